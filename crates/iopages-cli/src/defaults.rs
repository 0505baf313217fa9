//! The defaults and limits of `iopages serve` that both its command line
//! and its configuration file apply.
//!
//! Owns: each default once (the page arena — the volume crate's, named
//! here —, the in-memory volume's size and limit, the inline request
//! size), and the text the command line's help shows for the arena's.
//! Must never: name another module of the command: the command line
//! (`serve`), the file (`config`) and the volumes (`served`) all read
//! these from here.

use std::sync::LazyLock;

/// The page arena of a volume when neither `--arena` nor an export's
/// `arena` gives one: the volume's own default (512 MiB), so that the
/// command line, the file and [`iopages_nbd::volume::VolumeOptions`]
/// agree.
pub use iopages_nbd::volume::DEFAULT_ARENA_BYTES;

/// [`DEFAULT_ARENA_BYTES`] as `--arena`'s help shows it ("512M").
pub static DEFAULT_ARENA_TEXT: LazyLock<String> = LazyLock::new(|| size_text(DEFAULT_ARENA_BYTES));

/// The in-memory volume's payload when `--size` is not given.
pub const DEFAULT_MEMORY_BYTES: u64 = 256 << 20;

/// Largest in-memory volume `serve` accepts (the RAM it takes is real).
pub const MAX_MEMORY_BYTES: u64 = 64 << 30;

/// Requests served on the connection's thread by default, for fast
/// backends: the hand-off to a worker costs more than a small request
/// (4 KiB random I/O through the page cache: about 100 000 IOPS inline vs
/// 75 000 through the workers here), while large requests gain from
/// several workers encrypting at once (1 MiB writes: ~750 MiB/s inline vs
/// 1100–1600 MiB/s through the workers).
pub const DEFAULT_INLINE_MAX_BYTES: u32 = 64 << 10;

/// `bytes` as a size flag takes it: with the largest of the G, M and K
/// suffixes that divides it exactly, else a plain byte count.
pub fn size_text(bytes: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_written_with_the_largest_exact_suffix() {
        assert_eq!(size_text(512 << 20), "512M");
        assert_eq!(size_text(2 << 30), "2G");
        assert_eq!(size_text(1536 << 20), "1536M");
        assert_eq!(size_text(4096), "4K");
        assert_eq!(size_text(1000), "1000");
        assert_eq!(size_text(0), "0");
    }

    #[test]
    fn the_arena_default_is_512_mib_and_its_text_parses_back() {
        assert_eq!(DEFAULT_ARENA_BYTES, 512 << 20);
        assert_eq!(DEFAULT_ARENA_TEXT.as_str(), "512M");
        assert_eq!(
            crate::parse_size(&DEFAULT_ARENA_TEXT),
            Ok(DEFAULT_ARENA_BYTES)
        );
    }
}
