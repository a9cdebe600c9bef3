//! Holding a simulated stream back, for the tests that share it (`#[path]`-included): work
//! enqueued after the stall runs, and events recorded after it complete, only once the
//! returned sender is dropped.

use vrampool::{SimDevice, Stream};

/// `stream` runs nothing enqueued after this until the returned sender is dropped.
pub fn stalled(dev: &SimDevice, stream: &Stream) -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    dev.enqueue(stream, move || {
        let _ = rx.recv();
    })
    .unwrap();
    tx
}
