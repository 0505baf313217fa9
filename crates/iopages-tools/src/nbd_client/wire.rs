//! The NBD wire format as the tests speak it: every magic number, option,
//! reply type, flag and command, and the byte layouts of the messages
//! both sides send (encoded and decoded here, no I/O).
//!
//! Written from the protocol's specification (NetworkBlockDevice's
//! `doc/proto.md`), not from iopages-nbd's `proto` module, on purpose: a
//! test that encodes its requests with the server's own encoder cannot
//! see the server get the format wrong.
//!
//! Owns: the constants (the only place they are written in the test
//! code) and the layouts of the greeting, options, option replies,
//! requests, simple replies and structured reply chunks. Must never:
//! read or write a stream (that is `client` and `store`), or depend on
//! iopages-nbd.

use std::io;

/// "NBDMAGIC", the greeting's first 8 bytes.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": the greeting's second 8 bytes, and each option's first.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// The first 8 bytes of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// The first 4 bytes of every request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The first 4 bytes of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// The first 4 bytes of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// The greeting: NBD_MAGIC, IHAVEOPT, 2 bytes of handshake flags.
pub const GREETING_BYTES: usize = 18;
/// An option's header: IHAVEOPT, the option, its data's length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// An option reply's header: magic, option, reply type, data length.
pub const OPT_REPLY_HEADER_BYTES: usize = 20;
/// A request's header (its payload follows).
pub const REQUEST_BYTES: usize = 28;
/// A simple reply's header (a READ's data follows).
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// A structured reply chunk's header (its payload follows).
pub const STRUCTURED_REPLY_BYTES: usize = 20;
/// NBD_OPT_EXPORT_NAME's reply without the 124 zero bytes: size, flags.
pub const EXPORT_NAME_REPLY_BYTES: usize = 10;
/// The zero bytes after NBD_OPT_EXPORT_NAME's reply, unless NO_ZEROES.
pub const EXPORT_NAME_ZEROES: usize = 124;

/// Handshake flag: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: no zeroes after NBD_OPT_EXPORT_NAME's reply.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// NBD_OPT_EXPORT_NAME: the name; the server answers with no reply header.
pub const OPT_EXPORT_NAME: u32 = 1;
/// NBD_OPT_ABORT.
pub const OPT_ABORT: u32 = 2;
/// NBD_OPT_LIST.
pub const OPT_LIST: u32 = 3;
/// NBD_OPT_STARTTLS.
pub const OPT_STARTTLS: u32 = 5;
/// NBD_OPT_INFO.
pub const OPT_INFO: u32 = 6;
/// NBD_OPT_GO.
pub const OPT_GO: u32 = 7;
/// NBD_OPT_STRUCTURED_REPLY.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// NBD_OPT_LIST_META_CONTEXT.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// NBD_OPT_SET_META_CONTEXT.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// NBD_REP_ACK: the final reply of a successful option.
pub const REP_ACK: u32 = 1;
/// NBD_REP_SERVER: one export of NBD_OPT_LIST.
pub const REP_SERVER: u32 = 2;
/// NBD_REP_INFO.
pub const REP_INFO: u32 = 3;
/// NBD_REP_META_CONTEXT.
pub const REP_META_CONTEXT: u32 = 4;
/// Set in every error reply type.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// NBD_REP_ERR_UNSUP.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// NBD_REP_ERR_POLICY.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// NBD_REP_ERR_INVALID.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// NBD_REP_ERR_TLS_REQD.
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// NBD_REP_ERR_UNKNOWN.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// NBD_REP_ERR_SHUTDOWN.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// NBD_REP_ERR_TOO_BIG.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

/// NBD_INFO_EXPORT: size (u64) and transmission flags (u16).
pub const INFO_EXPORT: u16 = 0;
/// NBD_INFO_NAME.
pub const INFO_NAME: u16 = 1;
/// NBD_INFO_DESCRIPTION.
pub const INFO_DESCRIPTION: u16 = 2;
/// NBD_INFO_BLOCK_SIZE: minimum, preferred, maximum (u32 each).
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag: the flags field is valid.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: read-only export.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: NBD_CMD_FLUSH.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: NBD_CMD_FLAG_FUA.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: NBD_CMD_TRIM.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: NBD_CMD_WRITE_ZEROES.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: several connections see each other's writes.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: NBD_CMD_FLAG_FAST_ZERO.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

/// NBD_CMD_READ.
pub const CMD_READ: u16 = 0;
/// NBD_CMD_WRITE.
pub const CMD_WRITE: u16 = 1;
/// NBD_CMD_DISC.
pub const CMD_DISC: u16 = 2;
/// NBD_CMD_FLUSH.
pub const CMD_FLUSH: u16 = 3;
/// NBD_CMD_TRIM.
pub const CMD_TRIM: u16 = 4;
/// NBD_CMD_WRITE_ZEROES.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// NBD_CMD_BLOCK_STATUS.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: WRITE_ZEROES must not punch a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: don't fragment (a READ's structured reply).
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag: BLOCK_STATUS wants one descriptor.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag: WRITE_ZEROES must fail rather than be slow.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flag: the last chunk of its request.
pub const REPLY_FLAG_DONE: u16 = 1;
/// Chunk type NBD_REPLY_TYPE_NONE.
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk type NBD_REPLY_TYPE_OFFSET_DATA: offset (u64), then data.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk type NBD_REPLY_TYPE_OFFSET_HOLE: offset (u64), length (u32).
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Chunk type NBD_REPLY_TYPE_BLOCK_STATUS: context id, descriptors.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Chunk type NBD_REPLY_TYPE_ERROR: errno (u32), message length (u16),
/// message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
/// Chunk type NBD_REPLY_TYPE_ERROR_OFFSET.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

/// `base:allocation` block status flag: a hole.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` block status flag: reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;

/// NBD error EPERM.
pub const EPERM: u32 = 1;
/// NBD error EIO.
pub const EIO: u32 = 5;
/// NBD error ENOMEM.
pub const ENOMEM: u32 = 12;
/// NBD error EINVAL.
pub const EINVAL: u32 = 22;
/// NBD error ENOSPC.
pub const ENOSPC: u32 = 28;
/// NBD error EOVERFLOW.
pub const EOVERFLOW: u32 = 75;
/// NBD error ENOTSUP.
pub const ENOTSUP: u32 = 95;
/// NBD error ESHUTDOWN.
pub const ESHUTDOWN: u32 = 108;

/// The big-endian u16 at the start of `b`.
///
/// **Panics:** if `b` is shorter than 2 bytes.
pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// The big-endian u32 at the start of `b`.
///
/// **Panics:** if `b` is shorter than 4 bytes.
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

/// The big-endian u64 at the start of `b`.
///
/// **Panics:** if `b` is shorter than 8 bytes.
pub fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// An InvalidData error saying what was malformed.
pub fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// The server's greeting: the two magics and `flags`.
pub fn greeting_bytes(flags: u16) -> [u8; GREETING_BYTES] {
    let mut g = [0u8; GREETING_BYTES];
    g[..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    g[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    g[16..].copy_from_slice(&flags.to_be_bytes());
    g
}

/// The handshake flags of a greeting.
///
/// **Returns:** Err (InvalidData) unless it starts with NBDMAGIC and
/// IHAVEOPT (a newstyle server).
pub fn parse_greeting(g: &[u8; GREETING_BYTES]) -> io::Result<u16> {
    if be64(g) != NBD_MAGIC {
        return Err(invalid("the greeting does not start with NBDMAGIC"));
    }
    if be64(&g[8..]) != IHAVEOPT {
        return Err(invalid("the greeting is not newstyle (no IHAVEOPT)"));
    }
    Ok(be16(&g[16..]))
}

/// One option as the client sends it: IHAVEOPT, `option`, the length of
/// `data`, `data`.
pub fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(OPTION_HEADER_BYTES + data.len());
    v.extend_from_slice(&IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// The data of NBD_OPT_GO / NBD_OPT_INFO: the export's name and the
/// information requests.
pub fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// The data of NBD_OPT_LIST_META_CONTEXT / SET_META_CONTEXT: the export's
/// name and the queries.
pub fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// One option reply as the server sends it.
pub fn option_reply_bytes(option: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(OPT_REPLY_HEADER_BYTES + data.len());
    v.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// The data of an NBD_INFO_EXPORT reply: its type, `size`, `flags`.
pub fn info_export_data(size: u64, flags: u16) -> Vec<u8> {
    let mut d = INFO_EXPORT.to_be_bytes().to_vec();
    d.extend_from_slice(&size.to_be_bytes());
    d.extend_from_slice(&flags.to_be_bytes());
    d
}

/// A simple reply's header.
pub fn simple_reply_bytes(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut r = [0u8; SIMPLE_REPLY_BYTES];
    r[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    r[4..8].copy_from_slice(&error.to_be_bytes());
    r[8..].copy_from_slice(&cookie.to_be_bytes());
    r
}

/// A structured reply chunk's header, for a payload of `length` bytes.
pub fn structured_reply_bytes(
    flags: u16,
    kind: u16,
    cookie: u64,
    length: u32,
) -> [u8; STRUCTURED_REPLY_BYTES] {
    let mut r = [0u8; STRUCTURED_REPLY_BYTES];
    r[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    r[4..6].copy_from_slice(&flags.to_be_bytes());
    r[6..8].copy_from_slice(&kind.to_be_bytes());
    r[8..16].copy_from_slice(&cookie.to_be_bytes());
    r[16..].copy_from_slice(&length.to_be_bytes());
    r
}

/// One transmission request's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// The command (`CMD_*`).
    pub command: u16,
    /// The cookie its reply names.
    pub cookie: u64,
    /// The offset in the export.
    pub offset: u64,
    /// The length (a WRITE's payload follows the header).
    pub length: u32,
}

impl Request {
    /// The header as the client sends it.
    pub fn to_bytes(&self) -> [u8; REQUEST_BYTES] {
        let mut r = [0u8; REQUEST_BYTES];
        r[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        r[4..6].copy_from_slice(&self.flags.to_be_bytes());
        r[6..8].copy_from_slice(&self.command.to_be_bytes());
        r[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        r[16..24].copy_from_slice(&self.offset.to_be_bytes());
        r[24..].copy_from_slice(&self.length.to_be_bytes());
        r
    }

    /// The header a client sent.
    ///
    /// **Returns:** Err (InvalidData) for a bad request magic.
    pub fn parse(r: &[u8; REQUEST_BYTES]) -> io::Result<Request> {
        if be32(r) != REQUEST_MAGIC {
            return Err(invalid("bad request magic"));
        }
        Ok(Request {
            flags: be16(&r[4..]),
            command: be16(&r[6..]),
            cookie: be64(&r[8..]),
            offset: be64(&r[16..]),
            length: be32(&r[24..]),
        })
    }
}

/// One option reply: the option it answers, its type, its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptReply {
    /// The option answered.
    pub option: u32,
    /// The reply type (`REP_*`).
    pub kind: u32,
    /// The reply's data.
    pub data: Vec<u8>,
}

impl OptReply {
    /// Whether it ends the option: an ACK or an error.
    pub fn is_final(&self) -> bool {
        self.kind == REP_ACK || self.kind & REP_FLAG_ERROR != 0
    }

    /// For an NBD_REP_INFO, its information type.
    pub fn info_type(&self) -> Option<u16> {
        (self.kind == REP_INFO && self.data.len() >= 2).then(|| be16(&self.data))
    }
}

/// A structured reply chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Its flags (`REPLY_FLAG_DONE`).
    pub flags: u16,
    /// Its type (`REPLY_TYPE_*`).
    pub kind: u16,
    /// The cookie of the request it answers.
    pub cookie: u64,
    /// Its payload.
    pub payload: Vec<u8>,
}

impl Chunk {
    /// An error chunk's errno (`None` for other types).
    pub fn error(&self) -> Option<u32> {
        let is_error = self.kind == REPLY_TYPE_ERROR || self.kind == REPLY_TYPE_ERROR_OFFSET;
        (is_error && self.payload.len() >= 4).then(|| be32(&self.payload))
    }

    /// The offset an OFFSET_DATA or OFFSET_HOLE chunk starts with.
    ///
    /// **Panics:** if the payload is shorter than 8 bytes.
    pub fn offset(&self) -> u64 {
        be64(&self.payload)
    }
}

/// A reply as it comes: simple (its header only) or one chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnyReply {
    /// A simple reply: (error, cookie); a READ's data not read yet.
    Simple {
        /// 0 or an errno.
        error: u32,
        /// The request's cookie.
        cookie: u64,
    },
    /// One structured reply chunk.
    Chunk(Chunk),
}
