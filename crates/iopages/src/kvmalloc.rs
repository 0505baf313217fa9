//! kvmalloc: a contiguous block if one is to be had cheaply, else vmalloc.
//!
//! Owns: the choice between one physically contiguous block and a vmalloc
//! area for a buffer, the flags of the contiguous attempt under each
//! [`KvPolicy`], and per-policy counters for experiment E5. Must never:
//! let the contiguous attempt of the fail-fast policy run direct reclaim or
//! compaction (unless the caller asked for `RETRY_MAYFAIL`, as upstream),
//! let it loop (`NOFAIL` is honoured by the vmalloc fallback, not by the
//! contiguous attempt), or free a buffer the wrong way ([`KvBox`] knows
//! which kind it is).
//!
//! The two policies, for a buffer of `n > 1` pages (order ⌈log2 n⌉):
//!
//! ```text
//! FailFast  alloc_pages((gfp − DIRECT_RECLAIM) | NORETRY | NOWARN, order)
//!           — wakes background reclaim (KSWAPD_RECLAIM kept), never
//!           reclaims or compacts in the caller; then vmalloc(gfp)
//! Legacy    alloc_pages(gfp | NORETRY | NOWARN, order)
//!           — the pre-fix kernel (seed 003): direct reclaim in the caller
//!           before falling back; then vmalloc(gfp)
//! ```
//!
//! As in the kernel, `NORETRY` still allows one round of direct reclaim
//! and one of compaction in the slow path; it only gives up after them.
//! So `Legacy`'s contiguous attempt shrinks caches and compacts before it
//! falls back, which is the cost seed 003 removed.
//!
//! Buffers of more than 4 MiB (order > 10) go straight to vmalloc. A buffer
//! of one page is a single order-0 allocation with the caller's flags and
//! no fallback (a one-page vmalloc would map the same single frame).
//!
//! Why fail fast: in seed 003 (XFS CIL shadow buffers), a dozen CPUs sat in
//! direct compaction and reclaim inside kvmalloc and still fell back to
//! vmalloc most of the time; dropping direct reclaim from the contiguous
//! attempt cut the CPU cost per costly allocation about five times.

use crate::{Error, Gfp, Page, PageAllocator, Result, VmBox, Vmalloc, MAX_ORDER, PAGE_SIZE};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// How [`Kvmalloc::kvmalloc`] tries for contiguous memory before vmalloc.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvPolicy {
    /// Today's kernel: the contiguous attempt never reclaims or compacts in
    /// the caller (it only wakes background reclaim) and fails at once.
    #[default]
    FailFast,
    /// The kernel before the fix (seed 003): the contiguous attempt runs
    /// direct reclaim and compaction (`NORETRY`: one round) before falling
    /// back.
    Legacy,
}

impl KvPolicy {
    /// Both policies, for reports.
    pub const ALL: [KvPolicy; 2] = [KvPolicy::FailFast, KvPolicy::Legacy];

    /// The flags of the contiguous attempt for a multi-page buffer asked
    /// for with `gfp`. `NOFAIL` is always removed (the vmalloc fallback
    /// honours it) and `NOWARN` added. With `RETRY_MAYFAIL` the caller
    /// prefers contiguous memory and both policies keep direct reclaim, as
    /// upstream does; otherwise `NORETRY` is added, and `FailFast` removes
    /// `DIRECT_RECLAIM`.
    pub fn contiguous_gfp(self, gfp: Gfp) -> Gfp {
        let g = gfp.difference(Gfp::NOFAIL) | Gfp::NOWARN;
        if gfp.contains(Gfp::RETRY_MAYFAIL) {
            return g;
        }
        match self {
            KvPolicy::FailFast => g.difference(Gfp::DIRECT_RECLAIM) | Gfp::NORETRY,
            KvPolicy::Legacy => g | Gfp::NORETRY,
        }
    }

    fn index(self) -> usize {
        match self {
            KvPolicy::FailFast => 0,
            KvPolicy::Legacy => 1,
        }
    }
}

/// What one policy has done so far (a racy snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Buffers served by one contiguous block.
    pub contiguous: u64,
    /// Buffers served by vmalloc after the contiguous attempt failed.
    pub vmalloc_fallbacks: u64,
    /// Buffers too large for any block (more than 4 MiB), vmalloc'd directly.
    pub vmalloc_direct: u64,
    /// Calls that returned an error.
    pub failures: u64,
    /// Contiguous attempts made.
    pub contiguous_attempts: u64,
    /// Nanoseconds spent in them (successful or not).
    pub contiguous_ns: u64,
}

#[derive(Default)]
struct Counters {
    contiguous: AtomicU64,
    vmalloc_fallbacks: AtomicU64,
    vmalloc_direct: AtomicU64,
    failures: AtomicU64,
    contiguous_attempts: AtomicU64,
    contiguous_ns: AtomicU64,
}

/// kvmalloc over one page allocator and a [`Vmalloc`] for the fallback.
/// `Send` and `Sync`; share it by reference or in an `Arc`.
pub struct Kvmalloc {
    alloc: PageAllocator,
    vm: Vmalloc,
    counters: [Counters; 2],
}

/// A buffer from [`Kvmalloc::kvmalloc`]: one contiguous block or a vmalloc
/// area, `len()` bytes at one address either way. Freed the right way when
/// dropped.
pub struct KvBox {
    repr: Repr,
    len: usize,
}

enum Repr {
    Contiguous {
        alloc: PageAllocator,
        page: Page,
        order: u32,
    },
    Vmalloc(VmBox),
}

/// Which kind of memory a [`KvBox`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    /// One block of 2^order contiguous frames, used through the direct map.
    Contiguous {
        /// The block's order.
        order: u32,
    },
    /// A vmalloc area of this many runs.
    Vmalloc {
        /// Runs of contiguous frames (one mapping each).
        nr_runs: usize,
    },
}

impl Kvmalloc {
    /// kvmalloc over `alloc`, with a [`Vmalloc`] of default settings for
    /// the fallback.
    ///
    /// **Returns:** as [`Vmalloc::new`].
    pub fn new(alloc: &PageAllocator) -> Result<Kvmalloc> {
        Ok(Self::with_vmalloc(Vmalloc::new(alloc)?))
    }

    /// kvmalloc falling back to `vm` (and allocating contiguous blocks from
    /// its allocator).
    pub fn with_vmalloc(vm: Vmalloc) -> Kvmalloc {
        Kvmalloc {
            alloc: vm.allocator().clone(),
            vm,
            counters: Default::default(),
        }
    }

    /// Allocate `size_bytes`: one contiguous block of order
    /// ⌈log2(pages)⌉ tried with `policy`'s flags
    /// ([`KvPolicy::contiguous_gfp`]), then a vmalloc area with `gfp`.
    /// More than 4 MiB goes straight to vmalloc; one page is one order-0
    /// allocation with `gfp`. `Gfp::ZERO` zeroes the buffer.
    ///
    /// **Context:** the contiguous attempt blocks only under
    /// [`KvPolicy::Legacy`] (or with `RETRY_MAYFAIL`) and a blocking `gfp`;
    /// the vmalloc fallback as [`Vmalloc::vmalloc`]. **Returns:**
    /// `BadSetting` for a zero size or one larger than the arena;
    /// [`Error::NoMemory`] when neither kind of memory can be had (nothing
    /// stays allocated); [`Error::Os`] if mapping the fallback fails.
    pub fn kvmalloc(&self, size_bytes: usize, gfp: Gfp, policy: KvPolicy) -> Result<KvBox> {
        let c = &self.counters[policy.index()];
        let r = self.kvmalloc_inner(size_bytes, gfp, policy, c);
        if r.is_err() {
            c.failures.fetch_add(1, Relaxed);
        }
        r
    }

    fn kvmalloc_inner(
        &self,
        size_bytes: usize,
        gfp: Gfp,
        policy: KvPolicy,
        c: &Counters,
    ) -> Result<KvBox> {
        let arena_bytes = self.alloc.arena().size_bytes();
        if size_bytes == 0 {
            return Err(Error::setting(
                "size_bytes",
                0,
                "kvmalloc of zero bytes: ask for at least one byte",
            ));
        }
        if size_bytes > arena_bytes {
            return Err(Error::setting(
                "size_bytes",
                size_bytes,
                format!(
                    "larger than the whole arena ({arena_bytes} bytes); no kvmalloc this \
                     large can succeed — build a larger arena or ask for less"
                ),
            ));
        }
        let nr = size_bytes.div_ceil(PAGE_SIZE);
        let order = ceil_log2(nr);
        if order > MAX_ORDER {
            let b = self.vm.vmalloc(size_bytes, gfp)?;
            c.vmalloc_direct.fetch_add(1, Relaxed);
            return Ok(self.vmalloc_box(b, size_bytes));
        }
        let cgfp = if nr == 1 {
            gfp
        } else {
            policy.contiguous_gfp(gfp)
        };
        let start = Instant::now();
        let page = self.alloc.alloc_pages(cgfp, order);
        c.contiguous_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
        c.contiguous_attempts.fetch_add(1, Relaxed);
        if let Some(page) = page {
            c.contiguous.fetch_add(1, Relaxed);
            return Ok(KvBox {
                repr: Repr::Contiguous {
                    alloc: self.alloc.clone(),
                    page,
                    order,
                },
                len: size_bytes,
            });
        }
        if nr == 1 {
            return Err(Error::NoMemory(format!(
                "kvmalloc of {size_bytes} bytes (one page) under {gfp:?}: no page could be \
                 allocated; free memory or allow direct reclaim (Gfp::KERNEL)"
            )));
        }
        let b = self.vm.vmalloc(size_bytes, gfp)?;
        c.vmalloc_fallbacks.fetch_add(1, Relaxed);
        Ok(self.vmalloc_box(b, size_bytes))
    }

    fn vmalloc_box(&self, b: VmBox, len: usize) -> KvBox {
        KvBox {
            repr: Repr::Vmalloc(b),
            len,
        }
    }

    /// Free a buffer now (the same as dropping it): a contiguous block goes
    /// back to the page allocator, a vmalloc area to [`Vmalloc`].
    ///
    /// **Context:** never blocks on memory.
    pub fn kvfree(&self, buf: KvBox) {
        drop(buf);
    }

    /// What `policy` has done so far.
    pub fn stats(&self, policy: KvPolicy) -> KvStats {
        let c = &self.counters[policy.index()];
        KvStats {
            contiguous: c.contiguous.load(Relaxed),
            vmalloc_fallbacks: c.vmalloc_fallbacks.load(Relaxed),
            vmalloc_direct: c.vmalloc_direct.load(Relaxed),
            failures: c.failures.load(Relaxed),
            contiguous_attempts: c.contiguous_attempts.load(Relaxed),
            contiguous_ns: c.contiguous_ns.load(Relaxed),
        }
    }

    /// The vmalloc allocator used for fallbacks (its cache, budget, stats).
    pub fn vmalloc(&self) -> &Vmalloc {
        &self.vm
    }

    /// The page allocator.
    pub fn allocator(&self) -> &PageAllocator {
        &self.alloc
    }
}

impl KvBox {
    /// Bytes in the buffer (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer holds at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Which kind of memory backs the buffer.
    pub fn kind(&self) -> KvKind {
        match &self.repr {
            Repr::Contiguous { order, .. } => KvKind::Contiguous { order: *order },
            Repr::Vmalloc(b) => KvKind::Vmalloc {
                nr_runs: b.nr_runs(),
            },
        }
    }

    /// Whether the buffer is one physically contiguous block.
    pub fn is_contiguous(&self) -> bool {
        matches!(self.repr, Repr::Contiguous { .. })
    }

    /// Every frame behind the buffer, in address order (a contiguous block
    /// lists all 2^order of its frames).
    pub fn pages(&self) -> Vec<Page> {
        match &self.repr {
            Repr::Contiguous { page, order, .. } => (page.pfn()..page.pfn() + (1 << order))
                .map(Page::from_pfn)
                .collect(),
            Repr::Vmalloc(b) => b.pages(),
        }
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *const u8 {
        match &self.repr {
            Repr::Contiguous { alloc, page, .. } => alloc.page_address(*page),
            Repr::Vmalloc(b) => b.as_ptr(),
        }
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.repr {
            // SAFETY: the block is allocated to this buffer for its whole
            // life, lies inside the arena's direct map (kept alive by the
            // allocator handle held here) and holds at least `len` bytes;
            // writes need `&mut self`.
            Repr::Contiguous { alloc, page, .. } => unsafe {
                std::slice::from_raw_parts(alloc.page_address(*page), self.len)
            },
            Repr::Vmalloc(b) => b.as_slice(),
        }
    }

    /// The buffer's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.repr {
            // SAFETY: as in `as_slice`; `&mut self` makes the access unique.
            Repr::Contiguous { alloc, page, .. } => unsafe {
                std::slice::from_raw_parts_mut(alloc.page_address(*page), self.len)
            },
            Repr::Vmalloc(b) => b.as_mut_slice(),
        }
    }
}

impl std::fmt::Debug for KvBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBox")
            .field("len", &self.len)
            .field("kind", &self.kind())
            .finish()
    }
}

impl AsRef<[u8]> for KvBox {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsMut<[u8]> for KvBox {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl Drop for KvBox {
    fn drop(&mut self) {
        if let Repr::Contiguous { alloc, page, order } = &self.repr {
            // SAFETY: the box owns the block it allocated, and gives it up
            // here, once; its slices borrowed the box.
            unsafe { alloc.free_pages(*page, *order) };
        }
        // A vmalloc'd buffer frees itself when `repr` drops.
    }
}

/// log2 of `n` rounded up (`n >= 1`).
fn ceil_log2(n: usize) -> u32 {
    usize::BITS - (n - 1).leading_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HugePages;

    #[test]
    fn ceil_log2_rounds_up() {
        let got: Vec<u32> = [1, 2, 3, 4, 5, 16, 17, 1024, 1025]
            .iter()
            .map(|&n| ceil_log2(n))
            .collect();
        assert_eq!(got, vec![0, 1, 2, 2, 3, 4, 5, 10, 11]);
    }

    #[test]
    fn contiguous_flags_per_policy() {
        let ff = KvPolicy::FailFast.contiguous_gfp(Gfp::KERNEL | Gfp::NOFAIL);
        assert!(!ff.contains(Gfp::DIRECT_RECLAIM), "{ff:?}");
        assert!(ff.contains(Gfp::KSWAPD_RECLAIM | Gfp::NORETRY | Gfp::NOWARN));
        assert!(!ff.contains(Gfp::NOFAIL));
        let legacy = KvPolicy::Legacy.contiguous_gfp(Gfp::KERNEL);
        assert!(legacy.contains(Gfp::DIRECT_RECLAIM | Gfp::NORETRY | Gfp::NOWARN));
        let mayfail = KvPolicy::FailFast.contiguous_gfp(Gfp::KERNEL | Gfp::RETRY_MAYFAIL);
        assert!(mayfail.contains(Gfp::DIRECT_RECLAIM) && !mayfail.contains(Gfp::NORETRY));
        assert_eq!(KvPolicy::default(), KvPolicy::FailFast);
    }

    #[test]
    fn both_kinds_free_themselves() {
        let a = PageAllocator::builder()
            .size_bytes(16 << 20)
            .huge_pages(HugePages::Never)
            .build()
            .unwrap();
        let kv = Kvmalloc::new(&a).unwrap();
        let mut small = kv.kvmalloc(5000, Gfp::KERNEL, KvPolicy::FailFast).unwrap();
        assert_eq!(small.kind(), KvKind::Contiguous { order: 1 });
        small.as_mut_slice().fill(1);
        let big = kv
            .kvmalloc(5 << 20, Gfp::KERNEL | Gfp::ZERO, KvPolicy::Legacy)
            .unwrap();
        assert!(!big.is_contiguous());
        assert!(big.as_slice().iter().all(|&b| b == 0));
        assert_eq!(kv.stats(KvPolicy::Legacy).vmalloc_direct, 1);
        assert_eq!(kv.stats(KvPolicy::FailFast).contiguous, 1);
        kv.kvfree(small);
        drop(big);
        kv.vmalloc().purge();
        assert!(a.leak_check().is_ok());
    }
}
