//! `iopages serve --allow-discards`: sparse volumes against the tools that
//! read and make them. nbdinfo and qemu-img map the export (block status,
//! `base:allocation`), qemu-io and a small raw NBD client of this file
//! discard and zero ranges (misaligned ones, FAST_ZERO with and without
//! NO_HOLE), qemu-img convert and nbdcopy copy a mostly empty volume into
//! sparse files (and qemu-img convert -n into a used one), a
//! cryptsetup-made LUKS2 image keeps its header and its data, with holes
//! where it was discarded, and zeros written with NO_HOLE are ciphertext
//! that reads as zeros without the flag too. Random requests against a
//! model of content and allocation, and four connections punching and
//! writing neighbouring sectors at once, in memory and in image files
//! (O_DIRECT and buffered).
//!
//! Every server is a real `iopages serve` process on a Unix socket,
//! stopped with SIGTERM (which must flush, print its last statistics line
//! and `stopped`, and exit 0). Where a tool is missing the test says so
//! and returns, except under `CI=true`, where scripts/setup-debian.sh has
//! installed them all and a missing one fails.

mod common;

use common::{cryptsetup, luks_format, pattern, run, serve_cmd, tools, Dir, BIN};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const MIB: u64 = 1 << 20;
/// The in-memory volume's encryption sector.
const SECTOR: u64 = 4096;
/// Block status flags (`base:allocation`): a hole, reads as zeros.
const HOLE_ZERO: u32 = 3;
/// Block status flags of allocated data.
const DATA: u32 = 0;

/// A running `iopages serve` on a Unix socket (the common one, and its
/// socket for qemu-io).
struct Served {
    srv: common::Served,
    sock: PathBuf,
}

impl std::ops::Deref for Served {
    type Target = common::Served;
    fn deref(&self) -> &common::Served {
        &self.srv
    }
}

impl Served {
    /// `iopages serve ARGS` on `DIR/NAME.sock`.
    fn start(dir: &Dir, name: &str, args: &[&str]) -> Served {
        let sock = dir.join(&format!("{name}.sock"));
        let mut cmd = serve_cmd();
        cmd.args(args)
            .arg("--unix")
            .arg(&sock)
            .args(["--arena", "128M"]);
        let srv = common::Served::spawn(cmd, dir.join(&format!("{name}.err")), |_| {});
        assert!(srv.uri.starts_with("nbd+unix:///"), "{:?}", srv.banner);
        Served { srv, sock }
    }

    /// `iopages serve --image IMG --passphrase-file PASS ARGS` on
    /// `DIR/NAME.sock`.
    fn on_image(dir: &Dir, name: &str, img: &Path, pass: &Path, args: &[&str]) -> Served {
        let mut all = vec![
            "--image",
            img.to_str().unwrap(),
            "--passphrase-file",
            pass.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        Served::start(dir, name, &all)
    }

    /// SIGTERM: the server must exit 0 after its last statistics line and
    /// `stopped`, with nothing on stderr. Returns that statistics line.
    fn stop(self) -> String {
        let stderr = self.srv.stderr.clone();
        let rest = self.srv.stop();
        let err = std::fs::read_to_string(&stderr).unwrap_or_default();
        assert_eq!(rest.last().map(|l| l.as_str()), Some("stopped"), "{rest:?}");
        assert!(err.trim().is_empty(), "stderr: {err}");
        rest.iter()
            .find(|l| l.contains("out pages") && l.contains("| trim "))
            .unwrap_or_else(|| panic!("the last statistics line: {rest:?}"))
            .clone()
    }

    /// Bytes allocated to the in-memory volume: its memfd's blocks, seen
    /// through /proc.
    fn volume_bytes(&self) -> u64 {
        let fds = format!("/proc/{}/fd", self.pid());
        let mut names = Vec::new();
        for e in std::fs::read_dir(&fds).unwrap() {
            let p = e.unwrap().path();
            let name = std::fs::read_link(&p).unwrap_or_default();
            let name = name.to_string_lossy().into_owned();
            if name.starts_with("/memfd:") && name.contains("volume") {
                return std::fs::metadata(&p).unwrap().blocks() * 512;
            }
            names.push(name);
        }
        panic!("no memfd of the volume among {names:?}");
    }

    /// Whether the banner says discards are on.
    fn discards_on(&self) -> bool {
        self.banner.iter().any(|l| l.starts_with("discards: on"))
    }

    /// qemu-io's commands against the export; every one must succeed (a
    /// failed pattern check or request fails the test).
    fn qemu_io(&self, cmds: &[String]) -> String {
        let out = self.qemu_io_unchecked(cmds);
        assert!(
            out.status.success(),
            "qemu-io {cmds:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!text.contains("failed"), "qemu-io {cmds:?}:\n{text}");
        text
    }

    fn qemu_io_unchecked(&self, cmds: &[String]) -> std::process::Output {
        let mut cmd = Command::new("qemu-io");
        cmd.arg("--image-opts").arg(format!(
            "driver=nbd,server.type=unix,server.path={},export=iopages",
            self.sock.display()
        ));
        for c in cmds {
            cmd.arg("-c").arg(c);
        }
        cmd.stdin(Stdio::null()).output().expect("qemu-io runs")
    }

    /// `nbdinfo --json`: what the server offers.
    fn info(&self) -> serde_json::Value {
        let out = run(Command::new("nbdinfo").arg("--json").arg(&self.uri));
        let v: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo's JSON");
        v["exports"][0].clone()
    }

    /// `nbdinfo --map --json`, adjacent extents of one type merged.
    fn nbdinfo_map(&self) -> Vec<Extent> {
        let out = run(Command::new("nbdinfo")
            .args(["--map", "--json"])
            .arg(&self.uri));
        let v: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo's map");
        let list = v.as_array().expect("a list of extents");
        merged(
            list.iter()
                .map(|e| Extent {
                    offset: e["offset"].as_u64().unwrap(),
                    length: e["length"].as_u64().unwrap(),
                    flags: e["type"].as_u64().unwrap() as u32,
                })
                .collect(),
        )
    }

    /// `qemu-img map --output=json`, as block status flags (no data: hole;
    /// zero: zero), adjacent extents of one kind merged.
    fn qemu_img_map(&self) -> Vec<Extent> {
        let out = run(Command::new("qemu-img")
            .args(["map", "-f", "raw", "--output=json"])
            .arg(&self.uri));
        let v: serde_json::Value = serde_json::from_str(&out).expect("qemu-img's map");
        merged(
            v.as_array()
                .expect("a list of extents")
                .iter()
                .map(|e| {
                    assert_eq!(e["present"], true, "{e}");
                    let hole = e["data"] == false;
                    let zero = e["zero"] == true;
                    Extent {
                        offset: e["start"].as_u64().unwrap(),
                        length: e["length"].as_u64().unwrap(),
                        flags: u32::from(hole) | (u32::from(zero) << 1),
                    }
                })
                .collect(),
        )
    }
}

/// `iopages luks format IMG`: LUKS2, `size` of payload, 512-byte
/// sectors, cheap PBKDF2, under the passphrase in the file `pass`.
fn luks_image(img: &Path, size: &str, pass: &Path) {
    run(Command::new(BIN)
        .args(["luks", "format"])
        .arg(img)
        .args(["--size", size, "--sector-size", "512"])
        .args(["--pbkdf", "pbkdf2", "--iterations", "1000"])
        .arg("--passphrase-file")
        .arg(pass));
}

/// One extent of a block status map: `flags` as NBD's `base:allocation`
/// (1 hole, 2 zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Extent {
    offset: u64,
    length: u64,
    flags: u32,
}

/// `list` must be contiguous from 0; neighbours of one kind become one.
fn merged(list: Vec<Extent>) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    for e in list {
        assert!(e.length > 0, "an empty extent: {e:?}");
        match out.last_mut() {
            Some(l) => {
                assert_eq!(
                    l.offset + l.length,
                    e.offset,
                    "a gap in the map before {e:?}"
                );
                if l.flags == e.flags {
                    l.length += e.length;
                    continue;
                }
            }
            None => assert_eq!(e.offset, 0, "the map starts at 0: {e:?}"),
        }
        out.push(e);
    }
    out
}

/// The map of a volume of `size` bytes that is a hole everywhere but
/// `data` (`[start, end)` ranges, any order, may touch or overlap).
fn expected_map(size: u64, data: &[(u64, u64)]) -> Vec<Extent> {
    let mut d = data.to_vec();
    d.sort();
    let mut list = Vec::new();
    let mut at = 0;
    for (s, e) in d {
        if e <= at {
            continue;
        }
        let s = s.max(at);
        if s > at {
            list.push(Extent {
                offset: at,
                length: s - at,
                flags: HOLE_ZERO,
            });
        }
        list.push(Extent {
            offset: s,
            length: e - s,
            flags: DATA,
        });
        at = e;
    }
    if at < size {
        list.push(Extent {
            offset: at,
            length: size - at,
            flags: HOLE_ZERO,
        });
    }
    merged(list)
}

/// `ranges` less `holes` (all `[start, end)`).
fn cut(ranges: &[(u64, u64)], holes: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = ranges.to_vec();
    for &(hs, he) in holes {
        out = out
            .into_iter()
            .flat_map(|(s, e)| {
                if he <= s || e <= hs {
                    vec![(s, e)]
                } else {
                    vec![(s, hs.max(s)), (he.min(e), e)]
                }
            })
            .filter(|(s, e)| s < e)
            .collect();
    }
    out
}

/// The number right after `key` in a statistics line.
fn counter(line: &str, key: &str) -> u64 {
    let at = line
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {line}"));
    let digits: String = line[at + key.len()..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {key:?} in {line}"))
}

/// (TRIM requests, MiB discarded, WRITE_ZEROES requests, MiB punched by
/// them, BLOCK_STATUS requests) of a statistics line.
fn discard_counters(line: &str) -> (u64, u64, u64, u64, u64) {
    let trims = counter(line, "| trim ");
    let zeroes = counter(line, "write-zeroes ");
    (
        trims,
        counter(line, &format!("trim {trims} (")),
        zeroes,
        counter(line, &format!("write-zeroes {zeroes} (")),
        counter(line, "block status "),
    )
}

/// The whole sectors inside `[off, off + len)`, as `[start, end)` (empty
/// when there is none).
fn inward(off: u64, len: u64, sector: u64) -> (u64, u64) {
    let s = off.div_ceil(sector) * sector;
    let e = (off + len) / sector * sector;
    (s, e.max(s))
}

/// The sectors `[off, off + len)` touches, as `[start, end)`.
fn outward(off: u64, len: u64, sector: u64) -> (u64, u64) {
    (off / sector * sector, (off + len).div_ceil(sector) * sector)
}

/// The data extents of `model` (a byte image): the sectors that are not
/// all zeros.
fn data_sectors(model: &[u8], sector: usize) -> Vec<(u64, u64)> {
    model
        .chunks(sector)
        .enumerate()
        .filter(|(_, c)| c.iter().any(|&b| b != 0))
        .map(|(i, c)| ((i * sector) as u64, (i * sector + c.len()) as u64))
        .collect()
}

/// The tests' raw NBD client (`iopages_testkit::nbd_client`: newstyle
/// fixed handshake, NBD_OPT_GO, simple replies), for requests the tools
/// never send as they are: misaligned TRIM, WRITE_ZEROES with exactly the
/// flags asked for. What this file adds to it: the export's size and
/// flags beside it, reads of any length in pieces of 1 MiB, requests that
/// must succeed, and NBD_CMD_DISC when dropped.
mod raw {
    use super::*;
    use iopages_testkit::nbd_client::{self as nbd, Polite};

    pub use nbd::{
        CMD_FLAG_FAST_ZERO as FLAG_FAST_ZERO, CMD_FLAG_FUA as FLAG_FUA,
        CMD_FLAG_NO_HOLE as FLAG_NO_HOLE, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES, ENOTSUP,
        EPERM, TFLAG_SEND_FAST_ZERO, TFLAG_SEND_TRIM, TFLAG_SEND_WRITE_ZEROES,
    };

    pub struct Client {
        c: Polite<UnixStream>,
        pub size: u64,
        pub flags: u16,
    }

    impl Client {
        /// Connected to the export `iopages` on `sock`, in transmission.
        pub fn connect(sock: &Path) -> Client {
            let s = UnixStream::connect(sock).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut c = nbd::Client::greet(s).expect("a newstyle greeting");
            let hflags = c.handshake_flags();
            assert_ne!(hflags & nbd::FLAG_FIXED_NEWSTYLE, 0, "fixed newstyle");
            // Fixed newstyle, and no zeroes where the server offers that.
            let no_zeroes = u32::from(hflags & nbd::FLAG_NO_ZEROES);
            c.send_client_flags(nbd::FLAG_C_FIXED_NEWSTYLE | no_zeroes)
                .unwrap();
            let export = c
                .go("iopages", &[])
                .unwrap_or_else(|e| panic!("NBD_OPT_GO refused: {e}"));
            Client {
                c: c.disconnect_on_drop(),
                size: export.size,
                flags: export.flags,
            }
        }

        /// One request; its error (0: success) and, for a read, the data.
        pub fn request(
            &mut self,
            cmd: u16,
            flags: u16,
            offset: u64,
            len: u32,
            payload: &[u8],
        ) -> (u32, Vec<u8>) {
            let r = self.c.request(cmd, flags, offset, len, payload);
            (r.error, r.data)
        }

        /// A request that must succeed.
        pub fn ok(&mut self, cmd: u16, flags: u16, offset: u64, len: u32) {
            let (e, _) = self.request(cmd, flags, offset, len, &[]);
            assert_eq!(e, 0, "command {cmd} flags {flags:#x} at {offset} +{len}");
        }

        pub fn write(&mut self, offset: u64, data: &[u8]) {
            let (e, _) = self.request(CMD_WRITE, 0, offset, data.len() as u32, data);
            assert_eq!(e, 0, "write at {offset} +{}", data.len());
        }

        /// `len` bytes at `offset`, read in pieces of at most 1 MiB.
        pub fn read(&mut self, offset: u64, len: u64) -> Vec<u8> {
            let mut out = Vec::with_capacity(len as usize);
            let mut at = offset;
            while at < offset + len {
                let n = (offset + len - at).min(MIB);
                let (e, d) = self.request(CMD_READ, 0, at, n as u32, &[]);
                assert_eq!(e, 0, "read at {at} +{n}");
                out.extend_from_slice(&d);
                at += n;
            }
            out
        }
    }
}

/// Where `a` and `b` first differ, for a short failure message.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.chunks(1 << 16)
        .zip(b.chunks(1 << 16))
        .position(|(x, y)| x != y)
        .map(|i| {
            let base = i << 16;
            base + a[base..]
                .iter()
                .zip(&b[base..])
                .position(|(x, y)| x != y)
                .unwrap()
        })
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    if let Some(at) = first_difference(got, want) {
        panic!(
            "{what}: differs first at byte {at} (sector {} of 4096; {} bytes against {})",
            at / 4096,
            got.len(),
            want.len()
        );
    }
}

#[test]
fn a_fresh_in_memory_volume_maps_as_one_hole_and_writes_map_as_data_sectors() {
    if !tools(&["nbdinfo", "qemu-io", "qemu-img"]) {
        return;
    }
    let dir = Dir::new("fresh");
    let size = 64 * MIB;
    let srv = Served::start(&dir, "s", &["--size", "64M", "--allow-discards"]);
    assert!(srv.discards_on(), "{:?}", srv.banner);
    let info = srv.info();
    assert_eq!(info["export-size"], size, "{info}");
    assert!(
        info["contexts"]
            .as_array()
            .is_some_and(|c| c.iter().any(|x| x == "base:allocation")),
        "base:allocation is offered: {info}"
    );
    for cap in ["can_trim", "can_zero", "can_fast_zero"] {
        assert_eq!(info[cap], true, "{cap}: {info}");
    }
    let all_hole = vec![Extent {
        offset: 0,
        length: size,
        flags: HOLE_ZERO,
    }];
    assert_eq!(srv.nbdinfo_map(), all_hole, "nbdinfo, fresh");
    assert_eq!(srv.qemu_img_map(), all_hole, "qemu-img, fresh");
    // One aligned region, and one that starts and ends inside sectors
    // (qemu reads the partial sectors, holes, and writes them back whole).
    let (a, alen) = (MIB, 256 << 10);
    let (b, blen) = (10 * MIB + 1000, 9000);
    srv.qemu_io(&[
        format!("write -P 0xab {a} {alen}"),
        format!("write -P 0xcd {b} {blen}"),
        // A hole reads as zeros, and so do the written sectors' other
        // bytes.
        format!("read -P 0 0 {a}"),
        format!("read -P 0xab {a} {alen}"),
        format!("read -P 0 {} 1000", 10 * MIB),
        format!("read -P 0xcd {b} {blen}"),
        format!(
            "read -P 0 {} {}",
            b + blen,
            10 * MIB + 3 * SECTOR - b - blen
        ),
        format!("read -P 0 {} {}", 20 * MIB, 44 * MIB),
    ]);
    let want = expected_map(size, &[outward(a, alen, SECTOR), outward(b, blen, SECTOR)]);
    assert_eq!(want.len(), 5, "{want:?}");
    assert_eq!(srv.nbdinfo_map(), want, "nbdinfo after two writes");
    assert_eq!(srv.qemu_img_map(), want, "qemu-img after two writes");
    let line = srv.stop();
    let (trims, _, zeroes, _, status) = discard_counters(&line);
    assert_eq!((trims, zeroes), (0, 0), "{line}");
    assert!(status >= 4, "four maps ask block status: {line}");
}

#[test]
fn without_allow_discards_everything_is_allocated_and_trim_keeps_the_data() {
    if !tools(&["nbdinfo", "qemu-io", "qemu-img"]) {
        return;
    }
    let dir = Dir::new("nodiscard");
    let size = 64 * MIB;
    let srv = Served::start(&dir, "s", &["--size", "64M"]);
    assert!(!srv.discards_on(), "{:?}", srv.banner);
    let info = srv.info();
    assert_eq!(info["can_fast_zero"], false, "{info}");
    let all_data = vec![Extent {
        offset: 0,
        length: size,
        flags: DATA,
    }];
    assert_eq!(srv.nbdinfo_map(), all_data, "nbdinfo, fresh");
    assert_eq!(srv.qemu_img_map(), all_data, "qemu-img, fresh");
    srv.qemu_io(&[format!("write -P 0xab 0 {}", 8 * MIB)]);
    let before = srv.volume_bytes();
    assert!(before >= 8 * MIB, "{before}");
    srv.qemu_io(&[
        format!("discard 0 {}", 2 * MIB),
        format!("discard {} {}", 4 * MIB, 4 * MIB),
        format!("read -P 0xab 0 {}", 8 * MIB),
        // WRITE_ZEROES, NO_HOLE and not: encrypted zeros either way.
        format!("write -z {} {}", 10 * MIB, MIB),
        format!("write -z -u {} {}", 12 * MIB, MIB),
        format!("read -P 0 {} {}", 10 * MIB, MIB),
        format!("read -P 0 {} {}", 12 * MIB, MIB),
    ]);
    // FAST_ZERO is not offered: qemu's fast zero fails without a request
    // and writes nothing.
    let fast = srv.qemu_io_unchecked(&[format!("write -z -n -u 0 {MIB}")]);
    let text = String::from_utf8_lossy(&fast.stdout);
    assert!(
        !fast.status.success() && text.contains("Operation not supported"),
        "{text}"
    );
    let mut c = raw::Client::connect(&srv.sock);
    assert_eq!(c.size, size);
    assert_eq!(c.flags & raw::TFLAG_SEND_FAST_ZERO, 0, "{:#x}", c.flags);
    // TRIM is a no-op, misaligned or not.
    c.ok(raw::CMD_TRIM, 0, 100, (3 * MIB) as u32);
    c.ok(raw::CMD_TRIM, 0, 6 * MIB, (2 * MIB) as u32);
    assert!(c.read(0, 8 * MIB).iter().all(|&x| x == 0xab));
    assert!(c.read(10 * MIB, MIB).iter().all(|&x| x == 0));
    assert!(c.read(12 * MIB, MIB).iter().all(|&x| x == 0));
    // A sector never written is ciphertext zeros, which only decrypt to
    // zeros with --allow-discards.
    let never = c.read(40 * MIB, SECTOR);
    assert!(never.iter().any(|&x| x != 0), "never written reads zeros");
    drop(c);
    // Encrypted zeros take memory: 2 MiB more, none given back.
    assert_eq!(srv.volume_bytes(), before + 2 * MIB);
    assert_eq!(srv.nbdinfo_map(), all_data, "nbdinfo after discards");
    assert_eq!(srv.qemu_img_map(), all_data, "qemu-img after discards");
    let line = srv.stop();
    let (trims, discarded, zeroes, punched, status) = discard_counters(&line);
    assert!(trims >= 4 && zeroes >= 2 && status >= 4, "{line}");
    assert_eq!((discarded, punched), (0, 0), "nothing punched: {line}");
}

/// The TRIMs of the fstrim-like test within the first `span` bytes: edge
/// cases, then what a file system's fstrim sends.
fn fstrim_ranges(span: u64) -> Vec<(u64, u64)> {
    // Edge cases, then what a file system's fstrim sends: free ranges of
    // many sizes, at 4096 or 512 bytes or at any byte.
    let mut trims: Vec<(u64, u64)> = vec![
        (0, SECTOR),
        (2 * SECTOR, 16 * SECTOR),
        (MIB, MIB),
        (3 * MIB + 512, 8192),
        // No whole sector inside: nothing.
        (5 * MIB + 100, 3000),
        (6 * MIB, SECTOR + 2048),
        (7 * MIB - 1000, 3 * SECTOR),
        (8 * MIB + 4095, SECTOR + 2),
        (span - SECTOR, SECTOR),
    ];
    let mut x = 0x9e37_79b9_u32;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        u64::from(x) % m
    };
    for i in 0..60 {
        let align = [SECTOR, 512, 1][i % 3];
        let off = next(span - 2 * MIB) / align * align;
        let len = match i % 4 {
            0 => 1 + next(SECTOR),
            1 => 1 + next(64 << 10),
            2 => 1 + next(MIB),
            _ => (1 + next(64)) * SECTOR,
        };
        trims.push((9 * MIB + off % (5 * MIB), len));
    }
    trims
}

/// Send every TRIM of `trims` (and qemu's discard) to `srv`, zeroing
/// the whole sectors inside each in `model` (the first `span` bytes of a
/// `size`-byte volume), and read the span back.
///
/// **Returns:** the bytes punched, request by request (overlaps counted
/// again).
fn trim_each(srv: &Served, trims: &[(u64, u64)], model: &mut [u8], span: u64, size: u64) -> u64 {
    let mut c = raw::Client::connect(&srv.sock);
    assert_ne!(c.flags & raw::TFLAG_SEND_TRIM, 0, "{:#x}", c.flags);
    // The bytes punched, request by request (overlaps counted again).
    let mut punched = 0;
    for &(off, len) in trims {
        c.ok(raw::CMD_TRIM, 0, off, len as u32);
        let (s, e) = inward(off, len, SECTOR);
        model[s as usize..e as usize].fill(0);
        punched += e - s;
    }
    // qemu's discard too (qemu trims whole sectors only).
    srv.qemu_io(&[format!("discard {} {}", 15 * MIB + 10, MIB - 20)]);
    let (s, e) = inward(15 * MIB + 10, MIB - 20, SECTOR);
    model[s as usize..e as usize].fill(0);
    punched += e - s;
    let zeroed = model.chunks(SECTOR as usize).filter(|c| c[0] == 0).count();
    assert!(zeroed > 100, "the trims zero {zeroed} sectors");
    assert_same("the trimmed span", &c.read(0, span), model);
    assert!(c.read(span, size - span - MIB).iter().all(|&b| b == 0));
    drop(c);
    punched
}

/// The export's last bytes trimmed, misaligned; then all of it at once,
/// with FUA, as mkfs and a whole-device fstrim do: the memory goes back
/// to the `header`'s.
///
/// **Returns:** the bytes punched.
fn trim_tail_then_everything(srv: &Served, size: u64, header: u64) -> u64 {
    let mut punched = 0;
    let mut c = raw::Client::connect(&srv.sock);
    c.ok(
        raw::CMD_TRIM,
        0,
        size - 3 * SECTOR - 100,
        (3 * SECTOR + 100) as u32,
    );
    punched += 3 * SECTOR;
    let mut tail = vec![0xefu8; MIB as usize];
    tail[(MIB - 3 * SECTOR) as usize..].fill(0);
    assert_same("the trimmed tail", &c.read(size - MIB, MIB), &tail);
    let before = srv.volume_bytes();
    assert!(before > header + 8 * MIB, "{before} bytes of memory before");
    c.ok(raw::CMD_TRIM, raw::FLAG_FUA, 0, size as u32);
    punched += size;
    // The memory goes back: what is left is the header's.
    assert_eq!(srv.volume_bytes(), header, "memory after (from {before})");
    assert!(c.read(0, size).iter().all(|&b| b == 0), "all trimmed");
    drop(c);
    punched
}

#[test]
fn fstrim_like_discards_punch_whole_sectors_and_leave_their_neighbours() {
    if !tools(&["nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = Dir::new("fstrim");
    let size = 64 * MIB;
    let span = 16 * MIB;
    let srv = Served::start(&dir, "s", &["--size", "64M", "--allow-discards"]);
    // The memory of a fresh volume: its header's.
    let header = srv.volume_bytes();
    assert!(header < size, "{header}");
    srv.qemu_io(&[
        format!("write -P 0xab 0 {span}"),
        format!("write -P 0xef {} {MIB}", size - MIB),
    ]);
    let mut model = vec![0xabu8; span as usize];
    let trims = fstrim_ranges(span);
    let mut punched = trim_each(&srv, &trims, &mut model, span, size);
    // Another client agrees on a few of them.
    srv.qemu_io(&[
        format!("read -P 0 0 {SECTOR}"),
        format!("read -P 0xab {SECTOR} {SECTOR}"),
        format!("read -P 0xab {} 512", 3 * MIB + 512),
        format!("read -P 0 {} {SECTOR}", 3 * MIB + SECTOR),
        format!("read -P 0xab {} {}", 5 * MIB, SECTOR),
        format!("read -P 0 {} {SECTOR}", 8 * MIB + SECTOR),
        format!("read -P 0xab {} {SECTOR}", 8 * MIB),
        format!("read -P 0xab {} {SECTOR}", 8 * MIB + 2 * SECTOR),
    ]);
    let mut data = data_sectors(&model, SECTOR as usize);
    data.push((size - MIB, size));
    let want = expected_map(size, &data);
    assert_eq!(srv.nbdinfo_map(), want, "the map after the trims");
    punched += trim_tail_then_everything(&srv, size, header);
    let all_hole = vec![Extent {
        offset: 0,
        length: size,
        flags: HOLE_ZERO,
    }];
    assert_eq!(srv.nbdinfo_map(), all_hole, "the map after trimming it all");
    let line = srv.stop();
    let (requests, discarded, _, _, _) = discard_counters(&line);
    // qemu sends a misaligned discard's head and tail as TRIMs of their
    // own: at least one request from it.
    assert!(requests >= trims.len() as u64 + 3, "{line}");
    assert_eq!(discarded, punched >> 20, "{line}");
}

/// Our own WRITE_ZEROES at 9 MiB: NO_HOLE with FAST_ZERO refused with
/// ENOTSUP (nothing written), FAST_ZERO alone punches.
fn fast_zero_with_and_without_no_hole(srv: &Served) {
    let mut c = raw::Client::connect(&srv.sock);
    let want_flags = raw::TFLAG_SEND_WRITE_ZEROES | raw::TFLAG_SEND_FAST_ZERO;
    assert_eq!(c.flags & want_flags, want_flags, "{:#x}", c.flags);
    let (e, _) = c.request(
        raw::CMD_WRITE_ZEROES,
        raw::FLAG_NO_HOLE | raw::FLAG_FAST_ZERO,
        9 * MIB,
        MIB as u32,
        &[],
    );
    assert_eq!(e, raw::ENOTSUP, "FAST_ZERO with NO_HOLE");
    assert!(c.read(9 * MIB, MIB).iter().all(|&b| b == 0xab));
    // FAST_ZERO alone punches.
    c.ok(
        raw::CMD_WRITE_ZEROES,
        raw::FLAG_FAST_ZERO,
        9 * MIB,
        MIB as u32,
    );
    assert!(c.read(9 * MIB, MIB).iter().all(|&b| b == 0));
    assert!(c.read(10 * MIB, 2 * MIB).iter().all(|&b| b == 0xab));
    drop(c);
}

#[test]
fn write_zeroes_punches_unless_no_hole_and_fast_zero_fails_fast_when_it_cannot() {
    if !tools(&["nbdinfo", "qemu-io", "qemu-img"]) {
        return;
    }
    let dir = Dir::new("zeroes");
    let size = 64 * MIB;
    let json = dir.join("stats.json");
    let srv = Served::start(
        &dir,
        "s",
        &[
            "--size",
            "64M",
            "--allow-discards",
            "--stats-json",
            json.to_str().unwrap(),
        ],
    );
    let r = |m: u64, pat: u8| format!("read -P {pat:#x} {} {MIB}", m * MIB);
    srv.qemu_io(&[
        format!("write -P 0xab 0 {}", 12 * MIB),
        // NO_HOLE: encrypted zeros, allocated.
        format!("write -z {MIB} {MIB}"),
        // May unmap: a hole.
        format!("write -z -u {} {MIB}", 3 * MIB),
        // May unmap, and no slow fallback (FAST_ZERO): a hole.
        format!("write -z -u -n {} {MIB}", 5 * MIB),
        r(0, 0xab),
        r(1, 0),
        r(2, 0xab),
        r(3, 0),
        r(4, 0xab),
        r(5, 0),
        r(6, 0xab),
    ]);
    // NO_HOLE and FAST_ZERO: it cannot punch, so ENOTSUP, and nothing
    // written.
    let fast = srv.qemu_io_unchecked(&[format!("write -z -n {} {MIB}", 7 * MIB)]);
    let text = String::from_utf8_lossy(&fast.stdout);
    assert!(
        !fast.status.success() && text.contains("Operation not supported"),
        "{text}"
    );
    srv.qemu_io(&[r(7, 0xab)]);
    fast_zero_with_and_without_no_hole(&srv);
    let punched: Vec<(u64, u64)> = [3, 5, 9]
        .iter()
        .map(|&m| (m * MIB, (m + 1) * MIB))
        .collect();
    let want = expected_map(size, &cut(&[(0, 12 * MIB)], &punched));
    assert_eq!(want.len(), 8, "{want:?}");
    assert_eq!(srv.nbdinfo_map(), want, "nbdinfo after the zeroes");
    assert_eq!(srv.qemu_img_map(), want, "qemu-img after the zeroes");
    let line = srv.stop();
    let (_, _, zeroes, punched_mib, _) = discard_counters(&line);
    assert!(zeroes >= 4, "{line}");
    assert_eq!(punched_mib, 3, "three punched, NO_HOLE not: {line}");
    // Both NO_HOLE and FAST_ZERO requests, qemu's and ours, reached the
    // server and were refused there.
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["write_zeroes"]["errors"], 2, "{v}");
    assert_eq!(v["write_zeroes"]["requests"], zeroes, "{v}");
}

/// Where the blocks of `f` are allocated: its data extents `[start,
/// end)` (SEEK_DATA / SEEK_HOLE) within `[from, to)`.
fn file_data(f: &std::fs::File, from: u64, to: u64) -> Vec<(u64, u64)> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut at = from as libc::off_t;
    while (at as u64) < to {
        // SAFETY: lseek on a file descriptor we own.
        let d = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if d < 0 || d as u64 >= to {
            break;
        }
        // SAFETY: as above.
        let h = unsafe { libc::lseek(fd, d, libc::SEEK_HOLE) };
        assert!(h > d, "SEEK_HOLE after {d}");
        out.push((d as u64, (h as u64).min(to)));
        at = h;
    }
    out
}

#[test]
fn a_mostly_empty_volume_copies_into_sparse_files_with_qemu_img_and_nbdcopy() {
    if !tools(&["nbdinfo", "nbdcopy", "qemu-img"]) {
        return;
    }
    let dir = Dir::new("copies");
    let size = 256 * MIB;
    // 32 regions, about 11 % of the volume, in a sparse source file.
    let src = dir.join("src.raw");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(size).unwrap();
    let mut regions = Vec::new();
    for i in 0..32u64 {
        let off = i * 8 * MIB + (i * 7919 % 1000) * SECTOR;
        let len = (256 << 10) * (1 + i % 6);
        use std::os::unix::fs::FileExt;
        f.write_all_at(&pattern(i as u32 + 1, len as usize), off)
            .unwrap();
        regions.push((off, off + len));
    }
    drop(f);
    let written: u64 = regions.iter().map(|(s, e)| e - s).sum();
    let srv = Served::start(&dir, "s", &["--size", "256M", "--allow-discards"]);
    // nbdcopy writes the regions and zeroes the rest: holes stay holes.
    run(Command::new("nbdcopy").arg(&src).arg(&srv.uri));
    let want = expected_map(size, &regions);
    assert_eq!(srv.nbdinfo_map(), want, "the volume's map after nbdcopy");
    let expected = std::fs::read(&src).unwrap();
    let by_qemu = dir.join("qemu.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(&srv.uri)
        .arg(&by_qemu));
    let by_nbdcopy = dir.join("nbdcopy.raw");
    run(Command::new("nbdcopy").arg(&srv.uri).arg(&by_nbdcopy));
    // Every byte read, holes too (answered as holes in structured
    // replies); nbdcopy still leaves the zero blocks out.
    let every_byte = dir.join("every-byte.raw");
    run(Command::new("nbdcopy")
        .arg("--no-extents")
        .arg(&srv.uri)
        .arg(&every_byte));
    let line = srv.stop();
    assert!(discard_counters(&line).4 >= 2, "block status asked: {line}");
    for p in [&by_qemu, &by_nbdcopy, &every_byte] {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let got = std::fs::read(p).unwrap();
        assert_same(&name, &got, &expected);
        drop(got);
        let allocated = std::fs::metadata(p).unwrap().blocks() * 512;
        assert!(
            allocated >= written && allocated < size * 2 / 5,
            "{name}: {allocated} bytes allocated for {written} written of {size}"
        );
    }
}

/// A 64 MiB LUKS2 image made by cryptsetup in `dir` (512-byte sectors):
/// its path, its passphrase file and its payload's offset (from
/// cryptsetup's own description).
fn luks2_image(dir: &Dir) -> (PathBuf, PathBuf, u64) {
    let pass = dir.join("pass");
    std::fs::write(&pass, b"sparse luks2").unwrap();
    let img = dir.join("luks2.img");
    luks_format(
        &img,
        64 * MIB,
        &pass,
        "--type luks2 --cipher aes-xts-plain64 --key-size 512 --sector-size 512 --pbkdf pbkdf2 --pbkdf-force-iterations 1000",
    );
    // The payload's offset, from cryptsetup's own description.
    let dump = run(cryptsetup().arg("luksDump").arg(&img));
    let data_at: u64 = dump
        .lines()
        .skip_while(|l| !l.starts_with("Data segments:"))
        .find_map(|l| l.trim().strip_prefix("offset: "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no data offset in luksDump:\n{dump}"));
    assert_eq!(data_at % SECTOR, 0, "{dump}");
    (img, pass, data_at)
}

/// `model` written to a `payload`-byte export in 1 MiB pieces, then the
/// `trims` (zeroing the 512-byte sectors inside in `model`), then read
/// back.
fn write_then_trim(srv: &Served, model: &mut [u8], trims: &[(u64, u64)], payload: u64) {
    let mut c = raw::Client::connect(&srv.sock);
    assert_eq!(c.size, payload);
    for (i, chunk) in model.chunks(MIB as usize).enumerate() {
        c.write(i as u64 * MIB, chunk);
    }
    for &(off, len) in trims {
        c.ok(raw::CMD_TRIM, 0, off, len as u32);
        let (s, e) = inward(off, len, 512);
        model[s as usize..e as usize].fill(0);
    }
    assert_same("read back", &c.read(0, model.len() as u64), model);
    drop(c);
}

/// `img` served again read-only: the same map (`want`) and contents
/// (`model`, zeros after it), and TRIM refused.
fn read_only_keeps_the_map_and_refuses_trim(
    dir: &Dir,
    img: &Path,
    pass: &Path,
    want: &[Extent],
    model: &[u8],
    payload: u64,
) {
    let ro = Served::on_image(dir, "ro", img, pass, &["--allow-discards", "--read-only"]);
    assert_eq!(ro.nbdinfo_map(), want, "the map, read-only");
    let mut c = raw::Client::connect(&ro.sock);
    let written = model.len() as u64;
    assert_same("read back read-only", &c.read(0, written), model);
    assert!(c.read(written, payload - written).iter().all(|&b| b == 0));
    let (e, _) = c.request(raw::CMD_TRIM, 0, 0, MIB as u32, &[]);
    assert_eq!(e, raw::EPERM, "TRIM on a read-only export");
    drop(c);
    ro.stop();
}

/// Offline: the header is cryptsetup's (`header`), byte for byte, and
/// still opens; the image's own holes are where the map (`want`) said,
/// and the ciphertext of each of the `trims` is zeros.
fn offline_image_has_the_header_and_the_holes(
    img: &Path,
    pass: &Path,
    data_at: u64,
    header: &[u8],
    want: &[Extent],
    trims: &[(u64, u64)],
) {
    let image = std::fs::read(img).unwrap();
    assert!(
        image[..data_at as usize] == header[..],
        "the header changed"
    );
    run(cryptsetup().arg("luksDump").arg(img));
    run(cryptsetup()
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(pass)
        .arg(img));
    let f = std::fs::File::open(img).unwrap();
    let in_file: Vec<(u64, u64)> = file_data(&f, data_at, 64 * MIB)
        .into_iter()
        .map(|(s, e)| (s - data_at, e - data_at))
        .collect();
    let payload = 64 * MIB - data_at;
    assert_eq!(expected_map(payload, &in_file), want, "the image's holes");
    for &(off, len) in trims {
        let (s, e) = inward(off, len, 512);
        let at = (data_at + s) as usize..(data_at + e) as usize;
        assert!(
            image[at].iter().all(|&b| b == 0),
            "the ciphertext of {off} +{len} is zeros"
        );
    }
}

/// The offline reader (`iopages luks decrypt`) agrees on everything
/// written and not discarded (`model`).
fn offline_decrypt_agrees(dir: &Dir, img: &Path, pass: &Path, model: &[u8], payload: u64) {
    let plain = dir.join("plain.raw");
    run(Command::new(BIN)
        .args(["luks", "decrypt", "--yes"])
        .arg(img)
        .arg(&plain)
        .arg("--passphrase-file")
        .arg(pass));
    let offline = std::fs::read(&plain).unwrap();
    assert_eq!(offline.len() as u64, payload);
    let mut kept = 0;
    for (s, e) in data_sectors(model, 512) {
        assert_same(
            &format!("offline {s}..{e}"),
            &offline[s as usize..e as usize],
            &model[s as usize..e as usize],
        );
        kept += e - s;
    }
    assert!(kept > 20 * MIB, "{kept}");
}

#[test]
fn a_cryptsetup_luks2_image_keeps_its_header_and_data_and_gets_holes_where_discarded() {
    if !tools(&["cryptsetup", "nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = Dir::new("luks2");
    let (img, pass, data_at) = luks2_image(&dir);
    let payload = 64 * MIB - data_at;
    let header = std::fs::read(&img).unwrap()[..data_at as usize].to_vec();
    let srv = Served::on_image(&dir, "s", &img, &pass, &["--allow-discards"]);
    assert!(
        srv.banner
            .iter()
            .any(|l| l.contains("LUKS2 aes-xts-plain64, 512-bit key, 512-byte sectors")),
        "{:?}",
        srv.banner
    );
    let fresh = vec![Extent {
        offset: 0,
        length: payload,
        flags: HOLE_ZERO,
    }];
    assert_eq!(srv.nbdinfo_map(), fresh, "cryptsetup's sparse image, fresh");
    let written = 32 * MIB;
    let mut model = pattern(0x1f, written as usize);
    // Sector (512) aligned and not file-system block aligned, misaligned
    // at both ends, aligned.
    let trims = [
        (4 * MIB, 4 * MIB),
        (12 * MIB + 512, MIB),
        (20 * MIB + 100, 2 * MIB),
        (30 * MIB - 700, 1500),
    ];
    write_then_trim(&srv, &mut model, &trims, payload);
    srv.qemu_io(&[
        format!("read -P 0 {} {}", 12 * MIB + 512, MIB),
        format!("read -P 0 {} 512", 30 * MIB - 512),
    ]);
    // Holes are the image file's: whole 4096-byte blocks of the punched
    // sectors (the partial blocks are zeroed, not freed), rounded to
    // whole sectors; the never written tail is one too.
    let holes = [
        (4 * MIB, 8 * MIB),
        (12 * MIB + SECTOR, 13 * MIB),
        (20 * MIB + SECTOR, 22 * MIB),
    ];
    let want = expected_map(payload, &cut(&[(0, written)], &holes));
    assert_eq!(srv.nbdinfo_map(), want, "the map after the trims");
    let line = srv.stop();
    let punched: u64 = trims
        .iter()
        .map(|&(o, l)| {
            let (s, e) = inward(o, l, 512);
            e - s
        })
        .sum();
    assert_eq!(discard_counters(&line).1, punched >> 20, "{line}");
    read_only_keeps_the_map_and_refuses_trim(&dir, &img, &pass, &want, &model, payload);
    offline_image_has_the_header_and_the_holes(&img, &pass, data_at, &header, &want, &trims);
    offline_decrypt_agrees(&dir, &img, &pass, &model, payload);
}

#[test]
fn a_luks1_payload_off_the_file_system_blocks_maps_the_files_holes_in_whole_sectors() {
    if !tools(&["cryptsetup", "nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = Dir::new("luks1");
    let pass = dir.join("pass");
    std::fs::write(&pass, b"sparse luks1").unwrap();
    let img = dir.join("luks1.img");
    // The payload 512 bytes past a 4096-byte block: every hole of the
    // file is off the volume's 4096-byte boundaries.
    luks_format(
        &img,
        32 * MIB,
        &pass,
        "--type luks1 --align-payload 4097 --hash sha256 --pbkdf-force-iterations 1000",
    );
    let data_at = 4097 * 512;
    let payload = 32 * MIB - data_at;
    let srv = Served::on_image(&dir, "s", &img, &pass, &["--allow-discards"]);
    assert!(
        srv.banner
            .iter()
            .any(|l| l.contains(&format!("at offset {data_at}"))),
        "{:?}",
        srv.banner
    );
    // The image's data extents in payload bytes, each grown to whole
    // sectors (so its holes shrink to them).
    let file_map = || {
        let f = std::fs::File::open(&img).unwrap();
        let d: Vec<(u64, u64)> = file_data(&f, data_at, 32 * MIB)
            .into_iter()
            .map(|(s, e)| outward(s - data_at, e - s, 512))
            .collect();
        expected_map(payload, &d)
    };
    assert_eq!(srv.nbdinfo_map(), file_map(), "fresh");
    let mut model = pattern(0x2b, 8 * MIB as usize);
    let mut c = raw::Client::connect(&srv.sock);
    for (i, chunk) in model.chunks(MIB as usize).enumerate() {
        c.write(i as u64 * MIB, chunk);
    }
    for (off, len) in [(MIB, 2 * MIB), (5 * MIB + 700, 300 << 10)] {
        c.ok(raw::CMD_TRIM, 0, off, len as u32);
        let (s, e) = inward(off, len, 512);
        model[s as usize..e as usize].fill(0);
    }
    assert_same("read back", &c.read(0, 8 * MIB), &model);
    drop(c);
    srv.qemu_io(&[format!("read -P 0 {MIB} {}", 2 * MIB)]);
    let map = srv.nbdinfo_map();
    assert_eq!(map, file_map(), "after the trims");
    // Each trimmed range holds a hole: its 4096-byte file blocks less the
    // 512 bytes the payload is off them.
    for (s, e) in [
        (MIB + SECTOR - 512, 3 * MIB - 512),
        (5 * MIB + SECTOR - 512, 5 * MIB + (300 << 10) - 512),
    ] {
        assert!(
            map.iter()
                .any(|x| x.flags == HOLE_ZERO && x.offset == s && x.offset + x.length == e),
            "a hole at {s}..{e}: {map:?}"
        );
    }
    srv.stop();
}

/// A volume's expected content and which of its 4096-byte blocks (the
/// file system's, or the memfd's pages) hold data.
struct Model {
    bytes: Vec<u8>,
    allocated: Vec<bool>,
}

impl Model {
    /// Bytes `[s, e)` written: allocated in every block they touch.
    fn write(&mut self, s: u64, data: &[u8]) {
        self.bytes[s as usize..s as usize + data.len()].copy_from_slice(data);
        let (a, b) = outward(s, data.len() as u64, SECTOR);
        self.allocated[(a / SECTOR) as usize..(b / SECTOR) as usize].fill(true);
    }

    /// Bytes `[s, e)` punched: zeros, and the blocks wholly inside freed.
    fn punch(&mut self, s: u64, e: u64) {
        self.bytes[s as usize..e as usize].fill(0);
        let (a, b) = inward(s, e - s, SECTOR);
        self.allocated[(a / SECTOR) as usize..(b / SECTOR) as usize].fill(false);
    }

    fn map(&self) -> Vec<Extent> {
        let data: Vec<(u64, u64)> = (0..self.allocated.len() as u64)
            .filter(|&i| self.allocated[i as usize])
            .map(|i| (i * SECTOR, (i + 1) * SECTOR))
            .collect();
        expected_map(self.bytes.len() as u64, &data)
    }
}

/// Random writes, TRIMs (any bytes), WRITE_ZEROES (every flag mix) and
/// reads on `srv`'s volume of `sector`-byte sectors against a model; the
/// map at the end must be the model's.
fn random_ops(srv: &Served, sector: u64, seed: u32) {
    let mut c = raw::Client::connect(&srv.sock);
    let size = c.size;
    let mut m = Model {
        bytes: vec![0; size as usize],
        allocated: vec![false; (size / SECTOR) as usize],
    };
    assert_eq!(srv.nbdinfo_map(), m.map(), "fresh");
    let mut x = seed | 1;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        u64::from(x) % n
    };
    for i in 0..300 {
        let sectors = size / sector;
        let at = next(sectors);
        let n = (1 + next(64)).min(sectors - at);
        let (off, len) = (at * sector, n * sector);
        match next(4) {
            0 => {
                let data = pattern(seed ^ i, len as usize);
                c.write(off, &data);
                m.write(off, &data);
            }
            1 => {
                // Any bytes: the whole sectors inside are punched.
                let off = next(size - 1);
                let len = 1 + next((size - off).min(300_000));
                c.ok(raw::CMD_TRIM, 0, off, len as u32);
                let (s, e) = inward(off, len, sector);
                if s < e {
                    m.punch(s, e);
                }
            }
            2 => {
                let flags = [
                    0,
                    raw::FLAG_NO_HOLE,
                    raw::FLAG_FAST_ZERO,
                    raw::FLAG_NO_HOLE | raw::FLAG_FAST_ZERO,
                ][next(4) as usize];
                let (e, _) = c.request(raw::CMD_WRITE_ZEROES, flags, off, len as u32, &[]);
                if flags == raw::FLAG_NO_HOLE | raw::FLAG_FAST_ZERO {
                    assert_eq!(e, raw::ENOTSUP, "op {i}");
                } else if flags & raw::FLAG_NO_HOLE != 0 {
                    assert_eq!(e, 0, "op {i}");
                    m.write(off, &vec![0; len as usize]);
                } else {
                    assert_eq!(e, 0, "op {i}");
                    m.punch(off, off + len);
                }
            }
            _ => assert_same(
                &format!("op {i}: read {off} +{len}"),
                &c.read(off, len),
                &m.bytes[off as usize..(off + len) as usize],
            ),
        }
    }
    assert_same("the whole volume", &c.read(0, size), &m.bytes);
    drop(c);
    let want = m.map();
    assert!(want.len() > 10, "holes and data: {want:?}");
    assert_eq!(srv.nbdinfo_map(), want, "the map after the random ops");
}

#[test]
fn random_writes_trims_and_zeroes_match_a_model_in_memory_and_in_a_file_direct_and_buffered() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let dir = Dir::new("random");
    let srv = Served::start(&dir, "mem", &["--size", "16M", "--allow-discards"]);
    random_ops(&srv, SECTOR, 11);
    srv.stop();
    let pass = dir.join("pass");
    std::fs::write(&pass, b"random ops").unwrap();
    for (i, io) in ["direct", "buffered"].into_iter().enumerate() {
        let img = dir.join(&format!("{io}.img"));
        luks_image(&img, "16M", &pass);
        let srv = Served::on_image(&dir, io, &img, &pass, &["--allow-discards", "--io", io]);
        random_ops(&srv, 512, 12 + i as u32);
        srv.stop();
    }
}

/// Four connections at once, each owning every fourth sector of a 4 MiB
/// volume of `sector`-byte sectors: single-sector writes, TRIMs and
/// WRITE_ZEROES (punching or not), so neighbours in one 4096-byte block
/// are written and punched concurrently. Each checks its own sectors as
/// it goes; at the end the volume must be the four models interleaved.
fn concurrent_neighbours(srv: &Served, sector: u64) {
    let size = 4 * MIB;
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let sock = srv.sock.clone();
            std::thread::spawn(move || {
                let mut c = raw::Client::connect(&sock);
                let mut model = vec![0u8; size as usize];
                let mut x = 77 + t as u32;
                let mut next = |n: u64| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    u64::from(x) % n
                };
                for i in 0..1500u32 {
                    let off = (next(size / sector / 4) * 4 + t) * sector;
                    let r = off as usize..(off + sector) as usize;
                    match next(3) {
                        0 => {
                            let d = pattern(i * 4 + t as u32 + 1, sector as usize);
                            c.write(off, &d);
                            model[r].copy_from_slice(&d);
                        }
                        1 => {
                            c.ok(raw::CMD_TRIM, 0, off, sector as u32);
                            model[r].fill(0);
                        }
                        _ => {
                            let f = [0, raw::FLAG_NO_HOLE][next(2) as usize];
                            c.ok(raw::CMD_WRITE_ZEROES, f, off, sector as u32);
                            model[r].fill(0);
                        }
                    }
                    if i % 16 == 0 {
                        let r = off as usize..(off + sector) as usize;
                        assert!(c.read(off, sector) == model[r], "connection {t}, op {i}");
                    }
                }
                model
            })
        })
        .collect();
    let mut want = vec![0u8; size as usize];
    for (t, w) in workers.into_iter().enumerate() {
        let model = w.join().expect("a connection's checks");
        for s in (t as u64..size / sector).step_by(4) {
            let r = (s * sector) as usize..((s + 1) * sector) as usize;
            want[r.clone()].copy_from_slice(&model[r]);
        }
    }
    let mut c = raw::Client::connect(&srv.sock);
    assert_same("the interleaved sectors", &c.read(0, size), &want);
}

#[test]
fn concurrent_writes_and_punches_of_neighbouring_sectors_keep_each_others_data() {
    let dir = Dir::new("neighbours");
    let srv = Served::start(&dir, "mem", &["--size", "4M", "--allow-discards"]);
    concurrent_neighbours(&srv, SECTOR);
    srv.stop();
    let pass = dir.join("pass");
    std::fs::write(&pass, b"neighbours").unwrap();
    for io in ["direct", "buffered"] {
        let img = dir.join(&format!("{io}.img"));
        luks_image(&img, "4M", &pass);
        let srv = Served::on_image(&dir, io, &img, &pass, &["--allow-discards", "--io", io]);
        concurrent_neighbours(&srv, 512);
        srv.stop();
    }
}

#[test]
fn qemu_img_convert_into_a_used_volume_leaves_holes_where_the_source_has_them() {
    if !tools(&["nbdinfo", "nbdcopy", "qemu-img", "qemu-io"]) {
        return;
    }
    let dir = Dir::new("convert-in");
    let size = 32 * MIB;
    let srv = Served::start(&dir, "s", &["--size", "32M", "--allow-discards"]);
    srv.qemu_io(&[format!("write -P 0xab 0 {size}")]);
    // A sparse source of the volume's size with two regions of data.
    let src = dir.join("src.raw");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(size).unwrap();
    let regions = [(3 * MIB, 3 * MIB + 40960), (20 * MIB, 22 * MIB)];
    for (i, &(s, e)) in regions.iter().enumerate() {
        use std::os::unix::fs::FileExt;
        f.write_all_at(&pattern(i as u32 + 40, (e - s) as usize), s)
            .unwrap();
    }
    drop(f);
    // -n: the volume is there, and not known to be zeros.
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&srv.uri));
    assert_eq!(srv.nbdinfo_map(), expected_map(size, &regions));
    let back = dir.join("back.raw");
    run(Command::new("nbdcopy").arg(&srv.uri).arg(&back));
    assert_same(
        "the volume after the convert",
        &std::fs::read(&back).unwrap(),
        &std::fs::read(&src).unwrap(),
    );
    let line = srv.stop();
    let (_, _, _, punched, _) = discard_counters(&line);
    assert!(
        punched >= 29,
        "qemu-img zeroed the rest by punching: {line}"
    );
}

#[test]
fn zeros_written_with_no_hole_are_encrypted_and_read_as_zeros_without_allow_discards() {
    let dir = Dir::new("nohole");
    let pass = dir.join("pass");
    std::fs::write(&pass, b"no hole").unwrap();
    let img = dir.join("v.img");
    luks_image(&img, "8M", &pass);
    let data_at = std::fs::metadata(&img).unwrap().len() - 8 * MIB;
    let serve = |name: &str, discards: bool| {
        let args: &[&str] = if discards { &["--allow-discards"] } else { &[] };
        Served::on_image(&dir, name, &img, &pass, args)
    };
    let srv = serve("on", true);
    let mut c = raw::Client::connect(&srv.sock);
    let data = pattern(0x77, 4 * MIB as usize);
    c.write(0, &data);
    // NO_HOLE: encrypted zeros; without: a punch; and a TRIM.
    c.ok(raw::CMD_WRITE_ZEROES, raw::FLAG_NO_HOLE, MIB, MIB as u32);
    c.ok(raw::CMD_WRITE_ZEROES, 0, 2 * MIB, MIB as u32);
    c.ok(raw::CMD_TRIM, 0, 3 * MIB, MIB as u32);
    assert!(c.read(MIB, 3 * MIB).iter().all(|&b| b == 0));
    drop(c);
    srv.stop();
    let image = std::fs::read(&img).unwrap();
    let cipher = |m: u64| &image[(data_at + m * MIB) as usize..(data_at + (m + 1) * MIB) as usize];
    assert!(
        cipher(1).chunks(512).all(|s| s.iter().any(|&b| b != 0)),
        "every sector zeroed with NO_HOLE has ciphertext"
    );
    assert!(cipher(2).iter().chain(cipher(3)).all(|&b| b == 0));
    // Without the flag: the encrypted zeros still read as zeros, and the
    // punched sectors decrypt as any other ciphertext (not as zeros).
    let srv = serve("off", false);
    let mut c = raw::Client::connect(&srv.sock);
    assert!(c.read(0, MIB) == data[..MIB as usize], "the data");
    assert!(c.read(MIB, MIB).iter().all(|&b| b == 0), "NO_HOLE zeros");
    for m in [2, 3] {
        let got = c.read(m * MIB, MIB);
        assert!(
            got.chunks(512).all(|s| s.iter().any(|&b| b != 0)),
            "a punched sector at {m} MiB reads as zeros without --allow-discards"
        );
    }
    drop(c);
    srv.stop();
}
