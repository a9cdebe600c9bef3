//! The out-of-memory handler: the user's word before an allocation fails.
//!
//! A server often holds memory it could give up: a prefix cache, a KV cache of requests it
//! could pre-empt, buffers kept for a next batch. The ladder cannot know which; the server
//! can. So when every rung has failed, the pool calls the handler set with
//! [`crate::Pool::set_out_of_memory_handler`] with the error's figures. The handler frees
//! what it can and answers `true` to have the ladder climbed again from its first rung, or
//! `false` to let the allocation fail. As RMM's `failure_callback_resource_adaptor`; the C
//! ABI sets one with `vrampool_set_oom_handler`.
//!
//! **What it owns, and its invariants.**
//! - At most one handler a pool, swapped whole (`arc_swap`): a thread calling the old one
//!   while another sets a new one finishes with the old one; nothing else is shared.
//! - The pool holds no lock, no page and no reference into this thread's caches while the
//!   handler runs: it is called from the top of an allocation's cold path, after the
//!   ladder's climb has returned (`PoolInner::with_handler`), and the allocation starts again
//!   from finding its cache. So the handler may free blocks of any pool, allocate, flush
//!   this thread's caches and trim. The C ABI's list of the thread's caches keeps every
//!   entry while a handler runs (`in_handler`): the allocation under the handler is
//!   inside one of them.
//! - It is never called from inside itself: while a thread runs a handler, an allocation
//!   of that thread that runs out of memory (from any pool) fails at once. Without the
//!   guard a handler that allocates would call itself until the stack ran out.
//! - At most [`OOM_HANDLER_ROUNDS`] calls for one allocation: a handler that answers `true`
//!   without freeing anything cannot keep an allocation climbing for ever.
//! - A handler that panics counts as `false`, and the allocation fails with the
//!   out-of-memory error: nothing unwinds across the pool's API, and the unwinding left
//!   nothing held (the handler is called outside every tier).
//!
//! No hit path reads any of this: it is read after the ladder's last rung failed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use arc_swap::ArcSwapOption;

use crate::error::OutOfMemory;
use crate::stats::Counters;
use crate::sync::atomic::AtomicU64;

/// The most times the handler is called for one allocation.
pub const OOM_HANDLER_ROUNDS: u64 = 64;

/// An out-of-memory handler: called with the figures of the failed allocation; `true` to
/// try again (it freed memory), `false` to fail.
pub(crate) type OutOfMemoryHandler = dyn Fn(&OutOfMemory) -> bool + Send + Sync;

crate::sync::thread_local! {
    /// Whether this thread is running an out-of-memory handler now. Not part of any
    /// protocol between threads: a plain cell.
    static IN_HANDLER: std::cell::Cell<bool> = std::cell::Cell::new(false);
}

/// Whether this thread is running an out-of-memory handler now: code that could drop what
/// the allocation under the handler still uses (the C ABI's list of this thread's caches)
/// waits until it returns.
pub(crate) fn in_handler() -> bool {
    IN_HANDLER.try_with(|h| h.get()).unwrap_or(false)
}

/// A pool's handler and what it did.
#[derive(Default)]
pub(crate) struct OnOom {
    handler: ArcSwapOption<Box<OutOfMemoryHandler>>,
    /// Times a handler was called.
    pub(crate) calls: AtomicU64,
    /// Allocations that succeeded after a handler had been called for them.
    pub(crate) rescues: AtomicU64,
}

impl OnOom {
    pub(crate) fn set(&self, handler: Option<Box<OutOfMemoryHandler>>) {
        self.handler.store(handler.map(Arc::new));
    }

    /// Ask the handler about `oom`, the `round`-th failure of one allocation (from 0): true
    /// to climb the ladder again.
    pub(crate) fn retry(&self, oom: &OutOfMemory, round: u64) -> bool {
        if round >= OOM_HANDLER_ROUNDS {
            return false;
        }
        let Some(handler) = self.handler.load_full() else { return false };
        // Outside a thread-local destructor the guard is readable; inside one, no handler.
        let entered = IN_HANDLER.try_with(|h| !h.replace(true)).unwrap_or(false);
        if !entered {
            return false;
        }
        Counters::bump(&self.calls, 1);
        let answer = catch_unwind(AssertUnwindSafe(|| handler(oom)));
        let _ = IN_HANDLER.try_with(|h| h.set(false));
        match answer {
            Ok(again) => again,
            Err(_) => {
                tracing::error!(requested = oom.requested, "the out-of-memory handler panicked: the allocation fails");
                false
            }
        }
    }
}
