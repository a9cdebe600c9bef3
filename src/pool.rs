//! The pool: [`Pool`], [`PoolConfig`], [`Block`], and the out-of-memory ladder.
//!
//! A pool owns one reserved address range of its device, the lock-free buddy [`Arena`]
//! over it, the [`PageMap`] that maps physical pages under it on demand, and one
//! [`StreamRetire`] per stream it has seen.
//!
//! **Alloc** on stream S: a block freed on S and still in S's open batch is reused at once
//! (stream order protects it); else the arena serves the request *without mapping*; else the
//! ladder runs: poll every stream's retire queue → close every open batch (one event each) and
//! poll → map more pages under `max_reserved` → wait on the oldest pending events, one by one,
//! polling after each → unmap wholly free pages and map again → only then
//! [`Error::OutOfMemory`] with the figures.
//!
//! **Free** (dropping a [`Block`]) pushes the block onto its stream's open batch — never a
//! device call on its own — and closes the batch (records one event) once it holds
//! `batch_blocks` blocks or `batch_bytes` bytes. A block that was used on other streams
//! (`record_stream`) is queued behind one event per stream it was used on. Frees inside host
//! functions, where no device call is allowed, leave the batch open, and a later slow path
//! closes it.
//!
//! No lock anywhere: the arena and page map are CAS walks, the retire queues are a Treiber
//! stack and a Michael–Scott queue, and the stream registry is published with arc-swap.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};

use arc_swap::ArcSwap;

use crate::arena::{Acquire, Arena, PageMap};
use crate::device::{Device, Event, Stream, StreamId};
use crate::error::{Error, Result};
use crate::reclaim::{Span, StreamRetire};
use crate::stats::{Counters, Stats};
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::epoch;

/// Device addresses and sizes are multiples of this.
pub const ALIGN: u64 = 256;

/// How a pool behaves. `Default` gives what most servers want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Most physical memory the pool may map, in bytes. `None`: 80% of the device's memory.
    pub max_reserved: Option<u64>,
    /// Free mapped bytes kept between trims; past it, wholly free pages are unmapped as
    /// batches retire (as `cudaMemPoolAttrReleaseThreshold`). `u64::MAX`: keep everything.
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
            break_event_guard_for_tests: false,
        }
    }
}

/// A stream-ordered pool of device memory. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

/// What the pool knows of one stream.
struct StreamState {
    stream: Stream,
    retire: StreamRetire<Event>,
    /// Set once the stream is destroyed: frees then queue behind its final event.
    destroyed: AtomicBool,
}

struct PoolInner {
    device: Arc<dyn Device>,
    config: PoolConfig,
    max_reserved: u64,
    base: u64,
    range: u64,
    arena: Arena,
    pages: PageMap,
    /// Mapped bytes plus bytes being mapped: the budget checked against `max_reserved`.
    map_budget: AtomicU64,
    streams: ArcSwap<HashMap<StreamId, Arc<StreamState>>>,
    /// Destroyed streams whose batches have not all retired yet.
    orphans: ArcSwap<Vec<Arc<StreamState>>>,
    /// Blocks used on several streams, each behind one event per stream.
    cross: StreamRetire<Vec<Event>>,
    /// `record_stream` blocks dropped where no device call is allowed, waiting for a slow
    /// path to record their events.
    deferred_cross: crate::reclaim::Stack<(Span, Vec<Stream>)>,
    counters: Counters,
}

/// A block of device memory from a [`Pool`]. Dropping it frees it in stream order on its
/// stream. `Send`, not `Sync`: one thread at a time holds it; it may be dropped on any thread.
pub struct Block {
    addr: u64,
    len: usize,
    size: u64,
    stream: Option<Arc<StreamState>>,
    pool: Option<Arc<PoolInner>>,
    /// Other streams the block was used on (`record_stream`).
    used_on: std::cell::RefCell<Vec<Stream>>,
}

impl Block {
    /// The device address (aligned to 256 bytes; 0 for an empty block).
    pub fn device_ptr(&self) -> u64 {
        self.addr
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block is empty (a zero-byte request).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes usable at [`Block::device_ptr`] (at least [`Block::len`]).
    pub fn capacity(&self) -> usize {
        self.size as usize
    }

    /// The stream the block was allocated on, and will be freed on.
    pub fn stream(&self) -> Option<&Stream> {
        self.stream.as_ref().map(|s| &s.stream)
    }

    /// Say that the block was also used on `other`: its free then waits for the work
    /// enqueued on `other` before the free, as well as its own stream's.
    pub fn record_stream(&self, other: &Stream) {
        if self.stream().is_none_or(|s| s == other) {
            return;
        }
        let mut used = self.used_on.borrow_mut();
        if !used.iter().any(|s| s == other) {
            used.push(other.clone());
        }
    }
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("ptr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("capacity", &self.size)
            .field("stream", &self.stream().map(Stream::id))
            .finish()
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let (Some(pool), Some(st)) = (self.pool.take(), self.stream.take()) else { return };
        let used_on = std::mem::take(self.used_on.get_mut());
        pool.free(Span { addr: self.addr, size: self.size }, &st, used_on);
    }
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
        if config.batch_blocks == 0 {
            return Err(Error::InvalidArgument("batch_blocks must be at least 1".into()));
        }
        let max_reserved = config.max_reserved.unwrap_or(total / 10 * 8);
        let want = config.address_range.unwrap_or(total.saturating_mul(4)).max(max_reserved).max(g);
        let range = want
            .checked_next_power_of_two()
            .ok_or_else(|| Error::InvalidArgument(format!("address range {want} is too large")))?;
        let base = device.reserve(range)?;
        let arena = match Arena::new(base, range) {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: nothing was ever mapped in the range just reserved.
                let _ = unsafe { device.release(base, range) };
                return Err(e);
            }
        };
        let pages = match PageMap::new(base, range, g) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: nothing was ever mapped in the range just reserved.
                let _ = unsafe { device.release(base, range) };
                return Err(e);
            }
        };
        Ok(Pool {
            inner: Arc::new(PoolInner {
                device,
                config,
                max_reserved,
                base,
                range,
                arena,
                pages,
                map_budget: AtomicU64::new(0),
                streams: ArcSwap::from_pointee(HashMap::new()),
                orphans: ArcSwap::from_pointee(Vec::new()),
                cross: StreamRetire::new(),
                deferred_cross: crate::reclaim::Stack::new(),
                counters: Counters::default(),
            }),
        })
    }

    /// The device the pool allocates from.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// The most physical memory the pool may map.
    pub fn max_reserved(&self) -> u64 {
        self.inner.max_reserved
    }

    /// Allocate `bytes` for use on `stream`: work enqueued on `stream` after this call may
    /// use the block. A zero-byte request gives an empty block.
    pub fn alloc(&self, bytes: usize, stream: &Stream) -> Result<Block> {
        self.inner.alloc(bytes, stream)
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

    /// Check that every mapped byte is accounted for (invariant 3 of the design) and that
    /// the page map agrees with the arena. Exact when the pool is quiet.
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
    fn alloc(self: &Arc<Self>, bytes: usize, stream: &Stream) -> Result<Block> {
        let st = self.stream_state(stream)?;
        if bytes == 0 {
            return Ok(Block { addr: 0, len: 0, size: 0, stream: Some(st), pool: None, used_on: Default::default() });
        }
        let limit = self.max_reserved.min(self.range);
        let size = (bytes as u64).checked_next_multiple_of(ALIGN).filter(|&s| s <= limit);
        let Some(size) = size else { return Err(Error::TooLarge { requested: bytes as u64, limit }) };
        if self.device.is_capturing(stream)? {
            // Memory handed out during capture would be used whenever the graph replays; it
            // is refused rather than silently shared with work outside the graph.
            return Err(Error::StreamCapturing);
        }
        let slack = self.config.reuse_slack_div;
        let max_fit = size + size.checked_div(slack).unwrap_or(0);
        let addr = match st.retire.reuse(|s| s.size >= size && s.size <= max_fit) {
            Some(span) => {
                Counters::bump(&self.counters.same_stream_reuses, 1);
                // The reused block may be larger than asked: keep its size, so the arena gets
                // back exactly what it gave.
                return Ok(self.block(span.addr, bytes, span.size, st));
            }
            None => self.alloc_arena(size, bytes)?,
        };
        Ok(self.block(addr, bytes, size, st))
    }

    fn block(self: &Arc<Self>, addr: u64, len: usize, size: u64, st: Arc<StreamState>) -> Block {
        self.counters.on_alloc(size);
        Block { addr, len, size, stream: Some(st), pool: Some(Arc::clone(self)), used_on: Default::default() }
    }

    /// The ladder. Every rung that frees memory is followed by another try of the arena.
    fn alloc_arena(&self, size: u64, requested: usize) -> Result<u64> {
        if let Some(a) = self.try_arena(size, Mapping::Forbidden)? {
            return Ok(a);
        }
        self.drain_deferred();
        if self.poll_all() > 0 {
            if let Some(a) = self.try_arena(size, Mapping::Forbidden)? {
                return Ok(a);
            }
        }
        self.close_all();
        // Batches just closed on an idle stream complete within microseconds: polling them
        // for a bounded time costs less than mapping a page (~40 µs on an H200) and keeps the
        // memory figure down. A busy stream's batches are left for the wait rung.
        let deadline = std::time::Instant::now() + self.config.poll_before_map;
        loop {
            if self.poll_all() > 0 {
                if let Some(a) = self.try_arena(size, Mapping::Forbidden)? {
                    return Ok(a);
                }
            }
            if self.retiring_bytes() < size || std::time::Instant::now() >= deadline {
                break;
            }
            crate::sync::yield_now();
        }
        Counters::bump(&self.counters.ladder_maps, 1);
        if let Some(a) = self.try_arena(size, Mapping::Allowed)? {
            return Ok(a);
        }
        // Wait for the oldest pending event, one at a time, so the pool waits no longer than
        // it must; a stress run whose streams lag behind the host waits here, not fails.
        // Other threads keep closing batches while this one waits: close again before each
        // wait, so the loop ends only when nothing at all is left retiring or open.
        while {
            self.close_all();
            self.wait_oldest()
        } {
            Counters::bump(&self.counters.ladder_waits, 1);
            self.poll_all();
            if let Some(a) = self.try_arena(size, Mapping::Allowed)? {
                return Ok(a);
            }
        }
        // Free pages mapped where the request does not fit hold budget it could use.
        self.unmap_free(0);
        if let Some(a) = self.try_arena(size, Mapping::Allowed)? {
            return Ok(a);
        }
        Counters::bump(&self.counters.ooms, 1);
        let st = self.stats();
        Err(Error::OutOfMemory {
            requested: requested as u64,
            reserved: st.reserved_bytes,
            allocated: st.allocated_bytes,
            cached: st.cached_bytes,
            retiring: st.retiring_bytes,
            largest_free: st.largest_free_block,
            max_reserved: self.max_reserved,
        })
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
                    Acquire::Failed(Error::OutOfMemory { .. }) | Acquire::Failed(Error::Device { code: 2, .. }) => {
                        Ok(None)
                    }
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
            return Err(Error::OutOfMemory {
                requested: len64,
                reserved: before,
                allocated: 0,
                cached: 0,
                retiring: 0,
                largest_free: 0,
                max_reserved: self.max_reserved,
            });
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

    fn stream_state(self: &Arc<Self>, stream: &Stream) -> Result<Arc<StreamState>> {
        if let Some(st) = self.streams.load().get(&stream.id()) {
            return Ok(Arc::clone(st));
        }
        if stream.is_destroyed() {
            return Err(Error::StreamDestroyed);
        }
        let fresh = Arc::new(StreamState {
            stream: stream.clone(),
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
        st.destroyed.store(true, Ordering::Release);
        let guard = epoch::pin();
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

    fn free(&self, span: Span, st: &Arc<StreamState>, used_on: Vec<Stream>) {
        self.counters.on_free(span.size);
        if !used_on.is_empty() {
            self.free_cross(span, st, used_on);
            return;
        }
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
        let done = |st: &Arc<StreamState>| !st.retire.has_pending(guard) && Arc::strong_count(st) <= 2;
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

    fn retiring_bytes(&self) -> u64 {
        self.states().iter().map(|st| st.retire.pending_bytes()).sum::<u64>() + self.cross.pending_bytes()
    }

    fn stats(&self) -> Stats {
        let c = &self.counters;
        let (mut cached, mut retiring) = (0, self.cross.pending_bytes());
        for st in self.states() {
            cached += st.retire.open_bytes();
            retiring += st.retire.pending_bytes();
        }
        Stats {
            allocated_bytes: Counters::get(&c.allocated),
            reserved_bytes: self.pages.mapped_bytes(),
            peak_allocated_bytes: Counters::get(&c.peak_allocated),
            peak_reserved_bytes: self.pages.peak_mapped_bytes(),
            cached_bytes: cached,
            retiring_bytes: retiring,
            live_blocks: Counters::get(&c.live_blocks),
            allocs: Counters::get(&c.allocs),
            same_stream_reuses: Counters::get(&c.same_stream_reuses),
            events_recorded: Counters::get(&c.events_recorded),
            batches_retired: Counters::get(&c.batches_retired),
            ladder_maps: Counters::get(&c.ladder_maps),
            ladder_waits: Counters::get(&c.ladder_waits),
            ooms: Counters::get(&c.ooms),
            unmapped_bytes: Counters::get(&c.unmapped),
            largest_free_block: self.arena.largest_free(),
            arena_free_bytes: self.arena.free_bytes(),
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
        for w in free.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return broken(format!("free pieces {:#x}+{} and {:#x} overlap", w[0].0, w[0].1, w[1].0));
            }
        }
        let held = self.range - free_total;
        let in_tiers = st.allocated_bytes + st.cached_bytes + st.retiring_bytes;
        if held != in_tiers {
            return broken(format!(
                "arena holds {held} B out, but live {} + cached {} + retiring {} = {in_tiers}",
                st.allocated_bytes, st.cached_bytes, st.retiring_bytes
            ));
        }
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
