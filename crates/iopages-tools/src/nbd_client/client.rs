//! The client side: a raw NBD client over any byte stream (TCP, a Unix
//! socket, a TLS stream after STARTTLS), one step at a time — the
//! greeting, the client's flags, options and their replies, requests
//! with any flags and cookies, simple replies and structured reply
//! chunks — and raw bytes for the tests that send garbage.
//!
//! Two kinds of method: the wire steps return `io::Result` (the hostile
//! peers and the benchmark use them, and a test that expects the server
//! to close the connection looks at the error); the conveniences a test
//! calls by the hundred (`option`, `request`, `write`, `read`,
//! `command`, `reply_error`, `disconnect`) panic on an I/O error or a
//! reply that breaks the protocol, and return what the server said.
//!
//! Owns: its stream, its next cookie and the lengths of its READs not yet
//! answered (a simple reply does not say how much data follows). Must
//! never: hide what the server sent — every reply is handed back whole —
//! or send anything the caller did not ask for.

use super::wire::*;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::ops::{Deref, DerefMut};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The read timeout of [`Client::tcp`] and [`Client::unix`]: a server
/// that stops answering fails the test instead of hanging it.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest option reply [`Client::read_option_reply`] reads.
pub const OPT_REPLY_MAX_BYTES: u32 = 1 << 20;

/// What NBD_OPT_GO or NBD_OPT_INFO said about an export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Export {
    /// Its size in bytes (NBD_INFO_EXPORT).
    pub size: u64,
    /// Its transmission flags.
    pub flags: u16,
    /// Minimum, preferred and maximum block size (NBD_INFO_BLOCK_SIZE;
    /// zeros when the server sent none).
    pub block_sizes: [u32; 3],
}

/// A simple reply: its cookie, its NBD error (0: success; the values are
/// Linux errno numbers) and, for a successful READ, the data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The request's cookie.
    pub cookie: u64,
    /// 0, or an errno (EIO 5, ENOMEM 12, EINVAL 22, ENOSPC 28, …).
    pub error: u32,
    /// The data of a successful READ; empty otherwise.
    pub data: Vec<u8>,
}

/// A raw NBD client over the stream `S`.
pub struct Client<S = TcpStream> {
    stream: S,
    handshake_flags: u16,
    next_cookie: u64,
    reads: HashMap<u64, u32>,
}

impl Client<TcpStream> {
    /// Connected to `addr` over TCP ([`TEST_TIMEOUT`] on reads), past
    /// [`Client::start`].
    ///
    /// **Panics:** if it cannot connect or the greeting is not newstyle.
    pub fn tcp(addr: impl ToSocketAddrs) -> Client<TcpStream> {
        let s = TcpStream::connect(addr).expect("connect to the NBD server");
        s.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
        Client::start(s)
    }
}

impl Client<UnixStream> {
    /// Connected to the Unix socket `path` ([`TEST_TIMEOUT`] on reads),
    /// past [`Client::start`].
    ///
    /// **Panics:** if it cannot connect or the greeting is not newstyle.
    pub fn unix(path: &Path) -> Client<UnixStream> {
        let s = UnixStream::connect(path).expect("connect to the NBD socket");
        s.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
        Client::start(s)
    }
}

impl<S: Read + Write> Client<S> {
    /// A client on `stream` as it is: nothing read or sent (a stream past
    /// the greeting already, a TLS stream after STARTTLS, or one a test
    /// sends garbage on).
    pub fn new(stream: S) -> Client<S> {
        Client {
            stream,
            handshake_flags: 0,
            next_cookie: 1,
            reads: HashMap::new(),
        }
    }

    /// A client on `stream` with the server's greeting read.
    ///
    /// **Returns:** Err for a closed stream or a greeting that is not
    /// newstyle (InvalidData).
    pub fn greet(mut stream: S) -> io::Result<Client<S>> {
        let mut g = [0u8; GREETING_BYTES];
        stream.read_exact(&mut g)?;
        let flags = parse_greeting(&g)?;
        let mut c = Client::new(stream);
        c.handshake_flags = flags;
        Ok(c)
    }

    /// [`Client::greet`], then the client's flags: fixed newstyle, no
    /// zeroes — the start of every ordinary test connection.
    ///
    /// **Panics:** on an I/O error or a greeting that is not newstyle.
    pub fn start(stream: S) -> Client<S> {
        let mut c = Client::greet(stream).expect("the server's greeting");
        c.send_client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
            .expect("send the client flags");
        c
    }

    /// The handshake flags of the greeting (0 if it was not read here).
    pub fn handshake_flags(&self) -> u16 {
        self.handshake_flags
    }

    /// The stream (for timeouts or socket options).
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

    /// Read exactly `n` bytes.
    pub fn read_raw(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; n];
        self.stream.read_exact(&mut v)?;
        Ok(v)
    }

    /// Send the client's flags (any value: tests send unknown ones).
    pub fn send_client_flags(&mut self, flags: u32) -> io::Result<()> {
        self.stream.write_all(&flags.to_be_bytes())
    }

    /// Send one option: IHAVEOPT, `option`, `data`'s length, `data`.
    pub fn send_option(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        self.stream.write_all(&option_bytes(option, data))
    }

    /// The next option reply.
    ///
    /// **Returns:** Err (InvalidData) for a bad magic or data longer than
    /// [`OPT_REPLY_MAX_BYTES`]; the stream's errors.
    pub fn read_option_reply(&mut self) -> io::Result<OptReply> {
        let mut h = [0u8; OPT_REPLY_HEADER_BYTES];
        self.stream.read_exact(&mut h)?;
        if be64(&h) != OPT_REPLY_MAGIC {
            return Err(invalid("bad option reply magic"));
        }
        let len = be32(&h[16..]);
        if len > OPT_REPLY_MAX_BYTES {
            return Err(invalid(format!("an option reply of {len} bytes")));
        }
        Ok(OptReply {
            option: be32(&h[8..]),
            kind: be32(&h[12..]),
            data: self.read_raw(len as usize)?,
        })
    }

    /// Send `option`; every reply up to and including the final one (an
    /// ACK or an error).
    ///
    /// **Panics:** on an I/O error, or a reply naming another option.
    pub fn option(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.send_option(option, data).expect("send an option");
        let mut v = Vec::new();
        loop {
            let r = self.read_option_reply().expect("an option reply");
            assert_eq!(r.option, option, "a reply to another option");
            let done = r.is_final();
            v.push(r);
            if done {
                return v;
            }
        }
    }

    /// NBD_OPT_LIST: the names of the exports the server lists.
    ///
    /// **Panics:** as [`Client::option`], or for a malformed
    /// NBD_REP_SERVER.
    pub fn list(&mut self) -> Vec<String> {
        self.option(OPT_LIST, &[])
            .into_iter()
            .filter(|r| r.kind == REP_SERVER)
            .map(|r| {
                let n = be32(&r.data) as usize;
                String::from_utf8(r.data[4..4 + n].to_vec()).expect("a UTF-8 name")
            })
            .collect()
    }

    /// NBD_OPT_STRUCTURED_REPLY, acknowledged.
    ///
    /// **Panics:** unless the server answers with one ACK.
    pub fn structured_replies(&mut self) {
        let r = self.option(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(r[0].kind, REP_ACK, "structured replies refused");
    }

    /// `option` (NBD_OPT_GO or NBD_OPT_INFO) for `name`, asking for
    /// `infos`: what the replies said, or the error reply.
    ///
    /// **Panics:** on an I/O error.
    pub fn export_info(
        &mut self,
        option: u32,
        name: &str,
        infos: &[u16],
    ) -> Result<Export, OptReply> {
        self.send_option(option, &info_data(name, infos))
            .expect("send an option");
        self.export_replies(option)
            .expect("the replies about an export")
    }

    /// NBD_OPT_GO for `name` asking for `infos`: into transmission.
    ///
    /// **Returns:** the export; Err for an error reply — NotFound for
    /// NBD_REP_ERR_UNKNOWN, PermissionDenied for ERR_POLICY and
    /// ERR_TLS_REQD, its message in the error's text — no size, or the
    /// stream's errors.
    pub fn go(&mut self, name: &str, infos: &[u16]) -> io::Result<Export> {
        self.send_option(OPT_GO, &info_data(name, infos))?;
        self.export_replies(OPT_GO)?.map_err(|r| refusal(name, &r))
    }

    /// The replies to NBD_OPT_GO or NBD_OPT_INFO up to the final one.
    fn export_replies(&mut self, option: u32) -> io::Result<Result<Export, OptReply>> {
        let (mut e, mut sized) = (Export::default(), false);
        loop {
            let r = self.read_option_reply()?;
            if r.option != option {
                return Err(invalid(format!("reply to option {}", r.option)));
            }
            match (r.kind, r.info_type()) {
                (REP_ACK, _) if sized => return Ok(Ok(e)),
                (REP_ACK, _) => return Err(io::Error::other("the export's size never came")),
                (REP_INFO, Some(INFO_EXPORT)) if r.data.len() >= 12 => {
                    (e.size, e.flags, sized) = (be64(&r.data[2..]), be16(&r.data[10..]), true);
                }
                (REP_INFO, Some(INFO_BLOCK_SIZE)) if r.data.len() >= 14 => {
                    for (i, b) in e.block_sizes.iter_mut().enumerate() {
                        *b = be32(&r.data[2 + 4 * i..]);
                    }
                }
                (REP_INFO, _) => {}
                _ if r.is_final() => return Ok(Err(r)),
                (k, _) => return Err(invalid(format!("reply {k:#x} about an export"))),
            }
        }
    }

    /// Send one request and its payload (a WRITE's bytes; nothing for
    /// others, unless a test means to send garbage).
    pub fn send_request(&mut self, request: Request, payload: &[u8]) -> io::Result<()> {
        let mut v = request.to_bytes().to_vec();
        v.extend_from_slice(payload);
        self.stream.write_all(&v)?;
        if request.command == CMD_READ {
            self.reads.insert(request.cookie, request.length);
        }
        Ok(())
    }

    /// Send `command` with `flags` at `offset` for `length`, `payload`
    /// after it, under this client's next cookie.
    ///
    /// **Returns:** the cookie.
    pub fn send(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<u64> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let request = Request {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        self.send_request(request, payload)?;
        Ok(cookie)
    }

    /// The next simple reply's header: (error, cookie); a READ's data is
    /// left on the stream.
    ///
    /// **Returns:** Err (InvalidData) for another magic.
    pub fn read_simple_reply(&mut self) -> io::Result<(u32, u64)> {
        let mut h = [0u8; SIMPLE_REPLY_BYTES];
        self.stream.read_exact(&mut h)?;
        if be32(&h) != SIMPLE_REPLY_MAGIC {
            return Err(invalid("not a simple reply"));
        }
        Ok((be32(&h[4..]), be64(&h[8..])))
    }

    /// The next simple reply, with its data when it answers a READ this
    /// client sent, without error.
    pub fn reply(&mut self) -> io::Result<Reply> {
        let (error, cookie) = self.read_simple_reply()?;
        let len = self.reads.remove(&cookie).unwrap_or(0);
        let mut data = Vec::new();
        if error == 0 && len > 0 {
            data = self.read_raw(len as usize)?;
        }
        Ok(Reply {
            cookie,
            error,
            data,
        })
    }

    /// The next structured reply chunk (header and payload).
    ///
    /// **Returns:** Err (InvalidData) for another magic.
    pub fn read_chunk(&mut self) -> io::Result<Chunk> {
        let mut h = [0u8; STRUCTURED_REPLY_BYTES];
        self.stream.read_exact(&mut h)?;
        if be32(&h) != STRUCTURED_REPLY_MAGIC {
            return Err(invalid("not a structured reply chunk"));
        }
        self.chunk_after(&h[4..])
    }

    /// A chunk whose magic was read: the rest of its header is `rest`.
    fn chunk_after(&mut self, rest: &[u8]) -> io::Result<Chunk> {
        let (flags, kind, cookie) = (be16(rest), be16(&rest[2..]), be64(&rest[4..]));
        let payload = self.read_raw(be32(&rest[12..]) as usize)?;
        if flags & REPLY_FLAG_DONE != 0 {
            self.reads.remove(&cookie);
        }
        Ok(Chunk {
            flags,
            kind,
            cookie,
            payload,
        })
    }

    /// The next reply whichever kind it is (by its magic): a simple
    /// reply's header, or one whole chunk.
    pub fn read_any_reply(&mut self) -> io::Result<AnyReply> {
        let mut magic = [0u8; 4];
        self.stream.read_exact(&mut magic)?;
        match u32::from_be_bytes(magic) {
            SIMPLE_REPLY_MAGIC => {
                let rest = self.read_raw(SIMPLE_REPLY_BYTES - 4)?;
                Ok(AnyReply::Simple {
                    error: be32(&rest),
                    cookie: be64(&rest[4..]),
                })
            }
            STRUCTURED_REPLY_MAGIC => {
                let rest = self.read_raw(STRUCTURED_REPLY_BYTES - 4)?;
                Ok(AnyReply::Chunk(self.chunk_after(&rest)?))
            }
            m => Err(invalid(format!("reply magic {m:#x}"))),
        }
    }

    /// One request waited for: sent under the next cookie, its simple
    /// reply (with a READ's data) read.
    ///
    /// **Panics:** on an I/O error, or a reply to another cookie.
    pub fn request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Reply {
        let cookie = self
            .send(command, flags, offset, length, payload)
            .expect("send a request");
        let r = self.reply().expect("a simple reply");
        assert_eq!(r.cookie, cookie, "a reply to another cookie");
        r
    }

    /// A WRITE of `data` at `offset` with `flags`: its error (0: written).
    ///
    /// **Panics:** as [`Client::request`].
    pub fn write(&mut self, offset: u64, data: &[u8], flags: u16) -> u32 {
        self.request(CMD_WRITE, flags, offset, data.len() as u32, data)
            .error
    }

    /// A READ of `length` bytes at `offset`: the data, or the error.
    ///
    /// **Panics:** as [`Client::request`].
    pub fn read(&mut self, offset: u64, length: u32) -> Result<Vec<u8>, u32> {
        let r = self.request(CMD_READ, 0, offset, length, &[]);
        match r.error {
            0 => Ok(r.data),
            e => Err(e),
        }
    }

    /// A command without payload (FLUSH, TRIM, WRITE_ZEROES, …) with
    /// `flags`: its error (0: done).
    ///
    /// **Panics:** as [`Client::request`].
    pub fn command(&mut self, command: u16, flags: u16, offset: u64, length: u32) -> u32 {
        self.request(command, flags, offset, length, &[]).error
    }

    /// The reply to a request without reply data on a connection with
    /// structured replies: 0 for a simple success, else the errno of the
    /// one final error chunk.
    ///
    /// **Panics:** on an I/O error, a reply to another cookie, or a chunk
    /// that is not a final error.
    pub fn reply_error(&mut self, cookie: u64) -> u32 {
        match self.read_any_reply().expect("a reply") {
            AnyReply::Simple { error, cookie: c } => {
                assert_eq!(c, cookie, "a reply to another cookie");
                error
            }
            AnyReply::Chunk(ch) => {
                assert_eq!(ch.cookie, cookie, "a reply to another cookie");
                assert_eq!(ch.kind, REPLY_TYPE_ERROR, "an error chunk");
                assert_ne!(ch.flags & REPLY_FLAG_DONE, 0, "the final chunk");
                ch.error().expect("an error chunk's errno")
            }
        }
    }

    /// Send NBD_CMD_DISC (best effort: the stream may be gone).
    pub fn send_disconnect(&mut self) -> io::Result<()> {
        self.send(CMD_DISC, 0, 0, 0, &[]).map(drop)
    }

    /// NBD_CMD_DISC, then the server closes the connection.
    ///
    /// **Panics:** if the send fails or the server sends anything.
    pub fn disconnect(mut self) {
        self.send_disconnect().expect("send NBD_CMD_DISC");
        let mut b = [0u8; 1];
        let n = self.stream.read(&mut b).expect("the end of the stream");
        assert_eq!(n, 0, "the server closes after DISC");
    }

    /// Whether the server has closed the connection: the end of the
    /// stream or an error (a reset) — not a read timeout, and not a byte.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        match self.stream.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        }
    }

    /// This client, sending NBD_CMD_DISC when dropped.
    pub fn disconnect_on_drop(self) -> Polite<S> {
        Polite(Some(self))
    }
}

/// An option's error reply as an io::Error (for [`Client::go`]).
fn refusal(name: &str, r: &OptReply) -> io::Error {
    let kind = match r.kind {
        REP_ERR_UNKNOWN => io::ErrorKind::NotFound,
        REP_ERR_POLICY | REP_ERR_TLS_REQD => io::ErrorKind::PermissionDenied,
        _ => io::ErrorKind::Other,
    };
    let msg = String::from_utf8_lossy(&r.data);
    io::Error::new(
        kind,
        format!("NBD_OPT_GO {name:?} refused (reply {:#x}): {msg}", r.kind),
    )
}

/// A [`Client`] that sends NBD_CMD_DISC when dropped (the way a polite
/// client ends): everything else through `Deref`.
pub struct Polite<S: Read + Write>(Option<Client<S>>);

impl<S: Read + Write> Deref for Polite<S> {
    type Target = Client<S>;
    fn deref(&self) -> &Client<S> {
        self.0.as_ref().expect("present until dropped")
    }
}

impl<S: Read + Write> DerefMut for Polite<S> {
    fn deref_mut(&mut self) -> &mut Client<S> {
        self.0.as_mut().expect("present until dropped")
    }
}

impl<S: Read + Write> Drop for Polite<S> {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.send_disconnect();
        }
    }
}
