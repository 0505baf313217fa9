//! Builds the C test programs (tests/c/*.c) and the examples
//! (examples/c/*.c) with the system C compiler against the freshly built
//! libiopages, runs them, and checks their exit status and output; again
//! under AddressSanitizer where the compiler supports it.
//!
//! No C compiler: the tests say so and pass, except under `CI=true`, where
//! they fail.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn repo_root() -> PathBuf {
    manifest_dir().join("../..")
}

/// A directory holding libiopages.so and libiopages.a as C users see them
/// installed: links to the libiopages_ffi.so and libiopages_ffi.a that
/// [`build_c_libraries`] builds from the sources under test.
fn lib_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // Always built here, never taken from target/<profile>: `cargo
        // test` builds the crate's rlib only, so a libiopages_ffi.so there
        // is whatever an earlier `cargo build` left, possibly older than
        // the sources the tests should check.
        let built = build_c_libraries();
        let dir = out_dir().join("lib");
        std::fs::create_dir_all(&dir).unwrap();
        for (from, to) in [
            ("libiopages_ffi.so", "libiopages.so"),
            ("libiopages_ffi.a", "libiopages.a"),
        ] {
            let src = built.join(from);
            assert!(
                src.is_file(),
                "{} has no {from} (cargo build -p iopages-ffi made none)",
                built.display()
            );
            let dst = dir.join(to);
            let _ = std::fs::remove_file(&dst);
            std::os::unix::fs::symlink(&src, &dst).unwrap();
        }
        dir
    })
    .clone()
}

/// `cargo build -p iopages-ffi` into a target directory under the tests'
/// temporary directory; returns where the libraries are.
fn build_c_libraries() -> PathBuf {
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ffi-target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "-q", "-p", "iopages-ffi", "--manifest-path"])
        .arg(repo_root().join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .expect("run cargo build -p iopages-ffi");
    assert!(
        out.status.success(),
        "cargo build -p iopages-ffi failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    target.join("debug")
}

fn out_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("iopages-ffi-c");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The C compiler, or `None` (with a message) when there is none.
fn cc() -> Option<&'static str> {
    static CC: OnceLock<Option<&'static str>> = OnceLock::new();
    *CC.get_or_init(|| {
        let found = ["cc", "gcc", "clang"].into_iter().find(|c| {
            Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
        if found.is_none() {
            let ci = std::env::var("CI").is_ok_and(|v| v == "true");
            assert!(!ci, "no C compiler (cc, gcc, clang) on PATH, and CI=true");
            eprintln!("SKIPPED: no C compiler (cc, gcc, clang) on PATH");
        }
        found
    })
}

/// Whether `cc` builds and runs an AddressSanitizer program.
fn asan_works(cc: &str) -> bool {
    static ASAN: OnceLock<bool> = OnceLock::new();
    *ASAN.get_or_init(|| {
        let d = out_dir();
        let src = d.join("asan_probe.c");
        std::fs::write(
            &src,
            "#include <stdlib.h>\nint main(void){char*p=malloc(4);p[0]=0;free(p);return 0;}\n",
        )
        .unwrap();
        let exe = d.join("asan_probe");
        let built = Command::new(cc)
            .args(["-fsanitize=address", "-o"])
            .arg(&exe)
            .arg(&src)
            .status()
            .is_ok_and(|s| s.success());
        let ran = built && Command::new(&exe).status().is_ok_and(|s| s.success());
        if !ran {
            eprintln!("AddressSanitizer is not usable with {cc}: the ASan runs are skipped");
        }
        ran
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Link {
    Shared,
    Static,
}

/// Compile `src` into `name`; panics with the compiler's output on failure.
fn build(cc: &str, src: &Path, name: &str, link: Link, asan: bool) -> PathBuf {
    let lib = lib_dir();
    let exe = out_dir().join(name);
    let mut cmd = Command::new(cc);
    cmd.args(["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(manifest_dir().join("include"))
        .arg("-o")
        .arg(&exe)
        .arg(src);
    if asan {
        cmd.args(["-fsanitize=address", "-fno-omit-frame-pointer"]);
    }
    match link {
        Link::Shared => {
            cmd.arg("-L").arg(&lib).arg("-liopages");
            cmd.arg(format!("-Wl,-rpath,{}", lib.display()));
        }
        Link::Static => {
            cmd.arg(lib.join("libiopages.a"));
        }
    }
    cmd.args(["-lpthread", "-ldl", "-lm"]);
    let out = cmd.output().expect("run the C compiler");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// Run `exe`, assert exit 0 and that stdout contains `expect`.
fn run(exe: &Path, args: &[&str], asan: bool, expect: &str) -> String {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    // cargo puts its deps directory on LD_LIBRARY_PATH for tests, which the
    // loader searches before the program's RUNPATH: a stale libiopages.so
    // there would be loaded instead of the library under test.
    cmd.env_remove("LD_LIBRARY_PATH");
    if asan {
        // A Rust cdylib keeps thread-locals and lazily built globals alive
        // to the end of the process: LeakSanitizer would report them.
        cmd.env("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0");
    }
    let out = cmd.output().expect("run the C program");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} exited with {}:\n{stdout}{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(expect),
        "{}: no {expect:?} in:\n{stdout}",
        exe.display()
    );
    stdout
}

fn program(src: &Path, name: &str, args: &[&str], expect: &str) {
    let Some(cc) = cc() else { return };
    let exe = build(cc, src, name, Link::Shared, false);
    println!("{}", run(&exe, args, false, expect));
    if asan_works(cc) {
        let exe = build(cc, src, &format!("{name}-asan"), Link::Shared, true);
        println!("{}", run(&exe, args, true, expect));
    }
}

#[test]
fn every_call_and_its_error_paths() {
    program(&manifest_dir().join("tests/c/api.c"), "api", &[], "api: ok");
}

#[test]
fn the_static_library_links_alone() {
    let Some(cc) = cc() else { return };
    let exe = build(
        cc,
        &manifest_dir().join("tests/c/api.c"),
        "api-static",
        Link::Static,
        false,
    );
    run(&exe, &[], false, "api: ok");
}

#[test]
fn threads_allocate_free_and_count_at_once() {
    program(
        &manifest_dir().join("tests/c/threads.c"),
        "threads",
        &[],
        "threads: ok",
    );
}

#[test]
fn example_bulk_alloc() {
    program(
        &repo_root().join("examples/c/bulk_alloc.c"),
        "bulk_alloc",
        &[],
        "no leaks",
    );
}

#[test]
fn example_percpu_counter() {
    program(
        &repo_root().join("examples/c/percpu_counter.c"),
        "percpu_counter",
        &[],
        "percpu_counter: ok",
    );
}

#[test]
fn example_odirect_writer() {
    let dir = out_dir().join("odirect");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap().to_string();
    program(
        &repo_root().join("examples/c/odirect_writer.c"),
        "odirect_writer",
        &[&d],
        "0 bad pages",
    );
    // tmpfs refuses O_DIRECT: the fallback path.
    if Path::new("/dev/shm").is_dir() {
        program(
            &repo_root().join("examples/c/odirect_writer.c"),
            "odirect_writer_shm",
            &["/dev/shm"],
            "0 bad pages",
        );
    }
}

#[test]
fn the_header_is_valid_cplusplus() {
    let Some(_) = cc() else { return };
    let usable = Command::new("c++")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !usable {
        // scripts/setup-debian.sh installs g++: CI must not skip this.
        let ci = std::env::var("CI").is_ok_and(|v| v == "true");
        assert!(!ci, "no usable c++ on PATH, and CI=true");
        eprintln!("SKIPPED: no c++");
        return;
    }
    let src = out_dir().join("header.cpp");
    std::fs::write(
        &src,
        "#include \"iopages.h\"\nint main() { return iopages_version() ? 0 : 1; }\n",
    )
    .unwrap();
    let st = Command::new("c++")
        .args(["-std=c++11", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(manifest_dir().join("include"))
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "include/iopages.h does not compile as C++");
}
