//! The key-derivation flags of the LUKS tools and `serve`: the limits
//! on what a key slot may cost to open, and the KDF and its costs for a
//! new key slot.
//!
//! Owns: `--max-kdf-memory`'s limits ([`kdf_limits`]), `--pbkdf` and
//! `--hash` ([`PbkdfArg`], [`HashArg`]), and the cost flags `format` and
//! the key verbs share ([`KdfCostArgs`]: `--iter-time`, `--iterations`,
//! `--memory`, `--parallel`) with their checks. Must never: name the
//! commands that use them (`luks_cmd`, `luks_keys`, `serve`, `served`
//! all come down to this module), or derive a key (the LUKS crate does,
//! with what these give it).

use iopages_crypt::luks::{Hash, KdfKind, KdfLimits, KdfTarget};

/// The key derivation limits for `--max-kdf-memory BYTES` (`None`: the
/// default 1 GiB of Argon2 memory per key slot, cryptsetup's own default
/// for new key slots; at most 4 GiB, cryptsetup's maximum). For every
/// command that opens a volume with a passphrase (`serve --image` too).
pub(crate) fn kdf_limits(max_kdf_memory: Option<u64>) -> KdfLimits {
    match max_kdf_memory {
        Some(bytes) => KdfLimits::default().with_max_argon2_memory_bytes(bytes),
        None => KdfLimits::default(),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PbkdfArg {
    Pbkdf2,
    Argon2i,
    Argon2id,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum HashArg {
    Sha1,
    Sha256,
}

impl HashArg {
    pub(crate) fn hash(self) -> Hash {
        match self {
            HashArg::Sha1 => Hash::Sha1,
            HashArg::Sha256 => Hash::Sha256,
        }
    }
}

impl PbkdfArg {
    /// The KDF, PBKDF2 with `hash`.
    pub(crate) fn kind(self, hash: Hash) -> KdfKind {
        match self {
            PbkdfArg::Pbkdf2 => KdfKind::Pbkdf2(hash),
            PbkdfArg::Argon2i => KdfKind::Argon2i,
            PbkdfArg::Argon2id => KdfKind::Argon2id,
        }
    }
}

/// The key-derivation cost flags `format` and the key verbs share.
#[derive(clap::Args, Debug)]
pub(crate) struct KdfCostArgs {
    /// Unlock time to aim for, in milliseconds, as cryptsetup's
    /// --iter-time: the key derivation is benchmarked on this machine and
    /// its costs scaled to take about this long (Argon2: memory first, up
    /// to 1 GiB and half the available memory, then passes). Costs given
    /// with --iterations, --memory or --parallel are kept as given.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub iter_time: u64,
    /// PBKDF2 iterations, or Argon2 passes (time cost); skips their
    /// benchmark.
    #[arg(long, value_name = "N")]
    pub iterations: Option<u32>,
    /// Argon2 memory cost in KiB; skips its benchmark.
    #[arg(long, value_name = "KIB")]
    pub memory: Option<u32>,
    /// Argon2 lanes (default 4, or one per CPU on fewer CPUs).
    #[arg(long, value_name = "N")]
    pub parallel: Option<u32>,
}

impl KdfCostArgs {
    /// What to calibrate a new key slot of `kind` for (see [`kdf_target`]).
    pub(crate) fn target(&self, kind: KdfKind) -> Result<KdfTarget, String> {
        kdf_target(
            kind,
            self.iterations,
            self.memory,
            self.parallel,
            self.iter_time,
        )
    }
}

/// What to calibrate a new key slot's `kind` to, from the KDF flags
/// `format` and the key verbs share (`--iterations`, `--memory`,
/// `--parallel`, `--iter-time`).
///
/// **Returns:** the target; the error for Argon2 costs given to PBKDF2 or
/// an `--iter-time` of 0.
pub(crate) fn kdf_target(
    kind: KdfKind,
    iterations: Option<u32>,
    memory: Option<u32>,
    parallel: Option<u32>,
    iter_time_ms: u64,
) -> Result<KdfTarget, String> {
    if matches!(kind, KdfKind::Pbkdf2(_)) && (memory.is_some() || parallel.is_some()) {
        return Err(
            "--memory and --parallel are Argon2 costs: PBKDF2 has --iterations only".into(),
        );
    }
    if iter_time_ms == 0 {
        return Err("--iter-time 0: give the unlock time to aim for, in milliseconds".into());
    }
    Ok(KdfTarget {
        iterations,
        memory_kib: memory,
        parallel,
        ..KdfTarget::new(kind, std::time::Duration::from_millis(iter_time_ms))
    })
}
