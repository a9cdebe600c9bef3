//! The pool: [`Pool`], [`PoolConfig`], and the wiring of the tiers.
//!
//! A pool owns one reserved address range of its device, the [`Space`] over it (T3: first-fit
//! extents of 64 KiB granules for large blocks and for the 2 MiB chunks streams hold, with a
//! fence on every free granule), the [`PageMap`] that maps physical pages under it on
//! demand, and per stream it has seen a [`StreamState`]: the stream's depots (T1, one per
//! size class), its arena of small blocks (a buddy over the chunks it holds) and its fence
//! log (T2). Each thread that uses a stream gets a thread cache (T0, [`local`]).
//!
//! **Alloc** of a cached class on stream S: the thread's cache for S (no atomic RMW, no
//! lock, no driver call), else a full magazine from S's depot, else a block of a slightly
//! larger class the cache holds, else the arena through the out-of-memory ladder
//! ([`ladder`]). Requests above the largest cached class skip T0 and T1.
//!
//! **Free** (dropping a [`Block`]) pushes the block into the dropping thread's cache for the
//! block's stream; a full cache trades a magazine with the depot; past the depot's bound the
//! block goes back to the arena at once ([`place`]): S may reuse it straight away, any other
//! stream once S's fence on it is complete, or sooner by waiting on it on the device. A
//! block used on other streams (`record_stream`) waits behind one event per stream it was
//! used on. No free calls the device, except for those, so frees inside host functions and
//! thread-local destructors are safe.
//!
//! **Capture.** A stream being captured into a graph gets no event recorded or polled, and
//! the slow paths (a miss, anything that reaches the arena) refuse to allocate on it with
//! [`Error::StreamCapturing`]. A cache hit asks the driver nothing, so it cannot see a
//! capture: a program that captures must not allocate on the captured stream through the
//! caches (or must `flush_thread_cache()` first, so every allocation misses).
//!
//! No lock anywhere: the arenas and the page map are CAS walks, depots are Treiber stacks,
//! fence logs and the retire queue Michael–Scott queues, and the stream and cache registries
//! are published with arc-swap.

mod block;
mod books;
mod cheapest;
mod config;
mod cross;
mod dormant;
mod giveback;
mod judge;
mod ladder;
mod leaks;
mod local;
mod on_oom;
mod place;
mod record;
mod sites;
mod snapshot;
mod streams;
mod watch;

// The C ABI's hot paths use these; the C ABI is not built under loom.
#[cfg(not(loom))]
pub(crate) use block::class_and_size;
pub use block::Block;
pub use config::PoolConfig;
pub use leaks::Leak;
#[cfg(not(loom))]
pub(crate) use local::try_alloc_hit;
pub use local::StreamCache;
#[cfg(not(loom))]
pub(crate) use on_oom::in_handler as in_oom_handler;
pub use on_oom::OOM_HANDLER_ROUNDS;
pub(crate) use place::KEEP_FREE_CHUNKS;
pub use snapshot::{BlockState, Extent, Segment, Snapshot};

use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use crossbeam_utils::CachePadded;

use crate::arena::pages::Backing;
use crate::arena::{PageMap, Space, CHUNK};
use crate::cache::budget::Budget;
use crate::cache::thread::{mag_cap, CacheShared};
use crate::class;
use crate::device::{Device, Stream, StreamId};
use crate::error::{Error, OutOfMemory, Result};
use crate::reclaim::Span;
use crate::stats::{Counters, Stats};
use crate::sync::atomic::{AtomicU64, Ordering};
use block::Placed;
use streams::{Registry, StreamState};

/// Device addresses and sizes are multiples of this.
pub const ALIGN: u64 = 256;

/// The smallest `large_block_threshold`: size classes from here up are whole 64 KiB granules.
const LARGE_MIN: u64 = 512 << 10;

/// A stream-ordered pool of device memory. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
    /// Shared by the clones of this handle: its drop is the last handle's.
    _handle: Arc<LastHandle>,
}

/// Dropped with the last [`Pool`] handle: gives the memory back, and keeps the pool's state
/// alive for ever if blocks are still out (a block holds a plain pointer to it).
struct LastHandle(Arc<PoolInner>);

impl Drop for LastHandle {
    fn drop(&mut self) {
        local::flush(&self.0);
        let _ = self.0.trim();
        let live = self.0.stats().live_blocks;
        if live != 0 {
            self.0.warn_leaks(live);
            // Late frees must find the pool: its bookkeeping (not its device memory, which
            // trim gave back as far as it could) lives on.
            std::mem::forget(Arc::clone(&self.0));
        }
    }
}

pub(crate) struct PoolInner {
    /// The pool itself, for paths that make a stream's state (which registers a hook holding
    /// the pool weakly) from a plain reference: a block's free.
    me: std::sync::Weak<PoolInner>,
    device: Arc<dyn Device>,
    pub(crate) config: PoolConfig,
    /// `max_reserved` as made: what the address range and each stream's arena are sized
    /// for, the most [`Pool::set_max_reserved`] may set.
    ceiling: u64,
    /// The mapping limit now (`Pool::set_max_reserved`), at most `ceiling`.
    limit: AtomicU64,
    /// The range reserved from the device (the space may start a little above `base`, at a
    /// chunk boundary).
    base: u64,
    range: u64,
    /// What every cache hit and free reads, on cache lines of its own: away from the
    /// counters, registries and the arena's atomics that slow paths write, which would
    /// otherwise evict it from every core's cache at each write.
    pub(crate) hot: CachePadded<Hot>,
    space: CachePadded<Space>,
    /// The peak at which thread caches were last asked to give back their excess: it moves
    /// when the peak rises by a growth step (ladder rung 7), and each cache, seeing it moved
    /// at its owner's next slow path, gives back what it holds beyond its keep (`local`).
    pub(crate) shed_peak: AtomicU64,
    /// The bound on dormant pages (module `dormant`).
    pub(crate) dormant: dormant::Dormant,
    /// What recording an event has cost lately, a moving average in nanoseconds
    /// ([`PoolInner::events_contended`]).
    pub(crate) event_cost: AtomicU64,
    pages: CachePadded<PageMap>,
    /// The bound on every cache together.
    pub(crate) cache_budget: crate::sync::Arc<Budget>,
    /// Mapped bytes plus bytes being mapped: the budget checked against `max_reserved`.
    map_budget: AtomicU64,
    /// Bytes kept mapped through trims (pre-allocation).
    floor: AtomicU64,
    /// Bytes of live blocks above the largest cached class, which no cache ever holds, and
    /// of all such blocks ever placed (see [`PoolInner::short_of_memory`]). Counted where
    /// such blocks are placed and released, both slow paths.
    pub(crate) large_live: AtomicU64,
    pub(crate) large_placed: AtomicU64,
    registry: ArcSwap<Registry>,
    /// Destroyed streams. Kept: a late free of one of their blocks finds its state here.
    orphans: ArcSwap<Vec<Arc<StreamState>>>,
    /// Every live thread cache, with its stream: for stats, trim and the ladder.
    caches: ArcSwap<Vec<(Arc<CacheShared>, Arc<StreamState>)>>,
    /// Counters of caches that are gone, folded in so stats stay whole.
    folded: FoldedCounters,
    /// Blocks used on several streams, each behind one event per stream.
    cross: cross::CrossQueue,
    /// `record_stream` blocks dropped where no device call is allowed, waiting for a slow
    /// path to record their events.
    deferred_cross: crate::reclaim::Stack<(Span, Vec<Stream>)>,
    counters: CachePadded<Counters>,
    /// Live blocks with their sites, when `config.track_sites`.
    sites: Option<sites::Sites>,
    /// The trace being written, when `config.record_trace`.
    recorder: Option<record::Recorder>,
    /// The out-of-memory handler, if one is set, and its counts.
    on_oom: on_oom::OnOom,
}

/// See [`PoolInner::hot`].
pub(crate) struct Hot {
    /// Size classes kept in caches.
    pub(crate) classes: usize,
    /// Each class's magazine capacity.
    pub(crate) caps: Box<[u8]>,
}

#[derive(Default)]
struct FoldedCounters {
    misses: AtomicU64,
    t0_hits: AtomicU64,
    t1_hits: AtomicU64,
    frees: AtomicU64,
}

impl Pool {
    /// A pool over `device`: reserves its address range now; maps nothing until used (but
    /// `preallocate`).
    pub fn new<D: Device + 'static>(device: D, config: PoolConfig) -> Result<Pool> {
        Pool::with_device(Arc::new(device), config)
    }

    /// A pool over a shared device handle (as [`crate::device::auto`] returns).
    pub fn with_device(device: Arc<dyn Device>, config: PoolConfig) -> Result<Pool> {
        let total = device.total_memory();
        let g = device.granularity() as u64;
        if g == 0 || !g.is_power_of_two() || g < ALIGN {
            return Err(Error::InvalidArgument(format!("device granularity {g} is not a power of two ≥ 256")));
        }
        // Tracking sites or recording keeps every allocation off the hit path: no class is
        // cached.
        let slow_only = config.track_sites || config.record_trace.is_some();
        let classes = if slow_only { 0 } else { class::classes_up_to(config.largest_cached_class) };
        let caps: Box<[u8]> =
            (0..classes).map(|c| mag_cap(class::size_of_class(c), config.magazine_bytes) as u8).collect();
        let max_reserved = config.max_reserved.unwrap_or(total / 10 * 8);
        let config_max_cached = config.max_cached_bytes.unwrap_or(max_reserved / 2);
        // The range holds all of max_reserved twice over, and a chunk (or page) to spare for
        // aligning the space.
        let unit = g.max(CHUNK);
        let want =
            config.address_range.unwrap_or(total.saturating_mul(4)).max(max_reserved.saturating_mul(2)).max(2 * unit);
        let range = want
            .checked_next_power_of_two()
            .ok_or_else(|| Error::InvalidArgument(format!("address range {want} is too large")))?;
        let recorder = config.record_trace.as_deref().map(record::Recorder::create).transpose()?;
        let base = device.reserve(range)?;
        let made = (|| {
            let start = base.next_multiple_of(unit);
            let len = (base + range - start) / unit * unit;
            let space = Space::new(start, len, config.large_block_threshold.max(LARGE_MIN))?;
            let pages = PageMap::new(start, len, g)?.with_max_run(config.map_run_pages);
            Ok::<_, Error>((space, pages))
        })();
        let (space, pages) = match made {
            Ok(v) => v,
            Err(e) => {
                // SAFETY: nothing was ever mapped in the range just reserved.
                let _ = unsafe { device.release(base, range) };
                return Err(e);
            }
        };
        let preallocate = config.preallocate;
        let sites = sites::Sites::new(config.track_sites);
        let inner = Arc::new_cyclic(|me| PoolInner {
            me: me.clone(),
            device,
            config,
            ceiling: max_reserved,
            limit: AtomicU64::new(max_reserved),
            base,
            range,
            hot: CachePadded::new(Hot { classes, caps }),
            space: CachePadded::new(space),
            pages: CachePadded::new(pages),
            cache_budget: crate::sync::Arc::new(Budget::new(config_max_cached)),
            map_budget: AtomicU64::new(0),
            floor: AtomicU64::new(0),
            large_live: AtomicU64::new(0),
            large_placed: AtomicU64::new(0),
            registry: ArcSwap::from_pointee(Registry::default()),
            orphans: ArcSwap::from_pointee(Vec::new()),
            caches: ArcSwap::from_pointee(Vec::new()),
            folded: FoldedCounters::default(),
            cross: cross::CrossQueue::default(),
            deferred_cross: crate::reclaim::Stack::new(),
            counters: CachePadded::new(Counters::default()),
            shed_peak: AtomicU64::new(0),
            event_cost: AtomicU64::new(0),
            dormant: dormant::Dormant::default(),
            sites,
            recorder,
            on_oom: on_oom::OnOom::default(),
        });
        let pool = Pool { _handle: Arc::new(LastHandle(Arc::clone(&inner))), inner };
        if preallocate > 0 {
            pool.reserve(preallocate)?;
        }
        Ok(pool)
    }

    /// The device the pool allocates from.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// The most physical memory the pool may map now.
    pub fn max_reserved(&self) -> u64 {
        self.inner.max_reserved()
    }

    /// Change the most physical memory the pool may map (as PyTorch's
    /// `set_per_process_memory_fraction`), up to the `max_reserved` it was made with, which
    /// sized its address range; more is [`Error::InvalidArgument`]. Placements that begin
    /// after the call obey it: past it, allocations climb the ladder (which unmaps free
    /// pages to make room) and fail with [`Error::OutOfMemory`] as at any limit. Memory
    /// mapped above a lowered limit stays until its blocks are freed and [`Pool::trim`] or
    /// the ladder unmaps it; the floor of [`Pool::reserve`] stays mapped whatever the limit.
    /// A request above the limit made at creation is still [`Error::TooLarge`], one above
    /// the limit now is out of memory: raising the limit again can serve it.
    pub fn set_max_reserved(&self, bytes: u64) -> Result<()> {
        if bytes > self.inner.ceiling {
            return Err(Error::InvalidArgument(format!(
                "max_reserved {bytes} is above the {} bytes this pool was made for",
                self.inner.ceiling
            )));
        }
        self.inner.limit.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// The device address range the pool reserved, as (base, bytes): every block the pool
    /// hands out lies inside it, so an address outside it is not one of the pool's.
    pub fn address_range(&self) -> (u64, u64) {
        (self.inner.base, self.inner.range)
    }

    /// Allocate `bytes` for use on `stream`: work enqueued on `stream` after this call may
    /// use the block. A zero-byte request gives an empty block. Served by the calling
    /// thread's cache for `stream`, found through a thread-local.
    #[inline]
    #[track_caller]
    pub fn alloc(&self, bytes: usize, stream: &Stream) -> Result<Block> {
        local::alloc(&self.inner, stream, bytes)
    }

    /// The calling thread's cache for `stream`: the fastest way to allocate for a worker
    /// that owns its stream. Not `Send`.
    pub fn stream_cache(&self, stream: &Stream) -> Result<StreamCache> {
        let st = self.inner.stream_state(stream)?;
        local::stream_cache(&self.inner, &st)
            .ok_or(Error::NotPermitted("the calling thread is exiting: its thread-locals are gone"))
    }

    /// Give this thread's caches of this pool back (their blocks go to the stream depots,
    /// or back to the arena past the depots' bounds). A thread that exits does this by
    /// itself.
    pub fn flush_thread_cache(&self) {
        local::flush(&self.inner);
    }

    /// A snapshot of the figures (exact when the pool is quiet).
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Start the figures' peaks again from now (PyTorch's `reset_peak_memory_stats`):
    /// `Stats::peak_allocated_bytes` and `peak_reserved_bytes` then read the most held since
    /// this call, to measure one phase of a program. The pool's own rules, which compare its
    /// growth with the most it ever mapped, do not change.
    pub fn reset_peak_stats(&self) {
        self.inner.reset_peaks();
    }

    /// Give back what the pool holds and does not use: every cached block and every wholly
    /// free chunk goes back to the arena, the host waits for every stream's work enqueued so
    /// far (so no fence is left incomplete), and every wholly free page above the floor
    /// ([`Pool::reserve`]) is unmapped.
    pub fn trim(&self) -> Result<()> {
        self.inner.trim()
    }

    /// Map `bytes` (rounded up to pages) now and keep them mapped through [`Pool::trim`] and
    /// the release threshold, as a floor: pre-allocation, so that the first requests pay no
    /// mapping. Adds to what was reserved before; fails, mapping nothing, if the pool
    /// cannot map that much under `max_reserved`.
    ///
    /// What it holds, and what it cannot: the reserve is a floor of mapped memory, not
    /// room for any sequence of live bytes up to its size. A block holds its size class (at
    /// most an eighth more than asked, at least 256 B), small blocks come from each
    /// stream's 2 MiB chunks (a stream holds at least one while it has a small block out),
    /// and first-fit placement leaves holes that a later, larger request does not fit. No
    /// placement that never moves a live block can promise more for every sequence: in the
    /// worst case (Robson's bound) it needs a multiple of the live bytes that grows with
    /// the logarithm of the largest request over the smallest. What `tests/preallocate.rs`
    /// checks, counting the device's maps: random sizes from 256 B to 8 MiB on two
    /// streams whose live bytes (as asked) stay at most half the reserve map nothing; with
    /// live bytes up to three quarters of it, they mapped more.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        self.inner.reserve(bytes)
    }

    /// Set the out-of-memory handler, replacing any other: when an allocation has climbed
    /// every rung of the ladder and still does not fit, the pool calls `handler` with the
    /// figures it would fail with. The handler frees what the program can spare (a cache
    /// of its own, requests it can pre-empt) and returns `true` to have the allocation
    /// tried again from the start, `false` to let it fail with [`Error::OutOfMemory`].
    ///
    /// - It runs on the allocating thread, with nothing of the pool held (no lock, no page,
    ///   no reference into the thread's caches): it may free blocks, allocate, flush the
    ///   thread's caches and trim, this pool or another.
    /// - It is not called from inside itself: an allocation of the handler's own thread
    ///   that runs out of memory while the handler runs fails at once.
    /// - At most [`OOM_HANDLER_ROUNDS`] calls for one allocation; a handler that panics counts
    ///   as `false` (the panic does not reach the caller).
    ///
    /// `Stats::oom_handler_calls` and `Stats::oom_rescues` count what it did. Only
    /// allocations that run out of memory call it: nothing on the hit path reads it.
    ///
    /// ```
    /// # use std::sync::{Arc, Mutex};
    /// # use vrampool::{Pool, PoolConfig, SimDevice};
    /// let dev = SimDevice::new(64 << 20);
    /// let pool = Pool::new(dev.clone(), PoolConfig { max_reserved: Some(32 << 20), ..PoolConfig::default() })?;
    /// let s = dev.new_stream()?;
    /// // Blocks the program keeps only while memory lasts.
    /// let spare = Arc::new(Mutex::new(vec![pool.alloc(24 << 20, &s)?]));
    /// let evict = Arc::clone(&spare);
    /// pool.set_out_of_memory_handler(move |_oom| evict.lock().map(|mut v| v.pop().is_some()).unwrap_or(false));
    /// let b = pool.alloc(24 << 20, &s)?; // would not fit beside the spare block
    /// assert!(spare.lock().unwrap().is_empty());
    /// assert_eq!(pool.stats().oom_rescues, 1);
    /// # drop(b);
    /// # Ok::<(), vrampool::Error>(())
    /// ```
    pub fn set_out_of_memory_handler(&self, handler: impl Fn(&OutOfMemory) -> bool + Send + Sync + 'static) {
        self.inner.on_oom.set(Some(Box::new(handler)));
    }

    /// Remove the out-of-memory handler: allocations that run out of memory fail at once
    /// again. A call of the old handler under way finishes.
    pub fn clear_out_of_memory_handler(&self) {
        self.inner.on_oom.set(None);
    }

    /// Pause the trace of [`PoolConfig::record_trace`] (`true`) or go on with it (`false`):
    /// blocks allocated while it is paused are left out of it whole, so that a program can
    /// record its workload alone, not its start-up or its own checks. Nothing for a pool
    /// that does not record.
    pub fn pause_trace(&self, paused: bool) {
        if let Some(r) = &self.inner.recorder {
            r.pause(paused);
        }
    }

    /// Write the lines of [`PoolConfig::record_trace`] buffered so far to its file: the
    /// events written since the pool was made, or the error that stopped the recording (a
    /// full disk, say). `Ok(0)` for a pool that does not record.
    pub fn flush_trace(&self) -> Result<u64> {
        self.inner.recorder.as_ref().map_or(Ok(0), |r| r.flush())
    }

    /// [`Pool::flush_trace`] if no thread is writing a line now, errors kept for a later
    /// flush: what the registry's pools, never dropped, do as the process exits.
    pub(crate) fn flush_trace_if_idle(&self) {
        if let Some(r) = &self.inner.recorder {
            r.flush_if_idle();
        }
    }

    /// Check the pool's books (invariant 3 of the design): every block in a cache tier or
    /// the retire queue is walked and must agree with the tiers' counters; no block is in
    /// two places or overlaps free memory; every chunk a stream holds is known by its owner
    /// word; every page holding a byte is mapped and every mapped page's block count agrees
    /// with the space; reserved = allocated + cached + retiring + free-but-mapped. Exact when
    /// the pool is quiet (if a thread is inside its cache, the tier walk is skipped).
    ///
    /// `allocated_bytes` is derived (bytes handed out by the arenas less the tiers), so a
    /// block lost by every tier shows up as allocated bytes no live block accounts for: tests
    /// compare `stats().allocated_bytes` with their own count of live bytes.
    pub fn check(&self) -> Result<()> {
        self.inner.check()
    }

    /// Destroy a stream the pool has seen, after recording its final event (the same as
    /// [`Device::destroy_stream`], which runs the pool's hook).
    pub fn destroy_stream(&self, stream: &Stream) -> Result<()> {
        self.inner.device.destroy_stream(stream)
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("device", &self.inner.device.name())
            .field("base", &format_args!("{:#x}", self.inner.base))
            .field("range", &self.inner.range)
            .field("max_reserved", &self.inner.max_reserved())
            .finish()
    }
}

impl PoolInner {
    /// A request above the largest cached class (or made where the thread has no cache):
    /// exact size from the arena.
    pub(crate) fn alloc_uncached(
        self: &Arc<Self>,
        bytes: usize,
        st: &Arc<StreamState>,
        own: Option<&local::ThreadCache>,
        site: &'static std::panic::Location<'static>,
    ) -> Result<Placed> {
        if bytes == 0 {
            return Ok(Placed::EMPTY);
        }
        let limit = self.ceiling.min(self.space.len() / 2);
        let size = self.space.size_for(bytes as u64).filter(|&s| s <= limit);
        let Some(size) = size else { return Err(Error::TooLarge { requested: bytes as u64, limit }) };
        self.refuse_capture(st)?;
        let addr = self.alloc_arena(size, bytes, st, own)?;
        let size = self.held_size(addr, size);
        self.counters.on_alloc();
        if let Some(t) = &self.sites {
            t.insert(addr, sites::Site { bytes: bytes as u64, size, stream: st.stream.id(), at: site });
        }
        if let Some(r) = &self.recorder {
            r.alloc(addr, bytes as u64, st.stream.id());
        }
        Ok(self.placed_uncached(addr, size))
    }

    /// A block that no class holds, counted in `large_live` when it is above every class;
    /// [`PoolInner::release_uncached`] takes it off by the same test of the same size.
    fn placed_uncached(&self, addr: u64, size: u64) -> Placed {
        if self.above_classes(size) {
            self.large_live.fetch_add(size, Ordering::Relaxed);
            self.large_placed.fetch_add(size, Ordering::Relaxed);
        }
        Placed::uncached(addr, size)
    }

    /// Whether a block of `size` is larger than every cached class.
    pub(crate) fn above_classes(&self, size: u64) -> bool {
        self.hot.classes.checked_sub(1).is_none_or(|c| size > class::size_of_class(c))
    }

    /// A cached class missed T0 and T1: the arena (through the ladder) serves a block of the
    /// class's size; it is counted in the thread cache's counters by the caller's block.
    /// A block that landed in the extents at whole granules past the class's size (a small
    /// one at the limit, see [`PoolInner::held_size`]) is no block of the class: uncached.
    pub(crate) fn alloc_miss(
        &self,
        class: usize,
        size: u64,
        bytes: usize,
        st: &Arc<StreamState>,
        own: Option<&local::ThreadCache>,
    ) -> Result<Placed> {
        let limit = self.ceiling.min(self.space.len() / 2);
        if size > limit {
            return Err(Error::TooLarge { requested: bytes as u64, limit });
        }
        self.refuse_capture(st)?;
        let addr = self.alloc_arena(size, bytes, st, own)?;
        if let Some(tc) = own {
            // Counted as the cache's allocation (the hit path counts its own).
            let c = &tc.shared.counters;
            crate::cache::thread::bump(&c.misses, 1);
        } else {
            self.counters.on_alloc();
        }
        let held = self.held_size(addr, size);
        Ok(if held == size { Placed::cached(addr, size, class) } else { self.placed_uncached(addr, held) })
    }

    /// The bytes a placement of `size` at `addr` holds: `size`, or, for a small block that
    /// landed in the extents (at the limit, `place_small_in_extents`), its whole granules,
    /// so that the block's capacity is what the space counts as held.
    fn held_size(&self, addr: u64, size: u64) -> u64 {
        // A large block's size is whole granules already.
        if self.in_extents(Span { addr, size }) {
            size.next_multiple_of(crate::arena::GRANULE)
        } else {
            size
        }
    }

    /// Memory handed out during capture would be used whenever the graph replays; it is
    /// refused rather than silently shared with work outside the graph.
    fn refuse_capture(&self, st: &StreamState) -> Result<()> {
        if self.capturing(&st.stream)? {
            return Err(Error::StreamCapturing);
        }
        Ok(())
    }

    /// A block that bypasses the caches on its way back: above the largest cached class,
    /// used on several streams, or dropped where this thread has no cache any more.
    pub(crate) fn free_slow(&self, addr: u64, size: u64, stream: StreamId, used_on: Vec<Stream>) {
        Counters::timed(&self.counters.release_ns, || self.release_uncached(addr, size, stream, used_on));
    }

    /// [`PoolInner::free_slow`]'s work, timed by it.
    fn release_uncached(&self, addr: u64, size: u64, stream: StreamId, used_on: Vec<Stream>) {
        self.counters.on_free();
        if self.above_classes(size) {
            self.large_live.fetch_sub(size, Ordering::Relaxed);
        }
        if let Some(t) = &self.sites {
            t.remove(addr);
        }
        if let Some(r) = &self.recorder {
            r.free(addr, stream);
        }
        let span = Span { addr, size };
        let Some(st) = self.state_by_id(stream) else {
            // Only a destroyed stream's state is ever dropped, and only once its final event
            // has completed and it holds nothing: all its work is done and none can be queued
            // on it any more, so the block is free for everyone.
            self.release_clean(span);
            return;
        };
        if !used_on.is_empty() {
            self.free_cross(span, &st, used_on);
            return;
        }
        self.release(&st, span);
    }

    /// A new thread cache for `st` joins the registry.
    pub(crate) fn register_cache(&self, st: &Arc<StreamState>) -> Arc<CacheShared> {
        let shared = Arc::new(CacheShared::new(self.hot.classes));
        self.caches.rcu(|v| {
            let mut v = Vec::clone(v);
            v.push((Arc::clone(&shared), Arc::clone(st)));
            v
        });
        shared
    }

    /// A thread cache is gone: fold its counters in and drop it from the registry.
    /// The cache was flushed first (its budget went back with its blocks).
    pub(crate) fn unregister_cache(&self, shared: &Arc<CacheShared>) {
        let c = &shared.counters;
        let f = &self.folded;
        for (from, to) in
            [(&c.misses, &f.misses), (&c.t0_hits, &f.t0_hits), (&c.t1_hits, &f.t1_hits), (&c.frees, &f.frees)]
        {
            to.fetch_add(from.load(Ordering::Acquire), Ordering::AcqRel);
        }
        shared.retire();
        self.caches.rcu(|v| v.iter().filter(|(c, _)| !Arc::ptr_eq(c, shared)).cloned().collect::<Vec<_>>());
    }

    /// A cache let go of all its blocks: its whole reservation goes back. Called by whoever
    /// holds the cache's handshake.
    pub(crate) fn release_budget(&self, shared: &CacheShared) {
        let c = &shared.counters;
        let have = c.budget.load(Ordering::Relaxed);
        let keep = c.cached_bytes.load(Ordering::Relaxed).min(have);
        c.budget.store(keep, Ordering::Relaxed);
        self.cache_budget.give(have - keep);
    }

    /// Bytes out of the space: live, cached, retiring, or in chunks streams hold (one load).
    pub(crate) fn space_held(&self) -> u64 {
        self.space.len() - self.space.free_bytes()
    }

    /// The mapping limit now ([`Pool::set_max_reserved`]). Read where a placement decides
    /// how far it may map: a change applies to the placements that begin after it.
    pub(crate) fn max_reserved(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Whether the pool has mapped more than seven eighths of what it may: pages a placement
    /// needs beyond those it finds mapped may be pages it cannot have (module `place`).
    pub(crate) fn near_limit(&self) -> bool {
        let limit = self.max_reserved();
        self.pages.mapped_bytes() > limit - limit / 8
    }

    /// Whether memory is short: the pool is [near its limit](PoolInner::near_limit) and more
    /// than half of the room that `pinned` bytes of live large blocks leave is out of the
    /// space (live, cached, retiring, or in chunks streams hold). Then the thread caches serve
    /// misses at the size asked, not a class's, and borrow less far (module `local`).
    ///
    /// - Mapped pages alone do not make memory short: a pool keeps the pages it mapped when
    ///   its blocks go, and a server that had once filled most of the device kept its caches
    ///   off for good (every allocation on the slow path: 408 ns a pair instead of 5 on the
    ///   development machine).
    /// - Below half, a class's rounding (at most an eighth of what is live) cannot take what
    ///   another request needs; above it, the near-limit stresses (`tests/near_limit.rs`)
    ///   refused no more than with mapped pages alone (with seven eighths held as the bar
    ///   instead, the mixed window refused 91 requests at or below 95% of the limit, where it
    ///   had refused none).
    /// - `pinned` (a caller's estimate, at most the bytes of live blocks above the largest
    ///   cached class that were placed a while ago: `watch::Pinned`) is left out of both
    ///   sides: no cache holds those blocks, no class rounds them and they do not come and go,
    ///   so what the caches can cost is measured against the room left beside them. An LLM
    ///   server holding most of `max_reserved` in its KV cache kept its caches off for good
    ///   otherwise: `window --hold 0.86` ran every allocation as a miss. Large blocks that
    ///   come and go stay in: leaving every live large block out made the mixed window, whose
    ///   blocks of 4–8 MiB are half its bytes, refuse 1–7 requests at or below 95% of the
    ///   limit in each of seven runs, against 0–1 with none left out.
    pub(crate) fn short_of_memory(&self, pinned: u64) -> bool {
        if !self.near_limit() {
            return false;
        }
        let held = self.space_held();
        let pinned = pinned.min(held);
        held - pinned > self.max_reserved().saturating_sub(pinned) / 2
    }

    /// Every cached class.
    pub(crate) fn all_classes(&self) -> std::ops::Range<usize> {
        0..self.hot.classes
    }

    /// Bytes kept mapped through trims.
    pub(crate) fn floor_bytes(&self) -> u64 {
        self.floor.load(Ordering::Acquire)
    }

    /// See [`Pool::reserve`]: map the lowest pages of the space that are not mapped yet, as
    /// free chunks of no stream, and raise the floor.
    fn reserve(&self, bytes: u64) -> Result<()> {
        let page = self.pages.page_size();
        let want = bytes.next_multiple_of(page);
        if want == 0 {
            return Ok(());
        }
        let free_mapped = self.pages.free_mapped_pages() * page;
        let floor = self.floor.load(Ordering::Acquire);
        let to_map = (floor + want).saturating_sub(free_mapped.max(floor));
        // Take the lowest runs of the space, map their pages, and give them back free: the
        // pages stay mapped (free, count 0), where first-fit placement looks first.
        let mut taken = Vec::new();
        let mut mapped = 0u64;
        let result = (|| {
            while mapped < to_map {
                let chunk = (to_map - mapped).min(CHUNK.max(page)).next_multiple_of(page);
                let mut accept = |_: u64, _: u64| Ok(());
                let Some(addr) = self.space.alloc_large(chunk, &mut accept) else {
                    return Err(Error::OutOfMemory(Box::new(crate::error::OutOfMemory {
                        requested: bytes,
                        reserved: self.pages.mapped_bytes(),
                        allocated: 0,
                        cached: 0,
                        retiring: 0,
                        largest_free: self.free_mapped().0,
                        max_reserved: self.max_reserved(),
                    })));
                };
                taken.push((addr, chunk));
                let before = self.pages.mapped_bytes();
                let mut map = |p: u64, len: usize| self.map_pages(p, len, self.max_reserved()).map(|()| Backing::Fresh);
                if let Err(why) = self.pages.acquire(addr, chunk, true, &mut map) {
                    taken.pop();
                    self.space.give_back(addr, chunk);
                    return Err(match why {
                        crate::arena::Acquire::Failed(e) => e,
                        crate::arena::Acquire::NeedsMap => Error::InvariantBroken("reserve may map".into()),
                        crate::arena::Acquire::Lent => Error::InvariantBroken("reserve takes free runs only".into()),
                    });
                }
                mapped += self.pages.mapped_bytes() - before;
            }
            Ok(())
        })();
        for (addr, len) in taken {
            self.pages.release(addr, len);
            self.space.give_back(addr, len);
        }
        match result {
            Ok(()) => {
                self.floor.fetch_add(want, Ordering::AcqRel);
                Ok(())
            }
            Err(e) => {
                // Nothing reserved: what was mapped for it goes back.
                self.unmap_free(0);
                Err(e)
            }
        }
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Every block is gone (each held the pool). Wait for the streams' work on freed
        // blocks, then give every page and the range back.
        self.floor.store(0, Ordering::Release);
        let _ = self.trim();
        for st in self.states() {
            if !st.stream.is_destroyed() {
                let _ = self.device.synchronize(&st.stream);
            }
        }
        self.settle();
        self.unmap_lent(0);
        self.unmap_free(0);
        if self.pages.mapped_bytes() == 0 && self.pages.lent_pages() == 0 {
            // SAFETY: no page is mapped, and every stream that used the range is synchronized.
            let _ = unsafe { self.device.release(self.base, self.range) };
        }
    }
}
