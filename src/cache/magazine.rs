//! Magazines (Bonwick & Adams, 2001): small fixed arrays of free blocks of one size class,
//! moved between tiers whole, so that a thread cache talks to the shared depot once per
//! magazine, not once per block.
//!
//! A magazine holds device addresses only: the class (and so the size) is implied by the
//! slot it sits in, and the stream by the cache or depot that holds it.

/// The most blocks a magazine can hold. Large classes use fewer (see [`Magazine::push`]'s
/// `cap`), so one magazine never holds more than a bounded number of bytes.
pub const MAG_CAP: usize = 32;

/// A fixed array of free blocks' addresses.
#[derive(Debug, Clone)]
pub struct Magazine {
    len: usize,
    slots: [u64; MAG_CAP],
}

impl Default for Magazine {
    fn default() -> Self {
        Magazine { len: 0, slots: [0; MAG_CAP] }
    }
}

impl Magazine {
    /// An empty magazine on the heap (magazines move between threads as `Box`es).
    pub fn boxed() -> Box<Magazine> {
        Box::default()
    }

    /// Add a block if fewer than `cap` (at most [`MAG_CAP`]) are held.
    #[inline]
    pub fn push(&mut self, addr: u64, cap: usize) -> bool {
        if self.len >= cap.min(MAG_CAP) {
            return false;
        }
        self.slots[self.len] = addr;
        self.len += 1;
        true
    }

    /// Take the most recently added block (the warmest).
    #[inline]
    pub fn pop(&mut self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        self.len -= 1;
        Some(self.slots[self.len])
    }

    /// Blocks held.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no block is held.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `cap` blocks are held.
    #[inline]
    pub fn is_full(&self, cap: usize) -> bool {
        self.len >= cap.min(MAG_CAP)
    }

    /// Set the number of blocks held, for a holder that kept the count elsewhere while it
    /// pushed and popped through [`Magazine::slots_ptr`] (the thread cache's hot path).
    /// Capped at [`MAG_CAP`].
    #[inline]
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(MAG_CAP);
    }

    /// The slots' address, valid while this magazine is neither moved nor dropped (a boxed
    /// magazine's slots stay put while the box lives).
    #[inline]
    pub fn slots_ptr(&mut self) -> *mut u64 {
        self.slots.as_mut_ptr()
    }

    /// Every slot, held or not (for a holder that keeps the count elsewhere).
    pub fn slots(&self) -> &[u64] {
        &self.slots
    }

    /// The blocks held, oldest first.
    pub fn blocks(&self) -> &[u64] {
        &self.slots[..self.len]
    }

    /// Empty the magazine, handing each block to `f`.
    pub fn drain(&mut self, mut f: impl FnMut(u64)) {
        for &a in &self.slots[..self.len] {
            f(a);
        }
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_magazine_is_a_bounded_lifo() {
        let mut m = Magazine::default();
        assert!(m.push(1, 2) && m.push(2, 2));
        assert!(!m.push(3, 2), "cap respected");
        assert!(m.is_full(2));
        assert_eq!(m.pop(), Some(2));
        assert_eq!(m.blocks(), &[1]);
        let mut seen = vec![];
        m.drain(|a| seen.push(a));
        assert_eq!(seen, vec![1]);
        assert!(m.is_empty() && m.pop().is_none());
        for i in 0..MAG_CAP as u64 + 5 {
            m.push(i, usize::MAX);
        }
        assert_eq!(m.len(), MAG_CAP, "never past MAG_CAP");
    }
}
