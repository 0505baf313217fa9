//! Compaction: making high-order blocks by moving in-use movable pages.
//!
//! Owns: the entry point the allocator's slow path calls for order > 0
//! (unless `NORETRY` forbids it). Must never: move a pinned frame.
//!
//! Moving pages needs their owners' migration callbacks, which no user can
//! register yet, so today the entry point finds nothing movable and says so.
//! The slow path already calls it in the right place and counts the calls.

/// What a compaction attempt achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompactResult {
    /// Nothing was movable; no block was made.
    Skipped,
    /// A free block of the asked order exists now.
    Success,
}

/// Try to make a free block of `order`.
///
/// **Context:** may block; called without allocator locks held.
pub(crate) fn try_to_compact(_order: u32) -> CompactResult {
    CompactResult::Skipped
}
