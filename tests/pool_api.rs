//! The Pool API as a user sees it, on the simulated device (reuse across streams:
//! `stream_reuse.rs`).

use vrampool::{Block, Device, Error, Pool, PoolConfig, SimDevice, Stats, Stream, StreamCache};

#[path = "support/sim_pool.rs"]
mod sim_pool;
use sim_pool::{all_given_back, pool};

#[test]
fn blocks_are_aligned_exact_and_accounted() {
    let (_dev, pool, s) = pool(1 << 30);
    let b: Block = pool.alloc(4096, &s).unwrap();
    assert_eq!(b.device_ptr() % 256, 0);
    assert_eq!(b.len(), 4096);
    assert!(b.capacity() >= 4096);
    let c = pool.alloc(1000, &s).unwrap();
    assert_eq!((c.len(), c.capacity()), (1000, 1024));
    let st: Stats = pool.stats();
    assert_eq!(st.allocated_bytes, 4096 + 1024);
    assert_eq!(st.reserved_bytes, 2 << 20, "one page mapped for two small blocks");
    pool.check().unwrap();
    drop(b);
    drop(c);
    pool.check().unwrap();
    pool.trim().unwrap();
    pool.check().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocated_bytes, st.reserved_bytes, st.cached_bytes, st.retiring_bytes), (0, 0, 0, 0));
    assert_eq!(st.peak_allocated_bytes, 4096 + 1024);
    assert_eq!(st.peak_reserved_bytes, 2 << 20);
}

#[test]
fn a_zero_size_request_is_a_valid_empty_block() {
    let (_dev, pool, s) = pool(1 << 30);
    let b = pool.alloc(0, &s).unwrap();
    assert!(b.is_empty());
    assert_eq!(pool.stats().allocated_bytes, 0);
}

#[test]
fn an_empty_block_owns_nothing_wherever_it_is_dropped() {
    let (_dev, pool, s) = pool(1 << 30);
    let cache = pool.stream_cache(&s).unwrap();
    // A hit and a free first, so the thread's memo names this pool's cache for `s`: an empty
    // block's drop then meets the cache's hit path, which must not take it.
    drop(cache.alloc(4096).unwrap());
    let figures = |p: &Pool| {
        let st = p.stats();
        (st.allocated_bytes, st.thread_cached_bytes, st.live_blocks, st.allocs, st.t0_hits)
    };
    let before = figures(&pool);
    let (a, b) = (cache.alloc(0).unwrap(), pool.alloc(0, &s).unwrap());
    for e in [&a, &b] {
        assert!(e.is_empty() && e.capacity() == 0 && e.device_ptr() == 0, "{e:?}");
    }
    drop(a);
    assert_eq!(figures(&pool), before, "an empty block is neither counted nor cached");
    pool.check().unwrap();
    // The other outlives its pool, which kept nothing for it.
    drop(cache);
    drop(pool);
    drop(b);
}

#[test]
fn an_impossible_request_is_a_typed_error_and_damages_nothing() {
    let (_dev, pool, s) = pool(1 << 30);
    let keep = pool.alloc(1 << 20, &s).unwrap();
    match pool.alloc(usize::MAX, &s) {
        Err(Error::TooLarge { requested, limit }) => assert!(requested > limit),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    match pool.alloc((1 << 30) as usize, &s) {
        Err(e @ Error::TooLarge { .. }) => assert!(e.to_string().contains("never")),
        other => panic!("expected TooLarge past max_reserved, got {other:?}"),
    }
    pool.check().unwrap();
    drop(keep);
}

#[test]
fn out_of_memory_carries_the_figures() {
    let (_dev, pool, s) = pool(64 << 20);
    let mut held = vec![];
    let err = loop {
        match pool.alloc(8 << 20, &s) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
    };
    match err {
        Error::OutOfMemory(oom) => {
            assert_eq!(oom.requested, 8 << 20);
            assert!(oom.reserved <= oom.max_reserved);
            assert_eq!(oom.allocated, held.len() as u64 * (8 << 20));
            // What could be handed out without mapping: a stretch of the mapped memory, too
            // short for the request (not the unmapped address space beyond it).
            assert!(oom.largest_free < oom.requested, "{oom:?}");
            assert!(oom.largest_free <= oom.reserved - oom.allocated, "{oom:?}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    pool.check().unwrap();
    held.clear();
    pool.alloc(8 << 20, &s).expect("memory freed on the same stream is usable again");
}

/// `n` rounds through `cache` of a block of 256 B – 512 KiB held across a 4 KiB pair: hits
/// once the cache holds each class.
fn small_pairs(cache: &StreamCache, n: usize) {
    for i in 0..n {
        let kept = cache.alloc(256 << (i % 12)).unwrap();
        drop(cache.alloc(4096).unwrap());
        drop(kept);
    }
}

/// [`small_pairs`] through `cache`, and how many of its allocations the pool counted and
/// how many of them hit T0.
fn small_pair_hits(pool: &Pool, cache: &StreamCache, n: usize) -> (u64, u64) {
    let before = pool.stats();
    small_pairs(cache, n);
    let st = pool.stats();
    (st.allocs - before.allocs, st.t0_hits - before.t0_hits)
}

/// Blocks of 16 MiB on `s` up to fifteen sixteenths of `max_reserved`: past seven eighths
/// mapped, where the near-limit rules apply.
fn fill_past_seven_eighths(pool: &Pool, s: &Stream) -> Vec<Block> {
    let big = 16 << 20;
    let blocks = (0..pool.max_reserved() / big as u64 * 15 / 16).map(|_| pool.alloc(big, s).unwrap()).collect();
    assert!(pool.stats().reserved_bytes > pool.max_reserved() / 8 * 7);
    blocks
}

#[test]
fn every_allocation_below_the_caches_is_counted_by_the_rung_that_placed_it() {
    let (_dev, pool, s) = pool(64 << 20);
    // Above the largest cached class: every one goes below the caches.
    const BIG: usize = 8 << 20;
    let mut held = vec![];
    while let Ok(b) = pool.alloc(BIG, &s) {
        held.push(b);
    }
    let st = pool.stats();
    assert_eq!(st.ladder_rungs[6], held.len() as u64, "a cold pool maps past its peak (rung 7) for each: {st:?}");
    assert_eq!(st.ooms, 1);
    assert!(st.ladder_rung_ns[6] > 0, "rung 7's placements took time: {st:?}");
    let by_rung: u64 = st.ladder_rung_ns.iter().sum();
    // Each rung's time is a part of the ladder's (the failed climb is in neither: <=).
    assert!(by_rung <= st.ladder_ns + vrampool::LADDER_RUNGS as u64, "{st:?}");
    let unplaced = st.ladder_rungs.iter().zip(st.ladder_rung_ns).filter(|&(&n, ns)| n == 0 && ns > 0).count();
    assert_eq!(unplaced, 0, "no time for a rung that placed nothing: {st:?}");
    held.clear();
    let again = pool.alloc(BIG, &s).unwrap();
    let st = pool.stats();
    assert_eq!(st.ladder_rungs[0], 1, "memory its stream freed is ready at once (rung 1): {st:?}");
    let placed: u64 = st.ladder_rungs.iter().sum();
    assert_eq!(placed, st.allocs - st.t0_hits - st.t1_hits, "one count per allocation served: {st:?}");
    drop(again);
    // Small blocks, through a thread cache: its misses are counted the same way.
    let (_dev, pool, s) = self::pool(1 << 30);
    let cache = pool.stream_cache(&s).unwrap();
    small_pairs(&cache, 300);
    let st = pool.stats();
    let placed: u64 = st.ladder_rungs.iter().sum();
    assert!(st.t0_hits > 0 && placed > 2, "{st:?}");
    assert_eq!(placed, st.allocs - st.t0_hits - st.t1_hits, "one count per miss too: {st:?}");
}

#[test]
fn a_pool_that_once_mapped_near_its_limit_caches_again_once_its_blocks_are_gone() {
    let (_dev, pool, s) = pool(1 << 30);
    // Mapped past seven eighths of the limit, then everything freed: the pages stay mapped.
    drop(fill_past_seven_eighths(&pool, &s));
    assert!(pool.stats().reserved_bytes > pool.max_reserved() / 8 * 7);
    let cache = pool.stream_cache(&s).unwrap();
    let (allocs, hits) = small_pair_hits(&pool, &cache, 2_000);
    assert!(hits * 10 > allocs * 9, "the caches serve again: {hits} hits of {allocs} ({:?})", pool.stats());
}

#[test]
fn a_server_holding_its_kv_cache_near_the_limit_still_serves_from_its_caches() {
    let (_dev, pool, s) = pool(1 << 30);
    // A KV cache of large blocks, placed once and held.
    let kv = fill_past_seven_eighths(&pool, &s);
    let cache = pool.stream_cache(&s).unwrap();
    // The first pairs teach the cache that the large blocks stay put.
    small_pairs(&cache, 2_000);
    let (allocs, hits) = small_pair_hits(&pool, &cache, 2_000);
    let st = pool.stats();
    assert!(hits * 10 > allocs * 9, "the room beside the KV cache is cached: {hits} hits of {allocs} ({st:?})");
    drop(kv);
}

#[test]
fn a_thread_keeps_no_cache_for_streams_destroyed_before_its_next_new_one() {
    let (dev, pool, _s) = pool(1 << 30);
    for _ in 0..100 {
        let s = dev.new_stream().unwrap();
        drop(pool.alloc(1 << 20, &s).unwrap());
        dev.synchronize(&s).unwrap();
        dev.destroy_stream(&s).unwrap();
    }
    let st = pool.stats();
    assert!(st.thread_caches <= 1, "one cache a stream ever used stays registered: {st:?}");
    all_given_back(&pool);
}

#[test]
fn near_its_limit_a_miss_takes_the_bytes_asked_not_its_class() {
    // 3.1 MiB is in the 3.25 MiB class; in whole 64 KiB granules of the arena it is 3.125 MiB.
    const ASK: usize = 3_250_585;
    const CLASS: usize = 13 << 18;
    const EXACT: usize = 50 << 16;
    let dev = SimDevice::new(256 << 20);
    let config = PoolConfig { max_reserved: Some(64 << 20), ..PoolConfig::default() };
    let pool = Pool::new(dev.clone(), config).unwrap();
    let s = dev.new_stream().unwrap();
    let far = pool.alloc(ASK, &s).unwrap();
    assert_eq!(far.capacity(), CLASS, "far from the limit, a miss takes its class's size, to be cached");
    // Past seven eighths of the limit mapped.
    let ballast = pool.alloc(54 << 20, &s).unwrap();
    assert!(pool.stats().reserved_bytes > 56 << 20);
    let near = pool.alloc(ASK, &s).unwrap();
    assert_eq!(near.capacity(), EXACT, "near the limit, what was asked, rounded as the arena rounds");
    let held = pool.stats().allocated_bytes;
    drop(near);
    let st = pool.stats();
    assert_eq!(st.cached_bytes, 0, "an exact block is not cached: its free goes to the arena");
    assert_eq!(held - st.allocated_bytes, EXACT as u64);
    pool.check().unwrap();
    drop((far, ballast));
    all_given_back(&pool);
}

#[test]
fn at_its_limit_a_small_request_with_no_chunk_to_be_had_takes_a_gap_between_large_blocks() {
    const MIB: usize = 1 << 20;
    let dev = SimDevice::new(256 << 20);
    let config = PoolConfig { max_reserved: Some(16 << 20), ..PoolConfig::default() };
    let pool = Pool::new(dev.clone(), config).unwrap();
    let (s, other) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    // Every page mapped and half used: 1 MiB gaps, none a whole page, so no stream can have
    // a chunk for small blocks.
    let mut large: Vec<Block> = (0..16).map(|_| pool.alloc(MIB, &s).unwrap()).collect();
    assert_eq!(pool.stats().reserved_bytes, 16 << 20);
    let gaps: Vec<(u64, u64)> =
        large.iter().step_by(2).map(|b| (b.device_ptr(), b.device_ptr() + MIB as u64)).collect();
    let mut i = 0;
    large.retain(|_| {
        i += 1;
        i % 2 == 0
    });
    for stream in [&s, &other] {
        let small = pool.alloc(300_000, stream).expect("a gap holds it");
        let at = small.device_ptr();
        assert!(gaps.iter().any(|&(lo, hi)| lo <= at && at + 300_000 <= hi), "{at:#x} lies in a gap");
        dev.memset(at, 0xa5, 300_000, stream).unwrap();
        assert_eq!(small.capacity(), 5 << 16, "whole 64 KiB granules, as the space holds it");
        let st = pool.stats();
        assert_eq!(st.reserved_bytes, 16 << 20, "nothing mapped past the limit");
        assert_eq!(st.allocated_bytes, 8 * MIB as u64 + (5 << 16), "allocated: the live blocks' capacities");
        drop(small);
        pool.check().unwrap();
    }
    drop(large);
    all_given_back(&pool);
}

#[test]
fn when_the_peak_rises_a_busy_threads_cache_gives_back_its_excess_at_its_next_miss() {
    // A worker fills its cache with ~74 MiB of freed blocks (four each of eight classes
    // between 1 and 3.6 MiB), then keeps working on hits, so no thief takes its cache. The
    // main thread grows the pool past its peak. At the worker's next miss, its cache gives
    // back all but its keep (16 MiB).
    use std::sync::mpsc;
    const KEEP: u64 = 16 << 20;
    let (dev, pool, s) = pool(4 << 30);
    let other = dev.new_stream().unwrap();
    let (order, orders) = mpsc::channel::<bool>();
    let (report, reports) = mpsc::channel::<u64>();
    std::thread::scope(|sc| {
        let (pool, other) = (&pool, &other);
        sc.spawn(move || {
            let cache = pool.stream_cache(other).unwrap();
            let sizes = (0..8).flat_map(|i| [(1 << 20) + i * (384 << 10); 4]);
            drop(sizes.map(|n| cache.alloc(n).unwrap()).collect::<Vec<_>>());
            report.send(pool.stats().thread_cached_bytes).unwrap();
            loop {
                match orders.try_recv() {
                    // A miss: no class within two doublings of 100 KiB is held (nor borrowed).
                    Ok(true) => {
                        drop(cache.alloc(100 << 10).unwrap());
                        report.send(pool.stats().thread_cached_bytes).unwrap();
                    }
                    Ok(false) => break,
                    Err(_) => drop(cache.alloc(4096).unwrap()),
                }
            }
        });
        let filled = reports.recv().unwrap();
        assert!(filled > 64 << 20, "the worker's cache holds {filled} bytes");
        let peak = pool.stats().peak_reserved_bytes;
        let big = pool.alloc(512 << 20, &s).unwrap();
        assert!(pool.stats().peak_reserved_bytes > peak, "the pool grew");
        order.send(true).unwrap();
        let after = reports.recv().unwrap();
        order.send(false).unwrap();
        drop(big);
        assert!(after <= KEEP + (64 << 10), "{after} bytes still cached after the pool grew ({filled} before)");
    });
    pool.flush_thread_cache();
    pool.trim().unwrap();
    pool.check().unwrap();
}

#[test]
fn pool_stream_and_block_are_send_and_sync_as_promised() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Pool>();
    send_sync::<Stream>();
    send::<Block>();
    fn is_error<E: std::error::Error>() {}
    is_error::<Error>();
}

#[test]
fn all_caches_together_stay_under_their_bound() {
    let dev = SimDevice::new(1 << 30);
    let cfg = PoolConfig { max_cached_bytes: Some(8 << 20), thread_cache_bytes: 6 << 20, ..PoolConfig::default() };
    let pool = Pool::new(dev.clone(), cfg).unwrap();
    let streams: Vec<Stream> = (0..3).map(|_| dev.new_stream().unwrap()).collect();
    // Every thread holds its cache full at once before anyone looks: three thread caches of
    // up to 6 MiB each would hold 18 MiB without the pool-wide bound.
    let all_freed = std::sync::Barrier::new(3);
    std::thread::scope(|s| {
        for st in &streams {
            let (pool, all_freed) = (&pool, &all_freed);
            s.spawn(move || {
                // Many blocks of many classes, all freed: far more than the caches may keep.
                let blocks: Vec<Block> = (0..200).map(|i| pool.alloc(4096 * (1 + i % 50), st).unwrap()).collect();
                drop(blocks);
                all_freed.wait();
                let stats = pool.stats();
                assert!(
                    stats.thread_cached_bytes + stats.depot_bytes <= 8 << 20,
                    "caches hold {} + {} bytes",
                    stats.thread_cached_bytes,
                    stats.depot_bytes
                );
                // Flush here: a scoped thread's thread-local destructors may run after the
                // scope returns (rust#116179), racing the checks below.
                pool.flush_thread_cache();
            });
        }
    });
    let stats = pool.stats();
    assert!(stats.thread_cached_bytes + stats.depot_bytes <= 8 << 20);
    pool.check().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
}

#[test]
fn flushing_gives_back_even_the_cache_a_stream_cache_holds() {
    let (_dev, pool, s) = pool(1 << 30);
    let cache = pool.stream_cache(&s).unwrap();
    drop((0..8).map(|_| cache.alloc(4096).unwrap()).collect::<Vec<_>>());
    assert!(pool.stats().thread_cached_bytes > 0);
    pool.flush_thread_cache();
    assert_eq!(pool.stats().thread_cached_bytes, 0);
    drop((0..8).map(|_| cache.alloc(4096).unwrap()).collect::<Vec<_>>());
    assert_eq!(pool.stats().thread_caches, 1, "still one cache for (this thread, this stream)");
}

#[test]
fn a_block_dropped_inside_a_host_function_makes_no_cache_on_the_drivers_thread() {
    let (dev, pool, s) = pool(1 << 30);
    let b = pool.alloc(4096, &s).unwrap();
    let before = pool.stats().thread_caches;
    dev.enqueue(&s, move || drop(b)).unwrap();
    dev.synchronize(&s).unwrap();
    assert_eq!(pool.stats().thread_caches, before, "the stream's worker thread got a cache");
    assert_eq!(pool.stats().allocated_bytes, 0);
    all_given_back(&pool);
}

#[test]
fn a_destroyed_streams_cached_blocks_all_come_back() {
    // Blocks freed on a stream that is then destroyed sit in its thread caches and depots;
    // once its final event completes they must reach the arena, and blocks freed after the
    // stream's state is gone must too.
    let (dev, pool, copy) = pool(4 << 30);
    let mut late = Vec::new();
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..3usize)
            .map(|w| {
                let (pool, dev, copy) = (&pool, &dev, &copy);
                sc.spawn(move || {
                    let s = dev.new_stream().unwrap();
                    for i in 0..500usize {
                        let live: Vec<Block> = (0..5)
                            .map(|j| pool.alloc(4096 + (i * 7 + j * 13 + w) % 97 * 40_000, &s).unwrap())
                            .collect();
                        live[0].record_stream(copy);
                    }
                    let keep = pool.alloc(1 << 20, &s).unwrap();
                    dev.synchronize(&s).unwrap();
                    dev.destroy_stream(&s).unwrap();
                    pool.flush_thread_cache();
                    keep
                })
            })
            .collect();
        late.extend(handles.into_iter().map(|h| h.join().unwrap()));
    });
    dev.synchronize(&copy).unwrap();
    pool.trim().unwrap();
    drop(late);
    pool.trim().unwrap();
    pool.check().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocated_bytes, st.reserved_bytes, st.cached_bytes, st.retiring_bytes), (0, 0, 0, 0), "{st:?}");
}

#[test]
fn the_time_below_the_caches_counts_every_driver_call_it_made() {
    // Costs a driver spends inside each call: whatever the machine's speed, the pool's clock
    // must read at least what the device spent in its map and unmap calls.
    let costs = vrampool::SimCosts::h200();
    let dev = SimDevice::builder(1 << 30).costs(costs).build();
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    let pages = 3;
    // Above the largest cached class: through the ladder on allocation, around the caches
    // on the free.
    let b = pool.alloc(pages * (2 << 20), &s).unwrap();
    let st = pool.stats();
    // One call for the run or one a page, at least what one call for all of them costs.
    let least_map = costs.map(pages as u64).as_nanos() as u64;
    assert!(st.map_ns >= least_map, "map_ns {} under the driver's {least_map}", st.map_ns);
    assert!(st.ladder_ns >= st.map_ns, "the ladder's time {} holds its maps' {}", st.ladder_ns, st.map_ns);
    assert_eq!(st.release_ns, 0, "nothing was freed yet");
    drop(b);
    assert!(pool.stats().release_ns > 0, "the free around the caches is timed");
    pool.trim().unwrap();
    let st = pool.stats();
    let least_unmap = costs.unmap(pages as u64).as_nanos() as u64;
    assert!(st.unmapped_bytes >= pages as u64 * (2 << 20));
    assert!(st.unmap_ns >= least_unmap, "unmap_ns {} under the driver's {least_unmap}", st.unmap_ns);
    // The events that fenced the free, and their polls, are timed as well.
    let least_events = st.events_recorded * (costs.event_create + costs.event_record).as_nanos() as u64;
    assert!(st.events_recorded > 0, "the free was fenced by an event");
    assert!(st.event_ns >= least_events, "event_ns {} under the driver's {least_events}", st.event_ns);
}

#[test]
fn reset_peaks_measure_one_phase_and_leave_the_pools_own_peak_alone() {
    let (_dev, pool, s) = pool(1 << 30);
    let big = pool.alloc(64 << 20, &s).unwrap();
    drop(big);
    pool.trim().unwrap();
    let before = pool.stats();
    assert!(before.peak_reserved_bytes >= 64 << 20 && before.peak_allocated_bytes >= 64 << 20);
    pool.reset_peak_stats();
    let reset = pool.stats();
    assert_eq!((reset.peak_reserved_bytes, reset.peak_allocated_bytes), (reset.reserved_bytes, reset.allocated_bytes));
    // A smaller phase: its own peak, not the first one's.
    let b = pool.alloc(8 << 20, &s).unwrap();
    let phase = pool.stats();
    assert!(phase.peak_reserved_bytes >= 8 << 20 && phase.peak_reserved_bytes < 64 << 20, "{phase:?}");
    assert!(phase.peak_allocated_bytes >= 8 << 20 && phase.peak_allocated_bytes < 64 << 20, "{phase:?}");
    drop(b);
    pool.check().unwrap();
}
