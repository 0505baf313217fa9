//! TLS credentials for NBD_OPT_STARTTLS: X.509 or pre-shared keys.
//!
//! Owns: loading a server certificate and key from a directory laid out
//! as qemu, nbdkit and libnbd lay theirs out (`server-cert.pem`,
//! `server-key.pem`, and `ca-cert.pem` for verifying client
//! certificates), or a psktool-format key file (`identity:hexkey` lines),
//! into an OpenSSL acceptor; and the mode (`on`: offered, `require`: no
//! option but STARTTLS and ABORT before it). Must never: start with
//! credentials it could not load whole (every error names the file and
//! what is wrong), or accept a PSK client whose identity is not in the
//! file. The session these credentials start, and what it proves about a
//! client, are `session.rs`'s; the PSK file format and suites serve
//! the remote client (`client/tls.rs`) too.

use openssl::ssl::{
    SslAcceptor, SslAcceptorBuilder, SslFiletype, SslMethod, SslOptions, SslVerifyMode, SslVersion,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use zeroize::Zeroizing;

/// Largest key file read (a psktool file holds a few lines).
const MAX_PSK_FILE_BYTES: u64 = 1 << 20;
/// Longest pre-shared key (OpenSSL's PSK_MAX_PSK_LEN).
const MAX_PSK_BYTES: usize = 512;
/// Longest PSK identity (OpenSSL's PSK_MAX_IDENTITY_LEN).
const MAX_PSK_IDENTITY_BYTES: usize = 128;

/// Whether TLS is offered, and whether it is required.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// STARTTLS is offered; clients may also stay in plaintext.
    On,
    /// Every option before STARTTLS, except ABORT, is refused with
    /// NBD_REP_ERR_TLS_REQD (the protocol's FORCEDTLS mode).
    Require,
}

/// TLS credentials and mode for a server.
#[derive(Clone)]
pub struct TlsConfig {
    pub(crate) acceptor: Arc<SslAcceptor>,
    pub(crate) mode: TlsMode,
    kind: &'static str,
    /// Clients must present a certificate that verifies.
    verify_peer: bool,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("mode", &self.mode)
            .field("kind", &self.kind)
            .finish()
    }
}

fn err(what: impl std::fmt::Display) -> crate::Error {
    crate::Error::Config(what.to_string())
}

/// Mozilla's intermediate profile (TLS 1.2 and 1.3, AEAD suites only),
/// with the server's order of preference: AES-128-GCM first, which both
/// ends compute faster than AES-256-GCM with AES instructions (the
/// client's libraries often list AES-256 first).
fn acceptor() -> crate::Result<SslAcceptorBuilder> {
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
        .map_err(|e| err(format!("TLS: {e}")))?;
    b.set_options(SslOptions::CIPHER_SERVER_PREFERENCE);
    // Read whatever has arrived into the record buffer at once, not a
    // record's header and then its body (two system calls per record).
    b.set_read_ahead(true);
    Ok(b)
}

impl TlsConfig {
    /// X.509: the server's certificate (chain) and key from
    /// `dir/server-cert.pem` and `dir/server-key.pem`; with `verify_peer`,
    /// clients must present a certificate signed by `dir/ca-cert.pem`.
    ///
    /// **Returns:** [`crate::Error::Config`] naming the file that is
    /// missing or unusable, or a key that does not match the certificate.
    pub fn x509(dir: &Path, verify_peer: bool, mode: TlsMode) -> crate::Result<TlsConfig> {
        let cert = dir.join("server-cert.pem");
        let key = dir.join("server-key.pem");
        let ca = dir.join("ca-cert.pem");
        for f in [&cert, &key] {
            if !f.is_file() {
                return Err(err(format!(
                    "TLS certificates: {} is missing (the directory needs server-cert.pem and server-key.pem{})",
                    f.display(),
                    if verify_peer { ", and ca-cert.pem for --tls-verify-peer" } else { "" }
                )));
            }
        }
        let mut b = acceptor()?;
        load_cert_and_key(&mut b, &cert, &key).map_err(|e| err(format!("TLS: {e}")))?;
        if verify_peer {
            if !ca.is_file() {
                return Err(err(format!(
                    "TLS: --tls-verify-peer needs {} (the CA that signs client certificates)",
                    ca.display()
                )));
            }
            b.set_ca_file(&ca)
                .map_err(|e| err(format!("TLS: cannot load {}: {e}", ca.display())))?;
            let names = openssl::x509::X509Name::load_client_ca_file(&ca)
                .map_err(|e| err(format!("TLS: cannot load {}: {e}", ca.display())))?;
            b.set_client_ca_list(names);
            b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        }
        Ok(TlsConfig {
            acceptor: Arc::new(b.build()),
            mode,
            kind: "x509",
            verify_peer,
        })
    }

    /// Pre-shared keys from `file`, in psktool's format: one
    /// `identity:hexkey` per line. A client must name one of the
    /// identities and prove it holds that key.
    ///
    /// **Returns:** [`crate::Error::Config`] naming the file and line of
    /// anything malformed, or an empty file.
    pub fn psk(file: &Path, mode: TlsMode) -> crate::Result<TlsConfig> {
        let keys = Arc::new(read_psk_file(file)?);
        let mut b = acceptor()?;
        // TLS 1.3 takes an external PSK through the same callback when the
        // suite's hash is SHA-256; TLS 1.2 clients get the (EC)DHE-PSK
        // suites (forward secrecy), then plain PSK.
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(|e| err(format!("TLS: {e}")))?;
        b.set_ciphersuites(PSK_TLS13_SUITES)
            .map_err(|e| err(format!("TLS: {e}")))?;
        b.set_cipher_list(PSK_TLS12_CIPHERS)
            .map_err(|e| err(format!("TLS: {e}")))?;
        // Where the session keeps the identity for the session to read.
        let index = crate::tls::verify::psk_identity_index()?;
        b.set_psk_server_callback(move |ssl, identity, out| {
            let (id, key) = identity
                .and_then(|id| keys.get_key_value(id))
                .ok_or_else(openssl::error::ErrorStack::get)?;
            if key.len() > out.len() {
                return Err(openssl::error::ErrorStack::get());
            }
            // Kept on the session: under TLS 1.3 OpenSSL does not keep the
            // identity (SSL_get_psk_identity returns NULL there).
            ssl.set_ex_data(index, id.clone());
            out[..key.len()].copy_from_slice(key);
            Ok(key.len())
        });
        Ok(TlsConfig {
            acceptor: Arc::new(b.build()),
            mode,
            kind: "psk",
            verify_peer: false,
        })
    }

    /// The mode.
    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    /// `"x509"` or `"psk"`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Whether clients must present a certificate that verifies (X.509
    /// with `verify_peer`).
    pub fn verifies_peer(&self) -> bool {
        self.verify_peer
    }
}

type PskKeys = HashMap<Vec<u8>, Zeroizing<Vec<u8>>>;

/// Parse a psktool key file: `identity:hexkey` lines, blank lines
/// skipped.
pub(crate) fn read_psk_file(file: &Path) -> crate::Result<PskKeys> {
    use std::io::Read;
    let name = file.display();
    let f = std::fs::File::open(file)
        .map_err(|e| err(format!("TLS: cannot open the PSK file {name}: {e}")))?;
    let mut text = Zeroizing::new(Vec::with_capacity(4096));
    f.take(MAX_PSK_FILE_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| err(format!("TLS: cannot read the PSK file {name}: {e}")))?;
    if text.len() as u64 > MAX_PSK_FILE_BYTES {
        return Err(err(format!(
            "TLS: the PSK file {name} is larger than {MAX_PSK_FILE_BYTES} bytes"
        )));
    }
    parse_psk(&text).map_err(|m| err(format!("TLS: PSK file {name}: {m}")))
}

pub(crate) fn parse_psk(text: &[u8]) -> Result<PskKeys, String> {
    let mut keys = PskKeys::new();
    for (i, line) in text.split(|&b| b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let n = i + 1;
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return Err(format!("line {n}: expected identity:hexkey"));
        };
        let (id, hex) = (&line[..colon], &line[colon + 1..]);
        if id.is_empty() || id.len() > MAX_PSK_IDENTITY_BYTES {
            return Err(format!(
                "line {n}: the identity must be 1 to {MAX_PSK_IDENTITY_BYTES} bytes"
            ));
        }
        if hex.is_empty() || hex.len() % 2 != 0 || hex.len() / 2 > MAX_PSK_BYTES {
            return Err(format!(
                "line {n}: the key must be an even number of hex digits, at most {} bytes",
                MAX_PSK_BYTES
            ));
        }
        let mut key = Zeroizing::new(vec![0u8; hex.len() / 2]);
        for (j, pair) in hex.chunks_exact(2).enumerate() {
            let digit = |c: u8| (c as char).to_digit(16);
            match (digit(pair[0]), digit(pair[1])) {
                (Some(h), Some(l)) => key[j] = (h * 16 + l) as u8,
                _ => return Err(format!("line {n}: the key is not hexadecimal")),
            }
        }
        if keys.insert(id.to_vec(), key).is_some() {
            return Err(format!(
                "line {n}: identity {:?} appears twice",
                String::from_utf8_lossy(id)
            ));
        }
    }
    if keys.is_empty() {
        return Err("no keys (expected identity:hexkey lines)".into());
    }
    Ok(keys)
}

/// The TLS 1.3 suites of a PSK session (the callback's key is used with a
/// SHA-256 suite), for the server and the remote client alike.
pub(crate) const PSK_TLS13_SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";
/// The TLS 1.2 ciphers of a PSK session: the (EC)DHE-PSK suites (forward
/// secrecy), then plain PSK.
pub(crate) const PSK_TLS12_CIPHERS: &str =
    "ECDHE-PSK-AES128-CBC-SHA256:ECDHE-PSK-CHACHA20-POLY1305:DHE-PSK-AES128-GCM-SHA256:\
     DHE-PSK-AES256-GCM-SHA384:DHE-PSK-CHACHA20-POLY1305:PSK-AES128-GCM-SHA256:\
     PSK-AES256-GCM-SHA384";

/// Load a certificate chain and its private key into `b` and check that
/// they match; the error names the file at fault.
pub(crate) fn load_cert_and_key(
    b: &mut openssl::ssl::SslContextBuilder,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<(), String> {
    b.set_certificate_chain_file(cert)
        .map_err(|e| format!("cannot load {}: {e}", cert.display()))?;
    b.set_private_key_file(key, SslFiletype::PEM)
        .map_err(|e| format!("cannot load {}: {e}", key.display()))?;
    b.check_private_key()
        .map_err(|e| format!("{} does not match {}: {e}", key.display(), cert.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_and_bad_ones_say_where() {
        let k = parse_psk(b"alice:00ff10\n\nbob:0A0b\r\n").unwrap();
        assert_eq!(&k[&b"alice".to_vec()][..], &[0x00, 0xff, 0x10]);
        assert_eq!(&k[&b"bob".to_vec()][..], &[0x0a, 0x0b]);
        for (bad, what) in [
            (&b"alice"[..], "line 1"),
            (b"alice:0", "line 1"),
            (b"a:00\nb:zz", "line 2"),
            (b":00", "line 1"),
            (b"a:00\na:11", "twice"),
            (b"\n\n", "no keys"),
        ] {
            let e = parse_psk(bad).unwrap_err();
            assert!(e.contains(what), "{e}");
        }
        let long = format!("a:{}", "00".repeat(MAX_PSK_BYTES + 1));
        assert!(parse_psk(long.as_bytes()).is_err());
    }
}
