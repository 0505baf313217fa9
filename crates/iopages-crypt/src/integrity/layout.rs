//! Where an authenticated volume's tags and tree live, and how their
//! pieces are encoded.
//!
//! Owns: the geometry of the integrity area (two superblock slots, then
//! each level of the tree as pairs of 4 KiB slots, level 0 being the tag
//! blocks), the 64-byte tag record (a block's place in a tag block holds
//! two: its current one and the one that write replaced) and the 32-byte
//! tree entry, and the
//! hash that binds a node to its place. Must never: let a count or an
//! offset computed here overflow (every constructor checks), or read a
//! field outside its fixed place.

use std::fmt;

/// The unit of authentication: one tag per 4 KiB block of ciphertext.
pub const BLOCK: u64 = 4096;
/// Bytes of one tag record.
pub const RECORD: usize = 64;
/// Bytes of a block's place in a tag block: its current record, then the
/// record that write replaced (after an unclean stop the store may hold
/// either write's data: see `tree.rs`'s sweep).
pub const PLACE: usize = 2 * RECORD;
/// Blocks one tag block (a leaf of the tree) covers.
pub const RECORDS_PER_BLOCK: u64 = BLOCK / PLACE as u64;
/// Bytes of one tree entry (a child's hash, slot and epoch).
pub const ENTRY: usize = 32;
/// Entries in one interior node.
pub const FANOUT: u64 = BLOCK / ENTRY as u64;
/// Bytes of an entry's hash (SHA-256 truncated to 192 bits).
pub const HASH: usize = 24;

/// The message authentication code of the tags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mac {
    /// HMAC-SHA256 over the tag's header and the block's ciphertext
    /// (cryptsetup's spelling `hmac-sha256`).
    HmacSha256,
    /// GMAC (AES-256-GCM with no plaintext, the header and ciphertext as
    /// associated data) under a random 96-bit nonce stored in the tag:
    /// the fast choice (`aead`).
    Gmac,
}

impl Mac {
    /// The name used on the command line and in the LUKS2 header.
    pub fn name(self) -> &'static str {
        match self {
            Mac::HmacSha256 => "hmac-sha256",
            Mac::Gmac => "aead",
        }
    }

    /// The MAC named `name` (`hmac-sha256`, `aead`).
    pub fn from_name(name: &str) -> Option<Mac> {
        match name {
            "hmac-sha256" => Some(Mac::HmacSha256),
            "aead" => Some(Mac::Gmac),
            _ => None,
        }
    }

    /// A byte naming the MAC in superblocks and state files.
    pub fn code(self) -> u8 {
        match self {
            Mac::HmacSha256 => 1,
            Mac::Gmac => 2,
        }
    }

    /// The MAC whose code is `code`.
    pub fn from_code(code: u8) -> Option<Mac> {
        match code {
            1 => Some(Mac::HmacSha256),
            2 => Some(Mac::Gmac),
            _ => None,
        }
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The geometry of an authenticated volume: how many 4 KiB data blocks it
/// has, and from that the size of every level of its tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    mac: Mac,
    data_blocks: u64,
    /// Nodes per level, level 0 (tag blocks) first; the last level has one.
    levels: Vec<u64>,
    /// First area block of each level's slots: all its nodes' slot 0,
    /// then all their slot 1 (so the same slot of adjacent nodes is
    /// adjacent on the store, and one write carries a run of them).
    bases: Vec<u64>,
    area_blocks: u64,
}

/// Largest volume served: 2^40 blocks (4 PiB), so every offset fits.
pub const MAX_DATA_BLOCKS: u64 = 1 << 40;

impl Layout {
    /// The layout of `data_blocks` blocks of 4 KiB.
    ///
    /// **Returns:** `None` for 0 blocks or more than [`MAX_DATA_BLOCKS`].
    pub fn new(mac: Mac, data_blocks: u64) -> Option<Layout> {
        if data_blocks == 0 || data_blocks > MAX_DATA_BLOCKS {
            return None;
        }
        let mut levels = vec![data_blocks.div_ceil(RECORDS_PER_BLOCK)];
        while *levels.last()? > 1 {
            let n = levels.last()?.div_ceil(FANOUT);
            levels.push(n);
        }
        let mut bases = Vec::with_capacity(levels.len());
        let mut next = 2u64; // two superblock slots
        for &n in &levels {
            bases.push(next);
            next += 2 * n;
        }
        Some(Layout {
            mac,
            data_blocks,
            levels,
            bases,
            area_blocks: next,
        })
    }

    /// The largest layout whose data and integrity area fit in `bytes`
    /// (the data first, the area right after it).
    ///
    /// **Returns:** `None` when not even one data block fits.
    pub fn fit(mac: Mac, bytes: u64) -> Option<Layout> {
        let total = bytes / BLOCK;
        // The area is a little over 2/32 of the data: start from the
        // estimate and step down until data + area fit.
        let mut data = (total * RECORDS_PER_BLOCK / (RECORDS_PER_BLOCK + 2)).min(MAX_DATA_BLOCKS);
        while data > 0 {
            let l = Layout::new(mac, data)?;
            if data + l.area_blocks <= total {
                // The step down may overshoot by a few blocks: climb back.
                let mut best = l;
                while let Some(up) = Layout::new(mac, best.data_blocks + 1) {
                    if up.data_blocks + up.area_blocks > total {
                        break;
                    }
                    best = up;
                }
                return Some(best);
            }
            let over = data + l.area_blocks - total;
            data = data.saturating_sub(over.max(1));
        }
        None
    }

    /// The MAC of the tags.
    pub fn mac(&self) -> Mac {
        self.mac
    }

    /// Data blocks (4 KiB each).
    pub fn data_blocks(&self) -> u64 {
        self.data_blocks
    }

    /// Bytes of data the volume serves.
    pub fn data_bytes(&self) -> u64 {
        self.data_blocks * BLOCK
    }

    /// Blocks of the integrity area.
    pub fn area_blocks(&self) -> u64 {
        self.area_blocks
    }

    /// Bytes of the integrity area.
    pub fn area_bytes(&self) -> u64 {
        self.area_blocks * BLOCK
    }

    /// Levels of the tree (1 when one tag block covers the volume).
    pub fn depth(&self) -> usize {
        self.levels.len()
    }

    /// Nodes at `level` (0: tag blocks).
    pub fn nodes(&self, level: usize) -> u64 {
        self.levels[level]
    }

    /// Children of node `index` at `level` (records for a tag block).
    pub fn children(&self, level: usize, index: u64) -> u64 {
        let (below, per) = if level == 0 {
            (self.data_blocks, RECORDS_PER_BLOCK)
        } else {
            (self.levels[level - 1], FANOUT)
        };
        (below - index * per).min(per)
    }

    /// The area block of node `index` at `level` in `slot` (0 or 1).
    pub fn node_block(&self, level: usize, index: u64, slot: u8) -> u64 {
        self.bases[level] + u64::from(slot & 1) * self.levels[level] + index
    }
}

/// A tree entry: a child's hash, the slot its current copy is in, and the
/// epoch that copy was written in. All zeros: the child was never written
/// (its content is all zeros and is not read from the store).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Entry {
    /// SHA-256 of the child (see [`node_hash`]), truncated.
    pub hash: [u8; HASH],
    /// The slot (0 or 1) holding the child's current copy.
    pub slot: u8,
    /// The epoch that copy was written in (below 2^63).
    pub epoch: u64,
}

impl Entry {
    /// Whether this is the entry of a child never written.
    pub fn is_empty(&self) -> bool {
        *self == Entry::default()
    }

    /// The 32 bytes of this entry.
    pub fn encode(&self) -> [u8; ENTRY] {
        let mut b = [0u8; ENTRY];
        b[..HASH].copy_from_slice(&self.hash);
        let word = (self.epoch << 1) | u64::from(self.slot & 1);
        b[HASH..].copy_from_slice(&word.to_le_bytes());
        b
    }

    /// The entry encoded in `b` (any 32 bytes decode).
    pub fn decode(b: &[u8; ENTRY]) -> Entry {
        let mut hash = [0u8; HASH];
        hash.copy_from_slice(&b[..HASH]);
        let word = u64::from_le_bytes(b[HASH..].try_into().expect("8 bytes"));
        Entry {
            hash,
            slot: (word & 1) as u8,
            epoch: word >> 1,
        }
    }
}

/// The hash of a node's content at its place in the tree: a node moved
/// to another place does not match its parent's entry.
pub fn node_hash(level: usize, index: u64, content: &[u8]) -> [u8; HASH] {
    let mut h = openssl::sha::Sha256::new();
    h.update(b"iopages-node-v1\0");
    h.update(&(level as u32).to_le_bytes());
    h.update(&index.to_le_bytes());
    h.update(content);
    let full = h.finish();
    let mut out = [0u8; HASH];
    out.copy_from_slice(&full[..HASH]);
    out
}

/// Record flag: the block was discarded or zeroed, and reads as zero
/// ciphertext (its bytes on the store are not read).
pub const FLAG_ZERO: u8 = 1;

/// A tag record: the MAC of one block's ciphertext, bound to the block's
/// number and the epoch it was written in. All zeros: never written (reads
/// as zero ciphertext).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Record {
    /// The epoch the block was written in (0: never written).
    pub epoch: u64,
    /// [`FLAG_ZERO`] or 0.
    pub flags: u8,
    /// The GMAC nonce (12 bytes used); zero for HMAC.
    pub nonce: [u8; 16],
    /// The MAC (32 bytes for HMAC-SHA256, 16 and zeros for GMAC).
    pub mac: [u8; 32],
}

impl Record {
    /// Whether the block reads as zeros without touching the store (never
    /// written, or discarded).
    pub fn reads_zero(&self) -> bool {
        self.epoch == 0 || self.flags & FLAG_ZERO != 0
    }

    /// The 64 bytes of this record.
    pub fn encode(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[..8].copy_from_slice(&self.epoch.to_le_bytes());
        b[8] = self.flags;
        b[16..32].copy_from_slice(&self.nonce);
        b[32..].copy_from_slice(&self.mac);
        b
    }

    /// The record encoded in `b`.
    ///
    /// **Returns:** `None` if reserved bytes are not zero or a flag is
    /// unknown (a record this version never writes).
    pub fn decode(b: &[u8; RECORD]) -> Option<Record> {
        if b[9..16].iter().any(|&x| x != 0) || b[8] & !FLAG_ZERO != 0 {
            return None;
        }
        let epoch = u64::from_le_bytes(b[..8].try_into().ok()?);
        if epoch == 0 && b.iter().any(|&x| x != 0) {
            return None;
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[16..32]);
        let mut mac = [0u8; 32];
        mac.copy_from_slice(&b[32..]);
        Some(Record {
            epoch,
            flags: b[8],
            nonce,
            mac,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_shrink_to_one_root_and_slots_never_overlap() {
        for n in [1u64, 31, 32, 33, 32 * 128, 32 * 128 + 1, 1 << 28] {
            let l = Layout::new(Mac::HmacSha256, n).unwrap();
            assert_eq!(l.nodes(l.depth() - 1), 1);
            assert_eq!(l.nodes(0), n.div_ceil(32));
            let mut seen = std::collections::HashSet::new();
            for lv in 0..l.depth() {
                for i in [0, l.nodes(lv) / 2, l.nodes(lv) - 1] {
                    for s in 0..2 {
                        let b = l.node_block(lv, i, s);
                        assert!((2..l.area_blocks()).contains(&b), "{n} {lv} {i}");
                        seen.insert(b);
                    }
                }
                let sum: u64 = (0..l.nodes(lv).min(3)).map(|i| l.children(lv, i)).sum();
                assert!(sum > 0);
            }
            let last: u64 = l.children(0, l.nodes(0) - 1);
            assert_eq!((l.nodes(0) - 1) * 32 + last, n);
        }
        assert!(Layout::new(Mac::Gmac, 0).is_none());
        assert!(Layout::new(Mac::Gmac, MAX_DATA_BLOCKS + 1).is_none());
    }

    #[test]
    fn fit_uses_the_space_and_never_overflows_it() {
        for bytes in [4096u64 * 5, 1 << 20, (1 << 30) + 12345, 1 << 40] {
            let l = Layout::fit(Mac::HmacSha256, bytes).unwrap();
            assert!(l.data_bytes() + l.area_bytes() <= bytes);
            // One more block would not fit.
            let more = Layout::new(Mac::HmacSha256, l.data_blocks() + 1).unwrap();
            assert!(more.data_bytes() + more.area_bytes() > bytes, "{bytes}");
        }
        assert!(Layout::fit(Mac::HmacSha256, 4096 * 4).is_none());
    }

    #[test]
    fn entries_and_records_round_trip_and_reserved_bytes_are_refused() {
        let e = Entry {
            hash: [7; HASH],
            slot: 1,
            epoch: 12345,
        };
        assert_eq!(Entry::decode(&e.encode()), e);
        assert!(Entry::default().is_empty());
        let r = Record {
            epoch: 9,
            flags: FLAG_ZERO,
            nonce: [3; 16],
            mac: [4; 32],
        };
        assert_eq!(Record::decode(&r.encode()), Some(r));
        let mut b = r.encode();
        b[10] = 1;
        assert_eq!(Record::decode(&b), None);
        let mut b = r.encode();
        b[8] = 2;
        assert_eq!(Record::decode(&b), None);
        let mut b = [0u8; RECORD];
        assert_eq!(Record::decode(&b), Some(Record::default()));
        b[40] = 1;
        assert_eq!(Record::decode(&b), None, "epoch 0 must be all zeros");
    }

    #[test]
    fn a_node_hash_depends_on_its_place() {
        let c = [5u8; 4096];
        assert_ne!(node_hash(0, 1, &c), node_hash(0, 2, &c));
        assert_ne!(node_hash(0, 1, &c), node_hash(1, 1, &c));
        assert_eq!(node_hash(0, 1, &c), node_hash(0, 1, &c));
    }
}
