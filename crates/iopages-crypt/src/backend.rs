//! Backends: where the crypt target's ciphertext lives.
//!
//! Owns: the [`Backend`] contract (positional reads and writes of whole
//! buffers, flush) and the RAM disk, the seed's encrypted RAM device.
//! Must never: accept a short read or write silently — an I/O either moves
//! every byte or returns an error, and an out-of-range request is refused
//! before anything is touched.

use parking_lot::RwLock;
use std::io;

/// A block device the crypt target can sit on.
pub trait Backend: Send + Sync {
    /// Bytes the device holds.
    fn size_bytes(&self) -> u64;

    /// Write `segments` back to back starting at byte `offset`.
    ///
    /// **Context:** may block. **Returns:** an error (and possibly a
    /// partial write, as any device may leave) if any byte could not be
    /// written; `InvalidInput` before touching anything if the range
    /// leaves the device.
    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()>;

    /// Fill `segments` back to back from byte `offset`.
    ///
    /// **Context:** may block. **Returns:** an error if any byte could not
    /// be read; `InvalidInput` if the range leaves the device.
    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()>;

    /// Make completed writes durable.
    fn flush(&self) -> io::Result<()>;
}

/// Check that `len` bytes at `offset` lie inside a device of `size` bytes.
pub fn check_range(offset: u64, len: u64, size: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("I/O of {len} bytes at offset {offset} leaves the device ({size} bytes)"),
        )),
    }
}

/// Bytes per lock stripe of the RAM disk.
pub const RAMDISK_STRIPE_BYTES: usize = 64 << 10;

/// A RAM disk: memory split into 64 KiB stripes, each behind its own
/// reader-writer lock, so I/Os to different stripes run in parallel and
/// overlapping ones are serialised (never torn within a stripe).
pub struct RamDisk {
    stripes: Box<[RwLock<Box<[u8]>>]>,
    size_bytes: u64,
}

impl RamDisk {
    /// A zero-filled RAM disk of `size_bytes` (a multiple of 4096).
    ///
    /// **Returns:** `InvalidInput` for a zero or unaligned size.
    pub fn new(size_bytes: u64) -> io::Result<RamDisk> {
        if size_bytes == 0 || !size_bytes.is_multiple_of(4096) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("RAM disk size {size_bytes} must be a non-zero multiple of 4096 bytes"),
            ));
        }
        let n = (size_bytes as usize).div_ceil(RAMDISK_STRIPE_BYTES);
        let stripes = (0..n)
            .map(|i| {
                let len =
                    (size_bytes as usize - i * RAMDISK_STRIPE_BYTES).min(RAMDISK_STRIPE_BYTES);
                RwLock::new(vec![0u8; len].into_boxed_slice())
            })
            .collect();
        Ok(RamDisk {
            stripes,
            size_bytes,
        })
    }

    /// Visit the stripes covering `len` bytes at `offset`, in order, with
    /// (stripe index, offset inside the stripe, bytes in this stripe).
    fn spans(offset: u64, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let mut pos = offset as usize;
        let end = pos + len;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let (i, off) = (pos / RAMDISK_STRIPE_BYTES, pos % RAMDISK_STRIPE_BYTES);
            let n = (RAMDISK_STRIPE_BYTES - off).min(end - pos);
            pos += n;
            Some((i, off, n))
        })
    }
}

impl Backend for RamDisk {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let total: usize = segments.iter().map(|s| s.len()).sum();
        check_range(offset, total as u64, self.size_bytes)?;
        let mut at = offset;
        for seg in segments {
            let mut done = 0;
            for (i, off, n) in Self::spans(at, seg.len()) {
                self.stripes[i].write()[off..off + n].copy_from_slice(&seg[done..done + n]);
                done += n;
            }
            at += seg.len() as u64;
        }
        Ok(())
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        let total: usize = segments.iter().map(|s| s.len()).sum();
        check_range(offset, total as u64, self.size_bytes)?;
        let mut at = offset;
        for seg in segments.iter_mut() {
            let mut done = 0;
            let len = seg.len();
            for (i, off, n) in Self::spans(at, len) {
                seg[done..done + n].copy_from_slice(&self.stripes[i].read()[off..off + n]);
                done += n;
            }
            at += len as u64;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_across_stripes_read_back() {
        let d = RamDisk::new(1 << 20).unwrap();
        let a: Vec<u8> = (0..70_000u32).map(|i| (i * 7) as u8).collect();
        let b = vec![0xabu8; 5000];
        let off = RAMDISK_STRIPE_BYTES as u64 - 1000;
        d.write_at(off, &[&a, &b]).unwrap();
        let mut x = vec![0u8; a.len()];
        let mut y = vec![0u8; b.len()];
        d.read_at(off, &mut [&mut x, &mut y]).unwrap();
        assert_eq!((x, y), (a, b));
    }

    #[test]
    fn out_of_range_and_bad_sizes_are_errors_and_touch_nothing() {
        assert!(RamDisk::new(0).is_err());
        assert!(RamDisk::new(4097).is_err());
        let d = RamDisk::new(8192).unwrap();
        let e = d.write_at(4096, &[&[1u8; 4097]]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("leaves the device"), "{e}");
        let mut back = [9u8; 8192];
        d.read_at(0, &mut [&mut back]).unwrap();
        assert!(
            back.iter().all(|&b| b == 0),
            "a refused write must not write anything"
        );
        assert!(d.read_at(u64::MAX, &mut [&mut [0u8; 1]]).is_err());
    }
}
