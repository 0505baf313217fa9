//! Direct I/O of application buffers made of folios: pin, build the bio
//! folio by folio, submit it through io_uring, unpin folio by folio when
//! it completes (the kernel's `iomap` direct-I/O path, seed 002).
//!
//! Owns: checking a request's alignment before anything is pinned,
//! pinning exactly the pages an I/O covers for exactly as long as the
//! kernel may touch them, and turning the bio into the iovecs the ring
//! takes. Must never: return with pins held (success or error), hand
//! the ring a misaligned O_DIRECT request — those are refused with a clear
//! `InvalidInput`, or bounced by [`UringFile`] when bouncing is allowed —
//! or reach a buffer's bytes other than through the buffer: a bio's
//! segments become slices with [`iopages::Bio::slices`], borrowed from
//! the [`FolioBuffer`] that owns them, so this file has no `unsafe`.

use crate::backend::{check_range, Backend};
use crate::uring::UringFile;
use iopages::{Bio, BioLimits, FolioBuffer, Page, PageAllocator};
use std::io;
use std::sync::Arc;

fn invalid(e: iopages::BioError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e.to_string())
}

/// Direct I/O between folio buffers of one arena and a file.
pub struct DirectFile {
    file: Arc<UringFile>,
    alloc: PageAllocator,
    limits: BioLimits,
    folio_aware: bool,
    allow_bounce: bool,
}

impl DirectFile {
    /// Direct I/O on `file` for buffers of `alloc`'s arena, with the
    /// default bio limits, the folio-aware builder, and misaligned requests
    /// refused.
    pub fn new(file: Arc<UringFile>, alloc: &PageAllocator) -> DirectFile {
        DirectFile {
            file,
            alloc: alloc.clone(),
            limits: BioLimits::default(),
            folio_aware: true,
            allow_bounce: false,
        }
    }

    /// Bio limits for each request (a request needing more segments than
    /// they allow is split into several bios).
    pub fn with_limits(mut self, limits: BioLimits) -> DirectFile {
        self.limits = limits;
        self
    }

    /// Build bios page by page (the baseline) instead of folio by folio.
    pub fn with_page_by_page(mut self, on: bool) -> DirectFile {
        self.folio_aware = !on;
        self
    }

    /// Let misaligned requests go through the file's bounce buffers
    /// instead of refusing them.
    pub fn with_bounce(mut self, on: bool) -> DirectFile {
        self.allow_bounce = on;
        self
    }

    /// The file.
    pub fn file(&self) -> &Arc<UringFile> {
        &self.file
    }

    fn check(&self, file_offset: u64, pages: &[Page], offset: usize, len: usize) -> io::Result<()> {
        let bad = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        if offset
            .checked_add(len)
            .is_none_or(|end| end > pages.len() * iopages::PAGE_SIZE)
        {
            return bad(format!(
                "direct I/O of {len} bytes at buffer offset {offset} leaves the {}-byte buffer",
                pages.len() * iopages::PAGE_SIZE
            ));
        }
        check_range(file_offset, len as u64, self.file.size_bytes())?;
        if self.file.direct_io() && !self.allow_bounce {
            let (io_a, mem_a) = (self.file.io_align(), self.file.mem_align());
            if !file_offset.is_multiple_of(io_a as u64) || !len.is_multiple_of(io_a) {
                return bad(format!(
                    "direct I/O on {} needs file offset and length in multiples of {io_a} bytes: offset {file_offset}, length {len}",
                    self.file.path().display()
                ));
            }
            if !offset.is_multiple_of(mem_a) {
                return bad(format!(
                    "direct I/O on {} needs buffer offsets in multiples of {mem_a} bytes: buffer offset {offset} (allow bouncing to copy instead)",
                    self.file.path().display()
                ));
            }
        }
        Ok(())
    }

    fn build(&self, pages: &[Page], offset: usize, len: usize) -> io::Result<Bio> {
        let b = if self.folio_aware {
            Bio::from_pages(&self.alloc, pages, offset, len, self.limits)
        } else {
            Bio::from_pages_by_page(&self.alloc, pages, offset, len, self.limits)
        };
        b.map_err(invalid)
    }

    fn release(&self, bio: Bio) {
        if self.folio_aware {
            bio.release(&self.alloc)
        } else {
            bio.release_by_page(&self.alloc)
        }
    }

    /// Bytes one bio carries at most: `len` is cut into bios of this size.
    fn bio_bytes(&self) -> usize {
        let b = self.limits.max_segments * self.limits.max_segment_bytes;
        // Whole pages, so that every bio but the last stays aligned.
        (b / iopages::PAGE_SIZE * iopages::PAGE_SIZE).max(iopages::PAGE_SIZE)
    }

    /// Check the request, then cut it into bios: build each (pinning),
    /// run `io` on it at its file offset, release it (unpinning) whatever
    /// `io` returned.
    fn each_bio(
        &self,
        file_offset: u64,
        pages: &[Page],
        offset: usize,
        len: usize,
        mut io: impl FnMut(u64, &Bio) -> io::Result<()>,
    ) -> io::Result<()> {
        self.check(file_offset, pages, offset, len)?;
        let step = self.bio_bytes();
        let mut done = 0;
        while done < len {
            let n = step.min(len - done);
            let bio = self.build(pages, offset + done, n)?;
            let r = io(file_offset + done as u64, &bio);
            self.release(bio);
            r?;
            done += n;
        }
        Ok(())
    }

    /// Write `buf[range]` to the file at `file_offset`: the buffer's
    /// pages are pinned, built into bios folio by folio, and the bios'
    /// segments handed to the ring as slices borrowed from `buf`.
    ///
    /// **Context:** blocks until the I/O completes. **Returns:**
    /// `InvalidInput` before anything is pinned for a range outside the
    /// buffer or the file, a buffer of another arena, or a request
    /// misaligned for O_DIRECT; the file's error otherwise. No pin is left
    /// either way.
    pub fn write(
        &self,
        file_offset: u64,
        buf: &FolioBuffer,
        range: std::ops::Range<usize>,
    ) -> io::Result<()> {
        self.check_buffer(buf, &range)?;
        let pages = buf.pages();
        self.each_bio(file_offset, &pages, range.start, range.len(), |at, bio| {
            let segs = bio.slices(buf).map_err(invalid)?;
            self.file.write_at(at, &segs)
        })
    }

    /// Read the file at `file_offset` into `buf[range]`; `&mut buf` keeps
    /// every other access to those bytes out while the kernel writes them.
    ///
    /// **Context / Returns:** as [`DirectFile::write`].
    pub fn read(
        &self,
        file_offset: u64,
        buf: &mut FolioBuffer,
        range: std::ops::Range<usize>,
    ) -> io::Result<()> {
        self.check_buffer(buf, &range)?;
        let pages = buf.pages();
        self.each_bio(file_offset, &pages, range.start, range.len(), |at, bio| {
            let mut segs = bio.slices_mut(buf).map_err(invalid)?;
            self.file.read_at(at, &mut segs)
        })
    }

    fn check_buffer(&self, buf: &FolioBuffer, range: &std::ops::Range<usize>) -> io::Result<()> {
        if range.start > range.end || range.end > buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "range {range:?} is not inside the {}-byte buffer",
                    buf.len()
                ),
            ));
        }
        if !buf.allocator().same_allocator(&self.alloc) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the buffer belongs to another arena than this direct-I/O file's",
            ));
        }
        Ok(())
    }
}
