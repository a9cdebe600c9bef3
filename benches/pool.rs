//! Criterion benches: the pool's own cost on the simulated device (the device is only called
//! on slow paths), beside two baselines measured in the same run:
//!
//! - `bestfit`: a `Mutex<BTreeMap>` best-fit coalescing pool, the classic design of PyTorch's
//!   and RMM's pool allocators (`benches/support/bestfit.rs`);
//! - `arena`: vrampool's tier T3 alone (`__bench::Alone`): one stream's buddy over 2 MiB
//!   chunks for small blocks, the lock-free first-fit extents for large ones, no caches, no
//!   device, no page map.
//!
//! Groups:
//! - `hot_pair`: one alloc + free of 1 MiB, same class, same stream; and the arena's on 1
//!   and 2 threads at once (`arena_threads`, per pair per thread).
//! - `random_window`: 64 live blocks, sizes log-uniform 256 B – 4 MiB, replacing a random one
//!   per iteration (one alloc + one free), on 1 and 2 threads (each thread its own stream
//!   and window, threads kept for the whole benchmark so the caches are measured warm; the
//!   time is per pair per thread, so 2 threads at the same time as 1 thread means twice the
//!   aggregate throughput).
//! - `large_pair`: one alloc + free of an uncached block (8, 64 and 256 MiB) through
//!   `pool.alloc` on mapped memory, with 8 live blocks below it, beside best-fit's: what a
//!   large block's trip through the arena costs as it grows (the best-fit pool's is the
//!   same at any size).

use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use vrampool::__bench::Alone;
use vrampool::{Pool, PoolConfig, SimDevice, Stream};

#[path = "support/bestfit.rs"]
mod bestfit;
use bestfit::BestFit;

const HOT: usize = 1 << 20;
const WINDOW: usize = 64;

#[path = "support/sizes.rs"]
mod sizes;
use sizes::Rng;

fn setup() -> (SimDevice, Pool, Vec<Stream>) {
    let dev = SimDevice::new(64 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let streams = (0..2).map(|_| dev.new_stream().unwrap()).collect();
    (dev, pool, streams)
}

fn hot_pair(c: &mut Criterion) {
    let (_dev, pool, streams) = setup();
    let s = &streams[0];
    let mut g = c.benchmark_group("hot_pair");
    let cache = pool.stream_cache(s).unwrap();
    g.bench_function("stream_cache", |b| b.iter(|| drop(black_box(cache.alloc(HOT).unwrap()))));
    g.bench_function("pool_alloc", |b| b.iter(|| drop(black_box(pool.alloc(HOT, s).unwrap()))));
    let space = Alone::new(1 << 40, 1 << 40, 512 << 10).unwrap();
    let arena = space.stream().unwrap();
    let hot = space.size_for(HOT as u64).unwrap();
    g.bench_function("arena", |b| {
        b.iter(|| {
            let a = arena.alloc(hot).unwrap();
            arena.free(black_box(a), hot);
        })
    });
    let bf = BestFit::new(0, 1 << 40);
    g.bench_function("bestfit", |b| {
        b.iter(|| {
            let a = bf.alloc(HOT as u64).unwrap();
            bf.free(black_box(a), HOT as u64);
        })
    });
    // The arena's hot pair on 1 and 2 threads at once, each its own stream over one space:
    // what NBBS's `TB_cached_allocation` measures (per pair per thread).
    for threads in [1usize, 2] {
        let space = Alone::new(1 << 40, 1 << 40, 512 << 10).unwrap();
        window_crew(&mut g, "arena_threads", threads, |_, _| {
            let arena = space.stream().expect("a stream's arena");
            move |_: &mut Rng| {
                let a = arena.alloc(hot).expect("the space holds one block a thread");
                arena.free(black_box(a), hot);
            }
        });
    }
    g.finish();
}

type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// The random window on `threads` threads that live for the whole benchmark: each builds its
/// own state on its own thread with `make` (a window filled through its allocator; a
/// `StreamCache` is not `Send`), then for every sample runs the iterations criterion asks
/// for and times its own loop; a sample takes the slowest thread's time. Threads made per
/// sample would measure a cold cache at every sample, and a lock around a shared window
/// would cost the baselines more than their allocator does.
fn window_crew<M, S>(g: &mut Group<'_>, name: &str, threads: usize, make: M)
where
    M: Fn(usize, &mut Rng) -> S + Sync,
    S: FnMut(&mut Rng),
{
    std::thread::scope(|sc| {
        let (done_tx, done_rx) = mpsc::channel::<Duration>();
        let orders: Vec<mpsc::Sender<u64>> = (0..threads)
            .map(|t| {
                let (tx, rx) = mpsc::channel::<u64>();
                let (done, make) = (done_tx.clone(), &make);
                sc.spawn(move || {
                    let mut rng = Rng::new(0x9e37_79b9 ^ (t as u64 + 1));
                    let mut step = make(t, &mut rng);
                    // Ends when the bench drops its senders.
                    for iters in rx {
                        let begin = Instant::now();
                        for _ in 0..iters {
                            step(&mut rng);
                        }
                        if done.send(begin.elapsed()).is_err() {
                            break;
                        }
                    }
                });
                tx
            })
            .collect();
        g.bench_with_input(BenchmarkId::new(name, threads), &threads, |b, &threads| {
            b.iter_custom(|iters| {
                for o in &orders {
                    o.send(iters).expect("a window thread is gone");
                }
                (0..threads).map(|_| done_rx.recv().expect("a window thread is gone")).max().unwrap_or_default()
            })
        });
        drop(orders);
    });
}

/// The window step of a baseline that frees at once (no streams): replace a random block.
fn baseline_step<'a>(
    rng: &mut Rng,
    alloc: &'a (dyn Fn(u64) -> Option<u64> + Sync),
    free: &'a (dyn Fn(u64, u64) + Sync),
) -> impl FnMut(&mut Rng) + 'a {
    let mut w: Vec<(u64, u64)> = (0..WINDOW)
        .map(|_| {
            let s = rng.size() as u64;
            (alloc(s).expect("the baseline's range holds the window"), s)
        })
        .collect();
    move |rng: &mut Rng| {
        let i = (rng.next() % WINDOW as u64) as usize;
        let s = rng.size() as u64;
        let a = alloc(s).expect("the baseline's range holds the window");
        let (old, old_s) = std::mem::replace(&mut w[i], (a, s));
        free(old, old_s);
    }
}

fn random_window(c: &mut Criterion) {
    let (_dev, pool, streams) = setup();
    let mut g = c.benchmark_group("random_window");
    for threads in [1usize, 2] {
        window_crew(&mut g, "vrampool", threads, |t, rng| {
            let cache = pool.stream_cache(&streams[t]).expect("a stream cache");
            let mut w: Vec<_> = (0..WINDOW).map(|_| cache.alloc(rng.size()).expect("the window fits")).collect();
            move |rng: &mut Rng| {
                let i = (rng.next() % WINDOW as u64) as usize;
                w[i] = cache.alloc(rng.size()).expect("the window fits");
            }
        });
        // Each thread its own stream (its own arena of chunks), the space shared.
        let space = Alone::new(1 << 40, 1 << 40, 512 << 10).expect("a space");
        window_crew(&mut g, "arena", threads, |_, rng| {
            let arena = space.stream().expect("a stream's arena");
            let round = |s: u64| space.size_for(s).expect("a size");
            let mut w: Vec<(u64, u64)> = (0..WINDOW)
                .map(|_| {
                    let s = round(rng.size() as u64);
                    (arena.alloc(s).expect("the window fits"), s)
                })
                .collect();
            move |rng: &mut Rng| {
                let i = (rng.next() % WINDOW as u64) as usize;
                let s = round(rng.size() as u64);
                let a = arena.alloc(s).expect("the window fits");
                let (old, old_s) = std::mem::replace(&mut w[i], (a, s));
                arena.free(old, old_s);
            }
        });
        let bf = BestFit::new(0, 1 << 40);
        let (alloc, free) = (|s| bf.alloc(s), |a, s| bf.free(a, s));
        window_crew(&mut g, "bestfit", threads, |_, rng| baseline_step(rng, &alloc, &free));
    }
    g.finish();
}

fn large_pair(c: &mut Criterion) {
    let (_dev, pool, streams) = setup();
    let s = &streams[0];
    let _below: Vec<_> = (0..8).map(|i| pool.alloc((5 + i) << 20, s).unwrap()).collect();
    let bf = BestFit::new(0, 1 << 40);
    let _bf_below: Vec<_> = (0..8).map(|i| bf.alloc((5 + i) << 20).unwrap()).collect();
    let mut g = c.benchmark_group("large_pair");
    for mib in [8usize, 64, 256] {
        let bytes = mib << 20;
        // Mapped once, then reused in place.
        drop(pool.alloc(bytes, s).unwrap());
        g.bench_with_input(BenchmarkId::new("pool_alloc", mib), &bytes, |b, &n| {
            b.iter(|| drop(black_box(pool.alloc(n, s).unwrap())))
        });
        g.bench_with_input(BenchmarkId::new("bestfit", mib), &(bytes as u64), |b, &n| {
            b.iter(|| {
                let a = bf.alloc(n).unwrap();
                bf.free(black_box(a), n);
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hot_pair, random_window, large_pair
}
criterion_main!(benches);
