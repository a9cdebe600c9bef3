//! What a [`Stream`](crate::device::Stream) and an [`Event`](crate::device::Event) of
//! `CudaDevice` hold, and how they go: the last handle's drop destroys the driver's stream or
//! event (an event goes back to the device's spares first), unless it happens inside a host
//! function, where it is parked with the device instead; and the trampoline through which the
//! driver runs host functions, which is what marks a thread as inside one.
//!
//! - **Host functions** run through one `extern "C"` trampoline that owns the boxed closure,
//!   runs it under `catch_unwind` (unwinding into the driver is undefined behaviour) and marks
//!   the thread as inside a host function, so every method called from there fails with
//!   [`Error::NotPermitted`](crate::error::Error::NotPermitted) before it reaches the driver
//!   (which would refuse or deadlock).
//!   Streams and events whose last handle is dropped inside a host function cannot be
//!   destroyed there: they are parked and destroyed by the next device call on another thread.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::sys;

use super::CudaInner;
use crate::device::{in_host_fn, set_in_host_fn, HostFn};

/// A stream or an event whose last handle was dropped inside a host function, to destroy later.
pub(super) enum Parked {
    Stream(usize),
    Event(usize),
    /// A cudarc stream whose vrampool handle was dropped inside a host function: dropping
    /// it there could make cudarc call the driver (see `cudarc_interop`).
    Cudarc(Arc<cudarc::driver::CudaStream>),
}

/// What a [`Stream`](crate::device::Stream) of this device holds.
pub(super) struct CudaStream {
    pub(super) raw: usize,
    /// True while this handle owns a stream not yet destroyed: whoever swaps it to false
    /// (destroy_stream or the drop of the last handle) destroys it, exactly once.
    pub(super) owned_live: AtomicBool,
    pub(super) owned: bool,
    pub(super) device: Arc<CudaInner>,
    /// The cudarc stream this handle was made from (`cudarc_interop`), held so that the raw
    /// handle outlives every use of this one; `None` for streams vrampool created or wrapped
    /// from a raw handle.
    pub(super) cudarc: Option<Arc<cudarc::driver::CudaStream>>,
}

impl CudaStream {
    pub(super) fn raw(&self) -> sys::CUstream {
        self.raw as sys::CUstream
    }

    pub(super) fn take_ownership(&self) -> bool {
        self.owned_live.swap(false, Ordering::AcqRel)
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if self.take_ownership() {
            self.device.dispose(Parked::Stream(self.raw));
        }
        if let Some(s) = self.cudarc.take() {
            if in_host_fn() {
                self.device.park(Parked::Cudarc(s));
            }
        }
    }
}

/// What an [`Event`](crate::device::Event) of this device holds.
pub(super) struct CudaEvent {
    pub(super) raw: usize,
    pub(super) device: Arc<CudaInner>,
}

impl CudaEvent {
    pub(super) fn raw(&self) -> sys::CUevent {
        self.raw as sys::CUevent
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // Kept for the next `create_event`; destroyed only when the spares are full.
        if let Err(raw) = self.device.spare_events.push(self.raw) {
            self.device.dispose(Parked::Event(raw));
        }
    }
}

/// What the trampoline receives: the closure and where to count its panics.
pub(super) struct HostCall {
    pub(super) f: HostFn,
    pub(super) device: Weak<CudaInner>,
}

/// Clears the in-host-function flag however the closure ends.
struct HostFnFlag;

impl HostFnFlag {
    fn set() -> HostFnFlag {
        set_in_host_fn(true);
        HostFnFlag
    }
}

impl Drop for HostFnFlag {
    fn drop(&mut self) {
        set_in_host_fn(false);
    }
}

/// Run a host function for the driver.
///
/// # Safety
/// `data` must come from `Box::into_raw` of a `Box<HostCall>` and be passed here exactly once.
pub(super) unsafe extern "C" fn host_trampoline(data: *mut c_void) {
    // SAFETY: by the contract, `data` is an owned, live `Box<HostCall>` given to us once.
    let call = unsafe { Box::from_raw(data.cast::<HostCall>()) };
    // Held to the end: everything dropped here (the closure's captures, and the device itself
    // should the upgrade below hold its last reference) must park rather than call the driver.
    let _flag = HostFnFlag::set();
    let HostCall { f, device } = *call;
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        if let Some(dev) = device.upgrade() {
            dev.host_fn_panics.fetch_add(1, Ordering::Relaxed);
        }
    }
}
