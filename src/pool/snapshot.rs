//! [`Pool::snapshot`]: every segment of mapped memory and every stretch of it, with its
//! state — live, cached, retiring or free — for pictures, reports and leak hunts.
//!
//! **Inferred from the tiers**, as [`PoolInner::check`] walks them: a byte on a mapped page
//! is *free* when an arena holds it (the space's free runs, a stream's free pieces),
//! *cached* when a thread cache or a depot does, *retiring* when it is a `record_stream`
//! block waiting for its events, and *live* otherwise: the pool keeps no record of its live
//! blocks on the hit path, so live memory is what is mapped and in no tier. Adjacent live
//! blocks therefore show as one live extent, with the stream that holds the chunk they lie
//! in (small blocks) or no stream (large blocks). With [`PoolConfig::track_sites`] every
//! live block is its own extent, with its stream, the bytes asked for and its site.
//!
//! **Exact when the pool is quiet.** The walk reads lock-free structures while other
//! threads may change them; a thread cache is read through the handshake, waiting for its
//! owner to end the operation it is in (the owner's next operation waits while the walk
//! reads the magazines); an owner still inside after a while makes [`Snapshot::exact`]
//! false. A hit path is held up at most while one cache's magazines are read.
//!
//! [`PoolConfig::track_sites`]: super::PoolConfig::track_sites

use std::collections::HashMap;

use serde::Serialize;

use super::{Pool, PoolInner};
use crate::arena::CHUNK;
use crate::class;
use crate::device::StreamId;
use crate::stats::Stats;
use crate::sync::epoch;

/// How long the walk waits for a thread cache's owner to leave the operation it is in (one
/// that waits on the device, in the out-of-memory ladder, can take this long) before the
/// picture gives up on that cache.
const STEAL_PATIENCE: std::time::Duration = std::time::Duration::from_millis(20);

/// What a stretch of mapped memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockState {
    /// In a block the application holds.
    Live,
    /// Free, in a thread cache or a stream depot: reusable at once on its stream.
    Cached,
    /// Freed, used on several streams (`record_stream`), waiting for their events.
    Retiring,
    /// Free in the arena (mapped, holding no block).
    Free,
}

/// A stretch of mapped memory in one state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Extent {
    /// Device address.
    pub addr: u64,
    /// Bytes.
    pub bytes: u64,
    /// What it is.
    pub state: BlockState,
    /// The stream it belongs to, where the pool can tell: a cached block's stream, and the
    /// stream holding the chunk of a small block (live or free); with `track_sites`, every
    /// live block's.
    pub stream: Option<StreamId>,
    /// With `track_sites`, for a live block: bytes asked for (`bytes` is what it holds).
    pub requested: Option<u64>,
    /// With `track_sites`, for a live block: where it was allocated (`file:line:column`).
    pub site: Option<String>,
}

/// A run of mapped pages, cut into extents that cover it exactly, lowest address first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Segment {
    /// First address.
    pub addr: u64,
    /// Bytes mapped.
    pub bytes: u64,
    /// The extents, end to end.
    pub extents: Vec<Extent>,
}

/// A picture of a pool's memory: see [`Pool::snapshot`].
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// The device's name.
    pub device: String,
    /// Bytes per mapped page.
    pub page_size: u64,
    /// False if some thread cache could not be read (its owner stayed inside one operation
    /// for longer than the walk waits, 20 ms: one waiting on the device): its blocks then
    /// show as live. Always true on a quiet pool.
    pub exact: bool,
    /// Whether live extents are single blocks with their sites (`PoolConfig::track_sites`).
    pub sites_tracked: bool,
    /// Bytes in each state, over every segment.
    pub live_bytes: u64,
    /// See `live_bytes`.
    pub cached_bytes: u64,
    /// See `live_bytes`.
    pub retiring_bytes: u64,
    /// See `live_bytes`.
    pub free_bytes: u64,
    /// The pool's figures, taken just before the walk.
    pub stats: Stats,
    /// Every run of mapped pages, lowest first.
    pub segments: Vec<Segment>,
}

impl Snapshot {
    /// Every extent, lowest address first.
    pub fn extents(&self) -> impl Iterator<Item = &Extent> {
        self.segments.iter().flat_map(|s| s.extents.iter())
    }
}

impl Pool {
    /// Every segment of mapped memory and every stretch of it with its state (live, cached,
    /// retiring, free), inferred from the tiers; exact when the pool is quiet (see
    /// [`Snapshot::exact`]). Costs a walk of every tier: for reports, not for hot loops.
    pub fn snapshot(&self) -> Snapshot {
        self.inner.snapshot()
    }
}

/// A stretch the tiers know of.
#[derive(Clone, Copy)]
struct Known {
    addr: u64,
    bytes: u64,
    state: BlockState,
    stream: Option<StreamId>,
}

impl PoolInner {
    pub(crate) fn snapshot(&self) -> Snapshot {
        let stats = self.stats();
        let page = self.pages.page_size();
        let states = self.states();
        let stream_of_slot: HashMap<u32, StreamId> = states.iter().map(|s| (s.slot, s.stream.id())).collect();
        let (known, exact) = self.known_extents();
        let mut pages = Vec::new();
        self.pages.for_each_mapped(|p, _| pages.push(p));
        pages.sort_unstable();
        let mut segments: Vec<Segment> = Vec::new();
        for p in pages {
            match segments.last_mut() {
                Some(s) if s.addr + s.bytes == p => s.bytes += page,
                _ => segments.push(Segment { addr: p, bytes: page, extents: Vec::new() }),
            }
        }
        let chunk_stream = |addr: u64| self.space.owner(addr).and_then(|(slot, _)| stream_of_slot.get(&slot).copied());
        let mut k = 0;
        for seg in &mut segments {
            let end = seg.addr + seg.bytes;
            let mut at = seg.addr;
            while k < known.len() && known[k].addr + known[k].bytes <= at {
                k += 1;
            }
            let mut i = k;
            while at < end {
                // The next known stretch that reaches past `at` (overlaps, possible only on a
                // pool that is not quiet, are cut off).
                let next = known[i..].iter().position(|x| x.addr + x.bytes > at).map(|j| i + j);
                let (gap_end, hit) = match next {
                    Some(j) if known[j].addr <= at => (at, Some(j)),
                    Some(j) => (known[j].addr.min(end), None),
                    None => (end, None),
                };
                if gap_end > at {
                    self.live_extents(at, gap_end, &chunk_stream, &mut seg.extents);
                    at = gap_end;
                }
                if let Some(j) = hit {
                    let x = known[j];
                    let stop = (x.addr + x.bytes).min(end);
                    push(&mut seg.extents, Extent { addr: at, bytes: stop - at, ..extent(x.state, x.stream) });
                    at = stop;
                    i = j + 1;
                } else if let Some(j) = next {
                    i = j;
                }
            }
        }
        let mut sums: HashMap<BlockState, u64> = HashMap::new();
        for e in segments.iter().flat_map(|s| s.extents.iter()) {
            *sums.entry(e.state).or_default() += e.bytes;
        }
        let sum = |s| sums.get(&s).copied().unwrap_or(0);
        Snapshot {
            device: self.device.name(),
            page_size: page,
            exact,
            sites_tracked: self.sites.is_some(),
            live_bytes: sum(BlockState::Live),
            cached_bytes: sum(BlockState::Cached),
            retiring_bytes: sum(BlockState::Retiring),
            free_bytes: sum(BlockState::Free),
            stats,
            segments,
        }
    }

    /// Every stretch a tier holds (free pieces, cached blocks, retiring blocks), sorted by
    /// address; and whether every thread cache could be read.
    fn known_extents(&self) -> (Vec<Known>, bool) {
        let mut known = Vec::new();
        let states = self.states();
        self.space
            .for_each_free(|addr, bytes| known.push(Known { addr, bytes, state: BlockState::Free, stream: None }));
        for st in &states {
            let stream = Some(st.stream.id());
            st.arena.for_each_free(|addr, bytes| known.push(Known { addr, bytes, state: BlockState::Free, stream }));
        }
        let mut exact = true;
        for (cs, st) in self.caches.load().iter() {
            let stream = Some(st.stream.id());
            let mut got = Vec::new();
            let start = std::time::Instant::now();
            let walked = cs.steal_waiting(
                |c| {
                    // SAFETY: steal_waiting holds the handshake while this runs.
                    unsafe {
                        c.for_each_block(|class, addr| {
                            got.push(Known {
                                addr,
                                bytes: class::size_of_class(class),
                                state: BlockState::Cached,
                                stream,
                            })
                        })
                    }
                },
                || start.elapsed() < STEAL_PATIENCE,
            );
            exact &= walked;
            known.extend(got);
        }
        let guard = epoch::pin();
        for st in &states {
            let stream = Some(st.stream.id());
            for (class, d) in st.depots.iter().enumerate() {
                let bytes = class::size_of_class(class);
                d.for_each_block(|addr| known.push(Known { addr, bytes, state: BlockState::Cached, stream }), &guard);
            }
        }
        self.cross.for_each_span(
            |sp| known.push(Known { addr: sp.addr, bytes: sp.size, state: BlockState::Retiring, stream: None }),
            &guard,
        );
        drop(guard);
        known.sort_unstable_by_key(|x| x.addr);
        (known, exact)
    }

    /// The live memory `[lo, hi)`: with sites tracked, one extent per block recorded there
    /// (and live extents with no stream for any bytes no record covers); else one extent per
    /// run of chunks of one stream (or of none: large blocks).
    fn live_extents(&self, lo: u64, hi: u64, chunk_stream: &dyn Fn(u64) -> Option<StreamId>, out: &mut Vec<Extent>) {
        if let Some(sites) = &self.sites {
            let mut at = lo;
            for (addr, s) in sites.within(lo, hi) {
                if addr < at {
                    continue;
                }
                if addr > at {
                    push(out, Extent { addr: at, bytes: addr - at, ..extent(BlockState::Live, None) });
                }
                let stop = (addr + s.size).min(hi);
                out.push(Extent {
                    addr,
                    bytes: stop - addr,
                    state: BlockState::Live,
                    stream: Some(s.stream),
                    requested: Some(s.bytes),
                    site: Some(s.at.to_string()),
                });
                at = stop;
            }
            if hi > at {
                push(out, Extent { addr: at, bytes: hi - at, ..extent(BlockState::Live, None) });
            }
            return;
        }
        let mut at = lo;
        while at < hi {
            let stop = (at / CHUNK + 1).saturating_mul(CHUNK).min(hi);
            push(out, Extent { addr: at, bytes: stop - at, ..extent(BlockState::Live, chunk_stream(at)) });
            at = stop;
        }
    }
}

fn extent(state: BlockState, stream: Option<StreamId>) -> Extent {
    Extent { addr: 0, bytes: 0, state, stream, requested: None, site: None }
}

/// Append `e`, merged into the last extent when they touch and say the same (never blocks
/// with sites: those are one extent each).
fn push(out: &mut Vec<Extent>, e: Extent) {
    if let Some(last) = out.last_mut() {
        let same = last.state == e.state && last.stream == e.stream && last.site.is_none() && e.site.is_none();
        // Cached blocks stay one extent each: each is a block a cache holds.
        if same && e.state != BlockState::Cached && last.addr + last.bytes == e.addr {
            last.bytes += e.bytes;
            return;
        }
    }
    out.push(e);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{BlockState, Pool, PoolConfig, SimDevice};

    fn covered_exactly(snap: &crate::Snapshot) {
        for seg in &snap.segments {
            let mut at = seg.addr;
            for e in &seg.extents {
                assert_eq!(e.addr, at, "extents of a segment are end to end");
                assert!(e.bytes > 0);
                at += e.bytes;
            }
            assert_eq!(at, seg.addr + seg.bytes, "extents cover the segment");
        }
        let mapped: u64 = snap.segments.iter().map(|s| s.bytes).sum();
        assert_eq!(snap.live_bytes + snap.cached_bytes + snap.retiring_bytes + snap.free_bytes, mapped);
    }

    #[test]
    fn live_cached_and_free_memory_add_up_to_what_is_mapped() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let s = dev.new_stream().unwrap();
        let kept: Vec<_> = (0..8).map(|i| pool.alloc(4096 << i, &s).unwrap()).collect();
        let big = pool.alloc(96 << 20, &s).unwrap();
        drop(pool.alloc(8192, &s).unwrap());
        let snap = pool.snapshot();
        covered_exactly(&snap);
        assert!(snap.exact);
        assert_eq!(snap.live_bytes, snap.stats.allocated_bytes, "live = what the pool calls allocated");
        assert!(snap.cached_bytes >= 8192, "the freed block is in this thread's cache");
        assert_eq!(snap.live_bytes, kept.iter().map(|b| b.capacity() as u64).sum::<u64>() + big.capacity() as u64);
        let in_big = snap.extents().find(|e| e.addr <= big.device_ptr() && big.device_ptr() < e.addr + e.bytes);
        assert_eq!(in_big.map(|e| e.state), Some(BlockState::Live));
        let json = serde_json::to_string(&snap).unwrap();
        assert!(json.contains("\"state\":\"live\"") && json.contains("\"state\":\"cached\""));
        drop((kept, big));
        pool.trim().unwrap();
        let snap = pool.snapshot();
        covered_exactly(&snap);
        assert_eq!(snap.live_bytes, 0);
    }

    #[test]
    fn a_snapshot_of_a_busy_pool_still_cuts_every_mapped_byte_once() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let copy = dev.new_stream().unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            for t in 0..2u64 {
                let (pool, dev, copy, stop) = (&pool, &dev, &copy, &stop);
                scope.spawn(move || {
                    let s = dev.new_stream().unwrap();
                    let cache = pool.stream_cache(&s).unwrap();
                    let mut held = std::collections::VecDeque::new();
                    let mut i = t;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        i = i.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let b = cache.alloc(256 << (i >> 60)).unwrap();
                        if i % 7 == 0 {
                            b.record_stream(copy);
                        }
                        held.push_back(b);
                        if held.len() > 64 {
                            held.pop_front();
                        }
                    }
                });
            }
            for _ in 0..50 {
                let snap = pool.snapshot();
                covered_exactly(&snap);
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        pool.trim().unwrap();
        assert_eq!(pool.snapshot().live_bytes, 0);
    }

    #[test]
    fn with_sites_each_live_block_is_an_extent_with_its_stream_and_site() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig { track_sites: true, ..PoolConfig::default() }).unwrap();
        let (s, t) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
        let a = pool.alloc(1000, &s).unwrap();
        let line = line!() - 1;
        let b = pool.stream_cache(&t).unwrap().alloc(5 << 20).unwrap();
        let c = pool.alloc(3000, &s).unwrap();
        b.record_stream(&s);
        let snap = pool.snapshot();
        covered_exactly(&snap);
        assert!(snap.sites_tracked);
        let live: Vec<_> = snap.extents().filter(|e| e.state == BlockState::Live).collect();
        assert_eq!(live.len(), 3, "{live:?}");
        let ea = live.iter().find(|e| e.addr == a.device_ptr()).unwrap();
        assert_eq!((ea.stream, ea.requested), (Some(s.id()), Some(1000)));
        assert!(ea.site.as_deref().unwrap().contains(&format!("snapshot.rs:{line}:")), "{:?}", ea.site);
        let eb = live.iter().find(|e| e.addr == b.device_ptr()).unwrap();
        assert_eq!(eb.stream, Some(t.id()));
        drop((a, b, c));
        dev.synchronize(&s).unwrap();
        dev.synchronize(&t).unwrap();
        pool.trim().unwrap();
        let snap = pool.snapshot();
        assert_eq!(snap.live_bytes, 0);
        assert_eq!(snap.stats.live_blocks, 0);
    }
}
