//! Shared pieces of the iopages fuzz targets: an in-memory file for LUKS
//! images, a KDF cost guard, LUKS2 header rewriting (checksums kept
//! valid), and a model NBD connection to a server started once per
//! process. See docs/fuzzing.md.

use serde_json::Value;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// The passphrase every seed image was formatted with.
pub const PASSPHRASE: &[u8] = b"fuzz";

// ---------------------------------------------------------------------------
// In-memory device
// ---------------------------------------------------------------------------

/// A memfd reused for every run of the process (no disk I/O, no leak of
/// descriptors).
pub fn memfd_with(bytes: &[u8]) -> &'static File {
    static FD: OnceLock<File> = OnceLock::new();
    let f = FD.get_or_init(|| {
        let fd = unsafe { libc::memfd_create(c"iopages-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        unsafe { File::from_raw_fd(fd) }
    });
    f.set_len(0).unwrap();
    f.write_all_at(bytes, 0).unwrap();
    f.set_len(bytes.len() as u64).unwrap();
    f
}

// ---------------------------------------------------------------------------
// KDF cost guard
// ---------------------------------------------------------------------------
//
// `luks::open` runs every keyslot's KDF with the header's own parameters;
// a fuzzed header may ask for 2^32 PBKDF2 iterations or GiBs of Argon2.
// Until iopages-crypt has a limits API (an `open_with(&File, pass,
// KdfLimits)`), the targets call `open` only when this guard, which reads
// the same header fields the crate does, finds every KDF cheap. It errs on
// the side of "expensive": anything it cannot read is left to `inspect`.

/// Largest PBKDF2 work (iterations summed over keyslots and digests, times
/// the slots that may be tried) one run may do.
pub const MAX_PBKDF2_WORK: u64 = 40_000;
/// Largest Argon2 work (`time × memory_kib`, summed) one run may do.
pub const MAX_ARGON2_WORK: u64 = 8 * 1024;
/// Largest Argon2 memory (KiB) of one keyslot.
pub const MAX_ARGON2_MEMORY_KIB: u64 = 1024;
/// Largest anti-forensic material (stripes × key bytes) of one keyslot.
pub const MAX_AF_BYTES: u64 = 1 << 20;

const LUKS_MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
const LUKS2_MAGIC_SECONDARY: [u8; 6] = *b"SKUL\xba\xbe";
/// LUKS2 header-area sizes (where a secondary header may sit).
pub const LUKS2_HDR_SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];
/// LUKS2 binary header length.
pub const BIN: usize = 4096;

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}
fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// Whether opening `image` (LUKS1 or LUKS2) costs little KDF work.
pub fn kdf_is_cheap(image: &[u8]) -> bool {
    luks1_cheap(image) && luks2_cheap(image)
}

/// LUKS1 `phdr`: key-bytes at 108, mk-digest-iter at 164, eight 48-byte
/// slots from 208 (active, iterations, salt[32], km-offset, stripes).
fn luks1_cheap(image: &[u8]) -> bool {
    if image.len() < 592
        || image[..6] != LUKS_MAGIC
        || u16::from_be_bytes([image[6], image[7]]) != 1
    {
        return true; // not parsed as LUKS1
    }
    let key_bytes = u64::from(be32(image, 108));
    let mk_iter = u64::from(be32(image, 164));
    let mut work = 0u64;
    for i in 0..8 {
        let at = 208 + 48 * i;
        if be32(image, at) != 0x00AC_71F3 {
            continue; // disabled (skipped) or invalid (refused before any KDF)
        }
        work += u64::from(be32(image, at + 4)) + mk_iter;
        if u64::from(be32(image, at + 44)).saturating_mul(key_bytes) > MAX_AF_BYTES {
            return false;
        }
    }
    work <= MAX_PBKDF2_WORK
}

/// The JSON of every LUKS2 header copy the crate could choose (primary at
/// 0, secondaries at each allowed offset), checksum not verified.
pub fn luks2_json_copies(image: &[u8]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut offs = vec![0u64];
    offs.extend_from_slice(&LUKS2_HDR_SIZES);
    for off in offs {
        let off = off as usize;
        if image.len() < off + BIN {
            continue;
        }
        let b = &image[off..off + BIN];
        if b[..6] != LUKS_MAGIC && b[..6] != LUKS2_MAGIC_SECONDARY {
            continue;
        }
        let hdr_size = be64(b, 8);
        if !LUKS2_HDR_SIZES.contains(&hdr_size) {
            continue;
        }
        let end = (off + hdr_size as usize).min(image.len());
        let area = &image[off + BIN..end];
        // Short area: the crate's read fails (truncated); bounded anyway.
        let Some(nul) = area.iter().position(|&c| c == 0) else {
            continue;
        };
        if let Ok(v) = serde_json::from_slice::<Value>(&area[..nul]) {
            out.push(v);
        }
    }
    out
}

fn luks2_cheap(image: &[u8]) -> bool {
    luks2_json_copies(image).iter().all(json_kdf_is_cheap)
}

/// Whether the KDF/AF parameters anywhere in a LUKS2 JSON document are
/// cheap. Walks the whole document (not just `keyslots`/`digests`), so it
/// does not depend on how the crate navigates it.
pub fn json_kdf_is_cheap(v: &Value) -> bool {
    #[derive(Default)]
    struct Acc {
        pbkdf2: u64,
        argon2: u64,
        objects: u64,
        ok: bool,
    }
    fn num(o: &serde_json::Map<String, Value>, k: &str) -> Option<u64> {
        o.get(k).and_then(Value::as_u64)
    }
    fn walk(v: &Value, a: &mut Acc) {
        match v {
            Value::Object(o) => {
                a.objects += 1;
                if let Some(it) = num(o, "iterations") {
                    a.pbkdf2 = a.pbkdf2.saturating_add(it);
                }
                let t = num(o, "time").unwrap_or(0);
                let m = num(o, "memory").unwrap_or(0);
                if m > MAX_ARGON2_MEMORY_KIB || num(o, "cpus").unwrap_or(0) > 64 {
                    a.ok = false;
                }
                a.argon2 = a.argon2.saturating_add(t.saturating_mul(m.max(1)));
                // AF material = stripes × key_size (≤ 8000 × 128 here).
                if num(o, "stripes").is_some_and(|s| s > 8000)
                    || num(o, "key_size").is_some_and(|k| k > 128)
                {
                    a.ok = false;
                }
                for x in o.values() {
                    walk(x, a);
                }
            }
            Value::Array(xs) => xs.iter().for_each(|x| walk(x, a)),
            _ => {}
        }
    }
    let mut a = Acc {
        ok: true,
        ..Acc::default()
    };
    walk(v, &mut a);
    let slots = v
        .get("keyslots")
        .and_then(Value::as_object)
        .map_or(1, |m| m.len() as u64 + 1);
    a.ok && a.pbkdf2.saturating_mul(slots) <= MAX_PBKDF2_WORK
        && a.argon2.saturating_mul(slots) <= MAX_ARGON2_WORK
}

/// `IOPAGES_FUZZ_DEBUG=1`: print what the targets see (for reproducing).
pub fn debug() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| std::env::var_os("IOPAGES_FUZZ_DEBUG").is_some())
}

/// Everything the public LUKS API offers on an image: `is_luks`,
/// `inspect`, and `open_with` (default limits when [`kdf_is_cheap`], tiny
/// ones otherwise) with the seeds' passphrase, then the opened volume's
/// accessors and cipher; on the image as it is and, when it is shorter
/// than its version's layout needs, grown to that size with zeros.
pub fn exercise_luks(image: &[u8]) {
    exercise_luks_sized(image, image.len() as u64);
    // The seeds (and most inputs) hold the headers and key slot 0's
    // material only: the device-size rules refuse them as they are. Run
    // them again with the device grown (zeros, sparse) to what the
    // version needs, so the checks past the size check, and the opens,
    // are reached too.
    let full: u64 = if image.get(6..8) == Some(&[0, 1][..]) {
        (2 << 20) + 4096 // LUKS1: eight key-material areas, then payload
    } else {
        (16 << 20) + 4096 // LUKS2: the default layout's data offset
    };
    if (image.len() as u64) < full {
        exercise_luks_sized(image, full);
    }
}

/// [`exercise_luks`] on a device of `len` bytes (`image`, then zeros).
fn exercise_luks_sized(image: &[u8], len: u64) {
    use iopages_crypt::luks;
    let f = memfd_with(image);
    if len > image.len() as u64 {
        f.set_len(len).unwrap();
    }
    let _ = luks::is_luks(f);
    let info = luks::inspect(f);
    if debug() {
        eprintln!("inspect: {info:?}");
    }
    if let Ok(info) = info {
        let _ = format!("{info:?}");
    }
    // Inputs the guard calls cheap are opened under the default limits;
    // the rest under tiny ones, so the limits' refusals are exercised too
    // (every slot is checked before anything is derived) and no input can
    // spend the run deriving keys.
    let limits = if kdf_is_cheap(image) {
        luks::KdfLimits::default()
    } else {
        if debug() {
            eprintln!("open: KDF parameters too expensive for a fuzz run: tiny limits");
        }
        luks::KdfLimits {
            max_pbkdf2_iterations: 1000,
            max_argon2_memory_kib: 64,
            max_argon2_time: 4,
            max_argon2_lanes: 4,
            max_argon2_work_kib: 256,
            max_keyslots: 8,
            ..luks::KdfLimits::default()
        }
    };
    let opened = luks::open_with(f, PASSPHRASE, &limits);
    if debug() {
        eprintln!(
            "open: {:?}",
            opened
                .as_ref()
                .map(|v| (v.version(), v.keyslot(), v.sector_size()))
        );
    }
    match opened {
        Ok(vol) => {
            let _ = format!("{vol:?}");
            let _ = (vol.version(), vol.uuid(), vol.label(), vol.cipher_spec());
            let _ = (
                vol.master_key().len(),
                vol.keyslot(),
                vol.used_secondary_header(),
            );
            let _ = vol.data_size_bytes(len);
            let _ = vol.iv_offset();
            let ss = vol.sector_size();
            assert!(
                ss == 512 || ss == 4096,
                "opened volume with sector size {ss}"
            );
            if let Ok(mut xts) = vol.xts_cipher() {
                let mut sector = vec![0u8; ss];
                let _ = xts.encrypt_sectors_in_place(0, &mut sector);
            }
        }
        Err(e) => {
            // Every error must render and convert (CLI paths do both).
            let _ = e.to_string();
            let _: std::io::Error = e.into();
        }
    }
}

// ---------------------------------------------------------------------------
// LUKS2 header rewriting
// ---------------------------------------------------------------------------

/// Checksum `alg` over `data` (the algorithms the crate may accept).
pub fn luks2_checksum(alg: &str, data: &[u8]) -> Option<Vec<u8>> {
    use openssl::hash::{hash, MessageDigest};
    let md = match alg {
        "sha256" => MessageDigest::sha256(),
        "sha1" => MessageDigest::sha1(),
        "sha512" => MessageDigest::sha512(),
        "sha384" => MessageDigest::sha384(),
        "sha224" => MessageDigest::sha224(),
        _ => return None,
    };
    hash(md, data).ok().map(|d| d.to_vec())
}

const OFF_CSUM_ALG: usize = 72;
const OFF_CSUM: usize = 448;

/// Recompute the checksum of the LUKS2 header copy at `off` (binary
/// header's `hdr_size`, clamped to the image), with its own checksum_alg.
pub fn luks2_fix_checksum(image: &mut [u8], off: usize) {
    if image.len() < off + BIN {
        return;
    }
    let hdr_size = be64(&image[off..], 8) as usize;
    let end = off.saturating_add(hdr_size).min(image.len());
    if end < off + BIN {
        return;
    }
    let alg_raw = &image[off + OFF_CSUM_ALG..off + OFF_CSUM_ALG + 32];
    let alg_len = alg_raw.iter().position(|&c| c == 0).unwrap_or(32);
    let alg = String::from_utf8_lossy(&alg_raw[..alg_len]).into_owned();
    image[off + OFF_CSUM..off + OFF_CSUM + 64].fill(0);
    if let Some(sum) = luks2_checksum(&alg, &image[off..end]) {
        image[off + OFF_CSUM..off + OFF_CSUM + sum.len()].copy_from_slice(&sum);
    }
}

/// Write `json` (NUL-terminated, zero-padded) into the JSON area of the
/// copy at `off`; text longer than the area is cut (still NUL-ended).
pub fn luks2_put_json(image: &mut [u8], off: usize, json: &[u8]) {
    if image.len() < off + BIN {
        return;
    }
    let hdr_size = be64(&image[off..], 8) as usize;
    let end = off.saturating_add(hdr_size).min(image.len());
    if end <= off + BIN {
        return;
    }
    let area = &mut image[off + BIN..end];
    area.fill(0);
    let n = json.len().min(area.len() - 1);
    area[..n].copy_from_slice(&json[..n]);
}

// ---------------------------------------------------------------------------
// NBD model connection
// ---------------------------------------------------------------------------

/// Export name of the fuzzed server.
pub const EXPORT: &str = "vol";
/// RamDisk size behind the export.
pub const DISK_BYTES: u64 = 1 << 20;
/// Largest request payload the export accepts (kept small so generated
/// requests stay cheap).
pub const MAX_BLOCK: u32 = 64 << 10;
/// A connection that neither answers nor closes for this long is a hang.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

struct Nbd {
    path: PathBuf,
    _server: iopages_nbd::Server,
}

fn server() -> &'static Nbd {
    static S: OnceLock<Nbd> = OnceLock::new();
    S.get_or_init(|| {
        use iopages::PageAllocator;
        use iopages_crypt::backend::{Backend, PageStore};
        use iopages_crypt::queue::{CryptQueue, QueueConfig};
        use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
        use iopages_crypt::XtsCipher;
        use std::sync::Arc;
        // libFuzzer's main is C's: Rust's runtime did not set SIGPIPE to
        // ignored, and both the server and the model client write to
        // sockets the peer may have closed.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let alloc = PageAllocator::builder()
            .size_bytes(64 << 20)
            .build()
            .unwrap();
        // A page store with discards allowed: TRIM and WRITE_ZEROES punch
        // (empty slots), and block status has real holes to report.
        let disk: Arc<dyn Backend> = Arc::new(PageStore::new(&alloc, DISK_BYTES).unwrap());
        let key: Vec<u8> = (0u8..64).collect();
        let cipher = CipherPool::new(XtsCipher::new(&key, 512, 0).unwrap(), 2).unwrap();
        let cfg = TargetConfig {
            allow_discards: true,
            ..TargetConfig::default()
        };
        let target = Arc::new(CryptTarget::new(&alloc, cipher, disk, cfg).unwrap());
        let queue = Arc::new(CryptQueue::new(target, QueueConfig::default()).unwrap());
        let dir = std::env::temp_dir();
        let path = dir.join(format!("iopages-fuzz-nbd-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut cfg = iopages_nbd::ExportConfig::new(EXPORT);
        cfg.max_block_bytes = MAX_BLOCK;
        // Requests up to 4 KiB are served on the connection's thread, larger
        // ones by the queue's workers: both paths are fuzzed.
        cfg.inline_max_bytes = 4096;
        cfg.handshake_timeout = Duration::from_secs(3);
        let server =
            iopages_nbd::Server::start(queue, cfg, &[iopages_nbd::Listen::Unix(path.clone())])
                .expect("start the NBD server");
        Nbd {
            path,
            _server: server,
        }
    })
}

/// Client side of a handshake that reaches transmission with NBD_OPT_GO
/// for the export: client flags, then IHAVEOPT GO {name, 0 info requests}.
pub fn go_prefix() -> Vec<u8> {
    go_prefix_with(false)
}

/// [`go_prefix`], with NBD_OPT_STRUCTURED_REPLY and the `base:allocation`
/// metadata context asked for first when `structured` (the server then
/// answers reads and errors in chunks, and serves block status).
pub fn go_prefix_with(structured: bool) -> Vec<u8> {
    use iopages_nbd::proto::*;
    let mut v = Vec::new();
    v.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    if structured {
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&OPT_STRUCTURED_REPLY.to_be_bytes());
        v.extend_from_slice(&0u32.to_be_bytes());
        let (name, query) = (EXPORT.as_bytes(), META_BASE_ALLOCATION.as_bytes());
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&OPT_SET_META_CONTEXT.to_be_bytes());
        v.extend_from_slice(&(4 + name.len() as u32 + 4 + 4 + query.len() as u32).to_be_bytes());
        v.extend_from_slice(&(name.len() as u32).to_be_bytes());
        v.extend_from_slice(name);
        v.extend_from_slice(&1u32.to_be_bytes());
        v.extend_from_slice(&(query.len() as u32).to_be_bytes());
        v.extend_from_slice(query);
    }
    v.extend_from_slice(&IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&OPT_GO.to_be_bytes());
    let name = EXPORT.as_bytes();
    v.extend_from_slice(&(4 + name.len() as u32 + 2).to_be_bytes());
    v.extend_from_slice(&(name.len() as u32).to_be_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(&0u16.to_be_bytes());
    v
}

/// Send `bytes` on a fresh connection, close the write side, and read
/// everything the server sends until it closes. Panics (a finding) if the
/// server neither answers nor closes within [`REPLY_TIMEOUT`].
/// Returns the bytes received.
pub fn nbd_exchange(bytes: &[u8]) -> Vec<u8> {
    let s = server();
    let mut sock = UnixStream::connect(&s.path).expect("connect to the fuzzed server");
    sock.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
    sock.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
    let mut w = sock.try_clone().unwrap();
    let input = bytes.to_vec();
    // Write on another thread: the server may answer (and fill our receive
    // buffer) before it reads everything.
    let writer = std::thread::spawn(move || {
        let r = w.write_all(&input);
        let _ = w.shutdown(std::net::Shutdown::Write);
        r
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                panic!(
                    "NBD server hang: no reply and no close for {REPLY_TIMEOUT:?} \
                     after {} input bytes ({} reply bytes so far)",
                    bytes.len(),
                    got.len()
                );
            }
            Err(_) => break, // reset by the server: it closed
        }
    }
    // A write that failed because the server closed early is fine; one that
    // timed out means the server stopped reading without closing.
    if let Err(e) = writer.join().unwrap() {
        if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut {
            panic!("NBD server hang: stopped reading for {REPLY_TIMEOUT:?} without closing");
        }
    }
    got
}

/// A well-formed client session: GO, WRITE 512 bytes, READ them back,
/// FLUSH, DISC. Panics if the server does not serve it (stuck server).
pub fn nbd_health_check() {
    use iopages_nbd::proto::*;
    let mut v = go_prefix();
    let payload: Vec<u8> = (0..512u32).map(|i| (i * 7) as u8).collect();
    let req = |command, cookie, offset, length| Request {
        flags: 0,
        command,
        cookie,
        offset,
        length,
    };
    v.extend_from_slice(&req(CMD_WRITE, 1, 4096, 512).encode());
    v.extend_from_slice(&payload);
    v.extend_from_slice(&req(CMD_READ, 2, 4096, 512).encode());
    v.extend_from_slice(&req(CMD_FLUSH, 3, 0, 0).encode());
    v.extend_from_slice(&req(CMD_DISC, 4, 0, 0).encode());
    let got = nbd_exchange(&v);
    // The read's reply carries the payload back; find it after the
    // handshake replies (replies may come in completion order).
    let ok = got.windows(payload.len()).any(|w| w == &payload[..]);
    let replies = got
        .windows(4)
        .filter(|w| *w == SIMPLE_REPLY_MAGIC.to_be_bytes())
        .count();
    assert!(
        ok && replies >= 3,
        "NBD server no longer serves a well-formed session ({} bytes back, {replies} replies)",
        got.len()
    );
}

/// Run [`nbd_health_check`] every `every` calls (and on the first).
pub fn maybe_health_check(every: u64) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    if N.fetch_add(1, Ordering::Relaxed) % every == 0 {
        nbd_health_check();
    }
}

// ---------------------------------------------------------------------------
// Authenticated volumes
// ---------------------------------------------------------------------------

/// A small authenticated volume made once per process: 200 blocks (seven
/// tag blocks, two tree levels), every other block written and flushed,
/// block 7 discarded; its data, area and state file as bytes, and what
/// each block must read as.
struct IntegrityImage {
    data: Vec<u8>,
    area: Vec<u8>,
    state: PathBuf,
    expect: Vec<Vec<u8>>,
}

const INT_BLOCKS: u64 = 200;

fn integrity_keys() -> iopages_crypt::integrity::Keys {
    use iopages_crypt::integrity::{Keys, Mac};
    Keys::derive(Mac::Gmac, &[0x42; 64]).expect("keys")
}

fn integrity_image() -> &'static IntegrityImage {
    use iopages_crypt::backend::{Backend, RamDisk};
    use iopages_crypt::integrity::{self, AuthBackend, AuthOptions, Freshness, Layout, Mac, StateFile};
    use std::sync::Arc;
    static IMG: OnceLock<IntegrityImage> = OnceLock::new();
    IMG.get_or_init(|| {
        let layout = Layout::new(Mac::Gmac, INT_BLOCKS).expect("layout");
        let data = Arc::new(RamDisk::new(layout.data_bytes()).expect("ram"));
        let area = Arc::new(RamDisk::new(layout.area_bytes()).expect("ram"));
        let dir = std::env::temp_dir().join(format!("iopages-fuzz-int-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let state = dir.join("state");
        let anchor = integrity::format_area(&*area, &layout, &integrity_keys(), "fuzz").expect("format");
        StateFile { anchor, clean: true }.store(&state).expect("state");
        let opts = AuthOptions {
            uuid: "fuzz".into(),
            freshness: Freshness { state: Some(state.clone()), reset: false },
            ..AuthOptions::default()
        };
        let a = AuthBackend::open(data.clone(), area.clone(), layout.clone(), integrity_keys(), opts)
            .expect("open");
        let mut expect = vec![vec![0u8; 4096]; INT_BLOCKS as usize];
        for b in (0..INT_BLOCKS).step_by(2) {
            let bytes: Vec<u8> = (0..4096u64).map(|i| (i * 13 + b * 101) as u8).collect();
            a.write_at(b * 4096, &[&bytes]).expect("write");
            expect[b as usize] = bytes;
        }
        a.flush().expect("flush");
        a.punch(7 * 4096, 4096).expect("punch");
        expect[7] = vec![0u8; 4096];
        drop(a); // commits and marks the state file clean
        let mut d = vec![0u8; layout.data_bytes() as usize];
        data.read_at(0, &mut [&mut d[..]]).expect("read");
        let mut ar = vec![0u8; layout.area_bytes() as usize];
        area.read_at(0, &mut [&mut ar[..]]).expect("read");
        IntegrityImage { data: d, area: ar, state, expect }
    })
}

/// One input: the parsers on the raw bytes, then the bytes as flips
/// (`u32` offset into data ++ area, then a XOR mask; a zero mask zeroes
/// the byte) on the volume, opened read-only against its state file.
pub fn exercise_integrity(input: &[u8]) {
    use iopages_crypt::backend::{Backend, RamDisk};
    use iopages_crypt::integrity::layout::{Entry, Record, ENTRY, RECORD};
    use iopages_crypt::integrity::state::decode_superblock;
    use iopages_crypt::integrity::{AuthBackend, AuthOptions, Freshness, Layout, Mac, StateFile};
    use std::sync::Arc;
    let _ = StateFile::decode(input);
    let _ = decode_superblock(input, &integrity_keys());
    if let Ok(b) = <&[u8; RECORD]>::try_from(input.get(..RECORD).unwrap_or(&[])) {
        if let Some(r) = Record::decode(b) {
            assert_eq!(Record::decode(&r.encode()), Some(r));
        }
    }
    if let Ok(b) = <&[u8; ENTRY]>::try_from(input.get(..ENTRY).unwrap_or(&[])) {
        let e = Entry::decode(b);
        assert_eq!(Entry::decode(&e.encode()), e);
    }
    let img = integrity_image();
    let (mut data, mut area) = (img.data.clone(), img.area.clone());
    for flip in input.chunks_exact(5) {
        let at = u32::from_le_bytes(flip[..4].try_into().expect("4")) as usize;
        let at = at % (data.len() + area.len());
        let byte = if at < data.len() { &mut data[at] } else { &mut area[at - data.len()] };
        *byte = if flip[4] == 0 { 0 } else { *byte ^ flip[4] };
    }
    let layout = Layout::new(Mac::Gmac, INT_BLOCKS).expect("layout");
    let d = Arc::new(RamDisk::new(layout.data_bytes()).expect("ram"));
    let a = Arc::new(RamDisk::new(layout.area_bytes()).expect("ram"));
    d.write_at(0, &[&data]).expect("fill");
    a.write_at(0, &[&area]).expect("fill");
    let opts = AuthOptions {
        uuid: "fuzz".into(),
        freshness: Freshness { state: Some(img.state.clone()), reset: false },
        read_only: true,
        ..AuthOptions::default()
    };
    let Ok(vol) = AuthBackend::open(d, a, layout, integrity_keys(), opts) else {
        return;
    };
    let mut buf = vec![0u8; 4096];
    for b in 0..INT_BLOCKS {
        if vol.read_at(b * 4096, &mut [&mut buf[..]]).is_ok() {
            assert_eq!(buf, img.expect[b as usize], "block {b} read as other bytes");
        }
    }
}
