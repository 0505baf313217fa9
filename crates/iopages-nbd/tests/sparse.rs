//! Sparse volumes over the wire: the `base:allocation` metadata context,
//! NBD_CMD_BLOCK_STATUS, TRIM that punches, WRITE_ZEROES with and without
//! NO_HOLE and FAST_ZERO — with discards allowed (a page store: holes are
//! empty slots) and without (today's behaviour: nothing is punched and
//! every extent is reported allocated).

use iopages::PageAllocator;
use iopages_crypt::backend::{Backend, PageStore, RamDisk};
use iopages_crypt::target::TargetConfig;
use iopages_nbd::{ExportConfig, Listen, Server};
use iopages_testkit::nbd_client::*;
use std::sync::Arc;

mod common;
use common::{connect, queue_over};

const DISK: u64 = 4 << 20;
const NAME: &str = "vol";
const KEY: [u8; 64] = {
    let mut k = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        k[i] = (i as u8).wrapping_mul(37) ^ 0x5c;
        i += 1;
    }
    k
};

/// A server over a page store with discards allowed, or over a RAM disk
/// with the default target (no discards).
fn start(discards: bool, sector: usize) -> (PageAllocator, Server) {
    let alloc = PageAllocator::builder()
        .size_bytes(64 << 20)
        .huge_pages(iopages::HugePages::Never)
        .build()
        .unwrap();
    let disk: Arc<dyn Backend> = if discards {
        Arc::new(PageStore::new(&alloc, DISK).unwrap())
    } else {
        Arc::new(RamDisk::new(DISK).unwrap())
    };
    let cfg = TargetConfig {
        allow_discards: discards,
        ..TargetConfig::default()
    };
    let queue = queue_over(&alloc, disk, &KEY, sector, cfg);
    let server = Server::start(
        queue,
        ExportConfig::new(NAME),
        &[Listen::Tcp("127.0.0.1:0".parse().unwrap())],
    )
    .unwrap();
    (alloc, server)
}

fn finish(alloc: PageAllocator, server: Server) {
    server.shutdown();
    alloc.leak_check().expect("every page freed after shutdown");
}

/// The data of NBD_OPT_LIST/SET_META_CONTEXT.
fn meta(name: &str, queries: &[&str]) -> Vec<u8> {
    meta_data(name, queries)
}

/// NBD_OPT_GO; the transmission flags.
fn go(c: &mut Client) -> u16 {
    c.go(NAME, &[]).expect("GO").flags
}

/// A command without reply data, on a structured connection: 0 for a
/// simple success, else the error chunk's errno.
fn command(c: &mut Client, command: u16, flags: u16, offset: u64, length: u32) -> u32 {
    let payload = if command == CMD_WRITE {
        vec![0u8; length as usize]
    } else {
        Vec::new()
    };
    let cookie = c.send(command, flags, offset, length, &payload).unwrap();
    c.reply_error(cookie)
}

fn write(c: &mut Client, offset: u64, data: &[u8]) {
    let cookie = c
        .send(CMD_WRITE, 0, offset, data.len() as u32, data)
        .unwrap();
    assert_eq!(c.reply_error(cookie), 0);
}

/// A read: its bytes, and whether they came as one OFFSET_HOLE chunk.
fn read_chunked(c: &mut Client, offset: u64, len: u32) -> (Vec<u8>, bool) {
    let cookie = c.send(CMD_READ, 0, offset, len, &[]).unwrap();
    let ch = c.read_chunk().unwrap();
    assert_eq!((ch.cookie, ch.flags), (cookie, REPLY_FLAG_DONE));
    assert_eq!(ch.offset(), offset);
    match ch.kind {
        REPLY_TYPE_OFFSET_DATA => (ch.payload[8..].to_vec(), false),
        REPLY_TYPE_OFFSET_HOLE => {
            assert_eq!(ch.payload.len(), 12);
            assert_eq!(be32(&ch.payload[8..12]), len);
            (vec![0; len as usize], true)
        }
        k => panic!("a read answered with chunk type {k}"),
    }
}

fn read(c: &mut Client, offset: u64, len: u32) -> Vec<u8> {
    read_chunked(c, offset, len).0
}

/// NBD_CMD_BLOCK_STATUS: Ok(descriptors as (length, flags)) from the
/// one BLOCK_STATUS chunk of context `ctx`, or Err(errno).
fn block_status(
    c: &mut Client,
    ctx: u32,
    flags: u16,
    offset: u64,
    len: u32,
) -> Result<Vec<(u32, u32)>, u32> {
    let cookie = c.send(CMD_BLOCK_STATUS, flags, offset, len, &[]).unwrap();
    let ch = c.read_chunk().unwrap();
    assert_eq!((ch.cookie, ch.flags), (cookie, REPLY_FLAG_DONE));
    if ch.kind == REPLY_TYPE_ERROR {
        return Err(be32(&ch.payload[0..4]));
    }
    assert_eq!(ch.kind, REPLY_TYPE_BLOCK_STATUS);
    assert!(ch.payload.len() >= 12 && (ch.payload.len() - 4).is_multiple_of(8));
    assert_eq!(be32(&ch.payload[0..4]), ctx);
    let d: Vec<(u32, u32)> = ch.payload[4..]
        .chunks_exact(8)
        .map(|c| (be32(&c[0..4]), be32(&c[4..8])))
        .collect();
    // proto.md: every length non-zero; all but the last inside the
    // request.
    assert!(d.iter().all(|&(l, _)| l > 0));
    let before_last: u64 = d[..d.len() - 1].iter().map(|&(l, _)| l as u64).sum();
    assert!(before_last < len as u64);
    Ok(d)
}

/// Select `base:allocation`; its context id.
fn select_allocation(c: &mut Client) -> u32 {
    let r = c.option(OPT_SET_META_CONTEXT, &meta(NAME, &["base:allocation"]));
    assert_eq!(r.len(), 2, "one context, then ACK");
    assert_eq!(r[0].kind, REP_META_CONTEXT);
    assert_eq!(&r[0].data[4..], b"base:allocation");
    assert_eq!(r[1].kind, REP_ACK);
    be32(&r[0].data[0..4])
}

const HOLE: u32 = STATE_HOLE | STATE_ZERO;

/// Expand descriptors into (start, end, flags) ranges from `offset`.
fn ranges(offset: u64, d: &[(u32, u32)]) -> Vec<(u64, u64, u32)> {
    let mut at = offset;
    d.iter()
        .map(|&(l, f)| {
            let r = (at, at + l as u64, f);
            at += l as u64;
            r
        })
        .collect()
}

#[test]
fn metadata_contexts_are_negotiated_as_proto_md_says() {
    let (alloc, server) = start(true, 4096);
    let mut c = connect(&server);
    // Before structured replies: invalid, for LIST and SET.
    let r = c.option(OPT_LIST_META_CONTEXT, &meta(NAME, &[]));
    assert_eq!(r[0].kind, REP_ERR_INVALID);
    let r = c.option(OPT_SET_META_CONTEXT, &meta(NAME, &["base:allocation"]));
    assert_eq!(r[0].kind, REP_ERR_INVALID);
    c.structured_replies();
    // LIST: no query and the `base:` wildcard list base:allocation (id 0);
    // another namespace lists nothing.
    for q in [&[][..], &["base:"][..], &["base:allocation"][..]] {
        let r = c.option(OPT_LIST_META_CONTEXT, &meta(NAME, q));
        assert_eq!(r.len(), 2, "{q:?}");
        assert_eq!(r[0].kind, REP_META_CONTEXT);
        assert_eq!(r[0].data, [&[0u8; 4][..], b"base:allocation"].concat());
        assert_eq!(r[1].kind, REP_ACK);
    }
    let r = c.option(OPT_LIST_META_CONTEXT, &meta(NAME, &["qemu:dirty-bitmap:x"]));
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ACK);
    // Malformed, another export: errors. The wildcard and unknown names
    // select nothing.
    let mut bad = meta(NAME, &["base:allocation"]);
    bad.pop();
    assert_eq!(
        c.option(OPT_SET_META_CONTEXT, &bad)[0].kind,
        REP_ERR_INVALID
    );
    let r = c.option(OPT_SET_META_CONTEXT, &meta("other", &["base:allocation"]));
    assert_eq!(r[0].kind, REP_ERR_UNKNOWN);
    let r = c.option(OPT_SET_META_CONTEXT, &meta(NAME, &["base:", "x-y:z"]));
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ACK);
    // Selected, then replaced by a SET that selects nothing: block status
    // is refused.
    select_allocation(&mut c);
    let r = c.option(OPT_SET_META_CONTEXT, &meta(NAME, &[]));
    assert_eq!(r.len(), 1);
    go(&mut c);
    let cookie = c.send(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).unwrap();
    assert_eq!(c.reply_error(cookie), EINVAL);
    drop(c);
    // Selected for the session: served.
    let mut c = connect(&server);
    c.structured_replies();
    let ctx = select_allocation(&mut c);
    go(&mut c);
    assert_eq!(
        block_status(&mut c, ctx, 0, 0, DISK as u32).unwrap(),
        vec![(DISK as u32, HOLE)]
    );
    drop(c);
    finish(alloc, server);
}

#[test]
fn block_status_reports_holes_rounded_to_sectors_and_stays_in_bounds() {
    let (alloc, server) = start(true, 4096);
    let mut c = connect(&server);
    c.structured_replies();
    let ctx = select_allocation(&mut c);
    let flags = go(&mut c);
    assert_ne!(flags & TFLAG_SEND_FAST_ZERO, 0, "fast zero offered");
    // Data at 64 KiB..72 KiB and at the volume's last sector.
    write(&mut c, 64 << 10, &[0xab; 8192]);
    write(&mut c, DISK - 4096, &[0xcd; 4096]);
    let d = block_status(&mut c, ctx, 0, 0, DISK as u32).unwrap();
    assert_eq!(
        ranges(0, &d),
        vec![
            (0, 64 << 10, HOLE),
            (64 << 10, 72 << 10, 0),
            (72 << 10, DISK - 4096, HOLE),
            (DISK - 4096, DISK, 0),
        ]
    );
    // A request starting inside a hole, and one inside data.
    let d = block_status(&mut c, ctx, 0, 60 << 10, 8192).unwrap();
    assert_eq!(ranges(60 << 10, &d)[0], (60 << 10, 64 << 10, HOLE));
    assert_eq!(d.iter().map(|&(l, _)| l as u64).sum::<u64>(), 8192);
    // REQ_ONE: exactly one descriptor, no longer than asked.
    let d = block_status(&mut c, ctx, CMD_FLAG_REQ_ONE, 0, 1 << 20).unwrap();
    assert_eq!(d, vec![(64 << 10, HOLE)]);
    let d = block_status(&mut c, ctx, CMD_FLAG_REQ_ONE, 64 << 10, 4096).unwrap();
    assert_eq!(d, vec![(4096, 0)]);
    // Past the end, misaligned, empty, unknown flags: EINVAL, and the
    // connection stays in step.
    assert_eq!(block_status(&mut c, ctx, 0, DISK - 4096, 8192), Err(EINVAL));
    assert_eq!(block_status(&mut c, ctx, 0, 512, 4096), Err(EINVAL));
    assert_eq!(block_status(&mut c, ctx, 0, 0, 0), Err(EINVAL));
    assert_eq!(
        block_status(&mut c, ctx, CMD_FLAG_NO_HOLE, 0, 4096),
        Err(EINVAL)
    );
    // A read of data is one OFFSET_DATA chunk; a read wholly in a hole
    // one OFFSET_HOLE chunk (no data on the wire); a read across both
    // OFFSET_DATA with the zeros in it.
    assert_eq!(
        read_chunked(&mut c, 64 << 10, 8192),
        (vec![0xab; 8192], false)
    );
    assert_eq!(
        read_chunked(&mut c, 0, 4096),
        (vec![0; 4096], true),
        "a hole reads as zeros"
    );
    let (across, hole) = read_chunked(&mut c, 60 << 10, 8192);
    assert!(!hole);
    assert_eq!(across, [vec![0u8; 4096], vec![0xab; 4096]].concat());
    drop(c);
    finish(alloc, server);
}

/// A misaligned TRIM over `data` at 0 of a volume with `sector`-byte
/// sectors: only the whole 4096-byte blocks inside become holes; the
/// partial sectors around keep their data.
fn misaligned_trim_punches_whole_pages(c: &mut Client, ctx: u32, data: &[u8], sector: usize) {
    // A misaligned TRIM: only the whole 4096-byte blocks inside go
    // (the page store frees whole pages; partial ones read zeros in
    // the whole sectors inside).
    assert_eq!(command(c, CMD_TRIM, 0, 8192 + 100, 3 * 4096), 0);
    let back = read(c, 0, 256 << 10);
    let (lo, hi) = (
        (8192 + 100u64).next_multiple_of(sector as u64) as usize,
        ((8192 + 100 + 3 * 4096) / sector as u64 * sector as u64) as usize,
    );
    assert_eq!(back[..lo], data[..lo], "before the trim ({sector})");
    assert!(back[lo..hi].iter().all(|&b| b == 0), "trimmed ({sector})");
    assert_eq!(back[hi..], data[hi..], "after the trim ({sector})");
    let d = block_status(c, ctx, 0, 0, 256 << 10).unwrap();
    let holes: Vec<_> = ranges(0, &d)
        .into_iter()
        .filter(|r| r.2 == HOLE)
        .map(|r| (r.0, r.1))
        .collect();
    assert!(
        holes.contains(&(12288, 20480)),
        "the whole pages inside the trim are holes: {holes:?}"
    );
}

/// WRITE_ZEROES with and without NO_HOLE and FAST_ZERO over `data` at 0:
/// which ranges read as zeros and which are holes.
fn write_zeroes_punches_unless_no_hole(c: &mut Client, ctx: u32, data: &[u8]) {
    // WRITE_ZEROES without NO_HOLE punches; with NO_HOLE it writes
    // encrypted zeros (allocated); FAST_ZERO with NO_HOLE cannot be
    // fast: ENOTSUP, nothing changed.
    assert_eq!(command(c, CMD_WRITE_ZEROES, 0, 64 << 10, 16 << 10), 0);
    assert_eq!(
        command(c, CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 128 << 10, 16 << 10),
        0
    );
    assert_eq!(
        command(
            c,
            CMD_WRITE_ZEROES,
            CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            192 << 10,
            16 << 10
        ),
        ENOTSUP
    );
    assert_eq!(
        command(
            c,
            CMD_WRITE_ZEROES,
            CMD_FLAG_FAST_ZERO | CMD_FLAG_FUA,
            224 << 10,
            8192
        ),
        0
    );
    let back = read(c, 0, 256 << 10);
    for (off, len, zero) in [
        (64usize << 10, 16usize << 10, true),
        (128 << 10, 16 << 10, true),
        (192 << 10, 16 << 10, false),
        (224 << 10, 8192, true),
    ] {
        let r = &back[off..off + len];
        if zero {
            assert!(r.iter().all(|&b| b == 0), "zeroed at {off}");
        } else {
            assert_eq!(r, &data[off..off + len], "untouched at {off}");
        }
        assert_eq!(back[off - 1], data[off - 1], "byte before {off}");
        assert_eq!(back[off + len], data[off + len], "byte after {off}");
    }
    let status =
        |c: &mut Client, off: u64| block_status(c, ctx, CMD_FLAG_REQ_ONE, off, 4096).unwrap()[0].1;
    assert_eq!(status(c, 64 << 10), HOLE);
    assert_eq!(status(c, 128 << 10), 0, "NO_HOLE stays allocated");
    assert_eq!(status(c, 192 << 10), 0);
    assert_eq!(status(c, 224 << 10), HOLE);
}

#[test]
fn trim_and_write_zeroes_punch_whole_sectors_and_leave_neighbours_alone() {
    for sector in [512usize, 4096] {
        let (alloc, server) = start(true, sector);
        let mut c = connect(&server);
        c.structured_replies();
        let ctx = select_allocation(&mut c);
        go(&mut c);
        let data: Vec<u8> = (0..256 << 10)
            .map(|i: u32| (i * 13 % 251) as u8 + 1)
            .collect();
        write(&mut c, 0, &data);
        misaligned_trim_punches_whole_pages(&mut c, ctx, &data, sector);
        write_zeroes_punches_unless_no_hole(&mut c, ctx, &data);
        drop(c);
        let stats = server.stats();
        assert_eq!(stats.trim.requests, 1);
        assert_eq!(stats.write_zeroes.requests, 3, "served");
        assert_eq!(
            stats.write_zeroes.errors, 1,
            "the fast zero that could not be"
        );
        // Every block-status reply was counted (and none failed: the bad
        // ones are in the other test).
        assert_eq!(
            (stats.block_status.requests, stats.block_status.errors),
            (5, 0)
        );
        finish(alloc, server);
    }
}

#[test]
fn without_discards_nothing_is_punched_and_everything_reports_allocated() {
    let (alloc, server) = start(false, 4096);
    let mut c = connect(&server);
    c.structured_replies();
    let ctx = select_allocation(&mut c);
    let flags = go(&mut c);
    assert_eq!(flags & TFLAG_SEND_FAST_ZERO, 0, "no fast zero offered");
    let data = vec![0x5au8; 64 << 10];
    write(&mut c, 0, &data);
    // TRIM is a no-op: the data stays.
    assert_eq!(command(&mut c, CMD_TRIM, 0, 0, 64 << 10), 0);
    assert_eq!(read(&mut c, 0, 64 << 10), data);
    // FAST_ZERO was not advertised: EINVAL; plain WRITE_ZEROES writes
    // encrypted zeros.
    assert_eq!(
        command(&mut c, CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 4096),
        EINVAL
    );
    assert_eq!(read(&mut c, 0, 4096), data[..4096]);
    assert_eq!(command(&mut c, CMD_WRITE_ZEROES, 0, 0, 4096), 0);
    assert_eq!(read(&mut c, 0, 4096), vec![0; 4096]);
    // One allocated extent for any request (a never-written block of the
    // RAM disk decrypts to noise, not zeros).
    let d = block_status(&mut c, ctx, 0, 0, DISK as u32).unwrap();
    assert_eq!(d, vec![(DISK as u32, 0)]);
    let unwritten = read(&mut c, 1 << 20, 4096);
    assert!(
        unwritten.iter().any(|&b| b != 0),
        "zero ciphertext decrypts to noise"
    );
    drop(c);
    finish(alloc, server);
}

#[test]
fn a_simple_reply_client_gets_einval_for_block_status() {
    let (alloc, server) = start(true, 4096);
    let mut c = connect(&server);
    go(&mut c);
    let cookie = c.send(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).unwrap();
    let (e, got) = c.read_simple_reply().unwrap();
    assert_eq!((e, got), (EINVAL, cookie));
    drop(c);
    finish(alloc, server);
}
