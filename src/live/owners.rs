//! Owner records: one per thread that allocates through the C ABI, holding the thread's
//! announcement of the slot whose free it is inside (see the table's docs).
//!
//! A record is taken by a thread on its first allocation and given back when the thread
//! exits; a later thread may take it again and then owns every block published under its
//! index, which is sound because only one thread at a time holds an index and the hand-over
//! (a release store, then the next taker's acquiring compare-and-swap) orders the old
//! holder's last free before the new holder's first. Records are padded to a cache line so
//! that announcing touches no other thread's line.

use crossbeam_utils::CachePadded;

use super::MAX_OWNERS;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One thread's record.
#[derive(Default)]
pub struct Owner {
    /// The slot index + 1 of the owner's free window, 0 outside one.
    ann: AtomicU64,
    taken: AtomicBool,
}

impl Owner {
    /// Open the free window on slot `idx`.
    #[inline(always)]
    pub(super) fn announce(&self, idx: usize) {
        // Release, as every store to the announcement: a claimer that reads one sees the
        // owner's earlier stores to the tags (the end of its previous window).
        self.ann.store(idx as u64 + 1, Ordering::Release);
    }

    /// Close the free window.
    #[inline(always)]
    pub(super) fn clear(&self) {
        self.ann.store(0, Ordering::Release);
    }

    /// The slot whose free window the owner is in, as this thread sees it now.
    pub(super) fn announced(&self) -> Option<usize> {
        match self.ann.load(Ordering::Acquire) {
            0 => None,
            v => Some((v - 1) as usize),
        }
    }
}

/// Every owner record, and how owners and claimers fence.
pub struct Owners {
    recs: Box<[CachePadded<Owner>]>,
    asymmetric: bool,
}

impl Owners {
    /// `n` records (index 0 is never handed out: it means "no owner"), at most
    /// [`MAX_OWNERS`]. `asymmetric`: claimers settle with `membarrier` and owners fence with
    /// a compiler fence only; false: both sides use a full fence.
    pub fn new(n: usize, asymmetric: bool) -> Owners {
        let n = n.clamp(1, MAX_OWNERS);
        Owners { recs: (0..n).map(|_| CachePadded::new(Owner::default())).collect(), asymmetric }
    }

    /// Whether claimers fence with `membarrier` (owners with a compiler fence only).
    #[inline(always)]
    pub fn asymmetric(&self) -> bool {
        self.asymmetric
    }

    /// Record `id` (0 < `id` < the count).
    #[inline(always)]
    pub fn get(&self, id: usize) -> &Owner {
        &self.recs[id]
    }

    /// Take a free record for the calling thread; `None` if all are taken (the thread's
    /// blocks then have no owner, and each of their frees is a claim).
    pub fn acquire(&self) -> Option<usize> {
        (1..self.recs.len()).find(|&id| {
            let rec = &self.recs[id];
            // Acquire: the previous holder's last window happens before this thread's first.
            !rec.taken.load(Ordering::Relaxed)
                && rec.taken.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
        })
    }

    /// Give record `id` back: the calling thread held it and will free no block as its owner
    /// again.
    pub fn release(&self, id: usize) {
        let rec = &self.recs[id];
        debug_assert!(rec.announced().is_none(), "released inside a free window");
        rec.taken.store(false, Ordering::Release);
    }
}
