//! `luks check` and `luks decrypt` on an authenticated volume: every
//! block's tag and the tree above it verified offline, read-only.
//!
//! Owns: opening an image's tag layer read-only (against a freshness state
//! file when one is given, else the store's newest superblock — which
//! catches flips and moves, not a rollback, and says so), and reading the
//! whole volume through it a MiB at a time, narrowing a refused MiB to its
//! bad blocks. Must never: write the image or the state file, or pass on a
//! block that failed verification (its place gets zeros and its number is
//! reported).

use iopages_crypt::backend::Backend;
use iopages_crypt::integrity::{AuthBackend, AuthOptions, Freshness, Keys};
use iopages_crypt::luks::LuksVolume;
use iopages_crypt::uring::{DirectIo, UringFile, UringOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The whole image at `image` (a file or block device) as a backend,
/// read-only.
pub fn local_device(image: &Path) -> Result<Arc<dyn Backend>, String> {
    let opts = UringOptions {
        map_reads: false,
        rings: 1,
        ..UringOptions::default()
    }
    .read_only(true)
    .direct(DirectIo::Off);
    let f = UringFile::open(image, opts)
        .map_err(|e| format!("cannot open {}: {e}", image.display()))?;
    Ok(Arc::new(f))
}

/// The tag layer of `v` over `device` (the whole image), read-only, or
/// `None` when `v` is not an authenticated volume.
pub fn open(
    device: &Arc<dyn Backend>,
    v: &LuksVolume,
    freshness: Option<&Path>,
    name: &str,
) -> Result<Option<AuthBackend>, String> {
    let Some(i) = v.integrity() else {
        if freshness.is_some() {
            return Err(format!(
                "{name}: --freshness given, but the volume is not authenticated"
            ));
        }
        return Ok(None);
    };
    let window = |at: u64, len: u64| {
        iopages_crypt::backend::Window::new(Arc::clone(device), at, len)
            .map(|w| Arc::new(w) as Arc<dyn Backend>)
            .map_err(|e| format!("{name}: {e}"))
    };
    let data = window(v.data_offset_bytes(), i.layout.data_bytes())?;
    let area = window(i.area_offset, i.area_bytes())?;
    let keys = Keys::derive(i.mac(), v.master_key()).map_err(|e| format!("{name}: {e}"))?;
    if freshness.is_none() {
        eprintln!(
            "{name}: no --freshness state file: tags and tree checked against the store's own \
             superblock, which catches altered and moved blocks but not a store rolled back whole"
        );
    }
    let auth = AuthBackend::open(
        data,
        area,
        i.layout.clone(),
        keys,
        AuthOptions {
            uuid: v.uuid().to_string(),
            freshness: Freshness {
                state: freshness.map(Path::to_path_buf),
                reset: false,
            },
            read_only: true,
            name: name.to_string(),
            ..AuthOptions::default()
        },
    )
    .map_err(|e| format!("{name}: {e}"))?;
    Ok(Some(auth))
}

/// Read the whole volume through `auth` a MiB at a time, handing each
/// chunk (offset, ciphertext with refused blocks zeroed) to `sink`;
/// progress each second on standard error.
///
/// **Returns:** the blocks that failed verification (4 KiB blocks of the
/// volume), or the first error that is not a verification failure.
pub fn read_all(
    auth: &AuthBackend,
    mut sink: impl FnMut(u64, &[u8]) -> Result<(), String>,
) -> Result<Vec<u64>, String> {
    const CHUNK: usize = 1 << 20;
    let size = auth.size_bytes();
    let mut buf = vec![0u8; CHUNK];
    let mut bad = Vec::new();
    let (t0, mut last) = (Instant::now(), Instant::now());
    let mut at = 0u64;
    while at < size {
        let n = ((size - at) as usize).min(CHUNK);
        let b = &mut buf[..n];
        match auth.read_at(at, &mut [&mut b[..]]) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                narrow(auth, at, b, &mut bad)?;
            }
            Err(e) => return Err(format!("reading the volume at {at}: {e}")),
        }
        sink(at, b)?;
        at += n as u64;
        if last.elapsed().as_secs() >= 1 {
            last = Instant::now();
            eprint!("\rverified {} of {} MiB", at >> 20, size >> 20);
            let _ = std::io::stderr().flush();
        }
    }
    if t0.elapsed().as_secs() >= 1 {
        eprintln!();
    }
    Ok(bad)
}

/// Read `b` (the chunk at `at`) again block by block, zeroing and noting
/// the blocks that fail.
fn narrow(auth: &AuthBackend, at: u64, b: &mut [u8], bad: &mut Vec<u64>) -> Result<(), String> {
    for (i, block) in b.chunks_mut(4096).enumerate() {
        let off = at + (i as u64) * 4096;
        match auth.read_at(off, &mut [&mut block[..]]) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                block.fill(0);
                bad.push(off / 4096);
            }
            Err(e) => return Err(format!("reading the volume at {off}: {e}")),
        }
    }
    Ok(())
}
