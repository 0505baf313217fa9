//! Test-only support for iopages' integration tests: temporary
//! directories, and the run-time helpers of `iopages-tools` re-exported
//! under the names the tests use.
//!
//! Owns: the removed-on-drop directory (`dir`, [`TempDir`]). Must never:
//! be anything but a dev-dependency (the `iopages` binary does not link
//! it: `tests/shape.rs` checks every `Cargo.toml`), or measure anything —
//! timings belong to iopages-bench.
//!
//! Re-exported from `iopages-tools`, which the benchmarks use at run time
//! too: the one rule for a missing outside tool (`tools`), child processes
//! (`process`), test certificates (`pki`), the tests' one raw NBD client
//! (`nbd_client`: an implementation of the wire format independent of
//! iopages-nbd, so tests check the server and the remote client against
//! it; `tests/one_client.rs` keeps it the only one) and the hostile peers
//! of the many-tenant tests (`hostile`).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod dir;

pub use dir::TempDir;
/// Outside tools, child processes, test certificates and NBD peers:
/// `iopages-tools`', where the benchmarks find them.
pub use iopages_tools::{
    ci, die_with_parent, find_tool, hostile, lines_of, nbd_client, need_tool, pki, process,
    run_tool, signal, stop, tail_lines, tools, wait_for_socket, write_pki, write_psk, Pki, Ran,
    Reaped, XorShift,
};
