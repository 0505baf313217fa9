//! Outside tools and processes for iopages' benchmarks and tests: what
//! `iopages bench` needs at run time, shared with the integration tests
//! (through `iopages-testkit`, which re-exports it).
//!
//! Owns: the one rule for a missing outside tool (a skip with a message
//! locally, a failure under `CI=true`, where scripts/setup-debian.sh has
//! installed them all), the kill-on-drop child, running a tool to
//! completion under a timeout, waiting for a server's socket, the test
//! certificates and PSK files of TLS runs, and the hostile NBD peers of
//! E6's tenants row. Must never: be a dependency of the library crates
//! (iopages, iopages-crypt, iopages-nbd) other than as a dev-dependency,
//! or measure anything — timings belong to iopages-bench.
//!
//! Modules: `tools` (`find_tool`, `need_tool`, `ci`), `process`
//! (`Reaped`, `run_tool`, `wait_for_socket`, `stop`, `lines_of`), `pki`
//! (`write_pki`, `write_psk`, `Pki`) and `hostile` (the peers; its source
//! is `iopages-testkit/src/hostile.rs`, compiled here too so that the
//! benchmark does not depend on the test-only crate).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

#[path = "../../iopages-testkit/src/hostile.rs"]
pub mod hostile;
pub mod pki;
pub mod process;
pub mod tools;

pub use pki::{write_pki, write_psk, Pki};
pub use process::{
    die_with_parent, lines_of, run_tool, signal, stop, tail_lines, wait_for_socket, Ran, Reaped,
};
pub use tools::{ci, find_tool, need_tool};
