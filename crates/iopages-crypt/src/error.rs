//! The crate's one error type.
//!
//! Owns: every error a caller of `iopages-crypt` can see — a key, sector
//! size or buffer the cipher cannot take, and failures reported by OpenSSL.
//! Must never: carry key material (errors are printed and logged).

/// Errors from building a cipher or from encrypting and decrypting sectors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is neither 32 nor 64 bytes.
    #[error(
        "an AES-XTS key is 32 bytes (AES-128-XTS) or 64 bytes (AES-256-XTS), not {len_bytes} bytes"
    )]
    KeyLength {
        /// The length given.
        len_bytes: usize,
    },
    /// The two halves of the key (data key and tweak key) are equal.
    #[error(
        "the two halves of the AES-XTS key are equal; XTS needs independent data and tweak keys (OpenSSL refuses such keys too)"
    )]
    EqualKeyHalves,
    /// The sector size is not one dm-crypt's plain64 volumes use here.
    #[error("sector size {size_bytes} bytes is not supported: use 512 or 4096")]
    SectorSize {
        /// The size given.
        size_bytes: usize,
    },
    /// A buffer is not a whole number of sectors.
    #[error(
        "a buffer of {len_bytes} bytes is not a whole number of {sector_size_bytes}-byte sectors"
    )]
    PartialSector {
        /// The buffer's length.
        len_bytes: usize,
        /// The cipher's sector size.
        sector_size_bytes: usize,
    },
    /// Source and destination differ in length.
    #[error("the source is {src_bytes} bytes but the destination is {dst_bytes} bytes")]
    LengthMismatch {
        /// Source length.
        src_bytes: usize,
        /// Destination length.
        dst_bytes: usize,
    },
    /// The backend asked for cannot run here.
    #[error("the {backend} backend cannot run here: {reason}")]
    BackendUnavailable {
        /// The backend's name.
        backend: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// OpenSSL refused an operation (the OpenSSL backend only).
    #[error("OpenSSL: {0}")]
    OpenSsl(#[from] openssl::error::ErrorStack),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
