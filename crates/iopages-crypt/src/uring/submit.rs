//! Steps 2, 3 and 5 of a call (see the folder's notes): a ring is picked,
//! the call's transfers become submission entries, and the entries are
//! queued and reaped until nothing is in flight; the flush as well.
//!
//! Owns: `Op` (one transfer, resubmitted until done), the ring choice,
//! the split of a transfer into entries (1 GiB at most, never across a
//! fixed buffer's edge), the drive loop with its retries and short-transfer
//! resubmissions, the error of a stopped transfer, `io_uring_enter`, and
//! `fdatasync` through a ring.
//! The tests' completion faults ([`Faults`]) replace results here too.
//! Must never: return while an entry it queued may still be in flight
//! (should the ring itself keep failing, the process aborts instead),
//! accept a zero-byte completion as progress, or retry an entry more than
//! `MAX_RETRIES` times.

use super::UringFile;
use super::FIXED_BUFFER_MAX_BYTES;
use io_uring::{opcode, squeue, types, IoUring};
use parking_lot::MutexGuard;
use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering::Relaxed};

/// The largest transfer asked of the kernel in one entry.
const MAX_OP_BYTES: usize = 1 << 30;
/// How often one entry is retried after `EINTR` / `EAGAIN` /
/// `ECANCELED`.
const MAX_RETRIES: u32 = 64;

/// Whether a failed completion with `errno` is asked for again: an
/// interrupted or cancelled entry (nothing here cancels one, but the
/// kernel may, as when an io-wq worker ends) or one refused for now.
/// A read or write at a fixed offset repeats safely.
fn retried(errno: i32) -> bool {
    matches!(errno, libc::EINTR | libc::EAGAIN | libc::ECANCELED)
}

/// Tests only: every `every`-th completion (counted over the file's
/// calls, flushes included) has its result replaced by `-errno`
/// ([`UringFile::fail_completions_for_tests`]). Off (`every == 0`) it
/// costs one relaxed load per completion.
#[derive(Default)]
pub(super) struct Faults {
    errno: AtomicI32,
    every: AtomicU32,
    seen: AtomicU32,
}

impl Faults {
    /// Replace every `every`-th result with `-errno`; `every == 0` ends it.
    pub(super) fn set(&self, errno: i32, every: u32) {
        self.errno.store(errno, Relaxed);
        self.seen.store(0, Relaxed);
        self.every.store(every, Relaxed);
    }

    /// The result the drive loop sees for a completion that gave `res`.
    fn result(&self, res: i32) -> i32 {
        let every = self.every.load(Relaxed);
        if every == 0 || self.seen.fetch_add(1, Relaxed) % every != every - 1 {
            return res;
        }
        -self.errno.load(Relaxed)
    }
}
/// `user_data` of a flush entry.
const FLUSH_TAG: u64 = u64::MAX;

/// One transfer asked of the kernel, resubmitted until `done == len`.
pub(super) struct Op {
    off: u64,
    ptr: *mut u8,
    len: usize,
    done: usize,
    fixed: Option<u16>,
    started: bool,
    retries: u32,
}

/// What became of an entry after one completion.
enum Outcome {
    /// Every byte moved.
    Done,
    /// Resubmit it (short transfer, or `EINTR` / `EAGAIN` / `ECANCELED`).
    Again,
    /// It failed; nothing more is asked for it.
    Failed(io::Error),
}

/// The state of one [`UringFile::drive`] call: the entries waiting to be
/// queued (indices into its `ops`), how many are in the kernel, and what
/// bounds each submission.
struct Drive {
    ready: VecDeque<usize>,
    inflight: usize,
    /// The ring's submission queue size: at most this many in flight.
    cap: usize,
    /// The most a first attempt asks for (tests only; else `usize::MAX`).
    short_cap: usize,
    fd: types::Fd,
}

impl UringFile {
    /// A free ring if there is one (round robin from a rotating start),
    /// else wait for the first choice.
    pub(super) fn ring(&self) -> MutexGuard<'_, IoUring> {
        let n = self.rings.len();
        let start = self.next_ring.fetch_add(1, Relaxed) % n;
        for i in 0..n {
            if let Some(g) = self.rings[(start + i) % n].try_lock() {
                return g;
            }
        }
        self.rings[start].lock()
    }

    /// The fixed buffer index for `len` bytes at `ptr`, if they lie inside
    /// one registered chunk.
    fn fixed_index(&self, ptr: *const u8, len: usize) -> Option<u16> {
        let a = self.arena.as_ref().filter(|_| self.fixed)?;
        let off = (ptr as usize).checked_sub(a.base)?;
        let end = off.checked_add(len)?;
        if len == 0 || end > a.len {
            return None;
        }
        let idx = off / FIXED_BUFFER_MAX_BYTES;
        ((end - 1) / FIXED_BUFFER_MAX_BYTES == idx)
            .then(|| u16::try_from(idx).ok())
            .flatten()
    }

    /// Append the entries for `len` bytes at `ptr` going to file offset
    /// `off`: at most 1 GiB each, split at fixed buffer edges.
    pub(super) fn push_ops(&self, ops: &mut Vec<Op>, off: u64, ptr: *mut u8, len: usize) {
        let mut done = 0;
        while done < len {
            let p = ptr.wrapping_add(done);
            let mut n = (len - done).min(MAX_OP_BYTES);
            if let Some(a) = self.arena.as_ref().filter(|_| self.fixed) {
                if let Some(rel) = (p as usize).checked_sub(a.base).filter(|&r| r < a.len) {
                    n = n.min(FIXED_BUFFER_MAX_BYTES - rel % FIXED_BUFFER_MAX_BYTES);
                }
            }
            ops.push(Op {
                off: off + done as u64,
                ptr: p,
                len: n,
                done: 0,
                fixed: self.fixed_index(p, n),
                started: false,
                retries: 0,
            });
            done += n;
        }
    }

    /// Submit every entry in `ops` (in waves of the ring's size if there
    /// are more) and reap them all, resubmitting short and interrupted
    /// transfers. Returns the first error only once nothing is in flight.
    pub(super) fn drive(&self, ring: &mut IoUring, ops: &mut [Op], write: bool) -> io::Result<()> {
        let mut d = Drive {
            ready: (0..ops.len()).collect(),
            inflight: 0,
            cap: ring.params().sq_entries() as usize,
            short_cap: self.short_cap(),
            fd: types::Fd(self.file.as_raw_fd()),
        };
        let mut first_err: Option<io::Error> = None;
        loop {
            if first_err.is_none() {
                self.queue_ready(ring, ops, &mut d, write);
            }
            if d.inflight == 0 {
                break;
            }
            self.enter(ring);
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                let Some(op) = ops.get_mut(i) else { continue };
                d.inflight -= 1;
                match self.complete(op, self.faults.result(cqe.result()), write) {
                    Outcome::Done => {}
                    Outcome::Again => d.ready.push_back(i),
                    Outcome::Failed(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The most the first attempt of an entry asks for: no bound, or the
    /// tests' bound ([`UringFile::set_short_io_for_tests`]), rounded down
    /// to whole blocks (at least one) under `O_DIRECT`.
    fn short_cap(&self) -> usize {
        match self.short_io.load(Relaxed) {
            0 => usize::MAX,
            n if self.direct => {
                let unit = self.io_align.max(self.mem_align);
                (n / unit * unit).max(unit)
            }
            n => n,
        }
    }

    /// Queue ready entries until `d.cap` are in flight or the submission
    /// queue is full, and count them.
    fn queue_ready(&self, ring: &mut IoUring, ops: &mut [Op], d: &mut Drive, write: bool) {
        let mut sq = ring.submission();
        let (mut pushed, mut fixed) = (0u64, 0u64);
        while d.inflight < d.cap && !sq.is_full() {
            let Some(i) = d.ready.pop_front() else { break };
            let op = &mut ops[i];
            let was_started = op.started;
            let entry = next_entry(op, d, write);
            // SAFETY: the entry points at the rest of a caller
            // segment or bounce buffer, which stay valid (and, for a
            // read, unused by anyone else) until this function has
            // reaped the entry: it returns only with nothing in
            // flight. A fixed index names the registered chunk that
            // contains the whole range.
            if unsafe { sq.push(&entry.user_data(i as u64)) }.is_err() {
                op.started = was_started;
                d.ready.push_front(i);
                break;
            }
            pushed += 1;
            fixed += op.fixed.is_some() as u64;
            d.inflight += 1;
        }
        drop(sq);
        self.counters.submissions.fetch_add(pushed, Relaxed);
        self.counters.fixed_ops.fetch_add(fixed, Relaxed);
    }

    /// Account for one completion of `op` with result `res`.
    fn complete(&self, op: &mut Op, res: i32, write: bool) -> Outcome {
        let kind = if write { "write" } else { "read" };
        let at = op.off + op.done as u64;
        let left = op.len - op.done;
        if res < 0 {
            let errno = -res;
            if retried(errno) && op.retries < MAX_RETRIES {
                op.retries += 1;
                self.counters.retries.fetch_add(1, Relaxed);
                return Outcome::Again;
            }
            let e = io::Error::from_raw_os_error(errno);
            let hint = if write && self.read_only && errno == libc::EBADF {
                " (the file was opened read-only)"
            } else {
                ""
            };
            let msg = format!("{kind} of {left} bytes at offset {at} failed: {e}{hint}");
            return Outcome::Failed(self.err(e.kind(), msg));
        }
        if res == 0 {
            return Outcome::Failed(self.stopped(write, at, left));
        }
        op.done += (res as usize).min(left);
        if op.done == op.len {
            return Outcome::Done;
        }
        if self.direct && !op.done.is_multiple_of(self.io_align) {
            // The rest cannot be asked for under O_DIRECT (its offset is off
            // a block edge): only the end of the file stops a transfer
            // there.
            let at = op.off + op.done as u64;
            return Outcome::Failed(self.stopped(write, at, op.len - op.done));
        }
        self.counters.short_resubmissions.fetch_add(1, Relaxed);
        Outcome::Again
    }

    /// The error for a transfer that stopped at `at` with `left` bytes to go.
    fn stopped(&self, write: bool, at: u64, left: usize) -> io::Error {
        if write {
            let msg = format!("write at offset {at} stopped with {left} bytes left to write");
            self.err(io::ErrorKind::WriteZero, msg)
        } else {
            let msg = format!(
                "read at offset {at} (inside the device's {} bytes) hit the end of the file \
                 with {left} bytes left",
                self.size
            );
            self.err(io::ErrorKind::UnexpectedEof, msg)
        }
    }

    /// Submit what is queued and wait for at least one completion,
    /// retrying what the kernel asks to be retried.
    fn enter(&self, ring: &mut IoUring) {
        let mut failures = 0u32;
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => return,
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EAGAIN) | Some(libc::EBUSY) => std::thread::yield_now(),
                    _ => {
                        // The ring itself is broken (a kernel or program
                        // bug, never the caller's input). Entries may still
                        // be in flight into caller buffers, so returning
                        // would risk memory corruption; try a few more
                        // times, then stop the process.
                        failures += 1;
                        if failures > 100 {
                            eprintln!(
                                "{}: io_uring_enter keeps failing with I/O in flight: {e}; \
                                 aborting",
                                self.path.display()
                            );
                            std::process::abort();
                        }
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                },
            }
        }
    }

    /// `fdatasync` through a ring, retried after `EINTR` / `EAGAIN` /
    /// `ECANCELED`
    /// ([`Backend::flush`](crate::backend::Backend::flush)).
    pub(super) fn fdatasync(&self) -> io::Result<()> {
        let mut ring = self.ring();
        let entry = opcode::Fsync::new(types::Fd(self.file.as_raw_fd()))
            .flags(types::FsyncFlags::DATASYNC)
            .build()
            .user_data(FLUSH_TAG);
        let mut retries = 0;
        loop {
            // SAFETY: an fsync entry points at no memory.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                // Cannot happen: nothing else is queued on a ring we hold.
                return Err(self.err(io::ErrorKind::Other, "fdatasync: submission queue full"));
            }
            self.counters.submissions.fetch_add(1, Relaxed);
            let res = loop {
                self.enter(&mut ring);
                let done = ring
                    .completion()
                    .filter(|c| c.user_data() == FLUSH_TAG)
                    .map(|c| self.faults.result(c.result()))
                    .last();
                if let Some(r) = done {
                    break r;
                }
            };
            if res >= 0 {
                return Ok(());
            }
            if retried(-res) && retries < MAX_RETRIES {
                retries += 1;
                self.counters.retries.fetch_add(1, Relaxed);
                continue;
            }
            let e = io::Error::from_raw_os_error(-res);
            return Err(self.err(e.kind(), format!("fdatasync: {e}")));
        }
    }
}

/// The entry for what is left of `op` (its first attempt bounded by
/// `d.short_cap`), marking it started.
fn next_entry(op: &mut Op, d: &Drive, write: bool) -> squeue::Entry {
    let mut n = (op.len - op.done).min(u32::MAX as usize);
    if !op.started {
        n = n.min(d.short_cap);
        op.started = true;
    }
    let (ptr, off, n32) = (
        op.ptr.wrapping_add(op.done),
        op.off + op.done as u64,
        n as u32,
    );
    let fd = d.fd;
    match (write, op.fixed) {
        (true, Some(idx)) => opcode::WriteFixed::new(fd, ptr, n32, idx)
            .offset(off)
            .build(),
        (true, None) => opcode::Write::new(fd, ptr, n32).offset(off).build(),
        (false, Some(idx)) => opcode::ReadFixed::new(fd, ptr, n32, idx)
            .offset(off)
            .build(),
        (false, None) => opcode::Read::new(fd, ptr, n32).offset(off).build(),
    }
}
