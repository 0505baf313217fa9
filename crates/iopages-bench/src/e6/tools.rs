//! The outside programs E6 runs, found and probed once per run, and what
//! their one-line answers say.
//!
//! Owns: [`Tools`] (cryptsetup, fio with its nbd engine, nbdcopy, nbdinfo,
//! and the peers' nbdkit with its luks filter and qemu-nbd; found for E6
//! remote too), [`probe`] (a tool's feature), the parsing of `nbdinfo
//! --size` and `cryptsetup luksDump`, and the multi-conn question. Must never: install a tool — a missing one is an error that
//! names the Debian package.

use super::common::{os, workload};
use crate::BenchError;
use iopages_tools::{find_tool, run_tool};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The outside programs E6 runs (the peers' only when they run).
pub(crate) struct Tools {
    pub(crate) cryptsetup: PathBuf,
    pub(crate) fio: PathBuf,
    pub(crate) nbdcopy: PathBuf,
    pub(crate) nbdinfo: PathBuf,
    pub(crate) nbdkit: PathBuf,
    pub(crate) qemu_nbd: PathBuf,
}

impl Tools {
    pub(super) fn find(dir: &Path, peers: bool) -> Result<Tools, BenchError> {
        Tools::find_as(
            dir,
            peers.then_some("a peer server, with its luks filter"),
            peers,
        )
        .map_err(workload)
    }

    /// Finds cryptsetup, fio, nbdcopy and nbdinfo, then nbdkit where
    /// `nbdkit` says what it is for and qemu-nbd with `qemu` (else their
    /// names stand in; nothing starts them); then probes fio's nbd engine
    /// and, with nbdkit, its luks filter (E6 and E6 remote).
    pub(crate) fn find_as(dir: &Path, nbdkit: Option<&str>, qemu: bool) -> Result<Tools, String> {
        let t = Tools {
            cryptsetup: need("cryptsetup", "cryptsetup-bin", "it formats the LUKS1 image")?,
            fio: need("fio", "fio", "its nbd engine is the load")?,
            nbdcopy: need("nbdcopy", "libnbd-bin", "the copy load")?,
            nbdinfo: need("nbdinfo", "libnbd-bin", "it checks each export")?,
            nbdkit: match nbdkit {
                Some(why) => need("nbdkit", "nbdkit", why)?,
                None => PathBuf::from("nbdkit"),
            },
            qemu_nbd: if qemu {
                need(
                    "qemu-nbd",
                    "qemu-utils",
                    "a peer server, with qemu's LUKS driver",
                )?
            } else {
                PathBuf::from("qemu-nbd")
            },
        };
        probe(
            dir,
            &t.fio,
            &[&"--enghelp=nbd"],
            "this fio has no nbd engine (fio built with libnbd is needed)",
        )?;
        if nbdkit.is_some() {
            probe(
                dir,
                &t.nbdkit,
                &[&"--filter=luks", &"null", &"--dump-plugin"],
                "nbdkit's luks filter is missing",
            )?;
        }
        Ok(t)
    }

    /// The tools by their names alone, none looked for (the tests').
    #[cfg(test)]
    pub(crate) fn named() -> Tools {
        Tools {
            cryptsetup: "cryptsetup".into(),
            fio: "fio".into(),
            nbdcopy: "nbdcopy".into(),
            nbdinfo: "nbdinfo".into(),
            nbdkit: "nbdkit".into(),
            qemu_nbd: "qemu-nbd".into(),
        }
    }
}

/// `name` on the `PATH`; else why not (`why`: what E6 runs it for), with
/// the Debian package `pkg` that has it.
fn need(name: &str, pkg: &str, why: &str) -> Result<PathBuf, String> {
    find_tool(name).ok_or_else(|| {
        format!(
            "{name} is not installed ({why}); scripts/setup-debian.sh installs it (Debian package {pkg})"
        )
    })
}

/// Runs `prog args` in `dir`, which must succeed; else `what` (the
/// missing feature) is the error.
pub(crate) fn probe(
    dir: &Path,
    prog: &Path,
    args: &[&dyn AsRef<OsStr>],
    what: &str,
) -> Result<(), String> {
    let ok = run_tool(prog, &os(args), dir, Duration::from_secs(30), &[])
        .map(|r| r.status.success())
        .unwrap_or(false);
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what}; scripts/setup-debian.sh installs the Debian packages that have it"
        ))
    }
}

/// `nbdinfo --size`: one number.
pub(crate) fn parse_size(stdout: &str) -> Option<u64> {
    stdout.trim().parse().ok()
}

/// `cryptsetup luksDump`'s payload offset, in bytes.
pub(crate) fn parse_payload_offset(dump: &str) -> Option<u64> {
    dump.lines()
        .find_map(|l| l.trim().strip_prefix("Payload offset:"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|sectors| sectors * 512)
}

/// Whether the server behind `uri` advertises multi-conn (`None`: nbdinfo
/// could not say).
pub(super) fn multi_conn(tools: &Tools, uri: &str, work: &Path) -> Option<bool> {
    run_tool(
        &tools.nbdinfo,
        &os(&[&"--can", &"multi-conn", &uri]),
        work,
        Duration::from_secs(30),
        &[],
    )
    .ok()
    .and_then(|c| match c.status.code() {
        Some(0) => Some(true),
        Some(2) => Some(false),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_luks_dump_and_nbdinfo() {
        let dump = "LUKS header information for img\n\nVersion:       \t1\nCipher name:   \taes\nCipher mode:   \txts-plain64\nHash spec:     \tsha256\nPayload offset:\t4096\nMK bits:       \t512\n";
        assert_eq!(parse_payload_offset(dump), Some(2 << 20));
        assert_eq!(parse_payload_offset("Version: 2\n"), None);
        assert_eq!(parse_size("134217728\n"), Some(134_217_728));
        assert_eq!(parse_size("nbdinfo: error\n"), None);
    }
}
