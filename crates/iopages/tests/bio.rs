//! Bios built folio by folio against the page-by-page baseline: the same
//! bytes in the same order, segments that are exactly the contiguous runs,
//! pins that match the pages covered and go back to zero.

mod common;
use common::{assert_no_leaks, builder};
use iopages::{Bio, BioError, BioLimits, Folio, Gfp, Page, PageAllocator, PAGE_SIZE};
use proptest::prelude::*;
use std::collections::HashMap;

/// Folios of the given orders, and the page array of the memory they make
/// (each folio's frames in order).
fn folios(alloc: &PageAllocator, orders: &[u32]) -> (Vec<Folio>, Vec<Page>) {
    let fs: Vec<Folio> = orders
        .iter()
        .map(|&o| alloc.folio_alloc(Gfp::KERNEL, o).expect("folio"))
        .collect();
    let pages = fs
        .iter()
        .flat_map(|f| (0..f.nr_pages()).map(move |i| f.page_at(i)))
        .collect();
    (fs, pages)
}

/// Arena byte ranges a bio covers, in order.
fn ranges(bio: &Bio) -> Vec<(usize, usize)> {
    bio.segments()
        .iter()
        .map(|s| {
            (
                s.page.pfn() as usize * PAGE_SIZE + s.offset as usize,
                s.len as usize,
            )
        })
        .collect()
}

/// The byte ranges of `pages[offset..offset+len]`, merged where
/// contiguous, split at `max`: what a bio must hold.
fn expected(pages: &[Page], offset: usize, len: usize, max: usize) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let (mut pos, end) = (offset, offset + len);
    while pos < end {
        let n = (PAGE_SIZE - pos % PAGE_SIZE).min(end - pos);
        let start = pages[pos / PAGE_SIZE].pfn() as usize * PAGE_SIZE + pos % PAGE_SIZE;
        match runs.last_mut() {
            Some(last) if last.0 + last.1 == start && last.1 + n <= max => last.1 += n,
            Some(last) if last.0 + last.1 == start => {
                let room = max - last.1;
                last.1 += room;
                runs.push((start + room, n - room));
            }
            _ => runs.push((start, n)),
        }
        pos += n;
    }
    runs
}

fn pins(alloc: &PageAllocator, fs: &[Folio]) -> Vec<u32> {
    fs.iter().map(|&f| alloc.folio_pins(f)).collect()
}

/// Pins each folio should hold: one per page of it the range touches.
fn expected_pins(pages: &[Page], fs: &[Folio], offset: usize, len: usize) -> Vec<u32> {
    let mut by_head: HashMap<u32, u32> = HashMap::new();
    if len > 0 {
        for p in &pages[offset / PAGE_SIZE..(offset + len).div_ceil(PAGE_SIZE)] {
            let f = fs.iter().find(|f| f.index_of(*p).is_some()).unwrap();
            *by_head.entry(f.page().pfn()).or_default() += 1;
        }
    }
    fs.iter()
        .map(|f| by_head.get(&f.page().pfn()).copied().unwrap_or(0))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn folio_and_page_builders_cover_the_same_bytes_and_pin_the_same_pages(
        orders in prop::collection::vec(0u32..=6, 1..10),
        a in any::<u64>(), b in any::<u64>(),
        big_segments in any::<bool>(),
        checks in any::<bool>(),
    ) {
        let alloc = builder(16).checks(checks).build().unwrap();
        let (fs, pages) = folios(&alloc, &orders);
        let total = pages.len() * PAGE_SIZE;
        let offset = (a % total as u64) as usize;
        let len = (b % (total - offset + 1) as u64) as usize;
        let limits = BioLimits {
            max_segments: 1 << 16,
            max_segment_bytes: if big_segments { 1 << 30 } else { 16 << 10 },
        };
        let want = expected(&pages, offset, len, limits.max_segment_bytes);

        let folio_bio = Bio::from_pages(&alloc, &pages, offset, len, limits).unwrap();
        prop_assert_eq!(ranges(&folio_bio), want.clone());
        prop_assert_eq!(folio_bio.len(), len);
        prop_assert_eq!(pins(&alloc, &fs), expected_pins(&pages, &fs, offset, len));
        let page_bio = Bio::from_pages_by_page(&alloc, &pages, offset, len, limits).unwrap();
        prop_assert_eq!(ranges(&page_bio), want.clone());
        let touched = (offset + len).div_ceil(PAGE_SIZE) - offset / PAGE_SIZE;
        prop_assert!(folio_bio.segments().len() <= touched.max(1));
        if big_segments {
            // Segments are exactly the physically contiguous runs.
            let runs = 1 + pages.windows(2).enumerate()
                .filter(|(i, w)| {
                    let first = offset / PAGE_SIZE;
                    let last = (offset + len).div_ceil(PAGE_SIZE);
                    *i >= first && i + 2 <= last && w[1].pfn() != w[0].pfn() + 1
                })
                .count();
            prop_assert_eq!(folio_bio.segments().len(), if len == 0 { 0 } else { runs });
        }
        // Either release gives back what either builder took.
        page_bio.release(&alloc);
        folio_bio.release_by_page(&alloc);
        prop_assert_eq!(pins(&alloc, &fs), vec![0; fs.len()]);
        for f in fs {
            // SAFETY: the test allocated these pages and gives them up here, once.
            unsafe { alloc.folio_put(f) }.unwrap();
        }
        assert_no_leaks(&alloc);
    }
}

#[test]
fn a_folio_range_is_one_step_and_merges_with_what_precedes_it() {
    let alloc = builder(8).build().unwrap();
    let f = alloc.folio_alloc(Gfp::KERNEL, 4).unwrap();
    let mut bio = Bio::new(BioLimits::default()).unwrap();
    bio.add_page(f.page(), 100, PAGE_SIZE - 100).unwrap();
    bio.add_folio(f, PAGE_SIZE, 3 * PAGE_SIZE).unwrap();
    assert_eq!(bio.segments().len(), 1, "contiguous: merged");
    assert_eq!(bio.len(), 4 * PAGE_SIZE - 100);
    // Not contiguous: a new segment.
    bio.add_folio(f, 8 * PAGE_SIZE, 10).unwrap();
    assert_eq!(bio.segments().len(), 2);
    assert!(matches!(
        bio.add_folio(f, 15 * PAGE_SIZE, PAGE_SIZE + 1),
        Err(BioError::OutOfRange { .. })
    ));
    assert!(bio.add_page(f.page(), 4000, 100).is_err());
    assert!(!bio.is_pinned());
    bio.release(&alloc);
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.folio_put(f) }.unwrap();
    assert_no_leaks(&alloc);
}

#[test]
fn a_full_bio_refuses_the_add_unchanged_and_a_failed_build_leaves_no_pin() {
    let alloc = builder(8).build().unwrap();
    let (fs, pages) = folios(&alloc, &[0, 0, 0, 0, 0, 0, 0, 0]);
    let limits = BioLimits {
        max_segments: 2,
        max_segment_bytes: PAGE_SIZE,
    };
    let mut bio = Bio::new(limits).unwrap();
    bio.add_page(pages[0], 0, PAGE_SIZE).unwrap();
    let before = ranges(&bio);
    assert!(matches!(
        bio.add_folio(fs[1], 0, PAGE_SIZE)
            .and_then(|()| bio.add_folio(fs[2], 0, PAGE_SIZE)),
        Err(BioError::Full { .. })
    ));
    assert_eq!(bio.segments().len(), 2);
    assert_ne!(ranges(&bio), before);
    bio.release(&alloc);
    for build in [Bio::from_pages, Bio::from_pages_by_page] {
        let e = build(&alloc, &pages, 0, 8 * PAGE_SIZE, limits).unwrap_err();
        assert!(matches!(e, BioError::Full { .. }), "{e}");
        assert!(
            pins(&alloc, &fs).iter().all(|&p| p == 0),
            "pins left behind"
        );
        let e = build(&alloc, &pages, 4096, 8 * PAGE_SIZE, limits).unwrap_err();
        assert!(matches!(e, BioError::OutOfRange { .. }), "{e}");
    }
    assert!(Bio::new(BioLimits {
        max_segments: 0,
        ..BioLimits::default()
    })
    .is_err());
    for f in fs {
        // SAFETY: the test allocated these pages and gives them up here, once.
        unsafe { alloc.folio_put(f) }.unwrap();
    }
    assert_no_leaks(&alloc);
}

#[test]
fn a_bio_over_a_page_outside_the_arena_is_refused_with_no_pin_taken() {
    let alloc = builder(8).checks(true).build().unwrap();
    let (fs, mut pages) = folios(&alloc, &[0, 0, 0]);
    let limits = BioLimits::default();
    // A frame number past the arena: refused, no pin taken anywhere.
    let outside = Page::from_pfn(alloc.arena().nr_pages() as u32 + 5);
    pages.push(outside);
    for build in [Bio::from_pages, Bio::from_pages_by_page] {
        let e = build(&alloc, &pages, 0, 4 * PAGE_SIZE, limits).unwrap_err();
        assert!(matches!(e, BioError::OutOfRange { .. }), "{e}");
        assert!(pins(&alloc, &fs).iter().all(|&p| p == 0));
        // The pages before it are fine on their own.
        build(&alloc, &pages, 0, 3 * PAGE_SIZE, limits)
            .unwrap()
            .release(&alloc);
    }
    for &f in &fs {
        // SAFETY: allocated above, freed once here.
        unsafe { alloc.folio_put(f) }.unwrap();
    }
    assert_no_leaks(&alloc);
}

#[test]
fn a_folio_pinned_by_a_bio_cannot_be_freed_until_the_bio_is_released() {
    let alloc = builder(8).build().unwrap();
    let buf = alloc.alloc_buffer(Gfp::KERNEL, 256 << 10, 4).unwrap();
    let pages = buf.pages();
    let bio = Bio::from_pages(&alloc, &pages, 1000, 100 << 10, BioLimits::default()).unwrap();
    assert_eq!(
        bio.segments().iter().map(|s| s.len as usize).sum::<usize>(),
        100 << 10
    );
    let pinned = buf.folios()[0];
    assert_eq!(alloc.folio_pins(pinned), 16);
    match buf.free() {
        Err((iopages::Error::Pinned { pfn, .. }, buf)) => {
            assert_eq!(pfn, buf.folios()[buf.folios().len() - 1].page().pfn());
            bio.release(&alloc);
            buf.free().map_err(|(e, _)| e).unwrap();
        }
        other => panic!("expected Pinned, got {:?}", other.map_err(|(e, _)| e)),
    }
    assert_no_leaks(&alloc);
}

#[test]
fn a_bios_segments_are_slices_of_the_buffer_that_owns_them_in_order() {
    let alloc = builder(8).build().unwrap();
    let mut buf = alloc.alloc_buffer(Gfp::KERNEL, 200 << 10, 2).unwrap();
    let data: Vec<u8> = (0..200u32 << 10)
        .map(|i| (i * 13 + i / 4096) as u8)
        .collect();
    buf.copy_from(&data).unwrap();
    let pages = buf.pages();
    let (offset, len) = (1000, 150 << 10);
    let limits = BioLimits {
        max_segments: 64,
        max_segment_bytes: 8 << 10,
    };
    let bio = Bio::from_pages(&alloc, &pages, offset, len, limits).unwrap();
    let read: Vec<u8> = bio.slices(&buf).unwrap().concat();
    assert_eq!(read, data[offset..offset + len]);
    let io = bio.io_slices(&buf).unwrap();
    assert_eq!(io.len(), bio.segments().len());
    assert_eq!(io.iter().map(|s| s.len()).sum::<usize>(), len);
    // Writable slices fill exactly the bio's range of the buffer.
    for s in bio.slices_mut(&mut buf).unwrap() {
        s.fill(0xa5);
    }
    let after = buf.to_vec();
    assert_eq!(after[..offset], data[..offset]);
    assert!(after[offset..offset + len].iter().all(|&b| b == 0xa5));
    assert_eq!(after[offset + len..], data[offset + len..]);
    let total: usize = bio
        .io_slices_mut(&mut buf)
        .unwrap()
        .iter()
        .map(|s| s.len())
        .sum();
    assert_eq!(total, len);
    bio.release(&alloc);
    drop(buf);
    assert_no_leaks(&alloc);
}

#[test]
fn a_bio_over_other_memory_or_overlapping_itself_gets_no_slices() {
    let alloc = builder(8).build().unwrap();
    let mut buf = alloc.alloc_buffer(Gfp::KERNEL, 4 * PAGE_SIZE, 0).unwrap();
    let stranger = alloc.folio_alloc(Gfp::KERNEL, 0).unwrap();
    // One segment in the buffer, one in a folio it does not own.
    let mut bio = Bio::new(BioLimits::default()).unwrap();
    bio.add_folio(buf.folios()[1], 0, 100).unwrap();
    bio.add_folio(stranger, 0, 100).unwrap();
    for e in [
        bio.slices(&buf).map(|_| ()).unwrap_err(),
        bio.slices_mut(&mut buf).map(|_| ()).unwrap_err(),
    ] {
        assert!(
            matches!(
                e,
                BioError::NotInBuffer {
                    index: 1,
                    len: 100,
                    ..
                }
            ),
            "{e}"
        );
    }
    bio.release(&alloc);
    // The same bytes twice: readable twice, never writable twice.
    let mut bio = Bio::new(BioLimits::default()).unwrap();
    let f = buf.folios()[2];
    bio.add_folio(f, 0, 100).unwrap();
    bio.add_folio(f, 50, 100).unwrap();
    assert_eq!(bio.slices(&buf).unwrap().len(), 2);
    let e = bio.slices_mut(&mut buf).map(|_| ()).unwrap_err();
    assert!(matches!(e, BioError::NotInBuffer { index: 1, .. }), "{e}");
    // Touching (not overlapping) segments are fine.
    let mut bio = Bio::new(BioLimits {
        max_segments: 4,
        max_segment_bytes: PAGE_SIZE,
    })
    .unwrap();
    bio.add_folio(f, 100, 100).unwrap();
    bio.add_folio(f, 0, 100).unwrap();
    assert_eq!(bio.slices_mut(&mut buf).unwrap().len(), 2);
    // A segment running past the buffer's last folio is refused.
    let last = *buf.folios().last().unwrap();
    let mut bio = Bio::new(BioLimits::default()).unwrap();
    bio.add_page(last.page(), PAGE_SIZE - 10, 10).unwrap();
    bio.add_page(Page::from_pfn(last.page().pfn() + 1), 0, 10)
        .unwrap();
    assert_eq!(bio.segments().len(), 1, "merged across the frame boundary");
    if buf
        .folios()
        .iter()
        .all(|f| f.page().pfn() != last.page().pfn() + 1)
    {
        assert!(bio.slices(&buf).is_err());
    }
    // SAFETY: the test allocated these pages and gives them up here, once.
    unsafe { alloc.folio_put(stranger) }.unwrap();
    drop(buf);
    assert_no_leaks(&alloc);
}
