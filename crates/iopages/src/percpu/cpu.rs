//! CPUs: how many the system has and which one the caller runs on.
//!
//! Owns: the two questions every per-CPU structure asks. Must never: be
//! trusted for more than a hint — the caller can migrate right after asking,
//! so per-CPU data is protected by a try-lock or an atomic, never by the
//! answer alone.

/// CPUs the system is configured with (at least 1).
pub(crate) fn nr_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    if n > 0 {
        n as usize
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// Whether a batch of 2 to 4 pages freed into a handle's cache should be
/// written as packed 8-byte stores (true on AMD: with one 4-byte store per
/// slot its store-to-load forwarding predictor missed once per round, 14
/// ns per page at batch 2 against 3.7) or one store per slot (elsewhere:
/// on an Intel Xeon the packing cost 2.5-3.1 ns per page at batch 4
/// against 2.0-2.1).
/// Asked once per process.
pub(crate) fn packs_small_batches() -> bool {
    static PACKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PACKED.get_or_init(|| vendor_packs(&cpu_vendor()))
}

/// Whether the CPU vendor string (CPUID leaf 0) is one whose cores want
/// small batches packed (see [`packs_small_batches`]). Measured on AMD
/// EPYC only; Hygon's cores are AMD's Zen design, so they are included by
/// inference, not by a measurement.
fn vendor_packs(vendor: &[u8; 12]) -> bool {
    vendor == b"AuthenticAMD" || vendor == b"HygonGenuine"
}

/// The CPU's vendor string (CPUID leaf 0); zeros off x86-64.
fn cpu_vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: leaf 0 (the vendor) exists on every x86-64 CPU (the
        // call is safe from Rust 1.87 on; the crate builds from 1.80).
        #[allow(unused_unsafe)]
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        v
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        [0u8; 12]
    }
}

/// The caller's CPU modulo `nr_slots` (glibc answers from rseq, without a
/// system call).
#[inline]
pub(crate) fn slot(nr_slots: usize) -> usize {
    debug_assert!(nr_slots > 0);
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    cpu.max(0) as usize % nr_slots
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_batches_are_packed_on_amd_cores_only() {
        assert!(vendor_packs(b"AuthenticAMD"));
        assert!(vendor_packs(b"HygonGenuine"));
        assert!(!vendor_packs(b"GenuineIntel"));
        assert!(!vendor_packs(&[0; 12]));
        // The process-wide answer is the vendor's.
        assert_eq!(packs_small_batches(), vendor_packs(&cpu_vendor()));
    }
}
