//! The direction of iopages-nbd's layers, checked on the source.
//!
//! Owns: the one rule the workspace's cycle check (iopages-testkit's
//! `tests/shape.rs`) cannot state — a layer names only the layers below
//! it, and the server and the client never name each other — checked on
//! every `crate::` path outside comments and test modules. Must never:
//! pass a file it did not read; every source file belongs to exactly one
//! layer below.
//!
//! Layers, bottom to top: foundations (`sys`, `proto`, `error`, `stats`) ·
//! `tls` · `transport` · `server` and `client` side by side · the top
//! (`volume`, `lib.rs`, and the `remote` re-export), which may name
//! anything. Under a later event-driven data path the threads inside
//! `server/` and `client/` change, and these directions stay.

use std::path::{Path, PathBuf};

const FOUNDATION: &[&str] = &["sys", "proto", "error", "stats"];

/// Where a file sits, and the first path segments after `crate::` it may
/// name (`*`: anything).
fn allowed(rel: &str) -> (&'static str, Vec<&'static str>) {
    let top = rel.split('/').next().unwrap().trim_end_matches(".rs");
    let with = |more: &[&'static str]| FOUNDATION.iter().chain(more).copied().collect();
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

/// The first segment of each `crate::` path in a file's code (comments
/// and everything from the first `#[cfg(test)]` on left out); a braced
/// import `crate::{a::X, b}` gives each of its first segments.
fn crate_roots(src: &str) -> Vec<String> {
    let mut roots = Vec::new();
    for line in src.lines() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]") {
            break;
        }
        if code.starts_with("//") {
            continue;
        }
        let mut rest = code.split(" //").next().unwrap();
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(inner) = rest.strip_prefix('{') {
                let inner = inner.split('}').next().unwrap_or("");
                roots.extend(inner.split(',').map(|s| segment(s.trim())));
            } else {
                roots.push(segment(rest));
            }
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

fn permitted(root: &str, allow: &[&str]) -> bool {
    allow.iter().any(|a| *a == "*" || *a == root)
}

#[test]
fn every_layer_names_only_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let reexported = reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        let (layer, allow) = allowed(&rel);
        for root in crate_roots(&std::fs::read_to_string(f).unwrap()) {
            let to = resolve(&root, &reexported);
            if !permitted(&to, &allow) {
                bad.push(format!("{rel} ({layer}) names crate::{root} ({to})"));
            }
        }
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_checker_catches_an_upward_or_sideways_path() {
    let (_, allow) = allowed("tls/session.rs");
    assert!(!permitted("server", &allow));
    assert!(!permitted("transport", &allow));
    assert!(permitted("sys", &allow));
    let (_, allow) = allowed("client/conn.rs");
    assert!(
        !permitted("server", &allow),
        "the client never names the server"
    );
    assert!(permitted("transport", &allow));
    let (_, allow) = allowed("server/handshake.rs");
    assert!(
        !permitted("client", &allow),
        "the server never names the client"
    );
    assert!(!permitted("volume", &allow));
    let lib = "pub use server::serve::{\n    Server, ServerConfig,\n};\npub use error::Error;\npub struct ExportConfig;\n";
    let re = reexports(lib);
    assert_eq!(resolve("Server", &re), "server");
    assert_eq!(resolve("Error", &re), "error");
    assert_eq!(resolve("ExportConfig", &re), "root");
    assert_eq!(resolve("sys", &re), "sys");
    let (_, allow) = allowed("tls/config.rs");
    assert!(
        !permitted(&resolve("Server", &re), &allow),
        "a re-export is its module's"
    );
    assert!(!permitted(&resolve("ExportConfig", &re), &allow));
    let roots = crate_roots("use crate::{server::X, tls::Y}; // crate::client\nlet _ = crate::sys::poll;\n#[cfg(test)]\nuse crate::client::Z;\n");
    assert_eq!(roots, ["server", "tls", "sys"]);
}
