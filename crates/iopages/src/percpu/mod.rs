//! The per-CPU layer: caches of free blocks in front of the zone.
//!
//! Owns: the per-CPU lists with their `high` and `batch` (`pcp.rs`) behind
//! a try-only lock (`trylock.rs`), the per-thread magazines in front of
//! them (`tcache.rs`), and the CPU lookup every per-CPU structure uses
//! (`cpu.rs`). Must never: name the allocator or reclaim above it; a cache
//! knows its owner only through the [`tcache::Owner`] trait.
//!
//! Depends on: `buddy` (zone, arena, pages), `sync`.

pub(crate) mod cpu;
pub(crate) mod pcp;
pub(crate) mod tcache;
pub(crate) mod trylock;
