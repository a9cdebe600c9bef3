//! The pool: [`Pool`], [`PoolConfig`], the tiers' wiring, and the out-of-memory ladder.
//!
//! A pool owns one reserved address range of its device, the lock-free arena over it (T3,
//! [`Space`]: a buddy for blocks under 2 MiB in one half, first-fit 64 KiB extents for larger
//! ones in the other), the [`PageMap`] that maps physical pages under it on demand, and per
//! stream it has seen a [`StreamState`]: the stream's depots (T1, one per size class) and its
//! retire queue (T2). Each thread that uses a stream gets a thread cache (T0, [`local`]).
//!
//! **Alloc** of a cached class on stream S: the thread's cache for S (no atomic RMW, no
//! lock, no driver call), else a full magazine from S's depot, else a block of a slightly
//! larger class the cache holds, else the ladder: the arena without mapping → poll every
//! stream's retire queue → flush this thread's cache and the depots into retire in rounds,
//! blocks of the request's half of the range only, largest classes first, closing every open
//! batch (one event each) and polling after each → if mapping would take the pool past its
//! peak, the same rounds for the other half, each followed by a trade (unmap wholly free
//! pages, map the request's) → map more pages under `max_reserved`, unmapping free pages
//! first past the peak → wait on the oldest pending events, one at a time → take the blocks
//! of other threads' idle caches and every depot's → unmap wholly free pages and map again
//! → only then [`Error::OutOfMemory`] with the figures. Requests above the largest cached class skip T0
//! and T1: they reuse a block freed on the same stream if one fits, else the ladder.
//!
//! **Free** (dropping a [`Block`]) pushes the block into the dropping thread's cache for
//! the block's stream; a full cache trades a magazine with the depot; past the depot's bound
//! the blocks go to the stream's open retire batch, which is closed (one event) once it holds
//! `batch_blocks` blocks or `batch_bytes` bytes. A block used on other streams
//! (`record_stream`) retires behind one event per stream it was used on. Frees inside host
//! functions never call the device: a batch that cannot be closed there stays open, and a
//! later slow path closes it.
//!
//! **Capture.** A stream being captured into a graph retires nothing, and the slow paths
//! (a miss, anything that reaches the arena) refuse to allocate on it with
//! [`Error::StreamCapturing`]. A cache hit asks the driver nothing, so it cannot see a
//! capture: a program that captures must not allocate on the captured stream through the
//! caches (or must `flush_thread_cache()` first, so every allocation misses).
//!
//! No lock anywhere: the arena and page map are CAS walks, depots and retire queues are
//! Treiber stacks and a Michael–Scott queue, and the stream and cache registries are
//! published with arc-swap.

mod block;
mod local;

pub use block::Block;
pub use local::StreamCache;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};

use arc_swap::ArcSwap;
use crossbeam_utils::CachePadded;

use crate::arena::{Acquire, PageMap, Space};
use crate::cache::budget::Budget;
use crate::cache::depot::Depot;
use crate::cache::thread::{mag_cap, CacheShared};
use crate::class;
use crate::device::{Device, Event, Stream, StreamId};
use crate::error::{Error, OutOfMemory, Result};
use crate::reclaim::{Span, StreamRetire};
use crate::stats::{Counters, Stats};
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::epoch;
use block::Placed;

/// Device addresses and sizes are multiples of this.
pub const ALIGN: u64 = 256;

/// Most rounds of the out-of-memory ladder's last steps (wait, take idle caches and depots,
/// unmap free pages) before the pool gives up; it stops sooner after a round that released
/// nothing.
const LAST_ROUNDS: usize = 8;

/// The smallest `large_block_threshold`: size classes from here up are whole 64 KiB granules.
const LARGE_MIN: u64 = 512 << 10;

/// How a pool behaves. `Default` gives what most servers want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Most physical memory the pool may map, in bytes. `None`: 80% of the device's memory.
    pub max_reserved: Option<u64>,
    /// Free mapped bytes kept between trims; past it, wholly free pages are unmapped as
    /// batches retire (as `cudaMemPoolAttrReleaseThreshold`). Default `u64::MAX`: keep them,
    /// since pages reused soon would only be mapped again (~40 µs a page on an H200, under a
    /// driver lock every mapping thread shares); `trade_pages_on_map` keeps the footprint
    /// down instead.
    pub release_threshold: u64,
    /// Bytes of address space to reserve (rounded up to a power of two). `None`: four times
    /// the device's memory.
    pub address_range: Option<u64>,
    /// Close a stream's open batch (record its event) once it holds this many blocks.
    pub batch_blocks: u64,
    /// ... or this many bytes.
    pub batch_bytes: u64,
    /// A freed block is reused on its stream for a request of `n` bytes if its size is at
    /// most `n + n / reuse_slack_div` (0: exact sizes only).
    pub reuse_slack_div: u64,
    /// Before mapping more pages, keep polling freshly closed batches for up to this long
    /// when they hold enough bytes to serve the request.
    pub poll_before_map: std::time::Duration,
    /// The largest size class kept in the caches (rounded to a class); larger requests go
    /// to the arena directly and come back through retire.
    pub largest_cached_class: u64,
    /// Most bytes one thread's cache for one stream may hold.
    pub thread_cache_bytes: u64,
    /// A magazine holds at most this many bytes (and at most 32 blocks, at least one).
    pub magazine_bytes: u64,
    /// Most full magazines a stream's depot keeps per size class.
    pub depot_magazines: usize,
    /// When a miss must map pages past the pool's peak while wholly free pages stay mapped
    /// where it did not fit, unmap those first: the pool trades pages rather than grow its
    /// peak. Below the peak nothing is traded (no churn in a steady state).
    pub trade_pages_on_map: bool,
    /// Blocks of this many bytes or more are placed first fit at 64 KiB granularity in one half
    /// of the address range (the next block starts where the last ended), smaller ones by the
    /// buddy arena in the other half. At least 512 KiB (where size classes are whole granules).
    /// Default 2 MiB: on the shared traces 1.112 → 1.010 (gpt2_decode) peak reserved ÷ peak
    /// live, while random sizes under it keep the buddy's speed.
    pub large_block_threshold: u64,
    /// Pages mapped in one device call, as one physical allocation, when a block lands on
    /// several unmapped pages in a row (1..=64). Longer runs make growth much cheaper on CUDA
    /// (one `cuMemCreate` of 64 pages costs about what 4 single pages do) but a run goes back
    /// only whole, so a small block left on one of its pages keeps it all mapped. Default 1:
    /// the memory figure first (on the shared traces 16 cost 2–10% of peak memory).
    pub map_run_pages: usize,
    /// Most bytes all caches of the pool together (thread caches and depots) may hold.
    /// `None`: half of `max_reserved`.
    pub max_cached_bytes: Option<u64>,
    /// Test-only: treat every retire event as complete, so memory freed on one stream can be
    /// handed to another before the GPU is done with it. Exists so that stress tests can show
    /// they catch a broken guard; never set it otherwise.
    #[doc(hidden)]
    pub break_event_guard_for_tests: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_reserved: None,
            release_threshold: u64::MAX,
            address_range: None,
            batch_blocks: 64,
            batch_bytes: 64 << 20,
            reuse_slack_div: 8,
            poll_before_map: std::time::Duration::from_micros(200),
            largest_cached_class: class::DEFAULT_LARGEST_CLASS,
            thread_cache_bytes: 256 << 20,
            magazine_bytes: 8 << 20,
            depot_magazines: 8,
            max_cached_bytes: None,
            trade_pages_on_map: true,
            map_run_pages: 1,
            large_block_threshold: 2 << 20,
            break_event_guard_for_tests: false,
        }
    }
}

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
            // Late frees must find the pool: its bookkeeping (not its device memory, which
            // trim gave back as far as it could) lives on.
            std::mem::forget(Arc::clone(&self.0));
        }
    }
}

/// What the pool knows of one stream.
pub(crate) struct StreamState {
    pub(crate) stream: Stream,
    /// T1: one depot per cached size class.
    pub(crate) depots: Box<[Depot]>,
    retire: StreamRetire<Event>,
    /// Set once the stream is destroyed: frees then queue behind its final event.
    pub(crate) destroyed: AtomicBool,
}

pub(crate) struct PoolInner {
    device: Arc<dyn Device>,
    pub(crate) config: PoolConfig,
    max_reserved: u64,
    base: u64,
    range: u64,
    /// What every cache hit and free reads, on cache lines of its own: away from the
    /// counters, registries and the arena's atomics that slow paths write, which would
    /// otherwise evict it from every core's cache at each write.
    pub(crate) hot: CachePadded<Hot>,
    arena: CachePadded<Space>,
    pages: CachePadded<PageMap>,
    /// The bound on every cache together.
    pub(crate) cache_budget: crate::sync::Arc<Budget>,
    /// Mapped bytes plus bytes being mapped: the budget checked against `max_reserved`.
    map_budget: AtomicU64,
    streams: ArcSwap<HashMap<StreamId, Arc<StreamState>>>,
    /// Destroyed streams. Kept: a late free of one of their blocks finds its state here.
    orphans: ArcSwap<Vec<Arc<StreamState>>>,
    /// Every live thread cache, with its stream: for stats, trim and the ladder.
    caches: ArcSwap<Vec<(Arc<CacheShared>, Arc<StreamState>)>>,
    /// Counters of caches that are gone, folded in so stats stay whole.
    folded: FoldedCounters,
    /// Blocks used on several streams, each behind one event per stream.
    cross: StreamRetire<Vec<Event>>,
    /// `record_stream` blocks dropped where no device call is allowed, waiting for a slow
    /// path to record their events.
    deferred_cross: crate::reclaim::Stack<(Span, Vec<Stream>)>,
    counters: CachePadded<Counters>,
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
    /// A pool over `device`: reserves its address range now; maps nothing until used.
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
        let classes = class::classes_up_to(config.largest_cached_class);
        let caps: Box<[u8]> =
            (0..classes).map(|c| mag_cap(class::size_of_class(c), config.magazine_bytes) as u8).collect();
        if config.batch_blocks == 0 {
            return Err(Error::InvalidArgument("batch_blocks must be at least 1".into()));
        }
        let max_reserved = config.max_reserved.unwrap_or(total / 10 * 8);
        let config_max_cached = config.max_cached_bytes.unwrap_or(max_reserved / 2);
        // Each half of the range (small blocks, large blocks) can hold all of max_reserved.
        let want = config.address_range.unwrap_or(total.saturating_mul(4)).max(max_reserved.saturating_mul(2)).max(g);
        let range = want
            .checked_next_power_of_two()
            .ok_or_else(|| Error::InvalidArgument(format!("address range {want} is too large")))?;
        let base = device.reserve(range)?;
        let arena = match Space::new(base, range, config.large_block_threshold.max(LARGE_MIN)) {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: nothing was ever mapped in the range just reserved.
                let _ = unsafe { device.release(base, range) };
                return Err(e);
            }
        };
        let pages = match PageMap::new(base, range, g) {
            Ok(p) => p.with_max_run(config.map_run_pages),
            Err(e) => {
                // SAFETY: nothing was ever mapped in the range just reserved.
                let _ = unsafe { device.release(base, range) };
                return Err(e);
            }
        };
        let inner = Arc::new(PoolInner {
            device,
            config,
            max_reserved,
            base,
            range,
            hot: CachePadded::new(Hot { classes, caps }),
            arena: CachePadded::new(arena),
            pages: CachePadded::new(pages),
            cache_budget: crate::sync::Arc::new(Budget::new(config_max_cached)),
            map_budget: AtomicU64::new(0),
            streams: ArcSwap::from_pointee(HashMap::new()),
            orphans: ArcSwap::from_pointee(Vec::new()),
            caches: ArcSwap::from_pointee(Vec::new()),
            folded: FoldedCounters::default(),
            cross: StreamRetire::new(),
            deferred_cross: crate::reclaim::Stack::new(),
            counters: CachePadded::new(Counters::default()),
        });
        Ok(Pool { _handle: Arc::new(LastHandle(Arc::clone(&inner))), inner })
    }

    /// The device the pool allocates from.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// The most physical memory the pool may map.
    pub fn max_reserved(&self) -> u64 {
        self.inner.max_reserved
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
    /// or retire past the depots' bounds). A thread that exits does this by itself.
    pub fn flush_thread_cache(&self) {
        local::flush(&self.inner);
    }

    /// A snapshot of the figures (exact when the pool is quiet).
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Give back what the pool holds and does not use: close every open batch, wait for every
    /// pending event, return every freed block to the arena and unmap every wholly free page.
    pub fn trim(&self) -> Result<()> {
        self.inner.trim()
    }

    /// Check the pool's books (invariant 3 of the design): every block in a cache tier or a
    /// retire queue is walked and must agree with the tiers' counters; no block is in two
    /// places or overlaps free memory; every page holding a byte is mapped and every mapped
    /// page's block count agrees with the arena; reserved = allocated + cached + retiring +
    /// free-but-mapped. Exact when the pool is quiet (if a thread is inside its cache, the
    /// tier walk is skipped).
    ///
    /// `allocated_bytes` is derived (bytes handed out by the arena less the tiers), so a
    /// block lost by every tier shows up as allocated bytes no live block accounts for: tests
    /// compare `stats().allocated_bytes` with their own count of live bytes.
    pub fn check(&self) -> Result<()> {
        self.inner.check()
    }

    /// Destroy a stream the pool has seen, after closing its open batch with a final event
    /// (the same as [`Device::destroy_stream`], which runs the pool's hook).
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
            .field("max_reserved", &self.inner.max_reserved)
            .finish()
    }
}

/// Which rungs of the ladder an attempt may use.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mapping {
    Forbidden,
    Allowed,
}

impl PoolInner {
    /// A request above the largest cached class (or made where the thread has no cache):
    /// exact size from the arena, or a block of the same stream's open batch that fits.
    pub(crate) fn alloc_uncached(
        self: &Arc<Self>,
        bytes: usize,
        st: &Arc<StreamState>,
        own: Option<&local::ThreadCache>,
    ) -> Result<Placed> {
        if bytes == 0 {
            return Ok(Placed::EMPTY);
        }
        let limit = self.max_reserved.min(self.range / 2);
        let size = self.arena.size_for(bytes as u64).filter(|&s| s <= limit);
        let Some(size) = size else { return Err(Error::TooLarge { requested: bytes as u64, limit }) };
        self.refuse_capture(st)?;
        let max_fit = size + size.checked_div(self.config.reuse_slack_div).unwrap_or(0);
        let (addr, size) = match st.retire.reuse(|s| s.size >= size && s.size <= max_fit) {
            Some(span) => {
                Counters::bump(&self.counters.same_stream_reuses, 1);
                // The reused block may be larger than asked: keep its size, so the arena gets
                // back exactly what it gave.
                (span.addr, span.size)
            }
            None => (self.alloc_arena(size, bytes, st, own)?, size),
        };
        self.counters.on_alloc();
        Ok(Placed::uncached(addr, size))
    }

    /// A cached class missed T0 and T1: the arena (through the ladder) serves a block of the
    /// class's size; it is counted in the thread cache's counters by the caller's block.
    pub(crate) fn alloc_miss(
        &self,
        size: u64,
        bytes: usize,
        st: &Arc<StreamState>,
        own: Option<&local::ThreadCache>,
    ) -> Result<u64> {
        let limit = self.max_reserved.min(self.range / 2);
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
        Ok(addr)
    }

    /// Memory handed out during capture would be used whenever the graph replays; it is
    /// refused rather than silently shared with work outside the graph.
    fn refuse_capture(&self, st: &StreamState) -> Result<()> {
        if self.device.is_capturing(&st.stream)? {
            return Err(Error::StreamCapturing);
        }
        Ok(())
    }

    fn sample_peak(&self) {
        let now = self.allocated_now();
        self.counters.peak_allocated.fetch_max(now, Ordering::AcqRel);
    }

    /// The ladder. Every rung that frees memory is followed by another try of the arena.
    fn alloc_arena(
        &self,
        size: u64,
        requested: usize,
        st: &StreamState,
        own: Option<&local::ThreadCache>,
    ) -> Result<u64> {
        if let Some(a) = self.try_arena(size, Mapping::Forbidden)? {
            return Ok(a);
        }
        self.drain_deferred();
        if self.poll_all() > 0 {
            if let Some(a) = self.try_arena(size, Mapping::Forbidden)? {
                return Ok(a);
            }
        }
        // Before mapping, cached blocks of other classes are worth more to this request in
        // the arena than in a cache: this thread's cache and the depots give back memory in
        // rounds (see `flush_rounds`), so a cache gives back only as much as the request
        // needs: one emptied on every such miss would never warm up. Only blocks of the
        // request's half of the range can make room for it: the other half's would go back
        // to the arena for nothing (on the random window, flushing both halves here emptied
        // whole caches and kept the pool missing in steady state).
        Counters::bump(&self.counters.ladder_flushes, 1);
        // Near the mapping limit every class goes, largest first: there the other half's
        // blocks are what keeps pages from falling free and extents from coalescing (a
        // stress run at its limit ran out of memory about one time in ten flushing only the
        // request's half).
        let near_limit = self.near_limit();
        let classes = if near_limit { self.all_classes() } else { self.same_half_classes(size) };
        if let Some(a) = self.flush_rounds(size, own, classes, |p| p.poll_for(size, st))? {
            return Ok(a);
        }
        // Mapping past the pool's peak would raise the peak: the other half's cached blocks
        // give back whole pages first, and the pool trades those (unmaps them, maps the
        // request's) instead of growing. The shared traces' live memory moves between small
        // and large blocks: without this step resnet_varbatch read 1.104 peak reserved ÷ peak
        // live, with it 1.089. It costs the random window churn the request's half alone
        // does not (simulated device, 5M pairs from a cold pool: 10–17k misses against 2k),
        // but in steady state both miss a few dozen times in 5M.
        if self.config.trade_pages_on_map && self.past_peak(size) > 0 && !near_limit {
            let other = self.other_half_classes(size);
            let traded = self.flush_rounds(size, own, other, |p| match p.poll_for(size, st)? {
                Some(a) => Ok(Some(a)),
                None => p.try_map_within_peak(size),
            })?;
            if let Some(a) = traded {
                return Ok(a);
            }
        }
        Counters::bump(&self.counters.ladder_maps, 1);
        if let Some(a) = self.try_map(size)? {
            return Ok(a);
        }
        // At the limit, the memory the request needs is what other threads free meanwhile:
        // while a round of the last steps released something (a batch retired, a cache or a
        // depot gave blocks back), the next round may make room; the pool gives up after a
        // round that released nothing, or after `LAST_ROUNDS`. With one round, the 384 MiB
        // stress run (16 threads, lagging streams) ran out of memory in 3 runs of 58, with
        // ~120 MiB retiring and ~70 MiB cached at the error; with these rounds, in none of 54.
        for _ in 0..LAST_ROUNDS {
            let retired = Counters::get(&self.counters.batches_retired);
            if let Some(a) = self.wait_and_retry(size)? {
                return Ok(a);
            }
            // Other threads' idle caches give their blocks back (the handshake needs no help
            // from them), and every depot its magazines, both halves now: the request's half
            // alone did not make room, and a page of the other half that falls wholly free
            // can be unmapped and its budget mapped where the request fits. Then their
            // batches retire like any other.
            let stolen = self.steal_idle_caches() > 0;
            if stolen {
                Counters::bump(&self.counters.ladder_steals, 1);
            }
            let flushed = self.flush_depots(u64::MAX, self.all_classes()) > 0;
            if stolen || flushed {
                if let Some(a) = self.wait_and_retry(size)? {
                    return Ok(a);
                }
                self.poll_all();
                if let Some(a) = self.try_map(size)? {
                    return Ok(a);
                }
            }
            // Free pages mapped where the request does not fit hold budget it could use.
            self.unmap_free(0);
            if let Some(a) = self.try_arena(size, Mapping::Allowed)? {
                return Ok(a);
            }
            if !(stolen || flushed || Counters::get(&self.counters.batches_retired) != retired) {
                break;
            }
        }
        Counters::bump(&self.counters.ooms, 1);
        let st = self.stats();
        Err(Error::OutOfMemory(Box::new(OutOfMemory {
            requested: requested as u64,
            reserved: st.reserved_bytes,
            allocated: st.allocated_bytes,
            cached: st.cached_bytes,
            retiring: st.retiring_bytes,
            largest_free: st.largest_free_block,
            max_reserved: self.max_reserved,
        })))
    }

    /// Wait for the oldest pending event, one at a time, so the pool waits no longer than it
    /// must, and try again after each; a stress run whose streams lag behind the host waits
    /// here, not fails. Other threads keep closing batches while this one waits: close again
    /// before each wait, so the loop ends only when nothing at all is left retiring or open.
    fn wait_and_retry(&self, size: u64) -> Result<Option<u64>> {
        while {
            self.close_all();
            self.wait_oldest()
        } {
            Counters::bump(&self.counters.ladder_waits, 1);
            self.poll_all();
            if let Some(a) = self.try_map(size)? {
                return Ok(Some(a));
            }
        }
        Ok(None)
    }

    /// Batches just closed on an idle stream complete within microseconds: poll for up to
    /// `poll_before_map` (less than mapping a page costs, ~40 µs on an H200) while the
    /// requesting stream's own batch — the one this thread just closed — has not completed,
    /// trying the arena after each release. Other streams' batches are not waited for here
    /// (a busy stream's are left for the wait rung), and once something was released and the
    /// request still does not fit, waiting longer will not make it fit.
    fn poll_for(&self, size: u64, st: &StreamState) -> Result<Option<u64>> {
        let deadline = std::time::Instant::now() + self.config.poll_before_map;
        loop {
            if self.poll_all() > 0 {
                return self.try_arena(size, Mapping::Forbidden);
            }
            let guard = epoch::pin();
            if !st.retire.has_pending(&guard) || std::time::Instant::now() >= deadline {
                return Ok(None);
            }
            drop(guard);
            crate::sync::yield_now();
        }
    }

    /// The arena, mapping pages as needed. Mapping new pages while wholly free pages stay
    /// mapped elsewhere (where the request did not fit) would raise the pool's footprint by
    /// memory it does not use: past the peak, that many free pages are unmapped first, so a
    /// mapping trades pages instead of growing the pool, unless the pool is growing for real.
    fn try_map(&self, size: u64) -> Result<Option<u64>> {
        // Only growth past the pool's peak is traded: below it, mapping costs time but no
        // memory the pool has not held before, and unmapping there would only make the next
        // miss map again (a driver call that serialises every thread mapping at once). The
        // free pages go first, so the peak never spikes by them.
        let page = self.pages.page_size();
        let past_peak = self.past_peak(size);
        if past_peak > 0 && self.config.trade_pages_on_map {
            let free = self.pages.free_mapped_pages() * page;
            if free > 0 {
                self.unmap_free(free.saturating_sub(past_peak.next_multiple_of(page)));
            }
        }
        let got = self.try_arena(size, Mapping::Allowed)?;
        // The peak of live bytes is a sample, taken when the pool maps and when `stats()`
        // looks: summing every tier costs too much for every miss.
        self.sample_peak();
        Ok(got)
    }

    fn try_arena(&self, size: u64, mapping: Mapping) -> Result<Option<u64>> {
        let Some(addr) = self.arena.alloc(size) else { return Ok(None) };
        let mut map = |page: u64, len: usize| self.map_pages(page, len);
        match self.pages.acquire(addr, size, mapping == Mapping::Allowed, &mut map) {
            Ok(()) => Ok(Some(addr)),
            Err(why) => {
                self.arena.free(addr, size);
                match why {
                    Acquire::NeedsMap => Ok(None),
                    // Over budget, or the device itself is out of memory: the next rung.
                    Acquire::Failed(Error::OutOfMemory(_)) | Acquire::Failed(Error::Device { code: 2, .. }) => Ok(None),
                    Acquire::Failed(e) => Err(e),
                }
            }
        }
    }

    /// Map pages under the budget: the budget is taken before the device call, so two
    /// threads can never map past `max_reserved` together.
    fn map_pages(&self, page: u64, len: usize) -> Result<()> {
        let len64 = len as u64;
        let before = self.map_budget.fetch_add(len64, Ordering::AcqRel);
        if before + len64 > self.max_reserved {
            self.map_budget.fetch_sub(len64, Ordering::AcqRel);
            return Err(Error::OutOfMemory(Box::new(OutOfMemory {
                requested: len64,
                reserved: before,
                allocated: 0,
                cached: 0,
                retiring: 0,
                largest_free: 0,
                max_reserved: self.max_reserved,
            })));
        }
        let r = self.device.map(page, len);
        if r.is_err() {
            self.map_budget.fetch_sub(len64, Ordering::AcqRel);
        }
        r
    }

    fn unmap_free(&self, keep: u64) -> u64 {
        let mut unmap = |page: u64, len: usize| {
            // SAFETY: the page map hands out only pages no held block overlaps: no live,
            // cached or retiring block, so no work queued on any stream can use them.
            let r = unsafe { self.device.unmap(page, len) };
            if r.is_ok() {
                self.map_budget.fetch_sub(len as u64, Ordering::AcqRel);
            }
            r
        };
        let n = self.pages.unmap_free(keep, &mut unmap);
        Counters::bump(&self.counters.unmapped, n);
        n
    }

    fn release_to_arena(&self, span: Span) {
        self.pages.release(span.addr, span.size);
        self.arena.free(span.addr, span.size);
    }

    pub(crate) fn stream_state(self: &Arc<Self>, stream: &Stream) -> Result<Arc<StreamState>> {
        if let Some(st) = self.streams.load().get(&stream.id()) {
            return Ok(Arc::clone(st));
        }
        if stream.is_destroyed() {
            return Err(Error::StreamDestroyed);
        }
        let fresh = Arc::new(StreamState {
            stream: stream.clone(),
            depots: (0..self.hot.classes)
                .map(|c| {
                    let budget = crate::sync::Arc::clone(&self.cache_budget);
                    Depot::with_budget(self.config.depot_magazines, budget, class::size_of_class(c))
                })
                .collect(),
            retire: StreamRetire::new(),
            destroyed: AtomicBool::new(false),
        });
        let mut installed = None;
        self.streams.rcu(|map| {
            let mut map = HashMap::clone(map);
            let st = map.entry(stream.id()).or_insert_with(|| Arc::clone(&fresh));
            installed = Some(Arc::clone(st));
            map
        });
        let st = installed.unwrap_or(fresh);
        if Arc::ptr_eq(&st, &self.streams.load().get(&stream.id()).cloned().unwrap_or_else(|| Arc::clone(&st))) {
            let weak: Weak<PoolInner> = Arc::downgrade(self);
            let id = stream.id();
            // Only the thread whose state won registers the hook (a lost race registers for
            // a state that is not in the map, and the hook then finds nothing to do).
            stream.on_destroy(Box::new(move |s: &Stream| {
                if let Some(pool) = weak.upgrade() {
                    pool.on_stream_destroyed(id, s);
                }
            }));
        }
        Ok(st)
    }

    /// The stream is about to be destroyed: close its open batch with a final event, then
    /// move its state out of the registry; its live blocks retire behind that event.
    fn on_stream_destroyed(&self, id: StreamId, stream: &Stream) {
        let Some(st) = self.streams.load().get(&id).cloned() else { return };
        let guard = epoch::pin();
        // Before the flag: the depots' blocks join the open batch that the final event closes.
        self.flush_stream_depots(&st, u64::MAX, self.all_classes(), &guard);
        st.destroyed.store(true, Ordering::Release);
        let _ = self.close_one(&st, &guard);
        if !st.retire.has_pending(&guard) {
            // Nothing closed (the batch was empty): still put a final event behind all the
            // stream's work, for blocks still live on it.
            if let Ok(ev) = self.device.create_event() {
                if self.device.record_event(&ev, stream).is_ok() {
                    Counters::bump(&self.counters.events_recorded, 1);
                    st.retire.queue_batch(Some(ev), Vec::new(), &guard);
                }
            }
        }
        self.streams.rcu(|map| {
            let mut map = HashMap::clone(map);
            map.remove(&id);
            map
        });
        self.orphans.rcu(|v| {
            let mut v = Vec::clone(v);
            v.push(Arc::clone(&st));
            v
        });
    }

    /// A block that bypasses the caches on its way back: above the largest cached class,
    /// used on several streams, or dropped where this thread has no cache any more.
    pub(crate) fn free_slow(&self, addr: u64, size: u64, stream: StreamId, used_on: Vec<Stream>) {
        self.counters.on_free();
        let span = Span { addr, size };
        let Some(st) = self.state_by_id(stream) else {
            // Only a destroyed stream's state is ever dropped, and only once its final event
            // has completed and nothing of it is left in any tier: all its work is done and
            // none can be queued on it any more, so the block is free for everyone.
            self.release_to_arena(span);
            return;
        };
        if !used_on.is_empty() {
            self.free_cross(span, &st, used_on);
            return;
        }
        self.retire_span(&st, span);
    }

    /// A free block leaves the caches for its stream's retire queue.
    pub(crate) fn retire_span(&self, st: &StreamState, span: Span) {
        if st.destroyed.load(Ordering::Acquire) {
            // No more work can reach a destroyed stream: the block waits only for the final
            // event queued ahead of it.
            st.retire.queue_batch(None, vec![span], &epoch::pin());
            return;
        }
        let (blocks, bytes) = st.retire.free(span);
        if blocks >= self.config.batch_blocks || bytes >= self.config.batch_bytes {
            // Errors leave the batch open (inside a host function, say): a later slow path
            // closes it.
            let _ = self.close_one(st, &epoch::pin());
        }
    }

    /// Blocks taken out of a cache, as (class, address), go to the stream's retire queue.
    pub(crate) fn retire_cached(&self, st: &StreamState, blocks: Vec<(usize, u64)>) {
        for (class, addr) in blocks {
            self.retire_span(st, Span { addr, size: class::size_of_class(class) });
        }
    }

    /// The state of a stream the pool has seen, destroyed or not.
    pub(crate) fn state_by_id(&self, id: StreamId) -> Option<Arc<StreamState>> {
        if let Some(st) = self.streams.load().get(&id) {
            return Some(Arc::clone(st));
        }
        self.orphans.load().iter().find(|st| st.stream.id() == id).cloned()
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

    /// Depots give their blocks to their streams' retire queues, largest classes first,
    /// until at least `target` bytes have moved (`u64::MAX`: all). Returns the bytes moved.
    fn flush_depots(&self, target: u64, classes: std::ops::Range<usize>) -> u64 {
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

    /// Rounds in which cached blocks of the `classes` go back towards the arena — this
    /// thread's cache first, then the depots; largest classes first (the ones caches hit
    /// least); twice the request, then four, eight times, then all of them — each followed
    /// by closing every open batch (one event each) and `attempt`. Stops at the first
    /// address `attempt` gives, or when nothing is left to give back.
    fn flush_rounds(
        &self,
        size: u64,
        own: Option<&local::ThreadCache>,
        classes: std::ops::Range<usize>,
        mut attempt: impl FnMut(&Self) -> Result<Option<u64>>,
    ) -> Result<Option<u64>> {
        let mut target = size.saturating_mul(2).max(self.config.magazine_bytes);
        for round in 0..4 {
            if round == 3 {
                target = u64::MAX;
            }
            let mut moved = own.map_or(0, |tc| tc.flush_some(target, classes.clone()));
            if moved < target {
                moved += self.flush_depots(target - moved, classes.clone());
            }
            if moved == 0 && round > 0 {
                break;
            }
            // The flushed blocks' batches and any other stream's.
            self.close_all();
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

    /// Whether the pool has mapped more than seven eighths of what it may.
    pub(crate) fn near_limit(&self) -> bool {
        self.pages.mapped_bytes() > self.max_reserved - self.max_reserved / 8
    }

    /// Bytes by which mapping `size` more bytes would take the pool past its peak.
    fn past_peak(&self, size: u64) -> u64 {
        (self.pages.mapped_bytes() + size).saturating_sub(self.pages.peak_mapped_bytes())
    }

    /// The arena with mapping, but only as a trade: when the pool would map past its peak
    /// and not enough wholly free pages are mapped to unmap first, None (nothing changed).
    fn try_map_within_peak(&self, size: u64) -> Result<Option<u64>> {
        let page = self.pages.page_size();
        let past = self.past_peak(size).next_multiple_of(page);
        if past > self.pages.free_mapped_pages() * page {
            return Ok(None);
        }
        self.try_map(size)
    }

    /// Every cached class.
    fn all_classes(&self) -> std::ops::Range<usize> {
        0..self.hot.classes
    }

    /// The cached classes of the other half of the range than a block of `size` bytes.
    fn other_half_classes(&self, size: u64) -> std::ops::Range<usize> {
        let same = self.same_half_classes(size);
        if same.start == 0 {
            same.end..self.hot.classes
        } else {
            0..same.start
        }
    }

    /// The cached classes whose blocks share the arena's half with a block of `size` bytes.
    fn same_half_classes(&self, size: u64) -> std::ops::Range<usize> {
        let classes = self.hot.classes;
        let split = class::class_of(self.config.large_block_threshold).map_or(classes, |c| c.min(classes));
        if size < self.config.large_block_threshold {
            0..split
        } else {
            split..classes
        }
    }

    /// One stream's depots of the `classes` give their blocks to its retire queue, largest
    /// classes first, until at least `target` bytes have moved. Returns the bytes moved.
    fn flush_stream_depots(
        &self,
        st: &StreamState,
        target: u64,
        classes: std::ops::Range<usize>,
        guard: &epoch::Guard,
    ) -> u64 {
        let mut moved = 0;
        for (class, d) in st.depots.iter().enumerate().rev().filter(|(c, _)| classes.contains(c)) {
            let size = class::size_of_class(class);
            while moved < target && d.full_count() > 0 {
                let Some(mut m) = d.take_full(guard) else { break };
                moved += m.len() as u64 * size;
                m.drain(|addr| self.retire_span(st, Span { addr, size }));
                d.put_empty(m, guard);
            }
            if moved >= target {
                break;
            }
        }
        moved
    }

    /// Take the blocks of every thread cache whose owner is not inside an operation (the
    /// calling thread's own included: it is not inside one). Returns the blocks taken.
    fn steal_idle_caches(&self) -> u64 {
        let guard = epoch::pin();
        let mut taken = 0;
        for (shared, st) in self.caches.load().iter() {
            let mut out = Vec::new();
            shared.try_steal(|c| {
                // SAFETY: try_steal holds the handshake while this runs.
                unsafe { c.drain(&st.depots, false, |cl, a| out.push((cl, a)), &guard) };
                self.release_budget(c);
            });
            taken += out.len() as u64;
            self.retire_cached(st, out);
        }
        taken
    }

    fn free_cross(&self, span: Span, st: &Arc<StreamState>, mut used_on: Vec<Stream>) {
        used_on.push(st.stream.clone());
        if let Err((span, used_on)) = self.retire_cross(span, used_on) {
            self.deferred_cross.push((span, used_on));
        }
    }

    /// Queue a block used on several streams behind one event per live stream.
    #[allow(clippy::result_large_err)]
    fn retire_cross(&self, span: Span, used_on: Vec<Stream>) -> std::result::Result<(), (Span, Vec<Stream>)> {
        let mut events = Vec::with_capacity(used_on.len());
        for s in &used_on {
            if s.is_destroyed() {
                // Its final event was recorded at destroy time and covers the block; waiting
                // for the other streams' events is enough here because a destroyed stream
                // runs nothing new.
                continue;
            }
            let ev = match self.device.create_event() {
                Ok(ev) => ev,
                Err(_) => return Err((span, used_on)),
            };
            if self.device.record_event(&ev, s).is_err() {
                return Err((span, used_on));
            }
            Counters::bump(&self.counters.events_recorded, 1);
            events.push(ev);
        }
        self.cross.queue_batch(Some(events), vec![span], &epoch::pin());
        Ok(())
    }

    fn drain_deferred(&self) {
        for (span, used_on) in self.deferred_cross.take_all() {
            if let Err(back) = self.retire_cross(span, used_on) {
                self.deferred_cross.push(back);
            }
        }
    }

    fn close_one(&self, st: &StreamState, guard: &epoch::Guard) -> Result<u64> {
        if st.retire.open_blocks() == 0 {
            return Ok(0);
        }
        if self.device.is_capturing(&st.stream)? {
            // Nothing retires on a stream being captured: its events would be graph nodes.
            return Ok(0);
        }
        let closed = st.retire.close(
            || {
                let ev = self.device.create_event()?;
                self.device.record_event(&ev, &st.stream)?;
                Ok::<_, Error>(Some(ev))
            },
            guard,
        )?;
        if closed > 0 {
            Counters::bump(&self.counters.events_recorded, 1);
        }
        Ok(closed)
    }

    fn states(&self) -> Vec<Arc<StreamState>> {
        let mut v: Vec<_> = self.streams.load().values().cloned().collect();
        v.extend(self.orphans.load().iter().cloned());
        v
    }

    fn close_all(&self) {
        let guard = epoch::pin();
        for st in self.states() {
            let _ = self.close_one(&st, &guard);
        }
    }

    /// Poll every stream's retire queue (and the cross-stream one); returns bytes released.
    fn poll_all(&self) -> u64 {
        let guard = epoch::pin();
        let mut released = 0;
        let dev = &self.device;
        let broken = self.config.break_event_guard_for_tests;
        for st in self.states() {
            if !st.retire.has_pending(&guard) {
                continue;
            }
            if !st.destroyed.load(Ordering::Acquire) && dev.is_capturing(&st.stream).unwrap_or(true) {
                continue;
            }
            let (b, bytes) = st.retire.poll(
                |ev| broken || dev.query_event(ev).unwrap_or(false),
                |s| self.release_to_arena(s),
                &guard,
            );
            Counters::bump(&self.counters.batches_retired, b);
            released += bytes;
        }
        let (b, bytes) = self.cross.poll(
            |evs| broken || evs.iter().all(|ev| dev.query_event(ev).unwrap_or(false)),
            |s| self.release_to_arena(s),
            &guard,
        );
        Counters::bump(&self.counters.batches_retired, b);
        released += bytes;
        self.prune_orphans(&guard);
        if released > 0 && self.config.release_threshold != u64::MAX {
            self.unmap_free(self.config.release_threshold);
        }
        released
    }

    fn prune_orphans(&self, guard: &epoch::Guard) {
        // An orphan goes once nothing of it is left: no pending batch (so its final event has
        // completed), no open batch, no block in its depots, no thread cache for it (each
        // holds a reference: the list and `states()`'s snapshot hold the other two).
        let done = |st: &Arc<StreamState>| {
            !st.retire.has_pending(guard)
                && st.retire.open_blocks() == 0
                && st.depots.iter().all(|d| d.full_count() == 0)
                && Arc::strong_count(st) <= 2
        };
        if self.orphans.load().iter().any(done) {
            self.orphans.rcu(|v| v.iter().filter(|st| !done(st)).cloned().collect::<Vec<_>>());
        }
    }

    /// Block on the oldest pending event of the stream that has one; false if none is left.
    fn wait_oldest(&self) -> bool {
        let guard = epoch::pin();
        for st in self.states() {
            let waited = st.retire.with_oldest_event(|ev| self.device.synchronize_event(ev), &guard);
            if let Some(r) = waited {
                return r.is_ok();
            }
            if st.retire.has_pending(&guard) {
                // An event-less batch at the front retires on the next poll.
                return true;
            }
        }
        if let Some(r) =
            self.cross.with_oldest_event(|evs| evs.iter().try_for_each(|ev| self.device.synchronize_event(ev)), &guard)
        {
            return r.is_ok();
        }
        false
    }

    fn trim(&self) -> Result<()> {
        local::flush(self);
        self.steal_idle_caches();
        self.flush_depots(u64::MAX, self.all_classes());
        self.drain_deferred();
        self.close_all();
        loop {
            self.poll_all();
            if !self.wait_oldest() {
                break;
            }
        }
        self.poll_all();
        self.unmap_free(0);
        Ok(())
    }

    /// Bytes in live blocks now. Every byte the arena has handed out is live, cached or
    /// retiring (invariant 3), so live = handed out − cached − retiring: no counter on the
    /// hot path. A snapshot, exact when the pool is quiet; `check()` verifies the tiers'
    /// counters against their contents.
    fn allocated_now(&self) -> u64 {
        let (cached, retiring) = self.tier_bytes();
        let held = self.range - self.arena.free_bytes();
        held.saturating_sub(cached.0 + cached.1 + cached.2).saturating_sub(retiring)
    }

    /// ((thread caches, depots, open batches), retiring) bytes, from the tiers' counters.
    fn tier_bytes(&self) -> ((u64, u64, u64), u64) {
        let (mut open, mut retiring, mut depot) = (0, self.cross.pending_bytes(), 0);
        for st in self.states() {
            open += st.retire.open_bytes();
            retiring += st.retire.pending_bytes();
            for (class, d) in st.depots.iter().enumerate() {
                depot += d.blocks() as u64 * class::size_of_class(class);
            }
        }
        let thread: u64 = self.caches.load().iter().map(|(c, _)| Counters::get(&c.counters.cached_bytes)).sum();
        ((thread, depot, open), retiring)
    }

    /// (largest free stretch of mapped memory, free mapped bytes).
    fn free_mapped(&self) -> (u64, u64) {
        let page = self.pages.page_size();
        let mut mapped = Vec::new();
        self.pages.for_each_mapped(|p, _| mapped.push(p));
        mapped.sort_unstable();
        let mut free = Vec::new();
        self.arena.for_each_free(|a, l| free.push((a, l)));
        free.sort_unstable();
        // Walk the free pieces clipped to mapped pages, joining stretches that touch.
        let (mut largest, mut total, mut run_end, mut run_len) = (0u64, 0u64, u64::MAX, 0u64);
        for (a, l) in free {
            let end = a + l;
            let first = mapped.partition_point(|&p| p + page <= a);
            for &p in mapped[first..].iter().take_while(|&&p| p < end) {
                let (lo, hi) = (a.max(p), end.min(p + page));
                total += hi - lo;
                run_len = if lo == run_end { run_len + (hi - lo) } else { hi - lo };
                run_end = hi;
                largest = largest.max(run_len);
            }
        }
        (largest, total)
    }

    fn stats(&self) -> Stats {
        let c = &self.counters;
        let f = &self.folded;
        let ((thread_cached, depot, open), retiring) = self.tier_bytes();
        // Allocations through caches: misses here, hits added below.
        let (mut allocs, mut t0, mut t1, mut frees) =
            (Counters::get(&f.misses), Counters::get(&f.t0_hits), Counters::get(&f.t1_hits), Counters::get(&f.frees));
        let caches = self.caches.load();
        for (cs, _) in caches.iter() {
            let k = &cs.counters;
            allocs += Counters::get(&k.misses);
            t0 += Counters::get(&k.t0_hits);
            t1 += Counters::get(&k.t1_hits);
            frees += Counters::get(&k.frees);
        }
        allocs += t0 + t1;
        let allocated = self.allocated_now();
        let peak_allocated = c.peak_allocated.fetch_max(allocated, Ordering::AcqRel).max(allocated);
        let (largest_free_mapped, free_mapped_bytes) = self.free_mapped();
        Stats {
            allocated_bytes: allocated,
            reserved_bytes: self.pages.mapped_bytes(),
            peak_allocated_bytes: peak_allocated,
            peak_reserved_bytes: self.pages.peak_mapped_bytes(),
            cached_bytes: thread_cached + depot + open,
            thread_cached_bytes: thread_cached,
            depot_bytes: depot,
            open_batch_bytes: open,
            retiring_bytes: retiring,
            live_blocks: Counters::get(&c.live_blocks).wrapping_add(allocs).wrapping_sub(frees),
            allocs: Counters::get(&c.allocs) + allocs,
            t0_hits: t0,
            t1_hits: t1,
            thread_caches: caches.len() as u64,
            same_stream_reuses: Counters::get(&c.same_stream_reuses),
            events_recorded: Counters::get(&c.events_recorded),
            batches_retired: Counters::get(&c.batches_retired),
            ladder_flushes: Counters::get(&c.ladder_flushes),
            ladder_maps: Counters::get(&c.ladder_maps),
            ladder_waits: Counters::get(&c.ladder_waits),
            ladder_steals: Counters::get(&c.ladder_steals),
            ooms: Counters::get(&c.ooms),
            unmapped_bytes: Counters::get(&c.unmapped),
            largest_free_block: self.arena.largest_free(),
            arena_free_bytes: self.arena.free_bytes(),
            free_mapped_bytes,
            largest_free_mapped,
        }
    }

    fn check(&self) -> Result<()> {
        let broken = |what: String| Err(Error::InvariantBroken(what));
        let st = self.stats();
        let page = self.pages.page_size();
        // Free pieces of the arena, sorted, for per-page sums.
        let mut free = Vec::new();
        self.arena.for_each_free(|a, l| free.push((a, l)));
        free.sort_unstable();
        let free_total: u64 = free.iter().map(|f| f.1).sum();
        if free_total != self.arena.free_bytes() {
            return broken(format!("arena free pieces sum to {free_total}, counter says {}", self.arena.free_bytes()));
        }
        // Every block in a tier, walked, against the tiers' counters: the counters are what
        // `allocated_bytes` is derived from.
        let mut tiers: Vec<(u64, u64)> = Vec::new();
        let guard = epoch::pin();
        let mut thread_walked = 0;
        for (cs, _) in self.caches.load().iter() {
            let mut mine = 0;
            let mut entries = Ok(());
            let walked = cs.try_steal(|c| {
                // SAFETY: try_steal holds the handshake while this runs.
                unsafe {
                    entries = c.check_hot_entries();
                    c.for_each_block(|class, a| {
                        let s = class::size_of_class(class);
                        mine += s;
                        tiers.push((a, s));
                    })
                }
            });
            if !walked {
                // A thread is inside its cache: the pool is not quiet, and a walk cannot
                // be exact. Check only what does not move.
                return Ok(());
            }
            entries.or_else(|why| broken(format!("a thread cache's hot entries are wrong: {why}")))?;
            thread_walked += mine;
        }
        let mut depot_walked = 0;
        let mut queued_walked = 0;
        for s in self.states() {
            for (class, d) in s.depots.iter().enumerate() {
                let size = class::size_of_class(class);
                d.for_each_block(
                    |a| {
                        depot_walked += size;
                        tiers.push((a, size));
                    },
                    &guard,
                );
            }
            s.retire.for_each_span(
                |sp| {
                    queued_walked += sp.size;
                    tiers.push((sp.addr, sp.size));
                },
                &guard,
            );
        }
        self.cross.for_each_span(
            |sp| {
                queued_walked += sp.size;
                tiers.push((sp.addr, sp.size));
            },
            &guard,
        );
        drop(guard);
        if thread_walked != st.thread_cached_bytes || depot_walked != st.depot_bytes {
            return broken(format!(
                "thread caches hold {thread_walked} B (counters: {}), depots {depot_walked} B (counters: {})",
                st.thread_cached_bytes, st.depot_bytes
            ));
        }
        if queued_walked != st.open_batch_bytes + st.retiring_bytes {
            return broken(format!(
                "retire queues hold {queued_walked} B, counters say {} open + {} retiring",
                st.open_batch_bytes, st.retiring_bytes
            ));
        }
        // No block is in two places: tiers and free pieces never overlap.
        let mut all: Vec<(u64, u64)> = tiers.iter().chain(free.iter()).copied().collect();
        all.sort_unstable();
        for w in all.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return broken(format!(
                    "{:#x}+{} and {:#x}+{} overlap (tiers or free)",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ));
            }
        }
        let held = self.range - free_total;
        let free_on = |p: u64| -> u64 {
            let end = p + page;
            let i = free.partition_point(|f| f.0 + f.1 <= p);
            free[i..].iter().take_while(|f| f.0 < end).map(|f| (f.0 + f.1).min(end) - f.0.max(p)).sum()
        };
        let (mut mapped, mut held_on_mapped, mut problem) = (0u64, 0u64, None);
        self.pages.for_each_mapped(|p, count| {
            mapped += page;
            let h = page - free_on(p);
            held_on_mapped += h;
            if (count == 0) != (h == 0) && problem.is_none() {
                problem = Some(format!("page {p:#x}: {count} blocks on it but {h} B held"));
            }
        });
        if let Some(p) = problem {
            return broken(p);
        }
        if mapped != st.reserved_bytes {
            return broken(format!("{mapped} B of pages mapped, counter says {}", st.reserved_bytes));
        }
        if held_on_mapped != held {
            return broken(format!("{} B held on unmapped pages", held - held_on_mapped));
        }
        let free_mapped = mapped - held_on_mapped;
        let in_tiers = st.allocated_bytes + st.cached_bytes + st.retiring_bytes;
        if st.reserved_bytes != in_tiers + free_mapped {
            return broken(format!(
                "reserved {} != allocated {} + cached {} + retiring {} + free-but-mapped {free_mapped}",
                st.reserved_bytes, st.allocated_bytes, st.cached_bytes, st.retiring_bytes
            ));
        }
        Ok(())
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Every block is gone (each held the pool). Wait for the streams' work on freed
        // blocks, then give every page and the range back.
        let _ = self.trim();
        for st in self.states() {
            if !st.stream.is_destroyed() {
                let _ = self.device.synchronize(&st.stream);
            }
        }
        let guard = epoch::pin();
        for st in self.states() {
            st.retire.poll(|_| true, |s| self.release_to_arena(s), &guard);
        }
        self.unmap_free(0);
        if self.pages.mapped_bytes() == 0 {
            // SAFETY: no page is mapped, and every stream that used the range is synchronized.
            let _ = unsafe { self.device.release(self.base, self.range) };
        }
    }
}
