//! Reads straight out of the page cache: under buffered I/O the file is
//! also mapped read-only, and [`Backend::mapped`] hands out its bytes.
//!
//! Owns: `FileMap` (the mapping, made at open and unmapped on drop) and
//! the mapped read with its size check. Must never: write through the
//! mapping, hand out bytes past the device's size or the mapping's end, or
//! map a file opened with `O_DIRECT`.

use super::UringFile;
#[cfg(doc)]
use crate::backend::Backend;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;

/// A read-only shared mapping of the whole file: the page cache's pages
/// themselves, for reads that decrypt straight out of them.
pub(super) struct FileMap {
    ptr: *mut u8,
    len: usize,
    /// A regular file (which can shrink under us; a block device cannot).
    regular: bool,
}

// SAFETY: the mapping is read-only and shared by design; it is only read,
// through `&self`, and unmapped once, in `Drop`.
unsafe impl Send for FileMap {}
// SAFETY: as above.
unsafe impl Sync for FileMap {}

impl FileMap {
    /// `None` when the file cannot be mapped (the caller reads with
    /// `preadv` then).
    pub(super) fn new(file: &File, size: u64, is_block: bool) -> Option<FileMap> {
        let len = usize::try_from(size).ok()?;
        // SAFETY: a fresh read-only shared mapping of `len` bytes of an
        // open file; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        Some(FileMap {
            ptr: ptr.cast(),
            len,
            regular: !is_block,
        })
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; no borrow of
        // it outlives `&self` of the file that owns it.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

impl UringFile {
    /// The bytes at `offset` in the page cache, when the file is mapped
    /// (buffered I/O) and still holds them. A regular file is checked
    /// with `fstat` first: if it has been cut shorter, `None` sends the
    /// read to `preadv`, which reports the end of file (a mapping would
    /// fault). A truncation racing with the copy itself is not covered.
    pub(super) fn mapped_bytes(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let m = self.map.as_ref()?;
        let end = offset.checked_add(len as u64)?;
        if end > self.size || end > m.len as u64 {
            return None;
        }
        if m.regular {
            // SAFETY: `st` is a valid out-parameter for fstat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as above, on our own open descriptor.
            if unsafe { libc::fstat(self.file.as_raw_fd(), &mut st) } != 0
                || (st.st_size as u64) < end
            {
                return None;
            }
        }
        self.counters.mapped_reads.fetch_add(1, Relaxed);
        // SAFETY: `offset..end` lies inside the mapping (checked above),
        // which lives as long as `self`; it is only read.
        Some(unsafe { std::slice::from_raw_parts(m.ptr.add(offset as usize), len) })
    }
}
