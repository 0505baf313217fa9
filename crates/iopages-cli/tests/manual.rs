//! The manual, the completions and `--version`, checked against the
//! binary itself: `iopages man --out DIR` writes a page for every command
//! and every long option `--help` shows, `iopages.toml(5)` describes every
//! key the configuration file's parser accepts (as the parser lists them
//! when it refuses an unknown one), the completion scripts are scripts,
//! `--version` says what was built and on which code paths, and every
//! page renders without a groff warning.
//!
//! Nothing here is a list typed by hand: the commands and options come
//! from `--help`, the keys from `serve --config`'s own errors, so a new
//! option or key without its documentation fails a test.

use iopages_testkit::TempDir;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

mod common;

use common::BIN;

/// Deepest command path walked (`iopages luks format` is 2): a bound on
/// the walk should the help text ever list a command under itself.
const MAX_DEPTH: usize = 4;

/// The hand-written configuration page in the source tree.
fn toml_page_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/man/iopages.toml.5")
}

/// `iopages ARGS` with no standard input; its output, whatever its status.
fn iopages(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run iopages {args:?}: {e}"))
}

/// `iopages ARGS`, which must succeed; its standard output.
fn stdout_of(args: &[&str]) -> String {
    common::run(Command::new(BIN).args(args))
}

/// The lines of the `heading` section of a help text (up to the next
/// blank line followed by a heading, or the end).
fn help_section<'h>(help: &'h str, heading: &str) -> Vec<&'h str> {
    let mut lines = help.lines().skip_while(|l| *l != heading);
    if lines.next().is_none() {
        return Vec::new();
    }
    lines
        .take_while(|l| l.is_empty() || l.starts_with(' '))
        .collect()
}

/// The subcommands a help text lists (clap's own `help` left out: it has
/// no page, as in clap_mangen).
fn subcommands_in(help: &str) -> Vec<String> {
    help_section(help, "Commands:")
        .iter()
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_string)
        .collect()
}

/// The long options a help text lists: the first `--name` of each
/// option's own line (indented at most 6 columns; descriptions, which
/// may name other options, are indented further).
fn long_options_in(help: &str) -> BTreeSet<String> {
    help_section(help, "Options:")
        .iter()
        .filter(|l| {
            let indent = l.len() - l.trim_start().len();
            indent <= 6 && l.trim_start().starts_with('-')
        })
        .filter_map(|l| {
            l.split([' ', ','])
                .find(|t| t.starts_with("--"))
                .map(|t| t.trim_end_matches(['=', '<']).to_string())
        })
        .collect()
}

/// Every command path under `iopages` (`[]`, `["luks"]`, `["luks",
/// "format"]`, ...) with the long options its `--help` shows.
fn command_tree() -> Vec<(Vec<String>, BTreeSet<String>)> {
    let mut found = Vec::new();
    let mut todo: Vec<Vec<String>> = vec![Vec::new()];
    while let Some(path) = todo.pop() {
        assert!(path.len() <= MAX_DEPTH, "command path too deep: {path:?}");
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let help = stdout_of(&args);
        for sub in subcommands_in(&help) {
            let mut p = path.clone();
            p.push(sub);
            todo.push(p);
        }
        found.push((path, long_options_in(&help)));
    }
    found
}

/// A page's roff with hyphens unescaped (`\-` is how roff writes `-`).
fn page_text(path: &Path) -> String {
    let roff = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    roff.replace("\\-", "-")
}

/// Whether `text` names `option` as itself, not as the start of a
/// longer option (`--tls` in `--tls-psk`).
fn names_option(text: &str, option: &str) -> bool {
    text.match_indices(option).any(|(i, _)| {
        let next = text[i + option.len()..].chars().next();
        !matches!(next, Some(c) if c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn man_writes_a_page_for_every_command_naming_every_long_option() {
    let tree = command_tree();
    assert!(
        tree.iter().any(|(p, _)| p == &["luks", "format"]),
        "the walk of --help found no `luks format`: {:?}",
        tree.iter().map(|(p, _)| p).collect::<Vec<_>>()
    );
    assert!(
        tree.iter()
            .any(|(p, o)| p == &["serve"] && o.contains("--config") && o.contains("--image")),
        "the walk of --help found no options of serve"
    );
    let dir = TempDir::new("iopages-man");
    let printed = stdout_of(&["man", "--out", dir.path().to_str().unwrap()]);
    let printed: BTreeSet<PathBuf> = printed.lines().map(PathBuf::from).collect();
    let man1 = dir.join("man1");
    let mut expected = BTreeSet::new();
    for (path, options) in &tree {
        let name = std::iter::once("iopages")
            .chain(path.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join("-");
        let page = man1.join(format!("{name}.1"));
        assert!(printed.contains(&page), "{} not printed", page.display());
        let text = page_text(&page);
        assert!(text.contains("\n.TH "), "{name}: not roff");
        // Not every troff reads UTF-8 without a preprocessor.
        assert!(text.is_ascii(), "{name}.1 is not ASCII");
        for option in options {
            assert!(
                names_option(&text, option),
                "{name}.1 does not describe {option}"
            );
        }
        expected.insert(format!("{name}.1"));
    }
    let written: BTreeSet<String> = std::fs::read_dir(&man1)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        written, expected,
        "man1/ holds other pages than the commands'"
    );
    let toml = dir.join("man5").join("iopages.toml.5");
    assert!(printed.contains(&toml), "{} not printed", toml.display());
    assert_eq!(
        std::fs::read(&toml).unwrap(),
        std::fs::read(toml_page_source()).unwrap(),
        "man5/iopages.toml.5 is not docs/man/iopages.toml.5"
    );
    assert_eq!(printed.len(), expected.len() + 1, "{printed:?}");
}

/// The keys `serve --config` accepts where `who` says: it refuses a file
/// with an unknown key there, and its message lists what it expected.
fn keys_expected(file_text: &str, who: &str) -> Vec<String> {
    let dir = TempDir::new("iopages-keys");
    let file = dir.join("iopages.toml");
    std::fs::write(&file, file_text).unwrap();
    let out = iopages(&["serve", "--config", file.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{who}: an unknown key was accepted");
    let list = err
        .split_once("unknown key \"no-such-key\" (expected ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(list, _)| list)
        .unwrap_or_else(|| panic!("{who}: no list of keys in: {err}"));
    // serde's wording: `a`, `a or b`, `one of a, b, c`.
    let list = list.strip_prefix("one of ").unwrap_or(list);
    list.split(", ")
        .flat_map(|k| k.split(" or "))
        .map(|k| k.trim().to_string())
        .collect()
}

#[test]
fn every_config_key_is_described_in_iopages_toml_5() {
    let export = "[[export]]\nname = \"vm1\"\nimage = \"/img\"\npassphrase-file = \"/p\"\n";
    let top = keys_expected(&format!("no-such-key = 1\n{export}"), "top level");
    let server = keys_expected(&format!("[server]\nno-such-key = 1\n{export}"), "[server]");
    let exports = keys_expected(&format!("{export}no-such-key = 1\n"), "[[export]]");
    assert_eq!(top, ["[server]", "[[export]]"]);
    assert!(server.iter().any(|k| k == "listen"), "{server:?}");
    assert!(
        exports.iter().any(|k| k == "passphrase-file"),
        "{exports:?}"
    );
    let page = std::fs::read_to_string(toml_page_source()).unwrap();
    for table in &top {
        assert!(
            page.lines().any(|l| l == format!(".SH {table}")),
            "iopages.toml.5 has no section {table}"
        );
    }
    // Each key is the bold term of its own entry (`.TP`, then the term).
    let terms: Vec<&str> = page
        .lines()
        .zip(page.lines().skip(1))
        .filter(|(l, _)| *l == ".TP")
        .map(|(_, term)| term)
        .collect();
    for key in server.iter().chain(&exports) {
        let bold = format!("\\fB{}\\fR", key.replace('-', "\\-"));
        assert!(
            terms.iter().any(|t| t.starts_with(&bold)),
            "iopages.toml.5 does not describe the key {key}"
        );
    }
}

#[test]
fn completions_are_scripts_for_each_shell() {
    let bash = stdout_of(&["completions", "bash"]);
    assert!(bash.contains("serve") && bash.contains("--image"), "{bash}");
    assert!(bash.contains("--out") && bash.contains("header-backup"));
    let dir = TempDir::new("iopages-completions");
    let script = dir.join("iopages.bash");
    std::fs::write(&script, &bash).unwrap();
    let check = Command::new("bash").arg("-n").arg(&script).output();
    match check {
        Ok(out) => assert!(
            out.status.success(),
            "bash -n: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("cannot run bash -n: {e}"),
    }
    let zsh = stdout_of(&["completions", "zsh"]);
    assert!(zsh.starts_with("#compdef iopages"), "{zsh}");
    let fish = stdout_of(&["completions", "fish"]);
    assert!(fish.contains("complete -c iopages"), "{fish}");
    let bad = iopages(&["completions", "tcsh"]);
    assert!(!bad.status.success());
}

#[test]
fn version_names_the_release_the_commit_and_the_code_paths() {
    let version = env!("CARGO_PKG_VERSION");
    let short = stdout_of(&["-V"]);
    assert_eq!(short, format!("iopages {version}\n"));
    let long = stdout_of(&["--version"]);
    let mut lines = long.lines();
    assert_eq!(lines.next(), Some(format!("iopages {version}").as_str()));
    let field = |name: &str| {
        long.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no {name}: line in {long}"))
            .to_string()
    };
    let commit = field("commit");
    let hex = commit.strip_suffix("-dirty").unwrap_or(&commit);
    let is_hex = hex.len() >= 12 && hex.bytes().all(|b| b.is_ascii_hexdigit());
    assert!(
        is_hex || commit.contains("outside a git checkout"),
        "commit: {commit}"
    );
    if is_hex {
        // Built here, so the checkout's HEAD is the commit named.
        let head = Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|h| h.status.success());
        if let Some(head) = head {
            assert_eq!(String::from_utf8_lossy(&head.stdout).trim(), hex);
        }
    }
    assert!(field("rustc").starts_with("rustc "), "{long}");
    let xts = field("aes-xts");
    assert!(
        ["vaes (", "rustcrypto ("]
            .iter()
            .any(|p| xts.starts_with(p)),
        "aes-xts: {xts}"
    );
    let uring = field("io_uring");
    assert!(
        uring == "available" || uring.starts_with("unavailable: "),
        "{uring}"
    );
}

/// groff's warnings (`-ww`: all of them) for one page; empty when clean.
fn groff_warnings(groff: &Path, page: &Path) -> String {
    let out = Command::new(groff)
        .args(["-man", "-Tutf8", "-ww", "-z"])
        .arg(page)
        .output()
        .unwrap_or_else(|e| panic!("cannot run groff: {e}"));
    assert!(out.status.success(), "groff failed on {}", page.display());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn every_page_renders_without_a_groff_warning() {
    // groff-base (scripts/setup-debian.sh): skipped where missing, a
    // failure under CI=true.
    let Some(groff) = iopages_testkit::need_tool("groff", "the man pages' rendering check") else {
        return;
    };
    let dir = TempDir::new("iopages-render");
    let printed = stdout_of(&["man", "--out", dir.path().to_str().unwrap()]);
    let mut pages = 0;
    for page in printed.lines().map(Path::new) {
        let warnings = groff_warnings(&groff, page);
        assert!(warnings.is_empty(), "{}:\n{warnings}", page.display());
        pages += 1;
    }
    assert!(pages >= 3, "{printed}");
}

/// `iopages ARGS` with a standard output nobody reads (the pipe's reader
/// closed before it starts): it must fail with a message, not panic.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("iopages runs")
}

#[test]
fn a_closed_standard_output_is_an_error_not_a_panic() {
    let dir = TempDir::new("iopages-closed-stdout");
    let out_dir = dir.path().to_str().unwrap().to_string();
    for args in [
        vec!["man", "--out", out_dir.as_str()],
        vec!["completions", "bash"],
    ] {
        let out = with_closed_stdout(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.to_lowercase().contains("pipe"), "{args:?}: {err}");
    }
}
