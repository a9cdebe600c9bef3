//! Replay allocation traces (gzip'd or plain CSV: `op,id,size,stream`) through a pool and
//! report peak reserved ÷ peak live (the memory figure of merit), hit rates and time per
//! operation.
//!
//! ```text
//! cargo run --release --example replay -- benches/traces/*.csv.gz
//! ```
//!
//! Runs on the GPU when there is one, else on the simulated device. `--map-run-pages N` sets
//! `PoolConfig::map_run_pages` (pages mapped per device call; default 1).

use std::io::BufReader;

use vrampool::replay::{replay, Trace};
use vrampool::PoolConfig;

fn load(path: &str) -> Result<Trace, Box<dyn std::error::Error>> {
    let file = std::fs::File::open(path)?;
    Ok(if path.ends_with(".gz") {
        Trace::parse(BufReader::new(flate2::read::GzDecoder::new(file)))?
    } else {
        Trace::parse(BufReader::new(file))?
    })
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut config = PoolConfig::default();
    if let Some(i) = args.iter().position(|a| a == "--map-run-pages") {
        let n = args.get(i + 1).and_then(|v| v.parse().ok());
        let Some(n) = n else {
            eprintln!("--map-run-pages needs a number");
            std::process::exit(2);
        };
        config.map_run_pages = n;
        args.drain(i..i + 2);
    }
    let paths = args;
    if paths.is_empty() {
        eprintln!("usage: replay TRACE.csv[.gz] ...");
        std::process::exit(2);
    }
    let (device, why) = vrampool::device::auto(160 << 30);
    println!("device: {why}");
    println!(
        "{:<24} {:>8} {:>11} {:>14} {:>7} {:>7} {:>7} {:>8}",
        "trace", "events", "peak live", "peak reserved", "ratio", "T0 hit", "T1 hit", "ns/op"
    );
    for path in paths {
        let r = load(&path).and_then(|t| Ok(replay(&t, &device, config.clone())?));
        match r {
            Ok(r) => println!(
                "{:<24} {:>8} {:>7.1} MiB {:>10.1} MiB {:>7.3} {:>7.3} {:>7.3} {:>8.0}",
                path.rsplit('/').next().unwrap_or(&path),
                r.events,
                r.peak_live as f64 / (1 << 20) as f64,
                r.peak_reserved as f64 / (1 << 20) as f64,
                r.ratio(),
                r.stats.t0_hit_rate(),
                r.stats.t1_hit_rate(),
                r.ns_per_op()
            ),
            Err(e) => {
                eprintln!("{path}: {e}");
                std::process::exit(1);
            }
        }
    }
}
