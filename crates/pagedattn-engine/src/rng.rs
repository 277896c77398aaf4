//! A small seeded random stream whose sequence never changes between versions or machines
//! (workloads and samples are reproducible from their seed; `rand`'s generators do not
//! promise a stable stream across releases).

/// SplitMix64's increment per draw (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 (Steele, Lea and Flood, 2014): 64 bits of state, each output a mix of it.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The stream `n` draws further on (what `n` calls of [`next_u64`](Self::next_u64) would
    /// leave): SplitMix64's state advances by a constant per draw, so parts of one stream can
    /// be drawn in parallel.
    pub fn skip(&mut self, n: u64) {
        self.state = self.state.wrapping_add(GAMMA.wrapping_mul(n));
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_splitmix64() {
        // The published SplitMix64 outputs of seed 1234567.
        let mut r = SplitMix64::new(1234567);
        let want = [
            6457827717110365317,
            3203168211198807973,
            9817491932198370423,
        ];
        for w in want {
            assert_eq!(r.next_u64(), w);
        }
        let x = SplitMix64::new(5).next_f64();
        assert!((0.0..1.0).contains(&x));
        // Skipping n draws lands where n draws do.
        let (mut a, mut b) = (SplitMix64::new(9), SplitMix64::new(9));
        for _ in 0..1000 {
            a.next_u64();
        }
        b.skip(1000);
        assert_eq!(a.next_u64(), b.next_u64());
    }
}
