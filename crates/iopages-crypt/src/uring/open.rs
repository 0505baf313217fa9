//! Opening a [`UringFile`]: the file, its size, direct I/O or the
//! fallback to buffered I/O, the rings and the arena's fixed buffers.
//!
//! Owns: [`UringFile::open`] and its steps — the options checked, the open
//! (with `O_DIRECT` unless [`DirectIo::Off`]), the device size, the
//! alignment direct I/O needs (`statx` / `BLKSSZGET` and probe reads),
//! ring setup and the arena's registration — and [`block_device_size`]
//! and [`probe`] (whether this kernel sets up a ring at all).
//! Must never: take a fallback without recording why in the file's
//! fallbacks (or, under [`DirectIo::Require`], failing the open), shrink a
//! file, or leave fixed buffers registered on some rings and not others.

use super::bounce::HeapBuf;
use super::map::FileMap;
use super::options::{DirectIo, UringOptions};
use super::{ArenaMap, Counters, UringFile, FIXED_BUFFER_MAX_BYTES, RMW_STRIPES};
use io_uring::IoUring;
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::AtomicUsize;

/// Sectors: every device size is a multiple of this.
const SECTOR: u64 = 512;
/// The smallest memory alignment used for `O_DIRECT` buffers.
const MIN_MEM_ALIGN: usize = 4096;
/// What to add to a ring setup's error: where io_uring is switched off
/// (`EPERM`, `ENOSYS`), where to look; nothing otherwise.
fn disabled_hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::ENOSYS) => {
            " (io_uring is disabled here: see kernel.io_uring_disabled or seccomp)"
        }
        _ => "",
    }
}

impl UringFile {
    /// Open `path` as a backend.
    ///
    /// **Context:** blocks (open, extending the file with `ftruncate`, a
    /// probe read, ring setup and buffer registration).
    /// **Returns:** an error naming `path`: `InvalidInput` for bad options,
    /// a size that is zero or not a multiple of 512, or a path that is
    /// neither a regular file nor a block device; `Unsupported` when
    /// [`DirectIo::Require`] cannot be met; the system's error otherwise.
    pub fn open(path: impl AsRef<Path>, opts: UringOptions) -> io::Result<UringFile> {
        let path = path.as_ref().to_path_buf();
        check_options(&path, &opts)?;
        let mut fallbacks = Vec::new();
        let (file, direct) = open_file(&path, &opts, &mut fallbacks)?;
        let (size, is_block) = device_size(&path, &file, &opts)?;
        let (direct, mem_align, io_align) = direct_alignment(
            &path,
            &file,
            &opts,
            (direct, is_block, size),
            &mut fallbacks,
        )?;
        let rings = make_rings(&path, &opts)?;
        let (arena, fixed) = arena_buffers(&opts, &rings, &mut fallbacks);
        let map = if !direct && opts.map_reads && size > 0 {
            FileMap::new(&file, size, is_block)
        } else {
            None
        };

        Ok(UringFile {
            map,
            rings: rings.into_iter().map(Mutex::new).collect(),
            next_ring: AtomicUsize::new(0),
            arena,
            file,
            path,
            size,
            is_block,
            read_only: opts.read_only,
            direct,
            fixed,
            mem_align,
            io_align,
            fallbacks,
            rmw_locks: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
            short_io: AtomicUsize::new(0),
            faults: Default::default(),
            counters: Counters::default(),
        })
    }
}

/// An error about `path`.
fn named(path: &Path, kind: io::ErrorKind, msg: String) -> io::Error {
    io::Error::new(kind, format!("{}: {msg}", path.display()))
}

/// An `InvalidInput` error about `path`.
fn invalid(path: &Path, msg: String) -> io::Error {
    named(path, io::ErrorKind::InvalidInput, msg)
}

/// Refuse options that cannot work, before anything is opened.
fn check_options(path: &Path, opts: &UringOptions) -> io::Result<()> {
    if opts.rings == 0 {
        return Err(invalid(path, "rings must be at least 1".into()));
    }
    if opts.ring_entries == 0 {
        return Err(invalid(path, "ring_entries must be at least 1".into()));
    }
    if let Some(want) = opts.create_size {
        if opts.read_only {
            return Err(invalid(
                path,
                "create_size cannot be used with read_only (nothing may be created)".into(),
            ));
        }
        check_size(want).map_err(|m| invalid(path, m))?;
    }
    Ok(())
}

/// Open `path`, with `O_DIRECT` unless told otherwise. A file system that
/// refuses `O_DIRECT` at open (`EINVAL`) gets a buffered descriptor, the
/// fallback recorded (or the open fails under [`DirectIo::Require`]).
/// **Returns:** the file and whether it was opened with `O_DIRECT`.
fn open_file(
    path: &Path,
    opts: &UringOptions,
    fallbacks: &mut Vec<String>,
) -> io::Result<(File, bool)> {
    let open_with = |direct: bool| -> io::Result<File> {
        if direct && opts.refuse_direct_for_tests {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut o = OpenOptions::new();
        o.read(true).write(!opts.read_only);
        if opts.create_size.is_some() {
            o.create(true);
        }
        o.custom_flags(if direct { libc::O_DIRECT } else { 0 });
        o.open(path)
    };
    let direct = opts.direct != DirectIo::Off;
    match open_with(direct) {
        Ok(f) => Ok((f, direct)),
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
            let reason = format!("the file system refused O_DIRECT at open ({e})");
            refuse_direct(path, opts.direct, &reason, fallbacks)?;
            let f = open_with(false).map_err(|e| named(path, e.kind(), format!("open: {e}")))?;
            Ok((f, false))
        }
        Err(e) => Err(named(path, e.kind(), format!("open: {e}"))),
    }
}

/// The device's size: a regular file's (extended to `create_size` when
/// shorter) or a block device's (or its first `create_size` bytes),
/// checked to be a non-zero multiple of 512.
/// **Returns:** the size and whether the file is a block device.
fn device_size(path: &Path, file: &File, opts: &UringOptions) -> io::Result<(u64, bool)> {
    let meta = file
        .metadata()
        .map_err(|e| named(path, e.kind(), format!("fstat: {e}")))?;
    let ft = meta.file_type();
    let is_block = ft.is_block_device();
    let size = if ft.is_file() {
        match opts.create_size {
            Some(want) => {
                if meta.len() < want {
                    file.set_len(want).map_err(|e| {
                        named(
                            path,
                            e.kind(),
                            format!("extending the file to {want} bytes: {e}"),
                        )
                    })?;
                }
                want
            }
            None => meta.len(),
        }
    } else if is_block {
        let dev = block_device_size(file)
            .map_err(|e| named(path, e.kind(), format!("BLKGETSIZE64: {e}")))?;
        match opts.create_size {
            Some(want) if want > dev => {
                return Err(invalid(
                    path,
                    format!("a block device of {dev} bytes cannot be extended to {want} bytes"),
                ))
            }
            Some(want) => want,
            None => dev,
        }
    } else {
        return Err(invalid(
            path,
            "neither a regular file nor a block device".into(),
        ));
    };
    check_size(size).map_err(|m| invalid(path, m))?;
    Ok((size, is_block))
}

/// Direct I/O's alignment, then a probe read, on a file opened with
/// `O_DIRECT` (`(direct, is_block, size)`); where they fail, `O_DIRECT` is
/// cleared and the fallback recorded (or the open fails under
/// [`DirectIo::Require`]).
/// **Returns:** whether I/O is direct, the memory alignment and the file
/// offset and length alignment.
fn direct_alignment(
    path: &Path,
    file: &File,
    opts: &UringOptions,
    (direct, is_block, size): (bool, bool, u64),
    fallbacks: &mut Vec<String>,
) -> io::Result<(bool, usize, usize)> {
    let buffered = (false, MIN_MEM_ALIGN, SECTOR as usize);
    if !direct {
        return Ok(buffered);
    }
    match check_direct(file, is_block, size) {
        Ok((mem, io)) => Ok((true, mem, io)),
        Err(reason) => {
            refuse_direct(path, opts.direct, &reason, fallbacks)?;
            set_direct_flag(file, false)
                .map_err(|e| named(path, e.kind(), format!("clearing O_DIRECT with fcntl: {e}")))?;
            Ok(buffered)
        }
    }
}

/// Whether io_uring can be used here: sets up one ring of one entry and
/// closes it (what `iopages --version` reports).
///
/// **Context:** one `io_uring_setup` and one `close`; no file is opened.
///
/// **Returns:** `Ok(())`, or the kernel's refusal, with a hint where
/// io_uring is switched off (`EPERM`, `ENOSYS`).
pub fn probe() -> io::Result<()> {
    IoUring::new(1)
        .map(drop)
        .map_err(|e| io::Error::new(e.kind(), format!("{e}{}", disabled_hint(&e))))
}

/// `opts.rings` rings of `opts.ring_entries` entries each.
fn make_rings(path: &Path, opts: &UringOptions) -> io::Result<Vec<IoUring>> {
    let mut rings = Vec::with_capacity(opts.rings);
    for _ in 0..opts.rings {
        let ring = IoUring::builder()
            .setup_clamp()
            .build(opts.ring_entries)
            .map_err(|e| {
                let (n, hint) = (opts.ring_entries, disabled_hint(&e));
                named(
                    path,
                    e.kind(),
                    format!("io_uring setup ({n} entries): {e}{hint}"),
                )
            })?;
        // Best effort: kernels before 5.15 have no such limit (EINVAL).
        let _ = ring
            .submitter()
            .register_iowq_max_workers(&mut IO_WORKERS.clone());
        rings.push(ring);
    }
    Ok(rings)
}

/// The most io_uring worker threads (io-wq) each thread submitting to a
/// ring may have: bounded (file and block I/O that the kernel cannot
/// issue without waiting) and unbounded (sockets, which these rings never
/// carry). Without it the kernel allows up to 4 per CPU per submitting
/// thread, so a server with a crypt worker per CPU could grow to
/// hundreds of threads under buffered or non-`NOWAIT` I/O.
pub const IO_WORKERS: [u32; 2] = [4, 1];

/// The arena of `opts`, registered as fixed buffers on every ring where
/// the kernel allows it (a refusal is recorded in `fallbacks`).
/// **Returns:** the arena and whether its fixed buffers are in use.
fn arena_buffers(
    opts: &UringOptions,
    rings: &[IoUring],
    fallbacks: &mut Vec<String>,
) -> (Option<ArenaMap>, bool) {
    let mut fixed = false;
    let arena = opts.arena.as_ref().map(|alloc| ArenaMap {
        alloc: alloc.clone(),
        base: alloc.arena().base() as usize,
        len: alloc.arena().size_bytes(),
    });
    if let Some(a) = &arena {
        match register_arena(rings, a) {
            Ok(()) => fixed = true,
            Err(reason) => fallbacks.push(reason),
        }
    }
    (arena, fixed)
}

/// A device size is a non-zero multiple of 512.
fn check_size(size: u64) -> Result<(), String> {
    if size == 0 || !size.is_multiple_of(SECTOR) {
        Err(format!(
            "size {size} bytes is not a non-zero multiple of {SECTOR} bytes"
        ))
    } else {
        Ok(())
    }
}

/// `O_DIRECT` is unavailable for `reason`: record the fallback (`Auto`) or
/// fail (`Require`).
fn refuse_direct(
    path: &Path,
    mode: DirectIo,
    reason: &str,
    fallbacks: &mut Vec<String>,
) -> io::Result<()> {
    if mode == DirectIo::Require {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{}: O_DIRECT required but unavailable: {reason}",
                path.display()
            ),
        ));
    }
    fallbacks.push(format!("buffered I/O instead of O_DIRECT: {reason}"));
    Ok(())
}

/// Set or clear `O_DIRECT` on an open descriptor.
fn set_direct_flag(file: &File, on: bool) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL on a descriptor we own reads its flags; no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if on {
        flags | libc::O_DIRECT
    } else {
        flags & !libc::O_DIRECT
    };
    // SAFETY: F_SETFL with an int argument on a descriptor we own.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The alignments direct I/O needs on `file` (memory, file offset and
/// length), checked by probe reads; `Err` gives why it cannot be used.
fn check_direct(file: &File, is_block: bool, size: u64) -> Result<(usize, usize), String> {
    let fd = file.as_raw_fd();
    let mut mem_align = MIN_MEM_ALIGN;
    let mut io_align = SECTOR as usize;
    // SAFETY: statx writes one `struct statx` into `stx`, which is zeroed
    // plain data; the empty path with AT_EMPTY_PATH names `fd` itself.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 {
        if stx.stx_dio_offset_align == 0 {
            return Err("statx reports no direct I/O support for this file".into());
        }
        mem_align = mem_align.max(stx.stx_dio_mem_align as usize);
        io_align = io_align.max(stx.stx_dio_offset_align as usize);
    } else if is_block {
        let mut lbs: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int to the pointer given.
        if unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut lbs) } == 0 && lbs > 0 {
            io_align = io_align.max(lbs as usize);
        }
    }
    if !mem_align.is_power_of_two() || !io_align.is_power_of_two() {
        return Err(format!(
            "unusable direct I/O alignment (memory {mem_align}, offset {io_align})"
        ));
    }
    let probe = |len: usize, off: u64, align: usize| -> io::Result<()> {
        let buf = HeapBuf::new(len, align)?;
        // SAFETY: `buf` holds `len` writable bytes until it drops, after
        // the call has returned.
        let n = unsafe { libc::pread(fd, buf.ptr.cast(), len, off as libc::off_t) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    let len = io_align.max(4096);
    if let Err(e) = probe(len, 0, mem_align) {
        return Err(format!(
            "a probe read of {len} aligned bytes at offset 0 failed ({e})"
        ));
    }
    // The offset alignment: one block at the second block. A refusal means
    // the device wants larger blocks than reported; use 4096.
    if io_align < 4096 && size >= 2 * io_align as u64 {
        if let Err(e) = probe(io_align, io_align as u64, mem_align) {
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(format!("a probe read at offset {io_align} failed ({e})"));
            }
            io_align = 4096;
        }
    }
    if !size.is_multiple_of(io_align as u64) {
        return Err(format!(
            "the size ({size} bytes) is not a multiple of the direct I/O block ({io_align} bytes)"
        ));
    }
    Ok((mem_align, io_align))
}

/// The size of a block device in bytes (`BLKGETSIZE64`; the LUKS
/// header code asks the same way).
pub(crate) fn block_device_size(file: &File) -> io::Result<u64> {
    // _IOR(0x12, 114, size_t)
    #[cfg(any(
        target_arch = "powerpc",
        target_arch = "powerpc64",
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64"
    ))]
    const BLKGETSIZE64: u64 = 0x4008_1272;
    #[cfg(not(any(
        target_arch = "powerpc",
        target_arch = "powerpc64",
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc",
        target_arch = "sparc64"
    )))]
    const BLKGETSIZE64: u64 = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 to the pointer given.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Register the arena's mapping, in chunks of at most 1 GiB, on every ring;
/// on a refusal, undo what was registered and say why.
fn register_arena(rings: &[IoUring], a: &ArenaMap) -> Result<(), String> {
    let iovecs: Vec<libc::iovec> = (0..a.len)
        .step_by(FIXED_BUFFER_MAX_BYTES)
        .map(|off| libc::iovec {
            iov_base: (a.base + off) as *mut libc::c_void,
            iov_len: (a.len - off).min(FIXED_BUFFER_MAX_BYTES),
        })
        .collect();
    for (i, ring) in rings.iter().enumerate() {
        // SAFETY: the iovecs cover the arena's mapping, which the
        // `ArenaMap`'s allocator keeps alive for as long as the
        // `UringFile` holds the rings (the rings drop first).
        if let Err(e) = unsafe { ring.submitter().register_buffers(&iovecs) } {
            for r in &rings[..i] {
                let _ = r.submitter().unregister_buffers();
            }
            let mut why = format!(
                "plain buffers instead of fixed: registering the arena ({} bytes in {} \
                 buffers) on ring {i} failed: {e}",
                a.len,
                iovecs.len()
            );
            if e.raw_os_error() == Some(libc::ENOMEM) {
                let mut rl = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                // SAFETY: getrlimit writes one `rlimit` to the pointer.
                if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } == 0 {
                    why.push_str(&format!(
                        " (RLIMIT_MEMLOCK is {} bytes and each ring pins the whole arena; \
                         raise `ulimit -l` or grant CAP_IPC_LOCK)",
                        rl.rlim_cur
                    ));
                }
            }
            return Err(why);
        }
    }
    Ok(())
}
