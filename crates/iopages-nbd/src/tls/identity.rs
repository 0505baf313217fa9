//! What a finished TLS handshake proved about the other end, and how a
//! certificate's subject is spelled (RFC 4514).
//!
//! Owns: [`TlsIdentity`] (a PSK identity, or a verified certificate's
//! subject) and the RFC 4514 string of an X.509 name. Must never: take
//! anything the peer merely *says* as an identity — only what the
//! session's verification established (`verify.rs` decides that).

/// What a finished TLS handshake proved about the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsIdentity {
    /// The PSK identity (user name) whose key the client holds.
    Psk(String),
    /// The subject of the client's verified certificate, as an RFC 4514
    /// string (`CN=alice,O=example`).
    Subject(String),
}

/// A certificate subject as an RFC 4514 string: the attributes in reverse
/// order of the certificate's (most specific first), each `TYPE=value`
/// with RFC 4514's escapes, joined by commas. Each attribute is written
/// as its own RDN (a multi-valued RDN's parts are joined by commas too,
/// not `+`: the `openssl` crate does not expose the grouping).
pub(crate) fn rfc4514(name: &openssl::x509::X509NameRef) -> String {
    let mut parts: Vec<String> = Vec::new();
    for e in name.entries() {
        let nid = e.object().nid();
        let kind = nid
            .short_name()
            .map_or_else(|_| e.object().to_string(), str::to_string);
        let value = match e.data().to_string() {
            Ok(v) => escape_rfc4514(&v),
            Err(_) => format!("#{}", hex(e.data().as_slice())),
        };
        parts.push(format!("{kind}={value}"));
    }
    parts.reverse();
    parts.join(",")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// RFC 4514 section 2.4: `"+,;<>\` and NUL anywhere, `#` or a space
/// first, a space last.
fn escape_rfc4514(v: &str) -> String {
    let n = v.chars().count();
    let mut out = String::with_capacity(v.len());
    for (i, c) in v.chars().enumerate() {
        let special = matches!(c, '"' | '+' | ',' | ';' | '<' | '>' | '\\')
            || (i == 0 && (c == '#' || c == ' '))
            || (i + 1 == n && c == ' ');
        if c == '\0' {
            out.push_str("\\00");
        } else {
            if special {
                out.push('\\');
            }
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_escape_as_rfc4514_says() {
        assert_eq!(escape_rfc4514("a,b+c"), "a\\,b\\+c");
        assert_eq!(escape_rfc4514("#x "), "\\#x\\ ");
        assert_eq!(escape_rfc4514(" a"), "\\ a");
        assert_eq!(escape_rfc4514("plain name"), "plain name");
        let mut b = openssl::x509::X509NameBuilder::new().unwrap();
        b.append_entry_by_text("O", "iopages test").unwrap();
        b.append_entry_by_text("CN", "alice, admin").unwrap();
        let n = b.build();
        assert_eq!(rfc4514(&n), "CN=alice\\, admin,O=iopages test");
    }
}
