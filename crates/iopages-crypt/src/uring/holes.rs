//! Hole punches, discards and the file's data and holes: plain system
//! calls on the calling thread, outside the rings.
//!
//! Owns: the bodies of [`Backend::punch`], [`Backend::discard`] and
//! [`Backend::extents`] for a [`UringFile`] — `fallocate(PUNCH_HOLE |
//! KEEP_SIZE)`, `BLKDISCARD` where a block device cannot punch, and
//! `lseek(SEEK_DATA / SEEK_HOLE)`. Must never: punch or discard on a
//! read-only file or out of range (refused before anything is asked), or
//! report more extents than asked for.

use super::UringFile;
#[cfg(doc)]
use crate::backend::Backend;
use crate::backend::{check_range, push_extent, Extent};
use std::io;
use std::os::fd::AsRawFd;

/// `BLKDISCARD`: `_IO(0x12, 119)`.
const BLKDISCARD: u64 = 0x1277;

impl UringFile {
    /// [`Backend::punch`] (documented on this type's `Backend` impl):
    /// the range checked, then `fallocate(PUNCH_HOLE | KEEP_SIZE)`.
    pub(super) fn punch_range(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_discard(offset, len, "punch")?;
        if len == 0 {
            return Ok(());
        }
        self.punch_hole(offset, len)
    }

    /// [`Backend::discard`] (documented on this type's `Backend` impl):
    /// the range checked, then a punch, or `BLKDISCARD` where a block
    /// device cannot punch.
    pub(super) fn discard_range(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_discard(offset, len, "discard")?;
        if len == 0 {
            return Ok(());
        }
        match self.punch_hole(offset, len) {
            Err(e) if self.is_block && punch_refused(&e) => {}
            done => return done,
        }
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD reads two u64 (start, length) from the
        // pointer given, which points at `range` for the whole call.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), BLKDISCARD as _, range.as_ptr()) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return Err(self.err(
                os_kind(&e),
                format!("BLKDISCARD of {len} bytes at offset {offset}: {e}"),
            ));
        }
        Ok(())
    }

    /// [`Backend::extents`] (documented on this type's `Backend` impl):
    /// a regular file's data and holes from `lseek(SEEK_DATA /
    /// SEEK_HOLE)`; a block device is all data.
    pub(super) fn extents_of(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> io::Result<Vec<Extent>> {
        check_range(offset, len, self.size).map_err(|e| self.err(e.kind(), e))?;
        let end = offset + len;
        let max = max_extents.max(1);
        let mut out: Vec<Extent> = Vec::new();
        if self.is_block {
            push_extent(&mut out, len, false);
            return Ok(out);
        }
        let mut pos = offset;
        while pos < end {
            // The next data at or after `pos`: none (ENXIO) means a hole
            // to the end of the file.
            let data = match self.seek(pos, libc::SEEK_DATA) {
                Ok(d) => d.clamp(pos, end),
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
                Err(e) => return Err(self.err(e.kind(), format!("lseek(SEEK_DATA, {pos}): {e}"))),
            };
            if data > pos {
                if out.last().is_some_and(|x| !x.hole) && out.len() == max {
                    break;
                }
                push_extent(&mut out, data - pos, true);
                pos = data;
                continue;
            }
            // Data at `pos`: it runs to the next hole (the end of the
            // file at the latest).
            let hole = match self.seek(pos, libc::SEEK_HOLE) {
                Ok(h) if h > pos => h.min(end),
                // Cut shorter under us between the two calls: the rest is
                // past the end of the file, a hole.
                Ok(_) => pos,
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => pos,
                Err(e) => return Err(self.err(e.kind(), format!("lseek(SEEK_HOLE, {pos}): {e}"))),
            };
            let (next, hole_run) = if hole > pos {
                (hole, false)
            } else {
                (end, true)
            };
            if out.last().is_some_and(|x| x.hole != hole_run) && out.len() == max {
                break;
            }
            push_extent(&mut out, next - pos, hole_run);
            pos = next;
        }
        Ok(out)
    }

    /// Refuse a punch or discard on a read-only file (`PermissionDenied`)
    /// or out of range (`InvalidInput`), before anything is asked.
    fn check_discard(&self, offset: u64, len: u64, what: &str) -> io::Result<()> {
        check_range(offset, len, self.size).map_err(|e| self.err(e.kind(), e))?;
        if self.read_only {
            return Err(self.err(
                io::ErrorKind::PermissionDenied,
                format!("{what} of {len} bytes at offset {offset}: the file is open read-only"),
            ));
        }
        Ok(())
    }

    /// `fallocate(PUNCH_HOLE | KEEP_SIZE)` of a checked, non-empty range.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(n)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return Err(self.err(
                io::ErrorKind::InvalidInput,
                format!("punch of {len} bytes at offset {offset}: past the largest file offset"),
            ));
        };
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        loop {
            // SAFETY: fallocate on our own open descriptor; no memory.
            if unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, n) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(self.err(
                os_kind(&e),
                format!("fallocate(PUNCH_HOLE) of {len} bytes at offset {offset}: {e}"),
            ));
        }
    }

    /// `lseek(fd, pos, whence)`. The descriptor's position is never used
    /// for I/O here (every transfer names its offset), so moving it is
    /// harmless.
    fn seek(&self, pos: u64, whence: libc::c_int) -> io::Result<u64> {
        let off = libc::off_t::try_from(pos)
            .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: lseek on our own open descriptor; no memory.
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), off, whence) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as u64)
        }
    }
}

/// The kind of an OS error, `Unsupported` for `EOPNOTSUPP` (which the
/// standard library reports as `Other`) and `ENOSYS`.
fn os_kind(e: &io::Error) -> io::ErrorKind {
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => io::ErrorKind::Unsupported,
        _ => e.kind(),
    }
}

/// Whether a punch failed because the device does not offer it for this
/// range (`Unsupported`, or `InvalidInput` from `EINVAL`), so a discard
/// falls back to `BLKDISCARD`.
fn punch_refused(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Unsupported | io::ErrorKind::InvalidInput
    )
}
