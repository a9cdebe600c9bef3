//! The Pool API in a few lines: allocate on a stream, use, free in stream order.
//!
//! `cargo run --release --example quickstart` (on the GPU if there is one, else simulated).

use vrampool::{Pool, PoolConfig};

fn main() -> Result<(), vrampool::Error> {
    let (device, why) = vrampool::device::auto(16 << 30);
    println!("device: {why}");
    let pool = Pool::with_device(device.clone(), PoolConfig::default())?;
    let compute = device.create_stream()?;
    let copy = device.create_stream()?;

    let block = pool.alloc(1 << 20, &compute)?; // usable by work enqueued on `compute` from now on
    device.memset(block.device_ptr(), 0, block.len(), &compute)?;
    block.record_stream(&copy); // also used on `copy`: its free waits for both streams
    let mut head = [1u8; 16];
    device.copy_from_device(&mut head, block.device_ptr(), &copy)?;
    assert_eq!(head, [0u8; 16]);
    drop(block); // stream-ordered free

    let again = pool.alloc(1 << 20, &compute)?; // the first block still waits for both streams' events
    println!("block at {:#x}, {} bytes; stats: {:?}", again.device_ptr(), again.len(), pool.stats());
    drop(again);
    pool.trim()?;
    pool.check()?;
    println!("after trim: {} bytes reserved", pool.stats().reserved_bytes);
    Ok(())
}
