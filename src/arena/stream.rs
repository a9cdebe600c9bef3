//! One stream's buddy arena: the small blocks of one stream, in 2 MiB chunks the stream owns.
//!
//! # What it owns
//!
//! A chunked buddy [`Arena`] whose top order is a chunk ([`CHUNK`]), over *local* offsets:
//! local chunk `i` covers offsets `[i << CHUNK_ORDER, (i + 1) << CHUNK_ORDER)`. Beside it, the
//! address of each local chunk in the pool's range (`bases`), the local indices given back
//! for reuse (`spare`) and the next never-used index. Chunks come from the pool's extents
//! ([`super::Space`]) and go back there whole.
//!
//! # Why per stream
//!
//! Every byte free in a stream's arena was freed on that stream (or is free for everyone),
//! so the stream reuses it at once, whatever its device is still doing: stream order runs
//! the old use before the new one. Memory moves between streams only as whole chunks,
//! through the extents, behind a fence (see `crate::reclaim::fence`). And the threads of
//! different streams never touch the same bitmap words, so they do not slow each other
//! down. Local indices keep each stream's bitmaps as small and shallow as the chunks it
//! holds, wherever in the range they lie.
//!
//! # Invariants
//!
//! * A local index is, at any moment, unused (spare or never used), *reserved* (its base
//!   written, its chunk not yet in the buddy), or *held* (its chunk in the buddy, free or
//!   holding blocks). Only the thread that reserved or took back an index changes its base.
//! * A chunk leaves the buddy only wholly free ([`Arena::take_top`] claims its top-order
//!   bit), so no block of it is live or cached when it goes.
//!
//! # Why it is lock-free
//!
//! The buddy is the lock-free arena of [`super::buddy`]; indices are reserved with one
//! `fetch_add` or one claim of a bit of [`HBitmap`], and bases are published with a release
//! store before the chunk's top-order bit makes it visible to allocations (which read it
//! after their own acquire claim).

use super::hbitmap::HBitmap;
use super::words::LazyWords;
use super::Arena;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::Error;

/// log2 of a chunk.
pub const CHUNK_ORDER: u32 = 21;
/// The unit in which streams own memory for small blocks: the largest small block, and one
/// page on the devices we know (2 MiB on an H200).
pub const CHUNK: u64 = 1 << CHUNK_ORDER;

/// One stream's small-block arena. See the module docs.
pub struct StreamArena {
    buddy: Arena,
    /// Local index → the chunk's address + 1 (0: no chunk).
    bases: LazyWords,
    /// Local indices given back, free for reuse (lowest first keeps the bitmaps small).
    spare: HBitmap,
    /// Indices from here on were never used.
    next: AtomicUsize,
    cap: usize,
    /// Chunks reserved or held now.
    held: AtomicUsize,
}

impl std::fmt::Debug for StreamArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamArena")
            .field("chunks", &self.held_chunks())
            .field("free_bytes", &self.free_bytes())
            .finish_non_exhaustive()
    }
}

impl StreamArena {
    /// An arena that can hold up to `max_chunks` chunks at once (at least one).
    pub fn new(max_chunks: usize) -> Result<StreamArena, Error> {
        let cap = max_chunks.clamp(1, 1 << 26).next_power_of_two();
        Ok(StreamArena {
            buddy: Arena::chunked(0, (cap as u64) << CHUNK_ORDER, CHUNK_ORDER)?,
            bases: LazyWords::new(cap),
            spare: HBitmap::new(cap),
            next: AtomicUsize::new(0),
            cap,
            held: AtomicUsize::new(0),
        })
    }

    /// The address of local offset `off`, if its chunk is there.
    fn addr_of(&self, off: u64) -> Option<u64> {
        let base = self.bases.get((off >> CHUNK_ORDER) as usize, false)?.load(Ordering::Acquire);
        (base != 0).then(|| base - 1 + (off & (CHUNK - 1)))
    }

    /// A block of `bytes` (rounded up to 256; at most a chunk) from the chunks held: the
    /// lowest free place, with the tail given back (see [`Arena::alloc`]). None when no
    /// chunk held has room.
    pub fn alloc(&self, bytes: u64) -> Option<u64> {
        let off = self.buddy.alloc(bytes)?;
        match self.addr_of(off) {
            Some(a) => Some(a),
            None => {
                // Unreachable while the invariants hold (a chunk in the buddy has its base);
                // give the block back rather than hand out a wrong address.
                self.buddy.free(off, bytes);
                None
            }
        }
    }

    /// Free a block at `addr` of `bytes`, which lies in local chunk `idx`. `Some(true)` when
    /// the chunk is now wholly free (its owner may give it back), `Some(false)` when not,
    /// None when the free was refused (not a block of this arena).
    pub fn free(&self, addr: u64, bytes: u64, idx: usize) -> Option<bool> {
        let base = self.bases.get(idx, false)?.load(Ordering::Acquire).checked_sub(1)?;
        let within = addr.checked_sub(base).filter(|&o| o < CHUNK)?;
        let off = ((idx as u64) << CHUNK_ORDER) | within;
        Some(self.buddy.free_block(off, bytes)?.is_some())
    }

    /// Reserve a local index for the chunk at `addr` (CHUNK-aligned in the pool's range) and
    /// write its base; the chunk serves no allocation until [`StreamArena::publish`]. None
    /// when the arena holds as many chunks as it can.
    pub fn reserve(&self, addr: u64) -> Option<usize> {
        let idx = loop {
            match self.spare.find_first_set() {
                Some(i) if self.spare.try_clear(i) => break i,
                Some(_) => continue,
                None => {}
            }
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            if i < self.cap {
                break i;
            }
            self.next.fetch_sub(1, Ordering::AcqRel);
            // Full, unless an index was given back meanwhile.
            if !self.spare.any_set() {
                return None;
            }
        };
        self.bases.get(idx, true)?.store(addr + 1, Ordering::Release);
        self.held.fetch_add(1, Ordering::AcqRel);
        Some(idx)
    }

    /// Make reserved chunk `idx` serve allocations (wholly free).
    pub fn publish(&self, idx: usize) {
        let added = self.buddy.add_top(idx);
        debug_assert!(added, "a reserved index is never in the buddy");
    }

    /// Give back a reserved index whose chunk was never published.
    pub fn unreserve(&self, idx: usize) {
        if let Some(w) = self.bases.get(idx, false) {
            w.store(0, Ordering::Release);
        }
        self.held.fetch_sub(1, Ordering::AcqRel);
        self.spare.set(idx);
    }

    /// Take chunk `idx` out if it is wholly free now: its address, or None (it holds blocks,
    /// or another thread took it). The caller gives the index back with
    /// [`StreamArena::unreserve`] once the chunk is no longer known by it.
    pub fn take(&self, idx: usize) -> Option<u64> {
        let base = self.bases.get(idx, false)?.load(Ordering::Acquire).checked_sub(1)?;
        self.buddy.take_top(idx).then_some(base)
    }

    /// The lowest wholly free chunk, as a hint for [`StreamArena::take`].
    pub fn first_free_chunk(&self) -> Option<usize> {
        self.buddy.first_free_top()
    }

    /// Wholly free chunks (a snapshot).
    pub fn free_chunks(&self) -> usize {
        self.buddy.free_tops()
    }

    /// Chunks reserved or held (a snapshot).
    pub fn held_chunks(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Bytes free in the chunks held (a snapshot; exact when quiet).
    pub fn free_bytes(&self) -> u64 {
        self.buddy.free_bytes()
    }

    /// Call `f(addr, len)` on every free piece: a walk, exact when quiet.
    pub fn for_each_free(&self, mut f: impl FnMut(u64, u64)) {
        self.buddy.for_each_free(|off, len| {
            if let Some(a) = self.addr_of(off) {
                f(a, len);
            }
        });
    }

    /// Call `f(idx, addr)` on every chunk reserved or held: a walk, exact when quiet.
    pub fn for_each_chunk(&self, mut f: impl FnMut(usize, u64)) {
        let end = self.next.load(Ordering::Acquire).min(self.cap);
        for idx in 0..end {
            if let Some(base) = self.bases.get(idx, false).map(|w| w.load(Ordering::Acquire)).filter(|&b| b != 0) {
                f(idx, base - 1);
            }
        }
    }

    /// True when every free byte lies in wholly free chunks (checked by a walk; exact when
    /// quiet): what a stream's arena must show once every block on it is freed.
    pub fn is_coalesced(&self) -> bool {
        self.buddy.is_coalesced()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const BASE: u64 = 1 << 40;

    fn with_chunks(n: usize) -> (StreamArena, Vec<usize>) {
        let a = StreamArena::new(8).unwrap();
        let idx = (0..n)
            .map(|i| {
                let idx = a.reserve(BASE + i as u64 * 7 * CHUNK).unwrap();
                a.publish(idx);
                idx
            })
            .collect();
        (a, idx)
    }

    #[test]
    fn blocks_come_from_the_chunks_held_lowest_first_at_their_addresses() {
        let (a, idx) = with_chunks(2);
        assert_eq!(idx, vec![0, 1]);
        assert_eq!(a.alloc(256), Some(BASE));
        assert_eq!(a.alloc(CHUNK), Some(BASE + 7 * CHUNK), "a whole chunk: the second one");
        assert_eq!(a.alloc(CHUNK), None, "nothing left that holds a chunk");
        assert_eq!(a.free(BASE + 7 * CHUNK, CHUNK, 1), Some(true), "the second chunk is wholly free again");
        assert_eq!(a.free(BASE, 256, 0), Some(true));
        assert!(a.is_coalesced());
        assert_eq!(a.free_bytes(), 2 * CHUNK);
    }

    #[test]
    fn a_chunk_goes_back_only_wholly_free_and_its_index_is_reused() {
        let (a, _) = with_chunks(1);
        let b = a.alloc(4096).unwrap();
        assert_eq!(a.take(0), None, "a block is live on it");
        assert_eq!(a.free(b, 4096, 0), Some(true));
        assert_eq!(a.first_free_chunk(), Some(0));
        assert_eq!(a.take(0), Some(BASE));
        assert_eq!((a.free_bytes(), a.free_chunks()), (0, 0));
        a.unreserve(0);
        assert_eq!(a.held_chunks(), 0);
        assert_eq!(a.reserve(BASE + CHUNK), Some(0), "the lowest index given back first");
    }

    #[test]
    fn bad_frees_are_refused() {
        let (a, _) = with_chunks(1);
        let b = a.alloc(512).unwrap();
        assert_eq!(a.free(b, 512, 3), None, "an index with no chunk");
        assert_eq!(a.free(b + CHUNK, 512, 0), None, "outside the chunk");
        assert_eq!(a.free(b + 256, 512, 0), None, "misaligned for its size");
        let c = a.alloc(512).unwrap();
        assert_eq!(a.free(b, 512, 0), Some(false), "the chunk still holds a block");
        assert_eq!(a.free(b, 512, 0), None, "a double free of a block not merged away yet");
        assert_eq!(a.free(c, 512, 0), Some(true));
    }

    #[test]
    fn a_full_arena_reserves_no_more() {
        let a = StreamArena::new(2).unwrap();
        assert!(a.reserve(BASE).is_some() && a.reserve(BASE + CHUNK).is_some());
        assert_eq!(a.reserve(BASE + 2 * CHUNK), None);
        a.unreserve(1);
        assert_eq!(a.reserve(BASE + 3 * CHUNK), Some(1));
    }
}
