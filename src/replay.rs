//! Trace replay: allocation traces recorded from real programs, played through a [`Pool`].
//!
//! A trace is CSV with the header `op,id,size,stream` (`op`: `a` allocate, `f` free; `id`
//! names the block; `size` in bytes; `stream`: a small integer per CUDA stream). Events are
//! applied in file order; each trace stream becomes one stream of the device, and a free is
//! stream-ordered on the stream written on its line (a block allocated on one stream and
//! freed on another is recorded on the freeing stream first, as PyTorch's `record_stream`
//! would). The figure of merit is peak reserved ÷ peak live, with live the sum of `size`
//! over allocated, not yet freed ids.

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::{Device, SimDevice, Stream};
use crate::error::{Error, Result};
use crate::pool::{Block, Pool, PoolConfig};
use crate::stats::Stats;
use moves::Tracker;

mod interleave;
mod moves;
mod plan;
pub use interleave::interleave;
pub use moves::Move;
pub use plan::{Act, Plan, Step};

/// One event of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    /// Allocate (true) or free.
    pub alloc: bool,
    /// The block's id.
    pub id: u64,
    /// Bytes asked for (allocations; 0 on frees).
    pub size: usize,
    /// The trace's stream number.
    pub stream: u32,
}

/// A parsed trace.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The events, in file order.
    pub ops: Vec<Op>,
}

impl Trace {
    /// Parse CSV text (`op,id,size,stream`; the header line is optional).
    pub fn parse(input: impl BufRead) -> Result<Trace> {
        let mut ops = Vec::new();
        for (n, line) in input.lines().enumerate() {
            let line = line.map_err(|e| Error::InvalidArgument(format!("trace line {}: {e}", n + 1)))?;
            let line = line.trim();
            if line.is_empty() || line.starts_with("op") {
                continue;
            }
            let bad = || Error::InvalidArgument(format!("trace line {}: {line:?}", n + 1));
            let mut f = line.split(',');
            let (Some(op), Some(id), Some(size), Some(stream), None) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                return Err(bad());
            };
            let alloc = match op {
                "a" => true,
                "f" => false,
                _ => return Err(bad()),
            };
            ops.push(Op {
                alloc,
                id: id.parse().map_err(|_| bad())?,
                size: size.parse().map_err(|_| bad())?,
                stream: stream.parse().map_err(|_| bad())?,
            });
        }
        Ok(Trace { ops })
    }

    /// The most bytes live at once.
    pub fn peak_live(&self) -> u64 {
        let (mut live, mut peak) = (0u64, 0u64);
        let mut sizes = HashMap::new();
        for op in &self.ops {
            if op.alloc {
                sizes.insert(op.id, op.size as u64);
                live += op.size as u64;
                peak = peak.max(live);
            } else if let Some(s) = sizes.remove(&op.id) {
                live -= s;
            }
        }
        peak
    }
}

/// How to replay a trace. `Default`: the default pool, an idle device, one pass.
#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    /// The pool's configuration.
    pub config: PoolConfig,
    /// Microseconds of device work enqueued on the allocation's stream after each
    /// allocation (0: none).
    pub busy_us: u64,
    /// Synchronize every stream after every this many events (0: never).
    pub sync_every: usize,
    /// Play the trace a second time in the same pool, without trimming in between, and
    /// report that pass in [`Report::warm`].
    pub warm: bool,
    /// With `warm`, the passes to play after the first (0 and 1 play one): the third and
    /// later ones go to [`Report::later`]. A pool whose layout settles moves no pages in
    /// them; one that does not keeps trading pages for as long as the trace repeats.
    pub warm_passes: usize,
    /// List, in each pass's [`Pass::moves`], the allocations under which the device mapped
    /// or unmapped pages and the blocks no cache holds placed elsewhere than in the pass before
    /// (module `moves`). It reads the map counts around every allocation (on CUDA, the
    /// pool's figures: a walk of its tiers each time), outside the timed work but slowing
    /// the replay: for finding what moves, not for timing.
    pub moves: bool,
}

impl From<PoolConfig> for ReplayOptions {
    fn from(config: PoolConfig) -> ReplayOptions {
        ReplayOptions { config, ..ReplayOptions::default() }
    }
}

/// Where a replay's mapped and unmapped bytes were counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapCounts {
    /// By the device itself ([`SimDevice::mapped_bytes_total`] and
    /// [`SimDevice::unmapped_bytes_total`]): every byte, whoever asked.
    Device,
    /// From the pool's figures: the growth of [`Stats::mapped_bytes`] (every map the pool
    /// made, loans included: memory mapped at a second address) and of
    /// [`Stats::unmapped_bytes`].
    Pool,
}

/// What one pass over a trace measured.
#[derive(Debug, Clone)]
pub struct Pass {
    /// Events replayed.
    pub events: usize,
    /// Time spent in the pool's allocations and frees.
    pub elapsed: Duration,
    /// Bytes the device mapped during the pass.
    pub mapped_bytes: u64,
    /// Bytes the device unmapped during the pass.
    pub unmapped_bytes: u64,
    /// The pool's figures at the end of the pass, before the blocks still live are freed
    /// (its peaks cover every pass so far).
    pub stats: Stats,
    /// With [`ReplayOptions::moves`]: the allocations that mapped or unmapped pages, and the
    /// blocks no cache holds placed elsewhere than in the pass before, in the pass's order.
    pub moves: Vec<Move>,
}

impl Pass {
    /// Nanoseconds per event.
    pub fn ns_per_op(&self) -> f64 {
        if self.events == 0 {
            return 0.0;
        }
        self.elapsed.as_nanos() as f64 / self.events as f64
    }
}

/// What a replay measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Events replayed.
    pub events: usize,
    /// The most bytes live at once (sum of requested sizes).
    pub peak_live: u64,
    /// The most bytes the pool had mapped (over every pass with `warm`).
    pub peak_reserved: u64,
    /// Time spent in the allocations and frees (of the first pass).
    pub elapsed: Duration,
    /// The pool's figures at the end of the first pass, before the blocks still live are
    /// freed.
    pub stats: Stats,
    /// The first pass in full: its time and what the device mapped and unmapped.
    pub cold: Pass,
    /// The second pass, with [`ReplayOptions::warm`].
    pub warm: Option<Pass>,
    /// The third pass and those after it ([`ReplayOptions::warm_passes`]), in order.
    pub later: Vec<Pass>,
    /// Where the mapped and unmapped bytes were counted.
    pub map_counts: MapCounts,
}

impl Report {
    /// Peak reserved ÷ peak live.
    pub fn ratio(&self) -> f64 {
        if self.peak_live == 0 {
            return 0.0;
        }
        self.peak_reserved as f64 / self.peak_live as f64
    }

    /// Nanoseconds per event (of the first pass).
    pub fn ns_per_op(&self) -> f64 {
        self.cold.ns_per_op()
    }
}

/// Replay `trace` through a fresh pool of `config` on `device`; the pool is trimmed and
/// checked at the end. The same as [`replay_with`] with only `config` set.
pub fn replay(trace: &Trace, device: &Arc<dyn Device>, config: PoolConfig) -> Result<Report> {
    replay_with(trace, device, &ReplayOptions::from(config))
}

/// Replay `trace` as `options` say through a fresh pool on `device`; the pool is trimmed
/// and checked at the end. Mapped and unmapped bytes come from the pool's figures
/// ([`MapCounts::Pool`]); [`replay_sim`] counts them on the device.
pub fn replay_with(trace: &Trace, device: &Arc<dyn Device>, options: &ReplayOptions) -> Result<Report> {
    run(trace, device, options, None)
}

/// [`replay_with`] on a simulated device, whose own counts give the mapped and unmapped
/// bytes ([`MapCounts::Device`]).
pub fn replay_sim(trace: &Trace, device: &SimDevice, options: &ReplayOptions) -> Result<Report> {
    let dyn_device: Arc<dyn Device> = Arc::new(device.clone());
    run(trace, &dyn_device, options, Some(device))
}

/// Bytes mapped and unmapped so far, as the device or the pool counts them.
fn map_totals(pool: &Pool, sim: Option<&SimDevice>) -> (u64, u64) {
    match sim {
        Some(d) => (d.mapped_bytes_total(), d.unmapped_bytes_total()),
        None => {
            // Not reserved + unmapped: a loan maps memory the pool already holds at a second
            // address, which moves neither (on the H200 the warm passes read 0–5% of the peak
            // so, hiding every loan).
            let s = pool.stats();
            (s.mapped_bytes, s.unmapped_bytes)
        }
    }
}

fn run(trace: &Trace, device: &Arc<dyn Device>, options: &ReplayOptions, sim: Option<&SimDevice>) -> Result<Report> {
    let pool = Pool::with_device(Arc::clone(device), options.config.clone())?;
    let plan = trace.plan();
    let streams = plan.streams.iter().map(|_| device.create_stream()).collect::<Result<Vec<Stream>>>()?;
    let uncached = (options.config.largest_cached_class + 1).max(options.config.large_block_threshold);
    let mut player =
        Player { pool: &pool, device: &**device, streams: &streams, options, sim, moves: Tracker::new(uncached) };
    let (cold, peak_live, left) = player.pass(&plan)?;
    drop(left);
    let (mut warm, mut later) = (None, Vec::new());
    let passes = if options.warm { options.warm_passes.max(1) } else { 0 };
    for n in 0..passes {
        player.sync_all()?;
        let (pass, _, left) = player.pass(&plan)?;
        drop(left);
        if n == 0 {
            warm = Some(pass);
        } else {
            later.push(pass);
        }
    }
    let last = later.last().or(warm.as_ref()).unwrap_or(&cold);
    let peak_reserved = last.stats.peak_reserved_bytes;
    pool.trim()?;
    pool.check()?;
    for s in &streams {
        let _ = device.synchronize(s);
    }
    Ok(Report {
        events: trace.ops.len(),
        peak_live,
        peak_reserved,
        elapsed: cold.elapsed,
        stats: cold.stats,
        cold,
        warm,
        later,
        map_counts: if sim.is_some() { MapCounts::Device } else { MapCounts::Pool },
    })
}

/// The blocks live at the end of a pass, by slot (module `plan`), with the lane of each.
type Live = Vec<Option<(Block, u32)>>;

/// One replay's pool, streams (by lane) and options.
struct Player<'a> {
    pool: &'a Pool,
    device: &'a dyn Device,
    streams: &'a [Stream],
    options: &'a ReplayOptions,
    sim: Option<&'a SimDevice>,
    /// The addresses of the pass before, and this pass's moves, with `options.moves`.
    moves: Tracker,
}

impl Player<'_> {
    fn sync_all(&self) -> Result<()> {
        for s in self.streams {
            self.device.synchronize(s)?;
        }
        Ok(())
    }

    /// Play the trace once: the pass, its peak live bytes, and the blocks still live at its
    /// end (the caller frees them).
    fn pass(&mut self, plan: &Plan) -> Result<(Pass, u64, Live)> {
        let (busy, every) = (self.options.busy_us, self.options.sync_every);
        let (mapped0, unmapped0) = map_totals(self.pool, self.sim);
        let mut live: Live = std::iter::repeat_with(|| None).take(plan.slots).collect();
        let (mut live_bytes, mut peak_live) = (0u64, 0u64);
        // Device work and synchronizes are the harness's, not the pool's: timed apart and
        // taken out.
        let mut outside = Duration::ZERO;
        let start = Instant::now();
        for (n, step) in plan.steps.iter().enumerate() {
            let stream = &self.streams[step.lane as usize];
            let slot = &mut live[step.slot as usize];
            match step.act {
                Act::Alloc { size } => {
                    let counts = self.options.moves.then(|| {
                        let t = Instant::now();
                        let c = map_totals(self.pool, self.sim);
                        outside += t.elapsed();
                        c
                    });
                    let b = self.pool.alloc(size, stream)?;
                    if let Some((m0, u0)) = counts {
                        let t = Instant::now();
                        let (m1, u1) = map_totals(self.pool, self.sim);
                        self.moves.alloc(n, size, b.device_ptr(), m1.saturating_sub(m0), u1.saturating_sub(u0));
                        outside += t.elapsed();
                    }
                    live_bytes += size as u64;
                    peak_live = peak_live.max(live_bytes);
                    if let Some((old, _)) = slot.replace((b, step.lane)) {
                        // An id allocated twice: the trace lost a free; the older block goes.
                        live_bytes -= old.len() as u64;
                    }
                    if busy > 0 {
                        let t = Instant::now();
                        self.device.spin(stream, busy)?;
                        outside += t.elapsed();
                    }
                }
                Act::Free => {
                    if let Some((b, home)) = slot.take() {
                        if home != step.lane {
                            b.record_stream(stream);
                        }
                        live_bytes -= b.len() as u64;
                        drop(b);
                    }
                }
                Act::Skip => {}
            }
            if every > 0 && (n + 1) % every == 0 {
                let t = Instant::now();
                self.sync_all()?;
                outside += t.elapsed();
            }
        }
        let elapsed = start.elapsed().saturating_sub(outside);
        let stats = self.pool.stats();
        let (mapped1, unmapped1) = map_totals(self.pool, self.sim);
        let pass = Pass {
            events: plan.steps.len(),
            elapsed,
            mapped_bytes: mapped1.saturating_sub(mapped0),
            unmapped_bytes: unmapped1.saturating_sub(unmapped0),
            stats,
            moves: self.moves.end_pass(),
        };
        Ok((pass, peak_live, live))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::SimDevice;

    #[test]
    fn a_trace_parses_and_its_peak_is_the_most_live_at_once() {
        let t = Trace::parse("op,id,size,stream\na,1,100,0\na,2,50,0\nf,1,0,0\na,3,70,1\n".as_bytes()).unwrap();
        assert_eq!(t.ops.len(), 4);
        assert_eq!(t.peak_live(), 150);
        assert!(Trace::parse("x,1,2,3\n".as_bytes()).is_err());
        assert!(Trace::parse("a,1,2\n".as_bytes()).is_err());
    }

    #[test]
    fn a_replay_reports_the_peaks_and_leaves_the_pool_empty() {
        let dev: Arc<dyn Device> = Arc::new(SimDevice::new(1 << 30));
        let t = Trace::parse("a,1,1048576,0\na,2,4096,1\nf,1,0,0\nf,2,0,0\na,3,2048,0\n".as_bytes()).unwrap();
        let r = replay(&t, &dev, PoolConfig::default()).unwrap();
        assert_eq!(r.peak_live, 1048576 + 4096);
        assert!(r.peak_reserved >= r.peak_live);
        assert!(r.ratio() >= 1.0);
        assert!(r.warm.is_none());
        assert_eq!(r.map_counts, MapCounts::Pool);
        assert!(r.cold.mapped_bytes >= r.peak_reserved, "what was mapped at the peak was mapped during the pass");
    }

    #[test]
    fn a_busy_warm_replay_reports_both_passes_and_counts_maps_on_the_device() {
        let dev = SimDevice::new(1 << 30);
        let t = Trace::parse("a,1,3000000,0\na,2,4096,1\nf,1,0,1\na,3,2048,0\nf,2,0,1\nf,3,0,0\n".as_bytes()).unwrap();
        let options = ReplayOptions { busy_us: 50, sync_every: 2, warm: true, ..ReplayOptions::default() };
        let r = replay_sim(&t, &dev, &options).unwrap();
        assert_eq!(r.map_counts, MapCounts::Device);
        let warm = r.warm.as_ref().expect("a warm pass");
        assert_eq!((r.cold.events, warm.events), (6, 6));
        assert_eq!(r.peak_live, 3000000 + 4096);
        // The peak may come in either pass (on a busy device the warm pass can find memory
        // freed across streams not yet released), but never past what both mapped.
        assert!(r.cold.mapped_bytes + warm.mapped_bytes >= r.peak_reserved);
        assert_eq!(r.peak_reserved, warm.stats.peak_reserved_bytes, "the peak covers both passes");
        assert_eq!(dev.committed_bytes(), 0, "trimmed at the end");
        assert_eq!(dev.mapped_bytes_total(), dev.unmapped_bytes_total());
        assert!(r.later.is_empty(), "two passes unless asked for more");
    }

    #[test]
    fn a_repeated_trace_that_fits_what_the_first_pass_mapped_maps_nothing_in_later_passes() {
        let dev = SimDevice::new(1 << 30);
        // One stream, blocks of a few pages and a small one, freed in the order they came:
        // the same layout every pass.
        let t =
            Trace::parse("a,1,6291456,0\na,2,4096,0\na,3,3145728,0\nf,1,0,0\nf,3,0,0\nf,2,0,0\n".as_bytes()).unwrap();
        let options = ReplayOptions { warm: true, warm_passes: 4, ..ReplayOptions::default() };
        let r = replay_sim(&t, &dev, &options).unwrap();
        assert!(r.warm.is_some());
        assert_eq!(r.later.len(), 3, "passes three to five");
        for (n, p) in r.warm.iter().chain(&r.later).enumerate() {
            assert_eq!((p.events, p.mapped_bytes, p.unmapped_bytes), (6, 0, 0), "warm pass {}", n + 2);
        }
        assert_eq!(r.peak_reserved, r.later[2].stats.peak_reserved_bytes, "the peak covers every pass");
        assert!(r.cold.moves.is_empty(), "moves are listed only when asked for");
    }

    #[test]
    fn moves_name_the_allocations_that_mapped_and_none_once_the_layout_repeats() {
        let dev = SimDevice::new(1 << 30);
        let t =
            Trace::parse("a,1,6291456,0\na,2,4096,0\na,3,3145728,0\nf,1,0,0\nf,3,0,0\nf,2,0,0\n".as_bytes()).unwrap();
        let options = ReplayOptions { warm: true, warm_passes: 2, moves: true, ..ReplayOptions::default() };
        let r = replay_sim(&t, &dev, &options).unwrap();
        let under_allocations: u64 = r.cold.moves.iter().map(|m| m.mapped).sum();
        assert_eq!(under_allocations, r.cold.mapped_bytes, "every byte the first pass mapped, under its allocation");
        assert!(r.cold.moves.iter().all(|m| m.before.is_none() && m.event <= 2), "{:?}", r.cold.moves);
        assert!(r.cold.moves.iter().any(|m| m.event == 0 && m.mapped >= 6291456), "the first block mapped its pages");
        for p in r.warm.iter().chain(&r.later) {
            assert!(p.moves.is_empty(), "the same layout, nothing mapped: {:?}", p.moves);
        }
    }
}
