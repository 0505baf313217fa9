//! The io_uring backend against real files (no mocks): random multi-segment
//! round trips checked against an in-memory model and against the file's
//! bytes read back with plain `std::fs`, on the target directory's file
//! system and on tmpfs, with and without an arena registered as fixed
//! buffers, from aligned arena pages and from unaligned heap buffers;
//! short transfers resubmitted; refused ranges and sizes; a read-only file;
//! a file truncated underneath; eight threads at once; a memlock limit that
//! refuses the registration.

mod common;

use common::{target_tmp, TempFile};
use iopages::{Gfp, HugePages, PageAllocator, PageBox};
use iopages_crypt::backend::Backend;
use iopages_crypt::uring::{DirectIo, UringFile, UringOptions};
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

// ---------------------------------------------------------------- helpers

fn shm() -> Option<PathBuf> {
    let d = PathBuf::from("/dev/shm");
    if d.is_dir() {
        Some(d)
    } else {
        eprintln!("note: no /dev/shm here; tmpfs not checked");
        None
    }
}

fn arena() -> PageAllocator {
    PageAllocator::builder()
        .size_bytes(16 << 20)
        .huge_pages(HugePages::Never)
        .build()
        .unwrap()
}

fn leak_check(alloc: &PageAllocator) {
    if let Err(a) = alloc.leak_check() {
        panic!("arena pages leaked: {a:?}");
    }
}

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
}

/// Whether the file system takes `O_DIRECT` for the (existing, non-empty)
/// file at `path`, asked without the backend: open with `O_DIRECT`, then
/// an aligned read of 4096 bytes at offset 0.
fn fs_allows_direct(path: &Path) -> bool {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return false,
        Err(e) => panic!("{}: {e}", path.display()),
    };
    let mut v = vec![0u8; 8192];
    let a = v.as_ptr().align_offset(4096);
    match f.read_at(&mut v[a..a + 4096], 0) {
        Ok(_) => true,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

/// Memory for one segment: arena pages or a heap vector, and the window
/// of it the segment uses.
enum Mem<'a> {
    Page(PageBox<'a>, usize, usize),
    Heap(Vec<u8>, usize, usize),
}

impl Mem<'_> {
    fn slice(&self) -> &[u8] {
        match self {
            Mem::Page(b, s, n) => &b.as_slice()[*s..*s + *n],
            Mem::Heap(v, s, n) => &v[*s..*s + *n],
        }
    }
    fn slice_mut(&mut self) -> &mut [u8] {
        match self {
            Mem::Page(b, s, n) => &mut b.as_mut_slice()[*s..*s + *n],
            Mem::Heap(v, s, n) => &mut v[*s..*s + *n],
        }
    }
}

/// `len` bytes of memory: aligned arena pages, arena pages at an odd
/// address, a 4096-aligned heap window, or a heap window at an odd address.
fn mem<'a>(rng: &mut Rng, alloc: Option<&'a PageAllocator>, len: usize) -> Mem<'a> {
    let style = rng.below(4);
    if let Some(a) = alloc.filter(|_| style < 2 && len + 64 <= 1 << 20) {
        let start = if style == 0 { 0 } else { 1 + rng.below(63) };
        let order = (start + len)
            .div_ceil(4096)
            .max(1)
            .next_power_of_two()
            .trailing_zeros();
        if let Some(b) = a.alloc_box(Gfp::KERNEL, order) {
            return Mem::Page(b, start, len);
        }
    }
    let v = vec![0u8; len + 8192];
    let aligned = v.as_ptr().align_offset(4096);
    let start = if style.is_multiple_of(2) {
        aligned
    } else {
        aligned + 1 + rng.below(511)
    };
    Mem::Heap(v, start, len)
}

/// A segment length: whole pages, whole sectors, anything (zero too), or
/// a few bytes.
fn seg_len(rng: &mut Rng) -> usize {
    match rng.below(4) {
        0 => 4096 * (1 + rng.below(8)),
        1 => 512 * (1 + rng.below(16)),
        2 => rng.below(20_000),
        _ => 1 + rng.below(100),
    }
}

/// An offset for `total` bytes on a device of `size`: page-aligned,
/// sector-aligned or anywhere.
fn offset_for(rng: &mut Rng, size: usize, total: usize) -> usize {
    let room = size - total;
    let off = rng.below(room + 1);
    match rng.below(4) {
        0 | 1 => off / 4096 * 4096,
        2 => off / 512 * 512,
        _ => off,
    }
}

/// Random segment lengths adding up to at most `max` bytes.
fn seg_lens(rng: &mut Rng, max: usize) -> Vec<usize> {
    let mut lens = Vec::new();
    let mut total = 0;
    for _ in 0..1 + rng.below(6) {
        let n = seg_len(rng);
        if total + n > max {
            break;
        }
        total += n;
        lens.push(n);
    }
    lens
}

/// Write `lens` of random data at `off` (from memory chosen by `mem`),
/// and apply it to `model` (whose index 0 is device offset `base`).
fn write_random(
    f: &UringFile,
    rng: &mut Rng,
    alloc: Option<&PageAllocator>,
    model: &mut [u8],
    base: usize,
    off: usize,
    lens: &[usize],
) {
    let mut bufs: Vec<Mem<'_>> = lens.iter().map(|&n| mem(rng, alloc, n)).collect();
    for b in &mut bufs {
        rng.fill(b.slice_mut());
    }
    let slices: Vec<&[u8]> = bufs.iter().map(|b| b.slice()).collect();
    f.write_at(off as u64, &slices)
        .unwrap_or_else(|e| panic!("write of {lens:?} at {off}: {e}"));
    let mut at = off - base;
    for s in &slices {
        model[at..at + s.len()].copy_from_slice(s);
        at += s.len();
    }
}

/// Read `lens` at `off` and compare with `model` (index 0 = offset `base`).
fn read_check(
    f: &UringFile,
    rng: &mut Rng,
    alloc: Option<&PageAllocator>,
    model: &[u8],
    base: usize,
    off: usize,
    lens: &[usize],
) {
    let mut bufs: Vec<Mem<'_>> = lens.iter().map(|&n| mem(rng, alloc, n)).collect();
    for b in &mut bufs {
        b.slice_mut().fill(0xEE);
    }
    {
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.slice_mut()).collect();
        f.read_at(off as u64, &mut slices)
            .unwrap_or_else(|e| panic!("read of {lens:?} at {off}: {e}"));
    }
    let mut at = off - base;
    for (i, b) in bufs.iter().enumerate() {
        let s = b.slice();
        assert!(
            s == &model[at..at + s.len()],
            "segment {i} of a read of {lens:?} at {off} differs from what was written"
        );
        at += s.len();
    }
}

/// `iters` random writes, each followed by a read of a random range with
/// its own segmentation; then the whole device read back, through the
/// backend and with `std::fs`, against the model. The device starts zeroed.
fn round_trips(f: &UringFile, alloc: Option<&PageAllocator>, iters: usize, seed: u64) {
    let size = f.size_bytes() as usize;
    let mut model = vec![0u8; size];
    let mut rng = Rng::new(seed);
    for _ in 0..iters {
        let lens = seg_lens(&mut rng, size / 4);
        let off = offset_for(&mut rng, size, lens.iter().sum());
        write_random(f, &mut rng, alloc, &mut model, 0, off, &lens);
        let lens = seg_lens(&mut rng, size / 4);
        let off = offset_for(&mut rng, size, lens.iter().sum());
        read_check(f, &mut rng, alloc, &model, 0, off, &lens);
    }
    f.flush().unwrap();
    let mut all = vec![0u8; size];
    f.read_at(0, &mut [&mut all]).unwrap();
    assert!(all == model, "the whole device differs from the model");
    let on_disk = std::fs::read(f.path()).unwrap();
    assert_eq!(on_disk.len(), size);
    assert!(
        on_disk == model,
        "the file's bytes (read with std::fs) differ from the model"
    );
}

fn report(what: &str, f: &UringFile) {
    eprintln!(
        "{what}: {} direct_io={} fixed_buffers={} mem_align={} io_align={} rings={} \
         fallbacks={:?} stats={:?}",
        f.path().display(),
        f.direct_io(),
        f.fixed_buffers(),
        f.mem_align(),
        f.io_align(),
        f.nr_rings(),
        f.fallbacks(),
        f.stats()
    );
}

// ------------------------------------------------------------------ tests

#[test]
fn target_dir_file_round_trips_with_heap_buffers() {
    let t = TempFile::new(&target_tmp(), "heap");
    let f = UringFile::open(t.path(), UringOptions::default().create_size(8 << 20)).unwrap();
    let allows = fs_allows_direct(t.path());
    report("target dir, no arena", &f);
    assert_eq!(
        f.direct_io(),
        allows,
        "Auto must use O_DIRECT exactly when the file system takes it"
    );
    assert_eq!(f.fallbacks().is_empty(), allows, "{:?}", f.fallbacks());
    assert!(!f.fixed_buffers());
    // Buffered writes are copied into the page cache: the target encrypts
    // into the caches for them, past the caches for O_DIRECT.
    assert_eq!(f.reads_writes(), !f.direct_io());
    round_trips(&f, None, 200, 1);
    let s = f.stats();
    assert_eq!(s.fixed_ops, 0);
    if f.direct_io() {
        assert!(
            s.bounced_segments > 0,
            "unaligned heap segments must bounce"
        );
    } else {
        assert_eq!(s.bounced_segments, 0, "buffered I/O never bounces");
    }
    report("after", &f);
}

#[test]
fn a_thread_submitting_to_the_rings_has_its_io_workers_capped() {
    let t = TempFile::new(&target_tmp(), "iowq");
    let f = UringFile::open(t.path(), UringOptions::default().create_size(1 << 20)).unwrap();
    if !f.direct_io() {
        // Buffered I/O is done with preadv/pwritev, never through a ring:
        // this thread would have no io-wq to look at.
        eprintln!("skipped: the target dir's file system refuses O_DIRECT");
        return;
    }
    round_trips(&f, None, 20, 3);
    match f.io_worker_limits() {
        Ok(l) => assert_eq!(
            l,
            iopages_crypt::uring::IO_WORKERS,
            "the limits of this thread's io-wq"
        ),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!("skipped: this kernel has no io-wq worker limit: {e}")
        }
        Err(e) => panic!("querying the io-wq limits: {e}"),
    }
}

#[test]
fn target_dir_file_round_trips_with_the_arena_as_fixed_buffers() {
    let alloc = arena();
    {
        let t = TempFile::new(&target_tmp(), "fixed");
        let f = UringFile::open(
            t.path(),
            UringOptions::default()
                .create_size(8 << 20)
                .arena(alloc.clone()),
        )
        .unwrap();
        report("target dir, arena", &f);
        assert_eq!(f.direct_io(), fs_allows_direct(t.path()));
        if !f.fixed_buffers() {
            assert!(
                f.fallbacks().iter().any(|r| r.contains("fixed")),
                "a refused registration must say why: {:?}",
                f.fallbacks()
            );
        }
        round_trips(&f, Some(&alloc), 200, 2);
        let s = f.stats();
        if f.fixed_buffers() {
            assert!(s.fixed_ops > 0, "arena segments must use the fixed opcodes");
        } else {
            assert_eq!(s.fixed_ops, 0);
        }
        if f.direct_io() {
            assert!(s.bounced_segments > 0);
        }
        report("after", &f);
    }
    leak_check(&alloc);
}

#[test]
fn tmpfs_direct_io_is_what_the_file_system_allows() {
    let Some(dir) = shm() else { return };
    let alloc = arena();
    {
        let t = TempFile::new(&dir, "shm");
        let auto = UringFile::open(
            t.path(),
            UringOptions::default()
                .create_size(4 << 20)
                .arena(alloc.clone()),
        )
        .unwrap();
        let allows = fs_allows_direct(t.path());
        report("/dev/shm, Auto", &auto);
        eprintln!("/dev/shm: the file system itself takes O_DIRECT: {allows}");
        assert_eq!(auto.direct_io(), allows);
        if allows {
            assert!(
                !auto.fallbacks().iter().any(|r| r.contains("O_DIRECT")),
                "{:?}",
                auto.fallbacks()
            );
        } else {
            assert!(
                auto.fallbacks().iter().any(|r| r.contains("O_DIRECT")),
                "Auto must record why it fell back: {:?}",
                auto.fallbacks()
            );
        }
        round_trips(&auto, Some(&alloc), 120, 3);
        drop(auto);

        let req = UringFile::open(t.path(), UringOptions::default().direct(DirectIo::Require));
        match (allows, req) {
            (true, Ok(f)) => assert!(f.direct_io()),
            (false, Err(e)) => {
                eprintln!("/dev/shm, Require: {e}");
                assert_eq!(e.kind(), io::ErrorKind::Unsupported);
                let m = e.to_string();
                assert!(m.contains(&t.path().display().to_string()) && m.contains("O_DIRECT"));
            }
            (true, Err(e)) => panic!("tmpfs takes O_DIRECT here, but Require failed: {e}"),
            (false, Ok(_)) => panic!("tmpfs refuses O_DIRECT here, but Require opened"),
        }

        let off = UringFile::open(t.path(), UringOptions::default().direct(DirectIo::Off)).unwrap();
        assert!(!off.direct_io());
        assert!(off.fallbacks().is_empty());
    }
    leak_check(&alloc);
}

#[test]
fn refused_o_direct_falls_back_with_a_reason_or_fails_when_required() {
    // Every file system here may take O_DIRECT (tmpfs does since Linux
    // 6.6), so the refusal at open is simulated; the rest is real I/O.
    let t = TempFile::new(&target_tmp(), "refused");
    let opts = UringOptions {
        refuse_direct_for_tests: true,
        ..UringOptions::default().create_size(2 << 20)
    };
    let f = UringFile::open(t.path(), opts.clone()).unwrap();
    report("O_DIRECT refused, Auto", &f);
    assert!(!f.direct_io());
    assert!(
        f.fallbacks()
            .iter()
            .any(|r| r.contains("O_DIRECT") && r.contains("refused")),
        "{:?}",
        f.fallbacks()
    );
    round_trips(&f, None, 60, 4);
    drop(f);

    let e = UringFile::open(t.path(), opts.clone().direct(DirectIo::Require)).unwrap_err();
    eprintln!("O_DIRECT refused, Require: {e}");
    assert_eq!(e.kind(), io::ErrorKind::Unsupported);
    let m = e.to_string();
    assert!(m.contains(&t.path().display().to_string()), "{m}");
    assert!(m.contains("O_DIRECT required"), "{m}");

    let f = UringFile::open(t.path(), opts.direct(DirectIo::Off)).unwrap();
    assert!(!f.direct_io() && f.fallbacks().is_empty());
}

#[test]
fn short_transfers_are_resubmitted_for_the_rest() {
    let alloc = arena();
    {
        for (direct, cap) in [(DirectIo::Auto, 4096), (DirectIo::Off, 700)] {
            let t = TempFile::new(&target_tmp(), "short");
            let f = UringFile::open(
                t.path(),
                UringOptions::default()
                    .create_size(4 << 20)
                    .direct(direct)
                    .arena(alloc.clone()),
            )
            .unwrap();
            f.set_short_io_for_tests(Some(cap));
            round_trips(&f, Some(&alloc), 80, 5);
            let s = f.stats();
            report("short I/O", &f);
            assert!(
                s.short_resubmissions > 0,
                "capped transfers must be resubmitted: {s:?}"
            );
            // Off again: a write of one page is one submission.
            f.set_short_io_for_tests(None);
            let before = f.stats();
            let page = vec![7u8; 4096];
            f.write_at(0, &[&page]).unwrap();
            let after = f.stats();
            assert_eq!(after.short_resubmissions, before.short_resubmissions);
            // Through the ring under O_DIRECT, one pwritev when buffered.
            assert_eq!(
                (after.submissions - before.submissions) + (after.sync_calls - before.sync_calls),
                1
            );
        }
    }
    leak_check(&alloc);
}

#[test]
fn refused_ranges_and_sizes_name_the_path_and_touch_nothing() {
    let dir = target_tmp();
    let t = TempFile::new(&dir, "range");
    let name = t.path().display().to_string();
    let f = UringFile::open(t.path(), UringOptions::default().create_size(1 << 20)).unwrap();
    let size = f.size_bytes();
    assert_eq!(size, 1 << 20);
    let before = f.stats();

    let e = f
        .write_at(size - 100, &[&[1u8; 100], &[2u8; 100]])
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let m = e.to_string();
    assert!(m.contains("leaves the device") && m.contains(&name), "{m}");
    assert!(f.read_at(u64::MAX, &mut [&mut [0u8; 1]]).is_err());
    assert!(f.read_at(size, &mut [&mut [0u8; 1]]).is_err());
    assert!(f.write_at(u64::MAX - 10, &[&[0u8; 20]]).is_err());
    assert_eq!(
        f.stats(),
        before,
        "nothing may be submitted for a refused request"
    );
    // Empty requests, even at the very end, are fine and submit nothing.
    f.write_at(size, &[]).unwrap();
    f.read_at(size, &mut [&mut []]).unwrap();
    assert_eq!(f.stats(), before);
    let on_disk = std::fs::read(t.path()).unwrap();
    assert!(on_disk.iter().all(|&b| b == 0), "a refused write wrote");
    refused_sizes_name_the_path(&dir);

    // Other refusals name the path too.
    let missing = TempFile::new(&dir, "missing");
    let e = UringFile::open(missing.path(), UringOptions::default()).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::NotFound);
    assert!(e
        .to_string()
        .contains(&missing.path().display().to_string()));
    let e = UringFile::open(&dir, UringOptions::default().read_only(true)).unwrap_err();
    assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
    for opts in [
        UringOptions::default().rings(0),
        UringOptions::default().ring_entries(0),
        UringOptions::default().read_only(true).create_size(4096),
    ] {
        let e = UringFile::open(t.path(), opts).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains(&name), "{e}");
    }
}

/// Sizes zero or not a multiple of 512, however they arise (asked for,
/// or the file's own): refused, naming the path and the size, and
/// nothing created.
fn refused_sizes_name_the_path(dir: &Path) {
    for bad in [1000u64, 0, 513] {
        let t = TempFile::new(dir, "badsize");
        let e = UringFile::open(t.path(), UringOptions::default().create_size(bad)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let m = e.to_string();
        assert!(m.contains(&t.path().display().to_string()), "{m}");
        assert!(m.contains(&format!("size {bad} bytes")), "{m}");
        assert!(
            !t.path().exists(),
            "a refused size must not create the file"
        );
    }
    let t2 = TempFile::new(dir, "oddfile");
    std::fs::write(t2.path(), vec![0u8; 1000]).unwrap();
    let e = UringFile::open(t2.path(), UringOptions::default()).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("size 1000 bytes"), "{e}");
    let t3 = TempFile::new(dir, "empty");
    std::fs::write(t3.path(), b"").unwrap();
    assert!(UringFile::open(t3.path(), UringOptions::default()).is_err());
}

#[test]
fn writes_to_a_read_only_file_fail_cleanly() {
    let alloc = arena();
    {
        let t = TempFile::new(&target_tmp(), "ro");
        let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 13) as u8).collect();
        std::fs::write(t.path(), &data).unwrap();
        let f = UringFile::open(
            t.path(),
            UringOptions::default().read_only(true).arena(alloc.clone()),
        )
        .unwrap();
        report("read-only", &f);
        let mut page = alloc.alloc_box(Gfp::KERNEL, 0).unwrap();
        page.as_mut_slice().fill(1);
        let odd = vec![2u8; 777];
        let e = f
            .write_at(4096, &[page.as_slice(), &odd, page.as_slice()])
            .unwrap_err();
        eprintln!("write to a read-only file: {e}");
        let m = e.to_string();
        assert!(m.contains(&t.path().display().to_string()), "{m}");
        assert!(m.contains("offset") && m.contains("read-only"), "{m}");
        assert_eq!(std::fs::read(t.path()).unwrap(), data, "nothing may change");
        // Reads and flush still work.
        let mut back = vec![0u8; 5000];
        f.read_at(1000, &mut [page.as_mut_slice(), &mut back])
            .unwrap();
        assert_eq!(page.as_slice(), &data[1000..5096]);
        assert_eq!(back, &data[5096..10096]);
        f.flush().unwrap();
    }
    leak_check(&alloc);
}

#[test]
fn flush_is_fdatasync_and_succeeds() {
    let t = TempFile::new(&target_tmp(), "flush");
    let f = UringFile::open(t.path(), UringOptions::default().create_size(1 << 20)).unwrap();
    f.write_at(512, &[&[9u8; 3000]]).unwrap();
    let before = f.stats().submissions;
    f.flush().unwrap();
    assert_eq!(f.stats().submissions, before + 1, "one fsync entry");
    f.flush().unwrap();
    assert_eq!(
        &std::fs::read(t.path()).unwrap()[512..3512],
        &[9u8; 3000][..]
    );
}

#[test]
fn buffered_files_offer_their_page_cache_for_reads_and_it_follows_writes() {
    let t = TempFile::new(&target_tmp(), "mapped");
    let f = UringFile::open(
        t.path(),
        UringOptions::default()
            .create_size(1 << 20)
            .direct(DirectIo::Off),
    )
    .unwrap();
    let data: Vec<u8> = (0..256 << 10).map(|i: u32| (i * 31 + 7) as u8).collect();
    f.write_at(128 << 10, &[&data]).unwrap();
    assert_eq!(f.mapped(128 << 10, data.len()).unwrap(), &data[..]);
    // Later writes show through the mapping (one page cache).
    f.write_at(128 << 10, &[&[9u8; 4096]]).unwrap();
    assert!(f.mapped(128 << 10, 4096).unwrap().iter().all(|&b| b == 9));
    // Out of range: none.
    assert!(f.mapped((1 << 20) - 4096, 8192).is_none());
    assert!(f.mapped(u64::MAX, 1).is_none());
    assert!(f.stats().mapped_reads >= 2);
    // Not under O_DIRECT, and not when turned off.
    let d = UringFile::open(t.path(), UringOptions::default().direct(DirectIo::Auto)).unwrap();
    if d.direct_io() {
        assert!(d.mapped(0, 4096).is_none());
    }
    let mut o = UringOptions::default().direct(DirectIo::Off);
    o.map_reads = false;
    assert!(UringFile::open(t.path(), o)
        .unwrap()
        .mapped(0, 4096)
        .is_none());
}

#[test]
fn a_file_truncated_underneath_is_an_error_not_a_short_read() {
    for direct in [DirectIo::Auto, DirectIo::Off] {
        let t = TempFile::new(&target_tmp(), "trunc");
        let f = UringFile::open(
            t.path(),
            UringOptions::default().create_size(64 << 10).direct(direct),
        )
        .unwrap();
        f.write_at(0, &[&vec![5u8; 64 << 10]]).unwrap();
        f.flush().unwrap();
        OpenOptions::new()
            .write(true)
            .open(t.path())
            .unwrap()
            .set_len(8192)
            .unwrap();
        // (offset, length, memory offset from a page edge)
        for (off, len, skew) in [(4096u64, 12288, 0), (16384, 4096, 0), (4000, 5000, 1)] {
            let mut v = vec![0u8; len + 8192];
            let a = v.as_ptr().align_offset(4096) + skew;
            let e = f.read_at(off, &mut [&mut v[a..a + len]]).unwrap_err();
            eprintln!("{direct:?}: {e}");
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
            let m = e.to_string();
            assert!(m.contains(&t.path().display().to_string()) && m.contains("offset"));
        }
        // The mapping (buffered I/O) is not offered past the new end: a
        // read there goes to preadv and gets the error, never a fault.
        assert!(f.mapped(8192, 4096).is_none());
        assert!(f.mapped(0, 16384).is_none());
        // What is still there reads back.
        let mut head = vec![0u8; 8192];
        f.read_at(0, &mut [&mut head]).unwrap();
        assert!(head.iter().all(|&x| x == 5));
        if direct == DirectIo::Off {
            assert_eq!(f.mapped(0, 8192).unwrap(), &head[..]);
        }
    }
}

#[test]
fn more_entries_than_the_ring_holds_and_long_unaligned_runs() {
    let alloc = arena();
    {
        for direct in [DirectIo::Auto, DirectIo::Off] {
            let t = TempFile::new(&target_tmp(), "waves");
            let f = UringFile::open(
                t.path(),
                UringOptions::default()
                    .create_size(8 << 20)
                    .direct(direct)
                    .rings(1)
                    .ring_entries(4)
                    .arena(alloc.clone()),
            )
            .unwrap();
            let size = f.size_bytes() as usize;
            let mut model = vec![0u8; size];
            let mut rng = Rng::new(6);
            // 300 single pages from the arena: 300 entries through a ring
            // of 4.
            let mut pages: Vec<PageBox<'_>> = (0..300)
                .map(|_| alloc.alloc_box(Gfp::KERNEL, 0).unwrap())
                .collect();
            for p in &mut pages {
                rng.fill(p.as_mut_slice());
            }
            let slices: Vec<&[u8]> = pages.iter().map(|p| p.as_slice()).collect();
            f.write_at(8192, &slices).unwrap();
            for (i, s) in slices.iter().enumerate() {
                model[8192 + i * 4096..8192 + (i + 1) * 4096].copy_from_slice(s);
            }
            drop(slices);
            drop(pages);
            // One long unaligned segment (several bounce buffers), between
            // unaligned small ones.
            let lens = [3, (3 << 20) + 5, 700, 1];
            write_random(&f, &mut rng, None, &mut model, 0, 1_300_001, &lens);
            let mut big = vec![0u8; (3 << 20) + 9];
            let mut small = vec![0u8; 300];
            let (s1, s2) = small.split_at_mut(7);
            f.read_at(1_299_999, &mut [s1, &mut big, s2]).unwrap();
            assert!(small[..7] == model[1_299_999..1_300_006]);
            assert!(big[..] == model[1_300_006..1_300_006 + big.len()]);
            assert!(small[7..] == model[1_300_006 + big.len()..1_300_006 + big.len() + 293]);
            f.flush().unwrap();
            assert!(std::fs::read(t.path()).unwrap() == model);
            let s = f.stats();
            report("waves", &f);
            if f.fixed_buffers() && f.direct_io() {
                assert!(s.fixed_ops >= 300);
            }
            if !f.direct_io() {
                assert!(s.sync_calls > 0 && s.submissions <= 1, "{s:?}");
            }
        }
    }
    leak_check(&alloc);
}

#[test]
fn eight_threads_write_disjoint_ranges_with_shared_edge_blocks() {
    let alloc = arena();
    {
        let t = TempFile::new(&target_tmp(), "threads");
        let f = Arc::new(
            UringFile::open(
                t.path(),
                UringOptions::default()
                    .create_size(8 << 20)
                    .arena(alloc.clone()),
            )
            .unwrap(),
        );
        report("8 threads", &f);
        let size = f.size_bytes() as usize;
        // Range edges off block boundaries, so neighbours share a block
        // and both read-modify-write it.
        let edge = |t: usize| if t == 8 { size } else { t * (size / 8) + 7 * t };
        let models: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|i| {
                    let (f, alloc) = (&f, &alloc);
                    s.spawn(move || {
                        let (lo, hi) = (edge(i), edge(i + 1));
                        let mut model = vec![0u8; hi - lo];
                        let mut rng = Rng::new(100 + i as u64);
                        for _ in 0..150 {
                            let lens = seg_lens(&mut rng, (hi - lo) / 4);
                            let total: usize = lens.iter().sum();
                            let off = match rng.below(3) {
                                0 => lo,
                                1 => hi - total,
                                _ => lo + rng.below(hi - lo - total + 1),
                            };
                            write_random(f, &mut rng, Some(alloc), &mut model, lo, off, &lens);
                            let n = 1 + rng.below(3000);
                            let at = if rng.below(2) == 0 { lo } else { hi - n };
                            read_check(f, &mut rng, Some(alloc), &model, lo, at, &[n]);
                        }
                        alloc.flush_thread_cache();
                        model
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let model = models.concat();
        assert_eq!(model.len(), size);
        let mut all = vec![0u8; size];
        f.read_at(0, &mut [&mut all]).unwrap();
        assert!(all == model, "a thread's bytes were lost or torn");
        f.flush().unwrap();
        assert!(std::fs::read(t.path()).unwrap() == model);
        report("after", &f);
    }
    leak_check(&alloc);
}

/// Drop `CAP_IPC_LOCK` from the calling thread's effective set
/// (capabilities are per thread), so its rings account pinned memory
/// against `RLIMIT_MEMLOCK`.
fn drop_ipc_lock_in_this_thread() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget fills the header and two data words, which we own.
    if unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) } != 0 {
        return false;
    }
    d[0].effective &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and two data words; dropping an
    // effective capability is always allowed, and affects this thread only.
    unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) == 0 }
}

#[test]
fn a_memlock_limit_that_refuses_registration_falls_back_to_plain_buffers() {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) }, 0);
    if rl.rlim_cur == libc::RLIM_INFINITY || rl.rlim_cur >= 16 << 20 {
        eprintln!(
            "note: RLIMIT_MEMLOCK is {} bytes, enough for a 16 MiB arena; fallback not checked",
            rl.rlim_cur
        );
        return;
    }
    let alloc = arena();
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(drop_ipc_lock_in_this_thread(), "capset");
            let t = TempFile::new(&target_tmp(), "memlock");
            let f = UringFile::open(
                t.path(),
                UringOptions::default()
                    .create_size(2 << 20)
                    .rings(2)
                    .arena(alloc.clone()),
            )
            .unwrap();
            report("RLIMIT_MEMLOCK", &f);
            assert!(!f.fixed_buffers());
            assert!(
                f.fallbacks()
                    .iter()
                    .any(|r| r.contains("fixed") && r.contains("RLIMIT_MEMLOCK")),
                "{:?}",
                f.fallbacks()
            );
            round_trips(&f, Some(&alloc), 40, 7);
            assert_eq!(f.stats().fixed_ops, 0);
            alloc.flush_thread_cache();
        });
    });
    leak_check(&alloc);
}

/// A completion the kernel fails for now (`EINTR`, `EAGAIN`, `ECANCELED`)
/// is asked for again: with every third completion failed so, the bytes
/// still round-trip, the flush still lands, and the retries are counted;
/// no bounce page is left behind.
#[test]
fn completions_failed_for_now_are_asked_for_again() {
    let alloc = arena();
    for errno in [libc::EINTR, libc::EAGAIN, libc::ECANCELED] {
        let t = TempFile::new(&target_tmp(), "retried");
        let opts = UringOptions::default()
            .create_size(4 << 20)
            .arena(alloc.clone());
        let f = UringFile::open(t.path(), opts).unwrap();
        f.fail_completions_for_tests(Some((errno, 3)));
        round_trips(&f, Some(&alloc), 40, errno as u64);
        // Every completion of the flush failed once, then it lands.
        f.fail_completions_for_tests(Some((errno, 2)));
        f.flush().unwrap();
        f.fail_completions_for_tests(None);
        let s = f.stats();
        report("completions failed for now", &f);
        // Reads and writes go through the rings only under O_DIRECT; the
        // flush always does.
        let least = if f.direct_io() { 40 } else { 1 };
        assert!(s.retries >= least, "errno {errno}: {s:?}");
    }
    leak_check(&alloc);
}

/// A completion failed for good (`EIO`), or failed for now more often than
/// the retries allow, fails its call with the path, the offset and the
/// error — once every entry of the call was reaped, those that went
/// through included — and the file serves the next call as before; no
/// bounce page is left behind.
#[test]
fn completions_failed_for_good_fail_their_call_and_nothing_after() {
    let alloc = arena();
    let t = TempFile::new(&target_tmp(), "failed");
    let opts = UringOptions::default()
        .create_size(1 << 20)
        .arena(alloc.clone());
    let f = UringFile::open(t.path(), opts).unwrap();
    let name = t.path().display().to_string();
    // Four arena pages (an entry each under O_DIRECT) and a segment at an
    // odd address (a bounce page).
    let mut pages: Vec<PageBox<'_>> = (0..4)
        .map(|_| alloc.alloc_box(Gfp::KERNEL, 0).unwrap())
        .collect();
    for (i, p) in pages.iter_mut().enumerate() {
        p.as_mut_slice().fill(i as u8 + 1);
    }
    let odd = vec![9u8; 1001];
    let mut segs: Vec<&[u8]> = pages.iter().map(|p| p.as_slice()).collect();
    segs.push(&odd[1..]);
    let whole = segs.concat();
    // (errno, every how many completions fail): every other entry of the
    // write fails for good; the retried kinds fail every time.
    for (errno, every) in [(libc::EIO, 2), (libc::EAGAIN, 1), (libc::ECANCELED, 1)] {
        let want = io::Error::from_raw_os_error(errno);
        let mut calls = Vec::new();
        if f.direct_io() {
            f.fail_completions_for_tests(Some((errno, every)));
            calls.push(f.write_at(8192, &segs).unwrap_err());
            // One entry (a bounce): it fails every time.
            f.fail_completions_for_tests(Some((errno, 1)));
            let mut back = vec![0u8; whole.len()];
            calls.push(f.read_at(8192, &mut [&mut back]).unwrap_err());
        }
        f.fail_completions_for_tests(Some((errno, 1)));
        calls.push(f.flush().unwrap_err());
        f.fail_completions_for_tests(None);
        for e in calls {
            let m = e.to_string();
            assert_eq!(e.kind(), want.kind(), "{m}");
            assert!(m.contains(&name) && m.contains(&want.to_string()), "{m}");
        }
        f.write_at(8192, &segs).unwrap();
        let mut back = vec![0u8; whole.len()];
        f.read_at(8192, &mut [&mut back]).unwrap();
        assert!(
            back == whole,
            "errno {errno}: the bytes written after differ"
        );
        f.flush().unwrap();
    }
    report("completions failed for good", &f);
    drop((f, pages));
    leak_check(&alloc);
}
