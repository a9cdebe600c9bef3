//! Counters and the snapshot [`Pool::stats`](crate::Pool::stats) returns.
//!
//! Counters are plain atomics updated on slow paths and on each alloc and free; a snapshot
//! reads them one by one, so it is exact only when the pool is quiet.

use crate::sync::atomic::{AtomicU64, Ordering};

/// Rungs of the out-of-memory ladder that can place an allocation ([`Stats::ladder_rungs`]).
pub const LADDER_RUNGS: usize = 9;

/// A snapshot of the pool's figures, in bytes unless named otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[allow(deprecated)]
pub struct Stats {
    /// Bytes in live blocks (sizes rounded up to 256).
    pub allocated_bytes: u64,
    /// Bytes of physical memory mapped (reserved = mapped).
    pub reserved_bytes: u64,
    /// The most `allocated_bytes` has been since the pool was made or its peaks were last
    /// reset ([`crate::Pool::reset_peak_stats`]). A sample: `allocated_bytes` is derived
    /// from the tiers, with no counter on the hit path, so it is read whenever the pool maps
    /// past its peak and whenever the figures are taken.
    pub peak_allocated_bytes: u64,
    /// The most `reserved_bytes` has been since the pool was made or its peaks were last
    /// reset (exact).
    pub peak_reserved_bytes: u64,
    /// Bytes in the caches, free for reuse on their own stream: thread caches and stream
    /// depots together.
    pub cached_bytes: u64,
    /// ... of which in thread caches (T0).
    pub thread_cached_bytes: u64,
    /// ... of which in stream depots (T1).
    pub depot_bytes: u64,
    /// Always 0: freed memory no longer waits in open batches; it goes back to its stream's
    /// arena at once (counted in `stream_free_bytes` or the arena's free bytes). Kept so that
    /// code reading it still builds.
    #[deprecated(note = "always 0: freed memory goes back to the arena at once, behind a fence")]
    pub open_batch_bytes: u64,
    /// Bytes of blocks used on several streams (`record_stream`), freed and waiting for the
    /// events of every stream they were used on.
    pub retiring_bytes: u64,
    /// Bytes free in the chunks streams hold for their small blocks (free-but-mapped memory
    /// each stream reuses at once).
    pub stream_free_bytes: u64,
    /// 2 MiB chunks held by streams for their small blocks.
    pub stream_chunks: u64,
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
    /// Large blocks and chunks placed on memory the requesting stream had freed itself
    /// (reused at once, with no event).
    pub same_stream_reuses: u64,
    /// Large blocks and chunks placed on memory another stream freed, taken at once because
    /// this stream had already been made to wait on the device for the work that freed it
    /// (an earlier device wait covers it: no new wait, no event).
    pub covered_reuses: u64,
    /// Events recorded: when another stream needed a stream's fences resolved, at stream
    /// destruction, and one per stream for `record_stream` blocks.
    pub events_recorded: u64,
    /// Times a placement met an incomplete fence of another stream the placing thread
    /// allocates on too, and left that stream alone (no poll, no event recorded to hurry its
    /// memory), because the pool's event records had lately been slow: the driver busy with
    /// other threads' calls (`IMPLEMENTATION.md`, "Hurries wait when records are slow").
    /// Counted once per stream a placement meets, so it runs well above the records it
    /// saved. Streams the placing thread does not allocate on are asked instead
    /// (`records_asked`).
    pub hurries_skipped: u64,
    /// Times a placement met memory another stream freed that no event covered yet, on a
    /// stream the placing thread does not allocate on, and asked that stream's next free to
    /// record the event instead of recording it there itself: on a GPU a record on a stream
    /// another thread is launching on waits behind those launches
    /// (`benches/record_threads.cu`). Counted when an ask is made, not while it stands.
    pub records_asked: u64,
    /// Events asked whether they are complete (polls of the streams' fences). On a GPU each
    /// is a `cuEventQuery`, which the driver serialises across threads.
    pub events_queried: u64,
    /// Batches of `record_stream` blocks whose events were seen complete and whose blocks
    /// went back to the arena.
    pub batches_retired: u64,
    /// Device-side waits: a stream made to wait on another stream's event so that it could
    /// take memory freed there (see `PoolConfig::cross_stream_waits`).
    pub device_waits: u64,
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
    /// Times the out-of-memory handler was called ([`crate::Pool::set_out_of_memory_handler`]).
    pub oom_handler_calls: u64,
    /// Allocations that succeeded after the out-of-memory handler had been called for them:
    /// what the memory it freed served.
    pub oom_rescues: u64,
    /// Allocations placed below the caches, by the rung of the out-of-memory ladder that
    /// placed them: index 0 is rung 1 (ready memory on mapped pages, where most misses end),
    /// index 8 rung 9 (a gap between large blocks, near the limit); rung 10 is the
    /// out-of-memory handler (`oom_handler_calls`) and rung 11 `ooms`. The
    /// rungs, in order, are listed in `IMPLEMENTATION.md` and the docs of `src/pool/ladder.rs`.
    /// Where a pool's misses climb far (flushing caches, device waits, mapping past the
    /// peak) shows where its slow path's time goes.
    pub ladder_rungs: [u64; LADDER_RUNGS],
    /// Nanoseconds of `ladder_ns` by the rung that placed the allocation, as
    /// `ladder_rungs` counts them: what each rung's placements cost, the rungs below it
    /// that failed first included (a climb that ended out of memory is in `ladder_ns`
    /// only). A miss that costs more as threads are added shows here which rungs it climbs
    /// to when it does.
    pub ladder_rung_ns: [u64; LADDER_RUNGS],
    /// Nanoseconds allocations spent below the caches, in the arena and the out-of-memory
    /// ladder (the device calls they made included): what misses cost, beside `allocs`.
    pub ladder_ns: u64,
    /// Nanoseconds spent in frees that bypass the caches (blocks above the largest cached
    /// class, blocks used on several streams): their return to the arena.
    pub release_ns: u64,
    /// Nanoseconds spent in the device's map calls, loans included (inside `ladder_ns`).
    pub map_ns: u64,
    /// Nanoseconds spent in the device's unmap calls, for any reason.
    pub unmap_ns: u64,
    /// Nanoseconds spent in the device's event calls (creating and recording the events that
    /// fence frees, polling them), device waits, and the capture checks of a miss and before
    /// events, wherever they were made: in `ladder_ns`, `release_ns` or outside both.
    pub event_ns: u64,
    /// Nanoseconds of `event_ns` spent asking events whether they are complete
    /// (`events_queried` of them).
    pub query_ns: u64,
    /// Nanoseconds of `event_ns` spent creating and recording events (`events_recorded`).
    pub record_ns: u64,
    /// Events recorded for a placement rather than for the frees they cover (counted in
    /// `events_recorded` too): the events a device wait or the ladder's host wait needs, and
    /// a hurry, when a placement meets memory another stream freed that no event covers yet
    /// on a stream the placing thread allocates on too (other streams are asked instead:
    /// `records_asked`). Most go on another stream than the placing one, whose owner may be
    /// launching work meanwhile: on a busy GPU such a record waits for those launches
    /// (`benches/record_threads.cu`), where a record on the caller's own stream does not.
    pub reuse_records: u64,
    /// Nanoseconds of `record_ns` spent on `reuse_records`.
    pub reuse_record_ns: u64,
    /// Nanoseconds of `event_ns` spent making streams wait on events (`device_waits`).
    pub wait_ns: u64,
    /// Nanoseconds of `event_ns` spent asking whether streams are being captured (before
    /// every miss, and before a stream's events are recorded or polled). With `query_ns`,
    /// `record_ns` and `wait_ns` it makes up `event_ns`.
    pub capture_ns: u64,
    /// Bytes mapped over the pool's life (loans included: memory mapped at a second address).
    pub mapped_bytes: u64,
    /// Runs of free pages whose memory went to pages a request landed on, instead of new
    /// memory (trading pages without waiting for the device; see `IMPLEMENTATION.md`).
    pub pages_lent: u64,
    /// Pages a block took back the memory of, from the page it had been lent to, with no
    /// device call.
    pub pages_switched: u64,
    /// Bytes of lent pages: mapped, serving nothing until a block takes their memory back
    /// or a trim unmaps them.
    pub lent_bytes: u64,
    /// Bytes unmapped over the pool's life, for any reason (trims, the release threshold,
    /// trading pages).
    pub unmapped_bytes: u64,
    /// Bytes kept mapped through trims (pre-allocation, [`crate::Pool::reserve`]).
    pub floor_bytes: u64,
    /// The largest block the arena could hand out now (exact when quiet).
    pub largest_free_block: u64,
    /// Bytes free in the arena over its whole range (mapped or not).
    pub arena_free_bytes: u64,
    /// Bytes on mapped pages that no block holds.
    pub free_mapped_bytes: u64,
    /// The largest free stretch of mapped memory that one block could take (a stream's
    /// chunk counts by its largest free piece).
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
    pub covered_reuses: AtomicU64,
    pub events_recorded: AtomicU64,
    pub hurries_skipped: AtomicU64,
    pub records_asked: AtomicU64,
    pub events_queried: AtomicU64,
    pub batches_retired: AtomicU64,
    pub device_waits: AtomicU64,
    pub mapped: AtomicU64,
    pub pages_lent: AtomicU64,
    pub pages_switched: AtomicU64,
    pub ladder_flushes: AtomicU64,
    pub ladder_maps: AtomicU64,
    pub ladder_waits: AtomicU64,
    pub ladder_steals: AtomicU64,
    pub ooms: AtomicU64,
    pub rungs: [AtomicU64; LADDER_RUNGS],
    pub rung_ns: [AtomicU64; LADDER_RUNGS],
    pub unmapped: AtomicU64,
    pub ladder_ns: AtomicU64,
    pub release_ns: AtomicU64,
    pub map_ns: AtomicU64,
    pub unmap_ns: AtomicU64,
    pub query_ns: AtomicU64,
    pub record_ns: AtomicU64,
    pub reuse_records: AtomicU64,
    pub reuse_record_ns: AtomicU64,
    pub wait_ns: AtomicU64,
    pub capture_ns: AtomicU64,
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

    /// Run `f`, adding the time it took to `counter` in ticks ([`crate::clock`]; read them
    /// as ns with [`Counters::get_ns`]): for slow paths only (a clock read is dearer than a
    /// cache hit).
    pub(crate) fn timed<T>(counter: &AtomicU64, f: impl FnOnce() -> T) -> T {
        Self::timed_all(&[counter], f)
    }

    /// [`Counters::timed`], adding the same time to each of `counters`: a part and its
    /// whole, so that the part never reads larger.
    pub(crate) fn timed_all<T>(counters: &[&AtomicU64], f: impl FnOnce() -> T) -> T {
        let (out, took) = Self::time(f);
        for c in counters {
            c.fetch_add(took, Ordering::Relaxed);
        }
        out
    }

    /// Run `f`, returning what it took in ticks beside its result: for a caller that knows
    /// which counters to add it to only once `f` has returned.
    pub(crate) fn time<T>(f: impl FnOnce() -> T) -> (T, u64) {
        let start = crate::clock::ticks();
        let out = f();
        (out, crate::clock::ticks().saturating_sub(start))
    }

    /// A counter [`Counters::timed`] adds to, in ns.
    pub(crate) fn get_ns(counter: &AtomicU64) -> u64 {
        crate::clock::to_ns(counter.load(Ordering::Acquire))
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Acquire)
    }
}
