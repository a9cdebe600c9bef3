//! vrampool: a lock-free, concurrent, stream-ordered pool allocator for GPU device memory.
//!
//! # Using it
//!
//! Make a [`Pool`] over a device, give each worker thread a [`StreamCache`] for its stream,
//! and allocate [`Block`]s; dropping a block frees it in stream order (reusable at once by
//! later work on its stream, by other streams once the GPU is past it):
//!
//! ```
//! use vrampool::{Pool, PoolConfig, SimDevice};
//! let dev = SimDevice::new(1 << 30);                 // or `CudaDevice::new(0)`, `device::auto(..)`
//! let pool = Pool::new(dev.clone(), PoolConfig::default())?;
//! let s = dev.new_stream()?;                         // the worker's stream
//! let cache = pool.stream_cache(&s)?;                // the worker's cache for it: the fastest path
//! let b = cache.alloc(4096)?;                        // or `pool.alloc(4096, &s)`
//! assert_eq!(b.device_ptr() % 256, 0);               // use it in work enqueued on `s`
//! drop(b);                                           // freed in stream order
//! let stats = pool.stats();                          // every tier's figures
//! assert_eq!(stats.allocated_bytes, 0);
//! pool.trim()?;                                      // give back what is cached
//! # Ok::<(), vrampool::Error>(())
//! ```
//!
//! - A block used on another stream too: [`Block::record_stream`]; typed blocks:
//!   [`Buffer`] (and `CudaBuffer` for cudarc, feature `cuda`).
//! - What the memory holds: [`Pool::snapshot`] (every mapped byte live, cached, retiring or
//!   free), [`Pool::leaks`] (what is still out; with [`PoolConfig::track_sites`], where it
//!   was allocated), [`Pool::check`] (the books).
//! - Your own workload as a trace: [`PoolConfig::record_trace`] writes every allocation and
//!   free in the format [`replay`] plays (`VRAMPOOL_RECORD_TRACE` for the C ABI).
//! - Devices: `CudaDevice` (feature `cuda`, the driver API loaded at run time) and
//!   [`SimDevice`], a simulated GPU as strict as CUDA; [`device::auto`] picks one. C, C++ and
//!   PyTorch: [`ffi`] (`libvrampool.so`, `include/vrampool.h`); one pool per device for a
//!   process: [`registry`]. Implementing a [`Device`]: [`device::implement`].
//! - The slow paths (refills, the out-of-memory ladder, maps, unmaps, device waits) emit
//!   `tracing` spans and events; with no subscriber they cost nothing.
//!
//! # Inside
//!
//! Each worker thread gets its own cache per stream (T0), caches trade whole magazines with
//! per-stream depots (T1), freed memory goes back to the arena at once behind a per-stream
//! fence, and blocks used on several streams wait behind their events (T2); everything
//! comes from one lock-free arena over a reserved address range whose physical pages are
//! mapped on demand (T3). No lock on any path. See `IMPLEMENTATION.md` for the algorithms
//! and `../shared/DESIGN.md` for the contract.
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

mod buffer;
pub(crate) mod class;
mod clock;
pub mod device;
pub mod error;
#[cfg(not(loom))]
pub mod ffi;
#[cfg(loom)]
pub mod live;
#[cfg(not(loom))]
#[allow(dead_code)]
pub(crate) mod live;
mod pool;
#[cfg(not(loom))]
pub mod registry;
pub mod replay;
mod stats;

pub use buffer::{Buffer, BufferView, BufferViewMut};
#[cfg(feature = "cuda")]
pub use buffer::{CudaBuffer, CudaBufferView, CudaBufferViewMut};
/// The cudarc this crate is built with (0.19: driver and NVRTC, loaded at run time), so that
/// a `CudaBuffer` meets the very traits the caller's cudarc code names. A downstream crate
/// may use this re-export or depend on cudarc 0.19 itself (Cargo unifies the two), but must
/// not turn on cudarc's `dynamic-linking` (nor `static-linking`): vrampool uses
/// `dynamic-loading`, and cudarc's build refuses two linking modes. Nor should it turn on a
/// CUDA version feature newer than vrampool's `cuda-12080`: cudarc builds its bindings for
/// the newest one turned on.
#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use device::CudaDevice;
pub use device::{Device, DeviceKind, Event, MemInfo, SimCosts, SimDevice, Stream, StreamId};
pub use error::{Error, OutOfMemory, Result};
pub use pool::{
    Block, BlockState, Extent, Leak, Pool, PoolConfig, Segment, Snapshot, StreamCache, ALIGN, OOM_HANDLER_ROUNDS,
};
pub use stats::{Stats, LADDER_RUNGS};

/// Internals exposed for the benches' baselines only; not part of the API.
#[doc(hidden)]
pub mod __bench {
    pub use crate::arena::alone::{Alone, AloneStream};
    pub use crate::arena::Arena;
}
