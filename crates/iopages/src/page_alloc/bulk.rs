//! The bulk API: many order-0 pages per call (`__alloc_pages_bulk`).
//!
//! Owns: the array, list and callback forms of bulk allocation, bulk frees,
//! and their engine — take this thread's cache and this CPU's list once per
//! batch. Must never: call the caller's callback with an allocator lock
//! held, or lose the pages of a callback round that panicked.

use super::fastpath::PREPARED;
use super::{Core, PageAllocator, FAST};
use crate::buddy::frame::{clear_slots, copy_pages, Page};
use crate::gfp::Gfp;
use crate::percpu::pcp::bump;
use std::sync::atomic::Ordering::Relaxed;

/// Pages gathered per callback round of [`PageAllocator::alloc_pages_bulk_cb`].
const CB_CHUNK: usize = 64;

impl PageAllocator {
    /// Count one bulk call (`frees`: a bulk free) in this thread's cache's
    /// counters, or the shared ones when the thread has no cache.
    #[inline]
    pub(super) fn count_bulk(&self, frees: bool) {
        match self.tcache() {
            Some(tc) => bump(
                if frees {
                    &tc.bulk_frees
                } else {
                    &tc.bulk_allocs
                },
                1,
            ),
            None => {
                let c = &self.core.counters;
                let c = if frees { &c.bulk_frees } else { &c.bulk_allocs };
                c.fetch_add(1, Relaxed);
            }
        }
    }

    /// Bulk allocation, array form: fill the empty (`None`) slots of `slots`
    /// with order-0 pages; slots already holding a page are kept.
    ///
    /// Takes this thread's cache and this CPU's list once for the batch.
    /// Falls back to allocating a single page through the full path when the
    /// zone is below its low watermark or only one slot is empty.
    ///
    /// **Context:** as [`PageAllocator::alloc_pages`]. **Returns:** how many
    /// slots hold a page now, counting those filled before the call; may be
    /// fewer than `slots.len()`.
    #[inline]
    pub fn alloc_pages_bulk_array(&self, gfp: Gfp, slots: &mut [Option<Page>]) -> usize {
        let core = &*self.core;
        let nr = slots.len();
        if let [slot @ None] = slots {
            if core.careful {
                self.count_bulk(false);
            }
            *slot = self.alloc_pages(gfp, 0);
            return slot.is_some() as usize;
        }
        if nr > 1 && !gfp.intersects(PREPARED) {
            // Fast path: every slot empty and the whole batch in this
            // thread's cache above the floor (raised by fault injection,
            // checks, counting) — one copy, nothing counted.
            if let Some(tc) = self.tcache() {
                let floor = core.fault.alloc_floor().load(Relaxed);
                if tc.len(0) >= nr.saturating_add(floor) && slots.iter().all(Option::is_none) {
                    // SAFETY: this thread owns `tc`.
                    copy_into(slots, unsafe { tc.take_top(0, nr) });
                    return nr;
                }
            }
        }
        self.bulk_array_slow(gfp, slots)
    }

    #[inline(never)]
    pub(super) fn bulk_array_slow(&self, gfp: Gfp, slots: &mut [Option<Page>]) -> usize {
        let populated = slots.iter().filter(|s| s.is_some()).count();
        let need = slots.len() - populated;
        if need == 0 {
            return populated;
        }
        if populated == 0 {
            return self.bulk_fill(gfp, slots, true);
        }
        // Some slots are taken: fill a dense scratch array, then scatter.
        let mut scratch = vec![None; need];
        let got = self.bulk_fill(gfp, &mut scratch, true);
        let empty = slots.iter_mut().filter(|s| s.is_none());
        for (slot, p) in empty.zip(&scratch[..got]) {
            *slot = *p;
        }
        populated + got
    }

    /// Bulk allocation, list form: append up to `nr` order-0 pages to
    /// `list`. **Returns:** how many were appended (may be fewer than `nr`).
    pub fn alloc_pages_bulk_list(&self, gfp: Gfp, nr: usize, list: &mut Vec<Page>) -> usize {
        let start = list.len();
        list.reserve(nr);
        self.alloc_pages_bulk_cb(gfp, nr, |p| list.push(p));
        list.len() - start
    }

    /// Bulk allocation, callback form: allocate up to `nr` order-0 pages and
    /// hand each to `f` (to fill an I/O vector directly). `f` runs with no
    /// allocator lock held and may itself allocate or free. If `f` panics,
    /// the pages not yet handed over are freed.
    ///
    /// **Returns:** how many pages were handed to `f`.
    pub fn alloc_pages_bulk_cb(&self, gfp: Gfp, nr: usize, mut f: impl FnMut(Page)) -> usize {
        let mut done = 0;
        let mut first = true;
        while done < nr {
            let mut chunk = [None; CB_CHUNK];
            let want = (nr - done).min(CB_CHUNK);
            // Count the call once, not once per chunk.
            let got = self.bulk_fill(gfp, &mut chunk[..want], first);
            first = false;
            let mut guard = Undelivered {
                alloc: self,
                pages: &mut chunk[..got],
                next: 0,
            };
            while guard.next < got {
                let p = guard.pages[guard.next]
                    .take()
                    .expect("bulk fills a prefix of the slots");
                guard.next += 1;
                f(p);
            }
            done += got;
            if got < want {
                break;
            }
        }
        done
    }

    /// Free order-0 pages in bulk: this thread's cache takes what fits, the
    /// rest goes to this CPU's list in one hold.
    ///
    /// **Context:** never blocks.
    ///
    /// # Safety
    /// The caller owns every page of `pages` (each once): it came from this allocator with this order,
    /// and nothing else — no [`PageBox`](crate::PageBox), folio buffer,
    /// bio, pool, copy of the handle or pointer into its bytes — is used
    /// as owning it afterwards. Freeing a frame that something else still
    /// owns lets the allocator hand it out again, so two owners would reach
    /// the same bytes. (With checks on, a block that is not allocated is
    /// caught and panics; a block that is allocated to someone else cannot
    /// be told apart.)
    pub unsafe fn free_pages_bulk(&self, pages: &[Page]) {
        if self.core.checks {
            for &p in pages {
                self.core.free_prep(p, 0);
            }
        }
        self.bulk_free(pages, true);
    }

    /// Free the order-0 pages held in `slots` in bulk, leaving every slot
    /// empty: the counterpart of [`PageAllocator::alloc_pages_bulk_array`].
    ///
    /// **Context:** never blocks. **Returns:** how many pages were freed.
    ///
    /// # Safety
    /// The caller owns every page held in `slots` (each once): it came from this allocator with this order,
    /// and nothing else — no [`PageBox`](crate::PageBox), folio buffer,
    /// bio, pool, copy of the handle or pointer into its bytes — is used
    /// as owning it afterwards. Freeing a frame that something else still
    /// owns lets the allocator hand it out again, so two owners would reach
    /// the same bytes. (With checks on, a block that is not allocated is
    /// caught and panics; a block that is allocated to someone else cannot
    /// be told apart.)
    #[inline]
    pub unsafe fn free_pages_bulk_array(&self, slots: &mut [Option<Page>]) -> usize {
        let nr = slots.len();
        if let [Some(page)] = *slots {
            slots[0] = None;
            if self.core.careful {
                self.count_bulk(true);
            }
            // SAFETY: the caller owns the page (this function's contract).
            unsafe { self.free_pages(page, 0) };
            return 1;
        }
        if nr > 1 {
            // Fast path: every slot full and room for all in this thread's
            // cache below its fast capacity (0 with checks or counting on)
            // — one copy in, one clear, nothing counted.
            if let Some(tc) = self.tcache() {
                if tc.fast_cap.saturating_sub(tc.len(0)) >= nr && slots.iter().all(Option::is_some)
                {
                    // SAFETY: every slot is `Some`, which has exactly the
                    // page's representation; this thread owns `tc` and the
                    // pages fit.
                    unsafe {
                        tc.extend(
                            0,
                            std::slice::from_raw_parts(slots.as_ptr().cast::<Page>(), nr),
                        );
                        clear_slots(slots.as_mut_ptr(), nr);
                    }
                    return nr;
                }
            }
        }
        self.free_slots(slots, true)
    }

    #[inline(never)]
    pub(super) fn free_slots(&self, slots: &mut [Option<Page>], count_call: bool) -> usize {
        if let [Some(page)] = *slots {
            slots[0] = None;
            if count_call {
                self.count_bulk(true);
            }
            // SAFETY: the slots' pages are the caller's to free (the
            // contract of `free_pages_bulk_array`, or pages this call
            // allocated and never delivered).
            unsafe { self.free_pages(page, 0) };
            return 1;
        }
        let n = slots.iter().filter(|s| s.is_some()).count();
        if self.core.checks {
            for &p in slots.iter().flatten() {
                self.core.free_prep(p, 0);
            }
        }
        if n == slots.len() {
            // SAFETY: every slot is `Some`, and `Some(p)` has exactly `p`'s
            // representation (`Page` is a transparent `NonZeroU32`; the
            // standard library guarantees this for `Option`).
            let pages = unsafe { std::slice::from_raw_parts(slots.as_ptr().cast::<Page>(), n) };
            self.bulk_free(pages, count_call);
            // SAFETY: `slots` is valid for `n` writes.
            unsafe { clear_slots(slots.as_mut_ptr(), n) };
        } else {
            let pages: Vec<Page> = slots.iter_mut().filter_map(Option::take).collect();
            self.bulk_free(&pages, count_call);
        }
        n
    }

    /// The bulk allocation engine behind every form when the inlined fast
    /// path cannot serve the call: fill `out` (every slot empty) from the
    /// front, from this thread's cache and then this CPU's list, one hold
    /// each. `count_call` counts one bulk call. Returns how many slots were
    /// filled.
    #[inline(never)]
    pub(super) fn bulk_fill(&self, gfp: Gfp, out: &mut [Option<Page>], count_call: bool) -> usize {
        let core = &*self.core;
        let nr = out.len();
        debug_assert!(out.iter().all(Option::is_none));
        if nr == 0 {
            return 0;
        }
        if core.fault.is_enabled() {
            // Every page is a separate, injectable attempt, so callers see
            // partial fills.
            if count_call {
                core.counters.bulk_allocs.fetch_add(1, Relaxed);
            }
            return core.bulk_one_by_one(gfp, out);
        }
        // One page, or a zone below its low watermark: one page through the
        // full path, as the kernel does.
        let single = nr == 1 || !core.zone.watermark_ok(nr, FAST);
        let from_cache = self.tcache().map(|tc| {
            if count_call {
                bump(&tc.bulk_allocs, 1);
            }
            if single {
                return core.tcache_alloc(tc, 0).map_or(0, |p| {
                    out[0] = Some(p);
                    1
                });
            }
            let k = tc.len(0).min(nr);
            // SAFETY: this thread owns `tc`.
            copy_into(&mut out[..k], unsafe { tc.take_top(0, k) });
            bump(&tc.allocs, k as u64);
            k
        });
        let mut got = match from_cache {
            Some(k) => k,
            None => {
                if count_call {
                    core.counters.bulk_allocs.fetch_add(1, Relaxed);
                }
                0
            }
        };
        if single {
            if got == 0 {
                out[0] = core.alloc_uncached(gfp, 0);
                return out[0].is_some() as usize;
            }
        } else if got < nr {
            let rest = &mut out[got..];
            let mut at = 0;
            got += core.take(0, rest.len(), FAST, |run| {
                copy_into(&mut rest[at..at + run.len()], run);
                at += run.len();
            });
        }
        if gfp.contains(Gfp::ZERO) || core.checks {
            for p in out[..got].iter().flatten() {
                core.prep_new_page(*p, 0, gfp);
            }
        }
        got
    }

    /// The bulk free engine: this thread's cache takes what fits, the rest
    /// goes to this CPU's list in one hold. Callers have run the allocation
    /// checks already.
    #[inline]
    pub(super) fn bulk_free(&self, pages: &[Page], count_call: bool) {
        let core = &*self.core;
        let taken = self.tcache().map(|tc| {
            if count_call {
                bump(&tc.bulk_frees, 1);
            }
            let room = (tc.cap[0] - tc.len(0)).min(pages.len());
            // SAFETY: this thread owns `tc`, and `room` pages fit.
            unsafe { tc.extend(0, &pages[..room]) };
            bump(&tc.frees, room as u64);
            room
        });
        let rest = match taken {
            Some(room) => &pages[room..],
            None => {
                if count_call {
                    core.counters.bulk_frees.fetch_add(1, Relaxed);
                }
                pages
            }
        };
        if !rest.is_empty() {
            core.give(0, rest.len(), rest.iter().copied());
        }
    }
}

impl Core {
    #[cold]
    pub(super) fn bulk_one_by_one(&self, gfp: Gfp, out: &mut [Option<Page>]) -> usize {
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = self.alloc_uncached(gfp, 0);
            if slot.is_none() {
                return i;
            }
        }
        out.len()
    }
}

/// Copy pages into empty slots: a plain memory copy, because `Some(p)`
/// has exactly `p`'s representation.
#[inline]
fn copy_into(out: &mut [Option<Page>], pages: &[Page]) {
    assert_eq!(out.len(), pages.len());
    // SAFETY: the lengths match, the two slices cannot overlap (one is
    // borrowed mutably), and writing a valid `Page` into an `Option<Page>`
    // makes it `Some(page)` (`Page` is a transparent `NonZeroU32`).
    unsafe { copy_pages(out.as_mut_ptr().cast::<Page>(), pages.as_ptr(), pages.len()) };
}

/// Frees the pages of a callback round that `f` never received (it panicked).
struct Undelivered<'a> {
    alloc: &'a PageAllocator,
    pages: &'a mut [Option<Page>],
    next: usize,
}

impl Drop for Undelivered<'_> {
    fn drop(&mut self) {
        let rest = &mut self.pages[self.next..];
        if rest.iter().any(Option::is_some) {
            self.alloc.free_slots(rest, false);
        }
    }
}
