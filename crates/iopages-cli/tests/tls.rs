//! `iopages serve --tls` (NBD's STARTTLS) against the TLS clients people
//! use: libnbd (nbdinfo, nbdcopy), qemu-img and nbdkit's nbd plugin as a
//! client, each with X.509 certificates and with pre-shared keys; and each
//! shown refusing, or being refused, with the wrong key, a CA that did not
//! sign the server's certificate, no client certificate where the server
//! checks them, or no TLS at all.
//!
//! Every server is a real `iopages serve` process on a Unix socket (and on
//! 127.0.0.1 where a client only checks the server's certificate over TCP:
//! libnbd checks the server's certificate only when it has a host name to
//! check it against), stopped with SIGTERM. The certificates are made for
//! each test (`iopages_bench::nbd::write_pki`): nothing secret is committed.
//! Where a tool is missing the test says so and returns, except under
//! `CI=true`, where scripts/setup-debian.sh has installed them all and a
//! missing one fails.
//!
//! `IOPAGES_TLS_TEST_SERVER=nbdkit` runs the same client command lines
//! against `nbdkit memory` with the equivalent TLS flags instead: a check of
//! the clients' side independent of ours.

mod common;

use common::{have, pattern, sigterm_and_wait, succeeded, wait_for_banner, Dir, BIN};
use iopages_bench::nbd::{write_pki, write_psk, Pki};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
/// The export's name (nbdkit serves any name it is asked for).
const EXPORT: &str = "iopages";
/// The in-memory volume's size.
const SIZE: &str = "32M";
const SIZE_BYTES: usize = 32 << 20;
/// The PSK identity.
const USER: &str = "alice";
/// No client may take longer than this.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// Every tool in `list`, and nbdkit when it stands in for our server.
fn tools(list: &[&str]) -> bool {
    common::tools(list) && (kind() == Kind::Iopages || have("nbdkit"))
}

/// Run `cmd` to its end (killed after `CLIENT_TIMEOUT`).
fn exec(cmd: &mut Command) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let (out, err) = (read(Box::new(out)), read(Box::new(err)));
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish in {CLIENT_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// `cmd` must succeed; its stdout.
fn run(cmd: &mut Command) -> String {
    let out = exec(cmd);
    succeeded(cmd, &out)
}

/// `cmd` must fail; its stdout and stderr together.
fn refused(cmd: &mut Command) -> String {
    let out = exec(cmd);
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{cmd:?} must fail, but:\n{text}");
    text
}

/// Which server the clients talk to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Iopages,
    Nbdkit,
}

fn kind() -> Kind {
    match std::env::var("IOPAGES_TLS_TEST_SERVER").as_deref() {
        Ok("nbdkit") => Kind::Nbdkit,
        _ => Kind::Iopages,
    }
}

/// The server's TLS credentials.
enum Creds<'a> {
    /// `--tls-certificates DIR`.
    X509(&'a Path),
    /// `--tls-psk FILE`.
    Psk(&'a Path),
}

/// How the server is started.
struct Tls<'a> {
    /// `on` or `require`.
    mode: &'a str,
    creds: Creds<'a>,
    verify_peer: bool,
    /// Also listen on 127.0.0.1 (a free port).
    tcp: bool,
}

/// A running TLS server; killed if the test fails before stopping it.
struct Served {
    kind: Kind,
    child: Option<Child>,
    /// nbdkit's on 127.0.0.1, when it stands in for ours.
    tcp_child: Option<Child>,
    lines: Option<mpsc::Receiver<String>>,
    /// `nbds+unix:///iopages?socket=PATH`, as the server printed it.
    uri: String,
    sock: PathBuf,
    /// `127.0.0.1:PORT` with `Tls::tcp`.
    tcp: Option<String>,
    stderr: PathBuf,
}

impl Served {
    fn start(dir: &Dir, tls: &Tls) -> Served {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sock = dir.join(&format!("serve-{n}.sock"));
        let stderr = dir.join(&format!("serve-{n}.err"));
        match kind() {
            Kind::Iopages => Self::start_iopages(tls, sock, stderr),
            Kind::Nbdkit => Self::start_nbdkit(tls, sock, stderr),
        }
    }

    /// `iopages serve` of the in-memory volume with `tls`'s flags, on
    /// `sock` (and 127.0.0.1 with `Tls::tcp`), its standard error to
    /// `stderr`.
    fn iopages_cmd(tls: &Tls, sock: &Path, stderr: &Path) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .args(["--size", SIZE, "--arena", "128M", "--name", EXPORT])
            .arg("--unix")
            .arg(sock)
            .args(["--tls", tls.mode]);
        if tls.tcp {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        match tls.creds {
            Creds::X509(d) => cmd.arg("--tls-certificates").arg(d),
            Creds::Psk(f) => cmd.arg("--tls-psk").arg(f),
        };
        if tls.verify_peer {
            cmd.arg("--tls-verify-peer");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(stderr).unwrap());
        cmd
    }

    fn start_iopages(tls: &Tls, sock: PathBuf, stderr: PathBuf) -> Served {
        let mut child = Self::iopages_cmd(tls, &sock, &stderr)
            .spawn()
            .expect("iopages serve starts");
        let lines = common::lines_of(child.stdout.take().unwrap());
        let mut s = Served {
            kind: Kind::Iopages,
            child: Some(child),
            tcp_child: None,
            lines: Some(lines),
            uri: String::new(),
            sock,
            tcp: None,
            stderr,
        };
        let (mut uri, mut tcp) = (String::new(), None);
        let banner = wait_for_banner(
            s.child.as_mut().unwrap(),
            s.lines.as_ref().unwrap(),
            &s.stderr,
            |l| {
                if let Some(u) = l.strip_prefix("serving ") {
                    if u.starts_with("nbds+unix:") || u.starts_with("nbd+unix:") {
                        uri = u.to_string();
                    } else if let Some(rest) = u
                        .strip_prefix("nbds://")
                        .or_else(|| u.strip_prefix("nbd://"))
                    {
                        tcp = rest.split('/').next().map(str::to_string);
                    }
                }
            },
        );
        (s.uri, s.tcp) = (uri, tcp);
        s.check_printed_uris(tls, &banner);
        s
    }

    /// The URIs `iopages serve` printed are those of `tls`'s mode: on the
    /// socket `nbds+unix://` (or with TLS only offered, `nbd+unix://`,
    /// kept as `nbds+unix://`), and with `Tls::tcp` on 127.0.0.1.
    fn check_printed_uris(&mut self, tls: &Tls, banner: &[String]) {
        let want = format!("nbds+unix:///{EXPORT}?socket={}", self.sock.display());
        if tls.mode == "require" {
            assert_eq!(self.uri, want, "the TLS URI is printed: {banner:?}");
        } else {
            // TLS offered: either URI reaches the export.
            assert!(
                self.uri == want || self.uri == want.replacen("nbds+", "nbd+", 1),
                "{banner:?}"
            );
            self.uri = want;
        }
        if tls.tcp {
            let addr = self.tcp.clone().unwrap_or_default();
            assert!(
                addr.starts_with("127.0.0.1:")
                    && banner
                        .iter()
                        .any(|l| l == &format!("serving nbds://{addr}/{EXPORT}")
                            || tls.mode != "require"
                                && l == &format!("serving nbd://{addr}/{EXPORT}")),
                "{banner:?}"
            );
        }
    }

    /// `nbdkit memory` with the TLS flags `iopages serve` was given. nbdkit
    /// listens on one socket only: with `Tls::tcp` a second one serves
    /// 127.0.0.1 (its own memory: the TCP checks only connect).
    fn start_nbdkit(tls: &Tls, sock: PathBuf, stderr: PathBuf) -> Served {
        let nbdkit = |listen: &[String], err: &Path| {
            let mut cmd = Command::new("nbdkit");
            cmd.args(["--foreground", "--exit-with-parent"])
                .args(listen)
                .arg(format!("--tls={}", tls.mode));
            match tls.creds {
                Creds::X509(d) => cmd.arg(format!("--tls-certificates={}", d.display())),
                Creds::Psk(f) => cmd.arg(format!("--tls-psk={}", f.display())),
            };
            if tls.verify_peer {
                cmd.arg("--tls-verify-peer");
            }
            cmd.args(["memory", SIZE])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(err).unwrap());
            cmd.spawn().expect("nbdkit starts")
        };
        let child = nbdkit(&["--unix".into(), sock.display().to_string()], &stderr);
        let (tcp, tcp_child) = if tls.tcp {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = l.local_addr().unwrap().port();
            drop(l);
            let c = nbdkit(
                &[
                    "-i".into(),
                    "127.0.0.1".into(),
                    "-p".into(),
                    port.to_string(),
                ],
                &stderr.with_extension("tcp.err"),
            );
            (Some(format!("127.0.0.1:{port}")), Some(c))
        } else {
            (None, None)
        };
        let mut s = Served {
            kind: Kind::Nbdkit,
            child: Some(child),
            tcp_child,
            lines: None,
            uri: format!("nbds+unix:///{EXPORT}?socket={}", sock.display()),
            sock,
            tcp,
            stderr,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = s.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("nbdkit exited ({st}): {}", s.stderr_text());
            }
            let unix = std::os::unix::net::UnixStream::connect(&s.sock).is_ok();
            let tcp = s
                .tcp
                .as_ref()
                .is_none_or(|a| std::net::TcpStream::connect(a).is_ok());
            if unix && tcp {
                break;
            }
            assert!(Instant::now() < deadline, "nbdkit did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// libnbd's URI with an X.509 client directory.
    fn x509_uri(&self, client: &Path) -> String {
        format!("{}&tls-certificates={}", self.uri, client.display())
    }

    /// libnbd's URI with a PSK file; the identity is the URI's user (libnbd
    /// 1.14 has no `tls-username` query parameter; later ones take both).
    fn psk_uri(&self, psk: &Path) -> String {
        format!(
            "{}&tls-psk-file={}",
            self.uri
                .replacen("nbds+unix:///", &format!("nbds+unix://{USER}@/"), 1),
            psk.display()
        )
    }

    /// Over TCP to 127.0.0.1, where libnbd checks the server's certificate
    /// (IP SAN 127.0.0.1) against the client directory's CA.
    fn tcp_x509_uri(&self, client: &Path) -> String {
        format!(
            "nbds://{}/{EXPORT}?tls-certificates={}",
            self.tcp.as_deref().expect("started with tcp"),
            client.display()
        )
    }

    /// The same export without TLS.
    fn plaintext_uri(&self) -> String {
        format!("nbd+unix:///{EXPORT}?socket={}", self.sock.display())
    }

    /// qemu's `--image-opts` for the export, with `tls-creds=tls0` when
    /// `tls` (and `tls-hostname=localhost` for X.509: over a Unix socket
    /// qemu has no host name to check the certificate against otherwise).
    fn qemu_opts(&self, tls: Option<&str>) -> String {
        let mut o = format!(
            "driver=nbd,server.type=unix,server.path={},export={EXPORT}",
            self.sock.display().to_string().replace(',', ",,")
        );
        match tls {
            Some("x509") => o.push_str(",tls-creds=tls0,tls-hostname=localhost"),
            Some(_) => o.push_str(",tls-creds=tls0"),
            None => {}
        }
        o
    }

    /// SIGTERM; the exit status must be success (and ours says "stopped").
    fn stop(mut self) {
        let mut child = self.child.take().unwrap();
        let status = sigterm_and_wait(&mut child, "the server");
        assert!(
            status.success(),
            "the server exited with {status}: {}",
            self.stderr_text()
        );
        if self.kind == Kind::Iopages {
            // The reader thread sees the end of stdout once the process exits.
            let rest: Vec<String> = self.lines.as_ref().unwrap().iter().collect();
            assert!(rest.iter().any(|l| l == "stopped"), "{rest:?}");
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        for mut c in self.child.take().into_iter().chain(self.tcp_child.take()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The export's size by `nbdinfo --size URI`.
fn nbdinfo_size(uri: &str) -> u64 {
    run(Command::new("nbdinfo").arg("--size").arg(uri))
        .trim()
        .parse()
        .unwrap()
}

/// Write `data` through `uri` with nbdcopy, read the export back, compare.
fn nbdcopy_round_trip(dir: &Dir, uri: &str, seed: u32) {
    let data = pattern(seed, SIZE_BYTES);
    let src = dir.join(&format!("in-{seed}.raw"));
    let back = dir.join(&format!("out-{seed}.raw"));
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(uri));
    run(Command::new("nbdcopy").arg(uri).arg(&back));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbdcopy reads back what it wrote through TLS"
    );
}

/// A plaintext client is refused by a `--tls require` server, and says why.
fn plaintext_refused(srv: &Served) {
    let e = refused(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(srv.plaintext_uri()),
    );
    assert!(e.contains("TLS"), "nbdinfo names TLS as the reason: {e}");
}

fn qemu_x509(dir: &Path) -> String {
    format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        dir.display().to_string().replace(',', ",,")
    )
}

fn qemu_psk(dir: &Path) -> String {
    format!(
        "tls-creds-psk,id=tls0,dir={},username={USER},endpoint=client",
        dir.display().to_string().replace(',', ",,")
    )
}

/// qemu-img writes `data` into the export and converts it back to a file.
fn qemu_round_trip(dir: &Dir, object: &str, opts: &str, seed: u32) {
    let data = pattern(seed, SIZE_BYTES);
    let src = dir.join(&format!("qin-{seed}.raw"));
    let back = dir.join(&format!("qout-{seed}.raw"));
    std::fs::write(&src, &data).unwrap();
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw"])
        .arg(&src)
        .args(["--object", object, "--target-image-opts", opts]));
    run(Command::new("qemu-img")
        .args(["convert", "--object", object, "--image-opts", opts])
        .args(["-O", "raw"])
        .arg(&back));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "qemu-img reads back what it wrote through TLS"
    );
}

/// nbdkit's nbd plugin connects to our server with `tls` (its TLS
/// parameters) and serves the export in plaintext on its own socket, which
/// nbdcopy writes and reads back.
fn nbdkit_round_trip(dir: &Dir, srv: &Served, tls: &[String], seed: u32) {
    let data = pattern(seed, SIZE_BYTES);
    let src = dir.join(&format!("kin-{seed}.raw"));
    let back = dir.join(&format!("kout-{seed}.raw"));
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdkit")
        .args(["-U", "-", "nbd"])
        .arg(format!("socket={}", srv.sock.display()))
        .arg(format!("export={EXPORT}"))
        .arg("tls=require")
        .args(tls)
        .arg("--run")
        .arg(format!(
            "nbdinfo --size \"$uri\" && nbdcopy {} \"$uri\" && nbdcopy \"$uri\" {}",
            src.display(),
            back.display()
        )));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbdkit's nbd plugin reads back what it wrote through TLS"
    );
}

/// nbdkit's nbd plugin with `target` (its connection parameters) and `tls`
/// cannot reach the export: `nbdinfo` through it fails.
fn nbdkit_refused(target: &[String], tls: &[String]) -> String {
    refused(
        Command::new("nbdkit")
            .args(["-U", "-", "nbd"])
            .args(target)
            .arg(format!("export={EXPORT}"))
            .arg("tls=require")
            .args(tls)
            .args(["--run", "nbdinfo --size \"$uri\""]),
    )
}

fn arg(k: &str, p: &Path) -> String {
    format!("{k}={}", p.display())
}

/// A `--tls require` server with the X.509 certificates in `server`.
fn x509_server(dir: &Dir, server: &Path, verify_peer: bool, tcp: bool) -> Served {
    Served::start(
        dir,
        &Tls {
            mode: "require",
            creds: Creds::X509(server),
            verify_peer,
            tcp,
        },
    )
}

#[test]
fn x509_nbdinfo_and_nbdcopy_round_trip_and_refusals() {
    if !tools(&["nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("x509-libnbd");
    let pki = write_pki(&dir.join("pki")).unwrap();
    let srv = x509_server(&dir, &pki.server, false, true);
    let uri = srv.x509_uri(&pki.client);
    assert_eq!(nbdinfo_size(&uri), SIZE_BYTES as u64);
    let info = run(Command::new("nbdinfo").arg(&uri));
    assert!(info.contains("with TLS"), "{info}");
    nbdcopy_round_trip(&dir, &uri, 1);
    // Over TCP libnbd checks the certificate: it names 127.0.0.1 and is
    // signed by the client's CA...
    assert_eq!(
        nbdinfo_size(&srv.tcp_x509_uri(&pki.client)),
        SIZE_BYTES as u64
    );
    // ... and not by an unrelated CA's.
    let e = refused(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(srv.tcp_x509_uri(&pki.foreign)),
    );
    assert!(e.contains("certificate"), "{e}");
    plaintext_refused(&srv);
    // The connections refused did not stop the server.
    assert_eq!(nbdinfo_size(&uri), SIZE_BYTES as u64);
    srv.stop();
}

#[test]
fn x509_qemu_img_round_trip_and_an_unrelated_ca_refused() {
    if !tools(&["qemu-img"]) {
        return;
    }
    let dir = Dir::new("x509-qemu");
    let pki = write_pki(&dir.join("pki")).unwrap();
    let srv = x509_server(&dir, &pki.server, false, false);
    let opts = srv.qemu_opts(Some("x509"));
    let info = run(Command::new("qemu-img")
        .args(["info", "--object", &qemu_x509(&pki.client), "--image-opts"])
        .arg(&opts));
    assert!(info.contains(&format!("({SIZE_BYTES} bytes)")), "{info}");
    qemu_round_trip(&dir, &qemu_x509(&pki.client), &opts, 2);
    let e = refused(
        Command::new("qemu-img")
            .args(["info", "--object", &qemu_x509(&pki.foreign), "--image-opts"])
            .arg(&opts),
    );
    assert!(e.contains("certificate"), "{e}");
    // Without tls-creds qemu is told TLS is required.
    let e = refused(
        Command::new("qemu-img")
            .args(["info", "--image-opts"])
            .arg(srv.qemu_opts(None)),
    );
    assert!(e.contains("TLS"), "{e}");
    srv.stop();
}

#[test]
fn x509_nbdkit_nbd_plugin_as_client_round_trip_and_an_unrelated_ca_refused() {
    if !tools(&["nbdkit", "nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("x509-nbdkit");
    let pki = write_pki(&dir.join("pki")).unwrap();
    let srv = x509_server(&dir, &pki.server, false, true);
    nbdkit_round_trip(&dir, &srv, &[arg("tls-certificates", &pki.client)], 3);
    // Like libnbd, whose it is, the plugin checks the server's certificate
    // where it has a host name: over TCP.
    let addr = srv.tcp.clone().unwrap();
    let (host, port) = addr.rsplit_once(':').unwrap();
    let target = [format!("hostname={host}"), format!("port={port}")];
    let e = nbdkit_refused(&target, &[arg("tls-certificates", &pki.foreign)]);
    assert!(e.contains("certificate"), "{e}");
    run(Command::new("nbdkit")
        .args(["-U", "-", "nbd"])
        .args(&target)
        .arg(format!("export={EXPORT}"))
        .arg("tls=require")
        .arg(arg("tls-certificates", &pki.client))
        .args(["--run", "nbdinfo --size \"$uri\""]));
    srv.stop();
}

#[test]
fn x509_verify_peer_refuses_clients_without_a_certificate_from_its_ca() {
    if !tools(&["nbdinfo", "nbdcopy", "qemu-img", "nbdkit"]) {
        return;
    }
    let dir = Dir::new("x509-peer");
    let pki = write_pki(&dir.join("pki")).unwrap();
    let srv = x509_server(&dir, &pki.server, true, false);
    // With the client certificate: all three get in.
    let uri = srv.x509_uri(&pki.client);
    nbdcopy_round_trip(&dir, &uri, 4);
    let opts = srv.qemu_opts(Some("x509"));
    run(Command::new("qemu-img")
        .args(["info", "--object", &qemu_x509(&pki.client), "--image-opts"])
        .arg(&opts));
    nbdkit_round_trip(&dir, &srv, &[arg("tls-certificates", &pki.client)], 5);
    // Without one, or with one from another CA: refused.
    refused(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(srv.x509_uri(&pki.client_no_cert)),
    );
    refused(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(srv.x509_uri(&pki.foreign)),
    );
    refused(
        Command::new("qemu-img")
            .args([
                "info",
                "--object",
                &qemu_x509(&pki.client_no_cert),
                "--image-opts",
            ])
            .arg(&opts),
    );
    nbdkit_refused(
        &[arg("socket", &srv.sock)],
        &[arg("tls-certificates", &pki.client_no_cert)],
    );
    // Still serving the client that has one.
    assert_eq!(nbdinfo_size(&uri), SIZE_BYTES as u64);
    srv.stop();
}

/// A PSK file for the server (also qemu's `DIR/keys.psk`), and one with a
/// different key for the same identity.
fn psk_files(dir: &Dir) -> (PathBuf, PathBuf) {
    let good = dir.join("psk/keys.psk");
    let wrong = dir.join("wrong-psk/keys.psk");
    let k1 = write_psk(&good, USER).unwrap();
    let k2 = write_psk(&wrong, USER).unwrap();
    assert_ne!(k1, k2);
    (good, wrong)
}

fn psk_server(dir: &Dir, psk: &Path) -> Served {
    Served::start(
        dir,
        &Tls {
            mode: "require",
            creds: Creds::Psk(psk),
            verify_peer: false,
            tcp: false,
        },
    )
}

#[test]
fn psk_nbdinfo_and_nbdcopy_round_trip_and_a_wrong_key_refused() {
    if !tools(&["nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("psk-libnbd");
    let (good, wrong) = psk_files(&dir);
    let srv = psk_server(&dir, &good);
    let uri = srv.psk_uri(&good);
    assert_eq!(nbdinfo_size(&uri), SIZE_BYTES as u64);
    nbdcopy_round_trip(&dir, &uri, 6);
    refused(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(srv.psk_uri(&wrong)),
    );
    plaintext_refused(&srv);
    assert_eq!(nbdinfo_size(&uri), SIZE_BYTES as u64);
    srv.stop();
}

#[test]
fn psk_qemu_img_round_trip_and_a_wrong_key_refused() {
    if !tools(&["qemu-img"]) {
        return;
    }
    let dir = Dir::new("psk-qemu");
    let (good, wrong) = psk_files(&dir);
    let srv = psk_server(&dir, &good);
    let opts = srv.qemu_opts(Some("psk"));
    qemu_round_trip(&dir, &qemu_psk(good.parent().unwrap()), &opts, 7);
    refused(
        Command::new("qemu-img")
            .args([
                "info",
                "--object",
                &qemu_psk(wrong.parent().unwrap()),
                "--image-opts",
            ])
            .arg(&opts),
    );
    srv.stop();
}

#[test]
fn psk_nbdkit_nbd_plugin_as_client_round_trip_and_a_wrong_key_refused() {
    if !tools(&["nbdkit", "nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("psk-nbdkit");
    let (good, wrong) = psk_files(&dir);
    let srv = psk_server(&dir, &good);
    let user = format!("tls-username={USER}");
    nbdkit_round_trip(&dir, &srv, &[arg("tls-psk", &good), user.clone()], 8);
    nbdkit_refused(&[arg("socket", &srv.sock)], &[arg("tls-psk", &wrong), user]);
    srv.stop();
}

#[test]
fn tls_on_serves_plaintext_and_tls_clients_alike() {
    if !tools(&["nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = Dir::new("x509-on");
    let pki: Pki = write_pki(&dir.join("pki")).unwrap();
    let srv = Served::start(
        &dir,
        &Tls {
            mode: "on",
            creds: Creds::X509(&pki.server),
            verify_peer: false,
            tcp: false,
        },
    );
    let plain = srv.plaintext_uri();
    let tls = srv.x509_uri(&pki.client);
    let info = run(Command::new("nbdinfo").arg(&plain));
    assert!(info.contains("without TLS"), "{info}");
    let info = run(Command::new("nbdinfo").arg(&tls));
    assert!(info.contains("with TLS"), "{info}");
    // Written in plaintext, read back through TLS.
    let data = pattern(9, SIZE_BYTES);
    let src = dir.join("in.raw");
    let back = dir.join("out.raw");
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(&plain));
    run(Command::new("nbdcopy").arg(&tls).arg(&back));
    assert!(std::fs::read(&back).unwrap() == data);
    srv.stop();
}

#[test]
fn tls_flags_are_checked_before_serving() {
    if kind() != Kind::Iopages {
        return;
    }
    let dir = Dir::new("flags");
    let pki = write_pki(&dir.join("pki")).unwrap();
    let psk = dir.join("keys.psk");
    write_psk(&psk, USER).unwrap();
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let fail = |args: &[&str]| -> String {
        let e = refused(
            Command::new(BIN)
                .arg("serve")
                .args(["--size", SIZE, "--arena", "128M"])
                .args(args),
        );
        e.to_lowercase()
    };
    let sock = |n: &str| dir.join(n).display().to_string();
    let certs = pki.server.display().to_string();
    let psk = psk.display().to_string();
    // --tls without credentials, or with both kinds.
    let e = fail(&["--unix", &sock("a"), "--tls", "require"]);
    assert!(
        e.contains("--tls-certificates") || e.contains("--tls-psk"),
        "{e}"
    );
    let e = fail(&[
        "--unix",
        &sock("b"),
        "--tls",
        "on",
        "--tls-certificates",
        &certs,
        "--tls-psk",
        &psk,
    ]);
    assert!(
        e.contains("--tls-certificates") || e.contains("--tls-psk"),
        "{e}"
    );
    // A certificate directory without the server's certificate.
    let e = fail(&[
        "--unix",
        &sock("c"),
        "--tls",
        "require",
        "--tls-certificates",
        empty.to_str().unwrap(),
    ]);
    assert!(e.contains("server-cert.pem") || e.contains("empty"), "{e}");
    // Plaintext on an address other hosts reach: refused.
    let e = fail(&["--listen", "0.0.0.0:0"]);
    assert!(e.contains("--allow-plaintext"), "{e}");
    let e = fail(&[
        "--listen",
        "0.0.0.0:0",
        "--tls",
        "on",
        "--tls-certificates",
        &certs,
    ]);
    assert!(e.contains("--allow-plaintext"), "{e}");
}
