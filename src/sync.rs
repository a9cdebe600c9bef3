//! The one facade for everything the lock-free code shares between threads.
//!
//! Atomics, `UnsafeCell`, `Arc`, thread-locals, fences, spin hints and the epoch collector
//! come from here, never from `std` directly, so that a build with `--cfg loom` swaps every
//! one of them for loom's model-checked twin (and crossbeam-epoch for its loom build, under
//! `--cfg crossbeam_loom`). Code that is not part of a lock-free protocol — the simulated
//! device, which plays the part of the hardware and the driver — uses `std` on purpose, so
//! that loom models never see it.
//!
//! loom treats `SeqCst` loads and stores as `AcqRel` (loom#180): handshakes that need a
//! total order are built on [`atomic::fence`]`(SeqCst)`, which loom does model.

// The facade offers the whole set, whether or not today's code uses each one.
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) mod atomic {
    pub use std::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}
#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) mod atomic {
    pub use loom::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::Arc;
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::Arc;

#[cfg(loom)]
pub(crate) use loom::thread::{current as current_thread, ThreadId};
/// A thread's identity, and the calling thread's: loom's model threads share one OS thread,
/// so under loom they are loom's own.
#[cfg(not(loom))]
pub(crate) use std::thread::{current as current_thread, ThreadId};

/// The epoch-based reclamation crate, in its loom build under `--cfg crossbeam_loom`.
pub(crate) use crossbeam_epoch as epoch;

/// A spin-wait hint for loops that wait on another thread's progress. Under loom it yields,
/// so the model explores the other thread instead of spinning forever.
#[inline]
pub(crate) fn spin_hint() {
    #[cfg(not(loom))]
    std::hint::spin_loop();
    #[cfg(loom)]
    loom::thread::yield_now();
}

/// Give up the processor: for waits that may be long (another thread mapping a page).
#[inline]
pub(crate) fn yield_now() {
    #[cfg(not(loom))]
    std::thread::yield_now();
    #[cfg(loom)]
    loom::thread::yield_now();
}

/// The cheap side of an asymmetric fence pair: the owner of a thread cache runs it on every
/// operation. With [`heavy_fence`] on the other side, the pair orders as two SeqCst fences
/// would. In production it is only a compiler fence: the heavy side forces a full barrier on
/// every running thread with `membarrier(2)`, and where that is unavailable the heavy side
/// reports failure, so nothing relies on the pair (idle caches are then never taken, only
/// flushed by their owners). Under loom it is `fence(SeqCst)`, which is what the models check.
#[inline(always)]
pub(crate) fn light_fence() {
    #[cfg(not(loom))]
    std::sync::atomic::compiler_fence(atomic::Ordering::SeqCst);
    #[cfg(loom)]
    atomic::fence(atomic::Ordering::SeqCst);
}

/// The expensive side of the pair: run by a thread that must see every owner's latest
/// flag (a thief taking an idle cache). A `membarrier` system call in production. Returns
/// false if the ordering cannot be guaranteed (no membarrier here, or the call failed): the
/// caller must then not rely on it.
pub(crate) fn heavy_fence() -> bool {
    #[cfg(all(test, not(loom)))]
    HEAVY_FENCES.with(|n| n.set(n.get() + 1));
    #[cfg(not(loom))]
    {
        membarrier::available() && membarrier::barrier()
    }
    #[cfg(loom)]
    {
        atomic::fence(atomic::Ordering::SeqCst);
        true
    }
}

#[cfg(all(test, not(loom)))]
std::thread_local! {
    /// The [`heavy_fence`]s this thread asked for: each interrupts every core running the
    /// process, and tests check which paths need none.
    pub(crate) static HEAVY_FENCES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[cfg(not(loom))]
mod membarrier {
    //! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`: registered once per process, on the
    //! first heavy fence; if registration fails (an old kernel, a sandbox that filters the
    //! call) heavy fences report failure.
    use std::sync::atomic::{AtomicU8, Ordering};

    const CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

    /// 0: not tried yet, 1: works, 2: unavailable.
    static STATE: AtomicU8 = AtomicU8::new(0);

    fn register() -> bool {
        // SAFETY: membarrier takes plain integer arguments and touches no memory of ours.
        let rc = unsafe { libc::syscall(libc::SYS_membarrier, CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) };
        rc == 0
    }

    /// Whether membarrier works here (registering on the first call).
    pub(super) fn available() -> bool {
        match STATE.load(Ordering::Acquire) {
            1 => true,
            2 => false,
            _ => {
                let ok = register();
                STATE.store(if ok { 1 } else { 2 }, Ordering::Release);
                ok
            }
        }
    }

    /// Run the process-wide barrier; false if the call failed.
    pub(super) fn barrier() -> bool {
        // SAFETY: as in `register`.
        let rc = unsafe { libc::syscall(libc::SYS_membarrier, CMD_PRIVATE_EXPEDITED, 0, 0) };
        rc == 0
    }
}

/// `thread_local!` that loom sees (a std thread-local would be shared by every loom thread).
#[cfg(not(loom))]
#[allow(unused_macros)]
macro_rules! vp_thread_local {
    ($($t:tt)*) => { std::thread_local!($($t)*); };
}
#[cfg(loom)]
#[allow(unused_macros)]
macro_rules! vp_thread_local {
    ($($t:tt)*) => { loom::thread_local!($($t)*); };
}
#[allow(unused_imports)]
pub(crate) use vp_thread_local as thread_local;

/// An `UnsafeCell` whose accesses go through closures, as loom's does, so that loom can
/// check that no access races with another.
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(#[cfg(not(loom))] std::cell::UnsafeCell<T>, #[cfg(loom)] loom::cell::UnsafeCell<T>);

#[allow(dead_code)]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(not(loom))]
        return Self(std::cell::UnsafeCell::new(value));
        #[cfg(loom)]
        return Self(loom::cell::UnsafeCell::new(value));
    }

    /// Run `f` with a shared pointer to the contents; the caller's protocol must rule out a
    /// concurrent `with_mut`.
    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        #[cfg(not(loom))]
        return f(self.0.get());
        #[cfg(loom)]
        return self.0.with(f);
    }

    /// Run `f` with a unique pointer to the contents; the caller's protocol must rule out
    /// any concurrent access.
    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(not(loom))]
        return f(self.0.get());
        #[cfg(loom)]
        return self.0.with_mut(f);
    }
}

#[cfg(test)]
mod tests {
    use super::atomic::{AtomicU64, Ordering};
    use super::UnsafeCell;

    #[test]
    fn cell_with_and_with_mut_see_the_same_value() {
        let c = UnsafeCell::new(1u32);
        // SAFETY: single-threaded test; no other access exists.
        c.with_mut(|p| unsafe { *p = 7 });
        // SAFETY: as above.
        assert_eq!(c.with(|p| unsafe { *p }), 7);
    }

    #[test]
    fn atomics_are_the_std_ones_outside_loom() {
        let a = AtomicU64::new(3);
        assert_eq!(a.fetch_add(2, Ordering::AcqRel), 3);
        assert_eq!(a.load(Ordering::Acquire), 5);
    }
}
