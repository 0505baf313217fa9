//! Authenticated volumes: what a hostile store (and a damaged state file)
//! can feed the tag layer. The input drives the parsers of the state file,
//! the superblock, tag records and tree entries directly, and then a list
//! of byte flips applied to a valid volume's data and integrity area
//! before it is opened and every block read: nothing may panic, and every
//! block that reads at all must read as it was written — never other
//! bytes. See `iopages_fuzz::exercise_integrity`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    iopages_fuzz::exercise_integrity(data);
});
