//! The out-of-memory ladder: what a miss does, in order, until the request fits.
//!
//! Each rung frees or finds memory and tries the arena again; the first that places the
//! request wins. Before the pool maps past its peak, memory it already holds serves the
//! request; the host waits only as the last step before out-of-memory:
//!
//! 0. **Room for a block no cache holds**: before a block larger than every cached class
//!    is placed, this thread's cached large blocks for the stream, the stream's depots of
//!    them and its wholly free chunks go back to the space, where they cut the runs such a
//!    block looks for (module `giveback`).
//! 1. **Ready memory on mapped pages**: the stream's own free memory (stream order makes it
//!    safe at once), memory free for everyone, memory other streams freed whose fence's
//!    event is complete, and memory an earlier device wait of this stream already covers
//!    (stream order again: `crate::reclaim::waited`). A large block's first-fit run may
//!    still hold a few pages that need a driver call (module `place`, `FEW_DEAD_SHARE`):
//!    they are mapped afresh rather than the block moved far up. A stream whose incomplete
//!    fence the placement meets gets an event recorded if none is outstanding, so that the
//!    memory it freed is ready soon, unless the pool's records have lately been slow
//!    (module `judge`, `Judge::hurry`).
//! 2. **Settle**: poll every stream's events and the queue of blocks used on several
//!    streams; try again.
//! 3. **This stream's caches**: this thread's cache for the stream and the stream's depots
//!    give blocks back to its arena, in rounds (twice the request, four, eight times, then
//!    everything), largest classes first; a large request also gets the stream's wholly
//!    free chunks back in the space. Each round tries again.
//! 4. **Map below the peak**: growth that holds no more memory than the pool held before.
//! 5. **Other streams' idle memory**: every depot, every idle thread cache (taken through
//!    the handshake, without its owner's help) and every wholly free chunk go back; settle,
//!    and try again with what is ready.
//! 6. **Device waits**: memory other streams freed whose events are not complete yet, with
//!    this stream made to wait on those events on the device (`stream_wait_event`, as
//!    `cuMemAllocAsync` does); then the oldest blocks used on several streams
//!    (`record_stream`), taken before their events complete behind waits on all of them:
//!    large ones from any stream, small ones of this stream's chunks (module `cross`).
//!    Only here, where the alternative is to grow: a wait orders two streams, which servers
//!    want to run independently. `PoolConfig::cross_stream_waits` turns it off.
//! 7. **Map past the peak**, up to `max_reserved`; with `trade_pages_on_map`, wholly free
//!    pages mapped where the request does not fit are unmapped first, so the pool trades
//!    pages rather than grow (on a device that maps memory at two addresses, their memory
//!    is lent instead, and a large block goes to the run that needs the fewest driver calls:
//!    module `cheapest`; the next cheapest where the judgement refuses it). When the peak
//!    does rise (by a growth step), every thread's cache gives back what it holds beyond a
//!    keep at its owner's next slow path (busy caches are never taken from: see rung 5), so
//!    that the requests after this one find that memory.
//! 8. **Host waits**: on every stream's work so far (the requesting stream's too: unmapping a
//!    page needs its work done) and the oldest multi-stream batch, then
//!    everything idle is reclaimed again, free pages are unmapped, and the request tried
//!    with mapping; repeated while a round released something (at most [`LAST_ROUNDS`]):
//!    at the limit, what the request needs is what other threads free meanwhile.
//! 9. **A gap for a small request**: near the limit, a small block that no chunk can hold
//!    takes a run between large blocks, at whole 64 KiB granules (module `place`).
//! 10. **The user's handler** ([`crate::Pool::set_out_of_memory_handler`], module
//!     `on_oom`): given the figures, it frees what the server can spare and answers
//!     whether to climb again from rung 1.
//! 11. [`Error::OutOfMemory`], with the figures.
//!
//! Each placement is counted by the rung that made it (`Stats::ladder_rungs`; rung 11 is
//! `Stats::ooms`, and a placement after the handler counts by the rung of the climb that
//! made it), and its climb's time by that rung too (`Stats::ladder_rung_ns`): two relaxed
//! adds a miss, beside the counters a miss already bumps.

use super::local;
use super::place::{Mapping, Mode, Reuse};
use super::{PoolInner, StreamState};
use crate::error::{Error, OutOfMemory, Result};
use crate::stats::Counters;
use crate::sync::atomic::Ordering;

/// Most rounds of the last rung before the pool gives up; it stops sooner after a round that
/// released nothing.
pub(crate) const LAST_ROUNDS: usize = 8;

impl PoolInner {
    /// What the last rungs may take: memory ready for the stream, mapping up to the limit.
    const ALLOWED: Mode = Mode { reuse: Reuse::Ready, mapping: Mapping::Allowed };

    /// Place `size` bytes for `st`, climbing the ladder as far as it must; the time it
    /// takes is counted in `Stats::ladder_ns`. Rungs 10 and 11 are the caller's
    /// ([`PoolInner::with_handler`]), where no cache is held: the handler may drop this
    /// thread's caches.
    pub(crate) fn alloc_arena(
        &self,
        size: u64,
        requested: usize,
        st: &StreamState,
        own: Option<&local::ThreadCache>,
    ) -> Result<u64> {
        let (placed, took) = Counters::time(|| self.climb(size, requested, st, own));
        Counters::bump(&self.counters.ladder_ns, took);
        placed.map(|(rung, addr)| {
            Counters::bump(&self.counters.rungs[rung - 1], 1);
            Counters::bump(&self.counters.rung_ns[rung - 1], took);
            addr
        })
    }

    /// Rungs 10 and 11 around an allocation's whole cold path (`attempt`): while it runs
    /// out of memory and the out-of-memory handler says it freed some, `attempt` runs again
    /// from the start. An out-of-memory error returned is counted in `Stats::ooms`, a
    /// success after the handler in `Stats::oom_rescues`. Each `attempt` must hold no
    /// reference into this thread's caches once it returns: the handler runs user code,
    /// which may flush and drop them, and the next attempt finds its cache again.
    pub(crate) fn with_handler<T>(&self, mut attempt: impl FnMut() -> Result<T>) -> Result<T> {
        let mut round = 0;
        loop {
            match attempt() {
                // 10.
                Err(Error::OutOfMemory(oom)) if self.on_oom.retry(&oom, round) => {
                    tracing::debug!(requested = oom.requested, round, "rung 10: the handler freed memory");
                    round += 1;
                }
                // 11.
                Err(e @ Error::OutOfMemory(_)) => {
                    Counters::bump(&self.counters.ooms, 1);
                    return Err(e);
                }
                Ok(v) if round > 0 => {
                    Counters::bump(&self.on_oom.rescues, 1);
                    return Ok(v);
                }
                other => return other,
            }
        }
    }

    /// The ladder's rungs, in order, up to rung 9; the error it ends with is rung 10's
    /// question ([`PoolInner::with_handler`]).
    fn climb(
        &self,
        size: u64,
        requested: usize,
        st: &StreamState,
        own: Option<&local::ThreadCache>,
    ) -> Result<(usize, u64)> {
        let _span = tracing::debug_span!("ladder", size, stream = st.stream.id()).entered();
        let ready = Mode::READY;
        let try_ready = |p: &Self| p.place(st, size, ready);
        // 0.
        if self.clear_for_uncached(size, st, own) {
            tracing::trace!("rung 0: this stream's cached large blocks went back");
        }
        // 1.
        if let Some(a) = self.place(st, size, ready)? {
            return Ok((1, a));
        }
        // 2.
        tracing::trace!("rung 2: settle");
        if self.settle() {
            if let Some(a) = self.place(st, size, ready)? {
                return Ok((2, a));
            }
        }
        // 3.
        tracing::trace!("rung 3: flush this stream's caches");
        Counters::bump(&self.counters.ladder_flushes, 1);
        if let Some(a) = self.flush_rounds(size, st, own, try_ready)? {
            return Ok((3, a));
        }
        // 4.
        tracing::trace!("rung 4: map below the peak");
        Counters::bump(&self.counters.ladder_maps, 1);
        if let Some(a) = self.place(st, size, Mode { reuse: Reuse::Ready, mapping: Mapping::WithinPeak })? {
            return Ok((4, a));
        }
        // 5.
        tracing::debug!("rung 5: other streams' idle memory");
        if self.reclaim_held(false) | self.settle() {
            if let Some(a) = self.place(st, size, ready)? {
                return Ok((5, a));
            }
        }
        // 6.
        tracing::debug!("rung 6: device waits");
        if self.config.cross_stream_waits {
            let waiting = Mode { reuse: Reuse::Wait, mapping: Mapping::Forbidden };
            if let Some(a) = self.place(st, size, waiting)? {
                return Ok((6, a));
            }
            if self.take_retiring(st, size.saturating_mul(2)) {
                if let Some(a) = self.place(st, size, waiting)? {
                    return Ok((6, a));
                }
            }
        }
        // 7.
        tracing::debug!("rung 7: map past the peak");
        if let Some(a) = self.map_past_peak(st, size)? {
            return Ok((7, a));
        }
        // 8.
        tracing::debug!("rung 8: host waits");
        for _ in 0..LAST_ROUNDS {
            // Every stream's, this one's too: its own free memory is reusable without a wait,
            // but unmapping a page (to map its budget where the request fits) needs the work
            // queued on it done.
            let waited = self.host_wait(|_| true);
            let released = self.reclaim_held(true);
            self.unmap_lent(0);
            self.unmap_free(0);
            if let Some(a) = self.place(st, size, Self::ALLOWED)? {
                return Ok((8, a));
            }
            if !(waited || released) {
                break;
            }
        }
        // 9.
        if let Some(a) = self.place_small_in_extents(st, size, Self::ALLOWED)? {
            tracing::debug!(size, stream = st.stream.id(), "rung 9: a small block in a gap of the extents");
            return Ok((9, a));
        }
        // 10 and 11: the cold path's, once it holds no cache (`with_handler`).
        tracing::debug!("out of memory");
        let s = self.stats();
        Err(Error::OutOfMemory(Box::new(OutOfMemory {
            requested: requested as u64,
            reserved: s.reserved_bytes,
            allocated: s.allocated_bytes,
            cached: s.cached_bytes,
            retiring: s.retiring_bytes,
            largest_free: s.largest_free_mapped,
            max_reserved: self.max_reserved(),
        })))
    }

    /// After a placement past the peak: if the peak rose a growth step (a 64th, at least a
    /// chunk) past where it stood when caches were last asked, ask again: every thread's
    /// cache gives back what it holds beyond its keep at its owner's next slow path
    /// (`local::SHED_KEEP`), so that the requests after this one find that memory. A step,
    /// not any rise: in a steady state the peak still creeps up now and then (the highest
    /// value of a random walk grows with time), and caches drained at each creep would miss
    /// for nothing.
    fn note_growth(&self) {
        let peak = self.pages.peak_mapped_bytes();
        let asked = self.shed_peak.load(Ordering::Acquire);
        let step = (asked / 64).max(crate::arena::CHUNK);
        if peak >= asked.saturating_add(step) {
            // Lost to another thread's: that one asked.
            let _ = self.shed_peak.compare_exchange(asked, peak, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Rung 7: map up to `max_reserved`. Mapping new pages while wholly free pages stay
    /// mapped where the request did not fit would raise the footprint by memory the pool
    /// does not use: past the peak, that many free pages are unmapped first (those no
    /// stream's work can touch), so a mapping trades pages instead of growing the pool,
    /// unless it grows for real. Below the peak nothing is traded: unmapping there would only
    /// make the next miss map again, a driver call that serialises every thread mapping.
    fn map_past_peak(&self, st: &StreamState, size: u64) -> Result<Option<u64>> {
        let page = self.pages.page_size();
        let past_peak = (self.pages.mapped_bytes() + size).saturating_sub(self.pages.peak_mapped_bytes());
        // A device that can map memory at two addresses trades by lending (in the placement's
        // map callback), which needs no wait; one that cannot unmaps free pages first, and only
        // those whose work is complete.
        if past_peak > 0 && self.config.trade_pages_on_map && !self.device.can_alias() {
            // Pages can go only once their fences are complete: learn which are.
            self.settle();
            let free = self.pages.free_mapped_pages() * page;
            if free > 0 {
                self.unmap_free(free.saturating_sub(past_peak.next_multiple_of(page)));
            }
        }
        let before = self.pages.peak_mapped_bytes();
        let got = self.place(st, size, Self::ALLOWED)?;
        if got.is_some() {
            self.note_growth();
        }
        self.bound_dormant();
        if got.is_some() && self.pages.mapped_bytes() > before && tracing::enabled!(tracing::Level::DEBUG) {
            // Why the pool grew: where the memory it held was when nothing fitted.
            let s = self.stats();
            tracing::debug!(
                size,
                stream = st.stream.id(),
                reserved_mib = s.reserved_bytes >> 20,
                allocated_mib = s.allocated_bytes >> 20,
                thread_cached_mib = s.thread_cached_bytes >> 20,
                depot_mib = s.depot_bytes >> 20,
                retiring_mib = s.retiring_bytes >> 20,
                stream_free_mib = s.stream_free_bytes >> 20,
                free_mapped_mib = s.free_mapped_bytes >> 20,
                largest_free_mapped_mib = s.largest_free_mapped >> 20,
                "the pool grew past its peak"
            );
        }
        // The peak of live bytes is a sample, taken when the pool maps and when `stats()`
        // looks: summing every tier costs too much for every miss.
        self.sample_peak();
        Ok(got)
    }
}
