//! Criterion benches of the pool on the simulated device (the pool's own cost: the device
//! is only called on slow paths).
//!
//! - `pair/1_thread`: one alloc + free of 4 KiB on one stream (same-stream reuse).
//! - `pair/random_window`: 64 live blocks, sizes log-uniform 256 B – 4 MiB, one thread.
//! - `throughput/2_threads`: two threads, each its own stream, alloc + free pairs; the time
//!   reported is per pair per thread (divide by two for the aggregate).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use vrampool::{Pool, PoolConfig, SimDevice};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn size(&mut self) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (256.0 * (16384.0f64).powf(u)) as usize
    }
}

fn pair(c: &mut Criterion) {
    let dev = SimDevice::new(16 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    let mut g = c.benchmark_group("pair");
    g.bench_function("1_thread", |b| b.iter(|| drop(black_box(pool.alloc(4096, &s).unwrap()))));
    let mut rng = Rng(7);
    let mut window: Vec<_> = (0..64).map(|_| pool.alloc(rng.size(), &s).unwrap()).collect();
    g.bench_function("random_window", |b| {
        b.iter(|| {
            let i = (rng.next() % 64) as usize;
            window[i] = pool.alloc(rng.size(), &s).unwrap();
        })
    });
    g.finish();
}

fn throughput(c: &mut Criterion) {
    let dev = SimDevice::new(16 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let streams: Vec<_> = (0..2).map(|_| dev.new_stream().unwrap()).collect();
    let mut g = c.benchmark_group("throughput");
    g.bench_function("2_threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|sc| {
                for s in &streams {
                    let pool = &pool;
                    sc.spawn(move || {
                        for _ in 0..iters {
                            drop(black_box(pool.alloc(4096, s).unwrap()));
                        }
                    });
                }
            });
            start.elapsed()
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = pair, throughput
}
criterion_main!(benches);
