//! vrampool against the allocators it replaces, on a real GPU, in one run on the same
//! workloads (DESIGN.md §7's harness: a pair is one alloc + one free):
//!
//! - **vrampool**: `Pool` with `PoolConfig::default()`, through a `StreamCache` per thread;
//!   blocks are dropped (stream-ordered free). `--map-run-pages N` sets its
//!   `map_run_pages` (the C ABI's pools keep the registry's default).
//! - **cuMemAlloc/cuMemFree**: the synchronous driver calls.
//! - **cuMemAllocAsync/cuMemFreeAsync**: on the thread's stream, from the device's default
//!   memory pool with its release threshold set to `u64::MAX` (so it caches), warmed up.
//! - **mutex best-fit**: `benches/support/bestfit.rs` over one big `cuMemAlloc` range: host
//!   bookkeeping only, frees at once (no stream ordering), the classic design.
//! - **vrampool C ABI**: `vrampool_malloc`/`vrampool_free` on the registry's pool of GPU 0
//!   with the thread's `CUstream` handle, as a C or PyTorch caller sees vrampool (hot pair
//!   and random window only).
//! - **RMM pool** and **RMM arena** (with `--rmm librmm_shim.so`, module `rmm`): RAPIDS
//!   RMM's `pool_memory_resource` (starting empty) and `arena_memory_resource` (RMM's default
//!   size: half the free memory, taken up front), each over `cudaMalloc`, allocating and
//!   freeing on the worker's stream. Created before each workload's clock starts.
//!
//! Workloads: the hot pair (1 MiB, one thread, best of 3), the random window (1, 4 and 16
//! threads, each its own stream, 64 live blocks, sizes log-uniform 256 B – 4 MiB drawn before
//! timing) and the traces of `benches/traces`, or instead the traces named with `--trace`
//! (as `PoolConfig::record_trace` or `VRAMPOOL_RECORD_TRACE` write them: your own workload). Each measurement runs for a fixed time
//! (the iteration count follows from it), so every allocator gets ~0.4–0.8 s however slow
//! it is, after a warm-up of the same length for all (the window: half the measured time);
//! `--quick` runs every measurement 10× shorter. `--warm` plays each trace a second time
//! in the same allocator (nothing trimmed in between: a server's next step) and times that
//! pass too, as `replay --warm` does for vrampool alone; `--passes N` plays it N times and
//! times the last (a training job's steady state, once the first steps are past).
//!
//! ```text
//! cargo run --release --example compare [-- --quick] [--warm | --passes N] [--map-run-pages N] [--rmm librmm_shim.so] [--trace FILE.csv[.gz] ...]
//! ```
//!
//! Without a GPU it says so and exits 0. A failing driver call is printed and exits 1. The
//! allocators' adapters are the module `workers` (RMM's, loaded from its shim, `rmm`); the
//! trace replays are `traces`; this file holds the hot pair, the window and the run.

#[path = "../../benches/support/bestfit.rs"]
mod bestfit;
#[path = "../support/trace_file.rs"]
mod trace_file;

use std::ffi::{c_void, CStr};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use bestfit::BestFit;
use cudarc::driver::sys;
use vrampool::ffi::{vrampool_empty_cache, vrampool_last_error, vrampool_stream_destroyed};
use vrampool::registry::{self, Config, DeviceChoice};
use vrampool::{CudaDevice, Device, Pool, PoolConfig, Stats, Stream};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The hot pair's size.
const HOT: usize = 1 << 20;
/// Live blocks per thread in the random window.
const WINDOW: usize = 64;
/// Thread counts of the random window.
const THREADS: [usize; 3] = [1, 4, 16];
/// The best-fit baseline's range, one `cuMemAlloc` (train_gpt2 peaks at 5.5 GiB live).
const BESTFIT_RANGE: u64 = 16 * GIB;

/// Driver calls this program makes itself, beyond those `CudaDevice` checks: cudarc's loader
/// panics on a missing symbol, so they are looked up before the first call.
const SYMBOLS: &[&str] = &[
    "cuDriverGetVersion",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolTrimTo",
];

// ---------------------------------------------------------------------------------------
// Failing: print and exit non-zero, from any thread.

#[cold]
#[inline(never)]
fn die(what: &str) -> ! {
    eprintln!("compare: {what}");
    std::process::exit(1);
}

#[cold]
#[inline(never)]
fn die_cu(call: &str, rc: sys::CUresult) -> ! {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: writes a pointer to a static string, or leaves it null.
    let named = unsafe { sys::cuGetErrorName(rc, &mut name) } == sys::CUresult::CUDA_SUCCESS && !name.is_null();
    let text = if named {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    } else {
        format!("{rc:?}")
    };
    die(&format!("{call} failed: {text} ({})", rc as i32))
}

#[inline(always)]
fn ck(call: &str, rc: sys::CUresult) {
    if rc != sys::CUresult::CUDA_SUCCESS {
        die_cu(call, rc);
    }
}

#[inline(always)]
fn or_die<T>(what: &str, r: vrampool::Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => die(&format!("{what}: {e}")),
    }
}

fn symbols_present() -> Result<(), String> {
    match vrampool::device::cuda::missing_symbols(SYMBOLS)? {
        missing if missing.is_empty() => Ok(()),
        missing => Err(format!("the CUDA driver lacks {}", missing.join(", "))),
    }
}

// ---------------------------------------------------------------------------------------
// Sizes, drawn before timing (shared with benches/pool.rs).

#[path = "../../benches/support/sizes.rs"]
mod sizes;
use sizes::Rng;

mod workers;
use workers::{Bf, CAbi, CuAsync, CuMem, Vram, Worker};
mod rmm;
use rmm::Kind;
mod traces;

// ---------------------------------------------------------------------------------------
// Workloads.

/// One timed run of the hot pair: ns per pair.
fn hot_once<W: Worker>(w: &mut W, dur: Duration) -> (f64, u64) {
    let start = Instant::now();
    let mut pairs = 0u64;
    loop {
        for _ in 0..W::CHUNK {
            let h = w.alloc(black_box(HOT));
            w.free(black_box(h));
        }
        pairs += W::CHUNK;
        if start.elapsed() >= dur {
            break;
        }
    }
    w.sync();
    (start.elapsed().as_nanos() as f64 / pairs as f64, pairs)
}

/// A warm-up run, then the best of three: (ns per pair, pairs of the best run).
fn hot<W: Worker>(w: &mut W, dur: Duration) -> (f64, u64) {
    hot_once(w, dur / 4);
    (0..3).map(|_| hot_once(w, dur)).fold((f64::INFINITY, 0), |a, b| if b.0 < a.0 { b } else { a })
}

#[inline(always)]
fn step<W: Worker>(w: &mut W, slots: &mut [W::H], rng: &mut Rng) {
    let i = (rng.next() % WINDOW as u64) as usize;
    let fresh = w.alloc(rng.size());
    let old = std::mem::replace(&mut slots[i], fresh);
    w.free(old);
}

/// What a multi-threaded run measured.
struct Run {
    threads: usize,
    pairs: u64,
    /// The slowest thread's time.
    wall: Duration,
}

impl Run {
    /// Nanoseconds per pair, per thread.
    fn ns(&self) -> f64 {
        self.wall.as_nanos() as f64 * self.threads as f64 / self.pairs.max(1) as f64
    }
    /// Aggregate pairs per second, in millions.
    fn mps(&self) -> f64 {
        self.pairs as f64 / self.wall.as_secs_f64() / 1e6
    }
}

/// `threads` threads, thread t on `streams[t]` with the worker `make` gives it: each fills its
/// window, warms up for `dur / 2`, waits for the others, then replaces random blocks until
/// told to stop.
fn window<'a, W, F>(dev: &'a CudaDevice, streams: &'a [Stream], threads: usize, dur: Duration, make: F) -> Run
where
    W: Worker,
    F: Fn(&'a Stream) -> W + Sync,
{
    let barrier = Barrier::new(threads + 1);
    let stop = AtomicBool::new(false);
    let results: Vec<(u64, Duration)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, stop, make, stream) = (&barrier, &stop, &make, &streams[t]);
                sc.spawn(move || {
                    or_die("bind the primary context", dev.bind_context());
                    let mut w = make(stream);
                    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1));
                    let mut slots: Vec<W::H> = (0..WINDOW).map(|_| w.alloc(rng.size())).collect();
                    // Warm up for half the measured time, the same for every allocator: the
                    // figure is the steady state of a server, not its first milliseconds.
                    let warm_until = Instant::now() + dur / 2;
                    while Instant::now() < warm_until {
                        for _ in 0..W::CHUNK {
                            step(&mut w, &mut slots, &mut rng);
                        }
                    }
                    w.sync();
                    barrier.wait();
                    let start = Instant::now();
                    let mut pairs = 0u64;
                    // Relaxed: the flag only ends the loop; the counts travel through join.
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..W::CHUNK {
                            step(&mut w, &mut slots, &mut rng);
                        }
                        pairs += W::CHUNK;
                    }
                    w.sync();
                    let took = start.elapsed();
                    for h in slots {
                        w.free(h);
                    }
                    w.sync();
                    (pairs, took)
                })
            })
            .collect();
        barrier.wait();
        std::thread::sleep(dur);
        stop.store(true, Ordering::Relaxed);
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| die("a worker thread panicked"))).collect()
    });
    let pairs = results.iter().map(|r| r.0).sum();
    let wall = results.iter().map(|r| r.1).max().unwrap_or_default();
    Run { threads, pairs, wall }
}

// ---------------------------------------------------------------------------------------
// The driver's default memory pool.

struct MemPool(sys::CUmemoryPool);

impl MemPool {
    fn default_of(dev: &CudaDevice) -> MemPool {
        let mut p: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: writes the device's default pool handle.
        ck("cuDeviceGetDefaultMemPool", unsafe { sys::cuDeviceGetDefaultMemPool(&mut p, dev.device_raw()) });
        MemPool(p)
    }

    fn set(&self, attr: sys::CUmemPool_attribute, mut v: u64) {
        // SAFETY: both attributes set here take a cuuint64_t.
        ck("cuMemPoolSetAttribute", unsafe { sys::cuMemPoolSetAttribute(self.0, attr, (&mut v as *mut u64).cast()) });
    }

    fn get(&self, attr: sys::CUmemPool_attribute) -> u64 {
        let mut v = 0u64;
        // SAFETY: the attributes read here are cuuint64_t.
        ck("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(self.0, attr, (&mut v as *mut u64).cast::<c_void>())
        });
        v
    }

    /// Give back every reserved byte no allocation uses (the caller has synchronized).
    fn trim(&self) {
        // SAFETY: a live pool; only unused memory is released.
        ck("cuMemPoolTrimTo", unsafe { sys::cuMemPoolTrimTo(self.0, 0) });
    }
}

// ---------------------------------------------------------------------------------------
// Output.

const NAMES: [&str; 5] =
    ["vrampool", "cuMemAlloc/cuMemFree", "cuMemAllocAsync (pool)", "mutex best-fit", "vrampool C ABI"];

/// The C ABI's pool gives back what it holds, before the streams its blocks were cached
/// against are destroyed.
fn empty_c_abi() {
    if vrampool_empty_cache() != 0 {
        die(&format!("vrampool_empty_cache: {}", abi_error()));
    }
}

/// The C ABI's message for this thread's last failed call.
fn abi_error() -> String {
    // SAFETY: a NUL-terminated string, valid until this thread's next call.
    unsafe { CStr::from_ptr(vrampool_last_error()) }.to_string_lossy().into_owned()
}

/// Destroy a stream the C ABI may have seen, telling it first, as its contract asks: without
/// that, the ABI's pool may later record an event on the destroyed handle (when it flushes
/// the cache it keeps for it), which the driver need not survive.
fn destroy_seen_stream(dev: &CudaDevice, s: &Stream) {
    // SAFETY: `s` is still a live stream of device 0's primary context (destroyed below).
    if unsafe { vrampool_stream_destroyed(0, s.raw() as *mut c_void) } != 0 {
        die(&format!("vrampool_stream_destroyed: {}", abi_error()));
    }
    or_die("synchronize", dev.synchronize(s));
    or_die("destroy a stream", dev.destroy_stream(s));
}

/// The RMM resources to measure, with the library: none without `--rmm`.
fn rmm_kinds(lib: &Option<rmm::Lib>) -> impl Iterator<Item = (&rmm::Lib, Kind)> {
    lib.iter().flat_map(|l| Kind::ALL.into_iter().map(move |k| (l, k)))
}

fn versus(ns: f64, vram_ns: f64) -> String {
    if !(ns.is_finite() && vram_ns.is_finite() && ns > 0.0 && vram_ns > 0.0) {
        return "—".into();
    }
    let r = ns / vram_ns;
    if r >= 1.0 {
        format!("{r:.1}× slower")
    } else {
        format!("{:.1}× faster", 1.0 / r)
    }
}

fn ns_text(ns: f64) -> String {
    if ns >= 100_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

fn now_utc() -> String {
    match std::process::Command::new("date").arg("-u").arg("+%Y-%m-%d %H:%M:%S UTC").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => {
            let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            format!("{secs} s since 1970 UTC")
        }
    }
}

// ---------------------------------------------------------------------------------------

fn main() {
    let mut quick = false;
    // Passes over each trace in one allocator: the first is timed cold, the last warm.
    let mut passes = 1usize;
    let mut config = PoolConfig::default();
    let usage = || -> ! {
        eprintln!(
            "usage: compare [--quick] [--warm | --passes N] [--map-run-pages N (1 to {})] [--rmm librmm_shim.so] [--trace FILE.csv[.gz] ...]",
            PoolConfig::MAX_MAP_RUN_PAGES
        );
        std::process::exit(2);
    };
    let mut given: Vec<String> = Vec::new();
    let mut rmm_path: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--warm" => passes = 2,
            "--passes" => match args.next().and_then(|v| v.parse::<usize>().ok()) {
                Some(n) if n >= 1 => passes = n,
                _ => usage(),
            },
            "--trace" => given.push(args.next().unwrap_or_else(|| usage())),
            "--rmm" => rmm_path = Some(args.next().unwrap_or_else(|| usage())),
            "--map-run-pages" => match args.next().and_then(|v| v.parse::<usize>().ok()) {
                Some(n) if (1..=PoolConfig::MAX_MAP_RUN_PAGES).contains(&n) => config.map_run_pages = n,
                _ => usage(),
            },
            _ => usage(),
        }
    }
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            println!("compare: no CUDA GPU here ({e}); nothing to measure");
            return;
        }
    };
    if let Err(e) = symbols_present() {
        die(&e);
    }
    or_die("bind the primary context", dev.bind_context());
    let rmm_lib = rmm_path.as_deref().map(|p| rmm::Lib::load(p).unwrap_or_else(|e| die(&e)));
    let mut driver = 0i32;
    // SAFETY: writes one int.
    ck("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut driver) });
    let driver = format!("{}.{}", driver / 1000, (driver % 1000) / 10);
    let scale = if quick { 10 } else { 1 };
    let hot_dur = Duration::from_millis(400) / scale;
    let win_dur = Duration::from_millis(800) / scale;
    // cuMemAlloc replays: skipped when the hot-pair figure predicts more than this, cut at `cap`.
    let (cu_skip, cu_cap) = (Duration::from_secs(20) / scale, Duration::from_secs(20) / scale);
    let began = Instant::now();
    println!(
        "compare: {} ({:.0} GiB), driver {driver}{}",
        dev.name(),
        dev.total_memory() as f64 / GIB as f64,
        if quick { "; --quick: every measurement 10× shorter" } else { "" }
    );

    let traces = traces::load(&given);

    // The driver's pool caches everything, and is warmed up.
    let mempool = MemPool::default_of(&dev);
    mempool.set(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX);
    {
        let s = or_die("create a stream", dev.create_stream());
        let mut w = CuAsync::new(&dev, &s);
        let mut rng = Rng::new(7);
        let mut blocks: Vec<u64> = (0..256).map(|_| w.alloc(rng.size())).collect();
        blocks.extend((0..16).map(|_| w.alloc(HOT)));
        for p in blocks {
            w.free(p);
        }
        w.sync();
        or_die("destroy a stream", dev.destroy_stream(&s));
    }

    // The best-fit baseline's range.
    let mut bf_base: sys::CUdeviceptr = 0;
    // SAFETY: writes one device pointer; the context is current.
    ck("cuMemAlloc (best-fit range)", unsafe { sys::cuMemAlloc_v2(&mut bf_base, BESTFIT_RANGE as usize) });
    let bf = BestFit::new(bf_base, BESTFIT_RANGE);

    let pool = or_die("Pool::new", Pool::new(dev.clone(), config.clone()));
    // The C ABI's pools: the registry's, on the GPU (its own pool of the same device).
    or_die("registry::configure", registry::configure(Config { device: DeviceChoice::Cuda, ..Config::default() }));

    // ---- hot pair
    println!();
    println!(
        "== hot pair: alloc + free of 1 MiB, one thread, one stream (best of 3 runs of {:.2} s) ==",
        hot_dur.as_secs_f64()
    );
    println!("{:<24} {:>7} {:>12} {:>11} {:>10}  vs vrampool", "allocator", "threads", "ns/pair", "M pairs/s", "pairs");
    let hot_stream = or_die("create a stream", dev.create_stream());
    let hot_results: [(f64, u64); 5] = {
        let cache = or_die("stream_cache", pool.stream_cache(&hot_stream));
        let v = hot(&mut Vram { cache, dev: &dev, stream: &hot_stream }, hot_dur);
        let c = hot(&mut CuMem, hot_dur);
        let a = hot(&mut CuAsync::new(&dev, &hot_stream), hot_dur);
        let b = hot(&mut Bf { bf: &bf, high: 0 }, hot_dur);
        let f = hot(&mut CAbi::new(&dev, &hot_stream), hot_dur);
        [v, c, a, b, f]
    };
    // RMM's: each resource made before its clock starts and deleted before the stream goes.
    let rmm_hot: Vec<(&str, (f64, u64))> = rmm_kinds(&rmm_lib)
        .map(|(lib, k)| {
            let res = lib.resource(k);
            (k.name(), hot(&mut rmm::Rmm::new(&res, &dev, &hot_stream), hot_dur))
        })
        .collect();
    pool.flush_thread_cache();
    empty_c_abi();
    destroy_seen_stream(&dev, &hot_stream);
    let named_hot = NAMES.iter().copied().zip(hot_results.iter().copied()).chain(rmm_hot);
    for (i, (name, (ns, pairs))) in named_hot.enumerate() {
        let vs = if i == 0 { "—".to_string() } else { versus(ns, hot_results[0].0) };
        println!("{name:<24} {:>7} {:>12} {:>11.3} {:>10}  {vs}", 1, ns_text(ns), 1e3 / ns, pairs);
    }
    let cu_hot_ns = hot_results[1].0;

    // ---- random window
    println!();
    println!(
        "== random window: each thread its own stream, {WINDOW} live blocks, sizes log-uniform 256 B – 4 MiB; \
         {:.2} s per run after the windows are full ==",
        win_dur.as_secs_f64()
    );
    println!("   (ns/pair per thread = slowest thread's time ÷ its pairs; aggregate = all pairs ÷ that time)");
    println!("{:<24} {:>7} {:>12} {:>11} {:>10}  vs vrampool", "allocator", "threads", "ns/pair", "M pairs/s", "pairs");
    let streams: Vec<Stream> =
        (0..THREADS[THREADS.len() - 1]).map(|_| or_die("create a stream", dev.create_stream())).collect();
    let mut vram_runs = Vec::new();
    // RMM's resources serve every window run, as vrampool's one pool does.
    let rmm_win: Vec<rmm::Resource> = rmm_kinds(&rmm_lib).map(|(lib, k)| lib.resource(k)).collect();
    for &t in &THREADS {
        let before = pool.stats();
        let vr = window(&dev, &streams, t, win_dur, |s| Vram {
            cache: or_die("stream_cache", pool.stream_cache(s)),
            dev: &dev,
            stream: s,
        });
        let after = pool.stats();
        let runs = [
            vr,
            window(&dev, &streams, t, win_dur, |_| CuMem),
            window(&dev, &streams, t, win_dur, |s| CuAsync::new(&dev, s)),
            window(&dev, &streams, t, win_dur, |_| Bf { bf: &bf, high: 0 }),
            window(&dev, &streams, t, win_dur, |s| CAbi::new(&dev, s)),
        ];
        let rmm_runs: Vec<(&str, Run)> = rmm_win
            .iter()
            .zip(Kind::ALL)
            .map(|(res, k)| (k.name(), window(&dev, &streams, t, win_dur, |s| rmm::Rmm::new(res, &dev, s))))
            .collect();
        let named = NAMES.iter().copied().zip(runs.iter()).chain(rmm_runs.iter().map(|(n, r)| (*n, r)));
        for (i, (name, r)) in named.enumerate() {
            let vs = if i == 0 { "—".to_string() } else { versus(r.ns(), runs[0].ns()) };
            println!("{name:<24} {:>7} {:>12} {:>11.3} {:>10}  {vs}", r.threads, ns_text(r.ns()), r.mps(), r.pairs);
        }
        let d = |f: fn(&Stats) -> u64| f(&after).saturating_sub(f(&before));
        let allocs = d(|s| s.allocs).max(1);
        println!(
            "   vrampool in this run: T0 misses {:.3}% of {} allocs (T1 hits {}); ladder flushes {}, maps {}, \
             waits {}, steals {}; events {}; reserved {:.0} MiB",
            100.0 * allocs.saturating_sub(d(|s| s.t0_hits)) as f64 / allocs as f64,
            allocs,
            d(|s| s.t1_hits),
            d(|s| s.ladder_flushes),
            d(|s| s.ladder_maps),
            d(|s| s.ladder_waits),
            d(|s| s.ladder_steals),
            d(|s| s.events_recorded),
            after.reserved_bytes as f64 / 1048576.0
        );
        vram_runs.push(runs.into_iter().next().unwrap_or(Run { threads: t, pairs: 0, wall: Duration::ZERO }));
    }
    if let (Some(one), Some(many)) = (vram_runs.first(), vram_runs.last()) {
        println!(
            "vrampool scaling: {}-thread aggregate ÷ 1-thread throughput = {:.2}× ({:.2} ÷ {:.2} M pairs/s)",
            many.threads,
            many.mps() / one.mps(),
            many.mps(),
            one.mps()
        );
    }
    for (res, k) in rmm_win.iter().zip(Kind::ALL) {
        println!(
            "{} after the window runs: peak reserved {:.0} MiB",
            k.name(),
            res.peak_reserved() as f64 / MIB as f64
        );
    }
    drop(rmm_win);
    empty_c_abi();
    for s in &streams {
        destroy_seen_stream(&dev, s);
    }
    drop(streams);
    let pool_stats: Stats = pool.stats();
    or_die("pool trim", pool.trim());
    drop(pool);

    // ---- trace replay
    let from = if given.is_empty() { "benches/traces" } else { "--trace" };
    let setup = traces::Setup {
        dev: &dev,
        config: &config,
        passes,
        from,
        cu_hot_ns,
        cu_skip,
        cu_cap,
        mempool: &mempool,
        bf: &bf,
        bf_base,
        rmm: &rmm_lib,
    };
    let replay_stats = traces::replay_all(&setup, &traces);

    // ---- the end
    // SAFETY: the best-fit range was only ever bookkeeping; no work uses it.
    ck("cuMemFree (best-fit range)", unsafe { sys::cuMemFree_v2(bf_base) });
    mempool.trim();
    println!();
    println!(
        "vrampool stats (hot pair + random window): T0 hit rate {:.4}, T1 hit rate {:.4}, {} allocs, \
         {} events recorded, {} batches retired, peak reserved {:.1} MiB",
        pool_stats.t0_hit_rate(),
        pool_stats.t1_hit_rate(),
        pool_stats.allocs,
        pool_stats.events_recorded,
        pool_stats.batches_retired,
        pool_stats.peak_reserved_bytes as f64 / MIB as f64
    );
    for (name, r) in &replay_stats {
        println!(
            "vrampool stats ({name} replay): T0 hit rate {:.4}, T1 hit rate {:.4}, {} events recorded, {} batches retired",
            r.stats.t0_hit_rate(),
            r.stats.t1_hit_rate(),
            r.stats.events_recorded,
            r.stats.batches_retired
        );
    }
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "machine: {} ({:.0} GiB, driver {driver}), {cpus} CPUs, {}; run took {:.1} s",
        dev.name(),
        dev.total_memory() as f64 / GIB as f64,
        now_utc(),
        began.elapsed().as_secs_f64()
    );
}
