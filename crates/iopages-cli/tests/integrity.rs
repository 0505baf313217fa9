//! Authenticated volumes end to end: `iopages luks format --integrity`
//! images served by a real `iopages serve` over a store that lies — most
//! often nbdkit's `file` plugin over the image file, which the test edits
//! between reads (a bit flipped in a block's ciphertext or in a tag block,
//! two blocks swapped, a block and its tag block put back to an older copy,
//! the whole image rolled back, the tag area zeroed, a discard forged by
//! zeroing a block), once the image file served directly. Each case checks
//! that exactly the requests covering an altered block fail with EIO, that
//! the other blocks read back as written, and the per-export integrity
//! counters on the metrics page. The freshness state file lost or older
//! than the store is refused; a server killed with SIGKILL in the middle of
//! writes comes back (sweep logged) with every block holding the data of
//! its last write acknowledged before the last FLUSH or of a later write
//! sent — never EIO, never anything else. A `--config` export with
//! `freshness = "FILE"` serves an authenticated volume.
//!
//! Owns: nothing but its temporary directories and child processes.
//! Must never: speak NBD by hand (the project's client from
//! `iopages-testkit` does), or leave a server or nbdkit running.
//!
//! nbdkit and nbdinfo are outside tools: where one is missing the test says
//! so and returns, except under `CI=true`, where it fails.

mod common;

use common::{get, pattern, run, serve_cmd, tools, Dir, NbdKit, Served};
use iopages_testkit::nbd_client::{Client, CMD_FLUSH, CMD_TRIM, CMD_WRITE};
use std::io::Read;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// An authenticated volume's block (and encryption sector).
const BLOCK: u64 = 4096;
/// Data blocks per tag block (a block's place holds two 64-byte records).
const PER_TAG: u64 = 32;
/// EIO, as the NBD reply carries it.
const EIO: u32 = 5;
/// The tag cache: 16 nodes, so tag blocks leave it and are read again.
const CACHE: &str = "65536";

/// A formatted authenticated image, its passphrase and state files, and
/// where its data and integrity area lie in the image file.
struct Vol {
    dir: Dir,
    img: PathBuf,
    pass: PathBuf,
    state: PathBuf,
    data_off: u64,
    area_off: u64,
    blocks: u64,
}

impl Vol {
    /// `iopages luks format --integrity MAC --freshness STATE` of a 40 MiB
    /// payload; the layout from what it prints.
    fn new(tag: &str, mac: &str) -> Vol {
        let dir = Dir::new(tag);
        let pass = dir.join("pass");
        std::fs::write(&pass, b"authenticated passphrase").unwrap();
        let (img, state, out) = common::luks2_auth_image(&dir, "v", "40M", &pass, mac);
        let line = out
            .lines()
            .find(|l| l.starts_with("integrity: "))
            .unwrap_or_else(|| panic!("no integrity line: {out}"));
        let number_after = |word: &str| -> u64 {
            let at = line
                .find(word)
                .unwrap_or_else(|| panic!("{word} in {line}"))
                + word.len();
            let digits: String = line[at..]
                .chars()
                .skip_while(|c| *c == ' ')
                .take_while(char::is_ascii_digit)
                .collect();
            digits
                .parse()
                .unwrap_or_else(|_| panic!("{word} in {line}"))
        };
        let blocks = number_after("bytes (");
        let area_off = number_after("at offset");
        assert!(line.contains(mac), "{line}");
        Vol {
            data_off: area_off - blocks * BLOCK,
            dir,
            img,
            pass,
            state,
            area_off,
            blocks,
        }
    }

    /// Image offset of data block `b`'s ciphertext.
    fn data_at(&self, b: u64) -> u64 {
        self.data_off + b * BLOCK
    }

    /// Image offset of tag block `t`'s `slot` (0 or 1): after the two
    /// superblocks, every tag block's slot 0, then every one's slot 1.
    fn tag_at(&self, t: u64, slot: u64) -> u64 {
        self.area_off + (2 + slot * self.tag_blocks() + t) * BLOCK
    }

    /// Tag blocks (level 0 of the tree).
    fn tag_blocks(&self) -> u64 {
        self.blocks.div_ceil(PER_TAG)
    }

    fn bytes(&self, off: u64, len: u64) -> Vec<u8> {
        let f = std::fs::File::open(&self.img).unwrap();
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, off).unwrap();
        b
    }

    fn put(&self, off: u64, bytes: &[u8]) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.img)
            .unwrap();
        f.write_all_at(bytes, off).unwrap();
    }

    /// Flip one bit of the byte at `off`.
    fn flip(&self, off: u64) {
        let mut b = self.bytes(off, 1);
        b[0] ^= 0x10;
        self.put(off, &b);
    }
}

/// A running server with its metrics address and socket.
struct Srv {
    served: Served,
    metrics: SocketAddr,
    sock: PathBuf,
}

/// `iopages serve` of `image` (a path or an NBD URI) of `vol` on a Unix
/// socket, with its state file, the small tag cache, metrics, and `extra`.
fn serve_args(vol: &Vol, image: &str, extra: &[&str]) -> (Command, PathBuf) {
    let sock = vol.dir.join("srv.sock");
    let _ = std::fs::remove_file(&sock);
    let mut cmd = serve_cmd();
    cmd.args(["--arena", "64M", "--image", image, "--passphrase-file"])
        .arg(&vol.pass)
        .arg("--unix")
        .arg(&sock)
        .arg("--freshness")
        .arg(&vol.state)
        .args(["--freshness-cache", CACHE])
        .args(extra);
    (cmd, sock)
}

fn start(vol: &Vol, image: &str, extra: &[&str]) -> Srv {
    let (cmd, sock) = serve_args(vol, image, extra);
    let (served, metrics) = Served::spawn_with_metrics(cmd, vol.dir.join("srv.err"));
    Srv {
        served,
        metrics,
        sock,
    }
}

/// The server must refuse to start: what it said (stderr and stdout).
fn refused(vol: &Vol, image: &str, extra: &[&str]) -> String {
    let (mut cmd, _) = serve_args(vol, image, extra);
    let err = vol.dir.join("refused.err");
    let mut child = iopages_testkit::Reaped(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("iopages serve starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the server did not refuse");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let _ = child.0.stdout.take().unwrap().read_to_string(&mut out);
    let said = format!("{}{out}", std::fs::read_to_string(&err).unwrap());
    assert!(!status.success(), "the server started: {said}");
    said
}

impl Srv {
    fn client(&self) -> Client<UnixStream> {
        let mut c = Client::unix(&self.sock);
        c.go("iopages", &[]).expect("the export");
        c
    }

    /// `iopages_integrity_NAME_total` of the one export.
    fn counter(&self, name: &str) -> f64 {
        let (code, _, body) = get(self.metrics, "/metrics");
        assert_eq!(code, 200);
        let family = format!("iopages_integrity_{name}_total");
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let rest = l.strip_prefix(&family)?;
                if !rest.starts_with(['{', ' ']) {
                    return None;
                }
                l.rsplit(' ').next()?.parse().ok()
            })
            .unwrap_or_else(|| panic!("no {family} in:\n{body}"))
    }

    fn stop(self) -> Vec<String> {
        self.served.stop()
    }
}

/// Block `b`'s content in generation `g`.
fn data(g: u32, b: u64) -> Vec<u8> {
    pattern(g.wrapping_mul(1_000_003) ^ (b as u32), BLOCK as usize)
}

/// Write generation `g` to `blocks` and flush.
fn fill(c: &mut Client<UnixStream>, g: u32, blocks: &[u64]) {
    for &b in blocks {
        assert_eq!(c.write(b * BLOCK, &data(g, b), 0), 0, "write block {b}");
    }
    assert_eq!(c.command(CMD_FLUSH, 0, 0, 0), 0, "flush");
}

/// Block `b` must read back as generation `g` (`None`: zeros).
fn reads_as(c: &mut Client<UnixStream>, b: u64, g: Option<u32>) {
    let got = c
        .read(b * BLOCK, BLOCK as u32)
        .unwrap_or_else(|e| panic!("block {b}: error {e}"));
    let want = g.map_or(vec![0; BLOCK as usize], |g| data(g, b));
    assert!(got == want, "block {b} is not generation {g:?}");
}

/// Reading `n` blocks from `b` must fail with EIO.
fn fails(c: &mut Client<UnixStream>, b: u64, n: u64) {
    assert_eq!(
        c.read(b * BLOCK, (n * BLOCK) as u32).map(|_| ()),
        Err(EIO),
        "blocks {b}..{}",
        b + n
    );
}

/// nbdkit's file plugin over `vol`'s image: the store and its URI.
fn store(vol: &Vol) -> (NbdKit, String) {
    NbdKit::file(&vol.dir.join("store.sock"), &vol.img)
}

/// A bit flipped in block 3's ciphertext while served: the requests
/// covering block 3 fail, its neighbours and a far block read back.
fn flipped_data_bit(vol: &Vol, srv: &Srv) {
    let mut c = srv.client();
    let blocks: Vec<u64> = (0..8).chain([300]).collect();
    fill(&mut c, 1, &blocks);
    for &b in &blocks {
        reads_as(&mut c, b, Some(1));
    }
    assert_eq!(srv.counter("failures"), 0.0);
    vol.flip(vol.data_at(3) + 1000);
    fails(&mut c, 3, 1);
    fails(&mut c, 0, 8);
    for b in [0, 1, 2, 4, 5, 6, 7, 300] {
        reads_as(&mut c, b, Some(1));
    }
    reads_as(&mut c, 301, None);
    assert_eq!(srv.counter("failures"), 2.0);
    assert_eq!(srv.counter("bad_blocks"), 2.0);
    assert!(srv.counter("commits") >= 1.0);
    let err = srv.served.stderr_text();
    let logged = "1 block(s) failed verification (3; 4096-byte blocks";
    assert_eq!(err.matches(logged).count(), 2, "{err}");
    // A good write heals it.
    fill(&mut c, 2, &[3]);
    reads_as(&mut c, 3, Some(2));
    c.disconnect();
}

#[test]
fn a_flipped_ciphertext_bit_fails_only_the_reads_of_its_block() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    for mac in ["hmac-sha256", "aead"] {
        let vol = Vol::new(&format!("flip-{mac}"), mac);
        let (_kit, uri) = store(&vol);
        let srv = start(&vol, &uri, &[]);
        flipped_data_bit(&vol, &srv);
        srv.stop();
    }
}

#[test]
fn a_flipped_ciphertext_bit_in_an_image_file_served_directly_fails_its_reads() {
    let vol = Vol::new("flip-file", "hmac-sha256");
    let img = vol.img.display().to_string();
    let srv = start(&vol, &img, &[]);
    flipped_data_bit(&vol, &srv);
    srv.stop();
}

/// Flip a bit in both slots of tag block `t`.
fn flip_tag_block(vol: &Vol, t: u64) {
    vol.flip(vol.tag_at(t, 0) + 100);
    vol.flip(vol.tag_at(t, 1) + 100);
}

#[test]
fn a_flipped_tag_block_fails_the_reads_it_covers() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("tag-flip", "hmac-sha256");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    // Tag block 1 (blocks P..2P) and one block in each of 30 others.
    const P: u64 = PER_TAG;
    let others: Vec<u64> = (3..33).map(|t| t * P + 5).collect();
    let blocks: Vec<u64> = (P..P + 6).chain(others.iter().copied()).collect();
    fill(&mut c, 1, &blocks);
    flip_tag_block(&vol, 1);
    // Reading 30 other tag blocks evicts tag block 1 from the 16-node
    // cache: it is read again, altered, from the store.
    for &b in &others {
        reads_as(&mut c, b, Some(1));
    }
    fails(&mut c, P, 1);
    fails(&mut c, P + P / 2, 1);
    fails(&mut c, P - 4, 8);
    reads_as(&mut c, P - 1, None);
    reads_as(&mut c, 2 * P, None);
    reads_as(&mut c, others[0], Some(1));
    c.disconnect();
    srv.stop();
    // A cold start sees it too.
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fails(&mut c, P + 1, 1);
    reads_as(&mut c, others[1], Some(1));
    c.disconnect();
    srv.stop();
}

/// Reads refused because a tag block fails the tree are counted like
/// those of a block failing its tag (the families' help says "a block's
/// tag or the tree above it").
#[test]
fn a_tag_block_failing_the_tree_is_counted() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("tag-count", "hmac-sha256");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fill(&mut c, 1, &[PER_TAG, PER_TAG + 1, 200]);
    c.disconnect();
    srv.stop();
    flip_tag_block(&vol, 1);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fails(&mut c, PER_TAG, 1);
    fails(&mut c, PER_TAG, 2);
    reads_as(&mut c, 200, Some(1));
    assert_eq!(srv.counter("failures"), 2.0);
    assert_eq!(srv.counter("bad_blocks"), 3.0);
    c.disconnect();
    srv.stop();
}

#[test]
fn two_swapped_blocks_both_fail() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("swap", "aead");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fill(&mut c, 1, &[10, 11, 12, 500]);
    let (a, b) = (
        vol.bytes(vol.data_at(10), BLOCK),
        vol.bytes(vol.data_at(500), BLOCK),
    );
    vol.put(vol.data_at(10), &b);
    vol.put(vol.data_at(500), &a);
    fails(&mut c, 10, 1);
    fails(&mut c, 500, 1);
    fails(&mut c, 9, 4);
    reads_as(&mut c, 11, Some(1));
    reads_as(&mut c, 12, Some(1));
    assert_eq!(srv.counter("failures"), 3.0);
    assert_eq!(srv.counter("bad_blocks"), 3.0);
    c.disconnect();
    srv.stop();
}

#[test]
fn a_block_and_its_tag_block_put_back_to_an_older_copy_fail() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("older", "hmac-sha256");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fill(&mut c, 1, &[70, 71, 400]);
    let old = std::fs::read(&vol.img).unwrap();
    let at = |off: u64, len: u64| old[off as usize..(off + len) as usize].to_vec();
    fill(&mut c, 2, &[70, 71]);
    // The older data alone.
    vol.put(vol.data_at(70), &at(vol.data_at(70), BLOCK));
    fails(&mut c, 70, 1);
    reads_as(&mut c, 71, Some(2));
    c.disconnect();
    srv.stop();
    // And its tag block's two slots as they were.
    let t = 70 / PER_TAG;
    vol.put(vol.tag_at(t, 0), &at(vol.tag_at(t, 0), BLOCK));
    vol.put(vol.tag_at(t, 1), &at(vol.tag_at(t, 1), BLOCK));
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fails(&mut c, 70, 1);
    fails(&mut c, 71, 1);
    reads_as(&mut c, 400, Some(1));
    c.disconnect();
    srv.stop();
}

#[test]
fn a_whole_image_rolled_back_is_refused_until_reset() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("rollback", "hmac-sha256");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fill(&mut c, 1, &[1, 2, 700]);
    c.disconnect();
    srv.stop();
    let old = std::fs::read(&vol.img).unwrap();
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fill(&mut c, 2, &[1, 2, 700]);
    c.disconnect();
    srv.stop();
    vol.put(0, &old);
    let said = refused(&vol, &uri, &[]);
    assert!(said.contains("rolled back"), "{said}");
    let srv = start(&vol, &uri, &["--freshness-reset"]);
    let mut c = srv.client();
    for b in [1, 2, 700] {
        reads_as(&mut c, b, Some(1));
    }
    c.disconnect();
    srv.stop();
    // The reset wrote a state file that names the store's tree.
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    reads_as(&mut c, 700, Some(1));
    c.disconnect();
    srv.stop();
}

#[test]
fn a_zeroed_tag_area_fails_what_was_written_and_then_refuses_to_open() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("zeroed", "aead");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    // Nothing under tag block 0, which the open checks.
    let blocks = [3 * PER_TAG, 3 * PER_TAG + 1, 7 * PER_TAG + 9];
    fill(&mut c, 1, &blocks);
    c.disconnect();
    srv.stop();
    let tags = vec![0u8; (2 * vol.tag_blocks() * BLOCK) as usize];
    vol.put(vol.tag_at(0, 0), &tags);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    for b in blocks {
        fails(&mut c, b, 1);
    }
    reads_as(&mut c, 0, None);
    reads_as(&mut c, 5 * PER_TAG, None);
    c.disconnect();
    srv.stop();
    let len = std::fs::metadata(&vol.img).unwrap().len() - vol.area_off;
    vol.put(vol.area_off, &vec![0u8; len as usize]);
    let said = refused(&vol, &uri, &[]);
    assert!(said.contains("does not hold the tree"), "{said}");
}

#[test]
fn a_discard_forged_by_zeroing_a_block_fails_while_a_real_trim_reads_zeros() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("discard", "hmac-sha256");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &["--allow-discards"]);
    let mut c = srv.client();
    fill(&mut c, 1, &[20, 21, 22, 23]);
    assert_eq!(c.command(CMD_TRIM, 0, 21 * BLOCK, BLOCK as u32), 0);
    assert_eq!(c.command(CMD_FLUSH, 0, 0, 0), 0);
    reads_as(&mut c, 21, None);
    vol.put(vol.data_at(22), &[0u8; BLOCK as usize]);
    fails(&mut c, 22, 1);
    fails(&mut c, 20, 4);
    reads_as(&mut c, 20, Some(1));
    reads_as(&mut c, 21, None);
    reads_as(&mut c, 23, Some(1));
    assert_eq!(srv.counter("failures"), 2.0);
    c.disconnect();
    srv.stop();
}

#[test]
fn a_lost_or_older_state_file_is_refused() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("state", "hmac-sha256");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fill(&mut c, 1, &[5]);
    let older = std::fs::read(&vol.state).unwrap();
    fill(&mut c, 2, &[5]);
    c.disconnect();
    srv.stop();
    let kept = std::fs::read(&vol.state).unwrap();
    std::fs::remove_file(&vol.state).unwrap();
    let said = refused(&vol, &uri, &[]);
    assert!(said.contains("no freshness state file"), "{said}");
    std::fs::write(&vol.state, &older).unwrap();
    let said = refused(&vol, &uri, &[]);
    assert!(said.contains("older than the store"), "{said}");
    std::fs::write(&vol.state, &kept).unwrap();
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    reads_as(&mut c, 5, Some(2));
    c.disconnect();
    srv.stop();
}

#[test]
fn a_config_export_with_a_freshness_file_serves_an_authenticated_volume() {
    let vol = Vol::new("config", "aead");
    let sock = vol.dir.join("cfg.sock");
    let conf = vol.dir.join("serve.toml");
    let table = common::export_table(
        "auth",
        &vol.img.display().to_string(),
        &vol.pass,
        &format!("freshness = \"{}\"", vol.state.display()),
    );
    let text = format!("[server]\nunix = [\"{}\"]\n\n{table}", sock.display());
    std::fs::write(&conf, text).unwrap();
    let mut cmd = serve_cmd();
    cmd.arg("--config").arg(&conf);
    let (served, metrics) = Served::spawn_with_metrics(cmd, vol.dir.join("cfg.err"));
    let mut c = Client::unix(&sock);
    c.go("auth", &[]).expect("the export");
    fill(&mut c, 1, &[0, 9]);
    reads_as(&mut c, 9, Some(1));
    vol.flip(vol.data_at(9) + 7);
    fails(&mut c, 9, 1);
    reads_as(&mut c, 0, Some(1));
    c.disconnect();
    let srv = Srv {
        served,
        metrics,
        sock,
    };
    assert_eq!(srv.counter("failures"), 1.0);
    assert!(srv.counter("commits") >= 1.0);
    srv.stop();
}

/// SIGKILL to the server: no clean stop, no last commit.
fn kill(srv: &Srv) {
    run(Command::new("kill").args(["-KILL", &srv.served.pid().to_string()]));
}

/// What each block may read after the crash: its last generation
/// acknowledged before the last successful flush, and every one sent
/// after.
struct Allowed(Vec<Vec<u32>>);

/// Generations of writes to `blocks`, pipelined, a FLUSH after every
/// third; the last generation's writes are cut off by SIGKILL after
/// `sent_before_kill` of them.
fn write_then_kill(srv: &Srv, blocks: &[u64], gens: u32, sent_before_kill: usize) -> Allowed {
    let mut c = srv.client();
    let mut allowed: Vec<Vec<u32>> = vec![Vec::new(); blocks.len()];
    for g in 1..=gens {
        let last = g == gens;
        let n = if last { sent_before_kill } else { blocks.len() };
        let mut cookies = Vec::new();
        for (i, &b) in blocks.iter().enumerate().take(n) {
            let d = data(g, b);
            cookies.push(c.send(CMD_WRITE, 0, b * BLOCK, BLOCK as u32, &d).unwrap());
            allowed[i].push(g);
        }
        if last {
            kill(srv);
            break;
        }
        // Replies come in any order.
        let mut waiting: std::collections::BTreeSet<u64> = cookies.into_iter().collect();
        while !waiting.is_empty() {
            let r = c.reply().expect("a reply");
            assert!(waiting.remove(&r.cookie), "a reply to cookie {}", r.cookie);
            assert_eq!(r.error, 0, "generation {g}, cookie {}", r.cookie);
        }
        if g % 3 == 0 {
            assert_eq!(c.command(CMD_FLUSH, 0, 0, 0), 0, "flush");
            for a in allowed.iter_mut() {
                a.retain(|&x| x == g);
            }
        }
    }
    Allowed(allowed)
}

/// Kill a server in the middle of generation `gens` (a FLUSH after every
/// third) and restart it on the same state file: the sweep is logged and
/// counted, and every block holds an allowed generation.
fn crash_case(mac: &str, gens: u32) {
    let vol = Vol::new(&format!("crash-{mac}-{gens}"), mac);
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    // 384 blocks over every tag block of the volume.
    let blocks: Vec<u64> = (0..384).map(|i| i * 25 + i % 7).collect();
    assert!(blocks.iter().all(|&b| b < vol.blocks));
    let allowed = write_then_kill(&srv, &blocks, gens, 200);
    let (status, _) = srv.served.terminate();
    assert!(!status.success(), "killed: {status}");
    let srv = start(&vol, &uri, &[]);
    let err = srv.served.stderr_text();
    assert!(err.contains("not stopped cleanly"), "{err}");
    let kept: f64 = err
        .lines()
        .find_map(|l| l.split("kept ").nth(1)?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no sweep result in {err}"));
    assert_eq!(srv.counter("recovered_blocks"), kept);
    println!("{mac}: the sweep kept {kept} blocks written after the last flush");
    let mut c = srv.client();
    for (i, &b) in blocks.iter().enumerate() {
        let got = c
            .read(b * BLOCK, BLOCK as u32)
            .unwrap_or_else(|e| panic!("block {b}: error {e} after the crash"));
        let ok = allowed.0[i].iter().any(|&g| data(g, b) == got);
        assert!(ok, "block {b} holds none of generations {:?}", allowed.0[i]);
    }
    assert_eq!(srv.counter("failures"), 0.0);
    c.disconnect();
    srv.stop();
}

#[test]
fn a_server_killed_mid_write_keeps_flushed_or_later_data_hmac() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    // Generation 7 cut off: one write per block since the flush of 6.
    crash_case("hmac-sha256", 7);
}

#[test]
fn a_server_killed_mid_write_keeps_flushed_or_later_data_aead() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    crash_case("aead", 7);
}

#[test]
fn a_server_killed_in_a_second_write_since_the_flush_keeps_flushed_or_later_data() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    crash_case("hmac-sha256", 8);
}

/// The store as a kill between a write's tag block and its data leaves
/// it, made on purpose: block 40 flushed at generation 1, generation 2
/// written (acknowledged), generation 3 written, then generation 2's
/// ciphertext put back under generation 3's tag and the server killed.
/// The block must read as generation 2 or 3, not fail.
#[test]
fn a_kill_between_a_second_writes_tag_and_data_keeps_the_first() {
    if !tools(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let vol = Vol::new("window", "hmac-sha256");
    let (_kit, uri) = store(&vol);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    fill(&mut c, 1, &[40, 41]);
    assert_eq!(c.write(40 * BLOCK, &data(2, 40), 0), 0);
    let second = vol.bytes(vol.data_at(40), BLOCK);
    assert_eq!(c.write(40 * BLOCK, &data(3, 40), 0), 0);
    vol.put(vol.data_at(40), &second);
    kill(&srv);
    let _ = srv.served.terminate();
    drop(c);
    let srv = start(&vol, &uri, &[]);
    let mut c = srv.client();
    reads_as(&mut c, 41, Some(1));
    let got = c.read(40 * BLOCK, BLOCK as u32);
    assert!(
        got == Ok(data(2, 40)) || got == Ok(data(3, 40)),
        "block 40 after the crash: {:?}",
        got.map(|_| "other data")
    );
    c.disconnect();
    srv.stop();
}
