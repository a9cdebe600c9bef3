//! What a pool knows of each stream: its depots (T1), its arena of small blocks, its fence
//! log, and the registries that find them by stream id and by slot.
//!
//! A stream gets a *slot*, a small number of the pool's own, the first time the pool sees
//! it; fences name streams by slot (see `crate::reclaim::fence`), and slots are never reused
//! within a pool, so a fence never names the wrong stream. The registries are published with
//! arc-swap (readers never wait; a new stream copies the small map once).
//!
//! A destroyed stream gets a final event: frees of its blocks after that are stamped with
//! it. Its state moves to the orphans, where frees still find it, and is dropped once its
//! final event is complete and it holds nothing (no chunk, nothing in a depot, no thread
//! cache).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::PoolInner;
use crate::arena::{StreamArena, CHUNK};
use crate::cache::depot::Depot;
use crate::class;
use crate::device::{Event, Stream, StreamId};
use crate::error::{Error, Result};
use crate::reclaim::fence::FenceLog;
use crate::reclaim::waited::Waited;
use crate::stats::Counters;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::epoch;

/// Why an event is recorded on a stream: for the frees made there (their cadence, a block
/// used on several streams, the stream's end), or for a placement that waits on those
/// frees (the event a device wait or a host wait needs, and a hurry on a stream the placing
/// thread allocates on too: [`PoolInner::hurry`]). The second kind mostly goes on another
/// stream than the placing one, whose owner may be launching work meanwhile, and on a busy
/// GPU such a record waits for those launches (`benches/record_threads.cu`):
/// `Stats::reuse_records` counts them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RecordFor {
    /// The frees made on the stream.
    Frees,
    /// A placement waiting on those frees.
    Reuse,
}

/// A stream gets an event once this many blocks were freed to the arena since its last one
/// ([`PoolInner::note_free`]) ...
const EVENT_EVERY_BLOCKS: u64 = 64;
/// ... or this many bytes: a page's worth, so that pages falling free can be traded soon
/// after (an unmap needs their fences complete).
const EVENT_EVERY_BYTES: u64 = 64 << 20;

/// Above this average cost of recording an event (creating it, from the spares, and the
/// record), event calls are taken to be waiting behind other threads' calls into the driver,
/// and placements stop recording events on other streams to hurry their memory
/// (`judge::Judge::hurry`). A record costs about 0.5 µs on an idle H200 and a few µs under
/// PyTorch's four threads; in the 16-worker demo on an H100, where workers launch kernels
/// and map pages at once, about 400 µs, and the hurries' records took 43 s of the workers'
/// 160 s (`docs/BENCHMARKS.md`, thirty-fourth session).
pub(crate) const EVENTS_CONTENDED_NS: u64 = 50_000;

/// What the pool knows of one stream.
pub(crate) struct StreamState {
    pub(crate) stream: Stream,
    /// The stream's slot (1 and up): how fences name it.
    pub(crate) slot: u32,
    /// T1: one depot per cached size class.
    pub(crate) depots: Box<[Depot]>,
    /// The stream's small blocks, in the chunks it holds.
    pub(crate) arena: StreamArena,
    /// Which of the stream's events are complete, and the fence a free gets now.
    pub(crate) fence: Arc<FenceLog<Event>>,
    /// What the stream has been made to wait for on the device: memory those waits cover
    /// is ready for it.
    pub(crate) waited: Waited,
    /// Set once the stream is destroyed: frees then get its final event's fence.
    pub(crate) destroyed: AtomicBool,
    /// Bytes and blocks freed to the arena since the stream's last event (see
    /// [`PoolInner::note_free`]), packed `blocks << 40 | bytes`.
    since_event: AtomicU64,
}

/// A slot's entry: what resolving a fence of that slot needs, kept for the pool's life (a
/// fence may outlive its stream's state).
#[derive(Clone)]
pub(crate) struct SlotEntry {
    pub(crate) stream: Stream,
    pub(crate) fence: Arc<FenceLog<Event>>,
    pub(crate) state: Weak<StreamState>,
}

/// The registry of streams: by id, and by slot (index `slot - 1`).
#[derive(Default, Clone)]
pub(crate) struct Registry {
    pub(crate) by_id: HashMap<StreamId, Arc<StreamState>>,
    pub(crate) slots: SlotList,
}

/// Entries a chunk of a [`SlotList`]: about the square root of the slots a long-running
/// server gives out, so that a new stream copies about as many pointers as entries.
const SLOT_CHUNK: usize = 64;

/// Every slot's entry, index `slot - 1`, in chunks that a new registry shares with the one
/// it replaces: a new stream copies one pointer a full chunk and the entries of the last,
/// partial one, not every entry. Slots are never reused, and a server that made, used and
/// destroyed a stream per request copied (and dropped) every slot it had ever given out at
/// each new stream: on the simulator, 1.25 ms a stream by the 20,000th.
#[derive(Default, Clone)]
pub(crate) struct SlotList {
    full: Vec<Arc<[SlotEntry]>>,
    tail: Vec<SlotEntry>,
}

impl SlotList {
    /// Slots given out.
    pub(crate) fn len(&self) -> usize {
        self.full.len() * SLOT_CHUNK + self.tail.len()
    }

    /// The entry at index `i` (slot `i + 1`).
    pub(crate) fn get(&self, i: usize) -> Option<&SlotEntry> {
        let (c, at) = (i / SLOT_CHUNK, i % SLOT_CHUNK);
        match self.full.get(c) {
            Some(chunk) => chunk.get(at),
            None if c == self.full.len() => self.tail.get(at),
            None => None,
        }
    }

    /// Add the next slot's entry.
    fn push(&mut self, entry: SlotEntry) {
        self.tail.push(entry);
        if self.tail.len() == SLOT_CHUNK {
            self.full.push(std::mem::take(&mut self.tail).into());
        }
    }
}

impl PoolInner {
    /// The state of `stream`, made (with a new slot) the first time the pool sees it.
    pub(crate) fn stream_state(self: &Arc<Self>, stream: &Stream) -> Result<Arc<StreamState>> {
        let id = stream.id();
        if let Some(st) = self.registry.load().by_id.get(&id) {
            return Ok(Arc::clone(st));
        }
        if stream.is_destroyed() {
            return Err(Error::StreamDestroyed);
        }
        let (mut made, mut failed) = (None, None);
        self.registry.rcu(|reg| {
            (made, failed) = (None, None);
            if reg.by_id.contains_key(&id) {
                return Arc::clone(reg);
            }
            let slot = reg.slots.len() as u32 + 1;
            let st = match self.new_state(stream, slot) {
                Ok(st) => Arc::new(st),
                Err(e) => {
                    failed = Some(e);
                    return Arc::clone(reg);
                }
            };
            let mut next = Registry::clone(reg);
            next.slots.push(SlotEntry {
                stream: stream.clone(),
                fence: Arc::clone(&st.fence),
                state: Arc::downgrade(&st),
            });
            next.by_id.insert(id, Arc::clone(&st));
            made = Some(st);
            Arc::new(next)
        });
        if let Some(e) = failed {
            return Err(e);
        }
        if let Some(st) = made {
            // Only the thread whose state went in registers the hook.
            let weak: Weak<PoolInner> = Arc::downgrade(self);
            stream.on_destroy(Box::new(move |s: &Stream| {
                if let Some(pool) = weak.upgrade() {
                    pool.on_stream_destroyed(id, s);
                }
            }));
            return Ok(st);
        }
        self.registry.load().by_id.get(&id).cloned().ok_or(Error::StreamDestroyed)
    }

    fn new_state(&self, stream: &Stream, slot: u32) -> Result<StreamState> {
        if slot > crate::arena::space::MAX_SLOTS {
            return Err(Error::InvalidArgument(format!(
                "a pool serves at most {} streams",
                crate::arena::space::MAX_SLOTS
            )));
        }
        let max_chunks = self.ceiling.div_ceil(CHUNK) as usize + 1;
        Ok(StreamState {
            stream: stream.clone(),
            slot,
            depots: (0..self.hot.classes)
                .map(|c| {
                    let budget = crate::sync::Arc::clone(&self.cache_budget);
                    Depot::with_budget(self.config.depot_magazines, budget, class::size_of_class(c))
                })
                .collect(),
            arena: StreamArena::new(max_chunks)?,
            fence: Arc::new(FenceLog::new()),
            waited: Waited::default(),
            destroyed: AtomicBool::new(false),
            since_event: AtomicU64::new(0),
        })
    }

    /// The state of a stream the pool has seen, destroyed or not.
    pub(crate) fn state_by_id(&self, id: StreamId) -> Option<Arc<StreamState>> {
        if let Some(st) = self.registry.load().by_id.get(&id) {
            return Some(Arc::clone(st));
        }
        self.orphans.load().iter().find(|st| st.stream.id() == id).cloned()
    }

    /// The state of the stream of `slot`, if it still has one.
    pub(crate) fn state_by_slot(&self, slot: u32) -> Option<Arc<StreamState>> {
        self.registry.load().slots.get(slot.checked_sub(1)? as usize)?.state.upgrade()
    }

    /// Every stream's state, destroyed ones included: every stream whose fences may still be
    /// pending. A slot whose state is gone had its final event complete (`prune_orphans`), so
    /// polls and host waits walk these, not every slot: a server that made a stream per
    /// request had tens of thousands of slots, walked at every climb. A stream between the
    /// registry and the orphans is missed by one such walk only.
    pub(crate) fn states(&self) -> Vec<Arc<StreamState>> {
        let mut v: Vec<_> = self.registry.load().by_id.values().cloned().collect();
        v.extend(self.orphans.load().iter().cloned());
        v
    }

    /// `bytes` freed on `st`'s stream went back to the arena: once enough have since the
    /// stream's last event, record one, so that the fences of memory freed a while ago
    /// complete as the device gets past them (one recorded only when another stream asks
    /// would always cover the newest work, and complete only once the device is idle).
    /// Nothing is recorded where no device call is allowed, nor on a stream being captured:
    /// a later free tries again.
    ///
    /// **At most one event outstanding.** The stream's events seen complete are polled off
    /// its log first, and while one is still pending no new one is recorded: the device is
    /// behind it, so a new event would complete after it in any case, and the next free past
    /// the threshold tries again. A record costs about 0.5 µs on the freeing thread's own
    /// stream, even on a busy GPU, but on a stream another thread is launching on it waits
    /// for those launches, up to milliseconds (see [`RecordFor`]). The poll also keeps the
    /// log short, which every fence judgement walks.
    pub(crate) fn note_free(&self, st: &StreamState, bytes: u64) {
        const BLOCKS: u64 = 1 << 40;
        let before = st.since_event.fetch_add(BLOCKS | bytes.min(BLOCKS - 1), Ordering::AcqRel);
        let (blocks, freed) = ((before >> 40) + 1, (before & (BLOCKS - 1)) + bytes);
        if blocks < EVENT_EVERY_BLOCKS && freed < EVENT_EVERY_BYTES && !st.fence.is_asked() {
            return;
        }
        if st.destroyed.load(Ordering::Acquire) || crate::device::in_host_fn() {
            return;
        }
        if st.since_event.swap(0, Ordering::AcqRel) == 0 {
            // Another thread is recording for the same frees.
            return;
        }
        self.cover(st, &epoch::pin(), RecordFor::Frees);
    }

    /// Make sure an event will cover every free stamped on `st`'s stream so far: record one
    /// now, unless one is outstanding (the next, recorded once it is seen complete, covers
    /// them: a new one would complete after it anyway) or the stream cannot take one now
    /// (destroyed, on a host-function thread, or being captured: not even polled then, as a
    /// query there could end the user's capture). Polls the stream's log first.
    pub(crate) fn cover(&self, st: &StreamState, guard: &epoch::Guard, why: RecordFor) {
        if st.destroyed.load(Ordering::Acquire) || crate::device::in_host_fn() {
            return;
        }
        if self.capturing(&st.stream).unwrap_or(true) {
            return;
        }
        st.fence.poll(|ev| self.event_done(ev), guard);
        if st.fence.has_pending(guard) {
            return;
        }
        // A failed record leaves its number claimed: a later cover tries again.
        let _ = self.record_on(&st.stream, &st.fence, guard, why);
    }

    /// A placement met a fence `seq` of `st`'s stream that is not complete (`Judge::hurry`,
    /// once a judgement and stream): true if it is complete now. A thread that allocates on
    /// that stream itself (it holds a cache for it: it launches its work there) covers the
    /// frees at once (`covered_complete`: a poll, and a record unless one is outstanding),
    /// except while records are slow ([`PoolInner::events_contended`]). Any other thread
    /// only asks: the stream's next free records the event, on the thread that frees there
    /// ([`PoolInner::note_free`]), and the memory is ready once the device gets past it.
    ///
    /// Why not record it here: on a GPU a record on a stream another thread is launching on
    /// waits behind those launches. In the 16-worker demo on an H100 the hurries' records on
    /// other workers' streams took 828 µs each, 22 s of the workers' 192 s, while a record on
    /// the freeing thread's own stream took under 1 µs even with 16 threads launching
    /// (`docs/BENCHMARKS.md`, thirty-seventh session). Nor poll it here: a query of another
    /// stream's event took 2.7 µs there, and judgements meet others' fences several times a
    /// miss; the pollers the pool has (the asked stream's own frees, the ladder) suffice.
    pub(crate) fn hurry(&self, st: &StreamState, seq: u64, guard: &epoch::Guard) -> bool {
        if st.fence.is_complete(seq) {
            return true;
        }
        if !super::local::holds_cache_for(self, st.stream.id()) {
            if st.fence.ask() {
                Counters::bump(&self.counters.records_asked, 1);
            }
            return false;
        }
        if self.events_contended() {
            Counters::bump(&self.counters.hurries_skipped, 1);
            return false;
        }
        self.covered_complete(st, seq, guard, RecordFor::Reuse)
    }

    /// Whether the frees stamped `seq` on `st`'s stream are complete, covering them first
    /// if not (`cover`: the log polled, and an event recorded unless one is outstanding), so
    /// that a stream nobody is waiting on still gets the event its stamps need.
    pub(crate) fn covered_complete(&self, st: &StreamState, seq: u64, guard: &epoch::Guard, why: RecordFor) -> bool {
        st.fence.is_complete(seq) || {
            self.cover(st, guard, why);
            st.fence.is_complete(seq)
        }
    }

    /// The state of `stream` for fencing a block used there (`record_stream`): made the
    /// first time, as for an allocation. `None` while the pool is being dropped, or for a
    /// stream it cannot serve (destroyed, or past the most streams a pool keeps).
    pub(crate) fn state_for_fence(&self, stream: &Stream) -> Option<Arc<StreamState>> {
        self.me.upgrade()?.stream_state(stream).ok()
    }

    /// A new event recorded on `stream` now (its time counted in `Stats::record_ns`, and in
    /// the average [`PoolInner::events_contended`] reads; a record for another stream's
    /// placement also in `Stats::reuse_record_ns`).
    pub(crate) fn event_on(&self, stream: &Stream, why: RecordFor) -> Result<Event> {
        // `Instant`, not the statistics' ticks: a decision reads this (`crate::clock`).
        let start = std::time::Instant::now();
        let record = || {
            let ev = self.device.create_event()?;
            self.device.record_event(&ev, stream)?;
            Ok(ev)
        };
        let c = &self.counters;
        let ev = match why {
            RecordFor::Frees => Counters::timed(&c.record_ns, record),
            RecordFor::Reuse => Counters::timed_all(&[&c.record_ns, &c.reuse_record_ns], record),
        };
        // A moving average over about the last 16 records, each counted as at most four
        // times the threshold: a thread descheduled in the middle of one record (a loaded
        // machine, the simulator on two cores) moves it by a sixteenth of that, and only
        // records slow one after another close the gate. Racing updates may lose a sample,
        // which an average does not need.
        let took = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX).min(4 * EVENTS_CONTENDED_NS);
        let avg = self.event_cost.load(Ordering::Relaxed);
        self.event_cost.store(avg - avg / 16 + took / 16, Ordering::Relaxed);
        ev
    }

    /// Whether recording an event has lately cost more than [`EVENTS_CONTENDED_NS`]: the
    /// driver is busy with other threads' calls, and a record that only hurries memory
    /// along would wait behind them. Records the pool needs (a free's cadence, a device
    /// wait, a block used on several streams) are made all the same, and keep the average
    /// current, so hurries resume once records are cheap again.
    pub(crate) fn events_contended(&self) -> bool {
        self.event_cost.load(Ordering::Relaxed) > EVENTS_CONTENDED_NS
    }

    /// Whether `event` is complete (a failed query reads as not complete; counted in
    /// `Stats::events_queried`, its time in `Stats::query_ns`).
    pub(crate) fn event_done(&self, event: &Event) -> bool {
        Counters::bump(&self.counters.events_queried, 1);
        Counters::timed(&self.counters.query_ns, || self.device.query_event(event).unwrap_or(false))
    }

    /// Whether `stream` is being captured into a graph (its time in `Stats::capture_ns`: the
    /// check before its events are recorded or polled, and a miss's).
    pub(crate) fn capturing(&self, stream: &Stream) -> Result<bool> {
        Counters::timed(&self.counters.capture_ns, || self.device.is_capturing(stream))
    }

    /// Make `stream` wait on the device for `event` (its time in `Stats::wait_ns`).
    pub(crate) fn device_wait(&self, stream: &Stream, event: &Event) -> bool {
        Counters::timed(&self.counters.wait_ns, || self.device.stream_wait_event(stream, event).is_ok())
    }

    /// Record an event on `stream` now, in its `fence` log (it covers every free on it so far).
    pub(crate) fn record_on(
        &self,
        stream: &Stream,
        fence: &FenceLog<Event>,
        guard: &epoch::Guard,
        why: RecordFor,
    ) -> Result<u64> {
        let seq = fence.record(|| self.event_on(stream, why), guard)?;
        Counters::bump(&self.counters.events_recorded, 1);
        if why == RecordFor::Reuse {
            // Beside `events_recorded`, so that it counts the records made, not the tries.
            Counters::bump(&self.counters.reuse_records, 1);
        }
        Ok(seq)
    }

    /// Run `wait` on the event of `stream`'s `fence` log that covers frees stamped `seq`
    /// (with that event's number), recording one first if none does yet. `None` when the
    /// stamp is complete and needs no wait; `Some(false)` when no event could be had (a
    /// stream being captured or destroyed refuses the record) or `wait` failed.
    pub(crate) fn wait_covering(
        &self,
        stream: &Stream,
        fence: &FenceLog<Event>,
        seq: u64,
        mut wait: impl FnMut(u64, &Event) -> bool,
        guard: &epoch::Guard,
    ) -> Option<bool> {
        if let Some(ok) = fence.covering_numbered(seq, &mut wait, guard) {
            return Some(ok);
        }
        if fence.is_complete(seq) {
            return None;
        }
        if self.record_on(stream, fence, guard, RecordFor::Reuse).is_err() {
            return Some(false);
        }
        // A poller may have seen the new event complete (and dropped it) already.
        Some(fence.covering_numbered(seq, &mut wait, guard).unwrap_or_else(|| fence.is_complete(seq)))
    }

    /// The stream is about to be destroyed: its depots' blocks go back to its arena, its
    /// final event is recorded, and its state moves out of the registry; its live blocks,
    /// freed later, are fenced by that final event.
    pub(crate) fn on_stream_destroyed(&self, id: StreamId, stream: &Stream) {
        let Some(st) = self.registry.load().by_id.get(&id).cloned() else { return };
        let guard = epoch::pin();
        self.flush_stream_depots(&st, u64::MAX, self.all_classes(), &guard);
        let finished = st.fence.finish(|| self.event_on(stream, RecordFor::Frees), &guard);
        if finished.is_ok() {
            Counters::bump(&self.counters.events_recorded, 1);
        }
        st.destroyed.store(true, Ordering::Release);
        self.registry.rcu(|reg| {
            let mut next = Registry::clone(reg);
            next.by_id.remove(&id);
            next
        });
        self.orphans.rcu(|v| {
            let mut v = Vec::clone(v);
            v.push(Arc::clone(&st));
            v
        });
    }

    /// Drop the orphans that hold nothing any more and whose final event is complete.
    pub(crate) fn prune_orphans(&self) {
        // Each thread cache holds a reference: the list and the caller's snapshot hold the
        // other two.
        let done = |st: &Arc<StreamState>| {
            st.fence.is_finished()
                && st.fence.is_complete(st.fence.stamp())
                && st.arena.held_chunks() == 0
                && st.depots.iter().all(|d| d.full_count() == 0)
                && Arc::strong_count(st) <= 2
        };
        if self.orphans.load().iter().any(done) {
            self.orphans.rcu(|v| v.iter().filter(|st| !done(st)).cloned().collect::<Vec<_>>());
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::device::SimCosts;
    use crate::{Pool, PoolConfig, SimDevice};

    /// A pool whose device records an event in `record` (the simulator spends it in the
    /// call), after `n` records on one stream.
    fn after_records(record: std::time::Duration, n: usize) -> Pool {
        let dev = SimDevice::builder(1 << 30).costs(SimCosts { event_record: record, ..SimCosts::NONE }).build();
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let stream = dev.new_stream().unwrap();
        for _ in 0..n {
            pool.inner.event_on(&stream, RecordFor::Frees).unwrap();
        }
        pool
    }

    #[test]
    fn slow_records_one_after_another_stop_the_hurries_and_cheap_ones_do_not() {
        assert!(!after_records(std::time::Duration::from_micros(300), 0).inner.events_contended());
        assert!(after_records(std::time::Duration::from_micros(300), 32).inner.events_contended());
        assert!(!after_records(std::time::Duration::ZERO, 32).inner.events_contended());
    }

    #[test]
    fn a_slot_list_finds_every_entry_across_its_chunks() {
        let dev = crate::SimDevice::new(1 << 30);
        let stream = dev.new_stream().unwrap();
        let fences: Vec<_> = (0..3 * SLOT_CHUNK + 5).map(|_| Arc::new(FenceLog::new())).collect();
        let mut list = SlotList::default();
        for f in &fences {
            list.push(SlotEntry { stream: stream.clone(), fence: Arc::clone(f), state: Weak::new() });
        }
        let older = list.clone();
        list.push(SlotEntry { stream: stream.clone(), fence: Arc::new(FenceLog::new()), state: Weak::new() });
        assert_eq!((older.len(), list.len()), (fences.len(), fences.len() + 1));
        for (i, f) in fences.iter().enumerate() {
            assert!(Arc::ptr_eq(&list.get(i).unwrap().fence, f), "entry {i}");
            assert!(Arc::ptr_eq(&older.get(i).unwrap().fence, f), "entry {i} of the older list");
        }
        assert!(older.get(fences.len()).is_none() && list.get(fences.len() + 1).is_none());
    }
}
