//! The keys of an authenticated volume and the MAC of one block.
//!
//! Owns: deriving the tag and superblock keys from the volume key (each
//! its own key: HMAC-SHA256 of the volume key over a fixed label), sealing
//! a block into a [`Record`] and checking one. Must never: use the volume
//! key itself as a MAC key, compare MACs in variable time, or reuse a GMAC
//! nonce on purpose (each seal draws 96 random bits).

use super::layout::{Mac, Record, FLAG_ZERO};
use crate::luks::SecretBuf;
use openssl::hash::MessageDigest;
use openssl::pkey::{PKey, Private};
use openssl::sign::Signer;
use openssl::symm::{Cipher, Crypter, Mode};
use std::io;

/// The keys derived from a volume key for its tags and superblocks.
pub struct Keys {
    mac: Mac,
    tag: SecretBuf,
    superblock: SecretBuf,
    tag_pkey: PKey<Private>,
    sb_pkey: PKey<Private>,
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
        let tag_pkey = PKey::hmac(tag.as_slice()).map_err(io::Error::other)?;
        let sb_pkey = PKey::hmac(superblock.as_slice()).map_err(io::Error::other)?;
        Ok(Keys {
            mac,
            tag,
            superblock,
            tag_pkey,
            sb_pkey,
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
            openssl::rand::rand_bytes(&mut r.nonce[..12]).map_err(io::Error::other)?;
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
                let mut s = Signer::new(MessageDigest::sha256(), &self.tag_pkey)
                    .map_err(io::Error::other)?;
                s.update(&head).map_err(io::Error::other)?;
                s.update(&r.nonce).map_err(io::Error::other)?;
                s.update(data).map_err(io::Error::other)?;
                s.sign(&mut out).map_err(io::Error::other)?;
            }
            Mac::Gmac => {
                let mut c = Crypter::new(
                    Cipher::aes_256_gcm(),
                    Mode::Encrypt,
                    self.tag.as_slice(),
                    Some(&r.nonce[..12]),
                )
                .map_err(io::Error::other)?;
                c.aad_update(&head).map_err(io::Error::other)?;
                c.aad_update(data).map_err(io::Error::other)?;
                c.finalize(&mut []).map_err(io::Error::other)?;
                c.get_tag(&mut out[..16]).map_err(io::Error::other)?;
            }
        }
        Ok(out)
    }

    /// HMAC-SHA256 of `data` under the superblock key (superblocks are
    /// authenticated whatever the tags' MAC).
    pub fn superblock_mac(&self, data: &[u8]) -> io::Result<[u8; 32]> {
        let _ = &self.superblock;
        let mut s =
            Signer::new(MessageDigest::sha256(), &self.sb_pkey).map_err(io::Error::other)?;
        s.update(data).map_err(io::Error::other)?;
        let mut out = [0u8; 32];
        s.sign(&mut out).map_err(io::Error::other)?;
        Ok(out)
    }
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

    #[test]
    fn gmac_nonces_differ_between_seals() {
        let k = Keys::derive(Mac::Gmac, &[1u8; 32]).unwrap();
        let a = k.seal(1, 1, Some(&[0u8; 4096])).unwrap();
        let b = k.seal(1, 1, Some(&[0u8; 4096])).unwrap();
        assert_ne!(a.nonce, b.nonce);
        assert_ne!(a.mac, b.mac);
    }
}
