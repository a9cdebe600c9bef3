//! vrampool: a lock-free, concurrent, stream-ordered pool allocator for GPU device memory.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod sync;

#[cfg(loom)]
pub mod arena;
// The pool that uses the arena is not written yet; until then only the tests use it.
#[cfg(not(loom))]
#[allow(dead_code, unused_imports)]
pub(crate) mod arena;

pub mod error;
pub use error::{Error, Result};
