//! Criterion bench: a typed buffer costs what a block costs on the hit path. The hot pair
//! (one allocation and its free, same class, same stream, simulated device) four ways in one
//! run: `Block`s through a `StreamCache` and through `pool.alloc`, and `Buffer<f32>`s of the
//! same bytes through `StreamCache::alloc_buffer` and `pool.alloc_buffer`. Compare each
//! buffer line with the block line above it (a ratio within the run, never a fixed figure).
//! Also the same pairs with the device address used, the way a caller uses a buffer.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use vrampool::{Pool, PoolConfig, SimDevice};

/// 1 MiB, as the pool bench's hot pair.
const BYTES: usize = 1 << 20;
const FLOATS: usize = BYTES / 4;

fn hot_pair(c: &mut Criterion) {
    let dev = SimDevice::new(64 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    let cache = pool.stream_cache(&s).unwrap();
    let mut g = c.benchmark_group("buffer_hot_pair");
    g.bench_function("stream_cache_block", |b| b.iter(|| drop(black_box(cache.alloc(black_box(BYTES)).unwrap()))));
    g.bench_function("stream_cache_buffer", |b| {
        b.iter(|| drop(black_box(cache.alloc_buffer::<f32>(black_box(FLOATS)).unwrap())))
    });
    g.bench_function("pool_alloc_block", |b| b.iter(|| drop(black_box(pool.alloc(black_box(BYTES), &s).unwrap()))));
    g.bench_function("pool_alloc_buffer", |b| {
        b.iter(|| drop(black_box(pool.alloc_buffer::<f32>(black_box(FLOATS), &s).unwrap())))
    });
    g.bench_function("stream_cache_block_used", |b| {
        b.iter(|| {
            let blk = cache.alloc(black_box(BYTES)).unwrap();
            black_box((blk.device_ptr(), blk.len()));
        })
    });
    g.bench_function("stream_cache_buffer_used", |b| {
        b.iter(|| {
            let buf = cache.alloc_buffer::<f32>(black_box(FLOATS)).unwrap();
            black_box((buf.device_ptr(), buf.len()));
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = hot_pair
}
criterion_main!(benches);
