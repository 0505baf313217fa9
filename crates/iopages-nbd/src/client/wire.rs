//! Reaching a remote export: connecting (TCP or a Unix socket) and the
//! fixed newstyle handshake, STARTTLS first under TLS.

use super::*;

/// What the handshake learnt about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ExportInfo {
    pub(super) size: u64,
    pub(super) flags: u16,
    pub(super) min_block: u32,
    pub(super) pref_block: u32,
    pub(super) max_block: u32,
}

/// Handshake reads, all of them before `deadline`: each read waits at most
/// what is left, so a remote that trickles bytes cannot stretch the
/// handshake past its one timeout.
pub(super) fn hs_read(
    s: &mut Stream,
    buf: &mut [u8],
    what: &str,
    deadline: Instant,
) -> io::Result<()> {
    let timed_out = || {
        io::Error::new(
            ErrorKind::TimedOut,
            format!("handshake: timed out waiting for {what}"),
        )
    };
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        s.set_timeouts(left, left)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    ErrorKind::ConnectionAborted,
                    format!("handshake: the remote closed the connection before sending {what}"),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(timed_out()),
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("handshake: reading {what}: {e}"),
                ))
            }
        }
    }
    Ok(())
}

/// One option reply to `option` (`name` in messages): its reply type and
/// data, the header checked and the data bounded by
/// [`MAX_OPTION_REPLY_BYTES`].
pub(super) fn option_reply(
    s: &mut Stream,
    option: u32,
    name: &str,
    deadline: Instant,
) -> io::Result<(u32, Vec<u8>)> {
    let invalid = |m: String| io::Error::new(ErrorKind::InvalidData, format!("handshake: {m}"));
    let mut h = [0u8; 20];
    hs_read(s, &mut h, &format!("the reply to {name}"), deadline)?;
    let magic = u64::from_be_bytes(h[0..8].try_into().expect("8 bytes"));
    let got = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
    let reply = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes")) as usize;
    if magic != OPT_REPLY_MAGIC || got != option {
        return Err(invalid(format!(
            "a bad option reply to {name} (magic {magic:#x}, option {got})"
        )));
    }
    if len > MAX_OPTION_REPLY_BYTES {
        return Err(invalid(format!("an option reply of {len} bytes")));
    }
    let mut d = vec![0u8; len];
    hs_read(
        s,
        &mut d,
        &format!("the data of the reply to {name}"),
        deadline,
    )?;
    Ok((reply, d))
}

/// Send one option.
pub(super) fn send_option(s: &mut Stream, option: u32, data: &[u8]) -> io::Result<()> {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    s.write_all(&v)
}

/// NBD_OPT_GO for `export`, asking for the block sizes.
///
/// **Returns:** `None` when the server does not know NBD_OPT_GO.
pub(super) fn opt_go(
    s: &mut Stream,
    export: &str,
    deadline: Instant,
) -> io::Result<Option<ExportInfo>> {
    let mut data = (export.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(s, OPT_GO, &data)?;
    let mut export_info = None;
    let mut sizes = (1u32, 4096u32, MAX_PAYLOAD_BYTES);
    for _ in 0..MAX_GO_REPLIES {
        let (reply, d) = option_reply(s, OPT_GO, "NBD_OPT_GO", deadline)?;
        match reply {
            REP_ACK => {
                let (size, flags) = export_info.ok_or_else(|| {
                    go_invalid("NBD_OPT_GO ended without the export's size".into())
                })?;
                let (min_block, pref_block, max_block) = sizes;
                return Ok(Some(ExportInfo {
                    size,
                    flags,
                    min_block,
                    pref_block,
                    max_block,
                }));
            }
            REP_INFO => take_go_info(&d, &mut export_info, &mut sizes)?,
            REP_ERR_UNSUP => return Ok(None),
            r if r & REP_FLAG_ERROR != 0 => return Err(go_refused(r, export, &d)),
            _ => {} // unknown replies are skipped
        }
    }
    Err(go_invalid(format!(
        "more than {MAX_GO_REPLIES} replies to NBD_OPT_GO without a final one"
    )))
}

/// A reply to NBD_OPT_GO that breaks the protocol.
fn go_invalid(m: String) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, format!("handshake: {m}"))
}

/// Take one NBD_REP_INFO reply to NBD_OPT_GO: the export's size and
/// flags, or its block sizes (other information is not needed).
fn take_go_info(
    d: &[u8],
    export_info: &mut Option<(u64, u16)>,
    sizes: &mut (u32, u32, u32),
) -> io::Result<()> {
    if d.len() < 2 {
        return Err(go_invalid("an empty information reply".into()));
    }
    match u16::from_be_bytes([d[0], d[1]]) {
        INFO_EXPORT if d.len() == 12 => {
            *export_info = Some((
                u64::from_be_bytes(d[2..10].try_into().expect("8 bytes")),
                u16::from_be_bytes([d[10], d[11]]),
            ))
        }
        INFO_BLOCK_SIZE if d.len() == 14 => {
            let n = |i: usize| u32::from_be_bytes(d[i..i + 4].try_into().expect("4"));
            *sizes = (n(2), n(6), n(10));
        }
        INFO_EXPORT | INFO_BLOCK_SIZE => {
            return Err(go_invalid(format!(
                "an information reply of {} bytes",
                d.len()
            )))
        }
        _ => {} // other information is not needed
    }
    Ok(())
}

/// The error an error reply `reply` (data `d`) to NBD_OPT_GO for
/// `export` means.
fn go_refused(reply: u32, export: &str, d: &[u8]) -> io::Error {
    let text = String::from_utf8_lossy(d).into_owned();
    match reply {
        REP_ERR_UNKNOWN => io::Error::new(
            ErrorKind::NotFound,
            format!("the remote has no export named {export:?} ({text})"),
        ),
        REP_ERR_TLS_REQD => io::Error::new(
            ErrorKind::PermissionDenied,
            "the remote requires TLS: use nbds:// (or nbds+unix://) with \
             tls-certificates=DIR or tls-psk-file=FILE",
        ),
        REP_ERR_POLICY => io::Error::new(
            ErrorKind::PermissionDenied,
            format!("the remote refused export {export:?} by policy ({text})"),
        ),
        REP_ERR_BLOCK_SIZE_REQD => go_invalid("block sizes required although asked for".into()),
        r => io::Error::other(format!(
            "the remote refused export {export:?}: error {:#x} ({text})",
            r & !REP_FLAG_ERROR
        )),
    }
}

/// NBD_OPT_EXPORT_NAME for `export` (servers without NBD_OPT_GO).
pub(super) fn opt_export_name(
    s: &mut Stream,
    export: &str,
    no_zeroes: bool,
    deadline: Instant,
) -> io::Result<ExportInfo> {
    send_option(s, OPT_EXPORT_NAME, export.as_bytes())?;
    let mut d = [0u8; 10];
    hs_read(s, &mut d, "the export's size (no such export?)", deadline).map_err(|e| {
        if e.kind() == ErrorKind::ConnectionAborted {
            io::Error::new(
                ErrorKind::NotFound,
                format!("the remote refused export {export:?} (NBD_OPT_EXPORT_NAME)"),
            )
        } else {
            e
        }
    })?;
    if !no_zeroes {
        let mut z = [0u8; 124];
        hs_read(s, &mut z, "the handshake's padding", deadline)?;
    }
    Ok(ExportInfo {
        size: u64::from_be_bytes(d[0..8].try_into().expect("8 bytes")),
        flags: u16::from_be_bytes([d[8], d[9]]),
        min_block: 1,
        pref_block: 4096,
        max_block: MAX_PAYLOAD_BYTES,
    })
}

/// NBD_OPT_STARTTLS, then the TLS handshake: `s` becomes the session.
///
/// **Returns:** `PermissionDenied` when the remote does not offer TLS
/// (NBD_OPT_ABORT is sent; nothing continues in plaintext) or the TLS
/// handshake fails; `InvalidData` for a reply breaking the protocol.
pub(super) fn starttls(s: &mut Stream, tls: &Connector, deadline: Instant) -> io::Result<()> {
    send_option(s, OPT_STARTTLS, &[])?;
    let invalid = |m: String| io::Error::new(ErrorKind::InvalidData, format!("handshake: {m}"));
    let (reply, d) = option_reply(s, OPT_STARTTLS, "NBD_OPT_STARTTLS", deadline)?;
    let len = d.len();
    match reply {
        REP_ACK if len == 0 => {}
        REP_ACK => {
            return Err(invalid(format!(
                "NBD_OPT_STARTTLS acknowledged with {len} bytes"
            )))
        }
        r if r & REP_FLAG_ERROR != 0 => {
            // Leave politely; the session ends here either way.
            let _ = send_option(s, OPT_ABORT, &[]);
            let text = String::from_utf8_lossy(&d);
            return Err(io::Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "the remote does not offer TLS (NBD_OPT_STARTTLS refused: {}{}{}); \
                     nbds:// never falls back to plaintext (use nbd:// for a plaintext remote)",
                    match r {
                        REP_ERR_UNSUP => "unsupported".to_string(),
                        REP_ERR_POLICY => "by policy".to_string(),
                        r => format!("error {:#x}", r & !REP_FLAG_ERROR),
                    },
                    if text.is_empty() { "" } else { ", " },
                    text
                ),
            ));
        }
        r => return Err(invalid(format!("reply {r} to NBD_OPT_STARTTLS"))),
    }
    let plain = s.try_clone()?;
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            ErrorKind::TimedOut,
            "handshake: timed out before the TLS handshake",
        ));
    }
    // From here the socket is the session's (the same session type as
    // the server's connections run).
    let session: ClientTls = tls.connect(plain, left)?;
    *s = Stream::Tls(Arc::new(session));
    Ok(())
}

/// The fixed newstyle handshake for `export`, after NBD_OPT_STARTTLS
/// with `tls`.
pub(super) fn handshake(
    s: &mut Stream,
    export: &str,
    tls: Option<&Connector>,
    deadline: Instant,
) -> io::Result<ExportInfo> {
    let mut b = [0u8; 8];
    hs_read(s, &mut b, "the greeting", deadline)?;
    if u64::from_be_bytes(b) != NBD_MAGIC {
        return Err(io::Error::new(ErrorKind::InvalidData, "not an NBD server"));
    }
    hs_read(s, &mut b, "the greeting", deadline)?;
    match u64::from_be_bytes(b) {
        IHAVEOPT => {}
        OLDSTYLE_MAGIC => {
            return Err(io::Error::new(
                ErrorKind::Unsupported,
                "an oldstyle NBD server (only newstyle is supported)",
            ))
        }
        m => {
            return Err(io::Error::new(
                ErrorKind::InvalidData,
                format!("an NBD server with the unknown magic {m:#x}"),
            ))
        }
    }
    let mut f = [0u8; 2];
    hs_read(s, &mut f, "the handshake flags", deadline)?;
    let flags = u16::from_be_bytes(f);
    let fixed = flags & FLAG_FIXED_NEWSTYLE != 0;
    let no_zeroes = flags & FLAG_NO_ZEROES != 0;
    let client = if fixed { FLAG_C_FIXED_NEWSTYLE } else { 0 }
        | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    s.write_all(&client.to_be_bytes())?;
    if let Some(tls) = tls {
        if !fixed {
            return Err(io::Error::new(
                ErrorKind::PermissionDenied,
                "the remote does not offer TLS (not a fixed newstyle server, so no \
                 NBD_OPT_STARTTLS); nbds:// never falls back to plaintext",
            ));
        }
        starttls(s, tls, deadline)?;
    }
    let mut info = match fixed {
        true => opt_go(s, export, deadline)?,
        false => None,
    };
    if info.is_none() {
        info = Some(opt_export_name(s, export, no_zeroes, deadline)?);
    }
    let mut info = info.expect("set above");
    if info.flags & TFLAG_HAS_FLAGS == 0 {
        info.flags = 0;
    }
    let (min, pref, max) = (info.min_block, info.pref_block, info.max_block);
    if !min.is_power_of_two() || min > 65536 || max < min {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            format!("handshake: bad block sizes (minimum {min}, preferred {pref}, maximum {max})"),
        ));
    }
    // Payloads: at most 32 MiB, whole minimum blocks.
    info.max_block = max.min(MAX_PAYLOAD_BYTES) / min * min;
    Ok(info)
}

/// Connect to `spec`'s server within `timeout`.
pub(super) fn dial(spec: &RemoteSpec, timeout: Duration) -> io::Result<Stream> {
    // One deadline for every attempt (the name lookup itself is the
    // system resolver's and not bounded here).
    let deadline = Instant::now() + timeout;
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| io::Error::new(ErrorKind::TimedOut, "connect timed out"))
    };
    match &spec.address {
        RemoteAddress::Unix(p) => Ok(Stream::Unix(connect_unix(p, deadline)?)),
        RemoteAddress::Tcp { host, port } => {
            let mut last = io::Error::new(ErrorKind::NotFound, format!("{host} has no address"));
            for addr in (host.as_str(), *port).to_socket_addrs()? {
                match TcpStream::connect_timeout(&addr, left()?) {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        return Ok(Stream::Tcp(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

/// Connect to the Unix socket at `path` by `deadline`: a listener whose
/// backlog is full refuses a non-blocking connect (EAGAIN) rather than
/// making it wait, so the attempt is repeated until it is taken or the
/// deadline passes (a blocking `connect` would wait as long as the server
/// does not accept). The stream returned is blocking.
pub(super) fn connect_unix(path: &std::path::Path, deadline: Instant) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let Some(addr) = crate::sys::unix_address(path.as_os_str().as_bytes()) else {
        return Err(io::Error::new(
            ErrorKind::InvalidInput,
            format!("{}: not a usable socket path", path.display()),
        ));
    };
    let stream = crate::sys::unix_socket()?;
    loop {
        let r = crate::sys::connect_unix(stream.as_fd(), &addr);
        let Err(e) = r else {
            stream.set_nonblocking(false)?;
            return Ok(stream);
        };
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Some(libc::EAGAIN) => {
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    "connect timed out (the server accepts nothing)",
                ));
            }
            _ => return Err(e),
        }
    }
}
