//! The device an example runs on, shared by the examples that take `--sim` and `--costs`
//! (`#[path]`-included: examples have no crate of their own to share code through).

use std::sync::Arc;

use vrampool::{Device, SimCosts, SimDevice};

/// The GPU unless `force_sim` or there is none (or the `cuda` feature is off); else a
/// simulated device of `sim_bytes`, spending an H200 driver's costs with `costs`. The
/// simulator's own handle comes back too, for its counts; and a line saying which it is.
pub fn gpu_or_sim(force_sim: bool, sim_bytes: u64, costs: bool) -> (Arc<dyn Device>, Option<SimDevice>, String) {
    let sim = || {
        let dev = SimDevice::builder(sim_bytes).costs(if costs { SimCosts::h200() } else { SimCosts::NONE }).build();
        let what = if costs { "with H200 driver costs" } else { "no driver costs" };
        let arc: Arc<dyn Device> = Arc::new(dev.clone());
        (arc, Some(dev), format!("simulated device ({} GiB, {what})", sim_bytes >> 30))
    };
    if force_sim {
        return sim();
    }
    #[cfg(feature = "cuda")]
    match vrampool::CudaDevice::new(0) {
        Ok(d) => {
            if costs {
                eprintln!("--costs applies to the simulator only: a GPU spends its own");
            }
            let why = format!("CUDA device 0: {}", d.name());
            return (Arc::new(d), None, why);
        }
        Err(e) => {
            let (a, s, why) = sim();
            return (a, s, format!("{why}: no CUDA GPU ({e})"));
        }
    }
    #[allow(unreachable_code)]
    sim()
}
