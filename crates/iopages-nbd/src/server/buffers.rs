//! Payload buffers in arena pages.
//!
//! Owns: the buffers a connection receives write payloads into and reads
//! replies out of. They come from the crypt target's own page arena
//! through kvmalloc (a fail-fast contiguous block, else a vmalloc area),
//! so a payload lands in arena pages straight off the socket, and the
//! target's out pages, reserve and limits apply unchanged. Must never:
//! fail a request because the arena is short — a buffer the arena cannot
//! give comes from the heap instead, and is counted.

use crate::stats::BufferStats;
use iopages::{Gfp, KvBox, KvKind, KvPolicy, Kvmalloc, PageAllocator};
use std::sync::atomic::{AtomicU64, Ordering};

/// A payload buffer: arena pages, or heap memory when the arena had none.
pub(crate) enum Buf {
    Arena(KvBox),
    Heap(Vec<u8>),
}

impl AsRef<[u8]> for Buf {
    fn as_ref(&self) -> &[u8] {
        match self {
            Buf::Arena(b) => b.as_slice(),
            Buf::Heap(v) => v,
        }
    }
}

impl AsMut<[u8]> for Buf {
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            Buf::Arena(b) => b.as_mut_slice(),
            Buf::Heap(v) => v,
        }
    }
}

/// The source of payload buffers, shared by a server's connections.
pub(crate) struct Buffers {
    kv: Option<Kvmalloc>,
    contiguous: AtomicU64,
    vmalloc: AtomicU64,
    heap: AtomicU64,
}

impl Buffers {
    /// Buffers from `alloc`'s arena (from the heap only, if kvmalloc
    /// cannot be set up over it).
    pub(crate) fn new(alloc: &PageAllocator) -> Buffers {
        let kv = match Kvmalloc::new(alloc) {
            Ok(kv) => Some(kv),
            Err(e) => {
                eprintln!(
                    "iopages-nbd: payloads go to the heap: kvmalloc over the arena failed: {e}"
                );
                None
            }
        };
        Buffers {
            kv,
            contiguous: AtomicU64::new(0),
            vmalloc: AtomicU64::new(0),
            heap: AtomicU64::new(0),
        }
    }

    /// A buffer of `len` bytes (contents unspecified).
    pub(crate) fn get(&self, len: usize) -> Buf {
        if let Some(kv) = &self.kv {
            if let Ok(b) = kv.kvmalloc(len, Gfp::KERNEL | Gfp::NOWARN, KvPolicy::FailFast) {
                match b.kind() {
                    KvKind::Contiguous { .. } => &self.contiguous,
                    KvKind::Vmalloc { .. } => &self.vmalloc,
                }
                .fetch_add(1, Ordering::Relaxed);
                return Buf::Arena(b);
            }
        }
        self.heap.fetch_add(1, Ordering::Relaxed);
        Buf::Heap(vec![0u8; len])
    }

    pub(crate) fn stats(&self) -> BufferStats {
        BufferStats {
            arena_contiguous: self.contiguous.load(Ordering::Relaxed),
            arena_vmalloc: self.vmalloc.load(Ordering::Relaxed),
            heap: self.heap.load(Ordering::Relaxed),
        }
    }
}
