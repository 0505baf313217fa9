//! `xts` (E2's cipher): AES-XTS with plain64 IVs, implementation by
//! implementation, beside `openssl speed` — the measurement behind the
//! crypt target's choice of cipher.
//!
//! Owns: this workload, its table, JSON and plot. Must never: assert a
//! timing.
//!
//! Each candidate encrypts a 1 MiB buffer into a second one (dm-crypt's
//! write path), sector by sector with each sector's own plain64 IV, keys
//! expanded once beforehand. Key sizes 32 and 64 bytes (AES-128-XTS and
//! AES-256-XTS, i.e. 256- and 512-bit XTS keys) × sectors of 512 and 4096
//! bytes; candidates and configurations run interleaved, run by run.
//! `openssl speed -evp aes-*-xts -bytes N` is the reference: OpenSSL's own
//! loop over one N-byte buffer with the IV set once, so no per-sector IV
//! cost — the fastest this machine's OpenSSL goes, and the bar the chosen
//! implementation must reach (512-bit key, 4096-byte sectors).

use crate::harness::{interleave, Plot, PlotFile, Report, Table};
use crate::plot::Series;
use crate::{met, progress, round2, BenchError, BenchOptions};
use aes::cipher::{BlockCipherEncrypt, KeyInit};
use iopages_crypt::{XtsBackend, XtsCipher};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

/// Bytes encrypted per call.
pub const BUFFER_BYTES: usize = 1 << 20;
/// Sector sizes measured.
pub const SECTORS: [usize; 2] = [512, 4096];
/// Key sizes measured, bytes, with OpenSSL's cipher name.
pub const KEYS: [(usize, &str); 2] = [(32, "aes-128-xts"), (64, "aes-256-xts")];
/// Target: the chosen implementation at least this fraction of
/// `openssl speed -evp aes-256-xts -bytes 4096`.
pub const TARGET_MIN_RATIO: f64 = 1.0;

/// What is measured in-process.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Candidate {
    /// An `iopages-crypt` backend.
    Crypt(XtsBackend),
    /// `xts-mode` 0.6 over `aes` 0.9 (copy, then encrypt in place: the
    /// crate has no out-of-place call).
    XtsMode,
}

impl Candidate {
    fn name(self) -> &'static str {
        match self {
            Candidate::Crypt(b) => b.name(),
            Candidate::XtsMode => "xts-mode",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Candidate::Crypt(XtsBackend::Vaes) => "iopages-crypt VAES kernel",
            Candidate::Crypt(XtsBackend::RustCrypto) => "aes 0.9 + XTS in iopages-crypt",
            Candidate::Crypt(XtsBackend::OpenSsl) => "OpenSSL EVP, IV set per sector",
            Candidate::XtsMode => "aes 0.9 + xts-mode 0.6",
        }
    }
}

/// One candidate, ready to run one configuration.
enum Runner {
    Crypt(Box<XtsCipher>),
    XtsMode128(Box<xts_mode::Xts128<aes::Aes128>>),
    XtsMode256(Box<xts_mode::Xts128<aes::Aes256>>),
}

impl Runner {
    fn new(c: Candidate, key: &[u8], sector: usize) -> Result<Runner, String> {
        match c {
            Candidate::Crypt(b) => XtsCipher::builder(key)
                .backend(b)
                .sector_size_bytes(sector)
                .build()
                .map(|x| Runner::Crypt(Box::new(x)))
                .map_err(|e| e.to_string()),
            Candidate::XtsMode => {
                let (k1, k2) = key.split_at(key.len() / 2);
                let bad = |e| format!("{e}");
                Ok(if key.len() == 32 {
                    Runner::XtsMode128(Box::new(xts_mode::Xts128::new(
                        aes::Aes128::new_from_slice(k1).map_err(bad)?,
                        aes::Aes128::new_from_slice(k2).map_err(bad)?,
                    )))
                } else {
                    Runner::XtsMode256(Box::new(xts_mode::Xts128::new(
                        aes::Aes256::new_from_slice(k1).map_err(bad)?,
                        aes::Aes256::new_from_slice(k2).map_err(bad)?,
                    )))
                })
            }
        }
    }

    /// Encrypt `src` into `dst`, whole sectors from `first_sector`.
    fn encrypt(
        &mut self,
        first_sector: u64,
        sector: usize,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), BenchError> {
        match self {
            Runner::Crypt(x) => x
                .encrypt_sectors(first_sector, src, dst)
                .map_err(|e| BenchError::Workload(e.to_string())),
            Runner::XtsMode128(x) => {
                dst.copy_from_slice(src);
                x.encrypt_area(
                    dst,
                    sector,
                    first_sector.into(),
                    xts_mode::get_tweak_default,
                );
                Ok(())
            }
            Runner::XtsMode256(x) => {
                dst.copy_from_slice(src);
                x.encrypt_area(
                    dst,
                    sector,
                    first_sector.into(),
                    xts_mode::get_tweak_default,
                );
                Ok(())
            }
        }
    }
}

/// Time `calls` encryptions of the buffer: MB/s.
fn sample(
    r: &mut Runner,
    sector: usize,
    calls: usize,
    src: &[u8],
    dst: &mut [u8],
) -> Result<f64, BenchError> {
    let per_call = (src.len() / sector) as u64;
    let t0 = Instant::now();
    for i in 0..calls {
        r.encrypt(i as u64 * per_call, sector, black_box(src), dst)?;
        black_box(&mut *dst);
    }
    Ok((calls * src.len()) as f64 / t0.elapsed().as_secs_f64() / 1e6)
}

/// The `aes` crate alone, no XTS: ECB over the same buffer (a reference
/// for what the crate's run-time-dispatched backend delivers here).
fn sample_aes_ecb(key_len: usize, calls: usize, buf: &mut [u8]) -> f64 {
    let mut blocks: Vec<aes::Block> = buf
        .chunks_exact(16)
        .map(|c| aes::Block::try_from(c).expect("16 bytes"))
        .collect();
    let t0 = Instant::now();
    if key_len == 32 {
        let c = aes::Aes128::new_from_slice(&[7u8; 16]).expect("16-byte key");
        for _ in 0..calls {
            c.encrypt_blocks(black_box(&mut blocks));
        }
    } else {
        let c = aes::Aes256::new_from_slice(&[7u8; 32]).expect("32-byte key");
        for _ in 0..calls {
            c.encrypt_blocks(black_box(&mut blocks));
        }
    }
    (calls * buf.len()) as f64 / t0.elapsed().as_secs_f64() / 1e6
}

/// `openssl speed -evp NAME -bytes N -seconds S`: MB/s, or why not.
fn openssl_speed(cipher: &str, bytes: usize, seconds: u32) -> Result<f64, String> {
    let out = Command::new("openssl")
        .args([
            "speed",
            "-evp",
            cipher,
            "-bytes",
            &bytes.to_string(),
            "-seconds",
            &seconds.to_string(),
        ])
        .output()
        .map_err(|e| format!("cannot run the openssl command: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "openssl speed failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    parse_openssl_speed(&String::from_utf8_lossy(&out.stdout), cipher)
        .ok_or_else(|| format!("no {cipher} line in openssl speed's output"))
}

/// The figure of `cipher` in `openssl speed`'s table (thousands of bytes
/// per second, "5405914.76k") as MB/s.
pub fn parse_openssl_speed(stdout: &str, cipher: &str) -> Option<f64> {
    let line = stdout.lines().rev().find(|l| {
        l.split_whitespace()
            .next()
            .is_some_and(|w| w.eq_ignore_ascii_case(cipher))
    })?;
    let last = line.split_whitespace().last()?;
    let kbytes: f64 = last.trim_end_matches('k').parse().ok()?;
    Some(kbytes / 1000.0)
}

/// CPU features that decide which AES code runs, as `is_x86_feature_detected`
/// sees them.
fn cpu_features() -> Value {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let aes_crate = if has!("avx512f") && has!("vaes") {
            "vaes512"
        } else if has!("vaes") {
            "vaes256"
        } else if has!("aes") {
            "aes-ni"
        } else {
            "soft (constant-time bitsliced)"
        };
        json!({
            "aes": has!("aes"),
            "avx2": has!("avx2"),
            "vaes": has!("vaes"),
            "vpclmulqdq": has!("vpclmulqdq"),
            "avx512f": has!("avx512f"),
            "aes_crate_backend": aes_crate,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        json!({ "arch": std::env::consts::ARCH })
    }
}

/// Median, min and max.
fn stats(v: &[f64]) -> (f64, f64, f64) {
    (
        crate::measure::median(v),
        v.iter().copied().fold(f64::INFINITY, f64::min),
        v.iter().copied().fold(0.0, f64::max),
    )
}

/// Results by candidate name, then "key bytes/sector bytes": MB/s per run.
type Samples = BTreeMap<String, BTreeMap<String, Vec<f64>>>;

/// One configuration of a run, in the order a run visits them.
#[derive(Clone, Copy)]
enum Point {
    /// `Ctx::runners[i]`.
    Runner(usize),
    /// The `aes` crate's ECB over the buffer, AES alone, at this key size.
    Ecb(usize),
    /// `openssl speed` at every key and sector size (once with --quick).
    Speed,
}

/// What the runs need and what they found.
struct Ctx {
    /// Every (candidate, key bytes, sector bytes) built once.
    runners: Vec<(Candidate, usize, usize, Runner)>,
    src: Vec<u8>,
    dst: Vec<u8>,
    ecb_buf: Vec<u8>,
    calls: usize,
    speed_seconds: u32,
    quick: bool,
    samples: Samples,
    speed_failed: Option<String>,
    speed_runs: usize,
}

impl Ctx {
    fn push(&mut self, name: &str, key_len: usize, sector: usize, v: f64) {
        self.samples
            .entry(name.to_string())
            .or_default()
            .entry(format!("{key_len}/{sector}"))
            .or_default()
            .push(v);
    }

    fn measure(&mut self, p: Point) -> Result<(), BenchError> {
        match p {
            Point::Runner(i) => {
                let (c, key_len, sector, r) = &mut self.runners[i];
                let v = sample(r, *sector, self.calls, &self.src, &mut self.dst)?;
                let (name, key_len, sector) = (c.name(), *key_len, *sector);
                self.push(name, key_len, sector, v);
            }
            Point::Ecb(key_len) => {
                let v = sample_aes_ecb(key_len, self.calls, &mut self.ecb_buf);
                self.push("aes-ecb", key_len, 0, v);
            }
            Point::Speed => {
                let run = self.speed_runs;
                self.speed_runs += 1;
                if self.speed_failed.is_some() || (run > 0 && self.quick) {
                    return Ok(());
                }
                for &(key_len, cipher) in &KEYS {
                    for &sector in &SECTORS {
                        match openssl_speed(cipher, sector, self.speed_seconds) {
                            Ok(v) => self.push("openssl-speed", key_len, sector, v),
                            Err(why) => {
                                progress("xts", format!("openssl speed unavailable: {why}"));
                                self.speed_failed = Some(why);
                                return Ok(());
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The figures of one run of the experiment, read back by name.
struct Figures {
    candidates: Vec<Candidate>,
    unavailable: Vec<(String, String)>,
    chosen: XtsBackend,
    samples: Samples,
    speed_failed: Option<String>,
}

/// The point of the target: a 512-bit key, 4096-byte sectors.
const TARGET_KEY: usize = 64;
const TARGET_SECTOR: usize = 4096;

impl Figures {
    /// (median, min, max) MB/s of `name` at this point.
    fn get(&self, name: &str, key_len: usize, sector: usize) -> Option<(f64, f64, f64)> {
        let v = self
            .samples
            .get(name)?
            .get(&format!("{key_len}/{sector}"))?;
        (!v.is_empty()).then(|| stats(v))
    }
    fn chosen_mb_s(&self) -> Option<f64> {
        self.get(self.chosen.name(), TARGET_KEY, TARGET_SECTOR)
            .map(|s| s.0)
    }
    fn speed_mb_s(&self) -> Option<f64> {
        self.get("openssl-speed", TARGET_KEY, TARGET_SECTOR)
            .map(|s| s.0)
    }
    fn ratio(&self) -> Option<f64> {
        match (self.chosen_mb_s(), self.speed_mb_s()) {
            (Some(c), Some(s)) if s > 0.0 => Some(c / s),
            _ => None,
        }
    }
    fn fastest(&self) -> Option<&'static str> {
        self.candidates
            .iter()
            .filter_map(|c| {
                self.get(c.name(), TARGET_KEY, TARGET_SECTOR)
                    .map(|s| (c.name(), s.0))
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(n, _)| n)
    }
}

/// The candidates this CPU can run, and those it cannot with why.
fn candidates() -> (Vec<Candidate>, Vec<(String, String)>) {
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut unavailable: Vec<(String, String)> = Vec::new();
    for b in XtsBackend::ALL {
        if b.is_available() {
            candidates.push(Candidate::Crypt(b));
        } else {
            unavailable.push((b.name().into(), "this CPU cannot run it".into()));
        }
    }
    candidates.push(Candidate::XtsMode);
    (candidates, unavailable)
}

/// Run the experiment and write its report. Returns the JSON report.
pub fn run(opts: &BenchOptions) -> Result<Value, BenchError> {
    let (runs, calls, speed_seconds) = if opts.quick { (3, 24, 1) } else { (7, 96, 2) };
    let (candidates, unavailable) = candidates();
    progress(
        "xts",
        format!(
            "{runs} runs; each sample encrypts a {} KiB buffer {calls} times, sector by sector; candidates {:?}; openssl speed {speed_seconds} s per figure{}",
            BUFFER_BYTES >> 10,
            candidates.iter().map(|c| c.name()).collect::<Vec<_>>(),
            if opts.quick { ", once" } else { ", every run" }
        ),
    );
    let src: Vec<u8> = (0..BUFFER_BYTES).map(|i| (i * 131 % 251) as u8).collect();
    let runners = runners_of(&candidates)?;
    let mut points: Vec<Point> = (0..runners.len()).map(Point::Runner).collect();
    points.extend(KEYS.iter().map(|&(k, _)| Point::Ecb(k)));
    points.push(Point::Speed);
    let mut ctx = Ctx {
        runners,
        ecb_buf: src.clone(),
        dst: vec![0u8; BUFFER_BYTES],
        src,
        calls,
        speed_seconds,
        quick: opts.quick,
        samples: Samples::new(),
        speed_failed: None,
        speed_runs: 0,
    };
    interleave(
        "xts",
        points.len(),
        runs,
        &mut ctx,
        |ctx, i| match points[i] {
            Point::Runner(r) => {
                let (_, _, sector, runner) = &mut ctx.runners[r];
                sample(runner, *sector, 2, &ctx.src, &mut ctx.dst).map(|_| ())
            }
            _ => Ok(()),
        },
        |ctx, i| ctx.measure(points[i]),
    )?;
    let f = Figures {
        candidates,
        unavailable,
        chosen: XtsBackend::default(),
        samples: ctx.samples,
        speed_failed: ctx.speed_failed,
    };
    table(&f, runs).print();
    let pages = crate::xts_pages::run(runs, calls)?;
    let settings = settings(opts, runs, calls, speed_seconds);
    let plot = Plot::lines(
        PlotFile::Main,
        "AES-256-XTS (512-bit key), plain64 IV per sector: MB/s by sector size",
        "sector size, 512-byte units (1 = 512 B, 8 = 4096 B)",
        "MB/s",
        series(&f),
    );
    let body = Body {
        summary: summary(&f),
        samples_mb_s: &f.samples,
        pages,
    };
    Report::new("xts", settings, body).emit(opts, &[plot])
}

/// Every (candidate, key length, sector) runner, built once; the harness
/// warms each.
fn runners_of(
    candidates: &[Candidate],
) -> Result<Vec<(Candidate, usize, usize, Runner)>, BenchError> {
    let key_of = |len: usize| -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(73).wrapping_add(11))
            .collect()
    };
    let mut runners = Vec::new();
    for &c in candidates {
        for &(key_len, _) in &KEYS {
            for &sector in &SECTORS {
                let r = Runner::new(c, &key_of(key_len), sector)
                    .map_err(|e| BenchError::Workload(format!("{}: {e}", c.name())))?;
                runners.push((c, key_len, sector, r));
            }
        }
    }
    Ok(runners)
}

/// How the run was made.
fn settings(opts: &BenchOptions, runs: usize, calls: usize, speed_seconds: u32) -> Value {
    json!({
        "quick": opts.quick,
        "runs": runs,
        "buffer_bytes": BUFFER_BYTES,
        "calls_per_sample": calls,
        "openssl_speed_seconds": speed_seconds,
        "direction": "encrypt, out of place",
        "key_names": {"aes-128-xts": "32-byte (256-bit) XTS key", "aes-256-xts": "64-byte (512-bit) XTS key"},
        "openssl_speed_command": "openssl speed -evp aes-{128,256}-xts -bytes {512,4096} -seconds S",
    })
}

/// The table and the lines under it.
fn table(f: &Figures, runs: usize) -> Table {
    let mut t = Table::new("");
    t.line(format!(
        "xts: AES-XTS plain64 encryption of a {} KiB buffer into another, sector by sector, MB/s (median and min-max of {runs} runs) and ns per sector",
        BUFFER_BYTES >> 10
    ));
    let label = |c: &Candidate| {
        let mark = if Candidate::Crypt(f.chosen) == *c {
            " [chosen]"
        } else {
            ""
        };
        format!("{} ({}){mark}", c.name(), c.describe())
    };
    let width = f
        .candidates
        .iter()
        .map(|c| label(c).len())
        .max()
        .unwrap_or(0)
        .max(36);
    let points = || {
        KEYS.iter()
            .flat_map(|&k| SECTORS.iter().map(move |&s| (k, s)))
    };
    let mut head = vec![format!("{:<width$}", "")];
    head.extend(
        points().map(|((_, cipher), sector)| format!("{:>22}", format!("{cipher}, {sector} B"))),
    );
    t.row(head);
    let mut sub = vec![format!("{:<width$}", "candidate")];
    sub.extend(points().map(|_| format!("{:>6} {:>9} {:>5}", "MB/s", "min-max", "ns")));
    t.row(sub);
    let cell = |m: f64, lo: f64, hi: f64, ns: String| {
        format!("{m:>6.0} {:>9} {ns:>5}", format!("{lo:.0}-{hi:.0}"))
    };
    let dash = || format!("{:>22}", "-");
    let row = |label: String, name: &str| {
        let mut cells = vec![format!("{label:<width$}")];
        cells.extend(points().map(
            |((key_len, _), sector)| match f.get(name, key_len, sector) {
                Some((m, lo, hi)) => cell(m, lo, hi, format!("{:.0}", sector as f64 / m * 1e3)),
                None => dash(),
            },
        ));
        cells
    };
    for c in &f.candidates {
        t.row(row(label(c), c.name()));
    }
    t.row(row(
        "openssl speed -evp (reference)".into(),
        "openssl-speed",
    ));
    let mut ecb = vec![format!("{:<width$}", "aes 0.9 ECB, AES alone (reference)")];
    for &(key_len, _) in &KEYS {
        let c = match f.get("aes-ecb", key_len, 0) {
            Some((m, lo, hi)) => cell(m, lo, hi, "-".into()),
            None => dash(),
        };
        // ECB has no sectors: the one figure stands in both columns.
        ecb.extend([c.clone(), c]);
    }
    t.row(ecb);
    notes(f, &mut t);
    t
}

/// The lines under the table: what is missing, what the cells are, the
/// target and the choice.
fn notes(f: &Figures, t: &mut Table) {
    for (name, why) in &f.unavailable {
        t.line(format!("{name}: unavailable - {why}"));
    }
    if let Some(why) = &f.speed_failed {
        t.line(format!("openssl speed: unavailable - {why}"));
    }
    t.line("cells: median MB/s, min-max MB/s, ns per sector; aes-128-xts takes a 32-byte (256-bit) XTS key, aes-256-xts a 64-byte (512-bit) one");
    t.line("openssl speed encrypts one buffer of the sector size per call with the IV set once (no per-sector IV); the candidates set each sector's IV");
    t.line(match f.ratio() {
        Some(r) => format!(
            "target: {} >= openssl speed -evp aes-256-xts -bytes 4096: {:.0} vs {:.0} MB/s, ratio {r:.2} ({})",
            f.chosen.name(),
            f.chosen_mb_s().unwrap_or(0.0),
            f.speed_mb_s().unwrap_or(0.0),
            met(r >= TARGET_MIN_RATIO)
        ),
        None => "target: no openssl speed figure, so no ratio (NOT met)".into(),
    });
    t.line(format!(
        "chosen: {} (XtsBackend::default() on this CPU); fastest measured at 512-bit key, 4096-byte sectors: {}",
        f.chosen.name(),
        f.fastest().unwrap_or("-")
    ));
}

/// One cell of the report: MB/s median and range, ns per sector.
#[derive(Serialize)]
struct Cell {
    mb_s: f64,
    mb_s_min: f64,
    mb_s_max: f64,
    ns_per_sector: f64,
}

/// Cipher name → sector size → figure.
type ByKey<T> = BTreeMap<&'static str, BTreeMap<String, T>>;

/// `f` at every key and sector size where it gives a figure.
fn by_key<T>(f: impl Fn(usize, usize) -> Option<T>) -> ByKey<T> {
    KEYS.iter()
        .map(|&(key_len, cipher)| {
            let per = SECTORS
                .iter()
                .filter_map(|&s| f(key_len, s).map(|v| (s.to_string(), v)))
                .collect();
            (cipher, per)
        })
        .collect()
}

#[derive(Serialize)]
struct Body<'a> {
    summary: Value,
    samples_mb_s: &'a Samples,
    /// The page part ([`crate::xts_pages`]).
    pages: Value,
}

fn summary(f: &Figures) -> Value {
    let mut cands = serde_json::Map::new();
    for c in &f.candidates {
        let cells = by_key(|k, s| {
            f.get(c.name(), k, s).map(|(m, lo, hi)| Cell {
                mb_s: round2(m),
                mb_s_min: round2(lo),
                mb_s_max: round2(hi),
                ns_per_sector: round2(s as f64 / m * 1e3),
            })
        });
        let mut v = json!(cells);
        v["what"] = json!(c.describe());
        cands.insert(c.name().to_string(), v);
    }
    for (name, why) in &f.unavailable {
        cands.insert(name.clone(), json!({ "unavailable": why }));
    }
    let speed = match &f.speed_failed {
        Some(why) => json!({ "unavailable": why }),
        None => json!(by_key(|k, s| f
            .get("openssl-speed", k, s)
            .map(|v| round2(v.0)))),
    };
    let ecb: BTreeMap<String, f64> = KEYS
        .iter()
        .filter_map(|&(k, cipher)| {
            f.get("aes-ecb", k, 0)
                .map(|v| (cipher.replace("-xts", "-ecb"), round2(v.0)))
        })
        .collect();
    let ratio = f.ratio();
    json!({
        "candidates": cands,
        "openssl_speed_mb_s": speed,
        "aes_crate_ecb_mb_s": ecb,
        "chosen": f.chosen.name(),
        "fastest_at_target_point": f.fastest(),
        "chosen_mb_s": f.chosen_mb_s().map(round2),
        "chosen_vs_openssl_speed": ratio.map(round2),
        "target_point": "aes-256-xts (512-bit key), 4096-byte sectors",
        "target_min_ratio": TARGET_MIN_RATIO,
        "target_met": ratio.is_some_and(|r| r >= TARGET_MIN_RATIO),
        "cpu_features": cpu_features(),
    })
}

/// MB/s by sector size at a 512-bit key: each candidate and openssl speed.
fn series(f: &Figures) -> Vec<Series> {
    // The plot's x axis starts at 1: sector sizes in 512-byte units.
    let x_of = |sector: usize| (sector / 512) as f64;
    let line = |label: String, name: &str| Series {
        label,
        points: SECTORS
            .iter()
            .filter_map(|&s| f.get(name, TARGET_KEY, s).map(|v| (x_of(s), v.0)))
            .collect(),
    };
    let mut series: Vec<Series> = f
        .candidates
        .iter()
        .map(|c| line(format!("{} ({})", c.name(), c.describe()), c.name()))
        .collect();
    series.push(line(
        "openssl speed -evp aes-256-xts (IV set once)".into(),
        "openssl-speed",
    ));
    series.retain(|s| !s.points.is_empty());
    series
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_openssl_speed_table() {
        let out = "version: 3.0.19\nbuilt on: ...\nThe 'numbers' are in 1000s of bytes per second processed.\ntype           4096 bytes\nAES-256-XTS    5405914.76k\n";
        assert_eq!(parse_openssl_speed(out, "aes-256-xts"), Some(5405.91476));
        assert_eq!(parse_openssl_speed(out, "aes-128-xts"), None);
        assert_eq!(parse_openssl_speed("", "aes-256-xts"), None);
    }
}
