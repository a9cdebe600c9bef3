//! vrampool: a lock-free, concurrent, stream-ordered pool allocator for GPU device memory.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod sync;

// The lock-free building blocks are public under `--cfg loom` so the `loom_tests` crate can
// model them; some of their helpers serve only those models and the tests.
#[cfg(loom)]
pub mod arena;
#[cfg(not(loom))]
#[allow(dead_code, unused_imports)]
pub(crate) mod arena;
#[cfg(loom)]
pub mod reclaim;
#[cfg(not(loom))]
#[allow(dead_code, unused_imports)]
pub(crate) mod reclaim;

#[cfg(loom)]
pub mod cache;
#[cfg(not(loom))]
#[allow(dead_code, unused_imports)]
pub(crate) mod cache;

#[allow(dead_code)]
pub(crate) mod class;
pub mod device;
pub mod error;
mod pool;
pub mod replay;
mod stats;

#[cfg(feature = "cuda")]
pub use device::CudaDevice;
pub use device::{Device, DeviceKind, Event, MemInfo, SimDevice, Stream, StreamId};
pub use error::{Error, Result};
pub use pool::{Block, Pool, PoolConfig, StreamCache, ALIGN};
pub use stats::Stats;

/// Internals exposed for the benches' baselines only; not part of the API.
#[doc(hidden)]
pub mod __bench {
    pub use crate::arena::Arena;
}
