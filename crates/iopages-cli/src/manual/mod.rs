//! `iopages man --out DIR` and `iopages completions SHELL`: the manual
//! pages and the shell completion scripts, made from the command line's
//! own definition so that they cannot drift from it.
//!
//! Owns: which pages exist — `iopages(1)` and one page per visible
//! subcommand at every level, named as git names its own
//! (`iopages-luks-format(1)`), and `iopages.toml(5)`, written by hand in
//! `docs/man/` and carried inside the binary — where they go
//! (`DIR/man1/`, `DIR/man5/`), each page's SEE ALSO, and the completion
//! script on standard output. The build's description for `--version` is
//! `version.rs`'s. Must never: write outside `DIR/man1` and `DIR/man5`,
//! leave a page half written without saying which, or panic on a closed
//! standard output (`iopages completions bash | head`).
//!
//! A Debian package calls exactly `iopages man --out DIR` and `iopages
//! completions SHELL`: those spellings are an interface.

pub mod version;

use clap_mangen::roff::{bold, roman, Roff};
use std::io::Write;
use std::path::Path;

/// The configuration file's page (roff, man(7) macros), written by hand.
const TOML_PAGE: &str = include_str!("../../../../docs/man/iopages.toml.5");

/// Its file name under `man5/`.
const TOML_PAGE_NAME: &str = "iopages.toml.5";

/// Most pages one tree of commands may make: far more than iopages has,
/// a bound on the walk should a command ever name itself.
const MAX_PAGES: usize = 256;

/// Writes every page under `dir` and prints each path written, one a line.
///
/// **Context:** creates `dir/man1` and `dir/man5` where missing and
/// replaces pages already there; blocks on the file system.
///
/// **Returns:** the first error, naming the file; the pages written
/// before it stay and were printed.
pub fn write_pages(cmd: clap::Command, dir: &Path) -> Result<(), String> {
    let pages = pages_of(cmd);
    assert!(!pages.is_empty() && pages.len() <= MAX_PAGES);
    let man1 = dir.join("man1");
    let man5 = dir.join("man5");
    for d in [&man1, &man5] {
        std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    }
    for page in &pages {
        let path = man1.join(format!("{}.1", page.name));
        write_file(&path, &page.roff)?;
    }
    write_file(&man5.join(TOML_PAGE_NAME), TOML_PAGE.as_bytes())?;
    Ok(())
}

/// One section-1 page: its command's full name and its roff text.
struct Page {
    name: String,
    roff: Vec<u8>,
}

/// The pages of `cmd` and of its visible subcommands, parents first.
fn pages_of(cmd: clap::Command) -> Vec<Page> {
    // `iopages help` is clap's, not ours: it has no page (as
    // clap_mangen::generate_to leaves it out). Building names every
    // subcommand by its path (`iopages-luks-format`).
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let mut pages = Vec::new();
    add_pages(&cmd, None, &mut pages);
    pages
}

/// `cmd`'s page, then its subcommands', depth first (`parent`: the page
/// above, for SEE ALSO).
fn add_pages(cmd: &clap::Command, parent: Option<&str>, pages: &mut Vec<Page>) {
    if pages.len() == MAX_PAGES {
        return;
    }
    let name = page_name(cmd);
    let man = clap_mangen::Man::new(cmd.clone())
        .date(env!("IOPAGES_BUILD_DATE"))
        .source(format!("iopages {}", env!("CARGO_PKG_VERSION")))
        .manual("iopages manual");
    let mut rendered = Vec::new();
    man.render(&mut rendered)
        .expect("rendering into memory cannot fail");
    let mut roff = ascii_roff(&String::from_utf8_lossy(&rendered));
    roff.push_str(&see_also(cmd, parent));
    pages.push(Page {
        name: name.clone(),
        roff: roff.into_bytes(),
    });
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        add_pages(sub, Some(&name), pages);
    }
}

/// `roff` with every character outside ASCII written as groff's `\[uXXXX]`
/// escape: the help texts' dashes and ellipses would otherwise reach
/// troff as bytes it warns about unless a preprocessor (man-db's preconv)
/// converts them first.
fn ascii_roff(roff: &str) -> String {
    let mut out = String::with_capacity(roff.len());
    for c in roff.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            out.push_str(&format!("\\[u{:04X}]", u32::from(c)));
        }
    }
    debug_assert!(out.is_ascii());
    out
}

/// A built command's page name: `iopages`, `iopages-luks-format`.
fn page_name(cmd: &clap::Command) -> String {
    cmd.get_display_name()
        .unwrap_or_else(|| cmd.get_name())
        .to_string()
}

/// The SEE ALSO section: the page above, the configuration file's page
/// where the command reads it (`iopages`, `iopages-serve`), and the
/// LUKS tools' counterpart, cryptsetup(8).
fn see_also(cmd: &clap::Command, parent: Option<&str>) -> String {
    let name = page_name(cmd);
    let mut refs: Vec<(String, &str)> = Vec::new();
    if let Some(p) = parent {
        refs.push((p.to_string(), "1"));
    }
    if name == "iopages" || name == "iopages-serve" {
        refs.push(("iopages.toml".to_string(), "5"));
    }
    if name.starts_with("iopages-luks") {
        refs.push(("cryptsetup".to_string(), "8"));
    }
    if refs.is_empty() {
        return String::new();
    }
    let mut inlines = Vec::new();
    for (i, (page, section)) in refs.iter().enumerate() {
        let sep = if i + 1 == refs.len() { "" } else { ", " };
        inlines.push(bold(page.as_str()));
        inlines.push(roman(format!("({section}){sep}")));
    }
    let mut roff = Roff::new();
    roff.control("SH", ["SEE ALSO"]).text(inlines);
    roff.to_roff()
}

/// Writes `bytes` to `path` and prints the path (a closed standard
/// output is an error, not a panic).
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    writeln!(std::io::stdout().lock(), "{}", path.display())
        .map_err(|e| format!("wrote {} but cannot print its name: {e}", path.display()))
}

/// Prints `shell`'s completion script for `cmd` on standard output.
///
/// **Context:** builds the script in memory first, so a reader that goes
/// away (`| head`) is an error returned, not a panic inside the generator.
///
/// **Returns:** an error when standard output cannot take the script.
pub fn print_completions(
    mut cmd: clap::Command,
    shell: clap_complete::Shell,
) -> Result<(), String> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "iopages", &mut script);
    assert!(!script.is_empty(), "{shell}: an empty completion script");
    let mut out = std::io::stdout().lock();
    out.write_all(&script)
        .and_then(|()| out.flush())
        .map_err(|e| format!("cannot write the {shell} completion script: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_ascii_with_groff_escapes_for_the_rest() {
        assert_eq!(
            ascii_roff("E1\u{2013}E6 \u{2026}"),
            "E1\\[u2013]E6 \\[u2026]"
        );
        assert_eq!(ascii_roff("\u{1F512}"), "\\[u1F512]");
        assert_eq!(ascii_roff(".TH x"), ".TH x");
    }

    #[test]
    fn see_also_names_the_page_above_and_the_configuration_page() {
        let cmd = clap::Command::new("iopages")
            .subcommand(clap::Command::new("serve"))
            .subcommand(clap::Command::new("luks").subcommand(clap::Command::new("format")));
        let pages = pages_of(cmd);
        let names: Vec<&str> = pages.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "iopages",
                "iopages-serve",
                "iopages-luks",
                "iopages-luks-format"
            ]
        );
        let text = |i: usize| String::from_utf8(pages[i].roff.clone()).unwrap();
        assert!(
            text(0).contains(".SH \"SEE ALSO\"\n\\fBiopages.toml\\fR(5)"),
            "{}",
            text(0)
        );
        assert!(text(1).contains("\\fBiopages\\fR(1), \\fBiopages.toml\\fR(5)"));
        assert!(text(3).contains("\\fBiopages\\-luks\\fR(1), \\fBcryptsetup\\fR(8)"));
    }
}
