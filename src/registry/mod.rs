//! One pool per device for the whole process: what the C ABI allocates from, and what a
//! Rust server uses when it wants the same pools.
//!
//! **What it owns.** For each device ordinal that has been used, one [`Pool`] over the
//! device (on CUDA the device's primary context: [`crate::CudaDevice::new`]), made on first
//! use and kept for the life of the process, and the device's streams keyed by the
//! registry's own identity (see [`streams`](self) below), so that the C ABI and Rust code
//! that pass the same raw stream handle reach the same [`Stream`], and so the same caches.
//! One [`Config`] serves every pool: read once from the environment
//! ([`Config::from_env`], variables in [`VARIABLES`]), or set by the program with
//! [`configure`] before the first use.
//!
//! ```
//! use vrampool::registry::{self, Config, DeviceChoice};
//! registry::configure(Config { device: DeviceChoice::Sim, sim_bytes: 1 << 30, ..Config::default() })?;
//! let pool = registry::pool(0)?;
//! let stream = registry::default_stream(0)?;
//! let block = pool.alloc(4096, &stream)?;
//! assert!(registry::pool(1).is_err()); // one simulated device unless VRAMPOOL_SIM_DEVICES says more
//! # drop(block);
//! # Ok::<(), vrampool::Error>(())
//! ```
//!
//! **Invariants.** An entry, once published, is never replaced or dropped, so `&'static`
//! references to it are handed out; streams are never forgotten (blocks may be cached
//! against them). **Locks:** only for one-time set-up: making a device's entry, adding a
//! stream seen for the first time. Finding an entry is one acquire load, a known stream one
//! arc-swap load.

mod config;
mod streams;

pub use config::{Config, DeviceChoice, MAX_DEVICES, MAX_STREAMS, REGISTRY_MAP_RUN_PAGES, VARIABLES};
pub(crate) use streams::StreamRec;

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::device::{Device, DeviceKind, Stream};
use crate::error::{Error, Result};
use crate::{Pool, SimDevice};
use streams::Streams;

static CONFIG: OnceLock<Result<Config>> = OnceLock::new();
static KIND: OnceLock<Result<DeviceKind>> = OnceLock::new();
static ENTRIES: [AtomicPtr<Entry>; MAX_DEVICES] = [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_DEVICES];
static CREATE: Mutex<()> = Mutex::new(());

/// One device's pool and streams.
pub(crate) struct Entry {
    pub(crate) ordinal: usize,
    pub(crate) pool: Pool,
    pub(crate) kind: DeviceKind,
    pub(crate) streams: Streams,
}

/// Set the configuration before the registry's first use (the first call to anything else
/// here or to the C ABI). Fails with [`Error::NotPermitted`] once the configuration is
/// fixed, and with [`Error::InvalidArgument`] for a value out of range.
pub fn configure(config: Config) -> Result<()> {
    config.validate()?;
    CONFIG.set(Ok(config)).map_err(|_| {
        Error::NotPermitted("the registry's configuration is fixed at its first use: configure it before that")
    })
}

/// The configuration in force: the one given to [`configure`], else the environment's
/// (read on the first call). A bad environment variable is an error here and on every use.
pub fn config() -> Result<&'static Config> {
    CONFIG.get_or_init(Config::from_env).as_ref().map_err(Clone::clone)
}

/// Which kind of device the registry opens (with [`DeviceChoice::Auto`], decided on the
/// first call: CUDA if GPU 0 can be opened, else the simulator).
pub fn device_kind() -> Result<DeviceKind> {
    let config = config()?;
    KIND.get_or_init(|| match config.device {
        DeviceChoice::Sim => Ok(DeviceKind::Simulated),
        DeviceChoice::Cuda => cuda_available().map(|_| DeviceKind::Cuda),
        DeviceChoice::Auto => Ok(if cuda_available().is_ok() { DeviceKind::Cuda } else { DeviceKind::Simulated }),
    })
    .clone()
}

#[cfg(feature = "cuda")]
fn cuda_available() -> Result<()> {
    crate::CudaDevice::new(0).map(drop)
}

#[cfg(not(feature = "cuda"))]
fn cuda_available() -> Result<()> {
    Err(Error::NoDevice("vrampool was built without the `cuda` feature".into()))
}

/// The pool of device `device`, made on first use.
pub fn pool(device: usize) -> Result<Pool> {
    Ok(entry(device)?.pool.clone())
}

/// The device under [`pool`]`(device)`.
pub fn device(device: usize) -> Result<Arc<dyn Device>> {
    Ok(Arc::clone(entry(device)?.pool.device()))
}

/// The stream a null handle names: the simulator's default stream, or CUDA's legacy
/// default stream.
pub fn default_stream(device: usize) -> Result<Stream> {
    let e = entry(device)?;
    Ok(stream_rec(e, 0)?.stream.clone())
}

/// The registry's stream for raw handle `raw` on `device`, as the C ABI keys it: on the
/// simulator any value names a stream made the first time it is seen (0 the default
/// stream); on CUDA `raw` is a `CUstream` (0 and `CU_STREAM_LEGACY` the legacy default
/// stream, `CU_STREAM_PER_THREAD` the calling thread's per-thread stream), keyed by the
/// driver's stream id, never by the handle's value.
///
/// # Safety
/// On CUDA, `raw` must be a live stream of the device's primary context (or one of the
/// special handles), and outlive every use of the returned stream and of blocks allocated
/// on it. On the simulator any value is sound.
pub unsafe fn stream(device: usize, raw: u64) -> Result<Stream> {
    let e = entry(device)?;
    Ok(stream_rec(e, raw)?.stream.clone())
}

/// The caller is about to destroy the stream of raw handle `raw` on `device` (as for
/// [`stream`]): the pool records its last event there and never calls on the handle
/// again; blocks still live on it stay valid and are fenced by that event when freed. A
/// later use of the same handle value names a new stream. The default streams (0, and on
/// CUDA `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`) cannot be destroyed and are refused; a
/// handle never given to the registry is not an error (there is nothing to forget).
///
/// # Safety
/// As [`stream`]: `raw` is still live.
pub unsafe fn stream_destroyed(device: usize, raw: u64) -> Result<()> {
    let e = entry(device)?;
    let special = match e.kind {
        DeviceKind::Cuda => matches!(raw, 0 | streams::CU_STREAM_LEGACY | streams::CU_STREAM_PER_THREAD),
        DeviceKind::Simulated => raw == 0,
    };
    if special {
        return Err(Error::InvalidArgument(format!("stream {raw:#x} is a default stream: it is never destroyed")));
    }
    let key = stream_key(e, raw)?;
    let forgot = e.streams.forget(key);
    // After the key is forgotten, so that a memo taken from now on keys the handle anew.
    GATE.fetch_add(1 << CAPTURE_BITS, Ordering::SeqCst);
    match forgot {
        // On a wrapped stream this runs the pool's hooks and marks the handle destroyed,
        // without destroying the caller's stream.
        Some(rec) => e.pool.device().destroy_stream(&rec.stream),
        None => Ok(()),
    }
}

/// Every pool made so far, with its device ordinal.
pub fn pools() -> Vec<(usize, Pool)> {
    entries().map(|e| (e.ordinal, e.pool.clone())).collect()
}

/// Trim every pool made so far ([`Pool::trim`]); the first error is returned, after all
/// were tried.
pub fn trim() -> Result<()> {
    let mut first = Ok(());
    for e in entries() {
        if let Err(err) = e.pool.trim() {
            first = first.and(Err(err));
        }
    }
    first
}

/// Write out the traces the pools record ([`crate::PoolConfig::record_trace`],
/// `VRAMPOOL_RECORD_TRACE`): the events written by every pool so far, or the first error,
/// after all were tried. The registry's pools are never dropped, so their last lines reach
/// the file here, or when the process exits normally (an `atexit` handler flushes every
/// pool no thread is writing to at that moment).
pub fn flush_traces() -> Result<u64> {
    let (mut events, mut first) = (0, None);
    for e in entries() {
        match e.pool.flush_trace() {
            Ok(n) => events += n,
            Err(err) => {
                first.get_or_insert(err);
            }
        }
    }
    first.map_or(Ok(events), Err)
}

/// Whether the registry's traces are paused ([`pause_traces`]): pools made later start so.
static TRACES_PAUSED: AtomicBool = AtomicBool::new(false);

/// Pause (`true`) or resume (`false`) the traces every pool of the registry records
/// ([`Pool::pause_trace`]), and those of pools it makes later: a program may pause before
/// its first allocation and record only what it resumes around.
pub fn pause_traces(paused: bool) {
    // SeqCst with the load after a new entry is published: either this walk finds the
    // entry, or its maker reads the new value.
    TRACES_PAUSED.store(paused, Ordering::SeqCst);
    entries().for_each(|e| e.pool.pause_trace(paused));
}

/// Register, once, the `atexit` handler of [`flush_traces`].
fn flush_traces_at_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    extern "C" fn at_exit() {
        // Nothing may unwind out of an exit handler.
        let _ = std::panic::catch_unwind(|| entries().for_each(|e| e.pool.flush_trace_if_idle()));
    }
    ONCE.call_once(|| {
        // SAFETY: `at_exit` is a plain `extern "C" fn()` that lives as long as the program
        // (the library is never unloaded while its pools live: they are never dropped).
        let rc = unsafe { libc::atexit(at_exit) };
        if rc != 0 {
            tracing::warn!("atexit refused the trace flush: call registry::flush_traces before exiting");
        }
    });
}

/// The entries made so far.
pub(crate) fn entries() -> impl Iterator<Item = &'static Entry> {
    // SAFETY: a published entry is never dropped or replaced (see the module docs).
    ENTRIES.iter().filter_map(|p| unsafe { p.load(Ordering::Acquire).as_ref() })
}

/// Whether the registry serves ordinal `device` (below [`MAX_DEVICES`]).
pub(crate) fn served(device: usize) -> Result<()> {
    if device < MAX_DEVICES {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("device {device}: the registry serves ordinals 0 to {}", MAX_DEVICES - 1)))
    }
}

/// Device `device`'s entry, made on first use.
#[inline]
pub(crate) fn entry(device: usize) -> Result<&'static Entry> {
    served(device)?;
    let slot = &ENTRIES[device];
    // SAFETY: as in `entries`.
    match unsafe { slot.load(Ordering::Acquire).as_ref() } {
        Some(e) => Ok(e),
        None => make_entry(device, slot),
    }
}

#[cold]
fn make_entry(device: usize, slot: &AtomicPtr<Entry>) -> Result<&'static Entry> {
    let config = config()?;
    let kind = device_kind()?;
    let _one = CREATE.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: as in `entries`.
    if let Some(e) = unsafe { slot.load(Ordering::Acquire).as_ref() } {
        return Ok(e);
    }
    let dev: Arc<dyn Device> = match kind {
        DeviceKind::Simulated => {
            if device >= config.sim_devices {
                return Err(Error::NoDevice(format!(
                    "no simulated device {device}: there are {} (VRAMPOOL_SIM_DEVICES)",
                    config.sim_devices
                )));
            }
            Arc::new(SimDevice::new(config.sim_bytes))
        }
        DeviceKind::Cuda => cuda_device(device)?,
    };
    let mut pool_config = config.pool.clone();
    if let Some(path) = pool_config.record_trace.as_mut().filter(|_| device > 0) {
        path.as_mut_os_string().push(format!(".{device}"));
    }
    let records = pool_config.record_trace.is_some();
    let pool = Pool::with_device(dev, pool_config)?;
    if records {
        flush_traces_at_exit();
    }
    let entry = Box::new(Entry { ordinal: device, pool, kind, streams: Streams::new(config.max_streams) });
    let p = Box::into_raw(entry);
    // Release: whoever loads the pointer sees the entry whole.
    slot.store(p, Ordering::Release);
    // SAFETY: just published, never dropped.
    let e = unsafe { &*p };
    if records {
        // After publishing (see `pause_traces`): a pause made meanwhile is not missed.
        std::sync::atomic::fence(Ordering::SeqCst);
        e.pool.pause_trace(TRACES_PAUSED.load(Ordering::SeqCst));
    }
    Ok(e)
}

#[cfg(feature = "cuda")]
fn cuda_device(device: usize) -> Result<Arc<dyn Device>> {
    let missing = crate::device::cuda::missing_symbols(&["cuStreamGetId"]).map_err(Error::NoDevice)?;
    if !missing.is_empty() {
        return Err(Error::NoDevice("the CUDA driver lacks cuStreamGetId (CUDA 12.0 or later is needed)".into()));
    }
    Ok(Arc::new(crate::CudaDevice::new(device)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_device: usize) -> Result<Arc<dyn Device>> {
    cuda_available().map(|_| unreachable!())
}

/// The C ABI's memo gate: one word that changes whenever a thread's memo of a stream handle
/// may have gone stale. Its low [`CAPTURE_BITS`] count the graph captures declared underway,
/// on any device (`vrampool_begin_allocate_to_pool` until its
/// `vrampool_end_allocate_to_pool`); the bits above count the streams declared destroyed
/// (whose handle values may name new streams next). A memo taken while the gate read `g`
/// still names its stream while the gate reads `g`: the ABI requires
/// `vrampool_stream_destroyed` before a stream is destroyed, so a handle names a new stream
/// only after the gate moved, and a capture declared since moves it too. So the CUDA
/// allocation hit path needs one load here instead of asking the driver for the handle's id
/// (`cuStreamGetId`) on every call.
static GATE: AtomicU64 = AtomicU64::new(0);
const CAPTURE_BITS: u32 = 24;
const CAPTURES: u64 = (1 << CAPTURE_BITS) - 1;

/// The memo gate now (see [`GATE`]). Relaxed is enough: a caller told that a stream was
/// destroyed (or a capture began) learned it through its own synchronization with the
/// thread that said so, which made the gate's change visible with it.
#[inline(always)]
pub(crate) fn gate() -> u64 {
    GATE.load(Ordering::Relaxed)
}

/// Whether a memo taken while the gate read `gate` may serve allocations without keying
/// the handle again: no capture was declared underway then.
#[inline]
pub(crate) fn gate_open(gate: u64) -> bool {
    gate & CAPTURES == 0
}

/// A capture was declared: until [`capture_ended`], stream handles are checked for capture
/// before they are keyed, and the C ABI's driver calls run in the RELAXED capture mode.
pub(crate) fn capture_began() {
    GATE.fetch_add(1, Ordering::SeqCst);
}

/// A capture declared by [`capture_began`] ended (the caller checked that one had begun).
pub(crate) fn capture_ended() {
    GATE.fetch_sub(1, Ordering::SeqCst);
}

/// Whether any declared capture is underway (one load: the C ABI's cold paths and stream
/// keys read it).
#[inline]
pub(crate) fn captures_underway() -> bool {
    !gate_open(gate())
}

/// The key the registry gives raw handle `raw` on `e`'s device, from the calling thread.
/// While a capture is declared underway, a handle being captured is refused with
/// [`Error::StreamCapturing`] before the driver is asked for its id: `cuStreamGetId` on a
/// capturing stream fails and invalidates the capture.
#[inline]
pub(crate) fn stream_key(e: &Entry, raw: u64) -> Result<u64> {
    match e.kind {
        DeviceKind::Simulated => Ok(raw),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => streams::cuda_key(raw, |r| {
            if captures_underway() && crate::device::cuda::raw_is_capturing(r)? {
                return Err(Error::StreamCapturing);
            }
            streams::cu_stream_id(r)
        }),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(Error::NoDevice("built without the `cuda` feature".into())),
    }
}

/// The stream of raw handle `raw` on `e`'s device, made the first time its key is seen.
pub(crate) fn stream_rec(e: &Entry, raw: u64) -> Result<Arc<StreamRec>> {
    stream_rec_keyed(e, raw, stream_key(e, raw)?)
}

/// [`stream_rec`] for a caller that has the handle's key already ([`stream_key`]: one driver
/// call on CUDA, not made twice).
pub(crate) fn stream_rec_keyed(e: &Entry, raw: u64, key: u64) -> Result<Arc<StreamRec>> {
    e.streams.get_or_make(key, raw, || match e.kind {
        DeviceKind::Simulated => e.pool.device().create_stream(),
        // SAFETY: the caller of the C ABI (or of `stream`) promised a live stream of the
        // device's primary context; the wrapper never destroys it.
        DeviceKind::Cuda => unsafe { e.pool.device().wrap_stream(raw) },
    })
}
