//! The cost of the C ABI, on the simulated device, in one run beside what it wraps and the
//! classic baseline:
//!
//! - `rust_api`: `pool.alloc` + drop (the registry's pool, its default stream), the size
//!   known only at run time, as a C caller's is (`rust_api_const_size`: the same call with
//!   a size the compiler folds into the class lookup, which no caller of the ABI gets);
//! - `c_abi_free_any`: the same with `vrampool_free_any` (the free by address alone that the
//!   PyTorch allocator's deleter makes);
//! - `c_abi_two_streams`: a pair on stream 1, then one on stream 2, each iteration (a thread
//!   whose allocations alternate between two streams: its memo names one stream at a time);
//! - `c_abi`: `vrampool_malloc` + `vrampool_free` on the same pool and stream (NULL), called
//!   as the C functions they are (the `.so` exports the same code; a C caller adds the
//!   call through the PLT and its thread-locals' general-dynamic lookups);
//! - `bestfit`: the `Mutex<BTreeMap>` best-fit baseline (`benches/support/bestfit.rs`).
//!
//! Groups: `ffi_hot_pair` (one alloc + free of 1 MiB, one thread, one stream) and
//! `ffi_random_window` (64 live blocks, sizes log-uniform 256 B – 4 MiB, one replaced per
//! iteration, as in `benches/pool.rs`).
//!
//! ```text
//! cargo bench --bench ffi
//! ```

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use vrampool::registry;

#[path = "support/abi.rs"]
mod abi;
use abi::{free, free_any, malloc, setup};

#[path = "support/bestfit.rs"]
mod bestfit;
use bestfit::BestFit;

#[path = "support/sizes.rs"]
mod sizes;
use sizes::Rng;

const HOT: usize = 1 << 20;
const WINDOW: usize = 64;

fn hot_pair(c: &mut Criterion) {
    let pool = registry::pool(0).unwrap();
    let stream = registry::default_stream(0).unwrap();
    let mut g = c.benchmark_group("ffi_hot_pair");
    g.bench_function("rust_api", |b| b.iter(|| drop(black_box(pool.alloc(black_box(HOT), &stream).unwrap()))));
    g.bench_function("rust_api_const_size", |b| b.iter(|| drop(black_box(pool.alloc(HOT, &stream).unwrap()))));
    g.bench_function("c_abi", |b| b.iter(|| free(black_box(malloc(black_box(HOT))), HOT)));
    g.bench_function("c_abi_free_any", |b| b.iter(|| free_any(black_box(malloc(black_box(HOT))))));
    g.bench_function("c_abi_two_streams", |b| {
        b.iter(|| {
            for s in [1usize, 2] {
                let raw = s as *mut std::ffi::c_void;
                // SAFETY: the simulator takes any stream value.
                let p = unsafe { vrampool::ffi::vrampool_malloc(HOT as isize, 0, raw) };
                // SAFETY: as allocated.
                unsafe { vrampool::ffi::vrampool_free(black_box(p), HOT as isize, 0, raw) };
            }
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

fn random_window(c: &mut Criterion) {
    let pool = registry::pool(0).unwrap();
    let stream = registry::default_stream(0).unwrap();
    let mut g = c.benchmark_group("ffi_random_window");
    let mut rng = Rng::new(0x9e37_79b9);
    let mut w: Vec<_> = (0..WINDOW).map(|_| pool.alloc(rng.size(), &stream).unwrap()).collect();
    g.bench_function("rust_api", |b| {
        b.iter(|| {
            let i = (rng.next() % WINDOW as u64) as usize;
            w[i] = pool.alloc(rng.size(), &stream).unwrap();
        })
    });
    drop(w);
    let mut rng = Rng::new(0x9e37_79b9);
    let mut w: Vec<(*mut std::ffi::c_void, usize)> = (0..WINDOW)
        .map(|_| {
            let s = rng.size();
            (malloc(s), s)
        })
        .collect();
    g.bench_function("c_abi", |b| {
        b.iter(|| {
            let i = (rng.next() % WINDOW as u64) as usize;
            let s = rng.size();
            let (old, old_s) = std::mem::replace(&mut w[i], (malloc(s), s));
            free(old, old_s);
        })
    });
    for (p, s) in w {
        free(p, s);
    }
    let bf = BestFit::new(0, 1 << 40);
    let mut rng = Rng::new(0x9e37_79b9);
    let mut w: Vec<(u64, u64)> = (0..WINDOW)
        .map(|_| {
            let s = rng.size() as u64;
            (bf.alloc(s).unwrap(), s)
        })
        .collect();
    g.bench_function("bestfit", |b| {
        b.iter(|| {
            let i = (rng.next() % WINDOW as u64) as usize;
            let s = rng.size() as u64;
            let (old, old_s) = std::mem::replace(&mut w[i], (bf.alloc(s).unwrap(), s));
            bf.free(old, old_s);
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    setup();
    hot_pair(c);
    random_window(c);
}

criterion_group! {
    name = ffi;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(ffi);
