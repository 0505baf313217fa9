//! LUKS1 (and whatever else starts with the LUKS magic): the input is the
//! whole device image. `is_luks` and `inspect` on every input; `open` with
//! the seeds' passphrase when the header's KDF work is small (see
//! `iopages_fuzz::kdf_is_cheap`). Seeds: cryptsetup-made LUKS1 images cut
//! after keyslot 0's material, and a hand-sealed one-stripe image.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iopages_fuzz::exercise_luks(data);
});
