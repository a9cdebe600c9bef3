//! A xorshift generator for the tests that share it (`#[path]`-included, as the benches'
//! `support` modules are): cheap, seedable randomness, so a failing run can be replayed.

/// xorshift64 (13, 7, 17). The state must not be 0.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}
