//! The queue of blocks used on several streams (`record_stream`), each behind one event per
//! stream it was used on, in two lanes: blocks in the extents (large ones, and small ones
//! placed there at the limit) and blocks in streams' chunks.
//!
//! Why two: rung 6 of the ladder may take such a block before its events complete, with the
//! requesting stream made to wait on them, only if the block's memory goes back where that
//! stream's wait covers every later user. A block of the extents goes back there as the
//! taker's own free, so any stream may take it; one of a chunk goes back to the chunk's
//! stream, so only that stream may. Taking is oldest first and stops at the first
//! batch the taker may not have: in one queue, a small block of another stream at the front
//! held every large block behind it (the demo grew its peak with 127 MiB retiring behind
//! one). In lanes, the large lane never blocks, and each lane stays oldest first.
//!
//! Each lane is a [`Retire`] (lock-free, epoch-reclaimed; see [`crate::reclaim`]); nothing
//! here synchronises the two, since no operation needs them to agree: a batch lives in one
//! lane from its queueing to its release.
//!
//! **What a block waits for** on each stream it was used on is a [`Fence`]: a stamp in that
//! stream's fence log when the pool keeps one for it (its state: made for a stream the first
//! time a block is used there), else an event of its own. A stamp costs no device call at
//! the free: the stream's next event covers it, and a stream keeps at most one event
//! outstanding (`PoolInner::cover`), so a copy stream that many workers hand blocks to
//! records one event per round trip, not two per block (one on each stream, as PyTorch's
//! caching allocator and this queue did): on a GPU those records wait behind other threads'
//! maps (`docs/BENCHMARKS.md`, twenty-sixth session). The price is latency: a stamp made
//! while the stream's event is pending is covered only by the next one, recorded once that
//! event is seen complete.

use std::sync::Arc;

use super::StreamState;
use crate::device::Event;
use crate::reclaim::{Batch, Retire, Span};
use crate::sync::epoch::Guard;

/// What a block used on several streams waits for on one of them.
pub(crate) enum Fence {
    /// Every free on the stream stamped `seq` or less: complete once its log says so.
    Stamp(Arc<StreamState>, u64),
    /// An event recorded for this block alone (a stream the pool keeps no log for).
    Event(Event),
}

/// A block's fences, one per stream it was used on.
pub(crate) type Fences = Vec<Fence>;

/// Which lane a block goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Placed in the extents: back as the taker's free, so any stream may take it.
    Large,
    /// In a stream's buddy chunk: back to that stream's arena.
    Small,
}

/// Blocks used on several streams, waiting for their events, in two lanes.
#[derive(Default)]
pub(crate) struct CrossQueue {
    large: Retire<Fences>,
    small: Retire<Fences>,
}

impl CrossQueue {
    fn lane(&self, lane: Lane) -> &Retire<Fences> {
        match lane {
            Lane::Large => &self.large,
            Lane::Small => &self.small,
        }
    }

    /// Queue `span` behind `fences` in `lane`.
    pub(crate) fn queue(&self, lane: Lane, fences: Fences, span: Span, guard: &Guard) {
        self.lane(lane).queue_batch(Some(fences), vec![span], guard);
    }

    /// Bytes waiting in both lanes.
    pub(crate) fn pending_bytes(&self) -> u64 {
        self.large.pending_bytes() + self.small.pending_bytes()
    }

    /// Whether either lane holds a batch.
    pub(crate) fn has_pending(&self, guard: &Guard) -> bool {
        self.large.has_pending(guard) || self.small.has_pending(guard)
    }

    /// Release, in each lane, every batch oldest first whose fences `complete` says are
    /// done, up to the first that is not. Returns the batches released.
    pub(crate) fn poll(
        &self,
        mut complete: impl FnMut(&Fences) -> bool,
        mut release: impl FnMut(Span),
        guard: &Guard,
    ) -> u64 {
        let (a, _) = self.large.poll(&mut complete, &mut release, guard);
        let (b, _) = self.small.poll(&mut complete, &mut release, guard);
        a + b
    }

    /// Take batches of `lane`, oldest first, while `take` passes the oldest and fewer than
    /// `until` bytes have gone (see [`Retire::take_while`]). Returns (batches, bytes).
    pub(crate) fn take_while(
        &self,
        lane: Lane,
        take: impl FnMut(&Batch<Fences>) -> bool,
        release: impl FnMut(Span),
        until: u64,
        guard: &Guard,
    ) -> (u64, u64) {
        self.lane(lane).take_while(take, release, until, guard)
    }

    /// Run `f` on the oldest batch's fences of each lane that holds one; true if any `f`
    /// returned true.
    pub(crate) fn each_oldest(&self, mut f: impl FnMut(&Fences) -> bool, guard: &Guard) -> bool {
        let a = self.large.with_oldest_event(&mut f, guard).unwrap_or(false);
        let b = self.small.with_oldest_event(&mut f, guard).unwrap_or(false);
        a || b
    }

    /// Batches waiting in both lanes now: each holds the one block `queue` put in it.
    pub(crate) fn batches(&self, guard: &Guard) -> usize {
        let mut n = 0;
        self.for_each_span(|_| n += 1, guard);
        n
    }

    /// Visit every span waiting (for checks and snapshots).
    pub(crate) fn for_each_span(&self, mut f: impl FnMut(Span), guard: &Guard) {
        self.large.for_each_span(&mut f, guard);
        self.small.for_each_span(&mut f, guard);
    }
}
