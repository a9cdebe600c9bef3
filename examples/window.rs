//! The multi-threaded random window's steady state, with the pool's own figures over the
//! measured pairs alone: what `compare`'s window times, and where its time goes (misses,
//! driver calls, memory held, caches). Runs on the GPU when there is one (built with
//! `--features cuda`), else on the simulated device, whose `--costs` make a server's
//! steady state (driver calls queued behind one lock) visible without a GPU.
//!
//! Each thread has its own stream and `StreamCache` and keeps 64 live blocks of 256 B – 4 MiB
//! (log-uniform), replacing a random one per step; every thread warms up for `--warm N`
//! pairs, then all run `--pairs N` measured pairs at once.
//!
//! ```text
//! cargo run --release --example window -- --threads 16 --costs
//! ```
//!
//! Options: `--threads N` (default 4), `--pairs N` (default 200,000 a thread), `--warm N`
//! (default as `--pairs`), `--sim` (the simulator even where there is a GPU), `--sim-gib N`
//! (its memory, default 64), `--costs` (the simulator spends an H200 driver's costs, maps
//! and loans queued behind one driver lock), `--no-trade` (`PoolConfig::trade_pages_on_map`
//! off), `--map-run-pages N`, `--largest-cached N` and `--thread-cache N`
//! (`PoolConfig::largest_cached_class` and `thread_cache_bytes`, in bytes), `--hold F` (before
//! the threads start, hold F of `max_reserved` in 64 MiB blocks until the end, as an LLM
//! server holds its KV cache: the window then runs in what is left).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use vrampool::{Block, Device, Pool, PoolConfig, SimDevice, Stats, Stream};

#[path = "../benches/support/sizes.rs"]
mod sizes;
use sizes::Rng;

#[path = "support/device.rs"]
mod device;
use device::gpu_or_sim;

const WINDOW: usize = 64;

struct Args {
    threads: usize,
    pairs: u64,
    warm: u64,
    costs: bool,
    sim: bool,
    sim_gib: u64,
    hold: f64,
    config: PoolConfig,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        threads: 4,
        pairs: 200_000,
        warm: 0,
        costs: false,
        sim: false,
        sim_gib: 64,
        hold: 0.0,
        config: PoolConfig::default(),
    };
    let mut warm = None;
    let mut it = std::env::args().skip(1);
    let num = |v: Option<String>, what: &str| -> Result<u64, String> {
        v.and_then(|s| s.replace('_', "").parse().ok()).ok_or_else(|| format!("{what} needs a number"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--threads" => a.threads = num(it.next(), "--threads")?.max(1) as usize,
            "--pairs" => a.pairs = num(it.next(), "--pairs")?,
            "--warm" => warm = Some(num(it.next(), "--warm")?),
            "--costs" => a.costs = true,
            "--sim" => a.sim = true,
            "--sim-gib" => a.sim_gib = num(it.next(), "--sim-gib")?.max(1),
            "--hold" => {
                a.hold = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .filter(|f: &f64| (0.0..1.0).contains(f))
                    .ok_or("--hold needs a fraction in [0, 1)")?
            }
            "--no-trade" => a.config.trade_pages_on_map = false,
            "--largest-cached" => a.config.largest_cached_class = num(it.next(), "--largest-cached")?,
            "--thread-cache" => a.config.thread_cache_bytes = num(it.next(), "--thread-cache")?,
            "--map-run-pages" => a.config.map_run_pages = num(it.next(), "--map-run-pages")? as usize,
            other => return Err(format!("unknown option {other}")),
        }
    }
    a.warm = warm.unwrap_or(a.pairs);
    Ok(a)
}

fn step(cache: &vrampool::StreamCache, slots: &mut [Option<Block>], rng: &mut Rng) -> Result<(), String> {
    let i = (rng.next() % WINDOW as u64) as usize;
    let size = rng.size();
    let fresh = cache.alloc(size).map_err(|e| format!("alloc of {size} B: {e}"))?;
    slots[i] = Some(fresh);
    Ok(())
}

/// `--hold`: `fraction` of `max_reserved` in 64 MiB blocks (the last one smaller), on a
/// stream of its own that is synchronized before the window starts.
fn hold(pool: &Pool, dev: &dyn Device, fraction: f64) -> Result<Vec<Block>, String> {
    let total = (pool.max_reserved() as f64 * fraction) as u64;
    if total == 0 {
        return Ok(Vec::new());
    }
    let mut left = total;
    let stream = dev.create_stream().map_err(|e| e.to_string())?;
    let mut blocks = Vec::new();
    while left > 0 {
        let size = left.min(64 << 20);
        blocks.push(pool.alloc(size as usize, &stream).map_err(|e| format!("{} MiB held: {e}", blocks.len() * 64))?);
        left -= size;
    }
    dev.synchronize(&stream).map_err(|e| e.to_string())?;
    println!("holding {:.0} MiB in {} blocks", mib(total), blocks.len());
    Ok(blocks)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("window: {e}");
            std::process::exit(2);
        }
    };
    let (dev, sim, what) = gpu_or_sim(args.sim, args.sim_gib << 30, args.costs);
    println!("{what}");
    let pool = match Pool::new(Arc::clone(&dev), args.config.clone()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("window: pool: {e}");
            std::process::exit(1);
        }
    };
    let streams: Vec<Stream> = match (0..args.threads).map(|_| dev.create_stream()).collect() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("window: streams: {e}");
            std::process::exit(1);
        }
    };
    let held = match hold(&pool, &*dev, args.hold) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("window: --hold: {e}");
            std::process::exit(1);
        }
    };
    // Every thread meets the main thread at four barriers, failed or not: after its warm-up
    // (the figures start), before its measured pairs, after them (the figures end), and
    // before it frees its window.
    let barrier = Barrier::new(args.threads + 1);
    let results: Vec<Result<Duration, String>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let (pool, barrier, stream, args, dev) = (&pool, &barrier, &streams[t], &args, &dev);
                sc.spawn(move || -> Result<Duration, String> {
                    let cache = pool.stream_cache(stream).map_err(|e| format!("stream cache: {e}"));
                    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1));
                    let mut slots: Vec<Option<Block>> = (0..WINDOW).map(|_| None).collect();
                    let mut run = |pairs: u64| -> Result<(), String> {
                        let cache = cache.as_ref().map_err(Clone::clone)?;
                        (0..pairs).try_for_each(|_| step(cache, &mut slots, &mut rng))
                    };
                    let warm = run(args.warm);
                    let _ = dev.synchronize(stream);
                    barrier.wait();
                    barrier.wait();
                    let start = Instant::now();
                    let measured = warm.and_then(|()| run(args.pairs));
                    let took = start.elapsed();
                    let _ = dev.synchronize(stream);
                    barrier.wait();
                    barrier.wait();
                    drop(slots);
                    measured.map(|()| took)
                })
            })
            .collect();
        barrier.wait();
        let before = pool.stats();
        barrier.wait();
        barrier.wait();
        report(&args, &before, &pool.stats(), sim.as_ref());
        barrier.wait();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a worker panicked".into()))).collect()
    });
    let mut wall = Duration::ZERO;
    for r in results {
        match r {
            Ok(d) => wall = wall.max(d),
            Err(e) => {
                eprintln!("window: {e}");
                std::process::exit(1);
            }
        }
    }
    drop(held);
    let pairs = args.pairs * args.threads as u64;
    println!(
        "{} threads: {:.2} M pairs/s in aggregate ({:.1} ns a pair per thread)",
        args.threads,
        pairs as f64 / wall.as_secs_f64() / 1e6,
        wall.as_nanos() as f64 * args.threads as f64 / pairs.max(1) as f64
    );
}

/// The measured pairs' figures, read with every thread's window full.
fn report(args: &Args, b: &Stats, a: &Stats, sim: Option<&SimDevice>) {
    let d = |f: fn(&Stats) -> u64| f(a).saturating_sub(f(b));
    let allocs = d(|s| s.allocs).max(1);
    println!(
        "measured {} pairs a thread: T0 misses {:.3}%, ladder flushes {}, maps {}, pages lent {}, switched {}, \
         device waits {}, host waits {}; {:.1} ms in the ladder, {:.1} releasing",
        args.pairs,
        100.0 * allocs.saturating_sub(d(|s| s.t0_hits)) as f64 / allocs as f64,
        d(|s| s.ladder_flushes),
        d(|s| s.ladder_maps),
        d(|s| s.pages_lent),
        d(|s| s.pages_switched),
        d(|s| s.device_waits),
        d(|s| s.ladder_waits),
        d(|s| s.ladder_ns) as f64 / 1e6,
        d(|s| s.release_ns) as f64 / 1e6,
    );
    println!(
        "mapped in the pairs {:.0} MiB (loans included), {:.1} ms in maps; at the end: allocated {:.0} MiB, \
         reserved {:.0} (peak {:.0}), lent {:.0}, thread caches {:.0}, depots {:.0}, free mapped {:.0}{}",
        mib(d(|s| s.mapped_bytes)),
        d(|s| s.map_ns) as f64 / 1e6,
        mib(a.allocated_bytes),
        mib(a.reserved_bytes),
        mib(a.peak_reserved_bytes),
        mib(a.lent_bytes),
        mib(a.thread_cached_bytes),
        mib(a.depot_bytes),
        mib(a.free_mapped_bytes),
        sim.map_or(String::new(), |s| format!("; the simulator holds {:.0} MiB", mib(s.committed_bytes()))),
    );
    let rungs: Vec<String> = (0..a.ladder_rungs.len())
        .map(|i| {
            let ns = a.ladder_rung_ns[i].saturating_sub(b.ladder_rung_ns[i]);
            format!("{}: {} ({:.1} ms)", i + 1, a.ladder_rungs[i].saturating_sub(b.ladder_rungs[i]), ns as f64 / 1e6)
        })
        .collect();
    println!("misses placed by the ladder's rungs: {}", rungs.join(", "));
    // The driver's share of a miss, the rest being the pool's own work (and its contention).
    let ms = |ns: u64| ns as f64 / 1e6;
    println!(
        "driver calls in the pairs: maps {:.1} ms, unmaps {:.1}, events {:.1} (queries {:.1} for {}, records {:.1} \
         for {}, device waits {:.1}, capture checks {:.1})",
        ms(d(|s| s.map_ns)),
        ms(d(|s| s.unmap_ns)),
        ms(d(|s| s.event_ns)),
        ms(d(|s| s.query_ns)),
        d(|s| s.events_queried),
        ms(d(|s| s.record_ns)),
        d(|s| s.events_recorded),
        ms(d(|s| s.wait_ns)),
        ms(d(|s| s.capture_ns)),
    );
}
