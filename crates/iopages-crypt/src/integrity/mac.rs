//! The keys of an authenticated volume and the MAC of one block.
//!
//! Owns: deriving the tag and superblock keys from the volume key (each
//! its own key: HMAC-SHA256 of the volume key over a fixed label), sealing
//! a block into a [`Record`] and checking one. Must never: use the volume
//! key itself as a MAC key, compare MACs in variable time, or reuse a GMAC
//! nonce (a random 96-bit base per instance plus a count of its seals).

use super::layout::{Mac, Record, FLAG_ZERO};
use crate::luks::SecretBuf;
use openssl::cipher_ctx::CipherCtx;
use openssl::hash::MessageDigest;
use openssl::pkey::{PKey, Private};
use openssl::sha::Sha256;
use openssl::sign::Signer;
use parking_lot::Mutex;
use std::io;

/// The keys derived from a volume key for its tags and superblocks.
pub struct Keys {
    mac: Mac,
    tag: SecretBuf,
    sb_pkey: PKey<Private>,
    /// HMAC's inner and outer hashes with the key's pads already absorbed
    /// (each seal clones them: no key setup, no allocation).
    hmac_pads: (Sha256, Sha256),
    /// GMAC contexts with the key schedule done, reused across seals (a
    /// seal sets only the nonce).
    gcm: Mutex<Vec<CipherCtx>>,
    /// GMAC nonces: a random 96-bit base drawn when the keys are made,
    /// plus a count of seals (mod 2^96) — unique within this instance,
    /// and two instances' runs overlap with probability about
    /// (n₁ + n₂) / 2^96 — without a call to the random generator per
    /// seal.
    nonce_base: u128,
    nonces: std::sync::atomic::AtomicU64,
}

/// HMAC-SHA256's two hashes after the key's inner and outer pads (RFC
/// 2104; the 32-byte key is shorter than SHA-256's 64-byte block).
fn hmac_pads(key: &[u8]) -> (Sha256, Sha256) {
    let mut ipad = [0x36u8; 64];
    let mut opad = [0x5cu8; 64];
    for (i, k) in key.iter().enumerate() {
        ipad[i] ^= k;
        opad[i] ^= k;
    }
    let (mut inner, mut outer) = (Sha256::new(), Sha256::new());
    inner.update(&ipad);
    outer.update(&opad);
    zeroize::Zeroize::zeroize(&mut ipad);
    zeroize::Zeroize::zeroize(&mut opad);
    (inner, outer)
}

fn derive(volume_key: &[u8], label: &[u8]) -> io::Result<SecretBuf> {
    let pkey = PKey::hmac(volume_key).map_err(io::Error::other)?;
    let mut s = Signer::new(MessageDigest::sha256(), &pkey).map_err(io::Error::other)?;
    s.update(label).map_err(io::Error::other)?;
    let mut out = SecretBuf::zeroed(32).map_err(|_| io::Error::from(io::ErrorKind::OutOfMemory))?;
    s.sign(out.as_mut_slice()).map_err(io::Error::other)?;
    Ok(out)
}

impl Keys {
    /// The keys of a volume whose key is `volume_key`, tags under `mac`.
    ///
    /// **Returns:** an error only if OpenSSL fails.
    pub fn derive(mac: Mac, volume_key: &[u8]) -> io::Result<Keys> {
        let tag = derive(volume_key, b"iopages-integrity-v1 tag key")?;
        let superblock = derive(volume_key, b"iopages-integrity-v1 superblock key")?;
        let sb_pkey = PKey::hmac(superblock.as_slice()).map_err(io::Error::other)?;
        let mut base = [0u8; 16];
        openssl::rand::rand_bytes(&mut base[..12]).map_err(io::Error::other)?;
        Ok(Keys {
            nonce_base: u128::from_le_bytes(base),
            nonces: std::sync::atomic::AtomicU64::new(0),
            mac,
            hmac_pads: hmac_pads(tag.as_slice()),
            tag,
            sb_pkey,
            gcm: Mutex::new(Vec::new()),
        })
    }

    /// The MAC of the tags.
    pub fn mac(&self) -> Mac {
        self.mac
    }

    /// Seal block `block` (its ciphertext, or `None` when it is written as
    /// zeros) written in `epoch`.
    pub fn seal(&self, block: u64, epoch: u64, data: Option<&[u8]>) -> io::Result<Record> {
        let mut r = Record {
            epoch,
            flags: if data.is_none() { FLAG_ZERO } else { 0 },
            ..Record::default()
        };
        if self.mac == Mac::Gmac {
            let n = self
                .nonces
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let nonce = self.nonce_base.wrapping_add(u128::from(n)) & ((1u128 << 96) - 1);
            r.nonce[..12].copy_from_slice(&nonce.to_le_bytes()[..12]);
        }
        r.mac = self.compute(block, &r, data.unwrap_or(&[]))?;
        Ok(r)
    }

    /// Whether `r` is the seal of block `block` holding `data` (ignored for
    /// a zero record).
    pub fn verify(&self, block: u64, r: &Record, data: &[u8]) -> bool {
        if r.epoch == 0 {
            return false;
        }
        let data = if r.flags & FLAG_ZERO != 0 {
            &[][..]
        } else {
            data
        };
        match self.compute(block, r, data) {
            Ok(mac) => openssl::memcmp::eq(&mac, &r.mac),
            Err(_) => false,
        }
    }

    fn compute(&self, block: u64, r: &Record, data: &[u8]) -> io::Result<[u8; 32]> {
        let mut head = [0u8; 48];
        head[..16].copy_from_slice(b"iopages-tag-v1\0\0");
        head[16..24].copy_from_slice(&block.to_le_bytes());
        head[24..32].copy_from_slice(&r.epoch.to_le_bytes());
        head[32] = r.flags;
        let mut out = [0u8; 32];
        match self.mac {
            Mac::HmacSha256 => {
                let mut inner = self.hmac_pads.0.clone();
                inner.update(&head);
                inner.update(&r.nonce);
                inner.update(data);
                let mut outer = self.hmac_pads.1.clone();
                outer.update(&inner.finish());
                out = outer.finish();
            }
            Mac::Gmac => {
                let mut ctx = self.gcm_context()?;
                let res = gmac(&mut ctx, &r.nonce[..12], &head, data, &mut out[..16]);
                self.gcm.lock().push(ctx);
                res?;
            }
        }
        Ok(out)
    }

    /// A GMAC context keyed with the tag key: a pooled one, or a new one.
    fn gcm_context(&self) -> io::Result<CipherCtx> {
        if let Some(c) = self.gcm.lock().pop() {
            return Ok(c);
        }
        let mut c = CipherCtx::new().map_err(io::Error::other)?;
        c.encrypt_init(
            Some(openssl::cipher::Cipher::aes_256_gcm()),
            Some(self.tag.as_slice()),
            None,
        )
        .map_err(io::Error::other)?;
        Ok(c)
    }

    /// HMAC-SHA256 of `data` under the superblock key (superblocks are
    /// authenticated whatever the tags' MAC).
    pub fn superblock_mac(&self, data: &[u8]) -> io::Result<[u8; 32]> {
        let mut s =
            Signer::new(MessageDigest::sha256(), &self.sb_pkey).map_err(io::Error::other)?;
        s.update(data).map_err(io::Error::other)?;
        let mut out = [0u8; 32];
        s.sign(&mut out).map_err(io::Error::other)?;
        Ok(out)
    }
}

/// GMAC of `head ‖ data` under `nonce` with a keyed context: GCM with
/// both as associated data and no plaintext.
fn gmac(
    ctx: &mut CipherCtx,
    nonce: &[u8],
    head: &[u8],
    data: &[u8],
    tag: &mut [u8],
) -> io::Result<()> {
    ctx.encrypt_init(None, None, Some(nonce))
        .map_err(io::Error::other)?;
    ctx.cipher_update(head, None).map_err(io::Error::other)?;
    ctx.cipher_update(data, None).map_err(io::Error::other)?;
    ctx.cipher_final(&mut []).map_err(io::Error::other)?;
    ctx.tag(tag).map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_binds_data_block_epoch_and_flag() {
        for mac in [Mac::HmacSha256, Mac::Gmac] {
            let k = Keys::derive(mac, &[9u8; 64]).unwrap();
            let data = vec![0x5a; 4096];
            let r = k.seal(7, 3, Some(&data)).unwrap();
            assert!(k.verify(7, &r, &data), "{mac}");
            assert!(!k.verify(8, &r, &data), "moved block accepted ({mac})");
            let mut flipped = data.clone();
            flipped[100] ^= 1;
            assert!(!k.verify(7, &r, &flipped), "flip accepted ({mac})");
            let mut older = r;
            older.epoch = 2;
            assert!(!k.verify(7, &older, &data), "epoch not bound ({mac})");
            let z = k.seal(7, 3, None).unwrap();
            assert!(z.reads_zero());
            assert!(k.verify(7, &z, &data), "a zero record ignores the bytes");
            let mut forged = z;
            forged.flags = 0;
            assert!(!k.verify(7, &forged, &[0u8; 4096]));
            assert!(!k.verify(7, &Record::default(), &data));
            let other = Keys::derive(mac, &[8u8; 64]).unwrap();
            assert!(!other.verify(7, &r, &data), "another key accepted ({mac})");
        }
    }

    /// The pads-and-clones HMAC and the pooled GMAC give what OpenSSL's
    /// one-shot HMAC and AES-GCM give.
    #[test]
    fn the_fast_macs_match_openssl_one_shot() {
        use openssl::symm::{encrypt_aead, Cipher};
        let k = Keys::derive(Mac::HmacSha256, &[3u8; 64]).unwrap();
        let data = vec![0xa5u8; 4096];
        let r = k.seal(9, 4, Some(&data)).unwrap();
        let pkey = PKey::hmac(k.tag.as_slice()).unwrap();
        let mut s = Signer::new(MessageDigest::sha256(), &pkey).unwrap();
        let mut head = [0u8; 48];
        head[..16].copy_from_slice(b"iopages-tag-v1\0\0");
        head[16..24].copy_from_slice(&9u64.to_le_bytes());
        head[24..32].copy_from_slice(&4u64.to_le_bytes());
        s.update(&head).unwrap();
        s.update(&[0u8; 16]).unwrap();
        s.update(&data).unwrap();
        assert_eq!(s.sign_to_vec().unwrap(), r.mac.to_vec());

        let g = Keys::derive(Mac::Gmac, &[3u8; 64]).unwrap();
        for _ in 0..3 {
            let r = g.seal(9, 4, Some(&data)).unwrap();
            let mut aad = head.to_vec();
            aad.extend_from_slice(&data);
            let mut tag = [0u8; 16];
            let ct = encrypt_aead(
                Cipher::aes_256_gcm(),
                g.tag.as_slice(),
                Some(&r.nonce[..12]),
                &aad,
                &[],
                &mut tag,
            )
            .unwrap();
            assert!(ct.is_empty());
            assert_eq!(&r.mac[..16], &tag);
            assert_eq!(&r.mac[16..], &[0u8; 16]);
        }
    }

    #[test]
    fn gmac_nonces_differ_between_seals() {
        let k = Keys::derive(Mac::Gmac, &[1u8; 32]).unwrap();
        let a = k.seal(1, 1, Some(&[0u8; 4096])).unwrap();
        let b = k.seal(1, 1, Some(&[0u8; 4096])).unwrap();
        assert_ne!(a.nonce, b.nonce);
        assert_ne!(a.mac, b.mac);
    }
}
