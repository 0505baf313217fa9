//! fio for E6: the job lines of each load and of the read-back check, a
//! run of fio, and what its JSON report says.
//!
//! Owns: the loads' shapes (`SEQ_DEPTH`, `RAND_DEPTH`, `RAND_JOBS`), the
//! read-back region (`VERIFY_BYTES`), [`Plan`] (export size and run time
//! → fio's arguments), [`parse_fio`] and [`fio`]. Must never: take a
//! figure from a report whose job failed — a job's error is an error.

use super::load::Load;
use iopages_tools::{run_tool, tail_lines};
use serde_json::{json, Value};
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

/// Sequential loads: 1 MiB requests, 16 in flight, one connection.
pub(crate) const SEQ_DEPTH: u32 = 16;

/// Random load: 4 KiB, 50 % reads, 32 in flight on each of 2 connections.
pub(crate) const RAND_DEPTH: u32 = 32;

pub(crate) const RAND_JOBS: u32 = 2;

/// The region at the end of the export each server writes with fio's
/// verify headers for the next server to check.
pub(crate) const VERIFY_BYTES: u64 = 16 << 20;

/// What fio's JSON report says about one invocation, summed over its jobs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FioFigures {
    /// Jobs in the report.
    pub jobs: usize,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Read bandwidth, bytes per second.
    pub read_bw: f64,
    /// Write bandwidth, bytes per second.
    pub write_bw: f64,
    /// Read requests per second.
    pub read_iops: f64,
    /// Write requests per second.
    pub write_iops: f64,
}

/// Parse fio's `--output-format=json` output. Lines before the JSON (the nbd
/// engine prints "fio: connected to NBD server" on stdout) and text after it
/// are skipped. A job with a non-zero `error` is an error, never a figure.
pub fn parse_fio(stdout: &str) -> Result<FioFigures, String> {
    let start = stdout
        .find("\n{")
        .map(|i| i + 1)
        .or_else(|| stdout.starts_with('{').then_some(0))
        .ok_or_else(|| "no JSON report in fio's output".to_string())?;
    let v: Value = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter::<Value>()
        .next()
        .ok_or_else(|| "empty JSON report from fio".to_string())?
        .map_err(|e| format!("fio's JSON report does not parse: {e}"))?;
    let jobs = v["jobs"]
        .as_array()
        .filter(|j| !j.is_empty())
        .ok_or_else(|| "fio's JSON report has no jobs".to_string())?;
    let mut f = FioFigures {
        jobs: jobs.len(),
        ..FioFigures::default()
    };
    for job in jobs {
        let name = job["jobname"].as_str().unwrap_or("?");
        let err = job["error"]
            .as_i64()
            .ok_or_else(|| format!("fio job {name} has no error field"))?;
        if err != 0 {
            // An errno, or -1 (printed as unsigned) for the engine's own.
            let code = err as i32;
            let what = if code > 0 {
                format!(" ({})", std::io::Error::from_raw_os_error(code))
            } else {
                String::new()
            };
            return Err(format!("fio job {name} failed: error {code}{what}"));
        }
        let num = |dir: &str, k: &str| job[dir][k].as_f64().unwrap_or(0.0);
        f.read_bytes += num("read", "io_bytes") as u64;
        f.write_bytes += num("write", "io_bytes") as u64;
        f.read_bw += num("read", "bw_bytes");
        f.write_bw += num("write", "bw_bytes");
        f.read_iops += num("read", "iops");
        f.write_iops += num("write", "iops");
    }
    Ok(f)
}

/// Settings of the loads.
pub(crate) struct Plan {
    /// Export size, bytes.
    pub(crate) dev: u64,
    /// Each timed fio job's run time, ms.
    pub(crate) fio_ms: u64,
}

impl Plan {
    /// The report's `fio` settings: the engine, the seconds per load and
    /// the loads' shapes (`conns`: each job is a connection; `whole`: what
    /// the sequential loads cover).
    pub(crate) fn settings(&self, conns: bool, whole: &str) -> Value {
        let (one, jobs) = if conns {
            (" (1 connection)", " (connections)")
        } else {
            ("", "")
        };
        json!({
            "engine": "nbd (libnbd)",
            "seconds_per_load": self.fio_ms as f64 / 1000.0,
            "seq": format!("1 MiB, iodepth {SEQ_DEPTH}, 1 job{one}, time based over the whole {whole}"),
            "randrw": format!("4 KiB, 50 % reads, iodepth {RAND_DEPTH}, {RAND_JOBS} jobs{jobs}, time based"),
        })
    }

    /// What every fio job of E6 starts with: JSON out, threads, the nbd
    /// engine on `uri`, the job's name.
    fn fio_common(uri: &str, name: &str) -> Vec<String> {
        vec![
            "--output-format=json".to_string(),
            "--eta=never".into(),
            "--thread".into(),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            format!("--name=e6-{name}"),
        ]
    }

    pub(crate) fn fio_args(&self, uri: &str, load: Load) -> Vec<OsString> {
        let mut a = Self::fio_common(uri, load.key());
        a.extend([
            format!("--size={}", self.dev),
            "--group_reporting".into(),
            "--time_based".into(),
            format!("--runtime={}ms", self.fio_ms),
        ]);
        match load {
            Load::SeqWrite | Load::SeqRead => a.extend([
                format!(
                    "--rw={}",
                    if load == Load::SeqWrite {
                        "write"
                    } else {
                        "read"
                    }
                ),
                "--bs=1M".into(),
                format!("--iodepth={SEQ_DEPTH}"),
                "--numjobs=1".into(),
            ]),
            _ => a.extend([
                "--rw=randrw".into(),
                "--rwmixread=50".into(),
                "--bs=4k".into(),
                format!("--iodepth={RAND_DEPTH}"),
                format!("--numjobs={RAND_JOBS}"),
            ]),
        }
        a.into_iter().map(OsString::from).collect()
    }

    /// The read-back job: 64 KiB writes with crc32c verify headers over the
    /// last `VERIFY_BYTES` of the export, read back and checked; with
    /// `only`, the check alone (of what an earlier run of the job wrote,
    /// through another server).
    pub(crate) fn verify_args(&self, uri: &str, only: bool) -> Vec<OsString> {
        let mut a = Self::fio_common(uri, "verify");
        a.extend([
            "--rw=write".into(),
            "--bs=64k".into(),
            "--iodepth=8".into(),
            format!("--offset={}", self.dev - VERIFY_BYTES),
            format!("--size={VERIFY_BYTES}"),
            "--verify=crc32c".into(),
            "--do_verify=1".into(),
            "--verify_fatal=1".into(),
            "--verify_state_save=0".into(),
            "--randrepeat=1".into(),
        ]);
        if only {
            a.push("--verify_only".into());
        }
        a.into_iter().map(OsString::from).collect()
    }
}

/// fio over the verify region at the end of the export at `uri` (see
/// [`Plan::verify_args`]): write it with verify headers, or (`only`) check
/// what another server wrote there. **Returns:** an error unless fio ran
/// and covered the whole region.
pub(crate) fn verify_region(
    fio_bin: &Path,
    dir: &Path,
    home: Option<&Path>,
    plan: &Plan,
    uri: &str,
    only: bool,
) -> Result<(), String> {
    let v = fio(fio_bin, dir, home, plan.verify_args(uri, only), 10_000)?;
    (v.read_bytes == VERIFY_BYTES)
        .then_some(())
        .ok_or(format!("checked {} of {VERIFY_BYTES} bytes", v.read_bytes))
}

/// Run fio (with `HOME` at `home` where given), check its exit status and
/// every job's error field.
pub(crate) fn fio(
    fio: &Path,
    dir: &Path,
    home: Option<&Path>,
    args: Vec<OsString>,
    ms: u64,
) -> Result<FioFigures, String> {
    let env: Vec<(&str, &Path)> = home.map(|h| ("HOME", h)).into_iter().collect();
    let r = run_tool(fio, &args, dir, Duration::from_millis(ms + 120_000), &env)?;
    let parsed = parse_fio(&r.stdout);
    match (r.status.success(), parsed) {
        (true, Ok(f)) => Ok(f),
        (_, Err(e)) => Err(format!(
            "{e}; fio {}; stderr: {}",
            r.status,
            tail_lines(&r.stderr)
        )),
        (false, Ok(_)) => Err(format!(
            "fio {}; stderr: {}",
            r.status,
            tail_lines(&r.stderr)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_say_the_loads_shapes() {
        let p = Plan {
            dev: 0,
            fio_ms: 2500,
        };
        let v = p.settings(false, "volume");
        assert_eq!(v["engine"], "nbd (libnbd)");
        assert_eq!(v["seconds_per_load"], 2.5);
        assert_eq!(
            v["seq"],
            format!("1 MiB, iodepth {SEQ_DEPTH}, 1 job, time based over the whole volume")
        );
        assert_eq!(
            v["randrw"],
            format!("4 KiB, 50 % reads, iodepth {RAND_DEPTH}, {RAND_JOBS} jobs, time based")
        );
        let v = p.settings(true, "export");
        assert_eq!(
            v["seq"],
            format!("1 MiB, iodepth {SEQ_DEPTH}, 1 job (1 connection), time based over the whole export")
        );
        assert_eq!(
            v["randrw"],
            format!("4 KiB, 50 % reads, iodepth {RAND_DEPTH}, {RAND_JOBS} jobs (connections), time based")
        );
    }

    /// fio 3.33 with the nbd engine against nbdkit's luks filter, randrw
    /// 4 KiB, 2 jobs, group_reporting (trimmed to the fields read; the
    /// engine's line comes first on stdout).
    const RANDRW: &str = r#"fio: connected to NBD server
{
  "fio version" : "fio-3.33",
  "timestamp" : 1795397131,
  "jobs" : [
    {
      "jobname" : "rr",
      "groupid" : 0,
      "error" : 0,
      "job options" : { "name" : "rr", "ioengine" : "nbd", "rw" : "randrw", "bs" : "4k", "iodepth" : "32", "numjobs" : "2" },
      "job_runtime" : 6006,
      "read" : { "io_bytes" : 188854272, "bw_bytes" : 62825772, "bw" : 61353, "iops" : 15338.323353, "runtime" : 3006, "total_ios" : 46107, "short_ios" : 0, "drop_ios" : 0 },
      "write" : { "io_bytes" : 189145088, "bw_bytes" : 62922517, "bw" : 61447, "iops" : 15361.942781, "runtime" : 3006, "total_ios" : 46178, "short_ios" : 0, "drop_ios" : 0 },
      "trim" : { "io_bytes" : 0, "bw_bytes" : 0, "bw" : 0, "iops" : 0.0, "runtime" : 0, "total_ios" : 0, "short_ios" : 0, "drop_ios" : 0 }
    }
  ]
}
"#;

    /// fio verify_only over data another server had overwritten: error 84
    /// (EILSEQ) in the job.
    const VERIFY_FAILED: &str = r#"fio: connected to NBD server
{
  "fio version" : "fio-3.33",
  "jobs" : [
    {
      "jobname" : "verify",
      "groupid" : 0,
      "error" : 84,
      "read" : { "io_bytes" : 524288, "bw_bytes" : 174762666, "iops" : 2666.666667 },
      "write" : { "io_bytes" : 16777216, "bw_bytes" : 0, "iops" : 0.0 }
    }
  ]
}
"#;

    #[test]
    fn parses_fio_randrw() {
        let f = parse_fio(RANDRW).unwrap();
        assert_eq!(f.jobs, 1);
        assert_eq!(f.read_bytes, 188_854_272);
        assert_eq!(f.write_bytes, 189_145_088);
        assert_eq!(f.read_bw, 62_825_772.0);
        assert_eq!(f.write_bw, 62_922_517.0);
        assert!((f.read_iops + f.write_iops - 30_700.266_134).abs() < 1e-3);
    }

    #[test]
    fn sums_jobs_without_group_reporting() {
        let two = r#"{"jobs": [
            {"jobname": "a", "error": 0, "read": {"io_bytes": 0, "bw_bytes": 0, "iops": 0.0},
             "write": {"io_bytes": 1048576, "bw_bytes": 1000, "iops": 10.5}},
            {"jobname": "a", "error": 0, "read": {"io_bytes": 0, "bw_bytes": 0, "iops": 0.0},
             "write": {"io_bytes": 2097152, "bw_bytes": 3000, "iops": 20.0}}
        ]}"#;
        let f = parse_fio(two).unwrap();
        assert_eq!(f.jobs, 2);
        assert_eq!(f.write_bytes, 3 << 20);
        assert_eq!(f.write_bw, 4000.0);
        assert_eq!(f.write_iops, 30.5);
        assert_eq!(f.read_bytes, 0);
    }

    #[test]
    fn job_error_is_an_error() {
        let e = parse_fio(VERIFY_FAILED).unwrap_err();
        assert!(e.contains("error 84"), "{e}");
        assert!(e.contains("verify"), "{e}");
    }

    #[test]
    fn engine_error_is_an_error() {
        // A server that dropped the connection: libnbd's error comes as -1,
        // printed unsigned.
        let dead = r#"{"jobs": [{"jobname": "e6-seq_read", "error": 4294967295,
            "read": {"io_bytes": 1048576, "bw_bytes": 5, "iops": 1.0}}]}"#;
        let e = parse_fio(dead).unwrap_err();
        assert!(e.contains("e6-seq_read failed: error -1"), "{e}");
    }

    #[test]
    fn missing_or_broken_reports_are_errors() {
        assert!(parse_fio("fio: engine nbd not loadable\n").is_err());
        assert!(parse_fio("{\"jobs\": []}").is_err());
        assert!(parse_fio("{\"jobs\": [{\"jobname\": \"x\"}]}").is_err());
        assert!(parse_fio("fio: connected\n{\"jobs\": [").is_err());
    }
}
