//! How memory the pool holds but no block uses goes back towards the arena: caches and depots
//! flushed, idle threads' caches taken, wholly free chunks returned to the space, fences
//! settled by polling events (and, as a last resort, by the host waiting on them), blocks of
//! several streams released once their events complete, and free pages unmapped. The
//! out-of-memory ladder ([`super::ladder`]) and `trim()` are made of these steps.

use super::cross::{Fence, Fences, Lane};
use super::local;
use super::place::KEEP_FREE_CHUNKS;
use super::streams::RecordFor;
use super::{PoolInner, StreamState};
use crate::class;
use crate::device::Stream;
use crate::reclaim::Span;
use crate::stats::Counters;
use crate::sync::epoch;

/// Rounds in which [`PoolInner::trim`] looks again at caches it could not take from (100 µs
/// apart).
const TRIM_STEAL_ROUNDS: usize = 50;

impl PoolInner {
    /// Blocks taken out of a cache of `st`'s stream, as (class, address), back to the arena.
    pub(crate) fn free_cached(&self, st: &StreamState, blocks: Vec<(usize, u64)>) {
        for (class, addr) in blocks {
            self.release(st, Span { addr, size: class::size_of_class(class) });
        }
    }

    /// One stream's depots of the `classes` give their blocks back to the arena, largest
    /// classes first, until at least `target` bytes have moved. Returns the bytes moved.
    pub(crate) fn flush_stream_depots(
        &self,
        st: &StreamState,
        target: u64,
        classes: std::ops::Range<usize>,
        guard: &epoch::Guard,
    ) -> u64 {
        let mut moved = 0;
        for class in classes.rev() {
            let Some(d) = st.depots.get(class) else { continue };
            let size = class::size_of_class(class);
            while moved < target && d.full_count() > 0 {
                let Some(mut m) = d.take_full(guard) else { break };
                moved += m.len() as u64 * size;
                m.drain(|addr| self.release(st, Span { addr, size }));
                d.put_empty(m, guard);
            }
            if moved >= target {
                break;
            }
        }
        moved
    }

    /// Every stream's depots of the `classes` give their blocks back, until at least `target`
    /// bytes have moved (`u64::MAX`: all). Returns the bytes moved.
    pub(crate) fn flush_depots(&self, target: u64, classes: std::ops::Range<usize>) -> u64 {
        let guard = epoch::pin();
        let mut moved = 0;
        for st in self.states() {
            if moved >= target {
                break;
            }
            moved += self.flush_stream_depots(&st, target - moved, classes.clone(), &guard);
        }
        moved
    }

    /// Take the blocks of every thread cache whose owner is not inside an operation (the
    /// calling thread's own included: it is not inside one); with `only_idle`, only of
    /// those whose owner made no operation since the last such look ([`CacheShared::idle`]).
    /// Returns the blocks taken and the caches looked at that could not be taken from (their
    /// owner, or another thief, was inside).
    ///
    /// [`CacheShared::idle`]: crate::cache::thread::CacheShared::idle
    pub(crate) fn steal_idle_caches(&self, only_idle: bool) -> (u64, usize) {
        let guard = epoch::pin();
        let (mut taken, mut missed) = (0, 0);
        for (shared, st) in self.caches.load().iter() {
            // A cache in use keeps its blocks (its thread would only miss and take them
            // back), and is spared the thief's barrier, which interrupts every core.
            if only_idle && !shared.idle() {
                continue;
            }
            let mut out = Vec::new();
            let take = |c: &crate::cache::thread::CacheShared| {
                // SAFETY: the take holds the handshake while this runs.
                unsafe { c.drain(&st.depots, false, |cl, a| out.push((cl, a)), &guard) };
                self.release_budget(c);
            };
            // SAFETY: every registered cache is entered only by the thread that made it
            // (`ThreadCache::new` registers it on its own thread; the cache never leaves).
            let took = unsafe { shared.take_own_or_steal(take) };
            missed += usize::from(!took);
            taken += out.len() as u64;
            self.free_cached(st, out);
        }
        (taken, missed)
    }

    /// Before a block larger than every cached class is placed (it is placed in the space,
    /// first fit): the large blocks this thread's cache holds for `st`, those in `st`'s
    /// depots, and `st`'s wholly free chunks go back, so that the free runs they cut are
    /// whole again where the block looks. Returns whether anything went.
    ///
    /// Why: a cached block keeps its granules and pages while it waits for a request of its
    /// class, so the space a large block then sees depends on what the caches happen to
    /// hold, and placements that move from pass to pass take memory from each other's pages.
    /// Replayed six times in one pool on the simulator, train_gpt2 lent 112–161 pages in
    /// each pass from the third; with this step, 3 in the third and none after (peak
    /// reserved ÷ peak live 1.006 instead of 1.028), and bert_dynamic's maps and unmaps a
    /// pass fell from 1.2–2.9 times its peak to 0.1–0.3 (`docs/BENCHMARKS.md`, thirtieth
    /// session). Only for uncached requests: a request of a cached class that misses is
    /// the caches' steady state (the random window misses every ~160 pairs), and giving
    /// their large blocks back there made the window miss on 15% of its pairs.
    pub(crate) fn clear_for_uncached(&self, size: u64, st: &StreamState, own: Option<&local::ThreadCache>) -> bool {
        if !self.above_classes(size) || !self.space.is_large(size) {
            return false;
        }
        let all = self.all_classes();
        // The classes the space places as large blocks: from the class that holds its
        // threshold (the smallest class at least that large) up.
        let first = class::class_of(self.space.large_threshold()).map_or(all.end, |c| c.min(all.end));
        let mut moved = own.map_or(0, |tc| tc.flush_some(u64::MAX, first..all.end));
        moved += self.flush_stream_depots(st, u64::MAX, first..all.end, &epoch::pin());
        let chunks = self.return_free_chunks(st, 0);
        moved > 0 || chunks > 0
    }

    /// Every stream's wholly free chunks back to the space (each stream keeps `keep`);
    /// returns how many went.
    pub(crate) fn return_all_free_chunks(&self, keep: usize) -> usize {
        self.states().iter().map(|st| self.return_free_chunks(st, keep)).sum()
    }

    /// Rounds in which `st`'s cached blocks go back to its arena — this thread's cache for
    /// it first, then the stream's depots; largest classes first (the ones caches hit
    /// least); twice the request, then four, eight times, then all of them — each followed
    /// by `attempt`. Before a large request's attempt the stream's wholly free chunks go back
    /// to the space too (a large block is placed there). Stops at the first address
    /// `attempt` gives, or when nothing is left to give back.
    pub(crate) fn flush_rounds(
        &self,
        size: u64,
        st: &StreamState,
        own: Option<&local::ThreadCache>,
        mut attempt: impl FnMut(&Self) -> crate::Result<Option<u64>>,
    ) -> crate::Result<Option<u64>> {
        let large = self.space.is_large(size);
        let all = self.all_classes();
        let mut target = size.saturating_mul(2).max(self.config.magazine_bytes);
        for round in 0..4 {
            if round == 3 {
                target = u64::MAX;
            }
            let mut moved = own.map_or(0, |tc| tc.flush_some(target, all.clone()));
            if moved < target {
                moved += self.flush_stream_depots(st, target - moved, all.clone(), &epoch::pin());
            }
            let chunks = if large { self.return_free_chunks(st, 0) } else { 0 };
            if moved == 0 && chunks == 0 && round > 0 {
                break;
            }
            if let Some(a) = attempt(self)? {
                return Ok(Some(a));
            }
            if moved == 0 {
                break;
            }
            target = target.saturating_mul(2);
        }
        Ok(None)
    }

    /// What other streams hold and do not use goes back towards the arena, where this
    /// stream may take it once its fence allows: every depot's blocks, every idle thread
    /// cache's blocks, and every wholly free chunk beyond what each stream keeps. With
    /// `all`, every cache not inside an operation and every free chunk. Returns whether
    /// anything moved.
    pub(crate) fn reclaim_held(&self, all: bool) -> bool {
        // Short of the last rung, working threads keep their caches: taking them makes every
        // thread miss in turn, each miss taking the others' (measured on an H200: 16 threads
        // ran at a hundredth of their throughput).
        let (stolen, _) = self.steal_idle_caches(!all);
        if stolen > 0 {
            Counters::bump(&self.counters.ladder_steals, 1);
        }
        let flushed = self.flush_depots(u64::MAX, self.all_classes());
        let chunks = self.return_all_free_chunks(if all { 0 } else { KEEP_FREE_CHUNKS });
        stolen > 0 || flushed > 0 || chunks > 0
    }

    /// Poll what the device may have finished: every stream's events (so more fences are
    /// complete) and the queue of blocks used on several streams (released once all their
    /// events are complete). Returns whether anything became free for other streams.
    pub(crate) fn settle(&self) -> bool {
        self.drain_deferred();
        let guard = epoch::pin();
        let mut settled = false;
        // The streams with states, not every slot (see `states`).
        for st in self.states() {
            if !st.fence.has_pending(&guard) {
                continue;
            }
            // No event on a stream being captured is polled: while it is, its events are
            // graph nodes.
            if !st.stream.is_destroyed() && self.capturing(&st.stream).unwrap_or(true) {
                continue;
            }
            settled |= st.fence.poll(|ev| self.event_done(ev), &guard);
        }
        let broken = self.config.break_event_guard_for_tests;
        let b = self.cross.poll(
            |fences| broken || fences.iter().all(|f| self.fence_done(f, &guard)),
            |s| self.release_clean(s),
            &guard,
        );
        Counters::bump(&self.counters.batches_retired, b);
        tracing::trace!(batches = b, settled, "settle");
        drop(guard);
        self.prune_orphans();
        if (settled || b > 0) && self.config.release_threshold != u64::MAX {
            self.unmap_free(self.config.release_threshold);
        }
        settled || b > 0
    }

    /// Rung 6, for blocks used on several streams: the oldest such blocks go to `st` before
    /// their events are seen complete, with `st`'s stream made to wait on each of their
    /// events on the device; their memory goes back as if `st` had freed it (its fence), so
    /// `st` reuses it at once and other streams only after `st`'s next event, which follows
    /// the waits. Only blocks that lie in the extents (large ones, and small ones placed there
    /// at the limit) or in a chunk `st` holds: a small block goes back to its chunk's stream,
    /// which did not wait. Takes batches, large ones first, until `target` bytes have gone or
    /// the oldest of each lane cannot go (`super::cross`); returns whether any went.
    pub(crate) fn take_retiring(&self, st: &StreamState, target: u64) -> bool {
        if self.cross.pending_bytes() == 0 || self.capturing(&st.stream).unwrap_or(true) {
            return false;
        }
        let broken = self.config.break_event_guard_for_tests;
        let mut waits = 0;
        let guard = epoch::pin();
        let mut take = |batch: &crate::reclaim::Batch<Fences>| {
            let mut mine = true;
            batch.for_each_span(|s| {
                mine &= self.space.is_large(s.size) || self.space.owner(s.addr).is_none_or(|(slot, _)| slot == st.slot)
            });
            // The broken guard (a test switch) lets the memory cross unguarded.
            mine && (broken
                || batch.event().is_none_or(|fences| {
                    fences.iter().all(|f| {
                        self.fence_done(f, &guard) || {
                            let ok = self.wait_on_fence(&st.stream, f, &guard);
                            waits += u64::from(ok);
                            ok
                        }
                    })
                }))
        };
        let (mut batches, mut bytes) = (0, 0);
        for lane in [Lane::Large, Lane::Small] {
            let (b, n) = self.cross.take_while(
                lane,
                &mut take,
                |span| self.release(st, span),
                target.saturating_sub(bytes),
                &guard,
            );
            batches += b;
            bytes += n;
        }
        drop(guard);
        Counters::bump(&self.counters.device_waits, waits);
        Counters::bump(&self.counters.batches_retired, batches);
        if batches > 0 {
            tracing::debug!(
                stream = st.stream.id(),
                batches,
                bytes,
                waits,
                "retiring blocks taken behind device waits"
            );
        }
        batches > 0
    }

    /// The host waits, once per stream, for the work enqueued so far on each stream that
    /// `wanted` names (recording an event there first if it has none), and for the oldest
    /// batch of blocks used on several streams; then polls. The last resort before running
    /// out of memory, and what `trim()` does before it unmaps. Returns whether it waited on
    /// anything.
    pub(crate) fn host_wait(&self, mut wanted: impl FnMut(&Stream) -> bool) -> bool {
        let _span = tracing::debug_span!("host wait").entered();
        let guard = epoch::pin();
        let dev = &self.device;
        let mut waited = false;
        // The streams with states, not every slot (see `states`).
        for st in self.states() {
            let (stream, fence) = (&st.stream, &*st.fence);
            if !wanted(stream) || fence.is_complete(fence.stamp()) {
                continue;
            }
            let live = !stream.is_destroyed();
            if live
                && (self.capturing(stream).unwrap_or(true)
                    || self.record_on(stream, fence, &guard, RecordFor::Reuse).is_err())
            {
                continue;
            }
            // The newest event covers every free stamped so far.
            let newest = fence.claimed();
            let ok = fence.covering(newest, |ev| dev.synchronize_event(ev).is_ok(), &guard);
            if ok == Some(true) {
                Counters::bump(&self.counters.ladder_waits, 1);
                waited = true;
            }
        }
        waited |= self.cross.each_oldest(
            |fences| {
                fences.iter().all(|f| match f {
                    Fence::Event(ev) => dev.synchronize_event(ev).is_ok(),
                    Fence::Stamp(fst, seq) => self
                        .wait_covering(&fst.stream, &fst.fence, *seq, |_, ev| dev.synchronize_event(ev).is_ok(), &guard)
                        .unwrap_or(true),
                })
            },
            &guard,
        );
        drop(guard);
        self.settle();
        waited
    }

    /// Give back what the pool holds and does not use (see [`crate::Pool::trim`]).
    pub(crate) fn trim(&self) -> crate::Result<()> {
        local::flush(self);
        // A cache whose owner is inside an operation cannot be taken from. Its owner leaves
        // within that operation: a hit, or at most the flush into the depots its thread runs
        // as it exits, which may still be under way when a caller that joined the thread
        // trims (a thread's join can return before its thread-local destructors have run:
        // Python's does, and CI once saw `vrampool_empty_cache` leave 10 MiB cached so). So
        // trim looks again, for a few milliseconds at most, before the depots are flushed.
        for _ in 0..TRIM_STEAL_ROUNDS {
            if self.steal_idle_caches(false).1 == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        self.flush_depots(u64::MAX, self.all_classes());
        // Twice: blocks used on several streams, released by the first round's waits, may
        // leave chunks wholly free, whose return stamps fences the second round waits for.
        for _ in 0..2 {
            self.drain_deferred();
            self.return_all_free_chunks(0);
            // Pages go only once no stream's work can touch them: wait for every stream's
            // work up to now, and every batch of blocks used on several streams.
            self.host_wait(|_| true);
            // The batches queued before now, oldest first, each wait releasing at least one:
            // as many waits as there were batches, so that a trim among threads that keep
            // queueing (`record_stream` blocks of busy workers) does not chase their batches
            // for as long as they run.
            let guard = epoch::pin();
            for _ in 0..self.cross.batches(&guard) {
                if !self.cross.has_pending(&guard) || !self.host_wait(|_| false) {
                    break;
                }
            }
        }
        self.settle();
        self.unmap_lent(0);
        self.unmap_free(0);
        Ok(())
    }

    pub(crate) fn free_cross(&self, span: Span, st: &StreamState, mut used_on: Vec<Stream>) {
        used_on.push(st.stream.clone());
        if let Err((span, used_on)) = self.retire_cross(span, used_on) {
            self.deferred_cross.push((span, used_on));
        }
    }

    /// Queue a block used on several streams behind a fence on each live stream (module
    /// `cross`): a stamp in the stream's log, covered by its next event, or where the pool
    /// can keep no log for the stream, an event of its own.
    #[allow(clippy::result_large_err)]
    fn retire_cross(&self, span: Span, used_on: Vec<Stream>) -> std::result::Result<(), (Span, Vec<Stream>)> {
        if crate::device::in_host_fn() {
            return Err((span, used_on));
        }
        let guard = epoch::pin();
        let mut fences = Vec::with_capacity(used_on.len());
        for s in &used_on {
            if s.is_destroyed() {
                // Its final event was recorded at destroy time and covers the block; waiting
                // for the other streams' events is enough here because a destroyed stream
                // runs nothing new.
                continue;
            }
            if let Some(st) = self.state_for_fence(s) {
                // After the block's last use there was enqueued (the caller's free).
                let seq = st.fence.stamp();
                self.cover(&st, &guard, RecordFor::Frees);
                fences.push(Fence::Stamp(st, seq));
                continue;
            }
            let Ok(ev) = self.event_on(s, RecordFor::Frees) else { return Err((span, used_on)) };
            Counters::bump(&self.counters.events_recorded, 1);
            fences.push(Fence::Event(ev));
        }
        let lane = if self.in_extents(span) { Lane::Large } else { Lane::Small };
        self.cross.queue(lane, fences, span, &guard);
        Ok(())
    }

    /// Whether a block's fence on one stream is complete. A stamp not complete yet is covered
    /// (`covered_complete`), so that a stream nobody frees on, a copy stream, still gets the
    /// event its stamps wait for.
    fn fence_done(&self, f: &Fence, guard: &epoch::Guard) -> bool {
        match f {
            Fence::Event(ev) => self.event_done(ev),
            Fence::Stamp(st, seq) => self.covered_complete(st, *seq, guard, RecordFor::Frees),
        }
    }

    /// Make `stream` wait on the device for a block's fence on another stream: its event, or
    /// for a stamp the event that covers it (`wait_covering`: recorded now if none does; a
    /// stamp already complete needs none). False if no wait could be set up.
    fn wait_on_fence(&self, stream: &Stream, f: &Fence, guard: &epoch::Guard) -> bool {
        match f {
            Fence::Event(ev) => self.device_wait(stream, ev),
            Fence::Stamp(st, seq) => self
                .wait_covering(&st.stream, &st.fence, *seq, |_, ev| self.device_wait(stream, ev), guard)
                .unwrap_or(true),
        }
    }

    /// `record_stream` blocks dropped where no device call was allowed get their events now.
    pub(crate) fn drain_deferred(&self) {
        for (span, used_on) in self.deferred_cross.take_all() {
            if let Err(back) = self.retire_cross(span, used_on) {
                self.deferred_cross.push(back);
            }
        }
    }
}
