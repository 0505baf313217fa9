//! The XTS kernel for x86_64 CPUs with VAES: AES rounds on two blocks per
//! 256-bit register, sixteen blocks in flight.
//!
//! Owns: the AES key schedule (AES-NI `aeskeygenassist`), the round loop
//! and the tweak arithmetic, all under `#[target_feature]`, entered only
//! after run-time detection. Must never: run on a CPU without AES-NI, AVX2,
//! VAES and VPCLMULQDQ (construction checks, and every `unsafe` entry
//! relies on it), branch or index on key or data values, or keep key
//! material in its own memory after a call or after drop.
//!
//! Why it exists: the `aes` crate's VAES backend, reached through its
//! run-time dispatch, runs at half the speed of the same instructions
//! compiled here (measured on the project's machine, AMD EPYC Zen 3:
//! AES-256 ECB about 5 GB/s through `aes` 0.9.4 against 12 GB/s for a
//! plain round-major VAES loop; LLVM reorders the crate's 30-block loop
//! block by block and spills the round keys). Below `openssl speed`'s
//! AES-XTS rate, that would make the cipher the bottleneck of the crypt
//! target. See `docs/experiments.md` (`bench xts`) and `docs/architecture.md`.
//!
//! Layout of a pass: the first tweaks of up to [`FIRST_TWEAK_BATCH`] sectors
//! are encrypted together under the tweak key; a sector's first sixteen
//! tweaks come from its first one by sixteen independent multiplications
//! (`first_tweaks`); then the sector goes 256 bytes at a time: 8 registers of two blocks, each XORed with its tweaks
//! and the whitening key, the rounds applied round-major, the last round
//! key XORed with the tweaks so the final `aesenclast` also unmasks. Tweaks
//! for the next 256 bytes of the sector (none after its last step) are the
//! current ones times α^16: a 2-byte lane
//! shift plus the carry-less product (VPCLMULQDQ) of the 16 bits shifted
//! out with 0x87 (at most 23 bits, so no second reduction). An empty
//! `asm!` between rounds keeps the loop round-major (see `round_barrier`).

use core::arch::x86_64::*;
use zeroize::Zeroize;

/// Round keys of one AES key: 11 (AES-128) or 15 (AES-256) used.
type RoundKeys = [[u8; 16]; 15];

/// Bytes per inner step: 8 registers × 2 blocks × 16 bytes.
const STEP_BYTES: usize = 256;
/// Sectors whose first tweaks are encrypted in one go (8 registers × 2).
pub(crate) const FIRST_TWEAK_BATCH: usize = 16;

/// Whether this CPU can run the kernel.
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("vaes")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
}

/// Expanded keys of one AES-XTS key: data key both ways, tweak key
/// encryption only. Wiped on drop (each clone wipes its own copy).
#[derive(Clone)]
pub(crate) struct VaesXts {
    data_enc: RoundKeys,
    data_dec: RoundKeys,
    tweak_enc: RoundKeys,
    /// 10 (AES-128) or 14 (AES-256).
    rounds: usize,
}

impl Drop for VaesXts {
    fn drop(&mut self) {
        self.data_enc.zeroize();
        self.data_dec.zeroize();
        self.tweak_enc.zeroize();
    }
}

impl VaesXts {
    /// Expand `k1` (data) and `k2` (tweak), 16 or 32 bytes each. `None`
    /// when the CPU lacks AES-NI, AVX2, VAES or VPCLMULQDQ.
    pub(crate) fn new(k1: &[u8], k2: &[u8]) -> Option<VaesXts> {
        assert!(k1.len() == k2.len() && (k1.len() == 16 || k1.len() == 32));
        if !available() {
            return None;
        }
        let mut x = VaesXts {
            data_enc: [[0; 16]; 15],
            data_dec: [[0; 16]; 15],
            tweak_enc: [[0; 16]; 15],
            rounds: if k1.len() == 16 { 10 } else { 14 },
        };
        // SAFETY: AES-NI (and SSE2, part of x86_64) were detected above.
        unsafe {
            expand_key(k1, &mut x.data_enc);
            expand_key(k2, &mut x.tweak_enc);
            invert_keys(&x.data_enc, x.rounds, &mut x.data_dec);
        }
        Some(x)
    }

    /// XTS over whole sectors of `dst`'s segments, filled back to back:
    /// sector `k` (counted across the segments; read from `src`, or in
    /// place) has the tweak `E_K2(first_iv + k * iv_step)` (plain64, mod
    /// 2^64). One pass, so the round keys are
    /// set up, and the first tweaks encrypted 16 sectors at a time, once
    /// for the whole request rather than once per segment.
    ///
    /// The caller has checked: `sector_bytes` is a multiple of 256, every
    /// segment a multiple of `sector_bytes`, and `src`, if any, as long as
    /// all of them.
    pub(crate) fn crypt_segments(
        &self,
        op: Op,
        first_iv: u64,
        iv_step: u64,
        sector_bytes: usize,
        src: Option<&[u8]>,
        dst: &mut [&mut [u8]],
    ) {
        assert!(sector_bytes.is_multiple_of(STEP_BYTES));
        assert!(dst.iter().all(|d| d.len().is_multiple_of(sector_bytes)));
        let total: usize = dst.iter().map(|d| d.len()).sum();
        assert!(src.is_none_or(|s| s.len() == total));
        let job = Job {
            first_iv,
            iv_step,
            sector_bytes,
            sectors: total / sector_bytes,
            src,
        };
        // Non-temporal stores need 32-byte aligned destinations.
        let decrypt = op == Op::Decrypt;
        let stream = op == Op::EncryptStreaming
            && dst.iter().all(|d| (d.as_ptr() as usize).is_multiple_of(32));
        let (enc, dec, tw) = (&self.data_enc, &self.data_dec, &self.tweak_enc);
        // SAFETY: construction checked AES-NI, AVX2, VAES and VPCLMULQDQ; the lengths
        // are checked above, and `stream` only with aligned segments.
        unsafe {
            match (self.rounds, decrypt, stream) {
                (10, false, false) => xts_pass::<10, false, false>(enc, tw, job, dst),
                (10, false, true) => xts_pass::<10, false, true>(enc, tw, job, dst),
                (10, true, _) => xts_pass::<10, true, false>(dec, tw, job, dst),
                (_, false, false) => xts_pass::<14, false, false>(enc, tw, job, dst),
                (_, false, true) => xts_pass::<14, false, true>(enc, tw, job, dst),
                (_, true, _) => xts_pass::<14, true, false>(dec, tw, job, dst),
            }
        }
    }
}

/// What a pass does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Encrypt with ordinary stores.
    Encrypt,
    /// Encrypt, writing an aligned destination with non-temporal stores.
    EncryptStreaming,
    /// Decrypt.
    Decrypt,
}

#[derive(Clone, Copy)]
struct Job<'a> {
    first_iv: u64,
    iv_step: u64,
    sector_bytes: usize,
    /// Sectors in all the segments together.
    sectors: usize,
    src: Option<&'a [u8]>,
}

/// One XTS pass over `dst`'s segments, back to back; `NR` rounds, `DEC`
/// for decryption (`keys` then hold the equivalent inverse cipher's round
/// keys), `NT` to write `dst` with non-temporal stores (past the caches,
/// without first reading the lines: for destinations the CPU will not
/// read back soon).
///
/// # Safety
/// The CPU has AES-NI, AVX2, VAES and VPCLMULQDQ. Each segment's length
/// is a multiple of `job.sector_bytes`, itself a multiple of
/// [`STEP_BYTES`], and `job.sectors` sectors fill them all; `job.src`, if
/// any, is as long as all segments. With
/// `NT`, every segment is 32-byte aligned.
#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
unsafe fn xts_pass<const NR: usize, const DEC: bool, const NT: bool>(
    keys: &RoundKeys,
    tweak_keys: &RoundKeys,
    job: Job<'_>,
    dst: &mut [&mut [u8]],
) {
    let mut k = [_mm256_setzero_si256(); 15];
    let mut kt = [_mm256_setzero_si256(); 15];
    broadcast_keys::<NR>(keys, &mut k);
    broadcast_keys::<NR>(tweak_keys, &mut kt);
    let total = job.sectors;
    let mut sectors = dst
        .iter_mut()
        .flat_map(|d| d.chunks_exact_mut(job.sector_bytes));
    // A batch's first tweaks, two per register (sector 2j in the low lane
    // of register j, 2j + 1 in the high lane).
    let mut first = [_mm256_setzero_si256(); 8];
    let mut tw = [_mm256_setzero_si256(); 8];
    let mut done = 0;
    while done < total {
        let n = (total - done).min(FIRST_TWEAK_BATCH);
        // First tweaks of this batch: E_K2(plain64 IV), as many as it has
        // sectors need (a one-sector request, a 4 KiB page, encrypts one
        // register's worth, not sixteen tweaks).
        batch_ivs(&job, done as u64, n, &mut first);
        // SAFETY: this function's caller promised AES-NI, AVX2 and VAES.
        unsafe { encrypt_tweaks::<NR>(&kt, &mut first, n) };
        for (s, out) in sectors.by_ref().take(n).enumerate() {
            let pair = first[s / 2];
            let t = if s % 2 == 0 {
                _mm256_castsi256_si128(pair)
            } else {
                _mm256_extracti128_si256::<1>(pair)
            };
            tw = first_tweaks(t);
            let offset = (done + s) * job.sector_bytes;
            // SAFETY: `out` is one whole sector of `dst` (a multiple of
            // STEP_BYTES), and `job.src`, if any, holds it at `offset`;
            // with `NT` the caller promised every segment 32-byte aligned.
            // This function's caller promised the CPU features.
            unsafe { xts_sector::<NR, DEC, NT>(&k, &mut tw, job.src, offset, out) };
        }
        done += n;
    }
    if NT {
        // Order the weakly ordered stores before whatever publishes `dst`
        // (a lock release, a queue push) to other threads.
        _mm_sfence();
    }
    wipe(&mut first);
    wipe(&mut tw);
    wipe(&mut k);
    wipe(&mut kt);
}

/// One sector through the cipher, step by step, from its first tweaks
/// `tw`: `out` (whole steps) from `src[offset..]`, or in place. Every step
/// but the last moves the tweaks on; the last one's would be thrown away
/// (half the tweak work of a 512-byte sector: 16 % of its rate at
/// AES-256). The last is its own call after the loop, so the loop body
/// stays as it was (choosing inside the loop cost 4096-byte sectors 4 %).
///
/// # Safety
/// The CPU has AES-NI, AVX2, VAES and VPCLMULQDQ. `out.len()` is a
/// multiple of STEP_BYTES, and `src`, if any, holds as many bytes from
/// `offset`; with `NT`, `out` is 32-byte aligned.
#[inline]
#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
unsafe fn xts_sector<const NR: usize, const DEC: bool, const NT: bool>(
    k: &[__m256i; 15],
    tw: &mut [__m256i; 8],
    src: Option<&[u8]>,
    offset: usize,
    out: &mut [u8],
) {
    let steps = out.len() / STEP_BYTES;
    let mut chunks = out.chunks_exact_mut(STEP_BYTES).enumerate();
    let step_io = |c: usize, step: &mut [u8]| {
        let o = step.as_mut_ptr();
        let i = match src {
            Some(src) => src[offset + c * STEP_BYTES..][..STEP_BYTES].as_ptr(),
            None => o.cast_const(),
        };
        (i, o)
    };
    for (c, step) in chunks.by_ref().take(steps.saturating_sub(1)) {
        let (i, o) = step_io(c, step);
        // SAFETY: `i` starts STEP_BYTES readable bytes (of `src` or of
        // this step of `out`), `o` this step's STEP_BYTES writable bytes;
        // with `NT` the caller promised `out` 32-byte aligned, and steps
        // are multiples of 32. The caller promised the CPU features.
        unsafe { xts_step::<NR, DEC, NT, true>(k, tw, i, o) };
    }
    if let Some((c, step)) = chunks.next() {
        let (i, o) = step_io(c, step);
        // SAFETY: as in the loop above.
        unsafe { xts_step::<NR, DEC, NT, false>(k, tw, i, o) };
    }
}

/// The `NR + 1` round keys of `keys`, each broadcast to both 128-bit
/// lanes, into `k` (the caller's, which it wipes: no copy is left here).
#[inline]
#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
fn broadcast_keys<const NR: usize>(keys: &RoundKeys, k: &mut [__m256i; 15]) {
    for r in 0..=NR {
        // SAFETY: each round key is 16 readable bytes; `loadu` needs no
        // alignment.
        let kr = unsafe { _mm_loadu_si128(keys[r].as_ptr().cast()) };
        k[r] = _mm256_broadcastsi128_si256(kr);
    }
}

/// The plain64 IVs of the batch's first `sectors` sectors (at most
/// [`FIRST_TWEAK_BATCH`]), from `first_sector` (counted from the job's
/// first), into `first`: sector `i` in lane `i % 2` of register `i / 2`.
#[inline]
#[target_feature(enable = "avx2")]
fn batch_ivs(job: &Job<'_>, first_sector: u64, sectors: usize, first: &mut [__m256i; 8]) {
    let iv = |i: usize| {
        job.first_iv
            .wrapping_add((first_sector + i as u64).wrapping_mul(job.iv_step)) as i64
    };
    for (j, r) in first.iter_mut().enumerate().take(sectors.div_ceil(2)) {
        *r = _mm256_set_epi64x(0, iv(2 * j + 1), 0, iv(2 * j));
    }
}

/// One step of a sector: STEP_BYTES (16 blocks, eight registers) from `i`
/// through the cipher with round keys `k` and tweaks `tw` into `o`; the
/// tweaks move on by 16 blocks when the sector goes on (`MORE`) — the
/// last step's would be thrown away, and on a 512-byte sector (two steps)
/// they were half the tweak work.
///
/// # Safety
/// The CPU has AES-NI, AVX2, VAES and VPCLMULQDQ. `i` starts STEP_BYTES
/// readable bytes and `o` STEP_BYTES writable bytes (they may be the same
/// bytes); with `NT`, `o` is 32-byte aligned.
#[inline]
#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
unsafe fn xts_step<const NR: usize, const DEC: bool, const NT: bool, const MORE: bool>(
    k: &[__m256i; 15],
    tw: &mut [__m256i; 8],
    i: *const u8,
    o: *mut u8,
) {
    let mut x = [_mm256_setzero_si256(); 8];
    for j in 0..8 {
        // SAFETY: `i` starts STEP_BYTES (256) readable bytes, of `src` or
        // of this step of `dst`; `loadu` needs no alignment.
        let p = unsafe { _mm256_loadu_si256(i.add(32 * j).cast()) };
        x[j] = _mm256_xor_si256(p, _mm256_xor_si256(tw[j], k[0]));
    }
    for kr in &k[1..NR] {
        for xj in &mut x {
            *xj = if DEC {
                _mm256_aesdec_epi128(*xj, *kr)
            } else {
                _mm256_aesenc_epi128(*xj, *kr)
            };
        }
        round_barrier(&mut x);
    }
    for j in 0..8 {
        // The last round ends with a key XOR, so folding the tweak into
        // that key also unmasks the block.
        let last = _mm256_xor_si256(k[NR], tw[j]);
        let y = if DEC {
            _mm256_aesdeclast_epi128(x[j], last)
        } else {
            _mm256_aesenclast_epi128(x[j], last)
        };
        // SAFETY: `o` starts this step's 256 writable bytes of `dst`; with
        // `NT` the caller promised `o` 32-byte aligned, and offsets are
        // multiples of 32.
        unsafe {
            if NT {
                _mm256_stream_si256(o.add(32 * j).cast(), y);
            } else {
                _mm256_storeu_si256(o.add(32 * j).cast(), y);
            }
        }
        if MORE {
            tw[j] = mul_alpha16(tw[j]);
        }
    }
}

/// Encrypt the first tweaks of a batch of `sectors` in place: one
/// register (two blocks) for one or two sectors, all eight otherwise.
///
/// # Safety
/// The CPU has AES-NI, AVX2 and VAES.
#[inline]
#[target_feature(enable = "aes,avx2,vaes")]
unsafe fn encrypt_tweaks<const NR: usize>(k: &[__m256i; 15], x: &mut [__m256i; 8], sectors: usize) {
    if sectors <= 2 {
        let mut y = _mm256_xor_si256(x[0], k[0]);
        for kr in &k[1..NR] {
            y = _mm256_aesenc_epi128(y, *kr);
        }
        x[0] = _mm256_aesenclast_epi128(y, k[NR]);
        return;
    }
    for xj in x.iter_mut() {
        *xj = _mm256_xor_si256(*xj, k[0]);
    }
    for kr in &k[1..NR] {
        for xj in x.iter_mut() {
            *xj = _mm256_aesenc_epi128(*xj, *kr);
        }
        round_barrier(x);
    }
    for xj in x.iter_mut() {
        *xj = _mm256_aesenclast_epi128(*xj, k[NR]);
    }
}

/// Keep the round loop round-major: all eight registers finish a round
/// before any starts the next. Left alone, LLVM's generic x86-64 schedule
/// runs one or two registers through all rounds at a time, which leaves
/// the AES units waiting on latency (measured: half the throughput). The
/// empty `asm!` emits no instruction; it only makes the next round depend
/// on all eight results of this one.
#[inline]
#[target_feature(enable = "avx2")]
fn round_barrier(x: &mut [__m256i; 8]) {
    let [a, b, c, d, e, f, g, h] = x;
    // SAFETY: the template is empty: it reads and writes nothing but the
    // eight registers it is given, unchanged.
    unsafe {
        core::arch::asm!(
            "/* {0} {1} {2} {3} {4} {5} {6} {7} */",
            inout(ymm_reg) * a,
            inout(ymm_reg) * b,
            inout(ymm_reg) * c,
            inout(ymm_reg) * d,
            inout(ymm_reg) * e,
            inout(ymm_reg) * f,
            inout(ymm_reg) * g,
            inout(ymm_reg) * h,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
}

/// The tweaks of a sector's first 16 blocks, `T·α^j` for j = 0..16, two
/// per register: each lane is shifted by its own j bits (AVX2 variable
/// shifts), and the j bits shifted out are folded back in by one carry-less
/// multiply by 0x87 — sixteen independent products, no serial chain.
#[inline]
#[target_feature(enable = "avx2,vpclmulqdq")]
fn first_tweaks(t: __m128i) -> [__m256i; 8] {
    let t = _mm256_broadcastsi128_si256(t);
    let poly = _mm256_set_epi64x(0, 0x87, 0, 0x87);
    let low_to_high = _mm256_bslli_epi128::<8>(t);
    let high_to_low = _mm256_bsrli_epi128::<8>(t);
    let mut tw = [_mm256_setzero_si256(); 8];
    for (j, v) in tw.iter_mut().enumerate() {
        let k = 2 * j as i64;
        // Lane 0 shifts by k, lane 1 by k + 1 (both of its 64-bit halves).
        let count = _mm256_set_epi64x(k + 1, k + 1, k, k);
        let back = _mm256_sub_epi64(_mm256_set1_epi64x(64), count);
        let shifted = _mm256_xor_si256(
            _mm256_sllv_epi64(t, count),
            // Bits crossing from the low half into the high half (a
            // shift by 64 gives 0, which is right for k = 0).
            _mm256_srlv_epi64(low_to_high, back),
        );
        let out = _mm256_srlv_epi64(high_to_low, back);
        *v = _mm256_xor_si256(shifted, _mm256_clmulepi64_epi128::<0x00>(out, poly));
    }
    tw
}

/// Multiply both 128-bit tweaks by α^16: shift each lane up 2 bytes and
/// fold the 16 bits shifted out back in through x^128 = x^7 + x^2 + x + 1
/// (one carry-less multiply by 0x87; the product has at most 23 bits).
#[inline]
#[target_feature(enable = "avx2,vpclmulqdq")]
fn mul_alpha16(t: __m256i) -> __m256i {
    let poly = _mm256_set_epi64x(0, 0x87, 0, 0x87);
    let out = _mm256_bsrli_epi128::<14>(t);
    _mm256_xor_si256(
        _mm256_bslli_epi128::<2>(t),
        _mm256_clmulepi64_epi128::<0x00>(out, poly),
    )
}

/// Overwrite round keys or tweaks held on the stack, in a way the compiler
/// keeps.
#[inline]
#[target_feature(enable = "avx2")]
fn wipe<const N: usize>(regs: &mut [__m256i; N]) {
    for r in regs.iter_mut() {
        // SAFETY: `r` is a valid, aligned, exclusive reference.
        unsafe { core::ptr::write_volatile(r, _mm256_setzero_si256()) };
    }
}

/// The AES key schedule (FIPS-197 §5.2) with AES-NI, for 16- or 32-byte
/// keys.
///
/// # Safety
/// The CPU has AES-NI.
#[target_feature(enable = "aes")]
unsafe fn expand_key(key: &[u8], out: &mut RoundKeys) {
    let mut rk = [_mm_setzero_si128(); 15];
    assert!(key.len() == 16 || key.len() == 32);
    if key.len() == 16 {
        // SAFETY: the key holds 16 readable bytes; `loadu` needs no
        // alignment.
        rk[0] = unsafe { _mm_loadu_si128(key.as_ptr().cast()) };
        macro_rules! step {
            ($i:expr, $rcon:expr) => {
                rk[$i] = expand_step(rk[$i - 1], _mm_aeskeygenassist_si128::<$rcon>(rk[$i - 1]));
            };
        }
        step!(1, 0x01);
        step!(2, 0x02);
        step!(3, 0x04);
        step!(4, 0x08);
        step!(5, 0x10);
        step!(6, 0x20);
        step!(7, 0x40);
        step!(8, 0x80);
        step!(9, 0x1b);
        step!(10, 0x36);
    } else {
        // SAFETY: the key holds 32 readable bytes.
        rk[0] = unsafe { _mm_loadu_si128(key[..16].as_ptr().cast()) };
        // SAFETY: as above, its second half.
        rk[1] = unsafe { _mm_loadu_si128(key[16..].as_ptr().cast()) };
        // Even round keys: RotWord+SubWord of the previous key's last
        // word, with the round constant.
        macro_rules! even {
            ($i:expr, $rcon:expr) => {
                rk[$i] = expand_step(rk[$i - 2], _mm_aeskeygenassist_si128::<$rcon>(rk[$i - 1]));
            };
        }
        // Odd round keys: SubWord only (the assist's third word: no
        // rotation, no constant).
        macro_rules! odd {
            ($i:expr) => {
                let g = _mm_aeskeygenassist_si128::<0>(rk[$i - 1]);
                rk[$i] = expand_mix(rk[$i - 2], _mm_shuffle_epi32::<0xaa>(g));
            };
        }
        even!(2, 0x01);
        odd!(3);
        even!(4, 0x02);
        odd!(5);
        even!(6, 0x04);
        odd!(7);
        even!(8, 0x08);
        odd!(9);
        even!(10, 0x10);
        odd!(11);
        even!(12, 0x20);
        odd!(13);
        even!(14, 0x40);
    }
    for (o, r) in out.iter_mut().zip(rk.iter()) {
        // SAFETY: each round key is 16 writable bytes; `storeu` needs no
        // alignment.
        unsafe { _mm_storeu_si128(o.as_mut_ptr().cast(), *r) };
    }
    for r in rk.iter_mut() {
        // SAFETY: `r` is a valid, aligned, exclusive reference.
        unsafe { core::ptr::write_volatile(r, _mm_setzero_si128()) };
    }
}

/// One schedule step from the assist's RotWord/SubWord/Rcon word (the
/// fourth dword of `assist`).
#[inline]
#[target_feature(enable = "aes")]
fn expand_step(prev: __m128i, assist: __m128i) -> __m128i {
    expand_mix(prev, _mm_shuffle_epi32::<0xff>(assist))
}

/// `prev`'s words prefix-XORed, then XORed with the broadcast word `g`.
#[inline]
#[target_feature(enable = "aes")]
fn expand_mix(prev: __m128i, g: __m128i) -> __m128i {
    let mut k = prev;
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    _mm_xor_si128(k, g)
}

/// Round keys of the equivalent inverse cipher (FIPS-197 §5.3.5): the
/// encryption keys reversed, InvMixColumns applied to the inner ones.
///
/// # Safety
/// The CPU has AES-NI.
#[target_feature(enable = "aes")]
unsafe fn invert_keys(enc: &RoundKeys, rounds: usize, dec: &mut RoundKeys) {
    for r in 0..=rounds {
        // SAFETY: each round key is 16 readable bytes (`rounds` is 10 or
        // 14, below the 15 keys); `loadu` needs no alignment.
        let k = unsafe { _mm_loadu_si128(enc[rounds - r].as_ptr().cast()) };
        let k = if r == 0 || r == rounds {
            k
        } else {
            _mm_aesimc_si128(k)
        };
        // SAFETY: as the load, into the exclusively borrowed keys.
        unsafe { _mm_storeu_si128(dec[r].as_mut_ptr().cast(), k) };
    }
}
