//! The server layer: everything between an accepted socket and the crypt
//! queue — the listeners and the threads that serve them, the handshake,
//! transmission, the exports, and the limits shared among peers.
//!
//! Owns: the listeners, one thread per acceptor, and server-wide shutdown
//! (`serve.rs`); connections waiting for their clients (in the handshake,
//! between requests or partway through one) held without a thread in one
//! epoll instance, and the watcher threads (one per core) that serve them
//! when they come back (`park.rs`), each with a read buffer it keeps
//! between connections (`inbuf.rs`); option haggling up to GO or
//! EXPORT_NAME, resumed where the client's bytes stopped (`handshake.rs`); transmission — requests, replies, the
//! in-flight accounting and the byte budget of a connection (`conn.rs`), and a
//! request received in part, kept while its connection parks (`partial.rs`);
//! the exports and their lazy opening (`export.rs`), the device a request
//! reaches (`device.rs`) and its payload buffers (`buffers.rs`); who a
//! client is and the `allow` rules (`peer.rs`); fair shares of the
//! server's limits among peers (`shares.rs`, `shares/`); an export's rate
//! limits (`rate.rs`); long work (a lazy export's opening) queued off the
//! watchers on a thread of its own (`longwork.rs`).
//!
//! Must never: name the remote client (`client/`), make a system call
//! except through `sys`, or know whether a connection runs TLS beyond
//! asking its [`Transport`](crate::transport::nonblocking::Transport) (STARTTLS swaps
//! the session in underneath). The threads live in `serve.rs` and
//! `conn.rs` (and the parking lot's watchers and keeper in `park.rs`): an event loop
//! replacing them changes those files, not the layout.
//!
//! Depends on: `transport` (the connection's non-blocking socket), `tls`
//! (credentials, the identity a handshake proved), `proto`, `stats`,
//! `sys`, `error`.

pub(crate) mod buffers;
pub(crate) mod conn;
pub(crate) mod device;
pub(crate) mod export;
pub(crate) mod handshake;
pub(crate) mod inbuf;
pub(crate) mod longwork;
pub(crate) mod park;
pub(crate) mod partial;
pub(crate) mod peer;
pub(crate) mod rate;
pub(crate) mod serve;
pub(crate) mod shares;
