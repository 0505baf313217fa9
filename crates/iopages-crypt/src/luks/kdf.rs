//! Hashes and passphrase-based key derivation for LUKS keyslots and
//! volume-key digests.
//!
//! Owns: [`enum@Hash`] (the hash specs LUKS names: `sha1`, `sha256`, `sha512`),
//! one-shot hashing for the AF diffuser and the LUKS2 header checksum,
//! PBKDF2-HMAC (OpenSSL's `PKCS5_PBKDF2_HMAC`), Argon2i / Argon2id version
//! 0x13 (this crate's lane-parallel `argon2` module, which allocates and
//! wipes its memory), the
//! [`Pbkdf`] choice with its defaults and the limits cryptsetup applies.
//! Must never: allocate Argon2 memory without a bound and a fallible
//! reservation (a header can ask for gigabytes), leave derived bytes or
//! Argon2 memory unwiped, or panic on parameters read from a header.
//!
//! Layering: the bottom of the KDF modules. `limits` (what opening
//! accepts) and `calibrate` (what formatting chooses, including
//! [`Pbkdf::calibrate`]) name these types; nothing here names them.

use super::argon2::{Argon2Error, Variant};
use super::key::SecretBuf;
use super::LuksError;
use openssl::hash::MessageDigest;
use zeroize::Zeroize;

/// A hash LUKS names in its headers (LUKS1 `hash-spec`, LUKS2 `af.hash`,
/// `kdf.hash`, `digests.*.hash`, `checksum_alg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Hash {
    /// SHA-1 (20-byte digest). LUKS1's historical default.
    Sha1,
    /// SHA-256 (32-byte digest). cryptsetup's default since 1.7.
    Sha256,
    /// SHA-512 (64-byte digest).
    Sha512,
}

impl Hash {
    /// The name as written in LUKS headers.
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha1 => "sha1",
            Hash::Sha256 => "sha256",
            Hash::Sha512 => "sha512",
        }
    }

    /// Parse a header's hash name (case-insensitive, as cryptsetup is).
    pub fn from_name(name: &str) -> Option<Hash> {
        match name.to_ascii_lowercase().as_str() {
            "sha1" => Some(Hash::Sha1),
            "sha256" => Some(Hash::Sha256),
            "sha512" => Some(Hash::Sha512),
            _ => None,
        }
    }

    /// Digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }

    fn message_digest(self) -> MessageDigest {
        match self {
            Hash::Sha1 => MessageDigest::sha1(),
            Hash::Sha256 => MessageDigest::sha256(),
            Hash::Sha512 => MessageDigest::sha512(),
        }
    }

    /// Hash the concatenation of `parts` into `out[..digest_len]`
    /// (`out` must be at least 64 bytes). The stack copy is wiped.
    pub(crate) fn digest_into(self, parts: &[&[u8]], out: &mut [u8; 64]) {
        match self {
            Hash::Sha1 => {
                let mut h = openssl::sha::Sha1::new();
                parts.iter().for_each(|p| h.update(p));
                let mut d = h.finish();
                out[..20].copy_from_slice(&d);
                d.zeroize();
            }
            Hash::Sha256 => {
                let mut h = openssl::sha::Sha256::new();
                parts.iter().for_each(|p| h.update(p));
                let mut d = h.finish();
                out[..32].copy_from_slice(&d);
                d.zeroize();
            }
            Hash::Sha512 => {
                let mut h = openssl::sha::Sha512::new();
                parts.iter().for_each(|p| h.update(p));
                let mut d = h.finish();
                out.copy_from_slice(&d);
                d.zeroize();
            }
        }
    }
}

impl std::fmt::Display for Hash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// cryptsetup's smallest PBKDF2 iteration count for keyslots and digests.
pub const PBKDF2_MIN_ITERATIONS: u32 = 1000;
/// cryptsetup's smallest Argon2 time cost.
pub const ARGON2_MIN_TIME: u32 = 4;
/// cryptsetup's smallest Argon2 memory cost, KiB.
pub const ARGON2_MIN_MEMORY_KIB: u32 = 32;
/// cryptsetup's largest Argon2 memory cost, KiB (4 GiB). Headers asking
/// for more are refused rather than allocated.
pub const ARGON2_MAX_MEMORY_KIB: u32 = 4 * 1024 * 1024;
/// cryptsetup's largest Argon2 thread count when it formats.
pub const ARGON2_MAX_PARALLEL_FORMAT: u32 = 4;
/// The largest Argon2 lane count accepted when opening (RFC 9106 allows
/// up to 2^24 - 1; nobody formats with more than a few).
pub const ARGON2_MAX_PARALLEL_OPEN: u32 = 1024;

/// How a keyslot turns a passphrase into the key that unlocks its area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pbkdf {
    /// PBKDF2-HMAC (RFC 8018) with `hash`: LUKS1 keyslots, LUKS2
    /// `"pbkdf2"` keyslots.
    Pbkdf2 {
        /// The HMAC hash.
        hash: Hash,
        /// Iteration count (at least 1000 to format, as cryptsetup).
        iterations: u32,
    },
    /// Argon2i version 0x13 (RFC 9106), LUKS2 only.
    Argon2i {
        /// Passes over memory (LUKS2 `time`; at least 4 to format).
        time: u32,
        /// Memory in KiB (LUKS2 `memory`; 32 KiB ..= 4 GiB).
        memory_kib: u32,
        /// Lanes (LUKS2 `cpus`; 1 ..= 4 to format), computed in up to
        /// min(lanes, CPUs) threads.
        parallel: u32,
    },
    /// Argon2id version 0x13 (RFC 9106), LUKS2 only.
    Argon2id {
        /// Passes over memory (LUKS2 `time`; at least 4 to format).
        time: u32,
        /// Memory in KiB (LUKS2 `memory`; 32 KiB ..= 4 GiB).
        memory_kib: u32,
        /// Lanes (LUKS2 `cpus`; 1 ..= 4 to format).
        parallel: u32,
    },
}

/// A [`Pbkdf`]'s costs, with the two Argon2 variants as one case: what
/// the checks, the LUKS2 `kdf` object and the description read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KdfCosts {
    /// PBKDF2-HMAC-`hash`, `iterations` rounds.
    Pbkdf2 { hash: Hash, iterations: u32 },
    /// Argon2i or Argon2id: passes, memory in KiB, lanes.
    Argon2 {
        time: u32,
        memory_kib: u32,
        parallel: u32,
    },
}

impl Pbkdf {
    /// The default PBKDF2 (LUKS1, or LUKS2 when asked): HMAC-SHA256 with
    /// 600 000 iterations, OWASP's 2023 figure for PBKDF2-HMAC-SHA256 —
    /// a fixed count for [`super::FormatOptions::luks1`]; `iopages luks
    /// format` benchmarks instead, as cryptsetup does ([`Pbkdf::calibrate`]). On the
    /// project's machine (`cryptsetup benchmark`: 2.8 M PBKDF2-SHA256
    /// iterations/s) that is about 0.2 s per 32 bytes of derived key, so
    /// 0.4 s for a 512-bit LUKS1 keyslot (SHA-1 needs two or four blocks
    /// and runs at half the speed).
    pub const fn pbkdf2_default() -> Pbkdf {
        Pbkdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: 600_000,
        }
    }

    /// The default Argon2id: RFC 9106's second recommended option (time
    /// 3 is raised to cryptsetup's minimum of 4): 64 MiB, 4 passes, 4
    /// lanes. Far below cryptsetup's benchmarked default (up to 1 GiB and
    /// 2 s) but quick for an interactive tool: 0.2 s in a release build on
    /// the project's machine. `iopages
    /// luks format` benchmarks instead, as cryptsetup does
    /// ([`Pbkdf::calibrate`]).
    pub const fn argon2id_default() -> Pbkdf {
        Pbkdf::Argon2id {
            time: 4,
            memory_kib: 64 * 1024,
            parallel: 4,
        }
    }

    /// An Argon2 KDF by its LUKS2 `kdf.type` name (`"argon2i"` or
    /// `"argon2id"`); `None` for any other name.
    pub fn argon2(name: &str, time: u32, memory_kib: u32, parallel: u32) -> Option<Pbkdf> {
        match name {
            "argon2i" => Some(Pbkdf::Argon2i {
                time,
                memory_kib,
                parallel,
            }),
            "argon2id" => Some(Pbkdf::Argon2id {
                time,
                memory_kib,
                parallel,
            }),
            _ => None,
        }
    }

    /// `(time, memory_kib, parallel)` of an Argon2 KDF; `None` for PBKDF2.
    pub fn argon2_params(&self) -> Option<(u32, u32, u32)> {
        match self.costs() {
            KdfCosts::Pbkdf2 { .. } => None,
            KdfCosts::Argon2 {
                time,
                memory_kib,
                parallel,
            } => Some((time, memory_kib, parallel)),
        }
    }

    /// The costs, with Argon2i and Argon2id as one case (the variant's
    /// name is [`Pbkdf::name`]).
    pub(crate) fn costs(&self) -> KdfCosts {
        match *self {
            Pbkdf::Pbkdf2 { hash, iterations } => KdfCosts::Pbkdf2 { hash, iterations },
            Pbkdf::Argon2i {
                time,
                memory_kib,
                parallel,
            }
            | Pbkdf::Argon2id {
                time,
                memory_kib,
                parallel,
            } => KdfCosts::Argon2 {
                time,
                memory_kib,
                parallel,
            },
        }
    }

    /// The LUKS2 `kdf.type` name.
    pub fn name(&self) -> &'static str {
        match self {
            Pbkdf::Pbkdf2 { .. } => "pbkdf2",
            Pbkdf::Argon2i { .. } => "argon2i",
            Pbkdf::Argon2id { .. } => "argon2id",
        }
    }

    /// Check parameters against the limits cryptsetup applies when it
    /// formats, so that what this crate writes, cryptsetup accepts.
    pub(crate) fn check_for_format(&self) -> Result<(), LuksError> {
        match self.costs() {
            KdfCosts::Pbkdf2 { iterations, .. } => {
                if iterations < PBKDF2_MIN_ITERATIONS {
                    return Err(LuksError::InvalidOptions(format!(
                        "PBKDF2 iterations {iterations} is below cryptsetup's minimum of {PBKDF2_MIN_ITERATIONS}"
                    )));
                }
            }
            KdfCosts::Argon2 {
                time,
                memory_kib,
                parallel,
            } => {
                if time < ARGON2_MIN_TIME {
                    return Err(LuksError::InvalidOptions(format!(
                        "Argon2 time cost {time} is below cryptsetup's minimum of {ARGON2_MIN_TIME}"
                    )));
                }
                if !(ARGON2_MIN_MEMORY_KIB..=ARGON2_MAX_MEMORY_KIB).contains(&memory_kib) {
                    return Err(LuksError::InvalidOptions(format!(
                        "Argon2 memory {memory_kib} KiB is outside cryptsetup's range \
                         {ARGON2_MIN_MEMORY_KIB}..={ARGON2_MAX_MEMORY_KIB} KiB"
                    )));
                }
                if !(1..=ARGON2_MAX_PARALLEL_FORMAT).contains(&parallel) {
                    return Err(LuksError::InvalidOptions(format!(
                        "Argon2 parallelism {parallel} is outside cryptsetup's range 1..={ARGON2_MAX_PARALLEL_FORMAT}"
                    )));
                }
                if memory_kib < 8 * parallel {
                    return Err(LuksError::InvalidOptions(format!(
                        "Argon2 memory {memory_kib} KiB is below 8 KiB per lane ({parallel} lanes)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Derive `out.len()` bytes from `passphrase` and `salt`.
    ///
    /// **Returns:** [`LuksError::Corrupt`] for parameters no formatter
    /// writes (zero iterations, a salt too short for Argon2, memory over
    /// 4 GiB), [`LuksError::Io`] when Argon2's memory cannot be had.
    pub(crate) fn derive(
        &self,
        passphrase: &[u8],
        salt: &[u8],
        out: &mut [u8],
    ) -> Result<(), LuksError> {
        match *self {
            Pbkdf::Pbkdf2 { hash, iterations } => pbkdf2(hash, passphrase, salt, iterations, out),
            Pbkdf::Argon2i {
                time,
                memory_kib,
                parallel,
            } => argon2(
                Variant::I,
                passphrase,
                salt,
                time,
                memory_kib,
                parallel,
                out,
            ),
            Pbkdf::Argon2id {
                time,
                memory_kib,
                parallel,
            } => argon2(
                Variant::Id,
                passphrase,
                salt,
                time,
                memory_kib,
                parallel,
                out,
            ),
        }
    }
}

/// PBKDF2-HMAC-`hash` (RFC 8018) of `passphrase` and `salt` into `out`.
pub(crate) fn pbkdf2(
    hash: Hash,
    passphrase: &[u8],
    salt: &[u8],
    iterations: u32,
    out: &mut [u8],
) -> Result<(), LuksError> {
    if iterations == 0 {
        return Err(LuksError::Corrupt(
            "PBKDF2 iteration count is 0".to_string(),
        ));
    }
    if out.is_empty() {
        return Ok(());
    }
    // OpenSSL takes C ints; the crate's wrapper panics on larger values.
    const C_INT_MAX: usize = i32::MAX as usize;
    if iterations as usize > C_INT_MAX {
        return Err(LuksError::Corrupt(format!(
            "PBKDF2 iteration count {iterations} is over {C_INT_MAX}, the most OpenSSL computes"
        )));
    }
    if passphrase.len() > C_INT_MAX || salt.len() > C_INT_MAX || out.len() > C_INT_MAX {
        return Err(LuksError::Corrupt(format!(
            "PBKDF2 input of {} / {} / {} bytes (passphrase / salt / output) is over {C_INT_MAX}",
            passphrase.len(),
            salt.len(),
            out.len()
        )));
    }
    openssl::pkcs5::pbkdf2_hmac(
        passphrase,
        salt,
        iterations as usize,
        hash.message_digest(),
        out,
    )
    .map_err(|e| LuksError::Io(std::io::Error::other(format!("OpenSSL PBKDF2: {e}"))))
}

/// Argon2 (version 0x13, no secret, no associated data — as LUKS2 uses
/// it) of `passphrase` and `salt` into `out`, the lanes computed in up to
/// min(lanes, CPUs) threads as cryptsetup computes them.
fn argon2(
    variant: Variant,
    passphrase: &[u8],
    salt: &[u8],
    time: u32,
    memory_kib: u32,
    parallel: u32,
    out: &mut [u8],
) -> Result<(), LuksError> {
    let name = match variant {
        Variant::I => "argon2i",
        Variant::Id => "argon2id",
    };
    if memory_kib > ARGON2_MAX_MEMORY_KIB {
        return Err(LuksError::Corrupt(format!(
            "{name} memory {memory_kib} KiB is over the 4 GiB limit cryptsetup sets"
        )));
    }
    if parallel == 0 || parallel > ARGON2_MAX_PARALLEL_OPEN {
        return Err(LuksError::Corrupt(format!(
            "{name} parallelism {parallel} is outside 1..={ARGON2_MAX_PARALLEL_OPEN}"
        )));
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = u32::try_from(cpus).unwrap_or(u32::MAX).min(parallel);
    super::argon2::derive(
        variant, passphrase, salt, time, memory_kib, parallel, threads, out,
    )
    .map_err(|e| match e {
        Argon2Error::OutOfMemory { .. } => LuksError::Io(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("{name}: {e}"),
        )),
        e => LuksError::Corrupt(format!("{name} refused the keyslot's parameters: {e}")),
    })
}

/// Compare without an early exit.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A wiped buffer holding PBKDF output of `len` bytes.
pub(crate) fn derived(len: usize) -> Result<SecretBuf, LuksError> {
    SecretBuf::zeroed(len).map_err(|_| {
        LuksError::Io(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("cannot allocate {len} bytes for key material"),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn pbkdf2_vec(hash: Hash, p: &[u8], s: &[u8], c: u32, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        pbkdf2(hash, p, s, c, &mut out).unwrap();
        out
    }

    /// RFC 6070, PBKDF2-HMAC-SHA1 (the 16 777 216-iteration case is left
    /// out for time).
    #[test]
    fn pbkdf2_sha1_rfc6070() {
        let cases: [(&[u8], &[u8], u32, &str); 5] = [
            (
                b"password",
                b"salt",
                1,
                "0c60c80f961f0e71f3a9b524af6012062fe037a6",
            ),
            (
                b"password",
                b"salt",
                2,
                "ea6c014dc72d6f8ccd1ed92ace1d41f0d8de8957",
            ),
            (
                b"password",
                b"salt",
                4096,
                "4b007901b765489abead49d926f721d065a429c1",
            ),
            (
                b"passwordPASSWORDpassword",
                b"saltSALTsaltSALTsaltSALTsaltSALTsalt",
                4096,
                "3d2eec4fe41c849b80c8d83662c0e44a8b291a964cf2f07038",
            ),
            (
                b"pass\0word",
                b"sa\0lt",
                4096,
                "56fa6aa75548099dcc37d7f03425e0c3",
            ),
        ];
        for (p, s, c, want) in cases {
            let want = hex(want);
            assert_eq!(pbkdf2_vec(Hash::Sha1, p, s, c, want.len()), want, "c={c}");
        }
    }

    /// PBKDF2-HMAC-SHA256 vectors (the RFC 6070 inputs, as published in
    /// RFC 7914 §11 and widely reproduced).
    #[test]
    fn pbkdf2_sha256_vectors() {
        assert_eq!(
            pbkdf2_vec(Hash::Sha256, b"passwd", b"salt", 1, 64),
            hex("55 ac 04 6e 56 e3 08 9f ec 16 91 c2 25 44 b6 05
                 f9 41 85 21 6d de 04 65 e6 8b 9d 57 c2 0d ac bc
                 49 ca 9c cc f1 79 b6 45 99 16 64 b3 9d 77 ef 31
                 7c 71 b8 45 b1 e3 0b d5 09 11 20 41 d3 a1 97 83")
        );
        assert_eq!(
            pbkdf2_vec(Hash::Sha256, b"Password", b"NaCl", 80000, 64),
            hex("4d dc d8 f6 0b 98 be 21 83 0c ee 5e f2 27 01 f9
                 64 1a 44 18 d0 4c 04 14 ae ff 08 87 6b 34 ab 56
                 a1 d4 25 a1 22 58 33 54 9a db 84 1b 51 c9 b3 17
                 6a 27 2b de bb a1 d0 78 47 8f 62 b3 97 f3 3c 8d")
        );
        assert_eq!(
            pbkdf2_vec(Hash::Sha256, b"password", b"salt", 4096, 32),
            hex("c5e478d59288c841aa530db6845c4c8d962893a001ce4e11a4963873aa98134a")
        );
    }

    /// RFC 9106 §5.3 and §5.2 test vectors. They use a secret and
    /// associated data, which LUKS2 never does, so they are run straight
    /// through the `argon2` crate; `argon2()` here adds only the memory
    /// handling, checked below against the crate's own allocation.
    /// The lane-parallel derivation agrees with RustCrypto's `argon2`.
    #[test]
    fn argon2_wrapper_matches_a_plain_context() {
        use ::argon2::{Algorithm, Argon2, Block, Params, Version};
        let mut ours = [0u8; 64];
        Pbkdf::Argon2id {
            time: 4,
            memory_kib: 32,
            parallel: 2,
        }
        .derive(b"pass", &[9u8; 32], &mut ours)
        .unwrap();
        let ctx = Argon2::new(
            Algorithm::Argon2id,
            Version::V0x13,
            Params::new(32, 4, 2, Some(64)).unwrap(),
        );
        let mut mem = vec![Block::new(); ctx.params().block_count()];
        let mut want = [0u8; 64];
        ctx.hash_password_into_with_memory(b"pass", &[9u8; 32], &mut want, &mut mem[..])
            .unwrap();
        assert_eq!(ours, want);
    }

    #[test]
    fn bad_kdf_parameters_are_errors_not_panics() {
        let mut out = [0u8; 32];
        for p in [
            Pbkdf::Pbkdf2 {
                hash: Hash::Sha256,
                iterations: 0,
            },
            // Over OpenSSL's C int: an error, not the wrapper's panic.
            Pbkdf::Pbkdf2 {
                hash: Hash::Sha1,
                iterations: u32::MAX,
            },
            Pbkdf::Argon2id {
                time: 0,
                memory_kib: 32,
                parallel: 1,
            },
            Pbkdf::Argon2i {
                time: 4,
                memory_kib: u32::MAX,
                parallel: 1,
            },
            Pbkdf::Argon2i {
                time: 4,
                memory_kib: 8,
                parallel: 4,
            },
            Pbkdf::Argon2id {
                time: 4,
                memory_kib: 32,
                parallel: 0,
            },
        ] {
            assert!(
                matches!(
                    p.derive(b"x", &[0; 32], &mut out),
                    Err(LuksError::Corrupt(_))
                ),
                "{p:?}"
            );
        }
        // Argon2's salt must be at least 8 bytes.
        assert!(Pbkdf::Argon2id {
            time: 4,
            memory_kib: 32,
            parallel: 1
        }
        .derive(b"x", &[0; 4], &mut out)
        .is_err());
    }

    #[test]
    fn format_limits_are_cryptsetups() {
        assert!(Pbkdf::pbkdf2_default().check_for_format().is_ok());
        assert!(Pbkdf::argon2id_default().check_for_format().is_ok());
        assert!(Pbkdf::Pbkdf2 {
            hash: Hash::Sha1,
            iterations: 999
        }
        .check_for_format()
        .is_err());
        assert!(Pbkdf::Argon2i {
            time: 3,
            memory_kib: 32,
            parallel: 1
        }
        .check_for_format()
        .is_err());
        assert!(Pbkdf::Argon2i {
            time: 4,
            memory_kib: 31,
            parallel: 1
        }
        .check_for_format()
        .is_err());
        assert!(Pbkdf::Argon2id {
            time: 4,
            memory_kib: 32,
            parallel: 5
        }
        .check_for_format()
        .is_err());
    }

    #[test]
    fn hash_names_round_trip() {
        for h in [Hash::Sha1, Hash::Sha256, Hash::Sha512] {
            assert_eq!(Hash::from_name(h.name()), Some(h));
            let mut out = [0u8; 64];
            h.digest_into(&[b"ab", b"c"], &mut out);
            let want = openssl::hash::hash(h.message_digest(), b"abc").unwrap();
            assert_eq!(&out[..h.digest_len()], &want[..]);
        }
        assert_eq!(Hash::from_name("SHA256"), Some(Hash::Sha256));
        assert_eq!(Hash::from_name("ripemd160"), None);
    }
}
