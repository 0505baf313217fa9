//! Folio buffers and bios: I/O buffers in large folios and their iovecs.

use crate::alloc::{iopages_allocator, snprint};
use crate::{fail, gfp, guard, guard_int, guard_long, iopages_page, obj, obj_mut, put, slice};
use iopages::{Bio, BioLimits, FolioBuffer, Page, PageAllocator};
use std::ffi::{c_int, c_void};

/// An I/O buffer of `len` bytes made of folios (each contiguous, of up to
/// 2^`prefer_order` pages; folios need not be adjacent).
///
/// **Thread safety:** one thread at a time for writes; reads of its bytes
/// from several threads are the caller's business.
pub struct iopages_folio_buffer {
    buf: FolioBuffer,
}

/// The I/O vector of one request over pages or a folio buffer, in
/// multi-page segments, holding a pin on every folio it covers until
/// `iopages_bio_release` (a pinned folio cannot be freed).
///
/// **Thread safety:** one thread at a time.
pub struct iopages_bio {
    bio: Option<Bio>,
    alloc: PageAllocator,
}

/// Allocate a buffer of `len` bytes (rounded up to pages) in folios of up
/// to 2^`prefer_order` pages, smaller where large blocks cannot be had.
///
/// **Context:** as `gfp` allows (large orders are tried without retries).
/// **Returns:** 0; -EINVAL for an order above 10, unknown gfp bits or
/// NULL pointers; -ENOMEM when even single pages run out (nothing stays
/// allocated).
#[no_mangle]
pub unsafe extern "C" fn iopages_folio_buffer_create(
    a: *const iopages_allocator,
    gfp_flags: u32,
    len: usize,
    prefer_order: u32,
    out: *mut *mut iopages_folio_buffer,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        let g = gfp(gfp_flags)?;
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        let buf = a.alloc.alloc_buffer(g, len, prefer_order).map_err(|e| {
            let errno = match e {
                iopages::Error::BadSetting { .. } => libc::EINVAL,
                _ => libc::ENOMEM,
            };
            fail(errno, e.to_string())
        })?;
        let p = Box::into_raw(Box::new(iopages_folio_buffer { buf }));
        // SAFETY: checked not NULL; the caller's contract says writable.
        unsafe { out.write(p) };
        Ok(0)
    })
}

/// Free a buffer's folios. A folio still pinned by a bio makes it refuse
/// with -EBUSY: release the bio first; the buffer stays valid.
///
/// **Context:** never blocks. **Returns:** 0 (NULL does nothing); -EBUSY.
#[no_mangle]
pub unsafe extern "C" fn iopages_folio_buffer_destroy(b: *mut iopages_folio_buffer) -> c_int {
    guard_int(|| {
        if b.is_null() {
            return Ok(0);
        }
        // SAFETY: a buffer from `iopages_folio_buffer_create`, used by no
        // other thread now.
        let fb = unsafe { &*b };
        let alloc = fb.buf.allocator();
        if let Some(f) = fb.buf.folios().iter().find(|f| alloc.folio_pins(**f) != 0) {
            return Err(fail(
                libc::EBUSY,
                format!(
                    "the folio at page {} is pinned by a bio; release it first",
                    f.page().pfn() + 1
                ),
            ));
        }
        // SAFETY: as above; the box is given back once.
        let fb = unsafe { Box::from_raw(b) };
        match fb.buf.free() {
            Ok(()) => Ok(0),
            Err((e, buf)) => {
                // Pinned after the check above: a bio was built on another
                // thread meanwhile, against this handle's contract. The
                // handle is gone; its remaining folios stay allocated.
                std::mem::forget(buf);
                Err(fail(
                    libc::EBUSY,
                    format!("{e}; the handle is freed, its pinned folios leaked"),
                ))
            }
        }
    })
}

/// The buffer's length in bytes.
///
/// **Context:** never blocks. **Returns:** the length; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_folio_buffer_len(b: *const iopages_folio_buffer) -> usize {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live buffer.
        unsafe { b.as_ref() }.map_or(0, |b| b.buf.len())
    })
}

/// The number of folios (contiguous pieces) of the buffer.
///
/// **Context:** never blocks. **Returns:** the count; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_folio_buffer_nr_folios(b: *const iopages_folio_buffer) -> usize {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live buffer.
        unsafe { b.as_ref() }.map_or(0, |b| b.buf.folios().len())
    })
}

/// The `i`-th contiguous piece of the buffer: its address and length (the
/// last piece ends at the buffer's length). The memory is the buffer's:
/// valid until it is destroyed.
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL for `i` out of range
/// or NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_folio_buffer_chunk(
    b: *mut iopages_folio_buffer,
    i: usize,
    addr: *mut *mut c_void,
    len: *mut usize,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a buffer only this thread uses.
        let b = unsafe { obj_mut(b, "buffer")? };
        let chunk = b
            .buf
            .chunks_mut()
            .nth(i)
            .ok_or_else(|| fail(libc::EINVAL, format!("chunk {i} is past the buffer's end")))?;
        let (p, n) = (chunk.as_mut_ptr().cast::<c_void>(), chunk.len());
        // SAFETY: the caller passes NULL or writable out-pointers.
        unsafe {
            put(addr, p, "addr")?;
            put(len, n, "len")?;
        }
        Ok(0)
    })
}

/// Copy `len` bytes from `src` into the buffer's start.
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL when `len` exceeds
/// the buffer or for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_folio_buffer_copy_from(
    b: *mut iopages_folio_buffer,
    src: *const c_void,
    len: usize,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a buffer only this thread uses.
        let b = unsafe { obj_mut(b, "buffer")? };
        // SAFETY: the caller passes NULL or `len` readable bytes.
        let src = unsafe { slice(src.cast::<u8>(), len, "src")? };
        b.buf
            .copy_from(src)
            .map_err(|e| fail(libc::EINVAL, e.to_string()))?;
        Ok(0)
    })
}

/// Copy the buffer's first `len` bytes into `dst`.
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL when `len` exceeds
/// the buffer or for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_folio_buffer_copy_to(
    b: *const iopages_folio_buffer,
    dst: *mut c_void,
    len: usize,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live buffer.
        let b = unsafe { obj(b, "buffer")? };
        if len > b.buf.len() {
            return Err(fail(
                libc::EINVAL,
                format!("{len} bytes asked from a {}-byte buffer", b.buf.len()),
            ));
        }
        // SAFETY: the caller passes NULL or `len` writable bytes.
        let dst = unsafe { crate::slice_mut(dst.cast::<u8>(), len, "dst")? };
        let mut at = 0;
        for c in b.buf.chunks() {
            if at == len {
                break;
            }
            let n = c.len().min(len - at);
            dst[at..at + n].copy_from_slice(&c[..n]);
            at += n;
        }
        Ok(0)
    })
}

fn limits(max_segments: usize, max_segment_bytes: usize) -> BioLimits {
    let d = BioLimits::default();
    BioLimits {
        max_segments: if max_segments == 0 {
            d.max_segments
        } else {
            max_segments
        },
        max_segment_bytes: if max_segment_bytes == 0 {
            d.max_segment_bytes
        } else {
            max_segment_bytes
        },
    }
}

fn new_bio(
    alloc: &PageAllocator,
    pages: &[Page],
    offset: usize,
    len: usize,
    lim: BioLimits,
    out: *mut *mut iopages_bio,
) -> Result<c_int, c_int> {
    let errno = |e: iopages::BioError| match e {
        iopages::BioError::Full { .. } => fail(libc::E2BIG, e.to_string()),
        _ => fail(libc::EINVAL, e.to_string()),
    };
    let bio = Bio::from_pages(alloc, pages, offset, len, lim).map_err(errno)?;
    let p = Box::into_raw(Box::new(iopages_bio {
        bio: Some(bio),
        alloc: alloc.clone(),
    }));
    // SAFETY: the callers checked `out` is not NULL; writable by contract.
    unsafe { out.write(p) };
    Ok(0)
}

/// Build a bio over bytes [`offset`, `offset + len`) of a folio buffer,
/// folio by folio (one pin per folio). `max_segments` and
/// `max_segment_bytes` bound it (0: 256 segments of 64 KiB).
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL for a range outside
/// the buffer or NULL pointers; -E2BIG when the range needs more segments
/// than allowed (no pin is left behind on an error).
#[no_mangle]
pub unsafe extern "C" fn iopages_bio_from_buffer(
    b: *const iopages_folio_buffer,
    offset: usize,
    len: usize,
    max_segments: usize,
    max_segment_bytes: usize,
    out: *mut *mut iopages_bio,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live buffer.
        let b = unsafe { obj(b, "buffer")? };
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        if offset.checked_add(len).is_none_or(|end| end > b.buf.len()) {
            return Err(fail(
                libc::EINVAL,
                format!("bytes {offset}+{len} leave the {}-byte buffer", b.buf.len()),
            ));
        }
        let pages = b.buf.pages();
        new_bio(
            b.buf.allocator(),
            &pages,
            offset,
            len,
            limits(max_segments, max_segment_bytes),
            out,
        )
    })
}

/// Build a bio over bytes [`offset`, `offset + len`) of an array of
/// allocated pages of `a` (listed in address order within each folio, as
/// `iopages_alloc_pages_bulk` or a mempool gives them; each page is its
/// own segment unless it continues the one before). Limits as
/// `iopages_bio_from_buffer`.
///
/// **Context:** never blocks. **Returns:** 0; -EINVAL for a page outside
/// the arena, a range outside the array or NULL pointers; -E2BIG as
/// `iopages_bio_from_buffer`.
#[no_mangle]
pub unsafe extern "C" fn iopages_bio_from_pages(
    a: *const iopages_allocator,
    pages: *const iopages_page,
    n: usize,
    offset: usize,
    len: usize,
    max_segments: usize,
    max_segment_bytes: usize,
    out: *mut *mut iopages_bio,
) -> c_int {
    guard_int(|| {
        // SAFETY: the caller passes NULL or a live allocator.
        let a = unsafe { obj(a, "allocator")? };
        // SAFETY: the caller passes NULL or an array of `n` pages.
        let ids = unsafe { slice(pages, n, "pages")? };
        if out.is_null() {
            return Err(fail(libc::EINVAL, "out is NULL"));
        }
        let nr = a.alloc.arena().nr_pages() as u32;
        let mut v = Vec::with_capacity(n);
        for (i, &id) in ids.iter().enumerate() {
            if id == 0 || id > nr {
                return Err(fail(
                    libc::EINVAL,
                    format!("pages[{i}] = {id} is not a page of this arena"),
                ));
            }
            let pg = Page::from_pfn(id - 1);
            if a.alloc.checks_enabled()
                && a.alloc
                    .frame_info(pg)
                    .is_some_and(|f| f.flags & iopages::flags::BUDDY != 0)
            {
                return Err(fail(libc::EINVAL, format!("pages[{i}] = {id} is free")));
            }
            v.push(pg);
        }
        new_bio(
            &a.alloc,
            &v,
            offset,
            len,
            limits(max_segments, max_segment_bytes),
            out,
        )
    })
}

/// Bytes the bio covers.
///
/// **Context:** never blocks. **Returns:** the length; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_bio_len(bio: *const iopages_bio) -> usize {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live bio.
        unsafe { bio.as_ref() }
            .and_then(|b| b.bio.as_ref())
            .map_or(0, Bio::len)
    })
}

/// Segments in the bio (the iovecs `iopages_bio_iovecs` writes).
///
/// **Context:** never blocks. **Returns:** the count; 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn iopages_bio_nr_segments(bio: *const iopages_bio) -> usize {
    guard(0, || {
        // SAFETY: the caller passes NULL or a live bio.
        unsafe { bio.as_ref() }
            .and_then(|b| b.bio.as_ref())
            .map_or(0, |b| b.segments().len())
    })
}

/// Write the bio's segments as `struct iovec`s (address in the arena's
/// mapping, length) into `iov[0..returned]`, for `preadv`/`pwritev` or
/// io_uring. The addresses stay valid while the bio holds its pins and the
/// pages stay allocated.
///
/// **Context:** never blocks. **Returns:** the number of iovecs; -ENOSPC
/// when `max` is below `iopages_bio_nr_segments` (nothing written);
/// -EINVAL for NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn iopages_bio_iovecs(
    bio: *const iopages_bio,
    iov: *mut libc::iovec,
    max: usize,
) -> isize {
    guard_long(|| {
        // SAFETY: the caller passes NULL or a live bio.
        let b = unsafe { obj(bio, "bio")? };
        let bio = b
            .bio
            .as_ref()
            .ok_or_else(|| fail(libc::EINVAL, "released bio"))?;
        let n = bio.segments().len();
        if n > max {
            return Err(fail(
                libc::ENOSPC,
                format!("the bio has {n} segments, room for {max}"),
            ));
        }
        // SAFETY: the caller passes NULL or `max` writable iovecs.
        let out = unsafe { crate::slice_mut(iov, max, "iov")? };
        for (d, (p, len)) in out.iter_mut().zip(bio.iovecs(&b.alloc)) {
            *d = libc::iovec {
                iov_base: p.cast(),
                iov_len: len,
            };
        }
        Ok(n as isize)
    })
}

/// Release the bio's pins and free the handle (NULL does nothing).
///
/// **Context:** never blocks. **Returns:** 0.
#[no_mangle]
pub unsafe extern "C" fn iopages_bio_release(bio: *mut iopages_bio) -> c_int {
    guard_int(|| {
        if bio.is_null() {
            return Ok(0);
        }
        // SAFETY: a bio from a build call, given back once.
        let mut b = unsafe { Box::from_raw(bio) };
        if let Some(inner) = b.bio.take() {
            inner.release(&b.alloc);
        }
        Ok(0)
    })
}

/// A description of the bio's segments (one per line: page, offset,
/// length), written as snprintf does.
///
/// **Context:** never blocks. **Returns:** the whole text's length;
/// -EINVAL for a NULL bio.
#[no_mangle]
pub unsafe extern "C" fn iopages_bio_describe(
    bio: *const iopages_bio,
    buf: *mut std::ffi::c_char,
    len: usize,
) -> isize {
    guard_long(|| {
        // SAFETY: the caller passes NULL or a live bio.
        let b = unsafe { obj(bio, "bio")? };
        let mut text = String::new();
        if let Some(bio) = &b.bio {
            for s in bio.segments() {
                text.push_str(&format!(
                    "page {} offset {} len {}\n",
                    s.page.pfn() + 1,
                    s.offset,
                    s.len
                ));
            }
        }
        Ok(snprint(&text, buf, len))
    })
}
