//! Devices: the one trait the pool calls on its slow paths, and the handles it deals in.
//!
//! The pool never calls the device on its hot path; where it does (mapping pages, recording
//! and polling retire events, waiting before an out-of-memory error) it goes through a
//! `dyn Device`, so `Pool`, `Block` and [`Stream`] are not generic over the device.
//!
//! Two implementations: [`SimDevice`], a simulated GPU in host memory that is exactly as
//! strict as CUDA (used for tests and machines without a GPU), and `CudaDevice` (feature
//! `cuda`), the CUDA driver API through cudarc. [`auto`] picks CUDA when a driver and a GPU
//! are present, else the simulator.
//!
//! Streams are identified by a [`StreamId`] the library assigns, never by the raw handle:
//! the driver reuses handle values once a stream is destroyed, and the per-thread default
//! stream's handle names a different stream on each thread.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

pub mod costs;
pub mod implement;
pub mod sim;
pub use costs::SimCosts;
pub use sim::{SimDevice, SimDeviceBuilder};

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::CudaDevice;

/// A stream's identity, unique for the life of the process (never reused).
pub type StreamId = u64;

/// Which implementation a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The simulated device in host memory.
    Simulated,
    /// A CUDA GPU through the driver API.
    Cuda,
}

/// Free and total physical memory of the device, as `cuMemGetInfo` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes not in use by anyone.
    pub free: u64,
    /// Bytes on the device.
    pub total: u64,
}

/// A work queue on a device, cheap to clone and safe to share: clones name the same stream.
///
/// A stream created by a device is destroyed when [`Device::destroy_stream`] is called or
/// when its last clone is dropped; a wrapped raw stream is never destroyed by vrampool.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

struct StreamInner {
    id: StreamId,
    raw: u64,
    destroyed: AtomicBool,
    /// Run once, just before the stream is destroyed (the pool closes its batches here).
    destroy_hooks: Mutex<Vec<DestroyHook>>,
    backend: Box<dyn Any + Send + Sync>,
}

use implement::DestroyHook;

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

impl Stream {
    /// See [`implement::new_stream`].
    pub(crate) fn from_backend(raw: u64, backend: Box<dyn Any + Send + Sync>) -> Stream {
        // Relaxed: the counter only has to hand out distinct values.
        let id = NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed);
        Stream {
            inner: Arc::new(StreamInner {
                id,
                raw,
                destroyed: AtomicBool::new(false),
                destroy_hooks: Mutex::new(Vec::new()),
                backend,
            }),
        }
    }

    /// The stream's identity: unique for the life of the process.
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// The raw handle (a `CUstream` on CUDA, an index on the simulator).
    pub fn raw(&self) -> u64 {
        self.inner.raw
    }

    /// Whether the stream has been destroyed.
    pub fn is_destroyed(&self) -> bool {
        self.inner.destroyed.load(Ordering::Acquire)
    }

    /// See [`implement::mark_destroyed`].
    pub(crate) fn mark_destroyed(&self) -> bool {
        !self.inner.destroyed.swap(true, Ordering::AcqRel)
    }

    /// See [`implement::stream_backend`].
    pub(crate) fn backend<T: 'static>(&self) -> Option<&T> {
        self.inner.backend.downcast_ref::<T>()
    }

    /// See [`implement::on_destroy`].
    pub(crate) fn on_destroy(&self, hook: DestroyHook) {
        self.inner.destroy_hooks.lock().unwrap_or_else(|p| p.into_inner()).push(hook);
    }

    /// See [`implement::run_destroy_hooks`].
    pub(crate) fn run_destroy_hooks(&self) {
        let hooks = std::mem::take(&mut *self.inner.destroy_hooks.lock().unwrap_or_else(|p| p.into_inner()));
        for hook in hooks {
            hook(self);
        }
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.id() == other.id()
    }
}
impl Eq for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream").field("id", &self.id()).field("raw", &format_args!("{:#x}", self.raw())).finish()
    }
}

/// A device event: a marker recorded on a stream, complete once the stream has reached it.
/// Destroyed when dropped.
pub struct Event {
    backend: Box<dyn Any + Send + Sync>,
}

impl Event {
    /// See [`implement::new_event`].
    pub(crate) fn from_backend(backend: Box<dyn Any + Send + Sync>) -> Event {
        Event { backend }
    }

    /// See [`implement::event_backend`].
    pub(crate) fn backend<T: 'static>(&self) -> Option<&T> {
        self.backend.downcast_ref::<T>()
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Event")
    }
}

/// A host function run in stream order.
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// What the pool needs of a device, on its slow paths. Object-safe.
///
/// Every method may be called from any thread. Every method fails with
/// [`Error::NotPermitted`] when called from inside a host function running on a stream,
/// as CUDA's do.
pub trait Device: Send + Sync + fmt::Debug {
    /// Which implementation this is.
    fn kind(&self) -> DeviceKind;
    /// A human-readable name ("NVIDIA H200", "simulated device, 16 GiB").
    fn name(&self) -> String;
    /// Physical memory on the device, in bytes.
    fn total_memory(&self) -> u64;
    /// Free and total physical memory now.
    fn mem_info(&self) -> Result<MemInfo>;

    /// Create a stream owned by vrampool.
    fn create_stream(&self) -> Result<Stream>;
    /// Wrap a raw stream created elsewhere (PyTorch, cudarc). The wrapper gets a fresh
    /// [`StreamId`]; vrampool never destroys a wrapped stream.
    ///
    /// # Safety
    /// `raw` must be a live stream of this device's context (on CUDA, a `CUstream`; 0 is the
    /// legacy default stream), and it must outlive every use of the returned handle.
    unsafe fn wrap_stream(&self, raw: u64) -> Result<Stream>;
    /// Destroy a stream created by [`Device::create_stream`] once its work is done; its
    /// clones then fail with [`Error::StreamDestroyed`]. On a wrapped stream this only marks
    /// the handle destroyed.
    fn destroy_stream(&self, stream: &Stream) -> Result<()>;
    /// Block the calling thread until all work on `stream` is done.
    fn synchronize(&self, stream: &Stream) -> Result<()>;
    /// Whether `stream` is being captured into a graph.
    fn is_capturing(&self, stream: &Stream) -> Result<bool>;
    /// Block the calling thread until all work on the device is done, on every stream,
    /// also those the pool never saw (a CUDA graph's replays run on whatever stream the
    /// user launched them on).
    fn synchronize_device(&self) -> Result<()>;

    /// Create an event (no timing). An event never recorded is complete.
    fn create_event(&self) -> Result<Event>;
    /// Record `event` on `stream`, replacing any earlier record.
    fn record_event(&self, event: &Event, stream: &Stream) -> Result<()>;
    /// Whether the stream has reached the event's latest record.
    fn query_event(&self, event: &Event) -> Result<bool>;
    /// Block the calling thread until the event is complete.
    fn synchronize_event(&self, event: &Event) -> Result<()>;
    /// Make `stream` run nothing enqueued after this call until `event`'s latest record
    /// (as of this call) is complete.
    fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()>;

    /// Run `f` on a host thread once all earlier work on `stream` is done; later work on the
    /// stream waits for it. `f` must not call the device.
    fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()>;
    /// Copy `src` to device address `dst` in stream order; returns once the copy is done.
    fn copy_to_device(&self, dst: u64, src: &[u8], stream: &Stream) -> Result<()>;
    /// Copy from device address `src` into `dst` in stream order; returns once it is done.
    fn copy_from_device(&self, dst: &mut [u8], src: u64, stream: &Stream) -> Result<()>;
    /// Set `len` bytes at `dst` to `value`, in stream order (asynchronous).
    fn memset(&self, dst: u64, value: u8, len: usize, stream: &Stream) -> Result<()>;

    /// The page size of the address space: every map and unmap is a multiple of it.
    fn granularity(&self) -> usize;
    /// Reserve `bytes` of virtual address space (a multiple of the granularity); no physical
    /// memory is used until pages are mapped. Returns the base address.
    fn reserve(&self, bytes: u64) -> Result<u64>;
    /// Give back a range from [`Device::reserve`].
    ///
    /// # Safety
    /// No page under the range is mapped, and no work still uses addresses inside it.
    unsafe fn release(&self, base: u64, bytes: u64) -> Result<()>;
    /// Back `[addr, addr + bytes)` with physical memory, readable and writable by the device,
    /// as one allocation (one `cuMemCreate` on CUDA: a run of pages costs far less mapped in
    /// one call than page by page). Both are multiples of the granularity, inside a reserved
    /// range, and nothing under it is mapped.
    fn map(&self, addr: u64, bytes: usize) -> Result<()>;
    /// Map at `[to, to + bytes)` the physical memory mapped now at `[from, from + bytes)`,
    /// which stays mapped there too: the same memory at two addresses, with no new memory
    /// taken (`cuMemMap` of the allocation handle `cuMemRetainAllocationHandle` gives back).
    /// `[from, +bytes)` is exactly the range of one earlier [`Device::map`] or `alias` call;
    /// `to` is granularity-aligned inside a reservation with nothing mapped under it.
    /// Unmapping either range later leaves the other; the memory goes back to the device
    /// when its last mapping is unmapped. Devices that cannot say so
    /// ([`Device::can_alias`] false) refuse with [`Error::Unsupported`].
    fn alias(&self, from: u64, to: u64, bytes: usize) -> Result<()> {
        let _ = (from, to, bytes);
        Err(Error::Unsupported("this device cannot map memory at two addresses"))
    }
    /// Whether [`Device::alias`] works on this device.
    fn can_alias(&self) -> bool {
        false
    }
    /// Unmap exactly one range mapped by one [`Device::map`] or [`Device::alias`] call (as
    /// CUDA requires: not part of one, not two at once); its memory goes back to the device
    /// unless it is mapped elsewhere too.
    ///
    /// # Safety
    /// No work, queued or running, may still use the range; its contents are lost.
    unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<()>;

    /// Keep `stream` busy for `micros` µs of device time, in stream order (asynchronous):
    /// the work a kernel does, for benches and examples that need a device that lags behind
    /// the host. The default is a host function on a device timeline: each span starts when
    /// it was enqueued or when the thread's previous span ended, whichever is later, so queued
    /// spans add up exactly however the host thread is scheduled (see [`costs`]); on the
    /// simulator, whose streams each have their own worker, that is exactly a busy stream.
    /// `CudaDevice` runs a spin kernel instead.
    ///
    /// Fails with [`Error::InvalidArgument`] for more than [`MAX_SPIN_MICROS`].
    fn spin(&self, stream: &Stream, micros: u64) -> Result<()> {
        let span = std::time::Duration::from_nanos(spin_nanos(micros)?);
        let enqueued = std::time::Instant::now();
        self.launch_host_fn(stream, Box::new(move || costs::busy(enqueued, span)))
    }
}

/// The longest [`Device::spin`]: an hour.
pub const MAX_SPIN_MICROS: u64 = 3_600_000_000;

/// `micros` in nanoseconds, if it is a spin any device can run.
fn spin_nanos(micros: u64) -> Result<u64> {
    if micros > MAX_SPIN_MICROS {
        return Err(Error::InvalidArgument(format!("a spin of {micros} µs is longer than {MAX_SPIN_MICROS} µs")));
    }
    Ok(micros * 1000)
}

macro_rules! forward_device {
    ($($ty:ty),*) => {$(
        impl<D: Device + ?Sized> Device for $ty {
            fn kind(&self) -> DeviceKind { (**self).kind() }
            fn name(&self) -> String { (**self).name() }
            fn total_memory(&self) -> u64 { (**self).total_memory() }
            fn mem_info(&self) -> Result<MemInfo> { (**self).mem_info() }
            fn create_stream(&self) -> Result<Stream> { (**self).create_stream() }
            unsafe fn wrap_stream(&self, raw: u64) -> Result<Stream> {
                // SAFETY: the caller upholds wrap_stream's contract, which is forwarded unchanged.
                unsafe { (**self).wrap_stream(raw) }
            }
            fn destroy_stream(&self, stream: &Stream) -> Result<()> { (**self).destroy_stream(stream) }
            fn synchronize(&self, stream: &Stream) -> Result<()> { (**self).synchronize(stream) }
            fn is_capturing(&self, stream: &Stream) -> Result<bool> { (**self).is_capturing(stream) }
            fn synchronize_device(&self) -> Result<()> { (**self).synchronize_device() }
            fn create_event(&self) -> Result<Event> { (**self).create_event() }
            fn record_event(&self, event: &Event, stream: &Stream) -> Result<()> { (**self).record_event(event, stream) }
            fn query_event(&self, event: &Event) -> Result<bool> { (**self).query_event(event) }
            fn synchronize_event(&self, event: &Event) -> Result<()> { (**self).synchronize_event(event) }
            fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()> { (**self).stream_wait_event(stream, event) }
            fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()> { (**self).launch_host_fn(stream, f) }
            fn copy_to_device(&self, dst: u64, src: &[u8], stream: &Stream) -> Result<()> { (**self).copy_to_device(dst, src, stream) }
            fn copy_from_device(&self, dst: &mut [u8], src: u64, stream: &Stream) -> Result<()> { (**self).copy_from_device(dst, src, stream) }
            fn memset(&self, dst: u64, value: u8, len: usize, stream: &Stream) -> Result<()> { (**self).memset(dst, value, len, stream) }
            fn granularity(&self) -> usize { (**self).granularity() }
            fn reserve(&self, bytes: u64) -> Result<u64> { (**self).reserve(bytes) }
            unsafe fn release(&self, base: u64, bytes: u64) -> Result<()> {
                // SAFETY: the caller upholds release's contract, which is forwarded unchanged.
                unsafe { (**self).release(base, bytes) }
            }
            fn map(&self, addr: u64, bytes: usize) -> Result<()> { (**self).map(addr, bytes) }
            fn alias(&self, from: u64, to: u64, bytes: usize) -> Result<()> { (**self).alias(from, to, bytes) }
            fn can_alias(&self) -> bool { (**self).can_alias() }
            unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<()> {
                // SAFETY: the caller upholds unmap's contract, which is forwarded unchanged.
                unsafe { (**self).unmap(addr, bytes) }
            }
            fn spin(&self, stream: &Stream, micros: u64) -> Result<()> { (**self).spin(stream, micros) }
        }
    )*};
}
forward_device!(Arc<D>, Box<D>);

/// The device to use on this machine: the first CUDA GPU when a driver and a GPU are
/// present (feature `cuda`), else a simulated device of `sim_capacity` bytes. The second
/// value says why the choice was made, for the log.
pub fn auto(sim_capacity: u64) -> (Arc<dyn Device>, String) {
    #[cfg(feature = "cuda")]
    match CudaDevice::new(0) {
        Ok(dev) => {
            let why = format!("CUDA device 0: {}", dev.name());
            (Arc::new(dev), why)
        }
        Err(e) => {
            let sim = SimDevice::new(sim_capacity);
            (Arc::new(sim), format!("simulated device ({} GiB): no CUDA GPU ({e})", sim_capacity >> 30))
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let sim = SimDevice::new(sim_capacity);
        (Arc::new(sim), format!("simulated device ({} GiB): built without the `cuda` feature", sim_capacity >> 30))
    }
}

std::thread_local! {
    /// Set while this thread runs a host function launched through a device of this crate.
    static IN_HOST_FN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is running a host function launched through a device of this
/// crate: no device call may be made there, and the pool keeps its frees off the device.
pub fn in_host_fn() -> bool {
    IN_HOST_FN.try_with(std::cell::Cell::get).unwrap_or(false)
}

/// Mark the calling thread as running (or no longer running) a host function.
pub(crate) fn set_in_host_fn(running: bool) {
    let _ = IN_HOST_FN.try_with(|c| c.set(running));
}

/// The error every device method returns when called from inside a host function.
pub(crate) fn in_host_fn_error() -> Error {
    Error::NotPermitted("device call from inside a host function running on a stream")
}
