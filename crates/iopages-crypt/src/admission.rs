//! The queue's admission gate: at most `depth` requests in flight,
//! submitters asleep while it is full, woken a batch at a time.
//!
//! Owns: the count of admitted requests and the sleepers on it. Must
//! never: admit more than `depth`, or leave a sleeper asleep when it could
//! go on (a lost wake-up): a full gate wakes its submitters once `batch`
//! slots are free (the block layer's tag wake batch), and an empty gate
//! always wakes everyone — so as long as admitted requests complete,
//! every sleeper wakes.
//!
//! Generic over the lock and condition variable so that the same code is
//! model-checked with `loom` in the tests.

/// The counts the gate's lock guards.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Admitted and not yet completed.
    pub(crate) admitted: usize,
    /// Threads asleep waiting for room or for zero.
    pub(crate) waiting: usize,
}

/// A lock around [`Counts`] with one condition variable.
pub(crate) trait WaitCell: Send + Sync {
    /// A cell holding zero counts.
    fn new() -> Self;
    /// Under the lock, run `f` until it returns true, sleeping (counted in
    /// `waiting`) between tries.
    fn wait_until(&self, f: impl FnMut(&mut Counts) -> bool);
    /// Under the lock, run `f`; if it returns true, wake every sleeper.
    fn update(&self, f: impl FnOnce(&mut Counts) -> bool);
    /// Under the lock, read the counts.
    fn read<R>(&self, f: impl FnOnce(&Counts) -> R) -> R;
}

/// The gate.
pub(crate) struct Admission<W: WaitCell> {
    cell: W,
    depth: usize,
    batch: usize,
}

impl<W: WaitCell> Admission<W> {
    /// A gate of `depth` (≥ 1) slots waking sleepers `batch` (1..=depth)
    /// completions at a time.
    pub(crate) fn new(depth: usize, batch: usize) -> Self {
        assert!(depth >= 1 && (1..=depth).contains(&batch));
        Admission {
            cell: W::new(),
            depth,
            batch,
        }
    }

    /// Slots.
    pub(crate) fn depth(&self) -> usize {
        self.depth
    }

    /// Take a slot, sleeping while none is free.
    pub(crate) fn admit(&self) {
        let depth = self.depth;
        self.cell.wait_until(|c| {
            if c.admitted < depth {
                c.admitted += 1;
                true
            } else {
                false
            }
        });
    }

    /// Take a slot if one is free now.
    ///
    /// **Returns:** whether it was taken.
    pub(crate) fn try_admit(&self) -> bool {
        let depth = self.depth;
        let mut got = false;
        self.cell.update(|c| {
            got = c.admitted < depth;
            c.admitted += usize::from(got);
            false
        });
        got
    }

    /// Give a slot back (a request completed).
    pub(crate) fn complete(&self) {
        let (depth, batch) = (self.depth, self.batch);
        self.cell.update(|c| {
            c.admitted -= 1;
            c.waiting > 0 && (c.admitted == 0 || c.admitted + batch <= depth)
        });
    }

    /// Sleep until nothing is admitted.
    pub(crate) fn wait_idle(&self) {
        self.cell.wait_until(|c| c.admitted == 0);
    }

    /// Requests admitted now.
    pub(crate) fn admitted(&self) -> usize {
        self.cell.read(|c| c.admitted)
    }
}

/// The cell used outside the model: parking_lot's lock and condvar.
pub(crate) struct PlCell {
    counts: parking_lot::Mutex<Counts>,
    cv: parking_lot::Condvar,
}

impl WaitCell for PlCell {
    fn new() -> Self {
        PlCell {
            counts: parking_lot::Mutex::new(Counts::default()),
            cv: parking_lot::Condvar::new(),
        }
    }

    fn wait_until(&self, mut f: impl FnMut(&mut Counts) -> bool) {
        let mut c = self.counts.lock();
        while !f(&mut c) {
            c.waiting += 1;
            self.cv.wait(&mut c);
            c.waiting -= 1;
        }
    }

    fn update(&self, f: impl FnOnce(&mut Counts) -> bool) {
        let wake = f(&mut self.counts.lock());
        if wake {
            self.cv.notify_all();
        }
    }

    fn read<R>(&self, f: impl FnOnce(&Counts) -> R) -> R {
        f(&self.counts.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct LoomCell {
        counts: loom::sync::Mutex<Counts>,
        cv: loom::sync::Condvar,
    }

    impl WaitCell for LoomCell {
        fn new() -> Self {
            LoomCell {
                counts: loom::sync::Mutex::new(Counts::default()),
                cv: loom::sync::Condvar::new(),
            }
        }
        fn wait_until(&self, mut f: impl FnMut(&mut Counts) -> bool) {
            let mut c = self.counts.lock().unwrap();
            while !f(&mut c) {
                c.waiting += 1;
                c = self.cv.wait(c).unwrap();
                c.waiting -= 1;
            }
        }
        fn update(&self, f: impl FnOnce(&mut Counts) -> bool) {
            let wake = f(&mut self.counts.lock().unwrap());
            if wake {
                self.cv.notify_all();
            }
        }
        fn read<R>(&self, f: impl FnOnce(&Counts) -> R) -> R {
            f(&self.counts.lock().unwrap())
        }
    }

    /// Two submitters racing for the gate (the model's main thread is the
    /// second), completing what they were admitted; then the main thread
    /// waits for idle. loom tries every interleaving and reports a
    /// deadlock (a lost wake-up) or an over-admission.
    fn model(depth: usize, batch: usize) {
        loom::model(move || {
            let g = loom::sync::Arc::new(Admission::<LoomCell>::new(depth, batch));
            let other = {
                let g = g.clone();
                loom::thread::spawn(move || {
                    g.admit();
                    assert!(g.admitted() <= g.depth(), "over-admitted");
                    g.complete();
                })
            };
            g.admit();
            assert!(g.admitted() <= g.depth(), "over-admitted");
            g.complete();
            g.wait_idle();
            other.join().unwrap();
            assert_eq!(g.admitted(), 0);
        });
    }

    #[test]
    fn loom_a_gate_of_one_never_loses_a_wake_up() {
        model(1, 1);
    }

    #[test]
    fn loom_batched_wake_ups_never_strand_a_sleeper() {
        model(2, 2);
    }

    #[test]
    fn try_admit_takes_a_free_slot_and_never_waits() {
        let g = Admission::<PlCell>::new(2, 1);
        assert!(g.try_admit() && g.try_admit());
        assert!(!g.try_admit(), "no slot free");
        assert_eq!(g.admitted(), 2);
        g.complete();
        assert!(g.try_admit());
        g.complete();
        g.complete();
        g.wait_idle();
    }

    #[test]
    fn the_gate_bounds_admissions_and_wakes_in_batches() {
        let g = std::sync::Arc::new(Admission::<PlCell>::new(4, 2));
        for _ in 0..4 {
            g.admit();
        }
        let g2 = std::sync::Arc::clone(&g);
        let t = std::thread::spawn(move || g2.admit());
        while g.cell.read(|c| c.waiting) == 0 {
            std::thread::yield_now();
        }
        g.complete();
        // One slot free is below the batch: the submitter sleeps on.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(g.cell.read(|c| c.waiting), 1, "woken before the batch");
        g.complete();
        t.join().unwrap();
        assert_eq!(g.admitted(), 3);
        for _ in 0..3 {
            g.complete();
        }
        g.wait_idle();
    }
}
