//! The system calls the crate makes, each wrapped once with the argument
//! for its safety: `poll(2)`, `epoll(7)` for idle connections, the
//! wake-up eventfd, `O_NONBLOCK` through
//! `fcntl(2)`, the process umask, `SO_PEERCRED`, a Unix socket connected
//! without waiting, `sendmsg(2)` that does not wait, and the sealed memfd
//! of an in-memory volume.
//!
//! Owns: every `unsafe` call into the kernel made by the server, the
//! remote client, the TLS session and the volumes; each returns the
//! kernel's error as an [`io::Error`]. Must never: name another module of
//! the crate, keep state (beyond the lock that serialises umask changes),
//! retry or wait on its own (what an `EINTR` or `EAGAIN` means is the
//! caller's decision — except [`poll_until`], whose contract is a
//! deadline), or hand out a descriptor nobody owns.

use parking_lot::Mutex;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// `poll(2)` over `fds` for up to `timeout_ms` (-1: no limit; a negative
/// `fd` in an entry is skipped).
///
/// **Context:** blocks up to `timeout_ms`.
///
/// **Returns:** how many entries have events; the error (`Interrupted`
/// included) as it came.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a live, exclusively borrowed array of exactly
    // `fds.len()` pollfds for the duration of the call.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// `timeout` as `poll(2)`'s milliseconds, rounded up (a wait never ends
/// before its deadline); `None` is -1, no limit.
pub(crate) fn poll_ms(timeout: Option<Duration>) -> i32 {
    match timeout {
        None => -1,
        Some(t) => t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    }
}

/// Wait until `fd` has one of `events` (POLLIN, POLLOUT) or `deadline`
/// passes; an interrupted wait goes on.
///
/// **Context:** blocks up to `deadline`.
///
/// **Returns:** `Ok(true)` when ready (or hung up: the next attempt sees
/// it), `Ok(false)` when the deadline passed.
pub(crate) fn poll_until(fd: RawFd, events: libc::c_short, deadline: Instant) -> io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let mut p = [libc::pollfd {
            fd,
            events,
            revents: 0,
        }];
        match poll(&mut p, poll_ms(Some(left))) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
            Ok(0) => {}
            Ok(_) => return Ok(true),
        }
    }
}

/// A new non-blocking, close-on-exec eventfd (counter 0): the wake-up
/// descriptor other threads write to end a `poll`.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd has no memory arguments; a non-negative result is a
    // new descriptor nobody else owns.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is the fresh descriptor just checked, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Add one to the eventfd `fd`. A full counter (EAGAIN) already means
/// "woken", so the result is not looked at.
pub(crate) fn eventfd_signal(fd: BorrowedFd<'_>) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live local buffer to a descriptor the
    // caller keeps open for the call.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
}

/// Reset the eventfd `fd` to 0 (nothing happens when it was 0 already:
/// it is non-blocking).
pub(crate) fn eventfd_drain(fd: BorrowedFd<'_>) {
    let mut v = [0u8; 8];
    // SAFETY: reads 8 bytes into a live local buffer from a descriptor the
    // caller keeps open for the call.
    unsafe { libc::read(fd.as_raw_fd(), v.as_mut_ptr().cast(), v.len()) };
}

/// A new close-on-exec epoll instance: where idle connections wait
/// without a thread each.
pub(crate) fn epoll() -> io::Result<OwnedFd> {
    // SAFETY: epoll_create1 has no memory arguments; a non-negative result
    // is a new descriptor nobody else owns.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is the fresh descriptor just checked, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Watch `fd` in the epoll instance `ep` for input or a hang-up, handing
/// `token` back: once (`EPOLLONESHOT`: the watch is then disarmed until
/// [`epoll_forget`]), or for good.
pub(crate) fn epoll_watch(ep: BorrowedFd<'_>, fd: RawFd, token: u64, once: bool) -> io::Result<()> {
    let mut events = libc::EPOLLIN | libc::EPOLLRDHUP;
    if once {
        events |= libc::EPOLLONESHOT;
    }
    let mut ev = libc::epoll_event {
        events: events as u32,
        u64: token,
    };
    // SAFETY: `ev` is a live local the kernel only reads; `ep` is open for
    // the call and `fd` is the caller's open descriptor.
    let r = unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Ask the scheduler for a time slice of `slice` for the calling thread
/// (`sched_setattr(2)` with `SCHED_OTHER` and `sched_runtime`: Linux
/// 6.12's EEVDF takes it as the thread's slice, 0.1–100 ms; a shorter one
/// runs the thread sooner after it wakes). Its nice value is kept.
///
/// **Returns:** the error of `sched_setattr` (older kernels may refuse
/// or ignore the slice).
pub(crate) fn set_time_slice(slice: std::time::Duration) -> io::Result<()> {
    /// `struct sched_attr` (its first version's 56 bytes).
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }
    // SAFETY: getpriority has no memory arguments; errno is cleared first
    // so that -1 (a valid nice value) can be told from an error.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    };
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: 0,
        nice,
        priority: 0,
        runtime: slice.as_nanos().min(u64::MAX as u128) as u64,
        deadline: 0,
        period: 0,
    };
    // SAFETY: `attr` is a live, initialised `sched_attr` whose `size`
    // field gives its length; the kernel only reads it. Thread 0 is the
    // caller.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Watch `fd` in `ep` once more — with `read`, for input or the peer's
/// end of sending; with `out`, for room to write; always for a hang-up or
/// an error — handing `token` back (`EPOLLONESHOT`): the watch of a
/// descriptor watched before (and disarmed since it fired) is re-armed in
/// one call, a new one added.
pub(crate) fn epoll_rearm(
    ep: BorrowedFd<'_>,
    fd: RawFd,
    token: u64,
    read: bool,
    out: bool,
) -> io::Result<()> {
    let mut events = libc::EPOLLONESHOT;
    if read {
        events |= libc::EPOLLIN | libc::EPOLLRDHUP;
    }
    if out {
        events |= libc::EPOLLOUT;
    }
    let mut ev = libc::epoll_event {
        events: events as u32,
        u64: token,
    };
    // SAFETY: as in `epoll_watch`.
    let r = unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, &mut ev) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::ENOENT) {
        return Err(e);
    }
    // SAFETY: as above, with EPOLL_CTL_ADD.
    let r = unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Stop watching `fd` in `ep` (errors ignored: a descriptor not watched
/// has nothing to forget).
pub(crate) fn epoll_forget(ep: BorrowedFd<'_>, fd: RawFd) {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: as in `epoll_watch`; the event is ignored by EPOLL_CTL_DEL
    // but must be a valid pointer on old kernels.
    unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev) };
}

/// `epoll_wait(2)` on `ep` for up to `timeout_ms` (-1: no limit): the
/// tokens of the descriptors that became ready, written to `tokens`.
///
/// **Context:** blocks up to `timeout_ms`.
///
/// **Returns:** how many tokens were written; `Interrupted` as it came.
pub(crate) fn epoll_wait(
    ep: BorrowedFd<'_>,
    tokens: &mut [u64],
    timeout_ms: i32,
) -> io::Result<usize> {
    const MAX: usize = 64;
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; MAX];
    let n = tokens.len().min(MAX);
    // SAFETY: `evs` is a live local array of at least `n` entries the
    // kernel writes to; `ep` is open for the call.
    let r = unsafe { libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), n as i32, timeout_ms) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let r = r as usize;
    for (t, e) in tokens.iter_mut().zip(&evs[..r]) {
        *t = e.u64;
    }
    Ok(r)
}

/// Whether the open file behind `fd` is non-blocking (`O_NONBLOCK`).
pub(crate) fn is_nonblocking(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: F_GETFL has no memory arguments; `fd` is open for the call.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(flags & libc::O_NONBLOCK != 0)
}

/// Set or clear `O_NONBLOCK` on the open file behind `fd` (errors
/// ignored: the descriptor may be gone already).
pub(crate) fn set_nonblocking(fd: BorrowedFd<'_>, on: bool) {
    // SAFETY: F_GETFL / F_SETFL have no memory arguments; `fd` is open
    // for the call.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags >= 0 {
            let new = if on {
                flags | libc::O_NONBLOCK
            } else {
                flags & !libc::O_NONBLOCK
            };
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, new);
        }
    }
}

/// Serialises this crate's changes of the process's umask.
static UMASK: Mutex<()> = Mutex::new(());

/// Run `f` under the umask `mask`, the old mask put back afterwards.
pub(crate) fn with_umask<T>(mask: libc::mode_t, f: impl FnOnce() -> T) -> T {
    let _g = UMASK.lock();
    // SAFETY: umask only swaps the process's mask; UMASK serialises our
    // own changes.
    let old = unsafe { libc::umask(mask) };
    let r = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    r
}

/// The uid and gid of the process at the other end of the Unix socket
/// `fd` (`SO_PEERCRED`); `None` when the kernel does not say.
pub(crate) fn peer_credentials(fd: BorrowedFd<'_>) -> Option<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of `len` bytes that lives for the
    // call; `fd` is open for the call.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some((cred.uid, cred.gid))
}

/// The address of the Unix socket at `path` (the bytes of the path and a
/// NUL); `None` when the path is too long or holds a NUL.
pub(crate) fn unix_address(path: &[u8]) -> Option<libc::sockaddr_un> {
    // SAFETY: sockaddr_un is plain data; zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if path.len() >= addr.sun_path.len() || path.contains(&0) {
        return None;
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, &b) in addr.sun_path.iter_mut().zip(path) {
        *d = b as libc::c_char;
    }
    Some(addr)
}

/// A new, unconnected, non-blocking, close-on-exec Unix stream socket.
pub(crate) fn unix_socket() -> io::Result<UnixStream> {
    // SAFETY: socket has no memory arguments; a non-negative result is a
    // new descriptor, owned by the stream made from it at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    Ok(unsafe { UnixStream::from_raw_fd(fd) })
}

/// One `connect(2)` of the socket `fd` to `addr`.
///
/// **Returns:** the error as it came (`EAGAIN` from a non-blocking
/// socket whose listener's backlog is full, `EINTR`, ...).
pub(crate) fn connect_unix(fd: BorrowedFd<'_>, addr: &libc::sockaddr_un) -> io::Result<()> {
    // SAFETY: `addr` is a live, initialised sockaddr_un of that size;
    // `fd` is open for the call.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            std::ptr::addr_of!(*addr).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The most buffers one `sendmsg` takes (Linux's UIO_MAXIOV).
pub(crate) const MAX_IOV: usize = 1024;

/// One `sendmsg` of a prefix of `bufs` (at most [`MAX_IOV`] of them)
/// that does not wait (`MSG_DONTWAIT` for this call alone: the socket
/// stays blocking for a reader; `MSG_NOSIGNAL`: a closed peer is `EPIPE`,
/// not a signal).
pub(crate) fn send_nowait(fd: RawFd, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on Unix; sendmsg only reads
    // the buffers.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len().min(MAX_IOV) as _;
    // SAFETY: `msg` points at `bufs`, live for the call.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// One `recv` into `buf` that does not wait (`MSG_DONTWAIT` for this call
/// alone: the socket stays blocking for its other users).
pub(crate) fn recv_nowait(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its length for the call.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// A new close-on-exec memfd named `name` that can be sealed.
pub(crate) fn memfd_sealable(name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a NUL-terminated string; the flags are valid.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Seal the memfd `fd` against shrinking (`F_SEAL_SHRINK`).
pub(crate) fn seal_shrink(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_ADD_SEALS has no memory arguments; `fd` is open for the
    // call, and the seal flags are valid.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the kernel takes the slice, the thread's scheduling record
    /// shows it.
    #[test]
    fn a_time_slice_taken_is_the_threads_slice() {
        std::thread::spawn(|| {
            let before = std::fs::read_to_string("/proc/thread-self/sched").unwrap();
            match set_time_slice(std::time::Duration::from_micros(100)) {
                Ok(()) => {
                    let after = std::fs::read_to_string("/proc/thread-self/sched").unwrap();
                    let slice = after
                        .lines()
                        .find(|l| l.starts_with("se.slice"))
                        .and_then(|l| l.split(':').nth(1))
                        .map(|v| v.trim().to_string());
                    // Kernels before EEVDF's custom slices have no such
                    // line (and ignore the slice).
                    if before.contains("se.slice") {
                        assert_eq!(slice.as_deref(), Some("100000"), "{after}");
                    }
                }
                Err(e) => eprintln!("sched_setattr refused the slice here: {e}"),
            }
        })
        .join()
        .unwrap();
    }
}
