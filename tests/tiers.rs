//! The cache tiers against a sequential model: random operation sequences (proptest) of
//! allocations, frees, flushes and trims on one thread, checked after every operation
//! against the set of live blocks; and the two ways a thread's cache gives its blocks
//! back (thread exit, `flush_thread_cache`).
//!
//! The device has 64 KiB pages, so pages are mapped and unmapped as the tiers move blocks;
//! the caches are kept small so magazines overflow into the depots, depots fill up and
//! blocks spill to the retire queues.

use std::collections::BTreeMap;
use std::sync::mpsc;

use proptest::prelude::*;
use vrampool::{Block, Error, Pool, PoolConfig, SimDevice, Stream};

const GRANULARITY: usize = 64 << 10;
const MAX_RESERVED: u64 = 48 << 20;
const MAX_REQUEST: usize = 4 << 20;

fn config() -> PoolConfig {
    PoolConfig {
        max_reserved: Some(MAX_RESERVED),
        address_range: Some(1 << 30),
        // Small caches: a few frees overflow the magazines and the 256 KiB bound.
        thread_cache_bytes: 256 << 10,
        magazine_bytes: 16 << 10,
        depot_magazines: 2,
        // Requests above 1 MiB bypass the caches and come back through the retire queue
        // (and its same-stream reuse), so both paths are in every sequence.
        largest_cached_class: 1 << 20,
        ..Default::default()
    }
}

fn setup(streams: usize) -> (SimDevice, Pool, Vec<Stream>) {
    let dev = SimDevice::with_granularity(64 << 20, GRANULARITY);
    let pool = Pool::new(dev.clone(), config()).unwrap();
    let streams = (0..streams).map(|_| dev.new_stream().unwrap()).collect();
    (dev, pool, streams)
}

/// The size classes up to `MAX_REQUEST` (8 per doubling above 2 KiB, 256-byte steps
/// below), so the generator can hit exact class sizes, where rounding is zero.
fn class_sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (1..=8).map(|k| k * 256).collect();
    let mut base = 2048;
    while base < MAX_REQUEST {
        v.extend((1..=8).map(|k| base + k * base / 8));
        base *= 2;
    }
    v
}

#[derive(Debug, Clone)]
enum Op {
    /// `bytes` on stream `stream % streams`, through `pool.alloc` or an explicit
    /// `StreamCache`.
    Alloc {
        bytes: usize,
        stream: usize,
        via_stream_cache: bool,
    },
    /// Free live block `pick % live`; first `record_stream` it on the other stream.
    Free {
        pick: usize,
        record_other: bool,
    },
    FlushThreadCache,
    Trim,
}

fn size() -> impl Strategy<Value = usize> {
    let classes = class_sizes();
    prop_oneof![
        5 => 1usize..=4096,
        3 => proptest::sample::select(classes),
        1 => 4097usize..=MAX_REQUEST,
    ]
}

/// `free_weight` against allocations' 10: 8 keeps the live set small; 2 lets it grow past
/// `max_reserved`, so the out-of-memory ladder runs (flushes, steals, waits, then the error).
fn op(free_weight: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size(), 0usize..2, any::<bool>())
            .prop_map(|(bytes, stream, via_stream_cache)| Op::Alloc { bytes, stream, via_stream_cache }),
        free_weight => (any::<usize>(), proptest::bool::weighted(0.15))
            .prop_map(|(pick, record_other)| Op::Free { pick, record_other }),
        1 => Just(Op::FlushThreadCache),
        1 => Just(Op::Trim),
    ]
}

/// A live block in the model: the pool's handle and what was asked for.
struct Live {
    block: Block,
    len: usize,
    stream: usize,
}

/// The checks of every step: the live set is consistent (aligned, no overlap, capacity
/// covers the request), the pool counts exactly its capacities as allocated (one thread,
/// so the pool is quiet), and `check()` finds every mapped byte accounted for.
fn check_step(pool: &Pool, live: &[Live], streams: &[Stream]) {
    let mut by_addr = BTreeMap::new();
    for l in live {
        let b = &l.block;
        assert_eq!(b.device_ptr() % 256, 0, "{b:?} is 256-aligned");
        assert!(b.capacity() >= b.len() && b.len() == l.len, "{b:?} holds the {} bytes asked", l.len);
        assert_eq!(b.stream_id(), streams[l.stream].id());
        assert!(by_addr.insert(b.device_ptr(), b.capacity() as u64).is_none(), "two live blocks at {b:?}");
    }
    let mut end = 0;
    for (&addr, &cap) in &by_addr {
        assert!(addr >= end, "live block at {addr:#x} overlaps the one before (ends {end:#x})");
        end = addr + cap;
    }
    let st = pool.stats();
    let live_bytes: u64 = by_addr.values().sum();
    assert_eq!(st.allocated_bytes, live_bytes, "allocated bytes are the live blocks' capacities");
    pool.check().unwrap();
}

/// An out-of-memory error is legitimate only if the request could not fit next to the live
/// blocks: their bytes, plus at most two partly used pages each (a block's first and last),
/// plus the request leave no room under `max_reserved`. Anything less means a tier kept
/// memory the ladder should have flushed.
fn assert_oom_is_real(live: &[Live], bytes: usize) {
    let live_bytes: u64 = live.iter().map(|l| l.block.capacity() as u64).sum();
    let pinned = live.len() as u64 * 2 * GRANULARITY as u64;
    assert!(
        live_bytes + pinned + bytes as u64 > MAX_RESERVED,
        "out of memory with {live_bytes} B live in {} blocks, asking {bytes} B",
        live.len()
    );
}

fn run(ops: &[Op], nstreams: usize) {
    let (_dev, pool, streams) = setup(nstreams);
    let mut live: Vec<Live> = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc { bytes, stream, via_stream_cache } => {
                let stream = stream % nstreams;
                let s = &streams[stream];
                let got =
                    if via_stream_cache { pool.stream_cache(s).unwrap().alloc(bytes) } else { pool.alloc(bytes, s) };
                match got {
                    Ok(block) => live.push(Live { block, len: bytes, stream }),
                    Err(Error::OutOfMemory(_)) => assert_oom_is_real(&live, bytes),
                    Err(e) => panic!("alloc({bytes}) failed: {e}"),
                }
            }
            Op::Free { pick, record_other } => {
                if live.is_empty() {
                    continue;
                }
                let l = live.swap_remove(pick % live.len());
                if record_other && nstreams > 1 {
                    // The block was used on the other stream too: its free waits for both.
                    l.block.record_stream(&streams[(l.stream + 1) % nstreams]);
                }
                drop(l.block);
            }
            Op::FlushThreadCache => {
                pool.flush_thread_cache();
                assert_eq!(pool.stats().thread_cached_bytes, 0, "a flushed thread holds nothing");
            }
            Op::Trim => pool.trim().unwrap(),
        }
        check_step(&pool, &live, &streams);
    }
    // Invariant 4: with every block dropped and a trim, nothing is left anywhere.
    drop(live);
    pool.trim().unwrap();
    pool.check().unwrap();
    let st = pool.stats();
    assert_eq!(
        (st.allocated_bytes, st.reserved_bytes, st.cached_bytes, st.retiring_bytes),
        (0, 0, 0, 0),
        "after the last free and a trim the pool holds nothing: {st:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn tiers_agree_with_the_model_on_one_stream(ops in proptest::collection::vec(op(8), 1..200)) {
        run(&ops, 1);
    }

    #[test]
    fn tiers_agree_with_the_model_on_two_streams(ops in proptest::collection::vec(op(8), 1..200)) {
        run(&ops, 2);
    }

    #[test]
    fn tiers_agree_with_the_model_under_memory_pressure(ops in proptest::collection::vec(op(2), 100..200)) {
        run(&ops, 2);
    }
}

/// Blocks of several classes, including sizes past the largest cached class.
fn some_blocks(pool: &Pool, s: &Stream) -> Vec<Block> {
    [256, 1000, 4096, 4096, 4096, 12_000, 65_536, 300_000, 2 << 20]
        .iter()
        .cycle()
        .take(40)
        .map(|&n| pool.alloc(n, s).unwrap())
        .collect()
}

/// Blocks freed on another thread land in that thread's cache; when it exits, its
/// thread-local's destructor flushes the cache, and a trim then returns every byte.
#[test]
fn blocks_freed_on_a_thread_that_exits_come_back_whole_after_trim() {
    let (_dev, pool, streams) = setup(1);
    let blocks = some_blocks(&pool, &streams[0]);
    let bytes: u64 = blocks.iter().map(|b| b.capacity() as u64).sum();
    let before = pool.stats();
    let caches_before = before.thread_caches;
    let (tx, rx) = mpsc::channel::<Block>();
    let freer = std::thread::spawn(move || {
        for b in rx {
            drop(b);
        }
    });
    for b in blocks {
        tx.send(b).unwrap();
    }
    drop(tx);
    // A plain join waits for the thread's thread-local destructors (unlike a scope's end,
    // rust#116179), so the flush has run by now.
    freer.join().unwrap();
    let st = pool.stats();
    assert_eq!(st.thread_caches, caches_before, "the exited thread's cache left the registry");
    assert_eq!(st.allocated_bytes, 0);
    assert_eq!(st.thread_cached_bytes, 0, "nothing stays in a dead thread's cache");
    let to_arena = st.arena_free_bytes - before.arena_free_bytes;
    assert_eq!(st.cached_bytes + st.retiring_bytes + to_arena, bytes, "every freed byte is in a depot or the arena");
    pool.check().unwrap();
    pool.trim().unwrap();
    pool.check().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocated_bytes, st.reserved_bytes, st.cached_bytes, st.retiring_bytes), (0, 0, 0, 0), "{st:?}");
}

/// `flush_thread_cache` moves this thread's cached blocks out (to the depots or back to the
/// arena), leaving its cache empty and every byte accounted for.
#[test]
fn flush_thread_cache_empties_this_threads_cache() {
    let (_dev, pool, streams) = setup(1);
    let blocks = some_blocks(&pool, &streams[0]);
    let bytes: u64 = blocks.iter().map(|b| b.capacity() as u64).sum();
    let before = pool.stats();
    drop(blocks);
    let st = pool.stats();
    assert!(st.thread_cached_bytes > 0, "frees fill this thread's cache first");
    // What the caches do not keep goes back to the arena.
    let freed =
        |st: &vrampool::Stats| st.cached_bytes + st.retiring_bytes + st.arena_free_bytes - before.arena_free_bytes;
    assert_eq!(freed(&st), bytes);
    pool.flush_thread_cache();
    let st = pool.stats();
    assert_eq!(st.thread_cached_bytes, 0, "the flushed cache holds nothing");
    assert_eq!(freed(&st), bytes, "flushed blocks moved on, none lost");
    pool.check().unwrap();
    // The cache is made afresh on next use, and serves it.
    let b = pool.alloc(4096, &streams[0]).unwrap();
    assert_eq!(pool.stats().allocated_bytes, b.capacity() as u64);
    drop(b);
    pool.trim().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocated_bytes, st.reserved_bytes, st.cached_bytes, st.retiring_bytes), (0, 0, 0, 0), "{st:?}");
}

/// A block larger than every cached class is placed where its stream's cached large blocks
/// were: they go back to the space first, so the run they cut is whole again. Without that,
/// first fit went past them to a higher run (here one that was free and mapped too; in a
/// warm pool, often pages mapped or lent for it alone).
#[test]
fn a_block_no_cache_holds_takes_the_run_its_streams_cached_blocks_were_cutting() {
    const MIB: usize = 1 << 20;
    let dev = SimDevice::new(1 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    // Four cached-class blocks, then 5 MiB (uncached) beside them, a live block, and 8 MiB.
    let cached: Vec<Block> = (0..4).map(|_| pool.alloc(MIB, &s).unwrap()).collect();
    let base = cached[0].device_ptr();
    let beside = pool.alloc(5 * MIB, &s).unwrap();
    let live = pool.alloc(2 * MIB, &s).unwrap();
    let higher = pool.alloc(8 * MIB, &s).unwrap();
    assert_eq!(
        [beside.device_ptr(), live.device_ptr(), higher.device_ptr()],
        [base + 4 * MIB as u64, base + 9 * MIB as u64, base + 11 * MIB as u64],
        "in a row"
    );
    drop((beside, higher));
    drop(cached);
    assert_eq!(pool.stats().thread_cached_bytes, 4 * MIB as u64, "the four wait in this thread's cache");
    let mapped = dev.mapped_bytes_total();
    // 8 MiB, above the largest cached class (4 MiB): the 9 MiB from the base, not the 8 above.
    let big = pool.alloc(8 * MIB, &s).unwrap();
    assert_eq!(big.device_ptr(), base, "the run the cached blocks cut");
    assert_eq!(dev.mapped_bytes_total(), mapped, "nothing mapped");
    assert_eq!(pool.stats().thread_cached_bytes, 0);
    // A miss of a cached class leaves the cache alone.
    drop(big);
    drop(pool.alloc(MIB, &s).unwrap());
    let cached_now = pool.stats().thread_cached_bytes;
    assert!(cached_now > 0);
    let two = pool.alloc(2 * MIB, &s).unwrap();
    assert_eq!(pool.stats().thread_cached_bytes, cached_now, "a 2 MiB request takes no cached block back");
    drop((two, live));
    pool.flush_thread_cache();
    dev.synchronize(&s).unwrap();
    pool.check().unwrap();
}
