//! The direction of the layers of the crates that have them, checked on
//! the source: the allocator (`crates/iopages`) and the NBD crate
//! (`crates/iopages-nbd`).
//!
//! Owns: the one rule that neither visibility nor the workspace's cycle
//! check (`tests/shape.rs`) can state — a layer names only the layers
//! below it — checked on every `crate::` path outside comments and test
//! modules, with one table of layers per crate. Must never: pass a file it
//! did not read; every source file belongs to exactly one layer.
//!
//! **The allocator.** Bottom to top: foundations (`error`, `gfp`,
//! `fault`, `sync`) · `buddy` · `percpu` · `reclaim` · `page_alloc` ·
//! consumers (everything else at the crate root), which use crate-root
//! names only. (What visibility states, it states: `Core` and its fields
//! are private to `page_alloc`, the modules are private to the crate.)
//!
//! **iopages-nbd.** Bottom to top: foundations (`sys`, `proto`, `error`,
//! `stats`) · `tls` · `transport` · `server` and `client` side by side,
//! never naming each other · the top (`volume`, `lib.rs`, and the
//! `remote` re-export), which may name anything. A name lib.rs re-exports
//! counts as its module's. Under a later event-driven data path the
//! threads inside `server/` and `client/` change, and these directions
//! stay.

mod common;
use common::{crate_src, rs_files as rust_files};

// ---- the allocator's layers --------------------------------------------

/// Where a file sits, and the first path segments after `crate::` it may
/// use (`{` is a crate-root import, `*` any root item).
fn core_allowed(rel: &str) -> (&'static str, &'static [&'static str]) {
    const CORE_FOUNDATION: &[&str] = &["error", "gfp", "fault", "sync"];
    let top = rel.split('/').next().unwrap();
    match top {
        "error.rs" | "gfp.rs" | "fault.rs" | "sync.rs" => ("foundation", CORE_FOUNDATION),
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

/// The `crate::` paths of a file's code (comments and everything from the
/// first `#[cfg(test)]` on left out), each as the text after `crate::`; a
/// braced import on one line is one path, `{a::X, b}`.
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
            let end = match rest.strip_prefix('{') {
                Some(_) => rest.find('}').map_or(rest.len(), |e| e + 1),
                None => rest
                    .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .unwrap_or(rest.len()),
            };
            paths.push(rest[..end].to_string());
        }
    }
    paths
}

fn core_permitted(path: &str, allow: &[&str]) -> bool {
    let first = path.split("::").next().unwrap();
    let root_item = path.starts_with('{') || first.chars().next().is_some_and(char::is_uppercase);
    allow.iter().any(|a| match *a {
        "*" => root_item || first == "flags",
        a if a.contains("::") => path.starts_with(a),
        a => first == a,
    })
}

#[test]
fn the_allocators_layers_name_only_the_layers_below() {
    let src = crate_src("iopages");
    let files = rust_files(&src);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let (layer, allow) = core_allowed(&rel);
        let text = std::fs::read_to_string(f).unwrap();
        for p in crate_paths(&text) {
            if !core_permitted(&p, allow) {
                bad.push(format!("{rel} ({layer}) uses crate::{p}"));
            }
        }
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_allocator_checker_catches_an_upward_path() {
    let (_, allow) = core_allowed("buddy/zone.rs");
    assert!(!core_permitted("page_alloc::PageAllocator", allow));
    assert!(!core_permitted("PageAllocator", allow));
    assert!(!core_permitted("{Page, PageAllocator}", allow));
    assert!(core_permitted("buddy::frame::Page", allow));
    let (_, allow) = core_allowed("pagecache.rs");
    assert!(!core_permitted("page_alloc::Core", allow));
    assert!(!core_permitted("reclaim::compaction::CompactTarget", allow));
    assert!(core_permitted("{Gfp, Page}", allow));
    assert!(core_permitted("percpu::cpu::slot", allow));
    let paths = crate_paths("use crate::buddy::zone::Zone; // crate::PageAllocator\n");
    assert_eq!(paths, ["buddy::zone::Zone"]);
}

// ---- iopages-nbd's layers ------------------------------------------------

const NBD_FOUNDATION: &[&str] = &["sys", "proto", "error", "stats"];

/// Where a file sits, and the first path segments after `crate::` it may
/// name (`*`: anything).
fn nbd_allowed(rel: &str) -> (&'static str, Vec<&'static str>) {
    let top = rel.split('/').next().unwrap().trim_end_matches(".rs");
    let with = |more: &[&'static str]| NBD_FOUNDATION.iter().chain(more).copied().collect();
    match top {
        "sys" | "proto" | "error" | "stats" => ("foundation", with(&[])),
        "tls" => ("tls", with(&["tls"])),
        "transport" => ("transport", with(&["tls", "transport"])),
        // `root`: what lib.rs itself defines (the export's description and
        // the crate's defaults), which the two ends configure themselves by.
        "server" => ("server", with(&["tls", "transport", "server", "root"])),
        "client" => ("client", with(&["tls", "transport", "client", "root"])),
        _ => ("top", vec!["*"]),
    }
}

/// The first segment of each `crate::` path in a file's code; a braced
/// import `crate::{a::X, b}` gives each of its first segments.
fn crate_roots(src: &str) -> Vec<String> {
    let mut roots = Vec::new();
    for path in crate_paths(src) {
        match path.strip_prefix('{') {
            Some(inner) => roots.extend(inner.split(',').map(|s| segment(s.trim()))),
            None => roots.push(segment(&path)),
        }
    }
    roots.retain(|r| !r.is_empty());
    roots
}

fn segment(path: &str) -> String {
    path.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
        .unwrap_or("")
        .to_string()
}

/// lib.rs's re-exports: each item name with the module it comes from
/// (`pub use server::rate::RateLimit;` gives `RateLimit` → `server`).
fn reexports(lib: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for stmt in lib.split(';') {
        let Some(at) = stmt.find("pub use ") else {
            continue;
        };
        let path = &stmt[at + "pub use ".len()..];
        let module = segment(path);
        let names = path.split(|c: char| !(c.is_alphanumeric() || c == '_'));
        out.extend(
            names
                .skip(1)
                .filter(|n| !n.is_empty())
                .map(|n| (n.to_string(), module.clone())),
        );
    }
    out
}

/// The layer a `crate::` root names: a module by its name, a re-exported
/// item by the module it comes from, an item lib.rs defines as `root`.
fn resolve(root: &str, reexported: &[(String, String)]) -> String {
    if !root.starts_with(char::is_uppercase) {
        return root.to_string();
    }
    reexported
        .iter()
        .find(|(item, _)| item == root)
        .map_or_else(|| "root".to_string(), |(_, m)| m.clone())
}

fn nbd_permitted(root: &str, allow: &[&str]) -> bool {
    allow.iter().any(|a| *a == "*" || *a == root)
}

#[test]
fn the_nbd_layers_name_only_the_layers_below() {
    let src = crate_src("iopages-nbd");
    let files = rust_files(&src);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let reexported = reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        let (layer, allow) = nbd_allowed(&rel);
        for root in crate_roots(&std::fs::read_to_string(f).unwrap()) {
            let to = resolve(&root, &reexported);
            if !nbd_permitted(&to, &allow) {
                bad.push(format!("{rel} ({layer}) names crate::{root} ({to})"));
            }
        }
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_nbd_checker_catches_an_upward_or_sideways_path() {
    let (_, allow) = nbd_allowed("tls/session.rs");
    assert!(!nbd_permitted("server", &allow));
    assert!(!nbd_permitted("transport", &allow));
    assert!(nbd_permitted("sys", &allow));
    let (_, allow) = nbd_allowed("client/conn.rs");
    assert!(
        !nbd_permitted("server", &allow),
        "the client never names the server"
    );
    assert!(nbd_permitted("transport", &allow));
    let (_, allow) = nbd_allowed("server/handshake.rs");
    assert!(
        !nbd_permitted("client", &allow),
        "the server never names the client"
    );
    assert!(!nbd_permitted("volume", &allow));
    let lib = "pub use server::serve::{\n    Server, ServerConfig,\n};\npub use error::Error;\npub struct ExportConfig;\n";
    let re = reexports(lib);
    assert_eq!(resolve("Server", &re), "server");
    assert_eq!(resolve("Error", &re), "error");
    assert_eq!(resolve("ExportConfig", &re), "root");
    assert_eq!(resolve("sys", &re), "sys");
    let (_, allow) = nbd_allowed("tls/config.rs");
    assert!(
        !nbd_permitted(&resolve("Server", &re), &allow),
        "a re-export is its module's"
    );
    assert!(!nbd_permitted(&resolve("ExportConfig", &re), &allow));
    let roots = crate_roots("use crate::{server::X, tls::Y}; // crate::client\nlet _ = crate::sys::poll;\n#[cfg(test)]\nuse crate::client::Z;\n");
    assert_eq!(roots, ["server", "tls", "sys"]);
}
