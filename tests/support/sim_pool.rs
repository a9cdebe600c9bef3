//! A pool on the simulated device, and the checks the Pool API tests share
//! (`#[path]`-included by `pool_api.rs` and `stream_reuse.rs`).
#![allow(dead_code)]

use vrampool::{Pool, PoolConfig, SimDevice, Stream};

#[path = "stall.rs"]
mod stall;
#[allow(unused_imports)]
pub use stall::stalled;

/// A pool with the default configuration on a simulated device of `capacity` bytes, and
/// a stream.
pub fn pool(capacity: u64) -> (SimDevice, Pool, Stream) {
    let dev = SimDevice::new(capacity);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    (dev, pool, s)
}

/// Once every block is dropped: `trim` leaves nothing mapped, and the books agree.
pub fn all_given_back(pool: &Pool) {
    pool.trim().unwrap();
    pool.check().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
}

/// Work enqueued on `stream` now runs only once the stalled stream behind `tx` is released:
/// `stream` waits for it on the device.
pub fn runs_only_after_release(dev: &SimDevice, stream: &Stream, tx: std::sync::mpsc::Sender<()>, what: &str) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let ran = std::sync::Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    dev.enqueue(stream, move || flag.store(true, Ordering::Release)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!ran.load(Ordering::Acquire), "ran before {what}");
    drop(tx);
    dev.synchronize(stream).unwrap();
    assert!(ran.load(Ordering::Acquire));
}
