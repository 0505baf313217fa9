//! Socket activation: listening sockets handed over by systemd (or any
//! supervisor speaking the protocol of sd_listen_fds(3)).
//!
//! The protocol: the sockets are file descriptors 3, 4, … (`LISTEN_FDS`
//! of them), meant for the process `LISTEN_PID`, optionally named by the
//! colon-separated `LISTEN_FDNAMES`. Owns: reading those variables,
//! checking that each descriptor is a listening stream socket, TCP (IPv4
//! or IPv6) or Unix, marking it close-on-exec, taking ownership of it
//! (once: the variables are removed as they are read, so a second call
//! finds nothing), and removing the variables so that no child inherits
//! them. Must never: take a descriptor that is not a listening socket of
//! a family we serve (a clear error naming it instead), or take sockets
//! meant for another process (`LISTEN_PID` not ours: nothing is taken).

use crate::sys;
use iopages_nbd::{Listen, Listener};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

/// The first descriptor passed (SD_LISTEN_FDS_START).
const FIRST_FD: RawFd = 3;

/// The most sockets taken: more is an error (a mistaken `LISTEN_FDS`, not
/// a configuration anyone needs).
pub const MAX_FDS: usize = 64;

const VARS: [&str; 3] = ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"];

/// What the environment passes to this process.
#[derive(Debug, PartialEq, Eq)]
struct Passed {
    /// How many descriptors, from [`FIRST_FD`] on (1 to [`MAX_FDS`]).
    count: usize,
    /// Their names, one per descriptor, when `LISTEN_FDNAMES` gave as
    /// many (only for messages).
    names: Option<Vec<String>>,
}

/// Parse the protocol's variables for the process `me`.
///
/// **Returns:** `None` when nothing is passed to `me`: no `LISTEN_PID`,
/// another process's, or `LISTEN_FDS=0`; an error for a `LISTEN_PID`
/// that is not a process id, or, when it is ours, a `LISTEN_FDS` missing,
/// not a number or above [`MAX_FDS`].
fn parse_env(
    pid: Option<&str>,
    fds: Option<&str>,
    names: Option<&str>,
    me: u32,
) -> Result<Option<Passed>, String> {
    let Some(pid) = pid else {
        return Ok(None);
    };
    let pid: u32 = match pid.parse() {
        Ok(p) if p > 0 => p,
        _ => return Err(format!("LISTEN_PID={pid:?} is not a process id")),
    };
    if pid != me {
        // Meant for another process (a parent that was activated and
        // left them set): not ours to take.
        return Ok(None);
    }
    let Some(fds) = fds else {
        return Err("LISTEN_PID names this process but LISTEN_FDS is not set".into());
    };
    let count: usize = fds
        .parse()
        .map_err(|_| format!("LISTEN_FDS={fds:?} is not a number of sockets (0 to {MAX_FDS})"))?;
    if count > MAX_FDS {
        return Err(format!(
            "LISTEN_FDS={count}: more than {MAX_FDS} sockets passed"
        ));
    }
    if count == 0 {
        return Ok(None);
    }
    let names = names
        .map(|n| n.split(':').map(str::to_string).collect::<Vec<_>>())
        .filter(|n| n.len() == count);
    Ok(Some(Passed { count, names }))
}

/// A variable's value; one that is not UTF-8 cannot be a number, and is
/// passed on as its lossy text so that the parse names it.
fn var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// The sockets passed to this process, each owned from now on (and
/// closed when dropped), in descriptor order.
///
/// **Context:** call once, early, before the process starts threads: it
/// removes `LISTEN_PID`, `LISTEN_FDS` and `LISTEN_FDNAMES` from the
/// environment (whoever they were for), and the environment is not safe
/// to change while other threads read it.
///
/// **Returns:** `None` when no socket is passed to this process (see
/// [`parse_env`]); an error naming the variable or the descriptor for a
/// bad value, a descriptor that is not open, not a socket, not listening,
/// not a stream, or of another family than IPv4, IPv6 or Unix.
pub fn inherited_listeners() -> Result<Option<Vec<Listener>>, String> {
    let passed = parse_env(
        var("LISTEN_PID").as_deref(),
        var("LISTEN_FDS").as_deref(),
        var("LISTEN_FDNAMES").as_deref(),
        std::process::id(),
    );
    for v in VARS {
        // Edition 2021: remove_var is safe to call; the process has no
        // other threads yet (see Context).
        std::env::remove_var(v);
    }
    let Some(passed) = passed? else {
        return Ok(None);
    };
    let fds: Vec<RawFd> = (0..passed.count).map(|i| FIRST_FD + i as RawFd).collect();
    // Every descriptor is checked before any is taken: on an error none
    // is owned (and so none closed) here.
    let mut kinds = Vec::with_capacity(fds.len());
    for (i, &fd) in fds.iter().enumerate() {
        let name = match &passed.names {
            Some(n) => format!("socket-activation fd {fd} ({:?})", n[i]),
            None => format!("socket-activation fd {fd}"),
        };
        kinds.push(check_listening(fd).map_err(|e| format!("{name}: {e}"))?);
    }
    let mut out = Vec::with_capacity(fds.len());
    for (fd, kind) in fds.into_iter().zip(kinds) {
        set_cloexec(fd).map_err(|e| format!("socket-activation fd {fd}: {e}"))?;
        // SAFETY: fd is open and a listening socket (checked above); the
        // protocol hands descriptors 3.. to this process, each is taken
        // here exactly once (the range has no repeats) and the variables
        // are gone, so no later call takes it again.
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        out.push(match kind {
            Family::Inet => Listener::Tcp(std::net::TcpListener::from(owned)),
            Family::Unix => Listener::Unix(std::os::unix::net::UnixListener::from(owned)),
        });
    }
    Ok(Some(out))
}

/// `listen` followed by the addresses of `inherited` (its TCP addresses
/// and Unix paths, as the server will report them): every address served,
/// for checks that apply to all of them.
///
/// **Returns:** an error naming the descriptor whose address cannot be
/// read, or a Unix socket without a path (abstract or unnamed).
pub fn with_addresses(listen: &[Listen], inherited: &[Listener]) -> Result<Vec<Listen>, String> {
    let mut all = listen.to_vec();
    for l in inherited {
        all.push(
            l.address()
                .map_err(|e| format!("socket-activation fd {}: {e}", l.as_raw_fd()))?,
        );
    }
    Ok(all)
}

/// A listening socket's family, as the server serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// AF_INET or AF_INET6: TCP.
    Inet,
    /// AF_UNIX.
    Unix,
}

/// Whether `fd` is an open, listening stream socket, and of which family.
fn check_listening(fd: RawFd) -> Result<Family, String> {
    if sys::fd_flags(fd).is_err() {
        return Err("not an open file descriptor (LISTEN_FDS counts more than were passed)".into());
    }
    let ty = match sys::socket_option_int(fd, libc::SO_TYPE) {
        Ok(t) => t,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => return Err("not a socket".into()),
        Err(e) => return Err(format!("cannot read its socket type: {e}")),
    };
    if ty != libc::SOCK_STREAM {
        return Err("not a stream socket (NBD needs ListenStream=)".into());
    }
    match sys::socket_option_int(fd, libc::SO_ACCEPTCONN) {
        Ok(0) => return Err("a socket that is not listening".into()),
        Ok(_) => {}
        Err(e) => return Err(format!("cannot tell whether it listens: {e}")),
    }
    let family = sys::socket_family(fd).map_err(|e| format!("cannot read its address: {e}"))?;
    match family {
        libc::AF_INET | libc::AF_INET6 => Ok(Family::Inet),
        libc::AF_UNIX => Ok(Family::Unix),
        f => Err(format!(
            "a socket of address family {f}, neither TCP (IPv4, IPv6) nor Unix"
        )),
    }
}

/// Mark `fd` close-on-exec (systemd passes it without the flag).
fn set_cloexec(fd: RawFd) -> std::io::Result<()> {
    let flags = sys::fd_flags(fd)?;
    sys::set_fd_flags(fd, flags | libc::FD_CLOEXEC)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passed(count: usize) -> Option<Passed> {
        Some(Passed { count, names: None })
    }

    #[test]
    fn nothing_is_passed_without_listen_pid_or_to_another_process() {
        assert_eq!(parse_env(None, Some("2"), None, 100), Ok(None));
        assert_eq!(parse_env(Some("101"), Some("2"), None, 100), Ok(None));
        // Another process's, even with a LISTEN_FDS we could not parse.
        assert_eq!(parse_env(Some("101"), Some("abc"), None, 100), Ok(None));
    }

    #[test]
    fn our_pid_takes_listen_fds_sockets() {
        assert_eq!(parse_env(Some("100"), Some("1"), None, 100), Ok(passed(1)));
        assert_eq!(
            parse_env(Some("100"), Some("64"), None, 100),
            Ok(passed(64))
        );
        assert_eq!(parse_env(Some("100"), Some("0"), None, 100), Ok(None));
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        for (pid, fds, want) in [
            ("abc", "1", "LISTEN_PID=\"abc\" is not a process id"),
            ("0", "1", "LISTEN_PID=\"0\""),
            ("-5", "1", "LISTEN_PID=\"-5\""),
            ("100", "abc", "LISTEN_FDS=\"abc\" is not a number"),
            ("100", "-1", "LISTEN_FDS=\"-1\""),
            ("100", " 1", "LISTEN_FDS=\" 1\""),
            ("100", "", "LISTEN_FDS=\"\""),
            ("100", "65", "LISTEN_FDS=65: more than 64"),
            ("100", "99999999999999999999999", "is not a number"),
        ] {
            let e = parse_env(Some(pid), Some(fds), None, 100).unwrap_err();
            assert!(e.contains(want), "{pid} {fds}: {e}");
        }
        let e = parse_env(Some("100"), None, None, 100).unwrap_err();
        assert!(e.contains("LISTEN_FDS is not set"), "{e}");
    }

    #[test]
    fn names_are_kept_only_when_there_is_one_per_socket() {
        assert_eq!(
            parse_env(Some("100"), Some("2"), Some("nbd:nbd-tcp"), 100),
            Ok(Some(Passed {
                count: 2,
                names: Some(vec!["nbd".into(), "nbd-tcp".into()])
            }))
        );
        assert_eq!(
            parse_env(Some("100"), Some("2"), Some("nbd"), 100),
            Ok(passed(2))
        );
    }

    #[test]
    fn descriptors_are_checked() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(check_listening(l.as_raw_fd()), Ok(Family::Inet));
        let d = std::env::temp_dir().join(format!("iopages-activation-{}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        let u = std::os::unix::net::UnixListener::bind(&d).unwrap();
        assert_eq!(check_listening(u.as_raw_fd()), Ok(Family::Unix));
        let _ = std::fs::remove_file(&d);
        let f = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(check_listening(f.as_raw_fd()), Err("not a socket".into()));
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(check_listening(a.as_raw_fd())
            .unwrap_err()
            .contains("not listening"));
        let g = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(check_listening(g.as_raw_fd())
            .unwrap_err()
            .contains("not a stream socket"));
        // A descriptor number nothing uses.
        assert!(check_listening(1 << 20)
            .unwrap_err()
            .contains("not an open file descriptor"));
    }
}
