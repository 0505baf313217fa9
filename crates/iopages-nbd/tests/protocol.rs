//! A scripted NBD client against the server: handshake, every command,
//! bad requests, read-only exports, abrupt disconnects, multi-conn, and
//! interop with qemu's client tools.

use iopages::PageAllocator;
use iopages_crypt::backend::{Backend, RamDisk};
use iopages_crypt::queue::{CryptQueue, QueueConfig};
use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
use iopages_crypt::XtsCipher;
use iopages_nbd::{ExportConfig, Listen, Server, SHAPE_BUCKETS};
use iopages_testkit::nbd_client::*;
use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::crypt_queue;

const DISK: u64 = 16 << 20;
const NAME: &str = "vol";

fn start(read_only: bool, sector: usize) -> (PageAllocator, Server) {
    start_with(read_only, sector, 0)
}

fn start_with(read_only: bool, sector: usize, inline_max_bytes: u32) -> (PageAllocator, Server) {
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(7) ^ 0x5a).collect();
    let (alloc, queue) = crypt_queue(64 << 20, DISK, &key, sector);
    let mut cfg = ExportConfig::new(NAME);
    cfg.read_only = read_only;
    cfg.inline_max_bytes = inline_max_bytes;
    let server = Server::start(queue, cfg, &[Listen::Tcp("127.0.0.1:0".parse().unwrap())]).unwrap();
    (alloc, server)
}

fn finish(alloc: PageAllocator, server: Server) {
    server.shutdown();
    alloc.leak_check().expect("every page freed after shutdown");
}

/// A client of `server` past the greeting, which offers fixed newstyle
/// and no zeroes; the client's flags sent.
fn connect(server: &Server) -> Client {
    let c = Client::tcp(server.tcp_addr().unwrap());
    assert_eq!(c.handshake_flags(), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    c
}

/// NBD_OPT_GO for `name`, asking for the block sizes: (size, flags,
/// block sizes).
///
/// **Panics:** if the server refuses.
fn go(c: &mut Client, name: &str) -> (u64, u16, [u32; 3]) {
    let e = c.go(name, &[INFO_BLOCK_SIZE]).expect("NBD_OPT_GO");
    (e.size, e.flags, e.block_sizes)
}

/// Send one request with an explicit cookie (`payload` after it).
fn send(
    c: &mut Client,
    command: u16,
    flags: u16,
    cookie: u64,
    offset: u64,
    length: u32,
    payload: &[u8],
) {
    let r = Request {
        flags,
        command,
        cookie,
        offset,
        length,
    };
    c.send_request(r, payload).unwrap();
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Unknown options get ERR_UNSUP and LIST lists the one export; LIST
/// with data is invalid.
fn unknown_option_and_list(c: &mut Client) {
    // Unknown option: ERR_UNSUP, and the haggling goes on.
    let r = c.option(0x7777, b"whatever");
    assert_eq!((r[0].option, r[0].kind), (0x7777, REP_ERR_UNSUP));
    // LIST: one export, then ACK; LIST with data is invalid.
    let r = c.option(OPT_LIST, &[]);
    assert_eq!(r[0].kind, REP_SERVER);
    assert_eq!(&r[0].data[0..4], &3u32.to_be_bytes());
    assert_eq!(&r[0].data[4..], NAME.as_bytes());
    assert_eq!(r[1].kind, REP_ACK);
    assert_eq!(c.option(OPT_LIST, b"x")[0].kind, REP_ERR_INVALID);
}

/// INFO with every info type asked for: each one answered, right.
fn info_answers_every_type_asked_for(c: &mut Client) {
    let replies = c.option(
        OPT_INFO,
        &info_data(NAME, &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]),
    );
    let (last, infos) = replies.split_last().unwrap();
    assert_eq!(last.kind, REP_ACK);
    let mut seen = Vec::new();
    for r in infos {
        assert_eq!(r.option, OPT_INFO);
        assert_eq!(r.kind, REP_INFO);
        let t = be16(&r.data);
        match t {
            INFO_EXPORT => {
                assert_eq!(be64(&r.data[2..10]), DISK);
                let f = be16(&r.data[10..12]);
                assert_eq!(f & TFLAG_READ_ONLY, 0);
                assert_ne!(f & TFLAG_CAN_MULTI_CONN, 0);
            }
            INFO_NAME => assert_eq!(&r.data[2..], NAME.as_bytes()),
            INFO_DESCRIPTION => assert!(!r.data[2..].is_empty()),
            INFO_BLOCK_SIZE => {
                let v: Vec<u32> = r.data[2..].chunks(4).map(be32).collect();
                assert_eq!(v, vec![512, 4096, 32 << 20]);
            }
            _ => panic!("info type {t} not asked for"),
        }
        seen.push(t);
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![INFO_EXPORT, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]
    );
}

#[test]
fn handshake_go_info_list_unknown_and_abort() {
    let (alloc, server) = start(false, 512);
    let mut c = connect(&server);
    unknown_option_and_list(&mut c);
    info_answers_every_type_asked_for(&mut c);
    // INFO for an unknown export; malformed INFO.
    let r = c.option(OPT_INFO, &info_data("nope", &[]));
    assert_eq!(r[0].kind, REP_ERR_UNKNOWN);
    assert_eq!(
        c.option(OPT_GO, &[0, 0, 0, 9, b'v'])[0].kind,
        REP_ERR_INVALID
    );
    // Still in the handshake: GO works, and the export serves.
    let (size, flags, bs) = go(&mut c, NAME);
    assert_eq!(size, DISK);
    assert_ne!(flags & TFLAG_SEND_FUA, 0);
    assert_eq!(bs, [512, 4096, 32 << 20]);
    assert_eq!(c.write(0, &[7u8; 4096], 0), 0);
    assert_eq!(c.read(0, 4096).unwrap(), vec![7u8; 4096]);
    c.disconnect();

    // ABORT: ACK, then the server closes.
    let mut c = connect(&server);
    assert_eq!(c.option(OPT_ABORT, &[])[0].kind, REP_ACK);
    assert!(c.closed());

    // The default (empty) name is the export too.
    let mut c = connect(&server);
    assert_eq!(go(&mut c, "").0, DISK);
    c.disconnect();
    assert!(server.stats().sessions >= 2);
    finish(alloc, server);
}

#[test]
fn export_name_with_and_without_zeroes_and_unknown_name_closes() {
    let (alloc, server) = start(false, 512);
    // Old-style EXPORT_NAME, the client asking for no zeroes.
    let mut c = connect(&server);
    c.send_option(OPT_EXPORT_NAME, NAME.as_bytes()).unwrap();
    let b = c.read_raw(EXPORT_NAME_REPLY_BYTES).unwrap();
    assert_eq!(be64(&b[0..8]), DISK);
    assert_eq!(c.write(512, &[1u8; 512], 0), 0);
    c.disconnect();
    // Without NO_ZEROES: 124 zero bytes follow.
    let s = TcpStream::connect(server.tcp_addr().unwrap()).unwrap();
    let mut c = Client::greet(s).unwrap();
    c.send_client_flags(FLAG_C_FIXED_NEWSTYLE).unwrap();
    c.send_option(OPT_EXPORT_NAME, NAME.as_bytes()).unwrap();
    let b = c
        .read_raw(EXPORT_NAME_REPLY_BYTES + EXPORT_NAME_ZEROES)
        .unwrap();
    assert_eq!(b.len(), 134);
    assert!(b[10..].iter().all(|&x| x == 0));
    assert_eq!(c.read(512, 512).unwrap(), vec![1u8; 512]);
    c.disconnect();
    // An unknown name closes the connection.
    let mut c = connect(&server);
    c.send_option(OPT_EXPORT_NAME, b"nope").unwrap();
    assert!(c.closed());
    finish(alloc, server);
}

#[test]
fn bad_magic_and_unknown_client_flags_close_only_that_connection() {
    let (alloc, server) = start(false, 512);
    // Bad option magic.
    let mut c = connect(&server);
    c.send_raw(&[0xde; 16]).unwrap();
    assert!(c.closed());
    // Unknown client flags.
    let s = TcpStream::connect(server.tcp_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Client::greet(s).unwrap();
    c.send_client_flags(0x8000_0001).unwrap();
    assert!(c.closed());
    // Bad request magic in transmission.
    let mut c = connect(&server);
    go(&mut c, NAME);
    c.send_raw(&[0x11; 28]).unwrap();
    assert!(c.closed());
    // The server still serves.
    let mut c = connect(&server);
    go(&mut c, NAME);
    assert_eq!(c.write(0, &[3u8; 512], 0), 0);
    c.disconnect();
    finish(alloc, server);
}

/// WRITE (with and without FUA), READ, FLUSH, WRITE_ZEROES (FUA,
/// NO_HOLE, longer than a block), TRIM and a 3 MiB write, each checked
/// by reading back.
fn each_command_reads_back(c: &mut Client) {
    let data = pattern(0x42, 64 << 10);
    assert_eq!(c.write(8192, &data, 0), 0);
    assert_eq!(c.write(65536 + 8192, &data, CMD_FLAG_FUA), 0);
    assert_eq!(c.read(8192, 64 << 10).unwrap(), data);
    assert_eq!(c.read(65536 + 8192, 64 << 10).unwrap(), data);
    assert_eq!(c.command(CMD_FLUSH, 0, 0, 0), 0);
    // WRITE_ZEROES (with FUA and NO_HOLE) reads back as zeros.
    let fua_no_hole = CMD_FLAG_FUA | CMD_FLAG_NO_HOLE;
    assert_eq!(c.command(CMD_WRITE_ZEROES, fua_no_hole, 8192, 4096), 0);
    let back = c.read(8192, 64 << 10).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0));
    assert_eq!(&back[4096..], &data[4096..]);
    // A WRITE_ZEROES longer than the maximum block size is served.
    assert_eq!(c.command(CMD_WRITE_ZEROES, 0, 0, DISK as u32), 0);
    assert!(c.read(DISK - 4096, 4096).unwrap().iter().all(|&b| b == 0));
    // TRIM is checked and then a no-op (data stays); FUA allowed.
    assert_eq!(c.write(0, &data[..8192], 0), 0);
    assert_eq!(c.command(CMD_TRIM, CMD_FLAG_FUA, 0, 8192), 0);
    assert_eq!(c.read(0, 8192).unwrap(), &data[..8192]);
    assert_eq!(c.command(CMD_TRIM, 0, 0, DISK as u32), 0);
    // A 32 MiB-class request split into chunks: a 3 MiB + 4 KiB write.
    let big = pattern(0x99, (3 << 20) + 4096);
    assert_eq!(c.write(1 << 20, &big, CMD_FLAG_FUA), 0);
    assert_eq!(c.read(1 << 20, big.len() as u32).unwrap(), big);
}

/// Many requests in flight: 64 writes sent, then their replies read
/// (every cookie once), then some read back.
fn many_writes_in_flight(c: &mut Client) {
    for i in 0..64u64 {
        let d = pattern(i as u8, 16 << 10);
        let off = (8 << 20) + i * (16 << 10);
        send(c, CMD_WRITE, 0, 100 + i, off, d.len() as u32, &d);
    }
    let mut cookies: Vec<u64> = (0..64)
        .map(|_| {
            let (e, k) = c.read_simple_reply().unwrap();
            assert_eq!(e, 0);
            k
        })
        .collect();
    cookies.sort();
    assert_eq!(cookies, (100..164).collect::<Vec<_>>());
    for i in (0..64u64).step_by(13) {
        assert_eq!(
            c.read((8 << 20) + i * (16 << 10), 16 << 10).unwrap(),
            pattern(i as u8, 16 << 10)
        );
    }
}

#[test]
fn every_command_with_fua_and_large_requests() {
    // Through the workers, and with requests up to 64 KiB served on the
    // connection's thread (larger ones still through the workers).
    for (sector, inline) in [(512, 0), (4096, 0), (512, 64 << 10), (4096, 64 << 10)] {
        let (alloc, server) = start_with(false, sector, inline);
        let mut c = connect(&server);
        let (_, _, bs) = go(&mut c, NAME);
        assert_eq!(bs[0], sector as u32);
        each_command_reads_back(&mut c);
        many_writes_in_flight(&mut c);
        let st = server.stats();
        assert!(st.write.requests >= 67 && st.read.requests >= 8 && st.flush.requests == 1);
        assert!(
            st.write.bytes >= (3 << 20) && st.trim.requests == 2 && st.write_zeroes.requests == 2
        );
        // Payloads and read replies went through arena pages: single
        // blocks for the small ones, vmalloc areas or blocks for 1 MiB.
        assert_eq!(st.buffers.heap, 0, "{:?}", st.buffers);
        assert!(
            st.buffers.arena_contiguous + st.buffers.arena_vmalloc >= 67 + 8,
            "{:?}",
            st.buffers
        );
        c.disconnect();
        finish(alloc, server);
    }
}

/// Misaligned, empty, out-of-range and oversize requests: each its
/// error (a misaligned TRIM served for the whole sectors inside it).
fn bad_ranges_get_their_errors(c: &mut Client) {
    // Misaligned (the target's sector is 4096).
    assert_eq!(c.write(512, &[1u8; 4096], 0), EINVAL);
    assert_eq!(c.write(0, &[1u8; 512], 0), EINVAL);
    assert_eq!(c.read(100, 4096), Err(EINVAL));
    assert_eq!(c.command(CMD_WRITE_ZEROES, 0, 0, 100), EINVAL);
    // A misaligned TRIM is served (for the whole sectors inside it; a
    // discard is advisory) and the partial sectors around it keep their
    // data.
    assert_eq!(c.write(0, &[7u8; 3 * 4096], 0), 0);
    assert_eq!(c.command(CMD_TRIM, 0, 512, 4096), 0);
    assert_eq!(c.command(CMD_TRIM, 0, 4096 - 512, 4096 + 1024), 0);
    assert_eq!(c.command(CMD_TRIM, 0, 100, 1), 0);
    assert_eq!(c.read(0, 3 * 4096).unwrap(), vec![7u8; 3 * 4096]);
    // Zero length.
    assert_eq!(c.read(0, 0), Err(EINVAL));
    // Out of range: reads EINVAL, writes ENOSPC; offset+length overflow.
    assert_eq!(c.read(DISK, 4096), Err(EINVAL));
    assert_eq!(c.read(u64::MAX - 4095, 8192), Err(EINVAL));
    assert_eq!(c.write(DISK - 4096, &[1u8; 8192], 0), ENOSPC);
    assert_eq!(c.command(CMD_WRITE_ZEROES, 0, DISK, 4096), ENOSPC);
    // A trim past the end is EINVAL (proto.md: reads and trims EINVAL,
    // writes ENOSPC).
    assert_eq!(c.command(CMD_TRIM, 0, u64::MAX - 4095, 8192), EINVAL);
    assert_eq!(c.command(CMD_TRIM, 0, DISK, 4096), EINVAL);
    // Bounds before alignment: a misaligned write past the end is ENOSPC.
    assert_eq!(c.write(DISK + 512, &[1u8; 4096], 0), ENOSPC);
    // Oversize: a 33 MiB read is EINVAL (not EOVERFLOW, which proto.md
    // keeps for DF reads and commands without payload).
    assert_eq!(c.read(0, 33 << 20), Err(EINVAL));
}

/// FUA on every command; flags a command does not take or that were
/// never advertised, and an unknown command: EINVAL.
fn flags_are_checked(c: &mut Client) {
    // FUA is valid on every command once advertised: READ and FLUSH
    // accept it (they write nothing); the READ's data comes with it.
    let r = c.request(CMD_READ, CMD_FLAG_FUA, 0, 4096, &[]);
    assert_eq!((r.error, r.data.len()), (0, 4096));
    assert_eq!(c.command(CMD_FLUSH, CMD_FLAG_FUA, 0, 0), 0);
    // Flags a command does not take, and flags never advertised.
    assert_eq!(c.command(CMD_READ, CMD_FLAG_NO_HOLE, 0, 4096), EINVAL);
    assert_eq!(c.command(CMD_READ, CMD_FLAG_DF, 0, 4096), EINVAL);
    assert_eq!(
        c.command(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 4096),
        EINVAL
    );
    assert_eq!(c.command(CMD_FLUSH, 0, 0, 4096), EINVAL);
    assert_eq!(c.command(42, 0, 0, 4096), EINVAL);
}

#[test]
fn misaligned_out_of_range_and_oversize_requests_get_errors_and_the_connection_stays() {
    let (alloc, server) = start(false, 4096);
    let mut c = connect(&server);
    go(&mut c, NAME);
    bad_ranges_get_their_errors(&mut c);
    flags_are_checked(&mut c);
    // The connection is still in step and usable; nothing bad was written.
    assert_eq!(c.write(0, &[9u8; 4096], 0), 0);
    assert_eq!(c.read(0, 4096).unwrap(), vec![9u8; 4096]);
    assert_ne!(c.read(DISK - 8192, 4096).unwrap(), vec![1u8; 4096]);
    assert!(server.stats().read.errors >= 4);
    c.disconnect();
    // A write longer than 32 MiB (2^25, what proto.md says a server may
    // treat as an attack) closes that connection instead of making the
    // server read and discard it; other connections are untouched.
    let mut c2 = connect(&server);
    go(&mut c2, NAME);
    send(&mut c2, CMD_WRITE, 0, 7, 0, (32 << 20) + 4096, &[]);
    c2.stream()
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        c2.stream_mut().read(&mut b).unwrap_or(0),
        0,
        "the connection is closed"
    );
    let mut c3 = connect(&server);
    go(&mut c3, NAME);
    assert_eq!(c3.read(0, 4096).unwrap(), vec![9u8; 4096]);
    c3.disconnect();
    finish(alloc, server);
}

/// Check an error chunk: final, `ERROR`, for `cookie`, carrying `errno`
/// and a message that fits its length.
fn assert_error_chunk(ch: &Chunk, cookie: u64, errno: u32) {
    assert_eq!(
        (ch.flags, ch.kind, ch.cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie)
    );
    assert!(ch.payload.len() >= 6);
    assert_eq!(be32(&ch.payload[0..4]), errno);
    let msg_len = be16(&ch.payload[4..6]) as usize;
    assert_eq!(msg_len, ch.payload.len() - 6, "the message fills the chunk");
    assert!(msg_len > 0 && std::str::from_utf8(&ch.payload[6..]).is_ok());
}

/// Check a read's reply: one final `OFFSET_DATA` chunk at `offset`;
/// returns its data.
fn read_data_chunk(c: &mut Client, cookie: u64, offset: u64) -> Vec<u8> {
    let ch = c.read_chunk().unwrap();
    assert_eq!(
        (ch.flags, ch.kind, ch.cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, cookie)
    );
    assert_eq!(ch.offset(), offset);
    ch.payload[8..].to_vec()
}

#[test]
fn structured_replies_carry_reads_and_errors_and_leave_other_successes_simple() {
    let (alloc, server) = start(false, 4096);
    let mut c = connect(&server);
    // The option takes no data.
    let r = c.option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(
        (r[0].option, r[0].kind),
        (OPT_STRUCTURED_REPLY, REP_ERR_INVALID)
    );
    let r = c.option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!((r[0].option, r[0].kind), (OPT_STRUCTURED_REPLY, REP_ACK));
    go(&mut c, NAME);
    // A write's success: a simple reply (allowed without payload).
    let data = pattern(3, 3 << 20);
    assert_eq!(c.write(0, &data, 0), 0);
    // A read: one final OFFSET_DATA chunk, also one that the server
    // serves in several pieces (3 MiB).
    send(&mut c, CMD_READ, 0, 11, 4096, 8192, &[]);
    assert_eq!(read_data_chunk(&mut c, 11, 4096), data[4096..12288]);
    send(&mut c, CMD_READ, 0, 12, 0, 3 << 20, &[]);
    assert_eq!(read_data_chunk(&mut c, 12, 0), data);
    // Pipelined reads: each reply names its cookie and offset.
    for k in 0..4u64 {
        send(&mut c, CMD_READ, 0, 20 + k, k * 65536, 4096, &[]);
    }
    let mut seen = Vec::new();
    for _ in 0..4 {
        let ch = c.read_chunk().unwrap();
        assert_eq!(
            (ch.flags, ch.kind),
            (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA)
        );
        let k = ch.cookie - 20;
        let off = ch.offset();
        assert_eq!(off, k * 65536);
        assert_eq!(ch.payload[8..], data[off as usize..off as usize + 4096]);
        seen.push(k);
    }
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2, 3]);
    // Errors, reads first (never a simple reply to a read): misaligned,
    // past the end, bad flags, too long; then a write's and a trim's.
    for (cookie, offset, len, flags) in [
        (30, 100, 4096, 0),
        (31, DISK, 4096, 0),
        (32, 0, 4096, CMD_FLAG_NO_HOLE),
        (33, 0, 33 << 20, 0),
    ] {
        send(&mut c, CMD_READ, flags, cookie, offset, len, &[]);
        assert_error_chunk(&c.read_chunk().unwrap(), cookie, EINVAL);
    }
    send(&mut c, CMD_WRITE, 0, 34, 512, 4096, &[1u8; 4096]);
    assert_error_chunk(&c.read_chunk().unwrap(), 34, EINVAL);
    send(&mut c, CMD_WRITE, 0, 35, DISK - 4096, 8192, &[1u8; 8192]);
    assert_error_chunk(&c.read_chunk().unwrap(), 35, ENOSPC);
    send(&mut c, CMD_TRIM, 0, 36, DISK - 512, 4096, &[]);
    assert_error_chunk(&c.read_chunk().unwrap(), 36, EINVAL);
    // Still in step; nothing refused was written.
    assert_eq!(c.command(CMD_FLUSH, 0, 0, 0), 0);
    send(&mut c, CMD_READ, 0, 37, 0, 4096, &[]);
    assert_eq!(read_data_chunk(&mut c, 37, 0), data[..4096]);
    c.disconnect();
    // A client that does not ask gets simple replies, as before.
    let mut plain = connect(&server);
    go(&mut plain, NAME);
    assert_eq!(plain.read(0, 4096).unwrap(), data[..4096]);
    assert_eq!(plain.read(100, 4096), Err(EINVAL));
    plain.disconnect();
    finish(alloc, server);
}

#[test]
fn the_io_shape_counts_sizes_alignment_and_partial_sectors_per_direction() {
    let (alloc, server) = start(false, 4096);
    let mut c = connect(&server);
    go(&mut c, NAME);
    // Writes: two whole 64 KiB at 64 KiB-aligned offsets, one 4 KiB at a
    // 4 KiB offset, one 512 B at 512 (partial: refused, counted).
    assert_eq!(c.write(0, &[1u8; 65536], 0), 0);
    assert_eq!(c.write(65536, &[2u8; 65536], 0), 0);
    assert_eq!(c.write(12288, &[3u8; 4096], 0), 0);
    assert_eq!(c.write(512, &[4u8; 512], 0), EINVAL);
    // Reads: one 8 KiB at 8 KiB, one 4 KiB straddling two sectors.
    assert!(c.read(8192, 8192).is_ok());
    assert_eq!(c.read(2048, 4096), Err(EINVAL));
    c.disconnect();
    let sh = server.stats().shape;
    assert_eq!(sh.sector_bytes, 4096);
    let w = sh.write;
    assert_eq!(w.requests(), 4);
    assert_eq!((w.sizes[16], w.sizes[12], w.sizes[9]), (2, 1, 1));
    // Offsets 0 (the last bucket), 64 KiB, 12 KiB (4 KiB-aligned), 512.
    assert_eq!(w.align[SHAPE_BUCKETS - 1], 1);
    assert_eq!((w.align[16], w.align[12], w.align[9]), (1, 1, 1));
    assert_eq!(w.partial_sector, 1);
    assert_eq!(w.bytes, 2 * 65536 + 4096 + 512);
    assert_eq!(w.sector_bytes, 2 * 65536 + 4096 + 4096);
    assert!(w.amplification() > 1.0);
    let r = sh.read;
    assert_eq!(r.requests(), 2);
    assert_eq!((r.sizes[13], r.sizes[12]), (1, 1));
    assert_eq!((r.align[13], r.align[11]), (1, 1));
    assert_eq!(r.partial_sector, 1);
    assert_eq!(r.sector_bytes, 8192 + 8192);
    finish(alloc, server);
}

#[test]
fn a_read_only_export_refuses_writes_with_eperm() {
    let (alloc, server) = start(true, 512);
    let mut c = connect(&server);
    let (_, flags, _) = go(&mut c, NAME);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(c.write(0, &[1u8; 4096], 0), EPERM);
    assert_eq!(c.command(CMD_WRITE_ZEROES, 0, 0, 4096), EPERM);
    assert_eq!(c.command(CMD_TRIM, 0, 0, 4096), EPERM);
    assert_eq!(c.command(CMD_FLUSH, 0, 0, 0), 0);
    assert_eq!(c.read(0, 4096).unwrap().len(), 4096);
    assert_eq!(server.stats().write.requests, 0);
    c.disconnect();
    finish(alloc, server);
}

#[test]
fn a_client_that_waits_for_a_reply_in_the_middle_of_a_payload_gets_it() {
    // Inline mode defers replies while more requests are buffered; a
    // write whose payload is not all there yet must not keep them back.
    let (alloc, server) = start_with(false, 512, 64 << 10);
    let mut c = connect(&server);
    go(&mut c, NAME);
    assert_eq!(c.write(0, &[3u8; 4096], 0), 0);
    c.stream()
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // Two reads, and in the same segment a write's header with half its
    // payload; then wait for the reads' replies before sending the rest.
    // (The first read is served before the reader knows more is
    // buffered; the second one's reply is the one that may be deferred.)
    let mut bytes = Vec::new();
    for (command, cookie, offset, length) in [
        (CMD_READ, 1u64, 0u64, 4096u32),
        (CMD_READ, 3, 0, 4096),
        (CMD_WRITE, 2, 8192, 8192),
    ] {
        let r = Request {
            flags: 0,
            command,
            cookie,
            offset,
            length,
        };
        bytes.extend_from_slice(&r.to_bytes());
    }
    bytes.extend_from_slice(&[9u8; 4096]);
    c.send_raw(&bytes).unwrap();
    for want in [1, 3] {
        let (e, cookie) = c.read_simple_reply().unwrap();
        assert_eq!(
            (e, cookie),
            (0, want),
            "the reads' replies come while the write's payload is short"
        );
        let data = c.read_raw(4096).unwrap();
        assert!(data.iter().all(|&b| b == 3));
    }
    c.send_raw(&[9u8; 4096]).unwrap();
    assert_eq!(c.read_simple_reply().unwrap(), (0, 2));
    assert_eq!(c.read(8192, 8192).unwrap(), vec![9u8; 8192]);
    c.disconnect();
    finish(alloc, server);
}

#[test]
fn a_client_silent_in_the_handshake_is_disconnected_after_the_timeout() {
    let alloc = PageAllocator::builder()
        .size_bytes(16 << 20)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap();
    let disk: Arc<dyn Backend> = Arc::new(RamDisk::new(1 << 20).unwrap());
    let cipher = CipherPool::new(
        XtsCipher::new(
            &[3u8; 32]
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ i as u8)
                .collect::<Vec<_>>(),
            512,
            0,
        )
        .unwrap(),
        1,
    )
    .unwrap();
    let target = Arc::new(CryptTarget::new(&alloc, cipher, disk, TargetConfig::default()).unwrap());
    let queue = Arc::new(
        CryptQueue::new(
            target,
            QueueConfig {
                queue_depth: 4,
                workers: 1,
                preallocated_out: false,
            },
        )
        .unwrap(),
    );
    let mut cfg = ExportConfig::new(NAME);
    cfg.handshake_timeout = Duration::from_millis(300);
    let server = Server::start(queue, cfg, &[Listen::Tcp("127.0.0.1:0".parse().unwrap())]).unwrap();
    let s = std::net::TcpStream::connect(server.tcp_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t0 = std::time::Instant::now();
    let mut s = Client::greet(s).unwrap().into_stream();
    // Say nothing: the server gives up and closes.
    let mut rest = Vec::new();
    let n = s
        .read_to_end(&mut rest)
        .expect("the server closes the connection");
    assert_eq!(n, 0);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(250),
        "closed after {waited:?}"
    );
    assert!(waited < Duration::from_secs(9), "not closed: {waited:?}");
    // The server still serves others.
    let mut c = connect(&server);
    go(&mut c, NAME);
    assert_eq!(c.write(0, &[5u8; 4096], 0), 0);
    c.disconnect();
    finish(alloc, server);
}

#[test]
fn a_disconnect_mid_payload_loses_nothing_acknowledged_and_the_server_stays_up() {
    for inline in [0, 64 << 10] {
        let (alloc, server) = start_with(false, 512, inline);
        let mut c = connect(&server);
        go(&mut c, NAME);
        let a = pattern(0xa1, 1 << 20);
        assert_eq!(c.write(0, &a, 0), 0);
        // Requests in flight, then a write whose payload stops half way.
        for i in 0..8u64 {
            send(&mut c, CMD_READ, 0, 50 + i, i * 4096, 4096, &[]);
        }
        send(&mut c, CMD_WRITE, 0, 77, 0, 1 << 20, &vec![0xee; 300 << 10]);
        drop(c);
        // Another client sees the acknowledged write, not the partial one.
        let mut c = connect(&server);
        go(&mut c, NAME);
        assert_eq!(c.read(0, 1 << 20).unwrap(), a);
        // Disconnect without DISC, with writes in flight.
        for i in 0..16u64 {
            let d = pattern(i as u8, 64 << 10);
            send(
                &mut c,
                CMD_WRITE,
                0,
                i,
                (2 << 20) + i * (64 << 10),
                d.len() as u32,
                &d,
            );
        }
        drop(c);
        let mut c = connect(&server);
        go(&mut c, NAME);
        assert_eq!(c.write(4 << 20, &[1u8; 4096], 0), 0);
        c.disconnect();
        finish(alloc, server);
    }
}

#[test]
fn several_connections_at_once_share_the_volume() {
    // With 4 connections and 2 workers, inline mode serves every
    // request on the connections' threads, large ones included.
    for inline in [0, 64 << 10] {
        let (alloc, server) = start_with(false, 512, inline);
        let mut clients: Vec<Client> = (0..4).map(|_| connect(&server)).collect();
        for c in &mut clients {
            let (_, flags, _) = go(c, NAME);
            assert_ne!(flags & TFLAG_CAN_MULTI_CONN, 0);
        }
        // Writers on threads, one region each.
        let handles: Vec<_> = clients
            .drain(..)
            .enumerate()
            .map(|(i, mut c)| {
                std::thread::spawn(move || {
                    for j in 0..16u64 {
                        let d = pattern((i * 16) as u8 ^ j as u8, 32 << 10);
                        let off = (i as u64) * (2 << 20) + j * (32 << 10);
                        assert_eq!(c.write(off, &d, 0), 0);
                    }
                    c
                })
            })
            .collect();
        let mut clients: Vec<Client> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // Flush on one connection, read every region on another.
        assert_eq!(clients[0].command(CMD_FLUSH, 0, 0, 0), 0);
        for i in 0..4usize {
            for j in (0..16u64).step_by(5) {
                let off = (i as u64) * (2 << 20) + j * (32 << 10);
                let reader = &mut clients[(i + 1) % 4];
                assert_eq!(
                    reader.read(off, 32 << 10).unwrap(),
                    pattern((i * 16) as u8 ^ j as u8, 32 << 10)
                );
            }
        }
        // A large request with all four connections open: inline mode
        // serves it on the connection's thread.
        let big = pattern(0x77, 1 << 20);
        assert_eq!(clients[2].write(8 << 20, &big, CMD_FLAG_FUA), 0);
        assert_eq!(clients[3].read(8 << 20, 1 << 20).unwrap(), big);
        for c in clients {
            c.disconnect();
        }
        assert!(server.stats().connections >= 4);
        finish(alloc, server);
    }
}

#[test]
fn unix_socket_serves_too() {
    let alloc = PageAllocator::builder()
        .size_bytes(32 << 20)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap();
    let disk: Arc<dyn Backend> = Arc::new(RamDisk::new(1 << 20).unwrap());
    let key: Vec<u8> = (0..32u8).collect();
    let cipher = CipherPool::new(XtsCipher::new(&key, 512, 0).unwrap(), 1).unwrap();
    let target = Arc::new(CryptTarget::new(&alloc, cipher, disk, TargetConfig::default()).unwrap());
    let queue = Arc::new(CryptQueue::new(target, QueueConfig::default()).unwrap());
    let path = std::env::temp_dir().join(format!("iopages-nbd-test-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let server = Server::start(
        queue,
        ExportConfig::new(NAME),
        &[Listen::Unix(path.clone())],
    )
    .unwrap();
    // Owner-only: no other local user can connect to the plaintext volume.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "socket mode {mode:o}");
    let s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    Client::greet(s).expect("a newstyle greeting");
    server.shutdown();
    assert!(!path.exists(), "the socket file is removed at shutdown");
    alloc.leak_check().unwrap();
}

/// A qemu tool, or `None` with a note (a failure when CI=true).
fn qemu_tool(name: &str) -> Option<String> {
    iopages_testkit::need_tool(name, "the qemu interop test").map(|p| p.display().to_string())
}

#[test]
fn qemu_io_and_qemu_img_interoperate() {
    let (Some(io), Some(img)) = (qemu_tool("qemu-io"), qemu_tool("qemu-img")) else {
        return;
    };
    let (alloc, server) = start(false, 512);
    let url = format!("nbd://{}/{NAME}", server.tcp_addr().unwrap());
    let out = std::process::Command::new(&io)
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "read -P 0xab 0 1M",
        ])
        .args(["-c", "write -P 0xcd 1536 3k", "-c", "read -P 0xcd 1536 3k"])
        .arg(&url)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qemu-io failed: {text}");
    assert!(!text.contains("Pattern verification failed"), "{text}");
    let dir = std::env::temp_dir().join(format!("iopages-nbd-qemu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img_path = dir.join("out.img");
    let out = std::process::Command::new(&img)
        .args(["convert", "-f", "raw", "-O", "raw", &url])
        .arg(&img_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img convert failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = std::fs::read(&img_path).unwrap();
    assert_eq!(got.len() as u64, DISK);
    assert!(got[..1536].iter().all(|&b| b == 0xab));
    assert!(got[1536..1536 + 3072].iter().all(|&b| b == 0xcd));
    assert!(got[1536 + 3072..1 << 20].iter().all(|&b| b == 0xab));
    std::fs::remove_dir_all(&dir).unwrap();
    finish(alloc, server);
}
