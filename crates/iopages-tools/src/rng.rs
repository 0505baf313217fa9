//! A small reproducible pseudo-random generator for test data and
//! workloads: xorshift64 (Marsaglia's 13/7/17 triple).
//!
//! Owns: [`XorShift`], the one generator the tests and benchmarks share
//! where they want the same stream from the same seed. Must never: be used
//! for anything secret (keys, salts, IVs come from the system's CSPRNG),
//! or change its stream — a test's recorded expectations depend on it.

/// xorshift64 over a 64-bit state; the state is the last output.
#[derive(Clone, Debug)]
pub struct XorShift(pub u64);

impl XorShift {
    /// The next 64 bits (a zero state stays zero: seed with a non-zero
    /// value).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0) has no value");
        self.next() % n
    }

    /// Fill `b`, eight bytes per step, little-endian.
    pub fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::XorShift;

    #[test]
    fn the_stream_is_xorshift64_and_fill_is_its_little_endian_bytes() {
        let mut r = XorShift(1);
        // 1 → 1 ^ 1<<13 = 0x2001; ^ >>7 = 0x2001 ^ 0x40 = 0x2041;
        // ^ <<17 = 0x2041 ^ 0x4082_0000 = 0x4082_2041.
        assert_eq!(r.next(), 0x4082_2041);
        let mut a = XorShift(7);
        let mut b = XorShift(7);
        let mut buf = [0u8; 11];
        a.fill(&mut buf);
        let (x, y) = (b.next().to_le_bytes(), b.next().to_le_bytes());
        assert_eq!(&buf[..8], &x);
        assert_eq!(&buf[8..], &y[..3]);
        assert!((0..1000).all(|_| a.below(10) < 10));
    }
}
