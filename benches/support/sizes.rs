//! The random window's sizes and slots, drawn before timing, shared by the benches and the
//! GPU comparison (`#[path]`-included: no crate of its own).
#![allow(dead_code)]

/// Deterministic sizes and slots, drawn before timing so the harness costs a few
/// instructions per iteration (a `powf` per draw would cost more than a cache hit).
pub struct Rng {
    state: u64,
    sizes: Vec<usize>,
    i: usize,
}

impl Rng {
    const TABLE: usize = 1 << 16;

    pub fn new(seed: u64) -> Rng {
        let mut x = seed | 1;
        let sizes = (0..Self::TABLE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Log-uniform in [256 B, 4 MiB).
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                (256.0 * (16384.0f64).powf(u)) as usize
            })
            .collect();
        Rng { state: x, sizes, i: 0 }
    }

    #[inline]
    pub fn next(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }

    #[inline]
    pub fn size(&mut self) -> usize {
        self.i = (self.i + 1) & (Self::TABLE - 1);
        self.sizes[self.i]
    }
}
