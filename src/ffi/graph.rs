//! CUDA graph pools: the memory a graph capture allocates, kept apart from every other
//! allocation until the graph is released (PyTorch's private pools, which PyTorch opens with
//! `beginAllocateToPool` before `cudaStreamBeginCapture` and closes with
//! `endAllocateToPool` after `cudaStreamEndCapture`; `releasePool` when the graph is reset).
//!
//! **Why apart.** A graph keeps the addresses it captured and touches them on every replay,
//! on whatever stream the replay is launched, long after the capture's tensors were freed.
//! So memory a capture allocated may serve later captures into the same pool (graphs that
//! share a pool replay in capture order: PyTorch's rule), but nothing else until the pool is
//! released and no replay can still be running.
//!
//! **What it owns.** One [`GraphPool`] per (device, pool id) opened and not yet finished:
//! its own [`Pool`] on the device (its own address range and pages, so invariant 1 needs no
//! check on any path of the main pool), one internal stream every block of it is allocated
//! and freed on (never given work: stream order inside the pool is the graph's capture
//! order), and the pool's live blocks by address (the C ABI frees by address).
//!
//! **Invariants.**
//! 1. A block allocated into pool P is never handed to an allocation outside P.
//! 2. A block given to `vrampool_record_stream` while in P is not reused, even in P, until P
//!    finishes (its other stream's uses are part of some graph, whose replays vrampool
//!    cannot fence; PyTorch's private pools defer such blocks the same way). So is every
//!    block freed once P has served more than one capturing stream: the pool's one internal
//!    stream would order two branches of a graph that the graph does not order.
//! 3. P's memory goes back to the device only once every graph that used it was released
//!    (one `vrampool_release_pool` per `vrampool_begin_allocate_to_pool`: graphs may share a
//!    pool, and a graph replays its memory whether or not its tensors are alive), every
//!    block of it was freed, no capture is underway anywhere (a device-wide synchronize would
//!    fail on a capturing stream), and the device was synchronized (a replay may be running
//!    on any stream); and then only at `vrampool_empty_cache` or when an allocation runs out
//!    of memory, as PyTorch gives a released private pool back only then. Sooner is wrong: a tensor of a
//!    released pool may be read by a later capture and freed during it (PyTorch's
//!    `test_graph_capture_reset_recapture` does), and that graph replays into it; giving the
//!    pool back as that capture ended faulted the replay on an H200.
//! 4. No page of P is unmapped, or its memory lent to another address, before P finishes:
//!    a graph writes the addresses it captured on every replay, also those whose tensors
//!    were freed since (P's pool keeps every page it mapped: no release threshold, no page
//!    trades).
//!
//! **Locks.** One mutex per pool and one for the list of pools: both off the ordinary
//! allocation and free paths, which reach this module only for a pointer their device's
//! table does not know (the list is read through a lock-free snapshot there).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use arc_swap::ArcSwap;

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::registry;
use crate::{Block, Pool};

/// PyTorch's `MempoolId_t`: a pair of integers (a graph's own pool `(id, 0)`, a user's
/// `torch.cuda.MemPool` `(0, id)`).
pub(crate) type PoolId = (u64, u64);

/// A live block of a graph pool.
struct Held {
    block: Block,
    /// Bytes asked for, and the stream handle passed: a free must name both.
    len: u64,
    raw: u64,
    /// Given to `vrampool_record_stream`: parked at its free (invariant 2).
    shared: bool,
}

#[derive(Default)]
struct State {
    live: HashMap<u64, Held>,
    parked: Vec<Block>,
    /// The capturing streams' handles it served (invariant 2).
    streams: HashSet<u64>,
    /// Captures into this pool begun and not yet ended.
    capturing: usize,
    /// Captures begun and not yet released: the graphs that use the pool.
    users: usize,
    released: bool,
    finished: bool,
}

/// One graph pool (module docs).
pub(crate) struct GraphPool {
    device: usize,
    id: PoolId,
    pool: Pool,
    stream: Stream,
    state: Mutex<State>,
}

impl GraphPool {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn holds(&self, addr: u64) -> bool {
        let (base, bytes) = self.pool.address_range();
        addr.wrapping_sub(base) < bytes
    }

    /// Whether every condition of invariant 3 but the synchronize holds.
    fn can_finish(s: &State) -> bool {
        s.released && !s.finished && s.live.is_empty() && s.capturing == 0 && !registry::captures_underway()
    }
}

/// Pools opened and not finished; changed under `LIST`, read through `SNAPSHOT`.
static LIST: Mutex<Vec<Arc<GraphPool>>> = Mutex::new(Vec::new());
static SNAPSHOT: OnceLock<ArcSwap<Vec<Arc<GraphPool>>>> = OnceLock::new();

fn snapshot() -> &'static ArcSwap<Vec<Arc<GraphPool>>> {
    SNAPSHOT.get_or_init(|| ArcSwap::from_pointee(Vec::new()))
}

fn list() -> MutexGuard<'static, Vec<Arc<GraphPool>>> {
    LIST.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pool `id` of `device` not yet finished, preferring the open (not released) one: a
/// released pool waiting to be given back and a new one of the same id may both be there.
fn find_pool(device: usize, id: PoolId, open_only: bool) -> Option<Arc<GraphPool>> {
    let pools = snapshot().load();
    let mut named = pools.iter().filter(|p| p.device == device && p.id == id);
    let open = named.clone().find(|p| !p.state().released);
    open.or_else(|| if open_only { None } else { named.next() }).cloned()
}

/// The open (not released) pool `id` of `device`.
fn open_pool(device: usize, id: PoolId) -> Option<Arc<GraphPool>> {
    find_pool(device, id, true)
}

/// The pool whose address range holds `addr`.
fn pool_holding(addr: u64) -> Option<Arc<GraphPool>> {
    snapshot().load().iter().find(|p| p.holds(addr)).cloned()
}

/// Open pool `id` on `device` (or join it: graphs may share a pool) for a capture: until
/// [`end`], [`malloc`] serves it.
pub(crate) fn begin(device: usize, id: PoolId) -> Result<()> {
    // Under the list's lock: the snapshot changes only under it.
    let mut pools = list();
    let pool = match open_pool(device, id) {
        Some(p) => p,
        None => {
            let abi = super::device::get(device)?;
            let dev = Arc::clone(abi.entry.pool.device());
            let mut config = registry::config()?.pool.clone();
            // Its own range, the least a pool takes (twice its limit), and no floor: graph
            // pools come and go with their graphs.
            let limit = config.max_reserved.unwrap_or(dev.total_memory() / 10 * 8);
            config.address_range = Some(limit.saturating_mul(2));
            config.preallocate = 0;
            // The device's trace is the registry pool's file; a graph pool's blocks are not
            // in it (a second writer would truncate it).
            config.record_trace = None;
            // A graph replays into memory its tensors freed: no page of the pool may be
            // unmapped or lent elsewhere before the pool finishes (invariant 4).
            config.trade_pages_on_map = false;
            config.release_threshold = u64::MAX;
            let pool = Pool::with_device(Arc::clone(&dev), config)?;
            let stream = dev.create_stream()?;
            let p = Arc::new(GraphPool { device, id, pool, stream, state: Mutex::new(State::default()) });
            pools.push(Arc::clone(&p));
            snapshot().store(Arc::new(pools.clone()));
            p
        }
    };
    {
        let mut s = pool.state();
        s.capturing += 1;
        s.users += 1;
    }
    registry::capture_began();
    Ok(())
}

/// The capture into pool `id` that [`begin`] opened has ended: later allocations go to the
/// ordinary pools again. Pools released meanwhile finish once no capture is underway.
pub(crate) fn end(device: usize, id: PoolId) -> Result<()> {
    let pool = find_pool(device, id, false).ok_or_else(|| unknown(device, id))?;
    {
        let mut s = pool.state();
        if s.capturing == 0 {
            return Err(Error::InvalidArgument(format!(
                "graph pool ({}, {}) of device {device}: no capture into it is underway",
                id.0, id.1
            )));
        }
        s.capturing -= 1;
    }
    registry::capture_ended();
    Ok(())
}

/// Allocate `size` bytes in open pool `id` for the capture on handle `raw`.
pub(crate) fn malloc(size: usize, device: usize, raw: u64, id: PoolId) -> Result<u64> {
    let pool = open_pool(device, id).ok_or_else(|| unknown(device, id))?;
    let block = pool.pool.alloc(size, &pool.stream)?;
    let addr = block.device_ptr();
    let mut s = pool.state();
    s.streams.insert(raw);
    s.live.insert(addr, Held { block, len: size as u64, raw, shared: false });
    Ok(addr)
}

/// What a free freed: the bytes asked for, the stream handle and the device of its
/// allocation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Freed {
    pub len: u64,
    pub raw: u64,
    pub device: usize,
}

/// How a free of a graph pool's pointer went wrong.
pub(crate) enum FreeRefusal {
    /// No live block of the pool starts there (a double free or an interior pointer).
    NotLive,
    /// A live block, allocated with this size and stream handle.
    Mismatch { len: u64, raw: u64 },
}

/// Free `addr` if a graph pool holds it and it is what `expect` says (bytes asked for and
/// stream handle; `None`: whatever they were): `None` if no pool holds it (the pointer is
/// not this module's), else what it was or why it was refused. A refused free changes
/// nothing.
pub(crate) fn free(addr: u64, expect: Option<(u64, u64)>) -> Option<std::result::Result<Freed, FreeRefusal>> {
    let pool = pool_holding(addr)?;
    let (was, block) = {
        let mut s = pool.state();
        let Some(h) = s.live.remove(&addr) else { return Some(Err(FreeRefusal::NotLive)) };
        if expect.is_some_and(|(size, raw)| h.len != size || h.raw != raw) {
            let why = FreeRefusal::Mismatch { len: h.len, raw: h.raw };
            s.live.insert(addr, h);
            return Some(Err(why));
        }
        let was = Freed { len: h.len, raw: h.raw, device: pool.device };
        if h.shared || s.streams.len() > 1 {
            s.parked.push(h.block);
            (was, None)
        } else {
            (was, Some(h.block))
        }
    };
    // Outside the lock: the pool's free may close a batch (a device call).
    drop(block);
    Some(Ok(was))
}

/// Mark `addr`'s block as used on another stream (invariant 2), if a graph pool holds it.
pub(crate) fn record_stream(addr: u64) -> Option<bool> {
    let pool = pool_holding(addr)?;
    let mut s = pool.state();
    Some(match s.live.get_mut(&addr) {
        Some(h) => {
            h.shared = true;
            true
        }
        None => false,
    })
}

/// A graph that used pool `id` is gone: once every graph that used it is, its memory goes
/// back at the first [`finish_ready`] after every block is freed (invariant 3).
pub(crate) fn release(device: usize, id: PoolId) -> Result<()> {
    let pool = open_pool(device, id).ok_or_else(|| unknown(device, id))?;
    let mut s = pool.state();
    s.users = s.users.saturating_sub(1);
    s.released = s.users == 0;
    Ok(())
}

/// Whether [`finish_ready`] would give a pool back now.
pub(crate) fn finishable() -> bool {
    snapshot().load().iter().any(|p| GraphPool::can_finish(&p.state()))
}

/// Give back every released pool whose blocks are all freed, if no capture is underway
/// (`vrampool_empty_cache`, and an allocation out of memory before it tries again).
pub(crate) fn finish_ready() -> Result<()> {
    let ready: Vec<_> = snapshot().load().iter().filter(|p| GraphPool::can_finish(&p.state())).cloned().collect();
    ready.iter().try_for_each(finish)
}

/// Give pool `p`'s memory back (invariant 3): synchronize the device, then trim.
fn finish(p: &Arc<GraphPool>) -> Result<()> {
    p.pool.device().synchronize_device()?;
    let parked = {
        let mut s = p.state();
        if !GraphPool::can_finish(&s) {
            return Ok(()); // a capture began, or another thread finished it, meanwhile
        }
        s.finished = true;
        std::mem::take(&mut s.parked)
    };
    drop(parked);
    {
        let mut pools = list();
        pools.retain(|q| !Arc::ptr_eq(q, p));
        snapshot().store(Arc::new(pools.clone()));
    }
    // Every block is back and the device is idle: trim gives every page back; the pool's
    // range goes when its last handle drops.
    p.pool.trim()
}

fn unknown(device: usize, id: PoolId) -> Error {
    Error::InvalidArgument(format!(
        "graph pool ({}, {}) of device {device} is not open: vrampool_begin_allocate_to_pool first",
        id.0, id.1
    ))
}

/// A graph pool's memory for `vrampool_snapshot`: its id, its pool's picture, and its live
/// blocks as (address, bytes held, bytes asked for, stream handle), lowest first.
pub(crate) struct Picture {
    pub(crate) id: PoolId,
    pub(crate) snapshot: crate::Snapshot,
    pub(crate) live: Vec<(u64, u64, u64, u64)>,
}

/// Device `device`'s graph pools not finished, each as a [`Picture`].
pub(crate) fn pictures(device: usize) -> Vec<Picture> {
    let pools = snapshot().load();
    pools
        .iter()
        .filter(|p| p.device == device)
        .map(|p| {
            // Two reads, not one: a block allocated or freed between them shows as live
            // memory of no known block, or as the free memory it is (blocks only cut live
            // extents).
            let mut live: Vec<_> =
                p.state().live.iter().map(|(&a, h)| (a, h.block.capacity() as u64, h.len, h.raw)).collect();
            live.sort_unstable();
            Picture { id: p.id, snapshot: p.pool.snapshot(), live }
        })
        .collect()
}

/// Device `device`'s graph pools not finished, as (live blocks, bytes reserved) each: for
/// the statistics.
pub(crate) fn pools(device: usize) -> Vec<(usize, u64)> {
    let pools = snapshot().load();
    pools.iter().filter(|p| p.device == device).map(|p| (p.state().live.len(), p.pool.stats().reserved_bytes)).collect()
}
