//! What the workspace's source checks share (`shape.rs`, `layering.rs`,
//! `one_client.rs`): where the workspace is and its source files.
//!
//! Owns: the workspace root and the recursive, sorted walk for `.rs`
//! files. Must never: read outside the workspace, or hide a directory it
//! could not read from a check that needs it (a missing folder is an empty
//! list; the checks assert they found files).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The workspace root (this crate is `crates/iopages-testkit`).
pub fn root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.join("../..").canonicalize().expect("workspace root")
}

/// Every `.rs` file under `dir`, recursively, sorted (none when `dir` is
/// missing).
pub fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.expect("dir entry").path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The `src/` of crate `name` in this workspace.
pub fn crate_src(name: &str) -> PathBuf {
    root().join("crates").join(name).join("src")
}
