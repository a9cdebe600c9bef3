//! Tier T3 on its own, for the benches: one stream's arena over the chunks it takes from a
//! space, and the space's extents for large blocks, routed and returned as the pool does
//! (`pool::place`), without a device, a page map or other streams to judge fences against.
//! What a miss of the caches costs in the arena, and nothing else.

use super::{fence_word, Space, StreamArena, CHUNK};
use crate::error::Result;
use crate::sync::atomic::{AtomicU64, Ordering};

/// T3 over one space. See the module docs.
#[derive(Debug)]
pub struct Alone {
    space: Space,
    /// Slots given to stream views so far.
    streams: AtomicU64,
}

/// One stream's view of an [`Alone`]: its own arena of chunks, the space shared.
pub struct AloneStream<'a> {
    space: &'a Space,
    arena: StreamArena,
    slot: u32,
    /// Bumped at each free, as a stream's fence log would be at each event.
    seq: AtomicU64,
}

impl std::fmt::Debug for AloneStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AloneStream").field("slot", &self.slot).field("arena", &self.arena).finish()
    }
}

impl Alone {
    /// T3 over `[base, base + len)` (whole chunks), blocks of `large` bytes and more placed in
    /// the extents.
    pub fn new(base: u64, len: u64, large: u64) -> Result<Alone> {
        Ok(Alone { space: Space::new(base, len, large)?, streams: AtomicU64::new(0) })
    }

    /// The bytes a request of `bytes` occupies.
    pub fn size_for(&self, bytes: u64) -> Option<u64> {
        self.space.size_for(bytes)
    }

    /// A new stream's view: its own arena (each thread of the benches has its own stream).
    pub fn stream(&self) -> Result<AloneStream<'_>> {
        let slot = self.streams.fetch_add(1, Ordering::Relaxed) as u32 + 1;
        let arena = StreamArena::new((self.space.len() / CHUNK) as usize)?;
        Ok(AloneStream { space: &self.space, arena, slot, seq: AtomicU64::new(1) })
    }
}

impl AloneStream<'_> {
    /// A block of `size` bytes (as [`Alone::size_for`] gives), or None when the space is full.
    pub fn alloc(&self, size: u64) -> Option<u64> {
        let accept = &mut |_: u64, _: u64| Ok(());
        if self.space.is_large(size) {
            return self.space.alloc_large(size, accept);
        }
        for _ in 0..3 {
            if let Some(a) = self.arena.alloc(size) {
                return Some(a);
            }
            let chunk = self.space.alloc_chunk(false, accept)?;
            let idx = self.arena.reserve(chunk)?;
            self.space.set_owner(chunk, self.slot, idx);
            self.arena.publish(idx);
        }
        self.arena.alloc(size)
    }

    /// Free a block [`AloneStream::alloc`] gave; wholly free chunks beyond `keep` go back to the
    /// space, as the pool's do.
    pub fn free(&self, addr: u64, size: u64) {
        let fence = fence_word(self.slot, self.seq.load(Ordering::Relaxed));
        if self.space.is_large(size) {
            self.space.free(addr, size, fence);
            return;
        }
        let Some((_, idx)) = self.space.owner(addr) else { return };
        if self.arena.free(addr, size, idx) == Some(true) && self.arena.free_chunks() > crate::pool::KEEP_FREE_CHUNKS {
            if let Some(chunk) = self.arena.take(idx) {
                self.space.clear_owner(chunk);
                self.arena.unreserve(idx);
                self.space.free(chunk, CHUNK, fence);
            }
        }
    }
}
