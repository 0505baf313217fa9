//! Sparse volumes: hole punches and discards in every backend (RAM disk,
//! page store, window, a file and a sealed memfd through io_uring), their
//! extents, and the crypt target with `allow_discards` over them with the
//! real AES-XTS cipher — whole sectors inside a discarded range read as
//! zeros, partial ones and everything else read back intact, holes are
//! rounded inward to sectors, runs of data sectors are decrypted in one
//! call, and random write / discard / punch sequences read back as a
//! model says. Without `allow_discards` nothing changes.

use iopages::{HugePages, PageAllocator};
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

// ---------------------------------------------------------------- helpers

fn arena(mib: u64) -> PageAllocator {
    PageAllocator::builder()
        .size_bytes(mib << 20)
        .huge_pages(HugePages::Never)
        .build()
        .unwrap()
}

/// A path that is removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(dir: &Path, tag: &str) -> TempFile {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = dir.join(format!(
            "iopages-discard-{tag}-{}-{n}.img",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        TempFile(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn target_tmp() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

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

/// The file system's allocation unit for the file at `path`.
fn block_size(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blksize().max(512)
}

#[test]
fn a_file_punches_holes_refuses_out_of_range_and_read_only_and_reports_its_extents() {
    const SIZE: u64 = 1 << 20;
    for dir in dirs() {
        for direct in [DirectIo::Auto, DirectIo::Off] {
            let tmp = TempFile::new(&dir, "file");
            let f = open_file(&tmp.0, SIZE, direct);
            let what = format!("{} {direct:?}", dir.display());
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
            punch_contract(&f, &what);
            // The contract's punches left holes of the whole blocks they
            // covered: 8 KiB at 8 KiB, 4 KiB at 32 KiB.
            let bs = block_size(&tmp.0).max(4096);
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
            assert_eq!(std::fs::metadata(&tmp.0).unwrap().len(), SIZE, "KEEP_SIZE");
            drop(f);
            // Read-only: refused, nothing touched.
            let before = std::fs::read(&tmp.0).unwrap();
            let ro = UringFile::open(
                &tmp.0,
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
            assert!(e.to_string().contains(&*tmp.0.to_string_lossy()), "{e}");
            let e = ro.discard(0, 4096).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            assert!(std::fs::read(&tmp.0).unwrap() == before);
        }
    }
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
