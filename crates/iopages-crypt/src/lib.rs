//! # iopages-crypt — dm-crypt's cipher in userspace
//!
//! The encrypting block target of iopages (issue 5) encrypts every write
//! into freshly allocated pages and decrypts every read in place, with
//! dm-crypt's `aes-xts-plain64`: AES-XTS (IEEE 1619) over 512- or 4096-byte
//! sectors, the tweak of each sector being its number (plus `iv_offset`) as
//! a little-endian 64-bit value. This crate holds that cipher, the target
//! with its page strategies, queue and backends; the LUKS headers come on
//! top of it.
//!
//! ## Map: kernel → module
//!
//! | kernel | here | file |
//! |---|---|---|
//! | `crypto/xts.c` (`xts(aes)`) | [`XtsCipher`], backend choice [`XtsBackend`], the RustCrypto and OpenSSL backends | `xts.rs` |
//! | `arch/x86/crypto/aes-xts-avx-x86_64.S` (VAES XTS) | the VAES kernel and its AES-NI key schedule | `vaes.rs` |
//! | `crypt_iv_plain64_gen` in `drivers/md/dm-crypt.c` | [`plain64_iv`], [`XtsCipher::iv_sector`] | `xts.rs` |
//! | `iv_offset`, `sector_size`, `iv_large_sectors` table options | [`XtsCipherBuilder`] | `xts.rs` |
//! | error codes | [`Error`] | `error.rs` |
//! | `crypt_alloc_buffer`, `crypt_page_alloc`, pages per client | [`strategy::OutAllocator`] (per-page, bulk, compound), the page limit | `strategy.rs` |
//! | `brd` (RAM disk), the block device below | [`backend::Backend`], [`backend::RamDisk`], [`backend::PageStore`] | `backend.rs` |
//! | a file or block device under the target | [`uring::UringFile`] (io_uring, `O_DIRECT`, fixed buffers) | `uring/` |
//! | `iomap` direct I/O: pin, build the bio folio by folio, submit, unpin | [`dio`] | `dio.rs` |
//! | `crypt_map` write/read paths, per-CPU transforms | [`target::CryptTarget`], [`target::CipherPool`] | `target.rs` |
//! | the `allow_discards` table option, `REQ_OP_DISCARD` / `REQ_OP_WRITE_ZEROES` | [`target::TargetConfig::allow_discards`], [`target::CryptTarget::discard`], [`target::CryptTarget::punch_zeroes`], [`backend::Backend::punch`] | `target.rs`, `backend.rs`, `uring/holes.rs` |
//! | dm-integrity's per-sector tags, dm-verity's hash tree (here writable, two slots per node, the root anchored in a local state file) | [`integrity::AuthBackend`], [`integrity::Layout`], [`integrity::Keys`] | `integrity/` |
//! | cryptsetup's LUKS1/LUKS2 headers, keyslots, AF splitter, PBKDF2/Argon2 (userspace, not kernel) | [`luks::open`], [`luks::format`], [`luks::LuksVolume`] | `luks/` |
//! | `kcryptd` workqueue, the tag set's queue depth and wake batch | [`queue::CryptQueue`] | `queue.rs`, `admission.rs` |
//! | dm-crypt's inline mode (`no_write_workqueue`) with an asynchronous device below: encrypt on the submitter, complete where the device completes | [`async_io::AsyncIo`], [`target::CryptTarget::seal`] | `async_io.rs`, `queue.rs` |
//!
//! ## Implementation notes
//!
//! Three backends sit behind one interface and give byte-identical output;
//! the tests check each against the IEEE 1619 vectors and against the
//! others (and against Python's `cryptography` where it is installed). The
//! choice was made by measurement (`iopages bench xts`,
//! `docs/experiments.md` (`bench xts`) and `docs/architecture.md`):
//!
//! - [`XtsBackend::Vaes`], the default where the CPU has AES-NI, AVX2, VAES
//!   and VPCLMULQDQ: this crate's kernel, sixteen blocks in flight, two per
//!   instruction. The only one faster than `openssl speed -evp aes-256-xts`
//!   on the project's machine, which is the bar.
//! - [`XtsBackend::RustCrypto`], the default elsewhere: RustCrypto's `aes`
//!   with an XTS mode written here. Portable and constant-time, but the
//!   `aes` crate's run-time-dispatched VAES code runs at half speed here.
//! - [`XtsBackend::OpenSsl`]: OpenSSL's EVP XTS. Its context must be
//!   re-initialised with each sector's IV, and that call costs more than a
//!   512-byte sector's whole encryption.
//!
//! Keys are checked once (32 or 64 bytes, halves different, as OpenSSL
//! insists) and expanded once; the data path never allocates and never
//! panics on a caller's buffer.
//!
//! ```
//! use iopages_crypt::XtsCipher;
//! let key: Vec<u8> = (0u8..64).collect();
//! let mut xts = XtsCipher::new(&key, 512, 0).unwrap();
//! let plain = vec![7u8; 4096];
//! let mut sealed = vec![0u8; 4096];
//! xts.encrypt_sectors(100, &plain, &mut sealed).unwrap();
//! xts.decrypt_sectors_in_place(100, &mut sealed).unwrap();
//! assert_eq!(sealed, plain);
//! ```
//!
//! ## Requirements
//!
//! Linux only (the target's pages come from an [`iopages`] arena, a
//! memfd). io_uring is needed only by [`uring::UringFile`], the backend
//! for files and block devices; the RAM disk and the page store do not use
//! it. OpenSSL (the [`XtsBackend::OpenSsl`] backend, PBKDF2 and the hashes
//! of the LUKS headers, random keys) is built from source through
//! `openssl`'s `vendored` feature: a first build needs a C compiler,
//! `perl` and `make`, and no system libssl. The VAES backend is x86_64
//! only and chosen at run time from the CPU's features. Rust 1.89 or later
//! (`rust-version`); only the current stable toolchain is tested.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod admission;
pub mod async_io;
pub mod backend;
pub mod dio;
mod error;
pub mod integrity;
pub mod luks;
pub mod queue;
pub mod strategy;
pub mod target;
pub mod uring;
#[cfg(target_arch = "x86_64")]
mod vaes;
pub mod xts;

pub use error::{Error, Result};
pub use xts::{plain64_iv, XtsBackend, XtsCipher, XtsCipherBuilder};
