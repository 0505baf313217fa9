//! The newstyle fixed handshake: greeting, client flags, option haggling,
//! as a state machine ([`Handshake`]) that takes what the client has sent
//! and stops where the rest has not arrived (its connection then waits in
//! the parking lot without a thread).
//!
//! Owns: answering NBD_OPT_STARTTLS (upgrading the session to TLS when
//! the server has credentials), NBD_OPT_STRUCTURED_REPLY and the
//! metadata contexts (NBD_OPT_LIST_META_CONTEXT / SET_META_CONTEXT, one
//! context: `base:allocation`; both forgotten again by a later STARTTLS,
//! as `proto.md` requires), NBD_OPT_EXPORT_NAME,
//! NBD_OPT_ABORT, NBD_OPT_LIST (the exports the client may use),
//! NBD_OPT_INFO and NBD_OPT_GO (the export named, the first for the empty
//! name, opened first if it is opened lazily), and refusing every other
//! option with NBD_REP_ERR_UNSUP; who the client is for the exports'
//! `allow` rules (re-read after STARTTLS: the TLS identity) and its move
//! from the handshake pool into its peer's share of connections, before
//! GO's reply. Must never: enter transmission for an unknown export name,
//! an export the client is not allowed, or, when TLS is required, without
//! TLS; open a lazy export for a client not allowed to use it; tell a
//! client whether an export it may not use exists (it is "unknown"); read
//! an option's data without a bound; take longer than
//! the handshake deadline in all (one deadline for the whole handshake,
//! however slowly the client sends); quote more than a short, escaped
//! prefix of a client's export name back; or go on after a bad magic or
//! unknown client flags (the connection is closed).

use crate::proto::*;
use crate::server::export::Catalog;
use crate::server::partial;
use crate::server::peer::{Origin, Peer};
use crate::server::shares::Slot;
use crate::stats::Counters;
use crate::tls::config::{TlsConfig, TlsMode};
use crate::transport::nonblocking::Transport;
use crate::ExportInfo;
use std::io::{self, Read, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Option data larger than this is discarded and refused (TOO_BIG).
pub const MAX_OPTION_BYTES: u32 = 64 << 10;
/// Option data larger than this closes the connection instead (reading
/// it just to discard it would let a client keep the server busy).
const MAX_DISCARD_BYTES: u32 = 16 << 20;
/// At most this many bytes of a client's export name are quoted back in
/// an error message.
const MAX_QUOTED_NAME_BYTES: usize = 64;

/// What a handshake works with.
pub(crate) struct HsEnv<'a> {
    pub(crate) exports: &'a Catalog,
    pub(crate) tls: Option<&'a TlsConfig>,
    /// The server's counters (authorization refusals).
    pub(crate) counters: &'a Counters,
}

/// How a handshake step ended.
pub(crate) enum Outcome {
    /// Enter transmission on the export at this index of the catalog
    /// with what was negotiated.
    Transmission(Negotiated, usize),
    /// Close the connection (abort, bad magic, unknown export, …).
    Close,
    /// The option just received names the lazy export at this index,
    /// not opened yet: open it off the watchers (a key derivation), then
    /// step again to answer it.
    Open(usize),
    /// The step took its share of frames ([`OPTIONS_PER_STEP`]) and the
    /// handshake goes on: step again after the other connections ready
    /// meanwhile.
    Again,
    /// Replies the socket has not taken: step again once it has room
    /// (nothing more is read from the client until they have left).
    Backlog,
}

/// Frames (the client's flags, option headers, data) one step takes
/// before it lets other connections go first: a client sending options
/// without pause holds its watcher no longer than this many answers.
pub(crate) const OPTIONS_PER_STEP: usize = 32;

/// What the client and the server agreed on for transmission.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Negotiated {
    /// Structured replies (NBD_OPT_STRUCTURED_REPLY was acknowledged).
    pub(crate) structured: bool,
    /// The id of `base:allocation`, if the last NBD_OPT_SET_META_CONTEXT
    /// selected it (block status is served only then).
    pub(crate) allocation_context: Option<u32>,
    /// The export the metadata contexts were selected for: they hold only
    /// if the client goes on to that export (`proto.md`).
    meta_export: Option<usize>,
}

impl Negotiated {
    /// What holds on export `i`.
    fn on(mut self, i: usize) -> Negotiated {
        if self.meta_export != Some(i) {
            self.allocation_context = None;
        }
        self
    }
}

/// The steps a finished TLS handshake counts for, against a full
/// handshake pool: more than any client without credentials can take
/// before its deadline by sending options.
const TLS_PROGRESS: usize = 1 << 40;

/// The id `base:allocation` is given when selected (ids are opaque to
/// clients and need only be unique among the selected contexts).
pub(crate) const ALLOCATION_CONTEXT_ID: u32 = 1;

/// What NBD_OPT_LIST_META_CONTEXT / SET_META_CONTEXT ask.
struct MetaRequest<'a> {
    name: &'a [u8],
    queries: Vec<&'a [u8]>,
}

/// Split the data of a metadata-context option into the export name and
/// its queries; `None` if a length reaches past the data or bytes are left
/// over (the protocol's NBD_REP_ERR_INVALID). The queries are bounded by
/// the option's data ([`MAX_OPTION_BYTES`]): at most one per 4 bytes.
fn parse_meta_request(data: &[u8]) -> Option<MetaRequest<'_>> {
    fn take<'a>(d: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (h, rest) = d.split_at_checked(n)?;
        *d = rest;
        Some(h)
    }
    fn take_u32(d: &mut &[u8]) -> Option<u32> {
        Some(u32::from_be_bytes(take(d, 4)?.try_into().ok()?))
    }
    let mut d = data;
    let name_len = take_u32(&mut d)? as usize;
    let name = take(&mut d, name_len)?;
    let n = take_u32(&mut d)? as usize;
    if n > d.len() / 4 {
        return None;
    }
    let mut queries = Vec::with_capacity(n);
    for _ in 0..n {
        let len = take_u32(&mut d)? as usize;
        queries.push(take(&mut d, len)?);
    }
    if !d.is_empty() {
        return None;
    }
    Some(MetaRequest { name, queries })
}

/// Whether a LIST query matches `base:allocation`: every context (no
/// query), the `base:` wildcard, or its own name.
fn lists_allocation(queries: &[&[u8]]) -> bool {
    queries.is_empty()
        || queries
            .iter()
            .any(|q| *q == b"base:" || *q == META_BASE_ALLOCATION.as_bytes())
}

/// Whether a SET selects `base:allocation` (only its exact name does; the
/// `base:` wildcard selects nothing, unknown names are ignored).
fn selects_allocation(queries: &[&[u8]]) -> bool {
    queries
        .iter()
        .any(|q| *q == META_BASE_ALLOCATION.as_bytes())
}

/// The NBD_REP_META_CONTEXT reply naming `base:allocation` with `id`.
fn meta_context_reply(option: u32, id: u32) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + META_BASE_ALLOCATION.len());
    d.extend_from_slice(&id.to_be_bytes());
    d.extend_from_slice(META_BASE_ALLOCATION.as_bytes());
    option_reply(option, REP_META_CONTEXT, &d)
}

/// The handshake's view of the transport: reads that take what has
/// arrived and never wait for the client (`WouldBlock` then: the
/// connection waits in the parking lot), and writes that queue the
/// replies in `out`, sent without waiting between frames ([`send_out`];
/// what the socket does not take waits with the connection in the lot).
struct Hs<'a> {
    t: &'a Transport,
    deadline: Instant,
    out: &'a mut Vec<u8>,
}

/// Send what `out` holds without waiting (and TLS records sealed before).
///
/// **Returns:** whether everything has left.
fn send_out(t: &Transport, out: &mut Vec<u8>) -> io::Result<bool> {
    use crate::transport::nonblocking::Io;
    while !out.is_empty() {
        match t.try_write(&[io::IoSlice::new(out)])? {
            // Under TLS the same bytes are offered again after `Blocked`.
            Io::Done(n) => drop(out.drain(..n)),
            Io::Blocked { .. } => return Ok(false),
        }
    }
    t.push_out()?;
    Ok(!t.pending_out())
}

impl Read for Hs<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            match self.t.try_read(buf)? {
                crate::transport::nonblocking::Io::Done(n) => return Ok(n),
                // TLS must send before it can read on: that is waited for.
                crate::transport::nonblocking::Io::Blocked { write: true } => {
                    self.t.wait_by(false, true, self.deadline)?;
                }
                // Replies sealed under TLS go out before the connection
                // parks ([`send_out`]), or it waits for room in the lot.
                crate::transport::nonblocking::Io::Blocked { write: false } => {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
            }
        }
    }
}

impl Write for Hs<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn error_reply(s: &mut Hs<'_>, option: u32, reply: u32, msg: &str) -> io::Result<()> {
    s.write_all(&option_reply(option, reply, msg.as_bytes()))
}

/// A client's export name, cut short and escaped, for a message.
fn quoted(name: &[u8]) -> String {
    let cut = &name[..name.len().min(MAX_QUOTED_NAME_BYTES)];
    let mut q = format!("{:?}", String::from_utf8_lossy(cut));
    if cut.len() < name.len() {
        q.push_str(&format!(
            " (first {MAX_QUOTED_NAME_BYTES} of {} bytes)",
            name.len()
        ));
    }
    q
}

/// What the handshake waits for from the client next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Await {
    /// Its flags (4 bytes).
    Flags,
    /// An option's header (16 bytes).
    Header,
    /// Option `option`'s data (the frame's length); `opened`: the export
    /// it names has been opened for it (or its opening failed).
    Data { option: u32, opened: bool },
    /// Option `option`'s data, too large to keep: `left` bytes to drop,
    /// then it is refused (TOO_BIG).
    TooBig { option: u32, left: u64 },
    /// The TLS handshake after STARTTLS's ACK (the transport keeps it
    /// while it waits for the client).
    Tls,
}

/// What the client is and has agreed so far.
struct Agreed {
    peer: Peer,
    agreed: Negotiated,
    /// The client set NBD_FLAG_C_FIXED_NEWSTYLE.
    fixed: bool,
    /// The client set NBD_FLAG_C_NO_ZEROES.
    no_zeroes: bool,
    /// STARTTLS was acknowledged: the TLS handshake comes next.
    starting_tls: bool,
}

/// A handshake in progress: what it waits for, the frame of it received
/// so far, and what was agreed. It lives with its connection, which waits
/// for the client's next bytes without a thread ([`Handshake::step`]).
pub(crate) struct Handshake {
    awaiting: Await,
    frame: Vec<u8>,
    have: usize,
    st: Agreed,
    deadline: Instant,
    /// Replies not yet taken by the socket.
    out: Vec<u8>,
    /// Transmission agreed, entered once the replies have left.
    finished: Option<(Negotiated, usize)>,
}

impl Handshake {
    /// Greet a fresh connection from `origin` (the whole handshake due by
    /// `deadline`); the client's flags are awaited next.
    ///
    /// **Returns:** the socket's error if the greeting cannot be sent.
    pub(crate) fn greet(t: &Transport, origin: Origin, deadline: Instant) -> io::Result<Handshake> {
        let mut greeting = Vec::with_capacity(18);
        greeting.extend_from_slice(&NBD_MAGIC.to_be_bytes());
        greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
        greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        t.write_all_by(&greeting, deadline)?;
        Ok(Handshake {
            awaiting: Await::Flags,
            frame: vec![0; 4],
            have: 0,
            st: Agreed {
                peer: Peer { origin, tls: None },
                agreed: Negotiated::default(),
                fixed: false,
                no_zeroes: false,
                starting_tls: false,
            },
            deadline,
            out: Vec::new(),
            finished: None,
        })
    }

    /// When the whole handshake is due.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Go on with the handshake: take what the client has sent, answer
    /// each whole option, and stop where nothing more has arrived (or
    /// after [`OPTIONS_PER_STEP`] frames). With TLS required (`env.tls`'s
    /// mode), NBD_OPT_STARTTLS upgrades the session and nothing but
    /// STARTTLS and ABORT is answered before it.
    ///
    /// **Context:** never waits for the client's bytes, nor on a key
    /// derivation ([`Outcome::Open`]), nor for room for its replies
    /// ([`Outcome::Backlog`]), nor for room for the TLS handshake's own
    /// flights; only TLS asking to send before it can read on may wait
    /// for room (up to the deadline).
    /// **Returns:** how the step ended; `Ok(None)` when the rest has not
    /// arrived yet (call again once the socket is readable); the socket's
    /// error (a missed deadline is `TimedOut`, a failed TLS handshake
    /// `PermissionDenied`).
    pub(crate) fn step(
        &mut self,
        t: &Arc<Transport>,
        env: &HsEnv<'_>,
        slot: &mut Slot,
    ) -> io::Result<Option<Outcome>> {
        let mut out = std::mem::take(&mut self.out);
        let r = self.steps(t, env, slot, &mut out);
        self.out = out;
        r
    }

    /// [`Handshake::step`] with the replies not yet sent in `out`: each
    /// frame's replies leave before the next frame is read (STARTTLS's
    /// ACK before the TLS handshake), transmission is entered once they
    /// have all left, a close sends what the socket takes at once.
    fn steps(
        &mut self,
        t: &Arc<Transport>,
        env: &HsEnv<'_>,
        slot: &mut Slot,
        out: &mut Vec<u8>,
    ) -> io::Result<Option<Outcome>> {
        for _ in 0..OPTIONS_PER_STEP {
            if Instant::now() >= self.deadline {
                return Err(io::ErrorKind::TimedOut.into());
            }
            if !send_out(t, out)? {
                return Ok(Some(Outcome::Backlog));
            }
            if let Some((agreed, i)) = self.finished.take() {
                return Ok(Some(Outcome::Transmission(agreed, i)));
            }
            let mut s = Hs {
                t,
                deadline: self.deadline,
                out,
            };
            match self.receive(&mut s, env) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Sealed TLS records the socket has not taken, or the
                    // TLS handshake's own flight, wait for room; else the
                    // client is awaited.
                    let sent = send_out(t, out)?;
                    let room = !sent || t.accept_wants_write();
                    return Ok(room.then_some(Outcome::Backlog));
                }
                Err(e) => return Err(e),
            }
            match self.whole(t, s, env, slot)? {
                Some(Outcome::Transmission(agreed, i)) => self.finished = Some((agreed, i)),
                Some(Outcome::Close) => {
                    // Best effort: a client that does not read loses it.
                    let _ = send_out(t, out);
                    return Ok(Some(Outcome::Close));
                }
                Some(outcome) => return Ok(Some(outcome)),
                None => {}
            }
        }
        Ok(Some(Outcome::Again))
    }

    /// Read on until the awaited frame is whole (or dropped, for data too
    /// large to keep).
    fn receive(&mut self, s: &mut Hs<'_>, env: &HsEnv<'_>) -> io::Result<()> {
        if self.awaiting == Await::Tls {
            let acceptor = &env
                .tls
                .expect("STARTTLS is acknowledged with TLS on")
                .acceptor;
            return match s.t.accept_tls(acceptor, self.deadline)? {
                true => Ok(()),
                false => Err(io::ErrorKind::WouldBlock.into()),
            };
        }
        if let Await::TooBig { left, .. } = &mut self.awaiting {
            return partial::skip(s, left);
        }
        partial::fill(s, &mut self.frame, &mut self.have)
    }

    /// Await `what`, a frame of `len` bytes.
    fn expect(&mut self, what: Await, len: usize) {
        self.awaiting = what;
        self.frame.clear();
        self.frame.resize(len, 0);
        self.have = 0;
    }

    /// Act on the frame just received whole.
    ///
    /// **Returns:** how the handshake ends, if it does.
    fn whole(
        &mut self,
        t: &Arc<Transport>,
        mut s: Hs<'_>,
        env: &HsEnv<'_>,
        slot: &mut Slot,
    ) -> io::Result<Option<Outcome>> {
        let tls_missing = matches!(env.tls, Some(c) if c.mode == TlsMode::Require) && !t.is_tls();
        match self.awaiting {
            Await::Flags => {
                let flags = u32::from_be_bytes(self.frame[..4].try_into().expect("4 bytes"));
                if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                    return Ok(Some(Outcome::Close));
                }
                slot.progressed_by(1);
                self.st.fixed = flags & FLAG_C_FIXED_NEWSTYLE != 0;
                self.st.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                self.expect(Await::Header, 16);
                Ok(None)
            }
            Await::Header => Ok(self.header(slot, tls_missing)),
            Await::Tls => {
                // What was agreed in plaintext must be agreed again; who
                // the client is, now that TLS proved it; a handshake this
                // far along is the last one a full pool closes.
                self.st.agreed = Negotiated::default();
                self.st.peer.tls = t.tls_identity();
                slot.progressed_by(TLS_PROGRESS);
                self.expect(Await::Header, 16);
                Ok(None)
            }
            Await::TooBig { option, .. } => {
                self.expect(Await::Header, 16);
                error_reply(&mut s, option, REP_ERR_TOO_BIG, "option data too large")?;
                Ok(None)
            }
            Await::Data { option, opened } => {
                if tls_missing && !matches!(option, OPT_STARTTLS | OPT_ABORT) {
                    self.expect(Await::Header, 16);
                    let msg = "this server requires TLS: send NBD_OPT_STARTTLS first";
                    error_reply(&mut s, option, REP_ERR_TLS_REQD, msg)?;
                    return Ok(None);
                }
                if let Some(i) = self.to_open(option, env).filter(|_| !opened) {
                    // Answered once it is open: the data is kept, and no
                    // bytes are read meanwhile.
                    self.awaiting = Await::Data {
                        option,
                        opened: true,
                    };
                    return Ok(Some(Outcome::Open(i)));
                }
                let data = std::mem::take(&mut self.frame);
                self.expect(Await::Header, 16);
                let mut h = Haggle {
                    t,
                    env,
                    slot,
                    s,
                    st: &mut self.st,
                };
                let outcome = h.dispatch(option, &data)?;
                if std::mem::take(&mut self.st.starting_tls) {
                    self.expect(Await::Tls, 0);
                }
                Ok(outcome)
            }
        }
    }

    /// The lazy export that option `option` (its data received) would open
    /// now — allowed to this client, not open, its last failure's backoff
    /// passed — if any.
    fn to_open(&self, option: u32, env: &HsEnv<'_>) -> Option<usize> {
        let name = match option {
            OPT_GO | OPT_INFO => parse_info_request(&self.frame)?.0,
            OPT_EXPORT_NAME => &self.frame[..],
            _ => return None,
        };
        let i = env.exports.find_allowed(name, &self.st.peer)?;
        env.exports.slots[i].needs_opening().then_some(i)
    }

    /// An option's header: check it and await its data.
    fn header(&mut self, slot: &mut Slot, tls_missing: bool) -> Option<Outcome> {
        let h = &self.frame;
        if u64::from_be_bytes(h[0..8].try_into().expect("8 bytes")) != IHAVEOPT {
            return Some(Outcome::Close);
        }
        let option = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
        slot.progressed_by(1);
        if tls_missing && option == OPT_EXPORT_NAME {
            // It cannot be answered with an error: the protocol says close.
            return Some(Outcome::Close);
        }
        if len > MAX_OPTION_BYTES {
            if len > MAX_DISCARD_BYTES || option == OPT_EXPORT_NAME {
                return Some(Outcome::Close);
            }
            self.expect(
                Await::TooBig {
                    option,
                    left: len as u64,
                },
                0,
            );
            return None;
        }
        self.expect(
            Await::Data {
                option,
                opened: false,
            },
            len as usize,
        );
        None
    }
}

/// A handshake at a whole option: its handlers answer it. Each returns
/// `None` to read the next option, or how the handshake ends.
struct Haggle<'a, 'e> {
    t: &'a Arc<Transport>,
    env: &'a HsEnv<'e>,
    slot: &'a mut Slot,
    s: Hs<'a>,
    st: &'a mut Agreed,
}

impl Haggle<'_, '_> {
    /// Answer `option` (its data read whole) with its own handler.
    fn dispatch(&mut self, option: u32, data: &[u8]) -> io::Result<Option<Outcome>> {
        match option {
            OPT_STARTTLS => self.starttls(option, data),
            OPT_STRUCTURED_REPLY => self.structured_reply(option, data),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(option, data),
            OPT_EXPORT_NAME => self.export_name(data),
            OPT_ABORT => {
                // The client may already have gone: ignore a failed ACK.
                let _ = self.s.write_all(&option_reply(option, REP_ACK, &[]));
                Ok(Some(Outcome::Close))
            }
            OPT_LIST => {
                list(&mut self.s, self.env.exports, &self.st.peer, data)?;
                Ok(None)
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, data),
            _ => {
                let msg = format!("option {option} is not supported by this server");
                error_reply(&mut self.s, option, REP_ERR_UNSUP, &msg)?;
                Ok(None)
            }
        }
    }

    /// NBD_OPT_STARTTLS: acknowledge, then run the TLS handshake; what
    /// was agreed in plaintext is forgotten.
    fn starttls(&mut self, option: u32, data: &[u8]) -> io::Result<Option<Outcome>> {
        let s = &mut self.s;
        let Some(_) = self.env.tls else {
            error_reply(
                s,
                option,
                REP_ERR_POLICY,
                "TLS is not enabled on this server",
            )?;
            return Ok(None);
        };
        if self.t.is_tls() {
            error_reply(s, option, REP_ERR_INVALID, "TLS is already running")?;
            return Ok(None);
        }
        if !data.is_empty() || !self.st.fixed {
            error_reply(s, option, REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data")?;
            return Ok(None);
        }
        s.write_all(&option_reply(option, REP_ACK, &[]))?;
        // Past the ACK there is no way back to plaintext: the TLS
        // handshake comes next, and a failed one ends the connection.
        self.st.starting_tls = true;
        Ok(None)
    }

    /// NBD_OPT_STRUCTURED_REPLY: acknowledged when it carries no data.
    fn structured_reply(&mut self, option: u32, data: &[u8]) -> io::Result<Option<Outcome>> {
        if !data.is_empty() {
            let msg = "NBD_OPT_STRUCTURED_REPLY takes no data";
            error_reply(&mut self.s, option, REP_ERR_INVALID, msg)?;
            return Ok(None);
        }
        self.s.write_all(&option_reply(option, REP_ACK, &[]))?;
        self.st.agreed.structured = true;
        Ok(None)
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT: only
    /// `base:allocation` exists, and needs structured replies.
    fn meta_context(&mut self, option: u32, data: &[u8]) -> io::Result<Option<Outcome>> {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            // A SET replaces the selection, even when it fails.
            self.st.agreed.allocation_context = None;
            self.st.agreed.meta_export = None;
        }
        let s = &mut self.s;
        if !self.st.agreed.structured {
            let msg =
                "metadata contexts need structured replies: send NBD_OPT_STRUCTURED_REPLY first";
            error_reply(s, option, REP_ERR_INVALID, msg)?;
            return Ok(None);
        }
        let Some(req) = parse_meta_request(data) else {
            error_reply(
                s,
                option,
                REP_ERR_INVALID,
                "malformed metadata context request",
            )?;
            return Ok(None);
        };
        let Some(i) = find(self.env, req.name, &self.st.peer) else {
            let msg = format!("no export named {}", quoted(req.name));
            error_reply(s, option, REP_ERR_UNKNOWN, &msg)?;
            return Ok(None);
        };
        if set && selects_allocation(&req.queries) {
            s.write_all(&meta_context_reply(option, ALLOCATION_CONTEXT_ID))?;
            self.st.agreed.allocation_context = Some(ALLOCATION_CONTEXT_ID);
            self.st.agreed.meta_export = Some(i);
        } else if !set && lists_allocation(&req.queries) {
            // A listed context's id is reserved: zero.
            s.write_all(&meta_context_reply(option, 0))?;
        }
        s.write_all(&option_reply(option, REP_ACK, &[]))?;
        Ok(None)
    }

    /// NBD_OPT_EXPORT_NAME: no error can be sent to it, so an unknown
    /// export, one that cannot be opened, or no room for the connection
    /// closes it.
    fn export_name(&mut self, data: &[u8]) -> io::Result<Option<Outcome>> {
        let Some(i) = find(self.env, data, &self.st.peer) else {
            return Ok(Some(Outcome::Close));
        };
        let Ok(live) = self.env.exports.slots[i].open() else {
            return Ok(Some(Outcome::Close));
        };
        if self
            .slot
            .enter_transmission(&self.st.peer.share_key(), self.t)
            .is_err()
        {
            return Ok(Some(Outcome::Close));
        }
        let export = &live.info;
        let mut v = Vec::with_capacity(134);
        v.extend_from_slice(&export.size_bytes.to_be_bytes());
        v.extend_from_slice(&export.transmission_flags().to_be_bytes());
        if !self.st.no_zeroes {
            v.extend_from_slice(&[0u8; 124]);
        }
        self.s.write_all(&v)?;
        Ok(Some(Outcome::Transmission(self.st.agreed.on(i), i)))
    }

    /// NBD_OPT_INFO and NBD_OPT_GO; GO to an export the client may use
    /// ends the handshake.
    fn info_or_go(&mut self, option: u32, data: &[u8]) -> io::Result<Option<Outcome>> {
        let (slot, t) = (&mut *self.slot, self.t);
        let admit = |p: &Peer| slot.enter_transmission(&p.share_key(), t);
        let Some(i) = info_or_go(&mut self.s, self.env, &self.st.peer, option, data, admit)? else {
            return Ok(None);
        };
        if option == OPT_GO {
            return Ok(Some(Outcome::Transmission(self.st.agreed.on(i), i)));
        }
        Ok(None)
    }
}

/// The export `name` selects if `peer` may use it; a refusal is counted,
/// and told as "unknown" as a missing export is.
fn find(env: &HsEnv<'_>, name: &[u8], peer: &Peer) -> Option<usize> {
    let i = env.exports.find_allowed(name, peer);
    if i.is_none() && env.exports.find(name).is_some() {
        env.counters
            .authorization_refusals
            .fetch_add(1, Ordering::Relaxed);
    }
    i
}

/// Answer NBD_OPT_LIST: the exports `peer` may use.
fn list(s: &mut Hs<'_>, exports: &Catalog, peer: &Peer, data: &[u8]) -> io::Result<()> {
    let option = OPT_LIST;
    if !data.is_empty() {
        return error_reply(s, option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
    }
    let mine = exports
        .slots
        .iter()
        .filter(|e| crate::server::peer::allowed(&e.config.allow, peer));
    for export in mine {
        let name = export.config.name.as_bytes();
        let mut d = Vec::with_capacity(4 + name.len());
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name);
        s.write_all(&option_reply(option, REP_SERVER, &d))?;
    }
    s.write_all(&option_reply(option, REP_ACK, &[]))
}

/// Answer NBD_OPT_INFO or GO: the export's infos and ACK once it is
/// allowed, open (a lazy one opened now) and — for GO — `admit`ted to
/// transmission; an error reply otherwise.
///
/// **Returns:** the export's index when ACKed, `None` after an error
/// reply.
fn info_or_go(
    s: &mut Hs<'_>,
    env: &HsEnv<'_>,
    peer: &Peer,
    option: u32,
    data: &[u8],
    admit: impl FnOnce(&Peer) -> Result<(), String>,
) -> io::Result<Option<usize>> {
    let Some((name, infos)) = parse_info_request(data) else {
        error_reply(s, option, REP_ERR_INVALID, "malformed NBD_OPT_INFO/GO data")?;
        return Ok(None);
    };
    let Some(i) = find(env, name, peer) else {
        let msg = format!("no export named {}", quoted(name));
        error_reply(s, option, REP_ERR_UNKNOWN, &msg)?;
        return Ok(None);
    };
    let Ok(live) = env.exports.slots[i].open() else {
        // The cause is in the server's log, not for the client.
        let msg = format!("export {} could not be opened", quoted(name));
        error_reply(s, option, REP_ERR_UNKNOWN, &msg)?;
        return Ok(None);
    };
    if option == OPT_GO {
        if let Err(why) = admit(peer) {
            error_reply(s, option, REP_ERR_POLICY, &why)?;
            return Ok(None);
        }
    }
    send_infos(s, option, &live.info, &infos)?;
    s.write_all(&option_reply(option, REP_ACK, &[]))?;
    Ok(Some(i))
}

/// Split NBD_OPT_INFO/GO data into the name and the requested info types.
fn parse_info_request(data: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let name_len = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name = data.get(4..4usize.checked_add(name_len)?)?;
    let rest = &data[4 + name_len..];
    let n = u16::from_be_bytes(rest.get(0..2)?.try_into().ok()?) as usize;
    let list = &rest[2..];
    if list.len() != 2 * n {
        return None;
    }
    let infos = list
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Some((name, infos))
}

fn send_info(s: &mut Hs<'_>, option: u32, kind: u16, payload: &[u8]) -> io::Result<()> {
    let mut d = Vec::with_capacity(2 + payload.len());
    d.extend_from_slice(&kind.to_be_bytes());
    d.extend_from_slice(payload);
    s.write_all(&option_reply(option, REP_INFO, &d))
}

/// NBD_INFO_EXPORT and NBD_INFO_BLOCK_SIZE always (the export needs whole
/// sectors, so its block sizes are sent whether asked for or not, as the
/// protocol allows); NAME and DESCRIPTION when requested.
fn send_infos(s: &mut Hs<'_>, option: u32, export: &ExportInfo, infos: &[u16]) -> io::Result<()> {
    let mut e = Vec::with_capacity(10);
    e.extend_from_slice(&export.size_bytes.to_be_bytes());
    e.extend_from_slice(&export.transmission_flags().to_be_bytes());
    send_info(s, option, INFO_EXPORT, &e)?;
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&export.min_block_bytes.to_be_bytes());
    b.extend_from_slice(&export.preferred_block_bytes.to_be_bytes());
    b.extend_from_slice(&export.max_block_bytes.to_be_bytes());
    send_info(s, option, INFO_BLOCK_SIZE, &b)?;
    let mut sent_name = false;
    let mut sent_desc = false;
    for &i in infos {
        match i {
            INFO_NAME if !sent_name => {
                send_info(s, option, INFO_NAME, export.name.as_bytes())?;
                sent_name = true;
            }
            INFO_DESCRIPTION if !sent_desc && !export.description.is_empty() => {
                send_info(s, option, INFO_DESCRIPTION, export.description.as_bytes())?;
                sent_desc = true;
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &[u8], queries: &[&[u8]]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q);
        }
        d
    }

    #[test]
    fn meta_context_requests_parse_and_match_only_base_allocation() {
        let d = meta(b"vol", &[b"base:allocation", b"qemu:dirty-bitmap:x"]);
        let r = parse_meta_request(&d).unwrap();
        assert_eq!(r.name, b"vol");
        assert_eq!(r.queries.len(), 2);
        assert!(selects_allocation(&r.queries) && lists_allocation(&r.queries));
        // The wildcard lists it but selects nothing; no query lists all.
        assert!(lists_allocation(&[b"base:"]) && !selects_allocation(&[b"base:"]));
        assert!(lists_allocation(&[]) && !selects_allocation(&[]));
        assert!(!lists_allocation(&[b"qemu:"]) && !selects_allocation(&[b"base:alloc"]));
        // Truncated, trailing bytes, or a count the data cannot hold.
        assert!(parse_meta_request(&d[..d.len() - 1]).is_none());
        let mut long = d.clone();
        long.push(0);
        assert!(parse_meta_request(&long).is_none());
        let mut many = meta(b"", &[]);
        many[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta_request(&many).is_none());
        assert!(parse_meta_request(&[0xff, 0xff, 0xff, 0xff]).is_none());
        assert!(parse_meta_request(&[]).is_none());
    }

    #[test]
    fn info_requests_parse_and_malformed_ones_do_not() {
        let mut d = vec![0, 0, 0, 3];
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&[0, 2, 0, 3, 0, 1]);
        let (name, infos) = parse_info_request(&d).unwrap();
        assert_eq!(name, b"abc");
        assert_eq!(infos, vec![INFO_BLOCK_SIZE, INFO_NAME]);
        assert!(parse_info_request(&d[..d.len() - 1]).is_none());
        assert!(parse_info_request(&[0xff, 0xff, 0xff, 0xff, 0, 0]).is_none());
        assert!(parse_info_request(&[]).is_none());
    }
}
