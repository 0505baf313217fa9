//! Step 4 of a call under `O_DIRECT` (see the folder's notes): segments
//! that are not aligned go through aligned bounce buffers, and a write
//! that covers an edge block only partly reads that block first.
//!
//! Owns: `HeapBuf` (aligned heap memory), the bounce buffers (arena pages
//! or the heap), the plan of a call (its entries in file order, unaligned
//! runs gathered and widened to block edges), the copies into and out of
//! the bounces, and the read-modify-write of edge blocks under their
//! stripe locks. Must never: let a bounce buffer or an edge block's buffer
//! drop while an entry using it may be in flight, copy into a bounce
//! buffer that is in flight, or write an edge block without holding its
//! stripe lock from its read until the write is reaped.

use super::submit::Op;
use super::{Seg, UringFile, RMW_STRIPES};
use io_uring::IoUring;
use iopages::{Gfp, PageBox, MAX_ORDER, PAGE_SIZE};
use parking_lot::MutexGuard;
use std::alloc::Layout;
use std::io;
use std::sync::atomic::Ordering::Relaxed;

/// The largest bounce buffer; longer unaligned runs use several.
pub(super) const BOUNCE_CHUNK_BYTES: usize = 1 << 20;

/// Aligned memory from the heap, freed on drop.
pub(super) struct HeapBuf {
    pub(super) ptr: *mut u8,
    layout: Layout,
}

impl HeapBuf {
    pub(super) fn new(len: usize, align: usize) -> io::Result<HeapBuf> {
        let layout = Layout::from_size_align(len.max(1), align).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no aligned buffer of {len} bytes aligned to {align}"),
            )
        })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("no memory for an aligned buffer of {len} bytes"),
            ));
        }
        Ok(HeapBuf { ptr, layout })
    }
}

impl Drop for HeapBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with this layout, and every
        // entry using it has been reaped (buffers outlive the drive loop).
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// A bounce buffer: arena pages (which may be fixed buffers) or the heap.
enum BounceMem<'a> {
    Arena(#[allow(dead_code)] PageBox<'a>),
    Heap(#[allow(dead_code)] HeapBuf),
}

/// One bounce buffer standing for `len` bytes of the file at `off`.
pub(super) struct Bounce<'a> {
    off: u64,
    ptr: *mut u8,
    len: usize,
    _mem: BounceMem<'a>,
}

/// A run of consecutive unaligned segments and the bounce buffers covering
/// it (`cover` is the run widened to block edges).
pub(super) struct Run {
    segs: std::ops::Range<usize>,
    start: u64,
    end: u64,
    cover_start: u64,
    bounces: std::ops::Range<usize>,
}

/// The entries of one direct call in file order, the bounce buffers its
/// unaligned runs go through, and those runs.
pub(super) struct Plan<'a> {
    pub(super) ops: Vec<Op>,
    pub(super) bounces: Vec<Bounce<'a>>,
    pub(super) runs: Vec<Run>,
}

impl UringFile {
    /// Whether `seg` can go to the kernel as it is.
    fn aligned(&self, seg: &Seg) -> bool {
        !self.direct
            || ((seg.ptr as usize).is_multiple_of(self.mem_align)
                && seg.len.is_multiple_of(self.io_align)
                && seg.off.is_multiple_of(self.io_align as u64))
    }

    /// An aligned bounce buffer of `len` bytes (a multiple of the block)
    /// for file offset `off`: arena pages when they can be had at once,
    /// else the heap.
    fn bounce(&self, off: u64, len: usize) -> io::Result<Bounce<'_>> {
        if let Some(a) = &self.arena {
            let order = len.div_ceil(PAGE_SIZE).next_power_of_two().trailing_zeros();
            if order <= MAX_ORDER && self.mem_align <= PAGE_SIZE {
                if let Some(b) = a.alloc.alloc_box(Gfp::NOWAIT, order) {
                    let ptr = a.alloc.page_address(b.page());
                    return Ok(Bounce {
                        off,
                        ptr,
                        len,
                        _mem: BounceMem::Arena(b),
                    });
                }
            }
        }
        let h = HeapBuf::new(len, self.mem_align).map_err(|e| self.err(e.kind(), e))?;
        Ok(Bounce {
            off,
            ptr: h.ptr,
            len,
            _mem: BounceMem::Heap(h),
        })
    }

    /// Plan a direct call: entries in file order; unaligned runs through
    /// bounces of at most `chunk` bytes (counted as bounced segments).
    pub(super) fn plan(&self, segs: &[Seg], chunk: usize) -> io::Result<Plan<'_>> {
        let mut ops = Vec::with_capacity(segs.len());
        let mut bounces: Vec<Bounce<'_>> = Vec::new();
        let mut runs: Vec<Run> = Vec::new();
        let mut run_from: Option<usize> = None;
        for (i, s) in segs.iter().enumerate() {
            if s.len == 0 {
                continue;
            }
            if self.aligned(s) {
                if let Some(from) = run_from.take() {
                    runs.push(self.plan_run(segs, from..i, chunk, &mut ops, &mut bounces)?);
                }
                self.push_ops(&mut ops, s.off, s.ptr, s.len);
            } else if run_from.is_none() {
                run_from = Some(i);
            }
        }
        if let Some(from) = run_from {
            runs.push(self.plan_run(segs, from..segs.len(), chunk, &mut ops, &mut bounces)?);
        }
        let bounced: usize = runs
            .iter()
            .map(|r| segs[r.segs.clone()].iter().filter(|s| s.len > 0).count())
            .sum();
        self.counters
            .bounced_segments
            .fetch_add(bounced as u64, Relaxed);
        Ok(Plan { ops, bounces, runs })
    }

    /// Plan a run of unaligned segments: bounce buffers covering it,
    /// widened to block edges, and their entries.
    fn plan_run<'a>(
        &'a self,
        segs: &[Seg],
        range: std::ops::Range<usize>,
        chunk: usize,
        ops: &mut Vec<Op>,
        bounces: &mut Vec<Bounce<'a>>,
    ) -> io::Result<Run> {
        let block = self.io_align as u64;
        let last = &segs[range.end - 1];
        let (start, end) = (segs[range.start].off, last.off + last.len as u64);
        let cover_start = start / block * block;
        let cover_end = end.div_ceil(block) * block;
        let first = bounces.len();
        let mut at = cover_start;
        while at < cover_end {
            let n = (cover_end - at).min(chunk as u64) as usize;
            let b = self.bounce(at, n)?;
            self.push_ops(ops, b.off, b.ptr, b.len);
            bounces.push(b);
            at += n as u64;
        }
        Ok(Run {
            segs: range,
            start,
            end,
            cover_start,
            bounces: first..bounces.len(),
        })
    }

    /// Copy a run's segments into its bounce buffers (`into_bounce`) or
    /// back out of them.
    pub(super) fn copy_run(
        &self,
        r: &Run,
        segs: &[Seg],
        bounces: &[Bounce<'_>],
        chunk: usize,
        into: bool,
    ) {
        for s in &segs[r.segs.clone()] {
            let mut done = 0;
            while done < s.len {
                let rel = (s.off + done as u64 - r.cover_start) as usize;
                let b = &bounces[r.bounces.start + rel / chunk];
                let within = rel % chunk;
                let n = (s.len - done).min(b.len - within);
                let (bp, sp) = (b.ptr.wrapping_add(within), s.ptr.wrapping_add(done));
                // SAFETY: `sp..sp+n` lies inside the caller's segment (done +
                // n <= len) and `bp..bp+n` inside the bounce buffer (within
                // + n <= b.len, as the cover contains the segment); the
                // bounce buffer is ours alone, so they do not overlap, and
                // no entry using either is in flight (the copy in comes
                // before the submission, the copy out after the reaping).
                // A write segment is only read from (`into`).
                unsafe {
                    if into {
                        std::ptr::copy_nonoverlapping(sp, bp, n);
                    } else {
                        std::ptr::copy_nonoverlapping(bp, sp, n);
                    }
                }
                done += n;
            }
        }
    }

    /// Before a write: a block at an edge of the call that the write
    /// covers only partly is read first (into its own aligned buffer,
    /// under its stripe lock, so a concurrent write to the rest of that
    /// block is not undone) and copied into the bounce; the caller's bytes
    /// go over it afterwards ([`UringFile::copy_run`]).
    /// **Returns:** the stripe locks, to be held until the write is reaped.
    pub(super) fn read_edges(
        &self,
        ring: &mut IoUring,
        plan: &Plan<'_>,
        chunk: usize,
    ) -> io::Result<Vec<MutexGuard<'_, ()>>> {
        let block = self.io_align as u64;
        let edges = edge_blocks(plan, block, chunk);
        let mut stripes: Vec<usize> = edges
            .iter()
            .map(|&(b, _)| (b / block) as usize % RMW_STRIPES)
            .collect();
        stripes.sort_unstable();
        stripes.dedup();
        let locks: Vec<_> = stripes.iter().map(|&s| self.rmw_locks[s].lock()).collect();
        if !edges.is_empty() {
            let bufs = edges
                .iter()
                .map(|_| HeapBuf::new(self.io_align, self.mem_align))
                .collect::<io::Result<Vec<_>>>()
                .map_err(|e| self.err(e.kind(), e))?;
            let mut rmw = Vec::with_capacity(edges.len());
            for (&(blk, _), buf) in edges.iter().zip(&bufs) {
                self.push_ops(&mut rmw, blk, buf.ptr, self.io_align);
            }
            self.drive(ring, &mut rmw, false)?;
            for (&(_, dst), buf) in edges.iter().zip(&bufs) {
                // SAFETY: `buf` holds `io_align` bytes just read (its entry
                // was reaped); `dst` is a block-aligned block inside a bounce
                // buffer (blocks never straddle bounce buffers, whose sizes
                // are multiples of the block), ours alone and not in flight.
                unsafe { std::ptr::copy_nonoverlapping(buf.ptr, dst, self.io_align) };
            }
        }
        Ok(locks)
    }
}

/// The blocks at the edges of the plan's runs that a write covers only
/// partly, each once: its file offset and where it lies in its bounce.
fn edge_blocks(plan: &Plan<'_>, block: u64, chunk: usize) -> Vec<(u64, *mut u8)> {
    let mut edges: Vec<(u64, *mut u8)> = Vec::new();
    for r in &plan.runs {
        for pos in [r.start, r.end] {
            let blk = pos / block * block;
            if pos % block != 0 && !edges.iter().any(|&(b, _)| b == blk) {
                let rel = (blk - r.cover_start) as usize;
                let b = &plan.bounces[r.bounces.start + rel / chunk];
                edges.push((blk, b.ptr.wrapping_add(rel % chunk)));
            }
        }
    }
    edges
}
