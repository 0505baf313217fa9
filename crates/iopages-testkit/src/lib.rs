//! Dev-only support shared by iopages' integration tests and its
//! benchmarks (`iopages-bench`): finding outside tools, supervising child
//! processes, and temporary directories.
//!
//! Owns: the one rule for a missing outside tool (a skip with a message
//! locally, a failure under `CI=true`, where scripts/setup-debian.sh has
//! installed them all), the kill-on-drop child, running a tool to
//! completion under a timeout, waiting for a server's socket, and the
//! removed-on-drop directory. Must never: be a dependency of the library
//! crates (iopages, iopages-crypt, iopages-nbd) other than as a
//! dev-dependency, or measure anything — timings belong to iopages-bench.
//!
//! Modules: `tools` (`find_tool`, `need_tool`, `ci`), `process`
//! (`Reaped`, `run_tool`, `wait_for_socket`, `stop`, `lines_of`) and
//! `dir` (`TempDir`).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod dir;
pub mod hostile;

pub use dir::TempDir;
/// Outside tools, child processes and test certificates: `iopages-tools`',
/// where the benchmarks find them.
pub use iopages_tools::{
    ci, die_with_parent, find_tool, lines_of, need_tool, pki, process, run_tool, signal, stop,
    tail_lines, tools, wait_for_socket, write_pki, write_psk, Pki, Ran, Reaped,
};
