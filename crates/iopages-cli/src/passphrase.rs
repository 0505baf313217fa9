//! Reading a passphrase from a file or standard input.
//!
//! Owns: the passphrase's bytes, zeroized when dropped. Must never: echo
//! a passphrase, or accept an empty one.

use std::io::Read;
use std::path::Path;
use zeroize::Zeroizing;

/// Largest passphrase accepted (cryptsetup's default key file limit).
const MAX_PASSPHRASE_BYTES: u64 = 8 << 20;

/// The passphrase in `path`: the file's exact bytes (as cryptsetup's
/// `--key-file`), or for `-` one line of standard input without its line
/// end.
pub fn read_passphrase(path: &Path) -> Result<Zeroizing<Vec<u8>>, String> {
    let mut buf = Zeroizing::new(Vec::new());
    if path == Path::new("-") {
        let mut line = Zeroizing::new(String::new());
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| format!("cannot read the passphrase from standard input: {e}"))?;
        let t = line.trim_end_matches(['\n', '\r']);
        buf.extend_from_slice(t.as_bytes());
    } else {
        let f = std::fs::File::open(path)
            .map_err(|e| format!("cannot open the passphrase file {}: {e}", path.display()))?;
        f.take(MAX_PASSPHRASE_BYTES + 1)
            .read_to_end(&mut buf)
            .map_err(|e| format!("cannot read the passphrase file {}: {e}", path.display()))?;
        if buf.len() as u64 > MAX_PASSPHRASE_BYTES {
            return Err(format!(
                "the passphrase file {} is larger than {MAX_PASSPHRASE_BYTES} bytes",
                path.display()
            ));
        }
    }
    if buf.is_empty() {
        return Err(format!("the passphrase from {} is empty", path.display()));
    }
    Ok(buf)
}
