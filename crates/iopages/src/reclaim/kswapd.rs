//! Background reclaim: the kernel's `kswapd`, one thread per allocator.
//!
//! Owns: the thread's life (started by the first wake-up, asleep with no
//! timer until the next, gone when stopped or when its allocator is
//! dropped), its wake-up hand-off, and a balancing round — run the
//! shrinkers until the allocator is above its high watermark or they free
//! nothing more. Must never: keep its allocator alive (it holds a weak
//! reference), hold an allocator lock while it calls a shrinker, or wake
//! on a timer.
//!
//! It sees the allocator only through [`ReclaimTarget`], which the
//! allocator implements: this module sits below `page_alloc` and does not
//! name it.

use super::shrinker::ShrinkerRegistry;
use crate::gfp::Gfp;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};

/// Pages background reclaim asks the shrinkers for at a time.
const KSWAPD_BATCH: usize = 128;

/// What background reclaim needs of the allocator it serves.
pub(crate) trait ReclaimTarget: Send + Sync + 'static {
    /// Free pages the allocator can hand out without reclaim.
    fn free_pages(&self) -> usize;
    /// Where a balancing round stops: the high watermark.
    fn high_watermark(&self) -> usize;
    /// The shrinkers to run.
    fn shrinkers(&self) -> &ShrinkerRegistry;
    /// Give pages parked in caches back to the zone, where the watermarks
    /// see them (what a shrinker freed sits in this thread's cache).
    fn drain_to_zone(&self);
}

/// The state the thread and the allocator share.
#[derive(Default)]
struct Shared {
    /// Under the lock: a wake-up not yet served, and whether the thread is
    /// waiting for one.
    state: Mutex<State>,
    cv: Condvar,
    stop: AtomicBool,
    rounds: AtomicU64,
    reclaimed: AtomicU64,
}

#[derive(Default)]
struct State {
    pending: bool,
    asleep: bool,
}

/// One allocator's background reclaim.
pub(crate) struct Kswapd<T: ReclaimTarget> {
    started: AtomicBool,
    shared: Arc<Shared>,
    /// The allocator it serves, not kept alive by it.
    target: Weak<T>,
}

impl<T: ReclaimTarget> Kswapd<T> {
    /// Background reclaim for `target`; `enabled: false` starts it stopped.
    pub(crate) fn new(target: Weak<T>, enabled: bool) -> Kswapd<T> {
        Kswapd {
            started: AtomicBool::new(false),
            shared: Arc::new(Shared {
                stop: AtomicBool::new(!enabled),
                ..Shared::default()
            }),
            target,
        }
    }

    /// Wake the thread (start it on first use, naming it `name`).
    ///
    /// **Context:** never blocks for long: one short lock to post the
    /// wake-up. Without a thread (spawning failed) nothing happens and
    /// direct reclaim still works.
    pub(crate) fn wake(&self, name: impl FnOnce() -> String) {
        if self.shared.stop.load(Relaxed) {
            return;
        }
        if !self.started.load(Relaxed) && !self.started.swap(true, Relaxed) {
            let weak = self.target.clone();
            let shared = Arc::clone(&self.shared);
            let spawned = std::thread::Builder::new()
                .name(name())
                .spawn(move || kswapd_main(weak, shared));
            if spawned.is_err() {
                // No thread: try again at the next wake-up.
                self.started.store(false, Relaxed);
                return;
            }
        }
        let mut st = self.shared.state.lock();
        if !st.pending {
            st.pending = true;
            self.shared.cv.notify_one();
        }
    }

    /// Stop the thread; it exits at its next look at the flag.
    pub(crate) fn stop(&self) {
        self.shared.stop.store(true, Relaxed);
        let _g = self.shared.state.lock();
        self.shared.cv.notify_all();
    }

    /// Allow the thread again after [`Kswapd::stop`]; the next wake-up
    /// starts a new one.
    pub(crate) fn start(&self) {
        if self.shared.stop.swap(false, Relaxed) {
            self.started.store(false, Relaxed);
        }
    }

    /// Whether the thread is started and not stopped.
    pub(crate) fn running(&self) -> bool {
        self.started.load(Relaxed) && !self.shared.stop.load(Relaxed)
    }

    /// Whether nothing is in progress: never started, stopped, or asleep
    /// with no wake-up pending.
    pub(crate) fn idle(&self) -> bool {
        if !self.running() {
            return true;
        }
        let st = self.shared.state.lock();
        st.asleep && !st.pending
    }

    /// (rounds run, pages reclaimed).
    pub(crate) fn stats(&self) -> (u64, u64) {
        (
            self.shared.rounds.load(Relaxed),
            self.shared.reclaimed.load(Relaxed),
        )
    }
}

impl<T: ReclaimTarget> Drop for Kswapd<T> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: wait for a wake-up, run a round against the allocator if it
/// still exists, repeat.
fn kswapd_main<T: ReclaimTarget>(target: Weak<T>, shared: Arc<Shared>) {
    loop {
        {
            let mut st = shared.state.lock();
            while !st.pending && !shared.stop.load(Relaxed) {
                st.asleep = true;
                shared.cv.wait(&mut st);
            }
            st.asleep = false;
            st.pending = false;
        }
        if shared.stop.load(Relaxed) {
            return;
        }
        let Some(t) = target.upgrade() else { return };
        let got = balance(&*t, &shared.stop);
        shared.rounds.fetch_add(1, Relaxed);
        shared.reclaimed.fetch_add(got as u64, Relaxed);
        drop(t);
    }
}

/// One round of background reclaim: shrink until the allocator is above
/// its high watermark or the shrinkers free nothing more (or `stop` is
/// set). Returns pages reclaimed. Each pass asks for at most
/// [`KSWAPD_BATCH`] pages and either stops or frees at least one, and the
/// pages the shrinkers hold are finite, so the loop ends.
fn balance<T: ReclaimTarget>(t: &T, stop: &AtomicBool) -> usize {
    let high = t.high_watermark();
    let mut total = 0;
    loop {
        let free = t.free_pages();
        if free >= high || stop.load(Relaxed) {
            break;
        }
        let want = (high - free).min(KSWAPD_BATCH);
        let got = t.shrinkers().shrink(Gfp::KERNEL, want);
        t.drain_to_zone();
        total += got;
        if got == 0 {
            break;
        }
    }
    total
}
