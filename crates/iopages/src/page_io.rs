//! Page I/O: bounds-checked copies into and out of a [`crate::PageBox`]
//! (the kernel's `memcpy_to_page` / `memcpy_from_page`), for consumers that
//! hold an owned block and want its bytes at an offset.
//!
//! Owns: checking an (offset, length) range against the block before a
//! byte moves, and the copy itself, through the box's borrowed slices.
//! Must never: touch a byte outside the block (a range that leaves it is
//! refused with nothing copied), or reach page memory through an address:
//! everything here goes through [`crate::PageBox::as_slice`] and
//! [`crate::PageBox::as_mut_slice`], whose borrow of the box is the proof
//! of ownership, so this file has no `unsafe`.
//!
//! Bytes of folio buffers are reached the same way through
//! [`crate::FolioBuffer`] (per folio, per run, [`crate::FolioBuffer::write_at`]),
//! and a bio's segments through [`crate::Bio::slices`], borrowed from the
//! buffer that owns them.

use crate::{Error, PageBox, Result};

impl PageBox<'_> {
    /// Copy `src` into the block from byte `offset` on.
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting`, with nothing
    /// copied, when the range leaves the block.
    pub fn memcpy_to_page(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(self.len(), "memcpy_to_page", offset, src.len())?;
        self.as_mut_slice()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    /// Copy bytes of the block from `offset` on into `dst`.
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting`, with nothing
    /// copied, when the range leaves the block.
    pub fn memcpy_from_page(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(self.len(), "memcpy_from_page", offset, dst.len())?;
        dst.copy_from_slice(&self.as_slice()[offset..offset + dst.len()]);
        Ok(())
    }

    /// Set `len` bytes of the block from `offset` on to `byte` (the
    /// kernel's `memset_page`).
    ///
    /// **Context:** never blocks. **Returns:** `BadSetting`, with nothing
    /// written, when the range leaves the block.
    pub fn memset_page(&mut self, offset: usize, byte: u8, len: usize) -> Result<()> {
        check_range(self.len(), "memset_page", offset, len)?;
        self.as_mut_slice()[offset..offset + len].fill(byte);
        Ok(())
    }
}

/// `offset + len` must stay within `size` bytes, without overflowing.
fn check_range(size: usize, what: &'static str, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_some_and(|end| end <= size) {
        return Ok(());
    }
    Err(Error::setting(
        what,
        format!("{len} bytes at offset {offset}"),
        format!("the block holds {size} bytes"),
    ))
}

#[cfg(test)]
mod tests {
    use crate::{Error, Gfp, PageAllocator, PAGE_SIZE};

    fn arena() -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(8 << 20)
            .huge_pages(crate::HugePages::Never)
            .build()
            .unwrap()
    }

    #[test]
    fn copies_to_and_from_a_block_round_trip_at_any_offset() {
        let a = arena();
        let mut b = a.alloc_box(Gfp::KERNEL | Gfp::ZERO, 1).unwrap();
        let data: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        for offset in [0, 1, PAGE_SIZE - 150, 2 * PAGE_SIZE - 300] {
            b.memcpy_to_page(offset, &data).unwrap();
            let mut back = vec![0; data.len()];
            b.memcpy_from_page(offset, &mut back).unwrap();
            assert_eq!(back, data, "offset {offset}");
        }
        // The copy at offset 1 left byte i - 1 of `data` at byte i.
        b.memset_page(10, 0xee, 5).unwrap();
        assert_eq!(&b.as_slice()[9..16], &[8, 0xee, 0xee, 0xee, 0xee, 0xee, 14]);
        drop(b);
        a.leak_check().unwrap();
    }

    #[test]
    fn a_range_past_the_block_is_refused_and_copies_nothing() {
        let a = arena();
        let mut b = a.alloc_box(Gfp::KERNEL | Gfp::ZERO, 0).unwrap();
        let cases = [
            (PAGE_SIZE, 1),
            (PAGE_SIZE - 1, 2),
            (usize::MAX, 2),
            (1, PAGE_SIZE),
        ];
        for (offset, len) in cases {
            let src = vec![0xab; len.min(PAGE_SIZE + 1)];
            let e = b.memcpy_to_page(offset, &src).unwrap_err();
            assert!(matches!(e, Error::BadSetting { .. }), "{e}");
            let mut dst = vec![0; src.len()];
            assert!(b.memcpy_from_page(offset, &mut dst).is_err());
            assert!(b.memset_page(offset, 0xab, len).is_err());
        }
        assert!(b.as_slice().iter().all(|&x| x == 0), "nothing was written");
        // The last byte and an empty range at the end are inside.
        b.memcpy_to_page(PAGE_SIZE - 1, &[7]).unwrap();
        b.memcpy_to_page(PAGE_SIZE, &[]).unwrap();
        assert_eq!(b.as_slice()[PAGE_SIZE - 1], 7);
        drop(b);
        a.leak_check().unwrap();
    }
}
