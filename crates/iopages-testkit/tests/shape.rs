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

mod common;
use common::{root, rs_files};

/// The longest a function may be, in lines.
const MAX_FN_LINES: usize = 70;

/// Functions allowed to be longer: (path, fn name, reason) — a flat
/// table that reads worse split. None today (the metrics encoder, the one
/// candidate, is written one family group per function).
const LONG_FN_ALLOWED: &[(&str, &str, &str)] = &[];

/// Crates whose `unsafe` is their job (the allocator core and the C ABI):
/// left out of the inventory.
const UNSAFE_EXEMPT: &[&str] = &["crates/iopages/src", "crates/iopages-ffi/src"];

const INVENTORY_BEGIN: &str = "<!-- unsafe-inventory:begin -->";
const INVENTORY_END: &str = "<!-- unsafe-inventory:end -->";

// ---- the workspace on disk ------------------------------------------------

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
        if c[j] == '"'
            && c[j + 1..]
                .iter()
                .take(hashes)
                .filter(|&&x| x == '#')
                .count()
                == hashes
        {
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
            c[i..]
                .iter()
                .position(|&x| x == '\n')
                .map_or(c.len(), |n| i + n)
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            skip_block_comment(&c, i)
        } else if let Some(e) = (c[i] == 'r' || c[i] == 'b')
            .then(|| skip_raw_string(&c, i))
            .flatten()
        {
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
    let mut k = i;
    if t[k].text == "pub" {
        k += 1;
        if t.get(k).is_some_and(|x| x.text == "(") {
            k = matching(t, k) + 1;
        }
    }
    let is_use = t.get(k).is_some_and(|x| x.text == "use");
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

// ---- module graph ---------------------------------------------------------

/// A module path: the segments below the crate root.
type ModPath = Vec<String>;

/// The module of a file, from its path under `src/` (`/` separators).
fn module_path(under_src: &str) -> ModPath {
    let mut segs: ModPath = under_src
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    let last = segs.last().map(String::as_str);
    if last == Some("mod") || (segs.len() == 1 && matches!(last, Some("lib" | "main"))) {
        segs.pop();
    }
    segs
}

/// Split a token list at its top-level commas.
fn split_commas(t: &[Tok]) -> Vec<&[Tok]> {
    let (mut parts, mut start, mut i) = (Vec::new(), 0, 0);
    while i < t.len() {
        match t[i].text.as_str() {
            "{" | "(" | "[" => i = matching(t, i),
            "," => {
                parts.push(&t[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    parts.push(&t[start..]);
    parts
}

/// Expand a use tree (`a::{b::X, c::{Y, Z}}`) below `prefix` into paths.
fn expand_use(t: &[Tok], prefix: &[String], out: &mut Vec<ModPath>) {
    let mut path = prefix.to_vec();
    let mut i = 0;
    while i < t.len() {
        match t[i].text.as_str() {
            "::" => {}
            "{" => {
                let close = matching(t, i);
                for part in split_commas(&t[i + 1..close]) {
                    expand_use(part, &path, out);
                }
                return;
            }
            "*" | "as" => break,
            x => path.push(x.to_string()),
        }
        i += 1;
    }
    out.push(path);
}

/// `path` (starting with `crate`, `super` or `self`) from the module
/// `here`, as segments below the crate root; `None` for other paths.
fn absolute(path: &[String], here: &[String]) -> Option<ModPath> {
    let (mut base, mut rest) = match path.first()?.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (here.to_vec(), &path[1..]),
        "super" => (here.to_vec(), path),
        _ => return None,
    };
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    base.extend(rest.iter().filter(|s| *s != "self").cloned());
    Some(base)
}

/// A `crate::`/`super::`/`self::` path in code (not a `use`) starting at
/// `i`: its segments (up to a `::{`, `::<` or `::*`).
fn code_path(t: &[Tok], i: usize) -> Option<ModPath> {
    let root = matches!(t[i].text.as_str(), "crate" | "super" | "self");
    let visibility = i >= 2 && t[i - 1].text == "in" && t[i - 2].text == "(";
    if !root || visibility || !t.get(i + 1).is_some_and(|x| x.text == "::") {
        return None;
    }
    let mut segs = vec![t[i].text.clone()];
    let mut k = i + 1;
    while t.get(k).is_some_and(|x| x.text == "::")
        && t.get(k + 1).is_some_and(|x| x.text.starts_with(is_ident))
    {
        segs.push(t[k + 1].text.clone());
        k += 2;
    }
    Some(segs)
}

/// Every path a file's code names through `crate::`, `super::` or `self::`
/// (in `use` trees or in code), below the crate root. `here` is the file's
/// module; inline `mod m { .. }` blocks are followed.
fn named_paths(t: &[Tok], here: &[String]) -> Vec<ModPath> {
    let mut out = Vec::new();
    let mut inline: Vec<(String, usize)> = Vec::new();
    let (mut depth, mut i) = (0usize, 0);
    while i < t.len() {
        let mut cur = here.to_vec();
        cur.extend(inline.iter().map(|(m, _)| m.clone()));
        match t[i].text.as_str() {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                inline.retain(|&(_, d)| d <= depth);
            }
            "mod" if t.get(i + 2).is_some_and(|x| x.text == "{") => {
                inline.push((t[i + 1].text.clone(), depth + 1));
            }
            "use" => {
                let end = item_end(t, i).saturating_sub(1);
                let mut paths = Vec::new();
                expand_use(&t[i + 1..end], &[], &mut paths);
                out.extend(paths.iter().filter_map(|p| absolute(p, &cur)));
                i = end;
                continue;
            }
            _ => {
                if let Some(p) = code_path(t, i) {
                    out.extend(absolute(&p, &cur));
                }
            }
        }
        i += 1;
    }
    out
}

/// The deepest module of `modules` that is a prefix of `path`.
fn owner_of(path: &[String], modules: &BTreeSet<ModPath>) -> ModPath {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
        .unwrap_or_default()
}

fn is_prefix(a: &[String], b: &[String]) -> bool {
    a.len() <= b.len() && b[..a.len()] == *a
}

/// The module graph of one crate: `files` are (path under `src/`, source).
/// Nodes are file modules outside `#[cfg(test)]`; edges between modules
/// neither of which is the other's ancestor.
fn module_graph(files: &[(String, String)]) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let mut parsed = Vec::new();
    let mut test_only: Vec<ModPath> = Vec::new();
    for (path, src) in files {
        let here = module_path(path);
        let (code, test_mods) = without_test_items(&tokens(&blank_comments_and_strings(src)));
        for m in test_mods {
            test_only.push([here.clone(), vec![m]].concat());
        }
        parsed.push((here, code));
    }
    parsed.retain(|(m, _)| !test_only.iter().any(|t| is_prefix(t, m)));
    let modules: BTreeSet<ModPath> = parsed.iter().map(|(m, _)| m.clone()).collect();
    let mut graph = BTreeMap::new();
    for (here, code) in &parsed {
        let edges: BTreeSet<ModPath> = named_paths(code, here)
            .iter()
            .map(|p| owner_of(p, &modules))
            .filter(|to| !is_prefix(to, here) && !is_prefix(here, to))
            .collect();
        graph.insert(here.clone(), edges);
    }
    graph
}

/// Tarjan's strongly connected components.
struct Tarjan<'g> {
    graph: &'g BTreeMap<ModPath, BTreeSet<ModPath>>,
    index: BTreeMap<&'g ModPath, (usize, usize)>,
    stack: Vec<&'g ModPath>,
    on_stack: BTreeSet<&'g ModPath>,
    sccs: Vec<Vec<ModPath>>,
}

impl<'g> Tarjan<'g> {
    fn visit(&mut self, v: &'g ModPath) {
        let n = self.index.len();
        self.index.insert(v, (n, n));
        self.stack.push(v);
        self.on_stack.insert(v);
        let graph = self.graph;
        for w in graph.get(v).into_iter().flatten() {
            if !self.index.contains_key(w) {
                self.visit(w);
                let low = self.index[w].1.min(self.index[v].1);
                self.index.get_mut(v).unwrap().1 = low;
            } else if self.on_stack.contains(w) {
                let low = self.index[w].0.min(self.index[v].1);
                self.index.get_mut(v).unwrap().1 = low;
            }
        }
        if self.index[v].0 == self.index[v].1 {
            let mut scc = Vec::new();
            while let Some(w) = self.stack.pop() {
                self.on_stack.remove(w);
                scc.push(w.clone());
                if w == v {
                    break;
                }
            }
            scc.sort();
            self.sccs.push(scc);
        }
    }
}

/// The module cycles of one crate (`files` as in [`module_graph`]): each
/// cycle's files, and the edges among them as `a.rs -> b.rs` lines.
fn module_cycles(files: &[(String, String)]) -> Vec<(Vec<String>, Vec<String>)> {
    let graph = module_graph(files);
    let file_of: BTreeMap<ModPath, &String> =
        files.iter().map(|(p, _)| (module_path(p), p)).collect();
    let mut t = Tarjan {
        graph: &graph,
        index: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        sccs: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    let mut cycles: Vec<_> = t.sccs.into_iter().filter(|c| c.len() > 1).collect();
    cycles.sort();
    let name = |m: &ModPath| file_of[m].clone();
    cycles
        .iter()
        .map(|scc| {
            let edges = scc
                .iter()
                .flat_map(|a| {
                    graph[a]
                        .iter()
                        .filter(|b| scc.contains(b))
                        .map(move |b| (a, b))
                })
                .map(|(a, b)| format!("{} -> {}", name(a), name(b)))
                .collect();
            (scc.iter().map(name).collect(), edges)
        })
        .collect()
}

// ---- function length ------------------------------------------------------

/// Every function with a body in `src`: (name, line of `fn`, length in
/// lines from that line to the closing brace, both included). A
/// signature may span lines and carry a `where` clause; a declaration
/// without a body (`fn f();`) is not a function here.
fn fn_lengths(src: &str) -> Vec<(String, usize, usize)> {
    let t = tokens(&blank_comments_and_strings(src));
    let mut out = Vec::new();
    for i in 0..t.len() {
        let named = t.get(i + 1).is_some_and(|x| x.text.starts_with(is_ident));
        if t[i].text != "fn" || !named {
            continue;
        }
        let mut k = i + 2;
        while k < t.len() {
            match t[k].text.as_str() {
                ";" => break,
                "(" | "[" => k = matching(&t, k) + 1,
                "{" => {
                    let close = matching(&t, k);
                    out.push((
                        t[i + 1].text.clone(),
                        t[i].line,
                        t[close].line - t[i].line + 1,
                    ));
                    break;
                }
                _ => k += 1,
            }
        }
    }
    out
}

// ---- Cargo.toml -----------------------------------------------------------

/// The dependencies a `Cargo.toml` declares: (section, crate name), where
/// the section is `dependencies`, `dev-dependencies` or
/// `build-dependencies` (target-specific tables by their last part) and
/// the name is the package's (`package = "..."` when renamed).
fn cargo_deps(toml: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut section = String::new();
    for line in toml
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
    {
        if let Some(h) = line.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            let h = h.trim_matches(|c| c == '[' || c == ']');
            let kind = ["dev-dependencies", "build-dependencies", "dependencies"]
                .into_iter()
                .find(|k| h == *k || h.ends_with(&format!(".{k}")) || h.contains(&format!("{k}.")));
            section = kind.unwrap_or("").to_string();
            // `[dependencies.name]`: the table is one dependency.
            if let Some((_, name)) = kind.and_then(|k| h.split_once(&format!("{k}."))) {
                out.push((section.clone(), name.trim_matches('"').to_string()));
                section.clear();
            }
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        if section.is_empty() {
            continue;
        }
        let key = key.trim().split('.').next().unwrap_or("").trim_matches('"');
        let package = value
            .split_once("package")
            .and_then(|(_, p)| p.split('"').nth(1))
            .unwrap_or(key);
        out.push((section.clone(), package.to_string()));
    }
    out
}

/// What the dependency rules say of one crate's dependencies: test support
/// (`iopages-testkit`) only in `[dev-dependencies]`, and the experiments
/// (`iopages-bench`) only in the binary's `[dependencies]`.
fn dependency_violations(krate: &str, deps: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (section, name) in deps {
        if name == "iopages-testkit" && section != "dev-dependencies" {
            out.push(format!(
                "{krate}: iopages-testkit in [{section}] (only [dev-dependencies] may name it)"
            ));
        }
        if name == "iopages-bench" && !(krate == "iopages-cli" && section == "dependencies") {
            out.push(format!("{krate}: iopages-bench in [{section}] (only iopages-cli's [dependencies] may name it)"));
        }
    }
    out
}

// ---- the unsafe inventory -------------------------------------------------

/// Whether the code of `src` (comments and strings left out) uses `unsafe`.
fn uses_unsafe(src: &str) -> bool {
    tokens(&blank_comments_and_strings(src))
        .iter()
        .any(|t| t.text == "unsafe")
}

/// The paths listed in `doc` between the inventory markers, one
/// `` - `path` `` a line.
fn documented_inventory(doc: &str) -> BTreeSet<String> {
    let begin = doc
        .find(INVENTORY_BEGIN)
        .expect("docs/architecture.md has no inventory begin marker");
    let end = doc
        .find(INVENTORY_END)
        .expect("docs/architecture.md has no inventory end marker");
    assert!(begin < end, "the inventory markers are out of order");
    doc[begin + INVENTORY_BEGIN.len()..end]
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("- `")?
                .strip_suffix('`')
                .map(String::from)
        })
        .collect()
}

// ---- the checks on the workspace ------------------------------------------

#[test]
fn no_crate_has_a_module_cycle() {
    let mut report = Vec::new();
    for dir in crate_dirs() {
        let src = dir.join("src");
        let files: Vec<(String, String)> = rs_files(&src)
            .iter()
            .map(|p| {
                (
                    rel(p)
                        .trim_start_matches(&format!("{}/", rel(&src)))
                        .to_string(),
                    read(p),
                )
            })
            .collect();
        for (files_in_cycle, edges) in module_cycles(&files) {
            report.push(format!("{}/: {}", rel(&src), files_in_cycle.join(", ")));
            report.extend(edges.iter().map(|e| format!("    {e}")));
        }
    }
    assert!(report.is_empty(), "module cycles:\n{}", report.join("\n"));
}

#[test]
fn no_function_is_longer_than_70_lines() {
    let mut long = Vec::new();
    for dir in crate_dirs() {
        for p in rs_files(&dir.join("src"))
            .iter()
            .chain(&rs_files(&dir.join("tests")))
        {
            let path = rel(p);
            for (name, line, len) in fn_lengths(&read(p)) {
                let allowed = LONG_FN_ALLOWED
                    .iter()
                    .any(|&(ap, an, _)| ap == path && an == name);
                if len > MAX_FN_LINES && !allowed {
                    long.push(format!("{path}:{line} {name} {len}"));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "{} functions over {MAX_FN_LINES} lines:\n{}",
        long.len(),
        long.join("\n")
    );
}

#[test]
fn the_binary_does_not_link_test_support() {
    let mut bad = Vec::new();
    for dir in crate_dirs() {
        let krate = dir.file_name().unwrap().to_string_lossy().to_string();
        bad.extend(dependency_violations(
            &krate,
            &cargo_deps(&read(&dir.join("Cargo.toml"))),
        ));
    }
    assert!(
        bad.is_empty(),
        "dependency rules broken:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_unsafe_outside_the_core_is_the_documented_inventory() {
    let mut found = BTreeSet::new();
    for dir in crate_dirs() {
        let src = dir.join("src");
        if UNSAFE_EXEMPT.contains(&rel(&src).as_str()) {
            continue;
        }
        found.extend(
            rs_files(&src)
                .into_iter()
                .filter(|p| uses_unsafe(&read(p)))
                .map(|p| rel(&p)),
        );
    }
    let listed = documented_inventory(&read(&root().join("docs/architecture.md")));
    let missing: Vec<_> = found.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&found).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/architecture.md's unsafe inventory is out of date:\n\
         use unsafe but are not listed: {missing:?}\n\
         listed but use no unsafe: {extra:?}"
    );
}

/// The one TLS session type: OpenSSL's session (`SslStream`) is driven in
/// one source file of the workspace, which both the NBD server and the
/// remote store's client use — never a second poll loop and error mapping
/// beside it.
#[test]
fn one_file_drives_tls_sessions() {
    let mut drivers = Vec::new();
    for dir in crate_dirs() {
        for p in rs_files(&dir.join("src")) {
            let text = blank_comments_and_strings(&read(&p));
            if tokens(&text).iter().any(|t| t.text == "SslStream") {
                drivers.push(rel(&p));
            }
        }
    }
    assert_eq!(
        drivers.len(),
        1,
        "OpenSSL sessions must be driven in exactly one file; found {drivers:?}"
    );
}

// ---- the checkers, on known input -----------------------------------------

/// (path under `src/`, source) pairs.
fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|&(p, s)| (p.to_string(), s.to_string()))
        .collect()
}

#[test]
fn the_cycle_checker_catches_a_two_file_cycle() {
    let crate_src = files(&[
        ("lib.rs", "mod a;\nmod b;\n"),
        ("a.rs", "use crate::{b::{Y, Z}, c::W};\npub struct X;\n"),
        (
            "b.rs",
            "pub struct Y;\npub fn f() -> crate::a::X { crate::a::X }\n",
        ),
        ("c.rs", "pub struct W;\n"),
    ]);
    let cycles = module_cycles(&crate_src);
    assert_eq!(cycles.len(), 1, "{cycles:?}");
    assert_eq!(cycles[0].0, ["a.rs", "b.rs"]);
    assert_eq!(cycles[0].1, ["a.rs -> b.rs", "b.rs -> a.rs"]);
}

#[test]
fn the_cycle_checker_resolves_super_self_and_folders() {
    let crate_src = files(&[
        ("lib.rs", "mod net;\n"),
        (
            "net/mod.rs",
            "mod conn;\nmod wire;\npub use self::wire::Frame;\n",
        ),
        ("net/conn.rs", "use super::wire::{self, Frame};\n"),
        (
            "net/wire.rs",
            "pub struct Frame;\nfn g() { super::super::net::conn::h() }\n",
        ),
        ("io.rs", "pub fn f() {}\n"),
        ("io/uring.rs", "use super::super::net::wire::Frame;\n"),
    ]);
    let cycles = module_cycles(&crate_src);
    assert_eq!(cycles.len(), 1, "{cycles:?}");
    assert_eq!(cycles[0].0, ["net/conn.rs", "net/wire.rs"]);
    let graph = module_graph(&crate_src);
    let io_uring = vec!["io".to_string(), "uring".to_string()];
    assert_eq!(graph[&io_uring].len(), 1, "{graph:?}");
}

#[test]
fn the_cycle_checker_ignores_tests_comments_strings_and_ancestors() {
    let crate_src = files(&[
        ("lib.rs", "mod a;\nmod b;\npub use a::X;\n"),
        (
            "a.rs",
            "//! See crate::b::Y.\npub struct X;\n/* crate::b::Y */\n\
             fn s() -> &'static str { \"crate::b::Y\" }\n\
             #[cfg(test)]\nmod tests {\n    use crate::b::Y;\n}\n\
             #[cfg(test)]\nmod more;\npub(in crate::b) fn v() {}\n",
        ),
        ("a/more.rs", "use crate::b::Y;\n"),
        (
            "b.rs",
            "pub struct Y;\nuse crate::a::X;\nuse crate::X as Z;\n",
        ),
    ]);
    assert!(module_cycles(&crate_src).is_empty());
    let graph = module_graph(&crate_src);
    assert!(!graph.contains_key(&vec!["a".to_string(), "more".to_string()]));
    assert!(graph[&vec!["a".to_string()]].is_empty(), "{graph:?}");
}

#[test]
fn the_counter_measures_functions_from_fn_to_the_closing_brace() {
    let src = "\
trait T {
    fn declared(&self) -> u8;
}

/// Braces in a comment: { { {
pub(crate) fn generic<F>(
    f: F,
) -> Option<u8>
where
    F: Fn(u8) -> Result<(), ()>,
{
    let s = \"}}}\";
    let c = '}';
    fn inner() {}
    Some(s.len() as u8 + c as u8)
}

unsafe extern \"C\" fn ffi(p: *const [u8; 4]) -> i32 { 0 }
";
    let got = fn_lengths(src);
    let want = [
        ("generic".to_string(), 6, 11),
        ("inner".to_string(), 14, 1),
        ("ffi".to_string(), 18, 1),
    ];
    assert_eq!(got, want);
}

#[test]
fn cargo_sections_are_read_with_renames_and_tables() {
    let toml = "\
[package]
name = \"x\"

[dependencies]
iopages.workspace = true
bench = { package = \"iopages-bench\", path = \"../iopages-bench\" }

[dev-dependencies]
iopages-testkit.workspace = true # test support

[target.'cfg(unix)'.dependencies]
libc = \"0.2\"

[build-dependencies.iopages-testkit]
path = \"../iopages-testkit\"
";
    let deps = cargo_deps(toml);
    let has = |s: &str, n: &str| deps.contains(&(s.to_string(), n.to_string()));
    assert!(has("dependencies", "iopages"), "{deps:?}");
    assert!(has("dependencies", "iopages-bench"), "{deps:?}");
    assert!(has("dev-dependencies", "iopages-testkit"), "{deps:?}");
    assert!(has("dependencies", "libc"), "{deps:?}");
    assert!(has("build-dependencies", "iopages-testkit"), "{deps:?}");
    assert_eq!(deps.len(), 5, "{deps:?}");
    let bad = dependency_violations("iopages-nbd", &deps);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(dependency_violations("iopages-cli", &deps[..3]).is_empty());
}

#[test]
fn unsafe_counts_in_code_only() {
    assert!(uses_unsafe("fn f() { unsafe { g() } }"));
    assert!(uses_unsafe("pub unsafe fn f() {}"));
    assert!(!uses_unsafe(
        "#![deny(unsafe_op_in_unsafe_fn)]\n// unsafe\nfn f() { let s = \"unsafe\"; }"
    ));
    let doc = format!("x\n{INVENTORY_BEGIN}\n- `crates/a/src/x.rs`\n- `crates/b/src/y.rs`\n{INVENTORY_END}\n- `crates/c/src/z.rs`\n");
    let listed: Vec<String> = documented_inventory(&doc).into_iter().collect();
    assert_eq!(listed, ["crates/a/src/x.rs", "crates/b/src/y.rs"]);
}
