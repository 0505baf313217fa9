//! Reading a passphrase from a file or standard input.
//!
//! Owns: the passphrase's bytes, zeroized when dropped. Must never: echo
//! a passphrase, accept an empty one, or leave a copy of it unwiped — the
//! bytes are read straight into wiped buffers (no `String`, no growing
//! `Vec` whose old allocation is freed unwiped, no `Stdin` buffer), with a
//! hard cap and a clear error past it.

use std::fs::File;
use std::io::{self, Read};
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::path::Path;
use zeroize::Zeroizing;

/// Largest passphrase file accepted (cryptsetup's default key file
/// limit, 8 MiB).
pub const MAX_PASSPHRASE_BYTES: usize = 8 << 20;
/// Longest passphrase line accepted on standard input (`-`): a typed or
/// piped passphrase, not a key file (give the file itself for those).
pub const MAX_LINE_BYTES: usize = 64 << 10;

/// Why a capped read stopped.
#[derive(Debug)]
pub enum ReadError {
    /// More than the cap (the cap in bytes).
    TooLong(usize),
    /// The read itself failed.
    Io(io::Error),
}

/// Read from `r` into a wiped buffer: up to EOF, or with `line` up to the
/// first `\n` (which, with any `\r` before it, is dropped, as are the
/// bytes read past it). Never more than `cap` bytes. The buffer starts at
/// `hint` bytes (a file's size) or 4 KiB; when it must grow, the bytes
/// are copied into a new wiped buffer and the old one is wiped.
pub fn read_capped(
    r: &mut impl Read,
    cap: usize,
    hint: Option<u64>,
    line: bool,
) -> Result<Zeroizing<Vec<u8>>, ReadError> {
    // One byte of room past the cap tells "exactly cap" from "more".
    let start = hint.map_or(4096, |h| usize::try_from(h).unwrap_or(cap));
    let mut buf = Zeroizing::new(vec![0u8; start.clamp(1, cap) + 1]);
    let mut len = 0;
    loop {
        if len == buf.len() {
            if len > cap {
                return Err(ReadError::TooLong(cap));
            }
            let mut bigger = Zeroizing::new(vec![0u8; (len * 2).min(cap + 1)]);
            bigger[..len].copy_from_slice(&buf[..len]);
            buf = bigger; // the old buffer is wiped as it drops
        }
        let n = match r.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadError::Io(e)),
        };
        if line {
            if let Some(at) = buf[len..len + n].iter().position(|&b| b == b'\n') {
                len += at;
                break;
            }
        }
        len += n;
    }
    if len > cap {
        return Err(ReadError::TooLong(cap));
    }
    if line {
        while len > 0 && matches!(buf[len - 1], b'\r' | b'\n') {
            len -= 1;
        }
    }
    // Shortening keeps the allocation (and wipes it on drop); the bytes
    // past `len` are wiped now.
    buf[len..].fill(0);
    buf.truncate(len);
    Ok(buf)
}

/// The passphrase in `path`: the file's exact bytes (as cryptsetup's
/// `--key-file`, at most [`MAX_PASSPHRASE_BYTES`]), or for `-` one line of
/// standard input without its line end (at most [`MAX_LINE_BYTES`]).
pub fn read_passphrase(path: &Path) -> Result<Zeroizing<Vec<u8>>, String> {
    let buf = if path == Path::new("-") {
        // Descriptor 0 itself, not `std::io::stdin()`, whose buffer would
        // keep a copy that is never wiped. Not closed (ManuallyDrop).
        // SAFETY: descriptor 0 stays open for the process's life; the
        // File is never dropped, so it is not closed here.
        let mut stdin = ManuallyDrop::new(unsafe { File::from_raw_fd(0) });
        read_capped(&mut *stdin, MAX_LINE_BYTES, None, true).map_err(|e| match e {
            ReadError::TooLong(cap) => format!(
                "the passphrase line on standard input is longer than {cap} bytes \
                 (give a long key with --passphrase-file FILE)"
            ),
            ReadError::Io(e) => format!("cannot read the passphrase from standard input: {e}"),
        })?
    } else {
        let mut f = File::open(path)
            .map_err(|e| format!("cannot open the passphrase file {}: {e}", path.display()))?;
        let hint = f.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
        read_capped(&mut f, MAX_PASSPHRASE_BYTES, hint, false).map_err(|e| match e {
            ReadError::TooLong(cap) => format!(
                "the passphrase file {} is larger than {cap} bytes (cryptsetup's key file limit)",
                path.display()
            ),
            ReadError::Io(e) => {
                format!("cannot read the passphrase file {}: {e}", path.display())
            }
        })?
    };
    if buf.is_empty() {
        return Err(format!("the passphrase from {} is empty", path.display()));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A reader handing out at most `chunk` bytes per call.
    struct Chunks<'a>(&'a [u8], usize);

    impl Read for Chunks<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = self.0.len().min(self.1).min(out.len());
            out[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn lines_stop_at_the_first_newline_and_drop_the_line_end() {
        for input in [&b"pass word\n"[..], b"pass word\r\nrest", b"pass word"] {
            let got = read_capped(&mut Cursor::new(input), 100, None, true).unwrap();
            assert_eq!(&got[..], b"pass word", "{input:?}");
            let got = read_capped(&mut Chunks(input, 3), 100, None, true).unwrap();
            assert_eq!(&got[..], b"pass word", "{input:?}");
        }
        // Binary bytes are kept as they are (no UTF-8 requirement).
        let got = read_capped(&mut Cursor::new(b"\xff\x00a\n"), 100, None, true).unwrap();
        assert_eq!(&got[..], b"\xff\x00a");
    }

    #[test]
    fn the_cap_is_exact_and_past_it_is_an_error() {
        let data = vec![b'x'; 10_000];
        // Exactly the cap: accepted, whatever the hint or chunking.
        for hint in [None, Some(0), Some(10), Some(10_000), Some(u64::MAX)] {
            let got = read_capped(&mut Chunks(&data, 777), 10_000, hint, false).unwrap();
            assert_eq!(got.len(), 10_000, "{hint:?}");
        }
        // One byte more: refused.
        let more = vec![b'x'; 10_001];
        assert!(matches!(
            read_capped(&mut Cursor::new(&more), 10_000, Some(10_001), false),
            Err(ReadError::TooLong(10_000))
        ));
        assert!(matches!(
            read_capped(&mut Chunks(&more, 4096), 10_000, None, true),
            Err(ReadError::TooLong(10_000))
        ));
        // A line over the cap, newline after it: refused too.
        let mut long_line = vec![b'y'; 200];
        long_line.push(b'\n');
        assert!(matches!(
            read_capped(&mut Cursor::new(&long_line), 100, None, true),
            Err(ReadError::TooLong(100))
        ));
    }

    #[test]
    fn passphrase_files_over_8_mib_are_refused_and_empty_ones_too() {
        let dir = std::env::temp_dir().join(format!("iopages-pass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at_cap = dir.join("cap");
        std::fs::write(&at_cap, vec![7u8; MAX_PASSPHRASE_BYTES]).unwrap();
        assert_eq!(
            read_passphrase(&at_cap).unwrap().len(),
            MAX_PASSPHRASE_BYTES
        );
        let over = dir.join("over");
        std::fs::write(&over, vec![7u8; MAX_PASSPHRASE_BYTES + 1]).unwrap();
        let e = read_passphrase(&over).unwrap_err();
        assert!(e.contains("is larger than 8388608 bytes"), "{e}");
        let empty = dir.join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert!(read_passphrase(&empty).unwrap_err().contains("is empty"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
