//! The pool on a real GPU: blocks written and checked by kernels on several streams, memory
//! freed on a busy stream, and many threads. Every test is ignored by default; run them with
//! `cargo test --release --features cuda --test gpu_pool -- --ignored --nocapture --test-threads=1`.
#![cfg(feature = "cuda")]

mod common;

use std::ops::Range;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{device, Kernels};
use vrampool::{Block, CudaDevice, Device, Event, Pool, PoolConfig, Stats, Stream, StreamCache};

const MIB: usize = 1 << 20;

/// xorshift64*: deterministic, so a failing run can be replayed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// In [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A size log-uniform in 256 B ..= 8 MiB, a multiple of 4 (whole u32 words), often not
    /// of 256 (so the pool's rounding is exercised).
    fn size(&mut self) -> usize {
        let bytes = (8.0 + 15.0 * self.unit()).exp2() as usize;
        bytes.clamp(256, 8 * MIB) & !3
    }

    /// 70%: one of a few fixed sizes (multiples of 4, some not of 256), so the thread caches
    /// hit; 30%: [`Rng::size`].
    fn repeating_size(&mut self) -> usize {
        const FIXED: [usize; 8] = [256, 1000, 4096, 12_000, 65_536, 200_000, MIB, 3 * MIB];
        if self.below(10) < 7 {
            FIXED[self.below(FIXED.len())]
        } else {
            self.size()
        }
    }
}

/// Make the work enqueued on `later` from now on wait for the work enqueued on `earlier` so far.
fn order(dev: &CudaDevice, ev: &Event, earlier: &Stream, later: &Stream) {
    dev.record_event(ev, earlier).unwrap();
    dev.stream_wait_event(later, ev).unwrap();
}

/// `N` u32 words at `addr`, read in order on `stream`.
fn read_words<const N: usize>(dev: &CudaDevice, addr: u64, stream: &Stream) -> [u32; N] {
    let mut bytes = vec![0u8; 4 * N];
    dev.copy_from_device(&mut bytes, addr, stream).unwrap();
    std::array::from_fn(|i| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()))
}

/// Trim, check the books, and expect nothing held: every block is gone and every stream idle.
fn trim_to_empty(pool: &Pool) -> Stats {
    pool.check().unwrap();
    pool.trim().unwrap();
    pool.check().unwrap();
    let st = pool.stats();
    assert_eq!(
        (st.allocated_bytes, st.reserved_bytes, st.cached_bytes, st.retiring_bytes, st.live_blocks),
        (0, 0, 0, 0, 0),
        "the pool holds memory after every block was dropped and it was trimmed: {st:?}"
    );
    st
}

fn summary(test: &str, iterations: usize, st: &Stats, took: Duration) {
    println!(
        "{test}: {iterations} iterations in {:.2} s; peak reserved {:.1} MiB, peak allocated {:.1} MiB, \
         {} events recorded, {} batches retired, {} same-stream reuses, {} ladder maps, {} ladder waits",
        took.as_secs_f64(),
        st.peak_reserved_bytes as f64 / MIB as f64,
        st.peak_allocated_bytes as f64 / MIB as f64,
        st.events_recorded,
        st.batches_retired,
        st.same_stream_reuses,
        st.ladder_maps,
        st.ladder_waits
    );
    println!("  {st:?}");
}

/// A live block of the two-stream test.
struct Live {
    block: Block,
    seed: u32,
    /// Index of the stream it was allocated on (and is freed on).
    owner: usize,
    /// Also checked on the other stream.
    cross: bool,
    /// The other stream's use declared with `record_stream` (else ordered by an event).
    recorded: bool,
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_blocks_hold_patterns_across_two_streams() {
    const ITERS: usize = 2000;
    const MAX_LIVE: usize = 32;
    let dev = device();
    let kernels = Kernels::load(&dev);
    println!("{}; kernels from {}", dev.name(), kernels.source);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    // streams[0] is A, streams[1] is B; evs[i] is recorded on streams[i].
    let streams = [dev.create_stream().unwrap(), dev.create_stream().unwrap()];
    let evs = [dev.create_event().unwrap(), dev.create_event().unwrap()];

    // The mismatch counter: a pool block, zeroed on A, used by checks on both streams.
    let bad = pool.alloc(4, &streams[0]).unwrap();
    bad.record_stream(&streams[1]);
    let badp = bad.device_ptr();
    dev.memset(badp, 0, 4, &streams[0]).unwrap();
    order(&dev, &evs[0], &streams[0], &streams[1]);

    // A last check on the owner stream (and, for `record_stream` blocks, on the other stream,
    // enqueued just before the free: the pool must keep the memory until it is done), then
    // the stream-ordered free on the owner.
    let retire = |e: Live| {
        let (o, x) = (e.owner, 1 - e.owner);
        let (p, n) = (e.block.device_ptr(), e.block.len() / 4);
        if e.cross && !e.recorded {
            // Without record_stream, the user orders the other stream's use before the free.
            order(&dev, &evs[x], &streams[x], &streams[o]);
        }
        kernels.check(&streams[o], p, n, e.seed, badp);
        if e.recorded {
            order(&dev, &evs[o], &streams[o], &streams[x]);
            kernels.check(&streams[x], p, n, e.seed, badp);
        }
        drop(e.block);
    };

    let t = Instant::now();
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<Live> = Vec::with_capacity(MAX_LIVE);
    let (mut cross_n, mut recorded_n, mut on_b) = (0, 0, 0);
    for _ in 0..ITERS {
        if rng.below(50) == 0 {
            // Now and then a burst of frees.
            for _ in 0..live.len() / 2 {
                let i = rng.below(live.len());
                retire(live.swap_remove(i));
            }
        }
        if live.len() >= MAX_LIVE || (!live.is_empty() && rng.below(3) == 0) {
            let i = rng.below(live.len());
            retire(live.swap_remove(i));
        }
        let owner = usize::from(rng.below(3) == 0);
        let x = 1 - owner;
        let len = rng.size();
        let block = pool.alloc(len, &streams[owner]).unwrap();
        assert_eq!(block.len(), len);
        assert!(block.capacity() >= len, "{block:?}");
        assert_eq!(block.device_ptr() % 256, 0, "{block:?}");
        let seed = rng.next() as u32;
        let (p, n) = (block.device_ptr(), len / 4);
        kernels.fill(&streams[owner], p, n, seed);
        kernels.check(&streams[owner], p, n, seed, badp);
        let cross = rng.below(2) == 0;
        let recorded = cross && rng.below(2) == 0;
        if cross {
            order(&dev, &evs[owner], &streams[owner], &streams[x]);
            kernels.check(&streams[x], p, n, seed, badp);
        }
        if recorded {
            block.record_stream(&streams[x]);
        }
        cross_n += usize::from(cross);
        recorded_n += usize::from(recorded);
        on_b += owner;
        live.push(Live { block, seed, owner, cross, recorded });
    }
    dev.synchronize(&streams[0]).unwrap();
    dev.synchronize(&streams[1]).unwrap();
    let [mid] = read_words::<1>(&dev, badp, &streams[0]);
    assert_eq!(mid, 0, "{mid} words did not hold their pattern (before the last frees)");
    for e in live.drain(..) {
        retire(e);
    }
    dev.synchronize(&streams[0]).unwrap();
    dev.synchronize(&streams[1]).unwrap();
    let [bad_words] = read_words::<1>(&dev, badp, &streams[0]);
    let took = t.elapsed();
    println!(
        "{ITERS} blocks: {on_b} allocated on B, {cross_n} also checked on the other stream, \
         {recorded_n} of those with record_stream; mismatched words: {bad_words}"
    );
    assert_eq!(bad_words, 0, "{bad_words} words did not hold their pattern");
    drop(bad);
    let st = trim_to_empty(&pool);
    assert!(st.events_recorded > 0 && st.batches_retired > 0, "{st:?}");
    summary("pool_blocks_hold_patterns_across_two_streams", ITERS, &st, took);
}

/// What one run of the busy-stream scenario saw.
struct BusyRun {
    /// Mismatches A's check of X found (X's memory overwritten before A was done with it).
    bad_a: u32,
    /// Mismatches in the blocks B filled, checked at the end.
    bad_b: u32,
    /// Mismatches in A's big block, checked at the end.
    bad_busy: u32,
    /// Whether one of B's blocks overlaps X's memory.
    reused_x: bool,
    /// Whether B had finished its fills before A reached its check of X.
    b_finished_first: bool,
    words: usize,
    stats: Stats,
    took: Duration,
}

/// Stream A: fill X; a gate (a host function that blocks A until B is done, or 30 s at most);
/// a big block filled many times; check X into `bad_a`. X is freed on A right after all that
/// is enqueued, while A is stuck at the gate. Then B allocates blocks of X's size and fills
/// them with another seed. Had the pool handed X's memory to B before A's check, the check
/// would see B's seed.
fn busy_stream_run(break_event_guard: bool) -> BusyRun {
    const BUSY: usize = 2 << 30;
    const X: usize = 256 * MIB;
    const B_BLOCKS: usize = 8;
    const BUSY_FILLS: u32 = 16;
    let (seed_x, seed_b, seed_busy) = (0x0a0a_1111u32, 0x0b0b_2222u32, 0x0c0c_0000u32);
    let dev = device();
    let kernels = Kernels::load(&dev);
    println!("{}; kernels from {}", dev.name(), kernels.source);
    let config = PoolConfig { break_event_guard_for_tests: break_event_guard, ..PoolConfig::default() };
    let pool = Pool::new(dev.clone(), config).unwrap();
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();

    // The big block and the counters first, so that X, once back in the arena, is the lowest
    // free block of its size: a pool that handed it out too early would hand out X itself.
    let busy = pool.alloc(BUSY, &a).unwrap();
    let counters = pool.alloc(12, &a).unwrap();
    counters.record_stream(&b);
    let c = counters.device_ptr();
    let (bad_a, bad_b, bad_busy) = (c, c + 4, c + 8);
    dev.memset(c, 0, 12, &a).unwrap();
    dev.synchronize(&a).unwrap();

    let t = Instant::now();
    let x = pool.alloc(X, &a).unwrap();
    let x_range: Range<u64> = x.device_ptr()..x.device_ptr() + x.capacity() as u64;
    kernels.fill(&a, x.device_ptr(), X / 4, seed_x);
    let (open, shut) = mpsc::channel::<()>();
    dev.launch_host_fn(
        &a,
        Box::new(move || {
            // Opened by the test once B is done; the timeout only keeps a pool that chose to
            // wait for A's event from hanging the test.
            let _ = shut.recv_timeout(Duration::from_secs(30));
        }),
    )
    .unwrap();
    for k in 0..BUSY_FILLS {
        kernels.fill(&a, busy.device_ptr(), BUSY / 4, seed_busy + k);
    }
    kernels.check(&a, x.device_ptr(), X / 4, seed_x, bad_a);
    let x_checked = dev.create_event().unwrap();
    dev.record_event(&x_checked, &a).unwrap();
    // The stream-ordered free on A, which has not even started the fills above.
    drop(x);

    let mut on_b = Vec::with_capacity(B_BLOCKS);
    for _ in 0..B_BLOCKS {
        let blk = pool.alloc(X, &b).unwrap();
        kernels.fill(&b, blk.device_ptr(), X / 4, seed_b);
        on_b.push(blk);
    }
    let overlaps =
        |blk: &Block| blk.device_ptr() < x_range.end && x_range.start < blk.device_ptr() + blk.capacity() as u64;
    let reused_x = on_b.iter().any(overlaps);
    dev.synchronize(&b).unwrap();
    let b_finished_first = !dev.query_event(&x_checked).unwrap();
    let _ = open.send(());
    dev.synchronize(&a).unwrap();

    for blk in &on_b {
        kernels.check(&b, blk.device_ptr(), X / 4, seed_b, bad_b);
    }
    kernels.check(&a, busy.device_ptr(), BUSY / 4, seed_busy + BUSY_FILLS - 1, bad_busy);
    dev.synchronize(&a).unwrap();
    dev.synchronize(&b).unwrap();
    let [bad_a, bad_b, bad_busy] = read_words::<3>(&dev, c, &a);
    let took = t.elapsed();
    println!(
        "guard {}: X at {:#x}+{X}; B's blocks at {:?}; B reused X's memory: {reused_x}; \
         B's fills done before A's check of X: {b_finished_first}; mismatches: X on A {bad_a}, B's blocks {bad_b}, \
         A's big block {bad_busy}",
        if break_event_guard { "BROKEN (test-only)" } else { "intact" },
        x_range.start,
        on_b.iter().map(|blk| format!("{:#x}", blk.device_ptr())).collect::<Vec<_>>(),
    );
    drop(on_b);
    drop(busy);
    drop(counters);
    let stats = trim_to_empty(&pool);
    BusyRun { bad_a, bad_b, bad_busy, reused_x, b_finished_first, words: X / 4, stats, took }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memory_freed_on_a_busy_stream_is_not_reused_by_another_too_early() {
    let r = busy_stream_run(false);
    if !r.b_finished_first {
        println!("note: A reached its check of X before B was done (the pool waited, or the gate timed out)");
    }
    assert_eq!(r.bad_a, 0, "X's memory was overwritten by stream B before stream A's check of it ran");
    assert_eq!(r.bad_b, 0, "B's blocks did not hold their pattern");
    assert_eq!(r.bad_busy, 0, "A's big block did not hold its pattern");
    if r.b_finished_first {
        assert!(!r.reused_x, "X's memory went to B while A had not reached the free");
    }
    summary("memory_freed_on_a_busy_stream_is_not_reused_by_another_too_early", 8, &r.stats, r.took);
}

/// The same scenario with the pool's event guard broken on purpose: it shows the test above
/// can fail. The pool then hands X to B at once, and A's check sees B's pattern.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_busy_stream_test_catches_a_broken_event_guard() {
    let r = busy_stream_run(true);
    assert_eq!(r.bad_b, 0, "B's blocks did not hold their pattern");
    assert_eq!(r.bad_busy, 0, "A's big block did not hold its pattern");
    if r.reused_x && r.b_finished_first {
        assert!(r.bad_a > 0, "B overwrote X before A's check, yet the check did not see it");
        println!(
            "as expected: with the guard broken, A's check of X saw {} of {} words of B's pattern",
            r.bad_a, r.words
        );
    } else {
        println!(
            "INCONCLUSIVE: with the guard broken, B reused X: {}, B finished first: {} (bad_a {})",
            r.reused_x, r.b_finished_first, r.bad_a
        );
    }
    summary("the_busy_stream_test_catches_a_broken_event_guard", 8, &r.stats, r.took);
}

/// The kernels, shared by the threads of one test.
struct SharedKernels(Kernels);

impl SharedKernels {
    fn get(&self) -> &Kernels {
        &self.0
    }
}

// SAFETY: `Kernels` holds a device handle (Send + Sync) and driver handles of one module of
// the primary context, which the driver lets any thread use; every launch binds the context on
// the calling thread first, and the module is unloaded only when the test drops it, after all
// threads are joined and their streams synchronized.
unsafe impl Sync for SharedKernels {}

#[test]
#[ignore = "needs a CUDA GPU"]
fn many_threads_each_with_a_stream() {
    const THREADS: usize = 8;
    const ITERS: usize = 500;
    const MAX_LIVE: usize = 8;
    let dev = device();
    let kernels = SharedKernels(Kernels::load(&dev));
    println!("{}; kernels from {}", dev.name(), kernels.0.source);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let t = Instant::now();
    let bads: Vec<u32> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|thread| {
                let (dev, pool, shared) = (&dev, &pool, &kernels);
                scope.spawn(move || {
                    let kernels = shared.get();
                    let s = dev.create_stream().unwrap();
                    let bad = pool.alloc(4, &s).unwrap();
                    let badp = bad.device_ptr();
                    dev.memset(badp, 0, 4, &s).unwrap();
                    let retire = |(blk, seed): (Block, u32)| {
                        kernels.check(&s, blk.device_ptr(), blk.len() / 4, seed, badp);
                        drop(blk);
                    };
                    let mut rng = Rng::new(0x5151_0000_0000_0001 ^ (thread as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    let mut live: Vec<(Block, u32)> = Vec::with_capacity(MAX_LIVE);
                    for _ in 0..ITERS {
                        if live.len() >= MAX_LIVE || (!live.is_empty() && rng.below(3) == 0) {
                            let i = rng.below(live.len());
                            retire(live.swap_remove(i));
                        }
                        let len = rng.size();
                        let blk = pool.alloc(len, &s).unwrap();
                        assert!(blk.capacity() >= len && blk.device_ptr() % 256 == 0, "{blk:?}");
                        let seed = rng.next() as u32;
                        kernels.fill(&s, blk.device_ptr(), len / 4, seed);
                        kernels.check(&s, blk.device_ptr(), len / 4, seed, badp);
                        live.push((blk, seed));
                    }
                    for e in live.drain(..) {
                        retire(e);
                    }
                    dev.synchronize(&s).unwrap();
                    let [n] = read_words::<1>(dev, badp, &s);
                    drop(bad);
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t.elapsed();
    println!("mismatched words per thread: {bads:?}");
    assert!(bads.iter().all(|&n| n == 0), "some blocks did not hold their pattern: {bads:?}");
    let st = trim_to_empty(&pool);
    // Frees on a block's own stream are fenced by events; batches carry only blocks used on
    // several streams, which this test has none of.
    assert!(st.events_recorded > 0, "{st:?}");
    summary("many_threads_each_with_a_stream", THREADS * ITERS, &st, took);
    drop(kernels);
}

/// Through the cache tiers: 16 threads share 6 streams (thread `i` on stream `i % 6`), so
/// several threads' caches feed each stream's depot; half allocate through an explicit
/// `StreamCache`, half through `pool.alloc`. Blocks are filled and checked by kernels on their
/// stream, a quarter are also checked on another stream (ordered by an event, declared with
/// `record_stream`), and every block is checked once more on its stream just before its free.
/// `max_reserved` of 2 GiB is well under what 16 caches of 256 MiB can hold, so the
/// out-of-memory ladder runs (flushes, waits, steals from idle caches).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_stress_through_caches_16_threads_6_streams() {
    const THREADS: usize = 16;
    const STREAMS: usize = 6;
    const ITERS: usize = 2000;
    const MAX_LIVE: usize = 16;
    const MAX_RESERVED: u64 = 2 << 30;
    let dev = device();
    let kernels = SharedKernels(Kernels::load(&dev));
    println!("{}; kernels from {}", dev.name(), kernels.0.source);
    let config = PoolConfig { max_reserved: Some(MAX_RESERVED), ..PoolConfig::default() };
    let pool = Pool::new(dev.clone(), config).unwrap();
    let streams: Vec<Stream> = (0..STREAMS).map(|_| dev.create_stream().unwrap()).collect();
    let t = Instant::now();
    // Per thread: (mismatched words, blocks hopped, allocs through its StreamCache).
    let results: Vec<(u32, usize, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|thread| {
                let (dev, pool, shared, streams) = (&dev, &pool, &kernels, &streams);
                scope.spawn(move || {
                    let kernels = shared.get();
                    let si = thread % STREAMS;
                    let s = &streams[si];
                    // Not `thread % 2`: with an even number of streams, every stream would get
                    // threads of one kind only.
                    let cache: Option<StreamCache> =
                        if (thread / 2) % 2 == 0 { Some(pool.stream_cache(s).unwrap()) } else { None };
                    let ev = dev.create_event().unwrap();
                    // The mismatch counter: zeroed on the owner stream, written by checks on
                    // every stream (each ordered after the memset by the event of its hop).
                    let bad = pool.alloc(4, s).unwrap();
                    for other in streams.iter() {
                        bad.record_stream(other);
                    }
                    let badp = bad.device_ptr();
                    dev.memset(badp, 0, 4, s).unwrap();
                    // The last check on the owner stream, then the stream-ordered free.
                    let retire = |(blk, seed): (Block, u32)| {
                        kernels.check(s, blk.device_ptr(), blk.len() / 4, seed, badp);
                        drop(blk);
                    };
                    let mut rng = Rng::new(0xc0ff_ee00_0000_0001 ^ (thread as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    let mut live: Vec<(Block, u32)> = Vec::with_capacity(MAX_LIVE);
                    let mut hopped_to = [false; STREAMS];
                    let (mut hops, mut through_cache) = (0, 0);
                    for _ in 0..ITERS {
                        if live.len() >= MAX_LIVE || (!live.is_empty() && rng.below(3) == 0) {
                            let i = rng.below(live.len());
                            retire(live.swap_remove(i));
                        }
                        let len = rng.repeating_size();
                        let blk = match &cache {
                            Some(c) => {
                                through_cache += 1;
                                c.alloc(len).unwrap()
                            }
                            None => pool.alloc(len, s).unwrap(),
                        };
                        assert_eq!(blk.len(), len);
                        assert!(blk.capacity() >= len && blk.device_ptr() % 256 == 0, "{blk:?}");
                        assert_eq!(blk.stream_id(), s.id(), "{blk:?}");
                        let seed = rng.next() as u32;
                        let (p, n) = (blk.device_ptr(), len / 4);
                        kernels.fill(s, p, n, seed);
                        if rng.below(4) == 0 {
                            // Hop: the other stream waits for the fill, checks the block, and
                            // the pool is told the block was used there.
                            let o = (si + 1 + rng.below(STREAMS - 1)) % STREAMS;
                            order(dev, &ev, s, &streams[o]);
                            kernels.check(&streams[o], p, n, seed, badp);
                            blk.record_stream(&streams[o]);
                            hopped_to[o] = true;
                            hops += 1;
                        }
                        live.push((blk, seed));
                    }
                    for e in live.drain(..) {
                        retire(e);
                    }
                    drop(cache);
                    // Read the counter on the owner stream once every stream this thread
                    // checked on has run those checks (other threads' work on the shared
                    // streams is not waited for beyond that).
                    for (o, other) in streams.iter().enumerate() {
                        if hopped_to[o] {
                            order(dev, &ev, other, s);
                        }
                    }
                    let [n] = read_words::<1>(dev, badp, s);
                    drop(bad);
                    (n, hops, through_cache)
                })
            })
            .collect();
        // Joined one by one: a join also waits for the thread's thread-local destructors,
        // which flush its caches (the scope alone does not: rust#116179).
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t.elapsed();
    for s in &streams {
        dev.synchronize(s).unwrap();
    }
    let bads: Vec<u32> = results.iter().map(|r| r.0).collect();
    let hops: usize = results.iter().map(|r| r.1).sum();
    let through_cache: usize = results.iter().map(|r| r.2).sum();
    println!(
        "mismatched words per thread: {bads:?}; {hops} blocks hopped streams; \
         {through_cache} of {} allocs through StreamCaches",
        THREADS * ITERS
    );
    assert!(bads.iter().all(|&n| n == 0), "some blocks did not hold their pattern: {bads:?}");
    let st = trim_to_empty(&pool);
    assert!(st.events_recorded > 0 && st.batches_retired > 0, "{st:?}");
    assert!(st.t0_hits > 0, "the thread caches never hit: {st:?}");
    assert!(st.peak_reserved_bytes <= MAX_RESERVED, "mapped past max_reserved: {st:?}");
    println!(
        "gpu_stress_through_caches_16_threads_6_streams: {THREADS} threads on {STREAMS} streams, {} iterations \
         in {:.2} s; T0 hit rate {:.1}%, T1 hit rate {:.1}% of {} allocs; {} events recorded, {} batches \
         retired; ladder flushes {}, maps {}, waits {}, steals {}, ooms {}; peak reserved {:.1} MiB of {} MiB",
        THREADS * ITERS,
        took.as_secs_f64(),
        100.0 * st.t0_hit_rate(),
        100.0 * st.t1_hit_rate(),
        st.allocs,
        st.events_recorded,
        st.batches_retired,
        st.ladder_flushes,
        st.ladder_maps,
        st.ladder_waits,
        st.ladder_steals,
        st.ooms,
        st.peak_reserved_bytes as f64 / MIB as f64,
        MAX_RESERVED >> 20
    );
    summary("gpu_stress_through_caches_16_threads_6_streams", THREADS * ITERS, &st, took);
    drop(streams);
    drop(kernels);
}

/// The out-of-memory handler on a GPU: a spare block, still being read on a busy stream A,
/// is what the handler frees; the allocation it rescues, on stream B, gets that memory and
/// is written at once. The pool must order B's writes after A's reads (a device wait, or a
/// host wait at the last rung): the checks on A see the spare's pattern intact.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_out_of_memory_handler_frees_memory_still_in_use_on_another_stream() {
    const MIB: usize = 1 << 20;
    let dev = device();
    let kernels = Kernels::load(&dev);
    let pool = Pool::new(dev.clone(), PoolConfig { max_reserved: Some(64 << 20), ..PoolConfig::default() }).unwrap();
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let bad = pool.alloc(4, &a).unwrap();
    bad.record_stream(&b);
    dev.memset(bad.device_ptr(), 0, 4, &a).unwrap();
    let spare = pool.alloc(48 * MIB, &a).unwrap();
    let (sp, words) = (spare.device_ptr(), 48 * MIB / 4);
    kernels.fill(&a, sp, words, 7);
    // A stays busy, then reads the spare: the read runs long after the handler freed it.
    dev.spin(&a, 20_000).unwrap();
    kernels.check(&a, sp, words, 7, bad.device_ptr());
    let spare = std::sync::Mutex::new(Some(spare));
    let spare = std::sync::Arc::new(spare);
    let evict = std::sync::Arc::clone(&spare);
    pool.set_out_of_memory_handler(move |_| evict.lock().unwrap().take().is_some());
    let rescued = pool.alloc(48 * MIB, &b).expect("the handler freed the spare");
    kernels.fill(&b, rescued.device_ptr(), words, 9);
    kernels.check(&b, rescued.device_ptr(), words, 9, bad.device_ptr());
    dev.synchronize(&a).unwrap();
    dev.synchronize(&b).unwrap();
    let st = pool.stats();
    println!(
        "oom handler: calls {}, rescues {}, device waits {}, host waits {}",
        st.oom_handler_calls, st.oom_rescues, st.device_waits, st.ladder_waits
    );
    assert_eq!((st.oom_handler_calls, st.oom_rescues), (1, 1));
    assert_eq!(read_words::<1>(&dev, bad.device_ptr(), &a)[0], 0, "A's reads saw the spare overwritten");
    pool.clear_out_of_memory_handler();
    drop((rescued, bad));
    trim_to_empty(&pool);
}
