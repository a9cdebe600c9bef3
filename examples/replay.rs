//! Replay allocation traces (gzip'd or plain CSV: `op,id,size,stream`) through a pool and
//! report peak reserved ÷ peak live (the memory figure of merit), hit rates and time per
//! event, beside the time per event of a single-threaded `Mutex<BTreeMap>` best-fit pool
//! (`benches/support/bestfit.rs`, address arithmetic only) on the same trace in the same run.
//!
//! ```text
//! cargo run --release --example replay -- benches/traces/*.csv.gz
//! cargo run --release --example replay -- --busy-us 20 --sync-every 1000 --warm --costs benches/traces/*.csv.gz
//! ```
//!
//! Runs on the GPU when there is one, else on the simulated device. Options:
//!
//! - `--busy-us N`: N µs of device work on the allocation's stream after each allocation (a
//!   host function on the simulator, a spin kernel on CUDA);
//! - `--sync-every M`: synchronize every stream every M events;
//! - `--warm`: replay each trace twice in one pool, untrimmed in between, and report the
//!   second pass too: time per event (the best-fit pool's likewise, its second pass in one
//!   pool) and the bytes the device mapped and unmapped during it (the simulator's own
//!   counts; on CUDA, from the pool's figures), and where its time went below the caches
//!   (the pool's timers: its ladder and uncached frees, and the maps, unmaps and event calls
//!   it made, most of them inside those): the pool's own work, or the driver's;
//! - `--passes N`: with `--warm` implied, N passes in one pool: the second is reported as
//!   above, and every later one by its maps + unmaps ÷ peak and time per event (whether the
//!   layout settles once the trace repeats);
//! - `--costs`: the simulator spends an H200 driver's costs (`SimCosts::h200`);
//! - `--sim`: the simulator even where there is a GPU;
//! - `--interleave`: play all the traces given at once, as one trace, each on its own streams;
//! - `--map-run-pages N`: `PoolConfig::map_run_pages` (pages mapped per device call);
//! - `--no-trade`: `PoolConfig::trade_pages_on_map` off: the pool grows instead of moving
//!   free pages' memory where a block lands (what a placement alone holds, and its speed);
//! - `--moves`: with `--warm` implied, list the warm pass's allocations under which the
//!   device mapped or unmapped pages, and count its blocks no cache holds placed elsewhere
//!   than in the first pass (`ReplayOptions::moves`): which allocations a warm pool's page
//!   moves come from.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vrampool::replay::{interleave, replay_sim, replay_with, Act, Plan, ReplayOptions, Report, Trace};
use vrampool::{Device, SimDevice};

#[path = "../benches/support/bestfit.rs"]
mod bestfit;
use bestfit::BestFit;

#[path = "support/device.rs"]
mod device;
use device::gpu_or_sim;

#[path = "support/trace_file.rs"]
mod trace_file;

/// One pass of `plan` through `bf`, with the bookkeeping the pool's replay has (the trace's
/// plan: live blocks by slot): the time of its allocations and frees (the blocks left live
/// at the end are freed untimed, so a second pass starts from an empty pool).
fn bestfit_pass(bf: &BestFit, plan: &Plan) -> Duration {
    let mut live: Vec<Option<(u64, u64)>> = vec![None; plan.slots];
    let start = Instant::now();
    for step in &plan.steps {
        let slot = &mut live[step.slot as usize];
        match step.act {
            Act::Alloc { size } => {
                let size = (size as u64).max(1);
                if let Some(addr) = bf.alloc(size) {
                    if let Some((a, s)) = slot.replace((addr, size)) {
                        bf.free(a, s);
                    }
                }
            }
            Act::Free => {
                if let Some((a, s)) = slot.take() {
                    bf.free(a, s);
                }
            }
            Act::Skip => {}
        }
    }
    let elapsed = start.elapsed();
    for (a, s) in live.into_iter().flatten() {
        bf.free(a, s);
    }
    elapsed
}

fn ns_per(d: Duration, events: usize) -> f64 {
    if events == 0 {
        0.0
    } else {
        d.as_nanos() as f64 / events as f64
    }
}

struct Args {
    options: ReplayOptions,
    costs: bool,
    sim: bool,
    interleave: bool,
    paths: Vec<String>,
}

fn usage(why: &str) -> ! {
    eprintln!("{why}");
    eprintln!(
        "usage: replay [--busy-us N] [--sync-every M] [--warm] [--passes N] [--costs] [--sim] [--interleave] \
         [--map-run-pages N] [--no-trade] [--moves] TRACE.csv[.gz] ..."
    );
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut a = Args { options: ReplayOptions::default(), costs: false, sim: false, interleave: false, paths: vec![] };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut number = |name: &str| -> u64 {
            it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| usage(&format!("{name} needs a number")))
        };
        match arg.as_str() {
            "--busy-us" => a.options.busy_us = number("--busy-us"),
            "--sync-every" => a.options.sync_every = number("--sync-every") as usize,
            "--map-run-pages" => a.options.config.map_run_pages = number("--map-run-pages") as usize,
            "--no-trade" => a.options.config.trade_pages_on_map = false,
            "--warm" => a.options.warm = true,
            "--moves" => (a.options.warm, a.options.moves) = (true, true),
            "--passes" => match number("--passes") {
                n @ 2.. => (a.options.warm, a.options.warm_passes) = (true, n as usize - 1),
                _ => usage("--passes needs 2 or more"),
            },
            "--costs" => a.costs = true,
            "--sim" => a.sim = true,
            "--interleave" => a.interleave = true,
            s if s.starts_with("--") => usage(&format!("unknown option {s}")),
            _ => a.paths.push(arg),
        }
    }
    if a.paths.is_empty() {
        usage("no trace given");
    }
    a
}

/// The device: the GPU unless `--sim` or there is none; else the simulator (160 GiB),
/// costed with `--costs`, whose replays read its own counts.
enum Dev {
    Gpu(Arc<dyn Device>),
    Sim(SimDevice),
}

fn device(args: &Args) -> (Dev, String) {
    let (gpu, sim, why) = gpu_or_sim(args.sim, 160 << 30, args.costs);
    (sim.map_or(Dev::Gpu(gpu), Dev::Sim), why)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() {
    let args = parse_args();
    let (dev, why) = device(&args);
    let o = &args.options;
    println!("device: {why}");
    println!(
        "busy {} µs after each allocation, sync every {} events{}",
        o.busy_us,
        if o.sync_every == 0 { "∞".to_string() } else { o.sync_every.to_string() },
        if o.warm { ", warm pass" } else { "" }
    );
    let mut traces = Vec::new();
    for path in &args.paths {
        match trace_file::load(path) {
            Ok(t) => traces.push((path.rsplit('/').next().unwrap_or(path).trim_end_matches(".gz").to_string(), t)),
            Err(e) => {
                eprintln!("{path}: {e}");
                std::process::exit(1);
            }
        }
    }
    if args.interleave {
        let name = traces.iter().map(|(n, _)| n.trim_end_matches(".csv")).collect::<Vec<_>>().join("+");
        let all: Vec<Trace> = traces.drain(..).map(|(_, t)| t).collect();
        match interleave(&all) {
            Ok(t) => traces.push((name, t)),
            Err(e) => {
                eprintln!("interleave: {e}");
                std::process::exit(1);
            }
        }
    }
    let mut rows = Vec::new();
    for (name, trace) in &traces {
        let r = match &dev {
            Dev::Gpu(d) => replay_with(trace, d, o),
            Dev::Sim(d) => replay_sim(trace, d, o),
        };
        let bf = BestFit::new(0, 1 << 48);
        let plan = trace.plan();
        let bf_cold = bestfit_pass(&bf, &plan);
        let bf_warm = o.warm.then(|| bestfit_pass(&bf, &plan));
        match r {
            Ok(r) => rows.push((name.clone(), r, bf_cold, bf_warm)),
            Err(e) => {
                eprintln!("{name}: {e}");
                std::process::exit(1);
            }
        }
    }
    print_cold(&rows);
    if o.warm {
        print_warm(&rows);
        print_warm_time(&rows);
    }
    if o.warm_passes > 1 {
        print_later(&rows);
    }
    if o.moves {
        print_moves(&rows, o.config.largest_cached_class);
    }
}

type Row = (String, Report, Duration, Option<Duration>);

fn print_cold(rows: &[Row]) {
    println!();
    println!(
        "{:<28} {:>8} {:>11} {:>14} {:>7} {:>6} {:>6} {:>8} {:>9} {:>7} {:>11} {:>11}",
        "trace",
        "events",
        "peak live",
        "peak reserved",
        "ratio",
        "T0",
        "T1",
        "ns/op",
        "bestfit",
        "÷bf",
        "mapped",
        "unmapped"
    );
    for (name, r, bf, _) in rows {
        let bf_ns = ns_per(*bf, r.events);
        println!(
            "{:<28} {:>8} {:>7.1} MiB {:>10.1} MiB {:>7.3} {:>6.3} {:>6.3} {:>8.0} {:>9.0} {:>7.2} {:>7.1} MiB {:>7.1} MiB",
            name,
            r.events,
            mib(r.peak_live),
            mib(r.cold.stats.peak_reserved_bytes),
            r.cold.stats.peak_reserved_bytes as f64 / r.peak_live.max(1) as f64,
            r.stats.t0_hit_rate(),
            r.stats.t1_hit_rate(),
            r.ns_per_op(),
            bf_ns,
            r.ns_per_op() / bf_ns.max(f64::MIN_POSITIVE),
            mib(r.cold.mapped_bytes),
            mib(r.cold.unmapped_bytes)
        );
    }
}

fn print_warm(rows: &[Row]) {
    println!();
    println!("warm pass (the trace again in the same pool; maps counted by {:?})", rows[0].1.map_counts);
    println!(
        "{:<28} {:>8} {:>9} {:>7} {:>11} {:>11} {:>8} {:>8} {:>14} {:>7}",
        "trace", "ns/op", "bestfit", "÷bf", "mapped", "unmapped", "map÷pk", "unmap÷pk", "peak reserved", "ratio"
    );
    for (name, r, _, bf_warm) in rows {
        let Some(w) = &r.warm else { continue };
        let bf_ns = ns_per(bf_warm.unwrap_or_default(), w.events);
        println!(
            "{:<28} {:>8.0} {:>9.0} {:>7.2} {:>7.1} MiB {:>7.1} MiB {:>8.3} {:>8.3} {:>10.1} MiB {:>7.3}",
            name,
            w.ns_per_op(),
            bf_ns,
            w.ns_per_op() / bf_ns.max(f64::MIN_POSITIVE),
            mib(w.mapped_bytes),
            mib(w.unmapped_bytes),
            w.mapped_bytes as f64 / r.peak_reserved.max(1) as f64,
            w.unmapped_bytes as f64 / r.peak_reserved.max(1) as f64,
            mib(r.peak_reserved),
            r.ratio()
        );
    }
}

/// Where the warm pass's time went below the caches, from the pool's own timers (the
/// differences of `Stats` between the ends of the first and second passes): the pool's work
/// or the driver's.
fn print_warm_time(rows: &[Row]) {
    println!();
    println!(
        "warm pass, time below the caches (ms): the ladder (allocating), uncached frees, and the driver's maps, \
         unmaps and event calls (most of them inside those two)"
    );
    println!(
        "{:<28} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "trace", "pass", "ladder", "frees", "maps", "unmaps", "events"
    );
    let ms = |ns: u64| ns as f64 / 1e6;
    for (name, r, _, _) in rows {
        let Some(w) = &r.warm else { continue };
        let (a, b) = (&r.cold.stats, &w.stats);
        println!(
            "{:<28} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            name,
            w.elapsed.as_secs_f64() * 1e3,
            ms(b.ladder_ns.saturating_sub(a.ladder_ns)),
            ms(b.release_ns.saturating_sub(a.release_ns)),
            ms(b.map_ns.saturating_sub(a.map_ns)),
            ms(b.unmap_ns.saturating_sub(a.unmap_ns)),
            ms(b.event_ns.saturating_sub(a.event_ns))
        );
    }
}

fn print_later(rows: &[Row]) {
    println!();
    println!("later passes (maps + unmaps ÷ peak reserved, then ns an event), from the third on");
    for (name, r, _, _) in rows {
        let pk = r.peak_reserved.max(1) as f64;
        let passes: Vec<String> = r
            .later
            .iter()
            .map(|p| format!("{:.3} ({:.0} ns)", (p.mapped_bytes + p.unmapped_bytes) as f64 / pk, p.ns_per_op()))
            .collect();
        println!("{:<28} {}", name, passes.join("  "));
    }
}

/// The warm pass's moves: how many uncached blocks landed elsewhere than in the first pass,
/// and the allocations under which the device mapped or unmapped pages, most bytes first
/// (at most `SHOWN` a trace).
fn print_moves(rows: &[Row], largest_cached: u64) {
    const SHOWN: usize = 12;
    println!();
    println!(
        "warm pass, what moved: blocks no cache holds placed elsewhere than in the first pass, \
         and the allocations that mapped or unmapped pages (most first)"
    );
    for (name, r, _, _) in rows {
        let Some(warm) = &r.warm else { continue };
        let elsewhere =
            warm.moves.iter().filter(|m| m.size as u64 > largest_cached && m.shift().is_some_and(|s| s != 0)).count();
        let mut paging: Vec<_> = warm.moves.iter().filter(|m| m.mapped + m.unmapped > 0).collect();
        paging.sort_by_key(|m| std::cmp::Reverse(m.mapped + m.unmapped));
        println!("{name}: {elsewhere} uncached blocks elsewhere, {} allocations moved pages", paging.len());
        for m in paging.iter().take(SHOWN) {
            let shift = m.shift().map_or("—".to_string(), |s| format!("{:+.1} MiB", s as f64 / (1u64 << 20) as f64));
            println!(
                "  event {:>7}: {:>9.1} MiB, {} from the first pass, mapped {:.0} MiB, unmapped {:.0} MiB",
                m.event,
                mib(m.size as u64),
                shift,
                mib(m.mapped),
                mib(m.unmapped)
            );
        }
    }
}
