//! `iopages serve` under socket activation: listening sockets passed as
//! descriptors 3.. with `LISTEN_FDS` and `LISTEN_PID` (sd_listen_fds(3)).
//! Under systemd-socket-activate (skipped where it is not installed: it
//! comes with the whole `systemd` package, which scripts/setup-debian.sh
//! does not install), and by hand: a Unix and a TCP socket both served,
//! an explicit --unix beside them, sockets meant for another process
//! ignored, a bad `LISTEN_FDS`, a descriptor that is not a socket and a
//! plaintext socket off loopback refused clearly.

mod common;

use common::{sigterm_and_wait, wait_for_banner, Dir, BIN};
use iopages_testkit::nbd_client::Client;
use std::ffi::CString;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Who `LISTEN_PID` names.
#[derive(Clone, Copy)]
enum Pid {
    /// The child itself (set in the child, after the fork).
    Child,
    /// This test process: not the child, so the sockets are not its own.
    Other,
}

/// `iopages serve ARGS` with `fds` as its descriptors 3, 4, …,
/// `LISTEN_FDS=listen_fds` and `LISTEN_PID` as `pid` says.
fn spawn_activated(
    args: &[&str],
    fds: &[RawFd],
    listen_fds: &str,
    pid: Pid,
    stderr: &Path,
) -> Child {
    // Copies above the targets first (close-on-exec, owned here), so that
    // no dup2 below overwrites a source it has yet to copy.
    let high: Vec<OwnedFd> = fds
        .iter()
        .map(|&fd| {
            // SAFETY: F_DUPFD_CLOEXEC only duplicates fd, which the caller
            // keeps open for the call.
            let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100) };
            assert!(d >= 0, "dup: {}", std::io::Error::last_os_error());
            // SAFETY: d was just made by fcntl and is owned by nothing else.
            unsafe { OwnedFd::from_raw_fd(d) }
        })
        .collect();
    let sources: Vec<RawFd> = high.iter().map(|f| f.as_raw_fd()).collect();
    let mut cmd = Command::new(BIN);
    cmd.arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(stderr).unwrap());
    // The variables are set in the child itself, not with Command::env:
    // std installs a Command's own environment after the pre_exec
    // closures run, which would drop what they set.
    let c = |s: &str| CString::new(s).unwrap();
    let (k_pid, k_fds, k_names) = (c("LISTEN_PID"), c("LISTEN_FDS"), c("LISTEN_FDNAMES"));
    let v_fds = c(listen_fds);
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec. dup2
    // and getpid are async-signal-safe. setenv and unsetenv are not (they
    // may allocate), but the child of fork has a single thread, so no
    // other thread holds a lock they need (glibc makes malloc usable in
    // the child of fork). The pid must be the child's own, known only
    // after the fork — which is why the variables are set here.
    unsafe {
        cmd.pre_exec(move || {
            for (i, &src) in sources.iter().enumerate() {
                // dup2 leaves the copy without FD_CLOEXEC: it survives exec.
                if libc::dup2(src, 3 + i as RawFd) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            let mut buf = [0u8; 16];
            let pid = match pid {
                Pid::Child => libc::getpid() as u32,
                Pid::Other => parent,
            };
            let v_pid = decimal(pid, &mut buf);
            if libc::setenv(k_pid.as_ptr(), v_pid.as_ptr().cast(), 1) == -1
                || libc::setenv(k_fds.as_ptr(), v_fds.as_ptr(), 1) == -1
                || libc::unsetenv(k_names.as_ptr()) == -1
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().expect("iopages serve starts");
    drop(high);
    child
}

/// `n` in decimal, NUL-terminated, in `buf` (no allocation: used between
/// fork and exec).
fn decimal(mut n: u32, buf: &mut [u8; 16]) -> &[u8] {
    let mut i = buf.len() - 1;
    buf[i] = 0;
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

/// A started server: its banner, its stdout lines, its stderr file.
struct Started {
    child: Child,
    lines: mpsc::Receiver<String>,
    banner: Vec<String>,
    stderr: PathBuf,
}

impl Started {
    fn wait(mut child: Child, stderr: PathBuf) -> Started {
        let lines = common::lines_of(child.stdout.take().unwrap());
        let banner = wait_for_banner(&mut child, &lines, &stderr, |_| {});
        Started {
            child,
            lines,
            banner,
            stderr,
        }
    }

    /// The `serving …` lines of the banner.
    fn serving(&self) -> Vec<&str> {
        self.banner
            .iter()
            .filter_map(|l| l.strip_prefix("serving "))
            .collect()
    }

    /// SIGTERM; the exit must be a success with `stopped` printed.
    fn stop(mut self) {
        let status = sigterm_and_wait(&mut self.child, "iopages serve");
        let rest: Vec<String> =
            std::iter::from_fn(|| self.lines.recv_timeout(Duration::from_secs(10)).ok()).collect();
        assert!(
            status.success(),
            "iopages serve exited with {status}: {}\n{rest:?}",
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        );
        assert!(rest.iter().any(|l| l == "stopped"), "{rest:?}");
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether the server on `s` sends a fixed newstyle greeting (read by the
/// tests' one NBD client).
fn greeted(s: impl Read + Write) -> bool {
    Client::greet(s).is_ok()
}

/// A run that must fail before serving, its stderr.
fn fails(mut child: Child, stderr: &Path) -> String {
    let status = child.wait().unwrap();
    let err = std::fs::read_to_string(stderr).unwrap_or_default();
    assert!(!status.success(), "serve should fail: {err}");
    err
}

const SERVE: [&str; 4] = ["--size", "16M", "--arena", "128M"];

#[test]
fn inherited_unix_and_tcp_sockets_are_served_beside_an_explicit_unix_socket() {
    let d = Dir::new("byhand");
    let path = d.join("inherited.sock");
    let extra = d.join("extra.sock");
    let unix = UnixListener::bind(&path).unwrap();
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = tcp.local_addr().unwrap().port();
    let mut args = SERVE.to_vec();
    args.extend(["--unix", extra.to_str().unwrap()]);
    let child = spawn_activated(
        &args,
        &[unix.as_raw_fd(), tcp.as_raw_fd()],
        "2",
        Pid::Child,
        &d.join("stderr"),
    );
    let s = Started::wait(child, d.join("stderr"));
    let serving = s.serving();
    let want = [
        format!("nbd+unix:///iopages?socket={}", extra.display()),
        format!("nbd+unix:///iopages?socket={}", path.display()),
        format!("nbd://127.0.0.1:{port}/iopages"),
    ];
    assert_eq!(serving, want, "{:?}", s.banner);
    // Served: the greeting on each inherited socket (the test's own copies
    // are the same sockets), and on the explicit one.
    assert!(greeted(UnixStream::connect(&path).unwrap()));
    assert!(greeted(TcpStream::connect(("127.0.0.1", port)).unwrap()));
    assert!(greeted(UnixStream::connect(&extra).unwrap()));
    if common::have("nbdinfo") {
        for uri in &want {
            let out = Command::new("nbdinfo")
                .args(["--size", uri])
                .stdin(Stdio::null())
                .output()
                .unwrap();
            let so = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && so.trim() == (16u64 << 20).to_string(),
                "nbdinfo {uri}: {so}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    s.stop();
    // The socket it bound is gone; the one it was given is not its own to
    // remove.
    assert!(!extra.exists());
    assert!(path.exists());
}

#[test]
fn sockets_for_another_process_are_ignored() {
    let d = Dir::new("otherpid");
    let path = d.join("inherited.sock");
    let own = d.join("own.sock");
    let unix = UnixListener::bind(&path).unwrap();
    let mut args = SERVE.to_vec();
    args.extend(["--unix", own.to_str().unwrap()]);
    let child = spawn_activated(
        &args,
        &[unix.as_raw_fd()],
        "1",
        Pid::Other,
        &d.join("stderr"),
    );
    let s = Started::wait(child, d.join("stderr"));
    assert_eq!(
        s.serving(),
        [format!("nbd+unix:///iopages?socket={}", own.display())],
        "{:?}",
        s.banner
    );
    assert!(greeted(UnixStream::connect(&own).unwrap()));
    s.stop();
}

#[test]
fn a_bad_listen_fds_is_a_clear_error() {
    let d = Dir::new("badfds");
    let stderr = d.join("stderr");
    let child = spawn_activated(&SERVE, &[], "abc", Pid::Child, &stderr);
    let err = fails(child, &stderr);
    assert!(err.contains("LISTEN_FDS=\"abc\" is not a number"), "{err}");
    let child = spawn_activated(&SERVE, &[], "65", Pid::Child, &stderr);
    let err = fails(child, &stderr);
    assert!(err.contains("more than 64"), "{err}");
}

#[test]
fn a_descriptor_that_is_not_a_listening_socket_is_named() {
    let d = Dir::new("notsock");
    let stderr = d.join("stderr");
    let file = std::fs::File::open("/dev/null").unwrap();
    let unix = UnixListener::bind(d.join("ok.sock")).unwrap();
    let child = spawn_activated(
        &SERVE,
        &[unix.as_raw_fd(), file.as_raw_fd()],
        "2",
        Pid::Child,
        &stderr,
    );
    let err = fails(child, &stderr);
    assert!(
        err.contains("socket-activation fd 4: not a socket"),
        "{err}"
    );
    let (a, _b) = UnixStream::pair().unwrap();
    let child = spawn_activated(&SERVE, &[a.as_raw_fd()], "1", Pid::Child, &stderr);
    let err = fails(child, &stderr);
    assert!(
        err.contains("fd 3: a socket that is not listening"),
        "{err}"
    );
}

#[test]
fn an_inherited_tcp_socket_off_loopback_needs_tls_or_allow_plaintext() {
    let d = Dir::new("plain");
    let stderr = d.join("stderr");
    let tcp = TcpListener::bind("0.0.0.0:0").unwrap();
    let child = spawn_activated(&SERVE, &[tcp.as_raw_fd()], "1", Pid::Child, &stderr);
    let err = fails(child, &stderr);
    assert!(err.contains("is not a loopback address"), "{err}");
}

#[test]
fn under_systemd_socket_activate() {
    // Not in scripts/setup-debian.sh (it comes with the whole systemd
    // package): a skip wherever it is missing, CI included.
    let Some(tool) = iopages_testkit::find_tool("systemd-socket-activate") else {
        eprintln!("skipped under_systemd_socket_activate: systemd-socket-activate is not installed (Debian's systemd package)");
        return;
    };
    if !common::have("nbdinfo") {
        return;
    }
    let d = Dir::new("sd");
    let sock = d.join("nbd.sock");
    let stderr = d.join("stderr");
    let mut cmd = Command::new(tool);
    cmd.arg("-l")
        .arg(&sock)
        .arg(BIN)
        .arg("serve")
        .args(SERVE)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).unwrap());
    iopages_testkit::die_with_parent(&mut cmd, libc::SIGKILL);
    let mut child = cmd.spawn().unwrap();
    // It listens first, and execs iopages (in its own process: no
    // --accept) on the first connection, which waits in the backlog.
    let alive = |c: &mut Child| match c.try_wait().unwrap() {
        Some(st) => Err(format!(
            "systemd-socket-activate exited ({st}): {}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        )),
        None => Ok(()),
    };
    let waited =
        iopages_testkit::wait_for_socket(&sock, Duration::from_secs(30), || alive(&mut child));
    if let Err(e) = waited {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{e}");
    }
    // wait_for_socket's own connection started iopages already.
    let uri = format!("nbd+unix:///iopages?socket={}", sock.display());
    let out = Command::new("nbdinfo")
        .args(["--size", &uri])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let s = Started::wait(child, stderr.clone());
    assert!(
        out.status.success() && so.trim() == (16u64 << 20).to_string(),
        "nbdinfo {uri}: {so}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(s.serving(), [uri.as_str()], "{:?}", s.banner);
    s.stop();
    // systemd-socket-activate bound it: left in place.
    assert!(sock.exists());
}
