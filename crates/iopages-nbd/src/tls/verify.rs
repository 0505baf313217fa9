//! What each end of a TLS session checks of the other: the one place
//! that says who a peer proved to be.
//!
//! Owns: what the server learns of a client ([`client_identity`]: the
//! PSK identity its key was found for, kept on the session by the PSK
//! callback, or the RFC 4514 subject of a client certificate that
//! verified) and what the remote client demands of a store
//! ([`StoreCheck`]: a PSK handshake with the URI's identity, or an X.509
//! certificate that verifies against the URI's CA and host name — set on
//! the connector, on each connection's verification, and checked again
//! once the handshake is done), with the messages that say why a store
//! was refused. Must never: report an identity the handshake did not
//! prove (an unverified certificate proves nothing); let a store
//! authenticate otherwise than asked — with a PSK, any certificate it
//! presents (TLS 1.3 lets a store answer a PSK with one) fails the
//! handshake, with certificates a store presenting none fails; or put
//! text from the peer into a message unbounded or with control
//! characters.

use crate::tls::identity::TlsIdentity;
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{Ssl, SslConnector, SslConnectorBuilder, SslRef, SslVerifyMode, SslVersion};
use openssl::x509::{X509Ref, X509StoreContextRef, X509VerifyResult};
use parking_lot::Mutex;
use std::io::{self, ErrorKind};
use std::path::Path;
use std::sync::Arc;

/// Where a server session keeps the PSK identity its key was found for
/// (one index for the process, made on first use): the PSK callback
/// (`config.rs`) sets it, [`client_identity`] reads it.
pub(crate) fn psk_identity_index() -> crate::Result<Index<Ssl, Vec<u8>>> {
    static INDEX: std::sync::OnceLock<Index<Ssl, Vec<u8>>> = std::sync::OnceLock::new();
    if let Some(i) = INDEX.get() {
        return Ok(*i);
    }
    let i = Ssl::new_ex_index().map_err(|e| crate::Error::Config(format!("TLS: {e}")))?;
    Ok(*INDEX.get_or_init(|| i))
}

/// What a finished server handshake (`ssl`) proved about the client: its
/// PSK identity, or the subject of a client certificate that verified
/// (`None` with an unverified or absent certificate).
pub(crate) fn client_identity(ssl: &SslRef) -> Option<TlsIdentity> {
    // The identity the server's PSK callback found a key for (TLS 1.2 and
    // 1.3 alike; OpenSSL's own record of it is empty under 1.3).
    let kept = psk_identity_index().ok().and_then(|i| ssl.ex_data(i));
    if let Some(id) = kept.map(Vec::as_slice).or_else(|| ssl.psk_identity()) {
        return Some(TlsIdentity::Psk(String::from_utf8_lossy(id).into_owned()));
    }
    if ssl.verify_result() != X509VerifyResult::OK {
        return None;
    }
    let cert = ssl.peer_certificate()?;
    Some(TlsIdentity::Subject(crate::tls::identity::rfc4514(
        cert.subject_name(),
    )))
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

/// What the remote client demands of a store, and the words for it.
#[derive(Clone, Debug)]
pub(crate) struct StoreCheck {
    /// `Some`: verify the certificate and this name; `None`: PSK, or
    /// verification off.
    verify_name: Option<String>,
    expect: Expect,
    /// What was asked, for a refusal's message: `a PSK handshake as
    /// identity "alice" (from FILE)` or `an X.509 certificate from the
    /// store (checked against …)`.
    expected: String,
    /// What was checked against, for a failed handshake's message.
    checked_against: String,
}

/// The subject of the certificate a store presented, as noted during a
/// connection's handshake (`None` until one is presented).
pub(super) type Presented = Arc<Mutex<Option<String>>>;

impl StoreCheck {
    /// A PSK handshake as `user`, whose key comes from `file`.
    pub(crate) fn psk(user: &str, file: &Path) -> StoreCheck {
        let from = file.display();
        StoreCheck {
            verify_name: None,
            expect: Expect::Psk,
            expected: format!("a PSK handshake as identity {user:?} (from {from})"),
            checked_against: format!("PSK identity {user:?} from {from}"),
        }
    }

    /// An X.509 certificate, verified against `ca` (the CA file or store,
    /// in words) and `name` — or, with `name` `None`
    /// (`tls-verify-peer=false`), not verified at all.
    pub(crate) fn certificate(name: Option<String>, ca: &str) -> StoreCheck {
        let checked_against = match &name {
            Some(n) => format!("{ca}, host name {n:?}"),
            None => "nothing (tls-verify-peer=false)".to_string(),
        };
        StoreCheck {
            verify_name: name,
            expect: Expect::Certificate,
            expected: format!(
                "an X.509 certificate from the store (checked against {checked_against})"
            ),
            checked_against,
        }
    }

    /// Set the connector's own verification: with a PSK every certificate
    /// fails (each connection sets this again, noting the certificate for
    /// the message: [`StoreCheck::ssl`]); with verification off, none is
    /// checked.
    pub(crate) fn configure(&self, b: &mut SslConnectorBuilder) {
        match (self.expect, &self.verify_name) {
            (Expect::Psk, _) => b.set_verify_callback(SslVerifyMode::PEER, |_, _| false),
            (Expect::Certificate, None) => b.set_verify(SslVerifyMode::NONE),
            (Expect::Certificate, Some(_)) => {}
        }
    }

    /// A connection's TLS state, its verification noting into `presented`
    /// the subject of any certificate the store presents; with a PSK,
    /// every certificate fails.
    pub(super) fn ssl(
        &self,
        connector: &SslConnector,
        presented: Presented,
    ) -> Result<Ssl, ErrorStack> {
        let mut cfg = connector.configure()?;
        let name = match &self.verify_name {
            Some(n) => n.as_str(),
            None => {
                cfg.set_verify_hostname(false);
                cfg.set_use_server_name_indication(false);
                ""
            }
        };
        let mut ssl = cfg.into_ssl(name)?;
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
    pub(super) fn refusal(
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
        let why = match (self.expect, presented) {
            (Expect::Psk, Some(subject)) => format!(
                "expected {}; the store presented an X.509 certificate (subject {subject}) instead",
                self.expected
            ),
            (Expect::Psk, None) => self.psk_refused(&what),
            (Expect::Certificate, None) => format!(
                "expected {}; the store presented none{}: {what}",
                self.expected,
                if no_common_suite(&what) {
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

    /// Why a PSK handshake failed with no certificate presented (`what`:
    /// OpenSSL's reason).
    fn psk_refused(&self, what: &str) -> String {
        let expected = &self.expected;
        if no_common_suite(what) {
            format!(
                "expected {expected}; the store took none of the PSK cipher suites offered, \
                 as a store with a certificate and no PSK does ({what})"
            )
        } else if what.contains("alert unknown psk identity") {
            format!("expected {expected}; the store has no key for that identity ({what})")
        } else {
            format!("expected {expected}; the store did not complete it: {what}")
        }
    }

    /// After a completed handshake, before any application data: the
    /// store authenticated as asked — with a PSK, no certificate and a
    /// PSK session; with certificates, a certificate (the verification
    /// already checked it).
    pub(super) fn check_session(&self, ssl: &SslRef) -> io::Result<()> {
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

/// Whether OpenSSL's reason `what` is the alert a store with no suite in
/// common sends.
fn no_common_suite(what: &str) -> bool {
    what.contains("alert handshake failure")
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

/// A certificate's subject as `CN=…, O=…`, for a message: it comes from
/// the peer, so control characters are dropped and it is cut at 200
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
