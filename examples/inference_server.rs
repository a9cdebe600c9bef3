//! The main demo: an inference server's worker threads, each with its own stream, allocating
//! activations of varied sizes, using them on the device, and freeing them in stream order;
//! now and then a tensor crosses to a shared copy stream (`record_stream`). Prints the pool's
//! figures at the end.
//!
//! `cargo run --release --example inference_server` — on the GPU when there is one, else on
//! the simulated device. Options: `--workers N` (default 4), `--requests N` (per worker,
//! default 2000).

use std::sync::Arc;
use std::time::Instant;

use vrampool::{Device, Pool, PoolConfig};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A small xorshift generator: the demo needs no dependency for randomness.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Log-uniform in [lo, hi).
    fn size(&mut self, lo: f64, hi: f64) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (lo * (hi / lo).powf(u)) as usize
    }
}

fn main() -> Result<(), vrampool::Error> {
    let workers = arg("--workers", 4);
    let requests = arg("--requests", 2000);
    let (device, why) = vrampool::device::auto(16 << 30);
    println!("device: {why}");
    let pool = Pool::with_device(device.clone(), PoolConfig::default())?;
    let copy_stream = device.create_stream()?;
    let t = Instant::now();
    let served: Vec<Result<u64, vrampool::Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (pool, device, copy_stream) = (pool.clone(), Arc::clone(&device), copy_stream.clone());
                scope.spawn(move || worker(w, requests, &pool, &*device, &copy_stream))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(Err(vrampool::Error::NotPermitted("worker panicked")))).collect()
    });
    let elapsed = t.elapsed();
    let mut allocations = 0;
    for r in served {
        allocations += r?;
    }
    device.synchronize(&copy_stream)?;
    let st = pool.stats();
    println!(
        "{workers} workers served {} requests with {allocations} allocations in {:.2?} ({:.0} ns per alloc+free, wall)",
        workers * requests,
        elapsed,
        elapsed.as_nanos() as f64 / allocations as f64
    );
    println!(
        "peak allocated {:.1} MiB, peak reserved {:.1} MiB; thread-cache hits {:.1}%, depot hits {:.1}%; \
         events recorded {}, batches retired {}",
        st.peak_allocated_bytes as f64 / (1 << 20) as f64,
        st.peak_reserved_bytes as f64 / (1 << 20) as f64,
        100.0 * st.t0_hit_rate(),
        100.0 * st.t1_hit_rate(),
        st.events_recorded,
        st.batches_retired
    );
    pool.trim()?;
    pool.check()?;
    let st = pool.stats();
    println!("after trim: allocated {} B, reserved {} B", st.allocated_bytes, st.reserved_bytes);
    Ok(())
}

/// One worker: its own stream; each request allocates a few activations, runs "layers"
/// (memsets on the device), sends one result to the copy stream, and frees everything.
fn worker(
    id: usize,
    requests: usize,
    pool: &Pool,
    device: &dyn Device,
    copy: &vrampool::Stream,
) -> Result<u64, vrampool::Error> {
    let stream = device.create_stream()?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (id as u64 + 1));
    let mut allocations = 0;
    for _ in 0..requests {
        let layers = 2 + (rng.next() % 6) as usize;
        let mut live = Vec::with_capacity(layers);
        for _ in 0..layers {
            let b = pool.alloc(rng.size(4096.0, 4.0 * 1048576.0), &stream)?;
            // Touch the first bytes, as a kernel would (cheap on both devices).
            device.memset(b.device_ptr(), 0, b.len().min(4096), &stream)?;
            live.push(b);
            allocations += 1;
        }
        if let Some(out) = live.last() {
            out.record_stream(copy);
        }
        drop(live);
    }
    device.synchronize(&stream)?;
    device.destroy_stream(&stream)?;
    Ok(allocations)
}
