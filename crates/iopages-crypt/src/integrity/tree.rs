//! The tag tree in memory: the nodes cached within a bound, each checked
//! against its parent on the way in, and the commit that makes a new root.
//!
//! Owns: the cache of tag blocks (level 0) and interior nodes, the rule
//! that picks a node's slot (the one its committed copy is not in, kept
//! for the rest of the epoch), eviction (a changed node is written to that
//! slot and its new entry put in its parent), the commit (changed nodes
//! written bottom-up, the store flushed, a new root entry), and the sweep
//! that, after an unclean stop or a store that lost writes, takes each
//! block's newer tag where its data proves it was written. Must never:
//! hand out a node that does not match its parent's entry, write a node to
//! the slot of its committed copy, evict a node with cached children or a
//! tag-block write in flight, or grow past the bound by more than one path.

use super::layout::{node_hash, Entry, Layout, Record, BLOCK, ENTRY, PLACE, RECORD};
use super::mac::Keys;
use crate::backend::Backend;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::sync::Arc;

/// One cached node.
struct Node {
    data: Box<[u8]>,
    /// The node's entry as its parent (or the root) holds it now.
    entry: Entry,
    /// The slot written this epoch, once one is.
    written: Option<u8>,
    /// Content differs from what `entry` names.
    modified: bool,
    /// The store's copy in `written` may be older than `data` (a failed
    /// or skipped write): the commit and eviction write it.
    stale: bool,
    /// Cached children (a node with any is not evicted).
    children: u32,
    /// Tag-block writes in flight (a node with any is not evicted).
    pending: u32,
    /// Version of `data`, and the last version written (tag blocks).
    seq: u64,
    io: Arc<Mutex<u64>>,
    used: u64,
    /// Records replaced by writes still in flight (their data may not be
    /// on the store yet), by write: a read accepts either until that
    /// write finishes. Bounded by the writes in flight.
    prev: Vec<(u64, usize, Record)>,
}

/// A copy of a tag block to write through to the store.
pub(crate) struct WriteThrough {
    /// The write this is (to say when it is [`Tree::done`]).
    pub id: u64,
    /// The tag block.
    pub tb: u64,
    pub data: Box<[u8]>,
    pub seq: u64,
    pub block: u64,
    pub io: Arc<Mutex<u64>>,
}

/// An integrity failure in the tree itself (not a block's tag).
pub(crate) fn altered(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// The cached tree of one volume.
pub(crate) struct Tree {
    layout: Layout,
    area: Arc<dyn Backend>,
    nodes: HashMap<(usize, u64), Node>,
    /// The root's entry now (changes at commit and at the root's eviction,
    /// which never happens).
    root: Entry,
    /// The root's entry at the last commit.
    pub committed_root: Entry,
    /// The epoch being written.
    pub epoch: u64,
    /// The epoch of the last commit.
    pub committed: u64,
    budget: usize,
    clock: u64,
    /// Node reads from the store (tag blocks and interior).
    pub reads: u64,
    /// Node writes to the store.
    pub writes: u64,
    /// Whether changes may be written (false: a read-only check).
    writable: bool,
    /// The next write's id.
    next_write: u64,
}

fn zeroed() -> Box<[u8]> {
    vec![0u8; BLOCK as usize].into_boxed_slice()
}

impl Tree {
    /// A tree whose committed root is `root` at `epoch`, caching at most
    /// `budget_bytes` of nodes (never fewer than a few paths).
    pub fn new(
        layout: Layout,
        area: Arc<dyn Backend>,
        root: Entry,
        epoch: u64,
        budget_bytes: usize,
        writable: bool,
    ) -> Tree {
        let budget = (budget_bytes / BLOCK as usize).max(4 * layout.depth() + 8);
        Tree {
            layout,
            area,
            nodes: HashMap::new(),
            root,
            committed_root: root,
            epoch: epoch + 1,
            committed: epoch,
            budget,
            clock: 0,
            reads: 0,
            writes: 0,
            writable,
            next_write: 0,
        }
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Nodes cached now.
    pub fn cached(&self) -> usize {
        self.nodes.len()
    }

    /// The entry of node `index` at `level` as its parent holds it,
    /// loading the parent.
    fn parent_entry(&mut self, level: usize, index: u64) -> io::Result<Entry> {
        if level + 1 == self.layout.depth() {
            return Ok(self.root);
        }
        let parent = index / super::layout::FANOUT;
        self.load(level + 1, parent)?;
        let p = &self.nodes[&(level + 1, parent)];
        let at = (index % super::layout::FANOUT) as usize * ENTRY;
        Ok(Entry::decode(
            p.data[at..at + ENTRY].try_into().expect("32 bytes"),
        ))
    }

    fn slot_offset(&self, level: usize, index: u64, slot: u8) -> u64 {
        self.layout.node_block(level, index, slot) * BLOCK
    }

    /// Make node `index` at `level` cached, read from the store and
    /// checked against its parent if it is not.
    fn load(&mut self, level: usize, index: u64) -> io::Result<()> {
        self.clock += 1;
        if let Some(n) = self.nodes.get_mut(&(level, index)) {
            n.used = self.clock;
            return Ok(());
        }
        let entry = self.parent_entry(level, index)?;
        let mut data = zeroed();
        if !entry.is_empty() {
            let off = self.slot_offset(level, index, entry.slot);
            self.area.read_at(off, &mut [&mut data[..]])?;
            self.reads += 1;
            if node_hash(level, index, &data) != entry.hash {
                return Err(altered(format!(
                    "integrity: the store altered or rolled back tree node {index} of level {level} \
                     (slot {}, written in epoch {}): it does not match its parent",
                    entry.slot, entry.epoch
                )));
            }
        }
        self.insert(level, index, entry, data);
        Ok(())
    }

    fn insert(&mut self, level: usize, index: u64, entry: Entry, data: Box<[u8]>) {
        if level + 1 < self.layout.depth() {
            let parent = index / super::layout::FANOUT;
            if let Some(p) = self.nodes.get_mut(&(level + 1, parent)) {
                p.children += 1;
            }
        }
        self.nodes.insert(
            (level, index),
            Node {
                data,
                entry,
                written: None,
                modified: false,
                stale: false,
                children: 0,
                pending: 0,
                seq: 0,
                io: Arc::new(Mutex::new(0)),
                used: self.clock,
                prev: Vec::new(),
            },
        );
    }

    /// The slot node `n` is written to this epoch.
    fn slot_for(&self, n: &Node) -> u8 {
        match n.written {
            Some(s) => s,
            None if !n.entry.is_empty() && n.entry.epoch == self.epoch => n.entry.slot,
            None => 1 - n.entry.slot,
        }
    }

    /// Evict nodes until the cache is within its bound.
    pub fn make_room(&mut self) -> io::Result<()> {
        while self.nodes.len() > self.budget {
            let top = self.layout.depth() - 1;
            let victim = self
                .nodes
                .iter()
                .filter(|(k, n)| k.0 < top && n.children == 0 && n.pending == 0)
                .take(64)
                .min_by_key(|(_, n)| n.used)
                .map(|(k, _)| *k);
            let Some((level, index)) = victim else {
                return Ok(());
            };
            self.settle(level, index)?;
            self.nodes.remove(&(level, index));
            let parent = index / super::layout::FANOUT;
            if let Some(p) = self.nodes.get_mut(&(level + 1, parent)) {
                p.children -= 1;
            }
        }
        Ok(())
    }

    /// Write a changed node to its slot (tag blocks only when stale: their
    /// writes went through already) and put its new entry in its parent.
    fn settle(&mut self, level: usize, index: u64) -> io::Result<()> {
        let n = &self.nodes[&(level, index)];
        if !n.modified {
            return Ok(());
        }
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "integrity: a read-only tree cannot write a changed node",
            ));
        }
        let slot = self.slot_for(n);
        if level > 0 || n.stale || n.written.is_none() {
            let off = self.slot_offset(level, index, slot);
            self.area.write_at(off, &[&n.data[..]])?;
            self.writes += 1;
        }
        let entry = Entry {
            hash: node_hash(level, index, &n.data),
            slot,
            epoch: self.epoch,
        };
        let n = self.nodes.get_mut(&(level, index)).expect("cached");
        n.entry = entry;
        n.written = Some(slot);
        n.modified = false;
        n.stale = false;
        if level + 1 == self.layout.depth() {
            self.root = entry;
        } else {
            let parent = index / super::layout::FANOUT;
            let at = (index % super::layout::FANOUT) as usize * ENTRY;
            let p = self
                .nodes
                .get_mut(&(level + 1, parent))
                .expect("a cached node's parent is cached");
            p.data[at..at + ENTRY].copy_from_slice(&entry.encode());
            p.modified = true;
        }
        Ok(())
    }

    /// The records of data blocks `first..first + count` (within one tag
    /// block), each with the record it replaced while its write is in
    /// flight.
    pub fn records(
        &mut self,
        first: u64,
        count: usize,
    ) -> io::Result<Vec<(Record, Option<Record>)>> {
        let tb = first / super::layout::RECORDS_PER_BLOCK;
        self.load(0, tb)?;
        let n = &self.nodes[&(0, tb)];
        let at = (first % super::layout::RECORDS_PER_BLOCK) as usize;
        (at..at + count)
            .map(|i| {
                let b: &[u8; RECORD] = n.data[i * PLACE..i * PLACE + RECORD]
                    .try_into()
                    .expect("64");
                let r = Record::decode(b).ok_or_else(|| {
                    altered(format!(
                        "integrity: tag of block {} is malformed",
                        tb * super::layout::RECORDS_PER_BLOCK + i as u64
                    ))
                })?;
                let before = n
                    .prev
                    .iter()
                    .rev()
                    .find(|(_, p, _)| *p == i)
                    .map(|(_, _, r)| *r);
                Ok((r, before))
            })
            .collect()
    }

    /// Put `records` for data blocks from `first` (within one tag block)
    /// and return the tag block's copy to write through.
    pub fn update(&mut self, first: u64, records: &[Record]) -> io::Result<WriteThrough> {
        let tb = first / super::layout::RECORDS_PER_BLOCK;
        self.load(0, tb)?;
        let slot = self.slot_for(&self.nodes[&(0, tb)]);
        let block = self.slot_offset(0, tb, slot);
        self.next_write += 1;
        let id = self.next_write;
        let n = self.nodes.get_mut(&(0, tb)).expect("loaded");
        let at = (first % super::layout::RECORDS_PER_BLOCK) as usize;
        for (i, r) in records.iter().enumerate() {
            let place = &mut n.data[(at + i) * PLACE..(at + i + 1) * PLACE];
            let (cur, replaced) = place.split_at_mut(RECORD);
            let old: &[u8; RECORD] = (&*cur).try_into().expect("64");
            if let Some(old) = Record::decode(old) {
                n.prev.push((id, at + i, old));
            }
            replaced.copy_from_slice(cur);
            cur.copy_from_slice(&r.encode());
        }
        n.modified = true;
        n.written = Some(slot);
        n.seq += 1;
        n.pending += 1;
        Ok(WriteThrough {
            id,
            tb,
            data: n.data.clone(),
            seq: n.seq,
            block,
            io: Arc::clone(&n.io),
        })
    }

    /// Tag block `tb`'s copy on the store may be older than the cache's
    /// (a write through failed): the commit or eviction writes it.
    pub fn mark_stale(&mut self, tb: u64) {
        if let Some(n) = self.nodes.get_mut(&(0, tb)) {
            n.stale = true;
        }
    }

    /// Write `id` through tag block `tb` finished (a failed write through
    /// was marked with [`Tree::mark_stale`]).
    pub fn done(&mut self, tb: u64, id: u64) {
        if let Some(n) = self.nodes.get_mut(&(0, tb)) {
            n.pending -= 1;
            n.prev.retain(|(w, _, _)| *w != id);
        }
    }

    /// Commit: settle every changed node bottom-up and flush the store;
    /// [`Tree::advance`] once the new root is anchored.
    ///
    /// **Returns:** the new root entry, or `None` when nothing changed
    /// since the last commit (the store is flushed all the same).
    pub fn commit(&mut self, data: &dyn Backend) -> io::Result<Option<Entry>> {
        let changed = self.nodes.values().any(|n| n.modified);
        if !changed {
            data.flush()?;
            return Ok(None);
        }
        for level in 0..self.layout.depth() {
            let mut keys: Vec<u64> = self
                .nodes
                .iter()
                .filter(|(k, n)| k.0 == level && n.modified)
                .map(|(k, _)| k.1)
                .collect();
            keys.sort_unstable();
            for index in keys {
                self.settle(level, index)?;
            }
        }
        data.flush()?;
        self.area.flush()?;
        Ok(Some(self.root))
    }

    /// The root [`Tree::commit`] returned is anchored (the state file
    /// names it): it is the committed tree now, and writes go to a new
    /// epoch. Until this is called a failed commit can be retried: it
    /// writes the same slots again.
    pub fn advance(&mut self) {
        for n in self.nodes.values_mut() {
            n.written = None;
        }
        self.committed_root = self.root;
        self.committed = self.epoch;
        self.epoch += 1;
    }

    /// Forget everything since the last commit (the store lost writes):
    /// the cache is emptied and the committed root is current again.
    pub fn rewind(&mut self) {
        self.nodes.clear();
        self.root = self.committed_root;
    }

    /// Sweep tag blocks `range` after an unclean stop or lost writes: where
    /// a block's other slot holds a tag newer than the last commit and
    /// the block's data on the store verifies under it, take it (and
    /// write the merged tag block through at the next commit).
    ///
    /// **Returns:** tags taken, and the newest epoch seen among them.
    pub fn sweep(
        &mut self,
        keys: &Keys,
        data: &dyn Backend,
        range: std::ops::Range<u64>,
    ) -> io::Result<(u64, u64)> {
        let (mut taken, mut newest) = (0u64, 0u64);
        let mut pair = vec![0u8; 2 * BLOCK as usize];
        for tb in range {
            self.make_room()?;
            let entry = self.parent_entry(0, tb)?;
            let (s0, s1) = pair.split_at_mut(BLOCK as usize);
            self.area
                .read_at(self.slot_offset(0, tb, 0), &mut [&mut s0[..]])?;
            self.area
                .read_at(self.slot_offset(0, tb, 1), &mut [&mut s1[..]])?;
            self.reads += 2;
            let (s0, s1) = (&*s0, &*s1);
            let (cur, other) = if entry.slot == 0 { (s0, s1) } else { (s1, s0) };
            let mut merged: Box<[u8]> = if entry.is_empty() {
                zeroed()
            } else if node_hash(0, tb, cur) == entry.hash {
                cur.into()
            } else {
                continue; // altered: its reads fail when they load it
            };
            let n = sweep_block(
                keys,
                data,
                tb,
                self.committed,
                &mut merged,
                other,
                &mut newest,
            )?;
            if n > 0 {
                taken += n;
                self.insert(0, tb, entry, merged);
                let node = self.nodes.get_mut(&(0, tb)).expect("inserted");
                node.modified = true;
                node.stale = true;
            }
        }
        Ok((taken, newest))
    }
}

/// Merge into `merged` (tag block `tb`'s committed copy) the records of
/// `other` (its other slot) written after the last commit whose block's
/// data on the store verifies under them. Each place in `other` holds
/// the block's newest record and the one that write replaced: a write's
/// tag goes to the store before its data, so an unclean stop can leave
/// the newer tag beside the data of the write before it, and either is a
/// version written since the commit (a replaced record older than the
/// commit is the committed one, already in `merged`).
fn sweep_block(
    keys: &Keys,
    data: &dyn Backend,
    tb: u64,
    committed: u64,
    merged: &mut [u8],
    other: &[u8],
    newest: &mut u64,
) -> io::Result<u64> {
    let mut taken = 0;
    let mut buf = vec![0u8; BLOCK as usize];
    let per = super::layout::RECORDS_PER_BLOCK;
    for i in 0..per as usize {
        let block = tb * per + i as u64;
        if block * BLOCK >= data.size_bytes() {
            break;
        }
        let mut read = false;
        for half in 0..2 {
            let at = i * PLACE + half * RECORD;
            let o: &[u8; RECORD] = other[at..at + RECORD].try_into().expect("64");
            let Some(cand) = Record::decode(o) else {
                continue;
            };
            if cand.epoch <= committed || o[..] == merged[i * PLACE..i * PLACE + RECORD] {
                continue;
            }
            if !cand.reads_zero() && !read {
                data.read_at(block * BLOCK, &mut [&mut buf[..]])?;
                read = true;
            }
            if keys.verify(block, &cand, &buf) {
                let place = &mut merged[i * PLACE..(i + 1) * PLACE];
                let (cur, replaced) = place.split_at_mut(RECORD);
                replaced.copy_from_slice(cur);
                cur.copy_from_slice(o);
                *newest = (*newest).max(cand.epoch);
                taken += 1;
                break;
            }
        }
    }
    Ok(taken)
}
