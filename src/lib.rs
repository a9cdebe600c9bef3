//! vrampool: a lock-free, concurrent, stream-ordered pool allocator for GPU device memory.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod sync;

pub mod error;
pub use error::{Error, Result};
