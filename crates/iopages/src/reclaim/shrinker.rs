//! Reclaim: shrinkers that give memory back when an allocation needs it.
//!
//! Owns: the registry of [`Shrinker`]s and direct reclaim — an allocating
//! thread asking them, in registration order, to free pages. Must never:
//! call a shrinker that needs I/O or file-system context from an allocation
//! whose flags (after the thread's NOIO/NOFS scope) forbid it, or call one
//! while holding an allocator lock.
//!
//! Background reclaim (`kswapd.rs`, woken below the low watermark) calls
//! the same registry from its own thread.

use crate::gfp::Gfp;
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Something that holds freeable pages (a cache) and can give them back.
pub trait Shrinker: Send + Sync {
    /// A name for statistics and logs.
    fn name(&self) -> &str;
    /// Pages it could free right now (an estimate is fine).
    fn count_objects(&self) -> usize;
    /// Free up to `nr_to_scan` pages; returns how many were freed.
    ///
    /// **Context:** called from an allocating thread with no allocator lock
    /// held; may allocate only with `Gfp::NOWAIT`.
    fn scan_objects(&self, nr_to_scan: usize) -> usize;
    /// Whether scanning may start I/O (skipped under `NOIO`).
    fn needs_io(&self) -> bool {
        false
    }
    /// Whether scanning may enter a file system (skipped under `NOFS`).
    fn needs_fs(&self) -> bool {
        false
    }
}

/// A registered shrinker's handle, for [`ShrinkerRegistry::unregister`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShrinkerId(u64);

/// The allocator's shrinkers.
#[derive(Default)]
pub struct ShrinkerRegistry {
    list: RwLock<Vec<(ShrinkerId, Arc<dyn Shrinker>)>>,
    next_id: AtomicU64,
    runs: AtomicU64,
    pages_freed: AtomicU64,
}

impl ShrinkerRegistry {
    /// Add a shrinker; it is asked to free memory from now on.
    pub fn register(&self, s: Arc<dyn Shrinker>) -> ShrinkerId {
        let id = ShrinkerId(self.next_id.fetch_add(1, Relaxed));
        self.list.write().push((id, s));
        id
    }

    /// Remove a shrinker. Returns whether it was registered.
    pub fn unregister(&self, id: ShrinkerId) -> bool {
        let mut l = self.list.write();
        let before = l.len();
        l.retain(|(i, _)| *i != id);
        l.len() != before
    }

    /// Registered shrinkers.
    pub fn len(&self) -> usize {
        self.list.read().len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Direct reclaim: ask the shrinkers that `gfp` allows to free
    /// `nr_wanted` pages between them. Returns pages freed.
    ///
    /// **Context:** may block (the shrinkers may); `gfp` must already have
    /// the thread's NOIO/NOFS scope applied.
    pub fn shrink(&self, gfp: Gfp, nr_wanted: usize) -> usize {
        let shrinkers: Vec<Arc<dyn Shrinker>> = self
            .list
            .read()
            .iter()
            .filter(|(_, s)| {
                (gfp.contains(Gfp::IO) || !s.needs_io()) && (gfp.contains(Gfp::FS) || !s.needs_fs())
            })
            .map(|(_, s)| Arc::clone(s))
            .collect();
        self.runs.fetch_add(1, Relaxed);
        let mut freed = 0;
        for s in shrinkers {
            if freed >= nr_wanted {
                break;
            }
            let nr = s.count_objects().min(nr_wanted - freed);
            if nr > 0 {
                freed += s.scan_objects(nr);
            }
        }
        self.pages_freed.fetch_add(freed as u64, Relaxed);
        freed
    }

    /// (direct reclaim runs, pages freed by shrinkers) so far.
    pub fn totals(&self) -> (u64, u64) {
        (self.runs.load(Relaxed), self.pages_freed.load(Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Cache {
        held: AtomicUsize,
        io: bool,
    }
    impl Shrinker for Cache {
        fn name(&self) -> &str {
            "test-cache"
        }
        fn count_objects(&self) -> usize {
            self.held.load(Relaxed)
        }
        fn scan_objects(&self, nr: usize) -> usize {
            let n = nr.min(self.held.load(Relaxed));
            self.held.fetch_sub(n, Relaxed);
            n
        }
        fn needs_io(&self) -> bool {
            self.io
        }
    }

    #[test]
    fn shrink_stops_when_enough_is_freed_and_respects_noio() {
        let r = ShrinkerRegistry::default();
        let a = Arc::new(Cache {
            held: AtomicUsize::new(10),
            io: true,
        });
        let b = Arc::new(Cache {
            held: AtomicUsize::new(10),
            io: false,
        });
        r.register(a.clone());
        let id_b = r.register(b.clone());
        assert_eq!(r.shrink(Gfp::NOIO, 5), 5);
        assert_eq!(
            a.held.load(Relaxed),
            10,
            "NOIO must skip the shrinker that needs I/O"
        );
        assert_eq!(b.held.load(Relaxed), 5);
        assert_eq!(r.shrink(Gfp::KERNEL, 12), 12);
        assert_eq!(a.held.load(Relaxed) + b.held.load(Relaxed), 3);
        assert!(r.unregister(id_b));
        assert!(!r.unregister(id_b));
        assert_eq!(r.len(), 1);
        assert_eq!(r.totals(), (2, 17));
    }
}
