//! [`AuthBackend`]: a backend whose every block is authenticated and
//! fresh, over a data backend and an integrity area.
//!
//! Owns: sealing each written block (MAC outside any lock), the write's
//! order (data, then its tag blocks written through under a per-block
//! order), verifying each read block against its tag (a block that fails
//! is refused with `InvalidData` — EIO to a client — counted and logged
//! once per request with its block numbers, and never returned), discards
//! as authenticated zero tags, and the flush that commits the tree and
//! writes the anchors (state file first, then the store's superblock).
//! Must never: return bytes whose tag does not verify, let a commit see a
//! write half done (writes hold the epoch gate shared, the commit holds it
//! exclusively), or write to the store before the state file says the
//! session is open.

use super::layout::{Layout, Record, BLOCK, RECORDS_PER_BLOCK};
use super::mac::Keys;
use super::state::{self, Anchor, StateFile};
use super::tree::{altered, Tree, WriteThrough};
use crate::backend::{check_range, push_extent, Backend, Extent};
use parking_lot::{Mutex, RwLock};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Where the volume's freshness is anchored.
#[derive(Clone, Debug, Default)]
pub struct Freshness {
    /// The local state file (`serve --freshness FILE`). `None`: only a
    /// read-only open, which trusts the store's newest superblock (it
    /// catches flips and moves, not a rollback).
    pub state: Option<PathBuf>,
    /// Accept the store's current tree as fresh (`--freshness-reset`):
    /// for a lost state file, or one older than the store.
    pub reset: bool,
}

/// How an [`AuthBackend`] is opened.
#[derive(Clone, Debug)]
pub struct AuthOptions {
    /// The LUKS UUID of the volume (binds the anchors to it).
    pub uuid: String,
    /// The freshness anchor.
    pub freshness: Freshness,
    /// Bytes of tree nodes kept in memory (default 64 MiB).
    pub cache_bytes: usize,
    /// Refuse writes and never write the store or the state file.
    pub read_only: bool,
    /// A name for log lines (the export).
    pub name: String,
}

impl Default for AuthOptions {
    fn default() -> Self {
        AuthOptions {
            uuid: String::new(),
            freshness: Freshness::default(),
            cache_bytes: 64 << 20,
            read_only: false,
            name: String::from("volume"),
        }
    }
}

/// What an [`AuthBackend`] has counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuthStats {
    /// Reads refused because a block failed verification.
    pub failures: u64,
    /// Blocks that failed verification.
    pub bad_blocks: u64,
    /// Commits that wrote a new root.
    pub commits: u64,
    /// Tags taken from writes after the last commit by a sweep.
    pub recovered: u64,
    /// Tree nodes read from the store.
    pub node_reads: u64,
    /// Tree nodes written to the store (tag blocks included).
    pub node_writes: u64,
    /// The epoch being written.
    pub epoch: u64,
}

/// An authenticated, fresh view of a data backend.
pub struct AuthBackend {
    data: Arc<dyn Backend>,
    area: Arc<dyn Backend>,
    keys: Keys,
    layout: Layout,
    gate: RwLock<()>,
    /// Write order per tag block (its number modulo the stripes): a
    /// write holds its tag blocks' stripes from its tags to its data.
    stripes: Box<[Mutex<()>]>,
    tree: Mutex<Tree>,
    anchor: Mutex<AnchorState>,
    epoch: AtomicU64,
    broken: AtomicBool,
    /// Set once `open` has succeeded: only then does drop commit.
    opened: AtomicBool,
    opts: AuthOptions,
    failures: AtomicU64,
    bad_blocks: AtomicU64,
    commits: AtomicU64,
    recovered: AtomicU64,
    tag_writes: AtomicU64,
}

/// The anchors' bookkeeping: the volume's identity and where the next
/// superblock goes.
struct AnchorState {
    volume: [u8; 32],
    next_sb: u8,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl AuthBackend {
    /// Open the authenticated volume whose data is `data` and whose
    /// integrity area is `area`: find the anchor (state file, or the
    /// store's superblock), check the store's root against it, recover
    /// after an unclean stop, and mark the session open in the state file.
    ///
    /// **Returns:** `InvalidData` with the reason when the store does not
    /// match the anchor (rolled back, altered, another volume) or the
    /// state file is missing or older than the store; `InvalidInput` when
    /// the backends are too small for `layout`.
    pub fn open(
        data: Arc<dyn Backend>,
        area: Arc<dyn Backend>,
        layout: Layout,
        keys: Keys,
        opts: AuthOptions,
    ) -> io::Result<AuthBackend> {
        if data.size_bytes() < layout.data_bytes() || area.size_bytes() < layout.area_bytes() {
            return Err(invalid(format!(
                "integrity: the volume needs {} data bytes and {} area bytes, {} and {} given",
                layout.data_bytes(),
                layout.area_bytes(),
                data.size_bytes(),
                area.size_bytes()
            )));
        }
        let volume = state::volume_id(&opts.uuid);
        let sbs = read_superblocks(&*area, &keys)?;
        let (anchor, clean) = choose_anchor(&opts, &layout, volume, &sbs)?;
        let tree = Tree::new(
            layout.clone(),
            Arc::clone(&area),
            anchor.root,
            anchor.epoch,
            opts.cache_bytes,
            !opts.read_only,
        );
        let newest_sb = sbs.iter().flatten().map(|a| a.epoch).max();
        let next_sb = match (&sbs[0], &sbs[1]) {
            (Some(a), Some(b)) if a.epoch >= b.epoch => 1,
            (Some(_), None) => 1,
            _ => 0,
        };
        let me = AuthBackend {
            data,
            area,
            keys,
            layout,
            gate: RwLock::new(()),
            stripes: (0..256).map(|_| Mutex::new(())).collect(),
            tree: Mutex::new(tree),
            anchor: Mutex::new(AnchorState { volume, next_sb }),
            epoch: AtomicU64::new(anchor.epoch + 1),
            broken: AtomicBool::new(false),
            opened: AtomicBool::new(false),
            opts,
            failures: AtomicU64::new(0),
            bad_blocks: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            recovered: AtomicU64::new(0),
            tag_writes: AtomicU64::new(0),
        };
        me.check_root(&anchor, newest_sb)?;
        if !me.opts.read_only {
            me.write_state(&anchor, false)?;
            if !clean {
                me.recover()?;
            }
        } else if !clean {
            return Err(altered(format!(
                "integrity: {} was not stopped cleanly: serve it once (or open it writable) \
                 to take its last writes before checking it read-only",
                me.opts.name
            )));
        }
        me.opened.store(true, Ordering::Release);
        Ok(me)
    }

    /// Check that the store's root matches the anchor.
    fn check_root(&self, anchor: &Anchor, newest_sb: Option<u64>) -> io::Result<()> {
        if let Some(sb) = newest_sb.filter(|&e| e > anchor.epoch) {
            return Err(altered(format!(
                "integrity: the freshness state is older than the store: the store holds a tree \
                 committed in epoch {sb}, the state file names epoch {} (a state file restored \
                 from a backup, or another host wrote the volume); refusing to serve older data — \
                 --freshness-reset accepts the store's tree",
                anchor.epoch
            )));
        }
        let mut t = self.tree.lock();
        let depth = t.layout().depth();
        match t.records(0, 1) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => Err(altered(format!(
                "integrity: the store does not hold the tree the freshness state names (epoch {}, \
                 {depth} levels): it was rolled back or altered ({e})",
                anchor.epoch
            ))),
            Err(e) => Err(e),
        }
    }

    /// The layout served.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// What has been counted so far.
    pub fn stats(&self) -> AuthStats {
        let t = self.tree.lock();
        AuthStats {
            failures: self.failures.load(Ordering::Relaxed),
            bad_blocks: self.bad_blocks.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Relaxed),
            recovered: self.recovered.load(Ordering::Relaxed),
            node_reads: t.reads,
            node_writes: t.writes + self.tag_writes.load(Ordering::Relaxed),
            epoch: t.epoch,
        }
    }

    /// Nodes cached now (never more than the bound and one path).
    pub fn cached_nodes(&self) -> usize {
        self.tree.lock().cached()
    }

    fn write_state(&self, anchor: &Anchor, clean: bool) -> io::Result<()> {
        let Some(path) = &self.opts.freshness.state else {
            return Ok(());
        };
        StateFile {
            anchor: anchor.clone(),
            clean,
        }
        .store(path)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "integrity: cannot write the freshness state {}: {e}",
                    path.display()
                ),
            )
        })
    }

    /// Sweep every tag block for writes after the last commit, then commit.
    fn recover(&self) -> io::Result<()> {
        let _g = self.gate.write();
        let mut t = self.tree.lock();
        t.rewind();
        let blocks = self.layout.nodes(0);
        eprintln!(
            "iopages: integrity: {}: not stopped cleanly; checking the writes after epoch {} \
             ({blocks} tag blocks)",
            self.opts.name, t.committed
        );
        let (mut taken, mut newest) = (0, 0);
        let (t0, mut shown) = (std::time::Instant::now(), std::time::Instant::now());
        let mut at = 0;
        while at < blocks {
            let end = (at + 1024).min(blocks);
            let (n, e) = t.sweep(&self.keys, &*self.data, at..end)?;
            (taken, newest) = (taken + n, newest.max(e));
            at = end;
            if shown.elapsed().as_secs() >= 1 {
                shown = std::time::Instant::now();
                eprintln!(
                    "iopages: integrity: {}: swept {at} of {blocks} tag blocks ({:.0} s)",
                    self.opts.name,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        t.epoch = t.epoch.max(newest + 1);
        self.epoch.store(t.epoch, Ordering::Release);
        self.recovered.fetch_add(taken, Ordering::Relaxed);
        eprintln!(
            "iopages: integrity: {}: kept {taken} blocks written after the last flush",
            self.opts.name
        );
        self.commit_locked(&mut t)?;
        self.broken.store(false, Ordering::Release);
        Ok(())
    }

    /// Commit with the gate held exclusively and the tree locked.
    fn commit_locked(&self, t: &mut Tree) -> io::Result<()> {
        let Some(root) = t.commit(&*self.data)? else {
            return Ok(());
        };
        let mut a = self.anchor.lock();
        let anchor = Anchor {
            mac: self.layout.mac(),
            data_blocks: self.layout.data_blocks(),
            volume: a.volume,
            epoch: t.epoch,
            root,
        };
        self.write_state(&anchor, false)?;
        t.advance();
        self.epoch.store(t.epoch, Ordering::Release);
        self.commits.fetch_add(1, Ordering::Relaxed);
        // The superblock only explains a mismatch later; it is flushed by
        // the next commit, and one lost is one commit behind.
        let sb = state::encode_superblock(&anchor, &self.keys)?;
        self.area.write_at(u64::from(a.next_sb) * BLOCK, &[&sb])?;
        a.next_sb ^= 1;
        Ok(())
    }

    /// Commit, and mark the state file clean: nothing is written after
    /// this until the next write.
    pub fn close(&self) -> io::Result<()> {
        if self.opts.read_only || !self.opened.load(Ordering::Acquire) {
            return Ok(());
        }
        self.flush()?;
        let _g = self.gate.write();
        let t = self.tree.lock();
        let a = self.anchor.lock();
        let anchor = Anchor {
            mac: self.layout.mac(),
            data_blocks: self.layout.data_blocks(),
            volume: a.volume,
            epoch: t.committed,
            root: t.committed_root,
        };
        self.write_state(&anchor, true)
    }

    fn check_io(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.layout.data_bytes())?;
        if !offset.is_multiple_of(BLOCK) || !len.is_multiple_of(BLOCK) {
            return Err(invalid(format!(
                "integrity: I/O must be whole 4096-byte blocks ({len} bytes at {offset})"
            )));
        }
        if self.broken.load(Ordering::Acquire) {
            self.recover()?;
        }
        Ok(())
    }

    /// Put `records` (one per block from `first`) into the tree and write
    /// their tag blocks through; each tag block touched stays marked in
    /// flight (pushed on `touched`) until [`AuthBackend::release`].
    fn put_records(
        &self,
        first: u64,
        records: &[Record],
        touched: &mut Vec<(u64, u64)>,
    ) -> io::Result<()> {
        let mut wts: Vec<WriteThrough> = Vec::new();
        {
            let mut t = self.tree.lock();
            t.make_room()?;
            let mut at = 0usize;
            while at < records.len() {
                let block = first + at as u64;
                let n = ((RECORDS_PER_BLOCK - block % RECORDS_PER_BLOCK) as usize)
                    .min(records.len() - at);
                let wt = match t.update(block, &records[at..at + n]) {
                    Ok(wt) => wt,
                    Err(e) => {
                        // Those updated already are not written through.
                        for w in &wts {
                            t.mark_stale(w.tb);
                        }
                        return Err(e);
                    }
                };
                touched.push((block / RECORDS_PER_BLOCK, wt.id));
                wts.push(wt);
                at += n;
            }
        }
        let failed = self.write_through(&wts);
        if failed.is_empty() {
            return Ok(());
        }
        let mut t = self.tree.lock();
        for (tb, _) in &failed {
            t.mark_stale(*tb);
        }
        Err(failed.into_iter().next().expect("one").1)
    }

    /// Write the tag blocks `wts` (ascending) to the store, a run of
    /// adjacent ones in one write, skipping any whose newer copy another
    /// write already wrote (each block's order is its `io` lock, taken in
    /// ascending order).
    ///
    /// **Returns:** the tag blocks whose write failed, with the error.
    fn write_through(&self, wts: &[WriteThrough]) -> Vec<(u64, io::Error)> {
        let mut guards: Vec<_> = wts.iter().map(|w| w.io.lock()).collect();
        let mut runs: Vec<(u64, Vec<usize>)> = Vec::new();
        for (i, w) in wts.iter().enumerate() {
            if *guards[i] >= w.seq {
                continue; // a newer copy of the block is already written
            }
            match runs.last_mut() {
                Some((at, idx)) if *at + idx.len() as u64 * BLOCK == w.block => idx.push(i),
                _ => runs.push((w.block, vec![i])),
            }
        }
        let mut failed = Vec::new();
        for (at, idx) in runs {
            let segs: Vec<&[u8]> = idx.iter().map(|&i| &wts[i].data[..]).collect();
            match self.area.write_at(at, &segs) {
                Ok(()) => {
                    for &i in &idx {
                        *guards[i] = wts[i].seq;
                    }
                    self.tag_writes
                        .fetch_add(idx.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    let msg = e.to_string();
                    for &i in &idx {
                        failed.push((wts[i].tb, io::Error::new(e.kind(), msg.clone())));
                    }
                }
            }
        }
        failed
    }

    /// Lock the write-order stripes of the tag blocks that blocks
    /// `first..first + count` fall in (ascending, each once).
    fn lock_stripes(&self, first: u64, count: u64) -> Vec<parking_lot::MutexGuard<'_, ()>> {
        let (a, b) = (
            first / RECORDS_PER_BLOCK,
            (first + count.max(1) - 1) / RECORDS_PER_BLOCK,
        );
        let n = self.stripes.len() as u64;
        let mut idx: Vec<usize> = (a..=b.min(a + n - 1)).map(|tb| (tb % n) as usize).collect();
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| self.stripes[i].lock()).collect()
    }

    /// The writes through `touched` tag blocks are over.
    fn release(&self, touched: &[(u64, u64)]) {
        let mut t = self.tree.lock();
        for &(tb, id) in touched {
            t.done(tb, id);
        }
    }

    /// The records of blocks `first..first + count`, each with the one it
    /// replaced while a write to it is in flight.
    fn get_records(&self, first: u64, count: usize) -> io::Result<Vec<(Record, Option<Record>)>> {
        let mut out = Vec::with_capacity(count);
        let mut t = self.tree.lock();
        t.make_room()?;
        while out.len() < count {
            let block = first + out.len() as u64;
            let n =
                ((RECORDS_PER_BLOCK - block % RECORDS_PER_BLOCK) as usize).min(count - out.len());
            out.extend(t.records(block, n)?);
        }
        Ok(out)
    }

    /// Report blocks that failed (`tree`: because their tag block or a
    /// node above it did not verify): counted, logged once per request.
    fn refuse(&self, bad: &[u64], tree: Option<&io::Error>) -> io::Error {
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.bad_blocks
            .fetch_add(bad.len() as u64, Ordering::Relaxed);
        let ranges = block_ranges(bad);
        let why = match tree {
            Some(e) => format!(" ({e})"),
            None => String::new(),
        };
        eprintln!(
            "iopages: integrity: {}: {} block(s) failed verification ({ranges}; 4096-byte blocks \
             of the volume){why}: the read is refused",
            self.opts.name,
            bad.len()
        );
        altered(format!(
            "integrity: {} block(s) failed verification: {ranges}{why}",
            bad.len()
        ))
    }
}

/// `3-5, 9` for blocks 3, 4, 5, 9 (sorted input): how block numbers are
/// shown in messages.
pub fn block_ranges(bad: &[u64]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < bad.len() {
        let mut j = i;
        while j + 1 < bad.len() && bad[j + 1] == bad[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            bad[i].to_string()
        } else {
            format!("{}-{}", bad[i], bad[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// Both superblocks, each if it is this volume's and verifies.
fn read_superblocks(area: &dyn Backend, keys: &Keys) -> io::Result<[Option<Anchor>; 2]> {
    let mut b = vec![0u8; 2 * BLOCK as usize];
    area.read_at(0, &mut [&mut b[..]])?;
    let (a, c) = b.split_at(BLOCK as usize);
    Ok([
        state::decode_superblock(a, keys),
        state::decode_superblock(c, keys),
    ])
}

/// The anchor to trust, and whether the last session stopped cleanly.
fn choose_anchor(
    opts: &AuthOptions,
    layout: &Layout,
    volume: [u8; 32],
    sbs: &[Option<Anchor>; 2],
) -> io::Result<(Anchor, bool)> {
    let ours = |a: &Anchor| {
        a.volume == volume && a.data_blocks == layout.data_blocks() && a.mac == layout.mac()
    };
    let newest = sbs
        .iter()
        .flatten()
        .filter(|a| ours(a))
        .max_by_key(|a| a.epoch)
        .cloned();
    let store = || {
        newest.clone().ok_or_else(|| {
            altered(
                "integrity: the store holds no valid superblock for this volume (altered, or \
                 not an authenticated volume's area)"
                    .to_string(),
            )
        })
    };
    let Some(path) = &opts.freshness.state else {
        if !opts.read_only {
            return Err(invalid(
                "integrity: an authenticated volume is served with a freshness state file \
                 (--freshness FILE); --freshness-reset makes one from the store's tree"
                    .to_string(),
            ));
        }
        return Ok((store()?, true));
    };
    if opts.freshness.reset {
        return Ok((store()?, false));
    }
    let Some(s) = StateFile::load(path)? else {
        return Err(altered(format!(
            "integrity: no freshness state file at {}: without it a rolled-back store cannot be \
             told from a current one; --freshness-reset accepts the store's tree and makes one",
            path.display()
        )));
    };
    if !ours(&s.anchor) {
        return Err(altered(format!(
            "integrity: the freshness state file {} belongs to another volume (or another layout)",
            path.display()
        )));
    }
    Ok((s.anchor, s.clean))
}

impl Backend for AuthBackend {
    fn size_bytes(&self) -> u64 {
        self.layout.data_bytes()
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        if self.opts.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "integrity: read-only",
            ));
        }
        let len: u64 = segments.iter().map(|s| s.len() as u64).sum();
        self.check_io(offset, len)?;
        let _g = self.gate.read();
        let epoch = self.epoch.load(Ordering::Acquire);
        let first = offset / BLOCK;
        let mut records = Vec::with_capacity((len / BLOCK) as usize);
        for_each_block(segments, |i, block| {
            records.push(self.keys.seal(first + i, epoch, Some(block))?);
            Ok(())
        })?;
        // Tags first: a write cut short (iopages killed between the two)
        // leaves a new tag beside old data, which the sweep does not take,
        // so the block reads as before. The tag blocks' stripes are held
        // across both, so two writes to one block (from two connections)
        // land tag and data in the same order.
        let _order = self.lock_stripes(first, records.len() as u64);
        let mut touched = Vec::new();
        let res = self.put_records(first, &records, &mut touched);
        let res = res.and_then(|()| self.data.write_at(offset, segments));
        self.release(&touched);
        res
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        let len: u64 = segments.iter().map(|s| s.len() as u64).sum();
        self.check_io(offset, len)?;
        let first = offset / BLOCK;
        let count = (len / BLOCK) as usize;
        let mut records = match self.get_records(first, count) {
            Ok(r) => r,
            // A tag block (or a node above it) did not verify: every block
            // of the request is refused, counted and logged as a bad tag is.
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                let blocks: Vec<u64> = (first..first + count as u64).collect();
                return Err(self.refuse(&blocks, Some(&e)));
            }
            Err(e) => return Err(e),
        };
        self.data.read_at(offset, segments)?;
        let mut bad = Vec::new();
        let mut scratch = vec![0u8; BLOCK as usize];
        for i in 0..count as u64 {
            let block = first + i;
            let mut ok = self.verify_either(segments, i, block, records[i as usize], &mut scratch);
            // A write may have replaced the block since its tag was taken:
            // take the tag again, and read the block again if it changed.
            for _ in 0..3 {
                if ok {
                    break;
                }
                let now = self.get_records(block, 1)?[0];
                if now == records[i as usize] {
                    break;
                }
                records[i as usize] = now;
                self.data.read_at(block * BLOCK, &mut [&mut scratch[..]])?;
                put_block(segments, i, &scratch);
                ok = self.verify_either(segments, i, block, now, &mut scratch);
            }
            if !ok {
                bad.push(block);
                put_block(segments, i, &[0u8; BLOCK as usize]);
            }
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(self.refuse(&bad, None))
        }
    }

    fn flush(&self) -> io::Result<()> {
        if self.opts.read_only {
            return Ok(());
        }
        if self.broken.load(Ordering::Acquire) {
            return self.recover(); // it commits
        }
        let _g = self.gate.write();
        let mut t = self.tree.lock();
        match self.commit_locked(&mut t) {
            Ok(()) => Ok(()),
            Err(e) => {
                // The store may have lost writes since the last commit (a
                // reconnect): forget them and sweep before the next I/O.
                t.rewind();
                self.broken.store(true, Ordering::Release);
                Err(e)
            }
        }
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.opts.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "integrity: read-only",
            ));
        }
        self.check_io(offset, len)?;
        let _g = self.gate.read();
        let epoch = self.epoch.load(Ordering::Acquire);
        // In pieces of 1024 blocks: a client's TRIM of any size costs a
        // bounded list of records.
        let (first, count) = (offset / BLOCK, len / BLOCK);
        let mut at = 0;
        while at < count {
            let n = (count - at).min(1024);
            let records = (first + at..first + at + n)
                .map(|b| self.keys.seal(b, epoch, None))
                .collect::<io::Result<Vec<_>>>()?;
            let _order = self.lock_stripes(first + at, n);
            let mut touched = Vec::new();
            let res = self.put_records(first + at, &records, &mut touched);
            self.release(&touched);
            res?;
            // The tags say zeros whatever the store keeps; freeing its
            // space is a courtesy that may be refused.
            let _ = self.data.discard((first + at) * BLOCK, n * BLOCK);
            at += n;
        }
        Ok(())
    }

    fn can_punch(&self) -> bool {
        !self.opts.read_only
    }

    fn reads_writes(&self) -> bool {
        true
    }

    /// Holes are the blocks whose tags say zeros (never written, or
    /// discarded): authenticated, whatever the store holds there.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> io::Result<Vec<Extent>> {
        check_range(offset, len, self.layout.data_bytes())?;
        let (max, end) = (max_extents.max(1), offset + len);
        let mut out: Vec<Extent> = Vec::new();
        let mut at = offset;
        while at < end {
            let block = at / BLOCK;
            let last = (end - 1) / BLOCK;
            let n = (RECORDS_PER_BLOCK - block % RECORDS_PER_BLOCK).min(last - block + 1);
            for (i, (r, _)) in self.get_records(block, n as usize)?.into_iter().enumerate() {
                let piece = ((block + i as u64 + 1) * BLOCK).min(end) - at;
                let hole = r.reads_zero();
                if out.last().is_some_and(|e| e.hole != hole) && out.len() == max {
                    return Ok(out);
                }
                push_extent(&mut out, piece, hole);
                at += piece;
            }
        }
        Ok(out)
    }
}

impl AuthBackend {
    /// Whether block `i` of `segments` verifies under the record, or under
    /// the one it replaced while the write is in flight.
    fn verify_either(
        &self,
        segments: &mut [&mut [u8]],
        i: u64,
        block: u64,
        (r, before): (Record, Option<Record>),
        scratch: &mut [u8],
    ) -> bool {
        if self.verify_block(segments, i, block, &r, scratch) {
            return true;
        }
        before.is_some_and(|b| self.verify_block(segments, i, block, &b, scratch))
    }

    /// Whether block `i` of `segments` verifies under `r` (a zero record
    /// fills the block with zeros).
    fn verify_block(
        &self,
        segments: &mut [&mut [u8]],
        i: u64,
        block: u64,
        r: &Record,
        scratch: &mut [u8],
    ) -> bool {
        if r.epoch == 0 {
            put_block(segments, i, &[0u8; BLOCK as usize]);
            return true;
        }
        if r.reads_zero() {
            put_block(segments, i, &[0u8; BLOCK as usize]);
            return self.keys.verify(block, r, &[]);
        }
        if let Some(b) = block_in_place(segments, i) {
            return self.keys.verify(block, r, b);
        }
        get_block(segments, i, scratch);
        self.keys.verify(block, r, scratch)
    }
}

/// Block `i` of `segments` where it lies whole in one segment (no copy).
fn block_in_place<'a>(segments: &'a [&mut [u8]], i: u64) -> Option<&'a [u8]> {
    let mut skip = i * BLOCK;
    for s in segments {
        let len = s.len() as u64;
        if skip >= len {
            skip -= len;
            continue;
        }
        let from = skip as usize;
        return s.get(from..from + BLOCK as usize);
    }
    None
}

impl Drop for AuthBackend {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            eprintln!(
                "iopages: integrity: {}: the last commit failed ({e}); the next open takes the \
                 writes since the last flush",
                self.opts.name
            );
        }
    }
}

/// Call `f` with each 4 KiB block of `segments` (copied when it spans two).
fn for_each_block(
    segments: &[&[u8]],
    mut f: impl FnMut(u64, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let mut tmp = Vec::new();
    let mut idx = 0u64;
    for s in segments {
        let mut rest: &[u8] = s;
        while !rest.is_empty() {
            if tmp.is_empty() && rest.len() >= BLOCK as usize {
                let (b, r) = rest.split_at(BLOCK as usize);
                f(idx, b)?;
                idx += 1;
                rest = r;
                continue;
            }
            let take = (BLOCK as usize - tmp.len()).min(rest.len());
            tmp.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if tmp.len() == BLOCK as usize {
                f(idx, &tmp)?;
                idx += 1;
                tmp.clear();
            }
        }
    }
    Ok(())
}

/// Call `f(segment, offset in it, length, offset in the block)` for each
/// piece of block `i` of segments whose lengths are `lens`.
fn each_piece(
    lens: impl Iterator<Item = usize>,
    i: u64,
    mut f: impl FnMut(usize, usize, usize, usize),
) {
    let mut skip = i * BLOCK;
    let mut at = 0usize;
    for (n, len) in lens.enumerate() {
        if skip >= len as u64 {
            skip -= len as u64;
            continue;
        }
        let from = skip as usize;
        let take = (len - from).min(BLOCK as usize - at);
        f(n, from, take, at);
        at += take;
        skip = 0;
        if at == BLOCK as usize {
            return;
        }
    }
}

/// Copy block `i` of `segments` into `out` (a block's length).
fn get_block(segments: &[&mut [u8]], i: u64, out: &mut [u8]) {
    each_piece(segments.iter().map(|s| s.len()), i, |n, from, take, at| {
        out[at..at + take].copy_from_slice(&segments[n][from..from + take]);
    });
}

/// Copy `src` (a block's length) over block `i` of `segments`.
fn put_block(segments: &mut [&mut [u8]], i: u64, src: &[u8]) {
    let lens: Vec<usize> = segments.iter().map(|s| s.len()).collect();
    each_piece(lens.into_iter(), i, |n, from, take, at| {
        segments[n][from..from + take].copy_from_slice(&src[at..at + take]);
    });
}
