//! Child processes: servers under test or under load, and tools run to
//! completion.
//!
//! Owns: starting a child that dies with its parent, killing and reaping
//! it on every path (drop included), running a tool under a timeout with
//! its output collected, waiting for a server's Unix socket, and stopping
//! a server with SIGTERM then SIGKILL. Must never: leave a child running
//! or unreaped behind a returned error, or signal a process it did not
//! start.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Children of `cmd` get `sig` if the thread that started them goes away
/// without stopping them (a panicking test, a killed benchmark).
pub fn die_with_parent(cmd: &mut Command, sig: libc::c_int) {
    // SAFETY: prctl is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0);
            Ok(())
        });
    }
}

/// Send `sig` to `child`.
pub fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own, not yet reaped, child's id.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// Kills and reaps the child when dropped, unless it was reaped already.
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            signal(&self.0, libc::SIGKILL);
            let _ = self.0.wait();
        }
    }
}

/// SIGTERM to `child`, a wait of up to `timeout`, then SIGKILL.
///
/// **Context:** sleeps (10 ms steps) while it waits.
///
/// **Returns:** how it ended, in words ("… after SIGTERM", "killed: …",
/// "had exited before the stop: …").
pub fn stop(child: &mut Child, timeout: Duration) -> String {
    if let Ok(Some(s)) = child.try_wait() {
        return format!("had exited before the stop: {s}");
    }
    signal(child, libc::SIGTERM);
    let t = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return format!("{s} after SIGTERM"),
            Ok(None) if t.elapsed() < timeout => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                signal(child, libc::SIGKILL);
                let _ = child.wait();
                return format!(
                    "killed: still running {} s after SIGTERM",
                    timeout.as_secs()
                );
            }
        }
    }
}

/// Wait until `sock` takes connections, `alive` saying (Err) when the
/// server has exited first.
///
/// **Context:** sleeps (20 ms steps), at most `timeout`.
///
/// **Returns:** Err with `alive`'s reason, or with "did not listen" after
/// `timeout`; the caller stops the server.
pub fn wait_for_socket(
    sock: &Path,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<(), String>,
) -> Result<(), String> {
    let t = Instant::now();
    loop {
        alive()?;
        if std::os::unix::net::UnixStream::connect(sock).is_ok() {
            return Ok(());
        }
        if t.elapsed() > timeout {
            return Err(format!(
                "did not listen on {} within {} s",
                sock.display(),
                timeout.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Most bytes of a tool's stdout or stderr that [`run_tool`] keeps; the
/// rest is read and dropped (so the tool never blocks on a full pipe).
pub const MAX_TOOL_OUTPUT: u64 = 16 << 20;

/// A tool's run: its status, output and wall time.
#[derive(Debug)]
pub struct Ran {
    /// How it exited.
    pub status: ExitStatus,
    /// What it wrote to stdout (the first [`MAX_TOOL_OUTPUT`] bytes).
    pub stdout: String,
    /// What it wrote to stderr (likewise).
    pub stderr: String,
    /// Wall seconds from start to exit.
    pub secs: f64,
}

/// Run `program args` in `dir` to completion, with `env` added to its
/// environment, killing it after `timeout`.
///
/// **Context:** blocks; polls the child every millisecond (the wall time
/// is a benchmark figure) and reads its output on two threads.
///
/// **Returns:** Err if it cannot start, or did not finish in `timeout`
/// (then killed and reaped; the error carries its stderr's tail).
pub fn run_tool(
    program: &Path,
    args: &[OsString],
    dir: &Path,
    timeout: Duration,
    env: &[(&str, &Path)],
) -> Result<Ran, String> {
    let name = program.display().to_string();
    let mut cmd = Command::new(program);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd, libc::SIGKILL);
    let start = Instant::now();
    let mut child = Reaped(
        cmd.spawn()
            .map_err(|e| format!("could not start {name}: {e}"))?,
    );
    let out = read_output(child.0.stdout.take().map(|r| Box::new(r) as _));
    let err = read_output(child.0.stderr.take().map(|r| Box::new(r) as _));
    let status = loop {
        match child.0.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() > timeout => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => return Err(format!("cannot wait for {name}: {e}")),
        }
    };
    let secs = start.elapsed().as_secs_f64();
    if status.is_none() {
        signal(&child.0, libc::SIGKILL);
        let _ = child.0.wait();
    }
    let exited = status.is_some();
    let (stdout, stderr) = (output_of(out, exited), output_of(err, exited));
    match status {
        Some(status) => Ok(Ran {
            status,
            stdout,
            stderr,
            secs,
        }),
        None => Err(format!(
            "{name} did not finish in {} s (killed); stderr: {}",
            timeout.as_secs(),
            tail_lines(&stderr)
        )),
    }
}

/// A thread reading `r` to its end: the first [`MAX_TOOL_OUTPUT`] bytes
/// kept (as text), the rest read and dropped.
fn read_output(r: Option<Box<dyn Read + Send>>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut r) = r {
            let _ = (&mut r).take(MAX_TOOL_OUTPUT).read_to_end(&mut buf);
            let _ = std::io::copy(&mut r, &mut std::io::sink());
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// What the reader `h` read. A killed tool's child (`exited` false) may
/// still hold its pipes: give the reader a moment, then leave it (its
/// output is not needed for an error beyond what it has).
fn output_of(h: JoinHandle<String>, exited: bool) -> String {
    let done = exited || {
        let t = Instant::now();
        while !h.is_finished() && t.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(10));
        }
        h.is_finished()
    };
    if done {
        h.join().unwrap_or_default()
    } else {
        String::new()
    }
}

/// The last three non-empty lines of `s`, each cut at 200 characters,
/// joined with " | " (for one-line errors).
pub fn tail_lines(s: &str) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..]
        .iter()
        .map(|l| match l.char_indices().nth(200) {
            Some((i, _)) => format!("{}…", &l[..i]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// A child's stdout, line by line, read on a thread of its own.
pub fn lines_of(out: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_runs_to_completion_and_a_slow_one_is_killed() {
        let sh = Path::new("/bin/sh");
        let dir = std::env::temp_dir();
        let args = |s: &str| vec![OsString::from("-c"), OsString::from(s)];
        let r = run_tool(sh, &args("echo hi"), &dir, Duration::from_secs(10), &[]).unwrap();
        assert!(r.status.success());
        assert_eq!(r.stdout, "hi\n");
        let e = run_tool(sh, &args("sleep 5"), &dir, Duration::from_millis(100), &[]);
        assert!(e.unwrap_err().contains("did not finish"));
    }

    #[test]
    fn stop_ends_a_child_with_sigterm() {
        let mut c = Command::new("sleep").arg("30").spawn().unwrap();
        let how = stop(&mut c, Duration::from_secs(5));
        assert!(how.ends_with("after SIGTERM"), "{how}");
    }
}
