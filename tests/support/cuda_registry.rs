//! The registry on CUDA device 0, for the C ABI's GPU tests: the device with its context
//! bound to the calling thread, or `None` (said on stderr) where there is no GPU.

use std::sync::Arc;

use vrampool::registry::{self, Config, DeviceChoice};
use vrampool::CudaDevice;

pub fn cuda_registry() -> Option<Arc<CudaDevice>> {
    let dev = match CudaDevice::new(0) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            eprintln!("skipped: no CUDA GPU ({e})");
            return None;
        }
    };
    registry::configure(Config { device: DeviceChoice::Cuda, ..Config::default() })
        .expect("the registry is configured first");
    dev.bind_context().expect("bind the primary context");
    Some(dev)
}
