//! Authenticated volumes over RAM disks that the tests tamper with: flips,
//! moves, rollbacks of one block, of its tags, of the whole store; lost
//! and stale state files; unclean stops; a cache far smaller than the tree.

use iopages_crypt::backend::{Backend, RamDisk};
use iopages_crypt::integrity::{AuthBackend, AuthOptions, Freshness, Keys, Layout, Mac, StateFile};
use iopages_testkit::TempDir;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

const B: usize = 4096;

struct Vol {
    data: Arc<RamDisk>,
    area: Arc<RamDisk>,
    layout: Layout,
    state: PathBuf,
    _dir: TempDir,
}

fn vol(mac: Mac, blocks: u64, name: &str) -> Vol {
    let layout = Layout::new(mac, blocks).unwrap();
    let data = Arc::new(RamDisk::new(layout.data_bytes()).unwrap());
    let area = Arc::new(RamDisk::new(layout.area_bytes()).unwrap());
    let dir = TempDir::new(name);
    let state = dir.join("vol.fresh");
    let keys = Keys::derive(mac, &[7; 64]).unwrap();
    let anchor = iopages_crypt::integrity::format_area(&*area, &layout, &keys, "uuid-1").unwrap();
    StateFile {
        anchor,
        clean: true,
    }
    .store(&state)
    .unwrap();
    Vol {
        data,
        area,
        layout,
        state,
        _dir: dir,
    }
}

fn opts(v: &Vol, cache: usize, reset: bool) -> AuthOptions {
    AuthOptions {
        uuid: "uuid-1".into(),
        freshness: Freshness {
            state: Some(v.state.clone()),
            reset,
        },
        cache_bytes: cache,
        read_only: false,
        name: "test".into(),
    }
}

fn open_with(v: &Vol, o: AuthOptions) -> io::Result<AuthBackend> {
    AuthBackend::open(
        v.data.clone() as Arc<dyn Backend>,
        v.area.clone() as Arc<dyn Backend>,
        v.layout.clone(),
        Keys::derive(v.layout.mac(), &[7; 64]).unwrap(),
        o,
    )
}

fn open(v: &Vol) -> AuthBackend {
    open_with(v, opts(v, 64 << 20, false)).unwrap()
}

fn pattern(block: u64, gen: u8) -> Vec<u8> {
    (0..B)
        .map(|i| (i as u64 * 31 + block * 7 + u64::from(gen)) as u8)
        .collect()
}

fn write(a: &AuthBackend, block: u64, gen: u8) {
    a.write_at(block * B as u64, &[&pattern(block, gen)])
        .unwrap();
}

fn read(a: &AuthBackend, block: u64) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; B];
    a.read_at(block * B as u64, &mut [&mut buf[..]])?;
    Ok(buf)
}

fn raw(d: &RamDisk, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    d.read_at(offset, &mut [&mut b[..]]).unwrap();
    b
}

fn snapshot(v: &Vol) -> (Vec<u8>, Vec<u8>) {
    (
        raw(&v.data, 0, v.layout.data_bytes() as usize),
        raw(&v.area, 0, v.layout.area_bytes() as usize),
    )
}

fn restore(v: &Vol, s: &(Vec<u8>, Vec<u8>)) {
    v.data.write_at(0, &[&s.0]).unwrap();
    v.area.write_at(0, &[&s.1]).unwrap();
}

fn refused(r: io::Result<Vec<u8>>) -> bool {
    matches!(r, Err(e) if e.kind() == io::ErrorKind::InvalidData && e.to_string().contains("integrity"))
}

#[test]
fn written_blocks_read_back_unwritten_and_discarded_read_as_zero_ciphertext() {
    for mac in [Mac::HmacSha256, Mac::Gmac] {
        let v = vol(mac, 300, "int-rt");
        let a = open(&v);
        assert_eq!(a.size_bytes(), 300 * B as u64);
        assert_eq!(read(&a, 5).unwrap(), vec![0u8; B]);
        for b in [0, 1, 63, 64, 200, 299] {
            write(&a, b, 1);
        }
        // One write spanning a tag-block boundary, in odd segments.
        let big: Vec<u8> = (60..68).flat_map(|b| pattern(b, 2)).collect();
        let (x, y) = big.split_at(6000);
        a.write_at(60 * B as u64, &[x, y]).unwrap();
        for b in 60..68 {
            assert_eq!(read(&a, b).unwrap(), pattern(b, 2), "{mac} {b}");
        }
        assert_eq!(read(&a, 200).unwrap(), pattern(200, 1));
        a.punch(200 * B as u64, B as u64).unwrap();
        assert_eq!(read(&a, 200).unwrap(), vec![0u8; B]);
        a.flush().unwrap();
        drop(a);
        let a = open(&v);
        assert_eq!(read(&a, 299).unwrap(), pattern(299, 1));
        assert_eq!(read(&a, 200).unwrap(), vec![0u8; B]);
        assert!(a.write_at(1, &[&[0u8; B]]).is_err(), "unaligned accepted");
        assert_eq!(a.stats().failures, 0);
    }
}

#[test]
fn flips_moves_and_forged_zeros_are_refused_and_only_their_blocks() {
    let v = vol(Mac::HmacSha256, 256, "int-flip");
    let a = open(&v);
    for b in 0..16 {
        write(&a, b, 1);
    }
    a.flush().unwrap();
    // Flip one bit of block 3's ciphertext.
    let mut c = raw(&v.data, 3 * B as u64, B);
    c[77] ^= 4;
    v.data.write_at(3 * B as u64, &[&c]).unwrap();
    // Move block 5's ciphertext over block 6.
    let c5 = raw(&v.data, 5 * B as u64, B);
    v.data.write_at(6 * B as u64, &[&c5]).unwrap();
    // Forge a discard: zero block 9's ciphertext.
    v.data.write_at(9 * B as u64, &[&vec![0u8; B]]).unwrap();
    for b in 0..16u64 {
        let r = read(&a, b);
        if [3, 6, 9].contains(&b) {
            assert!(refused(r), "block {b} not refused");
        } else {
            assert_eq!(r.unwrap(), pattern(b, 1), "block {b}");
        }
    }
    // A request covering a bad block fails as a whole; the error names it.
    let mut buf = vec![0u8; 8 * B];
    let e = a.read_at(0, &mut [&mut buf[..]]).unwrap_err();
    assert!(e.to_string().contains("3, 6"), "{e}");
    assert!(
        buf[3 * B..4 * B].iter().all(|&x| x == 0),
        "bad bytes left in the buffer"
    );
    let s = a.stats();
    assert_eq!((s.failures, s.bad_blocks), (4, 5));
}

#[test]
fn tags_altered_or_zeroed_on_the_store_are_caught_at_reload() {
    let v = vol(Mac::Gmac, 32 * 200, "int-tags");
    let a = open(&v);
    for b in (0..32 * 200).step_by(32) {
        write(&a, b, 1);
    }
    a.flush().unwrap();
    drop(a);
    // Zero the area's tag blocks except the superblocks: every loaded tag
    // block now mismatches its parent.
    let area = v.layout.area_bytes() as usize;
    v.area
        .write_at(2 * B as u64, &[&vec![0u8; area - 2 * B]])
        .unwrap();
    let a = open_with(&v, opts(&v, 64 << 20, false));
    match a {
        Err(e) => assert!(e.to_string().contains("rolled back or altered"), "{e}"),
        Ok(a) => assert!(refused(read(&a, 32))),
    }
}

#[test]
fn one_block_rolled_back_with_its_tag_is_caught() {
    let v = vol(Mac::HmacSha256, 128, "int-rb1");
    let a = open(&v);
    write(&a, 10, 1);
    write(&a, 11, 1);
    a.flush().unwrap();
    let old = snapshot(&v);
    write(&a, 10, 2);
    a.flush().unwrap();
    write(&a, 11, 2);
    a.flush().unwrap();
    drop(a);
    // The store serves block 10's older ciphertext and the whole older
    // tag block (the area as it was): the tree does not accept it.
    v.data
        .write_at(10 * B as u64, &[&old.0[10 * B..11 * B]])
        .unwrap();
    let slots = 2 * B..6 * B;
    v.area
        .write_at(slots.start as u64, &[&old.1[slots]])
        .unwrap();
    let a = open_with(&v, opts(&v, 64 << 20, false));
    match a {
        Err(e) => assert!(e.to_string().contains("integrity"), "{e}"),
        Ok(a) => assert!(refused(read(&a, 10)), "rolled-back block believed"),
    }
}

#[test]
fn a_whole_store_rolled_back_is_refused_at_open_and_reset_accepts_it() {
    let v = vol(Mac::HmacSha256, 100, "int-rbs");
    let a = open(&v);
    write(&a, 1, 1);
    a.flush().unwrap();
    let old = snapshot(&v);
    for g in 2..5 {
        write(&a, 1, g);
        a.flush().unwrap();
    }
    drop(a);
    restore(&v, &old);
    let e = open_with(&v, opts(&v, 64 << 20, false)).err().unwrap();
    assert!(e.to_string().contains("rolled back or altered"), "{e}");
    let a = open_with(&v, opts(&v, 64 << 20, true)).unwrap();
    assert_eq!(read(&a, 1).unwrap(), pattern(1, 1));
}

#[test]
fn a_lost_or_older_state_file_is_refused_with_a_way_out() {
    let v = vol(Mac::Gmac, 100, "int-state");
    let a = open(&v);
    write(&a, 1, 1);
    a.flush().unwrap();
    drop(a);
    let old_state = std::fs::read(&v.state).unwrap();
    let a = open(&v);
    for g in 2..4 {
        write(&a, 1, g);
        a.flush().unwrap();
    }
    drop(a);
    std::fs::write(&v.state, &old_state).unwrap();
    let e = open_with(&v, opts(&v, 64 << 20, false)).err().unwrap();
    assert!(e.to_string().contains("older than the store"), "{e}");
    std::fs::remove_file(&v.state).unwrap();
    let e = open_with(&v, opts(&v, 64 << 20, false)).err().unwrap();
    assert!(e.to_string().contains("no freshness state file"), "{e}");
    let a = open_with(&v, opts(&v, 64 << 20, true)).unwrap();
    assert_eq!(read(&a, 1).unwrap(), pattern(1, 3));
    drop(a);
    // The reset made a state file; the next open needs no reset.
    let a = open(&v);
    assert_eq!(read(&a, 1).unwrap(), pattern(1, 3));
}

#[test]
fn after_an_unclean_stop_unflushed_blocks_read_old_or_new_and_flushed_ones_stay() {
    let v = vol(Mac::HmacSha256, 256, "int-crash");
    let a = open(&v);
    for b in 0..8 {
        write(&a, b, 1);
    }
    a.flush().unwrap();
    let flushed = snapshot(&v);
    for b in 0..4 {
        write(&a, b, 2);
    }
    write(&a, 100, 2);
    // Killed: no close, no last commit.
    std::mem::forget(a);
    assert!(!StateFile::load(&v.state).unwrap().unwrap().clean);
    // The store kept block 1's old data (its new write never landed).
    v.data.write_at(B as u64, &[&flushed.0[B..2 * B]]).unwrap();
    let a = open(&v);
    assert!(a.stats().recovered >= 4, "{:?}", a.stats());
    assert_eq!(read(&a, 0).unwrap(), pattern(0, 2));
    assert_eq!(
        read(&a, 1).unwrap(),
        pattern(1, 1),
        "old data is the old version"
    );
    assert_eq!(read(&a, 2).unwrap(), pattern(2, 2));
    assert_eq!(read(&a, 100).unwrap(), pattern(100, 2));
    for b in 4..8 {
        assert_eq!(read(&a, b).unwrap(), pattern(b, 1));
    }
    assert_eq!(a.stats().failures, 0);
    drop(a);
    assert!(StateFile::load(&v.state).unwrap().unwrap().clean);
}

#[test]
fn a_cache_smaller_than_the_tree_evicts_writes_back_and_still_verifies() {
    // 64 Ki blocks: 1024 tag blocks and 8 interior nodes; a cache of 16
    // nodes holds a sliver of it.
    let n = 64 * 1024u64;
    let v = vol(Mac::Gmac, n, "int-evict");
    let a = open_with(&v, opts(&v, 16 * B, false)).unwrap();
    let blocks: Vec<u64> = (0..400).map(|i| (i * 2654435761u64) % n).collect();
    for (i, &b) in blocks.iter().enumerate() {
        write(&a, b, i as u8);
        assert!(a.cached_nodes() <= 16 + 4 * 3, "{}", a.cached_nodes());
        if i == 200 {
            a.flush().unwrap();
        }
    }
    let last = |b: u64| blocks.iter().rposition(|&x| x == b).unwrap() as u8;
    for &b in &blocks {
        assert_eq!(read(&a, b).unwrap(), pattern(b, last(b)), "block {b}");
    }
    a.flush().unwrap();
    drop(a);
    let a = open_with(&v, opts(&v, 16 * B, false)).unwrap();
    for &b in &blocks {
        assert_eq!(
            read(&a, b).unwrap(),
            pattern(b, last(b)),
            "block {b} after reopen"
        );
    }
    assert!(a.stats().node_reads > 0);
}

#[test]
fn concurrent_writers_and_readers_never_see_a_false_failure() {
    let v = vol(Mac::Gmac, 512, "int-mt");
    let a = Arc::new(open_with(&v, opts(&v, 8 * B, false)).unwrap());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                for i in 0..300u64 {
                    let b = (i * 7 + t * 131) % 512;
                    if (i + t) % 3 == 0 {
                        let _ = read(&a, b).unwrap();
                    } else {
                        write(&a, b, (i % 200) as u8);
                    }
                    if i % 97 == 0 {
                        a.flush().unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(a.stats().failures, 0);
}

/// A store that can lose writes (a reconnect that dropped what it had not
/// flushed) and then fail the next flush, as the remote store's contract
/// says it does.
struct Lossy {
    inner: Arc<RamDisk>,
    lose: std::sync::atomic::AtomicBool,
    fail_flush: std::sync::atomic::AtomicBool,
}

impl Backend for Lossy {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        if self.lose.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(()); // acknowledged, then lost
        }
        self.inner.write_at(offset, segments)
    }
    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        self.inner.read_at(offset, segments)
    }
    fn flush(&self) -> io::Result<()> {
        if self
            .fail_flush
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(io::Error::other(
                "the store lost writes no flush had covered",
            ));
        }
        self.inner.flush()
    }
}

#[test]
fn a_store_that_loses_writes_fails_the_flush_and_blocks_read_old_or_new_after() {
    use std::sync::atomic::Ordering::SeqCst;
    let v = vol(Mac::HmacSha256, 256, "int-lossy");
    let lossy = |d: &Arc<RamDisk>| {
        Arc::new(Lossy {
            inner: Arc::clone(d),
            lose: false.into(),
            fail_flush: false.into(),
        })
    };
    let (data, area) = (lossy(&v.data), lossy(&v.area));
    let a = AuthBackend::open(
        data.clone(),
        area.clone(),
        v.layout.clone(),
        Keys::derive(Mac::HmacSha256, &[7; 64]).unwrap(),
        opts(&v, 64 << 20, false),
    )
    .unwrap();
    write(&a, 1, 1);
    write(&a, 70, 1);
    a.flush().unwrap();
    write(&a, 70, 2); // kept by the store
    data.lose.store(true, SeqCst);
    area.lose.store(true, SeqCst);
    write(&a, 1, 2); // lost: neither its data nor its tag block lands
    data.lose.store(false, SeqCst);
    area.lose.store(false, SeqCst);
    data.fail_flush.store(true, SeqCst);
    assert!(a.flush().is_err(), "a flush after lost writes must fail");
    // The next request sweeps: block 1 is its old data, block 70 its new.
    assert_eq!(read(&a, 1).unwrap(), pattern(1, 1));
    assert_eq!(read(&a, 70).unwrap(), pattern(70, 2));
    a.flush().unwrap();
    drop(a);
    let a = open(&v);
    assert_eq!(read(&a, 1).unwrap(), pattern(1, 1));
    assert_eq!(read(&a, 70).unwrap(), pattern(70, 2));
    assert_eq!(a.stats().failures, 0);
}

#[test]
fn holes_are_the_blocks_whose_tags_say_zeros() {
    use iopages_crypt::backend::Extent;
    let v = vol(Mac::Gmac, 200, "int-holes");
    let a = open(&v);
    for b in [3, 4, 5, 70] {
        write(&a, b, 1);
    }
    a.punch(4 * B as u64, B as u64).unwrap();
    let e = |len: u64, hole: bool| Extent {
        len_bytes: len * B as u64,
        hole,
    };
    let all = a.extents(0, 200 * B as u64, 100).unwrap();
    assert_eq!(
        all,
        vec![
            e(3, true),
            e(1, false),
            e(1, true),
            e(1, false),
            e(64, true),
            e(1, false),
            e(129, true)
        ]
    );
    // A range starting mid-block, and the extent cap.
    let part = a.extents(3 * B as u64 + 100, 2 * B as u64, 2).unwrap();
    assert_eq!(
        part,
        vec![
            Extent {
                len_bytes: B as u64 - 100,
                hole: false
            },
            Extent {
                len_bytes: B as u64,
                hole: true
            }
        ]
    );
    assert_eq!(a.extents(0, 200 * B as u64, 2).unwrap().len(), 2);
}

/// Two writes to one block after the last flush, then a stop between the
/// second write's tag (on the store) and its data (not): the store holds
/// the first write's data beside the second's tag. The block reads as
/// that first write — a version written since the flush — not EIO.
#[test]
fn a_stop_between_a_second_writes_tag_and_data_keeps_the_first() {
    for mac in [Mac::HmacSha256, Mac::Gmac] {
        let v = vol(mac, 256, "int-second");
        let a = open(&v);
        write(&a, 40, 1);
        a.flush().unwrap();
        write(&a, 40, 2);
        let second = raw(&v.data, 40 * B as u64, B);
        write(&a, 40, 3);
        std::mem::forget(a);
        // Write 3's data never landed.
        v.data.write_at(40 * B as u64, &[&second]).unwrap();
        let a = open(&v);
        assert_eq!(read(&a, 40).unwrap(), pattern(40, 2), "{mac}");
        assert_eq!(a.stats().failures, 0);
        drop(a);
        let a = open(&v);
        assert_eq!(
            read(&a, 40).unwrap(),
            pattern(40, 2),
            "{mac} after the next open"
        );
    }
}

/// A read whose tag block fails the tree is refused, counted and logged
/// as a bad tag is.
#[test]
fn a_tag_block_that_fails_the_tree_is_counted() {
    let v = vol(Mac::Gmac, 32 * 8, "int-treefail");
    let a = open(&v);
    write(&a, 33, 1);
    a.flush().unwrap();
    drop(a);
    // Flip a byte of tag block 1 in both its slots (a level's slot 0
    // copies, then its slot 1 copies: see Layout::node_block).
    let (n0, base) = (v.layout.nodes(0), 2u64);
    for slot in 0..2 {
        let at = (base + slot * n0 + 1) * B as u64 + 10;
        let mut b = raw(&v.area, at, 1);
        b[0] ^= 0x40;
        v.area.write_at(at, &[&b]).unwrap();
    }
    let a = open(&v);
    assert!(refused(read(&a, 33)));
    assert!(refused(read(&a, 40)), "an unwritten block under it too");
    assert_eq!(read(&a, 5).unwrap(), vec![0u8; B]);
    let s = a.stats();
    assert_eq!((s.failures, s.bad_blocks), (2, 2));
}

/// Writes to the same blocks from several threads at once (two
/// connections writing one block: undefined which lands, but it must be
/// one of them): every block verifies afterwards, and after a reopen.
/// A store whose writes take a varying while (so two writers' data can
/// overtake each other).
struct Jittery(Arc<RamDisk>, std::sync::atomic::AtomicU64);

impl Backend for Jittery {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let n = self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_micros((n * 7919) % 300));
        self.0.write_at(offset, segments)
    }
    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        self.0.read_at(offset, segments)
    }
    fn flush(&self) -> io::Result<()> {
        self.0.flush()
    }
}

#[test]
fn concurrent_writes_to_the_same_blocks_leave_each_one_of_them() {
    let v = vol(Mac::HmacSha256, 96, "int-overlap");
    let a = AuthBackend::open(
        Arc::new(Jittery(v.data.clone(), 0.into())),
        Arc::new(Jittery(v.area.clone(), 3.into())),
        v.layout.clone(),
        Keys::derive(Mac::HmacSha256, &[7; 64]).unwrap(),
        opts(&v, 64 << 20, false),
    )
    .unwrap();
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let b = (i * 5 + u64::from(t)) % 8 + 30;
                    // One block, or a pair across the tag-block boundary.
                    let n = if i % 3 == 0 { 2 } else { 1 };
                    let buf: Vec<u8> = (b..b + n).flat_map(|x| pattern(x, t)).collect();
                    a.write_at(b * B as u64, &[&buf]).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let check = |a: &AuthBackend| {
        for b in 30..39 {
            let got = read(a, b).expect("a block written concurrently failed");
            assert!((0..4).any(|t| got == pattern(b, t)), "block {b}");
        }
    };
    check(&a);
    a.flush().unwrap();
    drop(a);
    check(&open(&v));
}
