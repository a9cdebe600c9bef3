//! Replay allocation traces (gzip'd CSV: `op,id,size,stream`) through a pool and report
//! peak reserved ÷ peak live, the memory figure of merit.
//!
//! ```text
//! cargo run --release --example replay -- benches/traces/*.csv.gz
//! ```
//!
//! Runs on the GPU when there is one, else on the simulated device. Each trace stream is a
//! stream of the device; each free is stream-ordered on the stream written on its line.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::time::Instant;

use vrampool::{Block, Pool, PoolConfig};

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        eprintln!("usage: replay TRACE.csv.gz ...");
        std::process::exit(2);
    }
    let (device, why) = vrampool::device::auto(160 << 30);
    println!("device: {why}");
    println!(
        "{:<26} {:>10} {:>12} {:>14} {:>8} {:>10}",
        "trace", "events", "peak live", "peak reserved", "ratio", "ns/op"
    );
    for path in paths {
        match replay(&path, &device) {
            Ok(r) => println!(
                "{:<26} {:>10} {:>8.1} MiB {:>10.1} MiB {:>8.3} {:>10.0}",
                path.rsplit('/').next().unwrap_or(&path),
                r.events,
                r.peak_live as f64 / (1 << 20) as f64,
                r.peak_reserved as f64 / (1 << 20) as f64,
                r.peak_reserved as f64 / r.peak_live as f64,
                r.ns_per_op
            ),
            Err(e) => {
                eprintln!("{path}: {e}");
                std::process::exit(1);
            }
        }
    }
}

struct Replayed {
    events: u64,
    peak_live: u64,
    peak_reserved: u64,
    ns_per_op: f64,
}

fn replay(path: &str, device: &std::sync::Arc<dyn vrampool::Device>) -> Result<Replayed, Box<dyn std::error::Error>> {
    let file = std::fs::File::open(path)?;
    let reader = BufReader::new(flate2::read::GzDecoder::new(file));
    let mut ops = Vec::new();
    for line in reader.lines() {
        let line = line?;
        if line.starts_with("op") || line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 4 {
            return Err(format!("bad line {line:?}").into());
        }
        ops.push((f[0] == "a", f[1].parse::<u64>()?, f[2].parse::<usize>()?, f[3].parse::<u32>()?));
    }
    let pool = Pool::with_device(device.clone(), PoolConfig::default())?;
    let mut streams = HashMap::new();
    let mut live: HashMap<u64, Block> = HashMap::new();
    let (mut live_bytes, mut peak_live) = (0u64, 0u64);
    let t = Instant::now();
    for &(alloc, id, size, stream) in &ops {
        if alloc {
            let s = match streams.get(&stream) {
                Some(s) => s,
                None => streams.entry(stream).or_insert(device.create_stream()?),
            };
            live.insert(id, pool.alloc(size, s)?);
            live_bytes += size as u64;
            peak_live = peak_live.max(live_bytes);
        } else if let Some(b) = live.remove(&id) {
            live_bytes -= b.len() as u64;
            drop(b);
        }
    }
    let elapsed = t.elapsed();
    let st = pool.stats();
    drop(live);
    pool.trim()?;
    pool.check()?;
    Ok(Replayed {
        events: ops.len() as u64,
        peak_live,
        peak_reserved: st.peak_reserved_bytes,
        ns_per_op: elapsed.as_nanos() as f64 / ops.len() as f64,
    })
}
