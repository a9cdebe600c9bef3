//! Criterion bench: what a picture of the pool costs ([`Pool::snapshot`], behind
//! `vrampool_snapshot` and `torch.cuda.memory_snapshot`), on a quiet pool and while worker
//! threads allocate and free through their own `StreamCache`s. A busy thread's cache is read
//! through the handshake, waiting for its owner to end the operation it is in, so the busy
//! figure is the walk plus those waits; how many pictures came out inexact (a cache whose
//! owner stayed inside past the walk's patience) is printed after the group.
//!
//! Each worker keeps a window of 16 live blocks of 256 B – 4 MiB (the random window's
//! sizes) and replaces one per step.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use vrampool::{Pool, PoolConfig, SimDevice};

#[path = "support/sizes.rs"]
mod sizes;
use sizes::Rng;

const LIVE: usize = 16;

/// Worker threads that allocate and free until `stop`, each with its own stream and cache.
fn workers(pool: &Pool, dev: &SimDevice, n: usize, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    (0..n)
        .map(|t| {
            let (pool, dev, stop) = (pool.clone(), dev.clone(), stop.clone());
            std::thread::spawn(move || {
                let s = dev.new_stream().expect("a stream");
                let cache = pool.stream_cache(&s).expect("a cache");
                let mut rng = Rng::new(0x5eed + t as u64);
                let mut live: Vec<_> = (0..LIVE).map(|_| cache.alloc(rng.size()).expect("alloc")).collect();
                while !stop.load(Ordering::Relaxed) {
                    let i = (rng.next() % LIVE as u64) as usize;
                    live[i] = cache.alloc(rng.size()).expect("alloc");
                }
            })
        })
        .collect()
}

fn snapshot(c: &mut Criterion) {
    let mut g = c.benchmark_group("snapshot");
    for threads in [0usize, 2, 4] {
        let dev = SimDevice::new(16 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).expect("pool");
        // A quiet pool with the same kind of contents: the workers' blocks, then their caches.
        let stop = Arc::new(AtomicBool::new(threads == 0));
        let mut running = workers(&pool, &dev, threads.max(1), &stop);
        if threads == 0 {
            running.drain(..).for_each(|h| h.join().expect("worker"));
        }
        let inexact = AtomicUsize::new(0);
        let taken = AtomicUsize::new(0);
        g.bench_with_input(BenchmarkId::new("busy_threads", threads), &threads, |b, _| {
            b.iter(|| {
                let s = pool.snapshot();
                taken.fetch_add(1, Ordering::Relaxed);
                if !s.exact {
                    inexact.fetch_add(1, Ordering::Relaxed);
                }
                black_box(s.segments.len())
            })
        });
        stop.store(true, Ordering::Relaxed);
        running.into_iter().for_each(|h| h.join().expect("worker"));
        println!(
            "snapshot/busy_threads/{threads}: {} of {} pictures inexact",
            inexact.load(Ordering::Relaxed),
            taken.load(Ordering::Relaxed)
        );
    }
    g.finish();
}

criterion_group!(benches, snapshot);
criterion_main!(benches);
