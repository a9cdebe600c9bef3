//! A sequential model of placement under a cap on physical pages: what a pool that moves
//! free pages' memory where blocks land (as vrampool's loans do) can reach, pass after pass.
//!
//! Each trace is replayed twice in one model address space, frees taking effect at once and
//! no caches. Large blocks (512 KiB and more, in 64 KiB granules) are placed in one range;
//! small ones in per-stream 2 MiB chunks taken from the same range, sized as a buddy would
//! (`--no-chunks`: in the range too, in 256-byte units). 2 MiB pages are mapped the first
//! time a block touches them; when more are mapped than `--slack` times the most pages ever
//! needed at once, the highest wholly free mapped pages are unmapped (a trade: the memory
//! goes where the block landed). So the first pass's peak over peak live is the memory
//! figure such a pool reaches, and the second pass's maps and unmaps over that peak are its
//! warm-pass churn, the figures of issue 11 (bars: 1.10 and 5%).
//!
//! Placements (`--policy`):
//! - `first`: first fit among free runs lying on mapped pages, else first fit anywhere (the
//!   pool's rung 1, then its mapping rungs);
//! - `best`: best fit among the stretches of free runs that lie on mapped pages, else best
//!   fit by run length.
//!
//! Physical allocations (`--run N`, default 1): the pages a block lands on unmapped are
//! mapped in allocations of at most N pages, one driver call each, and a trade unmaps only a
//! whole allocation none of whose pages holds a block, one call each (CUDA maps, lends and
//! unmaps a physical allocation only whole, and its driver charges per allocation, not per
//! page: `benches/vmm_probe.c`). With `--edges`, a page the block covers only in part is an
//! allocation of its own. The "calls" columns count these maps and unmaps per pass: what a
//! pool that lends and unmaps whole allocations of N pages would ask of the driver.
//!
//! `--where` prints, for the second pass, the events around which pages were mapped (where
//! the churn comes from).
//!
//! ```text
//! cargo run --release --example placement_model -- [--policy first|best] [--slack S] [--run N] [--edges] [--no-chunks] [--where] TRACE.csv.gz ...
//! ```

use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;

use vrampool::replay::Trace;

const PAGE: u64 = 2 << 20;
const GRANULE: u64 = 64 << 10;
const LARGE: u64 = 512 << 10;
const CHUNK: u64 = 2 << 20;
/// Wholly free chunks a stream keeps, as the pool's arenas do.
const KEEP_FREE_CHUNKS: usize = 2;

#[derive(Clone, Copy, PartialEq)]
enum Policy {
    First,
    Best,
}

/// The model's address space: free runs, the blocks on each page, which pages are mapped.
struct Space {
    policy: Policy,
    slack: f64,
    /// Free runs: start → length.
    free: BTreeMap<u64, u64>,
    /// Live blocks (and chunks) overlapping each page.
    on_page: Vec<u32>,
    mapped: Vec<bool>,
    mapped_pages: u64,
    /// Pages with a block on them now, and the most at once.
    needed: u64,
    needed_peak: u64,
    /// Pages past the highest ever touched are all unmapped and free.
    top: u64,
    maps: u64,
    unmaps: u64,
    peak_mapped: u64,
    /// Pages mapped as one physical allocation at most (`--run`).
    run: u64,
    /// Pages a block covers only in part are allocations of their own (`--edges`).
    edges: bool,
    /// Each mapped page's allocation: an index into `allocs`.
    alloc_of: Vec<u32>,
    /// Allocations: first page and pages.
    allocs: Vec<(u64, u64)>,
    /// Driver calls: allocations mapped and unmapped.
    map_calls: u64,
    unmap_calls: u64,
}

impl Space {
    fn new(policy: Policy, slack: f64, run: u64, edges: bool) -> Space {
        let mut free = BTreeMap::new();
        free.insert(0, u64::MAX / 2);
        Space {
            policy,
            slack,
            free,
            on_page: Vec::new(),
            mapped: Vec::new(),
            mapped_pages: 0,
            needed: 0,
            needed_peak: 0,
            top: 0,
            maps: 0,
            unmaps: 0,
            peak_mapped: 0,
            run,
            edges,
            alloc_of: Vec::new(),
            allocs: Vec::new(),
            map_calls: 0,
            unmap_calls: 0,
        }
    }

    fn is_mapped(&self, page: u64) -> bool {
        self.mapped.get(page as usize).copied().unwrap_or(false)
    }

    /// The stretches of `[a, a + len)` whose pages are all mapped, as (start, length).
    fn mapped_stretches(&self, a: u64, len: u64) -> Vec<(u64, u64)> {
        let end = (a + len).min(self.top * PAGE);
        let mut out = Vec::new();
        let mut start = None;
        let mut p = a / PAGE;
        while p * PAGE < end {
            match (self.is_mapped(p), start) {
                (true, None) => start = Some(a.max(p * PAGE)),
                (false, Some(s)) => {
                    out.push((s, p * PAGE - s));
                    start = None;
                }
                _ => {}
            }
            p += 1;
        }
        if let Some(s) = start {
            out.push((s, end - s));
        }
        out
    }

    /// Where a block of `n` bytes aligned to `align` goes.
    fn place(&self, n: u64, align: u64) -> u64 {
        let fits = |s: u64, l: u64| {
            let a = s.next_multiple_of(align);
            (a + n <= s + l).then_some(a)
        };
        let mut mapped_fit: Option<(u64, u64)> = None;
        for (&a, &l) in &self.free {
            for (s, sl) in self.mapped_stretches(a, l) {
                if let Some(x) = fits(s, sl) {
                    match self.policy {
                        Policy::First => return x,
                        Policy::Best if mapped_fit.is_none_or(|(bl, _)| sl < bl) => mapped_fit = Some((sl, x)),
                        Policy::Best => {}
                    }
                }
            }
        }
        if let Some((_, x)) = mapped_fit {
            return x;
        }
        let mut fit: Option<(u64, u64)> = None;
        for (&a, &l) in &self.free {
            if let Some(x) = fits(a, l) {
                match self.policy {
                    Policy::First => return x,
                    Policy::Best if fit.is_none_or(|(bl, _)| l < bl) => fit = Some((l, x)),
                    Policy::Best => {}
                }
            }
        }
        fit.map(|(_, x)| x).expect("the range is far larger than any trace")
    }

    /// Take `[x, x + n)` out of its free run and put a block on its pages, mapping and then
    /// trading as the cap says.
    fn take(&mut self, x: u64, n: u64) {
        let (&a, &l) = self.free.range(..=x).next_back().expect("a free run holds the block");
        self.free.remove(&a);
        if x > a {
            self.free.insert(a, x - a);
        }
        if a + l > x + n {
            self.free.insert(x + n, a + l - x - n);
        }
        let last = (x + n - 1) / PAGE;
        if self.on_page.len() <= last as usize {
            self.on_page.resize(last as usize + 1, 0);
            self.mapped.resize(last as usize + 1, false);
            self.alloc_of.resize(last as usize + 1, u32::MAX);
        }
        // Unmapped pages of the block, in stretches of at most `run` pages, each one
        // allocation and one call.
        let mut p = x / PAGE;
        while p <= last {
            if self.mapped[p as usize] {
                p += 1;
                continue;
            }
            let start = p;
            // With `--edges`, a page the block covers only in part is an allocation of its
            // own: a neighbour may keep it busy after the block goes, and would pin the
            // block's whole allocation.
            let edge = |q: u64| self.edges && ((q == x / PAGE && x % PAGE != 0) || (q == last && (x + n) % PAGE != 0));
            let run = if edge(p) { 1 } else { self.run };
            while p <= last && !self.mapped[p as usize] && p - start < run && (p == start || !edge(p)) {
                self.mapped[p as usize] = true;
                self.alloc_of[p as usize] = self.allocs.len() as u32;
                self.mapped_pages += 1;
                self.maps += 1;
                p += 1;
            }
            self.allocs.push((start, p - start));
            self.map_calls += 1;
        }
        for p in x / PAGE..=last {
            let p = p as usize;
            if self.on_page[p] == 0 {
                self.needed += 1;
            }
            self.on_page[p] += 1;
        }
        self.top = self.top.max(last + 1);
        self.needed_peak = self.needed_peak.max(self.needed);
        let cap = (self.needed_peak as f64 * self.slack) as u64;
        let mut p = self.top;
        while self.mapped_pages > cap && p > 0 {
            p -= 1;
            let q = p as usize;
            if !self.mapped[q] {
                continue;
            }
            // Only a whole allocation goes, and only when none of its pages holds a block.
            let (s0, n0) = self.allocs[self.alloc_of[q] as usize];
            if (s0..s0 + n0).all(|r| self.on_page[r as usize] == 0) {
                for r in s0..s0 + n0 {
                    self.mapped[r as usize] = false;
                    self.alloc_of[r as usize] = u32::MAX;
                }
                self.mapped_pages -= n0;
                self.unmaps += n0;
                self.unmap_calls += 1;
            }
            p = s0;
        }
        self.peak_mapped = self.peak_mapped.max(self.mapped_pages);
    }

    fn give(&mut self, x: u64, n: u64) {
        for p in x / PAGE..=(x + n - 1) / PAGE {
            let p = p as usize;
            self.on_page[p] -= 1;
            if self.on_page[p] == 0 {
                self.needed -= 1;
            }
        }
        let (mut a, mut l) = (x, n);
        if let Some((&pa, &pl)) = self.free.range(..a).next_back() {
            if pa + pl == a {
                self.free.remove(&pa);
                (a, l) = (pa, pl + l);
            }
        }
        if let Some(nl) = self.free.remove(&(a + l)) {
            l += nl;
        }
        self.free.insert(a, l);
    }
}

/// A stream's chunks of small blocks: each chunk's address and bytes in use.
#[derive(Default)]
struct Chunks(Vec<(u64, u64)>);

/// Where a live block is.
enum Placed {
    Large(u64, u64),
    Small(u32, u64, u64),
}

struct Model {
    space: Space,
    chunks: HashMap<u32, Chunks>,
    use_chunks: bool,
    live: HashMap<u64, (Placed, u64)>,
}

impl Model {
    fn alloc(&mut self, id: u64, size: u64, stream: u32) {
        let size = size.max(1);
        let placed = if self.use_chunks && size < LARGE {
            // A buddy serves powers of two; the chunk is the first of the stream's with room.
            let n = size.max(256).next_power_of_two();
            let chunks = self.chunks.entry(stream).or_default();
            let at = match chunks.0.iter().position(|c| c.1 + n <= CHUNK) {
                Some(i) => i,
                None => {
                    let x = self.space.place(CHUNK, CHUNK);
                    self.space.take(x, CHUNK);
                    chunks.0.push((x, 0));
                    chunks.0.len() - 1
                }
            };
            chunks.0[at].1 += n;
            Placed::Small(stream, chunks.0[at].0, n)
        } else {
            let (n, align) = if size >= LARGE {
                (size.next_multiple_of(GRANULE), GRANULE)
            } else {
                (size.next_multiple_of(256), 256)
            };
            let x = self.space.place(n, align);
            self.space.take(x, n);
            Placed::Large(x, n)
        };
        if let Some((old, _)) = self.live.insert(id, (placed, size)) {
            self.release(old);
        }
    }

    fn free(&mut self, id: u64) {
        if let Some((placed, _)) = self.live.remove(&id) {
            self.release(placed);
        }
    }

    fn release(&mut self, placed: Placed) {
        match placed {
            Placed::Large(x, n) => self.space.give(x, n),
            Placed::Small(stream, chunk, n) => {
                let Some(chunks) = self.chunks.get_mut(&stream) else { return };
                let Some(i) = chunks.0.iter().position(|c| c.0 == chunk) else { return };
                chunks.0[i].1 -= n;
                if chunks.0[i].1 == 0 && chunks.0.iter().filter(|c| c.1 == 0).count() > KEEP_FREE_CHUNKS {
                    chunks.0.remove(i);
                    self.space.give(chunk, CHUNK);
                }
            }
        }
    }
}

/// One pass's figures: the peak of mapped bytes over peak live, and the bytes mapped and
/// unmapped during the pass.
struct Pass {
    ratio: f64,
    calls: u64,
    mapped: u64,
    unmapped: u64,
    peak: u64,
}

fn run(
    trace: &Trace,
    policy: Policy,
    slack: f64,
    (run, edges): (u64, bool),
    use_chunks: bool,
    show_where: bool,
) -> [Pass; 2] {
    let mut m = Model {
        space: Space::new(policy, slack, run, edges),
        chunks: HashMap::new(),
        use_chunks,
        live: HashMap::new(),
    };
    let peak_live = trace.peak_live().max(1) as f64;
    let pass = |m: &mut Model, second: bool| {
        let (maps, unmaps) = (m.space.maps, m.space.unmaps);
        let calls = m.space.map_calls + m.space.unmap_calls;
        m.space.peak_mapped = m.space.mapped_pages;
        for (i, op) in trace.ops.iter().enumerate() {
            let before = m.space.maps;
            if op.alloc {
                m.alloc(op.id, op.size as u64, op.stream);
            } else {
                m.free(op.id);
            }
            if show_where && second && m.space.maps > before {
                println!(
                    "  pass 2, event {i}: {} MiB mapped for a block of {} B",
                    (m.space.maps - before) * 2,
                    op.size
                );
            }
        }
        let ids: Vec<u64> = m.live.keys().copied().collect();
        for id in ids {
            m.free(id);
        }
        Pass {
            ratio: (m.space.peak_mapped * PAGE) as f64 / peak_live,
            calls: m.space.map_calls + m.space.unmap_calls - calls,
            mapped: (m.space.maps - maps) * PAGE,
            unmapped: (m.space.unmaps - unmaps) * PAGE,
            peak: m.space.peak_mapped * PAGE,
        }
    };
    let cold = pass(&mut m, false);
    let warm = pass(&mut m, true);
    [cold, warm]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut policy, mut slack, mut use_chunks, mut show_where, mut paths) = (Policy::Best, 1.0, true, false, vec![]);
    let (mut run_pages, mut edges) = (1u64, false);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--policy" => {
                policy = match args.next().as_deref() {
                    Some("first") => Policy::First,
                    Some("best") => Policy::Best,
                    other => return eprintln!("--policy first|best, not {other:?}"),
                }
            }
            "--slack" => match args.next().and_then(|v| v.parse::<f64>().ok()).filter(|s| *s >= 1.0) {
                Some(s) => slack = s,
                None => return eprintln!("--slack needs a number of at least 1"),
            },
            "--run" => match args.next().and_then(|v| v.parse::<u64>().ok()).filter(|r| *r >= 1) {
                Some(r) => run_pages = r,
                None => return eprintln!("--run needs a number of pages, at least 1"),
            },
            "--edges" => edges = true,
            "--no-chunks" => use_chunks = false,
            "--where" => show_where = true,
            _ => paths.push(a),
        }
    }
    if paths.is_empty() {
        return eprintln!(
            "usage: placement_model [--policy first|best] [--slack S] [--run N] [--edges] [--no-chunks] [--where] TRACE.csv[.gz] ..."
        );
    }
    println!(
        "{:<28} {:>8} {:>8} {:>14} {:>14} {:>11} {:>11}",
        "trace", "cold", "warm", "warm mapped", "warm unmapped", "cold calls", "warm calls"
    );
    for path in &paths {
        let trace = match std::fs::File::open(path).map(BufReader::new).map_err(|e| e.to_string()).and_then(|f| {
            if path.ends_with(".gz") {
                Trace::parse(BufReader::new(flate2::read::GzDecoder::new(f)))
            } else {
                Trace::parse(f)
            }
            .map_err(|e| e.to_string())
        }) {
            Ok(t) => t,
            Err(e) => return eprintln!("{path}: {e}"),
        };
        let [cold, warm] = run(&trace, policy, slack, (run_pages, edges), use_chunks, show_where);
        let name = path.rsplit('/').next().unwrap_or(path);
        println!(
            "{name:<28} {:>8.3} {:>8.3} {:>9.3} × pk {:>9.3} × pk {:>11} {:>11}",
            cold.ratio,
            warm.ratio,
            warm.mapped as f64 / warm.peak.max(1) as f64,
            warm.unmapped as f64 / warm.peak.max(1) as f64,
            cold.calls,
            warm.calls,
        );
    }
}
