//! Per-CPU counters: the sum is exact at quiescence, the rough read stays
//! within the documented bound `(batch − 1) × nr_slots` while other
//! threads add, `compare` answers correctly from whichever it uses, and
//! `limited_add` never lets the exact total pass its limit, however many
//! threads race it.

use iopages::{default_batch, PercpuCounter, PERCPU_BATCH_MAX, PERCPU_SLOTS_MAX};
use proptest::prelude::*;
use std::cmp::Ordering;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::thread;

#[test]
fn default_batch_is_max_of_32_and_twice_the_cpus() {
    assert_eq!(default_batch(1), 32);
    assert_eq!(default_batch(16), 32);
    assert_eq!(default_batch(17), 34);
    assert_eq!(default_batch(256), 512);
    let c = PercpuCounter::new(0);
    assert_eq!(c.batch(), default_batch(c.nr_slots()));
}

#[test]
fn error_bound_is_batch_minus_one_times_slots() {
    let c = PercpuCounter::with_settings(0, 6, 10).unwrap();
    assert_eq!(c.error_bound(), 9 * 6);
    let c = PercpuCounter::new(0);
    assert_eq!(c.error_bound(), (c.batch() - 1) * c.nr_slots() as i64);
}

#[test]
fn settings_outside_their_range_are_refused() {
    assert!(PercpuCounter::with_settings(0, 0, 32).is_err());
    assert!(PercpuCounter::with_settings(0, PERCPU_SLOTS_MAX + 1, 32).is_err());
    assert!(PercpuCounter::with_settings(0, 4, 0).is_err());
    assert!(PercpuCounter::with_settings(0, 4, PERCPU_BATCH_MAX + 1).is_err());
    assert!(PercpuCounter::with_settings(0, PERCPU_SLOTS_MAX, PERCPU_BATCH_MAX).is_ok());
}

#[test]
fn small_adds_stay_per_cpu_until_the_batch_then_fold() {
    let c = PercpuCounter::with_settings(100, 1, 8).unwrap();
    for _ in 0..7 {
        c.add(1);
    }
    assert_eq!(c.read(), 100, "deltas below the batch stay per CPU");
    assert_eq!(c.sum(), 107);
    c.add(1);
    assert_eq!(c.read(), 108, "reaching the batch folds");
    assert_eq!(c.stats().folds, 1);
    c.add(-500);
    assert_eq!(c.read(), -392, "a large amount folds at once");
    assert_eq!(c.read_positive(), 0);
    assert_eq!(c.sum_positive(), 0);
    assert_eq!(c.sum(), -392);
}

#[test]
fn add_batch_never_uses_a_batch_above_the_counters() {
    let c = PercpuCounter::with_settings(0, 1, 8).unwrap();
    for _ in 0..100 {
        c.add_batch(1, 1_000_000);
        assert!((c.sum() - c.read()).abs() <= c.error_bound());
    }
    c.set(0);
    for i in 1..=20 {
        c.add_batch(1, 1);
        assert_eq!(c.read(), i, "batch 1 folds every add");
    }
}

#[test]
fn set_replaces_the_total_and_clears_the_deltas() {
    let c = PercpuCounter::with_settings(0, 2, 16).unwrap();
    c.add(5);
    c.set(-3);
    assert_eq!((c.read(), c.sum()), (-3, -3));
}

#[test]
fn compare_uses_the_rough_count_far_from_rhs_and_the_exact_sum_near_it() {
    let c = PercpuCounter::with_settings(0, 4, 8).unwrap();
    c.add(3);
    assert_eq!(c.read(), 0);
    let sums = c.stats().exact_sums;
    assert_eq!(c.compare(1000), Ordering::Less);
    assert_eq!(c.compare(-1000), Ordering::Greater);
    assert_eq!(c.stats().exact_sums, sums, "far from rhs: no lock");
    assert_eq!(c.compare(3), Ordering::Equal);
    assert_eq!(c.compare(2), Ordering::Greater);
    assert_eq!(c.compare(4), Ordering::Less);
    assert_eq!(c.stats().exact_sums, sums + 3, "near rhs: exact");
}

#[test]
fn limited_add_works_in_both_directions_and_decides_exactly() {
    let c = PercpuCounter::with_settings(0, 2, 4).unwrap();
    assert!(c.limited_add(10, 0));
    assert!(c.limited_add(10, 10));
    assert!(!c.limited_add(10, 1));
    assert_eq!(c.sum(), 10);
    assert!(c.limited_add(4, -6), "a floor of 4 allows going down to 4");
    assert!(!c.limited_add(4, -1));
    assert_eq!(c.sum(), 4);
    assert!(c.limited_add(i64::MAX, 1));
    assert!(c.limited_add(i64::MIN, -1));
    assert_eq!(c.sum(), 4);
    let s = c.stats();
    assert!(s.limited_exact >= 1 && s.limited_locked >= s.limited_exact);
}

/// Run `f(t)` on `n` threads that start together and join them.
fn race(n: usize, f: impl Fn(usize) + Send + Sync + 'static) {
    let f = Arc::new(f);
    let line = Arc::new(Barrier::new(n));
    let hs: Vec<_> = (0..n)
        .map(|t| {
            let (f, line) = (f.clone(), line.clone());
            thread::spawn(move || {
                line.wait();
                f(t)
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

/// Eight threads each holding up to 16 adds of up to 20 against a limit of
/// 500, far more demand than room: `held` (raised after a successful add,
/// lowered before the release) is a lower bound of the exact total at
/// every instant, and an observer checks it never passes the limit; at the
/// end every add has been released and the total is back where it began.
#[test]
fn limited_add_never_overshoots_with_racing_adds_and_releases() {
    const LIMIT: i64 = 500;
    let c = Arc::new(PercpuCounter::with_settings(0, 4, 16).unwrap());
    let held = Arc::new(AtomicI64::new(0));
    let running = Arc::new(AtomicUsize::new(8));
    let seen_max = Arc::new(AtomicI64::new(0));
    {
        let (c, held, running, seen_max) =
            (c.clone(), held.clone(), running.clone(), seen_max.clone());
        race(9, move |t| {
            if t == 8 {
                while running.load(SeqCst) > 0 {
                    let h = held.load(SeqCst);
                    seen_max.fetch_max(h, SeqCst);
                    assert!(h <= LIMIT, "the exact total reached {h} > {LIMIT}");
                    thread::yield_now();
                }
                return;
            }
            let mut rng = 0x2545_f491_4f6c_dd1d_u64 ^ (t as u64 + 1);
            let mut mine = Vec::new();
            for _ in 0..40_000 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let a = 1 + (rng % 20) as i64;
                if c.limited_add(LIMIT, a) {
                    // `held` trails the counter's exact total (added after
                    // a grant, taken before a release), so it is never
                    // above the limit either. The workers record its peak
                    // themselves: on a loaded machine the watcher may
                    // hardly run.
                    let now = held.fetch_add(a, SeqCst) + a;
                    assert!(now <= LIMIT, "the exact total reached {now} > {LIMIT}");
                    seen_max.fetch_max(now, SeqCst);
                    mine.push(a);
                }
                if mine.len() > 15 || (rng >> 40) % 3 == 0 {
                    if let Some(a) = mine.pop() {
                        held.fetch_sub(a, SeqCst);
                        c.add(-a);
                    }
                }
            }
            for a in mine {
                held.fetch_sub(a, SeqCst);
                c.add(-a);
            }
            running.fetch_sub(1, SeqCst);
        });
    }
    assert_eq!(c.sum(), 0);
    assert!(
        seen_max.load(SeqCst) > LIMIT / 4,
        "the limit was never approached: the test tested nothing"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// Whatever the slots, batch, threads and amounts, once every thread
    /// has finished the sum is the exact total and the rough count is
    /// within the bound of it.
    #[test]
    fn sum_is_exact_at_quiescence(
        slots in 1usize..8,
        batch in 1i64..64,
        initial in -1000i64..1000,
        work in prop::collection::vec(prop::collection::vec(-200i64..200, 0..300), 1..5),
    ) {
        let c = Arc::new(PercpuCounter::with_settings(initial, slots, batch).unwrap());
        let total = initial + work.iter().flatten().sum::<i64>();
        let work = Arc::new(work);
        let n = work.len();
        {
            let (c, work) = (c.clone(), work.clone());
            race(n, move |t| {
                for (i, &a) in work[t].iter().enumerate() {
                    if i % 3 == 0 {
                        c.add_batch(a, 1 + i as i64 % batch);
                    } else {
                        c.add(a);
                    }
                }
            });
        }
        prop_assert_eq!(c.sum(), total);
        prop_assert!((c.read() - total).abs() <= c.error_bound());
        prop_assert_eq!(c.compare(total), Ordering::Equal);
    }

    /// While threads add, a reader's rough count is within the bound of
    /// some total the adds can have reached at that moment. Each thread
    /// publishes how many of its adds have started and finished; the
    /// reader loads the finished counts, reads, then loads the started
    /// counts, so the total at the read lies between the prefix sums those
    /// bracket.
    #[test]
    fn read_stays_within_the_bound_during_concurrent_adds(
        slots in 1usize..6,
        batch in 2i64..40,
        work in prop::collection::vec(prop::collection::vec(-50i64..60, 50..400), 2..5),
    ) {
        let c = Arc::new(PercpuCounter::with_settings(0, slots, batch).unwrap());
        let n = work.len();
        // prefix[t][k]: the sum of thread t's first k amounts.
        let prefix: Arc<Vec<Vec<i64>>> = Arc::new(
            work.iter()
                .map(|w| std::iter::once(0).chain(w.iter().scan(0, |s, a| { *s += a; Some(*s) })).collect())
                .collect(),
        );
        let started: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
        let done: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
        let finished = Arc::new(AtomicBool::new(false));
        let violations = Arc::new(AtomicUsize::new(0));
        let work = Arc::new(work);
        let reader = {
            let (c, prefix, started, done, finished, violations) =
                (c.clone(), prefix.clone(), started.clone(), done.clone(), finished.clone(), violations.clone());
            thread::spawn(move || {
                let mut reads = 0;
                while !finished.load(SeqCst) || reads == 0 {
                    let d: Vec<usize> = done.iter().map(|x| x.load(SeqCst)).collect();
                    let r = c.read();
                    let s: Vec<usize> = started.iter().map(|x| x.load(SeqCst)).collect();
                    let (mut lo, mut hi) = (0, 0);
                    for t in 0..d.len() {
                        let range = &prefix[t][d[t]..=s[t]];
                        lo += range.iter().min().unwrap();
                        hi += range.iter().max().unwrap();
                    }
                    if r < lo - c.error_bound() || r > hi + c.error_bound() {
                        violations.fetch_add(1, SeqCst);
                    }
                    reads += 1;
                }
            })
        };
        {
            let (c, work, started, done) = (c.clone(), work.clone(), started.clone(), done.clone());
            race(n, move |t| {
                for (k, &a) in work[t].iter().enumerate() {
                    started[t].store(k + 1, SeqCst);
                    c.add(a);
                    done[t].store(k + 1, SeqCst);
                }
            });
        }
        finished.store(true, SeqCst);
        reader.join().unwrap();
        prop_assert_eq!(violations.load(SeqCst), 0, "read() left the error bound");
        prop_assert_eq!(c.sum(), prefix.iter().map(|p| p.last().unwrap()).sum::<i64>());
    }

    /// Many threads race `limited_add` (increases only) toward a limit: an
    /// observer's exact sums never pass it (with increases only, a sum taken
    /// under the lock is at most the total at its end), the final total is
    /// within the limit and equals the start plus every accepted amount, and
    /// at quiescence the counter can be filled exactly to the limit.
    #[test]
    fn limited_add_never_overshoots_under_racing_threads(
        slots in 1usize..8,
        batch in 1i64..48,
        threads in 2usize..8,
        limit in 0i64..3000,
        start_below in 0i64..200,
        amounts in prop::collection::vec(1i64..40, 20..200),
    ) {
        let initial = limit - start_below;
        let c = Arc::new(PercpuCounter::with_settings(initial, slots, batch).unwrap());
        let accepted = Arc::new(AtomicI64::new(0));
        let running = Arc::new(AtomicUsize::new(threads));
        let amounts = Arc::new(amounts);
        let worst = Arc::new(AtomicI64::new(i64::MIN));
        {
            let (c, accepted, running, amounts, worst) =
                (c.clone(), accepted.clone(), running.clone(), amounts.clone(), worst.clone());
            race(threads + 1, move |t| {
                if t == threads {
                    while running.load(SeqCst) > 0 {
                        worst.fetch_max(c.sum(), SeqCst);
                    }
                    return;
                }
                for (i, &a) in amounts.iter().enumerate() {
                    let a = a + (i as i64 + t as i64) % 3;
                    if c.limited_add(limit, a) {
                        accepted.fetch_add(a, SeqCst);
                    }
                }
                running.fetch_sub(1, SeqCst);
            });
        }
        prop_assert!(worst.load(SeqCst) <= limit, "an observer saw {} > {}", worst.load(SeqCst), limit);
        let total = c.sum();
        prop_assert!(total <= limit);
        prop_assert_eq!(total, initial + accepted.load(SeqCst));
        prop_assert!((c.read() - total).abs() <= c.error_bound());
        if total < limit {
            prop_assert!(c.limited_add(limit, limit - total), "room left but refused");
        }
        prop_assert!(!c.limited_add(limit, 1));
        prop_assert_eq!(c.sum(), limit);
    }

    /// Without races `limited_add` accepts exactly when the exact total
    /// plus the amount stays within the limit (upper limit for increases,
    /// floor for decreases), whichever path decides.
    #[test]
    fn limited_add_without_races_matches_the_exact_rule(
        slots in 1usize..5,
        batch in 1i64..32,
        ops in prop::collection::vec((-60i64..60, -200i64..200, any::<bool>()), 1..300),
    ) {
        let c = PercpuCounter::with_settings(0, slots, batch).unwrap();
        let mut model = 0i64;
        for (amount, limit, plain) in ops {
            if plain {
                c.add(amount);
                model += amount;
                continue;
            }
            let fits = match amount.cmp(&0) {
                Ordering::Greater => model + amount <= limit,
                Ordering::Less => model + amount >= limit,
                Ordering::Equal => true,
            };
            prop_assert_eq!(c.limited_add(limit, amount), fits, "total {} amount {} limit {}", model, amount, limit);
            if fits {
                model += amount;
            }
        }
        prop_assert_eq!(c.sum(), model);
    }
}

#[test]
fn a_statistic_counter_takes_large_adds_from_many_threads_without_folding() {
    let c = Arc::new(PercpuCounter::statistic());
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                for i in 0..10_000i64 {
                    c.add(1 << 20 | (i ^ t));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let want: i64 = (0..4i64)
        .map(|t| (0..10_000i64).map(|i| 1 << 20 | (i ^ t)).sum::<i64>())
        .sum();
    assert_eq!(c.sum(), want);
    // A slot folds only when its delta passes the batch (2^30): about
    // once per GiB added, not once per add.
    let folds = c.stats().folds as i64;
    assert!(
        folds <= want / PERCPU_BATCH_MAX + 4,
        "{folds} folds for 40000 adds of ~1 MiB"
    );
}
