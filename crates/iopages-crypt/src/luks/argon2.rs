//! Argon2i and Argon2id, version 0x13 (RFC 9106), with the lanes of each
//! slice computed in threads, as cryptsetup's libargon2 does: a 4-lane
//! derivation on a machine with 2 or more CPUs takes about
//! 1/min(lanes, CPUs) of the time of one thread computing lane after lane.
//!
//! Owns: [`derive`] and its [`Argon2Error`]; H0 and the variable-length
//! hash H' (over the `blake2` crate's BLAKE2b), the compression function G
//! (BlaMka), the reference-block indexing of RFC 9106 §3.4, the block
//! memory and the threads that fill it.
//!
//! Must never: race (no block is written while another thread may read
//! it), leave the block memory unwiped (it is zeroed before it is freed,
//! on every path, panics included), allocate it without a fallible
//! reservation, or panic on parameters (every bad one is an
//! [`Argon2Error`]).
//!
//! ## Memory and threads without `unsafe`
//!
//! The m' blocks are held as one vector per segment, slice-major (slice s
//! in 0..4 holds the segments of lanes 0..p), so at each slice the
//! segments split (`split_at_mut`) into three parts: the slices before it
//! and after it, shared read-only by all threads, and the current slice,
//! one `&mut` segment per lane. Each thread takes whole lanes (segments)
//! from a queue and writes only its own segment; it reads other lanes only
//! outside the current slice, which is exactly what RFC 9106 §3.4.2
//! allows (a block of another lane is never taken from that lane's
//! current segment). The borrow checker thus proves the absence of data
//! races: this file has no `unsafe`. The threads are joined at the end of
//! every slice (the sync points).
//!
//! Every segment is reserved up front (fallibly) and filled in the first
//! pass by the thread that computes it, so the memory is first touched in
//! parallel rather than zeroed by one thread beforehand; at the end the
//! threads wipe it too.
//!
//! BLAKE2b's internal state and G's stack temporaries are not wiped (as in
//! libargon2); H0, H' buffers, the final block and the memory are.
//!
//! ## Speed of one lane
//!
//! G is plain Rust built for the x86-64 baseline (SSE2): with no `unsafe`
//! there is no switch to AVX2 at run time, which the `argon2` crate makes.
//! On an AMD EPYC (Zen 4, KVM) G alone runs at ~0.65× the crate's speed
//! (446 against 285 ns a block, memory in cache). As the memory is first
//! touched by the fill rather than zeroed beforehand, a one-lane 64 MiB
//! derivation with t = 3 still takes about as long as the crate's (less
//! for smaller t, more for larger). Lanes in threads make up for the
//! rest: 4 lanes, t = 3 on 2 threads took 77 ms against the crate's 145.

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;
use std::sync::{Mutex, PoisonError};
use zeroize::{Zeroize, Zeroizing};

/// 64-bit words in a 1 KiB block.
const WORDS: usize = 128;
/// Slices per pass (sync points).
const SYNC_POINTS: u32 = 4;
/// The Argon2 version computed here (1.3).
const VERSION: u32 = 0x13;
/// Most lanes Argon2 allows (2^24 - 1).
pub(crate) const MAX_LANES: u32 = 0xFF_FFFF;
/// Shortest salt Argon2 allows, in bytes.
pub(crate) const MIN_SALT_LEN: usize = 8;
/// Shortest tag Argon2 allows, in bytes.
pub(crate) const MIN_OUT_LEN: usize = 4;

/// Which Argon2 (Argon2d is not used by LUKS and not provided).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    /// Argon2i: data-independent addressing throughout.
    I,
    /// Argon2id: data-independent addressing for the first half of the
    /// first pass, data-dependent after.
    Id,
}

impl Variant {
    /// The type code `y` hashed into H0 and the address blocks.
    fn code(self) -> u32 {
        match self {
            Variant::I => 1,
            Variant::Id => 2,
        }
    }
}

/// Parameters Argon2 refuses, or memory that cannot be had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Argon2Error {
    /// Time cost 0: at least one pass is needed.
    #[error("Argon2 time cost is 0 (at least one pass is needed)")]
    TimeZero,
    /// Lanes (parallelism) 0 or over 2^24 - 1.
    #[error("Argon2 lanes {0} outside 1..={MAX_LANES}")]
    Lanes(u32),
    /// Memory under 8 KiB per lane.
    #[error("Argon2 memory {memory_kib} KiB is under {min_kib} KiB (8 KiB per lane)")]
    MemoryTooSmall {
        /// The memory cost asked for, in KiB.
        memory_kib: u32,
        /// The least the lanes need, in KiB.
        min_kib: u64,
    },
    /// Salt under 8 bytes.
    #[error("Argon2 salt of {0} bytes is under {MIN_SALT_LEN} bytes")]
    SaltTooShort(usize),
    /// Output (tag) under 4 bytes.
    #[error("Argon2 output of {0} bytes is under {MIN_OUT_LEN} bytes")]
    OutputTooShort(usize),
    /// An input or the output is longer than a 32-bit length can say.
    #[error("Argon2 {what} of {len} bytes is over 2^32 - 1 bytes")]
    TooLong {
        /// Which input ("passphrase", "salt", "secret", "associated data",
        /// "output").
        what: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The block memory could not be allocated.
    #[error("Argon2 needs {kib} KiB of memory, which cannot be allocated")]
    OutOfMemory {
        /// The memory asked for (m' blocks of 1 KiB).
        kib: u64,
    },
}

/// Argon2 (`kind`, version 0x13, no secret, no associated data — as LUKS2
/// uses it) of `passphrase` and `salt` into `out`, with `time` passes over
/// `memory_kib` KiB split in `lanes` lanes, computed by at most
/// `min(threads, lanes)` threads, the calling thread included (`threads`
/// 0 counts as 1). Equal to libargon2's and the `argon2` crate's output
/// for any thread count.
///
/// **Returns:** [`Argon2Error`] for parameters Argon2 refuses (time 0,
/// lanes 0 or over 2^24 - 1, memory under 8 KiB per lane, salt under 8
/// bytes, output under 4 bytes, lengths over 2^32 - 1) or memory that
/// cannot be allocated; `out` is then untouched.
#[allow(clippy::too_many_arguments, reason = "mirrors libargon2's argon2_hash")]
pub(crate) fn derive(
    kind: Variant,
    passphrase: &[u8],
    salt: &[u8],
    time: u32,
    memory_kib: u32,
    lanes: u32,
    threads: u32,
    out: &mut [u8],
) -> Result<(), Argon2Error> {
    let inputs = Inputs {
        passphrase,
        salt,
        secret: &[],
        ad: &[],
    };
    let costs = Costs {
        time,
        memory_kib,
        lanes,
        threads,
    };
    derive_with(kind, &inputs, &costs, out)
}

/// The byte-string inputs of Argon2 (RFC 9106 §3.1: P, S, K, X).
struct Inputs<'a> {
    /// The message P (the passphrase).
    passphrase: &'a [u8],
    /// The nonce S (the salt).
    salt: &'a [u8],
    /// The secret value K (empty for LUKS).
    secret: &'a [u8],
    /// The associated data X (empty for LUKS).
    ad: &'a [u8],
}

/// The numeric parameters: t, m (KiB), p, and the thread count.
struct Costs {
    /// Passes t.
    time: u32,
    /// Memory m in KiB (1 KiB blocks).
    memory_kib: u32,
    /// Lanes p.
    lanes: u32,
    /// Most threads to compute the lanes with (0 counts as 1).
    threads: u32,
}

/// The memory's shape once the parameters are checked.
struct Shape {
    /// Argon2i or Argon2id.
    variant: Variant,
    /// Lanes p.
    lanes: u32,
    /// Blocks per lane q = m' / p.
    lane_len: u32,
    /// Blocks per segment q / 4.
    seg_len: u32,
    /// Passes t.
    passes: u32,
    /// All blocks m' = 4p * floor(m / 4p).
    blocks: u32,
}

impl Shape {
    /// Index in [`Memory`] of the segment of `lane` in `slice`: slices in
    /// order, and in each slice the lanes in order (see the module doc).
    fn segment(&self, slice: u32, lane: u32) -> usize {
        slice as usize * self.lanes as usize + lane as usize
    }
}

/// Argon2 with a secret and associated data (RFC 9106's full input; the
/// test vectors use both): check, allocate, fill, hash the last column.
fn derive_with(
    variant: Variant,
    inputs: &Inputs<'_>,
    costs: &Costs,
    out: &mut [u8],
) -> Result<(), Argon2Error> {
    let shape = check(variant, inputs, costs, out.len())?;
    let mut memory = Memory::new(&shape)?;
    let h0 = initial_hash(variant, inputs, costs, out.len() as u32);
    first_blocks(&shape, &h0, &mut memory.0);
    drop(h0);
    let threads = costs.threads.clamp(1, shape.lanes) as usize;
    for pass in 0..shape.passes {
        for slice in 0..SYNC_POINTS {
            fill_slice(&shape, pass, slice, threads, &mut memory.0);
        }
    }
    finish(&shape, &memory.0, out);
    // Wipe with all the threads; `Memory`'s drop has nothing left to do.
    on_threads(threads, memory.0.iter_mut(), |segment| {
        segment.zeroize();
        *segment = Vec::new();
    });
    Ok(())
}

/// Check the parameters (RFC 9106 §3.1, libargon2's limits) and work out
/// the memory's shape.
fn check(
    variant: Variant,
    inputs: &Inputs<'_>,
    costs: &Costs,
    out_len: usize,
) -> Result<Shape, Argon2Error> {
    if costs.time == 0 {
        return Err(Argon2Error::TimeZero);
    }
    let lanes = costs.lanes;
    if lanes == 0 || lanes > MAX_LANES {
        return Err(Argon2Error::Lanes(lanes));
    }
    let min_kib = 2 * u64::from(SYNC_POINTS) * u64::from(lanes);
    if u64::from(costs.memory_kib) < min_kib {
        return Err(Argon2Error::MemoryTooSmall {
            memory_kib: costs.memory_kib,
            min_kib,
        });
    }
    if inputs.salt.len() < MIN_SALT_LEN {
        return Err(Argon2Error::SaltTooShort(inputs.salt.len()));
    }
    if out_len < MIN_OUT_LEN {
        return Err(Argon2Error::OutputTooShort(out_len));
    }
    let lengths = [
        ("passphrase", inputs.passphrase.len()),
        ("salt", inputs.salt.len()),
        ("secret", inputs.secret.len()),
        ("associated data", inputs.ad.len()),
        ("output", out_len),
    ];
    if let Some(&(what, len)) = lengths.iter().find(|(_, len)| u32::try_from(*len).is_err()) {
        return Err(Argon2Error::TooLong { what, len });
    }
    // 4 * lanes < 2^26, and blocks <= memory_kib: both fit a u32.
    let per_slice = SYNC_POINTS * lanes;
    let blocks = per_slice * (costs.memory_kib / per_slice);
    Ok(Shape {
        variant,
        lanes,
        lane_len: blocks / lanes,
        seg_len: blocks / per_slice,
        passes: costs.time,
        blocks,
    })
}

/// A 1 KiB Argon2 block as 128 little-endian 64-bit words.
#[repr(C, align(64))]
struct Block([u64; WORDS]);

impl Block {
    /// The all-zero block.
    const ZERO: Block = Block([0; WORDS]);
}

impl Zeroize for Block {
    fn zeroize(&mut self) {
        self.0.zeroize();
    }
}

/// The m' blocks: one vector per segment, in [`Shape::segment`]'s order,
/// each reserved (fallibly, never to grow) for a segment's blocks and
/// filled during the first pass by the thread computing it, so that the
/// memory is first touched by the threads, in parallel, not by a serial
/// zeroing. Wiped when dropped (on success, error and unwinding alike):
/// the blocks and any reserved room not yet filled.
struct Memory(Vec<Vec<Block>>);

impl Memory {
    /// Empty segments with room for all of `shape`'s blocks.
    fn new(shape: &Shape) -> Result<Memory, Argon2Error> {
        let oom = |_| Argon2Error::OutOfMemory {
            kib: u64::from(shape.blocks),
        };
        let count = SYNC_POINTS as usize * shape.lanes as usize;
        let mut segments = Vec::new();
        segments.try_reserve_exact(count).map_err(oom)?;
        for _ in 0..count {
            let mut segment = Vec::new();
            segment
                .try_reserve_exact(shape.seg_len as usize)
                .map_err(oom)?;
            segments.push(segment);
        }
        Ok(Memory(segments))
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        for segment in &mut self.0 {
            segment.zeroize();
        }
    }
}

/// BLAKE2b with an `out.len()`-byte digest (1..=64 bytes) of `first`
/// followed by the concatenated `rest`.
fn blake2b(out: &mut [u8], first: &[u8], rest: &[&[u8]]) {
    let mut h = Blake2bVar::new(out.len()).expect("callers ask for 1..=64 bytes");
    h.update(first);
    for part in rest {
        h.update(part);
    }
    h.finalize_variable(out)
        .expect("the buffer has the digest's length");
}

/// The variable-length hash H' (RFC 9106 §3.3) of the concatenated
/// `parts` into `out` (4 to 2^32 - 1 bytes).
fn h_prime(out: &mut [u8], parts: &[&[u8]]) {
    let len = (out.len() as u32).to_le_bytes();
    if out.len() <= 64 {
        return blake2b(out, &len, parts);
    }
    // r = ceil(T / 32) - 2 full 64-byte hashes give 32 bytes each; the
    // last hash gives the remaining T - 32r bytes (33..=64).
    let r = out.len().div_ceil(32) - 2;
    let mut v = Zeroizing::new([0u8; 64]);
    blake2b(&mut v[..], &len, parts);
    out[..32].copy_from_slice(&v[..32]);
    for i in 1..r {
        let prev = v.clone();
        blake2b(&mut v[..], &prev[..], &[]);
        out[32 * i..32 * i + 32].copy_from_slice(&v[..32]);
    }
    blake2b(&mut out[32 * r..], &v[..], &[]);
}

/// H0 (RFC 9106 §3.2 step 1): BLAKE2b-512 of the parameters and inputs.
fn initial_hash(
    variant: Variant,
    inputs: &Inputs<'_>,
    costs: &Costs,
    out_len: u32,
) -> Zeroizing<[u8; 64]> {
    let le = |x: u32| x.to_le_bytes();
    let len = |s: &[u8]| (s.len() as u32).to_le_bytes();
    let head = [
        le(costs.lanes),
        le(out_len),
        le(costs.memory_kib),
        le(costs.time),
        le(VERSION),
        le(variant.code()),
    ]
    .concat();
    let mut h0 = Zeroizing::new([0u8; 64]);
    blake2b(
        &mut h0[..],
        &head,
        &[
            &len(inputs.passphrase),
            inputs.passphrase,
            &len(inputs.salt),
            inputs.salt,
            &len(inputs.secret),
            inputs.secret,
            &len(inputs.ad),
            inputs.ad,
        ],
    );
    h0
}

/// Blocks 0 and 1 of every lane: H'^1024(H0 || LE32(j) || LE32(lane)).
fn first_blocks(shape: &Shape, h0: &[u8; 64], memory: &mut [Vec<Block>]) {
    let mut bytes = Zeroizing::new([0u8; 1024]);
    for lane in 0..shape.lanes {
        let segment = &mut memory[shape.segment(0, lane)];
        for col in 0..2u32 {
            h_prime(
                &mut bytes[..],
                &[h0, &col.to_le_bytes(), &lane.to_le_bytes()],
            );
            push_zero(segment);
            let block = &mut segment[col as usize];
            for (w, b) in block.0.iter_mut().zip(bytes.chunks_exact(8)) {
                *w = u64::from_le_bytes(b.try_into().expect("8-byte chunk"));
            }
        }
    }
}

/// Append a zero block to a segment, to be computed in place. There is
/// room for it: [`Memory::new`] reserved every segment's blocks, and each
/// is appended once. (A push that had to grow the vector would leave the
/// old buffer unwiped.)
fn push_zero(segment: &mut Vec<Block>) {
    debug_assert!(segment.len() < segment.capacity(), "segment grown");
    segment.push(Block::ZERO);
}

/// The tag: H'^T of the XOR of every lane's last block.
fn finish(shape: &Shape, memory: &[Vec<Block>], out: &mut [u8]) {
    let mut c = Zeroizing::new([0u64; WORDS]);
    for lane in 0..shape.lanes {
        let last = &memory[shape.segment(SYNC_POINTS - 1, lane)][shape.seg_len as usize - 1];
        for (c, w) in c.iter_mut().zip(&last.0) {
            *c ^= w;
        }
    }
    let mut bytes = Zeroizing::new([0u8; 1024]);
    for (b, w) in bytes.chunks_exact_mut(8).zip(c.iter()) {
        b.copy_from_slice(&w.to_le_bytes());
    }
    h_prime(out, &[&bytes[..]]);
}

/// Fill one slice of one pass: every lane's segment, by `threads`
/// threads (see [`on_threads`]), all joined before this returns (the sync
/// point).
fn fill_slice(shape: &Shape, pass: u32, slice: u32, threads: usize, memory: &mut [Vec<Block>]) {
    let (before, rest) = memory.split_at_mut(shape.segment(slice, 0));
    let (current, after) = rest.split_at_mut(shape.lanes as usize);
    let view = View {
        shape,
        pass,
        slice,
        before,
        after,
    };
    on_threads(threads, current.iter_mut().zip(0..), |(segment, lane)| {
        fill_segment(&view, lane, segment);
    });
}

/// Run `work` on every item of `jobs` with `threads` threads: the caller
/// and `threads - 1` spawned ones, each taking items from a shared queue
/// until none is left. A thread that cannot be spawned leaves its share to
/// the others (the caller always takes part), so a failed spawn only
/// costs time. All threads are joined before this returns.
fn on_threads<I: Iterator + Send>(threads: usize, jobs: I, work: impl Fn(I::Item) + Sync) {
    let queue = Mutex::new(jobs);
    let run = || loop {
        // The lock is held only for `next`, which does not panic: a
        // poisoned queue is still consistent.
        let job = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
        match job {
            Some(job) => work(job),
            None => return,
        }
    };
    if threads <= 1 {
        return run();
    }
    std::thread::scope(|scope| {
        for _ in 1..threads {
            let spawned = std::thread::Builder::new()
                .name("argon2".into())
                .spawn_scoped(scope, run);
            if spawned.is_err() {
                break;
            }
        }
        run();
    });
}

/// What a thread may read while one slice is filled: the segments of the
/// slices before and after it (all lanes), shared by all threads and
/// written by none.
struct View<'a> {
    /// The memory's shape.
    shape: &'a Shape,
    /// The pass being computed (0-based).
    pass: u32,
    /// The slice being computed (0..4).
    slice: u32,
    /// Slices `0..slice`.
    before: &'a [Vec<Block>],
    /// Slices `slice + 1..4` (earlier passes' blocks; empty in the first).
    after: &'a [Vec<Block>],
}

impl View<'_> {
    /// Block `col` of `lane`, which must lie outside the current slice.
    fn get(&self, lane: u32, col: u32) -> &Block {
        let sh = self.shape;
        let (slice, index) = (col / sh.seg_len, (col % sh.seg_len) as usize);
        if slice < self.slice {
            &self.before[sh.segment(slice, lane)][index]
        } else if slice > self.slice {
            &self.after[sh.segment(slice - self.slice - 1, lane)][index]
        } else {
            unreachable!("the reference set never holds another lane's current segment")
        }
    }

    /// Whether J1, J2 come from address blocks (Argon2i; Argon2id in the
    /// first two slices of the first pass) rather than the previous block.
    fn data_independent(&self) -> bool {
        match self.shape.variant {
            Variant::I => true,
            Variant::Id => self.pass == 0 && self.slice < SYNC_POINTS / 2,
        }
    }

    /// The reference block's (lane, column) for block `index` of `lane`'s
    /// current segment, from the 64-bit pseudo-random value `rand`
    /// (J1 = low half, J2 = high half; RFC 9106 §3.4.2).
    fn reference(&self, lane: u32, index: u32, rand: u64) -> (u32, u32) {
        let sh = self.shape;
        let (j1, j2) = (rand as u32, (rand >> 32) as u32);
        let ref_lane = if self.pass == 0 && self.slice == 0 {
            lane
        } else {
            j2 % sh.lanes
        };
        // Finished segments of the reference lane that may be referenced:
        // the slices before this one in the first pass, the three other
        // slices afterwards.
        let finished = if self.pass == 0 {
            self.slice * sh.seg_len
        } else {
            (SYNC_POINTS - 1) * sh.seg_len
        };
        let area = if ref_lane == lane {
            // This segment's blocks so far, less the previous block.
            finished + index - 1
        } else {
            // Another lane's last finished block is left out while the
            // first block of a segment is computed.
            finished - u32::from(index == 0)
        };
        let x = (u64::from(j1) * u64::from(j1)) >> 32;
        let y = (u64::from(area) * x) >> 32;
        let rel = u64::from(area) - 1 - y;
        let start = if self.pass == 0 || self.slice == SYNC_POINTS - 1 {
            0
        } else {
            (self.slice + 1) * sh.seg_len
        };
        let col = (u64::from(start) + rel) % u64::from(sh.lane_len);
        (ref_lane, col as u32)
    }
}

/// Compute `lane`'s segment of the current slice into `segment`: new
/// blocks appended in the first pass, XORed into the old ones after.
fn fill_segment(view: &View<'_>, lane: u32, segment: &mut Vec<Block>) {
    let sh = view.shape;
    let seg_start = view.slice * sh.seg_len;
    let first = if view.pass == 0 && view.slice == 0 {
        2
    } else {
        0
    };
    let mut addresses = view.data_independent().then(|| Addresses::new(view, lane));
    for index in first..sh.seg_len {
        if view.pass == 0 {
            push_zero(segment);
        }
        let (done, rest) = segment.split_at_mut(index as usize);
        let cur = &mut rest[0];
        let prev = match index.checked_sub(1) {
            Some(i) => &done[i as usize],
            // The first block of a segment follows the previous slice's
            // (or, in slice 0, the lane's last block of the last pass).
            None => view.get(lane, seg_start.checked_sub(1).unwrap_or(sh.lane_len - 1)),
        };
        let rand = match &mut addresses {
            Some(a) => a.value(index),
            None => prev.0[0],
        };
        let (ref_lane, ref_col) = view.reference(lane, index, rand);
        let same_segment = ref_lane == lane && ref_col / sh.seg_len == view.slice;
        let refb = if same_segment {
            &done[(ref_col - seg_start) as usize]
        } else {
            view.get(ref_lane, ref_col)
        };
        compress(prev, refb, cur, view.pass > 0);
    }
}

/// The address blocks of one segment (data-independent addressing, RFC
/// 9106 §3.4.1.2): G(0, G(0, Z)) with Z = (pass, lane, slice, m', t, y,
/// counter), counter from 1, one block per 128 reference blocks.
struct Addresses {
    /// Z, the counter in word 6.
    input: Block,
    /// The current address block.
    block: Block,
    /// Whether `block` is computed for the current 128 indexes.
    ready: bool,
}

impl Addresses {
    /// Z for `lane`'s segment of the view's pass and slice.
    fn new(view: &View<'_>, lane: u32) -> Addresses {
        let sh = view.shape;
        let mut input = Block::ZERO;
        let head = [
            view.pass,
            lane,
            view.slice,
            sh.blocks,
            sh.passes,
            sh.variant.code(),
        ];
        for (w, v) in input.0.iter_mut().zip(head) {
            *w = u64::from(v);
        }
        Addresses {
            input,
            block: Block::ZERO,
            ready: false,
        }
    }

    /// The pseudo-random value for block `index` of the segment.
    fn value(&mut self, index: u32) -> u64 {
        let i = index as usize % WORDS;
        if !self.ready || i == 0 {
            self.input.0[6] += 1;
            let mut z = Block::ZERO;
            compress(&Block::ZERO, &self.input, &mut z, false);
            compress(&Block::ZERO, &z, &mut self.block, false);
            self.ready = true;
        }
        self.block.0[i]
    }
}

/// The compression function G (RFC 9106 §3.5): `out = P(x ^ y) ^ x ^ y`,
/// or `out ^= P(x ^ y) ^ x ^ y` for passes after the first (version
/// 0x13).
///
/// The block is an 8×8 matrix of 16-byte registers, register (i, j) the
/// word pair 16i + 2j, 16i + 2j + 1; P runs on its eight rows, then on its
/// eight columns. P's words v0..v15 are eight pairs (v_2k, v_2k+1): pair
/// k of column j is at 16k + 2j, so the 16-word run k holds pair k of
/// every column and [`permute_runs`] computes the eight column Ps side by
/// side. The rows are done the same way on the transposed matrix.
fn compress(x: &Block, y: &Block, out: &mut Block, xor: bool) {
    // A 1 the optimizer cannot see through: see [`mul_add`].
    let one = std::hint::black_box(1);
    let mut r = [0u64; WORDS];
    for ((r, x), y) in r.iter_mut().zip(&x.0).zip(&y.0) {
        *r = x ^ y;
    }
    let mut t = [0u64; WORDS];
    transpose(&r, &mut t);
    permute_runs(&mut t, one);
    let mut q = [0u64; WORDS];
    transpose(&t, &mut q);
    permute_runs(&mut q, one);
    if xor {
        for ((o, q), r) in out.0.iter_mut().zip(&q).zip(&r) {
            *o ^= q ^ r;
        }
    } else {
        for ((o, q), r) in out.0.iter_mut().zip(&q).zip(&r) {
            *o = q ^ r;
        }
    }
}

/// `to` = `from` with the 8×8 matrix of word pairs transposed.
#[inline(always)]
fn transpose(from: &[u64; WORDS], to: &mut [u64; WORDS]) {
    let (from, _) = from.as_chunks::<2>();
    let (to, _) = to.as_chunks_mut::<2>();
    for i in 0..8 {
        for j in 0..8 {
            to[8 * j + i] = from[8 * i + j];
        }
    }
}

/// BlaMka's multiply-add: `a + b + 2 * lo32(a) * lo32(b)` (mod 2^64),
/// the doubling written as a shift by `one` (always 1). With a constant
/// shift LLVM moves the doubling into the multiply, whose operand then
/// has 33 bits: two SSE2 multiplies instead of one, and vector code it
/// judges too dear to emit.
#[inline(always)]
fn mul_add(a: u64, b: u64, one: u32) -> u64 {
    let m = u64::from(a as u32) * u64::from(b as u32);
    a.wrapping_add(b).wrapping_add(m << one)
}

/// GB (RFC 9106 §3.6) on `N` independent quadruples `(a[i], b[i], c[i],
/// d[i])` at once, written lane-wise so that LLVM vectorizes it.
#[inline(always)]
fn gb<const N: usize>([a, b, c, d]: [&mut [u64; N]; 4], one: u32) {
    for i in 0..N {
        a[i] = mul_add(a[i], b[i], one);
        d[i] = (d[i] ^ a[i]).rotate_right(32);
        c[i] = mul_add(c[i], d[i], one);
        b[i] = (b[i] ^ c[i]).rotate_right(24);
        a[i] = mul_add(a[i], b[i], one);
        d[i] = (d[i] ^ a[i]).rotate_right(16);
        c[i] = mul_add(c[i], d[i], one);
        b[i] = (b[i] ^ c[i]).rotate_right(63);
    }
}

/// P on eight word sets side by side: run k (words 16k..16k+16) holds the
/// pair (v_2k, v_2k+1) of set j at 2j, 2j + 1. GB on the columns
/// (v0, v4, v8, v12)..(v3, v7, v11, v15) is GB on whole runs; GB on the
/// diagonals (v0, v5, v10, v15), (v1, v6, v11, v12) and (v2, v7, v8,
/// v13), (v3, v4, v9, v14) is GB on runs whose pairs are first crossed.
#[inline(always)]
fn permute_runs(q: &mut [u64; WORDS], one: u32) {
    let (runs, _) = q.as_chunks_mut::<16>();
    let [a0, a1, b0, b1, c0, c1, d0, d1] = runs else {
        unreachable!("a block is eight 16-word runs")
    };
    gb([a0, b0, c0, d0], one);
    gb([a1, b1, c1, d1], one);
    // Per set: (v5, v6) = (b0 odd, b1 even), (v15, v12) = (d1 odd, d0
    // even), (v7, v4) = (b1 odd, b0 even), (v13, v14) = (d0 odd, d1 even).
    let cross = |x: &[u64; 16], y: &[u64; 16]| -> [u64; 16] {
        core::array::from_fn(|i| if i % 2 == 0 { x[i + 1] } else { y[i - 1] })
    };
    let (mut b01, mut d10) = (cross(b0, b1), cross(d1, d0));
    let (mut b10, mut d01) = (cross(b1, b0), cross(d0, d1));
    gb([a0, &mut b01, c1, &mut d10], one);
    gb([a1, &mut b10, c0, &mut d01], one);
    // Back: b0 = (v4, v5), b1 = (v6, v7), d0 = (v12, v13), d1 = (v14, v15).
    *b0 = cross(&b10, &b01);
    *b1 = cross(&b01, &b10);
    *d0 = cross(&d10, &d01);
    *d1 = cross(&d01, &d10);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::argon2::{Algorithm, Argon2, Params, Version};
    use proptest::prelude::*;

    /// The RFC 9106 §5 inputs: P = 32 × 0x01, S = 16 × 0x02, K = 8 × 0x03,
    /// X = 12 × 0x04; t = 3, m = 32 KiB, p = 4, T = 32; with `threads`.
    fn rfc_vector(variant: Variant, threads: u32) -> [u8; 32] {
        let inputs = Inputs {
            passphrase: &[0x01; 32],
            salt: &[0x02; 16],
            secret: &[0x03; 8],
            ad: &[0x04; 12],
        };
        let costs = Costs {
            time: 3,
            memory_kib: 32,
            lanes: 4,
            threads,
        };
        let mut out = [0u8; 32];
        derive_with(variant, &inputs, &costs, &mut out).unwrap();
        out
    }

    /// The `argon2` crate's output for the same LUKS-style parameters.
    fn reference(
        v: Variant,
        pw: &[u8],
        salt: &[u8],
        t: u32,
        m: u32,
        p: u32,
        len: usize,
    ) -> Vec<u8> {
        let algorithm = match v {
            Variant::I => Algorithm::Argon2i,
            Variant::Id => Algorithm::Argon2id,
        };
        let params = Params::new(m, t, p, Some(len)).unwrap();
        let mut memory = vec![::argon2::Block::new(); params.block_count()];
        let mut out = vec![0u8; len];
        Argon2::new(algorithm, Version::V0x13, params)
            .hash_password_into_with_memory(pw, salt, &mut out, &mut memory[..])
            .unwrap();
        out
    }

    /// Our output for the same parameters.
    #[allow(clippy::too_many_arguments)]
    fn ours(
        v: Variant,
        pw: &[u8],
        salt: &[u8],
        t: u32,
        m: u32,
        p: u32,
        th: u32,
        len: usize,
    ) -> Vec<u8> {
        let mut out = vec![0u8; len];
        derive(v, pw, salt, t, m, p, th, &mut out).unwrap();
        out
    }

    /// Hex of a test vector written with spaces.
    fn hex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|d| u8::from_str_radix(std::str::from_utf8(d).unwrap(), 16).unwrap())
            .collect()
    }

    /// RFC 9106 §5.3 (Argon2i) and §5.4 (Argon2id), on 1 to 8 threads.
    #[test]
    fn rfc9106_vectors() {
        let cases = [
            (
                Variant::I,
                "c8 14 d9 d1 dc 7f 37 aa 13 f0 d7 7f 24 94 bd a1
                 c8 de 6b 01 6d d3 88 d2 99 52 a4 c4 67 2b 6c e8",
            ),
            (
                Variant::Id,
                "0d 64 0d f5 8d 78 76 6c 08 c0 37 a3 4a 8b 53 c9
                 d0 1e f0 45 2d 75 b6 5e b5 25 20 e9 6b 01 e6 59",
            ),
        ];
        for (v, tag) in cases {
            for threads in [1, 2, 4, 8] {
                assert_eq!(
                    rfc_vector(v, threads).to_vec(),
                    hex(tag),
                    "{v:?}, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn h_prime_lengths_agree_with_the_argon2_crate() {
        // Outputs around H''s 64-byte switch and its 32-byte steps.
        for len in [4, 31, 32, 33, 63, 64, 65, 96, 97, 128, 129, 200, 1024] {
            for v in [Variant::I, Variant::Id] {
                let want = reference(v, b"pw", b"saltsalt", 1, 16, 2, len);
                assert_eq!(ours(v, b"pw", b"saltsalt", 1, 16, 2, 2, len), want, "{len}");
            }
        }
    }

    #[test]
    fn several_address_blocks_and_uneven_memory_agree() {
        // 1 lane of 1030 blocks: 257-block segments need 3 address
        // blocks; m is not a multiple of 4p for the 3-lane case.
        for (m, p) in [(1030, 1), (1030, 3), (4099, 4)] {
            for v in [Variant::I, Variant::Id] {
                let want = reference(v, b"passphrase", b"0123456789abcdef", 2, m, p, 32);
                let got = ours(v, b"passphrase", b"0123456789abcdef", 2, m, p, 3, 32);
                assert_eq!(got, want, "{v:?} m={m} p={p}");
            }
        }
    }

    #[test]
    fn bad_parameters_are_errors() {
        let call = |t, m, p, salt: &[u8], out: &mut [u8]| {
            derive(Variant::Id, b"pw", salt, t, m, p, 2, out)
        };
        let salt = [7u8; 16];
        let mut out = [0u8; 32];
        assert_eq!(call(0, 64, 1, &salt, &mut out), Err(Argon2Error::TimeZero));
        assert_eq!(call(1, 64, 0, &salt, &mut out), Err(Argon2Error::Lanes(0)));
        assert_eq!(
            call(1, u32::MAX, 1 << 24, &salt, &mut out),
            Err(Argon2Error::Lanes(1 << 24))
        );
        let small = Argon2Error::MemoryTooSmall {
            memory_kib: 31,
            min_kib: 32,
        };
        assert_eq!(call(1, 31, 4, &salt, &mut out), Err(small));
        assert_eq!(
            call(1, 64, 1, &salt[..7], &mut out),
            Err(Argon2Error::SaltTooShort(7))
        );
        assert_eq!(
            call(1, 64, 1, &salt, &mut out[..3]),
            Err(Argon2Error::OutputTooShort(3))
        );
        assert_eq!(out, [0u8; 32], "a refused call leaves the output untouched");
        // A tag longer than a 32-bit length (checked before any output is
        // made, so no such buffer is needed).
        let inputs = Inputs {
            passphrase: b"pw",
            salt: &salt,
            secret: &[],
            ad: &[],
        };
        let costs = Costs {
            time: 1,
            memory_kib: 64,
            lanes: 1,
            threads: 1,
        };
        let long = u32::MAX as usize + 1;
        assert!(matches!(
            check(Variant::I, &inputs, &costs, long),
            Err(Argon2Error::TooLong { what: "output", len }) if len == long
        ));
        // The smallest accepted values.
        assert!(call(1, 8, 1, &salt[..8], &mut out[..4]).is_ok());
        assert!(call(1, 32, 4, &salt[..8], &mut out[..4]).is_ok());
    }

    #[test]
    fn memory_that_cannot_be_had_is_an_error() {
        // ~4 TiB in four 1 TiB segments: refused by any allocator without
        // an overcommit of everything (vm.overcommit_memory = 1 would
        // grant it, then die).
        let always = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
            .is_ok_and(|s| s.trim() == "1");
        if always || usize::BITS < 64 {
            return;
        }
        let mut out = [0u8; 32];
        let r = derive(Variant::Id, b"pw", &[1; 16], 1, u32::MAX, 1, 1, &mut out);
        let kib = u64::from(u32::MAX / 4 * 4);
        assert_eq!(r, Err(Argon2Error::OutOfMemory { kib }));
    }

    #[test]
    fn thread_counts_do_not_change_the_output() {
        let want = ours(Variant::Id, b"pw", b"saltsalt", 2, 256, 5, 1, 40);
        for threads in [0, 2, 3, 5, 64] {
            assert_eq!(
                ours(Variant::Id, b"pw", b"saltsalt", 2, 256, 5, threads, 40),
                want
            );
        }
    }

    #[test]
    fn on_threads_does_every_job_once() {
        for threads in [0, 1, 2, 3, 16] {
            let mut seen = vec![0u32; 37];
            on_threads(threads, seen.iter_mut().enumerate(), |(i, n)| {
                *n += i as u32 + 1
            });
            let want: Vec<u32> = (1..=37).collect();
            assert_eq!(seen, want, "{threads} threads");
        }
    }

    /// P as RFC 9106 §3.6 writes it, on 16 words.
    fn p_literal(v: &mut [u64; 16]) {
        let quads = [
            [0, 4, 8, 12],
            [1, 5, 9, 13],
            [2, 6, 10, 14],
            [3, 7, 11, 15],
            [0, 5, 10, 15],
            [1, 6, 11, 12],
            [2, 7, 8, 13],
            [3, 4, 9, 14],
        ];
        // a = (a + b + 2 * trunc(a) * trunc(b)) mod 2^64, as the RFC has it.
        let f = |a: u64, b: u64| {
            let prod = 2 * u128::from(a & 0xFFFF_FFFF) * u128::from(b & 0xFFFF_FFFF);
            ((u128::from(a) + u128::from(b) + prod) % (1 << 64)) as u64
        };
        for [a, b, c, d] in quads {
            v[a] = f(v[a], v[b]);
            v[d] = (v[d] ^ v[a]).rotate_right(32);
            v[c] = f(v[c], v[d]);
            v[b] = (v[b] ^ v[c]).rotate_right(24);
            v[a] = f(v[a], v[b]);
            v[d] = (v[d] ^ v[a]).rotate_right(16);
            v[c] = f(v[c], v[d]);
            v[b] = (v[b] ^ v[c]).rotate_right(63);
        }
    }

    #[test]
    fn g_equals_p_as_written() {
        let mut q = [0u64; WORDS];
        for (i, w) in q.iter_mut().enumerate() {
            *w = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
        // All rows (words 16i..16i+16), then all columns (words 16k + 2i + e).
        let mut spec = q;
        for i in 0..8 {
            let row: [usize; 16] = core::array::from_fn(|j| 16 * i + j);
            let mut v = row.map(|k| spec[k]);
            p_literal(&mut v);
            row.into_iter().zip(v).for_each(|(k, x)| spec[k] = x);
        }
        for i in 0..8 {
            let col: [usize; 16] = core::array::from_fn(|j| 16 * (j / 2) + 2 * i + j % 2);
            let mut v = col.map(|k| spec[k]);
            p_literal(&mut v);
            col.into_iter().zip(v).for_each(|(k, x)| spec[k] = x);
        }
        let want: Vec<u64> = spec.iter().zip(&q).map(|(p, r)| p ^ r).collect();
        // G(0, q) = P(q) ^ q; G(x, y) depends on x ^ y only.
        let mut out = Block::ZERO;
        compress(&Block::ZERO, &Block(q), &mut out, false);
        assert_eq!(out.0.to_vec(), want);
        let (mut x, mut y) = (Block(q), Block(q));
        x.0[..64].fill(u64::MAX);
        y.0[..64].iter_mut().for_each(|w| *w = !*w);
        y.0[64..].fill(0);
        let mut acc = Block([5; WORDS]);
        compress(&x, &y, &mut acc, true);
        let xored: Vec<u64> = want.iter().map(|w| w ^ 5).collect();
        assert_eq!(
            acc.0.to_vec(),
            xored,
            "the pass-2+ form XORs into the old block"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn equals_the_argon2_crate(
            id in any::<bool>(),
            pw in proptest::collection::vec(any::<u8>(), 8..64),
            salt in proptest::collection::vec(any::<u8>(), 8..64),
            time in 1u32..=4,
            lanes in 1u32..=8,
            extra in 0u32..=512,
            out_len in 4usize..=96,
            threads in 1u32..=4,
        ) {
            let v = if id { Variant::Id } else { Variant::I };
            let memory = (8 * lanes + extra).min(512);
            let want = reference(v, &pw, &salt, time, memory, lanes, out_len);
            let got = ours(v, &pw, &salt, time, memory, lanes, threads, out_len);
            prop_assert_eq!(got, want);
        }
    }

    /// Nanoseconds the calling thread has spent on a CPU (Linux
    /// schedstat; 0 elsewhere).
    fn thread_cpu_ns() -> u64 {
        std::fs::read_to_string("/proc/thread-self/schedstat")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// One call of `f`: (wall-clock, on-CPU time of this thread) in ms.
    fn timed(f: impl FnOnce()) -> (f64, f64) {
        let (t, c) = (std::time::Instant::now(), thread_cpu_ns());
        f();
        let cpu = (thread_cpu_ns() - c) as f64 / 1e6;
        (t.elapsed().as_secs_f64() * 1e3, cpu)
    }

    /// The `argon2` crate's Argon2id as kdf.rs calls it: memory reserved,
    /// zeroed, used, wiped.
    fn crate_argon2id(t: u32, m: u32, p: u32) {
        let params = Params::new(m, t, p, Some(32)).unwrap();
        let ctx = Argon2::new(Algorithm::Argon2id, Version::V0x13, params);
        let mut memory = Vec::new();
        memory.try_reserve_exact(m as usize).unwrap();
        memory.resize(m as usize, ::argon2::Block::new());
        let mut out = [0u8; 32];
        ctx.hash_password_into_with_memory(b"pw", b"saltsalt", &mut out, &mut memory[..])
            .unwrap();
        memory.iter_mut().for_each(Zeroize::zeroize);
    }

    /// Timings (run with `--release -- --ignored --nocapture`), best of
    /// `ARGON2_RUNS` (default 7) interleaved runs: one lane against the
    /// `argon2` crate (wall-clock and on-CPU time, as the machine may be
    /// shared), then 4 lanes: the crate, ours on 1, 2 and 4 threads
    /// (wall-clock).
    #[test]
    #[ignore = "timing, not a check"]
    fn timings() {
        let runs: usize = std::env::var("ARGON2_RUNS").map_or(7, |v| v.parse().unwrap());
        let m = 64 * 1024;
        let min = |v: &[(f64, f64)], i: usize| {
            v.iter()
                .map(|x| if i == 0 { x.0 } else { x.1 })
                .fold(f64::MAX, f64::min)
        };
        for t in 1..=3 {
            let (mut theirs, mut mine) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                theirs.push(timed(|| crate_argon2id(t, m, 1)));
                mine.push(timed(|| {
                    drop(ours(Variant::Id, b"pw", b"saltsalt", t, m, 1, 1, 32))
                }));
            }
            let (tw, tc, ow, oc) = (
                min(&theirs, 0),
                min(&theirs, 1),
                min(&mine, 0),
                min(&mine, 1),
            );
            println!(
                "1 lane, 64 MiB, t={t}: argon2 crate {tw:.1} ms wall / {tc:.1} ms cpu, \
                 ours {ow:.1} / {oc:.1}: speed ratio {:.2} wall, {:.2} cpu",
                tw / ow,
                tc / oc
            );
        }
        let (mut lanes4, mut theirs) = ([Vec::new(), Vec::new(), Vec::new()], Vec::new());
        for _ in 0..runs {
            theirs.push(timed(|| crate_argon2id(3, m, 4)));
            for (i, threads) in [1, 2, 4].into_iter().enumerate() {
                let f = || drop(ours(Variant::Id, b"pw", b"saltsalt", 3, m, 4, threads, 32));
                lanes4[i].push(timed(f));
            }
        }
        let (one, crate4) = (min(&lanes4[0], 0), min(&theirs, 0));
        println!("4 lanes, 64 MiB, t=3: argon2 crate {crate4:.1} ms, ours on 1 thread {one:.1} ms");
        for (i, threads) in [(1, 2), (2, 4)] {
            let many = min(&lanes4[i], 0);
            println!(
                "4 lanes, 64 MiB, t=3, {threads} threads: {many:.1} ms, speedup {:.2} over 1 \
                 thread, {:.2} over the argon2 crate",
                one / many,
                crate4 / many
            );
        }
    }
}
