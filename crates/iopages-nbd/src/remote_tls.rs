//! TLS for the remote store's connections (`nbds://`, `nbds+unix://`):
//! the client side of NBD_OPT_STARTTLS.
//!
//! Owns: the TLS settings an NBD URI carries ([`RemoteTls`]: an X.509
//! directory laid out as qemu, nbdkit and libnbd lay theirs out —
//! `ca-cert.pem`, and `client-cert.pem`/`client-key.pem` when the server
//! wants a client certificate — or a psktool key file and a username; the
//! hostname checked; whether the server is verified), the OpenSSL
//! connector built from them (TLS 1.2 at least), the client handshake
//! under a deadline, and the session a connection then reads and writes
//! through ([`ClientTls`], one lock around it, nobody waiting for the
//! socket while holding it, so the reader thread and the writers of a
//! connection use it at once). Must never: continue in plaintext when TLS
//! was asked for; accept a store that authenticated otherwise than the URI
//! asked — with `tls-psk-file`, any handshake but a PSK one with that key
//! (a store presenting a certificate, which TLS 1.3 allows in answer to a
//! PSK, fails the handshake), with certificates, a store presenting none —
//! or exchange application data with it before that is settled; accept a
//! server certificate that does not verify (unless the URI says
//! `tls-verify-peer=false`); or wait for the socket past the caller's
//! timeout.

use crate::stream::Stream;
use openssl::ssl::{
    ErrorCode, HandshakeError, Ssl, SslConnector, SslConnectorBuilder, SslMethod, SslOptions,
    SslRef, SslStream, SslVerifyMode, SslVersion,
};
use openssl::x509::{X509Ref, X509StoreContextRef, X509VerifyResult};
use parking_lot::Mutex;
use std::io::{self, ErrorKind, IoSlice};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Small pieces of a vectored write are gathered into one TLS record of
/// up to this many bytes (OpenSSL has no vectored write), as the server's
/// transport does.
use crate::transport::TLS_RECORD_BYTES as GATHER_BYTES;
/// While a write waits for OpenSSL to read (a TLS 1.2 renegotiation), the
/// socket is polled in slices this long: the reader thread may take the
/// bytes first.
const WRITE_WANTS_READ_SLICE: Duration = Duration::from_millis(10);

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

/// How the store must authenticate: what the URI asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// A PSK handshake with the file's key for the identity: a store that
    /// presents a certificate instead fails the handshake.
    Psk,
    /// An X.509 certificate (verified, chain and name, unless
    /// `tls-verify-peer=false`): the client offers no PSK.
    Certificate,
}

/// What a connection needs to start TLS: the connector, the name the
/// server's certificate is checked against, and how the store must
/// authenticate.
#[derive(Clone)]
pub(crate) struct Connector {
    connector: SslConnector,
    /// `Some`: verify the certificate and this name; `None`: PSK, or
    /// verification off.
    verify_name: Option<String>,
    /// What the URI asked for.
    expect: Expect,
    /// The same in words, for a refusal's message: `a PSK handshake as
    /// identity "alice" (from FILE)` or `an X.509 certificate from the
    /// store (checked against …)`.
    expected: String,
    /// What was checked against, for a failed handshake's message.
    checked_against: String,
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
    let keys = crate::tls::read_psk_file(file).map_err(|e| config_error(e.to_string()))?;
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
    b.set_ciphersuites(crate::tls::PSK_TLS13_SUITES)
        .map_err(ssl)?;
    b.set_cipher_list(crate::tls::PSK_TLS12_CIPHERS)
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
    // fails the handshake (each connection sets this again, noting the
    // certificate for the message: `Connector::ssl`).
    b.set_verify_callback(SslVerifyMode::PEER, |_, _| false);
    Ok(Connector {
        connector: b.build(),
        verify_name: None,
        expect: Expect::Psk,
        expected: format!(
            "a PSK handshake as identity {user:?} (from {})",
            file.display()
        ),
        checked_against: format!("PSK identity {user:?} from {}", file.display()),
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
            b.set_verify(SslVerifyMode::NONE);
            None
        };
    let checked_against = match &verify_name {
        Some(n) => format!("{checked}, host name {n:?}"),
        None => "nothing (tls-verify-peer=false)".to_string(),
    };
    Ok(Connector {
        connector: b.build(),
        verify_name,
        expect: Expect::Certificate,
        expected: format!(
            "an X.509 certificate from the store (checked against {checked_against})"
        ),
        checked_against,
    })
}

/// A certificate's subject as `CN=…, O=…`, for a message: it comes from
/// the store, so control characters are dropped and it is cut at 200
/// characters.
fn subject_of(cert: &X509Ref) -> String {
    let entries: Vec<String> = cert
        .subject_name()
        .entries()
        .map(|e| {
            let key = e.object().nid().short_name().unwrap_or("?");
            match e.data().to_string() {
                Ok(v) => format!("{key}={v}"),
                Err(_) => format!("{key}=?"),
            }
        })
        .collect();
    let clean: String = entries
        .join(", ")
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect();
    if clean.is_empty() {
        "empty".to_string()
    } else {
        clean
    }
}

/// The subject of the certificate a verification is about: the store's
/// own (the chain's first), else the one at hand.
fn presented_subject(ctx: &X509StoreContextRef) -> Option<String> {
    ctx.chain()
        .and_then(|c| c.iter().next())
        .or_else(|| ctx.current_cert())
        .map(subject_of)
}

/// The subject of the certificate a store presented, as noted during a
/// connection's handshake (`None` until one is presented).
type Presented = Arc<Mutex<Option<String>>>;

/// An error setting a connection's TLS state up (not the store's doing).
fn setup_error(e: openssl::error::ErrorStack) -> io::Error {
    io::Error::other(format!("TLS: {e}"))
}

impl Connector {
    /// A connection's TLS state, its verification noting into `presented`
    /// the subject of any certificate the store presents; with a PSK,
    /// every certificate fails.
    fn ssl(&self, presented: Presented) -> io::Result<Ssl> {
        let mut cfg = self.connector.configure().map_err(setup_error)?;
        let name = match &self.verify_name {
            Some(n) => n.as_str(),
            None => {
                cfg.set_verify_hostname(false);
                cfg.set_use_server_name_indication(false);
                ""
            }
        };
        let mut ssl = cfg.into_ssl(name).map_err(setup_error)?;
        let refuse_all = self.expect == Expect::Psk;
        let mode = match (self.expect, &self.verify_name) {
            (Expect::Certificate, None) => SslVerifyMode::NONE,
            _ => SslVerifyMode::PEER,
        };
        ssl.set_verify_callback(mode, move |ok, ctx| {
            let mut seen = presented.lock();
            if seen.is_none() {
                *seen = Some(presented_subject(ctx).unwrap_or_else(|| "unknown".into()));
            }
            if refuse_all {
                ctx.set_error(X509VerifyResult::APPLICATION_VERIFICATION);
            }
            ok && !refuse_all
        });
        Ok(ssl)
    }

    /// Why a failed handshake (`e`, on `ssl`) did not authenticate the
    /// store as asked: what was expected and what the store offered
    /// (`presented`: the subject of the certificate it presented).
    fn refusal(
        &self,
        ssl: &SslRef,
        e: &openssl::ssl::Error,
        presented: Option<String>,
    ) -> io::Error {
        let what = e
            .ssl_error()
            .map_or_else(|| e.to_string(), |s| s.to_string());
        let presented = presented.or_else(|| {
            ssl.peer_cert_chain()
                .and_then(|c| c.iter().next())
                .map(subject_of)
        });
        // The alert a store with no suite in common sends.
        let no_common_suite = what.contains("alert handshake failure");
        let expected = &self.expected;
        let why = match (self.expect, presented) {
            (Expect::Psk, Some(subject)) => format!(
                "expected {expected}; the store presented an X.509 certificate (subject {subject}) instead"
            ),
            (Expect::Psk, None) if no_common_suite => format!(
                "expected {expected}; the store took none of the PSK cipher suites offered, \
                 as a store with a certificate and no PSK does ({what})"
            ),
            (Expect::Psk, None) if what.contains("alert unknown psk identity") => format!(
                "expected {expected}; the store has no key for that identity ({what})"
            ),
            (Expect::Psk, None) => {
                format!("expected {expected}; the store did not complete it: {what}")
            }
            (Expect::Certificate, None) => format!(
                "expected {expected}; the store presented none{}: {what}",
                if no_common_suite {
                    ", as a store set up for PSK only does (for one, put tls-psk-file= in the URI)"
                } else {
                    ""
                }
            ),
            (Expect::Certificate, Some(_)) if ssl.verify_result() != X509VerifyResult::OK => {
                format!(
                    "the server's certificate was not accepted: {} (checked against {})",
                    ssl.verify_result().error_string(),
                    self.checked_against
                )
            }
            (Expect::Certificate, Some(_)) => {
                format!("{what} (credentials: {})", self.checked_against)
            }
        };
        io::Error::new(
            ErrorKind::PermissionDenied,
            format!("TLS handshake with the remote failed: {why}"),
        )
    }

    /// After a completed handshake, before any application data: the
    /// store authenticated as asked — with a PSK, no certificate and a
    /// PSK session; with certificates, a certificate (the verification
    /// already checked it).
    fn check_session(&self, ssl: &SslRef) -> io::Result<()> {
        let session = || {
            let cipher = ssl.current_cipher().map_or("none", |c| c.name());
            format!("{} {cipher}", ssl.version_str())
        };
        let why = match (self.expect, ssl.peer_certificate()) {
            (Expect::Psk, Some(cert)) => format!(
                "the store presented an X.509 certificate (subject {}) instead",
                subject_of(&cert)
            ),
            (Expect::Psk, None) if !psk_session(ssl) => {
                format!("the session ({}) is not a PSK one", session())
            }
            (Expect::Certificate, None) => {
                format!("the store presented none (the session: {})", session())
            }
            _ => return Ok(()),
        };
        Err(io::Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "TLS handshake with the remote failed: expected {}; {why}",
                self.expected
            ),
        ))
    }
}

/// Whether `ssl`'s session was authenticated by a PSK: under TLS 1.3 the
/// store took the PSK offered (OpenSSL counts that as a session reused;
/// this client keeps no session to resume), under TLS 1.2 a PSK suite.
fn psk_session(ssl: &SslRef) -> bool {
    match ssl.version2() {
        Some(SslVersion::TLS1_3) => ssl.session_reused(),
        _ => ssl
            .current_cipher()
            .is_some_and(|c| c.name().contains("PSK")),
    }
}

/// `dir/client-cert.pem` and `dir/client-key.pem`, when present.
fn load_client_cert(b: &mut SslConnectorBuilder, dir: &Path) -> io::Result<()> {
    let cert = dir.join("client-cert.pem");
    let key = dir.join("client-key.pem");
    match (cert.is_file(), key.is_file()) {
        (false, false) => Ok(()),
        (true, true) => crate::tls::load_cert_and_key(b, &cert, &key).map_err(config_error),
        (c, _) => Err(config_error(format!(
            "{} is there but {} is not (a client certificate needs both)",
            if c { cert.display() } else { key.display() },
            if c { key.display() } else { cert.display() }
        ))),
    }
}

/// Wait up to `deadline` for `events` on `fd`.
///
/// **Returns:** `Ok(true)` when ready (or hung up: the next attempt sees
/// it), `Ok(false)` when the deadline passed.
pub(crate) fn poll_until(fd: i32, events: libc::c_short, deadline: Instant) -> io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r > 0 {
            return Ok(true);
        }
    }
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(ErrorKind::WouldBlock, format!("TLS: timed out {what}"))
}

/// An error of the session (after the handshake: a server refusing the
/// client's certificate under TLS 1.3 says so only now), named as TLS's.
fn ssl_io_error(e: openssl::ssl::Error) -> io::Error {
    match e.into_io_error() {
        Ok(io) => io::Error::new(io.kind(), format!("TLS session: {io}")),
        Err(e) => io::Error::new(ErrorKind::InvalidData, format!("TLS session: {e}")),
    }
}

/// A client TLS session on a non-blocking socket, shared by a
/// connection's reader and writers.
pub struct ClientTls {
    ssl: Mutex<SslStream<Stream>>,
    /// The socket, for `poll` and `shutdown`.
    sock: Stream,
    read_timeout_ns: AtomicU64,
    write_timeout_ns: AtomicU64,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("sock", &self.sock)
            .finish()
    }
}

impl ClientTls {
    /// Run the client handshake on `sock` (NBD_OPT_STARTTLS acknowledged)
    /// within `timeout`.
    ///
    /// **Returns:** `PermissionDenied` naming why the server was not
    /// accepted (its certificate's verification error and what it was
    /// checked against; a store that authenticated otherwise than asked:
    /// what was expected and what it offered) or why the handshake
    /// failed; `TimedOut`.
    pub(crate) fn connect(sock: Stream, c: &Connector, timeout: Duration) -> io::Result<ClientTls> {
        let deadline = Instant::now() + timeout;
        let raw = sock.try_clone()?;
        raw.set_nonblocking(true)?;
        let presented = Presented::default();
        let mut step = c.ssl(presented.clone())?.connect(raw);
        let fd = sock.as_raw_fd();
        loop {
            let mid = match step {
                Ok(s) => {
                    // Nothing has been sent through the session yet.
                    c.check_session(s.ssl())?;
                    return Ok(ClientTls {
                        ssl: Mutex::new(s),
                        sock,
                        read_timeout_ns: AtomicU64::new(timeout.as_nanos() as u64),
                        write_timeout_ns: AtomicU64::new(timeout.as_nanos() as u64),
                    });
                }
                Err(HandshakeError::WouldBlock(m)) => m,
                Err(HandshakeError::SetupFailure(e)) => return Err(setup_error(e)),
                Err(HandshakeError::Failure(m)) => {
                    let seen = presented.lock().take();
                    return Err(c.refusal(m.ssl(), m.error(), seen));
                }
            };
            let events = if mid.error().code() == ErrorCode::WANT_WRITE {
                libc::POLLOUT
            } else {
                libc::POLLIN
            };
            if !poll_until(fd, events, deadline)? {
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    format!("TLS handshake with the remote: no answer within {timeout:?}"),
                ));
            }
            step = mid.handshake();
        }
    }

    /// Reads and writes wait at most this long for the socket (then
    /// `WouldBlock`, as a socket timeout would).
    pub(crate) fn set_timeouts(&self, read: Duration, write: Duration) {
        self.read_timeout_ns
            .store(read.as_nanos() as u64, Ordering::Relaxed);
        self.write_timeout_ns
            .store(write.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Writes wait at most `write` for the socket (reads keep theirs).
    pub(crate) fn set_write_timeout(&self, write: Duration) {
        self.write_timeout_ns
            .store(write.as_nanos() as u64, Ordering::Relaxed);
    }

    fn deadline(ns: &AtomicU64) -> Instant {
        Instant::now() + Duration::from_nanos(ns.load(Ordering::Relaxed))
    }

    /// Read plaintext; `Ok(0)` at the end of the stream.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let deadline = Self::deadline(&self.read_timeout_ns);
        loop {
            let r = self.ssl.lock().ssl_read(buf);
            let events = match r {
                Ok(n) => return Ok(n),
                Err(e) => match e.code() {
                    ErrorCode::WANT_READ => libc::POLLIN,
                    ErrorCode::WANT_WRITE => libc::POLLOUT,
                    ErrorCode::ZERO_RETURN => return Ok(0),
                    ErrorCode::SYSCALL if e.io_error().is_none() => return Ok(0),
                    _ => return Err(ssl_io_error(e)),
                },
            };
            if !poll_until(self.sock.as_raw_fd(), events, deadline)? {
                return Err(timed_out("waiting for the remote's data"));
            }
        }
    }

    /// Seal and send a prefix of `buf`.
    pub(crate) fn write(&self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let deadline = Self::deadline(&self.write_timeout_ns);
        loop {
            let r = self.ssl.lock().ssl_write(buf);
            let (events, until) = match r {
                Ok(n) => return Ok(n),
                Err(e) => match e.code() {
                    ErrorCode::WANT_WRITE => (libc::POLLOUT, deadline),
                    ErrorCode::WANT_READ => (
                        libc::POLLIN,
                        deadline.min(Instant::now() + WRITE_WANTS_READ_SLICE),
                    ),
                    _ => return Err(ssl_io_error(e)),
                },
            };
            if !poll_until(self.sock.as_raw_fd(), events, until)? && Instant::now() >= deadline {
                return Err(timed_out("waiting for the remote to take data"));
            }
        }
    }

    /// Seal a prefix of `bufs`: small pieces gathered into one record.
    pub(crate) fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let Some(first) = bufs.iter().find(|b| !b.is_empty()) else {
            return Ok(0);
        };
        if first.len() >= GATHER_BYTES {
            return self.write(first);
        }
        // As large as what is gathered (a request header alone is 28
        // bytes), not a whole record each time.
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut gathered = Vec::with_capacity(total.min(GATHER_BYTES));
        for b in bufs {
            let room = GATHER_BYTES - gathered.len();
            if room == 0 {
                break;
            }
            gathered.extend_from_slice(&b[..b.len().min(room)]);
        }
        self.write(&gathered)
    }

    /// Send close_notify if it can leave at once, then shut `how` down.
    pub(crate) fn shutdown_how(&self, how: std::net::Shutdown) {
        if how != std::net::Shutdown::Read {
            let _ = self.ssl.lock().shutdown();
        }
        self.sock.shutdown_how(how);
    }

    /// The socket's descriptor.
    pub(crate) fn raw_fd(&self) -> i32 {
        self.sock.as_raw_fd()
    }
}
