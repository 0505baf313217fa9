//! The NBD wire protocol: constants and the fixed-size messages.
//!
//! Owns: the numbers of the protocol (magics, flags, option, reply, info,
//! command and error codes) and encoding/decoding of the handshake's and
//! transmission's fixed-size headers, big-endian as the protocol says.
//! Must never: do I/O policy (what to answer is the handshake's and the
//! connection's business) or accept a header with a wrong magic.
//!
//! Numbers follow the NBD protocol document (`doc/proto.md` of the
//! NetworkBlockDevice project).

/// The server's first 8 bytes: `"NBDMAGIC"`.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// Newstyle magic (`"IHAVEOPT"`), also the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of an option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flag: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: no 124 zero bytes after NBD_OPT_EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option: choose the export and end the handshake (old style).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: end the handshake without an export.
pub const OPT_ABORT: u32 = 2;
/// Option: list the exports.
pub const OPT_LIST: u32 = 3;
/// Option: start TLS.
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list the metadata contexts matching queries.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select the metadata contexts block status reports.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Reply: done.
pub const REP_ACK: u32 = 1;
/// Reply: one export of a list.
pub const REP_SERVER: u32 = 2;
/// Reply: one piece of information about an export.
pub const REP_INFO: u32 = 3;
/// Option reply: a metadata context (its id, then its name).
pub const REP_META_CONTEXT: u32 = 4;
/// Error replies have this bit set.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// Error: option unknown or not supported.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// Error: forbidden by policy.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// Error: the option is malformed.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// Error: TLS is required first (NBD_OPT_STARTTLS).
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// Error: no such export.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// Error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// Error: the option's data is too large.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

/// Info: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Info: canonical name.
pub const INFO_NAME: u16 = 1;
/// Info: description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Info: minimum, preferred and maximum block sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag: the flags field is valid.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: NBD_CMD_FLUSH is supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: NBD_CMD_FLAG_FUA is supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: NBD_CMD_TRIM is supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: NBD_CMD_WRITE_ZEROES is supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: several connections see one consistent export.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: NBD_CMD_FLAG_FAST_ZERO is supported.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write (with a payload).
pub const CMD_WRITE: u16 = 1;
/// Command: disconnect.
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: the block status of a range (for the selected metadata
/// contexts).
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access (durable before the reply).
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: write zeroes without punching a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: fail fast rather than write zeroes slowly.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Command flag (BLOCK_STATUS): one extent only, no longer than asked.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

/// Error: operation not permitted (a write to a read-only export).
pub const EPERM: u32 = 1;
/// Error: input/output error.
pub const EIO: u32 = 5;
/// Error: out of memory.
pub const ENOMEM: u32 = 12;
/// Error: invalid argument (malformed or misaligned request).
pub const EINVAL: u32 = 22;
/// Error: no space (a write beyond the end of the export).
pub const ENOSPC: u32 = 28;
/// Error: value too large (`proto.md` reserves it for DF reads and
/// oversize commands without payload; this server does not send it).
pub const EOVERFLOW: u32 = 75;
/// Error: not supported.
pub const ENOTSUP: u32 = 95;
/// Error: the server is shutting down.
pub const ESHUTDOWN: u32 = 108;

/// Bytes of a transmission request header.
pub const REQUEST_BYTES: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;

/// A transmission request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// Command (`CMD_*`).
    pub command: u16,
    /// The client's cookie (handle), echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Bytes.
    pub length: u32,
}

impl Request {
    /// Decode a header.
    ///
    /// **Returns:** `None` if the magic is wrong (the connection must be
    /// closed: the stream cannot be trusted any more).
    pub fn decode(b: &[u8; REQUEST_BYTES]) -> Option<Request> {
        if u32::from_be_bytes(b[0..4].try_into().unwrap()) != REQUEST_MAGIC {
            return None;
        }
        Some(Request {
            flags: u16::from_be_bytes([b[4], b[5]]),
            command: u16::from_be_bytes([b[6], b[7]]),
            cookie: u64::from_be_bytes(b[8..16].try_into().unwrap()),
            offset: u64::from_be_bytes(b[16..24].try_into().unwrap()),
            length: u32::from_be_bytes(b[24..28].try_into().unwrap()),
        })
    }

    /// Encode a header (what a client sends).
    pub fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// Encode a simple reply header.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut b = [0u8; SIMPLE_REPLY_BYTES];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Bytes of a structured reply chunk header.
pub const STRUCTURED_REPLY_BYTES: usize = 20;
/// Structured reply flag: the last chunk of the reply.
pub const REPLY_FLAG_DONE: u16 = 1;
/// Chunk type: nothing (the reply's end).
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk type: data at an offset.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk type: a hole (zeros) at an offset.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Chunk type: block status extents of one metadata context.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Chunk type: an error, with a message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
/// Chunk type: an error at an offset, with a message.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

/// Encode a structured reply chunk header for `len` bytes of payload.
pub fn structured_reply(
    flags: u16,
    kind: u16,
    cookie: u64,
    len: u32,
) -> [u8; STRUCTURED_REPLY_BYTES] {
    let mut b = [0u8; STRUCTURED_REPLY_BYTES];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// What an error code means, for the message of an error chunk.
pub fn error_message(error: u32) -> &'static str {
    match error {
        EPERM => "the export is read-only",
        EIO => "input/output error",
        ENOMEM => "the server is out of memory for requests in flight; retry",
        EINVAL => "invalid request: unknown command or flags, misaligned, out of range or too long",
        ENOSPC => "the request reaches past the end of the export",
        EOVERFLOW => "value too large",
        ENOTSUP => "not supported",
        ESHUTDOWN => "the server is shutting down",
        _ => "error",
    }
}

/// The one metadata context served: allocation (holes and zeros).
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// `base:allocation` status flag: the extent is a hole (not allocated).
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` status flag: the extent reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;

/// Encode an option reply header followed by `data`.
pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + data.len());
    v.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&reply.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_a_bad_magic_is_refused() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            command: CMD_WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 4096,
            length: 512,
        };
        let mut b = r.encode();
        assert_eq!(Request::decode(&b), Some(r));
        b[0] ^= 1;
        assert_eq!(Request::decode(&b), None);
        assert_eq!(&NBD_MAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
    }
}
