//! The demo: an LLM inference server's worker threads on one pool, doing real work on every
//! block and checking it.
//!
//! ```text
//! cargo run --release --example inference_server -- [--threads N] [--duration S]
//!     [--device auto|sim|cuda] [--trace FILE] [--report DIR] [--seed N] [--map-run-pages N]
//!     [--break-event-guard]
//! ```
//!
//! `--map-run-pages` sets `PoolConfig::map_run_pages` (default 1); the rest is the
//! default configuration.
//!
//! Each worker thread (default one per core, at most 16) has its own stream and
//! `StreamCache` and serves requests shaped like LLM serving (see `model`): a prefill, then
//! decode steps, with a KV block per layer regrown 64 tokens at a time (the new block
//! allocated before the old is freed) and activation sizes drawn from a real trace. With
//! `--trace FILE` the workers replay that trace instead, each on streams of its own. Every
//! block gets real work (`work`: NVRTC kernels on a GPU, host functions on the simulator)
//! that writes a pattern naming it, and every block's pattern is checked before it is freed;
//! a wrong word is a corrupted block. Some blocks go to a shared copy stream (the sampled
//! token's logits, every eighth decode step, as a server streaming tokens back): the copy
//! stream first waits on an event of the worker's stream (the stream contract: the copy stream may use the block only after the work that
//! wrote it), and the block is marked `record_stream`, so the pool holds its memory until the
//! copy stream is done with it too.
//!
//! Runs on the GPU when there is one (`CudaDevice`), else on the simulator; ends by itself
//! after `--duration` seconds (default 15); shows live progress on a terminal; prints the
//! tiers' figures and ends with `corrupted blocks: N`; writes `snapshot.json`, `memory.svg`
//! and `timeline.svg` into `--report DIR` (default `vrampool-report/`). Exits non-zero when
//! any block is corrupted. `--break-event-guard` sets the pool's test switch that treats
//! every event as complete: memory then goes from one stream to another while the first is
//! still using it, which the checks catch. `RUST_LOG=vrampool=debug` shows the pool's slow
//! paths (tracing).

#[path = "inference_server/model.rs"]
mod model;
#[path = "inference_server/report.rs"]
mod report;
#[path = "inference_server/work.rs"]
mod work;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vrampool::{Block, Device, Event, Pool, PoolConfig, SimDevice, Snapshot, Stream, StreamCache};

use model::{Request, Rng, SizeModel, Trace, KV_GROWTH, LAYERS};
use report::{mib, Sample};
use work::{Error, Work};

struct Args {
    threads: usize,
    duration: Duration,
    device: String,
    trace: Option<PathBuf>,
    report: PathBuf,
    seed: u64,
    break_guard: bool,
    map_run_pages: usize,
}

const USAGE: &str = "usage: inference_server [--threads N] [--duration S] [--device auto|sim|cuda] [--trace FILE] \
                     [--report DIR] [--seed N] [--map-run-pages N] [--break-event-guard]";

fn parse_args() -> Result<Args, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut a = Args {
        threads: cores.clamp(1, 16),
        duration: Duration::from_secs(15),
        device: "auto".into(),
        trace: None,
        report: PathBuf::from("vrampool-report"),
        seed: 1,
        break_guard: false,
        map_run_pages: PoolConfig::default().map_run_pages,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--threads" => {
                let v = value("--threads")?;
                a.threads =
                    v.parse().ok().filter(|&n| (1..=256).contains(&n)).ok_or(format!("--threads {v}: 1 to 256"))?
            }
            "--duration" => {
                let v = value("--duration")?;
                let s: f64 =
                    v.parse().ok().filter(|s: &f64| *s > 0.0 && *s <= 3600.0).ok_or(format!("--duration {v}"))?;
                a.duration = Duration::from_secs_f64(s);
            }
            "--device" => {
                a.device = value("--device")?;
                if !matches!(a.device.as_str(), "auto" | "sim" | "cuda") {
                    return Err(format!("--device {}: auto, sim or cuda", a.device));
                }
            }
            "--trace" => a.trace = Some(PathBuf::from(value("--trace")?)),
            "--report" => a.report = PathBuf::from(value("--report")?),
            "--seed" => a.seed = value("--seed")?.parse().map_err(|_| "--seed needs a number".to_string())?,
            "--map-run-pages" => {
                let v = value("--map-run-pages")?;
                let most = PoolConfig::MAX_MAP_RUN_PAGES;
                a.map_run_pages = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=most).contains(n))
                    .ok_or(format!("--map-run-pages {v}: 1 to {most}"))?
            }
            "--break-event-guard" => a.break_guard = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok(a)
}

/// What the workers run on.
struct Setup {
    device: Arc<dyn Device>,
    pool: Pool,
    work: Arc<dyn Work>,
    why: String,
    #[cfg(feature = "cuda")]
    gpu: Option<Arc<work::gpu::GpuWork>>,
}

fn config(args: &Args) -> PoolConfig {
    PoolConfig {
        break_event_guard_for_tests: args.break_guard,
        map_run_pages: args.map_run_pages,
        ..PoolConfig::default()
    }
}

fn simulator(args: &Args, why: String) -> Result<Setup, Error> {
    let sim = SimDevice::new(16 << 30);
    let pool = Pool::new(sim.clone(), config(args))?;
    Ok(Setup {
        device: Arc::new(sim.clone()),
        pool,
        work: Arc::new(work::SimWork::new(sim)),
        why,
        #[cfg(feature = "cuda")]
        gpu: None,
    })
}

#[cfg(feature = "cuda")]
fn setup(args: &Args) -> Result<Setup, Error> {
    if args.device == "sim" {
        return simulator(args, "the simulator (--device sim)".into());
    }
    let cuda = vrampool::CudaDevice::new(0).map_err(|e| format!("no CUDA GPU: {e}")).and_then(|dev| {
        let pool = Pool::new(dev.clone(), config(args)).map_err(|e| e.to_string())?;
        let gpu = work::gpu::GpuWork::new(&dev, &pool).map_err(|e| format!("{} found, but {e}", dev.name()))?;
        Ok((dev, pool, Arc::new(gpu)))
    });
    match cuda {
        Ok((dev, pool, gpu)) => Ok(Setup {
            why: format!("CUDA device 0: {}", dev.name()),
            device: Arc::new(dev),
            pool,
            work: gpu.clone(),
            gpu: Some(gpu),
        }),
        Err(why) if args.device == "auto" => simulator(args, format!("the simulator ({why})")),
        Err(why) => Err(why.into()),
    }
}

#[cfg(not(feature = "cuda"))]
fn setup(args: &Args) -> Result<Setup, Error> {
    if args.device == "cuda" {
        return Err("built without the `cuda` feature".into());
    }
    simulator(args, "the simulator (built without the `cuda` feature)".into())
}

/// Where the main thread asks every worker to stop between two steps, for the snapshot.
#[derive(Default)]
struct Pause {
    wanted: AtomicBool,
    parked: Mutex<usize>,
    cv: Condvar,
}

impl Pause {
    /// Called by a worker between steps: if a pause is wanted, finish the stream's work and
    /// wait until the main thread lets go.
    fn point(&self, device: &dyn Device, stream: &Stream) -> Result<(), Error> {
        if !self.wanted.load(Ordering::Acquire) {
            return Ok(());
        }
        device.synchronize(stream)?;
        let mut parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        *parked += 1;
        self.cv.notify_all();
        while self.wanted.load(Ordering::Acquire) {
            parked = self.cv.wait(parked).unwrap_or_else(|p| p.into_inner());
        }
        *parked -= 1;
        Ok(())
    }

    /// Ask every running worker to park; true once `running()` of them have (or after 10 s).
    fn hold(&self, running: impl Fn() -> usize) -> bool {
        self.wanted.store(true, Ordering::Release);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        while *parked < running() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            parked = self
                .cv
                .wait_timeout(parked, left.min(Duration::from_millis(50)))
                .map_or_else(|p| p.into_inner().0, |r| r.0);
        }
        true
    }

    fn release(&self) {
        let _g = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        self.wanted.store(false, Ordering::Release);
        self.cv.notify_all();
    }
}

/// What every worker shares.
struct Shared {
    device: Arc<dyn Device>,
    pool: Pool,
    work: Arc<dyn Work>,
    copy: Stream,
    model: SizeModel,
    trace: Option<Trace>,
    deadline: Instant,
    seed: u64,
    pause: Pause,
    /// Bytes asked for and not yet freed, across all workers, and their peak.
    live: AtomicU64,
    peak_live: AtomicU64,
    /// The peak of `live` since the main thread's last sample.
    window_peak: AtomicU64,
    requests: AtomicU64,
    handoffs: AtomicU64,
    next_tag: AtomicU64,
    running: AtomicUsize,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Shared {
    /// Live bytes are `now`: keep the peaks.
    fn note_live(&self, now: u64) {
        self.peak_live.fetch_max(now, Ordering::Relaxed);
        self.window_peak.fetch_max(now, Ordering::Relaxed);
    }
}

/// A block with the tag of its pattern.
struct Held {
    block: Block,
    tag: u64,
}

/// One worker's stream, cache and handoff event.
struct Worker<'a> {
    sh: &'a Shared,
    stream: Stream,
    cache: StreamCache,
    event: Event,
    rng: Rng,
}

impl Worker<'_> {
    /// Allocate `bytes`, and write its pattern on the worker's stream.
    fn alloc(&mut self, bytes: u64) -> Result<Held, Error> {
        let block = self.cache.alloc(bytes as usize)?;
        let tag = self.sh.next_tag.fetch_add(1, Ordering::Relaxed);
        self.sh.work.fill(block.device_ptr(), block.capacity() as u64, tag, &self.stream)?;
        let now = self.sh.live.fetch_add(block.len() as u64, Ordering::Relaxed) + block.len() as u64;
        self.sh.note_live(now);
        Ok(Held { block, tag })
    }

    /// Check the block on `stream`, then free it.
    fn free_after_check(&self, h: Held, stream: &Stream) -> Result<(), Error> {
        self.sh.work.check(h.block.device_ptr(), h.block.capacity() as u64, h.tag, stream)?;
        self.sh.live.fetch_sub(h.block.len() as u64, Ordering::Relaxed);
        drop(h.block);
        Ok(())
    }

    fn free(&self, h: Held) -> Result<(), Error> {
        self.free_after_check(h, &self.stream)
    }

    /// Hand the blocks to the copy stream: it waits for this stream's work so far (which
    /// wrote them), checks them, and the pool keeps them until both streams are done.
    fn hand_off(&self, blocks: Vec<Held>) -> Result<(), Error> {
        let d = &*self.sh.device;
        d.record_event(&self.event, &self.stream)?;
        d.stream_wait_event(&self.sh.copy, &self.event)?;
        for h in blocks {
            h.block.record_stream(&self.sh.copy);
            self.sh.handoffs.fetch_add(1, Ordering::Relaxed);
            self.free_after_check(h, &self.sh.copy)?;
        }
        Ok(())
    }

    /// One layer's activations for a step: allocated, used, checked and freed.
    fn activations(&mut self, size: impl Fn(&mut Rng) -> u64) -> Result<(), Error> {
        let n = self.rng.range(2, 4);
        let mut acts = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let bytes = size(&mut self.rng);
            acts.push(self.alloc(bytes)?);
        }
        for a in acts {
            self.free(a)?;
        }
        Ok(())
    }

    fn serve(&mut self, r: Request) -> Result<(), Error> {
        let sh = self.sh;
        let mut tokens = r.prompt;
        let mut cap = tokens.div_ceil(KV_GROWTH) * KV_GROWTH;
        let mut kv = Vec::with_capacity(LAYERS);
        // Prefill: every layer's KV block, and its activations over the whole prompt.
        for _ in 0..LAYERS {
            kv.push(self.alloc(r.kv_bytes(cap))?);
            self.activations(|rng| sh.model.prefill(rng, r.prompt))?;
        }
        for step in 0..r.decode_steps {
            sh.pause.point(&*sh.device, &self.stream)?;
            tokens += 1;
            if tokens > cap {
                // Regrow each layer's block: the new one first, the cache copied (the old
                // checked, the new written), then the old freed.
                cap += KV_GROWTH;
                for slot in kv.iter_mut() {
                    let grown = self.alloc(r.kv_bytes(cap))?;
                    let old = std::mem::replace(slot, grown);
                    self.free(old)?;
                }
            }
            for _ in 0..LAYERS {
                self.activations(|rng| sh.model.decode(rng))?;
            }
            let bytes = sh.model.decode(&mut self.rng) * r.batch;
            let logits = self.alloc(bytes)?;
            if step % 8 == 7 {
                self.hand_off(vec![logits])?;
            } else {
                self.free(logits)?;
            }
        }
        // The request is done: its work finishes (a snapshot may be taken here, with its KV
        // cache live), then the cache is freed.
        sh.device.synchronize(&self.stream)?;
        sh.pause.point(&*sh.device, &self.stream)?;
        for block in kv {
            self.free(block)?;
        }
        Ok(())
    }

    /// Replay the trace once on this worker's streams (one per stream of the trace; frees on
    /// the stream of their line); every 16th block goes through the copy stream.
    fn replay(&mut self, trace: &Trace, streams: &[Stream], caches: &[StreamCache]) -> Result<(), Error> {
        let mut live: Vec<Option<(Held, usize)>> = (0..trace.ids).map(|_| None).collect();
        for (i, e) in trace.events.iter().enumerate() {
            if i % 1024 == 0 {
                for s in streams {
                    self.sh.pause.point(&*self.sh.device, s)?;
                }
                if Instant::now() >= self.sh.deadline {
                    break;
                }
            }
            match *e {
                model::Event::Alloc { id, size, stream } => {
                    let s = stream % streams.len();
                    let block = caches[s].alloc(size as usize)?;
                    let tag = self.sh.next_tag.fetch_add(1, Ordering::Relaxed);
                    self.sh.work.fill(block.device_ptr(), block.capacity() as u64, tag, &streams[s])?;
                    let now = self.sh.live.fetch_add(size, Ordering::Relaxed) + size;
                    self.sh.note_live(now);
                    live[id] = Some((Held { block, tag }, s));
                }
                model::Event::Free { id } => {
                    let Some((h, s)) = live[id].take() else { continue };
                    if id % 16 == 15 {
                        let d = &*self.sh.device;
                        d.record_event(&self.event, &streams[s])?;
                        d.stream_wait_event(&self.sh.copy, &self.event)?;
                        h.block.record_stream(&self.sh.copy);
                        self.sh.handoffs.fetch_add(1, Ordering::Relaxed);
                        self.free_after_check(h, &self.sh.copy)?;
                    } else {
                        self.free_after_check(h, &streams[s])?;
                    }
                }
            }
        }
        for (h, s) in live.into_iter().flatten() {
            self.free_after_check(h, &streams[s])?;
        }
        for s in streams {
            self.sh.device.synchronize(s)?;
        }
        Ok(())
    }
}

fn worker(id: usize, sh: &Shared) -> Result<(), Error> {
    let stream = sh.work.new_stream()?;
    let cache = sh.pool.stream_cache(&stream)?;
    let event = sh.device.create_event()?;
    let mut w = Worker { sh, stream, cache, event, rng: Rng::new(sh.seed.wrapping_add(id as u64 * 7919)) };
    if let Some(trace) = &sh.trace {
        let mut streams = vec![w.stream.clone()];
        for _ in 1..trace.streams {
            streams.push(sh.work.new_stream()?);
        }
        let caches = streams.iter().map(|s| sh.pool.stream_cache(s)).collect::<Result<Vec<_>, _>>()?;
        while Instant::now() < sh.deadline {
            w.replay(trace, &streams, &caches)?;
            sh.requests.fetch_add(1, Ordering::Relaxed);
        }
        drop(caches);
        for s in &streams[1..] {
            sh.device.destroy_stream(s)?;
        }
    } else {
        while Instant::now() < sh.deadline {
            let r = Request::draw(&mut w.rng);
            w.serve(r)?;
            sh.requests.fetch_add(1, Ordering::Relaxed);
        }
    }
    sh.device.synchronize(&w.stream)?;
    let stream = w.stream.clone();
    drop(w);
    sh.device.destroy_stream(&stream)?;
    Ok(())
}

fn progress_bar(duration: Duration) -> indicatif::ProgressBar {
    if !std::io::stdout().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(duration.as_millis() as u64),
        indicatif::ProgressDrawTarget::stdout(),
    );
    let style = indicatif::ProgressStyle::with_template("{bar:24.cyan/blue} {elapsed:>4} {msg}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    match run(&args) {
        Ok(0) => {}
        Ok(_) => std::process::exit(1),
        Err(e) => {
            eprintln!("error: {e}");
            println!("corrupted blocks: unknown (the demo stopped: {e})");
            std::process::exit(1);
        }
    }
}

/// Runs the demo; returns the number of corrupted blocks plus errors (0: all good).
fn run(args: &Args) -> Result<u64, Error> {
    let setup = setup(args)?;
    let model_trace = model::parse_trace(model::MODEL_TRACE)?;
    let model = SizeModel::from_trace(&model_trace)?;
    let trace = match &args.trace {
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            Some(model::parse_trace(&bytes).map_err(|e| format!("{}: {e}", p.display()))?)
        }
        None => None,
    };
    println!("vrampool demo: {} worker threads on {}", args.threads, setup.why);
    println!("work on every block: {}", setup.work.what());
    match (&args.trace, &trace) {
        (Some(p), Some(t)) => println!(
            "requests: replays of {} ({} events, {} streams), each worker on streams of its own",
            p.display(),
            t.events.len(),
            t.streams
        ),
        _ => {
            let (median, p99) = model.quantiles();
            println!(
                "requests: LLM serving (prefill, then 8-128 decode steps; {LAYERS} layers, KV blocks regrown every \
                 {KV_GROWTH} tokens); activation sizes from {} short-lived allocations of gpt2_decode (median {} B, \
                 p99 {} B)",
                model.samples(),
                median,
                p99
            );
        }
    }
    if args.break_guard {
        println!("--break-event-guard: the pool treats every event as complete (its test switch)");
    }
    let copy = setup.work.new_stream()?;
    let start = Instant::now();
    let sh = Shared {
        device: Arc::clone(&setup.device),
        pool: setup.pool.clone(),
        work: Arc::clone(&setup.work),
        copy: copy.clone(),
        model,
        trace,
        deadline: start + args.duration,
        seed: args.seed,
        pause: Pause::default(),
        live: AtomicU64::new(0),
        peak_live: AtomicU64::new(0),
        window_peak: AtomicU64::new(0),
        requests: AtomicU64::new(0),
        handoffs: AtomicU64::new(0),
        next_tag: AtomicU64::new(1),
        running: AtomicUsize::new(args.threads),
        errors: AtomicU64::new(0),
        first_error: Mutex::new(None),
    };
    let bar = progress_bar(args.duration);
    let mut samples = Vec::new();
    let mut snapshot: Option<(Snapshot, f64)> = None;
    std::thread::scope(|scope| {
        for id in 0..args.threads {
            let sh = &sh;
            scope.spawn(move || {
                if let Err(e) = worker(id, sh) {
                    sh.errors.fetch_add(1, Ordering::Relaxed);
                    sh.first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(format!("worker {id}: {e}"));
                }
                // A worker that stops is no longer waited for at a pause.
                sh.running.fetch_sub(1, Ordering::AcqRel);
                sh.pause.cv.notify_all();
            });
        }
        let (mut last_t, mut last_allocs, mut last_requests) = (0.0, 0u64, 0u64);
        while sh.running.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(100));
            let t = start.elapsed().as_secs_f64();
            let st = sh.pool.stats();
            let live = sh.window_peak.swap(sh.live.load(Ordering::Relaxed), Ordering::Relaxed);
            samples.push(Sample { t, live, reserved: st.reserved_bytes });
            if t - last_t >= 0.5 {
                let dt = t - last_t;
                let requests = sh.requests.load(Ordering::Relaxed);
                bar.set_position((t * 1000.0) as u64);
                bar.set_message(format!(
                    "{:.0} req/s  {:.0}k allocs/s  live {}  reserved {}  hits {:.1}%",
                    (requests - last_requests) as f64 / dt,
                    (st.allocs - last_allocs) as f64 / dt / 1e3,
                    mib(sh.live.load(Ordering::Relaxed)),
                    mib(st.reserved_bytes),
                    100.0 * (st.t0_hit_rate() + st.t1_hit_rate())
                ));
                (last_t, last_allocs, last_requests) = (t, st.allocs, requests);
            }
            // The picture: every worker parked between two steps, its blocks held, mid-run.
            if snapshot.is_none() && t >= args.duration.as_secs_f64() * 0.6 {
                let parked = sh.pause.hold(|| sh.running.load(Ordering::Acquire));
                let quiet = parked && sh.device.synchronize(&sh.copy).is_ok();
                let snap = sh.pool.snapshot();
                if !quiet {
                    println!("(the snapshot was taken with workers running: it may be inexact)");
                }
                snapshot = Some((snap, start.elapsed().as_secs_f64()));
                sh.pause.release();
            }
        }
    });
    let wall = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let mut problems = sh.errors.load(Ordering::Relaxed);
    if let Some(e) = sh.first_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        println!("error: {e}");
    }
    sh.device.synchronize(&copy)?;
    let st = sh.pool.stats();
    let allocs = st.allocs;
    let requests = sh.requests.load(Ordering::Relaxed);
    let peak_live = sh.peak_live.load(Ordering::Relaxed);
    println!();
    println!(
        "served {requests} requests in {wall:.1} s: {:.1} requests/s, {allocs} allocations ({:.0}k/s), {} blocks \
         through the copy stream, {} blocks checked",
        requests as f64 / wall,
        allocs as f64 / wall / 1e3,
        sh.handoffs.load(Ordering::Relaxed),
        setup.work.checks()
    );
    println!();
    print!("{}", report::tier_table(&st));
    println!();
    println!(
        "peak live (bytes asked for, not yet freed): {}; peak reserved: {}; peak reserved / peak live: {:.3}",
        mib(peak_live),
        mib(st.peak_reserved_bytes),
        st.peak_reserved_bytes as f64 / peak_live.max(1) as f64
    );
    let (submits, submit_ns) = setup.work.submitted();
    let per = |ns: u64, n: u64| ns as f64 / n.max(1) as f64 / 1e3;
    println!(
        "handing work to the device: {submits} calls, {:.1} µs each on average ({} in all); the pool's event \
         records: {:.1} µs each for the frees they cover, {:.1} µs for placements waiting on those frees",
        per(submit_ns, submits),
        report::ms(submit_ns),
        per(st.record_ns.saturating_sub(st.reuse_record_ns), st.events_recorded.saturating_sub(st.reuse_records)),
        per(st.reuse_record_ns, st.reuse_records)
    );
    let corrupted = setup.work.corrupted()?;
    #[cfg(feature = "cuda")]
    if let Some(g) = &setup.gpu {
        println!("CUDA events created: {} (the rest were spares, reused)", g.events_created());
        g.release();
    }
    drop(sh);
    setup.device.destroy_stream(&copy)?;
    let leaks = setup.pool.leaks();
    if !leaks.is_empty() {
        println!("leaks: {} stretches of live memory after every worker finished", leaks.len());
        problems += 1;
    }
    setup.pool.trim()?;
    if let Err(e) = setup.pool.check() {
        println!("the pool's books: {e}");
        problems += 1;
    }
    let (snap, at) = match snapshot {
        Some(s) => s,
        None => (setup.pool.snapshot(), wall),
    };
    let title = format!("vrampool at {at:.1} s: {} workers on {}", args.threads, setup.device.name());
    let memory = report::memory_svg(&snap, &title);
    let timeline = report::timeline_svg(
        &samples,
        (peak_live, st.peak_reserved_bytes),
        Some(at),
        &format!("live and reserved bytes, {} workers on {}", args.threads, setup.device.name()),
    );
    report::write_files(&args.report, &snap, &memory, &timeline)?;
    println!(
        "report: {} (snapshot.json, memory.svg, timeline.svg; the snapshot at {at:.1} s: live {}, cached {}, \
         retiring {}, free {})",
        args.report.display(),
        mib(snap.live_bytes),
        mib(snap.cached_bytes),
        mib(snap.retiring_bytes),
        mib(snap.free_bytes)
    );
    println!("corrupted blocks: {corrupted}");
    Ok(corrupted + problems)
}
