//! Near its limit, the pool refuses a request only when it truly does not fit: an
//! out-of-memory error is allowed only when the bytes asked for and not yet freed (by every
//! thread together) plus the request exceed 95% of `max_reserved`. Class rounding, blocks
//! borrowed from larger classes, memory held in other streams' caches and memory freed on a
//! stream that has not yet run past the free must all give way before the pool says no.
//!
//! Each case runs threads that allocate on their streams, use every block on its stream (a
//! stream-ordered write at each end, which faults the simulated context if the memory is
//! not mapped by then), and let the streams fall behind the host (now and then a span of
//! device time; each thread keeps at most ~128 allocations' worth of work queued). Every
//! refusal records the utilisation: (bytes live + the request) ÷ `max_reserved`, with the
//! live bytes read before the call and after the refusal and the larger taken (threads free
//! concurrently; the pool gets the benefit of the doubt).
//!
//! 1. `a_window_of_mixed_sizes_is_refused_only_above_95_percent`: 8 threads × 4 streams, 32
//!    live blocks each of 1 B – 8 MiB (log-uniform), ~520,000 allocations, on a 320 MiB
//!    device with `max_reserved` 256 MiB (issue 11).
//! 2. `a_window_beside_a_kv_cache_is_refused_only_above_95_percent`: a KV cache of 62.5% of
//!    the limit held throughout, and beside it 8 threads × 4 streams, 32 live blocks each of
//!    1 B – 4 MiB.
//! 3. `filling_to_the_brim_from_several_streams_is_refused_only_above_95_percent`: 4 threads,
//!    each on its own stream, allocate blocks of 64 KiB – 32 MiB until refused, then free a
//!    random half and go on, so the pool lives at its limit and every refusal is a
//!    judgement: memory one stream freed must serve another's request, with a device or host
//!    wait if need be, rather than fail it.
//!
//! `VRAMPOOL_NEAR_LIMIT_ALLOCS` sets the allocations of a run (release default: 520,000,
//! 320,000 and 80,000; debug builds run a tenth).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use vrampool::{Block, Device, Error, Event, Pool, PoolConfig, SimDevice, Stream};

const MIB: u64 = 1 << 20;
const DEVICE: u64 = 320 * MIB;
const LIMIT: u64 = 256 * MIB;
/// A refusal is allowed only above this share of `max_reserved`.
const THRESHOLD: f64 = 0.95;

fn allocs(release_default: u64) -> u64 {
    let fallback = if cfg!(debug_assertions) { release_default / 10 } else { release_default };
    std::env::var("VRAMPOOL_NEAR_LIMIT_ALLOCS").ok().and_then(|v| v.parse().ok()).unwrap_or(fallback)
}

/// The cases share the machine's cores: one at a time, so a stream lags because of its
/// work, not because the other case is running.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// xorshift64*: cheap, seedable randomness.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Log-uniform in `[lo, hi]`: as many small requests as large ones.
    fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((lo as f64) * (hi as f64 / lo as f64).powf(u)).round().clamp(lo as f64, hi as f64) as u64
    }
}

/// A refusal: its utilisation and what the pool said.
struct Refusal {
    utilisation: f64,
    what: String,
}

/// Everything the threads share.
struct World {
    dev: SimDevice,
    pool: Pool,
    streams: Vec<Stream>,
    /// Bytes asked for and not yet freed, by every thread together.
    live: AtomicU64,
    allocs: AtomicU64,
    refusals: Mutex<Vec<Refusal>>,
    errors: Mutex<Vec<String>>,
}

/// A block and the bytes asked for it.
struct Held {
    block: Block,
    size: u64,
}

/// What one thread keeps between calls: its stream, randomness and lag bound.
struct Worker<'w> {
    world: &'w World,
    stream: usize,
    rng: Rng,
    /// Two events recorded 64 allocations apart: before recording one again the thread
    /// waits for it, so at most ~128 allocations' work of this thread is queued.
    marks: [Event; 2],
    since_mark: u64,
    next_mark: usize,
}

impl World {
    fn new(streams: usize) -> World {
        let dev = SimDevice::new(DEVICE);
        let config = PoolConfig { max_reserved: Some(LIMIT), ..PoolConfig::default() };
        let pool = Pool::new(dev.clone(), config).unwrap();
        let streams = (0..streams).map(|_| dev.new_stream().unwrap()).collect();
        World {
            dev,
            pool,
            streams,
            live: AtomicU64::new(0),
            allocs: AtomicU64::new(0),
            refusals: Mutex::new(Vec::new()),
            errors: Mutex::new(Vec::new()),
        }
    }

    fn error(&self, what: String) {
        self.errors.lock().unwrap_or_else(|p| p.into_inner()).push(what);
    }

    fn worker(&self, stream: usize, seed: u64) -> Worker<'_> {
        let ev = || self.dev.create_event().unwrap();
        Worker { world: self, stream, rng: Rng(seed | 1), marks: [ev(), ev()], since_mark: 0, next_mark: 0 }
    }

    /// Stop the run, check the pool's books and report.
    fn finish(&self, name: &str, started: Instant) -> (usize, usize, f64) {
        for s in &self.streams {
            if let Err(e) = self.dev.synchronize(s) {
                self.error(format!("the device faulted: {e}"));
            }
        }
        let stats = self.pool.stats();
        self.pool.trim().unwrap();
        self.pool.check().unwrap();
        let refusals = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        let lowest = refusals.iter().min_by(|a, b| a.utilisation.total_cmp(&b.utilisation));
        let below = refusals.iter().filter(|r| r.utilisation <= THRESHOLD).count();
        eprintln!(
            "{name}: {} allocations in {:.1} s, {} refused ({below} at or below {:.0}%); lowest utilisation at a \
             refusal {}; pool: peak reserved {:.1} MiB, {} ooms, {} ladder waits, {} ladder maps",
            self.allocs.load(Ordering::Relaxed),
            started.elapsed().as_secs_f64(),
            refusals.len(),
            THRESHOLD * 100.0,
            lowest.map_or("-".to_string(), |r| format!("{:.3} ({})", r.utilisation, r.what)),
            stats.peak_reserved_bytes as f64 / MIB as f64,
            stats.ooms,
            stats.ladder_waits,
            stats.ladder_maps,
        );
        let errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        assert!(errors.is_empty(), "{name}: {} errors, the first: {}", errors.len(), errors[0]);
        (refusals.len(), below, lowest.map_or(1.0, |r| r.utilisation))
    }
}

impl Worker<'_> {
    fn stream(&self) -> &Stream {
        &self.world.streams[self.stream]
    }

    /// Allocate `size` bytes and use them on the stream; a refusal is recorded.
    fn alloc(&mut self, size: u64) -> Option<Held> {
        let w = self.world;
        let before = w.live.load(Ordering::Acquire);
        match w.pool.alloc(size as usize, self.stream()) {
            Ok(block) => {
                w.live.fetch_add(size, Ordering::AcqRel);
                w.allocs.fetch_add(1, Ordering::Relaxed);
                self.use_on_stream(&block);
                Some(Held { block, size })
            }
            Err(Error::OutOfMemory(oom)) => {
                let live = before.max(w.live.load(Ordering::Acquire));
                let utilisation = (live + size) as f64 / LIMIT as f64;
                let what = format!(
                    "{size} B asked with {:.1} MiB live; the pool had {:.1} MiB reserved, {:.1} allocated, \
                     {:.1} cached, {:.1} retiring, largest free {:.1}",
                    live as f64 / MIB as f64,
                    oom.reserved as f64 / MIB as f64,
                    oom.allocated as f64 / MIB as f64,
                    oom.cached as f64 / MIB as f64,
                    oom.retiring as f64 / MIB as f64,
                    oom.largest_free as f64 / MIB as f64,
                );
                w.refusals.lock().unwrap_or_else(|p| p.into_inner()).push(Refusal { utilisation, what });
                None
            }
            Err(e) => {
                w.error(format!("alloc({size}) on stream {}: {e}", self.stream));
                None
            }
        }
    }

    /// A write at each end of the block, in stream order (the simulated context faults if
    /// either lands on memory unmapped by the time the stream runs it); now and then a span
    /// of device time, so the stream falls behind; and the bound on how far.
    fn use_on_stream(&mut self, block: &Block) {
        let (dev, s) = (&self.world.dev, &self.world.streams[self.stream]);
        let (addr, len) = (block.device_ptr(), block.len() as u64);
        if len > 0 {
            let tag = self.rng.next() as u8;
            for at in [addr, addr + len - 1] {
                if let Err(e) = dev.memset(at, tag, 1, s) {
                    self.world.error(format!("memset at {at:#x} on stream {}: {e}", self.stream));
                }
            }
        }
        if self.rng.below(16) == 0 {
            let us = 20 + self.rng.below(480);
            if let Err(e) = dev.spin(s, us) {
                self.world.error(format!("spin on stream {}: {e}", self.stream));
            }
        }
        self.since_mark += 1;
        if self.since_mark == 64 {
            self.since_mark = 0;
            let ev = &self.marks[self.next_mark];
            self.next_mark ^= 1;
            let waited = dev.synchronize_event(ev).and_then(|()| dev.record_event(ev, s));
            if let Err(e) = waited {
                self.world.error(format!("lag bound on stream {}: {e}", self.stream));
            }
        }
    }

    fn free(&self, held: Held) {
        let Held { block, size } = held;
        drop(block);
        self.world.live.fetch_sub(size, Ordering::AcqRel);
    }
}

fn report(name: &str, below: usize, lowest: f64) {
    assert_eq!(
        below,
        0,
        "{name}: {below} requests were refused at or below {:.0}% of max_reserved (lowest {lowest:.3})",
        THRESHOLD * 100.0
    );
}

/// The streams the window cases' threads share.
const WINDOW_STREAMS: usize = 4;

/// The window cases' threads: 8 threads over [`WINDOW_STREAMS`] streams, each keeping 32 live
/// blocks of 1 B – `largest` (log-uniform), replacing a random one per step, `total`
/// allocations in all.
fn windows(world: &World, total: u64, largest: u64, seed: u64) {
    const THREADS: usize = 8;
    const WINDOW: usize = 32;
    let per_thread = total / THREADS as u64;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            scope.spawn(move || {
                let mut w = world.worker(t % WINDOW_STREAMS, seed ^ ((t as u64) << 32));
                let mut window: Vec<Option<Held>> = (0..WINDOW).map(|_| None).collect();
                for _ in 0..per_thread {
                    let slot = w.rng.below(WINDOW as u64) as usize;
                    if let Some(old) = window[slot].take() {
                        w.free(old);
                    }
                    let size = w.rng.log_uniform(1, largest);
                    window[slot] = w.alloc(size);
                }
                for held in window.into_iter().flatten() {
                    w.free(held);
                }
            });
        }
    });
}

// Issue 11's bar, not met yet: with exact misses near the limit, the near-limit placement
// and small blocks in the extents' gaps, runs refused 0–12 requests at or below 95% (none in
// about half of them), the lowest at 0.79–0.85; what is left is free memory in runs shorter
// than the request, which no non-moving placement gives back.
#[test]
#[ignore = "issue 11's bar: 0-12 refusals at or below 95% of max_reserved remain (lowest 0.79-0.85)"]
fn a_window_of_mixed_sizes_is_refused_only_above_95_percent() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(WINDOW_STREAMS);
    let started = Instant::now();
    windows(&world, allocs(520_000), 8 * MIB, 0x9e37_79b9_7f4a_7c15);
    let (_, below, lowest) = world.finish("window", started);
    report("window", below, lowest);
}

/// A server's KV cache, placed once and held: ten blocks of 16 MiB (62.5% of the limit);
/// beside it 8 threads × 4 streams keep 32 live activations each of 1 B – 4 MiB (all of
/// cached classes), so that the pool lives near its limit with most of it pinned.
///
/// Issue 11's bar, not met: in six runs 1,818–2,005 of about 2,000 refusals were at or
/// below 95% (lowest 0.865–0.883), as in two runs before the caches learnt to leave the KV
/// cache out of their rule (1,833–1,968, lowest 0.872–0.881); with every thread on one
/// stream, 562–569 (lowest 0.90). At a refusal the caches are
/// off (allocated within 5 MiB of live): the 30 MiB free are in pages that small blocks
/// still use in part, and a request of 2–4 MiB needs whole ones.
#[test]
#[ignore = "issue 11's bar: ~1,900 refusals at or below 95% of max_reserved remain (lowest 0.87-0.88)"]
fn a_window_beside_a_kv_cache_is_refused_only_above_95_percent() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(WINDOW_STREAMS);
    let mut kv = world.worker(0, 1);
    let cache: Vec<Held> = (0..10).map(|_| kv.alloc(16 * MIB).expect("the KV cache fits")).collect();
    let started = Instant::now();
    windows(&world, allocs(320_000), 4 * MIB, 0x6a09_e667_f3bc_c908);
    for held in cache {
        kv.free(held);
    }
    let (_, below, lowest) = world.finish("kv", started);
    report("kv", below, lowest);
}

// Issue 11's bar, not met: ~4,000 of ~8,700 refusals at or below 95% (lowest 0.58–0.75).
// Requests of up to 32 MiB (an eighth of the limit) need that many whole free pages; a
// sequential model of this case with exact sizes and the best of several placements
// (`docs/BENCHMARKS.md`, tenth session) still refused 94 at or below 95% (lowest 0.881).
#[test]
#[ignore = "issue 11's bar: ~4,000 refusals at or below 95% of max_reserved remain (lowest 0.58-0.75)"]
fn filling_to_the_brim_from_several_streams_is_refused_only_above_95_percent() {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    const THREADS: usize = 4;
    let world = World::new(THREADS);
    let per_thread = allocs(80_000) / THREADS as u64;
    let started = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let world = &world;
            scope.spawn(move || {
                let mut w = world.worker(t, 0x2545_f491_4f6c_dd1d ^ ((t as u64 + 1) << 40));
                let mut held: Vec<Held> = Vec::new();
                for _ in 0..per_thread {
                    let size = w.rng.log_uniform(64 << 10, 32 * MIB);
                    match w.alloc(size) {
                        Some(h) => held.push(h),
                        None => {
                            // Refused: give back a random half, as a server sheds requests.
                            let mut i = 0;
                            while i < held.len() {
                                if w.rng.below(2) == 0 {
                                    w.free(held.swap_remove(i));
                                } else {
                                    i += 1;
                                }
                            }
                        }
                    }
                }
                for h in held {
                    w.free(h);
                }
            });
        }
    });
    let (refused, below, lowest) = world.finish("brim", started);
    assert!(refused > 0, "the pool was never at its limit: the case tests nothing");
    report("brim", below, lowest);
}
