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
//!
//! NBD peers: `nbd_client` is the tests' one raw NBD client (and the
//! scripted server side of their fake stores), an implementation of the
//! wire format independent of iopages-nbd, so that tests check the server
//! and the remote client against it; `hostile` starts the hostile peers
//! and the polite client of the many-tenant tests over it.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod dir;
pub mod hostile;
pub mod nbd_client;
pub mod process;
pub mod tools;

pub use dir::TempDir;
pub use process::{
    die_with_parent, lines_of, run_tool, signal, stop, tail_lines, wait_for_socket, Ran, Reaped,
};
pub use tools::{ci, find_tool, need_tool};
