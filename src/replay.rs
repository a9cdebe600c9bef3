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

use crate::device::{Device, Stream};
use crate::error::{Error, Result};
use crate::pool::{Block, Pool, PoolConfig};
use crate::stats::Stats;

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

/// What a replay measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Events replayed.
    pub events: usize,
    /// The most bytes live at once (sum of requested sizes).
    pub peak_live: u64,
    /// The most bytes the pool had mapped.
    pub peak_reserved: u64,
    /// Time spent in the allocations and frees.
    pub elapsed: Duration,
    /// The pool's figures at the end of the replay, before the blocks still live are freed.
    pub stats: Stats,
}

impl Report {
    /// Peak reserved ÷ peak live.
    pub fn ratio(&self) -> f64 {
        if self.peak_live == 0 {
            return 0.0;
        }
        self.peak_reserved as f64 / self.peak_live as f64
    }

    /// Nanoseconds per event.
    pub fn ns_per_op(&self) -> f64 {
        if self.events == 0 {
            return 0.0;
        }
        self.elapsed.as_nanos() as f64 / self.events as f64
    }
}

/// Replay `trace` through a fresh pool of `config` on `device`; the pool is trimmed and
/// checked at the end.
pub fn replay(trace: &Trace, device: &Arc<dyn Device>, config: PoolConfig) -> Result<Report> {
    let pool = Pool::with_device(Arc::clone(device), config)?;
    let mut streams: HashMap<u32, Stream> = HashMap::new();
    for op in &trace.ops {
        if let std::collections::hash_map::Entry::Vacant(v) = streams.entry(op.stream) {
            v.insert(device.create_stream()?);
        }
    }
    let mut live: HashMap<u64, (Block, u32)> = HashMap::with_capacity(1024);
    let (mut live_bytes, mut peak_live) = (0u64, 0u64);
    let start = Instant::now();
    for op in &trace.ops {
        let Some(stream) = streams.get(&op.stream) else { continue };
        if op.alloc {
            let b = pool.alloc(op.size, stream)?;
            live_bytes += op.size as u64;
            peak_live = peak_live.max(live_bytes);
            if let Some((old, _)) = live.insert(op.id, (b, op.stream)) {
                // An id allocated twice: the trace lost a free; the older block goes.
                live_bytes -= old.len() as u64;
            }
        } else if let Some((b, home)) = live.remove(&op.id) {
            if home != op.stream {
                b.record_stream(stream);
            }
            live_bytes -= b.len() as u64;
            drop(b);
        }
    }
    let elapsed = start.elapsed();
    let stats = pool.stats();
    drop(live);
    pool.trim()?;
    pool.check()?;
    for s in streams.values() {
        let _ = device.synchronize(s);
    }
    Ok(Report { events: trace.ops.len(), peak_live, peak_reserved: stats.peak_reserved_bytes, elapsed, stats })
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
    }
}
