//! TLS for the remote store's connections (`nbds://`, `nbds+unix://`):
//! the client side of NBD_OPT_STARTTLS.
//!
//! Owns: the TLS settings an NBD URI carries ([`RemoteTls`]: an X.509
//! directory laid out as qemu, nbdkit and libnbd lay theirs out —
//! `ca-cert.pem`, and `client-cert.pem`/`client-key.pem` when the server
//! wants a client certificate — or a psktool key file and a username; the
//! hostname checked; whether the server is verified), and the OpenSSL
//! connector built from them (TLS 1.2 at least; with a PSK, the PSK
//! suites only and the identity's key). The session a connection then
//! runs is the server's own type ([`ClientTls`] is a
//! [`TlsSession`](crate::tls::session::TlsSession) over the plain stream),
//! and what is demanded of the store — the URI's PSK or a certificate
//! that verifies, checked during and after the handshake — is
//! `tls/verify.rs`'s [`StoreCheck`]. Must never: continue in
//! plaintext when TLS was asked for, or build a connector from settings
//! it could not load whole (every error names the parameter or file).

use crate::tls::session::TlsSession;
use crate::tls::verify::StoreCheck;
use crate::transport::stream::Stream;
use openssl::ssl::{SslConnector, SslConnectorBuilder, SslMethod, SslOptions, SslVersion};
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The session of a remote connection under TLS (in `Stream::Tls`).
pub(crate) type ClientTls = TlsSession<Stream>;

/// The TLS settings of an `nbds://` or `nbds+unix://` URI (its query
/// parameters, named as libnbd names them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteTls {
    /// `tls-certificates=DIR`: `DIR/ca-cert.pem` verifies the server,
    /// `DIR/client-cert.pem` and `DIR/client-key.pem` (both or neither)
    /// are presented to it. `None`: the system's CA store, no client
    /// certificate.
    pub certificates: Option<PathBuf>,
    /// `tls-psk-file=FILE`: pre-shared keys (psktool's `identity:hexkey`
    /// lines) instead of certificates.
    pub psk_file: Option<PathBuf>,
    /// `tls-username=NAME` (or the URI's `user@`): the PSK identity. Default:
    /// the login name (`$USER`, `$LOGNAME`).
    pub username: Option<String>,
    /// `tls-hostname=NAME`: the name the server's certificate must carry.
    /// Default: the URI's host; a Unix socket has none, so it needs this
    /// (or `tls-verify-peer=false`).
    pub hostname: Option<String>,
    /// `tls-verify-peer=false` (or `0`) turns verification of the
    /// server's certificate off. Default `true`.
    pub verify_peer: bool,
}

impl RemoteTls {
    /// Settings before any query parameter: X.509 with the system's CA
    /// store, the server verified.
    pub fn new() -> RemoteTls {
        RemoteTls {
            verify_peer: true,
            ..RemoteTls::default()
        }
    }
}

fn config_error(msg: String) -> io::Error {
    io::Error::new(ErrorKind::InvalidInput, format!("TLS: {msg}"))
}

/// CA bundles tried, in order, when no `tls-certificates` directory is
/// given and OpenSSL's own default store (the vendored build's path) has
/// nothing.
const SYSTEM_CA_FILES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// The login name, the default PSK identity.
fn login_name() -> Option<String> {
    ["USER", "LOGNAME"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .find(|u| !u.is_empty())
}

/// What a connection needs to start TLS: the connector, and what the
/// store must prove.
#[derive(Clone)]
pub(crate) struct Connector {
    connector: SslConnector,
    check: StoreCheck,
}

impl Connector {
    /// Run the TLS handshake on `sock` (NBD_OPT_STARTTLS acknowledged)
    /// within `timeout`, the store held to what the URI asked.
    ///
    /// **Context:** blocks up to `timeout`.
    ///
    /// **Returns:** the session, its reads and writes waiting `timeout`
    /// until set otherwise; `PermissionDenied` naming why the store was
    /// not accepted; `TimedOut`.
    pub(crate) fn connect(&self, sock: Stream, timeout: Duration) -> io::Result<ClientTls> {
        TlsSession::connect(sock, &self.connector, &self.check, timeout)
    }
}

/// Build the connector for `tls`; `host` is the URI's host (`None` for a
/// Unix socket).
///
/// **Returns:** `InvalidInput` naming the file or parameter that is
/// missing or unusable.
pub(crate) fn connector(tls: &RemoteTls, host: Option<&str>) -> io::Result<Connector> {
    let ssl = |e: openssl::error::ErrorStack| config_error(e.to_string());
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(ssl)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(ssl)?;
    // A server that closes without close_notify after NBD_CMD_DISC is an
    // end of stream, not an error.
    b.set_options(SslOptions::IGNORE_UNEXPECTED_EOF);
    match &tls.psk_file {
        Some(file) => psk_connector(b, tls, file),
        None => x509_connector(b, tls, host),
    }
}

/// The connector of `tls-psk-file=file`: PSK suites only, the identity's
/// key offered, and any certificate the store presents refused (TLS 1.3
/// lets a store answer a PSK with a certificate).
fn psk_connector(
    mut b: SslConnectorBuilder,
    tls: &RemoteTls,
    file: &Path,
) -> io::Result<Connector> {
    let ssl = |e: openssl::error::ErrorStack| config_error(e.to_string());
    if tls.certificates.is_some() {
        return Err(config_error(
            "give tls-certificates= or tls-psk-file=, not both".into(),
        ));
    }
    let keys = crate::tls::config::read_psk_file(file).map_err(|e| config_error(e.to_string()))?;
    let Some(user) = tls.username.clone().or_else(login_name) else {
        return Err(config_error(format!(
            "no PSK username: add tls-username=NAME (an identity in {})",
            file.display()
        )));
    };
    let Some(key) = keys.get(user.as_bytes()).cloned() else {
        return Err(config_error(format!(
            "the PSK file {} has no key for the username {user:?} (set tls-username= to one of its identities)",
            file.display()
        )));
    };
    // TLS 1.3 uses the same callback with a SHA-256 suite; TLS 1.2
    // servers get the (EC)DHE-PSK suites, then plain PSK.
    b.set_ciphersuites(crate::tls::config::PSK_TLS13_SUITES)
        .map_err(ssl)?;
    b.set_cipher_list(crate::tls::config::PSK_TLS12_CIPHERS)
        .map_err(ssl)?;
    let identity = user.clone().into_bytes();
    b.set_psk_client_callback(move |_ssl, _hint, id_out, key_out| {
        if identity.len() >= id_out.len() || key.len() > key_out.len() {
            return Err(openssl::error::ErrorStack::get());
        }
        id_out[..identity.len()].copy_from_slice(&identity);
        id_out[identity.len()] = 0;
        key_out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    // Every certificate fails verification, so a store that presents one
    // fails the handshake.
    let check = StoreCheck::psk(&user, file);
    check.configure(&mut b);
    Ok(Connector {
        connector: b.build(),
        check,
    })
}

/// The connector of a certificate setup: `tls-certificates=DIR` (or the
/// system's CA store), the name checked (`tls-hostname`, else `host`)
/// unless `tls-verify-peer=false`. It offers no PSK.
fn x509_connector(
    mut b: SslConnectorBuilder,
    tls: &RemoteTls,
    host: Option<&str>,
) -> io::Result<Connector> {
    let mut checked = "the system's CA certificates".to_string();
    if let Some(dir) = &tls.certificates {
        if !dir.is_dir() {
            return Err(config_error(format!(
                "the certificate directory {} does not exist",
                dir.display()
            )));
        }
        let ca = dir.join("ca-cert.pem");
        if ca.is_file() {
            b.set_ca_file(&ca)
                .map_err(|e| config_error(format!("cannot load {}: {e}", ca.display())))?;
            checked = ca.display().to_string();
        } else if tls.verify_peer {
            return Err(config_error(format!(
                "{} is missing: it is needed to verify the server (or set tls-verify-peer=false)",
                ca.display()
            )));
        }
        load_client_cert(&mut b, dir)?;
    } else if std::env::var_os("SSL_CERT_FILE").is_none() {
        if let Some(f) = SYSTEM_CA_FILES.iter().map(Path::new).find(|f| f.is_file()) {
            b.set_ca_file(f)
                .map_err(|e| config_error(format!("cannot load {}: {e}", f.display())))?;
            checked = f.display().to_string();
        }
    }
    let verify_name =
        if tls.verify_peer {
            match tls.hostname.as_deref().or(host) {
                Some(h) => Some(h.to_string()),
                None => return Err(config_error(
                    "a Unix socket has no host name to check the server's certificate against: \
                     add tls-hostname=NAME (the name in the certificate), or tls-verify-peer=false"
                        .into(),
                )),
            }
        } else {
            None
        };
    let check = StoreCheck::certificate(verify_name, &checked);
    check.configure(&mut b);
    Ok(Connector {
        connector: b.build(),
        check,
    })
}

/// `dir/client-cert.pem` and `dir/client-key.pem`, when present.
fn load_client_cert(b: &mut SslConnectorBuilder, dir: &Path) -> io::Result<()> {
    let cert = dir.join("client-cert.pem");
    let key = dir.join("client-key.pem");
    match (cert.is_file(), key.is_file()) {
        (false, false) => Ok(()),
        (true, true) => crate::tls::config::load_cert_and_key(b, &cert, &key).map_err(config_error),
        (c, _) => Err(config_error(format!(
            "{} is there but {} is not (a client certificate needs both)",
            if c { cert.display() } else { key.display() },
            if c { key.display() } else { cert.display() }
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::poll_until;
    use crate::tls::config::{TlsConfig, TlsMode};
    use crate::tls::identity::TlsIdentity;
    use crate::tls::session::Io;
    use std::io::IoSlice;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::time::Instant;

    const T: Duration = Duration::from_secs(20);

    /// Wait for `events` on `fd` by `deadline`, or fail the test.
    fn ready(fd: i32, events: libc::c_short, deadline: Instant) {
        assert!(poll_until(fd, events, deadline).unwrap(), "timed out");
    }

    /// The server's and the client's ends of one PSK session ("alice")
    /// over a socket pair, each a `TlsSession` over a `Stream`.
    fn pair(dir: &Path) -> (TlsSession<Stream>, ClientTls) {
        let file = dir.join("keys.psk");
        std::fs::write(&file, "alice:000102030405060708090a0b0c0d0e0f\n").unwrap();
        let server = TlsConfig::psk(&file, TlsMode::Require).unwrap();
        let tls = RemoteTls {
            psk_file: Some(file),
            username: Some("alice".into()),
            ..RemoteTls::new()
        };
        let client = connector(&tls, None).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let accept = std::thread::spawn(move || {
            let sock = Stream::Unix(a);
            let (fd, deadline) = (sock.as_raw_fd(), Instant::now() + T);
            TlsSession::accept(sock, &server.acceptor, T, |read, write| {
                let r = if read { libc::POLLIN } else { 0 };
                let w = if write { libc::POLLOUT } else { 0 };
                ready(fd, r | w, deadline);
                Ok(())
            })
        });
        let client = client.connect(Stream::Unix(b), T).unwrap();
        (accept.join().unwrap().unwrap(), client)
    }

    /// `len` bytes read from a server session with attempts.
    fn server_read(s: &TlsSession<Stream>, len: usize) -> Vec<u8> {
        let (mut got, deadline) = (vec![0u8; len], Instant::now() + T);
        let mut at = 0;
        while at < len {
            match s.try_read(&mut got[at..]).unwrap() {
                Io::Done(n) => {
                    assert!(n > 0, "the client ended the stream early");
                    at += n;
                }
                Io::Blocked { write: false } => ready(s.raw_fd(), libc::POLLIN, deadline),
                Io::Blocked { write: true } => ready(s.raw_fd(), libc::POLLOUT, deadline),
            }
        }
        got
    }

    /// Send all of `buf` from a server session with attempts, batched
    /// records pushed until none is left.
    fn server_write(s: &TlsSession<Stream>, buf: &[u8]) {
        let (mut at, deadline) = (0, Instant::now() + T);
        while at < buf.len() || s.pending_out() {
            let r = match at < buf.len() {
                true => s.try_write(&[IoSlice::new(&buf[at..])]).unwrap(),
                false => Io::Blocked { write: true },
            };
            match r {
                Io::Done(n) => at += n,
                Io::Blocked { write } => {
                    let events = if write { libc::POLLOUT } else { libc::POLLIN };
                    ready(s.raw_fd(), events | libc::POLLOUT, deadline);
                    s.push_out().unwrap();
                }
            }
        }
    }

    #[test]
    fn both_ends_run_one_session_type_and_the_server_learns_the_psk_identity() {
        let dir = iopages_testkit::TempDir::new("tls-session");
        let (server, client) = pair(dir.path());
        assert_eq!(
            server.client_identity(),
            Some(TlsIdentity::Psk("alice".into()))
        );
        // A request header and a payload of many records, in one vectored
        // write; then everything the server sends back, up to close_notify.
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let len = sent.len();
        let remote = std::thread::spawn(move || {
            let mut iov = [IoSlice::new(&sent[..28]), IoSlice::new(&sent[28..])];
            let mut bufs = &mut iov[..];
            while !bufs.is_empty() {
                let n = client.write_vectored(bufs).unwrap();
                IoSlice::advance_slices(&mut bufs, n);
            }
            let (mut back, mut buf) = (Vec::new(), [0u8; 4096]);
            loop {
                match client.read(&mut buf).unwrap() {
                    0 => return (sent, back),
                    n => back.extend_from_slice(&buf[..n]),
                }
            }
        });
        let got = server_read(&server, len);
        server_write(&server, &got);
        server.close_notify();
        let (sent, back) = remote.join().unwrap();
        assert!(got == sent, "the server read what the client wrote");
        assert!(
            back == sent,
            "the client read what the server wrote, then the end"
        );
    }
}
