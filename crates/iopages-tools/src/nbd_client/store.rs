//! The server side, scripted: what a test's fake NBD store says to the
//! client under test (iopages-nbd's remote backend) — the greeting, the
//! client's options read and answered, requests read, simple replies
//! sent — and raw bytes for the stores that misbehave on purpose.
//!
//! Owns: its stream. Must never: answer anything on its own — a script
//! says every byte it sends, in order (a fake store's point is the
//! replies a real server would not send).

use super::wire::*;
use std::io::{self, Read, Write};

/// The size of the export [`Store::accept_go`] offers: 1 MiB.
pub const STORE_EXPORT_BYTES: u64 = 1 << 20;

/// A scripted NBD server's side of one connection.
pub struct Store<S> {
    stream: S,
}

impl<S: Read + Write> Store<S> {
    /// A store on an accepted `stream`; nothing sent yet.
    pub fn new(stream: S) -> Store<S> {
        Store { stream }
    }

    /// The stream (for timeouts).
    pub fn stream(&self) -> &S {
        &self.stream
    }

    /// The stream, to read or write it directly.
    pub fn stream_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    /// The stream back (to start TLS on it, say).
    pub fn into_stream(self) -> S {
        self.stream
    }

    /// Send `bytes` as they are.
    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Read exactly `n` bytes (a WRITE's payload, say).
    pub fn read_raw(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; n];
        self.stream.read_exact(&mut v)?;
        Ok(v)
    }

    /// Send the greeting (fixed newstyle, no zeroes) and read the
    /// client's flags.
    pub fn greet(&mut self) -> io::Result<u32> {
        self.stream
            .write_all(&greeting_bytes(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))?;
        let f = self.read_raw(4)?;
        Ok(be32(&f))
    }

    /// The client's next option: (option, data).
    ///
    /// **Returns:** Err (InvalidData) unless it starts with IHAVEOPT.
    pub fn read_option(&mut self) -> io::Result<(u32, Vec<u8>)> {
        let h = self.read_raw(OPTION_HEADER_BYTES)?;
        if be64(&h) != IHAVEOPT {
            return Err(invalid("an option without IHAVEOPT"));
        }
        let data = self.read_raw(be32(&h[12..]) as usize)?;
        Ok((be32(&h[8..]), data))
    }

    /// Send one option reply.
    pub fn reply_option(&mut self, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
        self.stream
            .write_all(&option_reply_bytes(option, kind, data))
    }

    /// Answer NBD_OPT_GO: NBD_INFO_EXPORT (`size`, `TFLAG_HAS_FLAGS |
    /// flags`), then ACK.
    pub fn answer_go(&mut self, size: u64, flags: u16) -> io::Result<()> {
        let info = info_export_data(size, TFLAG_HAS_FLAGS | flags);
        self.reply_option(OPT_GO, REP_INFO, &info)?;
        self.reply_option(OPT_GO, REP_ACK, &[])
    }

    /// [`Store::greet`] and the client's first option: (option, data).
    ///
    /// **Panics:** on an I/O error, or client flags other than fixed
    /// newstyle and no zeroes (what a client must send this greeting).
    pub fn greet_and_read_option(&mut self) -> (u32, Vec<u8>) {
        let f = self.greet().expect("the client's flags");
        assert_eq!(f, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, "client flags");
        self.read_option().expect("the client's first option")
    }

    /// The whole handshake up to transmission: greet, the client's
    /// NBD_OPT_GO, answered with a `size`-byte export and `flags`.
    ///
    /// **Panics:** on an I/O error, unexpected client flags, or a first
    /// option other than NBD_OPT_GO.
    pub fn accept_go(&mut self, size: u64, flags: u16) {
        let (option, _) = self.greet_and_read_option();
        assert_eq!(option, OPT_GO, "NBD_OPT_GO first");
        self.answer_go(size, flags).expect("answer NBD_OPT_GO");
    }

    /// The client's next request's header.
    ///
    /// **Returns:** Err (InvalidData) for a bad request magic.
    pub fn read_request(&mut self) -> io::Result<Request> {
        let mut r = [0u8; REQUEST_BYTES];
        self.stream.read_exact(&mut r)?;
        Request::parse(&r)
    }

    /// The client's last request: NBD_CMD_DISC.
    ///
    /// **Panics:** on an I/O error or another request.
    pub fn expect_disconnect(&mut self) {
        let r = self.read_request().expect("the client's NBD_CMD_DISC");
        assert_eq!(r.command, CMD_DISC, "NBD_CMD_DISC last");
    }

    /// Send a simple reply to `cookie` with `error`, `data` after it (a
    /// READ's, or part of it).
    pub fn simple_reply(&mut self, error: u32, cookie: u64, data: &[u8]) -> io::Result<()> {
        let mut v = simple_reply_bytes(error, cookie).to_vec();
        v.extend_from_slice(data);
        self.stream.write_all(&v)
    }
}
