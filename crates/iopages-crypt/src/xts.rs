//! AES-XTS with plain64 IVs over whole sectors: dm-crypt's
//! `aes-xts-plain64`.
//!
//! Owns: key checks, the sector geometry (512 or 4096 bytes, `iv_offset`,
//! IV units), the plain64 IV, the choice among three interchangeable
//! backends, and two of them: RustCrypto (`aes` round keys plus the XTS
//! mode written here) and OpenSSL (one EVP context per direction). The
//! third, the VAES kernel, lives in `vaes.rs`. Must never: re-expand the
//! AES keys per sector, allocate on the data path, or panic on a caller's
//! buffer — every misuse is an [`Error`].
//!
//! XTS (IEEE 1619) encrypts block `j` of data unit `i` as
//! `C = E_K1(P ^ T) ^ T` with `T = E_K2(iv(i)) · α^j` in GF(2^128). The
//! RustCrypto path computes the first tweaks of up to
//! [`TWEAK_BATCH_SECTORS`] sectors in one parallel pass through the tweak
//! key, then streams the data blocks through the data key's widest parallel
//! backend (VAES, AES-NI or the constant-time software one, chosen by the
//! `aes` crate at run time), multiplying the tweak by α block by block and
//! starting over at each sector boundary. Sectors are whole numbers of
//! blocks, so ciphertext stealing never happens.

use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::vaes::VaesXts;
use aes::cipher::{
    array::{Array, ArraySize},
    consts::U16,
    typenum::Unsigned,
    BlockCipherDecBackend, BlockCipherDecClosure, BlockCipherDecrypt, BlockCipherEncBackend,
    BlockCipherEncClosure, BlockCipherEncrypt, BlockSizeUser, KeyInit,
};
use aes::{Aes128, Aes128Enc, Aes256, Aes256Enc};
use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;
use zeroize::Zeroize;

/// AES block size in bytes.
const BLOCK_BYTES: usize = 16;
/// Sector sizes this cipher takes, bytes.
pub const SECTOR_SIZES_BYTES: [usize; 2] = [512, 4096];
/// Key sizes this cipher takes, bytes: AES-128-XTS and AES-256-XTS.
pub const KEY_SIZES_BYTES: [usize; 2] = [32, 64];
/// Sectors whose first tweaks are computed in one pass through the tweak
/// key (a stack array; bounds the work per pass, never allocates).
pub const TWEAK_BATCH_SECTORS: usize = 64;
/// The unit of dm-crypt's sector numbers and `iv_offset`.
pub const KERNEL_SECTOR_BYTES: usize = 512;

/// Which implementation does the AES work. All give identical output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XtsBackend {
    /// This crate's kernel for x86_64 CPUs with AES-NI, AVX2, VAES and VPCLMULQDQ
    /// (`vaes.rs`): two blocks per instruction, sixteen in flight. The
    /// default where the CPU has it — the fastest on the project's machine,
    /// see `docs/experiments.md` (`bench xts`) and `docs/architecture.md`.
    Vaes,
    /// RustCrypto's `aes` (VAES / AES-NI / constant-time software, chosen
    /// at run time) with the XTS mode of this module. Runs anywhere; the
    /// default where [`XtsBackend::Vaes`] cannot run.
    RustCrypto,
    /// OpenSSL's EVP `aes-{128,256}-xts`, one initialised context per
    /// direction; the IV is set per sector with no key.
    OpenSsl,
}

impl XtsBackend {
    /// Every backend, fastest first.
    pub const ALL: [XtsBackend; 3] = [
        XtsBackend::Vaes,
        XtsBackend::RustCrypto,
        XtsBackend::OpenSsl,
    ];

    /// Short name for tables and reports.
    pub fn name(self) -> &'static str {
        match self {
            XtsBackend::Vaes => "vaes",
            XtsBackend::RustCrypto => "rustcrypto",
            XtsBackend::OpenSsl => "openssl",
        }
    }

    /// Whether this backend can run on this CPU (only [`XtsBackend::Vaes`]
    /// depends on it).
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            XtsBackend::Vaes => crate::vaes::available(),
            #[cfg(not(target_arch = "x86_64"))]
            XtsBackend::Vaes => false,
            XtsBackend::RustCrypto | XtsBackend::OpenSsl => true,
        }
    }

    /// The instructions this backend runs on this CPU, for people
    /// (`iopages --version`): [`XtsBackend::Vaes`] its own; RustCrypto's
    /// `aes` picks VAES (on AVX-512 or AVX2 registers), AES-NI (or ARMv8's
    /// AES) or its portable constant-time code at run time, and this names
    /// the one it picks; OpenSSL picks for itself.
    pub fn instructions(self) -> &'static str {
        match self {
            XtsBackend::Vaes if self.is_available() => "VAES and VPCLMULQDQ on AVX2 registers",
            XtsBackend::Vaes => "none: this CPU lacks AES-NI, AVX2, VAES or VPCLMULQDQ",
            XtsBackend::RustCrypto => rustcrypto_instructions(),
            XtsBackend::OpenSsl => "OpenSSL's own run-time choice",
        }
    }
}

/// What RustCrypto's `aes` runs here, tested as it tests (its
/// `cpufeatures` checks, in the same order).
fn rustcrypto_instructions() -> &'static str {
    #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("vaes") {
            return "VAES on AVX-512 registers";
        }
        if has!("vaes") {
            return "VAES on AVX2 registers";
        }
        if has!("aes") {
            return "AES-NI";
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("aes") {
            return "the ARMv8 AES instructions";
        }
    }
    "portable constant-time code (no AES instructions here)"
}

impl Default for XtsBackend {
    /// The fastest backend this CPU runs: [`XtsBackend::Vaes`], else
    /// [`XtsBackend::RustCrypto`].
    fn default() -> Self {
        if XtsBackend::Vaes.is_available() {
            XtsBackend::Vaes
        } else {
            XtsBackend::RustCrypto
        }
    }
}

/// The plain64 IV of dm-crypt: `iv_sector` as a little-endian 64-bit
/// number in the first 8 bytes of the 16-byte tweak, the rest zero.
///
/// **Context:** any. **Returns:** the IV block.
pub fn plain64_iv(iv_sector: u64) -> [u8; 16] {
    let mut iv = [0u8; 16];
    iv[..8].copy_from_slice(&iv_sector.to_le_bytes());
    iv
}

/// Builds an [`XtsCipher`]; see [`XtsCipher::builder`].
#[derive(Clone, Copy)]
pub struct XtsCipherBuilder<'k> {
    key: &'k [u8],
    sector_size_bytes: usize,
    iv_offset: u64,
    iv_large_sectors: bool,
    backend: XtsBackend,
}

impl std::fmt::Debug for XtsCipherBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("XtsCipherBuilder")
            .field("key_bytes", &self.key.len())
            .field("sector_size_bytes", &self.sector_size_bytes)
            .field("iv_offset", &self.iv_offset)
            .field("iv_large_sectors", &self.iv_large_sectors)
            .field("backend", &self.backend)
            .finish()
    }
}

impl<'k> XtsCipherBuilder<'k> {
    /// Sector (XTS data unit) size: 512 (default) or 4096 bytes.
    pub fn sector_size_bytes(mut self, size_bytes: usize) -> Self {
        self.sector_size_bytes = size_bytes;
        self
    }

    /// Added to every IV sector number (dm-crypt's `iv_offset`), in IV
    /// units (see [`Self::iv_large_sectors`]). Default 0.
    pub fn iv_offset(mut self, iv_offset: u64) -> Self {
        self.iv_offset = iv_offset;
        self
    }

    /// `true` (default): the IV counts this cipher's sectors, as dm-crypt
    /// does with its `iv_large_sectors` option (which cryptsetup sets only
    /// for plain devices, `--iv-large-sectors`). `false`: the IV counts
    /// 512-byte units even for 4096-byte sectors (dm-crypt's default table
    /// without the option, and what cryptsetup sets up for every LUKS
    /// volume, LUKS2 with 4096-byte sectors included — use
    /// [`LuksVolume::xts_cipher`](crate::luks::LuksVolume::xts_cipher)),
    /// so sector `s` gets IV `s * 8 + iv_offset`. The two agree for
    /// 512-byte sectors.
    pub fn iv_large_sectors(mut self, large: bool) -> Self {
        self.iv_large_sectors = large;
        self
    }

    /// Which implementation does the AES work. Default:
    /// [`XtsBackend::default`].
    pub fn backend(mut self, backend: XtsBackend) -> Self {
        self.backend = backend;
        self
    }

    /// Check the settings and expand the keys once.
    ///
    /// **Context:** may allocate (the OpenSSL contexts); call at set-up,
    /// not per request. **Returns:** [`Error::KeyLength`] unless the key
    /// is 32 or 64 bytes, [`Error::EqualKeyHalves`] when the data and
    /// tweak halves are equal, [`Error::SectorSize`] unless the sector
    /// size is 512 or 4096, [`Error::OpenSsl`] if OpenSSL refuses the key.
    pub fn build(self) -> Result<XtsCipher> {
        let key = self.key;
        if !KEY_SIZES_BYTES.contains(&key.len()) {
            return Err(Error::KeyLength {
                len_bytes: key.len(),
            });
        }
        let (k1, k2) = key.split_at(key.len() / 2);
        // Compared without an early exit, as OpenSSL does (CRYPTO_memcmp).
        let differ = k1.iter().zip(k2).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if differ == 0 {
            return Err(Error::EqualKeyHalves);
        }
        if !SECTOR_SIZES_BYTES.contains(&self.sector_size_bytes) {
            return Err(Error::SectorSize {
                size_bytes: self.sector_size_bytes,
            });
        }
        let engine = match self.backend {
            #[cfg(target_arch = "x86_64")]
            XtsBackend::Vaes => {
                Engine::Vaes(VaesXts::new(k1, k2).ok_or(Error::BackendUnavailable {
                    backend: "vaes",
                    reason: "this CPU lacks AES-NI, AVX2, VAES or VPCLMULQDQ",
                })?)
            }
            #[cfg(not(target_arch = "x86_64"))]
            XtsBackend::Vaes => {
                return Err(Error::BackendUnavailable {
                    backend: "vaes",
                    reason: "it is written for x86_64 only",
                })
            }
            XtsBackend::RustCrypto => Engine::RustCrypto(RustCryptoXts::new(k1, k2)),
            XtsBackend::OpenSsl => Engine::OpenSsl(OpenSslXts::new(key)?),
        };
        let iv_step = if self.iv_large_sectors {
            1
        } else {
            (self.sector_size_bytes / KERNEL_SECTOR_BYTES) as u64
        };
        Ok(XtsCipher {
            engine,
            key_size_bytes: key.len(),
            sector_size_bytes: self.sector_size_bytes,
            iv_offset: self.iv_offset,
            iv_step,
        })
    }
}

/// AES-XTS over whole sectors with dm-crypt's plain64 IVs.
///
/// Sector `s` of a request is encrypted with the IV
/// `plain64(s * step + iv_offset)` (modulo 2^64, like the kernel's
/// `sector_t`), where `step` is 1, or `sector_size / 512` when
/// [`XtsCipherBuilder::iv_large_sectors`] is off. The keys are expanded
/// once in [`XtsCipherBuilder::build`]; each sector only sets its tweak.
///
/// Key material: the VAES backend's round keys are zeroized on drop, and
/// the copies its kernel spreads on the stack are overwritten before each
/// call returns; the RustCrypto backend's expanded keys are zeroized on
/// drop by the `aes` crate (its `zeroize` feature), and this crate wipes
/// its per-call tweak buffers. The OpenSSL backend's key schedule lives in
/// OpenSSL's memory, out of Rust's reach: OpenSSL wipes it itself
/// (`OPENSSL_clear_free` in the provider's `freectx`) when the context is
/// freed on drop. Values left in CPU registers, and copies the compiler
/// makes on its own, cannot be wiped by any of them. The key passed to
/// [`XtsCipher::builder`] is the caller's to wipe.
pub struct XtsCipher {
    engine: Engine,
    key_size_bytes: usize,
    sector_size_bytes: usize,
    iv_offset: u64,
    iv_step: u64,
}

impl std::fmt::Debug for XtsCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("XtsCipher")
            .field("backend", &self.backend())
            .field("key_size_bytes", &self.key_size_bytes)
            .field("sector_size_bytes", &self.sector_size_bytes)
            .field("iv_offset", &self.iv_offset)
            .field("iv_large_sectors", &self.iv_large_sectors())
            .finish()
    }
}

enum Engine {
    #[cfg(target_arch = "x86_64")]
    Vaes(VaesXts),
    RustCrypto(RustCryptoXts),
    OpenSsl(OpenSslXts),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Encrypt,
    Decrypt,
}

impl XtsCipher {
    /// Start building a cipher from a 32-byte (AES-128-XTS) or 64-byte
    /// (AES-256-XTS) key: first half the data key, second half the tweak
    /// key, as dm-crypt and cryptsetup lay them out. The builder borrows
    /// the key; the caller owns (and wipes) it.
    pub fn builder(key: &[u8]) -> XtsCipherBuilder<'_> {
        XtsCipherBuilder {
            key,
            sector_size_bytes: 512,
            iv_offset: 0,
            iv_large_sectors: true,
            backend: XtsBackend::default(),
        }
    }

    /// A cipher with the default backend and IV units.
    ///
    /// **Context:** as [`XtsCipherBuilder::build`]. **Returns:** its errors.
    pub fn new(key: &[u8], sector_size_bytes: usize, iv_offset: u64) -> Result<XtsCipher> {
        XtsCipher::builder(key)
            .sector_size_bytes(sector_size_bytes)
            .iv_offset(iv_offset)
            .build()
    }

    /// The backend doing the AES work.
    pub fn backend(&self) -> XtsBackend {
        match self.engine {
            #[cfg(target_arch = "x86_64")]
            Engine::Vaes(_) => XtsBackend::Vaes,
            Engine::RustCrypto(_) => XtsBackend::RustCrypto,
            Engine::OpenSsl(_) => XtsBackend::OpenSsl,
        }
    }

    /// 32 (AES-128-XTS) or 64 (AES-256-XTS).
    pub fn key_size_bytes(&self) -> usize {
        self.key_size_bytes
    }

    /// 512 or 4096.
    pub fn sector_size_bytes(&self) -> usize {
        self.sector_size_bytes
    }

    /// The offset added to every IV sector number.
    pub fn iv_offset(&self) -> u64 {
        self.iv_offset
    }

    /// Whether the IV counts this cipher's sectors (`true`) or 512-byte
    /// units.
    pub fn iv_large_sectors(&self) -> bool {
        self.iv_step == 1
    }

    /// The IV sector number of `sector`: `sector * step + iv_offset`,
    /// modulo 2^64.
    pub fn iv_sector(&self, sector: u64) -> u64 {
        sector
            .wrapping_mul(self.iv_step)
            .wrapping_add(self.iv_offset)
    }

    /// The plain64 IV block of `sector`.
    pub fn iv(&self, sector: u64) -> [u8; 16] {
        plain64_iv(self.iv_sector(sector))
    }

    /// Encrypt `src` (whole sectors, the first numbered `first_sector`)
    /// into `dst` of the same length — dm-crypt's write path into fresh
    /// pages.
    ///
    /// **Context:** never blocks or allocates. **Returns:**
    /// [`Error::PartialSector`], [`Error::LengthMismatch`], or
    /// [`Error::OpenSsl`] (OpenSSL backend); `dst` is unspecified after an
    /// error.
    pub fn encrypt_sectors(&mut self, first_sector: u64, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.crypt(Direction::Encrypt, first_sector, Some(src), dst, false)
    }

    /// As [`Self::encrypt_sectors`], but the VAES backend writes a 32-byte
    /// aligned `dst` with non-temporal stores: past the caches, without
    /// first reading each line in. For ciphertext that goes to a device and
    /// is not read back by the CPU soon (the crypt target's out pages), it
    /// saves the read of cold memory; for a buffer that stays in cache it
    /// is slower. Same output as [`Self::encrypt_sectors`]; the other
    /// backends simply encrypt.
    pub fn encrypt_sectors_streaming(
        &mut self,
        first_sector: u64,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        self.crypt(Direction::Encrypt, first_sector, Some(src), dst, true)
    }

    /// Encrypt `src` into `dst`'s segments, filled back to back (the
    /// sectors numbered on across them; each segment whole sectors):
    /// a write's out pages where they are not contiguous. One call, so
    /// the per-call work (taking the keys into registers, the first
    /// tweaks sixteen sectors at a time) is paid once per request, not
    /// once per page. `streaming` as [`Self::encrypt_sectors_streaming`]
    /// (non-temporal stores where every segment is 32-byte aligned).
    /// Same output as [`Self::encrypt_sectors`] into one buffer.
    ///
    /// **Context:** never blocks or allocates. **Returns:** as
    /// [`Self::encrypt_sectors`], the lengths checked against the
    /// segments' total.
    pub fn encrypt_sectors_scattered(
        &mut self,
        first_sector: u64,
        src: &[u8],
        dst: &mut [&mut [u8]],
        streaming: bool,
    ) -> Result<()> {
        self.crypt_segments(Direction::Encrypt, first_sector, Some(src), dst, streaming)
    }

    /// Decrypt `src` into `dst`. As [`Self::encrypt_sectors`].
    pub fn decrypt_sectors(&mut self, first_sector: u64, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.crypt(Direction::Decrypt, first_sector, Some(src), dst, false)
    }

    /// Encrypt whole sectors in place. As [`Self::encrypt_sectors`].
    pub fn encrypt_sectors_in_place(&mut self, first_sector: u64, buf: &mut [u8]) -> Result<()> {
        self.crypt(Direction::Encrypt, first_sector, None, buf, false)
    }

    /// Decrypt whole sectors in place — dm-crypt's read path. As
    /// [`Self::encrypt_sectors`].
    pub fn decrypt_sectors_in_place(&mut self, first_sector: u64, buf: &mut [u8]) -> Result<()> {
        self.crypt(Direction::Decrypt, first_sector, None, buf, false)
    }

    /// An independent cipher with the same keys and geometry (one per
    /// worker thread, as dm-crypt keeps one transform per CPU).
    ///
    /// **Context:** may allocate. **Returns:** [`Error::OpenSsl`] if
    /// OpenSSL cannot copy its context.
    pub fn try_clone(&self) -> Result<XtsCipher> {
        let engine = match &self.engine {
            #[cfg(target_arch = "x86_64")]
            Engine::Vaes(v) => Engine::Vaes(v.clone()),
            Engine::RustCrypto(r) => Engine::RustCrypto(r.clone()),
            Engine::OpenSsl(o) => Engine::OpenSsl(o.try_clone()?),
        };
        Ok(XtsCipher {
            engine,
            key_size_bytes: self.key_size_bytes,
            sector_size_bytes: self.sector_size_bytes,
            iv_offset: self.iv_offset,
            iv_step: self.iv_step,
        })
    }

    fn crypt(
        &mut self,
        dir: Direction,
        first_sector: u64,
        src: Option<&[u8]>,
        dst: &mut [u8],
        stream: bool,
    ) -> Result<()> {
        self.crypt_segments(dir, first_sector, src, &mut [dst], stream)
    }

    /// [`Self::crypt`] into `dst`'s segments, back to back: the VAES
    /// backend in one pass, the others segment by segment.
    fn crypt_segments(
        &mut self,
        dir: Direction,
        first_sector: u64,
        src: Option<&[u8]>,
        dst: &mut [&mut [u8]],
        stream: bool,
    ) -> Result<()> {
        let total: usize = dst.iter().map(|d| d.len()).sum();
        if let Some(src) = src {
            if src.len() != total {
                return Err(Error::LengthMismatch {
                    src_bytes: src.len(),
                    dst_bytes: total,
                });
            }
        }
        if let Some(d) = dst
            .iter()
            .find(|d| !d.len().is_multiple_of(self.sector_size_bytes))
        {
            return Err(Error::PartialSector {
                len_bytes: d.len(),
                sector_size_bytes: self.sector_size_bytes,
            });
        }
        let ss = self.sector_size_bytes;
        let mut geometry = Geometry {
            sector_size_bytes: ss,
            first_iv: self.iv_sector(first_sector),
            iv_step: self.iv_step,
        };
        #[cfg(target_arch = "x86_64")]
        if let Engine::Vaes(v) = &self.engine {
            let op = match (dir, stream) {
                (Direction::Decrypt, _) => crate::vaes::Op::Decrypt,
                (Direction::Encrypt, false) => crate::vaes::Op::Encrypt,
                (Direction::Encrypt, true) => crate::vaes::Op::EncryptStreaming,
            };
            v.crypt_segments(op, geometry.first_iv, geometry.iv_step, ss, src, dst);
            return Ok(());
        }
        let mut done = 0;
        for d in dst.iter_mut() {
            let s = src.map(|s| &s[done..done + d.len()]);
            match &mut self.engine {
                #[cfg(target_arch = "x86_64")]
                Engine::Vaes(_) => unreachable!("served above"),
                Engine::RustCrypto(r) => r.crypt(dir, geometry, s, d),
                Engine::OpenSsl(o) => o.crypt(dir, geometry, s, d)?,
            }
            done += d.len();
            geometry.first_iv = geometry.iv(d.len() / ss);
        }
        Ok(())
    }
}

/// Where a request's sectors sit: IV of sector `k` of the request is
/// `first_iv + k * iv_step` (mod 2^64).
#[derive(Clone, Copy)]
struct Geometry {
    sector_size_bytes: usize,
    first_iv: u64,
    iv_step: u64,
}

impl Geometry {
    fn iv(&self, k: usize) -> u64 {
        self.first_iv
            .wrapping_add((k as u64).wrapping_mul(self.iv_step))
    }
}

// ---------------------------------------------------------------------------
// RustCrypto backend.

/// The expanded data key (both directions) and tweak key (encryption only).
/// `aes` zeroizes both on drop.
#[derive(Clone)]
enum RustCryptoXts {
    Aes128 { data: Aes128, tweak: Aes128Enc },
    Aes256 { data: Aes256, tweak: Aes256Enc },
}

impl RustCryptoXts {
    fn new(k1: &[u8], k2: &[u8]) -> RustCryptoXts {
        // Lengths were checked by the builder: 16 or 32 bytes each.
        match k1.len() {
            16 => RustCryptoXts::Aes128 {
                data: Aes128::new_from_slice(k1).expect("16-byte key"),
                tweak: Aes128Enc::new_from_slice(k2).expect("16-byte key"),
            },
            _ => RustCryptoXts::Aes256 {
                data: Aes256::new_from_slice(k1).expect("32-byte key"),
                tweak: Aes256Enc::new_from_slice(k2).expect("32-byte key"),
            },
        }
    }

    fn crypt(&self, dir: Direction, geo: Geometry, src: Option<&[u8]>, dst: &mut [u8]) {
        match self {
            RustCryptoXts::Aes128 { data, tweak } => xts_crypt(data, tweak, dir, geo, src, dst),
            RustCryptoXts::Aes256 { data, tweak } => xts_crypt(data, tweak, dir, geo, src, dst),
        }
    }
}

/// XTS over whole sectors, batch by batch of [`TWEAK_BATCH_SECTORS`].
fn xts_crypt<C, T>(
    data: &C,
    tweak: &T,
    dir: Direction,
    geo: Geometry,
    src: Option<&[u8]>,
    dst: &mut [u8],
) where
    C: BlockCipherEncrypt + BlockCipherDecrypt + BlockSizeUser<BlockSize = U16>,
    T: BlockCipherEncrypt + BlockSizeUser<BlockSize = U16>,
{
    let sector = geo.sector_size_bytes;
    debug_assert!(sector.is_multiple_of(BLOCK_BYTES) && dst.len().is_multiple_of(sector));
    debug_assert!(src.is_none_or(|s| s.len() == dst.len()));
    let batch_bytes = sector * TWEAK_BATCH_SECTORS;
    let mut first_tweaks = [0u128; TWEAK_BATCH_SECTORS];
    for (batch, out) in dst.chunks_mut(batch_bytes).enumerate() {
        let nr_sectors = out.len() / sector;
        let first_k = batch * TWEAK_BATCH_SECTORS;
        for (k, t) in first_tweaks[..nr_sectors].iter_mut().enumerate() {
            // plain64: the IV block read as a little-endian number is the
            // 64-bit sector number itself.
            *t = u128::from(geo.iv(first_k + k));
        }
        tweak.encrypt_with_backend(EncryptTweaks {
            tweaks: &mut first_tweaks[..nr_sectors],
        });
        let pass = XtsPass {
            first_tweaks: &first_tweaks[..nr_sectors],
            blocks_per_sector: sector / BLOCK_BYTES,
            src: src.map(|s| &s[batch * batch_bytes..][..out.len()]),
            dst: out,
        };
        match dir {
            Direction::Encrypt => data.encrypt_with_backend(pass),
            Direction::Decrypt => data.decrypt_with_backend(pass),
        }
    }
    first_tweaks.zeroize();
}

/// Multiply a tweak by α (x) in GF(2^128) modulo x^128 + x^7 + x^2 + x + 1,
/// the tweak read as a little-endian number (IEEE 1619 §5.2).
#[inline(always)]
fn mul_alpha(t: u128) -> u128 {
    // Branch-free: the reduction mask is all ones when the top bit is set.
    (t << 1) ^ (0u128.wrapping_sub(t >> 127) & 0x87)
}

/// Encrypts sector IVs into first tweaks, in place, a full parallel width
/// at a time (a short last group is padded rather than done block by block,
/// which would serialise on the AES latency).
struct EncryptTweaks<'a> {
    tweaks: &'a mut [u128],
}

impl BlockSizeUser for EncryptTweaks<'_> {
    type BlockSize = U16;
}

impl BlockCipherEncClosure for EncryptTweaks<'_> {
    #[inline(always)]
    fn call<B: BlockCipherEncBackend<BlockSize = U16>>(self, backend: &B) {
        let width = B::ParBlocksSize::USIZE;
        let mut lanes: Array<Array<u8, U16>, B::ParBlocksSize> = Default::default();
        for group in self.tweaks.chunks_mut(width) {
            for (lane, t) in lanes.iter_mut().zip(group.iter()) {
                *lane = t.to_le_bytes().into();
            }
            backend.encrypt_par_blocks_inplace(&mut lanes);
            for (lane, t) in lanes.iter().zip(group.iter_mut()) {
                *t = u128::from_le_bytes(lane.0);
            }
        }
        wipe_lanes(&mut lanes);
    }
}

/// One XTS pass over whole sectors whose first tweaks are known.
struct XtsPass<'a> {
    first_tweaks: &'a [u128],
    blocks_per_sector: usize,
    /// `None`: in place (read from `dst`).
    src: Option<&'a [u8]>,
    dst: &'a mut [u8],
}

impl BlockSizeUser for XtsPass<'_> {
    type BlockSize = U16;
}

impl BlockCipherEncClosure for XtsPass<'_> {
    #[inline(always)]
    fn call<B: BlockCipherEncBackend<BlockSize = U16>>(self, backend: &B) {
        self.run::<B::ParBlocksSize>(|lanes| backend.encrypt_par_blocks_inplace(lanes));
    }
}

impl BlockCipherDecClosure for XtsPass<'_> {
    #[inline(always)]
    fn call<B: BlockCipherDecBackend<BlockSize = U16>>(self, backend: &B) {
        self.run::<B::ParBlocksSize>(|lanes| backend.decrypt_par_blocks_inplace(lanes));
    }
}

impl XtsPass<'_> {
    /// `C = E(P ^ T) ^ T` for every block, `width` blocks per call of
    /// `cipher`. The tweak runs on across groups and restarts at each
    /// sector from the next first tweak.
    #[inline(always)]
    fn run<W: ArraySize>(self, mut cipher: impl FnMut(&mut Array<Array<u8, U16>, W>)) {
        let width_bytes = W::USIZE * BLOCK_BYTES;
        let mut lanes: Array<Array<u8, U16>, W> = Default::default();
        let mut tweaks: Array<u128, W> = Default::default();
        let mut next_first = self.first_tweaks.iter();
        let mut t = 0u128;
        let mut pos = 0usize;
        let mut done_bytes = 0usize;
        for out in self.dst.chunks_mut(width_bytes) {
            let inp = self.src.map(|s| &s[done_bytes..][..out.len()]);
            let n = out.len() / BLOCK_BYTES;
            for i in 0..n {
                if pos == 0 {
                    t = *next_first.next().expect("one first tweak per sector");
                }
                tweaks[i] = t;
                t = mul_alpha(t);
                pos += 1;
                if pos == self.blocks_per_sector {
                    pos = 0;
                }
                let block = match inp {
                    Some(inp) => &inp[i * BLOCK_BYTES..][..BLOCK_BYTES],
                    None => &out[i * BLOCK_BYTES..][..BLOCK_BYTES],
                };
                let p = u128::from_le_bytes(block.try_into().expect("16 bytes"));
                lanes[i] = (p ^ tweaks[i]).to_le_bytes().into();
            }
            // A short last group runs at full width too; the spare lanes
            // hold stale blocks whose output is dropped.
            cipher(&mut lanes);
            for (i, c) in out.chunks_exact_mut(BLOCK_BYTES).enumerate() {
                let x = u128::from_le_bytes(lanes[i].0) ^ tweaks[i];
                c.copy_from_slice(&x.to_le_bytes());
            }
            done_bytes += out.len();
        }
        debug_assert!(pos == 0 && next_first.next().is_none());
        tweaks.as_mut_slice().zeroize();
        wipe_lanes(&mut lanes);
    }
}

/// Wipe a lane buffer (tweak-masked data or tweaks) before it goes out of
/// scope.
#[inline(always)]
fn wipe_lanes<W: ArraySize>(lanes: &mut Array<Array<u8, U16>, W>) {
    for lane in lanes.iter_mut() {
        lane.0.zeroize();
    }
}

// ---------------------------------------------------------------------------
// OpenSSL backend.

/// One EVP context per direction, keyed once. Per sector only the IV is
/// set (`EVP_CipherInit_ex` with no cipher and no key), which keeps the
/// expanded keys.
struct OpenSslXts {
    enc: CipherCtx,
    dec: CipherCtx,
}

impl OpenSslXts {
    fn new(key: &[u8]) -> Result<OpenSslXts> {
        let cipher = if key.len() == 32 {
            Cipher::aes_128_xts()
        } else {
            Cipher::aes_256_xts()
        };
        let mut enc = CipherCtx::new()?;
        enc.encrypt_init(Some(cipher), Some(key), None)?;
        let mut dec = CipherCtx::new()?;
        dec.decrypt_init(Some(cipher), Some(key), None)?;
        Ok(OpenSslXts { enc, dec })
    }

    fn try_clone(&self) -> Result<OpenSslXts> {
        let mut enc = CipherCtx::new()?;
        enc.copy(&self.enc)?;
        let mut dec = CipherCtx::new()?;
        dec.copy(&self.dec)?;
        Ok(OpenSslXts { enc, dec })
    }

    fn crypt(
        &mut self,
        dir: Direction,
        geo: Geometry,
        src: Option<&[u8]>,
        dst: &mut [u8],
    ) -> Result<()> {
        let sector = geo.sector_size_bytes;
        for (k, out) in dst.chunks_mut(sector).enumerate() {
            let iv = plain64_iv(geo.iv(k));
            // XTS takes one update per data unit; a fresh IV starts the next.
            let ctx = match dir {
                Direction::Encrypt => {
                    self.enc.encrypt_init(None, None, Some(&iv))?;
                    &mut self.enc
                }
                Direction::Decrypt => {
                    self.dec.decrypt_init(None, None, Some(&iv))?;
                    &mut self.dec
                }
            };
            let n = match src {
                Some(src) => ctx.cipher_update(&src[k * sector..][..sector], Some(out))?,
                None => ctx.cipher_update_inplace(out, sector)?,
            };
            debug_assert_eq!(n, sector);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backend_names_the_instructions_it_runs_here() {
        for b in XtsBackend::ALL {
            assert!(!b.instructions().is_empty(), "{}", b.name());
        }
        let vaes = XtsBackend::Vaes.instructions();
        assert_eq!(
            XtsBackend::Vaes.is_available(),
            !vaes.starts_with("none"),
            "{vaes}"
        );
        // RustCrypto's portable code runs exactly where there is no AES
        // instruction at all.
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            XtsBackend::RustCrypto
                .instructions()
                .starts_with("portable"),
            !std::arch::is_x86_feature_detected!("aes")
        );
    }
}
