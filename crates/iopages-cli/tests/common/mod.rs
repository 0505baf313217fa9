//! Helpers shared by the CLI's integration tests (`mod common;` in each):
//! finding the tools a test needs, running commands, a temporary
//! directory, test data, and starting and stopping an `iopages serve`
//! process (its stdout lines, its banner up to `statistics:`, SIGTERM).
//! Not every test file uses every helper. Tools, directories and child
//! processes come from `iopages-testkit` (shared with the other crates'
//! tests and the benchmarks).
#![allow(dead_code)]

use iopages_testkit::TempDir;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[allow(unused_imports)]
pub use iopages_testkit::lines_of;

pub const BIN: &str = env!("CARGO_BIN_EXE_iopages");

/// Whether `tool` is installed; says so when it is not, and fails under
/// `CI=true`, where scripts/setup-debian.sh has installed them all (the
/// one rule, `iopages_testkit::need_tool`).
pub fn have(tool: &str) -> bool {
    iopages_testkit::need_tool(tool, env!("CARGO_CRATE_NAME")).is_some()
}

/// Every tool in `list` (each one checked, so each missing one is named).
pub fn tools(list: &[&str]) -> bool {
    list.iter().all(|t| have(t))
}

/// `out`, what `cmd` gave, must be a success; its stdout.
pub fn succeeded(cmd: &Command, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run `cmd` (stdin empty); it must succeed; its stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    succeeded(cmd, &out)
}

/// A command for cryptsetup (found on `PATH` or in the sbin directories).
pub fn cryptsetup() -> Command {
    Command::new(iopages_testkit::find_tool("cryptsetup").expect("cryptsetup"))
}

/// A new file `img` of `size` bytes, then `cryptsetup luksFormat
/// --batch-mode ARGS --key-file KEY IMG`, which must succeed: `args`,
/// split at white space, give the type, cipher, key size, PBKDF and its
/// cost.
pub fn luks_format(img: &Path, size: u64, key: &Path, args: &str) {
    std::fs::File::create(img).unwrap().set_len(size).unwrap();
    run(cryptsetup()
        .args(["luksFormat", "--batch-mode"])
        .args(args.split_whitespace())
        .arg("--key-file")
        .arg(key)
        .arg(img));
}

/// `iopages luks decrypt` of `img` into the file `out`, offline; its
/// bytes.
pub fn decrypt(img: &Path, pass: &Path, out: &Path) -> Vec<u8> {
    run(Command::new(BIN)
        .args(["luks", "decrypt", "--yes"])
        .arg(img)
        .arg(out)
        .arg("--passphrase-file")
        .arg(pass));
    std::fs::read(out).unwrap()
}

/// fio's nbd engine against `uri`: `size` of 4 KiB random writes with
/// checksums, read back and verified (no state file left behind); its
/// JSON report of the job.
pub fn fio_verify(uri: &str, size: &str) -> serde_json::Value {
    let out = run(Command::new("fio")
        .args(["--name=verify", "--ioengine=nbd", "--rw=randwrite"])
        .args(["--bs=4k", &format!("--size={size}"), "--iodepth=16"])
        .args(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1"])
        .args(["--verify_state_save=0", "--output-format=json"])
        .arg(format!("--uri={uri}")));
    let json_at = out.find('{').expect("fio printed JSON");
    let v: serde_json::Value = serde_json::from_str(&out[json_at..]).expect("fio's JSON");
    v["jobs"][0].clone()
}

/// A directory of its own under the temporary directory, removed when
/// dropped: `iopages-TESTFILE-TAG-PID-N`.
pub struct Dir(pub PathBuf, TempDir);

impl Dir {
    pub fn new(tag: &str) -> Dir {
        let t = TempDir::new(&format!("iopages-{}-{tag}", env!("CARGO_CRATE_NAME")));
        Dir(t.path().to_path_buf(), t)
    }
    pub fn join(&self, n: &str) -> PathBuf {
        self.0.join(n)
    }
}

/// Bytes that differ at every 512-byte sector.
pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// The banner `iopages serve` prints as it starts, up to and including its
/// `statistics:` line, each line also given to `seen`. Fails if the
/// process exits first (with its stderr, from the file `stderr`) or prints
/// no such line within 60 s.
pub fn wait_for_banner(
    child: &mut Child,
    lines: &mpsc::Receiver<String>,
    stderr: &Path,
    mut seen: impl FnMut(&str),
) -> Vec<String> {
    let stderr_text = || std::fs::read_to_string(stderr).unwrap_or_default();
    let mut banner = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match lines.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => {
                seen(&l);
                let done = l.starts_with("statistics:");
                banner.push(l);
                if done {
                    return banner;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some(st) = child.try_wait().unwrap() {
                    panic!("iopages serve exited ({st}): {}", stderr_text());
                }
                assert!(
                    Instant::now() < deadline,
                    "iopages serve did not start: {banner:?}"
                );
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let st = child.wait().unwrap();
                panic!("iopages serve exited ({st}): {}", stderr_text());
            }
        }
    }
}

/// SIGTERM to `child`, and its exit status once it has exited; fails if
/// it has not within 60 s (`what` names the server in that message).
pub fn sigterm_and_wait(child: &mut Child, what: &str) -> ExitStatus {
    iopages_testkit::signal(child, libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(Instant::now() < deadline, "{what} did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `iopages serve`, killed if the test fails before stopping
/// it: its stdout lines after the banner, the banner, the URI of its last
/// `serving` line (empty when none) and the file of its stderr.
pub struct Served {
    child: Option<Child>,
    pub lines: mpsc::Receiver<String>,
    pub uri: String,
    pub banner: Vec<String>,
    pub stderr: PathBuf,
}

/// `iopages serve`, to be given its arguments and started with
/// [`Served::spawn`].
pub fn serve_cmd() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("serve");
    cmd
}

/// `iopages serve` (64 MiB arena, `extra` arguments added) over the image
/// on the remote NBD store at `remote`, on the Unix socket `sock`, stderr
/// into the file `stderr`. Its banner must name the remote; its URI is
/// that of its export on `sock`.
pub fn serve_remote(
    remote: &str,
    pass: &Path,
    sock: &Path,
    stderr: &Path,
    extra: &[&str],
) -> Served {
    let mut cmd = serve_cmd();
    cmd.args(["--arena", "64M", "--image", remote, "--passphrase-file"])
        .arg(pass)
        .arg("--unix")
        .arg(sock)
        .args(extra);
    let mut srv = Served::spawn(cmd, stderr.to_path_buf(), |_| {});
    assert!(
        srv.banner
            .iter()
            .any(|l| l == &format!("image: {remote} (remote NBD export)")),
        "{:?}",
        srv.banner
    );
    srv.uri = format!("nbd+unix:///iopages?socket={}", sock.display());
    srv
}

/// A LUKS2 image made by cryptsetup (cheap PBKDF2, 4096-byte sectors) of
/// `size` bytes in all, `luks2.img` in `dir`, and its passphrase file.
pub fn luks2_by_cryptsetup(dir: &Dir, size: u64) -> (PathBuf, PathBuf) {
    let (img, pass) = (dir.join("luks2.img"), dir.join("pass"));
    std::fs::write(&pass, b"remote passphrase").unwrap();
    luks_format(
        &img,
        size,
        &pass,
        "--type luks2 --cipher aes-xts-plain64 --key-size 512 --sector-size 4096 --pbkdf pbkdf2 --pbkdf-force-iterations 1000",
    );
    (img, pass)
}

impl Served {
    /// Starts `cmd` (from [`serve_cmd`]) with its stderr into the file
    /// `stderr` and waits for its banner, each line also given to `seen`.
    pub fn spawn(mut cmd: Command, stderr: PathBuf, mut seen: impl FnMut(&str)) -> Served {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("iopages serve starts");
        let lines = lines_of(child.stdout.take().unwrap());
        let mut uri = String::new();
        let banner = wait_for_banner(&mut child, &lines, &stderr, |l| {
            if let Some(u) = l.strip_prefix("serving ") {
                uri = u.to_string();
            }
            seen(l);
        });
        Served {
            child: Some(child),
            lines,
            uri,
            banner,
            stderr,
        }
    }

    /// [`Served::spawn`] with `--metrics 127.0.0.1:0` added to `cmd`: the
    /// server and the metrics address its banner prints.
    pub fn spawn_with_metrics(mut cmd: Command, stderr: PathBuf) -> (Served, SocketAddr) {
        cmd.args(["--metrics", "127.0.0.1:0"]);
        let mut metrics = None;
        let srv = Served::spawn(cmd, stderr, |l| {
            if let Some(m) = l.strip_prefix("metrics: http://") {
                let addr = m.strip_suffix("/metrics").expect("…/metrics");
                metrics = Some(addr.parse().expect("a socket address"));
            }
        });
        let metrics = metrics.unwrap_or_else(|| panic!("no metrics line: {:?}", srv.banner));
        (srv, metrics)
    }

    /// What it has written to stderr so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// Its next stdout line, if one comes within `d`.
    pub fn line_within(&self, d: Duration) -> Option<String> {
        self.lines.recv_timeout(d).ok()
    }

    /// SIGTERM; its exit status and the lines it printed after the banner.
    pub fn terminate(mut self) -> (ExitStatus, Vec<String>) {
        let mut child = self.child.take().unwrap();
        let status = sigterm_and_wait(&mut child, "iopages serve");
        (status, self.lines.try_iter().collect())
    }

    /// SIGTERM, then the exit status must be success after a `stopped`
    /// line; returns the lines printed after the banner.
    pub fn stop(self) -> Vec<String> {
        let stderr = self.stderr.clone();
        let (status, rest) = self.terminate();
        assert!(
            status.success(),
            "iopages serve exited with {status}: {}\n{rest:?}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
        assert!(rest.iter().any(|l| l == "stopped"), "{rest:?}");
        rest
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A LUKS2 image of `size` payload bytes (sparse; cheap PBKDF2) made by
/// `iopages luks format` in `dir`, under the passphrase `pass` (written to
/// its own file): the image's and the passphrase file's paths.
pub fn luks2_image(dir: &Dir, name: &str, size: &str, pass: &[u8]) -> (PathBuf, PathBuf) {
    let img = dir.join(&format!("{name}.luks"));
    let pf = dir.join(&format!("{name}.pass"));
    std::fs::write(&pf, pass).unwrap();
    run(cheap_format(size)
        .arg("--passphrase-file")
        .arg(&pf)
        .arg(&img));
    (img, pf)
}

/// `iopages luks format --pbkdf pbkdf2 --iterations 1000 --size SIZE`:
/// the rest (passphrase, image, options) to add.
fn cheap_format(size: &str) -> Command {
    let mut c = Command::new(BIN);
    c.args([
        "luks",
        "format",
        "--pbkdf",
        "pbkdf2",
        "--iterations",
        "1000",
    ])
    .args(["--size", size]);
    c
}

/// An authenticated LUKS2 image of `size` bytes in all (`luks format
/// --integrity MAC`, cheap PBKDF2) in `dir` under the passphrase file
/// `pass`, and its freshness state file: the image's and the state's
/// paths, and what the command printed (the layout).
pub fn luks2_auth_image(
    dir: &Dir,
    name: &str,
    size: &str,
    pass: &Path,
    mac: &str,
) -> (PathBuf, PathBuf, String) {
    let img = dir.join(&format!("{name}.luks"));
    let state = dir.join(&format!("{name}.fresh"));
    let said = run(cheap_format(size)
        .args(["--integrity", mac, "--freshness"])
        .arg(&state)
        .arg("--passphrase-file")
        .arg(pass)
        .arg(&img));
    (img, state, said)
}

/// A `[[export]]` table of a `--config` file: `image` (a path or an NBD
/// URI), its passphrase file, a 64 MiB arena, and `extra` lines.
pub fn export_table(name: &str, image: &str, pass: &Path, extra: &str) -> String {
    format!(
        "[[export]]\nname = \"{name}\"\nimage = \"{image}\"\npassphrase-file = \"{}\"\narena = \"64M\"\n{extra}\n",
        pass.display()
    )
}

/// Send `request` whole and read the reply until the server closes:
/// the status code, the head and the body (`None`: closed without a
/// reply).
pub fn exchange(addr: SocketAddr, request: &[u8]) -> Option<(u16, String, String)> {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The server may close before taking it all (an oversized head).
    let _ = s.write_all(request);
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    let reply = String::from_utf8(reply).expect("a text reply");
    let (head, body) = reply.split_once("\r\n\r\n")?;
    let code = head.split(' ').nth(1)?.parse().ok()?;
    Some((code, head.to_string(), body.to_string()))
}

/// GET `path` from the HTTP endpoint at `addr`: status, head, body.
pub fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    exchange(addr, req.as_bytes()).unwrap_or_else(|| panic!("no reply to GET {path}"))
}

/// A `luksDump` report (cryptsetup's or `iopages luks dump`'s) as
/// `section/item/field → value`: hex continued on later lines joined,
/// white space collapsed. Two reports showing the same fields with the
/// same values give the same map.
pub fn dump_fields(text: &str) -> std::collections::BTreeMap<String, String> {
    let mut map = std::collections::BTreeMap::new();
    let (mut section, mut item, mut last) = (String::new(), String::new(), String::new());
    for l in text.lines() {
        let words = l.split_whitespace().collect::<Vec<_>>().join(" ");
        let Some((name, value)) = words.split_once(':') else {
            if l.starts_with(char::is_whitespace) && !last.is_empty() && !words.is_empty() {
                let v: &mut String = map.get_mut(&last).unwrap();
                v.push(' ');
                v.push_str(&words);
            }
            continue;
        };
        let (name, value) = (name.trim().to_string(), value.trim().to_string());
        let key = match (l.starts_with('\t'), l.starts_with("  ")) {
            (true, _) if item.is_empty() => format!("{section}/{name}"),
            (true, _) => format!("{section}/{item}/{name}"),
            (false, true) => {
                item = name.clone();
                format!("{section}/{name}")
            }
            (false, false) => {
                section = name.clone();
                item.clear();
                name
            }
        };
        map.insert(key.clone(), value);
        last = key;
    }
    map
}

/// An nbdkit child serving a plugin on a Unix socket, killed on drop.
pub struct NbdKit(Option<Child>);

impl NbdKit {
    /// nbdkit's `file` plugin over `file` on the Unix socket `sock`, up
    /// (nbdinfo reaches it) when this returns; its `nbd+unix://` URI.
    pub fn file(sock: &Path, file: &Path) -> (NbdKit, String) {
        let child = Command::new("nbdkit")
            .arg("-U")
            .arg(sock)
            .args(["--foreground", "--exit-with-parent", "file"])
            .arg(file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nbdkit starts");
        let kit = NbdKit(Some(child));
        let uri = format!("nbd+unix:///?socket={}", sock.display());
        let deadline = Instant::now() + Duration::from_secs(20);
        while !Command::new("nbdinfo")
            .args(["--size", &uri])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            assert!(Instant::now() < deadline, "nbdkit did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        (kit, uri)
    }

    /// Its process id (to stop it with SIGSTOP, say).
    pub fn pid(&self) -> i32 {
        self.0.as_ref().map_or(0, |c| c.id() as i32)
    }
}

impl Drop for NbdKit {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
