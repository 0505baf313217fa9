//! The direction of the allocator's layers, checked on the source.
//!
//! Owns: the one rule visibility cannot state — a layer names only the
//! layers below it — checked on every `crate::` path outside comments and
//! test modules. (What visibility does state, it states: `Core` and its
//! fields are private to `page_alloc`, the modules are private to the
//! crate.) Must never: pass a file it did not read; every source file
//! belongs to exactly one layer below.
//!
//! Layers, bottom to top: foundations (`error`, `gfp`, `fault`, `sync`) ·
//! `buddy` · `percpu` · `reclaim` · `page_alloc` · consumers (everything
//! else at the crate root), which use crate-root names only.

use std::path::{Path, PathBuf};

/// Where a file sits, and the first path segments after `crate::` it may
/// use (`{` is a crate-root import, `*` any root item).
fn allowed(rel: &str) -> (&'static str, &'static [&'static str]) {
    const FOUNDATION: &[&str] = &["error", "gfp", "fault", "sync"];
    let top = rel.split('/').next().unwrap();
    match top {
        "error.rs" | "gfp.rs" | "fault.rs" | "sync.rs" => ("foundation", FOUNDATION),
        "buddy" => ("buddy", &["error", "gfp", "fault", "sync", "buddy"]),
        "percpu" => (
            "percpu",
            &["error", "gfp", "fault", "sync", "buddy", "percpu"],
        ),
        "reclaim" => (
            "reclaim",
            &["error", "gfp", "fault", "sync", "buddy", "reclaim"],
        ),
        "page_alloc" => (
            "page_alloc",
            &[
                "error",
                "gfp",
                "fault",
                "sync",
                "buddy",
                "percpu",
                "reclaim",
                "page_alloc",
                "*",
            ],
        ),
        "lib.rs" => ("root", &["*"]),
        // Consumers: crate-root names, the shared `sync` shims, and the CPU
        // lookup (which the per-CPU counter shares with the per-CPU lists).
        _ => ("consumer", &["*", "sync", "percpu::cpu"]),
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The `crate::` paths of a file's code (comments and `#[cfg(test)]`
/// modules left out), each as the text after `crate::`.
fn crate_paths(src: &str) -> Vec<String> {
    let mut paths = Vec::new();
    for line in src.lines() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]") {
            break;
        }
        if code.starts_with("//") {
            continue;
        }
        let code = code.split(" //").next().unwrap();
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':' || c == '{'))
                .unwrap_or(rest.len());
            paths.push(rest[..end].to_string());
        }
    }
    paths
}

fn permitted(path: &str, allow: &[&str]) -> bool {
    let first = path.split("::").next().unwrap();
    let root_item = path.starts_with('{') || first.chars().next().is_some_and(char::is_uppercase);
    allow.iter().any(|a| match *a {
        "*" => root_item || first == "flags",
        a if a.contains("::") => path.starts_with(a),
        a => first == a,
    })
}

#[test]
fn every_layer_names_only_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let (layer, allow) = allowed(&rel);
        let text = std::fs::read_to_string(f).unwrap();
        for p in crate_paths(&text) {
            if !permitted(&p, allow) {
                bad.push(format!("{rel} ({layer}) uses crate::{p}"));
            }
        }
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_checker_catches_an_upward_path() {
    let (_, allow) = allowed("buddy/zone.rs");
    assert!(!permitted("page_alloc::PageAllocator", allow));
    assert!(!permitted("PageAllocator", allow));
    assert!(!permitted("{Page, PageAllocator}", allow));
    assert!(permitted("buddy::frame::Page", allow));
    let (_, allow) = allowed("pagecache.rs");
    assert!(!permitted("page_alloc::Core", allow));
    assert!(!permitted("reclaim::compaction::CompactTarget", allow));
    assert!(permitted("{Gfp, Page}", allow));
    assert!(permitted("percpu::cpu::slot", allow));
    let paths = crate_paths("use crate::buddy::zone::Zone; // crate::PageAllocator\n");
    assert_eq!(paths, ["buddy::zone::Zone"]);
}
