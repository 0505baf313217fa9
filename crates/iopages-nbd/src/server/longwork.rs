//! Long work kept off the watchers: [`LongWork`].
//!
//! A watcher serves connections in turn; work that takes seconds — a lazy
//! export's opening, whose key derivation is serialised process-wide
//! anyway — would hold one while the others wait for the keeper's grace.
//! Such work is queued here instead and run in order on one thread of its
//! own, started when work arrives and ended when none is left (a server
//! that never opens a lazy export never runs it). What the work belongs to
//! (a connection in the handshake) waits in the queue without a thread.
//!
//! Owns: the queue and its thread. Must never: run two jobs at once, run a
//! job after [`LongWork::stop`] (queued ones are dropped, giving back what
//! they hold), or end the stop before its thread has ended.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

/// A piece of long work.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// The thread runs (it takes the queue's jobs until none is left).
    running: bool,
    closed: bool,
    thread: Option<JoinHandle<()>>,
}

/// One thread's queue of long work.
#[derive(Default)]
pub(crate) struct LongWork {
    state: Mutex<State>,
}

impl LongWork {
    /// Run `job` after the jobs queued before it, on the long-work thread
    /// (started if none runs). After the stop, or if no thread can be
    /// started, `job` is dropped instead (what it holds is given back).
    pub(crate) fn submit(self: &Arc<Self>, job: Job) {
        let mut s = self.state.lock();
        if s.closed {
            return;
        }
        s.queue.push_back(job);
        if s.running {
            return;
        }
        if let Some(t) = s.thread.take() {
            // Ended (it was not running): nothing to wait for.
            let _ = t.join();
        }
        let me = Arc::clone(self);
        match std::thread::Builder::new()
            .name("nbd-long-work".into())
            .spawn(move || me.run())
        {
            Ok(t) => {
                s.running = true;
                s.thread = Some(t);
            }
            Err(e) => {
                eprintln!("iopages-nbd: cannot start the long-work thread: {e}");
                s.queue.clear();
            }
        }
    }

    /// The thread: every job queued, in order, until none is left.
    fn run(self: Arc<Self>) {
        loop {
            let job = {
                let mut s = self.state.lock();
                match s.queue.pop_front() {
                    Some(j) if !s.closed => j,
                    _ => {
                        s.running = false;
                        return;
                    }
                }
            };
            // A job that panics ends alone (what it held is dropped as it
            // unwinds).
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        }
    }

    /// Take no more work, drop the jobs queued and wait for the one
    /// running, if any. Idempotent.
    pub(crate) fn stop(&self) {
        let (queued, thread) = {
            let mut s = self.state.lock();
            s.closed = true;
            (std::mem::take(&mut s.queue), s.thread.take())
        };
        drop(queued);
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn jobs_run_in_order_one_at_a_time_and_the_thread_ends_when_idle() {
        let w = Arc::new(LongWork::default());
        let (tx, rx) = mpsc::channel();
        let busy = Arc::new(AtomicUsize::new(0));
        for i in 0..20 {
            let (tx, busy) = (tx.clone(), Arc::clone(&busy));
            w.submit(Box::new(move || {
                assert_eq!(busy.fetch_add(1, Ordering::SeqCst), 0, "two jobs at once");
                std::thread::sleep(Duration::from_millis(1));
                busy.fetch_sub(1, Ordering::SeqCst);
                tx.send(i).unwrap();
            }));
        }
        let got: Vec<i32> = (0..20)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(got, (0..20).collect::<Vec<_>>());
        let t = std::time::Instant::now();
        while w.state.lock().running {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the thread never ended"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // A later job starts it again; a panicking one ends alone.
        w.submit(Box::new(|| panic!("a job that panics")));
        let tx2 = tx.clone();
        w.submit(Box::new(move || tx2.send(99).unwrap()));
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), 99);
        w.stop();
    }

    #[test]
    fn the_stop_drops_queued_jobs_and_waits_for_the_running_one() {
        let w = Arc::new(LongWork::default());
        let (started_tx, started) = mpsc::channel();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&ran);
        w.submit(Box::new(move || {
            started_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            r.fetch_add(1, Ordering::SeqCst);
        }));
        let held = Arc::new(());
        for _ in 0..3 {
            let (r, h) = (Arc::clone(&ran), Arc::clone(&held));
            w.submit(Box::new(move || {
                let _h = h;
                r.fetch_add(10, Ordering::SeqCst);
            }));
        }
        started.recv_timeout(Duration::from_secs(10)).unwrap();
        w.stop();
        assert_eq!(
            ran.load(Ordering::SeqCst),
            1,
            "the running job finished, no queued one ran"
        );
        assert_eq!(Arc::strong_count(&held), 1, "the queued jobs were dropped");
        let r = Arc::clone(&ran);
        w.submit(Box::new(move || {
            r.fetch_add(100, Ordering::SeqCst);
        }));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(ran.load(Ordering::SeqCst), 1, "a job ran after the stop");
    }
}
