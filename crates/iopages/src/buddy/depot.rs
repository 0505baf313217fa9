//! The depot: full magazines of free order-0 pages in transit between
//! threads and CPUs.
//!
//! Owns: a bounded ring of magazines (fixed-size batches of free order-0
//! pages) that thread caches and per-CPU lists hand over whole and take
//! whole. Putting or taking a magazine costs one compare-and-swap on the
//! ring's position, one acquire load and one release store on the slot, and
//! a copy of the batch. Must never: hold more than its capacity, wait for
//! anything (a caller that finds the ring full or empty, or a slot not yet
//! published, goes to the per-CPU lists or the zone), or keep pages from an
//! allocation that needs them merged — the slow path and `drain_all` empty
//! it into the buddy lists first.
//!
//! Why: when one thread allocates and another frees (an I/O submitted on
//! one thread and completed on another), pages leave the freeing thread's
//! cache and arrive in the allocating thread's cache. Through the buddy
//! lists every page would be merged on the way in and split again on the
//! way out, under the zone lock; through one shared locked stack every
//! batch would serialise all threads (the design this replaces collapsed
//! at 8 producer/consumer pairs). The ring moves a batch with one atomic
//! read-modify-write and never spins on another thread: each slot carries
//! its own sequence number (Vyukov's bounded MPMC queue), so a thread
//! preempted in the middle of a copy only makes its one slot look busy.
//! DPDK's mempool ring moves objects instead of magazines and makes
//! producers wait for earlier producers to finish their copies, which is
//! what oversubscribed cores cannot afford.
//!
//! Generic over the atomic and cell types so that the same code is
//! model-checked with `loom` in the tests.

use crate::sync::{RingWord, SlotCell, StdCell};
use crossbeam_utils::CachePadded;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Slot<W, C> {
    /// `pos` when free for the put at `pos`; `pos + 1` once that put has
    /// published its magazine; `pos + slots` once the take at `pos` has
    /// copied it out (free for the next lap).
    seq: W,
    /// Held (`with_mut`) for exactly the window in which the slot's
    /// magazine is written or read: nothing in production, the access that
    /// `loom` checks for overlaps in the model.
    claim: C,
}

/// Bytes a magazine's storage is rounded up to, and aligned on: two cache
/// lines, so neighbouring magazines never share a line (one may be written
/// while the next is read), and a run of magazines is one contiguous
/// stretch of memory that the hardware prefetcher streams.
const MAG_ALIGN: usize = 128;

/// A bounded multi-producer multi-consumer ring of magazines of `mag`
/// items each. The slots' sequence numbers are cache-padded; the magazines
/// themselves lie in one contiguous block, slot after slot.
pub(crate) struct MagazineRing<T, W = AtomicUsize, C = StdCell<()>> {
    enq: CachePadded<W>,
    deq: CachePadded<W>,
    slots: Box<[CachePadded<Slot<W, C>>]>,
    mag: usize,
    /// Items from one magazine's start to the next's.
    stride: usize,
    data: *mut MaybeUninit<T>,
    layout: std::alloc::Layout,
}

// SAFETY: `data` is owned by the ring; a magazine in it is touched only
// inside its slot's claimed window (see `put` and `take`), by one thread.
unsafe impl<T: Send, W: Send, C: Send> Send for MagazineRing<T, W, C> {}
// SAFETY: as above.
unsafe impl<T: Send, W: Sync, C: Sync> Sync for MagazineRing<T, W, C> {}

impl<T, W, C> Drop for MagazineRing<T, W, C> {
    fn drop(&mut self) {
        if self.layout.size() > 0 {
            // SAFETY: allocated in `new` with this layout (items are `Copy`
            // and need no drop).
            unsafe { std::alloc::dealloc(self.data.cast(), self.layout) };
        }
    }
}

impl<T: Copy + Send, W: RingWord, C: SlotCell<()>> MagazineRing<T, W, C> {
    /// A ring of `slots` magazines of `mag` items (no slots: always full
    /// and always empty).
    pub(crate) fn new(slots: usize, mag: usize) -> Self {
        assert!(mag > 0, "a magazine holds at least one item");
        let size = std::mem::size_of::<T>().max(1);
        let stride = if MAG_ALIGN % size == 0 {
            mag.next_multiple_of(MAG_ALIGN / size)
        } else {
            mag
        };
        let layout = std::alloc::Layout::array::<T>(slots * stride)
            .and_then(|l| l.align_to(MAG_ALIGN))
            .expect("the depot fits in memory");
        let data = if layout.size() == 0 {
            std::ptr::NonNull::<MaybeUninit<T>>::dangling().as_ptr()
        } else {
            // SAFETY: the layout has a non-zero size.
            let p = unsafe { std::alloc::alloc(layout) }.cast::<MaybeUninit<T>>();
            if p.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            p
        };
        MagazineRing {
            enq: CachePadded::new(W::new(0)),
            deq: CachePadded::new(W::new(0)),
            slots: (0..slots)
                .map(|i| {
                    CachePadded::new(Slot {
                        seq: W::new(i),
                        claim: C::new(()),
                    })
                })
                .collect(),
            mag,
            stride,
            data,
            layout,
        }
    }

    /// The storage of slot `i`'s magazine.
    #[inline]
    fn magazine_at(&self, i: usize) -> *mut MaybeUninit<T> {
        // SAFETY: `i` < slots, so the offset stays inside the block.
        unsafe { self.data.add(i * self.stride) }
    }

    /// Items per magazine.
    #[inline]
    pub(crate) fn magazine(&self) -> usize {
        self.mag
    }

    /// Magazines it can hold.
    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Full magazines held (a racy snapshot; exact when quiet).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        let deq = self.deq.load(Ordering::Relaxed);
        let enq = self.enq.load(Ordering::Relaxed);
        enq.saturating_sub(deq).min(self.slots.len())
    }

    /// Claim the next position of `at` (`enq` for a put, `deq` for a
    /// take) whose slot is ready for it: its sequence is the position plus
    /// `ahead` (0: free for a put, 1: published for a take). `None` when the
    /// ring is full or empty there, or the slot is still being emptied or
    /// written.
    #[inline]
    fn claim(&self, at: &W, ahead: usize) -> Option<usize> {
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        let mut pos = at.load(Ordering::Relaxed);
        loop {
            let seq = self.slots[pos % n].seq.load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos.wrapping_add(ahead)) as isize;
            if dif == 0 {
                match at.cas(pos, pos.wrapping_add(1)) {
                    Ok(_) => return Some(pos),
                    Err(now) => pos = now,
                }
            } else if dif < 0 {
                return None;
            } else {
                pos = at.load(Ordering::Relaxed);
            }
        }
    }

    /// Park one magazine: `items` must hold exactly [`Self::magazine`]
    /// items. `false` (nothing taken) when the ring is full or the next
    /// slot is still being emptied.
    #[inline]
    pub(crate) fn put(&self, items: &[T]) -> bool {
        assert_eq!(items.len(), self.mag, "a magazine is put whole");
        let Some(pos) = self.claim(&self.enq, 0) else {
            return false;
        };
        let i = pos % self.slots.len();
        let dst = self.magazine_at(i);
        // SAFETY: the claim gave this put the slot alone until the store
        // below publishes it; the magazine's storage holds `mag` items.
        unsafe {
            self.slots[i].claim.with_mut(|_| {
                std::ptr::copy_nonoverlapping(items.as_ptr(), dst.cast::<T>(), self.mag)
            })
        };
        self.slots[i]
            .seq
            .store(pos.wrapping_add(1), Ordering::Release);
        true
    }

    /// Take one magazine and hand its items to `f` (keep `f` short: the
    /// slot stays claimed while it runs). `false` when the ring is empty
    /// or the oldest magazine is still being written.
    #[inline]
    pub(crate) fn take(&self, f: impl FnOnce(&[T])) -> bool {
        let Some(pos) = self.claim(&self.deq, 1) else {
            return false;
        };
        let n = self.slots.len();
        let src = self.magazine_at(pos % n);
        // SAFETY: claimed as in `put`; the acquire load of `seq` in the
        // claim saw the put's release store, so all `mag` items are
        // initialised.
        unsafe {
            self.slots[pos % n]
                .claim
                .with_mut(|_| f(std::slice::from_raw_parts(src.cast::<T>(), self.mag)))
        };
        self.slots[pos % n]
            .seq
            .store(pos.wrapping_add(n), Ordering::Release);
        true
    }
}

/// Free order-0 pages in transit between CPUs, a magazine at a time.
pub(crate) struct Depot {
    ring: MagazineRing<crate::buddy::frame::Page>,
}

impl Depot {
    /// A depot of at most `cap_pages` pages in magazines of `mag` pages
    /// (no room for one magazine: off).
    pub(crate) fn new(cap_pages: usize, mag: usize) -> Depot {
        let mag = mag.max(1);
        Depot {
            ring: MagazineRing::new(cap_pages / mag, mag),
        }
    }

    /// Pages per magazine.
    #[inline]
    pub(crate) fn magazine(&self) -> usize {
        self.ring.magazine()
    }

    /// Pages held (racy snapshot).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.ring.len() * self.ring.magazine()
    }

    /// Park one magazine (exactly [`Depot::magazine`] pages); `false` when
    /// full.
    #[inline]
    pub(crate) fn put(&self, pages: &[crate::buddy::frame::Page]) -> bool {
        self.ring.put(pages)
    }

    /// Take one magazine into `f`; `false` when empty.
    #[inline]
    pub(crate) fn take(&self, f: impl FnOnce(&[crate::buddy::frame::Page])) -> bool {
        self.ring.take(f)
    }

    /// Empty the depot into `free` (the buddy lists), a magazine at a time.
    /// Returns pages drained. A magazine still being written when this runs
    /// stays for the next drain.
    pub(crate) fn drain(&self, mut free: impl FnMut(&[crate::buddy::frame::Page])) -> usize {
        let mut n = 0;
        while self.ring.take(|m| {
            free(m);
            n += m.len();
        }) {}
        n
    }

    /// Most pages it holds.
    pub(crate) fn capacity(&self) -> usize {
        self.ring.slots() * self.ring.magazine()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buddy::frame::Page;

    fn pages(r: std::ops::Range<u32>) -> Vec<Page> {
        r.map(Page::from_pfn).collect()
    }

    #[test]
    fn magazines_go_in_whole_and_come_out_oldest_first() {
        let d = Depot::new(8, 4);
        assert_eq!((d.capacity(), d.magazine()), (8, 4));
        assert!(d.put(&pages(0..4)));
        assert!(d.put(&pages(4..8)));
        assert!(!d.put(&pages(8..12)), "a third magazine does not fit");
        assert_eq!(d.len(), 8);
        let mut got = Vec::new();
        assert!(d.take(|m| got.extend_from_slice(m)));
        assert_eq!(got, pages(0..4));
        assert!(d.put(&pages(8..12)), "the freed slot is reused");
        let mut rest = Vec::new();
        assert_eq!(d.drain(|m| rest.extend_from_slice(m)), 8);
        assert_eq!(rest, pages(4..12));
        assert_eq!(d.len(), 0);
        assert!(!d.take(|_| panic!("an empty depot handed out a magazine")));
    }

    #[test]
    fn a_depot_without_room_for_a_magazine_is_off() {
        let d = Depot::new(3, 4);
        assert_eq!(d.capacity(), 0);
        assert!(!d.put(&pages(0..4)));
        assert!(!d.take(|_| panic!("nothing was put")));
        assert_eq!(d.len(), 0);
    }

    #[test]
    #[should_panic(expected = "put whole")]
    fn a_partial_magazine_is_refused() {
        Depot::new(8, 4).put(&pages(0..3));
    }

    #[test]
    fn many_laps_keep_every_page_exactly_once() {
        // Wrap the positions around the ring many times from several
        // threads; every page must come out exactly once.
        let d = std::sync::Arc::new(Depot::new(16, 4));
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    let mut next = t * 1_000_000;
                    for _ in 0..20_000 {
                        let m = pages(next..next + 4);
                        if d.put(&m) {
                            next += 4;
                        }
                        d.take(|m| mine.extend_from_slice(m));
                    }
                    (next - t * 1_000_000, mine)
                })
            })
            .collect();
        let mut put = 0;
        let mut seen = Vec::new();
        for h in threads {
            let (n, mine) = h.join().unwrap();
            put += n as usize;
            seen.extend(mine);
        }
        d.drain(|m| seen.extend_from_slice(m));
        assert_eq!(seen.len(), put);
        seen.sort_by_key(|p| p.pfn());
        seen.dedup();
        assert_eq!(seen.len(), put, "a page came out twice");
    }

    mod model {
        //! `loom` explores every interleaving of concurrent puts, takes and
        //! a drain on a two-slot ring: no item is lost, none is handed out
        //! twice, and no slot is read while it is written (loom's cell
        //! reports any overlapping access).
        use super::super::MagazineRing;
        use crate::sync::loom_impls::LoomCell;
        use loom::sync::atomic::AtomicUsize;
        use loom::sync::Arc;

        type Ring = MagazineRing<u32, AtomicUsize, LoomCell<()>>;

        /// Every interleaving with up to three preemptions: enough for a
        /// two-slot ring, and seconds rather than minutes.
        fn bounded() -> loom::model::Builder {
            let mut b = loom::model::Builder::new();
            b.preemption_bound = Some(3);
            b
        }

        fn check(taken: Vec<u32>, put: Vec<u32>) {
            let (mut a, mut b) = (taken, put);
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "what came out is not what went in");
        }

        #[test]
        fn loom_concurrent_put_take_drain_lose_and_duplicate_nothing() {
            bounded().check(|| {
                let r = Arc::new(Ring::new(2, 2));
                // One magazine already parked, so the slots wrap around.
                assert!(r.put(&[1, 2]));
                assert!(r.take(|m| assert_eq!(m, [1, 2])));
                assert!(r.put(&[3, 4]));
                let producer = {
                    let r = r.clone();
                    loom::thread::spawn(move || {
                        let mut put = Vec::new();
                        for m in [[5, 6], [7, 8]] {
                            if r.put(&m) {
                                put.extend(m);
                            }
                        }
                        put
                    })
                };
                let consumer = {
                    let r = r.clone();
                    loom::thread::spawn(move || {
                        let mut got = Vec::new();
                        r.take(|m| got.extend_from_slice(m));
                        got
                    })
                };
                let mut taken = Vec::new();
                // The drain, as `drain_all` runs it, beside both.
                while r.take(|m| taken.extend_from_slice(m)) {}
                let mut put = vec![3, 4];
                put.extend(producer.join().unwrap());
                taken.extend(consumer.join().unwrap());
                while r.take(|m| taken.extend_from_slice(m)) {}
                assert_eq!(r.len(), 0);
                check(taken, put);
            });
        }

        #[test]
        fn loom_two_producers_never_share_a_slot() {
            bounded().check(|| {
                let r = Arc::new(Ring::new(2, 1));
                let hs: Vec<_> = [7u32, 8]
                    .into_iter()
                    .map(|v| {
                        let r = r.clone();
                        loom::thread::spawn(move || if r.put(&[v]) { vec![v] } else { vec![] })
                    })
                    .collect();
                let mut put = Vec::new();
                for h in hs {
                    put.extend(h.join().unwrap());
                }
                assert_eq!(put.len(), 2, "two slots fit two magazines");
                let mut taken = Vec::new();
                while r.take(|m| taken.extend_from_slice(m)) {}
                check(taken, put);
            });
        }
    }
}
