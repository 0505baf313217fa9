//! Key changes on a served volume (`iopages bench keys`): what rotating
//! passphrases costs the clients of `iopages serve`, and what a key slot
//! `iopages luks add-key` makes costs an attacker.
//!
//! Row 1: a LUKS2 volume on a file, served by `iopages serve`; fio's nbd
//! engine runs E6's random load (4 KiB randrw, 2 jobs × queue depth 32)
//! for a fixed time, once alone and once while 20 `iopages luks change-key`
//! run back to back (`--iter-time 100 --parallel 1`, the passphrase going
//! back and forth between two). The change-keys' own CPU time (each one's
//! rusage from `wait4`) over the window's CPU capacity (wall × CPUs) is the
//! KDF's share; target: IOPS with ≥ (1 − share − 0.1) × IOPS without,
//! measured side by side in this run.
//!
//! Row 2: a cryptsetup-made LUKS2 volume gets one slot from `cryptsetup
//! luksAddKey` and one from `iopages luks add-key`, both with defaults;
//! `cryptsetup open --test-passphrase --key-slot N` times each (3 runs
//! each, alternating): target ours ≥ 0.75 × cryptsetup's.
//!
//! Owns: its work directory, the server it starts (stopped and reaped on
//! every path), `keys.json`. Must never: leave a child process behind.

use crate::e6::common::os;
use crate::e6::files::work_dirs;
use crate::e6::remote::start;
use crate::harness::{Report, Table};
use crate::measure::median;
use crate::{progress, round2, BenchError, BenchOptions};
use iopages_tools::{find_tool, run_tool, Ran};
use serde::Serialize;
use serde_json::Value;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Back-to-back key changes in row 1.
const CHANGES: usize = 20;
/// What the clients may lose beyond the KDF's CPU share.
const SLACK: f64 = 0.1;
/// Row 2: ours over cryptsetup's unlock time, at least.
const UNLOCK_TARGET: f64 = 0.75;

fn workload(e: impl std::fmt::Display) -> BenchError {
    BenchError::Workload(format!("keys: {e}"))
}

struct Setup {
    work: PathBuf,
    iopages: PathBuf,
    fio: PathBuf,
    cryptsetup: Option<PathBuf>,
    sock: PathBuf,
}

impl Setup {
    fn run(&self, prog: &Path, args: Vec<OsString>, what: &str) -> Result<Ran, BenchError> {
        let r =
            run_tool(prog, &args, &self.work, Duration::from_secs(600), &[]).map_err(workload)?;
        if !r.status.success() {
            return Err(workload(format!("{what} failed: {}", r.stderr.trim())));
        }
        Ok(r)
    }

    fn pass(&self, name: &str, text: &str) -> Result<PathBuf, BenchError> {
        let p = self.work.join(name);
        std::fs::write(&p, text).map_err(|e| workload(format!("{}: {e}", p.display())))?;
        Ok(p)
    }

    /// fio's E6 random load for `secs` through the server: its IOPS.
    fn fio(&self, secs: f64) -> Result<f64, BenchError> {
        let args = os(&[
            &"--name=keys",
            &"--ioengine=nbd",
            &"--rw=randrw",
            &"--bs=4k",
            &"--iodepth=32",
            &"--numjobs=2",
            &"--group_reporting",
            &"--size=128M",
            &"--time_based",
            &format!("--runtime={:.1}", secs.max(1.0)),
            &"--output-format=json",
            &format!("--uri=nbd+unix:///iopages?socket={}", self.sock.display()),
        ]);
        let r = self.run(&self.fio, args, "fio")?;
        let at = r
            .stdout
            .find('{')
            .ok_or_else(|| workload("fio printed no report"))?;
        let v: Value = serde_json::from_str(&r.stdout[at..]).map_err(workload)?;
        let j = &v["jobs"][0];
        Ok(j["read"]["iops"].as_f64().unwrap_or(0.0) + j["write"]["iops"].as_f64().unwrap_or(0.0))
    }
}

/// Run `prog args` in `dir` to completion.
///
/// **Returns:** its own CPU seconds (user and system, from `wait4`: only
/// this process's, whatever else ends meanwhile); its stderr when it fails.
fn run_cpu(prog: &Path, args: &[OsString], dir: &Path) -> Result<f64, BenchError> {
    let err = dir.join("change-key.err");
    let log = std::fs::File::create(&err).map_err(workload)?;
    let child = Command::new(prog)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| workload(format!("cannot start {}: {e}", prog.display())))?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: rusage is plain data; zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is our own child, not reaped yet; `status` and
        // `ru` are live locals of the types wait4 fills.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(workload(format!("wait4: {e}")));
        }
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        let said = std::fs::read_to_string(&err).unwrap_or_default();
        return Err(workload(format!(
            "iopages luks change-key failed: {}",
            said.trim()
        )));
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    Ok(t(ru.ru_utime) + t(ru.ru_stime))
}

/// `CHANGES` change-keys back to back: their wall seconds and CPU seconds.
fn rotate(st: &Setup, image: &Path, a: &Path, b: &Path) -> Result<(f64, f64), BenchError> {
    let mut cpu = 0.0;
    let t = std::time::Instant::now();
    for i in 0..CHANGES {
        let (old, new) = if i % 2 == 0 { (a, b) } else { (b, a) };
        let args = os(&[
            &"luks",
            &"change-key",
            &image,
            &"--passphrase-file",
            &old,
            &"--new-passphrase-file",
            &new,
            &"--iter-time",
            &"100",
            &"--parallel",
            &"1",
        ]);
        cpu += run_cpu(&st.iopages, &args, &st.work)?;
    }
    Ok((t.elapsed().as_secs_f64(), cpu))
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Served {
    pub changes: usize,
    pub rotation_s: f64,
    pub kdf_cpu_s: f64,
    pub cpus: usize,
    /// The change-keys' CPU over the window's capacity.
    pub kdf_share: f64,
    /// The share is a fraction of the CPUs: at most 1, else the figure
    /// is wrong (and the row fails).
    pub share_within_bound: bool,
    pub iops_alone: f64,
    pub iops_rotating: f64,
    pub ratio: f64,
    pub target: f64,
    pub met: bool,
}

/// Row 1.
fn served_row(st: &Setup) -> Result<Served, BenchError> {
    let image = st.work.join("served.luks");
    let a = st.pass("a.pass", "keys bench first")?;
    let b = st.pass("b.pass", "keys bench second")?;
    let fmt = os(&[
        &"luks",
        &"format",
        &"--pbkdf",
        &"pbkdf2",
        &"--iterations",
        &"1000",
        &"--size",
        &"256M",
        &"--passphrase-file",
        &a,
        &image,
    ]);
    st.run(&st.iopages, fmt, "iopages luks format")?;
    progress("keys", "timing 20 change-keys alone");
    let (dry, _) = rotate(st, &image, &a, &b)?;
    let mut cmd = Command::new(&st.iopages);
    cmd.args(["serve", "--arena", "256M", "--image"])
        .arg(&image)
        .arg("--passphrase-file")
        .arg(&a)
        .arg("--unix")
        .arg(&st.sock);
    let (server, _) = start("iopages serve", "serve", cmd, &st.sock, &st.work).map_err(workload)?;
    let served = (|| {
        progress("keys", format!("fio alone for {dry:.1} s"));
        let alone = st.fio(dry)?;
        progress("keys", "fio while 20 change-keys run");
        let fio = std::thread::scope(|s| {
            let h = s.spawn(|| st.fio(dry));
            let rot = rotate(st, &image, &a, &b);
            (h.join().expect("the fio thread"), rot)
        });
        let (rotating, (wall, cpu)) = (fio.0?, fio.1?);
        Ok::<_, BenchError>((alone, rotating, wall, cpu))
    })();
    drop(server);
    let (alone, rotating, wall, cpu) = served?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = cpu / (wall * cpus as f64);
    let ratio = rotating / alone.max(1.0);
    let target = 1.0 - share - SLACK;
    Ok(Served {
        changes: CHANGES,
        rotation_s: round2(wall),
        kdf_cpu_s: round2(cpu),
        cpus,
        kdf_share: round2(share),
        share_within_bound: share <= 1.0,
        iops_alone: alone.round(),
        iops_rotating: rotating.round(),
        ratio: round2(ratio),
        target: round2(target),
        met: ratio >= target && share <= 1.0,
    })
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Unlock {
    pub cryptsetup_s: Vec<f64>,
    pub ours_s: Vec<f64>,
    pub ratio: f64,
    pub met: bool,
}

/// Row 2 (needs cryptsetup).
fn unlock_row(st: &Setup, cs: &Path) -> Result<Unlock, BenchError> {
    let image = st.work.join("unlock.luks");
    let f = std::fs::File::create(&image).map_err(workload)?;
    f.set_len(32 << 20).map_err(workload)?;
    let p0 = st.pass("p0.pass", "unlock zero")?;
    let p1 = st.pass("p1.pass", "unlock cryptsetup")?;
    let p2 = st.pass("p2.pass", "unlock iopages")?;
    let cheap = os(&[
        &"luksFormat",
        &"--batch-mode",
        &"--type",
        &"luks2",
        &"--pbkdf",
        &"pbkdf2",
        &"--pbkdf-force-iterations",
        &"1000",
        &"--key-file",
        &p0,
        &image,
    ]);
    st.run(cs, cheap, "cryptsetup luksFormat")?;
    progress(
        "keys",
        "a slot by cryptsetup luksAddKey and one by iopages luks add-key, defaults",
    );
    let add = os(&[
        &"luksAddKey",
        &"--batch-mode",
        &"--key-file",
        &p0,
        &image,
        &p1,
    ]);
    st.run(cs, add, "cryptsetup luksAddKey")?;
    let ours = os(&[
        &"luks",
        &"add-key",
        &image,
        &"--passphrase-file",
        &p0,
        &"--new-passphrase-file",
        &p2,
    ]);
    st.run(&st.iopages, ours, "iopages luks add-key")?;
    let time = |slot: &str, key: &Path| -> Result<f64, BenchError> {
        let args = os(&[
            &"open",
            &"--test-passphrase",
            &"--key-slot",
            &slot,
            &"--key-file",
            &key,
            &image,
        ]);
        Ok(st.run(cs, args, "cryptsetup open --test-passphrase")?.secs)
    };
    let (mut theirs, mut ours) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        theirs.push(round2(time("1", &p1)?));
        ours.push(round2(time("2", &p2)?));
    }
    let ratio = median(&ours) / median(&theirs).max(1e-9);
    Ok(Unlock {
        cryptsetup_s: theirs,
        ours_s: ours,
        ratio: round2(ratio),
        met: ratio >= UNLOCK_TARGET,
    })
}

#[derive(Serialize)]
struct Body {
    served: Served,
    unlock: Option<Unlock>,
    unlock_skipped: Option<String>,
}

/// Run both rows.
///
/// **Returns:** the report; a workload error (skipped) without fio's nbd
/// engine.
pub fn run(opts: &BenchOptions, iopages_bin: &Path) -> Result<Value, BenchError> {
    let (json_path, _) = opts.paths("keys");
    let (work, socks, _dirs) = work_dirs(iopages_bin, &json_path, "keys")?;
    let st = Setup {
        iopages: iopages_bin.to_path_buf(),
        fio: find_tool("fio").ok_or_else(|| workload("skipped: fio is not installed"))?,
        cryptsetup: find_tool("cryptsetup"),
        sock: socks.join("keys.sock"),
        work,
    };
    let served = served_row(&st)?;
    let (unlock, unlock_skipped) = match &st.cryptsetup {
        Some(cs) => (Some(unlock_row(&st, cs)?), None),
        None => (None, Some("cryptsetup is not installed".to_string())),
    };
    let body = Body {
        served,
        unlock,
        unlock_skipped,
    };
    print(&body);
    #[derive(Serialize)]
    struct Settings {
        changes: usize,
        change_key: &'static str,
        fio: &'static str,
    }
    let settings = Settings {
        changes: CHANGES,
        change_key: "--iter-time 100 --parallel 1 (argon2id)",
        fio: "randrw 4k, 2 jobs x iodepth 32, nbd engine",
    };
    Report::new("keys", settings, body).emit(opts, &[])
}

fn print(b: &Body) {
    let s = &b.served;
    let mut t = Table::new("keys: key changes on a served volume, and the cost of a new key slot");
    t.line(format!(
        "served: {} change-keys in {:.1} s, KDF CPU {:.1} s of {} CPUs = share {:.2}; randrw {:.0} IOPS alone, {:.0} while rotating = {:.2} (target >= {:.2}: {})",
        s.changes, s.rotation_s, s.kdf_cpu_s, s.cpus, s.kdf_share, s.iops_alone, s.iops_rotating, s.ratio, s.target,
        if s.met { "met" } else { "NOT met" }
    ));
    match (&b.unlock, &b.unlock_skipped) {
        (Some(u), _) => t.line(format!(
            "unlock of a default slot: cryptsetup luksAddKey's {:?} s, iopages add-key's {:?} s: ours / cryptsetup {:.2} (target >= {UNLOCK_TARGET}: {})",
            u.cryptsetup_s, u.ours_s, u.ratio, if u.met { "met" } else { "NOT met" }
        )),
        (None, why) => t.line(format!("unlock row skipped: {}", why.as_deref().unwrap_or("?"))),
    };
    t.print();
}
