//! The rest of a started write the socket did not take at once: left to
//! the connection's reader thread, which sends it as the store reads, so
//! that no submitting thread waits on a slow store.
//!
//! Owns: the connection's tail (the requests of one write, and how much
//! of it went out), the reader's pushes of it when the socket has room,
//! its deadline (the earliest of its requests'), and its end when the
//! reader ends. Must never: let another request's bytes into the stream
//! while a tail is left (every writer checks [`Conn::tail_busy`] under
//! the writer lock), leave a tail nobody sends (one is left only while
//! the reader runs: checked under the connection's mutex, which the
//! reader's end takes too), or end a request twice.
//!
//! Lock order: the writer, then the connection's mutex, then the tail.

use super::started::{reqs_bufs, HeldReq, Written};
use super::*;
use crate::sys;
use std::os::fd::{AsFd, RawFd};

/// The requests of one write, and how many of its bytes went out.
pub(super) struct Tail {
    reqs: Vec<HeldReq>,
    sent: usize,
}

impl Conn {
    /// Whether a write is left in part (the stream is mid-request).
    pub(super) fn tail_busy(&self) -> bool {
        self.has_tail.load(Ordering::Acquire)
    }

    /// Leave the rest of `reqs` (`sent` bytes of which went out) to the
    /// reader, and wake it. Called under the writer lock.
    ///
    /// **Returns:** `reqs` back with the error to fail them with when the
    /// reader has ended or the connection was given up (nobody would send
    /// the rest).
    pub(super) fn leave_tail(
        &self,
        reqs: Vec<HeldReq>,
        sent: usize,
    ) -> Result<(), (Vec<HeldReq>, io::Error)> {
        let s = self.shared.lock();
        if s.reader_gone || s.dead.is_some() {
            return Err((reqs, self.ended_mid_request()));
        }
        *self.tail.lock() = Some(Tail { reqs, sent });
        self.has_tail.store(true, Ordering::Release);
        drop(s);
        sys::eventfd_signal(self.wake.as_fd());
        Ok(())
    }

    /// The reader's turn with the tail: send more of it when the socket
    /// is `writable`, fail it past its deadline; end its requests once it
    /// is all sent or failed. Never waits.
    pub(super) fn tend_tail(&self, writable: bool) {
        if !self.tail_busy() {
            return;
        }
        // Other lock holders only look at the tail and let go: try again
        // at the next turn.
        let Some(w) = self.writer.try_lock() else {
            return;
        };
        let mut t = self.tail.lock();
        let Some(tail) = t.as_mut() else {
            return;
        };
        let Some(result) = self.push(&w, tail, writable) else {
            return;
        };
        let tail = t.take().expect("looked at above");
        self.has_tail.store(false, Ordering::Release);
        self.tail_done.notify_all();
        drop((t, w));
        self.after_written(Written::Ended(tail.reqs, result));
    }

    /// Send more of `tail` if `writable`. **Returns:** `Some` once it is
    /// all sent (`Ok`) or failed (the send's error, or `TimedOut` past
    /// its deadline); `None` while some is left.
    fn push(
        &self,
        w: &Stream,
        tail: &mut Tail,
        writable: bool,
    ) -> Option<Result<(), Option<io::Error>>> {
        let deadline = tail.reqs.iter().map(|r| r.call.deadline).min()?;
        let parts: Vec<Vec<&[u8]>> = tail.reqs.iter().map(HeldReq::parts).collect();
        let mut bufs = reqs_bufs(&tail.reqs, &parts);
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut rest: &mut [IoSlice<'_>] = &mut bufs;
        IoSlice::advance_slices(&mut rest, tail.sent);
        if writable {
            match sys::send_nowait(w.as_raw_fd(), rest) {
                Ok(0) => return Some(Err(Some(ErrorKind::WriteZero.into()))),
                Ok(n) => tail.sent += n,
                Err(e) if is_timeout(&e) || e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Some(Err(Some(e))),
            }
        }
        if tail.sent == total {
            return Some(Ok(()));
        }
        if Instant::now() >= deadline {
            let left = total - tail.sent;
            let e = io::Error::new(
                ErrorKind::TimedOut,
                format!("only {left} bytes left: the store stopped reading or reads too slowly"),
            );
            return Some(Err(Some(e)));
        }
        None
    }

    /// The reader has ended: a tail left fails (its requests end `Again`
    /// within their deadline, as the connection's other requests do).
    /// Called after `reader_gone` is set, so no tail is left after it.
    pub(super) fn end_tail(&self) {
        let tail = {
            let _s = self.shared.lock();
            let t = self.tail.lock().take();
            self.has_tail.store(false, Ordering::Release);
            t
        };
        self.tail_done.notify_all();
        if let Some(tail) = tail {
            let e = self.ended_mid_request();
            self.after_written(Written::Ended(tail.reqs, Err(Some(e))));
        }
    }

    /// What a write left in part fails with when nobody will send its
    /// rest.
    fn ended_mid_request(&self) -> io::Error {
        io::Error::new(
            ErrorKind::ConnectionAborted,
            format!("{}: the connection ended mid-request", self.name),
        )
    }

    /// Wait, under the writer lock `w` (given up meanwhile), until no
    /// write is left in part or `deadline` passes.
    ///
    /// **Returns:** the writer again with no tail left; `None` past the
    /// deadline.
    pub(super) fn without_tail<'a>(
        &'a self,
        mut w: parking_lot::MutexGuard<'a, Stream>,
        deadline: Instant,
    ) -> Option<parking_lot::MutexGuard<'a, Stream>> {
        loop {
            if !self.tail_busy() {
                return Some(w);
            }
            let mut t = self.tail.lock();
            drop(w);
            while t.is_some() {
                if self.tail_done.wait_until(&mut t, deadline).timed_out() {
                    return None;
                }
            }
            drop(t);
            w = self.writer.try_lock_until(deadline)?;
        }
    }

    /// The reader's wait for input: also for room when a tail is left,
    /// and for the wake-up a new tail sends; tends the tail on return.
    ///
    /// **Returns:** whether the socket has input.
    pub(super) fn wait_input(&self, fd: RawFd, tick: Duration) -> io::Result<bool> {
        let out = if self.tail_busy() { libc::POLLOUT } else { 0 };
        let mut p = [
            libc::pollfd {
                fd,
                events: libc::POLLIN | out,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let r = match sys::poll(&mut p, sys::poll_ms(Some(tick))) {
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(false),
            Err(e) => Err(e),
            Ok(_) => Ok(p[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0),
        };
        if p[1].revents != 0 {
            sys::eventfd_drain(self.wake.as_fd());
        }
        self.tend_tail(p[0].revents & libc::POLLOUT != 0);
        r
    }
}
