//! `luks format`'s key derivation, chosen as cryptsetup chooses it: a
//! short benchmark scaled to a target unlock time (`--iter-time`), Argon2
//! memory bounded by 1 GiB and half the available memory, explicit costs
//! kept, and what is chosen opens here (under the default `KdfLimits`)
//! and passes `cryptsetup luksDump`.
//!
//! The timing checks use a small target (200 ms) and a generous range:
//! they check that the calibration scales, not how fast this machine is.
//! cryptsetup is an outside tool: where it is missing the test prints a
//! skip line, except under `CI=true`, where it fails.

use iopages_crypt::luks::{
    self, Calibrated, FormatOptions, Hash, KdfKind, KdfLimits, KdfTarget, LuksError, LuksVersion,
    Pbkdf,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::{need, Dir};

const PASS: &[u8] = b"calibrated passphrase";

/// The tests here time key derivations: one at a time, so that one
/// test's benchmark does not share the CPU with another's.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
const TARGET: Duration = Duration::from_millis(200);

/// The limits every calibrated cost must pass: `KdfLimits::default()`.
fn assert_opens_under_default_limits(p: &Pbkdf) {
    let l = KdfLimits::default();
    match p.argon2_params() {
        None => {
            let Pbkdf::Pbkdf2 { iterations, .. } = *p else {
                unreachable!("{p:?}")
            };
            assert!(
                (1000..=l.max_pbkdf2_iterations).contains(&iterations),
                "{p:?}"
            )
        }
        Some((time, memory_kib, parallel)) => {
            assert!((4..=l.max_argon2_time).contains(&time), "{p:?}");
            assert!(
                (32..=l.max_argon2_memory_kib).contains(&memory_kib),
                "{p:?}"
            );
            assert!((1..=4.min(l.max_argon2_lanes)).contains(&parallel), "{p:?}");
            assert!(u64::from(time) * u64::from(memory_kib) <= l.max_argon2_work_kib);
        }
    }
}

/// `(time, memory_kib, parallel)` of a calibration that must be Argon2id.
fn argon2id_costs(c: &Calibrated) -> (u32, u32, u32) {
    let Pbkdf::Argon2id {
        time,
        memory_kib,
        parallel,
    } = c.pbkdf
    else {
        panic!("{c}")
    };
    (time, memory_kib, parallel)
}

/// Time one unlock of `pbkdf` the way `open` runs it: derive a key of
/// `key_bytes` (through a real format and open, so nothing is left out).
fn format_and_time_open(dir: &Dir, name: &str, opts: &FormatOptions) -> (PathBuf, Duration) {
    let img = dir.path(name);
    let size = match opts.version {
        LuksVersion::Luks1 => (2 << 20) + 4096,
        LuksVersion::Luks2 => (16 << 20) + 4096,
    };
    let made = luks::format_path(&img, Some(size), PASS, opts).unwrap();
    let t0 = Instant::now();
    let vol = luks::open_path(&img, PASS).unwrap_or_else(|e| panic!("{name}: {e}"));
    let took = t0.elapsed();
    assert_eq!(vol.master_key(), made.master_key());
    (img, took)
}

/// Unlock took between a quarter and four times the target: the
/// calibration scaled the benchmark (a badly wrong rate is off by far
/// more), on a machine that may be busy with other tests.
fn assert_roughly(name: &str, c: &Calibrated, took: Duration) {
    eprintln!(
        "{name}: {c} — open took {:.3} s, benchmark {:.3} s",
        took.as_secs_f64(),
        c.benchmark_time.as_secs_f64()
    );
    assert!(c.benchmarked, "{name}: {c}");
    assert!(
        in_window(took),
        "{name}: unlocking took {took:?} for a {TARGET:?} target ({c})"
    );
    let expected = c.expected.unwrap();
    assert!(
        expected >= TARGET / 2 && expected <= TARGET * 2,
        "{name}: expected {expected:?} ({c})"
    );
    // The benchmark is a fraction of the target, not a second run of it.
    assert!(
        c.benchmark_time < TARGET + Duration::from_millis(500),
        "{name}: the benchmark took {:?}",
        c.benchmark_time
    );
}

#[test]
fn calibration_hits_roughly_the_target_time_and_the_result_opens() {
    let _serial = serial();
    let dir = Dir::new("luks-kdf", "target");
    for (name, version, kind) in [
        (
            "luks1-pbkdf2-sha256",
            LuksVersion::Luks1,
            KdfKind::Pbkdf2(Hash::Sha256),
        ),
        (
            "luks1-pbkdf2-sha1",
            LuksVersion::Luks1,
            KdfKind::Pbkdf2(Hash::Sha1),
        ),
        ("luks2-argon2id", LuksVersion::Luks2, KdfKind::Argon2id),
        ("luks2-argon2i", LuksVersion::Luks2, KdfKind::Argon2i),
        (
            "luks2-pbkdf2-sha256",
            LuksVersion::Luks2,
            KdfKind::Pbkdf2(Hash::Sha256),
        ),
    ] {
        let base = FormatOptions {
            version,
            ..FormatOptions::fast_for_tests(version)
        };
        // Up to three calibrations: one whose benchmark and unlock saw a
        // different load (other tests, other processes on a shared
        // machine) may miss the window; a wrong rate misses it every time.
        for attempt in 1..=3 {
            let (opts, c) = base
                .clone()
                .with_calibrated_kdf(&KdfTarget::new(kind, TARGET))
                .unwrap();
            assert_eq!(opts.pbkdf, c.pbkdf);
            assert_opens_under_default_limits(&c.pbkdf);
            let (_, took) = format_and_time_open(&dir, &format!("{name}.img"), &opts);
            if attempt == 3 || in_window(took) {
                assert_roughly(name, &c, took);
                break;
            }
            eprintln!("{name}: unlock took {took:?}, outside the window: calibrating again");
        }
    }
}

/// Whether an unlock time is within a quarter and four times the target.
fn in_window(took: Duration) -> bool {
    took >= TARGET / 4 && took <= TARGET * 4
}

#[test]
fn calibrated_defaults_follow_cryptsetup() {
    let _serial = serial();
    // LUKS1: PBKDF2-SHA256; LUKS2: Argon2id with up to 4 lanes (one per
    // CPU at most), 4 passes at least.
    let (o1, c1) = FormatOptions::calibrated(LuksVersion::Luks1, TARGET).unwrap();
    assert!(matches!(
        c1.pbkdf,
        Pbkdf::Pbkdf2 {
            hash: Hash::Sha256,
            ..
        }
    ));
    assert_eq!((o1.version, o1.key_bytes), (LuksVersion::Luks1, 64));
    let (o2, c2) = FormatOptions::calibrated(LuksVersion::Luks2, TARGET).unwrap();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    match c2.pbkdf {
        Pbkdf::Argon2id { time, parallel, .. } => {
            assert!(time >= 4);
            assert_eq!(parallel, cpus.clamp(1, 4) as u32);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(o2.version, LuksVersion::Luks2);
    assert_eq!(luks::default_lanes(cpus), cpus.clamp(1, 4) as u32);
    // Pbkdf::calibrate is the same choice without the options.
    let c = Pbkdf::calibrate(KdfKind::Argon2id, TARGET, 64).unwrap();
    assert!(matches!(c.pbkdf, Pbkdf::Argon2id { .. }) && c.benchmarked);
    // A longer target buys more work.
    let c_long = Pbkdf::calibrate(KdfKind::Pbkdf2(Hash::Sha256), TARGET * 4, 64).unwrap();
    let (
        Pbkdf::Pbkdf2 {
            iterations: short, ..
        },
        Pbkdf::Pbkdf2 {
            iterations: long, ..
        },
    ) = (c1.pbkdf, c_long.pbkdf)
    else {
        unreachable!()
    };
    assert!(long > short * 2, "{short} → {long}");
}

/// Every cost given (PBKDF2, Argon2i): nothing is benchmarked and the
/// costs are kept as given.
fn every_cost_given_benchmarks_nothing() {
    let t = KdfTarget {
        iterations: Some(1234),
        ..KdfTarget::new(KdfKind::Pbkdf2(Hash::Sha1), TARGET)
    };
    let c = luks::calibrate(&t, 32).unwrap();
    assert_eq!(
        c.pbkdf,
        Pbkdf::Pbkdf2 {
            hash: Hash::Sha1,
            iterations: 1234
        }
    );
    assert!(!c.benchmarked && c.expected.is_none());
    assert_eq!(c.benchmark_time, Duration::ZERO);
    assert!(c.to_string().contains("not benchmarked"), "{c}");

    let t = KdfTarget {
        iterations: Some(5),
        memory_kib: Some(4096),
        parallel: Some(3),
        ..KdfTarget::new(KdfKind::Argon2i, TARGET)
    };
    let c = luks::calibrate(&t, 64).unwrap();
    assert_eq!(
        c.pbkdf,
        Pbkdf::Argon2i {
            time: 5,
            memory_kib: 4096,
            parallel: 3
        }
    );
    assert!(!c.benchmarked);
}

#[test]
fn explicit_costs_are_kept_and_skip_their_calibration() {
    let _serial = serial();
    every_cost_given_benchmarks_nothing();
    // Memory given: only the passes are calibrated.
    let t = KdfTarget {
        memory_kib: Some(8192),
        ..KdfTarget::new(KdfKind::Argon2id, TARGET)
    };
    let c = luks::calibrate(&t, 64).unwrap();
    let (time, memory_kib, parallel) = argon2id_costs(&c);
    assert_eq!(memory_kib, 8192);
    assert_eq!(parallel, t.default_parallel);
    assert!(c.benchmarked && time >= 4, "{c}");

    // Passes and lanes given: only the memory is calibrated.
    let t = KdfTarget {
        iterations: Some(6),
        parallel: Some(1),
        ..KdfTarget::new(KdfKind::Argon2id, TARGET)
    };
    let c = luks::calibrate(&t, 64).unwrap();
    let (time, memory_kib, parallel) = argon2id_costs(&c);
    assert_eq!((time, parallel), (6, 1));
    assert!(c.benchmarked && memory_kib >= 32, "{c}");
    let dir = Dir::new("luks-kdf", "explicit");
    let opts = FormatOptions {
        pbkdf: c.pbkdf,
        ..FormatOptions::fast_for_tests(LuksVersion::Luks2)
    };
    let (_, took) = format_and_time_open(&dir, "time6.img", &opts);
    eprintln!("{c}: open took {took:?}");
    assert!(took <= TARGET * 4, "{took:?} for {c}");
    refused_costs_are_named();
}

/// Given costs that cryptsetup or opening here would refuse: each
/// refusal names its reason; Argon2 for LUKS1 is refused before any
/// benchmark.
fn refused_costs_are_named() {
    for (t, key_bytes, want) in [
        (
            KdfTarget {
                iterations: Some(999),
                ..KdfTarget::new(KdfKind::Pbkdf2(Hash::Sha256), TARGET)
            },
            64,
            "minimum",
        ),
        (
            KdfTarget {
                iterations: Some(60_000_000),
                ..KdfTarget::new(KdfKind::Pbkdf2(Hash::Sha256), TARGET)
            },
            64,
            "max_pbkdf2_iterations",
        ),
        (
            KdfTarget {
                memory_kib: Some(2 << 20),
                ..KdfTarget::new(KdfKind::Argon2id, TARGET)
            },
            64,
            "max_argon2_memory_kib",
        ),
        (
            KdfTarget {
                iterations: Some(100),
                memory_kib: Some(1 << 20),
                ..KdfTarget::new(KdfKind::Argon2id, TARGET)
            },
            64,
            "max_argon2_work_kib",
        ),
        (
            KdfTarget {
                parallel: Some(5),
                ..KdfTarget::new(KdfKind::Argon2id, TARGET)
            },
            64,
            "parallelism",
        ),
        (
            KdfTarget {
                memory_kib: Some(1024),
                ..KdfTarget::new(KdfKind::Pbkdf2(Hash::Sha256), TARGET)
            },
            64,
            "Argon2",
        ),
        (KdfTarget::new(KdfKind::Argon2id, Duration::ZERO), 64, "0"),
    ] {
        match luks::calibrate(&t, key_bytes) {
            Err(LuksError::InvalidOptions(m)) => assert!(m.contains(want), "{want}: {m}"),
            other => panic!("{t:?}: {other:?}"),
        }
    }
    // Argon2 for LUKS1 is refused before any benchmark.
    let t0 = Instant::now();
    let e = FormatOptions::fast_for_tests(LuksVersion::Luks1)
        .with_calibrated_kdf(&KdfTarget::new(KdfKind::Argon2id, Duration::from_secs(30)))
        .unwrap_err();
    assert!(matches!(e, LuksError::InvalidOptions(m) if m.contains("PBKDF2 only")));
    assert!(t0.elapsed() < Duration::from_secs(1));
}

#[test]
fn argon2_memory_is_bounded_by_available_memory_and_by_1_gib() {
    let _serial = serial();
    // Little memory available: at most half of it, whatever the target.
    let t = KdfTarget {
        available_memory_kib: Some(16 << 10),
        ..KdfTarget::new(KdfKind::Argon2id, TARGET)
    };
    let c = luks::calibrate(&t, 64).unwrap();
    let (time, memory_kib, _) = argon2id_costs(&c);
    assert!(memory_kib <= 8 << 10, "{c}");
    assert!(time >= 4, "{c}");
    if memory_kib == 8 << 10 {
        // The cap held it: the passes carry the rest of the target, and
        // the note says why.
        assert!(c.to_string().contains("half the memory available"), "{c}");
    }
    assert_opens_under_default_limits(&c.pbkdf);

    // A long target on a large machine: memory stops at 1 GiB (nothing
    // is derived at that cost here; only the benchmark runs, briefly).
    let long = Duration::from_secs(120);
    let t = KdfTarget {
        iterations: Some(4),
        available_memory_kib: Some(64 << 20),
        ..KdfTarget::new(KdfKind::Argon2id, long)
    };
    let t0 = Instant::now();
    let c = luks::calibrate(&t, 64).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(
        matches!(
            c.pbkdf,
            Pbkdf::Argon2id {
                time: 4,
                memory_kib: 1048576,
                ..
            }
        ),
        "{c}"
    );
    // Nothing fixed: memory at 1 GiB, passes raised, and the work held to
    // what opening accepts by default.
    let t = KdfTarget {
        available_memory_kib: Some(64 << 20),
        ..KdfTarget::new(KdfKind::Argon2id, Duration::from_secs(3600))
    };
    let c = luks::calibrate(&t, 64).unwrap();
    let (time, memory_kib, _) = argon2id_costs(&c);
    assert_eq!(memory_kib, 1 << 20, "{c}");
    assert!(time > 4, "{c}");
    assert_opens_under_default_limits(&c.pbkdf);
    assert!(c.to_string().contains("opening accepts"), "{c}");
    pbkdf2_and_the_memory_cap_are_bounded();
}

/// PBKDF2 for a long target stops at 50 M iterations; the memory cap is
/// half the available memory, at most 1 GiB.
fn pbkdf2_and_the_memory_cap_are_bounded() {
    // The same for PBKDF2: at most 50 M iterations.
    let c = Pbkdf::calibrate(KdfKind::Pbkdf2(Hash::Sha1), Duration::from_secs(3600), 32).unwrap();
    assert_eq!(
        c.pbkdf,
        Pbkdf::Pbkdf2 {
            hash: Hash::Sha1,
            iterations: KdfLimits::default().max_pbkdf2_iterations
        }
    );
    assert_opens_under_default_limits(&c.pbkdf);
    // The bound itself: half the available memory, at most 1 GiB.
    assert_eq!(luks::argon2_memory_cap(Some(64 << 20)), 1 << 20);
    assert_eq!(luks::argon2_memory_cap(Some(512 << 10)), 256 << 10);
    assert_eq!(luks::argon2_memory_cap(None), 1 << 20);
    if let Some(avail) = luks::available_memory_kib() {
        let cap = luks::argon2_memory_cap(Some(avail));
        assert!(u64::from(cap) <= avail / 2 || cap == 32);
    }
}

fn cryptsetup_accepts(cs: &Path, img: &Path, pass_file: &Path) -> String {
    let out = Command::new(cs).arg("luksDump").arg(img).output().unwrap();
    assert!(
        out.status.success(),
        "luksDump {}: {}",
        img.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let test = Command::new(cs)
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(pass_file)
        .arg(img)
        .output()
        .unwrap();
    assert!(
        test.status.success(),
        "cryptsetup open --test-passphrase {}: {}",
        img.display(),
        String::from_utf8_lossy(&test.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn calibrated_volumes_pass_cryptsetup() {
    let _serial = serial();
    let Some(cs) = need("cryptsetup", "calibrated_volumes_pass_cryptsetup") else {
        return;
    };
    let dir = Dir::new("luks-kdf", "cryptsetup");
    let pass_file = dir.path("pass");
    std::fs::write(&pass_file, PASS).unwrap();
    for version in [LuksVersion::Luks1, LuksVersion::Luks2] {
        let (opts, c) = FormatOptions::calibrated(version, TARGET).unwrap();
        let (img, _) = format_and_time_open(&dir, &format!("{version}.img"), &opts);
        let dump = cryptsetup_accepts(&cs, &img, &pass_file);
        match c.pbkdf {
            Pbkdf::Pbkdf2 { iterations, .. } => {
                assert!(dump.contains(&iterations.to_string()), "{dump}")
            }
            Pbkdf::Argon2id {
                time, memory_kib, ..
            } => {
                assert!(dump.contains(&format!("Time cost:  {time}")), "{dump}");
                assert!(
                    dump.contains(&format!("Memory:     {memory_kib}")),
                    "{dump}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
