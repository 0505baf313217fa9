//! One read or write call from start to end: step 1 (the range check)
//! and the choice between the rings (`O_DIRECT`, steps 2 to 5) and
//! buffered `preadv` / `pwritev` on the calling thread.
//!
//! Owns: `UringFile::io` (the whole of one call) and the buffered path.
//! Must never: submit anything for a refused range, return before every
//! byte of the call moved or an error names where it stopped, or accept a
//! zero-byte transfer as progress.

use super::bounce::BOUNCE_CHUNK_BYTES;
#[cfg(doc)]
use super::DirectIo;
use super::{Seg, UringFile};
use crate::backend::check_range;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;

/// The most iovecs one `preadv` / `pwritev` takes (`IOV_MAX`).
const MAX_IOV: usize = 1024;

impl UringFile {
    /// The whole of one read or write call.
    pub(super) fn io(&self, offset: u64, segs: &[Seg], write: bool) -> io::Result<()> {
        let total = segs
            .iter()
            .try_fold(0u64, |acc, s| acc.checked_add(s.len as u64))
            .ok_or_else(|| self.err(io::ErrorKind::InvalidInput, "segment lengths overflow"))?;
        check_range(offset, total, self.size).map_err(|e| self.err(e.kind(), e))?;
        if total == 0 {
            return Ok(());
        }
        if !self.direct {
            return self.io_sync(segs, write);
        }
        let chunk = BOUNCE_CHUNK_BYTES.max(self.io_align);
        let mut plan = self.plan(segs, chunk)?;
        let mut ring = self.ring();
        if !write {
            self.drive(&mut ring, &mut plan.ops, false)?;
            for r in &plan.runs {
                self.copy_run(r, segs, &plan.bounces, chunk, false);
            }
            return Ok(());
        }
        let _locks = self.read_edges(&mut ring, &plan, chunk)?;
        for r in &plan.runs {
            self.copy_run(r, segs, &plan.bounces, chunk, true);
        }
        self.drive(&mut ring, &mut plan.ops, true)
        // The bounces drop after this, once every entry using them was reaped.
    }

    /// Buffered I/O ([`DirectIo::Off`], or the fallback where `O_DIRECT` is
    /// refused): `preadv` / `pwritev` on the calling thread. Through
    /// io_uring a buffered write to ext4 cannot complete without blocking,
    /// so the kernel hands every one to an io-wq worker thread: two more
    /// context switches per I/O, which cost more than the copy into the
    /// page cache (measured with 4 KiB random writes, `docs/experiments.md`
    /// E6). Short transfers continue where they stopped; `EINTR` retries.
    fn io_sync(&self, segs: &[Seg], write: bool) -> io::Result<()> {
        let cap = match self.short_io.load(Relaxed) {
            0 => usize::MAX,
            n => n,
        };
        let mut i = 0; // first segment not fully done
        let mut done_in_first = 0usize; // bytes of segs[i] already moved
        while i < segs.len() {
            let iov = sync_iovecs(&segs[i..], done_in_first, cap);
            let off = segs[i].off + done_in_first as u64;
            self.counters.sync_calls.fetch_add(1, Relaxed);
            let what = if write { "pwritev" } else { "preadv" };
            let n = match self.sync_transfer(&iov, off, write) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    self.counters.retries.fetch_add(1, Relaxed);
                    continue;
                }
                Err(e) => return Err(self.err(e.kind(), format!("{what} at offset {off}: {e}"))),
            };
            if n == 0 {
                return Err(self.err(
                    if write {
                        io::ErrorKind::WriteZero
                    } else {
                        io::ErrorKind::UnexpectedEof
                    },
                    format!("{what} moved no bytes at offset {off} (end of file)"),
                ));
            }
            (i, done_in_first) = self.advance(segs, (i, done_in_first), n);
        }
        Ok(())
    }

    /// One `pwritev` (`write`) or `preadv` of `iov` at `off`.
    /// **Returns:** the bytes moved, or the system's error.
    fn sync_transfer(&self, iov: &[libc::iovec], off: u64, write: bool) -> io::Result<usize> {
        let fd = self.file.as_raw_fd();
        // SAFETY: every iovec describes (the rest of) a caller's segment,
        // valid for the call: readable for a write, writable for a read.
        let n = unsafe {
            if write {
                libc::pwritev(
                    fd,
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    off as libc::off_t,
                )
            } else {
                libc::preadv(
                    fd,
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    off as libc::off_t,
                )
            }
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Where a buffered call continues after `n` more bytes moved from
    /// `(i, done_in_first)` (the first segment not fully done, and its
    /// bytes already moved), past empty segments; a transfer that stopped
    /// inside a segment counts as a short one.
    fn advance(&self, segs: &[Seg], at: (usize, usize), n: usize) -> (usize, usize) {
        let (mut i, mut done_in_first) = at;
        let mut left = n;
        while left > 0 {
            let rest = segs[i].len - done_in_first;
            if left >= rest {
                left -= rest;
                i += 1;
                done_in_first = 0;
            } else {
                done_in_first += left;
                left = 0;
                self.counters.short_resubmissions.fetch_add(1, Relaxed);
            }
        }
        while i < segs.len() && segs[i].len == 0 {
            i += 1;
        }
        (i, done_in_first)
    }
}

/// The iovecs of one buffered call over `segs` (at most `MAX_IOV`), the
/// first `skip_first` bytes of the first segment left out, `cap` bytes at
/// most in all.
fn sync_iovecs(segs: &[Seg], skip_first: usize, cap: usize) -> Vec<libc::iovec> {
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(segs.len().min(MAX_IOV));
    let mut asked = 0usize;
    for (k, s) in segs.iter().take(MAX_IOV).enumerate() {
        let skip = if k == 0 { skip_first } else { 0 };
        let len = (s.len - skip).min(cap - asked);
        iov.push(libc::iovec {
            iov_base: s.ptr.wrapping_add(skip).cast(),
            iov_len: len,
        });
        asked += len;
        if asked == cap {
            break;
        }
    }
    iov
}
