//! `CudaDevice`: a CUDA GPU through the driver API (cudarc's raw `sys` bindings, loaded at
//! run time), on the device's primary context.
//!
//! The device and its driver calls are here; submodules own the rest, each with its reasons:
//! `loader` (finding the driver without panicking, naming its errors), `handles` (what a
//! stream and an event hold, how they are destroyed or parked, and the trampoline that runs
//! host functions), `capture` (the capture checks that the registry and the C ABI share),
//! `spin` and `cudarc_interop`.
//!
//! Choices, and why:
//!
//! - **The primary context**, retained for as long as any clone, stream or event of the device
//!   lives, so vrampool shares memory and streams with PyTorch or any runtime-API code. It is
//!   bound before every driver call, because a block may be dropped on any thread: the current
//!   context is read back from the driver (`cuCtxGetCurrent`, a thread-local read inside the
//!   driver) rather than cached on our side, so code that switches contexts behind our back
//!   (another device, a library's own context) cannot leave us calling into the wrong one.
//! - **Capture**: operations that need the stream's work to run (synchronize, event record and
//!   wait, host functions, copies, memset) check `cuStreamIsCapturing` first and fail with
//!   [`Error::StreamCapturing`], as the simulator does. Otherwise some of them would be
//!   recorded into the user's graph and others would invalidate the user's capture.
//! - **Other threads' captures**: every device method runs its driver calls with the calling
//!   thread in the RELAXED capture mode (`capture::RelaxedCapture`, set back when the call
//!   returns), and so do the destruction of a stream or event and the device's own drop. In
//!   the GLOBAL mode, PyTorch's default and CUDA's, the driver refuses the calls it counts
//!   unsafe (event and stream queries among them, measured: see `capture`) on *every* thread
//!   while any thread captures, and the refusal invalidates that capture. The pool queries
//!   events and maps pages on its slow paths whenever a thread needs memory, and in Rust
//!   nothing tells it that another thread began a capture (the C ABI is told, and relaxes
//!   only then), so it relaxes always: two thread-local driver calls beside calls that cost
//!   microseconds. None of these calls touches a capturing stream (the checks above), so
//!   relaxing them cannot corrupt a graph.
//! - **Virtual memory**: every [`Device::map`] call is one physical allocation
//!   (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`) of the range it is given: one page by
//!   default, a run of pages with `PoolConfig::map_run_pages`. An allocation per page costs no
//!   less: `cuMemSetAccess` and `cuMemUnmap` cost per allocation they cover, in one call or
//!   many (`benches/vmm_probe.c`, `docs/BENCHMARKS.md`), so only a larger allocation makes a
//!   run cheap, at the price of being unmapped and lent only whole. The allocation handle is
//!   released right after mapping (the mapping keeps the memory alive and unmapping frees
//!   it), so no handle table is kept.
//! - **Events are reused.** An event whose last handle drops goes to a lock-free list of
//!   spares (at most `SPARE_EVENTS`) and the next [`Device::create_event`] takes one from it
//!   instead of calling `cuEventCreate`; only events beyond the list are destroyed.
//!   Recording an event again is allowed at any time, a wait enqueued earlier keeps the
//!   record it saw, and an event is spare only once nobody holds it, so nothing can observe
//!   the reuse. Why: with many threads busy on the device, `cuEventCreate` took milliseconds
//!   where `cuEventRecord` took microseconds (`docs/BENCHMARKS.md`, ninth session), and the
//!   pool records an event for batches of frees; PyTorch's caching allocator pools its
//!   events too. The list starts stocked (`STOCKED_EVENTS`, made when the device opens and
//!   nothing else runs), since a busy server's first bursts would otherwise create them at
//!   the dearest moment; [`CudaDevice::events_created`] counts the creations. A drop then
//!   needs no driver call, so inside a host function a spare is kept rather than parked.
//! - **Spin**: [`Device::spin`] launches a one-thread kernel that reads `%globaltimer` until
//!   the time has passed (module `spin`), compiled once per device on first use.
//! - **cudarc**: streams made from cudarc's `Arc<CudaStream>` and the device of a cudarc
//!   context live in the submodule `cudarc_interop` (see its docs); a handle made there holds
//!   the cudarc `Arc`, which is this module's only tie to cudarc's safe API.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys;
use sys::CUresult;

use super::{implement, in_host_fn_error, Device, DeviceKind, Event, HostFn, MemInfo, Stream};
use crate::error::{Error, Result};

use super::in_host_fn;

mod capture;
mod cudarc_interop;
mod handles;
mod loader;
mod spin;
pub(crate) use capture::{raw_is_capturing, RelaxedCapture};
pub(crate) use cudarc_interop::{cudarc_driver_error, wrapped_stream};
use handles::{host_trampoline, CudaEvent, CudaStream, HostCall, Parked};
pub use loader::missing_symbols;
use loader::{check, describe, driver_error, driver_present};
use spin::SpinKernel;

/// Most events kept for reuse per device (see the module docs); beyond it a dropped event is
/// destroyed. At least the most a busy server holds at once, or every event past the list is
/// destroyed at its drop and created again at the next burst: with 1,024 spares, 16 demo
/// workers on an H100 created 4,200–4,700 events in 15 s, and those creations and
/// destructions were most of the time their frees took (81–91 s of the workers' 243;
/// `docs/BENCHMARKS.md`, fourteenth session).
const SPARE_EVENTS: usize = 16384;

/// Events created when the device opens, before any thread is busy on it, so that the first
/// bursts of batches and `record_stream` frees find spares instead of calling
/// `cuEventCreate` while other threads hold the driver (module docs). The 16-worker demo
/// holds about 5,000 at its busiest; with 8,192 stocked it created none, and its workers'
/// time freeing fell from 81–91 s to 0.2 s.
const STOCKED_EVENTS: usize = 8192;

/// A CUDA GPU, on its primary context. Cheap to clone: clones are the same device.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<CudaInner>,
}

/// Raw driver handles are kept as integers: they are plain tokens to us, and integers are
/// `Send + Sync` without claims we would have to argue for.
struct CudaInner {
    ordinal: usize,
    device: sys::CUdevice,
    /// The retained primary context (`CUcontext`).
    ctx: usize,
    name: String,
    total: u64,
    granularity: usize,
    /// Streams and events whose last handle was dropped inside a host function.
    parked: Mutex<Vec<Parked>>,
    any_parked: AtomicBool,
    host_fn_panics: AtomicU64,
    /// `cuEventCreate` calls made, the stock included.
    events_created: AtomicU64,
    /// The spin kernel, loaded on the first [`Device::spin`] (or why it could not be).
    spin: OnceLock<Result<SpinKernel>>,
    /// Events of this context nobody holds, for reuse (`CUevent` handles).
    spare_events: crossbeam_queue::ArrayQueue<usize>,
}

/// What [`CudaInner::enter`] hands back: the calling thread's capture mode, RELAXED until it
/// drops (`None` where the driver would not exchange it).
type CallScope = Option<RelaxedCapture>;

/// Locks here guard plain lists and are never held across user code; a poisoned one only
/// means a panic elsewhere, and the list is still good.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl CudaInner {
    fn ctx(&self) -> sys::CUcontext {
        self.ctx as sys::CUcontext
    }

    /// Make our context current on this thread.
    fn bind(&self) -> Result<()> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes the calling thread's current context into `cur`.
        let rc = unsafe { sys::cuCtxGetCurrent(&mut cur) };
        if rc == CUresult::CUDA_SUCCESS && cur == self.ctx() {
            return Ok(());
        }
        // SAFETY: ctx is our retained primary context, alive as long as self.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx()) })
    }

    /// The prologue of every device method: refuse inside host functions, put the thread in
    /// the relaxed capture mode for the call (see the module docs), destroy what was parked,
    /// bind the context. The call's driver calls come before the returned scope drops.
    fn enter(&self) -> Result<CallScope> {
        if in_host_fn() {
            return Err(in_host_fn_error());
        }
        let relaxed = RelaxedCapture::enter();
        self.bind()?;
        // Acquire: pairs with the Release store in `park`, so the list holds the entry.
        if self.any_parked.load(Ordering::Acquire) {
            self.destroy_parked();
        }
        Ok(relaxed)
    }

    fn park(&self, what: Parked) {
        lock(&self.parked).push(what);
        self.any_parked.store(true, Ordering::Release);
    }

    /// Destroy parked streams and events; the context must be current.
    fn destroy_parked(&self) {
        let parked = {
            let mut list = lock(&self.parked);
            self.any_parked.store(false, Ordering::Release);
            std::mem::take(&mut *list)
        };
        for p in parked {
            // Failures are ignored: there is no caller to tell, and the handle is gone either way.
            // SAFETY: each handle was created on this context and its last user dropped it.
            unsafe {
                match p {
                    Parked::Stream(s) => {
                        let _ = sys::cuStreamDestroy_v2(s as sys::CUstream);
                    }
                    Parked::Event(e) => {
                        let _ = sys::cuEventDestroy_v2(e as sys::CUevent);
                    }
                    Parked::Cudarc(s) => drop(s),
                }
            }
        }
    }

    /// Destroy a stream or an event now, or park it when on a host-function thread.
    fn dispose(&self, what: Parked) {
        if in_host_fn() {
            self.park(what);
            return;
        }
        let _relaxed = RelaxedCapture::enter();
        if self.bind().is_err() {
            self.park(what);
            return;
        }
        // SAFETY: as in destroy_parked; the context was bound just now.
        unsafe {
            match what {
                Parked::Stream(s) => {
                    let _ = sys::cuStreamDestroy_v2(s as sys::CUstream);
                }
                Parked::Event(e) => {
                    let _ = sys::cuEventDestroy_v2(e as sys::CUevent);
                }
                Parked::Cudarc(s) => drop(s),
            }
        }
    }

    fn stream<'a>(&self, s: &'a Stream) -> Result<&'a CudaStream> {
        let h = implement::stream_backend::<CudaStream>(s)
            .ok_or_else(|| Error::InvalidArgument("stream is not a CUDA stream".into()))?;
        // Compared by context, not by `CudaInner`: two `CudaDevice::new(n)` share one.
        if h.device.ctx != self.ctx {
            return Err(Error::InvalidArgument("stream belongs to another CUDA device".into()));
        }
        if s.is_destroyed() {
            return Err(Error::StreamDestroyed);
        }
        Ok(h)
    }

    fn event<'a>(&self, e: &'a Event) -> Result<&'a CudaEvent> {
        let h = implement::event_backend::<CudaEvent>(e)
            .ok_or_else(|| Error::InvalidArgument("event is not a CUDA event".into()))?;
        if h.device.ctx != self.ctx {
            return Err(Error::InvalidArgument("event belongs to another CUDA device".into()));
        }
        Ok(h)
    }

    fn capturing(&self, h: &CudaStream) -> Result<bool> {
        // The stream is live (the caller checked) and of our context, which is bound.
        raw_is_capturing(h.raw() as u64)
    }

    /// The checks shared by every operation that needs the stream's work to run, and the
    /// scope of [`CudaInner::enter`] to hold until the operation's driver calls are done.
    fn running<'a>(&self, s: &'a Stream) -> Result<(&'a CudaStream, CallScope)> {
        let scope = self.enter()?;
        let h = self.stream(s)?;
        if self.capturing(h)? {
            return Err(Error::StreamCapturing);
        }
        Ok((h, scope))
    }

    fn aligned(&self, what: &str, addr: u64, bytes: u64) -> Result<()> {
        let g = self.granularity as u64;
        if bytes == 0 || addr % g != 0 || bytes % g != 0 || addr.checked_add(bytes).is_none() {
            return Err(Error::InvalidArgument(format!(
                "{what} [{addr:#x}, +{bytes}) is not a non-empty range aligned to the granularity ({g} B)"
            )));
        }
        Ok(())
    }

    /// A new event of our context, which must be current (`bind`/`enter` done).
    fn new_event(&self) -> Result<usize> {
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: writes a new event handle of the current (our) context.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        self.events_created.fetch_add(1, Ordering::Relaxed);
        Ok(raw as usize)
    }

    /// What every physical allocation of this device is made with.
    fn alloc_prop(&self) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }
}

impl Drop for CudaInner {
    fn drop(&mut self) {
        // Inside a host function the driver must not be called: the context stays retained
        // (a leak of one reference, at worst until the process ends).
        if in_host_fn() {
            return;
        }
        let _relaxed = RelaxedCapture::enter();
        if self.bind().is_ok() {
            self.destroy_parked();
            while let Some(e) = self.spare_events.pop() {
                // SAFETY: a spare event of our context, which is current; nobody holds it.
                let _ = unsafe { sys::cuEventDestroy_v2(e as sys::CUevent) };
            }
            if let Some(Ok(kernel)) = self.spin.get() {
                // A wrapped stream (another runtime's) may still run a spin launched through
                // us: unload the module only once the context's work is done.
                // SAFETY: our context is current; synchronizing has no other precondition.
                let _ = unsafe { sys::cuCtxSynchronize() };
                kernel.unload();
            }
        }
        // SAFETY: releases the one reference `new` retained; every stream and event of this
        // device held an `Arc` of us, so none is left to use the context through us.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

impl CudaDevice {
    /// Open GPU `ordinal` on its primary context. Fails with [`Error::NoDevice`] when there is
    /// no driver, no such GPU, or the driver refuses to start; never panics.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        if in_host_fn() {
            return Err(in_host_fn_error());
        }
        driver_present().map_err(Error::NoDevice)?;
        let no_device = |call: &str, rc: CUresult| Error::NoDevice(format!("{call} failed: {}", describe(rc)));
        // SAFETY: cuInit has no preconditions and may be called any number of times.
        let rc = unsafe { sys::cuInit(0) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(no_device("cuInit", rc));
        }
        let ord = i32::try_from(ordinal).map_err(|_| Error::NoDevice(format!("no CUDA device {ordinal}")))?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: writes the device handle for `ord`; the driver rejects a bad ordinal.
        let rc = unsafe { sys::cuDeviceGet(&mut device, ord) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(no_device("cuDeviceGet", rc));
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: retains the device's primary context, released in CudaInner's Drop.
        let rc = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(no_device("cuDevicePrimaryCtxRetain", rc));
        }
        // From here on the retain is owned by `inner`; its Drop releases it on any failure.
        let mut inner = CudaInner {
            ordinal,
            device,
            ctx: ctx as usize,
            name: String::new(),
            total: 0,
            granularity: 0,
            parked: Mutex::new(Vec::new()),
            any_parked: AtomicBool::new(false),
            host_fn_panics: AtomicU64::new(0),
            events_created: AtomicU64::new(0),
            spin: OnceLock::new(),
            spare_events: crossbeam_queue::ArrayQueue::new(SPARE_EVENTS),
        };
        inner.bind()?;

        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `name`.
        check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, device) })?;
        // SAFETY: the buffer is zeroed past the name and its last byte is never written
        // beyond `len`, so a NUL lies inside it.
        inner.name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();

        let mut total = 0usize;
        // SAFETY: writes the device's memory size.
        check("cuDeviceTotalMem", unsafe { sys::cuDeviceTotalMem_v2(&mut total, device) })?;
        inner.total = total as u64;

        let prop = inner.alloc_prop();
        let mut granularity = 0usize;
        // SAFETY: `prop` is a fully initialised property block; the driver writes one usize.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(Error::NoDevice(format!(
                "device {ordinal} reports a virtual-memory granularity of {granularity} B; \
                 virtual memory management is needed"
            )));
        }
        inner.granularity = granularity;
        for _ in 0..STOCKED_EVENTS {
            let raw = inner.new_event()?;
            // The queue holds SPARE_EVENTS > STOCKED_EVENTS, so the push cannot fail; were it
            // to, the event would leak rather than be destroyed twice.
            let _ = inner.spare_events.push(raw);
        }
        Ok(CudaDevice { inner: Arc::new(inner) })
    }

    /// The device's ordinal, as given to [`CudaDevice::new`].
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The primary context (`CUcontext`) as an integer, for FFI.
    pub fn context_raw(&self) -> u64 {
        self.inner.ctx as u64
    }

    /// The driver's device handle (`CUdevice`).
    pub fn device_raw(&self) -> i32 {
        self.inner.device
    }

    /// Make this device's primary context current on the calling thread, for code that then
    /// calls the driver itself (kernel launches in tests, FFI).
    pub fn bind_context(&self) -> Result<()> {
        self.inner.enter().map(drop)
    }

    /// How many host functions panicked (the panic was caught; the stream carried on).
    pub fn host_fn_panics(&self) -> u64 {
        self.inner.host_fn_panics.load(Ordering::Acquire)
    }

    /// How many events this device has created with `cuEventCreate` over its life, the stock
    /// made when it opened included; events handed out again from the spares are not counted.
    pub fn events_created(&self) -> u64 {
        self.inner.events_created.load(Ordering::Relaxed)
    }

    /// Where the spin kernel came from ("NVRTC" or "hand-written PTX"), once a
    /// [`Device::spin`] has loaded it.
    pub fn spin_kernel_source(&self) -> Option<&'static str> {
        self.inner.spin.get().and_then(|k| k.as_ref().ok()).map(|k| k.source)
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("total", &self.inner.total)
            .field("granularity", &self.inner.granularity)
            .field("context", &format_args!("{:#x}", self.inner.ctx))
            .finish()
    }
}

impl CudaDevice {
    /// Map the allocation `handle` (one reference to it, which this call gives up) at
    /// `[addr, addr + bytes)` and grant read-write access there; the mapping keeps the memory
    /// alive. Nothing is left mapped if access cannot be granted.
    ///
    /// # Safety
    /// `handle` is a live allocation handle of exactly `bytes` that the caller owns one
    /// reference to, and `[addr, addr + bytes)` lies in this device's reservation with
    /// nothing mapped there (the driver rejects it otherwise).
    unsafe fn map_handle(&self, addr: u64, bytes: usize, handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
        // SAFETY: as the caller promises.
        let rc = unsafe { sys::cuMemMap(addr, bytes, 0, handle, 0) };
        // The mapping, if made, keeps the memory alive; unmapping it will free it.
        // SAFETY: the caller's reference to `handle`, released once.
        let released = unsafe { sys::cuMemRelease(handle) };
        check("cuMemMap", rc)?;
        check("cuMemRelease", released)?;
        let access = sys::CUmemAccessDesc {
            location: self.inner.alloc_prop().location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range was mapped just above.
        let granted = check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(addr, bytes, &access, 1) });
        if granted.is_err() {
            // SAFETY: mapped just above and never handed out: nothing can use it.
            let _ = check("cuMemUnmap", unsafe { sys::cuMemUnmap(addr, bytes) });
        }
        granted
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn name(&self) -> String {
        self.inner.name.clone()
    }

    fn total_memory(&self) -> u64 {
        self.inner.total
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let _scope = self.inner.enter()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes for the current (our) context.
        check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok(MemInfo { free: free as u64, total: total as u64 })
    }

    fn create_stream(&self) -> Result<Stream> {
        let _scope = self.inner.enter()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: writes a new stream handle of the current (our) context.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, flags) })?;
        let backend = CudaStream {
            raw: raw as usize,
            owned_live: AtomicBool::new(true),
            owned: true,
            device: self.inner.clone(),
            cudarc: None,
        };
        Ok(implement::new_stream(raw as u64, Box::new(backend)))
    }

    unsafe fn wrap_stream(&self, raw: u64) -> Result<Stream> {
        let _scope = self.inner.enter()?;
        let raw = usize::try_from(raw).map_err(|_| Error::InvalidArgument(format!("{raw:#x} is not a stream")))?;
        let backend = CudaStream {
            raw,
            owned_live: AtomicBool::new(false),
            owned: false,
            device: self.inner.clone(),
            cudarc: None,
        };
        Ok(implement::new_stream(raw as u64, Box::new(backend)))
    }

    fn destroy_stream(&self, stream: &Stream) -> Result<()> {
        let _scope = self.inner.enter()?;
        let h = self.inner.stream(stream)?;
        // Before the stream goes: the pool records its final events here.
        implement::run_destroy_hooks(stream);
        // Both flags are swapped so that a second destroy, or the drop of the last handle,
        // finds the stream gone; only the owner of a live owned stream calls the driver.
        let first = implement::mark_destroyed(stream);
        if first && h.owned && h.take_ownership() {
            // As documented for cuStreamDestroy: returns at once, queued work still runs.
            // SAFETY: the stream is ours, live, and no handle will name it to the driver again.
            check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(h.raw()) })?;
        }
        Ok(())
    }

    fn synchronize(&self, stream: &Stream) -> Result<()> {
        let (h, _scope) = self.inner.running(stream)?;
        // SAFETY: a live stream of our context, which is bound.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(h.raw()) })
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        let _scope = self.inner.enter()?;
        let h = self.inner.stream(stream)?;
        self.inner.capturing(h)
    }

    fn synchronize_device(&self) -> Result<()> {
        let _scope = self.inner.enter()?;
        // SAFETY: our context is bound to this thread; the call takes no pointers.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn create_event(&self) -> Result<Event> {
        let _scope = self.inner.enter()?;
        let raw = match self.inner.spare_events.pop() {
            Some(raw) => raw,
            None => self.inner.new_event()?,
        };
        Ok(implement::new_event(Box::new(CudaEvent { raw, device: self.inner.clone() })))
    }

    fn record_event(&self, event: &Event, stream: &Stream) -> Result<()> {
        let (h, _scope) = self.inner.running(stream)?;
        let e = self.inner.event(event)?;
        // SAFETY: a live event and a live stream of our context, which is bound.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e.raw(), h.raw()) })
    }

    fn query_event(&self, event: &Event) -> Result<bool> {
        let _scope = self.inner.enter()?;
        let e = self.inner.event(event)?;
        // SAFETY: a live event of our context, which is bound.
        match unsafe { sys::cuEventQuery(e.raw()) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(driver_error("cuEventQuery", rc)),
        }
    }

    fn synchronize_event(&self, event: &Event) -> Result<()> {
        let _scope = self.inner.enter()?;
        let e = self.inner.event(event)?;
        // SAFETY: a live event of our context, which is bound.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e.raw()) })
    }

    fn stream_wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        let (h, _scope) = self.inner.running(stream)?;
        let e = self.inner.event(event)?;
        // SAFETY: a live event and a live stream of our context, which is bound.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(h.raw(), e.raw(), 0) })
    }

    fn launch_host_fn(&self, stream: &Stream, f: HostFn) -> Result<()> {
        let (h, _scope) = self.inner.running(stream)?;
        // Boxed again because a `Box<dyn FnOnce>` is a fat pointer and the driver carries one
        // thin `void *`.
        let call = Box::into_raw(Box::new(HostCall { f, device: Arc::downgrade(&self.inner) }));
        // SAFETY: a live stream of our context, which is bound; on success the driver calls the
        // trampoline exactly once with `call`, which then owns it.
        let rc = unsafe { sys::cuLaunchHostFunc(h.raw(), Some(host_trampoline), call.cast()) };
        if rc != CUresult::CUDA_SUCCESS {
            // SAFETY: the launch failed, so the driver will never call the trampoline and
            // `call` is still ours, from Box::into_raw just above.
            drop(unsafe { Box::from_raw(call) });
            return Err(driver_error("cuLaunchHostFunc", rc));
        }
        Ok(())
    }

    fn copy_to_device(&self, dst: u64, src: &[u8], stream: &Stream) -> Result<()> {
        let (h, _scope) = self.inner.running(stream)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is valid for its length until we return, and we return only after the
        // stream (and so the copy) is done; the driver checks `dst` and faults the stream,
        // not the host, if it is bad.
        check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), h.raw()) })?;
        // SAFETY: as above.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(h.raw()) })
    }

    fn copy_from_device(&self, dst: &mut [u8], src: u64, stream: &Stream) -> Result<()> {
        let (h, _scope) = self.inner.running(stream)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is valid and exclusively ours until we return, and we return only
        // after the stream (and so the copy) is done.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), h.raw())
        })?;
        // SAFETY: as above.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(h.raw()) })
    }

    fn memset(&self, dst: u64, value: u8, len: usize, stream: &Stream) -> Result<()> {
        let (h, _scope) = self.inner.running(stream)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: device memory only; the driver checks the range and faults the stream, not
        // the host, if it is bad.
        check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(dst, value, len, h.raw()) })
    }

    fn granularity(&self) -> usize {
        self.inner.granularity
    }

    fn reserve(&self, bytes: u64) -> Result<u64> {
        let _scope = self.inner.enter()?;
        self.inner.aligned("reserve", 0, bytes)?;
        let size = usize::try_from(bytes).map_err(|_| Error::InvalidArgument("reserve size too large".into()))?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: asks for fresh address space anywhere (addr 0); no memory is touched.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, self.inner.granularity, 0, 0)
        })?;
        Ok(base)
    }

    unsafe fn release(&self, base: u64, bytes: u64) -> Result<()> {
        let _scope = self.inner.enter()?;
        self.inner.aligned("release", base, bytes)?;
        // SAFETY: the caller guarantees nothing is mapped under the range or uses it; the
        // driver rejects a range that is not one reservation.
        check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(base, bytes as usize) })
    }

    fn map(&self, addr: u64, bytes: usize) -> Result<()> {
        let _scope = self.inner.enter()?;
        self.inner.aligned("map", addr, bytes as u64)?;
        let prop = self.inner.alloc_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `prop` is a fully initialised property block; the driver writes a handle.
        check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) })?;
        // SAFETY: the handle was just created, of exactly `bytes`; the range is the caller's,
        // in its reservation.
        unsafe { self.map_handle(addr, bytes, handle) }
    }

    fn alias(&self, from: u64, to: u64, bytes: usize) -> Result<()> {
        let _scope = self.inner.enter()?;
        self.inner.aligned("alias", to, bytes as u64)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: asks the driver for the handle of the allocation mapped at `from` (it fails
        // for an address that maps none); writes only `handle`.
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&mut handle, from as *mut c_void)
        })?;
        // SAFETY: the handle was retained above; it is of `bytes` because the caller names
        // exactly one earlier map's range, whose allocation is that size; `to` is the
        // caller's, in its reservation.
        unsafe { self.map_handle(to, bytes, handle) }
    }

    fn can_alias(&self) -> bool {
        true
    }

    unsafe fn unmap(&self, addr: u64, bytes: usize) -> Result<()> {
        let _scope = self.inner.enter()?;
        self.inner.aligned("unmap", addr, bytes as u64)?;
        // SAFETY: the caller guarantees nothing uses the range and that it is exactly one
        // mapping (the driver rejects anything else); unmapping frees the memory, whose handle
        // was released when it was mapped.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(addr, bytes) })
    }

    fn spin(&self, stream: &Stream, micros: u64) -> Result<()> {
        let ns = super::spin_nanos(micros)?;
        let (h, _scope) = self.inner.running(stream)?;
        // Loaded under the context `running` just bound.
        let kernel = self.inner.spin.get_or_init(SpinKernel::load).as_ref().map_err(Clone::clone)?;
        kernel.launch(h.raw(), ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_a_device_never_panics() {
        match CudaDevice::new(0) {
            Ok(dev) => {
                assert_eq!(dev.kind(), DeviceKind::Cuda);
                assert!(dev.granularity().is_power_of_two());
                assert!(dev.total_memory() > 0);
            }
            Err(e) => assert!(matches!(e, Error::NoDevice(_)), "expected NoDevice, got {e:?}"),
        }
    }

    #[test]
    fn a_missing_ordinal_is_no_device() {
        let r = CudaDevice::new(1 << 20);
        assert!(matches!(r, Err(Error::NoDevice(_))), "got {r:?}");
    }

    #[test]
    fn auto_falls_back_to_the_simulator_without_a_gpu() {
        let (dev, why) = super::super::auto(1 << 30);
        match CudaDevice::new(0) {
            Ok(_) => assert_eq!(dev.kind(), DeviceKind::Cuda, "{why}"),
            Err(_) => {
                assert_eq!(dev.kind(), DeviceKind::Simulated, "{why}");
                assert!(why.contains("no CUDA GPU"), "{why}");
            }
        }
    }

    #[test]
    fn streams_of_the_simulator_are_refused() {
        let Ok(dev) = CudaDevice::new(0) else { return };
        let sim = crate::device::SimDevice::new(1 << 30);
        let s = sim.create_stream().unwrap();
        assert!(matches!(dev.synchronize(&s), Err(Error::InvalidArgument(_))));
    }
}
