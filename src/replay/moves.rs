//! Where a pass's allocations land against the pass before, and which of them map or unmap
//! pages: what a warm pool that keeps moving pages is moving, allocation by allocation
//! ([`ReplayOptions::moves`](super::ReplayOptions::moves)).
//!
//! A warm pass that maps and unmaps pages does so under a few allocations, and the cause is
//! usually earlier: a large block placed elsewhere than in the pass before takes the run a
//! later one needs, which then takes loans. So a pass lists both: every allocation under
//! which the device mapped or unmapped anything (the first pass's growth included), and
//! every block no cache holds (larger than `PoolConfig::largest_cached_class`, placed in
//! the space at each allocation) that landed elsewhere than the same allocation of the pass
//! before. Cached sizes are left out of the second kind: caches hand blocks out last in,
//! first out, so their addresses change from pass to pass without a page moving.

/// One allocation of a pass that moved pages or landed elsewhere (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// The trace's event (its line among the events, from 0).
    pub event: usize,
    /// Bytes asked for.
    pub size: usize,
    /// Where the block landed.
    pub addr: u64,
    /// Where the same allocation (by its rank among the pass's allocations) landed in the
    /// pass before; None in the first pass.
    pub before: Option<u64>,
    /// Bytes the device mapped while the allocation ran (loans included).
    pub mapped: u64,
    /// Bytes the device unmapped while it ran.
    pub unmapped: u64,
}

impl Move {
    /// How far the block landed from where it did in the pass before (bytes, up positive).
    pub fn shift(&self) -> Option<i64> {
        self.before.map(|b| self.addr.wrapping_sub(b) as i64)
    }
}

/// The addresses of one pass's allocations, in order, and the moves found against the pass
/// before.
#[derive(Default)]
pub(super) struct Tracker {
    /// The pass before's addresses, by rank.
    before: Vec<u64>,
    /// This pass's, by rank.
    now: Vec<u64>,
    /// What this pass found.
    moves: Vec<Move>,
    /// The size from which no cache holds a block.
    large: u64,
}

impl Tracker {
    pub(super) fn new(large: u64) -> Tracker {
        Tracker { large, ..Tracker::default() }
    }

    /// The allocation of `size` bytes at event `event` landed at `addr`, while the device
    /// mapped `mapped` bytes and unmapped `unmapped`.
    pub(super) fn alloc(&mut self, event: usize, size: usize, addr: u64, mapped: u64, unmapped: u64) {
        let before = self.before.get(self.now.len()).copied();
        self.now.push(addr);
        let elsewhere = before.is_some_and(|b| b != addr) && size as u64 >= self.large;
        if mapped > 0 || unmapped > 0 || elsewhere {
            self.moves.push(Move { event, size, addr, before, mapped, unmapped });
        }
    }

    /// The pass is over: its moves, and its addresses kept for the next pass.
    pub(super) fn end_pass(&mut self) -> Vec<Move> {
        self.before = std::mem::take(&mut self.now);
        std::mem::take(&mut self.moves)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_pass_lists_what_paged_and_the_uncached_blocks_that_landed_elsewhere() {
        let mut t = Tracker::new(4 * MIB + 1);
        // The first pass: only what mapped is listed, with nothing to compare with.
        t.alloc(0, 8 << 20, 0x1000_0000, 8 * MIB, 0);
        t.alloc(1, 1 << 20, 0x1080_0000, 0, 0);
        t.alloc(2, 8 << 20, 0x1090_0000, 0, 0);
        let first = t.end_pass();
        assert_eq!(
            first,
            vec![Move { event: 0, size: 8 << 20, addr: 0x1000_0000, before: None, mapped: 8 * MIB, unmapped: 0 }]
        );
        // The second: the cached size elsewhere is not listed; the uncached block elsewhere
        // is, with how far it went; one that paged where it was before is too.
        t.alloc(0, 8 << 20, 0x1000_0000, 0, 2 * MIB);
        t.alloc(1, 1 << 20, 0x1200_0000, 0, 0);
        t.alloc(2, 8 << 20, 0x1100_0000, 0, 0);
        let second = t.end_pass();
        assert_eq!(second.len(), 2);
        assert_eq!((second[0].event, second[0].shift(), second[0].unmapped), (0, Some(0), 2 * MIB));
        assert_eq!((second[1].event, second[1].shift()), (2, Some(0x70_0000)));
        // A pass with more allocations than the one before compares only those it has.
        t.alloc(0, 8 << 20, 0x1000_0000, 0, 0);
        t.alloc(1, 1 << 20, 0x1200_0000, 0, 0);
        t.alloc(2, 8 << 20, 0x1100_0000, 0, 0);
        t.alloc(3, 8 << 20, 0x1300_0000, 0, 0);
        assert!(t.end_pass().is_empty(), "the same layout, and a fourth block new to it");
    }
}
