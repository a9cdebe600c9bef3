//! The C ABI's hot pair against the Rust API's and the best-fit baseline's, as paired
//! ratios: each round times a batch of each, back to back, and the ratio is taken within
//! the round.
//!
//! Why beside `benches/ffi.rs`: criterion measures one function after the other, seconds
//! apart, and on a shared machine the speed of the core moves on that scale (the same
//! build's hot pair read 5.2–7.9 ns on one day here). A ratio of two criterion figures then
//! carries that drift; a ratio within a round of a few milliseconds does not, and the
//! spread over rounds shows how far noise moves it. The rounds rotate which kind goes
//! first, so no kind always runs on a core warmed by another.
//!
//! The kinds are `benches/ffi.rs`'s `ffi_hot_pair` group: `rust_api` (`pool.alloc` + drop
//! of 1 MiB on the registry's pool and default stream, the size known only at run time),
//! `c_abi` (`vrampool_malloc` + `vrampool_free` of the same) and `bestfit` (the
//! `Mutex<BTreeMap>` best fit).
//!
//! ```text
//! cargo bench --bench ffi_paired            # 201 rounds
//! cargo bench --bench ffi_paired -- 1001    # as many rounds as given
//! ```

use std::hint::black_box;
use std::time::Instant;

use vrampool::registry;

#[path = "support/abi.rs"]
mod abi;
use abi::{free, malloc, setup};

#[path = "support/bestfit.rs"]
mod bestfit;
use bestfit::BestFit;

const HOT: usize = 1 << 20;
/// Pairs in a batch of the pool's kinds: about a millisecond.
const BATCH: u32 = 100_000;
/// Pairs in a batch of the baseline, about ten times slower a pair.
const BATCH_BESTFIT: u32 = BATCH / 10;
const DEFAULT_ROUNDS: usize = 201;

const KINDS: [&str; 3] = ["rust_api", "c_abi", "bestfit"];

fn main() {
    // `cargo bench` passes `--bench`; a number among the arguments is the round count.
    let rounds = std::env::args().skip(1).find_map(|a| a.parse::<usize>().ok()).unwrap_or(DEFAULT_ROUNDS).max(1);
    setup();
    let pool = registry::pool(0).expect("the registry's pool on the simulator");
    let stream = registry::default_stream(0).expect("its default stream");
    let bf = BestFit::new(0, 1 << 40);

    // One batch of kind `k`, in ns a pair.
    let batch = |k: usize| -> f64 {
        let t = Instant::now();
        let n = match k {
            0 => {
                for _ in 0..BATCH {
                    drop(black_box(pool.alloc(black_box(HOT), &stream).expect("a hot-pair allocation")));
                }
                BATCH
            }
            1 => {
                for _ in 0..BATCH {
                    free(black_box(malloc(black_box(HOT))), HOT);
                }
                BATCH
            }
            _ => {
                for _ in 0..BATCH_BESTFIT {
                    let a = bf.alloc(black_box(HOT) as u64).expect("the baseline's range is ample");
                    bf.free(black_box(a), HOT as u64);
                }
                BATCH_BESTFIT
            }
        };
        t.elapsed().as_nanos() as f64 / f64::from(n)
    };

    // Warm every path (caches loaded, memo set, code paged in) before the first round.
    for k in 0..KINDS.len() {
        batch(k);
    }
    let mut ns = vec![[0f64; 3]; rounds];
    for (r, row) in ns.iter_mut().enumerate() {
        for i in 0..KINDS.len() {
            let k = (r + i) % KINDS.len();
            row[k] = batch(k);
        }
    }

    println!("ffi_paired: the hot pair (1 MiB), {rounds} rounds; ns a pair, median [10th, 90th percentile]");
    for (k, name) in KINDS.iter().enumerate() {
        let s = spread(ns.iter().map(|row| row[k]).collect());
        println!("  {name:<9} {:7.2} [{:.2}, {:.2}]", s.0, s.1, s.2);
    }
    let ratio = |num: usize, den: usize| spread(ns.iter().map(|row| row[num] / row[den]).collect());
    let c_rust = ratio(1, 0);
    let above = ns.iter().filter(|row| row[1] / row[0] > 2.0).count();
    println!(
        "  c_abi / rust_api: {:.3} [{:.3}, {:.3}], {above} of {rounds} rounds above 2",
        c_rust.0, c_rust.1, c_rust.2
    );
    let bf_c = ratio(2, 1);
    println!("  bestfit / c_abi:  {:.2} [{:.2}, {:.2}]", bf_c.0, bf_c.1, bf_c.2);
}

/// (median, 10th percentile, 90th percentile) of `v`, not empty.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.1), at(0.9))
}
