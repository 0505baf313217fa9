//! NBD URIs: where a remote export is and how to reach it.

use super::*;

/// Where a remote export is: a TCP host and port, or a Unix socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteAddress {
    /// `nbd://host[:port]`: a host name or address, and a port.
    Tcp {
        /// Host name, IPv4 or IPv6 address (without brackets).
        host: String,
        /// TCP port.
        port: u16,
    },
    /// `nbd+unix://…?socket=PATH`: a Unix socket.
    Unix(PathBuf),
}

/// A remote export, as an NBD URI names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteSpec {
    /// Where the server listens.
    pub address: RemoteAddress,
    /// The export's name ("" : the server's default export).
    pub export: String,
    /// `nbds://`, `nbds+unix://`: TLS is required, with these settings.
    pub tls: Option<RemoteTls>,
    /// `reconnect-delay=SECS`: how long requests wait for the store to
    /// come back (see [`RemoteOptions::reconnect_delay`]); `None`: the
    /// options' own.
    pub reconnect_delay: Option<Duration>,
}

/// An `InvalidInput` error about the URI `uri`.
fn bad_uri(uri: &str, msg: &str) -> io::Error {
    io::Error::new(
        ErrorKind::InvalidInput,
        format!(
            "remote {uri:?}: {msg} (expected nbd[s]://host[:port][/export] or \
             nbd[s]+unix:///export?socket=PATH)"
        ),
    )
}

/// Decode `%XX` escapes; the result must be UTF-8.
pub fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match hex {
                Some(v) => out.push(v),
                None => return Err(format!("a bad %-escape in {s:?}")),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once %-decoded"))
}

/// `%XX`-escape everything but unreserved characters and `/`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &c in s.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~/".contains(&c) {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

impl RemoteSpec {
    /// Parse an NBD URI: `nbd://host[:port][/export]` (port 10809 by
    /// default, IPv6 addresses in brackets, the export `%`-escaped, "" when
    /// absent) or `nbd+unix:///export?socket=PATH`; `nbds://` and
    /// `nbds+unix://` require TLS, set with the query parameters
    /// `tls-certificates=DIR`, `tls-psk-file=FILE`, `tls-username=NAME`
    /// (or `nbds://NAME@host`), `tls-hostname=NAME`,
    /// `tls-verify-peer=true|false` (also `1|0`) and `tls-type=x509|psk`;
    /// any of them may take `reconnect-delay=SECS` (whole seconds, at most
    /// an hour).
    ///
    /// **Context:** pure. **Returns:** `InvalidInput` naming what is wrong
    /// for anything else: other schemes, user info without TLS, fragments,
    /// a missing host or socket, a bad port, unknown or repeated query
    /// keys, `tls-*` keys without TLS, an export name over 4096 bytes.
    pub fn parse(uri: &str) -> io::Result<RemoteSpec> {
        let bad = |m: &str| bad_uri(uri, m);
        let (scheme, rest) = uri.split_once("://").ok_or_else(|| bad("not an NBD URI"))?;
        let scheme = scheme.to_ascii_lowercase();
        let (unix, tls) = match scheme.as_str() {
            "nbd" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" => (false, true),
            "nbds+unix" => (true, true),
            _ => return Err(bad(&format!("scheme {scheme:?} is not supported"))),
        };
        if rest.contains('#') {
            return Err(bad("a fragment (#...) is not allowed"));
        }
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let export = percent_decode(path).map_err(|m| bad(&m))?;
        if export.len() > 4096 {
            return Err(bad("the export name is longer than 4096 bytes"));
        }
        let mut q = Query::parse(query, unix, tls).map_err(|m| bad(&m))?;
        q.check_tls().map_err(|m| bad(&m))?;
        let authority = take_user(authority, tls, &mut q.settings).map_err(|m| bad(&m))?;
        let address = if unix {
            unix_address(&scheme, authority, q.socket)
        } else {
            tcp_address(authority)
        };
        Ok(RemoteSpec {
            address: address.map_err(|m| bad(&m))?,
            export,
            tls: tls.then_some(q.settings),
            reconnect_delay: q.reconnect_delay,
        })
    }

    /// The URI naming this export (what [`RemoteSpec::parse`] reads back).
    ///
    /// **Returns:** `nbd[s]://…` or `nbd[s]+unix://…`, names `%`-escaped,
    /// the TLS settings as query parameters.
    pub fn uri(&self) -> String {
        let export = percent_encode(&self.export);
        let s = if self.tls.is_some() { "s" } else { "" };
        let mut query = Vec::new();
        let base = match &self.address {
            RemoteAddress::Tcp { host, port } if host.contains(':') => {
                format!("nbd{s}://[{host}]:{port}/{export}")
            }
            RemoteAddress::Tcp { host, port } => format!("nbd{s}://{host}:{port}/{export}"),
            RemoteAddress::Unix(p) => {
                query.push(format!("socket={}", percent_encode(&p.to_string_lossy())));
                format!("nbd{s}+unix:///{export}")
            }
        };
        if let Some(t) = &self.tls {
            let mut add = |k: &str, v: &str| query.push(format!("{k}={}", percent_encode(v)));
            if let Some(d) = &t.certificates {
                add("tls-certificates", &d.to_string_lossy());
            }
            if let Some(f) = &t.psk_file {
                add("tls-psk-file", &f.to_string_lossy());
            }
            if let Some(u) = &t.username {
                add("tls-username", u);
            }
            if let Some(h) = &t.hostname {
                add("tls-hostname", h);
            }
            if !t.verify_peer {
                add("tls-verify-peer", "false");
            }
        }
        if let Some(d) = self.reconnect_delay {
            query.push(format!("reconnect-delay={}", d.as_secs()));
        }
        if query.is_empty() {
            base
        } else {
            format!("{base}?{}", query.join("&"))
        }
    }
}

/// What an NBD URI's query parameters set.
struct Query {
    /// `socket=PATH` (`nbd+unix` and `nbds+unix` only).
    socket: Option<String>,
    /// The `tls-*` parameters but `tls-type`.
    settings: RemoteTls,
    /// `tls-type=x509|psk`, lowercased.
    tls_type: Option<String>,
    /// `reconnect-delay=SECS`.
    reconnect_delay: Option<Duration>,
}

impl Query {
    /// Read `query` (`key=value&…`, values `%`-decoded); each key at most
    /// once, `tls-*` keys only with TLS.
    ///
    /// **Returns:** the message naming the first key that is wrong.
    fn parse(query: &str, unix: bool, tls: bool) -> Result<Query, String> {
        let mut q = Query {
            socket: None,
            settings: RemoteTls::new(),
            tls_type: None,
            reconnect_delay: None,
        };
        let mut seen: Vec<&str> = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if seen.contains(&key) {
                return Err(format!("{key}= is given twice"));
            }
            seen.push(key);
            let value = percent_decode(value)?;
            if key.starts_with("tls-") && !tls {
                return Err(format!("{key}= needs TLS: use nbds:// or nbds+unix://"));
            }
            q.set(key, value, unix)?;
        }
        Ok(q)
    }

    /// Take one parameter `key=value`.
    fn set(&mut self, key: &str, value: String, unix: bool) -> Result<(), String> {
        let path = |v: String| {
            if v.is_empty() {
                Err(format!("{key}= is empty"))
            } else {
                Ok(Some(PathBuf::from(v)))
            }
        };
        let settings = &mut self.settings;
        match key {
            "socket" if unix => self.socket = Some(value),
            "tls-certificates" => settings.certificates = path(value)?,
            "tls-psk-file" => settings.psk_file = path(value)?,
            "tls-username" if !value.is_empty() => settings.username = Some(value),
            "tls-hostname" if !value.is_empty() => settings.hostname = Some(value),
            "tls-verify-peer" => {
                settings.verify_peer = match value.to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" | "on" => true,
                    "0" | "false" | "no" | "off" => false,
                    _ => {
                        return Err(format!(
                            "tls-verify-peer={value:?} is not a boolean (true or false)"
                        ))
                    }
                }
            }
            "tls-type" => self.tls_type = Some(value.to_ascii_lowercase()),
            "reconnect-delay" => self.reconnect_delay = Some(parse_reconnect_delay(&value)?),
            "tls-username" | "tls-hostname" => return Err(format!("{key}= is empty")),
            _ => return Err(format!("unknown query parameter {key:?}")),
        }
        Ok(())
    }

    /// Whether `tls-type` agrees with the key files given, and at most one
    /// kind of key file is.
    fn check_tls(&self) -> Result<(), String> {
        let settings = &self.settings;
        match self.tls_type.as_deref() {
            None => {}
            Some("x509") if settings.psk_file.is_none() => {}
            Some("psk") if settings.psk_file.is_some() => {}
            Some("psk") => return Err("tls-type=psk needs tls-psk-file=FILE".into()),
            Some("x509") => return Err("tls-type=x509 with tls-psk-file= given".into()),
            Some(t) => return Err(format!("tls-type={t:?} is not supported (x509 or psk)")),
        }
        if settings.psk_file.is_some() && settings.certificates.is_some() {
            return Err("give tls-certificates= or tls-psk-file=, not both".into());
        }
        Ok(())
    }
}

/// The authority without its user info: a `user@` (TLS only) becomes the
/// PSK user name in `settings`.
fn take_user<'a>(
    authority: &'a str,
    tls: bool,
    settings: &mut RemoteTls,
) -> Result<&'a str, String> {
    let authority = match authority.rsplit_once('@') {
        Some((user, host)) if tls => {
            let user = percent_decode(user)?;
            if user.is_empty() || user.contains(':') {
                return Err("user info must be a user name alone (user@host)".into());
            }
            if settings.username.is_some() {
                return Err("a user name both as user@ and tls-username=".into());
            }
            settings.username = Some(user);
            host
        }
        _ => authority,
    };
    if authority.contains('@') {
        return Err("user info (user@) is only for TLS (nbds://user@host)".into());
    }
    Ok(authority)
}

/// The address of an `nbd+unix` or `nbds+unix` URI: no host, and the
/// `socket=PATH` parameter.
fn unix_address(
    scheme: &str,
    authority: &str,
    socket: Option<String>,
) -> Result<RemoteAddress, String> {
    if !authority.is_empty() {
        return Err(format!(
            "{scheme}:// takes no host ({scheme}:///export?socket=PATH)"
        ));
    }
    match socket {
        Some(s) if !s.is_empty() => Ok(RemoteAddress::Unix(PathBuf::from(s))),
        _ => Err(format!("{scheme}:// needs ?socket=PATH")),
    }
}

/// The address of an `nbd` or `nbds` URI: `host[:port]`, an IPv6 host in
/// brackets, the port [`DEFAULT_PORT`] when none is given.
fn tcp_address(authority: &str) -> Result<RemoteAddress, String> {
    if authority.matches(':').count() > 1 && !authority.starts_with('[') {
        return Err("an IPv6 address must be in brackets ([::1]:10809)".into());
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or("an IPv6 address without its closing ]")?;
        match after {
            "" => (host, None),
            p => match p.strip_prefix(':') {
                Some(p) => (host, Some(p)),
                None => return Err("junk after the IPv6 address".into()),
            },
        }
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    let port = match port {
        None | Some("") => DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 && p.bytes().all(|c| c.is_ascii_digit()) => n,
            _ => return Err(format!("bad port {p:?}")),
        },
    };
    Ok(RemoteAddress::Tcp {
        host: host.to_string(),
        port,
    })
}

impl std::fmt::Display for RemoteSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

/// `reconnect-delay`'s value: whole seconds, 0 to [`MAX_RECONNECT_DELAY`].
///
/// **Returns:** the delay; what is wrong with the value.
pub fn parse_reconnect_delay(value: &str) -> Result<Duration, String> {
    match value.parse::<u64>() {
        Ok(n)
            if value.bytes().all(|c| c.is_ascii_digit()) && n <= MAX_RECONNECT_DELAY.as_secs() =>
        {
            Ok(Duration::from_secs(n))
        }
        _ => Err(format!(
            "reconnect-delay={value:?} is not whole seconds from 0 to {}",
            MAX_RECONNECT_DELAY.as_secs()
        )),
    }
}
