//! vrampool: a lock-free, concurrent, stream-ordered pool allocator for GPU device memory.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod sync;

#[cfg(loom)]
pub mod arena;
#[cfg(not(loom))]
pub(crate) mod arena;
#[cfg(loom)]
pub mod reclaim;
#[cfg(not(loom))]
pub(crate) mod reclaim;

pub mod device;
pub mod error;
mod pool;
mod stats;

pub use device::{Device, DeviceKind, Event, MemInfo, SimDevice, Stream, StreamId};
#[cfg(feature = "cuda")]
pub use device::CudaDevice;
pub use error::{Error, Result};
pub use pool::{Block, Pool, PoolConfig, ALIGN};
pub use stats::Stats;
