//! `compare`'s trace replays: every trace of `benches/traces` (or those given with
//! `--trace`) through each allocator, the first pass from nothing held and, with `--warm` or
//! `--passes`, the last in the same allocator, then a summary of the traces each peer lost
//! to vrampool and held more on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vrampool::replay::{replay_with, Act, Plan, ReplayOptions, Report, Trace};
use vrampool::{CudaDevice, Device, PoolConfig, Stream};

use super::bestfit::BestFit;
use super::rmm;
use super::workers::{Bf, CuAsync, CuMem, Worker};
use super::{die, ns_text, or_die, rmm_kinds, trace_file, versus, MemPool, BESTFIT_RANGE, GIB, MIB, NAMES};
use cudarc::driver::sys;

const TRACES: [&str; 10] = [
    "gpt2_decode",
    "resnet_varbatch",
    "train_gpt2",
    "bert_dynamic",
    "llama_decode_server",
    "threads_streams",
    "pipeline_side_stream",
    "gpt2_train_4streams",
    "gpt2_generate_4streams",
    "resnet50_4streams",
];
/// Peak reserved ÷ peak live under PyTorch's caching allocator (benches/traces/README.md).
/// None where the table has no figure (the traces vrampool recorded itself): the row is
/// left out.
const PYTORCH_RATIO: [Option<f64>; 10] =
    [Some(1.160), Some(1.493), Some(1.271), Some(1.977), Some(1.233), Some(2.517), Some(2.747), None, None, None];

/// A trace to replay: its name, PyTorch's figure for it where known, the events.
pub(super) struct Named {
    name: String,
    pytorch: Option<f64>,
    trace: Trace,
}

/// A trace file given with `--trace`; its name is the file's, without `.csv` and `.gz`.
fn load_trace_file(path: &str) -> Named {
    let trace = trace_file::load(path).unwrap_or_else(|e| die(&format!("trace {path}: {e}")));
    let file = path.rsplit('/').next().unwrap_or(path);
    let name = file.trim_end_matches(".gz").trim_end_matches(".csv").to_string();
    Named { name, pytorch: None, trace }
}

/// One of `benches/traces`, by name; None (said why) where it cannot be read.
fn load_trace(name: &str) -> Option<Trace> {
    let candidates = [
        format!("{}/benches/traces/{name}.csv.gz", env!("CARGO_MANIFEST_DIR")),
        format!("benches/traces/{name}.csv.gz"),
    ];
    let Some(path) = candidates.iter().find(|p| std::path::Path::new(p).exists()) else {
        println!("trace {name}: not found under benches/traces; skipped");
        return None;
    };
    trace_file::load(path).map_err(|e| println!("trace {name}: {path}: {e}; skipped")).ok()
}

/// The traces to replay: the files given with `--trace`, else the shared ones.
pub(super) fn load(given: &[String]) -> Vec<Named> {
    if given.is_empty() {
        (0..TRACES.len())
            .filter_map(|i| {
                let trace = load_trace(TRACES[i])?;
                Some(Named { name: TRACES[i].to_string(), pytorch: PYTORCH_RATIO[i], trace })
            })
            .collect()
    } else {
        given.iter().map(|p| load_trace_file(p)).collect()
    }
}

/// A trace replayed through raw allocators, with the same bookkeeping as `vrampool::replay`
/// (the trace's plan: live blocks in a vector by slot, streams by lane), so the harness
/// costs each allocator the same, and little. `workers[lane]` serves the trace's stream,
/// or `workers[0]` every stream with `one_lane`; a free goes to the freeing stream's worker.
/// Stops early past `cap`. Returns (events done, time including the final syncs).
fn replay_raw<W: Worker>(plan: &Plan, workers: &mut [W], one_lane: bool, cap: Duration) -> (usize, Duration) {
    let mut live: Vec<Option<(W::H, usize)>> = std::iter::repeat_with(|| None).take(plan.slots).collect();
    let start = Instant::now();
    let mut done = 0usize;
    for step in &plan.steps {
        if done % 256 == 0 && start.elapsed() > cap {
            break;
        }
        done += 1;
        let lane = if one_lane { 0 } else { step.lane as usize };
        let slot = &mut live[step.slot as usize];
        match step.act {
            Act::Alloc { size } => {
                // A zero-byte request is refused by the driver; one byte stands in for it.
                let h = workers[lane].alloc(size.max(1));
                if let Some((old, _)) = slot.replace((h, lane)) {
                    // An id allocated twice: the trace lost a free; the older block goes.
                    workers[lane].free(old);
                }
            }
            Act::Free => {
                if let Some((h, _)) = slot.take() {
                    workers[lane].free(h);
                }
            }
            Act::Skip => {}
        }
    }
    for w in workers.iter_mut() {
        w.sync();
    }
    let elapsed = start.elapsed();
    for (h, lane) in live.into_iter().flatten() {
        workers[lane].free(h);
    }
    for w in workers.iter_mut() {
        w.sync();
    }
    (done, elapsed)
}

/// The trace rows of one run, by allocator, against vrampool's row of the same trace (which
/// comes first): how many traces each was slower than vrampool on, cold and warm, and how
/// many it held more on. A summary for someone replaying their own traces.
#[derive(Default)]
struct Tally {
    /// vrampool's figures on the trace being printed: cold ns, warm ns, reserved ÷ live.
    vram: [Option<f64>; 3],
    /// Per allocator, in order of appearance: against vrampool, cold time, warm time, memory.
    rows: Vec<(String, [Worse; 3])>,
}

/// Of the traces where both figures were measured, on how many a peer's was the larger.
#[derive(Clone, Copy, Default)]
struct Worse {
    compared: usize,
    worse: usize,
}

impl Worse {
    fn note(&mut self, theirs: Option<f64>, vrampool: Option<f64>) {
        if let (Some(t), Some(v)) = (theirs, vrampool) {
            self.compared += 1;
            self.worse += usize::from(t > v);
        }
    }

    fn text(self) -> String {
        if self.compared == 0 {
            return "—".into();
        }
        format!("{} of {}", self.worse, self.compared)
    }
}

impl Tally {
    fn add(&mut self, alloc: &str, ns: f64, warm: Option<f64>, ratio: Option<f64>) {
        let figures = [Some(ns), warm, ratio];
        if alloc == NAMES[0] {
            self.vram = figures;
            return;
        }
        let i = match self.rows.iter().position(|(n, _)| n == alloc) {
            Some(i) => i,
            None => {
                self.rows.push((alloc.to_string(), [Worse::default(); 3]));
                self.rows.len() - 1
            }
        };
        for (w, (theirs, vrampool)) in self.rows[i].1.iter_mut().zip(figures.into_iter().zip(self.vram)) {
            w.note(theirs, vrampool);
        }
    }

    fn print(&self) {
        if self.rows.is_empty() {
            return;
        }
        println!();
        println!("summary: on how many traces each was slower than vrampool (cold, warm) and held more");
        for (name, [cold, warm, memory]) in &self.rows {
            println!(
                "   {name:<24} slower cold on {}, slower warm on {}, held more on {}",
                cold.text(),
                warm.text(),
                memory.text()
            );
        }
    }
}

/// After a trace's first pass, the rest of `passes` through `pass` (a `replay_raw` in the
/// same workers): nanoseconds per event of the last, or None for one pass only.
fn last_pass(passes: usize, mut pass: impl FnMut() -> (usize, Duration)) -> Option<f64> {
    let mut ns = None;
    for _ in 1..passes {
        let (done, took) = pass();
        ns = Some(took.as_nanos() as f64 / done.max(1) as f64);
    }
    ns
}

/// What the replays take from the rest of the run.
#[derive(Clone, Copy)]
pub(super) struct Setup<'a> {
    pub(super) dev: &'a CudaDevice,
    pub(super) config: &'a PoolConfig,
    /// Passes over each trace (1: cold only).
    pub(super) passes: usize,
    /// Where the traces came from, for the heading.
    pub(super) from: &'a str,
    /// cuMemAlloc's hot pair, to predict its replays: skipped past `cu_skip`, cut at `cu_cap`.
    pub(super) cu_hot_ns: f64,
    pub(super) cu_skip: Duration,
    pub(super) cu_cap: Duration,
    pub(super) mempool: &'a MemPool,
    pub(super) bf: &'a BestFit,
    pub(super) bf_base: u64,
    pub(super) rmm: &'a Option<rmm::Lib>,
}

/// Replay every trace through every allocator and print the rows and the summary; returns
/// vrampool's reports, by trace.
pub(super) fn replay_all<'t>(setup: &Setup, traces: &'t [Named]) -> Vec<(&'t str, Report)> {
    let Setup { dev, config, passes, from, cu_hot_ns, cu_skip, cu_cap, mempool, bf, bf_base, rmm: rmm_lib } = *setup;
    println!();
    println!(
        "== trace replay ({from}; time per event, alloc or free, {}) ==",
        match passes {
            1 => "one pass".to_string(),
            2 => "a cold pass, then a warm one in the same allocator".to_string(),
            n => format!("a cold pass, and the last of {n} in the same allocator as the warm one"),
        }
    );
    println!(
        "   vrampool (fresh pool) and cuMemAllocAsync (pool trimmed to 0) start with nothing mapped: their growth"
    );
    println!(
        "   is timed; best-fit's range was allocated beforehand; cuMemAlloc is cut after {:.0} s",
        cu_cap.as_secs_f64()
    );
    println!("   reserved ÷ live: vrampool peak mapped, cuMemAllocAsync the pool's RESERVED_MEM_HIGH, RMM its");
    println!("   peak of bytes taken from cudaMalloc (the arena takes half the free memory up front),");
    println!("   best-fit the highest address used in its one range (no segments); live = sum of sizes asked");
    println!(
        "{:<20} {:<24} {:>8} {:>12}  {:<15} {:>10} {:>13} {:>9} {:>12}  {:<15}",
        "trace",
        "allocator",
        "events",
        "ns/event",
        "vs vrampool",
        "peak live",
        "peak reserved",
        "res÷live",
        "warm ns/ev",
        "warm vs vrampool"
    );
    let adev: Arc<dyn Device> = Arc::new(dev.clone());
    let mut replay_stats: Vec<(&str, Report)> = Vec::new();
    // Every row's figures, for the summary at the end.
    let tally = std::cell::RefCell::new(Tally::default());
    for Named { name, pytorch, trace } in traces {
        let name = name.as_str();
        let peak_live = trace.peak_live();
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / MIB as f64);
        // The warm pass's figure, and vrampool's to compare it with (None: not measured).
        let vram_warm = std::cell::Cell::new(None::<f64>);
        let row = |alloc: &str, events: String, ns: f64, vs: String, reserved: Option<u64>, warm_ns: Option<f64>| {
            let (res, ratio) = match reserved {
                Some(r) => (mib(r), format!("{:.3}", r as f64 / peak_live.max(1) as f64)),
                None => ("—".to_string(), "—".to_string()),
            };
            tally.borrow_mut().add(alloc, ns, warm_ns, reserved.map(|r| r as f64 / peak_live.max(1) as f64));
            let (w, wvs) = match (warm_ns, vram_warm.get()) {
                (Some(w), Some(v)) if alloc != NAMES[0] => (ns_text(w), versus(w, v)),
                (Some(w), _) => (ns_text(w), "—".to_string()),
                (None, _) => ("—".to_string(), String::new()),
            };
            println!(
                "{name:<20} {alloc:<24} {events:>8} {:>12}  {vs:<15} {:>10} {res:>13} {ratio:>9} {w:>12}  {wvs}",
                ns_text(ns),
                mib(peak_live)
            );
        };
        let plan = trace.plan();
        let lanes = plan.streams.len();

        // vrampool, through the library's replay.
        let options = ReplayOptions {
            config: config.clone(),
            warm: passes > 1,
            warm_passes: passes - 1,
            ..ReplayOptions::default()
        };
        let r = or_die("vrampool replay", replay_with(trace, &adev, &options));
        let vram_ns = r.cold.ns_per_op();
        vram_warm.set(r.later.last().or(r.warm.as_ref()).map(|p| p.ns_per_op()));
        row(NAMES[0], r.events.to_string(), vram_ns, "—".into(), Some(r.peak_reserved), vram_warm.get());

        // cuMemAlloc, unless the hot-pair figure says it would take too long.
        let allocs = trace.ops.iter().filter(|o| o.alloc).count();
        let estimate = Duration::from_secs_f64(allocs as f64 * cu_hot_ns / 1e9);
        if estimate > cu_skip {
            println!(
                "{name:<20} {:<24} skipped: ~{:.0} s estimated from the hot pair ({allocs} pairs × {})",
                NAMES[1],
                estimate.as_secs_f64(),
                ns_text(cu_hot_ns)
            );
        } else {
            let (done, took) = replay_raw(&plan, &mut [CuMem], true, cu_cap);
            let ns = took.as_nanos() as f64 / done.max(1) as f64;
            let events = if done < trace.ops.len() { format!("{done}*") } else { done.to_string() };
            row(NAMES[1], events, ns, versus(ns, vram_ns), None, None);
            if done < trace.ops.len() {
                println!("{:<16} * stopped after {:.1} s", "", cu_cap.as_secs_f64());
            }
        }

        // cuMemAllocAsync, one stream per trace stream, from an empty pool.
        let tstreams: Vec<Stream> = (0..lanes).map(|_| or_die("create a stream", dev.create_stream())).collect();
        mempool.trim();
        mempool.set(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0);
        let mut workers: Vec<CuAsync> = tstreams.iter().map(|s| CuAsync::new(dev, s)).collect();
        let (done, took) = replay_raw(&plan, &mut workers, false, Duration::from_secs(600));
        let warm_ns = last_pass(passes, || replay_raw(&plan, &mut workers, false, Duration::from_secs(600)));
        let high = mempool.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH);
        drop(workers);
        for s in &tstreams {
            or_die("destroy a stream", dev.destroy_stream(s));
        }
        mempool.trim();
        let ns = took.as_nanos() as f64 / done.max(1) as f64;
        row(NAMES[2], done.to_string(), ns, versus(ns, vram_ns), Some(high), warm_ns);

        // RMM's, one stream per trace stream, a fresh resource each (made before the clock).
        for (lib, k) in rmm_kinds(rmm_lib) {
            let tstreams: Vec<Stream> = (0..lanes).map(|_| or_die("create a stream", dev.create_stream())).collect();
            let res = lib.resource(k);
            let mut workers: Vec<rmm::Rmm> = tstreams.iter().map(|s| rmm::Rmm::new(&res, dev, s)).collect();
            let (done, took) = replay_raw(&plan, &mut workers, false, Duration::from_secs(600));
            let warm_ns = last_pass(passes, || replay_raw(&plan, &mut workers, false, Duration::from_secs(600)));
            drop(workers);
            let peak = res.peak_reserved();
            drop(res);
            for s in &tstreams {
                or_die("destroy a stream", dev.destroy_stream(s));
            }
            let ns = took.as_nanos() as f64 / done.max(1) as f64;
            row(k.name(), done.to_string(), ns, versus(ns, vram_ns), Some(peak), warm_ns);
        }

        // Best-fit over its range, where the trace fits it with room to fragment (a trace
        // recorded from a whole program may peak far above the shared ones).
        if peak_live > BESTFIT_RANGE / 2 {
            println!(
                "{name:<20} {:<24} skipped: its peak live is more than half its {} GiB range",
                NAMES[3],
                BESTFIT_RANGE / GIB
            );
        } else {
            let mut w = [Bf { bf, high: bf_base }];
            let (done, took) = replay_raw(&plan, &mut w, true, Duration::from_secs(600));
            let warm_ns = last_pass(passes, || replay_raw(&plan, &mut w, true, Duration::from_secs(600)));
            let ns = took.as_nanos() as f64 / done.max(1) as f64;
            row(NAMES[3], done.to_string(), ns, versus(ns, vram_ns), Some(w[0].high - bf_base), warm_ns);
        }
        if let Some(ratio) = pytorch {
            println!(
                "{name:<20} {:<24} {:>8} {:>12}  {:<15} {:>10} {:>13} {ratio:>9.3}",
                "PyTorch (recorded)", "", "", "", "", ""
            );
        }
        replay_stats.push((name, r));
    }
    tally.into_inner().print();
    replay_stats
}
