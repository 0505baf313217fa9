//! The freshness anchors: the local state file and the store's
//! superblocks.
//!
//! Owns: the two encodings that name a committed tree — the state file
//! (kept where the store cannot change it: its root entry is the
//! authority) and the superblock (on the store, authenticated by the
//! superblock key: it says which tree the store holds and from which
//! epoch, so a mismatch can be explained and `--freshness-reset` can adopt
//! it) — and writing the state file atomically. Must never: accept a
//! state file of another volume, a truncated or corrupt one, or leave a
//! half-written one behind (temporary file, `fsync`, `rename`, directory
//! `fsync`).

use super::layout::{Entry, Mac, BLOCK, ENTRY};
use super::mac::Keys;
use std::fs;
use std::io::{self, Write};
use std::path::Path;

/// What a committed tree is: the volume it belongs to, its epoch and root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Anchor {
    /// The tags' MAC.
    pub mac: Mac,
    /// Data blocks of the volume.
    pub data_blocks: u64,
    /// SHA-256 of the volume's UUID (binds the anchor to one volume).
    pub volume: [u8; 32],
    /// The epoch of the last commit (0: as formatted).
    pub epoch: u64,
    /// The root's entry.
    pub root: Entry,
}

/// The state file: an anchor and whether the last session stopped cleanly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateFile {
    /// The committed tree.
    pub anchor: Anchor,
    /// Whether the session that wrote it stopped cleanly (no writes after
    /// its last commit).
    pub clean: bool,
}

const STATE_MAGIC: &[u8; 8] = b"IOPGFRS1";
const SB_MAGIC: &[u8; 8] = b"IOPGSB01";
/// Bytes of an encoded state file.
pub const STATE_LEN: usize = 8 + 4 + 4 + 8 + 8 + 32 + 8 + ENTRY + 32;
const SB_BODY: usize = 8 + 4 + 4 + 8 + 8 + 32 + 8 + ENTRY;

/// SHA-256 of a volume's UUID, as anchors hold it.
pub fn volume_id(uuid: &str) -> [u8; 32] {
    openssl::sha::sha256(uuid.as_bytes())
}

fn bad(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

fn put_anchor(out: &mut Vec<u8>, a: &Anchor) {
    out.extend_from_slice(&u64::from(a.mac.code()).to_le_bytes());
    out.extend_from_slice(&a.data_blocks.to_le_bytes());
    out.extend_from_slice(&a.volume);
    out.extend_from_slice(&a.epoch.to_le_bytes());
    out.extend_from_slice(&a.root.encode());
}

fn get_anchor(b: &[u8]) -> Option<Anchor> {
    let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
    let code = u(0..8);
    let mac = Mac::from_code(u8::try_from(code).ok()?)?;
    let mut volume = [0u8; 32];
    volume.copy_from_slice(&b[16..48]);
    let root = Entry::decode(b[56..56 + ENTRY].try_into().ok()?);
    Some(Anchor {
        mac,
        data_blocks: u(8..16),
        volume,
        epoch: u(48..56),
        root,
    })
}

impl StateFile {
    /// The file's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(STATE_LEN);
        out.extend_from_slice(STATE_MAGIC);
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&u32::from(self.clean).to_le_bytes());
        put_anchor(&mut out, &self.anchor);
        let sum = openssl::sha::sha256(&out);
        out.extend_from_slice(&sum);
        out
    }

    /// The state file in `b`.
    ///
    /// **Returns:** `InvalidData` naming what is wrong (length, magic,
    /// version, checksum, flags, MAC).
    pub fn decode(b: &[u8]) -> io::Result<StateFile> {
        if b.len() != STATE_LEN {
            return Err(bad(format!(
                "a freshness state file holds {STATE_LEN} bytes, this one {}",
                b.len()
            )));
        }
        if &b[..8] != STATE_MAGIC {
            return Err(bad("not a freshness state file (bad magic)".into()));
        }
        let (body, sum) = b.split_at(STATE_LEN - 32);
        if openssl::sha::sha256(body) != sum {
            return Err(bad("the freshness state file is corrupt (checksum)".into()));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        if version != 1 {
            return Err(bad(format!(
                "freshness state file version {version} is not supported"
            )));
        }
        let flags = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
        if flags > 1 {
            return Err(bad(format!(
                "freshness state file flags {flags:#x} are unknown"
            )));
        }
        let anchor = get_anchor(&b[16..body.len()])
            .ok_or_else(|| bad("the freshness state file names an unknown MAC".into()))?;
        Ok(StateFile {
            anchor,
            clean: flags == 1,
        })
    }

    /// Read the state file at `path`.
    ///
    /// **Returns:** `Ok(None)` if there is none; `InvalidData` if it is not
    /// a state file (more than 4 KiB is not read).
    pub fn load(path: &Path) -> io::Result<Option<StateFile>> {
        use std::io::Read;
        let f = match fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut b = Vec::new();
        f.take(4096).read_to_end(&mut b)?;
        StateFile::decode(&b)
            .map(Some)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
    }

    /// Write the state file to `path` atomically: a temporary file beside
    /// it (mode 0600), synced, renamed over it, the directory synced.
    pub fn store(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
        let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(&self.encode())?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    }
}

/// Encode a superblock for `anchor`, authenticated with `keys`.
pub fn encode_superblock(anchor: &Anchor, keys: &Keys) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(BLOCK as usize);
    out.extend_from_slice(SB_MAGIC);
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    put_anchor(&mut out, anchor);
    let mac = keys.superblock_mac(&out)?;
    out.extend_from_slice(&mac);
    out.resize(BLOCK as usize, 0);
    Ok(out)
}

/// The superblock in `b` (4096 bytes), if it is one this volume's keys
/// wrote.
///
/// **Returns:** `None` for anything else (zeros, another volume's,
/// altered, unknown version).
pub fn decode_superblock(b: &[u8], keys: &Keys) -> Option<Anchor> {
    if b.len() < SB_BODY + 32 || &b[..8] != SB_MAGIC {
        return None;
    }
    let (body, rest) = b.split_at(SB_BODY);
    let mac = keys.superblock_mac(body).ok()?;
    if !openssl::memcmp::eq(&mac, &rest[..32]) || rest[32..].iter().any(|&x| x != 0) {
        return None;
    }
    if b[8..16] != [1, 0, 0, 0, 0, 0, 0, 0] {
        return None;
    }
    get_anchor(&b[16..SB_BODY])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anchor() -> Anchor {
        Anchor {
            mac: Mac::Gmac,
            data_blocks: 1000,
            volume: volume_id("4f9a"),
            epoch: 17,
            root: Entry {
                hash: [3; 24],
                slot: 1,
                epoch: 17,
            },
        }
    }

    #[test]
    fn state_files_round_trip_and_damage_is_named() {
        let s = StateFile {
            anchor: anchor(),
            clean: true,
        };
        let b = s.encode();
        assert_eq!(b.len(), STATE_LEN);
        assert_eq!(StateFile::decode(&b).unwrap(), s);
        for i in 0..b.len() {
            let mut d = b.clone();
            d[i] ^= 0x10;
            assert!(StateFile::decode(&d).is_err(), "byte {i}");
        }
        let e = StateFile::decode(&b[..50]).unwrap_err();
        assert!(e.to_string().contains("holds"), "{e}");
    }

    #[test]
    fn state_files_are_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("iopages-state-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("vol.fresh");
        assert!(StateFile::load(&p).unwrap().is_none());
        let mut s = StateFile {
            anchor: anchor(),
            clean: false,
        };
        s.store(&p).unwrap();
        s.anchor.epoch = 18;
        s.store(&p).unwrap();
        assert_eq!(StateFile::load(&p).unwrap().unwrap(), s);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "no temporary left");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn superblocks_are_authenticated() {
        let k = Keys::derive(Mac::Gmac, &[1; 64]).unwrap();
        let b = encode_superblock(&anchor(), &k).unwrap();
        assert_eq!(decode_superblock(&b, &k), Some(anchor()));
        let other = Keys::derive(Mac::Gmac, &[2; 64]).unwrap();
        assert_eq!(decode_superblock(&b, &other), None);
        let mut d = b.clone();
        d[60] ^= 1;
        assert_eq!(decode_superblock(&d, &k), None);
        assert_eq!(decode_superblock(&[0u8; 4096], &k), None);
    }
}
