//! Counters and the snapshot [`Pool::stats`](crate::Pool::stats) returns.
//!
//! Counters are plain atomics updated on slow paths and on each alloc and free; a snapshot
//! reads them one by one, so it is exact only when the pool is quiet.

use crate::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of the pool's figures, in bytes unless named otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Bytes in live blocks (sizes rounded up to 256).
    pub allocated_bytes: u64,
    /// Bytes of physical memory mapped (reserved = mapped).
    pub reserved_bytes: u64,
    /// The most `allocated_bytes` has been.
    pub peak_allocated_bytes: u64,
    /// The most `reserved_bytes` has been.
    pub peak_reserved_bytes: u64,
    /// Bytes free for reuse on their own stream without an event: thread caches, stream
    /// depots and open retire batches together.
    pub cached_bytes: u64,
    /// ... of which in thread caches (T0).
    pub thread_cached_bytes: u64,
    /// ... of which in stream depots (T1).
    pub depot_bytes: u64,
    /// ... of which in open retire batches (T2, before their event is recorded).
    pub open_batch_bytes: u64,
    /// Bytes freed and waiting for their batch's event.
    pub retiring_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Allocations served.
    pub allocs: u64,
    /// Allocations served by the thread's own cache (T0).
    pub t0_hits: u64,
    /// Allocations served by a magazine from the stream's depot (T1).
    pub t1_hits: u64,
    /// Live thread caches.
    pub thread_caches: u64,
    /// Allocations above the largest cached class served by a block freed on the same
    /// stream (no event needed).
    pub same_stream_reuses: u64,
    /// Events recorded (one per closed batch, one per stream for `record_stream` blocks).
    pub events_recorded: u64,
    /// Batches whose event was seen complete and whose blocks went back to the arena.
    pub batches_retired: u64,
    /// Times the out-of-memory ladder flushed the caches and depots into retire.
    pub ladder_flushes: u64,
    /// Times the out-of-memory ladder had to map more pages.
    pub ladder_maps: u64,
    /// Times the out-of-memory ladder took the blocks of other threads' idle caches.
    pub ladder_steals: u64,
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
    /// Bytes on mapped pages that no block holds.
    pub free_mapped_bytes: u64,
    /// The largest free stretch of mapped memory.
    pub largest_free_mapped: u64,
}

impl Stats {
    /// Share of allocations served by the thread caches (T0).
    pub fn t0_hit_rate(&self) -> f64 {
        ratio(self.t0_hits, self.allocs)
    }

    /// Share of allocations served by the stream depots (T1).
    pub fn t1_hit_rate(&self) -> f64 {
        ratio(self.t1_hits, self.allocs)
    }

    /// 1 − largest free stretch of mapped memory ÷ free mapped bytes: 0 when the free mapped
    /// memory is one piece.
    pub fn fragmentation(&self) -> f64 {
        if self.free_mapped_bytes == 0 {
            return 0.0;
        }
        1.0 - ratio(self.largest_free_mapped, self.free_mapped_bytes)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The pool's counters.
#[derive(Default)]
pub(crate) struct Counters {
    pub peak_allocated: AtomicU64,
    pub live_blocks: AtomicU64,
    pub allocs: AtomicU64,
    pub same_stream_reuses: AtomicU64,
    pub events_recorded: AtomicU64,
    pub batches_retired: AtomicU64,
    pub ladder_flushes: AtomicU64,
    pub ladder_maps: AtomicU64,
    pub ladder_waits: AtomicU64,
    pub ladder_steals: AtomicU64,
    pub ooms: AtomicU64,
    pub unmapped: AtomicU64,
}

impl Counters {
    /// An allocation outside the thread caches (bytes are not counted: the pool derives its
    /// live bytes from the tiers). `live_blocks` may wrap below zero here while the caches'
    /// own counters hold the matching allocations: only sums are meaningful.
    pub(crate) fn on_alloc(&self) {
        self.live_blocks.fetch_add(1, Ordering::AcqRel);
        self.allocs.fetch_add(1, Ordering::Relaxed);
    }

    /// A free outside the thread caches.
    pub(crate) fn on_free(&self) {
        self.live_blocks.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Acquire)
    }
}
