//! Limits on what a header may ask of the host when a volume is opened:
//! the key derivation's cost per keyslot and the number of keyslots.
//!
//! Owns: [`KdfLimits`] and its checks. Must never: let a keyslot's KDF run
//! (or its memory be allocated) before its costs passed these checks.
//!
//! A header is input: a crafted one can ask for 2^32 - 1 PBKDF2
//! iterations, 4 GiB of Argon2 memory per keyslot or thousands of
//! keyslots, each of which would be derived in turn. cryptsetup bounds
//! the same things (`crypt_pbkdf_get_limits`: Argon2 memory 4 GiB, 4
//! threads; `LUKS2_KEYSLOTS_MAX` 32 keyslots); the defaults here are
//! tighter where a small host needs them to be, and every one can be
//! raised by the caller for a genuine volume.

use super::kdf::KdfCosts;
use super::{LuksError, LuksVersion, SlotPlan};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// cryptsetup's `LUKS2_KEYSLOTS_MAX`: no LUKS2 header it makes or
/// accepts has more keyslots.
pub const LUKS2_KEYSLOTS_MAX: usize = 32;

/// What opening a volume may spend on key derivation, checked against
/// every keyslot (and its volume-key digest) before anything is derived
/// for it; and a flag that cancels the open between derivations.
///
/// A keyslot over a limit is not tried: if another keyslot opens, the
/// volume opens; if none does, the open fails with
/// [`LuksError::OverLimit`] naming the keyslot, the header field, its
/// value and the limit (rather than "wrong passphrase", since the
/// passphrase may belong to the keyslot that was not tried).
#[derive(Clone, Debug)]
pub struct KdfLimits {
    /// Most PBKDF2 iterations of a keyslot or a volume-key digest.
    /// Default 50 000 000: cryptsetup sizes the count with a 2-second
    /// benchmark (LUKS1 and LUKS2 PBKDF2 keyslots), which gives about
    /// 5 M to 20 M iterations on current CPUs (8 M on a 4 M-iteration/s
    /// SHA-256 machine, 20 M where SHA extensions reach 10 M/s); the cap
    /// leaves room for `--iter-time` of several seconds while bounding a
    /// crafted keyslot to about 40 s here (two SHA-256 blocks for a
    /// 512-bit key at 2.8 M iterations/s). Never above 2^31 - 1, OpenSSL's
    /// own limit.
    pub max_pbkdf2_iterations: u32,
    /// Most Argon2 memory of a keyslot, in KiB (1 KiB = one Argon2
    /// block). Default 1 GiB (1 048 576 KiB): cryptsetup's own default
    /// for new keyslots (`DEFAULT_LUKS2_MEMORY_KB`), so every volume it
    /// formats without `--pbkdf-memory` opens, while a crafted header
    /// cannot make a small host commit 4 GiB (cryptsetup's hard maximum,
    /// which a caller on a large host may set).
    pub max_argon2_memory_kib: u32,
    /// Most Argon2 passes (`time`) of a keyslot. Default 1 000 000.
    /// cryptsetup raises the time cost only once the memory is at its
    /// maximum, so volumes formatted with a small `--pbkdf-memory` carry
    /// time costs in the ten-thousands; the CPU time itself is bounded by
    /// [`Self::max_argon2_work_kib`].
    pub max_argon2_time: u32,
    /// Most Argon2 lanes (`cpus`) of a keyslot. Default 16: cryptsetup
    /// formats with at most 4; lanes add no memory or work (they run in
    /// at most min(lanes, CPUs) threads), only a bound on odd headers.
    pub max_argon2_lanes: u32,
    /// Most Argon2 work of a keyslot: memory in KiB times passes, the
    /// number of 1 KiB blocks computed, which is what its CPU time is
    /// proportional to. Default 64 × 1 GiB (67 108 864 KiB): 64 passes
    /// over the default memory cap, a little over a minute on one core
    /// here (about 1 GiB per second per pass) and 8 times what a
    /// cryptsetup default keyslot (1 GiB, 4 to 8 passes) asks.
    pub max_argon2_work_kib: u64,
    /// Most keyslots a header may hold. Default 32
    /// ([`LUKS2_KEYSLOTS_MAX`]); LUKS1 has 8 at most anyway. Checked when
    /// the header is parsed, before any keyslot is planned.
    pub max_keyslots: usize,
    /// When set (by another thread, a signal handler...), the open stops
    /// before the next derivation (each keyslot's, and each volume-key
    /// digest's) with [`LuksError::Cancelled`]. A derivation already
    /// running finishes first (OpenSSL's PBKDF2 and the Argon2 crate have
    /// no cancellation point); the caps above bound how long that is.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for KdfLimits {
    /// The defaults documented on each field.
    fn default() -> Self {
        KdfLimits {
            max_pbkdf2_iterations: 50_000_000,
            max_argon2_memory_kib: 1 << 20,
            max_argon2_time: 1_000_000,
            max_argon2_lanes: 16,
            max_argon2_work_kib: 64 << 20,
            max_keyslots: LUKS2_KEYSLOTS_MAX,
            cancel: None,
        }
    }
}

impl KdfLimits {
    /// These limits with the Argon2 memory cap set to `bytes` (rounded
    /// down to whole KiB, at most 4 GiB, cryptsetup's maximum). The work
    /// cap is raised with it where it would otherwise refuse 64 passes at
    /// the new memory cap.
    pub fn with_max_argon2_memory_bytes(mut self, bytes: u64) -> KdfLimits {
        let kib = (bytes / 1024).min(u64::from(super::ARGON2_MAX_MEMORY_KIB));
        self.max_argon2_memory_kib = kib as u32;
        self.max_argon2_work_kib = self.max_argon2_work_kib.max(kib.saturating_mul(64));
        self
    }

    /// These limits with `flag` as the cancel flag.
    pub fn with_cancel(mut self, flag: Arc<AtomicBool>) -> KdfLimits {
        self.cancel = Some(flag);
        self
    }

    /// `Err(Cancelled)` once the cancel flag is set.
    pub(crate) fn check_cancel(&self) -> Result<(), LuksError> {
        match &self.cancel {
            Some(f) if f.load(Ordering::Relaxed) => Err(LuksError::Cancelled),
            _ => Ok(()),
        }
    }

    /// The keyslot count of a header.
    pub(crate) fn check_keyslot_count(
        &self,
        version: LuksVersion,
        count: usize,
    ) -> Result<(), LuksError> {
        if count > self.max_keyslots {
            return Err(LuksError::OverLimit(format!(
                "the {version} header has {count} keyslots, over the limit of {} \
                 (KdfLimits::max_keyslots; cryptsetup's LUKS2_KEYSLOTS_MAX is {LUKS2_KEYSLOTS_MAX})",
                self.max_keyslots
            )));
        }
        Ok(())
    }

    /// A keyslot's KDF and its digest's iterations, before either runs.
    pub(crate) fn check_slot(&self, slot: &SlotPlan) -> Result<(), LuksError> {
        match slot.pbkdf.costs() {
            KdfCosts::Pbkdf2 { iterations, .. } => {
                if iterations > self.max_pbkdf2_iterations {
                    return Err(over(
                        slot,
                        "PBKDF2 iterations",
                        &kdf_field(slot, "iterations"),
                        iterations.into(),
                        "",
                        self.max_pbkdf2_iterations.into(),
                        "max_pbkdf2_iterations",
                    ));
                }
            }
            KdfCosts::Argon2 {
                time,
                memory_kib,
                parallel,
            } => self.check_argon2(slot, time, memory_kib, parallel)?,
        }
        if slot.digest.iterations > self.max_pbkdf2_iterations {
            return Err(over(
                slot,
                "volume-key digest PBKDF2 iterations",
                &slot.digest.field,
                slot.digest.iterations.into(),
                "",
                self.max_pbkdf2_iterations.into(),
                "max_pbkdf2_iterations",
            ));
        }
        Ok(())
    }

    /// An Argon2 keyslot's memory, passes, lanes and work (memory ×
    /// passes), in that order.
    fn check_argon2(
        &self,
        slot: &SlotPlan,
        time: u32,
        memory_kib: u32,
        parallel: u32,
    ) -> Result<(), LuksError> {
        let name = slot.pbkdf.name();
        let field = |name: &str| kdf_field(slot, name);
        if memory_kib > self.max_argon2_memory_kib {
            return Err(over(
                slot,
                &format!("{name} memory"),
                &field("memory"),
                memory_kib.into(),
                " KiB",
                self.max_argon2_memory_kib.into(),
                "max_argon2_memory_kib",
            ));
        }
        if time > self.max_argon2_time {
            return Err(over(
                slot,
                &format!("{name} time cost"),
                &field("time"),
                time.into(),
                "",
                self.max_argon2_time.into(),
                "max_argon2_time",
            ));
        }
        if parallel > self.max_argon2_lanes {
            return Err(over(
                slot,
                &format!("{name} lanes"),
                &field("cpus"),
                parallel.into(),
                "",
                self.max_argon2_lanes.into(),
                "max_argon2_lanes",
            ));
        }
        let work = u64::from(memory_kib) * u64::from(time);
        if work > self.max_argon2_work_kib {
            return Err(over(
                slot,
                &format!("{name} work (memory × time)"),
                &format!("{} × {}", field("memory"), field("time")),
                work,
                " KiB",
                self.max_argon2_work_kib,
                "max_argon2_work_kib",
            ));
        }
        Ok(())
    }
}

/// The header field of `slot`'s KDF named `name` (its `kdf_field` prefix
/// and the name).
fn kdf_field(slot: &SlotPlan, name: &str) -> String {
    format!("{}{name}", slot.kdf_field)
}

/// The error for `slot`'s `what` of `value` (read from `field`, in
/// `unit`) over `limit` (`KdfLimits::{knob}`).
fn over(
    slot: &SlotPlan,
    what: &str,
    field: &str,
    value: u64,
    unit: &str,
    limit: u64,
    knob: &str,
) -> LuksError {
    LuksError::OverLimit(format!(
        "keyslot {}: {what} {value}{unit} ({field}) is over the limit of {limit}{unit} \
         (KdfLimits::{knob})",
        slot.index
    ))
}
