//! Direct I/O of folio buffers through a real file: round trips of ranges
//! that start and end inside folios, folio-aware and page-by-page, with
//! O_DIRECT and on a file opened as if the file system refused it; clear
//! errors for misaligned requests; no pin left behind.

use iopages::{BioLimits, FolioBuffer, Gfp, HugePages, PageAllocator};
use iopages_crypt::backend::Backend;
use iopages_crypt::dio::DirectFile;
use iopages_crypt::uring::{DirectIo, UringFile, UringOptions};
use std::io::ErrorKind;
use std::path::PathBuf;
use std::sync::Arc;

const FILE: u64 = 4 << 20;

fn arena() -> PageAllocator {
    PageAllocator::builder()
        .size_bytes(32 << 20)
        .huge_pages(HugePages::Never)
        .build()
        .unwrap()
}

fn path(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("dio-{name}-{}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn open(alloc: &PageAllocator, name: &str, refuse_direct: bool) -> (Arc<UringFile>, PathBuf) {
    let p = path(name);
    let f = UringFile::open(
        &p,
        UringOptions {
            arena: Some(alloc.clone()),
            create_size: Some(FILE),
            rings: 2,
            direct: DirectIo::Auto,
            refuse_direct_for_tests: refuse_direct,
            ..UringOptions::default()
        },
    )
    .unwrap();
    (Arc::new(f), p)
}

fn no_pins(alloc: &PageAllocator, buf: &FolioBuffer) {
    for &f in buf.folios() {
        assert_eq!(alloc.folio_pins(f), 0, "pins left on {f:?}");
    }
}

#[test]
fn ranges_inside_folios_round_trip_folio_aware_and_page_by_page() {
    for refuse_direct in [false, true] {
        let alloc = arena();
        let (file, p) = open(&alloc, &format!("rt-{refuse_direct}"), refuse_direct);
        assert_eq!(
            file.direct_io(),
            !refuse_direct && file.fallbacks().is_empty()
        );
        let mut model = vec![0u8; FILE as usize];
        for page_by_page in [false, true] {
            let dio = DirectFile::new(Arc::clone(&file), &alloc)
                .with_page_by_page(page_by_page)
                .with_limits(BioLimits {
                    max_segments: 8,
                    max_segment_bytes: 64 << 10,
                });
            let mut buf = alloc.alloc_buffer(Gfp::KERNEL, 1 << 20, 4).unwrap();
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ page_by_page as u64;
            for round in 0..24u64 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                // Page-aligned starts and ends that fall inside 64 KiB folios.
                let start = (rng as usize % 200) * 4096;
                let len = (1 + (rng >> 20) as usize % 56) * 4096;
                let file_off = ((rng >> 40) % (FILE / 4096 - 56)) * 4096;
                let data: Vec<u8> = (0..1 << 20).map(|i: u64| (i ^ round ^ rng) as u8).collect();
                buf.copy_from(&data).unwrap();
                dio.write(file_off, &buf, start..start + len).unwrap();
                model[file_off as usize..][..len].copy_from_slice(&data[start..start + len]);
                no_pins(&alloc, &buf);
                let mut back = alloc.alloc_buffer(Gfp::KERNEL, 1 << 20, 4).unwrap();
                dio.read(file_off, &mut back, start..start + len).unwrap();
                assert!(
                    back.to_vec()[start..start + len] == model[file_off as usize..][..len],
                    "round {round}: read-back differs (page_by_page {page_by_page})"
                );
                no_pins(&alloc, &back);
            }
            // The file holds what was written, as any reader sees it.
            file.flush().unwrap();
            let on_disk = std::fs::read(&p).unwrap();
            assert!(on_disk == model, "file contents differ");
            drop(buf);
        }
        drop(file);
        std::fs::remove_file(&p).unwrap();
        alloc.leak_check().unwrap();
    }
}

#[test]
fn misaligned_or_out_of_range_requests_are_refused_before_anything_is_pinned() {
    let alloc = arena();
    let (file, p) = open(&alloc, "bad", false);
    let dio = DirectFile::new(Arc::clone(&file), &alloc);
    let buf = alloc.alloc_buffer(Gfp::KERNEL, 256 << 10, 4).unwrap();
    let mut cases = vec![(0u64, 0usize..(256 << 10) + 4096), (FILE - 4096, 0..8192)];
    if file.direct_io() {
        cases.extend([(100, 0..4096), (0, 0..1000), (0, 512..4608)]);
    }
    for (off, range) in cases {
        let e = dio.write(off, &buf, range.clone()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{off} {range:?}: {e}");
        no_pins(&alloc, &buf);
    }
    // Bouncing lets a misaligned buffer offset through, correctly.
    if file.direct_io() {
        let mut src = alloc.alloc_buffer(Gfp::KERNEL, 64 << 10, 4).unwrap();
        let data: Vec<u8> = (0..64 << 10).map(|i: u32| (i % 251) as u8).collect();
        src.copy_from(&data).unwrap();
        let bouncing = DirectFile::new(Arc::clone(&file), &alloc).with_bounce(true);
        bouncing.write(8192, &src, 512..512 + 8192).unwrap();
        let mut back = vec![0u8; 8192];

        file.read_at(8192, &mut [&mut back]).unwrap();
        assert_eq!(back, data[512..512 + 8192]);
        no_pins(&alloc, &src);
    }
    // A buffer of another arena is refused.
    let other = arena();
    let foreign = other.alloc_buffer(Gfp::KERNEL, 8192, 1).unwrap();
    assert!(dio.write(0, &foreign, 0..8192).is_err());
    drop((buf, foreign, dio, file));
    std::fs::remove_file(&p).unwrap();
    alloc.leak_check().unwrap();
}
