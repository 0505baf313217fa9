//! The buddy layer: physical memory and the buddy allocator over it.
//!
//! Owns: the arena (memfd, direct map, frame metadata — `arena.rs`,
//! `frame.rs`), the zone (buddy free lists, watermarks, pageblock types —
//! `zone.rs`) and the depot of order-0 magazines the zone keeps in front
//! of its lists (`depot.rs`). Must never: name a module above it (per-CPU
//! lists, the allocator, reclaim, consumers); every caller comes down to
//! it.
//!
//! Depends on: `sync`, `gfp` (migratetype of a request), `error`.

pub(crate) mod arena;
pub(crate) mod depot;
pub(crate) mod frame;
pub(crate) mod zone;
