//! NBD transmission: a valid handshake (client flags, structured replies
//! when the input's length is odd, NBD_OPT_GO "vol") is sent first, then
//! the input as the request stream (headers, write payloads, whatever). Replies are read until the server closes; a
//! server that neither answers nor closes is a hang. Every input is also
//! cut into 28-byte headers for `proto::Request::decode`, which must
//! round-trip through `encode`. A well-formed session is checked every 256
//! runs.
#![no_main]

use iopages_nbd::proto::{Request, REQUEST_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for chunk in data.chunks_exact(REQUEST_BYTES) {
        let b: &[u8; REQUEST_BYTES] = chunk.try_into().unwrap();
        if let Some(r) = Request::decode(b) {
            assert_eq!(&r.encode(), b, "Request encode(decode(b)) != b");
        }
    }
    iopages_fuzz::maybe_health_check(256);
    // An input of odd length negotiates structured replies first (the
    // whole input stays the request stream, so seeds keep their meaning).
    let mut v = iopages_fuzz::go_prefix_with(data.len() % 2 == 1);
    v.extend_from_slice(data);
    let _ = iopages_fuzz::nbd_exchange(&v);
});
