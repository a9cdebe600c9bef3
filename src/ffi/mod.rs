//! The C ABI, with PyTorch's pluggable-allocator signatures: `libvrampool.so` and
//! `include/vrampool.h`.
//!
//! ```c
//! void*  vrampool_malloc(ssize_t size, int device, void* stream);   /* PyTorch's alloc_fn */
//! void   vrampool_free(void* ptr, ssize_t size, int device, void* stream); /* free_fn */
//! int    vrampool_free_any(void* ptr, size_t* size, int* device, void** stream); /* by address */
//! int    vrampool_record_stream(void* ptr, void* stream);           /* 0, or an error code */
//! int    vrampool_empty_cache(void);                                /* trim every pool */
//! size_t vrampool_stats_json(int device, char* buf, size_t len);    /* bytes needed */
//! int    vrampool_snapshot(int device, vrampool_extent* out, size_t cap, size_t* count);
//! const char* vrampool_last_error(void);   /* this thread's last error, then cleared */
//! ```
//!
//! **What it owns.** The C side of the [`crate::registry`]'s pools: per device a
//! live-block table (the `live` module: from a block's address to what its free needs, in
//! O(1), without a lock), the calling thread's memo of its last device and stream, and the
//! queue of frees made on other threads than the allocating one (`ffi::foreign`), and the
//! CUDA graph pools (`ffi::graph`: `vrampool_begin_allocate_to_pool`,
//! `vrampool_malloc_to_pool`, `vrampool_end_allocate_to_pool`, `vrampool_release_pool`,
//! PyTorch's private pools). This file holds the entry points themselves (cbindgen reads
//! it and `ffi::status` for the header), their panic guard and the capture mode they run
//! in; the allocation, free and record-stream paths behind them are `ffi::blocks`. Pools,
//! their configuration (environment variables, see [`crate::registry::VARIABLES`]) and
//! streams are the registry's.
//!
//! **Streams.** A stream handle is a `cudaStream_t` on CUDA (keyed by the driver's stream
//! id, never by the handle's value, which the driver reuses) and an opaque value on the
//! simulator (NULL the default stream, any other value a stream made the first time it is
//! seen). A block is freed on the stream it was allocated on; the free's `stream` argument
//! must be the handle the allocation was given (PyTorch passes it), and is checked.
//!
//! **Invariants.** Every entry point catches panics: nothing unwinds into C. A refused call
//! changes nothing, counts the refusal (`abi_*` in the statistics JSON) and sets the
//! calling thread's last error; a successful call leaves the last error alone. Every block
//! is given back to the pool at most once, whatever pointers, sizes and streams the caller
//! passes and from however many threads (the live table's invariant 4).
//!
//! # Safety
//! The entry points are `unsafe`: on CUDA a stream handle must be a live stream of the
//! device's primary context, `vrampool_stats_json` writes `len` bytes at `buf`, and a
//! pointer freed must not be used by work enqueued after the free on streams other than
//! its own (and those given to `vrampool_record_stream`). Bad pointers, sizes and stream
//! values that name no stream are refused, never followed.

mod blocks;
mod device;
mod foreign;
mod graph;
mod memo;
mod snapshot;
mod stats;
mod status;
mod words;

pub use stats::Report;
pub use status::{vrampool_status, AbiCounters};

use std::any::Any;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use libc::{size_t, ssize_t};

use crate::registry;
use crate::Error;
use blocks::{free, malloc, record_stream};
use status::{AbiError, Counter};
use words::Ext;

/// The version of the ABI this header describes: bumped when a signature or a status code
/// changes meaning.
pub const VRAMPOOL_ABI_VERSION: u32 = 1;

/// Allocate `size` bytes on device `device` for use on `stream` (PyTorch's `alloc_fn`).
/// Returns a 256-byte-aligned device pointer, or NULL: for `size == 0` without an error (as
/// PyTorch gives empty tensors), else with the error set (`vrampool_last_error`).
///
/// # Safety
/// On CUDA, `stream` is NULL or a live stream of the device's primary context.
#[no_mangle]
pub unsafe extern "C" fn vrampool_malloc(size: ssize_t, device: c_int, stream: *mut c_void) -> *mut c_void {
    guarded("vrampool_malloc", std::ptr::null_mut(), || malloc(size, device, stream as u64))
}

/// Free `ptr`, allocated by `vrampool_malloc(size, device, stream)` with these same
/// arguments (PyTorch's `free_fn`), in stream order on its stream. Any thread may free.
/// NULL is ignored. A pointer that is no live block's start (foreign, interior, already
/// freed) or a wrong size or stream is refused: nothing is freed, the error is counted and
/// set.
///
/// # Safety
/// No work enqueued after this call on other streams than the block's (and those given to
/// `vrampool_record_stream`) may use the memory.
#[no_mangle]
pub unsafe extern "C" fn vrampool_free(ptr: *mut c_void, size: ssize_t, device: c_int, stream: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    guarded("vrampool_free", (), || free(ptr as u64, size, device, stream as u64))
}

/// Free the block at `ptr` as it was allocated, given its address alone: its size, device
/// and stream are the ones it was allocated with (looked up in the pool, on whichever
/// device or graph pool holds it), and are written to `size`, `device` and `stream` where
/// those are not NULL. For wrappers that would otherwise keep their own table of every live
/// block to call `vrampool_free` with (PyTorch's `CUDAPluggableAllocator` keeps one, under
/// a process-wide mutex). As `vrampool_free` otherwise, but a refusal is returned too: 0,
/// or a `vrampool_status` with the error set (`VRAMPOOL_ERROR_DOUBLE_FREE`,
/// `VRAMPOOL_ERROR_INVALID_FREE`); nothing is written then. NULL is freed as nothing (0).
///
/// # Safety
/// `size`, `device` and `stream` are each NULL or writable. As `vrampool_free` for the
/// block's use.
#[no_mangle]
pub unsafe extern "C" fn vrampool_free_any(
    ptr: *mut c_void,
    size: *mut size_t,
    device: *mut c_int,
    stream: *mut *mut c_void,
) -> c_int {
    if ptr.is_null() {
        return 0;
    }
    guarded("vrampool_free_any", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        match blocks::free_any(ptr as u64) {
            Ok(was) => {
                // SAFETY: the caller promises each pointer NULL or writable.
                unsafe {
                    write_out(size, was.len as size_t);
                    write_out(device, was.device as c_int);
                    write_out(stream, was.raw as usize as *mut c_void);
                }
                0
            }
            Err(e) => e.report(),
        }
    })
}

/// Write `v` to `out` unless it is NULL.
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn write_out<T>(out: *mut T, v: T) {
    if !out.is_null() {
        // SAFETY: as the caller promises.
        unsafe { out.write(v) };
    }
}

/// Say that the block at `ptr` is also used on `stream`: its free then waits for the work
/// enqueued on `stream` before the free, as well as its own stream's. Returns 0, or a
/// `vrampool_status` with the error set.
///
/// # Safety
/// As `vrampool_malloc` for `stream`.
#[no_mangle]
pub unsafe extern "C" fn vrampool_record_stream(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    guarded("vrampool_record_stream", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        match record_stream(ptr as u64, stream as u64) {
            Ok(()) => 0,
            Err(e) => e.report(),
        }
    })
}

/// Say that `stream` is about to be destroyed: call this before `cuStreamDestroy` on a
/// stream vrampool has seen (any stream passed to `vrampool_malloc`, `vrampool_free` or
/// `vrampool_record_stream`). vrampool records its last event on it and never touches the
/// handle again; blocks still live on it stay valid (free them with the same handle value
/// as before). Without this call vrampool may use the handle later (to fence frees and to
/// check for graph capture), which on a destroyed stream is undefined behaviour in the
/// driver. Returns 0 (also for a stream vrampool never saw), or a `vrampool_status` with
/// the error set: `VRAMPOOL_ERROR_INVALID_ARGUMENT` for a default stream.
///
/// # Safety
/// `stream` is still a live stream of device `device`'s primary context.
#[no_mangle]
pub unsafe extern "C" fn vrampool_stream_destroyed(device: c_int, stream: *mut c_void) -> c_int {
    guarded("vrampool_stream_destroyed", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        let _relaxed = relaxed();
        // SAFETY: the caller promises a live stream of the device.
        match ordinal(device).and_then(|d| unsafe { registry::stream_destroyed(d, stream as u64) }) {
            Ok(()) => 0,
            Err(e) => AbiError::from_error("vrampool_stream_destroyed", Counter::FailedCalls, &e).report(),
        }
    })
}

/// An out-of-memory handler (`vrampool_set_oom_handler`): called with the bytes asked, the
/// device, and the `user_data` given with it; returns non-zero when it freed memory and the
/// allocation should be tried again, 0 to let it fail. It must not throw or `longjmp` out.
#[allow(non_camel_case_types)]
pub type vrampool_oom_handler =
    Option<unsafe extern "C" fn(requested: size_t, device: c_int, user_data: *mut c_void) -> c_int>;

/// Set device `device`'s out-of-memory handler, replacing any other; NULL removes it. When
/// an allocation on the device has tried every step of the pool's out-of-memory ladder and
/// still does not fit, the pool calls `handler(size, device, user_data)` on the allocating
/// thread before failing; the handler frees what the program can spare (it may call
/// `vrampool_free` and `vrampool_malloc`) and returns non-zero to have the allocation tried
/// again, at most 64 times. An allocation of the handler's own thread that runs out of
/// memory while it runs fails at once (no handler inside the handler). The statistics
/// count its calls (`oom_handler_calls`) and the allocations it saved (`oom_rescues`).
/// Graph pools' allocations do not call it. Returns 0, or a `vrampool_status` with the
/// error set.
///
/// # Safety
/// `handler`, if not NULL, may be called with `user_data` from any thread that allocates on
/// the device, at any time until it is replaced, and must not unwind.
#[no_mangle]
pub unsafe extern "C" fn vrampool_set_oom_handler(
    device: c_int,
    handler: vrampool_oom_handler,
    user_data: *mut c_void,
) -> c_int {
    guarded("vrampool_set_oom_handler", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        let pool = match pool_of(device) {
            Ok(p) => p,
            Err(e) => return AbiError::from_error("vrampool_set_oom_handler", Counter::FailedCalls, &e).report(),
        };
        let Some(handler) = handler else {
            pool.clear_out_of_memory_handler();
            return 0;
        };
        let user = UserData(user_data);
        pool.set_out_of_memory_handler(move |oom| {
            let requested = usize::try_from(oom.requested).unwrap_or(usize::MAX);
            // SAFETY: the caller of `vrampool_set_oom_handler` promised a handler that may be
            // called with this pointer from any allocating thread and does not unwind.
            unsafe { handler(requested, device, user.get()) != 0 }
        });
        0
    })
}

/// Limit device `device`'s pool to `fraction` of the device's memory (PyTorch's
/// `set_per_process_memory_fraction`, the pluggable allocator's memory-fraction hook):
/// allocations that would map past it run out of memory, memory mapped above it stays until
/// freed and trimmed. The limit is whole pages, rounded down. `fraction` is in (0, 1], and
/// at most the pool's ceiling, the limit it was made with (`VRAMPOOL_MAX_RESERVED`, default
/// 80% of the device). Returns 0, or a `vrampool_status` with the error set
/// (`VRAMPOOL_ERROR_INVALID_ARGUMENT` for a fraction out of range).
#[no_mangle]
pub extern "C" fn vrampool_set_memory_fraction(device: c_int, fraction: f64) -> c_int {
    guarded("vrampool_set_memory_fraction", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        let valid = if fraction > 0.0 && fraction <= 1.0 {
            Ok(fraction)
        } else {
            Err(Error::InvalidArgument(format!("memory fraction {fraction} is not in (0, 1]")))
        };
        // The fraction is checked first: a refused call makes no pool.
        let set = valid.and_then(|_| pool_of(device)).and_then(|pool| {
            // Whole pages (memory is mapped by the page), rounded down: 80% of a device is
            // then never a few bytes above the pool's default 80%.
            let page = (pool.device().granularity() as u64).max(1);
            let bytes = (pool.device().total_memory() as f64 * fraction) as u64 / page * page;
            pool.set_max_reserved(bytes)
        });
        match set {
            Ok(()) => 0,
            Err(e) => AbiError::from_error("vrampool_set_memory_fraction", Counter::FailedCalls, &e).report(),
        }
    })
}

/// Start device `device`'s peaks again from now (PyTorch's `reset_peak_memory_stats`): the
/// statistics' `peak_allocated_bytes` and `peak_reserved_bytes` then read the most held since
/// this call. Returns 0, or a `vrampool_status` with the error set.
#[no_mangle]
pub extern "C" fn vrampool_reset_peak_stats(device: c_int) -> c_int {
    guarded("vrampool_reset_peak_stats", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || match pool_of(device) {
        Ok(p) => {
            p.reset_peak_stats();
            0
        }
        Err(e) => AbiError::from_error("vrampool_reset_peak_stats", Counter::FailedCalls, &e).report(),
    })
}

/// Device `device`'s pool (made now if it was not yet).
fn pool_of(device: c_int) -> Result<crate::Pool, Error> {
    ordinal(device).and_then(registry::pool)
}

/// The device ordinal a C caller passed, or `InvalidArgument` for a negative one.
fn ordinal(device: c_int) -> Result<usize, Error> {
    usize::try_from(device).map_err(|_| Error::InvalidArgument(format!("device {device} is not an ordinal")))
}

/// The `user_data` of an out-of-memory handler, carried to whichever thread runs it.
struct UserData(*mut c_void);

// SAFETY: vrampool never reads through the pointer; it hands it back to the handler, whose
// setter promised that any allocating thread may (`vrampool_set_oom_handler`'s contract).
unsafe impl Send for UserData {}
// SAFETY: as for `Send`: shared only to be passed back, never dereferenced here.
unsafe impl Sync for UserData {}

impl UserData {
    /// The pointer (a method, so that a closure captures the whole `UserData`, not its
    /// field).
    fn get(&self) -> *mut c_void {
        self.0
    }
}

/// Open graph pool `(pool_a, pool_b)` on `device` for a capture about to begin (PyTorch's
/// `beginAllocateToPool`; the pair is its `MempoolId_t`), or join it if open: until
/// `vrampool_end_allocate_to_pool`, `vrampool_malloc_to_pool` serves the capture from
/// memory nothing outside the pool gets until `vrampool_release_pool`. While any capture is
/// declared, every call checks its stream for capture before it keys it (asking a capturing
/// stream's id invalidates the capture) and runs its driver calls in the RELAXED capture
/// mode. Returns 0, or a `vrampool_status` with the error set.
#[no_mangle]
pub extern "C" fn vrampool_begin_allocate_to_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    graph_call("vrampool_begin_allocate_to_pool", device, |d| graph::begin(d, (pool_a, pool_b)))
}

/// The capture `vrampool_begin_allocate_to_pool` was called for has ended (PyTorch's
/// `endAllocateToPool`, after `cudaStreamEndCapture`). Returns 0, or a `vrampool_status`.
#[no_mangle]
pub extern "C" fn vrampool_end_allocate_to_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    graph_call("vrampool_end_allocate_to_pool", device, |d| graph::end(d, (pool_a, pool_b)))
}

/// A graph that used pool `(pool_a, pool_b)` is gone (PyTorch's `releasePool`; one call
/// per `vrampool_begin_allocate_to_pool`). Once every such graph is, the pool's memory goes
/// back at the first `vrampool_empty_cache` (or allocation out of memory) after its last
/// block is freed, as PyTorch gives a released private pool back only then (a later graph
/// may still replay into a block the pool held). Returns 0, or a `vrampool_status` with
/// the error set.
#[no_mangle]
pub extern "C" fn vrampool_release_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    graph_call("vrampool_release_pool", device, |d| graph::release(d, (pool_a, pool_b)))
}

/// Allocate `size` bytes in open graph pool `(pool_a, pool_b)` for the capture on `stream`.
/// As `vrampool_malloc` otherwise: freed with `vrampool_free` and the same size and stream.
///
/// # Safety
/// As `vrampool_malloc`.
#[no_mangle]
pub unsafe extern "C" fn vrampool_malloc_to_pool(
    size: ssize_t,
    device: c_int,
    stream: *mut c_void,
    pool_a: u64,
    pool_b: u64,
) -> *mut c_void {
    guarded("vrampool_malloc_to_pool", std::ptr::null_mut(), || {
        let _relaxed = relaxed();
        let call = "vrampool_malloc_to_pool";
        if size == 0 {
            return std::ptr::null_mut();
        }
        let result = match (usize::try_from(size), usize::try_from(device)) {
            (Ok(size), Ok(d)) => graph::malloc(size, d, stream as u64, (pool_a, pool_b)),
            _ => Err(Error::InvalidArgument(format!("{call}({size}, device {device}): a negative size or device"))),
        };
        match result {
            Ok(addr) => addr as *mut c_void,
            Err(e) => {
                let counter =
                    if matches!(e, Error::OutOfMemory(_)) { Counter::FailedMallocs } else { Counter::InvalidMallocs };
                AbiError::from_error(call, counter, &e).report();
                std::ptr::null_mut()
            }
        }
    })
}

/// A graph-pool call on `device`: 0, or the error reported.
fn graph_call(call: &'static str, device: c_int, f: impl FnOnce(usize) -> Result<(), Error>) -> c_int {
    guarded(call, vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        let _relaxed = relaxed();
        let result = ordinal(device).and_then(f);
        match result {
            Ok(()) => 0,
            Err(e) => AbiError::from_error(call, Counter::FailedCalls, &e).report(),
        }
    })
}

/// While a capture is declared underway, the calling thread's capture mode is RELAXED until
/// the guard drops, so that the pool's event and stream queries neither fail nor invalidate
/// the capture (`device::cuda::RelaxedCapture`).
#[inline(always)]
fn relaxed() -> Option<impl Sized> {
    if !registry::captures_underway() {
        return None;
    }
    relax_now()
}

#[cold]
#[inline(never)]
fn relax_now() -> Option<impl Sized> {
    #[cfg(feature = "cuda")]
    return match registry::device_kind() {
        Ok(crate::DeviceKind::Cuda) => crate::device::cuda::RelaxedCapture::enter(),
        _ => None, // the simulator has no capture modes (nor, maybe, a CUDA driver)
    };
    #[cfg(not(feature = "cuda"))]
    return None::<()>; // without CUDA there are no capture modes
}

/// Give back what every pool holds and does not use: settle pending frees, close every
/// open batch, wait for pending events, unmap every wholly free page, and give back every
/// released graph pool whose blocks are all freed (after a device-wide synchronize; not
/// while a capture is declared). Returns 0, or a `vrampool_status` with the error set.
#[no_mangle]
pub extern "C" fn vrampool_empty_cache() -> c_int {
    guarded("vrampool_empty_cache", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        let _relaxed = relaxed();
        foreign::settle(true);
        match graph::finish_ready().and_then(|()| registry::trim()) {
            Ok(()) => 0,
            Err(e) => AbiError::from_error("vrampool_empty_cache", Counter::FailedCalls, &e).report(),
        }
    })
}

/// Write out the traces the pools record (`VRAMPOOL_RECORD_TRACE`): every line buffered so
/// far reaches its file. Returns 0 (also when nothing records), or a `vrampool_status` with
/// the error set (a write failed: the recording stopped there). The lines also reach the
/// file when the process exits normally.
#[no_mangle]
pub extern "C" fn vrampool_flush_traces() -> c_int {
    guarded("vrampool_flush_traces", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        foreign::settle(true);
        match registry::flush_traces() {
            Ok(_) => 0,
            Err(e) => AbiError::from_error("vrampool_flush_traces", Counter::FailedCalls, &e).report(),
        }
    })
}

/// Pause (`paused` non-zero) or resume (0) the traces the pools record
/// (`VRAMPOOL_RECORD_TRACE`): blocks allocated while paused are left out whole (their frees
/// too), so a program records its workload alone, not its start-up or its own checks; the
/// frees of blocks written before are written. Pools made later start as this says, so a
/// program may pause before its first allocation. Returns 0 (also when nothing records).
#[no_mangle]
pub extern "C" fn vrampool_pause_traces(paused: c_int) -> c_int {
    guarded("vrampool_pause_traces", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        registry::pause_traces(paused != 0);
        0
    })
}

/// Device `device`'s statistics as one JSON object, as `snprintf` writes: returns the
/// length of the whole JSON (without its NUL), writes at most `len` bytes including a NUL,
/// and accepts `buf = NULL, len = 0` to ask for the length. The keys are the fields of
/// vrampool's `Stats` (`"allocated_bytes"`, ...) and the ABI's counters (`"abi_*"`,
/// process-wide). Pending frees are settled first. On failure returns 0 with the error set.
/// The figures move between calls (and settling takes time, which is a figure), so the length
/// one call returns may be short for the next: give room to spare and ask again when the
/// return is `len` or more.
///
/// # Safety
/// `buf` is NULL with `len == 0`, or valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn vrampool_stats_json(device: c_int, buf: *mut c_char, len: size_t) -> size_t {
    guarded("vrampool_stats_json", 0, || {
        let _relaxed = relaxed();
        match stats::json(device, buf, len) {
            Ok(n) => n,
            Err(e) => {
                e.report();
                0
            }
        }
    })
}

/// What a stretch of memory in a [`vrampool_snapshot`] is.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum vrampool_extent_state {
    /// A block the program holds: allocated and not yet freed.
    VRAMPOOL_EXTENT_LIVE = 0,
    /// Freed and kept in a cache of its stream, reused at once by that stream.
    VRAMPOOL_EXTENT_CACHED = 1,
    /// Freed after use on several streams (`vrampool_record_stream`), waiting for their work.
    VRAMPOOL_EXTENT_RETIRING = 2,
    /// Mapped and in no block.
    VRAMPOOL_EXTENT_FREE = 3,
}

/// One stretch of a device's memory, as [`vrampool_snapshot`] reports it.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy)]
pub struct vrampool_extent {
    /// First address of the segment the stretch lies in: a run of mapped pages.
    pub segment: u64,
    /// Bytes of the segment.
    pub segment_bytes: u64,
    /// First address of the stretch.
    pub addr: u64,
    /// Its bytes; for a live block, all it holds (its size class).
    pub bytes: u64,
    /// For a live block, the bytes asked for (its whole capacity for a block given to
    /// `vrampool_record_stream`, whose record a racing free may drop, so it is not read);
    /// 0 for live memory no known block starts in (a block allocated while the picture was
    /// taken, or one of the Rust API) and for the other states.
    pub requested: u64,
    /// For a live block, the stream handle it was allocated with (NULL for a block given to
    /// `vrampool_record_stream`, as `requested` says); for a cached stretch, its stream's;
    /// otherwise NULL (so is the default stream's handle).
    pub stream: *mut c_void,
    /// The CUDA graph pool it belongs to (the pair given to
    /// `vrampool_begin_allocate_to_pool`); (0, 0) for the device's own pool.
    pub pool_a: u64,
    /// See `pool_a`.
    pub pool_b: u64,
    /// What the stretch is.
    pub state: vrampool_extent_state,
}

/// Device `device`'s memory, stretch by stretch (PyTorch's `torch.cuda.memory_snapshot`):
/// every run of mapped pages (a segment), cut into extents that cover it end to end, lowest
/// address first, the device's own pool first, then each CUDA graph pool's. Live memory is
/// cut block by block, each with the bytes asked for and its stream. Writes the first `cap`
/// extents to `out` (NULL with `cap == 0`: only count), their number to `*count`, and returns
/// 0, or a `vrampool_status` with the error set. The pool is read while other threads go on:
/// call with `cap = 0` for the number, then with room for a few more, and again while
/// `*count > cap`; a block allocated or freed meanwhile may show in either state. A device
/// no C call has allocated on yet has no extents (none is made for it). Pending frees are
/// settled first.
///
/// # Safety
/// `count` is valid for writing one `size_t`; `out` is NULL with `cap == 0`, or valid for
/// writing `cap` extents.
#[no_mangle]
pub unsafe extern "C" fn vrampool_snapshot(
    device: c_int,
    out: *mut vrampool_extent,
    cap: size_t,
    count: *mut size_t,
) -> c_int {
    guarded("vrampool_snapshot", vrampool_status::VRAMPOOL_ERROR_INTERNAL as c_int, || {
        let _relaxed = relaxed();
        let call = "vrampool_snapshot";
        let invalid = |msg: String| {
            AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_ARGUMENT, Counter::FailedCalls, msg).report()
        };
        if count.is_null() || (out.is_null() && cap != 0) {
            return invalid(format!("{call}: a null count, or a null array of {cap} extents"));
        }
        match ordinal(device).and_then(snapshot::extents) {
            Ok(extents) => {
                let n = extents.len().min(cap);
                // SAFETY: `out` has room for `cap >= n` extents (non-null when `n > 0`, as
                // `cap > 0` then) and `count` for one size_t, as the caller promised.
                unsafe {
                    if n > 0 {
                        std::ptr::copy_nonoverlapping(extents.as_ptr(), out, n);
                    }
                    *count = extents.len();
                }
                0
            }
            Err(e) => AbiError::from_error(call, Counter::FailedCalls, &e).report(),
        }
    })
}

/// The message of this thread's last failed call, then cleared (as `dlerror`); NULL when
/// there is none. Successful calls do not set it. The string stays valid until this
/// thread's next call into the library.
#[no_mangle]
pub extern "C" fn vrampool_last_error() -> *const c_char {
    guarded("vrampool_last_error", std::ptr::null(), status::take_last)
}

/// The `vrampool_status` of this thread's last failed call, 0 if none (or once
/// `vrampool_last_error` has read it). Does not clear it.
#[no_mangle]
pub extern "C" fn vrampool_last_error_code() -> c_int {
    guarded("vrampool_last_error_code", 0, status::last_code)
}

/// vrampool's version, as `"0.1.0"` (a static string).
#[no_mangle]
pub extern "C" fn vrampool_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// `VRAMPOOL_ABI_VERSION` of the library loaded (compare with the header's).
#[no_mangle]
pub extern "C" fn vrampool_abi_version() -> u32 {
    VRAMPOOL_ABI_VERSION
}

/// Run an entry point, turning a panic into an internal error (counted and set) and
/// `on_panic`: unwinding into C is undefined behaviour. Any path of it that may call the
/// driver other than to key a stream (every cold path) takes [`relaxed`] first; the hot
/// paths (a cache hit, a cache push) make no such call and skip even its load.
#[inline(always)]
fn guarded<T>(call: &'static str, on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(payload) => {
            panicked(call, payload);
            on_panic
        }
    }
}

#[cold]
#[inline(never)]
fn panicked(call: &str, payload: Box<dyn Any + Send>) {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    let msg = format!("{call}: internal error, a panic was caught ({what}); please report it");
    AbiError::new(vrampool_status::VRAMPOOL_ERROR_INTERNAL, Counter::Internal, msg).report();
}

/// Every live block of device `device` the ABI knows, as (address, bytes asked for), in
/// address order: for tests and the fuzzer's model checks.
///
/// # Safety
/// No other thread may be inside the ABI during the call (a boxed block's record could be
/// freed while it is read).
#[doc(hidden)]
pub unsafe fn live_blocks(device: usize) -> Vec<(u64, u64)> {
    let Some(dev) = device::existing(device) else { return Vec::new() };
    dev.table
        .live_slots()
        .into_iter()
        .map(|(idx, w)| {
            let len = if w.ext {
                // SAFETY: no other thread is inside the ABI (the caller's promise), so the
                // record is not freed meanwhile.
                unsafe { Ext::peek(w.info) }.block.len() as u64
            } else {
                words::unpack(w.info).0
            };
            (dev.table.address(idx), len)
        })
        .collect()
}
