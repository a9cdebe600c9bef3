//! The calling thread's caches: one [`ThreadCache`] per (pool, stream) this thread has used,
//! found through a thread-local, and [`StreamCache`], the explicit handle to one.
//!
//! The thread-local keeps a short list of entries and remembers the last one hit, so
//! `pool.alloc(bytes, &stream)` and a block's drop find their cache with two compares in the
//! common case. A thread that exits flushes its caches (its thread-local's destructor); a
//! block dropped after that (during another thread-local's teardown) takes the pool's slow
//! path, which pushes it onto its stream's open batch without calling the device.

use std::cell::{Cell, RefCell};
use std::panic::Location;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;

use super::block::{Block, Placed, NO_CLASS};
use super::watch::{GrowthWatch, Pinned};
use super::{PoolInner, StreamState};
use crate::cache::thread::{CacheShared, Hit, Slot, Spill};
use crate::class;
use crate::device::{Stream, StreamId};
use crate::error::Result;
use crate::sync::atomic::Ordering;
use crate::sync::epoch;

/// When a class's loaded magazine is empty, a block of up to this many classes larger (two
/// doublings: at most four times the size) that the cache already holds is used instead:
/// first on the hit path, from the larger classes' loaded magazines; on the slow path, after
/// the class's previous magazine and its depot, from their previous magazines; only then
/// new memory. The random sizes of a serving workload hit far more often so. On the random
/// window (simulated device, 5M pairs from a cold pool) one doubling took 50–110k misses,
/// 2.7–4.8k ladder flushes and 1.0–1.4k maps; two doublings 12–17k, 0.7–1.1k and 270–320,
/// and the shared traces' peak reserved ÷ peak live stayed at most 1.089.
const BORROW_CLASSES: usize = 16;

/// ... but one doubling once the pool has mapped most of what it may: a borrowed block's
/// extra capacity is held while it lives, and there it is memory another request needs (a
/// stress run at its limit ran out of memory about one time in ten with two doublings).
const BORROW_CLASSES_NEAR_LIMIT: usize = 8;

/// ... and for large blocks this many (three quarters of a doubling), but none while the
/// pool grows ([`GROWTH_COLD_CALLS`](super::watch::GROWTH_COLD_CALLS)): the extra capacity
/// is held while the block lives, and on large blocks it shows in the footprint. Without
/// large borrowing the random window takes 250 ns a pair instead of 24 (criterion,
/// simulator), so it stays in the steady state.
const BORROW_CLASSES_LARGE: usize = 6;

/// What a thread's cache keeps when the pool's peak rises: the rest it gives back at its
/// owner's next slow path ([`ThreadCache::shed_if_grew`]). A busy thread's cache is never
/// taken from (rung 5 of the ladder takes idle ones only: stealing from working threads cost
/// them their hit rate), and the demo's two workers each held up to 55 MiB in theirs while
/// the other's request grew the pool: 27 runs had peak reserved ÷ peak live 1.042–1.348,
/// four of them above 1.2; giving back down to 16 MiB after each rise, 38 runs read
/// 1.038–1.188 at the same throughput (simulator, `docs/BENCHMARKS.md`). A steady state
/// does not raise the peak by a growth step, so the random window's hit rate does not
/// change.
const SHED_KEEP: u64 = 16 << 20;

// The hit path looks at most this far up.
const _: () = assert!(BORROW_CLASSES <= crate::cache::thread::REACH_MAX);

/// The unit in which thread caches reserve cache budget.
fn budget_chunk(config: &super::PoolConfig) -> u64 {
    (config.thread_cache_bytes / 8).clamp(1 << 20, 16 << 20)
}

/// One thread's cache for one (pool, stream).
pub(crate) struct ThreadCache {
    /// The stream's id, copied here so the hot path never reads the shared stream state.
    stream_id: StreamId,
    pub(crate) shared: Arc<CacheShared>,
    pub(crate) pool: Arc<PoolInner>,
    pub(crate) stream: Arc<StreamState>,
    /// Whether the cache's reach (see [`ThreadCache::within`]) was last set for a pool short
    /// of memory ([`PoolInner::short_of_memory`]).
    near: Cell<bool>,
    /// Whether the reach was last set for a growing pool (no large borrowing).
    growing: Cell<bool>,
    /// Whether the pool grows, as this cache sees it.
    growth: GrowthWatch,
    /// The live large bytes that stay put, as this cache sees them.
    pinned: Pinned,
    /// The pool's `shed_peak` this cache last acted on.
    shed_seen: Cell<u64>,
}

impl ThreadCache {
    /// A cache for (`pool`, `stream`), registered, with its reach set.
    fn new(pool: &Arc<PoolInner>, stream: &Arc<StreamState>) -> ThreadCache {
        let tc = ThreadCache {
            stream_id: stream.stream.id(),
            shared: pool.register_cache(stream),
            pool: Arc::clone(pool),
            stream: Arc::clone(stream),
            near: Cell::new(pool.short_of_memory(0)),
            growing: Cell::new(true),
            growth: GrowthWatch::new(pool.space_held()),
            pinned: Pinned::new(pool.large_placed.load(Ordering::Relaxed)),
            shed_seen: Cell::new(pool.shed_peak.load(Ordering::Acquire)),
        };
        tc.set_reach();
        tc
    }

    /// How many classes larger than `class` an allocation of it may borrow from.
    fn within(&self, class: usize, near_limit: bool, growing: bool) -> usize {
        let large = self.pool.config.large_block_threshold;
        if class::size_of_class(class) >= large {
            return if growing { 0 } else { BORROW_CLASSES_LARGE };
        }
        // A small block borrows only small blocks: a large one lent to a small request is
        // held whole while it lives, which a large request then maps again (on the shared
        // traces 1 MiB requests took 2–4 MiB blocks, 4.7% of resnet_varbatch's peak).
        let small_above = class::class_of(large).map_or(usize::MAX, |l| l.saturating_sub(class + 1));
        small_above.min(if near_limit { BORROW_CLASSES_NEAR_LIMIT } else { BORROW_CLASSES })
    }

    /// Write every class's reach into the cache for its hit path, for the pool's state now.
    fn set_reach(&self) {
        let (near, growing) = (self.near.get(), self.growing.get());
        self.shared.enter_wait();
        // SAFETY: entered above.
        unsafe { self.shared.set_reach(|c| self.within(c, near, growing)) };
        self.shared.exit();
    }

    /// Whether the pool grows, as this cache sees it at this cold-path call ([`GrowthWatch`]).
    fn pool_growing(&self) -> bool {
        self.growth.observe(self.pool.space_held())
    }

    /// The hit path: a block from the loaded magazine of the class or, when that is empty,
    /// of the smallest larger class within reach that holds one; anything else (a thief,
    /// empty magazines, a zero-byte or uncached size) is [`ThreadCache::alloc_cold`]; see
    /// [`alloc_through`].
    #[inline(always)]
    #[track_caller]
    pub(crate) fn alloc(&self, bytes: usize) -> Result<Block> {
        let (pool, site) = (NonNull::from(&*self.pool), Location::caller());
        alloc_through(
            pool,
            self.stream_id,
            bytes,
            || Some(&*self.shared),
            |class| self.alloc_cold_whole(bytes, class, site),
        )
    }

    /// [`ThreadCache::alloc_cold`] with rungs 10 and 11 of the ladder (the out-of-memory
    /// handler): for a cache its caller holds through a [`StreamCache`], which keeps it alive
    /// whatever the handler drops.
    #[cold]
    #[inline(never)]
    fn alloc_cold_whole(&self, bytes: usize, class: Option<usize>, site: &'static Location) -> Result<Placed> {
        self.pool.with_handler(|| self.alloc_cold(bytes, class, site))
    }

    /// Everything but the hit path: the magazines again once any thief is gone, the
    /// previous magazine, the depot, a larger cached class, the arena. `class` is
    /// `class_of(bytes)`, already computed by the caller.
    #[cold]
    #[inline(never)]
    pub(crate) fn alloc_cold(&self, bytes: usize, class: Option<usize>, site: &'static Location) -> Result<Placed> {
        let pool = &*self.pool;
        self.shed_if_grew();
        let pinned = self.pinned.observe(
            self.shared.counters.t0_hits.load(Ordering::Relaxed),
            pool.large_live.load(Ordering::Relaxed),
            pool.large_placed.load(Ordering::Relaxed),
        );
        let (near, growing) = (pool.short_of_memory(pinned), self.pool_growing());
        if (near, growing) != (self.near.get(), self.growing.get()) {
            self.near.set(near);
            self.growing.set(growing);
            self.set_reach();
        }
        let class = match class {
            Some(c) if c < pool.hot.classes => c,
            // A zero-byte request has no class: `alloc_uncached` gives it an empty block.
            _ => return self.pool.alloc_uncached(bytes, &self.stream, Some(self), site),
        };
        let size = class::size_of_class(class);
        if let Some(hit) = self.take_cached(class, size) {
            return Ok(Placed::taken(hit));
        }
        if near {
            // Short of memory, a miss takes what was asked (as the arena rounds it), uncached: a
            // class's rounding is held while the block lives, and there it is memory another
            // request needs. Class blocks took 17% more than the bytes asked when the window
            // case of `tests/near_limit.rs` first ran out; exact, it refused 1–9 requests at
            // or below 95% of the limit in four runs (lowest 0.774) instead of 134–157
            // (lowest 0.667).
            return self.pool.alloc_uncached(bytes, &self.stream, Some(self), site);
        }
        pool.alloc_miss(class, size, bytes, &self.stream, Some(self))
    }

    /// A block for `class` from this cache or its stream's depot, with the class it came
    /// from: the loaded or previous magazine, a full magazine from the depot, else a block
    /// of a larger class this cache holds. No device call, no ladder, nothing that could
    /// remove a thread-local entry. `class` is one of the pool's cached classes.
    ///
    /// The hit path has already looked at the loaded magazines within reach; a previous
    /// magazine (of the class or a larger one) and the depot are left. One handshake; the
    /// depot (an epoch pin) only when it holds a magazine.
    fn take_cached(&self, class: usize, size: u64) -> Option<Hit> {
        self.shared.enter_wait();
        // SAFETY: entered above (for both calls).
        if let Some(a) = unsafe { self.shared.pop(class, size).or_else(|| self.shared.pop_prev(class, size)) } {
            self.shared.exit();
            return Some(Hit { addr: a, class, size });
        }
        let depot = self.stream.depots.get(class);
        if let (Some(depot), Some(&cap)) = (depot.filter(|d| d.full_count() > 0), self.pool.hot.caps.get(class)) {
            if let Some(a) = self.refill(Slot { class, size, cap: cap as usize }, depot) {
                return Some(Hit { addr: a, class, size });
            }
            self.shared.enter_wait();
        }
        // SAFETY: entered (above, or again after the refill exited).
        let larger = unsafe { self.shared.pop_larger(class) };
        self.shared.exit();
        larger
    }

    /// Both magazines of `slot`'s class are empty and `depot` holds a full one: load it.
    /// Called entered; exits.
    #[cold]
    #[inline(never)]
    fn refill(&self, slot: Slot, depot: &crate::cache::depot::Depot) -> Option<u64> {
        tracing::trace!(class = slot.class, stream = self.stream_id, "refill from the depot");
        // A magazine from the depot moves its bytes into this cache: reserve for them first.
        let c = &self.shared.counters;
        self.grow_budget(c.cached_bytes.load(Ordering::Relaxed) + slot.cap as u64 * slot.size);
        // SAFETY: the caller entered.
        let hit = unsafe { self.shared.pop_slow(slot, depot, epoch::pin) };
        let mut spilled = Vec::new();
        let over = c.cached_bytes.load(Ordering::Relaxed).saturating_sub(c.budget.load(Ordering::Relaxed));
        if over > 0 {
            // The budget could not cover the whole magazine: give the excess back.
            // SAFETY: still entered.
            unsafe { self.shared.drain_some(over, 0..self.pool.hot.classes, |cl, a| spilled.push((cl, a))) };
        }
        self.shrink_budget();
        self.shared.exit();
        if !spilled.is_empty() {
            self.pool.free_cached(&self.stream, spilled);
        }
        hit
    }

    /// If the pool's peak rose since this cache last looked, give back what it holds beyond
    /// [`SHED_KEEP`], largest classes first: memory other threads' requests then find
    /// instead of mapping more. Done by the owner itself, on its own slow path: no thief,
    /// no barrier.
    fn shed_if_grew(&self) {
        let asked = self.pool.shed_peak.load(Ordering::Acquire);
        if asked == self.shed_seen.get() {
            return;
        }
        self.shed_seen.set(asked);
        // A thief may take blocks before the flush holds the cache: then it flushes what is
        // left, down to less than the keep at worst.
        let over = self.shared.counters.cached_bytes.load(Ordering::Relaxed).saturating_sub(SHED_KEEP);
        if over > 0 {
            self.flush_some(over, 0..self.pool.hot.classes);
        }
    }

    /// Reserve cache budget so that the cache may hold `want` bytes (up to the per-thread
    /// bound): in chunks, so the shared counter moves rarely. Returns the reservation now.
    /// Called entered (the reservation is written only under the handshake).
    fn grow_budget(&self, want: u64) -> u64 {
        let c = &self.shared.counters;
        let limit = self.pool.config.thread_cache_bytes;
        let have = c.budget.load(Ordering::Relaxed);
        let want = want.min(limit);
        if want <= have {
            return have;
        }
        let chunk = budget_chunk(&self.pool.config);
        let rounded = ((want - have).div_ceil(chunk) * chunk).min(limit - have);
        let budget = &self.pool.cache_budget;
        let grant = if budget.try_take(rounded) {
            rounded
        } else if budget.try_take(want - have) {
            want - have
        } else {
            0
        };
        c.budget.store(have + grant, Ordering::Relaxed);
        have + grant
    }

    /// Give back reserved budget well above what the cache holds. Called entered.
    fn shrink_budget(&self) {
        let c = &self.shared.counters;
        let (have, cached) = (c.budget.load(Ordering::Relaxed), c.cached_bytes.load(Ordering::Relaxed));
        let chunk = budget_chunk(&self.pool.config);
        if have > cached + 2 * chunk {
            let keep = cached + chunk;
            c.budget.store(keep, Ordering::Relaxed);
            self.pool.cache_budget.give(have - keep);
        }
    }

    /// Free through the whole path: the hit path if it takes the block, else waiting out
    /// a thief and trading with the depot.
    fn free(&self, class: usize, size: u64, addr: u64) {
        // The hit path reads the capacity from the cache's own entry; the slow path looks it up.
        let slot = Slot { class, size, cap: 0 };
        self.shared.enter_wait();
        let budget = self.shared.counters.budget.load(Ordering::Relaxed);
        // SAFETY: entered above; the class came from a block of this pool.
        if unsafe { self.shared.push(slot, addr, budget) } {
            self.shared.exit();
            return;
        }
        self.free_slow(slot, addr);
    }

    /// The loaded magazine is full (or the class is new here): trade with the depot, and
    /// retire what cannot be kept. Called entered; exits.
    #[cold]
    #[inline(never)]
    fn free_slow(&self, slot: Slot, addr: u64) {
        let pool = &*self.pool;
        let (Some(&cap), Some(depot)) = (pool.hot.caps.get(slot.class), self.stream.depots.get(slot.class)) else {
            // Not a cached class (blocks of those carry no class): never kept.
            self.shared.exit();
            pool.release(&self.stream, crate::reclaim::Span { addr, size: slot.size });
            return;
        };
        let slot = Slot { cap: cap as usize, ..slot };
        let c = &self.shared.counters;
        let need = c.cached_bytes.load(Ordering::Relaxed) + slot.size;
        let budget = self.grow_budget(need);
        // SAFETY: the caller entered.
        let spill = unsafe { self.shared.push_slow(slot, addr, budget, depot, epoch::pin) };
        self.shrink_budget();
        self.shared.exit();
        if let Spill::Retire(addrs) = spill {
            for a in addrs {
                pool.release(&self.stream, crate::reclaim::Span { addr: a, size: slot.size });
            }
        }
        self.shed_if_grew();
    }

    /// Move every block out: to the depots when `to_depots`, else (and past the depots'
    /// bounds) to the stream's retire queue.
    pub(crate) fn flush(&self, to_depots: bool) {
        self.shared.enter_wait();
        let guard = epoch::pin();
        let mut out = Vec::new();
        // SAFETY: entered above.
        unsafe { self.shared.drain(&self.stream.depots, to_depots, |c, a| out.push((c, a)), &guard) };
        self.pool.release_budget(&self.shared);
        self.shared.exit();
        self.pool.free_cached(&self.stream, out);
    }

    /// Move about `target` bytes of the `classes` out to the stream's retire queue, largest
    /// classes first.
    pub(crate) fn flush_some(&self, target: u64, classes: std::ops::Range<usize>) -> u64 {
        self.shared.enter_wait();
        let mut out = Vec::new();
        // SAFETY: entered above.
        let moved = unsafe { self.shared.drain_some(target, classes, |c, a| out.push((c, a))) };
        self.shrink_budget();
        self.shared.exit();
        self.pool.free_cached(&self.stream, out);
        moved
    }
}

impl Drop for ThreadCache {
    fn drop(&mut self) {
        self.flush(true);
        self.pool.unregister_cache(&self.shared);
    }
}

/// A thread's handle to its cache for one stream: the fastest way to allocate for a worker
/// thread that owns its stream. Not `Send`: it names the calling thread's cache.
pub struct StreamCache {
    tc: Rc<ThreadCache>,
}

impl StreamCache {
    /// Allocate `bytes` on the cache's stream (see [`super::Pool::alloc`]). Inlined into
    /// callers always: left out of line inside a wrapper (`alloc_buffer`), the block stalled
    /// on its way into the wrapper (3.5–4× the hot pair).
    #[inline(always)]
    #[track_caller]
    pub fn alloc(&self, bytes: usize) -> Result<Block> {
        self.tc.alloc(bytes)
    }

    /// The cache's shared part (for the C ABI's free hot path), alive as long as `self`.
    #[cfg(not(loom))]
    pub(crate) fn shared(&self) -> &CacheShared {
        &self.tc.shared
    }

    /// The stream this cache serves.
    pub fn stream(&self) -> &Stream {
        &self.tc.stream.stream
    }
}

impl std::fmt::Debug for StreamCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamCache").field("stream", &self.stream().id()).finish()
    }
}

struct Entry {
    pool: *const PoolInner,
    stream: StreamId,
    tc: Rc<ThreadCache>,
}

/// Every cache of this thread. Its destructor (thread exit) flushes them.
#[derive(Default)]
struct Local {
    entries: RefCell<Vec<Entry>>,
}

impl Local {
    fn find_rc(&self, pool: *const PoolInner, stream: StreamId) -> Option<Rc<ThreadCache>> {
        self.entries.borrow().iter().find(|e| e.pool == pool && e.stream == stream).map(|e| Rc::clone(&e.tc))
    }

    /// Before a new entry: the caches of streams destroyed since (of any pool) go, as they
    /// would at thread exit, unless a [`StreamCache`] still holds one. A thread that served
    /// a stream a request, each destroyed after, kept a cache per stream it had ever used,
    /// and every idle-cache sweep of the ladder walked them all (on the simulator, 20,000
    /// streams made, used and destroyed in turn took 32 ms each by the end).
    fn drop_destroyed(&self) {
        let gone: Vec<Entry> = {
            let mut entries = self.entries.borrow_mut();
            if !entries.iter().any(|e| e.tc.stream.destroyed.load(Ordering::Acquire)) {
                return;
            }
            let (gone, kept): (Vec<Entry>, Vec<Entry>) = entries
                .drain(..)
                .partition(|e| e.tc.stream.destroyed.load(Ordering::Acquire) && Rc::strong_count(&e.tc) == 1);
            *entries = kept;
            gone
        };
        if !gone.is_empty() {
            // The memo may name one of them: it never names a cache no entry holds.
            let _ = MEMO.try_with(Memo::forget);
        }
        // Dropped with the entries released: a cache's drop flushes it into the pool.
        drop(gone);
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        // Thread exit: every cache of this thread flushes (ThreadCache::drop).
        let _ = MEMO.try_with(Memo::forget);
        let entries = std::mem::take(self.entries.get_mut());
        drop(entries);
    }
}

/// The last cache this thread used, as three plain cells in a thread-local without a
/// destructor: finding it is one thread-local address and two compares, no reference
/// count, no borrow flag.
///
/// It only ever names a cache that an entry of [`Local`] holds, and is cleared before any
/// entry is removed ([`flush`], [`Local`]'s destructor); nothing reachable from a cache's
/// alloc or free removes entries. So a reference taken from it is valid for the call.
struct Memo {
    pool: Cell<*const PoolInner>,
    stream: Cell<StreamId>,
    tc: Cell<*const ThreadCache>,
    /// `tc`'s shared part, so a free's hit path follows no pointer from the cache.
    shared: Cell<*const CacheShared>,
}

impl Memo {
    const fn new() -> Memo {
        Memo {
            pool: Cell::new(std::ptr::null()),
            stream: Cell::new(0),
            tc: Cell::new(std::ptr::null()),
            shared: Cell::new(std::ptr::null()),
        }
    }

    /// Whether the memo names (`pool`, `stream`).
    #[inline(always)]
    fn names(&self, pool: *const PoolInner, stream: StreamId) -> bool {
        self.pool.get() == pool && self.stream.get() == stream
    }

    /// The memo's cache, if the memo names (`pool`, `stream`).
    #[inline(always)]
    fn find(&self, pool: *const PoolInner, stream: StreamId) -> Option<&ThreadCache> {
        self.named(pool, stream, &self.tc)
    }

    /// The memo's cache's shared part, if the memo names (`pool`, `stream`).
    #[inline(always)]
    fn find_shared(&self, pool: *const PoolInner, stream: StreamId) -> Option<&CacheShared> {
        self.named(pool, stream, &self.shared)
    }

    /// What `cell` (the memo's cache, or its shared part) points to, if the memo names
    /// (`pool`, `stream`).
    #[inline(always)]
    fn named<'a, T>(&'a self, pool: *const PoolInner, stream: StreamId, cell: &'a Cell<*const T>) -> Option<&'a T> {
        // SAFETY: the memo names a cache held by a live entry (see the type's docs), which
        // holds its shared part.
        self.names(pool, stream).then(|| unsafe { &*cell.get() })
    }

    fn remember(&self, pool: *const PoolInner, stream: StreamId, tc: *const ThreadCache) {
        self.pool.set(pool);
        self.stream.set(stream);
        self.tc.set(tc);
        // SAFETY: a non-null `tc` names a live cache (the caller holds it).
        let shared = if tc.is_null() { std::ptr::null() } else { Arc::as_ptr(unsafe { &(*tc).shared }) };
        self.shared.set(shared);
    }

    fn forget(&self) {
        self.remember(std::ptr::null(), 0, std::ptr::null());
    }
}

crate::sync::thread_local! {
    static LOCAL: Local = Local::default();
}

// `const` initialisation makes the memo's access a plain thread-local address; loom's macro
// has no `const` form.
#[cfg(not(loom))]
crate::sync::thread_local! {
    static MEMO: Memo = const { Memo::new() };
}
#[cfg(loom)]
crate::sync::thread_local! {
    static MEMO: Memo = Memo::new();
}

/// This thread's cache for (`pool`, `stream`), made on first use; remembered as the last
/// one used. None inside a host function: the threads that run them belong to the driver,
/// and a cache there would never be flushed (its frees take the deferred path instead).
pub(crate) fn cache_for(pool: &Arc<PoolInner>, stream: &Arc<StreamState>) -> Option<Rc<ThreadCache>> {
    if crate::device::in_host_fn() {
        return None;
    }
    let p = Arc::as_ptr(pool);
    let id = stream.stream.id();
    let tc = LOCAL
        .try_with(|l| {
            if let Some(tc) = l.find_rc(p, id) {
                return tc;
            }
            l.drop_destroyed();
            let tc = Rc::new(ThreadCache::new(pool, stream));
            l.entries.borrow_mut().push(Entry { pool: p, stream: id, tc: Rc::clone(&tc) });
            tc
        })
        .ok()?;
    MEMO.try_with(|m| m.remember(p, id, Rc::as_ptr(&tc))).ok()?;
    Some(tc)
}

/// Whether the calling thread holds a cache for `stream` of `pool`: it allocates there, so
/// it most likely launches its work there too, and an event it records there does not wait
/// behind another thread's launches (`PoolInner::hurry`). False while its list of caches is
/// being changed (a cache being dropped may flush into the ladder).
pub(crate) fn holds_cache_for(pool: &PoolInner, stream: StreamId) -> bool {
    let p: *const PoolInner = pool;
    LOCAL
        .try_with(|l| l.entries.try_borrow().is_ok_and(|e| e.iter().any(|e| e.pool == p && e.stream == stream)))
        .unwrap_or(false)
}

/// The calling thread's [`StreamCache`] for `stream`.
pub(crate) fn stream_cache(pool: &Arc<PoolInner>, stream: &Arc<StreamState>) -> Option<StreamCache> {
    cache_for(pool, stream).map(|tc| StreamCache { tc })
}

/// Allocate through the calling thread's cache for `stream`; without a cache (this thread's
/// thread-locals are gone: it is exiting; or it runs a host function), straight from the
/// arena. The same hit path as [`ThreadCache::alloc`] ([`alloc_through`]), with the cache
/// found through the memo.
#[inline(always)]
#[track_caller]
pub(crate) fn alloc(pool: &Arc<PoolInner>, stream: &Stream, bytes: usize) -> Result<Block> {
    let (p, id, site) = (Arc::as_ptr(pool), stream.id(), Location::caller());
    // The cache's shared part straight from the memo: the hit needs nothing else of the
    // cache (one dependent load fewer before it can start).
    let shared = || {
        let shared = MEMO.try_with(|m| m.find_shared(p, id).map(|s| s as *const CacheShared)).ok()??;
        // SAFETY: the memo names a cache a live entry of this thread holds (see `Memo`), and
        // the hit path removes no entry.
        Some(unsafe { &*shared })
    };
    alloc_through(NonNull::from(&**pool), id, bytes, shared, |class| alloc_slow(pool, stream, bytes, class, site))
}

/// The allocation hit path both entry points share: the block of `bytes`' class (or a
/// larger one within reach) from `shared()`'s loaded magazines, else `cold(class)`; both meet
/// on where the block is ([`Placed`]), and the block of `pool` for `stream` is built once,
/// after. A class past the pool's cached ones has no magazines, so it misses here.
#[inline(always)]
fn alloc_through<'a>(
    pool: NonNull<PoolInner>,
    stream: StreamId,
    bytes: usize,
    shared: impl FnOnce() -> Option<&'a CacheShared>,
    cold: impl FnOnce(Option<usize>) -> Result<Placed>,
) -> Result<Block> {
    let class = class::class_of(bytes as u64);
    let at = match class.and_then(|c| pop_hit(shared()?, c)) {
        Some(at) => at,
        None => cold(class)?,
    };
    Ok(Block::new(pool, stream, bytes, at))
}

/// The hit path alone, for the C ABI's: a block of `bytes`'s class (or a larger one within
/// reach) from `shared`'s loaded magazines, as (address, size-and-class word); None where
/// the cache's whole path would go further (nothing is done then).
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn try_alloc_hit(shared: &CacheShared, bytes: usize) -> Option<(u64, u64)> {
    let at = pop_hit(shared, class::class_of(bytes as u64)?)?;
    Some((at.addr, at.size_class))
}

/// A block of `class` (or a larger one within reach) from `shared`'s loaded magazines.
#[inline(always)]
fn pop_hit(shared: &CacheShared, class: usize) -> Option<Placed> {
    shared.try_pop_fast(class, class::size_of_class(class)).map(Placed::taken)
}

/// Everything [`alloc`]'s hit path does not do: find (or make) the cache, then its cold path.
#[cold]
#[inline(never)]
fn alloc_slow(
    pool: &Arc<PoolInner>,
    stream: &Stream,
    bytes: usize,
    class: Option<usize>,
    site: &'static Location,
) -> Result<Placed> {
    pool.with_handler(|| match find(pool, stream.id(), || pool.stream_state(stream).ok()) {
        // SAFETY: `find` names a cache a live entry of this thread holds, and nothing the
        // allocation reaches removes entries (see `Memo`): the out-of-memory handler, which
        // may, runs only once this reference is dead (between attempts), and the next
        // attempt finds the cache again.
        Some(tc) => unsafe { &*tc }.alloc_cold(bytes, class, site),
        None => pool.alloc_uncached(bytes, &pool.stream_state(stream)?, None, site),
    })
}

/// This thread's cache for (`pool`, `stream`): the memo's, else found among the entries or
/// made for `state()` (the stream's state, if it may still get a cache), and remembered.
/// None where this thread can have no cache (thread-locals gone, inside a host function,
/// no such stream).
#[cold]
#[inline(never)]
fn find(
    pool: &Arc<PoolInner>,
    stream: StreamId,
    state: impl FnOnce() -> Option<Arc<StreamState>>,
) -> Option<*const ThreadCache> {
    let p = Arc::as_ptr(pool);
    if let Ok(Some(tc)) = MEMO.try_with(|m| m.find(p, stream).map(|tc| tc as *const ThreadCache)) {
        return Some(tc);
    }
    let tc = match LOCAL.try_with(|l| l.find_rc(p, stream)).ok()? {
        Some(tc) => tc,
        None => cache_for(pool, &state()?)?,
    };
    MEMO.try_with(|m| m.remember(p, stream, Rc::as_ptr(&tc))).ok()?;
    // The entry holds the cache on: the pointer outlives this `Rc`.
    Some(Rc::as_ptr(&tc))
}

/// Free `block` into the calling thread's cache for its stream, if the thread-local memo
/// names that cache and its hit path takes the block: a leaf, with no call, so the block's
/// drop keeps its fast path free of register saves. False: the caller takes [`free_slow`].
#[inline(always)]
pub(crate) fn try_free_fast(pool: NonNull<PoolInner>, block: &Block) -> bool {
    let p = pool.as_ptr() as *const PoolInner;
    MEMO.try_with(|m| match m.find_shared(p, block.stream) {
        Some(shared) => shared.try_push_fast(block.class() as usize, block.size(), block.addr),
        None => false,
    })
    .unwrap_or(false)
}

/// Free `block` (of a cached class) into the calling thread's cache for its stream, by the
/// whole path. False if that is not possible here (thread-locals gone, stream unknown or
/// destroyed): the caller retires the block instead.
#[cold]
#[inline(never)]
pub(crate) fn free_slow(pool: NonNull<PoolInner>, block: &Block) -> bool {
    debug_assert!(block.class() != NO_CLASS);
    let p = pool.as_ptr() as *const PoolInner;
    // The memo's cache (its magazine was full, or a thief held it): no pool count to take.
    if let Ok(Some(())) =
        MEMO.try_with(|m| m.find(p, block.stream).map(|tc| tc.free(block.class() as usize, block.size(), block.addr)))
    {
        return true;
    }
    // SAFETY: the pool's state outlives every block (see `Pool`'s drop), so a strong count
    // is held by someone: taking one more is sound.
    let arc = unsafe {
        Arc::increment_strong_count(p);
        Arc::from_raw(p)
    };
    let state = || arc.state_by_id(block.stream).filter(|st| !st.destroyed.load(Ordering::Acquire));
    match find(&arc, block.stream, state) {
        Some(tc) => {
            // SAFETY: as in `alloc_slow`.
            unsafe { &*tc }.free(block.class() as usize, block.size(), block.addr);
            true
        }
        None => false,
    }
}

/// Drop this thread's caches of `pool` (their blocks go to the depots or retire).
pub(crate) fn flush(pool: &PoolInner) {
    let p = pool as *const PoolInner;
    let _ = MEMO.try_with(Memo::forget);
    let _ = LOCAL.try_with(|l| {
        // Caches a `StreamCache` still holds stay registered (so the thread keeps one cache
        // per stream) but give their blocks back like the others.
        let mine: Vec<Entry> = {
            let mut entries = l.entries.borrow_mut();
            let (mine, rest): (Vec<Entry>, Vec<Entry>) =
                entries.drain(..).partition(|e| e.pool == p && Rc::strong_count(&e.tc) == 1);
            *entries = rest;
            for e in entries.iter().filter(|e| e.pool == p) {
                e.tc.flush(true);
            }
            mine
        };
        drop(mine);
    });
}
