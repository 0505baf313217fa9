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
//! (`write_pki`, `write_psk`, `Pki`), `rng` (`XorShift`, the reproducible
//! generator of test data), `nbd_client` (the one raw NBD client
//! of the tests and the hostile peers, and the scripted server side of the
//! tests' fake stores: the wire format written from the protocol, not
//! taken from iopages-nbd) and `hostile` (the hostile peers and the polite
//! client of E6's tenants row and the many-tenant tests).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod hostile;
pub mod nbd_client;
pub mod pki;
pub mod process;
pub mod rng;
pub mod tools;

pub use pki::{write_pki, write_psk, Pki};
pub use process::{
    die_with_parent, lines_of, run_tool, signal, stop, tail_lines, wait_for_socket, Ran, Reaped,
};
pub use rng::XorShift;
pub use tools::{ci, find_tool, need_tool};
