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

/// The caller's CPU modulo `nr_slots` (glibc answers from rseq, without a
/// system call).
#[inline]
pub(crate) fn slot(nr_slots: usize) -> usize {
    debug_assert!(nr_slots > 0);
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    cpu.max(0) as usize % nr_slots
}
