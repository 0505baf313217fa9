//! Where a write's "out" pages come from: the three allocation strategies
//! of the crypt target, and the per-device page limit.
//!
//! Owns: turning "this write needs N pages of ciphertext" into blocks of
//! pages, by one of three strategies (switchable at run time), while
//! keeping the mempool's forward-progress guarantee and counting every
//! page against the device's limit. Must never: fail a blocking request,
//! hand out a page twice, or lose count of a page (the limit counter goes
//! back to zero when every write has completed).
//!
//! A write's pages are owned by the [`FolioBuffer`] inside its
//! [`OutPages`], which hands out their bytes; the only `unsafe` here is
//! where a page the mempool or the bulk call returned as a plain
//! [`Page`] passes into that buffer's ownership (`push_raw`).
//!
//! - `PerPage` — one mempool allocation per page (the seed's baseline).
//! - `Bulk` — the page allocator's bulk API for as many pages as it gives,
//!   then the mempool's bulk allocation for the rest (seed 000).
//! - `Compound` — high-order blocks with `NORETRY | NOWARN`, stepping the
//!   order down when one is refused, then the mempool page by page (what
//!   upstream dm-crypt does today).
//!
//! The limit (2 % of the arena by default, like dm-crypt's pages per
//! client) is a per-CPU counter. When it is reached the non-blocking
//! attempts are refused and the mempool's reserve (or a wait for a free)
//! serves, so writes slow down instead of failing. It is checked either
//! exactly (`compare`, which sums every CPU's delta under a lock when close
//! to the limit) or approximately (`read_positive`, no lock) — experiment
//! E3 compares the two.

use iopages::{
    ElementSource, FolioBuffer, Gfp, Mempool, Page, PageAllocator, PageSource, PercpuCounter,
    MAX_ORDER,
};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How out pages are allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// One mempool allocation per page.
    PerPage,
    /// Bulk page allocation, then bulk mempool allocation for the rest.
    Bulk,
    /// High-order blocks (`NORETRY | NOWARN`, order stepping down), then
    /// the mempool.
    Compound,
}

impl Strategy {
    fn to_u8(self) -> u8 {
        match self {
            Strategy::PerPage => 0,
            Strategy::Bulk => 1,
            Strategy::Compound => 2,
        }
    }

    fn from_u8(v: u8) -> Strategy {
        match v {
            0 => Strategy::PerPage,
            1 => Strategy::Bulk,
            _ => Strategy::Compound,
        }
    }
}

/// How the page limit is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitCheck {
    /// `compare`: exact near the limit (takes the counter's lock there).
    Exact,
    /// `read_positive`: the rough count, never a lock.
    Approximate,
}

/// Default page limit: this share of the arena, in percent.
pub const DEFAULT_LIMIT_PERCENT: usize = 2;

/// A write's out pages: blocks of `2^order` pages that together hold at
/// least the pages asked for, in order, owned by a [`FolioBuffer`] (which
/// hands out their bytes) and counted against the device's limit until
/// [`OutAllocator::free`] or [`OutAllocator::hand_over`].
pub struct OutPages {
    buf: FolioBuffer,
    /// Pages counted against the limit for this write.
    nr_pages: usize,
}

impl OutPages {
    /// The blocks, in order: (first page, order).
    pub fn blocks(&self) -> Vec<(Page, u32)> {
        self.buf
            .folios()
            .iter()
            .map(|f| (f.page(), f.order()))
            .collect()
    }

    /// Pages counted for this write (every page of every block).
    pub fn nr_pages(&self) -> usize {
        self.nr_pages
    }

    /// Every page, in order.
    pub fn pages(&self) -> impl Iterator<Item = Page> {
        self.buf.pages().into_iter()
    }

    /// The buffer that owns the pages: their bytes (`runs_mut`), and the
    /// pages themselves for a backend that keeps them (moved out with
    /// `push_from`, before [`OutAllocator::hand_over`]). Only the target
    /// moves pages out, so the count stays right.
    pub(crate) fn buffer_mut(&mut self) -> &mut FolioBuffer {
        &mut self.buf
    }

    /// The buffer that owns the pages, to read their bytes (`chunks`).
    pub(crate) fn buffer(&self) -> &FolioBuffer {
        &self.buf
    }

    /// Move the blocks past the first `nr_pages` pages to a new
    /// `OutPages` (each keeps counting its own pages). `nr_pages` must
    /// fall on a block boundary (split first).
    ///
    /// **Context:** never blocks. Panics if it does not.
    pub fn split_off(&mut self, nr_pages: usize) -> OutPages {
        let mut pages = 0;
        let at = self
            .buf
            .folios()
            .iter()
            .position(|f| {
                let here = pages;
                pages += f.nr_pages();
                here >= nr_pages
            })
            .unwrap_or(self.buf.folios().len());
        let tail = self.buf.split_off(at);
        let moved: usize = tail.folios().iter().map(|f| f.nr_pages()).sum();
        assert_eq!(
            self.nr_pages - moved,
            nr_pages.min(self.nr_pages),
            "split_off: page {nr_pages} is inside a block (split first)"
        );
        self.nr_pages -= moved;
        OutPages {
            buf: tail,
            nr_pages: moved,
        }
    }

    /// Take ownership of the order-0 pages in `slots`, every one filled.
    ///
    /// # Safety
    /// As [`OutPages::push_raw`] for each page.
    unsafe fn push_slots(&mut self, slots: Vec<Option<Page>>) {
        for p in slots {
            // SAFETY: passed on: the caller owns each page and gives it up.
            unsafe { self.push_raw(p.expect("every slot filled"), 0) };
        }
    }

    /// Take ownership of a page of the device's arena.
    ///
    /// # Safety
    /// As [`FolioBuffer::push_raw`]: the caller owns the block and gives
    /// it up.
    unsafe fn push_raw(&mut self, page: Page, order: u32) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.buf.push_raw(page, order) };
        self.nr_pages += 1 << order;
    }
}

impl std::fmt::Debug for OutPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutPages")
            .field("blocks", &self.blocks())
            .field("nr_pages", &self.nr_pages)
            .finish()
    }
}

/// The device's page limit: pages allocated and not yet freed (compound
/// blocks by their size), and how the limit is checked.
struct Limit {
    allocated: PercpuCounter,
    limit_pages: i64,
    check: AtomicU8,
    /// Whether checks are timed (off by default: it costs two clock reads).
    timed: AtomicBool,
    /// Checks made and nanoseconds spent in them, when timed.
    checks: PercpuCounter,
    check_ns: PercpuCounter,
}

impl Limit {
    fn check(&self) -> LimitCheck {
        if self.check.load(Ordering::Relaxed) == LimitCheck::Exact as u8 {
            LimitCheck::Exact
        } else {
            LimitCheck::Approximate
        }
    }

    /// Whether the device is at its limit, checked as configured.
    #[inline]
    fn reached(&self) -> bool {
        if self.timed.load(Ordering::Relaxed) {
            let t = Instant::now();
            let r = self.reached_untimed();
            self.check_ns.add(t.elapsed().as_nanos() as i64);
            self.checks.add(1);
            return r;
        }
        self.reached_untimed()
    }

    fn reached_untimed(&self) -> bool {
        match self.check() {
            LimitCheck::Exact => {
                self.allocated.compare(self.limit_pages) != std::cmp::Ordering::Less
            }
            LimitCheck::Approximate => self.allocated.read_positive() >= self.limit_pages,
        }
    }
}

/// The page pool's source: order-0 pages from the page allocator, refused
/// to attempts that cannot block once the device is at its limit — the
/// gate of dm-crypt's `crypt_page_alloc`, so that the pool's reserve and
/// waiting for frees throttle writers instead of the arena running dry.
pub struct LimitedPageSource {
    inner: PageSource,
    limit: Arc<Limit>,
}

impl LimitedPageSource {
    fn gate(&self, gfp: Gfp) -> bool {
        gfp.may_block() || !self.limit.reached()
    }
}

impl ElementSource for LimitedPageSource {
    type Elem = Page;

    fn alloc(&self, gfp: Gfp) -> Option<Page> {
        if self.gate(gfp) {
            self.inner.alloc(gfp)
        } else {
            None
        }
    }

    unsafe fn free(&self, page: Page) {
        // SAFETY: passed on: the caller owns the page (the trait's contract).
        unsafe { self.inner.free(page) }
    }

    fn alloc_bulk(&self, gfp: Gfp, slots: &mut [Option<Page>]) -> usize {
        if self.gate(gfp) {
            self.inner.alloc_bulk(gfp, slots)
        } else {
            slots.iter().filter(|s| s.is_some()).count()
        }
    }

    unsafe fn free_bulk(&self, pages: &mut Vec<Page>) {
        // SAFETY: passed on: the caller owns the pages (the trait's contract).
        unsafe { self.inner.free_bulk(pages) }
    }

    unsafe fn free_slots(&self, slots: &mut [Option<Page>]) {
        // SAFETY: passed on: the caller owns the pages (the trait's contract).
        unsafe { self.inner.free_slots(slots) }
    }
}

/// Allocates and frees out pages for one device.
pub struct OutAllocator {
    alloc: PageAllocator,
    pool: Mempool<LimitedPageSource>,
    strategy: AtomicU8,
    limit: Arc<Limit>,
    /// Pages the strategy's own attempt served (bulk array or compound
    /// blocks), without the mempool.
    direct_pages: PercpuCounter,
    /// Compound blocks among them.
    compound_blocks: PercpuCounter,
    /// Pages served through the mempool (its source, its reserve, or a
    /// wait for a free).
    pool_pages: PercpuCounter,
}

/// Where a device's out pages came from (see [`OutAllocator::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutStats {
    /// Pages the strategy's own non-blocking attempt served: the bulk
    /// array call, or compound blocks.
    pub direct_pages: u64,
    /// Compound blocks among them.
    pub compound_blocks: u64,
    /// Pages served through the mempool (per-page strategy, the rest of a
    /// short attempt, or anything at the limit).
    pub pool_pages: u64,
    /// Of those, pages the mempool took from its reserve.
    pub reserve_pages: u64,
    /// Sleeps of writers that found the reserve empty.
    pub waits: u64,
}

impl OutStats {
    /// Share of pages the strategy's own attempt served (0 with none yet).
    pub fn direct_hit_rate(&self) -> f64 {
        let all = self.direct_pages + self.pool_pages;
        if all == 0 {
            0.0
        } else {
            self.direct_pages as f64 / all as f64
        }
    }
}

/// Largest order the compound strategy tries (32 pages, 128 KiB; dm-crypt
/// caps its attempts the same way so one write does not drain the
/// high-order blocks).
pub const COMPOUND_MAX_ORDER: u32 = 5;
const _: () = assert!(COMPOUND_MAX_ORDER <= MAX_ORDER);

impl OutAllocator {
    /// An allocator of out pages from `alloc`, with a mempool of `min_nr`
    /// reserved pages and a page limit of `limit_pages` (`None`: 2 % of the
    /// arena, at least `min_nr`).
    ///
    /// **Returns:** an error if the reserve cannot be filled.
    pub fn new(
        alloc: &PageAllocator,
        min_nr: usize,
        limit_pages: Option<usize>,
        strategy: Strategy,
        limit_check: LimitCheck,
    ) -> iopages::Result<OutAllocator> {
        let default_limit = (alloc.arena().nr_pages() * DEFAULT_LIMIT_PERCENT / 100).max(min_nr);
        let limit = Arc::new(Limit {
            allocated: PercpuCounter::new(0),
            limit_pages: limit_pages.unwrap_or(default_limit) as i64,
            check: AtomicU8::new(limit_check as u8),
            timed: AtomicBool::new(false),
            checks: PercpuCounter::statistic(),
            check_ns: PercpuCounter::statistic(),
        });
        let source = LimitedPageSource {
            inner: PageSource::new(alloc.clone(), 0)?,
            limit: Arc::clone(&limit),
        };
        Ok(OutAllocator {
            alloc: alloc.clone(),
            pool: Mempool::new(source, min_nr)?,
            strategy: AtomicU8::new(strategy.to_u8()),
            limit,
            direct_pages: PercpuCounter::statistic(),
            compound_blocks: PercpuCounter::statistic(),
            pool_pages: PercpuCounter::statistic(),
        })
    }

    /// Where out pages came from so far (approximate sums of per-CPU
    /// counters; exact once writes have stopped).
    pub fn stats(&self) -> OutStats {
        let m = self.pool.stats();
        OutStats {
            direct_pages: self.direct_pages.sum().max(0) as u64,
            compound_blocks: self.compound_blocks.sum().max(0) as u64,
            pool_pages: self.pool_pages.sum().max(0) as u64,
            reserve_pages: m.reserve_allocs,
            waits: m.waits,
        }
    }

    /// The strategy in use.
    pub fn strategy(&self) -> Strategy {
        Strategy::from_u8(self.strategy.load(Ordering::Relaxed))
    }

    /// Switch strategies; writes in flight finish with the old one.
    pub fn set_strategy(&self, s: Strategy) {
        self.strategy.store(s.to_u8(), Ordering::Relaxed);
    }

    /// How the limit is checked.
    pub fn limit_check(&self) -> LimitCheck {
        self.limit.check()
    }

    /// Change how the limit is checked.
    pub fn set_limit_check(&self, c: LimitCheck) {
        self.limit.check.store(c as u8, Ordering::Relaxed);
    }

    /// The page limit.
    pub fn limit_pages(&self) -> usize {
        self.limit.limit_pages as usize
    }

    /// Pages allocated and not freed (exact; takes the counter's lock).
    pub fn allocated_pages(&self) -> i64 {
        self.limit.allocated.sum()
    }

    /// Allocate at least `nr_pages` out pages.
    ///
    /// **Context:** may block (it never fails: below the limit the page
    /// allocator serves without reclaim; at the limit, or when it is short,
    /// the mempool's reserve serves or the call waits for a free).
    pub fn alloc(&self, nr_pages: usize) -> OutPages {
        let mut out = self.empty_out(nr_pages);
        match self.strategy() {
            Strategy::PerPage => self.fill_per_page(&mut out, nr_pages),
            Strategy::Bulk => self.fill_bulk(&mut out, nr_pages),
            Strategy::Compound => self.fill_compound(&mut out, nr_pages),
        }
        debug_assert!(
            out.nr_pages >= nr_pages && out.nr_pages * iopages::PAGE_SIZE == out.buf.len()
        );
        self.limit.allocated.add(out.nr_pages as i64);
        out
    }

    /// [`OutAllocator::alloc`] where serving needs no wait: below the
    /// limit, `nr_pages` (≥ 1) taken from the allocator in one
    /// non-blocking bulk call, whatever the strategy (counted as the bulk
    /// strategy's direct pages); `None`, nothing taken, at the limit or
    /// when the allocator is short. For a thread that holds requests back
    /// ([`hold_starts`](crate::async_io::hold_starts)) and may not sleep
    /// before it sends them.
    pub fn try_alloc(&self, nr_pages: usize) -> Option<OutPages> {
        let g = self.source_gfp()?;
        let mut slots = vec![None; nr_pages];
        let got = self.alloc.alloc_pages_bulk_array(g, &mut slots);
        if got < nr_pages {
            // SAFETY: the pages in the slots were allocated by this call
            // alone and nobody else saw them.
            unsafe { self.alloc.free_pages_bulk_array(&mut slots) };
            return None;
        }
        self.direct_pages.add(got as i64);
        let mut out = self.empty_out(nr_pages);
        // SAFETY: every slot was filled by the bulk call above with an
        // order-0 page of `self.alloc`, seen by nobody else.
        unsafe { out.push_slots(slots) };
        self.limit.allocated.add(out.nr_pages as i64);
        Some(out)
    }

    /// An empty out buffer with room for `nr_pages`.
    fn empty_out(&self, nr_pages: usize) -> OutPages {
        OutPages {
            buf: FolioBuffer::with_capacity(&self.alloc, nr_pages),
            nr_pages: 0,
        }
    }

    /// Flags for the strategies' own non-blocking attempts, or `None` at
    /// the limit (then the mempool serves, gated the same way).
    fn source_gfp(&self) -> Option<Gfp> {
        (!self.limit.reached()).then_some(Gfp::NOWAIT | Gfp::NOWARN)
    }

    /// One page through the mempool, blocking: its source is tried first
    /// (refused at the limit), then the reserve, then a wait for a free.
    fn pool_page(&self) -> Page {
        self.pool_pages.add(1);
        self.pool
            .alloc(Gfp::NOIO)
            .expect("a blocking mempool allocation never fails")
    }

    fn fill_per_page(&self, out: &mut OutPages, nr_pages: usize) {
        for _ in 0..nr_pages {
            let p = self.pool_page();
            // SAFETY: the mempool handed the page to this call alone; its
            // source allocates order-0 pages of `self.alloc`.
            unsafe { out.push_raw(p, 0) };
        }
    }

    fn fill_bulk(&self, out: &mut OutPages, nr_pages: usize) {
        let mut slots = vec![None; nr_pages];
        let mut got = 0;
        if let Some(g) = self.source_gfp() {
            got = self.alloc.alloc_pages_bulk_array(g, &mut slots);
            self.direct_pages.add(got as i64);
        }
        if got < nr_pages {
            self.pool_pages.add((nr_pages - got) as i64);
            // The rest from the mempool in reserve-sized bites: a blocking
            // bulk call may not ask for more than the reserve holds.
            let bite = self.pool.min_nr().max(1);
            let mut at = 0;
            while at < slots.len() {
                let end = (at + bite).min(slots.len());
                let n = self.pool.alloc_bulk(Gfp::NOIO, &mut slots[at..end]);
                debug_assert_eq!(n, end - at);
                at = end;
            }
        }
        // SAFETY: every slot was filled by this call, by the bulk
        // allocator or the mempool (order-0 pages of `self.alloc`), and
        // nobody else saw the page.
        unsafe { out.push_slots(slots) };
    }

    fn fill_compound(&self, out: &mut OutPages, nr_pages: usize) {
        let mut remaining = nr_pages;
        while remaining > 0 {
            let Some(g) = self.source_gfp() else { break };
            let mut order = (usize::BITS - 1 - remaining.leading_zeros()).min(COMPOUND_MAX_ORDER);
            let mut got = None;
            while order > 0 {
                // A folio: a compound block (`Gfp::COMP`).
                if out.buf.push_alloc(g | Gfp::NORETRY, order) {
                    got = Some(order);
                    break;
                }
                order -= 1;
            }
            match got {
                Some(o) => {
                    out.nr_pages += 1 << o;
                    remaining -= 1 << o;
                    self.direct_pages.add(1 << o);
                    self.compound_blocks.add(1);
                }
                None => break,
            }
        }
        // Order-0 pages for the rest, through the mempool as dm-crypt does.
        self.fill_per_page(out, remaining);
    }

    /// Free a write's out pages (the write completed). Order-0 pages go
    /// back through the mempool (refilling its reserve first), in bulk.
    ///
    /// **Context:** never blocks.
    pub fn free(&self, out: OutPages) {
        assert!(
            out.buf.allocator().same_allocator(&self.alloc),
            "free: out pages of another device's arena"
        );
        let nr_pages = out.nr_pages;
        // The buffer gives up its folios (`into_raw`): from here this call
        // is their only owner, and frees each once.
        let folios = out.buf.into_raw();
        let mut singles = Vec::with_capacity(folios.len());
        for f in folios {
            if f.order() == 0 {
                singles.push(f.page());
            } else {
                // SAFETY: owned here alone (see above), allocated from
                // this device's arena with this order.
                unsafe { self.alloc.free_pages(f.page(), f.order()) };
            }
        }
        // SAFETY: as above; order-0 out pages come from the mempool or
        // the same allocator, which the pool's source frees to.
        unsafe { self.pool.free_bulk_raw(&mut singles) };
        self.limit.allocated.add(-(nr_pages as i64));
    }

    /// Split every high-order block of `out` into order-0 pages, so that
    /// each can later be freed (or stored) on its own. The pages and their
    /// count against the limit are unchanged.
    pub fn split(&self, out: &mut OutPages) {
        out.buf.split_folios();
    }

    /// A backend took every page out of `out`'s buffer and keeps them:
    /// they leave the device's count.
    ///
    /// **Context:** never blocks. Panics if the buffer still holds a page
    /// (free those with [`Self::free`] instead).
    pub fn hand_over(&self, out: OutPages) {
        assert!(
            out.buf.folios().is_empty(),
            "hand_over: {} blocks are still in the out buffer",
            out.buf.folios().len()
        );
        self.limit.allocated.add(-(out.nr_pages as i64));
    }

    /// Free order-0 pages a backend gave back (the pages a stored write
    /// replaced). They refill the mempool's reserve first; they were not
    /// counted against the limit.
    ///
    /// **Context:** never blocks.
    pub fn free_replaced(&self, replaced: FolioBuffer) {
        assert!(
            replaced.allocator().same_allocator(&self.alloc),
            "free_replaced: pages of another arena"
        );
        let folios = replaced.into_raw();
        assert!(
            folios.iter().all(|f| f.order() == 0),
            "free_replaced: a stored page is always order-0"
        );
        let mut pages: Vec<Page> = folios.iter().map(|f| f.page()).collect();
        // SAFETY: the backend gave the buffer up (`into_raw` above), so
        // this call owns the pages alone and frees each once.
        unsafe { self.pool.free_bulk_raw(&mut pages) };
    }

    /// Pages held in the mempool's reserve.
    pub fn reserve_len(&self) -> usize {
        self.pool.reserve_len()
    }

    /// Time every limit check from now on (`true`) or stop (`false`).
    pub fn set_timed_checks(&self, on: bool) {
        self.limit.timed.store(on, Ordering::Relaxed);
    }

    /// Limit checks timed so far, and the time they took in all.
    pub fn check_time(&self) -> (u64, Duration) {
        (
            self.limit.checks.sum().max(0) as u64,
            Duration::from_nanos(self.limit.check_ns.sum().max(0) as u64),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn arena(mib: u64) -> PageAllocator {
        PageAllocator::builder()
            .size_bytes(mib << 20)
            .huge_pages(iopages::HugePages::Never)
            .build()
            .unwrap()
    }

    /// Every page of every block, checked distinct.
    fn distinct_pages(outs: &[OutPages]) -> usize {
        let mut seen = HashSet::new();
        for o in outs {
            for p in o.pages() {
                assert!(seen.insert(p), "page {p:?} handed out twice");
            }
        }
        seen.len()
    }

    #[test]
    fn every_strategy_covers_the_request_with_distinct_pages_and_gives_them_all_back() {
        let alloc = arena(16);
        for s in [Strategy::PerPage, Strategy::Bulk, Strategy::Compound] {
            for check in [LimitCheck::Exact, LimitCheck::Approximate] {
                let out = OutAllocator::new(&alloc, 64, None, s, check).unwrap();
                let outs: Vec<OutPages> = [1usize, 7, 32, 64, 256]
                    .iter()
                    .map(|&n| out.alloc(n))
                    .collect();
                for (o, n) in outs.iter().zip([1usize, 7, 32, 64, 256]) {
                    assert!(o.nr_pages() >= n, "{s:?}: asked {n}, got {}", o.nr_pages());
                    assert_eq!(o.pages().count(), o.nr_pages());
                }
                assert_eq!(
                    distinct_pages(&outs),
                    outs.iter().map(OutPages::nr_pages).sum::<usize>()
                );
                assert_eq!(
                    out.allocated_pages(),
                    outs.iter().map(|o| o.nr_pages() as i64).sum::<i64>()
                );
                for o in outs {
                    out.free(o);
                }
                assert_eq!(
                    out.allocated_pages(),
                    0,
                    "{s:?}: the page count must return to zero"
                );
                assert_eq!(
                    out.reserve_len(),
                    64,
                    "{s:?}: the reserve must be full again"
                );
                drop(out);
                alloc
                    .leak_check()
                    .unwrap_or_else(|a| panic!("{s:?} leaked: {a}"));
            }
        }
    }

    #[test]
    fn compound_uses_high_order_blocks_and_per_page_only_single_pages() {
        let alloc = arena(16);
        let compound = OutAllocator::new(
            &alloc,
            16,
            None,
            Strategy::Compound,
            LimitCheck::Approximate,
        )
        .unwrap();
        let o = compound.alloc(64);
        assert!(
            o.blocks().iter().any(|&(_, ord)| ord > 0),
            "{:?}",
            o.blocks()
        );
        assert!(o.blocks().iter().all(|&(_, ord)| ord <= COMPOUND_MAX_ORDER));
        assert!(o.blocks().len() < 64);
        let st = compound.stats();
        let high = o.blocks().iter().filter(|&&(_, ord)| ord > 0).count() as u64;
        assert_eq!(st.compound_blocks, high, "{st:?}");
        assert_eq!(st.direct_pages + st.pool_pages, 64, "{st:?}");
        compound.free(o);
        compound.set_strategy(Strategy::PerPage);
        assert_eq!(compound.strategy(), Strategy::PerPage);
        let o = compound.alloc(64);
        assert_eq!(o.blocks().len(), 64);
        assert!(o.blocks().iter().all(|&(_, ord)| ord == 0));
        let st2 = compound.stats();
        assert_eq!(
            st2.pool_pages,
            st.pool_pages + 64,
            "per-page goes through the mempool"
        );
        assert_eq!(st2.direct_pages, st.direct_pages);
        compound.free(o);
        compound.set_strategy(Strategy::Bulk);
        let o = compound.alloc(64);
        let st3 = compound.stats();
        assert_eq!(st3.direct_pages, st2.direct_pages + 64, "{st3:?}");
        assert!(st3.direct_hit_rate() > 0.0 && st3.direct_hit_rate() < 1.0);
        compound.free(o);
        drop(compound);
        alloc.leak_check().unwrap();
    }

    #[test]
    fn try_alloc_serves_below_the_limit_and_takes_nothing_where_it_would_wait() {
        let alloc = arena(8);
        for s in [Strategy::PerPage, Strategy::Bulk, Strategy::Compound] {
            let out = OutAllocator::new(&alloc, 32, Some(40), s, LimitCheck::Exact).unwrap();
            let a = out
                .try_alloc(24)
                .expect("below the limit, the arena has room");
            assert_eq!(a.nr_pages(), 24);
            assert_eq!(distinct_pages(std::slice::from_ref(&a)), 24);
            assert_eq!(out.allocated_pages(), 24);
            let b = out.try_alloc(24).expect("below the limit still");
            assert_eq!(out.allocated_pages(), 48);
            // At the limit: nothing, and nothing counted.
            assert!(out.try_alloc(1).is_none(), "{s:?}: at the limit");
            assert_eq!(out.allocated_pages(), 48);
            out.free(a);
            out.free(b);
            // More than the arena holds: nothing taken from it.
            let big = OutAllocator::new(&alloc, 32, Some(1 << 20), s, LimitCheck::Exact).unwrap();
            assert!(big.try_alloc(4096).is_none(), "{s:?}: the arena is short");
            assert_eq!(big.allocated_pages(), 0);
            drop((out, big));
            alloc.leak_check().unwrap();
        }
    }

    #[test]
    fn at_the_limit_writes_are_served_by_the_reserve_and_never_fail() {
        let alloc = arena(16);
        for check in [LimitCheck::Exact, LimitCheck::Approximate] {
            for s in [Strategy::PerPage, Strategy::Bulk, Strategy::Compound] {
                // A limit of 40 pages with 32 in reserve: a second write of 40
                // is over the limit and must come from the reserve (and the
                // blocking retry of the source), not fail.
                let out = OutAllocator::new(&alloc, 32, Some(40), s, check).unwrap();
                let a = out.alloc(40);
                assert!(out.allocated_pages() >= 40);
                let b = out.alloc(24);
                assert!(b.nr_pages() >= 24, "{s:?}/{check:?}");
                assert!(
                    out.reserve_len() < 32,
                    "{s:?}/{check:?}: over the limit the reserve must serve"
                );
                assert!(out.stats().reserve_pages > 0, "{:?}", out.stats());
                out.free(a);
                out.free(b);
                assert_eq!(out.allocated_pages(), 0);
                assert_eq!(out.reserve_len(), 32);
                drop(out);
                alloc.leak_check().unwrap();
            }
        }
    }

    #[test]
    fn writers_at_the_limit_with_the_arena_full_wait_for_completions_instead_of_failing() {
        let alloc = arena(8);
        let out = Arc::new(
            OutAllocator::new(
                &alloc,
                64,
                Some(64),
                Strategy::Bulk,
                LimitCheck::Approximate,
            )
            .unwrap(),
        );
        // Another user takes everything else.
        let hog: Vec<Page> =
            std::iter::from_fn(|| alloc.alloc_pages(Gfp::NOWAIT | Gfp::MEMALLOC, 0)).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let writers: Vec<_> = (0..4)
            .map(|t| {
                let (out, tx) = (Arc::clone(&out), tx.clone());
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let o = out.alloc(1 + (i + t) % 16);
                        std::thread::yield_now();
                        out.free(o);
                    }
                    tx.send(t).unwrap();
                })
            })
            .collect();
        for _ in 0..4 {
            rx.recv_timeout(std::time::Duration::from_secs(60))
                .expect("a writer is stuck: forward progress lost");
        }
        for w in writers {
            w.join().unwrap();
        }
        assert_eq!(out.allocated_pages(), 0);
        assert_eq!(out.reserve_len(), 64);
        // SAFETY: the test allocated the hog pages and gives them up here.
        unsafe { alloc.free_pages_bulk(&hog) };
        drop(out);
        alloc.leak_check().unwrap();
    }
}
