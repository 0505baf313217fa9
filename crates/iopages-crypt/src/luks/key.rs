//! Key material: the volume (master) key, and the buffers that hold
//! derived keys, decrypted keyslot areas and anti-forensic stripes while a
//! volume is opened or formatted.
//!
//! Owns: [`SecretBuf`] (one heap allocation, `mlock`ed where the kernel
//! allows it, zeroized and unlocked on drop) and [`MasterKey`] on top of
//! it. Must never: print or log key bytes (`Debug` shows lengths only),
//! reallocate a buffer (a moved copy would escape the wipe), or fail
//! because `mlock` was refused — a refusal (`RLIMIT_MEMLOCK`, `EPERM`) is
//! recorded and the key still works.
//!
//! cryptsetup keeps its volume key in `struct volume_key` (`crypt_alloc_
//! volume_key`, wiped by `crypt_free_volume_key`) and locks its whole
//! process with `mlockall`; here only the key buffers are locked, one
//! `mlock` per buffer.

use std::collections::TryReserveError;
use zeroize::Zeroize;

/// A heap buffer for secrets: fixed length, zero-filled at first,
/// `mlock`ed best effort, wiped and unlocked on drop.
pub struct SecretBuf {
    buf: Box<[u8]>,
    /// 0 when locked (or empty); the `errno` of the refused `mlock`
    /// otherwise.
    lock_errno: i32,
}

impl SecretBuf {
    /// A zero-filled buffer of `len` bytes, locked in memory if the kernel
    /// allows it.
    ///
    /// **Returns:** an error only when the memory cannot be had (the
    /// caller turns that into a clear message instead of an abort).
    pub(crate) fn zeroed(len: usize) -> Result<SecretBuf, TryReserveError> {
        let mut v: Vec<u8> = Vec::new();
        v.try_reserve_exact(len)?;
        v.resize(len, 0);
        let buf = v.into_boxed_slice();
        let mut lock_errno = 0;
        if !buf.is_empty() {
            // SAFETY: the pointer and length describe one live allocation
            // that this value owns until drop, where it is unlocked.
            let rc = unsafe { libc::mlock(buf.as_ptr().cast(), buf.len()) };
            if rc != 0 {
                lock_errno = std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::ENOMEM);
            }
        }
        Ok(SecretBuf { buf, lock_errno })
    }

    /// A locked copy of `bytes`.
    #[cfg(test)]
    pub(crate) fn copy_of(bytes: &[u8]) -> Result<SecretBuf, TryReserveError> {
        let mut s = SecretBuf::zeroed(bytes.len())?;
        s.buf.copy_from_slice(bytes);
        Ok(s)
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Whether `mlock` succeeded (an empty buffer counts as locked).
    pub fn is_locked(&self) -> bool {
        self.lock_errno == 0
    }

    /// Why `mlock` was refused, if it was.
    pub fn lock_error(&self) -> Option<std::io::Error> {
        (self.lock_errno != 0).then(|| std::io::Error::from_raw_os_error(self.lock_errno))
    }
}

impl Drop for SecretBuf {
    fn drop(&mut self) {
        self.buf.zeroize();
        if self.lock_errno == 0 && !self.buf.is_empty() {
            // SAFETY: the same allocation that was locked in `zeroed`.
            unsafe {
                libc::munlock(self.buf.as_ptr().cast(), self.buf.len());
            }
        }
    }
}

impl std::fmt::Debug for SecretBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretBuf")
            .field("len", &self.buf.len())
            .field("locked", &self.is_locked())
            .finish()
    }
}

/// The volume key of a LUKS volume (LUKS1 calls it the master key, LUKS2
/// the volume key): 32 or 64 bytes for `aes-xts-plain64`, the first half
/// the data key and the second the tweak key.
///
/// Zeroized on drop; `mlock`ed when the kernel allows it — see
/// [`MasterKey::is_locked`] and [`MasterKey::lock_error`].
pub struct MasterKey(SecretBuf);

impl MasterKey {
    pub(crate) fn from_secret(buf: SecretBuf) -> MasterKey {
        MasterKey(buf)
    }

    /// The key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// Key length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the key is empty (never, for an opened volume).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the key's memory is locked against swapping.
    pub fn is_locked(&self) -> bool {
        self.0.is_locked()
    }

    /// Why `mlock` was refused (typically `ENOMEM` under a small
    /// `RLIMIT_MEMLOCK`, or `EPERM`), if it was.
    pub fn lock_error(&self) -> Option<std::io::Error> {
        self.0.lock_error()
    }
}

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("MasterKey")
            .field("len", &self.0.len())
            .field("locked", &self.0.is_locked())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_buf_is_zeroed_sized_and_locked_or_says_why() {
        let mut s = SecretBuf::zeroed(64).unwrap();
        assert_eq!(s.len(), 64);
        assert!(s.as_slice().iter().all(|&b| b == 0));
        s.as_mut_slice()[0] = 7;
        assert_eq!(s.as_slice()[0], 7);
        // Either locked, or the refusal is recorded with its errno.
        assert!(s.is_locked() || s.lock_error().is_some());
        let dbg = format!("{s:?}");
        assert!(dbg.contains("len: 64"), "{dbg}");
    }

    #[test]
    fn master_key_debug_hides_the_bytes() {
        let k = MasterKey::from_secret(SecretBuf::copy_of(&[0xAB; 32]).unwrap());
        let dbg = format!("{k:?}");
        assert!(
            !dbg.contains("171") && !dbg.to_lowercase().contains("ab,"),
            "{dbg}"
        );
        assert_eq!(k.as_bytes(), &[0xAB; 32]);
    }

    #[test]
    fn empty_buffer_needs_no_lock() {
        let s = SecretBuf::zeroed(0).unwrap();
        assert!(s.is_empty() && s.is_locked());
    }
}
