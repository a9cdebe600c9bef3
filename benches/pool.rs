//! Criterion benches: the pool's own cost on the simulated device (the device is only called
//! on slow paths), beside two baselines measured in the same run:
//!
//! - `bestfit`: a `Mutex<BTreeMap>` best-fit coalescing pool, the classic design of PyTorch's
//!   and RMM's pool allocators (`benches/support/bestfit.rs`);
//! - `arena`: vrampool's lock-free buddy arena alone, with no caches and no retire.
//!
//! Groups:
//! - `hot_pair`: one alloc + free of 1 MiB, same class, same stream.
//! - `random_window`: 64 live blocks, sizes log-uniform 256 B – 4 MiB, replacing a random one
//!   per iteration (one alloc + one free), on 1 and 2 threads (each thread its own stream
//!   and window; the time is per pair per thread, so 2 threads at the same time as 1 thread
//!   means twice the aggregate throughput).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use vrampool::__bench::Arena;
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
    let arena = Arena::new(0, 1 << 40).unwrap();
    g.bench_function("arena", |b| {
        b.iter(|| {
            let a = arena.alloc(HOT as u64).unwrap();
            arena.free(black_box(a), HOT as u64);
        })
    });
    let bf = BestFit::new(0, 1 << 40);
    g.bench_function("bestfit", |b| {
        b.iter(|| {
            let a = bf.alloc(HOT as u64).unwrap();
            bf.free(black_box(a), HOT as u64);
        })
    });
    g.finish();
}

/// `threads` threads each replace random blocks of their own window `iters` times; returns
/// the time of the slowest thread.
fn window_run(threads: usize, iters: u64, step: &(dyn Fn(usize, &mut Rng) + Sync)) -> Duration {
    let start = Instant::now();
    std::thread::scope(|sc| {
        for t in 0..threads {
            sc.spawn(move || {
                let mut rng = Rng::new(0x2545_f491_4f6c_dd1d ^ (t as u64 + 1));
                for _ in 0..iters {
                    step(t, &mut rng);
                }
            });
        }
    });
    start.elapsed()
}

type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

/// The random window on a baseline that frees at once (no streams): each thread replaces
/// random blocks of its own window.
fn baseline_window(
    g: &mut Group<'_>,
    name: &str,
    threads: usize,
    alloc: &(dyn Fn(u64) -> Option<u64> + Sync),
    free: &(dyn Fn(u64, u64) + Sync),
) {
    let windows: Vec<std::sync::Mutex<Vec<(u64, u64)>>> = (0..threads)
        .map(|_| {
            let mut rng = Rng::new(3);
            let w = (0..WINDOW)
                .map(|_| {
                    let s = rng.size() as u64;
                    (alloc(s).unwrap(), s)
                })
                .collect();
            std::sync::Mutex::new(w)
        })
        .collect();
    g.bench_with_input(BenchmarkId::new(name, threads), &threads, |b, &threads| {
        b.iter_custom(|iters| {
            window_run(threads, iters, &|t, rng| {
                let mut w = windows[t].lock().unwrap();
                let i = (rng.next() % WINDOW as u64) as usize;
                let s = rng.size() as u64;
                let a = alloc(s).unwrap();
                let (old, old_s) = std::mem::replace(&mut w[i], (a, s));
                free(old, old_s);
            })
        })
    });
    for (a, s) in windows.into_iter().flat_map(|w| w.into_inner().unwrap()) {
        free(a, s);
    }
}

fn random_window(c: &mut Criterion) {
    let (_dev, pool, streams) = setup();
    let mut g = c.benchmark_group("random_window");
    for threads in [1usize, 2] {
        g.bench_with_input(BenchmarkId::new("vrampool", threads), &threads, |b, &threads| {
            b.iter_custom(|iters| {
                // Each thread times its own loop, after its window is full: the slowest one.
                std::thread::scope(|sc| {
                    let handles: Vec<_> = streams
                        .iter()
                        .enumerate()
                        .take(threads)
                        .map(|(t, s)| {
                            let pool = &pool;
                            sc.spawn(move || {
                                let cache = pool.stream_cache(s).unwrap();
                                let mut rng = Rng::new(0x9e37_79b9 ^ (t as u64 + 1));
                                let mut w: Vec<_> = (0..WINDOW).map(|_| cache.alloc(rng.size()).unwrap()).collect();
                                let begin = Instant::now();
                                for _ in 0..iters {
                                    let i = (rng.next() % WINDOW as u64) as usize;
                                    w[i] = cache.alloc(rng.size()).unwrap();
                                }
                                begin.elapsed()
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).max().unwrap_or_default()
                })
            })
        });
        let arena = Arena::new(0, 1 << 40).unwrap();
        baseline_window(&mut g, "arena", threads, &|s| arena.alloc(s), &|a, s| {
            arena.free(a, s);
        });
        let bf = BestFit::new(0, 1 << 40);
        baseline_window(&mut g, "bestfit", threads, &|s| bf.alloc(s), &|a, s| bf.free(a, s));
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hot_pair, random_window
}
criterion_main!(benches);
