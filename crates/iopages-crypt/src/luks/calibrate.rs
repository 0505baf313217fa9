//! Choosing a keyslot's key-derivation costs for a target unlock time,
//! as `cryptsetup luksFormat` does with its benchmark (`--iter-time`).
//!
//! Owns: [`KdfTarget`] (what to calibrate and which costs are fixed),
//! [`calibrate`] and [`Pbkdf::calibrate`] (a short benchmark, scaled to
//! the target) and
//! [`Calibrated`] (the choice, what bounded it, and how it reads on a
//! terminal); the memory bound ([`available_memory_kib`],
//! [`argon2_memory_cap`]) and the default lane count ([`default_lanes`]).
//! Must never: choose costs that [`KdfLimits::default`] would refuse when
//! opening (what is formatted here opens here), choose Argon2 memory over
//! 1 GiB or over half the available memory unless the caller asked for
//! it, override a cost the caller gave, or spend much more than a fraction
//! of the target time benchmarking.
//!
//! ## How the costs are chosen
//!
//! cryptsetup measures a cheap derivation, scales it to the target time
//! and, for Argon2, raises the memory first (up to its 1 GiB default cap,
//! bounded by half the machine's memory) and the passes (`time`) only
//! once the memory is at its cap, never below 4 passes. This does the
//! same in one step:
//!
//! 1. Benchmark: derive with a small cost, raising it until one
//!    derivation takes about a sixteenth of the target (10 ms ..=
//!    125 ms). PBKDF2 is timed with the output length of the real keyslot
//!    key (a 64-byte key is two SHA-256 blocks, twice the work), its last
//!    count twice (the faster run counts: the slower met a busy CPU or a
//!    cold cache). Argon2 is timed with one pass, the lanes it will use
//!    and growing memory, then with two passes at the last memory: the
//!    difference is the cost of a pass per KiB, the rest the cost of
//!    setting the memory up (allocation, page faults), so that neither
//!    is scaled by the other. Growing the memory (to ~100 MiB for a 2 s
//!    target) keeps the sample out of the CPU caches, which a small
//!    sample would time too fast.
//! 2. Scale: PBKDF2: the rate times the target, at least 1000
//!    iterations. Argon2: the memory that 4 passes (cryptsetup's
//!    minimum) fill the target with, up to the memory cap; then the
//!    passes that fill it at that memory (at least 4). A cost given by the caller is
//!    kept and only the others are scaled; when every cost is given,
//!    nothing is benchmarked.
//! 3. Bound by what opening accepts ([`KdfLimits::default`]): at most
//!    50 M PBKDF2 iterations, 1 GiB, 1 M passes, 64 GiB-passes of Argon2
//!    work. A calibrated cost is lowered to fit (and [`Calibrated::bounds`]
//!    says so); a cost the caller gave that does not fit is an error.
//!
//! Argon2 lanes are computed in up to min(lanes, CPUs) threads, as
//! cryptsetup computes them, and the benchmark times that: the target is
//! the unlock time on this machine, for this crate and cryptsetup alike
//! (one lane of this crate's G runs at about 0.65x the speed of an AVX2
//! one, so cryptsetup may unlock the same keyslot somewhat faster).

use super::kdf::{Hash, KdfCosts, Pbkdf};
use super::limits::KdfLimits;
use super::{
    LuksError, ARGON2_MAX_PARALLEL_FORMAT, ARGON2_MIN_MEMORY_KIB, ARGON2_MIN_TIME,
    PBKDF2_MIN_ITERATIONS,
};
use std::time::{Duration, Instant};

/// cryptsetup's default `--iter-time`: 2 seconds of unlock time.
pub const DEFAULT_ITER_TIME: Duration = Duration::from_millis(2000);
/// cryptsetup's default Argon2 memory cap for new keyslots
/// (`DEFAULT_LUKS2_MEMORY_KB`): 1 GiB.
pub const DEFAULT_ARGON2_MEMORY_CAP_KIB: u32 = 1 << 20;
/// Salt length of the benchmark derivations (a keyslot's salt length).
const SALT: [u8; 32] = [0x5a; 32];
/// The benchmark's passphrase.
const BENCH_PASSPHRASE: &[u8] = b"iopages kdf benchmark";

/// The key derivation to calibrate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdfKind {
    /// PBKDF2-HMAC with this hash (LUKS1; LUKS2 `"pbkdf2"`).
    Pbkdf2(Hash),
    /// Argon2i (LUKS2).
    Argon2i,
    /// Argon2id (LUKS2; cryptsetup's default).
    Argon2id,
}

impl KdfKind {
    /// The LUKS2 `kdf.type` name.
    pub fn name(self) -> &'static str {
        match self {
            KdfKind::Pbkdf2(_) => "pbkdf2",
            KdfKind::Argon2i => "argon2i",
            KdfKind::Argon2id => "argon2id",
        }
    }
}

/// What [`calibrate`] aims at: a KDF, the unlock time, and the costs the
/// caller fixed (each `Some` is kept as given and not calibrated).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KdfTarget {
    /// The KDF.
    pub kind: KdfKind,
    /// Target unlock time (cryptsetup's `--iter-time`, default 2 s).
    pub iter_time: Duration,
    /// PBKDF2 iterations, or Argon2 passes (`time`), fixed by the caller.
    pub iterations: Option<u32>,
    /// Argon2 memory in KiB, fixed by the caller (Argon2 only).
    pub memory_kib: Option<u32>,
    /// Argon2 lanes, fixed by the caller (Argon2 only); otherwise
    /// [`Self::default_parallel`].
    pub parallel: Option<u32>,
    /// The memory available for Argon2, in KiB (`None`: unknown). The
    /// calibrated memory is at most half of it ([`argon2_memory_cap`]).
    /// [`KdfTarget::new`] reads it from the machine
    /// ([`available_memory_kib`]).
    pub available_memory_kib: Option<u64>,
    /// Lanes when `parallel` is not given. [`KdfTarget::new`] sets
    /// [`default_lanes`] of this machine's CPUs.
    pub default_parallel: u32,
}

impl KdfTarget {
    /// `kind` for `iter_time`, nothing fixed, this machine's available
    /// memory and CPUs.
    pub fn new(kind: KdfKind, iter_time: Duration) -> KdfTarget {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        KdfTarget {
            kind,
            iter_time,
            iterations: None,
            memory_kib: None,
            parallel: None,
            available_memory_kib: available_memory_kib(),
            default_parallel: default_lanes(cpus),
        }
    }
}

/// The costs [`calibrate`] chose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Calibrated {
    /// The keyslot's KDF with its costs.
    pub pbkdf: Pbkdf,
    /// Whether a benchmark ran (`false`: every cost was given).
    pub benchmarked: bool,
    /// The unlock time the benchmark predicts for [`Self::pbkdf`] on this
    /// machine (`None` when nothing was benchmarked).
    pub expected: Option<Duration>,
    /// How long the benchmark itself took.
    pub benchmark_time: Duration,
    /// What held a cost below what the target time asked for, or above
    /// it (the memory cap, cryptsetup's minimums, the open-side limits),
    /// in words for the user; empty when nothing did.
    pub bounds: Vec<String>,
}

impl std::fmt::Display for Calibrated {
    /// `argon2id, 1048576 KiB, 5 passes, 4 lanes (about 2.0 s to unlock,
    /// benchmarked)` or `pbkdf2-sha256, 1234567 iterations (...)`, then
    /// the bounds, if any, after a semicolon.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pbkdf.costs() {
            KdfCosts::Pbkdf2 { hash, iterations } => {
                write!(f, "pbkdf2-{hash}, {iterations} iterations")?
            }
            KdfCosts::Argon2 {
                time,
                memory_kib,
                parallel,
            } => write!(
                f,
                "{}, {memory_kib} KiB, {time} passes, {parallel} lanes",
                self.pbkdf.name()
            )?,
        }
        match self.expected {
            Some(d) if self.benchmarked => write!(
                f,
                " (about {:.1} s to unlock, benchmarked)",
                d.as_secs_f64()
            )?,
            _ => write!(f, " (costs given explicitly, not benchmarked)")?,
        }
        if !self.bounds.is_empty() {
            write!(f, "; {}", self.bounds.join("; "))?;
        }
        Ok(())
    }
}

/// cryptsetup's lane count for new Argon2 keyslots: 4, or fewer on a
/// machine with fewer CPUs (at least 1).
pub fn default_lanes(cpus: usize) -> u32 {
    cpus.clamp(1, ARGON2_MAX_PARALLEL_FORMAT as usize) as u32
}

/// The most Argon2 memory calibration chooses, in KiB: cryptsetup's
/// 1 GiB default cap, and at most half of `available_kib` (cryptsetup
/// never takes more than half the memory: the OOM killer would end the
/// unlock), never below Argon2's 32 KiB minimum. Unknown memory: 1 GiB.
pub fn argon2_memory_cap(available_kib: Option<u64>) -> u32 {
    let cap = u64::from(DEFAULT_ARGON2_MEMORY_CAP_KIB);
    match available_kib {
        Some(a) => (a / 2).clamp(u64::from(ARGON2_MIN_MEMORY_KIB), cap) as u32,
        None => cap as u32,
    }
}

/// The memory this process could take now, in KiB: `MemAvailable` from
/// `/proc/meminfo` (or the free physical pages where it is missing),
/// and no more than a cgroup v2 memory limit leaves (`memory.max` less
/// `memory.current`). `None` when none of these can be read.
pub fn available_memory_kib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let field = |name: &str| -> Option<u64> {
        meminfo.as_deref()?.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.trim().trim_end_matches("kB").trim().parse().ok()
        })
    };
    let mut avail = field("MemAvailable").or_else(|| {
        // SAFETY: sysconf has no preconditions.
        let (pages, size) = unsafe {
            (
                libc::sysconf(libc::_SC_AVPHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        (pages > 0 && size > 0).then(|| pages as u64 * size as u64 / 1024)
    });
    let cg = |f: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    if let (Some(max), Some(cur)) = (cg("memory.max"), cg("memory.current")) {
        let left = max.saturating_sub(cur) / 1024;
        avail = Some(avail.map_or(left, |a| a.min(left)));
    }
    avail
}

/// A cost the caller gave that opening would refuse.
fn over_open_limit(what: &str, value: u64, limit: u64, knob: &str) -> LuksError {
    LuksError::InvalidOptions(format!(
        "{what} {value} is over the {limit} that opening accepts by default \
         (KdfLimits::{knob}): the volume would not open here"
    ))
}

/// How long one benchmark derivation should take for `target`: `div` of
/// it, within `lo ..= hi`.
fn sample_goal(target: Duration, div: u32, lo: u64, hi: u64) -> Duration {
    (target / div).clamp(Duration::from_millis(lo), Duration::from_millis(hi))
}

/// Time one derivation of `out_len` bytes.
fn time_one(p: &Pbkdf, out_len: usize) -> Result<Duration, LuksError> {
    let mut out = super::kdf::derived(out_len)?;
    let t0 = Instant::now();
    p.derive(BENCH_PASSPHRASE, &SALT, out.as_mut_slice())?;
    // Never zero: a rate is divided by it.
    Ok(t0.elapsed().max(Duration::from_micros(1)))
}

/// Choose the costs of a keyslot KDF for `target` (see the module notes);
/// `key_bytes` is the length of the key the keyslot derives (the volume
/// key's: 32 or 64), which PBKDF2's cost depends on.
///
/// **Returns:** the costs, or [`LuksError::InvalidOptions`] for a zero
/// target time, a fixed cost cryptsetup would refuse or opening here
/// would refuse, or memory or lanes given for PBKDF2.
pub fn calibrate(target: &KdfTarget, key_bytes: usize) -> Result<Calibrated, LuksError> {
    if target.iter_time.is_zero() {
        return Err(LuksError::InvalidOptions(
            "the target unlock time (iter-time) is 0: give at least 1 ms".to_string(),
        ));
    }
    if !(1..=1024).contains(&key_bytes) {
        return Err(LuksError::InvalidOptions(format!(
            "a {key_bytes}-byte keyslot key cannot be calibrated for"
        )));
    }
    let limits = KdfLimits::default();
    match target.kind {
        KdfKind::Pbkdf2(hash) => {
            if target.memory_kib.is_some() || target.parallel.is_some() {
                return Err(LuksError::InvalidOptions(
                    "memory and lanes are Argon2 costs: PBKDF2 has iterations only".to_string(),
                ));
            }
            calibrate_pbkdf2(target, hash, key_bytes, &limits)
        }
        KdfKind::Argon2i | KdfKind::Argon2id => calibrate_argon2(target, key_bytes, &limits),
    }
}

impl Pbkdf {
    /// The costs of `kind` for `iter_time` of unlock time on this machine,
    /// chosen as cryptsetup's benchmark does (this machine's memory and
    /// CPUs bound Argon2; nothing fixed): see [`calibrate()`] and
    /// [`KdfTarget`] to fix some costs. `key_bytes` is the volume key's
    /// length (PBKDF2's cost depends on it).
    pub fn calibrate(
        kind: KdfKind,
        iter_time: Duration,
        key_bytes: usize,
    ) -> Result<Calibrated, LuksError> {
        calibrate(&KdfTarget::new(kind, iter_time), key_bytes)
    }
}

/// [`calibrate`] for PBKDF2: a fixed count checked, or the rate
/// benchmarked and scaled to the target.
fn calibrate_pbkdf2(
    target: &KdfTarget,
    hash: Hash,
    key_bytes: usize,
    limits: &KdfLimits,
) -> Result<Calibrated, LuksError> {
    if let Some(iterations) = target.iterations {
        return pbkdf2_fixed(hash, iterations, limits);
    }
    let t0 = Instant::now();
    let rate = pbkdf2_rate(target, hash, key_bytes)?;
    let want = rate * target.iter_time.as_secs_f64();
    let mut bounds = Vec::new();
    let iterations = if want < f64::from(PBKDF2_MIN_ITERATIONS) {
        bounds.push(format!(
            "raised to cryptsetup's minimum of {PBKDF2_MIN_ITERATIONS} iterations"
        ));
        PBKDF2_MIN_ITERATIONS
    } else if want > f64::from(limits.max_pbkdf2_iterations) {
        bounds.push(format!(
            "lowered to the {} iterations opening accepts by default",
            limits.max_pbkdf2_iterations
        ));
        limits.max_pbkdf2_iterations
    } else {
        want as u32
    };
    Ok(Calibrated {
        pbkdf: Pbkdf::Pbkdf2 { hash, iterations },
        benchmarked: true,
        expected: Some(Duration::from_secs_f64(f64::from(iterations) / rate)),
        benchmark_time: t0.elapsed(),
        bounds,
    })
}

/// PBKDF2 with the `iterations` the caller gave: cryptsetup's format
/// rules, then what opening accepts; nothing benchmarked.
fn pbkdf2_fixed(hash: Hash, iterations: u32, limits: &KdfLimits) -> Result<Calibrated, LuksError> {
    let pbkdf = Pbkdf::Pbkdf2 { hash, iterations };
    pbkdf.check_for_format()?;
    if iterations > limits.max_pbkdf2_iterations {
        return Err(over_open_limit(
            "PBKDF2 iterations",
            iterations.into(),
            limits.max_pbkdf2_iterations.into(),
            "max_pbkdf2_iterations",
        ));
    }
    Ok(Calibrated {
        pbkdf,
        benchmarked: false,
        expected: None,
        benchmark_time: Duration::ZERO,
        bounds: Vec::new(),
    })
}

/// Step 1 for PBKDF2: this machine's iterations per second for a
/// `key_bytes` key, from a count raised until one derivation takes a
/// sixteenth of the target, timed twice at the last count.
fn pbkdf2_rate(target: &KdfTarget, hash: Hash, key_bytes: usize) -> Result<f64, LuksError> {
    let goal = sample_goal(target.iter_time, 16, 10, 125);
    let mut n = PBKDF2_MIN_ITERATIONS;
    loop {
        let took = time_one(
            &Pbkdf::Pbkdf2 {
                hash,
                iterations: n,
            },
            key_bytes,
        )?;
        if took >= goal || n >= 1 << 26 {
            // Once more at this cost; the faster run is the machine's
            // speed (the slower one met a busy CPU or a cold cache).
            let again = time_one(
                &Pbkdf::Pbkdf2 {
                    hash,
                    iterations: n,
                },
                key_bytes,
            )?;
            return Ok(f64::from(n) / took.min(again).as_secs_f64());
        }
        // Jump close to the goal when far below it, else double.
        let scale = (goal.as_secs_f64() / took.as_secs_f64()).clamp(2.0, 16.0);
        n = (f64::from(n) * scale) as u32;
    }
}

/// The Argon2 KDF named `name` (`argon2i` or `argon2id`) with these costs.
fn argon2_pbkdf(name: &str, time: u32, memory_kib: u32, parallel: u32) -> Pbkdf {
    Pbkdf::argon2(name, time, memory_kib, parallel).unwrap_or(Pbkdf::Argon2id {
        time,
        memory_kib,
        parallel,
    })
}

/// What the Argon2 benchmark measured, per KiB of memory: the cost of
/// setting the memory up and of one pass over it, in seconds.
struct Argon2Rate {
    setup: f64,
    per_pass: f64,
}

impl Argon2Rate {
    /// Predicted seconds for `mem` KiB and `t` passes.
    fn secs(&self, mem: f64, t: f64) -> f64 {
        mem * (self.setup + t * self.per_pass)
    }

    /// The passes that fill `budget` seconds at `mem` KiB.
    fn passes_for(&self, budget: f64, mem: f64) -> f64 {
        (budget / mem - self.setup) / self.per_pass
    }
}

/// [`calibrate`] for Argon2: fixed costs checked, then the three steps of
/// the module notes (benchmark, scale, bound by what opening accepts).
fn calibrate_argon2(
    target: &KdfTarget,
    key_bytes: usize,
    limits: &KdfLimits,
) -> Result<Calibrated, LuksError> {
    let name = target.kind.name();
    let parallel = target.parallel.unwrap_or(target.default_parallel).max(1);
    check_argon2_fixed(
        name,
        parallel,
        (target.iterations, target.memory_kib),
        limits,
    )?;
    if let (Some(time), Some(memory_kib)) = (target.iterations, target.memory_kib) {
        return Ok(Calibrated {
            pbkdf: argon2_pbkdf(name, time, memory_kib, parallel),
            benchmarked: false,
            expected: None,
            benchmark_time: Duration::ZERO,
            bounds: Vec::new(),
        });
    }

    let floor = (8 * parallel).max(ARGON2_MIN_MEMORY_KIB);
    let mut bounds = Vec::new();
    let cap = argon2_memory_cap(target.available_memory_kib).min(limits.max_argon2_memory_kib);
    let cap = cap.max(floor);

    let t0 = Instant::now();
    let top = target.memory_kib.unwrap_or(cap);
    let rate = argon2_rate(
        target,
        name,
        parallel,
        key_bytes,
        (floor.max(1024).min(top), top),
    )?;
    let benchmark_time = t0.elapsed();
    let (time, memory_kib) = scale_argon2(target, &rate, (floor, cap), &mut bounds);
    let time = bound_argon2_time(time, memory_kib, limits, &mut bounds);
    let pbkdf = argon2_pbkdf(name, time, memory_kib, parallel);
    pbkdf.check_for_format()?;
    let expected = rate.secs(f64::from(memory_kib), f64::from(time));
    Ok(Calibrated {
        pbkdf,
        benchmarked: true,
        expected: Some(Duration::from_secs_f64(expected)),
        benchmark_time,
        bounds,
    })
}

/// The Argon2 costs the caller fixed (`(time, memory)`, each optional):
/// cryptsetup's format rules, then the open-side limits.
fn check_argon2_fixed(
    name: &str,
    parallel: u32,
    (time, memory): (Option<u32>, Option<u32>),
    limits: &KdfLimits,
) -> Result<(), LuksError> {
    argon2_pbkdf(
        name,
        time.unwrap_or(ARGON2_MIN_TIME),
        memory.unwrap_or((8 * parallel).max(ARGON2_MIN_MEMORY_KIB)),
        parallel,
    )
    .check_for_format()?;
    if let Some(m) = memory {
        if m > limits.max_argon2_memory_kib {
            return Err(over_open_limit(
                &format!("{name} memory (KiB)"),
                m.into(),
                limits.max_argon2_memory_kib.into(),
                "max_argon2_memory_kib",
            ));
        }
    }
    if let Some(t) = time {
        if t > limits.max_argon2_time {
            return Err(over_open_limit(
                &format!("{name} passes"),
                t.into(),
                limits.max_argon2_time.into(),
                "max_argon2_time",
            ));
        }
    }
    if let (Some(t), Some(m)) = (time, memory) {
        let work = u64::from(t) * u64::from(m);
        if work > limits.max_argon2_work_kib {
            return Err(over_open_limit(
                &format!("{name} work (memory KiB × passes)"),
                work,
                limits.max_argon2_work_kib,
                "max_argon2_work_kib",
            ));
        }
    }
    Ok(())
}

/// Step 1 for Argon2: one pass with the lanes it will have, memory
/// growing from `start` up to `top` KiB, until a pass takes a sixteenth
/// of the target; then two passes at that memory. The difference is the
/// cost of a pass, the rest the cost of setting the memory up
/// (allocation, page faults, the first blocks), both per KiB.
fn argon2_rate(
    target: &KdfTarget,
    name: &str,
    parallel: u32,
    key_bytes: usize,
    (start, top): (u32, u32),
) -> Result<Argon2Rate, LuksError> {
    let goal = sample_goal(target.iter_time, 16, 10, 125);
    let mut m = start;
    let one = loop {
        let took = time_one(&argon2_pbkdf(name, 1, m, parallel), key_bytes)?;
        if took >= goal || m >= top {
            break took;
        }
        let scale = (goal.as_secs_f64() / took.as_secs_f64()).clamp(2.0, 8.0);
        m = ((f64::from(m) * scale) as u64).min(u64::from(top)) as u32;
    };
    let two = time_one(&argon2_pbkdf(name, 2, m, parallel), key_bytes)?.as_secs_f64();
    // A pass costs between a third and a half of two passes' time (the
    // set-up costs no more than a pass); noise is held to that range.
    let pass = (two - one.as_secs_f64()).clamp(two / 3.0, two / 2.0);
    let per_pass = pass / f64::from(m); // s per KiB per pass
    let setup = (two - 2.0 * pass).max(0.0) / f64::from(m); // s per KiB
    Ok(Argon2Rate { setup, per_pass })
}

/// Step 2 for Argon2: scale to the target, memory at the minimum passes
/// first (within `floor ..= cap`), then passes; a cost the caller gave is
/// kept. **Returns:** the passes and the memory in KiB.
fn scale_argon2(
    target: &KdfTarget,
    rate: &Argon2Rate,
    (floor, cap): (u32, u32),
    bounds: &mut Vec<String>,
) -> (u32, u32) {
    let budget = target.iter_time.as_secs_f64();
    match (target.iterations, target.memory_kib) {
        (_, Some(mem)) => {
            let t = rate.passes_for(budget, f64::from(mem)).round();
            if t < f64::from(ARGON2_MIN_TIME) {
                bounds.push(format!(
                    "passes raised to cryptsetup's minimum of {ARGON2_MIN_TIME}"
                ));
            }
            (t.clamp(f64::from(ARGON2_MIN_TIME), 1e9) as u32, mem)
        }
        (Some(t), None) => {
            let want = budget / (rate.setup + f64::from(t) * rate.per_pass);
            (t, fit_memory(want, floor, cap, target, bounds))
        }
        (None, None) => {
            let want = budget / (rate.setup + f64::from(ARGON2_MIN_TIME) * rate.per_pass);
            let mem = fit_memory(want, floor, cap, target, bounds);
            let t = rate
                .passes_for(budget, f64::from(mem))
                .round()
                .max(f64::from(ARGON2_MIN_TIME));
            (t.min(1e9) as u32, mem)
        }
    }
}

/// Step 3 for Argon2: the passes lowered to what opening accepts by
/// default (passes, and work at `memory_kib`), each bound noted.
fn bound_argon2_time(
    mut time: u32,
    memory_kib: u32,
    limits: &KdfLimits,
    bounds: &mut Vec<String>,
) -> u32 {
    if time > limits.max_argon2_time {
        time = limits.max_argon2_time;
        bounds.push(format!(
            "passes lowered to the {time} opening accepts by default"
        ));
    }
    let max_time_for_work = (limits.max_argon2_work_kib / u64::from(memory_kib)) as u32;
    if time > max_time_for_work {
        time = max_time_for_work.max(ARGON2_MIN_TIME);
        bounds.push(format!(
            "passes lowered to {time}: opening accepts at most {} KiB × passes of Argon2 work \
             by default",
            limits.max_argon2_work_kib
        ));
    }
    time
}

/// Memory for `want` KiB, within `floor ..= cap`; notes a bound that
/// held it.
fn fit_memory(
    want: f64,
    floor: u32,
    cap: u32,
    target: &KdfTarget,
    bounds: &mut Vec<String>,
) -> u32 {
    if want >= f64::from(cap) {
        if cap < DEFAULT_ARGON2_MEMORY_CAP_KIB {
            bounds.push(format!(
                "memory capped at {cap} KiB, half the memory available ({} KiB)",
                target.available_memory_kib.unwrap_or(0)
            ));
        }
        cap
    } else if want < f64::from(floor) {
        bounds.push(format!(
            "memory raised to the {floor} KiB minimum for {} lanes",
            target.parallel.unwrap_or(target.default_parallel)
        ));
        floor
    } else {
        want as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_cap_is_half_the_available_memory_at_most_1_gib() {
        assert_eq!(argon2_memory_cap(None), 1 << 20);
        assert_eq!(argon2_memory_cap(Some(64 << 20)), 1 << 20);
        assert_eq!(argon2_memory_cap(Some(1 << 20)), 1 << 19);
        assert_eq!(argon2_memory_cap(Some(10)), ARGON2_MIN_MEMORY_KIB);
    }

    #[test]
    fn lanes_are_four_at_most_and_bounded_by_cpus() {
        assert_eq!(default_lanes(0), 1);
        assert_eq!(default_lanes(1), 1);
        assert_eq!(default_lanes(2), 2);
        assert_eq!(default_lanes(64), 4);
    }

    #[test]
    fn reads_some_memory_figure_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(available_memory_kib().is_some_and(|k| k > 0));
        }
    }

    #[test]
    fn display_names_every_cost() {
        let c = Calibrated {
            pbkdf: Pbkdf::Argon2id {
                time: 5,
                memory_kib: 1 << 20,
                parallel: 4,
            },
            benchmarked: true,
            expected: Some(Duration::from_millis(2010)),
            benchmark_time: Duration::from_millis(300),
            bounds: Vec::new(),
        };
        assert_eq!(
            c.to_string(),
            "argon2id, 1048576 KiB, 5 passes, 4 lanes (about 2.0 s to unlock, benchmarked)"
        );
        let c = Calibrated {
            pbkdf: Pbkdf::Pbkdf2 {
                hash: Hash::Sha256,
                iterations: 1000,
            },
            benchmarked: false,
            expected: None,
            benchmark_time: Duration::ZERO,
            bounds: vec!["x".into()],
        };
        assert_eq!(
            c.to_string(),
            "pbkdf2-sha256, 1000 iterations (costs given explicitly, not benchmarked); x"
        );
    }
}
