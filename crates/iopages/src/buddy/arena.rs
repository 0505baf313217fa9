//! The arena: "physical memory" for iopages.
//!
//! Owns: one memfd of N bytes, its single shared read/write mapping (the
//! direct map: frame address = base + pfn × 4096) and the per-frame metadata
//! array. Must never: allocate or free frames — that is the zone's job; the
//! arena only translates between frame numbers, addresses and metadata.
//!
//! The memfd (rather than anonymous memory) is what later layers need: vmap
//! maps runs of its frames a second time elsewhere, and io_uring can register
//! the whole mapping as fixed buffers.

use crate::buddy::frame::{Frame, FrameInfo, Page, MAX_ORDER_NR_PAGES, PAGE_SHIFT, PAGE_SIZE};
use crate::error::{Error, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The smallest arena accepted: one largest block (4 MiB).
pub const ARENA_MIN_BYTES: u64 = (MAX_ORDER_NR_PAGES * PAGE_SIZE) as u64;
/// The largest arena accepted: frame numbers must fit in 31 bits (8 TiB).
pub const ARENA_MAX_BYTES: u64 = (1u64 << 31) * PAGE_SIZE as u64;

/// Whether the arena should be backed by huge pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Base pages only.
    Never,
    /// Ask for hugetlb pages, then for transparent huge pages, and work with
    /// base pages if the kernel allows neither.
    #[default]
    Try,
    /// Fail unless hugetlb pages back the arena.
    Require,
}

/// What actually backs the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// hugetlbfs pages (2 MiB), reserved when the arena was mapped.
    Hugetlb,
    /// Base pages with `MADV_HUGEPAGE` accepted; whether the kernel really
    /// uses huge pages for shared memory depends on
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled`.
    TransparentAdvised,
    /// 4 KiB base pages.
    Base,
}

/// The memfd, its direct map and the frame metadata.
pub struct Arena {
    fd: OwnedFd,
    base: *mut u8,
    size_bytes: usize,
    frames: Box<[Frame]>,
    backing: Backing,
}

// SAFETY: the mapping is shared memory owned by the arena for its whole life;
// the arena hands out addresses, never references, and the metadata is made
// of atomics.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    /// Create an arena of `size_bytes` (a multiple of 4 MiB, at least 4 MiB).
    ///
    /// **Context:** may block in the kernel while it reserves or populates
    /// memory. **Returns:** an error naming the size rule, or the system call
    /// that failed and why.
    pub fn new(size_bytes: u64, huge: HugePages, populate: bool) -> Result<Arena> {
        check_size(size_bytes)?;
        let size = size_bytes as usize;
        let (fd, base, backing) = match huge {
            HugePages::Never => {
                let fd = memfd(false)?;
                let base = map(&fd, size, populate)?;
                (fd, base, Backing::Base)
            }
            HugePages::Require => {
                let fd = memfd(true).map_err(hugetlb_error)?;
                let base = map(&fd, size, populate).map_err(hugetlb_error)?;
                (fd, base, Backing::Hugetlb)
            }
            HugePages::Try => {
                match memfd(true).and_then(|fd| map(&fd, size, populate).map(|b| (fd, b))) {
                    Ok((fd, base)) => (fd, base, Backing::Hugetlb),
                    Err(_) => {
                        let fd = memfd(false)?;
                        let base = map(&fd, size, populate)?;
                        // SAFETY: `base..base+size` is the mapping just made.
                        let advised =
                            unsafe { libc::madvise(base.cast(), size, libc::MADV_HUGEPAGE) } == 0;
                        let backing = if advised {
                            Backing::TransparentAdvised
                        } else {
                            Backing::Base
                        };
                        (fd, base, backing)
                    }
                }
            }
        };
        let nr_pages = size / PAGE_SIZE;
        let frames: Box<[Frame]> = (0..nr_pages).map(|_| Frame::default()).collect();
        Ok(Arena {
            fd,
            base,
            size_bytes: size,
            frames,
            backing,
        })
    }

    /// Bytes in the arena.
    #[inline]
    pub fn size_bytes(&self) -> usize {
        self.size_bytes
    }

    /// Frames in the arena.
    #[inline]
    pub fn nr_pages(&self) -> usize {
        self.frames.len()
    }

    /// What backs the arena.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The memfd (for mapping frames elsewhere or registering with io_uring).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Start of the direct map.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Address of `page` in the direct map.
    ///
    /// # Panics
    /// If `page` is outside the arena (in release builds too).
    #[inline]
    pub fn page_address(&self, page: Page) -> *mut u8 {
        let pfn = page.pfn() as usize;
        // Checked in release builds too: a `Page` is a plain number anyone
        // can make, and this is what keeps every address this crate hands
        // out inside the mapping. One compare, predicted.
        assert!(
            pfn < self.frames.len(),
            "page_address: pfn {pfn} outside the arena ({} frames)",
            self.frames.len()
        );
        // SAFETY: pfn < nr_pages, so the offset stays inside the mapping.
        unsafe { self.base.add(pfn << PAGE_SHIFT) }
    }

    /// Assert that `page` starts a block of `order` inside the arena: in
    /// range and aligned to its order. `boundary` names where it is
    /// checked, for the panic message (allocation checks call this at
    /// every layer boundary).
    #[cold]
    pub(crate) fn check_block(&self, page: Page, order: u32, boundary: &str) {
        let pfn = page.pfn();
        assert!(
            (pfn as usize) < self.frames.len() && pfn & ((1 << order) - 1) == 0,
            "{boundary}: pfn {pfn} is not an order-{order} block of this arena ({} frames)",
            self.frames.len()
        );
    }

    /// The page containing `addr`, if `addr` lies in the direct map.
    pub fn page_of_address(&self, addr: *const u8) -> Option<Page> {
        let off = (addr as usize).checked_sub(self.base as usize)?;
        (off < self.size_bytes).then(|| Page::from_pfn((off >> PAGE_SHIFT) as u32))
    }

    /// The metadata of frame `pfn`.
    #[inline]
    pub(crate) fn frame(&self, pfn: u32) -> &Frame {
        &self.frames[pfn as usize]
    }

    /// A snapshot of `page`'s metadata.
    pub fn frame_info(&self, page: Page) -> Option<FrameInfo> {
        self.frames.get(page.pfn() as usize).map(Frame::info)
    }

    /// Bytes of metadata per 4 KiB frame.
    pub const fn metadata_bytes_per_frame() -> usize {
        std::mem::size_of::<Frame>()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `base` and `size_bytes` describe the mapping made in `new`,
        // and nothing can use it once the arena is being dropped.
        unsafe { libc::munmap(self.base.cast(), self.size_bytes) };
    }
}

fn check_size(size_bytes: u64) -> Result<()> {
    let reason = if size_bytes < ARENA_MIN_BYTES {
        Some(format!(
            "the arena must hold at least one largest block ({} MiB); ask for a multiple of 4 MiB",
            ARENA_MIN_BYTES >> 20
        ))
    } else if size_bytes % ARENA_MIN_BYTES != 0 {
        Some(format!(
            "the size must be a multiple of the largest block (4 MiB); {} MiB or {} MiB would do",
            size_bytes / ARENA_MIN_BYTES * 4,
            (size_bytes / ARENA_MIN_BYTES + 1) * 4
        ))
    } else if size_bytes > ARENA_MAX_BYTES {
        Some(format!(
            "the largest arena is {} GiB",
            ARENA_MAX_BYTES >> 30
        ))
    } else {
        None
    };
    match reason {
        Some(reason) => Err(Error::BadArenaSize { size_bytes, reason }),
        None => Ok(()),
    }
}

fn hugetlb_error(e: Error) -> Error {
    match e {
        Error::Os { source, .. } => Error::HugePagesUnavailable(source),
        other => other,
    }
}

fn memfd(hugetlb: bool) -> Result<OwnedFd> {
    let mut flags = libc::MFD_CLOEXEC;
    if hugetlb {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: the name is a valid NUL-terminated string.
    let fd = unsafe { libc::memfd_create(c"iopages-arena".as_ptr(), flags) };
    if fd < 0 {
        return Err(Error::os(format!("memfd_create(hugetlb={hugetlb})")));
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn map(fd: &OwnedFd, size: usize, populate: bool) -> Result<*mut u8> {
    // SAFETY: fd is a valid memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(Error::os(format!("ftruncate(arena memfd, {size})")));
    }
    let mut flags = libc::MAP_SHARED;
    if populate {
        flags |= libc::MAP_POPULATE;
    }
    // SAFETY: a fresh mapping of the whole memfd at an address the kernel picks.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::os(format!("mmap(arena, {size} bytes)")));
    }
    Ok(p.cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_sizes_that_are_zero_small_or_unaligned() {
        for size in [
            0,
            4096,
            ARENA_MIN_BYTES - 4096,
            ARENA_MIN_BYTES + 4096,
            6 << 20,
        ] {
            let err = Arena::new(size, HugePages::Never, false)
                .err()
                .expect("size must be refused");
            assert!(matches!(err, Error::BadArenaSize { .. }), "{err}");
            assert!(err.to_string().contains("4 MiB"), "{err}");
        }
        assert!(Arena::new(ARENA_MAX_BYTES + ARENA_MIN_BYTES, HugePages::Never, false).is_err());
    }

    #[test]
    fn addresses_and_frames_round_trip() {
        let a = Arena::new(8 << 20, HugePages::Try, false).unwrap();
        assert_eq!(a.nr_pages(), 2048);
        for pfn in [0u32, 1, 1023, 2047] {
            let p = Page::from_pfn(pfn);
            let addr = a.page_address(p);
            assert_eq!(a.page_of_address(addr), Some(p));
            // SAFETY: addr is inside the live mapping.
            unsafe { addr.add(4095).write(0xa5) };
            assert_eq!(a.page_of_address(addr.wrapping_add(4095)), Some(p));
        }
        assert_eq!(a.page_of_address(std::ptr::null()), None);
        assert_eq!(a.page_of_address(a.base().wrapping_add(8 << 20)), None);
    }

    #[test]
    fn never_huge_is_base_backed() {
        let a = Arena::new(4 << 20, HugePages::Never, true).unwrap();
        assert_eq!(a.backing(), Backing::Base);
    }
}
