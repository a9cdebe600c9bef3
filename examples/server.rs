//! An LLM inference server's memory traffic, shaped as issue 11 asks, with a busy device:
//! worker threads each serve requests on a stream of their own; a request is a prefill
//! (its prompt in chunks of at most 2,048 tokens a step, across the batch) then 8–128
//! decode steps; each step runs every layer, and each layer allocates a few activations,
//! uses them with device work and frees them; each layer also keeps a KV block for the
//! batch, regrown 64 tokens at a time (the new block allocated, the cache copied, then the
//! old one freed). After every allocation the stream gets 10–30 µs of device work
//! ([`Device::spin`]: a host function on the simulator, a spin kernel on CUDA); the worker
//! synchronizes its stream at the end of each request.
//!
//! The model is Llama-3-8B-shaped in fp16: hidden 4,096, MLP 14,336, 8 KV heads of 128,
//! vocabulary 128,256; batches of 1–16 sequences, prompts of 16–512 tokens (log-uniform).
//! Weights are left out: they would be allocated once and dilute the figure.
//!
//! Reports peak reserved ÷ peak live, where peak live is the most bytes asked for and not
//! yet freed across all threads at once (one atomic counter, its peak kept with
//! `fetch_max`).
//!
//! ```text
//! cargo run --release --example server -- [--threads 8] [--requests 8] [--duration 60] [--layers 16]
//!     [--idle] [--sim] [--costs] [--seed N] [--map-run-pages N] [--no-trade]
//! ```
//!
//! `--requests` is per thread; `--duration` (seconds) stops threads from starting new
//! requests after it; `--idle` leaves out the device work; `--sim` uses the simulator even
//! where there is a GPU, `--costs` gives it an H200 driver's costs; `--map-run-pages` sets
//! `PoolConfig::map_run_pages` (default 1: single pages, which can be lent); `--no-trade`
//! turns `PoolConfig::trade_pages_on_map` off (past its peak the pool maps new pages and
//! lends none). `RUST_LOG=vrampool=debug` shows the pool's slow paths on stderr (why a
//! placement that may map failed, before the ladder's host waits).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrampool::{Block, Device, Pool, PoolConfig, Stats, Stream};

#[path = "support/device.rs"]
mod device;
use device::gpu_or_sim;

const HIDDEN: u64 = 4096;
const MLP: u64 = 14_336;
const KV_DIM: u64 = 8 * 128;
const VOCAB: u64 = 128_256;
/// fp16.
const ELEM: u64 = 2;
/// Tokens a prefill step processes across the batch.
const PREFILL_BUDGET: u64 = 2048;
/// A KV block grows by this many tokens.
const KV_GROWTH: u64 = 64;

struct Args {
    threads: usize,
    requests: u64,
    duration: Duration,
    layers: u64,
    idle: bool,
    sim: bool,
    costs: bool,
    seed: u64,
    /// The pool's configuration, as the switches set it.
    config: PoolConfig,
}

fn parse_args() -> Args {
    let mut a = Args {
        threads: 8,
        requests: 8,
        duration: Duration::from_secs(60),
        layers: 16,
        idle: false,
        sim: false,
        costs: false,
        seed: 1,
        config: PoolConfig::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut number = |name: &str| -> u64 {
            it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                eprintln!("{name} needs a number");
                std::process::exit(2)
            })
        };
        match arg.as_str() {
            "--threads" => a.threads = number("--threads").max(1) as usize,
            "--requests" => a.requests = number("--requests"),
            "--duration" => a.duration = Duration::from_secs(number("--duration")),
            "--layers" => a.layers = number("--layers").max(1),
            "--seed" => a.seed = number("--seed"),
            "--idle" => a.idle = true,
            "--sim" => a.sim = true,
            "--costs" => a.costs = true,
            "--no-trade" => a.config.trade_pages_on_map = false,
            "--map-run-pages" => {
                let (n, most) = (number("--map-run-pages"), PoolConfig::MAX_MAP_RUN_PAGES);
                match usize::try_from(n) {
                    Ok(n @ 1..) if n <= most => a.config.map_run_pages = n,
                    _ => {
                        eprintln!("--map-run-pages {n}: 1 to {most}");
                        std::process::exit(2)
                    }
                }
            }
            other => {
                eprintln!("unknown argument {other}");
                eprintln!(
                    "usage: server [--threads N] [--requests N] [--duration S] [--layers N] [--idle] [--sim] \
                     [--costs] [--seed N] [--map-run-pages N] [--no-trade]"
                );
                std::process::exit(2);
            }
        }
    }
    a
}

/// xorshift64*: the example needs no dependency for randomness.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[lo, hi]`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// Log-uniform in `[lo, hi]`.
    fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((lo as f64) * (hi as f64 / lo as f64).powf(u)).round().clamp(lo as f64, hi as f64) as u64
    }
}

/// Bytes asked for and not yet freed, across all threads, and their peak.
#[derive(Default)]
struct Live {
    now: AtomicU64,
    peak: AtomicU64,
    allocs: AtomicU64,
}

/// One worker: its pool, stream and device, and the shared live counter.
struct Worker<'a> {
    pool: &'a Pool,
    device: &'a dyn Device,
    stream: Stream,
    live: &'a Live,
    /// The requests' shapes.
    rng: Rng,
    /// The device work's lengths, apart, so that `--idle` serves the same requests.
    work: Rng,
    idle: bool,
    layers: u64,
}

/// A block and the bytes asked for it.
struct Held(Block, u64);

impl Worker<'_> {
    /// Allocate, count, and give the stream 10–30 µs of work on the block.
    fn alloc(&mut self, bytes: u64) -> vrampool::Result<Held> {
        let b = self.pool.alloc(bytes as usize, &self.stream)?;
        let now = self.live.now.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.live.peak.fetch_max(now, Ordering::AcqRel);
        self.live.allocs.fetch_add(1, Ordering::Relaxed);
        if !self.idle {
            let us = self.work.range(10, 30);
            self.device.spin(&self.stream, us)?;
        }
        Ok(Held(b, bytes))
    }

    fn free(&self, held: Held) {
        let Held(block, bytes) = held;
        drop(block);
        self.live.now.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// One request: prefill then decode; returns the tokens generated.
    fn request(&mut self) -> vrampool::Result<u64> {
        let batch = self.rng.range(1, 16);
        let prompt = self.rng.log_uniform(16, 512);
        let decode = self.rng.range(8, 128);
        let mut kv: Vec<Option<(Held, u64)>> = (0..self.layers).map(|_| None).collect();
        let mut tokens = 0;
        // Prefill, in chunks within the step's token budget.
        let chunk = (PREFILL_BUDGET / batch).max(1);
        while tokens < prompt {
            let n = chunk.min(prompt - tokens);
            tokens += n;
            self.step(batch, n, tokens, &mut kv)?;
        }
        for _ in 0..decode {
            tokens += 1;
            self.step(batch, 1, tokens, &mut kv)?;
        }
        for (held, _) in kv.into_iter().flatten() {
            self.free(held);
        }
        self.device.synchronize(&self.stream)?;
        Ok(decode * batch)
    }

    /// One forward step over `n` new tokens a sequence, the cache then holding `tokens`.
    fn step(&mut self, batch: u64, n: u64, tokens: u64, kv: &mut [Option<(Held, u64)>]) -> vrampool::Result<()> {
        let t = batch * n;
        let mut hidden = self.alloc(t * HIDDEN * ELEM)?; // the embeddings
        for layer in kv.iter_mut() {
            let norm = self.alloc(t * HIDDEN * ELEM)?;
            let qkv = self.alloc(t * (HIDDEN + 2 * KV_DIM) * ELEM)?;
            let need = tokens.div_ceil(KV_GROWTH) * KV_GROWTH;
            if layer.as_ref().is_none_or(|(_, cap)| *cap < need) {
                // The new block first, the cache copied into it (the allocation's device
                // work), then the old one goes.
                let grown = self.alloc(2 * batch * need * KV_DIM * ELEM)?;
                if let Some((old, _)) = layer.replace((grown, need)) {
                    self.free(old);
                }
            }
            let attn = self.alloc(t * HIDDEN * ELEM)?;
            self.free(qkv);
            self.free(norm);
            let proj = self.alloc(t * HIDDEN * ELEM)?;
            self.free(attn);
            let norm = self.alloc(t * HIDDEN * ELEM)?;
            let gate_up = self.alloc(t * 2 * MLP * ELEM)?;
            let act = self.alloc(t * MLP * ELEM)?;
            self.free(gate_up);
            self.free(norm);
            let down = self.alloc(t * HIDDEN * ELEM)?;
            self.free(act);
            self.free(proj);
            self.free(std::mem::replace(&mut hidden, down));
        }
        // Logits of each sequence's last token, and the sampled tokens.
        let logits = self.alloc(batch * VOCAB * ELEM)?;
        let sampled = self.alloc(batch * 8)?;
        self.free(logits);
        self.free(sampled);
        self.free(hidden);
        Ok(())
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() {
    let args = parse_args();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let (device, sim, why) = gpu_or_sim(args.sim, 80 << 30, args.costs);
    println!("device: {why}");
    println!(
        "{} threads, {} requests each (or {} s), {} layers, device {}",
        args.threads,
        args.requests,
        args.duration.as_secs(),
        args.layers,
        if args.idle { "idle" } else { "busy 10-30 µs after each allocation" }
    );
    let pool = match Pool::with_device(Arc::clone(&device), args.config.clone()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("pool: {e}");
            std::process::exit(1);
        }
    };
    let live = Live::default();
    let start = Instant::now();
    let results: Vec<Result<(u64, u64), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.threads)
            .map(|i| {
                let (pool, device, live, args) = (&pool, &*device, &live, &args);
                scope.spawn(move || -> vrampool::Result<(u64, u64)> {
                    let stream = device.create_stream()?;
                    let seed = args.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64 + 1);
                    let mut w = Worker {
                        pool,
                        device,
                        stream,
                        live,
                        rng: Rng(seed | 1),
                        work: Rng(seed.rotate_left(32) | 1),
                        idle: args.idle,
                        layers: args.layers,
                    };
                    let (mut served, mut tokens) = (0, 0);
                    while served < args.requests && start.elapsed() < args.duration {
                        tokens += w.request()?;
                        served += 1;
                    }
                    Ok((served, tokens))
                })
            })
            .collect();
        let outcome = |h: std::thread::ScopedJoinHandle<'_, vrampool::Result<(u64, u64)>>| match h.join() {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("the thread panicked".to_string()),
        };
        handles.into_iter().map(outcome).collect()
    });
    let elapsed = start.elapsed();
    let stats: Stats = pool.stats();
    let (mut requests, mut tokens) = (0, 0);
    for r in results {
        match r {
            Ok((s, t)) => {
                requests += s;
                tokens += t;
            }
            Err(e) => {
                eprintln!("a worker failed: {e}");
                std::process::exit(1);
            }
        }
    }
    let peak_live = live.peak.load(Ordering::Acquire);
    println!(
        "{requests} requests, {tokens} tokens generated, {} allocations in {:.2} s",
        live.allocs.load(Ordering::Relaxed),
        elapsed.as_secs_f64()
    );
    println!(
        "peak live {:.1} MiB, peak reserved {:.1} MiB: peak reserved ÷ peak live {:.3}",
        mib(peak_live),
        mib(stats.peak_reserved_bytes),
        stats.peak_reserved_bytes as f64 / peak_live.max(1) as f64
    );
    println!(
        "pool: T0 hits {:.3}, T1 hits {:.3}, {} ladder maps, {} host waits, {} device waits \
         ({} reuses covered by earlier ones), {} events recorded, {} ooms",
        stats.t0_hit_rate(),
        stats.t1_hit_rate(),
        stats.ladder_maps,
        stats.ladder_waits,
        stats.device_waits,
        stats.covered_reuses,
        stats.events_recorded,
        stats.ooms,
    );
    let rungs: Vec<String> = (0..stats.ladder_rungs.len())
        .map(|i| format!("{}: {} ({:.1} ms)", i + 1, stats.ladder_rungs[i], stats.ladder_rung_ns[i] as f64 / 1e6))
        .collect();
    println!("misses placed by the ladder's rungs: {}", rungs.join(", "));
    println!(
        "pages: {} lent, {} switched back, {:.1} MiB unmapped (lent pages' addresses included)",
        stats.pages_lent,
        stats.pages_switched,
        mib(stats.unmapped_bytes)
    );
    if let Some(sim) = sim {
        println!(
            "device: {:.1} MiB mapped and {:.1} MiB unmapped over the run",
            mib(sim.mapped_bytes_total()),
            mib(sim.unmapped_bytes_total())
        );
    }
}
