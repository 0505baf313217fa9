//! The crypt target: dm-crypt's write and read paths over a backend.
//!
//! Owns: a write — allocate the "out" pages with the device's strategy,
//! encrypt sector by sector from the caller's plaintext into them, submit
//! them to the backend, free them when the write completes (or, on a
//! [`PageStore`], hand them over and free the
//! pages they replace); a read — read the ciphertext from the backend into
//! the caller's buffer and decrypt it in place. Must never: leave out
//! pages allocated after a write returns (success or error), write a
//! request that is not whole sectors, or reach page memory through an
//! address: the out pages' bytes come from the [`iopages::FolioBuffer`]
//! that owns them (`runs_mut`); a caller's reused out buffer is one too
//! ([`CryptTarget::write_with_folios`]).
//!
//! With [`TargetConfig::allow_discards`] the target also discards and
//! punches whole sectors out of the backend, and a sector whose ciphertext
//! is all zero bytes (a hole) reads as plaintext zeros; without it the
//! read path is dm-crypt's, unchanged.
//!
//! This is the synchronous core, safe to call from many threads at once;
//! [`crate::queue::CryptQueue`] puts a queue depth and worker threads in
//! front of it.

use crate::async_io::Segments;
use crate::backend::{check_range, push_extent, Backend, Extent, PageStore};
use crate::strategy::{LimitCheck, OutAllocator, OutPages, Strategy};
use iopages::{FolioBuffer, Gfp, PageAllocator, PercpuCounter, PAGE_SIZE};
use parking_lot::Mutex;
use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A write's runs of out pages (or their ciphertext segments): on the
/// stack up to 16 — a write whose pages mostly follow each other — and on
/// the heap past that.
type Runs<T> = smallvec::SmallVec<[T; 16]>;

/// A write's ciphertext in its out pages while an asynchronous backend
/// sends it ([`CryptTarget::seal`]): the pages go back to the target's out
/// allocator when the last reference is dropped.
struct Sealed<C: SectorCipher> {
    target: Arc<CryptTarget<C>>,
    /// Taken only by `drop`.
    out: Option<OutPages>,
    /// The write's bytes (the out pages may hold more).
    len: usize,
}

impl<C: SectorCipher> Segments for Sealed<C> {
    fn segments(&self) -> Vec<&[u8]> {
        let out = self.out.as_ref().expect("taken only by drop");
        let mut left = self.len;
        out.buffer()
            .chunks()
            .map_while(|c| {
                let n = c.len().min(left);
                left -= n;
                (n > 0).then(|| &c[..n])
            })
            .collect()
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl<C: SectorCipher> Drop for Sealed<C> {
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            self.target.out.free(out);
        }
    }
}

/// Encryption of whole sectors with a per-sector IV (the sector number).
pub trait SectorCipher: Send + Sync {
    /// Bytes per sector (512 or 4096).
    fn sector_size(&self) -> usize;
    /// Encrypt whole sectors of `src` into `dst`, the first being `sector`.
    fn encrypt_sectors(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()>;
    /// Decrypt whole sectors in place, the first being `sector`.
    fn decrypt_sectors(&self, sector: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Decrypt whole sectors of `src` into `dst`, the first being `sector`.
    fn decrypt_sectors_from(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        if src.len() != dst.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "source of {} bytes, destination of {}",
                    src.len(),
                    dst.len()
                ),
            ));
        }
        dst.copy_from_slice(src);
        self.decrypt_sectors(sector, dst)
    }
    /// As `encrypt_sectors`, into a destination the CPU will not read back
    /// soon (a write's out pages): an implementation may bypass the caches.
    fn encrypt_sectors_streaming(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.encrypt_sectors(sector, src, dst)
    }
    /// Encrypt whole sectors of `src` into `dst`'s segments, filled back
    /// to back (each whole sectors, together as long as `src`), the first
    /// being `sector`; `streaming` as `encrypt_sectors_streaming`. An
    /// implementation should do it in one call (a write's out pages are
    /// often not contiguous, and a call per page costs); this one goes
    /// segment by segment.
    fn encrypt_sectors_scattered(
        &self,
        sector: u64,
        src: &[u8],
        dst: &mut [&mut [u8]],
        streaming: bool,
    ) -> io::Result<()> {
        let total: usize = dst.iter().map(|d| d.len()).sum();
        if total != src.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("source of {} bytes, destination of {total}", src.len()),
            ));
        }
        let (ss, mut done) = (self.sector_size(), 0);
        for d in dst.iter_mut() {
            let (at, s) = (sector + (done / ss) as u64, &src[done..done + d.len()]);
            if streaming {
                self.encrypt_sectors_streaming(at, s, d)?;
            } else {
                self.encrypt_sectors(at, s, d)?;
            }
            done += d.len();
        }
        Ok(())
    }
}

fn other(e: iopages::Error) -> io::Error {
    io::Error::other(e.to_string())
}

fn cipher_error(e: crate::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e.to_string())
}

/// The AES-XTS cipher behind a lock: `XtsCipher` keeps per-sector state
/// (OpenSSL's context), so one instance serves one caller at a time. A
/// target used by many threads takes a [`CipherPool`].
impl SectorCipher for Mutex<crate::XtsCipher> {
    fn sector_size(&self) -> usize {
        self.lock().sector_size_bytes()
    }
    fn encrypt_sectors(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.lock()
            .encrypt_sectors(sector, src, dst)
            .map_err(cipher_error)
    }
    fn decrypt_sectors(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
        self.lock()
            .decrypt_sectors_in_place(sector, buf)
            .map_err(cipher_error)
    }
    fn encrypt_sectors_streaming(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.lock()
            .encrypt_sectors_streaming(sector, src, dst)
            .map_err(cipher_error)
    }
    fn encrypt_sectors_scattered(
        &self,
        sector: u64,
        src: &[u8],
        dst: &mut [&mut [u8]],
        streaming: bool,
    ) -> io::Result<()> {
        self.lock()
            .encrypt_sectors_scattered(sector, src, dst, streaming)
            .map_err(cipher_error)
    }
}

/// One AES-XTS instance per thread that encrypts at once (dm-crypt's
/// per-CPU cipher requests): a caller takes the instance its thread was
/// first given, or the next free one if that is busy.
pub struct CipherPool {
    ciphers: Box<[Mutex<crate::XtsCipher>]>,
    sector_size: usize,
    locked: bool,
}

static NEXT_THREAD_SLOT: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    static THREAD_SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

impl CipherPool {
    /// `n` instances (at least one) of `cipher`, cloned with its keys.
    ///
    /// **Returns:** the cipher's error if it cannot be cloned.
    pub fn new(cipher: crate::XtsCipher, n: usize) -> crate::Result<CipherPool> {
        let mut v = Vec::with_capacity(n.max(1));
        for _ in 1..n.max(1) {
            v.push(Mutex::new(cipher.try_clone()?));
        }
        let sector_size = cipher.sector_size_bytes();
        v.push(Mutex::new(cipher));
        let ciphers = v.into_boxed_slice();
        // Keep the expanded keys (held inline by each instance) out of
        // swap, best effort: a refusal (RLIMIT_MEMLOCK) is reported by
        // `keys_locked`. The pages are not unlocked on drop (`munlock` is
        // not counted per buffer and could unlock another secret sharing
        // the page); the keys are wiped on drop either way.
        let bytes = std::mem::size_of_val(&*ciphers);
        // SAFETY: the range is the boxed slice's own memory.
        let locked = unsafe { libc::mlock(ciphers.as_ptr().cast(), bytes) } == 0;
        Ok(CipherPool {
            ciphers,
            sector_size,
            locked,
        })
    }

    /// Whether the instances' memory (their expanded keys) was `mlock`ed.
    pub fn keys_locked(&self) -> bool {
        self.locked
    }

    /// Instances in the pool.
    pub fn len(&self) -> usize {
        self.ciphers.len()
    }

    /// Always false: a pool holds at least one instance.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn with<R>(&self, f: impl FnOnce(&mut crate::XtsCipher) -> R) -> R {
        let n = self.ciphers.len();
        let mine = THREAD_SLOT.with(|s| {
            if s.get() == usize::MAX {
                s.set(NEXT_THREAD_SLOT.fetch_add(1, Ordering::Relaxed));
            }
            s.get()
        }) % n;
        for i in 0..n {
            if let Some(mut c) = self.ciphers[(mine + i) % n].try_lock() {
                return f(&mut c);
            }
        }
        f(&mut self.ciphers[mine].lock())
    }
}

impl SectorCipher for CipherPool {
    fn sector_size(&self) -> usize {
        self.sector_size
    }
    fn encrypt_sectors(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.with(|c| c.encrypt_sectors(sector, src, dst))
            .map_err(cipher_error)
    }
    fn decrypt_sectors(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
        self.with(|c| c.decrypt_sectors_in_place(sector, buf))
            .map_err(cipher_error)
    }
    fn decrypt_sectors_from(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.with(|c| c.decrypt_sectors(sector, src, dst))
            .map_err(cipher_error)
    }
    fn encrypt_sectors_streaming(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.with(|c| c.encrypt_sectors_streaming(sector, src, dst))
            .map_err(cipher_error)
    }
    fn encrypt_sectors_scattered(
        &self,
        sector: u64,
        src: &[u8],
        dst: &mut [&mut [u8]],
        streaming: bool,
    ) -> io::Result<()> {
        self.with(|c| c.encrypt_sectors_scattered(sector, src, dst, streaming))
            .map_err(cipher_error)
    }
}

/// Settings of a crypt target.
#[derive(Clone, Copy, Debug)]
pub struct TargetConfig {
    /// Out-page allocation strategy.
    pub strategy: Strategy,
    /// How the page limit is checked.
    pub limit_check: LimitCheck,
    /// Pages the out-page mempool keeps in reserve.
    pub min_nr: usize,
    /// Page limit (`None`: 2 % of the arena).
    pub limit_pages: Option<usize>,
    /// Allow discards (default off), as dm-crypt's `allow_discards`: the
    /// target then accepts [`CryptTarget::discard`] and
    /// [`CryptTarget::punch_zeroes`], and an encryption sector whose
    /// ciphertext is all zero bytes (a hole in the image, an empty page
    /// store block) reads as plaintext zeros instead of being decrypted
    /// (real AES-XTS ciphertext is all zeros with probability 2^-4096).
    ///
    /// The trade-off: the image shows which blocks are unused (holes, or
    /// zeroed sectors), which may reveal the file system and its usage;
    /// and whoever can write the image can make a sector read as plaintext
    /// zeros by zeroing its ciphertext, where without this they can only
    /// make it read as garbage.
    pub allow_discards: bool,
    /// Read an encryption sector whose ciphertext is all zero bytes as
    /// plaintext zeros, without allowing discards (default off; implied by
    /// [`TargetConfig::allow_discards`]). For a backend that returns zero
    /// ciphertext only for blocks it has authenticated as zeros (an
    /// authenticated volume's never-written and discarded blocks), where a
    /// store forging zeros is caught below the target.
    pub sparse_reads: bool,
}

impl Default for TargetConfig {
    fn default() -> Self {
        TargetConfig {
            strategy: Strategy::Compound,
            limit_check: LimitCheck::Approximate,
            min_nr: 256,
            limit_pages: None,
            allow_discards: false,
            sparse_reads: false,
        }
    }
}

/// What a target has done, and (when timed) where a write's time went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TargetStats {
    /// Writes completed successfully.
    pub writes: u64,
    /// Bytes of those writes.
    pub write_bytes: u64,
    /// Writes that failed (in the backend or the cipher).
    pub write_errors: u64,
    /// Reads completed successfully.
    pub reads: u64,
    /// Bytes of those reads.
    pub read_bytes: u64,
    /// Time spent allocating out pages, while timed.
    pub alloc_time: Duration,
    /// Time spent freeing out pages (or replaced pages), while timed.
    pub free_time: Duration,
    /// Time spent in whole writes, while timed.
    pub write_time: Duration,
    /// Discards that reached the backend ([`CryptTarget::discard`] with at
    /// least one whole sector).
    pub discards: u64,
    /// Bytes of those discards.
    pub discard_bytes: u64,
    /// Successful zeroing punches ([`CryptTarget::punch_zeroes`]).
    pub zero_punches: u64,
    /// Bytes of those punches.
    pub zero_punch_bytes: u64,
}

/// The target's statistics: per-CPU counters with the largest batch, so
/// that counting bytes and nanoseconds almost never locks (with the
/// default batch every add of a byte count folds under the counter's lock:
/// a global lock on every I/O, which stopped 16 writers scaling past 8).
struct Counters {
    writes: PercpuCounter,
    write_bytes: PercpuCounter,
    write_errors: PercpuCounter,
    reads: PercpuCounter,
    read_bytes: PercpuCounter,
    alloc_ns: PercpuCounter,
    free_ns: PercpuCounter,
    write_ns: PercpuCounter,
    discards: PercpuCounter,
    discard_bytes: PercpuCounter,
    zero_punches: PercpuCounter,
    zero_punch_bytes: PercpuCounter,
}

/// Starts a timed phase when timing is on.
#[inline]
fn now(timed: bool) -> Option<Instant> {
    if timed {
        Some(Instant::now())
    } else {
        None
    }
}

#[inline]
fn account(counter: &PercpuCounter, since: Option<Instant>) {
    if let Some(t) = since {
        counter.add(t.elapsed().as_nanos() as i64);
    }
}

/// Reads at least this large decrypt straight from a backend's mapping
/// when it offers one ([`Backend::mapped`]); below it the `fstat` that
/// guards the mapping costs more than the copy it saves.
pub const MAPPED_READ_MIN_BYTES: usize = 64 << 10;

/// An encrypting block device over `backend`.
pub struct CryptTarget<C: SectorCipher> {
    alloc: PageAllocator,
    cipher: C,
    backend: Arc<dyn Backend>,
    out: OutAllocator,
    timed: AtomicBool,
    allow_discards: bool,
    sparse_reads: bool,
    counters: Counters,
}

impl<C: SectorCipher> CryptTarget<C> {
    /// A target encrypting with `cipher` onto `backend`, its out pages from
    /// `alloc`.
    ///
    /// **Returns:** `InvalidInput` if the backend's size is not whole
    /// sectors or it is a page store over another arena; `OutOfMemory` if
    /// the out-page reserve cannot be filled.
    pub fn new(
        alloc: &PageAllocator,
        cipher: C,
        backend: Arc<dyn Backend>,
        cfg: TargetConfig,
    ) -> io::Result<Self> {
        let ss = cipher.sector_size() as u64;
        if ss == 0 || !backend.size_bytes().is_multiple_of(ss) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "backend size {} is not a whole number of {ss}-byte sectors",
                    backend.size_bytes()
                ),
            ));
        }
        if let Some(store) = backend.page_store() {
            if !store.allocator().same_allocator(alloc) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the page store's pages come from another arena than the target's out pages",
                ));
            }
        }
        let out = OutAllocator::new(
            alloc,
            cfg.min_nr,
            cfg.limit_pages,
            cfg.strategy,
            cfg.limit_check,
        )
        .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e.to_string()))?;
        Ok(CryptTarget {
            alloc: alloc.clone(),
            cipher,
            backend,
            out,
            timed: AtomicBool::new(false),
            allow_discards: cfg.allow_discards,
            sparse_reads: cfg.allow_discards || cfg.sparse_reads,
            counters: Counters {
                writes: PercpuCounter::statistic(),
                write_bytes: PercpuCounter::statistic(),
                write_errors: PercpuCounter::statistic(),
                reads: PercpuCounter::statistic(),
                read_bytes: PercpuCounter::statistic(),
                alloc_ns: PercpuCounter::statistic(),
                free_ns: PercpuCounter::statistic(),
                write_ns: PercpuCounter::statistic(),
                discards: PercpuCounter::statistic(),
                discard_bytes: PercpuCounter::statistic(),
                zero_punches: PercpuCounter::statistic(),
                zero_punch_bytes: PercpuCounter::statistic(),
            },
        })
    }

    /// The page allocator the out pages come from.
    pub fn allocator(&self) -> &PageAllocator {
        &self.alloc
    }

    /// The out-page allocator (strategy, limit, counters).
    pub fn out_pages(&self) -> &OutAllocator {
        &self.out
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Device size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.backend.size_bytes()
    }

    /// Bytes per sector.
    pub fn sector_size(&self) -> usize {
        self.cipher.sector_size()
    }

    /// Time the phases of every write from now on (`true`) or stop. Off by
    /// default; costs a few clock reads per write.
    pub fn set_timed(&self, on: bool) {
        self.timed.store(on, Ordering::Relaxed);
    }

    /// Counts and (when timed) phase times so far.
    pub fn stats(&self) -> TargetStats {
        let c = &self.counters;
        let n = |p: &PercpuCounter| p.sum().max(0) as u64;
        TargetStats {
            writes: n(&c.writes),
            write_bytes: n(&c.write_bytes),
            write_errors: n(&c.write_errors),
            reads: n(&c.reads),
            read_bytes: n(&c.read_bytes),
            alloc_time: Duration::from_nanos(n(&c.alloc_ns)),
            free_time: Duration::from_nanos(n(&c.free_ns)),
            write_time: Duration::from_nanos(n(&c.write_ns)),
            discards: n(&c.discards),
            discard_bytes: n(&c.discard_bytes),
            zero_punches: n(&c.zero_punches),
            zero_punch_bytes: n(&c.zero_punch_bytes),
        }
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<u64> {
        let ss = self.cipher.sector_size() as u64;
        if !offset.is_multiple_of(ss) || !(len as u64).is_multiple_of(ss) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("I/O at offset {offset} of {len} bytes is not whole {ss}-byte sectors"),
            ));
        }
        crate::backend::check_range(offset, len as u64, self.backend.size_bytes())?;
        Ok(offset / ss)
    }

    /// The page store to hand whole pages to, if the backend is one and the
    /// request covers whole pages.
    fn store_for(&self, offset: u64, len: usize) -> Option<&PageStore> {
        let store = self.backend.page_store()?;
        (offset.is_multiple_of(PAGE_SIZE as u64) && len.is_multiple_of(PAGE_SIZE)).then_some(store)
    }

    /// Count a write (and, when timed, its time since `since`), whether
    /// it ended here or on an asynchronous backend's thread.
    pub(crate) fn finish_write(&self, len: usize, result: &io::Result<()>, since: Option<Instant>) {
        if result.is_ok() {
            self.counters.writes.add(1);
            self.counters.write_bytes.add(len as i64);
        } else {
            self.counters.write_errors.add(1);
        }
        account(&self.counters.write_ns, since);
    }

    /// Encrypt `data` and write it at byte `offset`.
    ///
    /// **Context:** may block (out-page allocation waits at the page limit;
    /// the backend may block). **Returns:** `InvalidInput` for a request
    /// that is not whole sectors or leaves the device (nothing written), or
    /// the backend's error; the out pages are freed either way.
    pub fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_inner(offset, data, false)
    }

    /// Encrypt `data` and write it at byte `offset`, durable when this
    /// returns (FUA): passed down as [`Backend::write_at_fua`] when the
    /// backend has [`Backend::native_fua`] (an NBD remote offering
    /// NBD_FLAG_SEND_FUA), else the write and then a whole flush.
    ///
    /// **Context / Returns:** as [`CryptTarget::write`], or the flush's
    /// error.
    pub fn write_fua(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if !self.backend.native_fua() || self.store_for(offset, data.len()).is_some() {
            self.write(offset, data)?;
            return self.backend.flush();
        }
        self.write_inner(offset, data, true)
    }

    /// [`CryptTarget::write_fua`] when `fua`, else [`CryptTarget::write`]:
    /// for callers that carry the flag.
    ///
    /// **Context / Returns:** as those.
    pub fn write_with_fua(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        if fua {
            self.write_fua(offset, data)
        } else {
            self.write(offset, data)
        }
    }

    /// Whether the backend makes a single write durable by itself
    /// ([`Backend::native_fua`]): then FUA is best passed down per write
    /// ([`CryptTarget::write_fua`]) instead of flushing after a request.
    ///
    /// **Returns:** the backend's answer.
    pub fn native_fua(&self) -> bool {
        self.backend.native_fua()
    }

    fn write_inner(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let sector = self.check(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let timed = self.timed.load(Ordering::Relaxed);
        let start = now(timed);
        let nr_pages = data.len().div_ceil(PAGE_SIZE);
        let mut out = self.out.alloc(nr_pages);
        account(&self.counters.alloc_ns, start);
        let result = match self.store_for(offset, data.len()) {
            Some(store) => self.write_to_store(store, sector, offset, data, out, timed),
            None => {
                let r = self.encrypt_and_submit(sector, offset, data, out.buffer_mut(), fua);
                let t = now(timed);
                self.out.free(out);
                account(&self.counters.free_ns, t);
                r
            }
        };
        self.finish_write(data.len(), &result, start);
        result
    }

    /// The page-store write: encrypt into the out pages, hand them to the
    /// store, free the pages they replace.
    fn write_to_store(
        &self,
        store: &PageStore,
        sector: u64,
        offset: u64,
        data: &[u8],
        mut out: OutPages,
        timed: bool,
    ) -> io::Result<()> {
        let nr_pages = data.len() / PAGE_SIZE;
        let encrypted = self.encrypt(sector, data, out.buffer_mut(), |_| {});
        let t = now(timed);
        let mut result = encrypted;
        if result.is_ok() {
            self.out.split(&mut out);
            self.out.free(out.split_off(nr_pages));
            let mut replaced = FolioBuffer::with_capacity(&self.alloc, nr_pages);
            result = store.store_pages(offset, out.buffer_mut(), &mut replaced);
            if result.is_ok() {
                self.out.hand_over(out);
                self.out.free_replaced(replaced);
                account(&self.counters.free_ns, t);
                return Ok(());
            }
        }
        self.out.free(out);
        account(&self.counters.free_ns, t);
        result
    }

    /// Encrypt `data` into the first bytes of `out`, passing each filled
    /// run's bytes to `each`. Pages that follow each other in the arena
    /// are one run (one segment for the backend instead of one per page),
    /// and the runs are encrypted in one cipher call, however many there
    /// are: a call per 4 KiB page cost a quarter of the cipher's rate.
    fn encrypt<'o>(
        &self,
        sector: u64,
        data: &[u8],
        out: &'o mut FolioBuffer,
        mut each: impl FnMut(&'o [u8]),
    ) -> io::Result<()> {
        debug_assert!(out.len() >= data.len());
        let mut left = data.len();
        let mut runs: Runs<&'o mut [u8]> = out
            .runs_mut()
            .map_while(|run| {
                let n = run.len().min(left);
                left -= n;
                (n > 0).then(|| run.split_at_mut(n).0)
            })
            .collect();
        debug_assert_eq!(left, 0);
        let streaming = !self.backend.reads_writes();
        self.cipher
            .encrypt_sectors_scattered(sector, data, &mut runs, streaming)?;
        for run in runs {
            each(run);
        }
        Ok(())
    }

    fn encrypt_and_submit(
        &self,
        sector: u64,
        offset: u64,
        data: &[u8],
        out: &mut FolioBuffer,
        fua: bool,
    ) -> io::Result<()> {
        // One segment per run of out pages, trimmed to the request's length.
        let mut segments: Runs<&[u8]> = Runs::new();
        self.encrypt(sector, data, out, |seg| segments.push(seg))?;
        if fua {
            self.backend.write_at_fua(offset, &segments)
        } else {
            self.backend.write_at(offset, &segments)
        }
    }

    /// Encrypt `data` (to be written at byte `offset`) into out pages for
    /// an asynchronous backend ([`Backend::async_io`]): the ciphertext as
    /// [`Segments`], whose pages go back to the out allocator when the
    /// last reference to them is dropped.
    ///
    /// **Context:** may block (out-page allocation at the page limit).
    /// **Returns:** `None` (nothing allocated) when the write is not for
    /// the asynchronous path: no such backend, nothing to write, a request
    /// the blocking path refuses, a page-store write, or FUA on a backend
    /// without it — or when the cipher fails (the blocking path reports
    /// it).
    pub fn seal(self: &Arc<Self>, offset: u64, data: &[u8], fua: bool) -> Option<Arc<dyn Segments>>
    where
        C: 'static,
    {
        self.backend.async_io()?;
        let unfit = data.is_empty()
            || (fua && !self.backend.native_fua())
            || self.store_for(offset, data.len()).is_some();
        let sector = self.check(offset, data.len()).ok().filter(|_| !unfit)?;
        let start = now(self.timed.load(Ordering::Relaxed));
        let pages = data.len().div_ceil(PAGE_SIZE);
        // Requests this thread holds back may be what frees pages: it
        // sends them before it may wait for one.
        let ready = crate::async_io::holding()
            .then(|| self.out.try_alloc(pages))
            .flatten();
        let mut out = ready.unwrap_or_else(|| {
            crate::async_io::send_held();
            self.out.alloc(pages)
        });
        account(&self.counters.alloc_ns, start);
        if self
            .encrypt(sector, data, out.buffer_mut(), |_| {})
            .is_err()
        {
            self.out.free(out);
            return None;
        }
        Some(Arc::new(Sealed {
            target: Arc::clone(self),
            out: Some(out),
            len: data.len(),
        }))
    }

    /// When timing is on, now (a write's start).
    pub(crate) fn clock(&self) -> Option<Instant> {
        now(self.timed.load(Ordering::Relaxed))
    }

    /// Whether a read of `len` bytes at `offset` can go to the
    /// asynchronous backend (then [`CryptTarget::decrypt_read`] finishes
    /// it).
    pub(crate) fn reads_async(&self, offset: u64, len: usize) -> bool {
        self.backend.async_io().is_some() && len > 0 && self.check(offset, len).is_ok()
    }

    /// Decrypt (and count) a read's ciphertext, read into `buf` from
    /// byte `offset` by an asynchronous backend.
    pub(crate) fn decrypt_read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let sector = self.check(offset, buf.len())?;
        self.decrypt_in_place(sector, buf)?;
        self.count_read(buf.len());
        Ok(())
    }

    /// Decrypt a read's ciphertext in `buf` (the first sector `sector`),
    /// holes as plaintext zeros where reads are sparse.
    fn decrypt_in_place(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
        if self.sparse_reads {
            self.decrypt_sparse(sector, buf)
        } else {
            self.cipher.decrypt_sectors(sector, buf)
        }
    }

    fn count_read(&self, len: usize) {
        self.counters.reads.add(1);
        self.counters.read_bytes.add(len as i64);
    }

    /// Write through out pages the caller keeps instead of allocated ones:
    /// the same pipeline with no allocation, the ceiling the strategies
    /// are measured against. `buf` holds order-0 folios of this target's
    /// arena; it is topped up with fresh pages if it holds fewer than the
    /// write needs. On a page store the pages are handed over and the
    /// pages they replace take their place in `buf`.
    ///
    /// **Context / Returns:** as [`CryptTarget::write`]; `InvalidInput`
    /// (nothing written) for a buffer of another arena.
    pub fn write_with_folios(
        &self,
        offset: u64,
        data: &[u8],
        buf: &mut FolioBuffer,
    ) -> io::Result<()> {
        let sector = self.check(offset, data.len())?;
        if !buf.allocator().same_allocator(&self.alloc) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the out buffer belongs to another arena than the target's",
            ));
        }
        let nr_pages = data.len().div_ceil(PAGE_SIZE);
        let start = now(self.timed.load(Ordering::Relaxed));
        while buf.folios().len() < nr_pages {
            let got = buf.push_alloc(Gfp::NOIO | Gfp::NOFAIL, 0);
            assert!(got, "a NOFAIL allocation never fails");
        }
        // The pages past this write's wait aside, and go back after it.
        let mut rest = buf.split_off(nr_pages);
        let result = match self.store_for(offset, data.len()) {
            Some(store) => self.encrypt(sector, data, buf, |_| {}).and_then(|()| {
                let mut replaced = FolioBuffer::with_capacity(&self.alloc, nr_pages);
                store.store_pages(offset, buf, &mut replaced)?;
                buf.append(&mut replaced).map_err(other)
            }),
            None => self.encrypt_and_submit(sector, offset, data, buf, false),
        };
        buf.append(&mut rest)
            .expect("the pages set aside are of the buffer's own arena");
        self.finish_write(data.len(), &result, start);
        result
    }

    /// Read and decrypt `buf.len()` bytes at byte `offset`.
    ///
    /// **Context:** may block in the backend. **Returns:** `InvalidInput`
    /// for a request that is not whole sectors or leaves the device, or the
    /// backend's error.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let sector = self.check(offset, buf.len())?;
        let mapped = if buf.len() >= MAPPED_READ_MIN_BYTES {
            self.backend.mapped(offset, buf.len())
        } else {
            None
        };
        match mapped {
            // Straight out of the page cache: one pass instead of a copy
            // and a pass.
            Some(src) if self.sparse_reads => self.decrypt_sparse_from(sector, src, buf)?,
            Some(src) => self.cipher.decrypt_sectors_from(sector, src, buf)?,
            None => {
                self.backend.read_at(offset, &mut [buf])?;
                self.decrypt_in_place(sector, buf)?;
            }
        }
        self.count_read(buf.len());
        Ok(())
    }

    /// Decrypt `buf` (whole sectors of ciphertext, the first being
    /// `sector`) in place, leaving the sectors of all-zero ciphertext as
    /// they are (plaintext zeros); each run of other sectors is one cipher
    /// call.
    fn decrypt_sparse(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
        let ss = self.cipher.sector_size();
        let mut at = 0;
        while at < buf.len() {
            let zero = sector_is_zero(&buf[at..at + ss]);
            let end = run_end(buf, ss, at, zero);
            if !zero {
                self.cipher
                    .decrypt_sectors(sector + (at / ss) as u64, &mut buf[at..end])?;
            }
            at = end;
        }
        Ok(())
    }

    /// As [`CryptTarget::decrypt_sparse`], from `src` into `dst`: the
    /// sectors of all-zero ciphertext are zero-filled.
    fn decrypt_sparse_from(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        debug_assert_eq!(src.len(), dst.len());
        let ss = self.cipher.sector_size();
        let mut at = 0;
        while at < src.len() {
            let zero = sector_is_zero(&src[at..at + ss]);
            let end = run_end(src, ss, at, zero);
            if zero {
                dst[at..end].fill(0);
            } else {
                self.cipher.decrypt_sectors_from(
                    sector + (at / ss) as u64,
                    &src[at..end],
                    &mut dst[at..end],
                )?;
            }
            at = end;
        }
        Ok(())
    }

    /// Flush the backend (`fdatasync` for files).
    pub fn flush(&self) -> io::Result<()> {
        self.backend.flush()
    }

    /// Whether discards were allowed at construction
    /// ([`TargetConfig::allow_discards`]).
    ///
    /// **Returns:** the setting, fixed for the target's life.
    pub fn discards_allowed(&self) -> bool {
        self.allow_discards
    }

    /// Whether a zeroing punch ([`CryptTarget::punch_zeroes`]) can be
    /// attempted: discards are allowed and the backend can punch.
    ///
    /// **Returns:** `false` when either is missing; `true` does not
    /// promise that every punch succeeds (a block device may refuse).
    pub fn can_punch_zeroes(&self) -> bool {
        self.allow_discards && self.backend.can_punch()
    }

    /// Discard the whole encryption sectors inside `offset..offset + len`
    /// (any range inside the device; the partial sectors at its head and
    /// tail are left alone). Discarded sectors read as zeros where the
    /// backend deallocates (a file's hole), else as what they held or as
    /// zeros (a block device's discard).
    ///
    /// **Context:** may block in the backend. **Returns:** the bytes
    /// discarded (0, with nothing asked of the backend, when no whole
    /// sector is inside); `Unsupported` if discards are not allowed;
    /// `InvalidInput` if the range leaves the device; the backend's error.
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<u64> {
        if !self.allow_discards {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "discards are not allowed on this target (allow_discards is off)",
            ));
        }
        check_range(offset, len, self.backend.size_bytes())?;
        let ss = self.cipher.sector_size() as u64;
        let first = offset.div_ceil(ss) * ss;
        let end = (offset + len) / ss * ss;
        if end <= first {
            return Ok(0);
        }
        self.backend.discard(first, end - first)?;
        self.counters.discards.add(1);
        self.counters.discard_bytes.add((end - first) as i64);
        Ok(end - first)
    }

    /// Make `len` bytes at `offset` (whole sectors) read as zeros by
    /// punching them out of the backend: the fast form of writing
    /// encrypted zeros.
    ///
    /// **Context:** may block in the backend. **Returns:** `Unsupported`
    /// when [`CryptTarget::can_punch_zeroes`] is false or the backend
    /// refuses the punch as unsupported (the caller then writes encrypted
    /// zeros instead); `InvalidInput` for a range that is not whole
    /// sectors or leaves the device (nothing touched); the backend's error
    /// otherwise.
    pub fn punch_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.can_punch_zeroes() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                if self.allow_discards {
                    "the backend cannot punch holes"
                } else {
                    "zeroing punches need allow_discards, which is off on this target"
                },
            ));
        }
        let ss = self.cipher.sector_size() as u64;
        if !offset.is_multiple_of(ss) || !len.is_multiple_of(ss) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("punch at offset {offset} of {len} bytes is not whole {ss}-byte sectors"),
            ));
        }
        check_range(offset, len, self.backend.size_bytes())?;
        if len == 0 {
            return Ok(());
        }
        self.backend.punch(offset, len)?;
        self.counters.zero_punches.add(1);
        self.counters.zero_punch_bytes.add(len as i64);
        Ok(())
    }

    /// The allocation of the volume from `offset` (a sector multiple), as
    /// [`Backend::extents`], with holes rounded inward to whole encryption
    /// sectors (a sector partly allocated is allocated) and adjacent
    /// extents of one kind merged: at most `max_extents` (0 is taken as
    /// 1), covering at most `len` bytes clipped to the device (`len` need
    /// not be whole sectors). A hole reads as zeros only when discards are
    /// allowed.
    ///
    /// **Context:** may block in the backend. **Returns:** at least one
    /// extent when some of the range is inside the device, none otherwise;
    /// `InvalidInput` for an offset that is not a sector multiple or lies
    /// past the end; the backend's error.
    pub fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        let ss = self.cipher.sector_size() as u64;
        let size = self.backend.size_bytes();
        if !offset.is_multiple_of(ss) || offset > size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "extents at offset {offset}: not a {ss}-byte sector multiple inside the \
                     device ({size} bytes)"
                ),
            ));
        }
        let len = len.min(size - offset);
        let mut out = Extents {
            out: Vec::new(),
            max: max_extents.max(1),
            at: offset,
            full: false,
        };
        if len == 0 {
            return Ok(out.out);
        }
        // Whole sectors: the last one, partly asked for, is classified
        // whole (the device ends on a sector edge).
        let end = (offset + len).div_ceil(ss) * ss;
        // The backend's extents, merged across calls into maximal holes:
        // `hole_from` is where the hole being followed started.
        let mut pos = offset;
        let mut hole_from: Option<u64> = None;
        let batch = out.max.saturating_mul(2).saturating_add(16);
        while pos < end && !out.full {
            let before = pos;
            for e in self.backend.extents(pos, end - pos, batch)? {
                let at = pos;
                pos = (pos + e.len_bytes).min(end);
                if e.hole {
                    hole_from.get_or_insert(at);
                } else if let Some(h) = hole_from.take() {
                    out.hole(h.div_ceil(ss) * ss, at / ss * ss);
                }
            }
            if pos == before {
                // A backend that reported nothing: the rest is allocated.
                break;
            }
        }
        if let Some(h) = hole_from.take() {
            out.hole(h.div_ceil(ss) * ss, pos / ss * ss);
        }
        out.allocated(end);
        // Clip the partial last sector to what was asked for.
        let mut v = out.out;
        let covered: u64 = v.iter().map(|e| e.len_bytes).sum();
        if covered > len {
            let last = v.last_mut().expect("covered > 0");
            last.len_bytes -= covered - len;
        }
        Ok(v)
    }
}

/// Sector-level extents being built by [`CryptTarget::extents`].
struct Extents {
    out: Vec<Extent>,
    max: usize,
    /// Where the next extent starts.
    at: u64,
    /// An extent was refused: `max` reached.
    full: bool,
}

impl Extents {
    /// Add `len` bytes of kind `hole`, unless that would start one extent
    /// too many.
    fn push(&mut self, len: u64, hole: bool) {
        if self.full || len == 0 {
            return;
        }
        if self.out.last().is_some_and(|e| e.hole != hole) && self.out.len() == self.max {
            self.full = true;
            return;
        }
        push_extent(&mut self.out, len, hole);
        self.at += len;
    }

    /// The sector-aligned hole `from..to` (nothing if empty), allocated
    /// bytes before it.
    fn hole(&mut self, from: u64, to: u64) {
        if from < to {
            self.allocated(from);
            self.push(to - from, true);
        }
    }

    /// Allocated bytes up to `to`.
    fn allocated(&mut self, to: u64) {
        if to > self.at {
            self.push(to - self.at, false);
        }
    }
}

/// Whether a sector's ciphertext is all zero bytes. Real ciphertext fails
/// on its first 16 bytes; only a hole reads the whole sector.
#[inline]
fn sector_is_zero(sector: &[u8]) -> bool {
    let (head, rest) = sector.split_at(16.min(sector.len()));
    if head.iter().any(|&b| b != 0) {
        return false;
    }
    // 64 bytes at a time, ORed together: the compiler vectorises it.
    let mut chunks = rest.chunks_exact(64);
    for c in &mut chunks {
        if c.iter().fold(0u8, |acc, &b| acc | b) != 0 {
            return false;
        }
    }
    chunks.remainder().iter().all(|&b| b == 0)
}

/// The end (exclusive, in bytes) of the run of `ss`-byte sectors of `buf`
/// from `at` whose ciphertext is all zero (`zero`) or not.
fn run_end(buf: &[u8], ss: usize, at: usize, zero: bool) -> usize {
    let mut end = at + ss;
    while end < buf.len() && sector_is_zero(&buf[end..end + ss]) == zero {
        end += ss;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{PageStore, RamDisk};

    /// A stand-in cipher for the target's own logic: each byte XORed with
    /// its sector number and position, so misplaced sectors show up. The
    /// real cipher has its own tests.
    struct Tagged(usize);

    impl SectorCipher for Tagged {
        fn sector_size(&self) -> usize {
            self.0
        }
        fn encrypt_sectors(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
            for (i, (d, s)) in dst.iter_mut().zip(src).enumerate() {
                let sec = sector + (i / self.0) as u64;
                *d = s ^ (sec as u8).wrapping_mul(31) ^ (i % self.0) as u8 ^ 0x5a;
            }
            Ok(())
        }
        fn decrypt_sectors(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
            for (i, b) in buf.iter_mut().enumerate() {
                let sec = sector + (i / self.0) as u64;
                *b ^= (sec as u8).wrapping_mul(31) ^ (i % self.0) as u8 ^ 0x5a;
            }
            Ok(())
        }
    }

    fn target(strategy: Strategy, ss: usize) -> (PageAllocator, Arc<RamDisk>, CryptTarget<Tagged>) {
        let alloc = PageAllocator::builder()
            .size_bytes(32 << 20)
            .huge_pages(iopages::HugePages::Never)
            .build()
            .unwrap();
        let disk = Arc::new(RamDisk::new(4 << 20).unwrap());
        let cfg = TargetConfig {
            strategy,
            min_nr: 64,
            ..TargetConfig::default()
        };
        let t = CryptTarget::new(&alloc, Tagged(ss), disk.clone(), cfg).unwrap();
        (alloc, disk, t)
    }

    #[test]
    fn a_cipher_pool_locks_its_keys_in_memory_where_the_limit_allows() {
        let key: Vec<u8> = (0..64u8).collect();
        let pool = CipherPool::new(crate::XtsCipher::new(&key, 512, 0).unwrap(), 3).unwrap();
        assert_eq!(pool.len(), 3);
        // The pool's memory is a few hundred bytes per instance: far
        // below the smallest default RLIMIT_MEMLOCK (64 KiB), so it locks
        // unless the limit was set to zero.
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid out-parameter.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
        assert_eq!(rc, 0);
        if lim.rlim_cur >= 64 << 10 {
            assert!(pool.keys_locked());
        }
    }

    #[test]
    fn writes_of_every_strategy_and_sector_size_read_back_and_are_stored_encrypted() {
        for strategy in [Strategy::PerPage, Strategy::Bulk, Strategy::Compound] {
            for ss in [512usize, 4096] {
                let (alloc, disk, t) = target(strategy, ss);
                let mut rng = 0x1234_5678u64 ^ ss as u64;
                let mut model = vec![0u8; 4 << 20];
                // Start from a device of encrypted zeros, as after a format.
                for chunk in 0..4u64 {
                    t.write(chunk << 20, &model[..1 << 20]).unwrap();
                }
                for _ in 0..40 {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let sectors = (4 << 20) / ss;
                    let n = 1 + (rng as usize % 300).min(sectors - 1);
                    let first = (rng >> 20) as usize % (sectors - n + 1);
                    let data: Vec<u8> = (0..n * ss).map(|i| (i as u64 ^ rng) as u8).collect();
                    t.write((first * ss) as u64, &data).unwrap();
                    model[first * ss..(first + n) * ss].copy_from_slice(&data);
                    let mut raw = vec![0u8; data.len()];
                    disk.read_at((first * ss) as u64, &mut [&mut raw]).unwrap();
                    assert_ne!(raw, data, "the backend must hold ciphertext");
                }
                let mut back = vec![0u8; 4 << 20];
                t.read(0, &mut back).unwrap();
                assert!(
                    back == model,
                    "{strategy:?}/{ss}: read-back differs from what was written"
                );
                assert_eq!(t.out_pages().allocated_pages(), 0);
                drop(t);
                alloc.leak_check().unwrap();
            }
        }
    }

    #[test]
    fn writes_through_a_kept_out_buffer_read_back_and_leave_only_its_pages() {
        let alloc = PageAllocator::builder()
            .size_bytes(32 << 20)
            .huge_pages(iopages::HugePages::Never)
            .build()
            .unwrap();
        let ram: Arc<dyn Backend> = Arc::new(RamDisk::new(1 << 20).unwrap());
        let store: Arc<dyn Backend> = Arc::new(PageStore::new(&alloc, 1 << 20).unwrap());
        for backend in [ram, store] {
            let t =
                CryptTarget::new(&alloc, Tagged(512), backend, TargetConfig::default()).unwrap();
            let mut folios = FolioBuffer::new(&alloc);
            let mut second = FolioBuffer::new(&alloc);
            let mut model = vec![0u8; 1 << 20];
            // Start from a device of encrypted zeros, as after a format.
            t.write(0, &model).unwrap();
            // Page-aligned (handed to a page store) and not, longer and
            // shorter than the buffers, through both kinds of buffer.
            let writes = [
                (0, 8192),
                (4096, 3 * 4096),
                (512, 1536),
                (65536, 20 * 4096),
                (8192, 4096),
            ];
            for (k, &(offset, len)) in writes.iter().enumerate() {
                let data: Vec<u8> = (0..len).map(|i| (i * 7 + k) as u8).collect();
                let buf = if k % 2 == 0 { &mut folios } else { &mut second };
                t.write_with_folios(offset as u64, &data, buf).unwrap();
                model[offset..offset + len].copy_from_slice(&data);
            }
            let mut back = vec![0u8; 1 << 20];
            t.read(0, &mut back).unwrap();
            assert!(back == model, "read-back differs");
            assert!(
                folios.len() >= 8192 && !second.is_empty(),
                "the buffers are kept"
            );
            // A buffer of another arena is refused before anything moves.
            let other = PageAllocator::builder()
                .size_bytes(8 << 20)
                .huge_pages(iopages::HugePages::Never)
                .build()
                .unwrap();
            let mut foreign = FolioBuffer::new(&other);
            let e = t
                .write_with_folios(0, &[0; 4096], &mut foreign)
                .unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            drop(foreign);
            other.leak_check().unwrap();
            drop((folios, second, t));
        }
        alloc.leak_check().unwrap();
    }

    #[test]
    fn with_aes_xts_the_backend_holds_exactly_the_xts_ciphertext_of_each_sector() {
        for ss in [512usize, 4096] {
            let alloc = PageAllocator::builder()
                .size_bytes(16 << 20)
                .huge_pages(iopages::HugePages::Never)
                .build()
                .unwrap();
            let disk = Arc::new(RamDisk::new(1 << 20).unwrap());
            let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5c).collect();
            let cipher = Mutex::new(crate::XtsCipher::new(&key, ss, 0).unwrap());
            let t = CryptTarget::new(
                &alloc,
                cipher,
                disk.clone(),
                TargetConfig {
                    min_nr: 32,
                    ..TargetConfig::default()
                },
            )
            .unwrap();
            let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 13 + 1) as u8).collect();
            let off = (3 * ss) as u64;
            t.write(off, &data).unwrap();
            let mut raw = vec![0u8; data.len()];
            disk.read_at(off, &mut [&mut raw]).unwrap();
            // An independent instance of the cipher, sector numbers from 3.
            let mut expect = vec![0u8; data.len()];
            crate::XtsCipher::new(&key, ss, 0)
                .unwrap()
                .encrypt_sectors(3, &data, &mut expect)
                .unwrap();
            assert!(
                raw == expect,
                "{ss}: the backend must hold aes-xts-plain64 ciphertext"
            );
            let mut back = vec![0u8; data.len()];
            t.read(off, &mut back).unwrap();
            assert!(back == data);
            drop(t);
            alloc.leak_check().unwrap();
        }
    }

    /// A backend whose every I/O fails, as a dead disk would.
    struct Failing;

    impl Backend for Failing {
        fn size_bytes(&self) -> u64 {
            1 << 20
        }
        fn write_at(&self, _: u64, _: &[&[u8]]) -> io::Result<()> {
            Err(io::Error::other("injected write error"))
        }
        fn read_at(&self, _: u64, _: &mut [&mut [u8]]) -> io::Result<()> {
            Err(io::Error::other("injected read error"))
        }
        fn flush(&self) -> io::Result<()> {
            Err(io::Error::other("injected flush error"))
        }
    }

    #[test]
    fn a_backend_error_fails_that_io_with_the_error_and_leaks_no_page() {
        for strategy in [Strategy::PerPage, Strategy::Bulk, Strategy::Compound] {
            let alloc = PageAllocator::builder()
                .size_bytes(16 << 20)
                .huge_pages(iopages::HugePages::Never)
                .build()
                .unwrap();
            let cfg = TargetConfig {
                strategy,
                min_nr: 16,
                ..TargetConfig::default()
            };
            let t = CryptTarget::new(&alloc, Tagged(512), Arc::new(Failing), cfg).unwrap();
            for _ in 0..20 {
                let e = t.write(4096, &[7u8; 64 * 1024]).unwrap_err();
                assert!(e.to_string().contains("injected write error"), "{e}");
            }
            assert_eq!(
                t.out_pages().allocated_pages(),
                0,
                "{strategy:?}: out pages must be freed on error"
            );
            assert_eq!(t.out_pages().reserve_len(), 16);
            let mut buf = [0u8; 512];
            assert!(t
                .read(0, &mut buf)
                .unwrap_err()
                .to_string()
                .contains("injected read error"));
            assert!(t.flush().is_err());
            drop(t);
            alloc.leak_check().unwrap();
        }
    }

    #[test]
    fn partial_sectors_and_out_of_range_requests_are_refused_and_write_nothing() {
        let (alloc, disk, t) = target(Strategy::Bulk, 512);
        for (off, len) in [
            (0u64, 100usize),
            (100, 512),
            (4 << 20, 512),
            ((4 << 20) - 512, 1024),
        ] {
            let e = t.write(off, &vec![1u8; len]).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{off}/{len}: {e}");
        }
        let mut raw = vec![1u8; 4096];
        disk.read_at(0, &mut [&mut raw]).unwrap();
        assert!(
            raw.iter().all(|&b| b == 0),
            "a refused write must not reach the backend"
        );
        assert!(t.read(3, &mut [0u8; 512]).is_err());
        assert_eq!(t.out_pages().allocated_pages(), 0);
        drop(t);
        alloc.leak_check().unwrap();
    }

    /// A RAM disk recording which calls reached it: "write", "fua",
    /// "flush"; FUA native or not.
    struct Recording {
        disk: crate::backend::RamDisk,
        native: bool,
        calls: parking_lot::Mutex<Vec<&'static str>>,
    }

    impl Backend for Recording {
        fn size_bytes(&self) -> u64 {
            self.disk.size_bytes()
        }
        fn write_at(&self, offset: u64, segs: &[&[u8]]) -> io::Result<()> {
            self.calls.lock().push("write");
            self.disk.write_at(offset, segs)
        }
        fn read_at(&self, offset: u64, segs: &mut [&mut [u8]]) -> io::Result<()> {
            self.disk.read_at(offset, segs)
        }
        fn flush(&self) -> io::Result<()> {
            self.calls.lock().push("flush");
            Ok(())
        }
        fn write_at_fua(&self, offset: u64, segs: &[&[u8]]) -> io::Result<()> {
            if !self.native {
                self.calls.lock().push("write");
                self.disk.write_at(offset, segs)?;
                return self.flush();
            }
            self.calls.lock().push("fua");
            self.disk.write_at(offset, segs)
        }
        fn native_fua(&self) -> bool {
            self.native
        }
    }

    #[test]
    fn a_fua_write_goes_down_as_fua_where_the_backend_takes_it_else_write_then_flush() {
        for native in [true, false] {
            let alloc = PageAllocator::builder()
                .size_bytes(16 << 20)
                .huge_pages(iopages::HugePages::Never)
                .build()
                .unwrap();
            let rec = Arc::new(Recording {
                disk: crate::backend::RamDisk::new(1 << 20).unwrap(),
                native,
                calls: parking_lot::Mutex::new(Vec::new()),
            });
            let disk: Arc<dyn Backend> = rec.clone();
            let t = CryptTarget::new(&alloc, Tagged(512), disk, TargetConfig::default()).unwrap();
            assert_eq!(t.native_fua(), native);
            t.write_fua(4096, &[5u8; 8192]).unwrap();
            t.write(0, &[6u8; 512]).unwrap();
            let want: &[&str] = if native {
                &["fua", "write"]
            } else {
                &["write", "flush", "write"]
            };
            assert_eq!(*rec.calls.lock(), want, "native FUA {native}");
            let mut back = [0u8; 8192];
            t.read(4096, &mut back).unwrap();
            assert!(back.iter().all(|&b| b == 5));
            drop(t);
            alloc.leak_check().unwrap();
        }
    }
}
