//! NBD handshake and option haggling: the input is everything a client
//! sends after the server's greeting (client flags, then options), on a
//! fresh Unix-socket connection to a server started once per process. The
//! write side is shut after the input; the server must answer and close
//! (or enter transmission and close at EOF) within the reply timeout, and
//! still serve a well-formed session afterwards (checked every 256 runs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iopages_fuzz::maybe_health_check(256);
    let _ = iopages_fuzz::nbd_exchange(data);
});
