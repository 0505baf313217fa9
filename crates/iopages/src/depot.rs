//! The depot: whole batches of free order-0 pages parked between the
//! per-CPU lists and the buddy lists.
//!
//! Owns: a bounded stack of free order-0 pages that per-CPU lists drain
//! into and refill from, a batch at a time, under one short lock hold.
//! Must never: hold more than its capacity, or keep pages from an
//! allocation that needs them merged — the slow path and `drain_all` empty
//! it into the buddy lists first.
//!
//! Why: when one thread allocates and another frees (an I/O submitted on
//! one thread and completed on another), pages leave the freeing CPU's list
//! and arrive on the allocating CPU's list. Through the buddy lists every
//! page would be merged on the way in and split again on the way out; the
//! depot hands the batch over as it is (tcmalloc's transfer cache and
//! DPDK's mempool ring play the same part).

use crate::frame::Page;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Free order-0 pages in transit between CPUs.
pub(crate) struct Depot {
    stack: Mutex<Vec<Page>>,
    cap: usize,
    /// Pages held, readable without the lock (watermarks, accounting).
    nr: AtomicUsize,
}

impl Depot {
    pub(crate) fn new(cap: usize) -> Depot {
        Depot {
            stack: Mutex::new(Vec::with_capacity(cap)),
            cap,
            nr: AtomicUsize::new(0),
        }
    }

    /// Pages held (racy snapshot).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.nr.load(Relaxed)
    }

    /// Park `n` pages from `pages` if all of them fit; otherwise take
    /// nothing and return `false`.
    pub(crate) fn put(&self, n: usize, pages: impl Iterator<Item = Page>) -> bool {
        if n == 0 || self.len() + n > self.cap {
            return false;
        }
        let mut s = self.stack.lock();
        if s.len() + n > self.cap {
            return false;
        }
        let before = s.len();
        s.extend(pages.take(n));
        assert_eq!(
            s.len(),
            before + n,
            "depot was given fewer pages than promised"
        );
        self.nr.store(s.len(), Relaxed);
        true
    }

    /// Take up to `n` pages, most recently parked first; `put` receives
    /// them as one run. Returns how many.
    pub(crate) fn take(&self, n: usize, put: impl FnOnce(&[Page])) -> usize {
        if self.len() == 0 {
            return 0;
        }
        let mut s = self.stack.lock();
        let k = n.min(s.len());
        let at = s.len() - k;
        put(&s[at..]);
        s.truncate(at);
        self.nr.store(s.len(), Relaxed);
        k
    }

    /// Empty the depot into `free` (the buddy lists).
    pub(crate) fn drain(&self, mut free: impl FnMut(&[Page])) -> usize {
        let mut s = self.stack.lock();
        let n = s.len();
        free(&s);
        s.clear();
        self.nr.store(0, Relaxed);
        n
    }

    /// Most pages it holds.
    pub(crate) fn capacity(&self) -> usize {
        self.cap
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(r: std::ops::Range<u32>) -> Vec<Page> {
        r.map(Page::from_pfn).collect()
    }

    #[test]
    fn put_is_all_or_nothing_and_take_is_lifo() {
        let d = Depot::new(8);
        assert!(d.put(5, pages(0..5).into_iter()));
        assert!(
            !d.put(4, pages(5..9).into_iter()),
            "9 pages do not fit in 8"
        );
        assert_eq!(d.len(), 5);
        let mut got = Vec::new();
        assert_eq!(d.take(3, |run| got.extend_from_slice(run)), 3);
        assert_eq!(got, pages(2..5));
        let mut rest = Vec::new();
        assert_eq!(d.drain(|run| rest.extend_from_slice(run)), 2);
        assert_eq!(rest, pages(0..2));
        assert_eq!(d.len(), 0);
        assert_eq!(d.take(1, |_| panic!("empty depot handed out a page")), 0);
    }
}
