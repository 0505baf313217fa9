//! The anti-forensic splitter of LUKS (LUKS1 spec §2.4, "AF-Splitter";
//! LUKS2 `af.type = "luks1"`).
//!
//! Owns: `split` (key → `stripes` stripes, all but the last random) and
//! `merge` (stripes → key), and the diffuse function `H` they share.
//! Must never: keep a stripe or the running value outside a wiped buffer,
//! or panic on lengths taken from a header (every length is checked and
//! reported as an error).
//!
//! With `d_0 = 0`, `d_k = H(d_{k-1} ⊕ s_k)` for `k = 1 .. n-1` and
//! `s_n = d_{n-1} ⊕ key`. `H` hashes the buffer in digest-sized blocks,
//! block `i` replaced by `hash(be32(i) ‖ block_i)` cut to the block's
//! length (the last block may be short).

use super::kdf::Hash;
use super::key::SecretBuf;
use super::LuksError;

/// The stripe count every LUKS implementation writes (LUKS1
/// `LUKS_STRIPES`, LUKS2 `af.stripes`).
pub const STRIPES: u32 = 4000;

/// Bytes of split material for a key of `key_len` bytes.
pub fn split_len(key_len: usize, stripes: u32) -> Option<usize> {
    key_len.checked_mul(stripes as usize)
}

/// The diffuse function `H` over `buf`, in place.
fn diffuse(buf: &mut [u8], hash: Hash) {
    let dlen = hash.digest_len();
    let mut out = [0u8; 64];
    for (i, block) in buf.chunks_mut(dlen).enumerate() {
        // Index as a big-endian 32-bit counter, as the spec's `H` does.
        let iv = (i as u32).to_be_bytes();
        hash.digest_into(&[&iv, block], &mut out);
        let n = block.len();
        block.copy_from_slice(&out[..n]);
    }
    zeroize::Zeroize::zeroize(&mut out);
}

fn xor_into(dst: &mut [u8], src: &[u8]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d ^= s);
}

fn alloc(len: usize) -> Result<SecretBuf, LuksError> {
    SecretBuf::zeroed(len).map_err(|_| {
        LuksError::Io(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("cannot allocate {len} bytes for anti-forensic stripes"),
        ))
    })
}

/// Split `key` into `stripes` stripes (`key.len() * stripes` bytes).
pub(crate) fn split(key: &[u8], stripes: u32, hash: Hash) -> Result<SecretBuf, LuksError> {
    let len = split_len(key.len(), stripes)
        .filter(|_| stripes > 0)
        .ok_or_else(|| LuksError::InvalidOptions(format!("bad AF stripe count {stripes}")))?;
    let mut out = alloc(len)?;
    let klen = key.len();
    if klen == 0 {
        return Ok(out);
    }
    let material = out.as_mut_slice();
    // All stripes but the last are random.
    openssl::rand::rand_bytes(&mut material[..len - klen])
        .map_err(|e| LuksError::Io(std::io::Error::other(format!("OpenSSL random: {e}"))))?;
    let mut d = alloc(klen)?;
    for stripe in material[..len - klen].chunks(klen) {
        xor_into(d.as_mut_slice(), stripe);
        diffuse(d.as_mut_slice(), hash);
    }
    let last = &mut material[len - klen..];
    last.copy_from_slice(d.as_slice());
    xor_into(last, key);
    Ok(out)
}

/// Merge `stripes` stripes of `key_len` bytes each (the first
/// `key_len * stripes` bytes of `material`) back into the key.
///
/// **Returns:** [`LuksError::Corrupt`] when `material` is too short or
/// `stripes` is 0.
pub(crate) fn merge(
    material: &[u8],
    key_len: usize,
    stripes: u32,
    hash: Hash,
) -> Result<SecretBuf, LuksError> {
    let len = split_len(key_len, stripes)
        .filter(|&l| stripes > 0 && key_len > 0 && l <= material.len())
        .ok_or_else(|| {
            LuksError::Corrupt(format!(
                "anti-forensic material of {} bytes cannot hold {stripes} stripes of {key_len} bytes",
                material.len()
            ))
        })?;
    let mut d = alloc(key_len)?;
    for stripe in material[..len - key_len].chunks(key_len) {
        xor_into(d.as_mut_slice(), stripe);
        diffuse(d.as_mut_slice(), hash);
    }
    xor_into(d.as_mut_slice(), &material[len - key_len..len]);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_then_merge_gives_the_key_back() {
        for hash in [Hash::Sha1, Hash::Sha256, Hash::Sha512] {
            for key_len in [16usize, 32, 50, 64] {
                let key: Vec<u8> = (0..key_len as u8).map(|b| b.wrapping_mul(37)).collect();
                for stripes in [1u32, 2, 3, 4000] {
                    let m = split(&key, stripes, hash).unwrap();
                    assert_eq!(m.len(), key_len * stripes as usize);
                    let k = merge(m.as_slice(), key_len, stripes, hash).unwrap();
                    assert_eq!(k.as_slice(), &key[..], "{hash} {key_len} {stripes}");
                }
            }
        }
    }

    #[test]
    fn one_flipped_bit_in_any_stripe_changes_the_key() {
        let key = [0x5au8; 32];
        let m = split(&key, 50, Hash::Sha256).unwrap();
        for at in [0usize, 31, 32 * 25, 32 * 50 - 1] {
            let mut bad = m.as_slice().to_vec();
            bad[at] ^= 1;
            let k = merge(&bad, 32, 50, Hash::Sha256).unwrap();
            assert_ne!(k.as_slice(), &key[..], "flip at {at}");
        }
    }

    /// With one stripe the split is the key itself; with two, the first
    /// stripe's diffusion is `hash(be32(0) ‖ s1)` — checked by hand.
    #[test]
    fn diffuse_matches_the_spec_by_hand() {
        let key = [7u8; 20];
        let m = split(&key, 1, Hash::Sha1).unwrap();
        assert_eq!(m.as_slice(), &key);

        let s1 = [1u8; 24];
        let mut material = s1.to_vec();
        // Two SHA-1 blocks: bytes 0..20 with counter 0, 20..24 with 1.
        let mut h0 = [0u8; 64];
        Hash::Sha1.digest_into(&[&0u32.to_be_bytes(), &s1[..20]], &mut h0);
        let mut h1 = [0u8; 64];
        Hash::Sha1.digest_into(&[&1u32.to_be_bytes(), &s1[20..]], &mut h1);
        let d: Vec<u8> = h0[..20].iter().chain(&h1[..4]).copied().collect();
        let want = [9u8; 24];
        let last: Vec<u8> = d.iter().zip(want).map(|(a, b)| a ^ b).collect();
        material.extend_from_slice(&last);
        assert_eq!(
            merge(&material, 24, 2, Hash::Sha1).unwrap().as_slice(),
            &want
        );
    }

    #[test]
    fn short_material_is_an_error() {
        assert!(matches!(
            merge(&[0u8; 100], 32, 4000, Hash::Sha256),
            Err(LuksError::Corrupt(_))
        ));
        assert!(matches!(
            merge(&[0u8; 100], 32, 0, Hash::Sha256),
            Err(LuksError::Corrupt(_))
        ));
        assert!(matches!(
            merge(&[0u8; 100], usize::MAX, 4000, Hash::Sha256),
            Err(LuksError::Corrupt(_))
        ));
    }
}
