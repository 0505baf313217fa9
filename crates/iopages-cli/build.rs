//! Build script of the `iopages` binary: what `iopages --version` says
//! about the build.
//!
//! Owns: the environment variables `IOPAGES_BUILD_COMMIT` (the git commit
//! the binary was built from, 12 hex digits with `-dirty` after it when
//! tracked files differ from it, or `built outside a git checkout`) and
//! `IOPAGES_BUILD_RUSTC` (`rustc --version`) and `IOPAGES_BUILD_DATE`
//! (the manual pages' date), and the files whose change reruns it. Must never: fail the build — no git, no checkout, no
//! rustc answer each give a sentence instead of a value — or rerun on
//! every build: it watches the checkout's `HEAD`, the branch it points
//! at, the index and this crate's sources, not the clock.
//!
//! A crate unpacked from a `.crate` file (`cargo package`) carries
//! `.cargo_vcs_info.json`: such a build is outside a checkout even when
//! some other repository encloses it (a packaging tree), and the commit
//! it was packaged from is named from that file.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Longest `git` answer used (a commit, a path): more is not git's.
const MAX_ANSWER_BYTES: usize = 4096;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    let commit = match packaged_commit(&manifest) {
        Some(text) => text,
        None => {
            checkout_commit(&manifest).unwrap_or_else(|| "built outside a git checkout".to_string())
        }
    };
    println!("cargo:rustc-env=IOPAGES_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=IOPAGES_BUILD_RUSTC={}", rustc_version());
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    println!(
        "cargo:rustc-env=IOPAGES_BUILD_DATE={}",
        build_date(&manifest)
    );
}

/// The manual pages' date, `YYYY-MM-DD`: `SOURCE_DATE_EPOCH` where the
/// packager sets it (reproducible builds), else the commit's date, else
/// today's.
fn build_date(manifest: &Path) -> String {
    let epoch = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .or_else(|| git(manifest, &["log", "-1", "--format=%ct", "HEAD"]))
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
    civil_date(epoch / 86_400)
}

/// `YYYY-MM-DD` of the day `days` after 1970-01-01 (Gregorian calendar;
/// a date past 9999 stays in 9999).
fn civil_date(mut days: u64) -> String {
    let leap = |y: u64| (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400);
    let mut year = 1970;
    while year < 9999 && days >= 365 + u64::from(leap(year)) {
        days -= 365 + u64::from(leap(year));
        year += 1;
    }
    let february = 28 + u64::from(leap(year));
    let lengths = [31, february, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    let mut month = 1;
    for len in lengths {
        if days < len || month == 12 {
            break;
        }
        days -= len;
        month += 1;
    }
    format!("{year:04}-{month:02}-{:02}", (days + 1).min(31))
}

/// The answer of `git ARGS` run in `dir`, trimmed; `None` when git is
/// missing, fails or answers nothing.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_OPTIONAL_LOCKS", "0")
        .output()
        .ok()?;
    if !out.status.success() || out.stdout.len() > MAX_ANSWER_BYTES {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

/// The commit of the checkout around `manifest`, `-dirty` marked, after
/// telling cargo which of its files to watch; `None` outside one.
fn checkout_commit(manifest: &Path) -> Option<String> {
    let commit = git(manifest, &["rev-parse", "--short=12", "HEAD"])
        .filter(|c| c.len() >= 12 && c.bytes().all(|b| b.is_ascii_hexdigit()))?;
    watch_checkout(manifest);
    // Tracked files only, as `git describe --dirty`: an untracked
    // scratch file does not make the build another one.
    let dirty = git(manifest, &["status", "--porcelain", "--untracked-files=no"]).is_some();
    Some(if dirty {
        format!("{commit}-dirty")
    } else {
        commit
    })
}

/// Rerun when `HEAD` moves (a checkout), when the branch it names moves
/// (a commit) or the index changes (`git add`, a checkout's files).
fn watch_checkout(manifest: &Path) {
    let absolute = |p: String| {
        let p = PathBuf::from(p);
        if p.is_absolute() {
            p
        } else {
            manifest.join(p)
        }
    };
    // In a worktree HEAD and the index are its own; branches live in the
    // common directory.
    let Some(git_dir) = git(manifest, &["rev-parse", "--git-dir"]).map(absolute) else {
        return;
    };
    let common =
        git(manifest, &["rev-parse", "--git-common-dir"]).map_or(git_dir.clone(), absolute);
    watch(&git_dir.join("HEAD"));
    watch(&git_dir.join("index"));
    if let Some(branch) = git(manifest, &["symbolic-ref", "-q", "HEAD"]) {
        let loose = common.join(&branch);
        // A packed branch has no file of its own; cargo would rerun on
        // every build for a missing one.
        if loose.is_file() {
            watch(&loose);
        } else {
            watch(&common.join("packed-refs"));
        }
    }
}

/// `cargo:rerun-if-changed` for `path`, where it exists.
fn watch(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// For a crate unpacked from a `.crate` file: `built outside a git
/// checkout`, with the commit it was packaged from where cargo recorded
/// one. `None` for sources that are not a packaged crate.
fn packaged_commit(manifest: &Path) -> Option<String> {
    let info = std::fs::read_to_string(manifest.join(".cargo_vcs_info.json")).ok()?;
    // `"sha1": "<40 hex>"`, read without a JSON parser.
    let sha = info
        .split_once("\"sha1\"")
        .and_then(|(_, rest)| rest.split('"').nth(1))
        .filter(|s| s.len() >= 12 && s.bytes().all(|b| b.is_ascii_hexdigit()));
    Some(match sha {
        Some(s) => format!("built outside a git checkout (packaged from {})", &s[..12]),
        None => "built outside a git checkout".to_string(),
    })
}

/// `rustc --version` of the compiler cargo uses, or a sentence.
fn rustc_version() -> String {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty() && !s.contains('\n'))
        .unwrap_or_else(|| "unknown (rustc --version gave no answer)".to_string())
}
