//! vrampool: a lock-free, concurrent, stream-ordered pool allocator for GPU device memory.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod sync;

pub mod device;
pub mod error;

#[cfg(feature = "cuda")]
pub use device::CudaDevice;
pub use device::{Device, DeviceKind, Event, MemInfo, SimDevice, Stream, StreamId};
pub use error::{Error, Result};
