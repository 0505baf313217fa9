//! The raw system calls of the `iopages` command, each wrapped once.
//!
//! Owns: every `libc` call the command makes that needs `unsafe` (signal
//! masks and waits, `poll`, `getrandom`, `flock`, the open files limit,
//! descriptor flags and the
//! socket queries of socket activation), each behind a safe function that
//! turns `-1` into [`std::io::Error::last_os_error`] and states once, in
//! its `// SAFETY:` comment, why the call is sound. Callers decide what an
//! error means (retry on `EINTR`, a message naming the flag).
//! Must never: name another module of the command, retry or print (it
//! reports each call's result as it is), or take ownership of, close,
//! read or write a descriptor it is given: every call here only looks at
//! or sets a descriptor's flags, locks or socket state.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// `-1` as the error it reports, anything else as it is.
fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Block `signals` in the calling thread and every thread it starts from
/// now on (`pthread_sigmask(SIG_BLOCK)`), and return them as a set to
/// wait on with [`sigwait`].
pub fn block_signals(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, valid all zeros (sigemptyset below
    // initialises it properly); `set` is a live local for every call, and
    // pthread_sigmask's old-mask pointer may be null.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Wait for one signal of `set` (blocked beforehand): up to `timeout`
/// (`sigtimedwait`), or without limit (`sigwaitinfo`).
///
/// **Returns:** the signal's number; `EAGAIN` when `timeout` passed first,
/// `EINTR` when another signal interrupted the wait.
pub fn sigwait(set: &libc::sigset_t, timeout: Option<Duration>) -> io::Result<libc::c_int> {
    let r = match timeout {
        Some(t) => {
            let ts = libc::timespec {
                tv_sec: t.as_secs() as libc::time_t,
                tv_nsec: t.subsec_nanos() as libc::c_long,
            };
            // SAFETY: `set` and `ts` are valid for the call; the info
            // pointer may be null.
            unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) }
        }
        // SAFETY: `set` is valid for the call; the info pointer may be null.
        None => unsafe { libc::sigwaitinfo(set, std::ptr::null_mut()) },
    };
    check(r)
}

/// `poll(2)` on `fds` for up to `timeout_ms` milliseconds (-1: no limit).
///
/// **Returns:** how many entries have events (`revents` set); `EINTR`
/// when a signal interrupted the wait.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: libc::c_int) -> io::Result<usize> {
    // SAFETY: `fds` is a valid, exclusively borrowed array of
    // `fds.len()` pollfds; poll writes only their `revents`.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    check(n).map(|n| n as usize)
}

/// Fill `buf` from the kernel's random number generator (`getrandom`, no
/// flags: it blocks only until the generator is first seeded).
///
/// **Returns:** the error when fewer than `buf.len()` bytes came back (at
/// most 256 bytes are always filled whole).
pub fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    // SAFETY: getrandom writes at most `buf.len()` bytes to `buf`, a live,
    // exclusively borrowed slice.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != buf.len() as isize {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `flock(fd, op)`: take, share or drop the advisory lock of `fd`'s open
/// file (`op` as flock(2): `LOCK_EX`, `LOCK_SH`, `LOCK_NB`, …).
///
/// **Returns:** `EWOULDBLOCK` when `LOCK_NB` is given and another holds
/// the lock.
pub fn flock(fd: RawFd, op: libc::c_int) -> io::Result<()> {
    // SAFETY: flock takes a descriptor number and no memory; on a number
    // that is not open it fails with EBADF.
    check(unsafe { libc::flock(fd, op) }).map(drop)
}

/// Raise this process's soft limit on open files to its hard limit
/// (`RLIMIT_NOFILE`): each connection holds two descriptors, its socket
/// and its wake-up eventfd.
///
/// **Returns:** the soft limit now in force.
pub fn raise_open_files() -> io::Result<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the live local `r`.
    check(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) })?;
    if r.rlim_cur < r.rlim_max {
        r.rlim_cur = r.rlim_max;
        // SAFETY: setrlimit only reads the live local `r`.
        check(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) })?;
    }
    Ok(r.rlim_cur)
}

/// The descriptor flags of `fd` (`fcntl(F_GETFD)`).
///
/// **Returns:** `EBADF` when `fd` is not open.
pub fn fd_flags(fd: RawFd) -> io::Result<libc::c_int> {
    // SAFETY: F_GETFD only reads the descriptor's flags, and takes no
    // memory.
    check(unsafe { libc::fcntl(fd, libc::F_GETFD) })
}

/// Set the descriptor flags of `fd` (`fcntl(F_SETFD)`, e.g.
/// `FD_CLOEXEC`).
pub fn set_fd_flags(fd: RawFd, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: F_SETFD only sets the descriptor's flags, and takes no
    // memory.
    check(unsafe { libc::fcntl(fd, libc::F_SETFD, flags) }).map(drop)
}

/// One `int` option at `SOL_SOCKET` level of the socket `fd`
/// (`getsockopt`, e.g. `SO_TYPE`, `SO_ACCEPTCONN`).
///
/// **Returns:** `ENOTSOCK` when `fd` is not a socket.
pub fn socket_option_int(fd: RawFd, opt: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: v and len are ours and live across the call; len is v's
    // size, and getsockopt writes at most len bytes to v.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    check(r)?;
    Ok(v)
}

/// The address family of the socket `fd`'s own address (`getsockname`:
/// `AF_INET`, `AF_INET6`, `AF_UNIX`, …).
pub fn socket_family(fd: RawFd) -> io::Result<libc::c_int> {
    // SAFETY: sockaddr_storage is plain data, valid all zeros.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: ss and len are ours and live across the call; len is ss's
    // size, and getsockname writes at most len bytes to it.
    let r = unsafe {
        libc::getsockname(
            fd,
            (&mut ss as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    check(r)?;
    Ok(libc::c_int::from(ss.ss_family))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_random_fills_the_whole_buffer() {
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        fill_random(&mut a).unwrap();
        fill_random(&mut b).unwrap();
        assert_ne!(a, b, "two draws of 256 bits came out equal");
    }

    #[test]
    fn descriptor_calls_report_a_closed_descriptor_as_ebadf() {
        let bad = 1 << 20;
        let ebadf = Some(libc::EBADF);
        assert_eq!(fd_flags(bad).unwrap_err().raw_os_error(), ebadf);
        assert_eq!(set_fd_flags(bad, 0).unwrap_err().raw_os_error(), ebadf);
        assert_eq!(flock(bad, libc::LOCK_SH).unwrap_err().raw_os_error(), ebadf);
        let e = socket_option_int(bad, libc::SO_TYPE).unwrap_err();
        assert_eq!(e.raw_os_error(), ebadf);
        assert_eq!(socket_family(bad).unwrap_err().raw_os_error(), ebadf);
    }

    #[test]
    fn poll_times_out_with_nothing_ready() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsRawFd;
        let mut fds = [libc::pollfd {
            fd: a.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        assert_eq!(poll(&mut fds, 1).unwrap(), 0);
    }
}
