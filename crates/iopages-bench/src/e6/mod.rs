//! E6: the encrypting NBD server (`iopages serve --image`) against the
//! LUKS servers users would run instead — nbdkit with its luks filter and
//! qemu-nbd with qemu's LUKS driver — each serving the same LUKS1 image
//! over a Unix socket, loaded by fio's nbd engine and by nbdcopy; and the
//! runs built on the same parts: over a remote store (`remote`), the
//! sparse copy (`sparse`), many tenants (`tenants`), the store's outage
//! (`outage`), authenticated volumes (`integrity`), a thousand idle
//! connections (`connections`) and the unencrypted ceiling (`ceiling`).
//!
//! Owns, by file, from the bottom (each names only the files above it in
//! this list):
//! - `common.rs`: `MIB`, E6's error, argument lists, a log's tail;
//! - `load.rs`: the loads (`Load`) and one measurement (`Sample`);
//! - `fio.rs`: fio's job lines (`Plan`), a run of fio and its JSON report;
//! - `tools.rs`: the outside programs, found and probed, and their
//!   one-line answers (size, payload offset, multi-conn);
//! - `files.rs`: the run's directories, the LUKS1 image, the copy's
//!   source and the `--tls` certificates;
//! - `server.rs`: each server's command line, its start on a socket, its
//!   stop;
//! - `measure.rs`: one timed load, one server's pass over every load with
//!   the read-back checks, and each server's results;
//! - `report.rs`: the table, the ratios and targets, the JSON report and
//!   the bars;
//! - `runs.rs`: `iopages bench nbd` itself — every server in turn, every
//!   run, then the report;
//! - `remote.rs` (with `remote/store.rs`), `sparse.rs`, `tenants.rs`,
//!   `connections.rs` (after `tenants.rs`), `ceiling.rs` (after
//!   `remote.rs`), `outage.rs` and `integrity.rs` (plain, hmac-sha256 and aead LUKS2
//!   volumes on one store, against the CPU bound of the MAC): the other
//!   E6 runs, each sharing the parts above by design (the same loads,
//!   image, servers and report helpers).
//!
//! Must never: measure a server whose I/O failed — a fio job's error, a
//! tool's exit status, a failed read-back or a server that died marks the
//! server as failed, its figures are left out and the run ends in an error
//! after the report is written; nor leave a child process or a temporary
//! file behind, on any path.

pub mod ceiling;
pub(crate) mod common;
pub mod connections;
pub(crate) mod files;
pub(crate) mod fio;
pub mod integrity;
pub(crate) mod load;
pub(crate) mod measure;
pub mod outage;
pub mod remote;
pub(crate) mod report;
pub(crate) mod runs;
pub(crate) mod server;
pub mod sparse;
pub mod tenants;
pub(crate) mod tools;
