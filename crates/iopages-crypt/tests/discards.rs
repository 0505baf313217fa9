//! Sparse volumes: hole punches and discards in every backend (RAM disk,
//! page store, window, a file and a sealed memfd through io_uring), their
//! extents, and the crypt target with `allow_discards` over them with the
//! real AES-XTS cipher — whole sectors inside a discarded range read as
//! zeros, partial ones and everything else read back intact, holes are
//! rounded inward to sectors, runs of data sectors are decrypted in one
//! call, and random write / discard / punch sequences read back as a
//! model says. Without `allow_discards` nothing changes. A loop device
//! (as root) stands for a block device.

mod common;

use common::{arena, target_tmp, TempFile};
use iopages::PageAllocator;
use iopages_crypt::backend::{Backend, Extent, PageStore, RamDisk, Window};
use iopages_crypt::target::{CipherPool, CryptTarget, SectorCipher, TargetConfig};
use iopages_crypt::uring::{DirectIo, UringFile, UringOptions};
use iopages_crypt::XtsCipher;
use proptest::prelude::*;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

// ---------------------------------------------------------------- helpers

/// The directories to put test files in: the target directory's file
/// system, and tmpfs where there is one.
fn dirs() -> Vec<PathBuf> {
    let mut v = vec![target_tmp()];
    if Path::new("/dev/shm").is_dir() {
        v.push(PathBuf::from("/dev/shm"));
    }
    v
}

fn open_file(path: &Path, size: u64, direct: DirectIo) -> UringFile {
    let opts = UringOptions {
        create_size: Some(size),
        rings: 2,
        direct,
        ..UringOptions::default()
    };
    UringFile::open(path, opts).unwrap()
}

/// A memfd of `size` bytes sealed against shrinking and growing (as the
/// served in-memory volume is), and a backend over it opened through
/// `/proc/self/fd`. The memfd is kept open as long as the backend.
fn sealed_memfd(size: u64, direct: DirectIo) -> (File, UringFile) {
    let name = c"iopages-discard-test";
    // SAFETY: `name` is NUL-terminated; the flags are valid.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nothing else.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(size).unwrap();
    // SAFETY: F_ADD_SEALS on our own memfd, with valid seal flags.
    let rc = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
        )
    };
    assert_eq!(rc, 0, "sealing: {}", io::Error::last_os_error());
    let opts = UringOptions {
        rings: 1,
        direct,
        ..UringOptions::default()
    };
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let u = UringFile::open(&path, opts).unwrap();
    (file, u)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i.wrapping_mul(2654435761) >> 7) ^ seed ^ (i >> 9)) as u8 | 1)
        .collect()
}

fn read(b: &dyn Backend, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    b.read_at(offset, &mut [&mut v]).unwrap();
    v
}

fn ext(len_bytes: u64, hole: bool) -> Extent {
    Extent { len_bytes, hole }
}

/// Adjacent extents differ in kind and none is empty.
fn well_formed(v: &[Extent]) {
    assert!(v.iter().all(|e| e.len_bytes > 0), "{v:?}");
    assert!(v.windows(2).all(|w| w[0].hole != w[1].hole), "{v:?}");
}

// ---------------------------------------------------------------- backends

/// The punch contract every backend that can punch keeps: the punched
/// range reads zeros, the bytes around it are untouched, a range leaving
/// the device is refused with nothing touched.
fn punch_contract(b: &dyn Backend, what: &str) {
    let size = b.size_bytes();
    assert!(b.can_punch(), "{what}");
    let data = pattern(size as usize, 3);
    b.write_at(0, &[&data]).unwrap();
    // Misaligned on both ends, over several 4 KiB blocks.
    let (off, len) = (4096 + 700, 3 * 4096 + 1000);
    b.punch(off, len).unwrap();
    let mut want = data.clone();
    want[off as usize..(off + len) as usize].fill(0);
    assert!(read(b, 0, size as usize) == want, "{what}: punch");
    // Discard: on these backends, a punch.
    b.discard(8 * 4096, 4096).unwrap();
    want[8 * 4096..9 * 4096].fill(0);
    assert!(read(b, 0, size as usize) == want, "{what}: discard");
    // Empty ranges do nothing.
    b.punch(100, 0).unwrap();
    assert!(read(b, 0, size as usize) == want, "{what}: empty punch");
    // Out of range: refused, nothing touched.
    for (o, l) in [(size - 4096, 8192), (size + 1, 0), (u64::MAX, 2)] {
        let e = b.punch(o, l).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{what}: {e}");
        let e = b.discard(o, l).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{what}: {e}");
        let e = b.extents(o, l, 4).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{what}: {e}");
    }
    assert!(read(b, 0, size as usize) == want, "{what}: refused punch");
    assert!(b.extents(4096, 0, 4).unwrap().is_empty(), "{what}: len 0");
}

#[test]
fn ram_disks_page_stores_and_windows_punch_to_zeros_and_touch_nothing_else() {
    let alloc = arena(16);
    punch_contract(&RamDisk::new(64 << 10).unwrap(), "ram");
    punch_contract(&PageStore::new(&alloc, 64 << 10).unwrap(), "page store");
    let below: Arc<dyn Backend> = Arc::new(RamDisk::new(256 << 10).unwrap());
    let outside = pattern(256 << 10, 9);
    below.write_at(0, &[&outside]).unwrap();
    let w = Window::new(Arc::clone(&below), 64 << 10, 64 << 10).unwrap();
    punch_contract(&w, "window");
    // Nothing outside the window was touched.
    let all = read(&*below, 0, 256 << 10);
    assert!(all[..64 << 10] == outside[..64 << 10]);
    assert!(all[128 << 10..] == outside[128 << 10..]);
    // A RAM disk reports everything allocated.
    let r = RamDisk::new(64 << 10).unwrap();
    assert_eq!(r.extents(512, 10_000, 4).unwrap(), vec![ext(10_000, false)]);
    alloc.leak_check().unwrap();
}

#[test]
fn a_page_store_reports_its_empty_blocks_as_holes_clipped_to_the_range() {
    let alloc = arena(16);
    let s = PageStore::new(&alloc, 256 << 10).unwrap();
    assert_eq!(
        s.extents(100, (256 << 10) - 100, 8).unwrap(),
        vec![ext((256 << 10) - 100, true)]
    );
    // Blocks 3, 4, and 20 (across the 64 KiB stripe edge at 16) written.
    s.write_at(3 * 4096 + 10, &[&[1u8; 5000]]).unwrap();
    s.write_at(20 * 4096, &[&[2u8; 4096]]).unwrap();
    let v = s.extents(1000, 30 * 4096, 16).unwrap();
    well_formed(&v);
    assert_eq!(
        v,
        vec![
            ext(3 * 4096 - 1000, true),
            ext(2 * 4096, false),
            ext(15 * 4096, true),
            ext(4096, false),
            ext(30 * 4096 + 1000 - 21 * 4096, true),
        ]
    );
    // The bound: the first two only, covering less than asked.
    assert_eq!(
        s.extents(1000, 30 * 4096, 2).unwrap(),
        vec![ext(3 * 4096 - 1000, true), ext(2 * 4096, false)]
    );
    // Inside one written block.
    assert_eq!(s.extents(3 * 4096 + 5, 7, 1).unwrap(), vec![ext(7, false)]);
    // A window over it shifts the offsets.
    let arc: Arc<dyn Backend> = Arc::new(s);
    let w = Window::new(Arc::clone(&arc), 4096, 8 * 4096).unwrap();
    assert_eq!(
        w.extents(0, 8 * 4096, 8).unwrap(),
        vec![
            ext(2 * 4096, true),
            ext(2 * 4096, false),
            ext(4 * 4096, true)
        ]
    );
    drop((w, arc));
    alloc.leak_check().unwrap();
}

#[test]
fn a_page_store_punch_frees_whole_blocks_and_zeroes_partial_ones() {
    let alloc = arena(16);
    let s = PageStore::new(&alloc, 64 << 10).unwrap();
    s.write_at(0, &[&[7u8; 4 * 4096]]).unwrap();
    assert_eq!(s.stored_pages(), 4);
    let used = alloc.stats().in_use_pages;
    // Blocks 1 and 2 whole, block 0's last 100 bytes, block 3's first 100.
    s.punch(4096 - 100, 2 * 4096 + 200).unwrap();
    assert_eq!(s.stored_pages(), 2, "the whole blocks left their slots");
    assert_eq!(
        alloc.stats().in_use_pages,
        used - 2,
        "and their pages went back"
    );
    assert_eq!(
        s.extents(0, 4 * 4096, 8).unwrap(),
        vec![ext(4096, false), ext(2 * 4096, true), ext(4096, false)]
    );
    let mut back = vec![1u8; 4 * 4096];
    s.read_at(0, &mut [&mut back]).unwrap();
    assert!(back[..4096 - 100].iter().all(|&b| b == 7));
    assert!(back[4096 - 100..3 * 4096 + 100].iter().all(|&b| b == 0));
    assert!(back[3 * 4096 + 100..].iter().all(|&b| b == 7));
    drop(s);
    alloc.leak_check().unwrap();
}

/// The file system's allocation unit for the file at `path`.
fn block_size(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blksize().max(512)
}

#[test]
fn a_file_punches_holes_refuses_out_of_range_and_read_only_and_reports_its_extents() {
    for dir in dirs() {
        for direct in [DirectIo::Auto, DirectIo::Off] {
            let tmp = TempFile::new(&dir, "file");
            let f = open_file(&tmp.0, FILE_SIZE, direct);
            let what = format!("{} {direct:?}", dir.display());
            a_sparse_file_reports_its_extents(&f, &what);
            punch_contract(&f, &what);
            punched_blocks_show_as_holes(&f, &tmp.0, &what);
            drop(f);
            a_read_only_file_refuses_punches(&tmp.0, direct);
        }
    }
}

/// The file size of [`a_file_punches_holes_refuses_out_of_range_and_read_only_and_reports_its_extents`].
const FILE_SIZE: u64 = 1 << 20;

/// A fresh sparse file is one hole; after writes at 64, 192 and 512 KiB
/// its extents show them, clipped to the range asked and bounded by
/// `max_extents`.
fn a_sparse_file_reports_its_extents(f: &UringFile, what: &str) {
    const SIZE: u64 = FILE_SIZE;
    // A fresh sparse file: one hole, whatever the bound.
    assert_eq!(
        f.extents(0, SIZE, 1).unwrap(),
        vec![ext(SIZE, true)],
        "{what}"
    );
    assert_eq!(f.extents(777, 1000, 5).unwrap(), vec![ext(1000, true)]);
    assert!(f.extents(0, 0, 5).unwrap().is_empty());
    // Data at 64 KiB, 192 KiB and 512 KiB (64 KiB each, whole
    // blocks of any file system).
    for k in [1u64, 3, 8] {
        f.write_at(k << 16, &[&pattern(64 << 10, k)]).unwrap();
    }
    let v = f.extents(0, SIZE, 16).unwrap();
    well_formed(&v);
    let d = 64 << 10;
    assert_eq!(
        v,
        vec![
            ext(d, true),
            ext(d, false),
            ext(d, true),
            ext(d, false),
            ext(4 * d, true),
            ext(d, false),
            ext(SIZE - 9 * d, true),
        ],
        "{what}"
    );
    // Clipped to the range, bounded by max_extents.
    assert_eq!(
        f.extents(d + 100, d, 16).unwrap(),
        vec![ext(d - 100, false), ext(100, true)],
        "{what}"
    );
    assert_eq!(
        f.extents(1000, SIZE - 1000, 3).unwrap(),
        vec![ext(d - 1000, true), ext(d, false), ext(d, true)],
        "{what}"
    );
}

/// After [`punch_contract`]'s punches, and after punching whole blocks
/// out of the file written all over again, the extents show the holes;
/// the file keeps its size.
fn punched_blocks_show_as_holes(f: &UringFile, path: &Path, what: &str) {
    const SIZE: u64 = FILE_SIZE;
    // The contract's punches left holes of the whole blocks they
    // covered: 8 KiB at 8 KiB, 4 KiB at 32 KiB.
    let bs = block_size(path).max(4096);
    if bs == 4096 {
        assert_eq!(
            f.extents(0, 40 << 10, 16).unwrap(),
            vec![
                ext(8192, false),
                ext(8192, true),
                ext(16384, false),
                ext(4096, true),
                ext(4096, false)
            ],
            "{what}"
        );
    }
    // Punch whole blocks out of the file written all over again:
    // the extents show the one hole.
    f.write_at(0, &[&pattern(SIZE as usize, 11)]).unwrap();
    f.punch(4 * bs, 2 * bs).unwrap();
    let v = f.extents(0, SIZE, 16).unwrap();
    assert_eq!(
        v,
        vec![
            ext(4 * bs, false),
            ext(2 * bs, true),
            ext(SIZE - 6 * bs, false)
        ],
        "{what}"
    );
    assert_eq!(std::fs::metadata(path).unwrap().len(), SIZE, "KEEP_SIZE");
}

/// The file opened read-only: punches and discards are refused, nothing
/// touched.
fn a_read_only_file_refuses_punches(path: &Path, direct: DirectIo) {
    // Read-only: refused, nothing touched.
    let before = std::fs::read(path).unwrap();
    let ro = UringFile::open(
        path,
        UringOptions {
            read_only: true,
            rings: 1,
            direct,
            ..UringOptions::default()
        },
    )
    .unwrap();
    assert!(!ro.can_punch());
    let e = ro.punch(0, 4096).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains(&*path.to_string_lossy()), "{e}");
    let e = ro.discard(0, 4096).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
    assert!(std::fs::read(path).unwrap() == before);
}

#[test]
fn a_sealed_memfd_still_punches_and_its_mapping_reads_the_zeros() {
    const SIZE: u64 = 512 << 10;
    for direct in [DirectIo::Auto, DirectIo::Off] {
        let (_memfd, f) = sealed_memfd(SIZE, direct);
        assert!(f.can_punch());
        assert_eq!(f.extents(0, SIZE, 4).unwrap(), vec![ext(SIZE, true)]);
        let data = pattern(SIZE as usize, 5);
        f.write_at(0, &[&data]).unwrap();
        assert_eq!(f.extents(0, SIZE, 4).unwrap(), vec![ext(SIZE, false)]);
        f.punch(128 << 10, 64 << 10).unwrap();
        assert_eq!(
            f.extents(0, SIZE, 4).unwrap(),
            vec![
                ext(128 << 10, false),
                ext(64 << 10, true),
                ext(SIZE - (192 << 10), false)
            ]
        );
        let mut want = data.clone();
        want[128 << 10..192 << 10].fill(0);
        assert!(read(&f, 0, SIZE as usize) == want, "{direct:?}");
        if let Some(m) = f.mapped(0, SIZE as usize) {
            assert!(m == &want[..], "the mapping sees the hole");
        } else {
            assert!(f.direct_io(), "buffered I/O maps the memfd");
        }
        punch_contract(&f, &format!("memfd {direct:?}"));
    }
}

/// A loop device over a sparse file, detached when dropped.
struct LoopDevice {
    dev: PathBuf,
    _file: TempFile,
}

impl LoopDevice {
    /// `None` (after a `skipped` line) where loop devices cannot be set up
    /// here: not root, no `losetup`, or the kernel refused.
    fn new(size: u64, who: &str) -> Option<LoopDevice> {
        // SAFETY: geteuid reads the caller's effective user id; no memory.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped {who}: loop devices need root");
            return None;
        }
        let losetup = iopages_testkit::need_tool("losetup", who)?;
        let file = TempFile::new(&target_tmp(), "loop");
        std::fs::File::create(&file.0)
            .unwrap()
            .set_len(size)
            .unwrap();
        let out = std::process::Command::new(losetup)
            .args(["--find", "--show"])
            .arg(&file.0)
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!(
                "skipped {who}: losetup failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Some(LoopDevice { dev, _file: file })
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if let Some(losetup) = iopages_testkit::find_tool("losetup") {
            let _ = std::process::Command::new(losetup)
                .arg("-d")
                .arg(&self.dev)
                .status();
        }
    }
}

#[test]
fn a_block_device_punches_discards_and_reports_everything_allocated() {
    const SIZE: u64 = 1 << 20;
    let Some(lo) = LoopDevice::new(SIZE, "the block device test") else {
        return;
    };
    let f = UringFile::open(
        &lo.dev,
        UringOptions {
            rings: 1,
            ..UringOptions::default()
        },
    )
    .unwrap();
    assert_eq!(f.size_bytes(), SIZE);
    assert!(f.can_punch());
    assert_eq!(f.extents(0, SIZE, 4).unwrap(), vec![ext(SIZE, false)]);
    // A loop device zeroes a punched range (it punches its file).
    let data = pattern(SIZE as usize, 8);
    f.write_at(0, &[&data]).unwrap();
    f.punch(8192, 3 * 4096).unwrap();
    let mut want = data.clone();
    want[8192..8192 + 3 * 4096].fill(0);
    assert!(read(&f, 0, SIZE as usize) == want);
    // A discard: punched, or BLKDISCARD where the punch is refused; the
    // range reads as zeros or as it was, the rest is untouched.
    f.discard(64 << 10, 64 << 10).unwrap();
    let back = read(&f, 0, SIZE as usize);
    assert!(back[..64 << 10] == want[..64 << 10] && back[128 << 10..] == want[128 << 10..]);
    let d = &back[64 << 10..128 << 10];
    assert!(d.iter().all(|&b| b == 0) || d == &want[64 << 10..128 << 10]);
    let e = f.punch(SIZE - 4096, 8192).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    drop(f);
    let ro = UringFile::open(
        &lo.dev,
        UringOptions {
            rings: 1,
            read_only: true,
            ..UringOptions::default()
        },
    )
    .unwrap();
    assert!(!ro.can_punch());
    let e = ro.discard(0, 4096).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
}

// ---------------------------------------------------------------- target

const KEY: [u8; 64] = {
    let mut k = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        k[i] = (i as u8).wrapping_mul(29) ^ 0x3c;
        i += 1;
    }
    k
};

/// The real cipher, counting decrypt calls (one per run of data sectors).
struct Counting {
    pool: CipherPool,
    decrypts: Arc<AtomicUsize>,
}

impl SectorCipher for Counting {
    fn sector_size(&self) -> usize {
        self.pool.sector_size()
    }
    fn encrypt_sectors(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.pool.encrypt_sectors(sector, src, dst)
    }
    fn decrypt_sectors(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
        self.decrypts.fetch_add(1, Ordering::Relaxed);
        self.pool.decrypt_sectors(sector, buf)
    }
    fn decrypt_sectors_from(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.decrypts.fetch_add(1, Ordering::Relaxed);
        self.pool.decrypt_sectors_from(sector, src, dst)
    }
    fn encrypt_sectors_streaming(&self, sector: u64, src: &[u8], dst: &mut [u8]) -> io::Result<()> {
        self.pool.encrypt_sectors_streaming(sector, src, dst)
    }
}

fn target(
    alloc: &PageAllocator,
    backend: Arc<dyn Backend>,
    ss: usize,
    allow_discards: bool,
) -> (CryptTarget<Counting>, Arc<AtomicUsize>) {
    let decrypts = Arc::new(AtomicUsize::new(0));
    let cipher = Counting {
        pool: CipherPool::new(XtsCipher::new(&KEY, ss, 0).unwrap(), 2).unwrap(),
        decrypts: Arc::clone(&decrypts),
    };
    let cfg = TargetConfig {
        min_nr: 16,
        allow_discards,
        ..TargetConfig::default()
    };
    (
        CryptTarget::new(alloc, cipher, backend, cfg).unwrap(),
        decrypts,
    )
}

const DEV: u64 = 512 << 10;

/// The backends a target is checked over: a page store, a file (direct
/// where possible, and buffered with its mapping), a sealed memfd, and a
/// window of a file (as a LUKS payload).
fn target_backends(alloc: &PageAllocator) -> Vec<(String, Arc<dyn Backend>, Option<TempFile>)> {
    let mut v: Vec<(String, Arc<dyn Backend>, Option<TempFile>)> = vec![(
        "page store".into(),
        Arc::new(PageStore::new(alloc, DEV).unwrap()),
        None,
    )];
    for direct in [DirectIo::Auto, DirectIo::Off] {
        let t = TempFile::new(&target_tmp(), "target");
        let f = open_file(&t.0, DEV, direct);
        v.push((format!("file {direct:?}"), Arc::new(f), Some(t)));
    }
    let (memfd, f) = sealed_memfd(DEV, DirectIo::Off);
    drop(memfd);
    v.push(("memfd".into(), Arc::new(f), None));
    let t = TempFile::new(&target_tmp(), "window");
    let f: Arc<dyn Backend> = Arc::new(open_file(&t.0, DEV + (16 << 10), DirectIo::Auto));
    v.push((
        "window".into(),
        Arc::new(Window::new(f, 16 << 10, DEV).unwrap()),
        Some(t),
    ));
    v
}

#[test]
fn discarded_whole_sectors_read_as_zeros_and_partial_ones_keep_their_data() {
    let alloc = arena(32);
    for ss in [512usize, 4096] {
        for (what, backend, _tmp) in target_backends(&alloc) {
            let what = format!("{what} / {ss}");
            let (t, _) = target(&alloc, Arc::clone(&backend), ss, true);
            assert!(t.discards_allowed() && t.can_punch_zeroes(), "{what}");
            let data = pattern(DEV as usize, ss as u64);
            t.write(0, &data).unwrap();
            let mut model = data.clone();
            // Misaligned head and tail: only the whole sectors inside.
            let s = ss as u64;
            let (off, len) = (3 * s + 100, 10 * s);
            assert_eq!(t.discard(off, len).unwrap(), 9 * s, "{what}");
            model[4 * ss..13 * ss].fill(0);
            // A range inside one sector discards nothing.
            assert_eq!(t.discard(20 * s + 1, s - 2).unwrap(), 0, "{what}");
            assert_eq!(t.discard(21 * s, 0).unwrap(), 0, "{what}");
            // Past the end: refused.
            let e = t.discard(DEV - s, 2 * s).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{what}: {e}");
            // A zeroing punch of whole sectors.
            t.punch_zeroes(40 * s, 3 * s).unwrap();
            model[40 * ss..43 * ss].fill(0);
            for (o, l) in [(40 * s + 512, s), (40 * s, s + 512), (DEV - s, 2 * s)] {
                if ss == 512 && o % 512 == 0 && l % 512 == 0 && o + l <= DEV {
                    continue;
                }
                let e = t.punch_zeroes(o, l).unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{what}: {o}+{l} {e}");
            }
            // The whole device in one read (mapped where the backend maps),
            // and sector by sector around the edges.
            let mut back = vec![0u8; DEV as usize];
            t.read(0, &mut back).unwrap();
            assert!(back == model, "{what}: whole read");
            for k in [2usize, 3, 4, 12, 13, 14, 39, 40, 42, 43] {
                let mut one = vec![1u8; ss];
                t.read((k * ss) as u64, &mut one).unwrap();
                assert!(one == model[k * ss..(k + 1) * ss], "{what}: sector {k}");
            }
            let st = t.stats();
            assert_eq!((st.discards, st.discard_bytes), (1, 9 * s), "{what}");
            assert_eq!((st.zero_punches, st.zero_punch_bytes), (1, 3 * s), "{what}");
            // Rewriting a discarded sector brings data back.
            t.write(5 * s, &data[5 * ss..6 * ss]).unwrap();
            model[5 * ss..6 * ss].copy_from_slice(&data[5 * ss..6 * ss]);
            t.read(0, &mut back).unwrap();
            assert!(back == model, "{what}: rewrite");
            drop(t);
        }
    }
    alloc.leak_check().unwrap();
}

#[test]
fn each_run_of_data_sectors_is_decrypted_in_one_call() {
    let alloc = arena(32);
    for (what, backend, _tmp) in target_backends(&alloc) {
        let ss = 4096;
        let (t, calls) = target(&alloc, backend, ss, true);
        let n = 32;
        let data = pattern(n * ss, 1);
        t.write(0, &data).unwrap();
        // Holes at sectors 2..4, 6, 20..32: data runs 0..2, 4..6, 7..20.
        t.discard(2 * 4096, 2 * 4096).unwrap();
        t.punch_zeroes(6 * 4096, 4096).unwrap();
        t.discard(20 * 4096, 12 * 4096).unwrap();
        let before = calls.load(Ordering::Relaxed);
        let mut back = vec![9u8; n * ss];
        t.read(0, &mut back).unwrap();
        assert_eq!(calls.load(Ordering::Relaxed) - before, 3, "{what}");
        let mut model = data.clone();
        model[2 * ss..4 * ss].fill(0);
        model[6 * ss..7 * ss].fill(0);
        model[20 * ss..].fill(0);
        assert!(back == model, "{what}");
        // A read of holes only decrypts nothing.
        let before = calls.load(Ordering::Relaxed);
        t.read(20 * 4096, &mut back[..12 * ss]).unwrap();
        assert_eq!(calls.load(Ordering::Relaxed), before, "{what}");
        assert!(back[..12 * ss].iter().all(|&b| b == 0), "{what}");
        drop(t);
    }
    alloc.leak_check().unwrap();
}

#[test]
fn without_allow_discards_nothing_changes_and_zeroed_ciphertext_reads_as_garbage() {
    let alloc = arena(32);
    for ss in [512usize, 4096] {
        for (what, backend, _tmp) in target_backends(&alloc) {
            let what = format!("{what} / {ss}");
            let (t, _) = target(&alloc, Arc::clone(&backend), ss, false);
            assert!(!t.discards_allowed() && !t.can_punch_zeroes(), "{what}");
            let data = pattern(64 * ss, 2);
            t.write(0, &data).unwrap();
            let s = ss as u64;
            let e = t.discard(s, 4 * s).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{what}: {e}");
            let e = t.punch_zeroes(s, 4 * s).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{what}: {e}");
            let mut back = vec![0u8; data.len()];
            t.read(0, &mut back).unwrap();
            assert!(back == data, "{what}: a refused discard touched data");
            // Zero ciphertext (punched below the target) decrypts, as in
            // dm-crypt, to garbage.
            backend.punch(8 * s, 2 * s).unwrap();
            t.read(0, &mut back).unwrap();
            for k in [8usize, 9] {
                let sector = &back[k * ss..(k + 1) * ss];
                assert!(sector.iter().any(|&b| b != 0), "{what}: sector {k}");
                assert!(sector != &data[k * ss..(k + 1) * ss], "{what}");
            }
            assert!(back[..8 * ss] == data[..8 * ss] && back[10 * ss..] == data[10 * ss..]);
            assert_eq!(t.stats().discards + t.stats().zero_punches, 0);
        }
    }
    alloc.leak_check().unwrap();
}

/// A RAM disk that reports the holes it is given, at byte granularity,
/// at most `chunk_bytes` of them per call (a hole then arrives in pieces
/// over several calls, which the target must join).
struct FakeHoles {
    disk: RamDisk,
    holes: Vec<(u64, u64)>,
    chunk_bytes: u64,
}

impl Backend for FakeHoles {
    fn size_bytes(&self) -> u64 {
        self.disk.size_bytes()
    }
    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        self.disk.write_at(offset, segments)
    }
    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        self.disk.read_at(offset, segments)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        iopages_crypt::backend::check_range(offset, len, self.size_bytes())?;
        let end = offset + len.min(self.chunk_bytes);
        let is_hole = |at: u64| self.holes.iter().any(|&(a, b)| a <= at && at < b);
        let mut v: Vec<Extent> = Vec::new();
        let mut at = offset;
        while at < end {
            let hole = is_hole(at);
            let mut next = at + 1;
            while next < end && is_hole(next) == hole {
                next += 1;
            }
            if v.len() == max_extents {
                break;
            }
            v.push(ext(next - at, hole));
            at = next;
        }
        Ok(v)
    }
}

#[test]
fn target_extents_round_holes_inward_to_sectors_and_join_them_across_calls() {
    let alloc = arena(16);
    const SS: u64 = 4096;
    for chunk_bytes in [u64::MAX, 3000, 5000] {
        let fake = FakeHoles {
            disk: RamDisk::new(64 * SS).unwrap(),
            // Sector 0 partly, 1 wholly, 2 partly; 5..8 wholly; a hole
            // inside sector 10; 12..14 wholly from two holes that touch;
            // the last three sectors.
            holes: vec![
                (1000, 2 * SS + 5),
                (5 * SS, 8 * SS),
                (10 * SS + 10, 11 * SS - 10),
                (12 * SS, 13 * SS - 100),
                (13 * SS - 100, 14 * SS),
                (61 * SS - 1, 64 * SS),
            ],
            chunk_bytes,
        };
        let (t, _) = target(&alloc, Arc::new(fake), SS as usize, true);
        let all = t.extents(0, 64 * SS, 100).unwrap();
        well_formed(&all);
        assert_eq!(
            all,
            vec![
                ext(SS, false),
                ext(SS, true),
                ext(3 * SS, false),
                ext(3 * SS, true),
                ext(4 * SS, false),
                ext(2 * SS, true),
                ext(47 * SS, false),
                ext(3 * SS, true),
            ],
            "chunks of {chunk_bytes}"
        );
        // Bounded: the first three, covering less.
        assert_eq!(
            t.extents(0, 64 * SS, 3).unwrap(),
            vec![ext(SS, false), ext(SS, true), ext(3 * SS, false)]
        );
        assert_eq!(t.extents(0, 64 * SS, 0).unwrap(), vec![ext(SS, false)]);
        // From sector 6, a length that ends mid-sector: clipped to it, the
        // last sector (13, a hole) classified whole.
        assert_eq!(
            t.extents(6 * SS, 7 * SS + 1, 100).unwrap(),
            vec![ext(2 * SS, true), ext(4 * SS, false), ext(SS + 1, true)]
        );
        // A length past the end is clipped to the device; at the end,
        // nothing; past it or off a sector edge, refused.
        assert_eq!(
            t.extents(60 * SS, 100 * SS, 100).unwrap(),
            vec![ext(SS, false), ext(3 * SS, true)]
        );
        assert!(t.extents(64 * SS, 10, 4).unwrap().is_empty());
        assert!(t.extents(5 * SS, 0, 4).unwrap().is_empty());
        for off in [65 * SS, 512] {
            let e = t.extents(off, SS, 4).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        }
    }
    alloc.leak_check().unwrap();
}

#[test]
fn target_extents_over_a_file_show_the_discarded_sectors() {
    let alloc = arena(32);
    for ss in [512usize, 4096] {
        let tmp = TempFile::new(&target_tmp(), "extents");
        let f = open_file(&tmp.0, DEV, DirectIo::Auto);
        let bs = block_size(&tmp.0);
        let (t, _) = target(&alloc, Arc::new(f), ss, true);
        assert_eq!(t.extents(0, DEV, 8).unwrap(), vec![ext(DEV, true)]);
        t.write(0, &pattern(DEV as usize, 4)).unwrap();
        assert_eq!(t.extents(0, DEV, 8).unwrap(), vec![ext(DEV, false)]);
        // Whole file-system blocks discarded: a hole of exactly them.
        let discarded = t.discard(64 << 10, 32 << 10).unwrap();
        assert_eq!(discarded, 32 << 10);
        assert_eq!(
            t.extents(0, DEV, 8).unwrap(),
            vec![
                ext(64 << 10, false),
                ext(32 << 10, true),
                ext(DEV - (96 << 10), false)
            ],
            "{ss}"
        );
        // Less than a file-system block: zeros, but no hole.
        if bs > ss as u64 {
            t.discard(256 << 10, ss as u64).unwrap();
            let v = t.extents(256 << 10, 4096, 8).unwrap();
            assert_eq!(v, vec![ext(4096, false)], "{ss}");
            let mut one = vec![1u8; ss];
            t.read(256 << 10, &mut one).unwrap();
            assert!(one.iter().all(|&b| b == 0));
        }
        drop(t);
    }
    alloc.leak_check().unwrap();
}

/// A backend that cannot punch (the trait's defaults).
struct NoPunch(RamDisk);

impl Backend for NoPunch {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        self.0.write_at(offset, segments)
    }
    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        self.0.read_at(offset, segments)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_backend_that_cannot_punch_refuses_as_unsupported_after_checking_the_range() {
    let alloc = arena(16);
    let b = NoPunch(RamDisk::new(64 << 10).unwrap());
    assert!(!b.can_punch());
    assert_eq!(
        b.punch(0, 4096).unwrap_err().kind(),
        io::ErrorKind::Unsupported
    );
    assert_eq!(
        b.discard(0, 4096).unwrap_err().kind(),
        io::ErrorKind::Unsupported
    );
    assert_eq!(
        b.punch(0, 1 << 20).unwrap_err().kind(),
        io::ErrorKind::InvalidInput
    );
    assert_eq!(b.extents(10, 100, 0).unwrap(), vec![ext(100, false)]);
    let (t, _) = target(&alloc, Arc::new(b), 512, true);
    assert!(t.discards_allowed() && !t.can_punch_zeroes());
    assert_eq!(
        t.punch_zeroes(0, 512).unwrap_err().kind(),
        io::ErrorKind::Unsupported
    );
    assert_eq!(
        t.discard(0, 4096).unwrap_err().kind(),
        io::ErrorKind::Unsupported
    );
    assert_eq!(
        t.extents(0, 1 << 20, 4).unwrap(),
        vec![ext(64 << 10, false)]
    );
    drop(t);
    alloc.leak_check().unwrap();
}

// ---------------------------------------------------------------- model

#[derive(Clone, Debug)]
enum Op {
    /// Write sectors `first..first + n` with a pattern from `seed`.
    Write { first: u64, n: u64, seed: u64 },
    /// Discard any byte range.
    Discard { offset: u64, len: u64 },
    /// Punch sectors `first..first + n` to zeros.
    Punch { first: u64, n: u64 },
}

const MODEL_SECTORS_4K: u64 = 48;

fn arb_op(sectors: u64, ss: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..sectors, 1..17u64, any::<u64>()).prop_map(move |(first, n, seed)| Op::Write {
            first,
            n: n.min(sectors - first),
            seed
        }),
        (0..sectors * ss, 0..20 * ss).prop_map(move |(offset, len)| Op::Discard {
            offset,
            len: len.min(sectors * ss - offset)
        }),
        (0..sectors, 1..9u64).prop_map(move |(first, n)| Op::Punch {
            first,
            n: n.min(sectors - first)
        }),
    ]
}

/// Run `ops` on a target with discards allowed over `backend` and on a
/// model; every read of the target, whole and in pieces, matches it.
fn check_against_model(kind: u8, ss: usize, ops: &[Op], reads: &[(u64, u64)]) {
    let alloc = arena(32);
    let (backend, _tmp, _memfd) = model_backend(&alloc, kind, MODEL_SECTORS_4K * 4096);
    let s = ss as u64;
    let size = backend.size_bytes();
    let (t, _) = target(&alloc, backend, ss, true);
    let mut model = vec![0u8; size as usize];
    // From a device of encrypted zeros, as after a format: all data.
    t.write(0, &model).unwrap();
    for op in ops {
        match *op {
            Op::Write { first, n, seed } => {
                let data = pattern((n * s) as usize, seed);
                t.write(first * s, &data).unwrap();
                model[(first * s) as usize..((first + n) * s) as usize].copy_from_slice(&data);
            }
            Op::Discard { offset, len } => {
                let done = t.discard(offset, len).unwrap();
                let a = offset.div_ceil(s) * s;
                let b = (offset + len) / s * s;
                assert_eq!(done, b.saturating_sub(a));
                if b > a {
                    model[a as usize..b as usize].fill(0);
                }
            }
            Op::Punch { first, n } => {
                t.punch_zeroes(first * s, n * s).unwrap();
                model[(first * s) as usize..((first + n) * s) as usize].fill(0);
            }
        }
    }
    let mut back = vec![0u8; size as usize];
    t.read(0, &mut back).unwrap();
    assert!(back == model, "whole read");
    for &(first, n) in reads {
        let (first, n) = (first % (size / s), n.max(1));
        let n = n.min(size / s - first);
        let mut part = vec![7u8; (n * s) as usize];
        t.read(first * s, &mut part).unwrap();
        assert!(
            part[..] == model[(first * s) as usize..((first + n) * s) as usize],
            "read of {n} sectors at {first}"
        );
    }
    // Every hole the target reports reads as zeros.
    let mut at = 0;
    for e in t.extents(0, size, usize::MAX).unwrap() {
        if e.hole {
            assert!(model[at as usize..(at + e.len_bytes) as usize]
                .iter()
                .all(|&b| b == 0));
        }
        at += e.len_bytes;
    }
    assert_eq!(at, size);
    drop(t);
    alloc.leak_check().unwrap();
}

fn model_backend(
    alloc: &PageAllocator,
    kind: u8,
    size: u64,
) -> (Arc<dyn Backend>, Option<TempFile>, Option<File>) {
    match kind {
        0 => (Arc::new(RamDisk::new(size).unwrap()), None, None),
        3 => (Arc::new(PageStore::new(alloc, size).unwrap()), None, None),
        1 => {
            let t = TempFile::new(&target_tmp(), "model");
            let f = open_file(&t.0, size, DirectIo::Auto);
            (Arc::new(f), Some(t), None)
        }
        _ => {
            // Buffered: large reads decrypt straight out of the mapping.
            let (m, f) = sealed_memfd(size, DirectIo::Off);
            (Arc::new(f), None, Some(m))
        }
    }
}

/// A sector size and operations on a device of `MODEL_SECTORS_4K` 4 KiB
/// blocks with it.
fn arb_case() -> impl Strategy<Value = (usize, Vec<Op>)> {
    prop_oneof![Just(512usize), Just(4096usize)].prop_flat_map(|ss| {
        let sectors = MODEL_SECTORS_4K * 4096 / ss as u64;
        (
            Just(ss),
            proptest::collection::vec(arb_op(sectors, ss as u64), 1..24),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_writes_discards_and_punches_read_back_as_the_model_says(
        kind in 0u8..4,
        (ss, ops) in arb_case(),
        reads in proptest::collection::vec((any::<u64>(), 1..40u64), 0..6),
    ) {
        check_against_model(kind, ss, &ops, &reads);
    }
}
