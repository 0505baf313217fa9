//! The one raw NBD peer of iopages' tests: a client that speaks the
//! newstyle fixed handshake and transmission a step at a time, the
//! scripted server side fake stores use, and the wire format both share.
//! Every test file that speaks NBD by hand goes through it
//! (tests/one_client.rs fails when one writes the handshake again).
//!
//! An independent implementation, on purpose: this crate does not depend
//! on iopages-nbd, and these modules are written from the protocol's
//! specification, not from the server's `proto` module — a server test
//! that encoded its requests with the server's own encoder could not see
//! the server get the format wrong, nor could a remote-client test that
//! scripted its store with the client's own decoder.
//!
//! Modules: `wire` (every constant, written once here; the byte layouts
//! of greeting, options, option replies, requests, simple replies and
//! chunks), `client` ([`Client`]: connect over TCP or a Unix socket or
//! any stream, greeting, raw or malformed options, GO/INFO/LIST/
//! EXPORT_NAME/STRUCTURED_REPLY/STARTTLS/ABORT, requests with flags,
//! simple replies and parsed chunks, raw bytes) and `store` ([`Store`]:
//! a fake server's greeting, options read and answered, requests read,
//! replies sent).
//!
//! Owns: the NBD wire format in the test code. Must never: depend on
//! iopages-nbd, or paper over what a peer sent — replies are handed back
//! whole for the tests to check.

mod client;
mod store;
mod wire;

pub use client::{Client, Export, Polite, Reply, OPT_REPLY_MAX_BYTES, TEST_TIMEOUT};
pub use store::{Store, STORE_EXPORT_BYTES};
pub use wire::*;
