//! The workspace's shape, checked on the source of every crate under
//! `crates/`: no module cycles, no function over 70 lines, the binary does
//! not link test support, and the `unsafe` left in consumers is the list
//! `docs/architecture.md` gives.
//!
//! Owns: a small reader of Rust source (comments, strings and
//! `#[cfg(test)]` items blanked, line numbers kept), the module graph it
//! builds from `crate::`/`super::`/`self::` paths, and the `Cargo.toml`
//! dependency sections.
//! Must never: compile or run the code it reads, depend on anything outside
//! std, or be silenced with `#[ignore]` — a rule that no longer holds is
//! changed here, with its reason.
//!
//! **Module cycles.** A module is one source file; a folder's `mod.rs`,
//! `lib.rs` or `main.rs` is the folder's module (and a file `a.rs` is the
//! parent of the folder `a/`). An edge A → B exists when A's code outside
//! `#[cfg(test)]` names an item of B through `crate::`, `super::` or
//! `self::` (in `use` trees, braces expanded, or anywhere in the code); a
//! path names the deepest file module that is its prefix. Edges to or from
//! an ancestor do not count. Every strongly connected component of more
//! than one file is a cycle.
//!
//! **Function length.** From the line with `fn` to its closing brace, both
//! included, at most [`MAX_FN_LINES`], except [`LONG_FN_ALLOWED`].

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The longest a function may be, in lines.
const MAX_FN_LINES: usize = 70;

/// Functions allowed to be longer: (path, fn name, reason).
const LONG_FN_ALLOWED: &[(&str, &str, &str)] = &[(
    "crates/iopages-cli/src/metrics.rs",
    "encode",
    "flat table: one entry per metric family",
)];

/// Crates whose `unsafe` is their job (the allocator core and the C ABI):
/// left out of the inventory.
const UNSAFE_EXEMPT: &[&str] = &["crates/iopages/src", "crates/iopages-ffi/src"];

const INVENTORY_BEGIN: &str = "<!-- unsafe-inventory:begin -->";
const INVENTORY_END: &str = "<!-- unsafe-inventory:end -->";

// ---- the workspace on disk ------------------------------------------------

/// The workspace root (`crates/..`).
fn root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.join("../..").canonicalize().expect("workspace root")
}

/// Every crate folder under `crates/`, sorted.
fn crate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(root().join("crates"))
        .expect("crates/")
        .map(|e| e.expect("crates/ entry").path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 2, "no crates found under {:?}", root());
    dirs
}

/// Every `.rs` file under `dir`, recursively, sorted.
fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
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

/// `p` relative to the workspace root, with `/` separators.
fn rel(p: &Path) -> String {
    let r = p.strip_prefix(root()).unwrap_or(p);
    r.to_string_lossy().replace('\\', "/")
}

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

// ---- reading Rust source --------------------------------------------------

/// Skip a string literal body starting after its opening quote at `i`;
/// returns the index after the closing quote.
fn skip_string(c: &[char], mut i: usize) -> usize {
    while i < c.len() {
        match c[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// If a raw string (`r"`, `r#"`, `br#"` …) starts at `i`, the index after
/// its end.
fn skip_raw_string(c: &[char], i: usize) -> Option<usize> {
    let mut j = i + usize::from(c[i] == 'b');
    if c.get(j) != Some(&'r') || (i > 0 && is_ident(c[i - 1])) {
        return None;
    }
    j += 1;
    let hashes = c[j..].iter().take_while(|&&x| x == '#').count();
    j += hashes;
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && c[j + 1..].iter().take(hashes).filter(|&&x| x == '#').count() == hashes {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(j)
}

/// If a char literal (not a lifetime) starts at the quote at `i`, the index
/// after it.
fn skip_char(c: &[char], i: usize) -> Option<usize> {
    match (c.get(i + 1), c.get(i + 2)) {
        (Some('\\'), _) => {
            let end = c.get(i + 3..)?.iter().position(|&x| x == '\'')?;
            Some(i + 3 + end + 1)
        }
        (Some(_), Some('\'')) => Some(i + 3),
        _ => None,
    }
}

/// Skip a (nested) block comment starting at `i`.
fn skip_block_comment(c: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < c.len() {
        if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// The source with comments and the contents of string and char literals
/// replaced by spaces; newlines are kept, so line numbers stay right.
fn blank_comments_and_strings(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = Vec::with_capacity(c.len());
    let mut i = 0;
    while i < c.len() {
        let end = if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            c[i..].iter().position(|&x| x == '\n').map_or(c.len(), |n| i + n)
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            skip_block_comment(&c, i)
        } else if let Some(e) = (c[i] == 'r' || c[i] == 'b').then(|| skip_raw_string(&c, i)).flatten() {
            e
        } else if c[i] == '"' {
            skip_string(&c, i + 1)
        } else if c[i] == '\'' {
            skip_char(&c, i).unwrap_or(i + 1)
        } else {
            i + 1
        };
        let blank = end > i + 1 || c[i] == '"';
        for &x in &c[i..end.min(c.len())] {
            out.push(if blank && x != '\n' { ' ' } else { x });
        }
        i = end;
    }
    out.into_iter().collect()
}

fn is_ident(x: char) -> bool {
    x.is_alphanumeric() || x == '_'
}

/// A token of blanked source: an identifier or one punctuation character
/// (`::` is one token), with its line (1-based).
#[derive(Clone, Debug, PartialEq)]
struct Tok {
    text: String,
    line: usize,
}

fn tokens(blanked: &str) -> Vec<Tok> {
    let c: Vec<char> = blanked.chars().collect();
    let (mut out, mut line, mut i) = (Vec::new(), 1, 0);
    while i < c.len() {
        let start = i;
        if c[i] == '\n' {
            line += 1;
            i += 1;
            continue;
        } else if c[i].is_whitespace() {
            i += 1;
            continue;
        } else if is_ident(c[i]) {
            while i < c.len() && is_ident(c[i]) {
                i += 1;
            }
        } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
            i += 2;
        } else {
            i += 1;
        }
        out.push(Tok {
            text: c[start..i].iter().collect(),
            line,
        });
    }
    out
}

/// The index of the token that closes the bracket opened at `open`.
fn matching(t: &[Tok], open: usize) -> usize {
    let (o, cl) = match t[open].text.as_str() {
        "{" => ("{", "}"),
        "(" => ("(", ")"),
        _ => ("[", "]"),
    };
    let mut depth = 0usize;
    for (k, tok) in t.iter().enumerate().skip(open) {
        if tok.text == o {
            depth += 1;
        } else if tok.text == cl {
            depth -= 1;
            if depth == 0 {
                return k;
            }
        }
    }
    t.len() - 1
}

/// Where the item starting at `i` ends (the index after its `;` or its
/// closing brace): a `use` ends at its `;`, anything else at the first `;`
/// or braced body outside parentheses.
fn item_end(t: &[Tok], mut i: usize) -> usize {
    let is_use = t[i..].iter().take(4).any(|x| x.text == "use");
    while i < t.len() {
        match t[i].text.as_str() {
            ";" => return i + 1,
            "{" if !is_use => return matching(t, i) + 1,
            "(" | "[" | "{" => i = matching(t, i) + 1,
            _ => i += 1,
        }
    }
    i
}

/// If an attribute `#[...]` starts at `i`: its text and the index after it.
fn attribute(t: &[Tok], i: usize) -> Option<(String, usize)> {
    let open = i + 1 + usize::from(t.get(i + 1).is_some_and(|x| x.text == "!"));
    if t[i].text != "#" || !t.get(open).is_some_and(|x| x.text == "[") {
        return None;
    }
    let close = matching(t, open);
    let text: String = t[open + 1..close].iter().map(|x| x.text.as_str()).collect();
    Some((text, close + 1))
}

/// The tokens with every `#[cfg(test)]` item left out, and the names of the
/// out-of-line modules it declares (`#[cfg(test)] mod tests;`).
fn without_test_items(t: &[Tok]) -> (Vec<Tok>, Vec<String>) {
    let (mut out, mut test_mods, mut i) = (Vec::new(), Vec::new(), 0);
    while i < t.len() {
        match attribute(t, i) {
            // `#![cfg(test)]`: the whole file is test code.
            Some((text, _)) if text == "cfg(test)" && t[i + 1].text == "!" => {
                return (Vec::new(), Vec::new());
            }
            Some((text, after)) if text == "cfg(test)" => {
                let mut j = after;
                while let Some((_, next)) = attribute(t, j) {
                    j = next;
                }
                let end = item_end(t, j);
                if let Some(m) = t[j..end].iter().position(|x| x.text == "mod") {
                    if t[end - 1].text == ";" {
                        test_mods.push(t[j + m + 1].text.clone());
                    }
                }
                i = end;
            }
            _ => {
                out.push(t[i].clone());
                i += 1;
            }
        }
    }
    (out, test_mods)
}
