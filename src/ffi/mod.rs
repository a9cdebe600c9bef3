//! The C ABI, with PyTorch's pluggable-allocator signatures: `libvrampool.so` and
//! `include/vrampool.h`.
//!
//! ```c
//! void*  vrampool_malloc(ssize_t size, int device, void* stream);   /* PyTorch's alloc_fn */
//! void   vrampool_free(void* ptr, ssize_t size, int device, void* stream); /* free_fn */
//! int    vrampool_record_stream(void* ptr, void* stream);           /* 0, or an error code */
//! int    vrampool_empty_cache(void);                                /* trim every pool */
//! size_t vrampool_stats_json(int device, char* buf, size_t len);    /* bytes needed */
//! const char* vrampool_last_error(void);   /* this thread's last error, then cleared */
//! ```
//!
//! **What it owns.** The C side of the [`crate::registry`]'s pools: per device a
//! live-block table (the `live` module: from a block's address to what its free needs, in
//! O(1), without a lock), the calling thread's memo of its last device and stream, and the
//! queue of frees made on other threads than the allocating one (`ffi::foreign`), and the
//! CUDA graph pools (`ffi::graph`: `vrampool_begin_allocate_to_pool`,
//! `vrampool_malloc_to_pool`, `vrampool_end_allocate_to_pool`, `vrampool_release_pool`,
//! PyTorch's private pools). Pools, their configuration (environment variables, see
//! [`crate::registry::VARIABLES`]) and streams are the registry's.
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
//! **No lock on the allocation or free path.** A malloc finds its device, stream and owner
//! record in the thread's memo (a few loads and compares: on CUDA also one `cuStreamGetId`,
//! since a handle's value may name a new stream), allocates from the pool's thread cache
//! and publishes the block in its slot with plain stores; the owning thread's free finds
//! the slot from the address and takes it back with plain loads and stores. A free on
//! another thread takes one compare-and-swap and is settled in a batch; only the first use
//! of a device or a stream takes a lock (one-time set-up).
//!
//! # Safety
//! The entry points are `unsafe`: on CUDA a stream handle must be a live stream of the
//! device's primary context, `vrampool_stats_json` writes `len` bytes at `buf`, and a
//! pointer freed must not be used by work enqueued after the free on streams other than
//! its own (and those given to `vrampool_record_stream`). Bad pointers, sizes and stream
//! values that name no stream are refused, never followed.

mod device;
mod foreign;
mod graph;
mod memo;
mod stats;
mod status;
mod words;

pub use stats::Report;
pub use status::{vrampool_status, AbiCounters};

use std::any::Any;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use libc::{size_t, ssize_t};

use crate::live::{Refusal, Settled, Words};
use crate::pool::class_and_size;
use crate::registry::{self, StreamRec};
use crate::{Block, Error};
use device::AbiDevice;
use memo::MEMO;
use status::{bump, AbiError, Counter};
use words::{Ext, Parts, MAX_PACKED_LEN};

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
        let Ok(ordinal) = usize::try_from(device) else {
            let e = Error::InvalidArgument(format!("device {device} is not an ordinal"));
            return AbiError::from_error("vrampool_stream_destroyed", Counter::FailedCalls, &e).report();
        };
        // SAFETY: the caller promises a live stream of the device.
        match unsafe { registry::stream_destroyed(ordinal, stream as u64) } {
            Ok(()) => 0,
            Err(e) => AbiError::from_error("vrampool_stream_destroyed", Counter::FailedCalls, &e).report(),
        }
    })
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
        let result = usize::try_from(device)
            .map_err(|_| Error::InvalidArgument(format!("device {device} is not an ordinal")))
            .and_then(f);
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

/// Device `device`'s statistics as one JSON object, as `snprintf` writes: returns the
/// length of the whole JSON (without its NUL), writes at most `len` bytes including a NUL,
/// and accepts `buf = NULL, len = 0` to ask for the length. The keys are the fields of
/// vrampool's `Stats` (`"allocated_bytes"`, ...) and the ABI's counters (`"abi_*"`,
/// process-wide). Pending frees are settled first. On failure returns 0 with the error set.
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

#[inline(always)]
fn malloc(size: ssize_t, device: c_int, raw: u64) -> *mut c_void {
    // One compare for zero, negative and too long to pack (1 TiB and more).
    if (size as u64).wrapping_sub(1) >= MAX_PACKED_LEN {
        return malloc_edge(size, device, raw);
    }
    match MEMO.try_with(|m| malloc_hit(m, size as usize, device, raw)) {
        Ok(Some(p)) => p,
        _ => malloc_slow(size as usize, device, raw),
    }
}

#[cold]
#[inline(never)]
fn malloc_edge(size: ssize_t, device: c_int, raw: u64) -> *mut c_void {
    match size {
        0 => std::ptr::null_mut(),
        ..0 => refused_malloc(size, device),
        _ => malloc_slow(size as usize, device, raw),
    }
}

/// The memo's path: the device and stream of the thread's last allocation. `None` if the
/// memo names others (nothing was done).
#[inline(always)]
fn malloc_hit(m: &memo::Memo, size: usize, device: c_int, raw: u64) -> Option<*mut c_void> {
    if m.alloc_device.get() != device as i64 || m.raw.get() != raw {
        return None;
    }
    // SAFETY: `alloc_device` names the device only with a cache (and its shared part),
    // which the thread's `CACHES` holds until it clears the memo.
    let (cache, shared) = unsafe { (&*m.cache.get(), &*m.shared.get()) };
    // The hit alone here, everything else out of line: the hot path stays a small leaf.
    match crate::pool::try_alloc_hit(shared, size) {
        Some((addr, size_class)) => {
            let info = size as u64 | m.token_bits.get();
            if !m.table().publish_at(addr, m.owner.get(), Words { info, size: size_class, ext: false }) {
                return Some(outside_table(m, addr, size as u64, size_class));
            }
            Some(addr as *mut c_void)
        }
        None => Some(malloc_miss(m, cache, size)),
    }
}

/// [`malloc_hit`] past the loaded magazines: the cache's whole path.
#[cold]
#[inline(never)]
fn malloc_miss(m: &memo::Memo, cache: &crate::StreamCache, size: usize) -> *mut c_void {
    let _relaxed = relaxed();
    match cache.alloc(size) {
        Ok(block) => {
            // `size` packs (checked by the caller): the block goes to its slot as it is.
            let (addr, len, size_class) = words::view(&block);
            std::mem::forget(block);
            let info = len | m.token_bits.get();
            if !m.table().publish_at(addr, m.owner.get(), Words { info, size: size_class, ext: false }) {
                return outside_table(m, addr, len, size_class);
            }
            addr as *mut c_void
        }
        // SAFETY: the memo names a device, which lives for ever.
        Err(e) => malloc_failed(unsafe { &*m.dev.get() }, m, size, e),
    }
}

/// The pool handed the memo's stream a block outside its table (a bug): it goes back, the
/// allocation fails with the error set.
#[cold]
#[inline(never)]
fn outside_table(m: &memo::Memo, addr: u64, len: u64, size_class: u64) -> *mut c_void {
    free_freed(m, addr, len, size_class);
    report_outside(addr)
}

/// Report a block the pool handed out at `addr`, outside the table's range (a bug, given
/// back by the caller): the allocation's NULL.
#[cold]
fn report_outside(addr: u64) -> *mut c_void {
    let msg = format!("vrampool_malloc: the pool handed out {addr:#x}, outside its range (a bug)");
    AbiError::new(vrampool_status::VRAMPOOL_ERROR_INTERNAL, Counter::Internal, msg).report();
    std::ptr::null_mut()
}

/// CUDA's memo path: as [`malloc_hit`], once the handle's key (one driver call) shows it
/// still names the memo's stream; through the pool (its memo finds the same cache), so that
/// [`malloc_miss`] stays the one caller of `StreamCache::alloc`, which the compiler then
/// inlines into it.
fn malloc_hit_cuda(m: &memo::Memo, size: usize, device: c_int, raw: u64) -> Option<*mut c_void> {
    if !m.names(device as i64, raw) || m.cache.get().is_null() {
        return None;
    }
    // SAFETY: the memo names a device and a stream record, which live for ever.
    let (dev, rec) = unsafe { (&*m.dev.get(), &*m.rec.get()) };
    if registry::stream_key(dev.entry, raw).ok() != Some(m.key.get()) {
        return None;
    }
    Some(match dev.entry.pool.alloc(size, &rec.stream) {
        Ok(block) => publish(dev, block, rec.token, m.owner.get()),
        Err(e) => malloc_failed(dev, m, size, e),
    })
}

/// Record `block`, just allocated on stream `token` by owner `owner`, in its device's table.
#[inline(always)]
fn publish(dev: &AbiDevice, block: Block, token: u32, owner: usize) -> *mut c_void {
    let (addr, len, size) = words::view(&block);
    match dev.table.index(addr) {
        Some(idx) if len <= MAX_PACKED_LEN => {
            std::mem::forget(block);
            dev.table.publish(idx, owner, Words { info: words::pack(len, token), size, ext: false });
            addr as *mut c_void
        }
        _ => publish_ext(dev, block, token, owner),
    }
}

#[cold]
#[inline(never)]
fn publish_ext(dev: &AbiDevice, block: Block, token: u32, owner: usize) -> *mut c_void {
    let (addr, _, size) = words::view(&block);
    match dev.table.index(addr) {
        Some(idx) => {
            dev.table.publish(idx, owner, Words { info: Ext::into_info(block, token), size, ext: true });
            addr as *mut c_void
        }
        None => {
            drop(block);
            report_outside(addr)
        }
    }
}

/// The pool refused an allocation on the memo's stream: settle pending frees and try once
/// more if it was out of memory, else report.
#[cold]
#[inline(never)]
fn malloc_failed(dev: &AbiDevice, m: &memo::Memo, size: usize, e: Error) -> *mut c_void {
    // SAFETY: the memo names a stream record, which lives for ever.
    let rec = unsafe { &*m.rec.get() };
    let retried = match e {
        // The memo's stream was declared destroyed (`vrampool_stream_destroyed`) and its
        // handle value is in use again: the slow path finds the new stream.
        Error::StreamDestroyed => {
            let raw = m.raw.get();
            m.forget();
            return malloc_slow(size, m.device.get() as c_int, raw);
        }
        e => retry_out_of_memory(dev, size, &rec.stream, e),
    };
    match retried {
        Ok(block) => publish(dev, block, rec.token, m.owner.get()),
        Err(e) => {
            AbiError::from_error("vrampool_malloc", Counter::FailedMallocs, &e).report();
            std::ptr::null_mut()
        }
    }
}

/// An allocation on `stream` failed with `e`: if it ran out of memory and something can be
/// given back — frees other threads handed over, released graph pools (as PyTorch frees
/// its released private pools before it retries) — give it back and try once more.
#[cold]
#[inline(never)]
fn retry_out_of_memory(dev: &AbiDevice, size: usize, stream: &crate::Stream, e: Error) -> Result<Block, Error> {
    if !matches!(e, Error::OutOfMemory(_)) || (foreign::pending() == 0 && !graph::finishable()) {
        return Err(e);
    }
    foreign::settle(true);
    // A pool that cannot be given back now stays for `vrampool_empty_cache`; the retry
    // reports the out-of-memory if it fails again.
    let _ = graph::finish_ready();
    dev.entry.pool.alloc(size, stream)
}

#[cold]
#[inline(never)]
fn refused_malloc(size: ssize_t, device: c_int) -> *mut c_void {
    let msg = format!("vrampool_malloc({size}, device {device}): a negative size");
    AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_ARGUMENT, Counter::InvalidMallocs, msg).report();
    std::ptr::null_mut()
}

/// Everything the memo's path does not do: find (or make) the device and the stream,
/// take an owner record, allocate (settling pending frees and trying again when out of
/// memory), publish.
#[cold]
#[inline(never)]
fn malloc_slow(size: usize, device: c_int, raw: u64) -> *mut c_void {
    let _relaxed = relaxed();
    if let Ok(Some(p)) = MEMO.try_with(|m| malloc_hit_cuda(m, size, device, raw)) {
        return p;
    }
    match malloc_checked(size, device, raw) {
        Ok(p) => p,
        Err(e) => {
            e.report();
            std::ptr::null_mut()
        }
    }
}

fn malloc_checked(size: usize, device: c_int, raw: u64) -> Result<*mut c_void, AbiError> {
    let call = "vrampool_malloc";
    let invalid = |e: &Error| AbiError::from_error(call, Counter::InvalidMallocs, e);
    let ordinal = usize::try_from(device).map_err(|_| invalid(&Error::InvalidArgument(format!("device {device}"))))?;
    let dev = device::get(ordinal).map_err(|e| invalid(&e))?;
    let key = registry::stream_key(dev.entry, raw).map_err(|e| invalid(&e))?;
    let rec = registry::stream_rec(dev.entry, raw).map_err(|e| invalid(&e))?;
    let owner = MEMO
        .try_with(|m| {
            m.ensure_owner();
            m.remember(device as i64, raw, key, dev, &rec);
            m.owner.get()
        })
        .unwrap_or(0);
    // The pool's own path (it finds the cache just remembered), for the reason given at
    // `malloc_hit_cuda`.
    let block = dev
        .entry
        .pool
        .alloc(size, &rec.stream)
        .or_else(|e| retry_out_of_memory(dev, size, &rec.stream, e))
        .map_err(|e| AbiError::from_error(call, Counter::FailedMallocs, &e))?;
    Ok(publish(dev, block, rec.token, owner))
}

#[inline(always)]
fn free(addr: u64, size: ssize_t, device: c_int, raw: u64) {
    let done = MEMO.try_with(|m| {
        let len = size as u64;
        if m.free_device.get() != device as i64 || m.raw.get() != raw || len.wrapping_sub(1) >= MAX_PACKED_LEN {
            return false;
        }
        // SAFETY: `free_device` names the device only while the thread holds its owner
        // record.
        let mine = unsafe { &*m.owner_rec.get() };
        let table = m.table();
        let Some(idx) = table.index(addr) else { return false };
        let info = len | m.token_bits.get();
        match table.free_owned(idx, mine, m.owner.get(), info) {
            Some(size_class) => {
                // The thread's cache for the block's stream (the slot's info word named the
                // memo's stream) takes it as the block's own drop would, without making
                // the block and finding the cache again.
                let shared = m.shared.get();
                let (class, size) = class_and_size(size_class);
                // SAFETY: a non-null `shared` is held by the thread's `CACHES` (memo docs).
                if !shared.is_null() && unsafe { &*shared }.try_push_fast(class as usize, size, addr) {
                    return true;
                }
                free_freed(m, addr, len, size_class);
                true
            }
            None => false,
        }
    });
    if done != Ok(true) {
        free_slow(addr, size, device, raw);
    }
}

/// The rest of a hot-path free whose block the cache's hit path could not take (or a block
/// that cannot be published): the block made again and dropped (its whole path). Out of
/// line, so the hot path stays small.
#[cold]
#[inline(never)]
fn free_freed(m: &memo::Memo, addr: u64, len: u64, size_class: u64) {
    let _relaxed = relaxed();
    // SAFETY: the memo names a device, whose pool pointer is never null.
    let pool = unsafe { NonNull::new_unchecked(m.pool.get().cast_mut()) };
    let parts = Parts { addr, len, size_class, stream: m.stream_id.get(), pool };
    // SAFETY: these are the parts of a block the pool gave the memo's stream (whose id this
    // is) and nobody else holds: a slot's, whose info word matched that stream and whose
    // owner's free took it from live to free, or (`outside_table`) one just allocated.
    drop(unsafe { words::rebuild(parts) });
}

#[cold]
#[inline(never)]
fn free_slow(addr: u64, size: ssize_t, device: c_int, raw: u64) {
    let _relaxed = relaxed();
    if let Err(e) = free_checked(addr, size, device, raw) {
        e.report();
    }
}

/// What a free's check saw of the block, for the message of a refusal: (bytes asked for,
/// the stream handle it was allocated with).
type Seen = std::cell::Cell<Option<(u64, Option<u64>)>>;

/// Whether a slot's (unboxed) words are those of an allocation of `size` bytes on `raw`.
fn words_match(dev: &AbiDevice, w: Words, size: ssize_t, raw: u64, seen: &Seen) -> bool {
    let (len, token) = words::unpack(w.info);
    let alloc_raw = stream_raw(dev, token);
    seen.set(Some((len, alloc_raw)));
    size > 0 && len == size as u64 && alloc_raw == Some(raw)
}

fn ext_matches(dev: &AbiDevice, ext: &Ext, size: ssize_t, raw: u64, seen: &Seen) -> bool {
    let (len, alloc_raw) = (ext.block.len() as u64, stream_raw(dev, ext.token));
    seen.set(Some((len, alloc_raw)));
    size > 0 && len == size as u64 && alloc_raw == Some(raw)
}

fn stream_raw(dev: &AbiDevice, token: u32) -> Option<u64> {
    dev.entry.streams.by_token(token).map(|r| r.raw)
}

fn free_checked(addr: u64, size: ssize_t, device: c_int, raw: u64) -> Result<(), AbiError> {
    let call = "vrampool_free";
    let dev = usize::try_from(device).ok().and_then(device::existing).ok_or_else(|| {
        let msg = format!("{call}({addr:#x}): device {device} has no pool: no block of it was allocated here");
        AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_FREE, Counter::InvalidFrees, msg)
    })?;
    let Some(idx) = dev.table.index(addr) else {
        return match graph::free(addr, size as u64, raw) {
            Some(Ok(())) => Ok(()),
            Some(Err(graph::FreeRefusal::NotLive)) => {
                Err(refusal(call, addr, size, raw, Refusal::NotLive { ever: true }, None))
            }
            Some(Err(graph::FreeRefusal::Mismatch { len, raw: alloc_raw })) => {
                Err(mismatch(call, addr, size, raw, len, Some(alloc_raw)))
            }
            None => Err(not_a_block(call, dev, addr)),
        };
    };
    let seen = Seen::new(None);
    let refused = |r: Refusal| refusal(call, addr, size, raw, r, seen.get());
    let (me, mine) = MEMO.try_with(|m| (m.owner.get(), m.owner_rec.get())).unwrap_or((0, std::ptr::null()));
    if me != 0 && dev.table.owner(idx) == Ok(me) {
        // SAFETY: non-null with an owner index: the thread's own record.
        let mine = unsafe { &*mine };
        let check = |w: Words| {
            if w.ext {
                // SAFETY: the owner holds the slot inside its window (invariant 3).
                ext_matches(dev, unsafe { Ext::peek(w.info) }, size, raw, &seen)
            } else {
                words_match(dev, w, size, raw, &seen)
            }
        };
        match dev.table.free_owned_with(idx, mine, me, check) {
            Ok(w) => {
                give_back(dev, idx, w);
                return Ok(());
            }
            // The block changed hands meanwhile: free it as any other thread would.
            Err(Refusal::Foreign) => {}
            Err(r) => return Err(refused(r)),
        }
    }
    let claim = dev.table.claim(idx, |w| words_match(dev, w, size, raw, &seen)).map_err(refused)?;
    if !claim.words.ext {
        foreign::defer(dev, claim);
        return Ok(());
    }
    // A boxed block: its record may be read only once the claim has settled.
    bump(Counter::ForeignFrees);
    match dev.table.settle_now(&claim, device::owners()) {
        Some(Settled::Won) => {
            // SAFETY: a won claim holds the slot (invariant 3).
            let ext = unsafe { Ext::peek(claim.words.info) };
            if !ext_matches(dev, ext, size, raw, &seen) {
                dev.table.undo(&claim);
                return Err(refused(Refusal::Mismatch));
            }
            dev.table.release(&claim);
            give_back(dev, idx, claim.words);
            Ok(())
        }
        Some(_) => Err(refused(Refusal::Claimed)),
        None => Err(AbiError::new(
            vrampool_status::VRAMPOOL_ERROR_INTERNAL,
            Counter::Internal,
            format!("{call}({addr:#x}): the cross-thread fence failed; the block stays allocated"),
        )),
    }
}

/// Give a block back to the pool, once its slot went from live to free by this thread.
fn give_back(dev: &AbiDevice, idx: usize, w: Words) {
    if w.ext {
        // SAFETY: the slot no longer names the record: this thread freed it.
        drop(unsafe { Ext::take(w.info) }.block);
        return;
    }
    let (len, token) = words::unpack(w.info);
    match dev.entry.streams.by_token(token) {
        Some(rec) => {
            let parts = Parts { addr: dev.table.address(idx), len, size_class: w.size, stream: rec.id, pool: dev.pool };
            // SAFETY: the slot held these parts since the publication, and this thread took
            // it from live to free (invariant 4).
            drop(unsafe { words::rebuild(parts) });
        }
        None => bump(Counter::Internal),
    }
}

fn not_a_block(call: &str, dev: &AbiDevice, addr: u64) -> AbiError {
    let (base, bytes) = dev.entry.pool.address_range();
    let msg = if addr.wrapping_sub(base) < bytes {
        format!("{call}({addr:#x}): an interior pointer (block addresses are multiples of 256)")
    } else {
        format!("{call}({addr:#x}): not a pointer of device {}'s pool", dev.entry.ordinal)
    };
    AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_FREE, Counter::InvalidFrees, msg)
}

fn mismatch(call: &str, addr: u64, size: ssize_t, raw: u64, len: u64, alloc_raw: Option<u64>) -> AbiError {
    use vrampool_status::VRAMPOOL_ERROR_INVALID_FREE as INVALID;
    if size < 0 || len != size as u64 {
        let msg = format!("{call}({addr:#x}, size {size}): the block was allocated with size {len}");
        AbiError::new(INVALID, Counter::WrongSizeFrees, msg)
    } else {
        let was = alloc_raw.map_or("an unknown stream".to_string(), |r| format!("stream {r:#x}"));
        let msg = format!("{call}({addr:#x}, stream {raw:#x}): the block was allocated on {was}");
        AbiError::new(INVALID, Counter::WrongStreamFrees, msg)
    }
}

/// The error for refusal `r`; `seen`: what the check saw of the block, if it ran.
fn refusal(call: &str, addr: u64, size: ssize_t, raw: u64, r: Refusal, seen: Option<(u64, Option<u64>)>) -> AbiError {
    use vrampool_status::*;
    match r {
        Refusal::NotLive { ever: false } => {
            let msg = format!("{call}({addr:#x}): no block starts there (a foreign or interior pointer)");
            AbiError::new(VRAMPOOL_ERROR_INVALID_FREE, Counter::InvalidFrees, msg)
        }
        Refusal::NotLive { ever: true } => {
            let msg = format!("{call}({addr:#x}): no live block starts there: a double free (or an interior pointer)");
            AbiError::new(VRAMPOOL_ERROR_DOUBLE_FREE, Counter::DoubleFrees, msg)
        }
        Refusal::Claimed => {
            let msg = format!("{call}({addr:#x}): a double free: the block was freed on another thread");
            AbiError::new(VRAMPOOL_ERROR_DOUBLE_FREE, Counter::DoubleFrees, msg)
        }
        Refusal::Mismatch | Refusal::Foreign => match seen {
            Some((len, alloc_raw)) => mismatch(call, addr, size, raw, len, alloc_raw),
            None => {
                let msg = format!("{call}({addr:#x}, size {size}, stream {raw:#x}): not the block's size or stream");
                AbiError::new(VRAMPOOL_ERROR_INVALID_FREE, Counter::WrongSizeFrees, msg)
            }
        },
    }
}

fn record_stream(addr: u64, raw: u64) -> Result<(), AbiError> {
    use vrampool_status::*;
    let _relaxed = relaxed();
    let call = "vrampool_record_stream";
    let counter = Counter::FailedRecordStreams;
    if addr == 0 {
        return Err(AbiError::new(VRAMPOOL_ERROR_INVALID_ARGUMENT, counter, format!("{call}: a null pointer")));
    }
    let Some(dev) = device::holding(addr) else {
        return match graph::record_stream(addr) {
            // A graph pool's block: parked at its free until the pool finishes.
            Some(true) => Ok(()),
            Some(false) => Err(AbiError::new(
                VRAMPOOL_ERROR_INVALID_FREE,
                counter,
                format!("{call}({addr:#x}): no live block of its graph pool starts there"),
            )),
            None => Err(AbiError::new(
                VRAMPOOL_ERROR_INVALID_FREE,
                counter,
                format!("{call}({addr:#x}): not a pointer of any pool"),
            )),
        };
    };
    let as_record = |mut e: AbiError| {
        e.counter = counter;
        e.message = e.message.replacen("vrampool_free", call, 1);
        e
    };
    let idx = dev.table.index(addr).ok_or_else(|| as_record(not_a_block(call, dev, addr)))?;
    let rec: std::sync::Arc<StreamRec> = match registry::stream_rec(dev.entry, raw) {
        // A stream being captured cannot be keyed: the record its handle was last seen with.
        Err(Error::StreamCapturing) => dev.entry.streams.by_raw(raw),
        r => r.ok(),
    }
    .ok_or_else(|| AbiError::from_error(call, counter, &Error::StreamCapturing))?;
    let claim = dev.table.claim_busy(idx).map_err(|r| as_record(refusal(call, addr, 1, raw, r, None)))?;
    let me = MEMO.try_with(|m| m.owner.get()).unwrap_or(0);
    if me == 0 || claim.owner() != me {
        match dev.table.settle_now(&claim, device::owners()) {
            Some(Settled::Won) => {}
            Some(_) => {
                let msg = format!("{call}({addr:#x}): the block was freed meanwhile");
                return Err(AbiError::new(VRAMPOOL_ERROR_DOUBLE_FREE, counter, msg));
            }
            None => {
                let msg = format!("{call}({addr:#x}): the cross-thread fence failed");
                return Err(AbiError::new(VRAMPOOL_ERROR_INTERNAL, Counter::Internal, msg));
            }
        }
    }
    // The slot is held busy: nobody else reads or changes its words now.
    let words = if claim.words.ext {
        // SAFETY: a settled busy claim holds the slot (invariant 3); the block is not
        // `Sync`, but no other thread reaches it while the slot is held.
        let ext = unsafe { Ext::peek(claim.words.info) };
        ext.block.record_stream(&rec.stream);
        claim.words
    } else {
        let (len, token) = words::unpack(claim.words.info);
        let Some(stream) = dev.entry.streams.by_token(token).map(|r| r.id) else {
            dev.table.undo(&claim);
            return Err(AbiError::new(
                VRAMPOOL_ERROR_INTERNAL,
                Counter::Internal,
                format!("{call}: unknown stream token"),
            ));
        };
        if stream == rec.id {
            // Its own stream: nothing to record.
            dev.table.undo(&claim);
            return Ok(());
        }
        let parts = Parts { addr, len, size_class: claim.words.size, stream, pool: dev.pool };
        // SAFETY: the held slot's parts; the block is boxed and the slot rewritten to name
        // the box before anyone else can reach the slot, so it exists once.
        let block = unsafe { words::rebuild(parts) };
        block.record_stream(&rec.stream);
        let size = block.size_class.get();
        Words { info: Ext::into_info(block, token), size, ext: true }
    };
    dev.table.unbusy(&claim, words);
    Ok(())
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
