//! The classic baseline the benches measure the pool against: a best-fit, coalescing
//! allocator over one address range behind one lock, the design of the PyTorch caching
//! allocator's and RMM's pool resources.
//!
//! It owns only address arithmetic (no device memory), so benches can compare the pool's
//! bookkeeping cost and fragmentation with the textbook design's on the same traces. It is
//! included by path from bench files, so it imports nothing from the crate.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Every extent's start and length are multiples of this, as the device's are.
const ALIGN: u64 = 256;

/// A best-fit coalescing allocator over `[base, base + len)`.
pub struct BestFit {
    start: u64,
    end: u64,
    free: Mutex<Extents>,
}

/// The free extents, indexed twice: by size to find the best fit, by address to find a
/// freed block's neighbours. Both always hold the same extents.
#[derive(Default)]
struct Extents {
    by_size: BTreeSet<(u64, u64)>,
    by_addr: BTreeMap<u64, u64>,
}

impl Extents {
    fn insert(&mut self, addr: u64, size: u64) {
        self.by_size.insert((size, addr));
        self.by_addr.insert(addr, size);
    }

    fn remove(&mut self, addr: u64, size: u64) {
        self.by_size.remove(&(size, addr));
        self.by_addr.remove(&addr);
    }
}

fn round_up(bytes: u64) -> Option<u64> {
    bytes.checked_next_multiple_of(ALIGN)
}

impl BestFit {
    /// A pool over `[base, base + len)`, shrunk inward to [`ALIGN`] boundaries; empty if
    /// nothing aligned fits or the range would wrap.
    pub fn new(base: u64, len: u64) -> Self {
        let range = base
            .checked_add(len)
            .and_then(|end| Some((round_up(base)?, end - end % ALIGN)))
            .filter(|&(start, end)| start < end);
        let (start, end) = range.unwrap_or((0, 0));
        let mut free = Extents::default();
        if start < end {
            free.insert(start, end - start);
        }
        BestFit { start, end, free: Mutex::new(free) }
    }

    /// A benchmark thread that panicked mid-operation leaves the maps consistent (every
    /// update is insert/remove pairs on infallible maps), so poisoning is not a reason to
    /// stop measuring.
    fn lock(&self) -> MutexGuard<'_, Extents> {
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The address of `bytes` (rounded up to [`ALIGN`]) carved from the smallest free extent
    /// that holds them, or None if none does (or `bytes` is 0).
    pub fn alloc(&self, bytes: u64) -> Option<u64> {
        let size = round_up(bytes).filter(|&s| s > 0)?;
        let mut free = self.lock();
        let (ext_size, addr) = free.by_size.range((size, 0)..).next().copied()?;
        free.remove(addr, ext_size);
        // The block takes the extent's low end, as PyTorch's and RMM's pools split, so the
        // baseline fragments the way the allocators it stands for do.
        if ext_size > size {
            free.insert(addr + size, ext_size - size);
        }
        Some(addr)
    }

    /// Return a block from [`alloc`](Self::alloc) (with the same `bytes`), merging it with free
    /// neighbours on either side. A free that lies outside the range or overlaps free space
    /// (a double free) is ignored: the benches' traces are trusted, and corrupting the maps
    /// would skew every later measurement.
    pub fn free(&self, addr: u64, bytes: u64) {
        let Some(size) = round_up(bytes).filter(|&s| s > 0) else { return };
        let Some(end) = addr.checked_add(size).filter(|&e| addr >= self.start && e <= self.end) else { return };
        let mut free = self.lock();
        let before = free.by_addr.range(..=addr).next_back().map(|(&a, &s)| (a, s));
        let after = free.by_addr.range(addr..).next().map(|(&a, &s)| (a, s));
        if before.is_some_and(|(a, s)| a + s > addr) || after.is_some_and(|(a, _)| a < end) {
            return;
        }
        let (mut start, mut stop) = (addr, end);
        if let Some((a, s)) = before.filter(|&(a, s)| a + s == addr) {
            free.remove(a, s);
            start = a;
        }
        if let Some((a, s)) = after.filter(|&(a, _)| a == end) {
            free.remove(a, s);
            stop = a + s;
        }
        free.insert(start, stop - start);
    }

    /// Free bytes in all extents.
    pub fn free_bytes(&self) -> u64 {
        self.lock().by_addr.values().sum()
    }

    /// The number of free extents: 1 when everything is free and fully coalesced.
    pub fn free_extents(&self) -> usize {
        self.lock().by_addr.len()
    }

    /// The largest block an allocation could get now.
    pub fn largest_free(&self) -> u64 {
        self.lock().by_size.last().map_or(0, |&(s, _)| s)
    }
}
