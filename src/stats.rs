//! Counters and the snapshot [`Pool::stats`](crate::Pool::stats) returns.
//!
//! Counters are plain atomics updated on slow paths and on each alloc and free; a snapshot
//! reads them one by one, so it is exact only when the pool is quiet.

use crate::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of the pool's figures, in bytes unless named otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes in live blocks (sizes rounded up to 256).
    pub allocated_bytes: u64,
    /// Bytes of physical memory mapped (reserved = mapped).
    pub reserved_bytes: u64,
    /// The most `allocated_bytes` has been.
    pub peak_allocated_bytes: u64,
    /// The most `reserved_bytes` has been.
    pub peak_reserved_bytes: u64,
    /// Bytes freed and reusable at once on their own stream (open batches).
    pub cached_bytes: u64,
    /// Bytes freed and waiting for their batch's event.
    pub retiring_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Allocations served.
    pub allocs: u64,
    /// Allocations served by a block freed on the same stream (no event needed).
    pub same_stream_reuses: u64,
    /// Events recorded (one per closed batch, one per stream for `record_stream` blocks).
    pub events_recorded: u64,
    /// Batches whose event was seen complete and whose blocks went back to the arena.
    pub batches_retired: u64,
    /// Times the out-of-memory ladder had to map more pages.
    pub ladder_maps: u64,
    /// Times the out-of-memory ladder waited on an event.
    pub ladder_waits: u64,
    /// Allocations refused with out-of-memory.
    pub ooms: u64,
    /// Bytes unmapped by trims and the release threshold.
    pub unmapped_bytes: u64,
    /// The largest block the arena could hand out now (exact when quiet).
    pub largest_free_block: u64,
    /// Bytes free in the arena over its whole range (mapped or not).
    pub arena_free_bytes: u64,
}

/// The pool's counters.
#[derive(Default)]
pub(crate) struct Counters {
    pub allocated: AtomicU64,
    pub peak_allocated: AtomicU64,
    pub live_blocks: AtomicU64,
    pub allocs: AtomicU64,
    pub same_stream_reuses: AtomicU64,
    pub events_recorded: AtomicU64,
    pub batches_retired: AtomicU64,
    pub ladder_maps: AtomicU64,
    pub ladder_waits: AtomicU64,
    pub ooms: AtomicU64,
    pub unmapped: AtomicU64,
}

impl Counters {
    pub(crate) fn on_alloc(&self, size: u64) {
        let now = self.allocated.fetch_add(size, Ordering::AcqRel) + size;
        self.peak_allocated.fetch_max(now, Ordering::AcqRel);
        self.live_blocks.fetch_add(1, Ordering::AcqRel);
        self.allocs.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn on_free(&self, size: u64) {
        self.allocated.fetch_sub(size, Ordering::AcqRel);
        self.live_blocks.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Acquire)
    }
}
