//! Test certificates: the X.509 files and PSK keys of TLS runs, made
//! afresh for each run or test (nothing secret is committed).
//!
//! Owns: a CA, a server and a client certificate (and an unrelated CA with
//! a client of its own) in the directory layout qemu, nbdkit, libnbd and
//! `iopages serve --tls-certificates` read, and psktool-format PSK files.
//! Private keys are written 0600. Must never: be used for anything but
//! tests and benchmarks — the keys sit unencrypted beside the certificates.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The X.509 files of a TLS run, each directory in the layout qemu, nbdkit,
/// libnbd and `iopages serve --tls-certificates` read: `ca-cert.pem`, and
/// `server-cert.pem`/`server-key.pem` or `client-cert.pem`/`client-key.pem`.
#[derive(Clone, Debug)]
pub struct Pki {
    /// The server's: its certificate (CN and SAN localhost, SAN IP
    /// 127.0.0.1, serverAuth), its key and the CA's certificate.
    pub server: PathBuf,
    /// A client's: the CA's certificate and a client certificate
    /// (clientAuth) with its key.
    pub client: PathBuf,
    /// The CA's certificate only: a client that checks the server but has
    /// no certificate of its own.
    pub client_no_cert: PathBuf,
    /// Another CA's certificate, and a client certificate that CA signed:
    /// the server's certificate does not verify against it, and a server
    /// checking its clients refuses its certificate.
    pub foreign: PathBuf,
}

/// Make a CA, a server and a client certificate (and a second, unrelated
/// CA with a client of its own) under `dir`, in the directories of [`Pki`].
/// RSA 2048 keys, SHA-256 signatures, valid from a day ago for a year; the
/// extensions GnuTLS and qemu insist on (CA:TRUE and keyCertSign on the CA;
/// digitalSignature, keyEncipherment and serverAuth / clientAuth on the
/// leaves). Private keys are written 0600.
pub fn write_pki(dir: &Path) -> Result<Pki, String> {
    let ca = Issued::ca("iopages test CA")?;
    let foreign_ca = Issued::ca("iopages unrelated CA")?;
    let server = Issued::leaf(&ca, "localhost", true)?;
    let client = Issued::leaf(&ca, "iopages client", false)?;
    let foreign_client = Issued::leaf(&foreign_ca, "iopages client", false)?;
    let pki = Pki {
        server: dir.join("server"),
        client: dir.join("client"),
        client_no_cert: dir.join("client-no-cert"),
        foreign: dir.join("foreign"),
    };
    ca.write_cert(&pki.server, "ca-cert.pem")?;
    server.write_cert(&pki.server, "server-cert.pem")?;
    server.write_key(&pki.server, "server-key.pem")?;
    ca.write_cert(&pki.client, "ca-cert.pem")?;
    client.write_cert(&pki.client, "client-cert.pem")?;
    client.write_key(&pki.client, "client-key.pem")?;
    ca.write_cert(&pki.client_no_cert, "ca-cert.pem")?;
    foreign_ca.write_cert(&pki.foreign, "ca-cert.pem")?;
    foreign_client.write_cert(&pki.foreign, "client-cert.pem")?;
    foreign_client.write_key(&pki.foreign, "client-key.pem")?;
    Ok(pki)
}

/// Write a PSK file in psktool's format (`identity:hexkey`, one line) with
/// a fresh random 256-bit key; returns the key's hex.
pub fn write_psk(path: &Path, identity: &str) -> Result<String, String> {
    let mut key = [0u8; 32];
    openssl::rand::rand_bytes(&mut key).map_err(|e| format!("no random bytes: {e}"))?;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    write_private(path, format!("{identity}:{hex}\n").as_bytes())?;
    Ok(hex)
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// A key and the certificate issued for it.
struct Issued {
    key: openssl::pkey::PKey<openssl::pkey::Private>,
    cert: openssl::x509::X509,
}

impl Issued {
    fn new_key() -> Result<openssl::pkey::PKey<openssl::pkey::Private>, openssl::error::ErrorStack>
    {
        openssl::pkey::PKey::from_rsa(openssl::rsa::Rsa::generate(2048)?)
    }

    /// A builder with the common fields: version 3, random serial, validity
    /// from a day ago for a year, subject CN, the public key.
    fn builder(
        cn: &str,
        key: &openssl::pkey::PKey<openssl::pkey::Private>,
    ) -> Result<(openssl::x509::X509Builder, openssl::x509::X509Name), openssl::error::ErrorStack>
    {
        use openssl::asn1::{Asn1Integer, Asn1Time};
        use openssl::bn::{BigNum, MsbOption};
        let mut name = openssl::x509::X509NameBuilder::new()?;
        name.append_entry_by_nid(openssl::nid::Nid::COMMONNAME, cn)?;
        let name = name.build();
        let mut b = openssl::x509::X509Builder::new()?;
        b.set_version(2)?;
        let mut serial = BigNum::new()?;
        serial.rand(120, MsbOption::MAYBE_ZERO, false)?;
        b.set_serial_number(Asn1Integer::from_bn(&serial)?.as_ref())?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()) as libc::time_t;
        b.set_not_before(Asn1Time::from_unix(now - 86_400)?.as_ref())?;
        b.set_not_after(Asn1Time::days_from_now(365)?.as_ref())?;
        b.set_subject_name(&name)?;
        b.set_pubkey(key)?;
        Ok((b, name))
    }

    fn ca(cn: &str) -> Result<Issued, String> {
        use openssl::x509::extension::{BasicConstraints, KeyUsage, SubjectKeyIdentifier};
        let make = || -> Result<Issued, openssl::error::ErrorStack> {
            let key = Self::new_key()?;
            let (mut b, name) = Self::builder(cn, &key)?;
            b.set_issuer_name(&name)?;
            b.append_extension(BasicConstraints::new().critical().ca().build()?)?;
            b.append_extension(
                KeyUsage::new()
                    .critical()
                    .key_cert_sign()
                    .crl_sign()
                    .build()?,
            )?;
            let ski = SubjectKeyIdentifier::new().build(&b.x509v3_context(None, None))?;
            b.append_extension(ski)?;
            b.sign(&key, openssl::hash::MessageDigest::sha256())?;
            Ok(Issued {
                key,
                cert: b.build(),
            })
        };
        make().map_err(|e| format!("cannot make the CA certificate: {e}"))
    }

    /// A server (serverAuth, SAN DNS:localhost and IP:127.0.0.1) or client
    /// (clientAuth) certificate signed by `ca`.
    fn leaf(ca: &Issued, cn: &str, server: bool) -> Result<Issued, String> {
        use openssl::x509::extension::{
            AuthorityKeyIdentifier, BasicConstraints, ExtendedKeyUsage, KeyUsage,
            SubjectAlternativeName, SubjectKeyIdentifier,
        };
        let make = || -> Result<Issued, openssl::error::ErrorStack> {
            let key = Self::new_key()?;
            let (mut b, _) = Self::builder(cn, &key)?;
            b.set_issuer_name(ca.cert.subject_name())?;
            b.append_extension(BasicConstraints::new().critical().build()?)?;
            b.append_extension(
                KeyUsage::new()
                    .critical()
                    .digital_signature()
                    .key_encipherment()
                    .build()?,
            )?;
            let mut eku = ExtendedKeyUsage::new();
            if server {
                eku.server_auth();
            } else {
                eku.client_auth();
            }
            b.append_extension(eku.build()?)?;
            if server {
                let san = SubjectAlternativeName::new()
                    .dns("localhost")
                    .ip("127.0.0.1")
                    .build(&b.x509v3_context(Some(&ca.cert), None))?;
                b.append_extension(san)?;
            }
            let ski = SubjectKeyIdentifier::new().build(&b.x509v3_context(Some(&ca.cert), None))?;
            b.append_extension(ski)?;
            let aki = AuthorityKeyIdentifier::new()
                .keyid(true)
                .build(&b.x509v3_context(Some(&ca.cert), None))?;
            b.append_extension(aki)?;
            b.sign(&ca.key, openssl::hash::MessageDigest::sha256())?;
            Ok(Issued {
                key,
                cert: b.build(),
            })
        };
        make().map_err(|e| format!("cannot make the {cn} certificate: {e}"))
    }

    fn write_cert(&self, dir: &Path, name: &str) -> Result<(), String> {
        let pem = self
            .cert
            .to_pem()
            .map_err(|e| format!("cannot encode {name}: {e}"))?;
        std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(dir.join(name), pem))
            .map_err(|e| format!("cannot write {}: {e}", dir.join(name).display()))
    }

    fn write_key(&self, dir: &Path, name: &str) -> Result<(), String> {
        let pem = self
            .key
            .private_key_to_pem_pkcs8()
            .map_err(|e| format!("cannot encode {name}: {e}"))?;
        write_private(&dir.join(name), &pem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory under the temporary one, removed when dropped.
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn scratch(tag: &str) -> Scratch {
        let d =
            std::env::temp_dir().join(format!("iopages-tools-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }

    #[test]
    fn pki_chains_to_its_ca_only_and_has_the_usages_gnutls_wants() {
        use openssl::stack::Stack;
        use openssl::x509::store::X509StoreBuilder;
        use openssl::x509::{X509StoreContext, X509};
        let dir = scratch("pki");
        let pki = write_pki(&dir.0).unwrap();
        let cert = |d: &Path, n: &str| X509::from_pem(&std::fs::read(d.join(n)).unwrap()).unwrap();
        let verifies = |ca: &X509, leaf: &X509| {
            let mut b = X509StoreBuilder::new().unwrap();
            b.add_cert(ca.clone()).unwrap();
            let store = b.build();
            let mut ctx = X509StoreContext::new().unwrap();
            ctx.init(&store, leaf, &Stack::new().unwrap(), |c| c.verify_cert())
                .unwrap()
        };
        let ca = cert(&pki.server, "ca-cert.pem");
        let server = cert(&pki.server, "server-cert.pem");
        let client = cert(&pki.client, "client-cert.pem");
        let foreign_ca = cert(&pki.foreign, "ca-cert.pem");
        let foreign_client = cert(&pki.foreign, "client-cert.pem");
        assert!(verifies(&ca, &server));
        assert!(verifies(&ca, &client));
        assert!(verifies(&foreign_ca, &foreign_client));
        assert!(!verifies(&foreign_ca, &server));
        assert!(!verifies(&ca, &foreign_client));
        assert_eq!(
            cert(&pki.client_no_cert, "ca-cert.pem").to_pem().unwrap(),
            ca.to_pem().unwrap()
        );
        assert!(!pki.client_no_cert.join("client-cert.pem").exists());
        let text = |c: &X509| String::from_utf8(c.to_text().unwrap()).unwrap();
        let (ca_t, server_t, client_t) = (text(&ca), text(&server), text(&client));
        assert!(
            ca_t.contains("CA:TRUE") && ca_t.contains("Certificate Sign"),
            "{ca_t}"
        );
        assert!(
            server_t.contains("TLS Web Server Authentication"),
            "{server_t}"
        );
        assert!(server_t.contains("DNS:localhost") && server_t.contains("IP Address:127.0.0.1"));
        assert!(server_t.contains("Key Encipherment") && server_t.contains("sha256"));
        assert!(
            client_t.contains("TLS Web Client Authentication"),
            "{client_t}"
        );
        // The keys match their certificates and are private to us.
        use std::os::unix::fs::PermissionsExt;
        for (d, c, k) in [
            (&pki.server, &server, "server-key.pem"),
            (&pki.client, &client, "client-key.pem"),
        ] {
            let key = openssl::pkey::PKey::private_key_from_pem(&std::fs::read(d.join(k)).unwrap())
                .unwrap();
            assert!(c.public_key().unwrap().public_eq(&key));
            assert_eq!(
                std::fs::metadata(d.join(k)).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
        // psktool's format: identity:hex, one line.
        let psk = dir.0.join("keys.psk");
        let hex = write_psk(&psk, "alice").unwrap();
        assert_eq!(hex.len(), 64);
        assert_eq!(
            std::fs::read_to_string(&psk).unwrap(),
            format!("alice:{hex}\n")
        );
        assert_ne!(write_psk(&psk, "alice").unwrap(), hex);
    }
}
