//! E6's servers: ours, nbdkit's luks filter and qemu-nbd's LUKS driver,
//! each started on a Unix socket over the same image, checked alive and
//! stopped.
//!
//! Owns: [`Server`] (names, URIs), the command line of each server
//! ([`server_command`]), [`start_server`] (logs, the wait for the socket)
//! and [`Running`] (stopped with SIGTERM then SIGKILL, and reaped, on every
//! path). Must never: leave a server running behind an error or a drop.

use super::common::{tail, workload};
use super::files::{Files, TlsSetup};
use super::tools::Tools;
use crate::BenchError;
use iopages_tools::{die_with_parent, stop, wait_for_socket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Export name `iopages serve` is given (nbdkit and qemu-nbd export "").
pub(crate) const OUR_EXPORT: &str = "iopages";

pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether the servers ask for the client's certificate: no, as fio (run
/// by root) can present none (see `Server::fio_uri`). The check costs one
/// signature per connection's handshake, nothing per request.
pub(super) const TLS_VERIFY_PEER: bool = false;

/// The servers, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Server {
    Ours,
    /// With `--tls`: ours again without TLS, for TLS's cost side by side.
    OursPlain,
    /// The sparse copy (`sparse.rs`): ours with `--allow-discards` (holes
    /// reported and read as zeros).
    OursDiscards,
    Nbdkit,
    Qemu,
}

impl Server {
    pub(super) const ALL: [Server; 3] = [Server::Ours, Server::Nbdkit, Server::Qemu];
    /// With `--tls`: every server with TLS, and ours also without.
    pub(super) const ALL_TLS: [Server; 4] = [
        Server::Ours,
        Server::OursPlain,
        Server::Nbdkit,
        Server::Qemu,
    ];

    pub(crate) fn key(self) -> &'static str {
        match self {
            Server::Ours => "ours",
            Server::OursPlain => "ours_plaintext",
            Server::OursDiscards => "ours_discards",
            Server::Nbdkit => "nbdkit",
            Server::Qemu => "qemu",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Server::Ours => "iopages serve",
            Server::OursPlain => "iopages serve, no TLS",
            Server::OursDiscards => "iopages serve --allow-discards",
            Server::Nbdkit => "nbdkit luks filter",
            Server::Qemu => "qemu-nbd luks driver",
        }
    }

    pub(crate) fn is_ours(self) -> bool {
        matches!(
            self,
            Server::Ours | Server::OursPlain | Server::OursDiscards
        )
    }

    /// With TLS in a `--tls` run (all but `OursPlain`).
    fn tls(self, tls: Option<&TlsSetup>) -> Option<&TlsSetup> {
        tls.filter(|_| self != Server::OursPlain)
    }

    /// The URI nbdinfo and nbdcopy connect to: with TLS, `nbds+unix` and
    /// the client's certificate directory.
    fn uri(self, sock: &Path, tls: Option<&TlsSetup>) -> String {
        let name = if self.is_ours() { OUR_EXPORT } else { "" };
        match self.tls(tls) {
            None => format!("nbd+unix:///{name}?socket={}", sock.display()),
            Some(t) => format!(
                "nbds+unix:///{name}?socket={}&tls-certificates={}",
                sock.display(),
                t.pki.client.display()
            ),
        }
    }

    /// The URI fio's nbd engine connects to. fio 3.33 does not let libnbd
    /// read files the URI names (no nbd_set_uri_allow_local_file: "local
    /// file access (tls-certificates) is not allowed"), so with TLS it names
    /// none: libnbd takes its default certificate directory
    /// (`$HOME/.pki/libnbd`, which `TlsSetup::home` provides; root's is
    /// /etc/pki/libnbd, which the bench leaves alone) or the system's CAs.
    /// Over a Unix socket libnbd does not check the server's certificate,
    /// and no server asks for the client's (`TLS_VERIFY_PEER`).
    fn fio_uri(self, sock: &Path, tls: Option<&TlsSetup>) -> String {
        let name = if self.is_ours() { OUR_EXPORT } else { "" };
        let scheme = if self.tls(tls).is_some() {
            "nbds+unix"
        } else {
            "nbd+unix"
        };
        format!("{scheme}:///{name}?socket={}", sock.display())
    }
}

/// A value inside a qemu option string: commas are doubled.
fn qemu_escape(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

/// A server process, stopped with SIGTERM (then SIGKILL) and reaped on
/// every path.
pub(crate) struct Running {
    pub(super) server: Server,
    child: Option<Child>,
    pub(crate) uri: String,
    /// fio's URI (see `Server::fio_uri`).
    pub(super) fio_uri: String,
    /// fio's `HOME` with TLS.
    pub(super) home: Option<PathBuf>,
    err_log: PathBuf,
}

impl Running {
    /// Err if the server has exited.
    pub(crate) fn alive(&mut self) -> Result<(), String> {
        let child = self.child.as_mut().expect("running");
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(s)) => Err(format!(
                "{} exited ({s}); stderr: {}",
                self.server.label(),
                tail(&self.err_log)
            )),
            Err(e) => Err(format!("cannot wait for {}: {e}", self.server.label())),
        }
    }

    /// SIGTERM, wait, SIGKILL if it lingers. Says how it ended.
    pub(crate) fn stop(&mut self) -> String {
        match self.child.take() {
            Some(mut child) => stop(&mut child, STOP_TIMEOUT),
            None => "not running".into(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How a server is started.
pub(crate) fn server_command(
    s: Server,
    tools: &Tools,
    ours: &Path,
    f: &Files,
    sock: &Path,
) -> Command {
    let tls = s.tls(f.tls.as_ref());
    match s {
        Server::Ours | Server::OursPlain | Server::OursDiscards => {
            ours_command(s, ours, f, sock, tls)
        }
        Server::Nbdkit => nbdkit_command(tools, f, sock, tls),
        Server::Qemu => qemu_command(tools, f, sock, tls),
    }
}

/// `iopages serve` over the image (`s` says with discards or not).
fn ours_command(s: Server, ours: &Path, f: &Files, sock: &Path, tls: Option<&TlsSetup>) -> Command {
    let mut cmd = Command::new(ours);
    cmd.arg("serve")
        .arg("--image")
        .arg(&f.image)
        .arg("--passphrase-file")
        .arg(&f.pass)
        .arg("--unix")
        .arg(sock)
        .arg("--name")
        .arg(OUR_EXPORT)
        // Through the page cache, as both peers read and write it.
        .arg("--io")
        .arg("buffered");
    if s == Server::OursDiscards {
        cmd.arg("--allow-discards");
    }
    if f.read_only {
        cmd.arg("--read-only");
    }
    if let Some(t) = tls {
        cmd.args(["--tls", "require", "--tls-certificates"])
            .arg(&t.pki.server);
        if TLS_VERIFY_PEER {
            cmd.arg("--tls-verify-peer");
        }
    }
    cmd
}

/// nbdkit's file plugin under its luks filter.
fn nbdkit_command(tools: &Tools, f: &Files, sock: &Path, tls: Option<&TlsSetup>) -> Command {
    let mut cmd = Command::new(&tools.nbdkit);
    cmd.arg("--foreground")
        .arg("--exit-with-parent")
        .arg("--unix")
        .arg(sock);
    if f.read_only {
        cmd.arg("--readonly");
    }
    if let Some(t) = tls {
        cmd.arg("--tls=require")
            .arg(format!("--tls-certificates={}", t.pki.server.display()));
        if TLS_VERIFY_PEER {
            cmd.arg("--tls-verify-peer");
        }
    }
    cmd.arg("--filter=luks")
        .arg("file")
        .arg(format!("file={}", f.image.display()))
        .arg(format!("passphrase=+{}", f.pass.display()));
    cmd
}

/// qemu-nbd with qemu's LUKS driver over the image file.
fn qemu_command(tools: &Tools, f: &Files, sock: &Path, tls: Option<&TlsSetup>) -> Command {
    let mut cmd = Command::new(&tools.qemu_nbd);
    if let Some(t) = tls {
        cmd.arg("--object")
            .arg(format!(
                "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer={}",
                qemu_escape(&t.pki.server),
                if TLS_VERIFY_PEER { "on" } else { "off" }
            ))
            .arg("--tls-creds")
            .arg("tls0");
    }
    cmd.arg("--object")
        .arg(format!("secret,id=sec0,file={}", qemu_escape(&f.pass)))
        .arg("--image-opts")
        .arg(format!(
            "driver=luks,key-secret=sec0,file.driver=file,file.filename={}",
            qemu_escape(&f.image)
        ))
        .arg("--socket")
        .arg(sock);
    if f.read_only {
        cmd.arg("--read-only");
    }
    cmd.arg("--persistent")
        .arg("--shared=0")
        .arg("--cache=writeback")
        .arg("--aio=io_uring");
    cmd
}

pub(crate) fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A server's standard output and error logs in `work`, named by `tag`.
pub(crate) fn logs_in(work: &Path, tag: &str) -> (PathBuf, PathBuf) {
    (
        work.join(format!("{tag}.out")),
        work.join(format!("{tag}.err")),
    )
}

/// Spawn `cmd` in `work` with no input, its output and errors written to
/// `out` and `err`, killed (SIGTERM) if this process dies first.
pub(crate) fn spawn_logged(
    cmd: &mut Command,
    work: &Path,
    out: &Path,
    err: &Path,
) -> Result<std::process::Child, String> {
    let file = |p: &Path| {
        std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()))
    };
    cmd.current_dir(work)
        .stdin(Stdio::null())
        .stdout(file(out)?)
        .stderr(file(err)?);
    die_with_parent(cmd, libc::SIGTERM);
    cmd.spawn().map_err(|e| e.to_string())
}

/// Start `s` and wait until its socket takes connections.
pub(crate) fn start_server(
    s: Server,
    tools: &Tools,
    ours: &Path,
    f: &Files,
) -> Result<(Running, String), BenchError> {
    let sock = f.socks.join(format!("{}.sock", s.key()));
    let _ = std::fs::remove_file(&sock);
    let mut cmd = server_command(s, tools, ours, f, &sock);
    let line = command_line(&cmd);
    let (out_log, err_log) = logs_in(&f.work, s.key());
    let child = spawn_logged(&mut cmd, &f.work, &out_log, &err_log)
        .map_err(|e| workload(format!("cannot start {} ({line}): {e}", s.label())))?;
    let mut r = Running {
        server: s,
        child: Some(child),
        uri: s.uri(&sock, f.tls.as_ref()),
        fio_uri: s.fio_uri(&sock, f.tls.as_ref()),
        home: s.tls(f.tls.as_ref()).map(|t| t.home.clone()),
        err_log,
    };
    let sock_wait = wait_for_socket(&sock, START_TIMEOUT, || r.alive());
    if let Err(e) = sock_wait {
        // An exit's reason carries the stderr already; a silent server's not.
        let stderr = match e.starts_with("did not listen") {
            true => format!("; stderr: {}", tail(&r.err_log)),
            false => String::new(),
        };
        let why = format!("{} did not start: {e}{stderr} (command: {line})", s.label());
        r.stop();
        return Err(workload(why));
    }
    Ok((r, line))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::e6::runs::servers_of;
    use iopages_tools::pki::Pki;

    fn fake_tls() -> TlsSetup {
        let d = PathBuf::from("/t");
        TlsSetup {
            pki: Pki {
                server: d.join("server"),
                client: d.join("client"),
                client_no_cert: d.join("client-no-cert"),
                foreign: d.join("foreign"),
            },
            home: d.join("home"),
        }
    }

    #[test]
    fn tls_runs_every_server_with_tls_and_ours_also_without() {
        assert_eq!(servers_of(true, false), Server::ALL.to_vec());
        assert_eq!(servers_of(false, false), vec![Server::Ours]);
        assert_eq!(
            servers_of(true, true),
            vec![
                Server::Ours,
                Server::OursPlain,
                Server::Nbdkit,
                Server::Qemu
            ]
        );
        assert_eq!(
            servers_of(false, true),
            vec![Server::Ours, Server::OursPlain]
        );
        let t = fake_tls();
        let sock = Path::new("/s/x.sock");
        assert_eq!(
            Server::Ours.uri(sock, Some(&t)),
            "nbds+unix:///iopages?socket=/s/x.sock&tls-certificates=/t/client"
        );
        assert_eq!(
            Server::Qemu.uri(sock, Some(&t)),
            "nbds+unix:///?socket=/s/x.sock&tls-certificates=/t/client"
        );
        assert_eq!(
            Server::OursPlain.uri(sock, Some(&t)),
            "nbd+unix:///iopages?socket=/s/x.sock"
        );
        assert_eq!(
            Server::Ours.uri(sock, None),
            "nbd+unix:///iopages?socket=/s/x.sock"
        );
        // fio's URI names no file: libnbd finds the certificates in HOME.
        assert_eq!(
            Server::Nbdkit.fio_uri(sock, Some(&t)),
            "nbds+unix:///?socket=/s/x.sock"
        );
        assert_eq!(
            Server::OursPlain.fio_uri(sock, Some(&t)),
            "nbd+unix:///iopages?socket=/s/x.sock"
        );
        assert_eq!(
            Server::Ours.fio_uri(sock, None),
            Server::Ours.uri(sock, None)
        );
        assert!(Server::OursPlain.is_ours() && !Server::Qemu.is_ours());
    }

    #[test]
    fn tls_server_command_lines() {
        let tools = Tools::named();
        let mut f = Files {
            work: "/w".into(),
            socks: "/s".into(),
            image: "/w/luks1.img".into(),
            pass: "/w/passphrase".into(),
            source: "/w/source.bin".into(),
            tls: Some(fake_tls()),
            read_only: false,
        };
        let sock = Path::new("/s/x.sock");
        let line = |s: Server, f: &Files| {
            command_line(&server_command(
                s,
                &tools,
                Path::new("/bin/iopages"),
                f,
                sock,
            ))
        };
        assert_eq!(
            line(Server::Ours, &f),
            "/bin/iopages serve --image /w/luks1.img --passphrase-file /w/passphrase --unix /s/x.sock --name iopages --io buffered --tls require --tls-certificates /t/server"
        );
        assert_eq!(
            line(Server::OursPlain, &f),
            "/bin/iopages serve --image /w/luks1.img --passphrase-file /w/passphrase --unix /s/x.sock --name iopages --io buffered"
        );
        assert_eq!(
            line(Server::Nbdkit, &f),
            "nbdkit --foreground --exit-with-parent --unix /s/x.sock --tls=require --tls-certificates=/t/server --filter=luks file file=/w/luks1.img passphrase=+/w/passphrase"
        );
        let q = line(Server::Qemu, &f);
        assert!(
            q.starts_with("qemu-nbd --object tls-creds-x509,id=tls0,dir=/t/server,endpoint=server,verify-peer=off --tls-creds tls0 --object secret,id=sec0,"),
            "{q}"
        );
        // Without --tls: the command lines of the plaintext E6.
        f.tls = None;
        assert_eq!(
            line(Server::Ours, &f),
            "/bin/iopages serve --image /w/luks1.img --passphrase-file /w/passphrase --unix /s/x.sock --name iopages --io buffered"
        );
        assert!(!line(Server::Nbdkit, &f).contains("tls"));
        assert!(line(Server::Qemu, &f).starts_with("qemu-nbd --object secret,id=sec0,"));
    }

    #[test]
    fn qemu_option_values_double_their_commas() {
        assert_eq!(qemu_escape(Path::new("/a,b/img")), "/a,,b/img");
    }
}
