//! The one error type of the public API and the C ABI.
//!
//! Every failure is a value: nothing in vrampool panics across its API. Variants carry the
//! figures a user needs to act (an out-of-memory error says what was asked, what is mapped,
//! what is live, cached, retiring and the longest free stretch of mapped memory).

use std::fmt;

/// The figures of an out-of-memory error, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes mapped (physical memory held by the pool).
    pub reserved: u64,
    /// Bytes in live blocks (rounded sizes).
    pub allocated: u64,
    /// Bytes held in caches (blocks free for reuse on their stream).
    pub cached: u64,
    /// Bytes freed on a stream whose work has not been observed complete.
    pub retiring: u64,
    /// The largest block the pool could hand out without mapping: its longest free stretch
    /// of mapped memory (`Stats::largest_free_mapped`).
    pub largest_free: u64,
    /// The pool's mapping limit.
    pub max_reserved: u64,
}

/// Why an operation failed.
///
/// Five words, every one whole: a whole-word tag (`repr(u64)`) and whole-word fields. A
/// `Result<Block, Error>` kept whole (not unwrapped at once) is copied the way its variants
/// are laid out; with a 4-byte tag and a 4-byte code beside it, the compiler copied the
/// block's address in halves, and the next whole-word load of it stalled (9–13 ns an
/// allocation and free in a probe loop, against 6–9 ns so).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
#[repr(u64)]
pub enum Error {
    /// Every step of the out-of-memory ladder was taken and the request still did not fit.
    /// The figures are boxed: the error stays small enough that `Result<Block, Error>` is
    /// the size of a block (see [`crate::Block`]), and an out-of-memory error is rare.
    OutOfMemory(Box<OutOfMemory>),
    /// A request that can never be served, whatever is freed: it exceeds the pool's limit.
    TooLarge {
        /// Bytes asked for.
        requested: u64,
        /// The most the pool can ever serve in one block.
        limit: u64,
    },
    /// An argument that makes no sense (a stream of another device, an unaligned range, a
    /// pointer the pool does not own).
    InvalidArgument(String),
    /// The call is not allowed where it was made (a device call from inside a host function
    /// running on a stream, as CUDA forbids).
    NotPermitted(&'static str),
    /// The stream is being captured into a CUDA graph and the operation cannot be recorded.
    StreamCapturing,
    /// The stream was destroyed.
    StreamDestroyed,
    /// No usable device: no driver, no GPU, or the driver refused to start.
    NoDevice(String),
    /// The device cannot do what was asked (mapping memory at two addresses, say).
    Unsupported(&'static str),
    /// [`crate::Pool::check`] found the pool's books inconsistent (a bug: please report it).
    InvariantBroken(String),
    /// A device (driver) call failed.
    Device {
        /// The driver call that failed.
        call: &'static str,
        /// The driver's error code (CUresult), or -1 for the simulator.
        code: i64,
        /// The driver's words for it (boxed, so that the error stays five words).
        message: Box<String>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        match self {
            Error::OutOfMemory(oom) => {
                let OutOfMemory { requested, reserved, allocated, cached, retiring, largest_free, max_reserved } =
                    &**oom;
                write!(
                    f,
                    "out of device memory: asked {requested} B ({:.1} MiB); reserved {:.1} MiB of at most {:.1} MiB, \
                 allocated {:.1} MiB, cached {:.1} MiB, retiring {:.1} MiB, largest free stretch of mapped memory {:.1} MiB",
                    *requested as f64 / MIB,
                    *reserved as f64 / MIB,
                    *max_reserved as f64 / MIB,
                    *allocated as f64 / MIB,
                    *cached as f64 / MIB,
                    *retiring as f64 / MIB,
                    *largest_free as f64 / MIB,
                )
            }
            Error::TooLarge { requested, limit } => {
                write!(f, "request of {requested} B can never be served: the pool's limit is {limit} B")
            }
            Error::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            Error::NotPermitted(what) => write!(f, "not permitted: {what}"),
            Error::StreamCapturing => write!(f, "the stream is being captured into a graph"),
            Error::StreamDestroyed => write!(f, "the stream was destroyed"),
            Error::InvariantBroken(what) => write!(f, "pool invariant broken: {what}"),
            Error::NoDevice(why) => write!(f, "no usable device: {why}"),
            Error::Unsupported(what) => write!(f, "unsupported: {what}"),
            Error::Device { call, code, message } => write!(f, "{call} failed ({code}): {message}"),
        }
    }
}

impl std::error::Error for Error {}

/// Shorthand for vrampool's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_fits_beside_a_blocks_niche() {
        // `Result<Block, Error>` is the size of a block only while an error fits in a
        // block's words other than its never-null pool pointer.
        assert!(std::mem::size_of::<Error>() <= 40, "Error is {} bytes", std::mem::size_of::<Error>());
        assert_eq!(std::mem::size_of::<Result<crate::Block, Error>>(), std::mem::size_of::<crate::Block>());
    }
}
