//! LUKS2, structure-aware: the input is a *recipe* applied to a valid
//! embedded image (cryptsetup-made, passphrase "fuzz"); header checksums
//! are recomputed after the edits, so the fuzzer's effort reaches the JSON
//! parser and the crate's metadata planner instead of dying at the
//! checksum.
//!
//! Input layout:
//! - byte 0: bits 0..=6 pick the base image; bit 7 = raw-JSON mode.
//! - raw-JSON mode: byte 1 = flags (bit 0: leave the primary's JSON alone,
//!   bit 1: leave the secondary's alone, bit 2: secondary seqid + 1,
//!   bit 3: don't fix checksums); the rest is JSON text written into the
//!   JSON areas (NUL-terminated, cut to the area).
//! - recipe mode: a sequence of edits (one opcode byte, then operands),
//!   applied to the base's parsed JSON or to the binary headers; see
//!   `apply`.
#![no_main]

use iopages_fuzz::{exercise_luks, luks2_fix_checksum, luks2_put_json, BIN};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

const BASES: [&[u8]; 2] = [
    include_bytes!("../seeds/l2-pbkdf2.img"),
    include_bytes!("../seeds/l2-argon2id.img"),
];
const SECONDARY: usize = 16 << 10;

/// Strings the LUKS2 JSON uses, good and bad.
const WORDS: &[&str] = &[
    "luks2",
    "luks1",
    "raw",
    "crypt",
    "linear",
    "pbkdf2",
    "argon2i",
    "argon2id",
    "sha1",
    "sha256",
    "sha512",
    "sha384",
    "ripemd160",
    "whirlpool",
    "aes-xts-plain64",
    "aes-cbc-essiv:sha256",
    "aes-xts-plain",
    "twofish-xts-plain64",
    "dynamic",
    "0",
    "1",
    "2",
    "31",
    "32",
    "512",
    "4096",
    "8192",
    "16384",
    "32768",
    "131072",
    "163840",
    "12288",
    "4194304",
    "18446744073709551615",
    "-1",
    "",
    "keyslots",
    "segments",
    "digests",
    "config",
    "tokens",
    "type",
    "key_size",
    "af",
    "stripes",
    "hash",
    "area",
    "offset",
    "size",
    "encryption",
    "kdf",
    "iterations",
    "time",
    "memory",
    "cpus",
    "salt",
    "digest",
    "iv_tweak",
    "sector_size",
    "json_size",
    "keyslots_size",
    "flags",
    "requirements",
    "mandatory",
    "priority",
    "integrity",
    "online-reencrypt",
    "allow-discards",
    "AAAA",
    "AA==",
    "====",
    "p1z0+BFo1ePzmla4etyfHjhHWPAtVShQaOV1TDmg590=",
];

/// Numbers at the edges of what the crate checks.
const NUMS: &[u64] = &[
    0,
    1,
    2,
    4,
    16,
    31,
    32,
    33,
    48,
    64,
    128,
    511,
    512,
    513,
    1000,
    1024,
    4000,
    4096,
    4097,
    8192,
    16384,
    32768,
    131072,
    163840,
    1 << 20,
    64 << 20,
    u32::MAX as u64,
    1 << 32,
    1 << 53,
    u64::MAX,
];

struct Input<'a>(&'a [u8]);
impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.byte()?, self.byte()?]))
    }
    fn u64(&mut self) -> Option<u64> {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.byte()?;
        }
        Some(u64::from_le_bytes(b))
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn number(&mut self) -> Option<u64> {
        let sel = self.byte()?;
        Some(if sel & 0x80 == 0 {
            NUMS[sel as usize % NUMS.len()]
        } else if sel & 0x40 == 0 {
            u64::from(self.u16()?)
        } else {
            self.u64()?
        })
    }
    fn word(&mut self) -> Option<&'static str> {
        Some(WORDS[self.byte()? as usize % WORDS.len()])
    }
}

/// JSON pointers to every node of `v` (root excluded).
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    let esc = |k: &str| k.replace('~', "~0").replace('/', "~1");
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = format!("{at}/{}", esc(k));
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        Value::Array(xs) => {
            for (i, x) in xs.iter().enumerate() {
                let p = format!("{at}/{i}");
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        _ => {}
    }
}

fn split_parent(p: &str) -> (&str, String) {
    let i = p.rfind('/').unwrap();
    (&p[..i], p[i + 1..].replace("~1", "/").replace("~0", "~"))
}

struct Edit {
    json: Value,
    /// Write the JSON into the primary / secondary copy.
    put: [bool; 2],
    /// Recompute each copy's checksum.
    fix: [bool; 2],
}

/// Apply one recipe step. `None` when the input ran out.
fn apply(inp: &mut Input, e: &mut Edit, img: &mut Vec<u8>) -> Option<()> {
    let op = inp.byte()?;
    let mut ptrs = Vec::new();
    pointers(&e.json, String::new(), &mut ptrs);
    let target = if ptrs.is_empty() {
        None
    } else {
        Some(ptrs[inp.u16()? as usize % ptrs.len()].clone())
    };
    match (op % 16, target) {
        (0, Some(p)) => *e.json.pointer_mut(&p)? = json!(inp.number()?),
        (1, Some(p)) => *e.json.pointer_mut(&p)? = json!(inp.number()?.to_string()),
        (2, Some(p)) => *e.json.pointer_mut(&p)? = json!(inp.word()?),
        (3, Some(p)) => {
            let (parent, key) = split_parent(&p);
            match e.json.pointer_mut(parent)? {
                Value::Object(m) => {
                    m.remove(&key);
                }
                Value::Array(xs) => {
                    let i: usize = key.parse().ok()?;
                    if i < xs.len() {
                        xs.remove(i);
                    }
                }
                _ => {}
            }
        }
        (4, Some(p)) => {
            *e.json.pointer_mut(&p)? = match inp.byte()? % 6 {
                0 => Value::Null,
                1 => json!(true),
                2 => json!({}),
                3 => json!([]),
                4 => json!(-1),
                _ => json!(1.5),
            }
        }
        (5, Some(p)) => {
            // Copy the node under a new key of its parent object (e.g. a
            // second keyslot or digest), or append it to its array.
            let v = e.json.pointer(&p)?.clone();
            let (parent, _) = split_parent(&p);
            let key = inp.word()?;
            match e.json.pointer_mut(parent)? {
                Value::Object(m) => {
                    m.insert(key.to_string(), v);
                }
                Value::Array(xs) => xs.push(v),
                _ => {}
            }
        }
        (6, Some(p)) => {
            let n = inp.byte()? as usize % 64;
            let s = String::from_utf8_lossy(inp.bytes(n)).into_owned();
            *e.json.pointer_mut(&p)? = json!(s);
        }
        (7, Some(p)) => {
            // Insert a new member into an object node.
            let key = inp.word()?;
            let val = match inp.byte()? % 3 {
                0 => json!(inp.number()?),
                1 => json!(inp.word()?),
                _ => json!([inp.word()?]),
            };
            if let Value::Object(m) = e.json.pointer_mut(&p)? {
                m.insert(key.to_string(), val);
            }
        }
        (8, Some(p)) => {
            // Swap with another node's value.
            let q = ptrs[inp.u16()? as usize % ptrs.len()].clone();
            if !p.starts_with(&q) && !q.starts_with(&p) {
                let a = e.json.pointer(&p)?.clone();
                let b = std::mem::replace(e.json.pointer_mut(&q)?, a);
                *e.json.pointer_mut(&p)? = b;
            }
        }
        (9, _) => {
            // Binary header field of one copy.
            let copy = (inp.byte()? & 1) as usize;
            let off = [0, SECONDARY][copy];
            let field = inp.byte()? % 8;
            let v = inp.number()?;
            if img.len() < off + BIN {
                return Some(());
            }
            let h = &mut img[off..off + BIN];
            match field {
                0 => h[16..24].copy_from_slice(&v.to_be_bytes()), // seqid
                1 => {
                    let s = iopages_fuzz::LUKS2_HDR_SIZES[v as usize % 9];
                    h[8..16].copy_from_slice(&s.to_be_bytes()) // hdr_size
                }
                2 => h[8..16].copy_from_slice(&v.to_be_bytes()),
                3 => h[6..8].copy_from_slice(&(v as u16).to_be_bytes()), // version
                4 => h[256..264].copy_from_slice(&v.to_be_bytes()),      // hdr_offset
                5 => {
                    let alg = ["sha1", "sha256", "sha512", "sha384", "crc32", ""][v as usize % 6];
                    h[72..104].fill(0);
                    h[72..72 + alg.len()].copy_from_slice(alg.as_bytes());
                }
                6 => h[(v % 6) as usize] ^= 0x20, // magic
                _ => {
                    // label / uuid / subsystem text
                    let at = [24usize, 168, 208][(v % 3) as usize];
                    let n = inp.byte()? as usize % 48;
                    let t = inp.bytes(n).to_vec();
                    h[at..at + 48].fill(0);
                    h[at..at + t.len().min(40)].copy_from_slice(&t[..t.len().min(40)]);
                }
            }
        }
        (10, _) => {
            let b = inp.byte()?;
            e.put = [b & 1 == 0, b & 2 == 0];
            e.fix = [b & 4 == 0, b & 8 == 0];
        }
        (11, _) => {
            // Flip bytes in the keyslot area / anywhere past the headers.
            let at = 2 * SECONDARY + inp.u16()? as usize * 2;
            if at < img.len() {
                img[at] ^= inp.byte()? | 1;
            }
        }
        (12, _) => {
            // Cut the image (truncated keyslot area, missing secondary...).
            let n = inp.u64()? as usize % (img.len() + 1);
            img.truncate(n.max(BIN));
        }
        (13, Some(p)) => {
            // Wrap a node in an array / object.
            let v = e.json.pointer(&p)?.clone();
            *e.json.pointer_mut(&p)? = if inp.byte()? & 1 == 0 {
                json!([v])
            } else {
                json!({ "0": v })
            };
        }
        (14, _) => {
            // Grow the image (zeros) so areas may fit.
            let n = inp.u16()? as usize * 64;
            img.resize(img.len() + n, 0);
        }
        _ => {}
    }
    Some(())
}

fn finish(img: &mut Vec<u8>, json: &[u8], put: [bool; 2], fix: [bool; 2]) {
    for (i, off) in [0, SECONDARY].into_iter().enumerate() {
        if img.len() < off + BIN {
            continue;
        }
        if put[i] {
            luks2_put_json(img, off, json);
        }
        if fix[i] {
            luks2_fix_checksum(img, off);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let Some(b0) = inp.byte() else { return };
    let mut img = BASES[(b0 & 0x7f) as usize % BASES.len()].to_vec();
    if b0 & 0x80 != 0 {
        let flags = inp.byte().unwrap_or(0);
        if flags & 4 != 0 {
            let s = u64::from_be_bytes(img[SECONDARY + 16..SECONDARY + 24].try_into().unwrap());
            img[SECONDARY + 16..SECONDARY + 24].copy_from_slice(&s.wrapping_add(1).to_be_bytes());
        }
        let json = inp.0.to_vec();
        let fix = flags & 8 == 0;
        finish(
            &mut img,
            &json,
            [flags & 1 == 0, flags & 2 == 0],
            [fix, fix],
        );
    } else {
        let text_end = img[BIN..SECONDARY].iter().position(|&c| c == 0).unwrap();
        let json: Value = serde_json::from_slice(&img[BIN..BIN + text_end]).unwrap();
        let mut e = Edit {
            json,
            put: [true, true],
            fix: [true, true],
        };
        for _ in 0..64 {
            if apply(&mut inp, &mut e, &mut img).is_none() {
                break;
            }
        }
        let text = serde_json::to_vec(&e.json).unwrap();
        finish(&mut img, &text, e.put, e.fix);
    }
    exercise_luks(&img);
});
