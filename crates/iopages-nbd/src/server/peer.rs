//! Who a client is: the peer a connection belongs to, for fair shares and
//! for the exports' `allow` rules.
//!
//! Owns: a connection's [`Peer`] (where it came from — an IP address, or
//! the uid and gid of a Unix socket's other end — and, once TLS is
//! established, the identity it proved: a PSK user name or its client
//! certificate's subject as an RFC 4514 string), the key its fair share
//! is kept under, and the [`AllowRule`]s an export is guarded by. Must
//! never: take anything a client *says* (an export name, an option) as
//! its identity — only what the socket or a finished TLS handshake
//! proves; or let a TLS rule match a connection that is not under TLS.

use crate::tls::identity::TlsIdentity;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// Where a connection comes from, as the socket tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// A TCP peer's address.
    Ip(IpAddr),
    /// A Unix socket's peer credentials (SO_PEERCRED).
    Unix {
        /// The peer process's user id.
        uid: u32,
        /// The peer process's group id.
        gid: u32,
    },
    /// Nothing could be read (a Unix socket without credentials).
    Unknown,
}

/// A connection's peer: where it comes from and, once it has one, the
/// identity TLS proved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Peer {
    pub(crate) origin: Origin,
    pub(crate) tls: Option<TlsIdentity>,
}

impl Peer {
    /// The key its fair share is kept under: the TLS identity once it has
    /// one (so one tenant's connections from several hosts share one
    /// share), else its IPv4 address, its IPv6 /64 (a host commonly holds
    /// a whole /64), or its uid on a Unix socket.
    pub(crate) fn share_key(&self) -> String {
        match (&self.tls, self.origin) {
            (Some(TlsIdentity::Psk(n)), _) => format!("psk:{n}"),
            (Some(TlsIdentity::Subject(s)), _) => format!("dn:{s}"),
            (None, Origin::Ip(IpAddr::V4(a))) => format!("ip:{a}"),
            (None, Origin::Ip(IpAddr::V6(a))) => match a.to_ipv4_mapped() {
                Some(v4) => format!("ip:{v4}"),
                None => {
                    let s = a.segments();
                    format!("ip:{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
                }
            },
            (None, Origin::Unix { uid, .. }) => format!("uid:{uid}"),
            (None, Origin::Unknown) => "unknown".into(),
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.share_key())
    }
}

/// One rule of an export's `allow` list: who may use the export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowRule {
    /// `psk:NAME`: a TLS session under this PSK identity.
    Psk(String),
    /// `dn:SUBJECT`: a TLS session whose verified client certificate has
    /// exactly this subject (RFC 4514 string).
    Subject(String),
    /// `uid:N`: a Unix socket peer running as this user.
    Uid(u32),
    /// `gid:N`: a Unix socket peer running with this group.
    Gid(u32),
    /// `ip:CIDR`: a TCP peer in this network (a bare address is one host).
    Ip(IpAddr, u8),
}

impl AllowRule {
    /// Whether the rule names a TLS identity (it needs `--tls require`).
    pub fn needs_tls(&self) -> bool {
        matches!(self, AllowRule::Psk(_) | AllowRule::Subject(_))
    }

    /// Whether `p` matches this rule.
    pub(crate) fn allows(&self, p: &Peer) -> bool {
        match (self, &p.tls, p.origin) {
            (AllowRule::Psk(n), Some(TlsIdentity::Psk(id)), _) => n == id,
            (AllowRule::Subject(s), Some(TlsIdentity::Subject(d)), _) => s == d,
            (AllowRule::Uid(u), _, Origin::Unix { uid, .. }) => *u == uid,
            (AllowRule::Gid(g), _, Origin::Unix { gid, .. }) => *g == gid,
            (AllowRule::Ip(net, bits), _, Origin::Ip(a)) => in_network(a, *net, *bits),
            _ => false,
        }
    }
}

/// Whether the export guarded by `rules` admits `p` (no rule: anyone).
pub(crate) fn allowed(rules: &[AllowRule], p: &Peer) -> bool {
    rules.is_empty() || rules.iter().any(|r| r.allows(p))
}

/// Whether `a` lies in `net`/`bits` (an IPv4-mapped IPv6 address counts
/// as its IPv4 address).
fn in_network(a: IpAddr, net: IpAddr, bits: u8) -> bool {
    let a = match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, IpAddr::V4),
        v4 => v4,
    };
    match (a, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            prefix_eq(u32::from(a).into(), u32::from(n).into(), 32, bits)
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => prefix_eq(u128::from(a), u128::from(n), 128, bits),
        _ => false,
    }
}

/// Whether the first `bits` of two `width`-bit numbers agree.
fn prefix_eq(a: u128, b: u128, width: u32, bits: u8) -> bool {
    let bits = u32::from(bits);
    debug_assert!(bits <= width);
    if bits == 0 {
        return true;
    }
    let shift = width - bits;
    (a >> shift) == (b >> shift)
}

impl FromStr for AllowRule {
    type Err = String;

    /// `psk:NAME`, `dn:SUBJECT`, `uid:N`, `gid:N` or `ip:CIDR`.
    fn from_str(s: &str) -> Result<AllowRule, String> {
        let bad = |why: &str| {
            Err(format!(
                "allow rule {s:?}: {why} (expected psk:NAME, dn:SUBJECT, uid:N, gid:N or ip:CIDR)"
            ))
        };
        let Some((kind, value)) = s.split_once(':') else {
            return bad("no kind");
        };
        if value.is_empty() {
            return bad("empty value");
        }
        let id = |v: &str| {
            v.parse::<u32>()
                .map_err(|_| format!("allow rule {s:?}: {v:?} is not a number"))
        };
        match kind {
            "psk" if value.len() <= 128 => Ok(AllowRule::Psk(value.into())),
            "psk" => bad("a PSK identity is at most 128 bytes"),
            "dn" => Ok(AllowRule::Subject(value.into())),
            "uid" => Ok(AllowRule::Uid(id(value)?)),
            "gid" => Ok(AllowRule::Gid(id(value)?)),
            "ip" => parse_cidr(value).map_err(|e| format!("allow rule {s:?}: {e}")),
            _ => bad("unknown kind"),
        }
    }
}

/// `ADDR` or `ADDR/BITS`.
fn parse_cidr(v: &str) -> Result<AllowRule, String> {
    let (addr, bits) = match v.split_once('/') {
        Some((a, b)) => (a, Some(b)),
        None => (v, None),
    };
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("{addr:?} is not an IP address"))?;
    let width = if addr.is_ipv4() { 32 } else { 128 };
    let bits = match bits {
        None => width,
        Some(b) => b
            .parse::<u8>()
            .ok()
            .filter(|&b| b <= width)
            .ok_or_else(|| format!("prefix length {b:?} must be 0 to {width}"))?,
    };
    Ok(AllowRule::Ip(addr, bits))
}

impl fmt::Display for AllowRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllowRule::Psk(n) => write!(f, "psk:{n}"),
            AllowRule::Subject(s) => write!(f, "dn:{s}"),
            AllowRule::Uid(u) => write!(f, "uid:{u}"),
            AllowRule::Gid(g) => write!(f, "gid:{g}"),
            AllowRule::Ip(a, b) => write!(f, "ip:{a}/{b}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Peer {
        Peer {
            origin: Origin::Ip(s.parse().unwrap()),
            tls: None,
        }
    }

    #[test]
    fn rules_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("psk:alice".parse(), Ok(AllowRule::Psk("alice".into())));
        assert_eq!(
            "dn:CN=a,O=b".parse(),
            Ok(AllowRule::Subject("CN=a,O=b".into()))
        );
        assert_eq!("uid:1000".parse(), Ok(AllowRule::Uid(1000)));
        assert_eq!("gid:0".parse(), Ok(AllowRule::Gid(0)));
        assert_eq!(
            "ip:10.0.0.0/8".parse(),
            Ok(AllowRule::Ip("10.0.0.0".parse().unwrap(), 8))
        );
        assert_eq!(
            "ip:::1".parse(),
            Ok(AllowRule::Ip("::1".parse().unwrap(), 128))
        );
        for bad in [
            "alice",
            "psk:",
            "uid:x",
            "gid:-1",
            "ip:1.2.3.4/33",
            "ip:::1/129",
            "ip:host",
            "user:x",
        ] {
            let e = bad.parse::<AllowRule>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        let long = format!("psk:{}", "a".repeat(129));
        assert!(long.parse::<AllowRule>().is_err());
    }

    #[test]
    fn rules_match_only_what_the_socket_or_tls_proved() {
        let net: AllowRule = "ip:127.0.0.0/8".parse().unwrap();
        assert!(net.allows(&ip("127.0.0.9")));
        assert!(net.allows(&ip("::ffff:127.0.0.2")));
        assert!(!net.allows(&ip("128.0.0.1")));
        assert!(!net.allows(&ip("::1")));
        let v6: AllowRule = "ip:2001:db8::/32".parse().unwrap();
        assert!(v6.allows(&ip("2001:db8:1::5")) && !v6.allows(&ip("2001:db9::1")));
        let any: AllowRule = "ip:0.0.0.0/0".parse().unwrap();
        assert!(any.allows(&ip("8.8.8.8")));
        let unix = Peer {
            origin: Origin::Unix { uid: 1000, gid: 50 },
            tls: None,
        };
        assert!(AllowRule::Uid(1000).allows(&unix) && !AllowRule::Uid(0).allows(&unix));
        assert!(AllowRule::Gid(50).allows(&unix) && !AllowRule::Gid(1000).allows(&unix));
        assert!(!AllowRule::Uid(1000).allows(&ip("127.0.0.1")));
        // A TLS rule never matches a connection without TLS.
        let mut alice = ip("127.0.0.1");
        assert!(!AllowRule::Psk("alice".into()).allows(&alice));
        alice.tls = Some(TlsIdentity::Psk("alice".into()));
        assert!(AllowRule::Psk("alice".into()).allows(&alice));
        assert!(!AllowRule::Psk("bob".into()).allows(&alice));
        assert!(!AllowRule::Subject("alice".into()).allows(&alice));
        assert!(allowed(&[], &ip("1.2.3.4")));
        assert!(!allowed(&[AllowRule::Uid(0)], &ip("1.2.3.4")));
    }

    #[test]
    fn share_keys_group_a_tenant_and_an_ipv6_host() {
        assert_eq!(ip("127.0.0.2").share_key(), "ip:127.0.0.2");
        assert_eq!(ip("::ffff:10.1.2.3").share_key(), "ip:10.1.2.3");
        // One /64 is one host's.
        assert_eq!(
            ip("2001:db8:0:1::5").share_key(),
            ip("2001:db8:0:1:ffff::9").share_key()
        );
        assert_ne!(
            ip("2001:db8:0:1::5").share_key(),
            ip("2001:db8:0:2::5").share_key()
        );
        let mut p = ip("127.0.0.1");
        p.tls = Some(TlsIdentity::Subject("CN=a".into()));
        assert_eq!(p.share_key(), "dn:CN=a");
        let u = Peer {
            origin: Origin::Unix { uid: 7, gid: 8 },
            tls: None,
        };
        assert_eq!(u.share_key(), "uid:7");
    }
}
