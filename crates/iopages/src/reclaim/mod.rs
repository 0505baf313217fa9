//! The reclaim layer: getting memory back when the free lists run short.
//!
//! Owns: shrinkers and direct reclaim (`shrinker.rs`), background reclaim's
//! thread (`kswapd.rs`) and compaction (`compaction.rs`). Must never: name
//! the allocator above it — background reclaim and compaction reach it only
//! through the [`kswapd::ReclaimTarget`] and [`compaction::CompactTarget`]
//! traits that `page_alloc` implements — or hold an allocator lock while
//! calling a shrinker or an owner's callback.
//!
//! Depends on: `buddy` (arena, frames, pageblock types), `gfp`, `error`.

pub(crate) mod compaction;
pub(crate) mod kswapd;
pub(crate) mod shrinker;
