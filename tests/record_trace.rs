//! `PoolConfig::record_trace`: a pool writes what it serves as a trace that replays.
//!
//! - Replaying a recorded trace through a recording pool writes the same trace back (ids
//!   and stream numbers renamed in order of appearance; zero-byte requests left out; the
//!   blocks a trace leaves live freed at the end).
//! - Threads allocating and freeing at once on their own streams give a trace in which every
//!   free follows its allocation and an address is never live twice, and that replays.
//! - The registry's pools record from `VRAMPOOL_RECORD_TRACE`'s setting (`Config::pool`), and
//!   `registry::flush_traces` writes their lines out.

use std::collections::HashMap;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vrampool::replay::{replay, Op, Trace};
use vrampool::{Device, Pool, PoolConfig, SimDevice};

#[path = "support/xorshift.rs"]
mod xorshift;
use xorshift::Rng;

fn shared_trace(name: &str) -> Trace {
    let path = format!("{}/benches/traces/{name}.csv.gz", env!("CARGO_MANIFEST_DIR"));
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Trace::parse(BufReader::new(flate2::read::GzDecoder::new(file))).unwrap()
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vrampool-trace-{}-{name}.csv", std::process::id()))
}

fn read_trace(path: &Path) -> Trace {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Trace::parse(BufReader::new(file)).unwrap()
}

fn recording(path: &Path) -> PoolConfig {
    PoolConfig { record_trace: Some(path.to_path_buf()), ..PoolConfig::default() }
}

/// The events with ids and streams renamed in order of first appearance, zero-byte
/// allocations (and their frees) left out: what two traces of one workload share.
fn canonical(t: &Trace) -> Vec<Op> {
    let (mut ids, mut streams, mut empty) = (HashMap::new(), HashMap::new(), std::collections::HashSet::new());
    let mut out = Vec::new();
    for op in &t.ops {
        if op.alloc && op.size == 0 {
            empty.insert(op.id);
            continue;
        }
        if !op.alloc && empty.remove(&op.id) {
            continue;
        }
        let n = ids.len() as u64;
        let id = *ids.entry(op.id).or_insert(n);
        let n = streams.len() as u32;
        // A free is on its block's stream in a recorded trace, on the freeing stream in
        // PyTorch's: compare the allocations' streams only.
        let stream = if op.alloc { *streams.entry(op.stream).or_insert(n) } else { 0 };
        out.push(Op { alloc: op.alloc, id, size: if op.alloc { op.size } else { 0 }, stream });
    }
    out
}

#[test]
fn replaying_a_trace_through_a_recording_pool_writes_the_same_trace() {
    for name in ["resnet_varbatch", "pipeline_side_stream"] {
        let original = shared_trace(name);
        let path = temp(name);
        let dev: Arc<dyn Device> = Arc::new(SimDevice::new(16 << 30));
        let report = replay(&original, &dev, recording(&path)).unwrap();
        // The replay's pool is dropped at its end: every line is in the file.
        let recorded = read_trace(&path);
        std::fs::remove_file(&path).unwrap();
        let (want, got) = (canonical(&original), canonical(&recorded));
        assert!(got.len() >= want.len(), "{name}: {} events recorded of {}", got.len(), want.len());
        let differ = want.iter().zip(&got).position(|(a, b)| a != b);
        assert_eq!(differ, None, "{name}: the recorded trace differs at event {differ:?}");
        // What the original left live is freed after it, and nothing else.
        assert!(got[want.len()..].iter().all(|op| !op.alloc), "{name}: only frees follow the trace");
        assert_eq!(recorded.peak_live(), report.peak_live, "{name}: the same peak live bytes");
    }
}

#[test]
fn threads_at_once_record_a_trace_that_replays() {
    const THREADS: u64 = 4;
    const OPS: u64 = 20_000;
    let path = temp("threads");
    let dev = SimDevice::new(4 << 30);
    let pool = Pool::new(dev.clone(), recording(&path)).unwrap();
    let allocs: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (pool, dev) = (pool.clone(), dev.clone());
                s.spawn(move || {
                    let stream = dev.create_stream().unwrap();
                    let mut rng = Rng(t + 1);
                    let mut live = Vec::new();
                    let mut allocs = 0;
                    for _ in 0..OPS {
                        if live.len() < 32 && (live.is_empty() || rng.next() % 2 == 0) {
                            let bytes = 1usize << (8 + rng.next() % 15);
                            live.push(pool.alloc(bytes, &stream).unwrap());
                            allocs += 1;
                        } else {
                            let i = (rng.next() % live.len() as u64) as usize;
                            drop(live.swap_remove(i));
                        }
                    }
                    drop(live);
                    dev.synchronize(&stream).unwrap();
                    allocs
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    assert_eq!(pool.flush_trace().unwrap(), 2 * allocs, "a line for every allocation and every free");
    let trace = read_trace(&path);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(trace.ops.len() as u64, 2 * allocs);
    let mut live = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for (n, op) in trace.ops.iter().enumerate() {
        if op.alloc {
            assert!(seen.insert(op.id), "event {n}: id {} allocated twice", op.id);
            live.insert(op.id, op.size);
        } else {
            assert_eq!(live.remove(&op.id), Some(op.size), "event {n}: free of id {} that is not live", op.id);
        }
    }
    assert!(live.is_empty(), "every block was freed");
    let streams: std::collections::HashSet<u32> = trace.ops.iter().map(|op| op.stream).collect();
    assert_eq!(streams.len() as u64, THREADS, "one trace stream per thread's stream");
    let again: Arc<dyn Device> = Arc::new(SimDevice::new(4 << 30));
    let r = replay(&trace, &again, PoolConfig::default()).unwrap();
    assert_eq!(r.events as u64, 2 * allocs);
}

#[test]
fn a_pool_that_does_not_record_flushes_nothing_and_an_unwritable_path_is_refused() {
    let dev = SimDevice::new(1 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    assert_eq!(pool.flush_trace().unwrap(), 0);
    let bad = PathBuf::from("/nonexistent-vrampool-dir/trace.csv");
    let Err(e) = Pool::new(dev, recording(&bad)) else { panic!("the file cannot be made") };
    assert!(e.to_string().contains("nonexistent-vrampool-dir"), "{e}");
}

#[test]
fn the_registry_pools_record_where_the_configuration_says() {
    use vrampool::registry::{self, Config, DeviceChoice};
    let path = temp("registry");
    let mut config = Config { device: DeviceChoice::Sim, sim_bytes: 1 << 30, sim_devices: 2, ..Config::default() };
    config.pool.record_trace = Some(path.clone());
    registry::configure(config).unwrap();
    for device in 0..2 {
        let pool = registry::pool(device).unwrap();
        let stream = registry::default_stream(device).unwrap();
        drop(pool.alloc(4096 << device, &stream).unwrap());
    }
    assert_eq!(registry::flush_traces().unwrap(), 4, "two events on each device");
    let second = PathBuf::from(format!("{}.1", path.display()));
    for (p, size) in [(&path, 4096), (&second, 8192)] {
        let t = read_trace(p);
        std::fs::remove_file(p).unwrap();
        assert_eq!(t.ops.len(), 2, "{}", p.display());
        assert_eq!((t.ops[0].alloc, t.ops[0].size, t.ops[1].alloc), (true, size, false), "{}", p.display());
    }
}
