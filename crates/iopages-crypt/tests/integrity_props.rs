//! A model of an authenticated volume under random operations — writes,
//! discards, flushes, unclean stops (the backend dropped without its last
//! commit) and clean reopens — with a cache far smaller than the tree:
//! every read returns the block's last write, and after an unclean stop
//! a block reads as its version at the last flush or as one written after
//! it; never a failure, never other bytes.

use iopages_crypt::backend::{Backend, RamDisk};
use iopages_crypt::integrity::{AuthBackend, AuthOptions, Freshness, Keys, Layout, Mac, StateFile};
use iopages_testkit::TempDir;
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

const BLOCKS: u64 = 64 * 40; // 40 tag blocks, two tree levels
const B: usize = 4096;

#[derive(Clone, Debug)]
enum Op {
    Write { block: u64, count: u64, gen: u8 },
    Discard { block: u64 },
    Flush,
    Crash,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..BLOCKS, 1..4u64, any::<u8>()).prop_map(|(block, count, gen)| Op::Write { block, count, gen }),
        1 => (0..BLOCKS).prop_map(|block| Op::Discard { block }),
        2 => Just(Op::Flush),
        1 => Just(Op::Crash),
        1 => Just(Op::Reopen),
    ]
}

/// What a block may read as: `None` is zeros.
type Version = Option<(u64, u8)>;

fn bytes(v: Version) -> Vec<u8> {
    match v {
        None => vec![0u8; B],
        Some((block, gen)) => (0..B)
            .map(|i| (i as u64 ^ block.wrapping_mul(31) ^ (u64::from(gen) * 7)) as u8)
            .collect(),
    }
}

struct World {
    data: Arc<RamDisk>,
    area: Arc<RamDisk>,
    layout: Layout,
    state: std::path::PathBuf,
    _dir: TempDir,
}

impl World {
    fn open(&self) -> AuthBackend {
        AuthBackend::open(
            self.data.clone(),
            self.area.clone(),
            self.layout.clone(),
            Keys::derive(self.layout.mac(), &[5; 32]).unwrap(),
            AuthOptions {
                uuid: "props".into(),
                freshness: Freshness {
                    state: Some(self.state.clone()),
                    reset: false,
                },
                cache_bytes: 12 * B,
                name: "props".into(),
                ..AuthOptions::default()
            },
        )
        .unwrap()
    }
}

fn world(mac: Mac) -> World {
    let layout = Layout::new(mac, BLOCKS).unwrap();
    let data = Arc::new(RamDisk::new(layout.data_bytes()).unwrap());
    let area = Arc::new(RamDisk::new(layout.area_bytes()).unwrap());
    let dir = TempDir::new("int-props");
    let state = dir.join("s");
    let keys = Keys::derive(mac, &[5; 32]).unwrap();
    let anchor = iopages_crypt::integrity::format_area(&*area, &layout, &keys, "props").unwrap();
    StateFile {
        anchor,
        clean: true,
    }
    .store(&state)
    .unwrap();
    World {
        data,
        area,
        layout,
        state,
        _dir: dir,
    }
}

/// Each block's version at the last flush, and the versions written since.
#[derive(Default)]
struct Model {
    flushed: HashMap<u64, Version>,
    since: HashMap<u64, Vec<Version>>,
}

impl Model {
    fn put(&mut self, block: u64, v: Version) {
        self.since.entry(block).or_default().push(v);
    }
    fn current(&self, block: u64) -> Version {
        match self.since.get(&block).and_then(|v| v.last()) {
            Some(v) => *v,
            None => self.flushed.get(&block).copied().flatten(),
        }
    }
    fn flush(&mut self) {
        for (b, v) in self.since.drain() {
            self.flushed.insert(b, *v.last().unwrap());
        }
    }
    /// After an unclean stop: read what each touched block became, and
    /// check it is one of the allowed versions.
    fn settle(&mut self, a: &AuthBackend) -> Result<(), TestCaseError> {
        let touched: Vec<u64> = self.since.keys().copied().collect();
        for b in touched {
            let got = read(a, b)?;
            let mut allowed = vec![self.flushed.get(&b).copied().flatten()];
            allowed.extend(self.since[&b].iter().copied());
            let v = allowed.iter().find(|v| bytes(**v) == got);
            prop_assert!(v.is_some(), "block {} read as none of its versions", b);
            self.flushed.insert(b, *v.unwrap());
        }
        self.since.clear();
        Ok(())
    }
}

fn read(a: &AuthBackend, block: u64) -> Result<Vec<u8>, TestCaseError> {
    let mut buf = vec![0u8; B];
    let r = a.read_at(block * B as u64, &mut [&mut buf[..]]);
    prop_assert!(r.is_ok(), "block {} refused: {:?}", block, r.err());
    Ok(buf)
}

fn apply(
    w: &World,
    slot: &mut Option<AuthBackend>,
    m: &mut Model,
    op: &Op,
) -> Result<(), TestCaseError> {
    let a = slot.as_ref().expect("open");
    match *op {
        Op::Write { block, count, gen } => {
            let n = count.min(BLOCKS - block);
            let buf: Vec<u8> = (block..block + n)
                .flat_map(|b| bytes(Some((b, gen))))
                .collect();
            a.write_at(block * B as u64, &[&buf]).unwrap();
            for b in block..block + n {
                m.put(b, Some((b, gen)));
            }
        }
        Op::Discard { block } => {
            a.punch(block * B as u64, B as u64).unwrap();
            m.put(block, None);
        }
        Op::Flush => {
            a.flush().unwrap();
            m.flush();
        }
        Op::Crash => {
            // Killed: no last commit, the state file still says open.
            std::mem::forget(slot.take());
            let a = slot.insert(w.open());
            m.settle(a)?;
        }
        Op::Reopen => {
            drop(slot.take()); // a clean stop commits
            *slot = Some(w.open());
            m.flush();
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn reads_are_the_last_write_and_unclean_stops_keep_old_or_new(
        ops in proptest::collection::vec(op(), 1..60),
        gmac in any::<bool>(),
    ) {
        let w = world(if gmac { Mac::Gmac } else { Mac::HmacSha256 });
        let mut slot = Some(w.open());
        let mut m = Model::default();
        for op in &ops {
            apply(&w, &mut slot, &mut m, op)?;
        }
        let a = slot.take().expect("open");
        let mut blocks: Vec<u64> = m.flushed.keys().chain(m.since.keys()).copied().collect();
        blocks.extend([0, BLOCKS - 1]);
        for b in blocks {
            prop_assert_eq!(read(&a, b)?, bytes(m.current(b)), "block {}", b);
        }
        prop_assert_eq!(a.stats().failures, 0);
    }
}
