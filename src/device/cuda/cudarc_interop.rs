//! cudarc interop: [`Stream`]s made from cudarc's `Arc<CudaStream>` (and back), and the
//! [`CudaDevice`] of a cudarc context.
//!
//! - **One context.** `CudaDevice::new(n)` retains device `n`'s primary context
//!   (`cuDevicePrimaryCtxRetain`), and so does cudarc 0.19's `CudaContext::new(n)` (read in
//!   its source: `result::primary_ctx::retain`, `is_primary: true`): the two share one
//!   context, its memory and its streams, and neither releases the other's reference. A
//!   non-primary cudarc context (`new_non_primary`, `from_raw_context`) is refused.
//! - **A cudarc stream is wrapped once.** [`CudaDevice::wrap_cudarc_stream`] gives the same
//!   [`Stream`] (the same [`crate::StreamId`], so the same caches and depots in every pool)
//!   for the same `Arc<CudaStream>` until that stream is destroyed through vrampool: wrapped
//!   streams are kept in a process-wide table keyed by the address of cudarc's `CudaStream`.
//!   The table's entry holds the `Arc`, so the address cannot be reused while it is there;
//!   readers (a buffer used on another stream looks its stream up) load the table without a
//!   lock (`ArcSwap`), and writers (wrapping, destroying) take one lock, on no allocation or
//!   free path.
//! - **Wrapped streams are never destroyed by vrampool.** The handle holds the cudarc `Arc`,
//!   so the raw `CUstream` lives as long as any clone of the handle (a pool keeps one for
//!   every stream it served until `Pool::destroy_stream`); when the last goes, cudarc's own
//!   drop decides (it destroys only streams cudarc created). A handle dropped inside a host
//!   function parks its `Arc` with the device, since cudarc's drop would call the driver
//!   there (refused, and the error would surface at the user's next cudarc call).
//! - **Back:** [`Stream::cudarc_stream`] gives the `Arc` a handle was made from; for streams
//!   vrampool made itself, [`CudaDevice::create_cudarc_stream`] makes them through cudarc in
//!   the first place, and [`CudaDevice::cudarc_stream_of`] lends any stream of the device to
//!   cudarc (unsafe: the caller keeps the handle alive).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, LazyLock, Mutex};

use arc_swap::ArcSwap;
use cudarc::driver::{CudaContext, DriverError};

use super::{driver_error, lock, missing_symbols, CudaDevice, CudaStream};
use crate::device::{implement, Stream};
use crate::error::{Error, Result};

/// The handle value of CUDA's per-thread default stream (`CU_STREAM_PER_THREAD`).
const PER_THREAD_STREAM: usize = 0x2;

/// Driver symbols that cudarc's safe API calls on the paths used here, beyond those
/// `CudaDevice::new` already checked (cudarc resolves symbols lazily and panics on a missing one).
const INTEROP_SYMBOLS: &[&str] = &["cuDeviceGetAttribute", "cuCtxSynchronize"];

/// Wrapped cudarc streams, by the address of cudarc's `CudaStream` (inside its `Arc`).
static WRAPPED: LazyLock<ArcSwap<HashMap<usize, Stream>>> = LazyLock::new(|| ArcSwap::from_pointee(HashMap::new()));
/// Serialises the table's writers (each replaces the whole map).
static WRITERS: Mutex<()> = Mutex::new(());

fn key(s: &cudarc::driver::CudaStream) -> usize {
    s as *const cudarc::driver::CudaStream as usize
}

/// The handle [`CudaDevice::wrap_cudarc_stream`] made for `s`, if it is still live. Lock-free.
pub(crate) fn wrapped_stream(s: &cudarc::driver::CudaStream) -> Option<Stream> {
    WRAPPED.load().get(&key(s)).filter(|h| !h.is_destroyed()).cloned()
}

/// Drop the table's entry for `k` if it is still the handle `id` (a stream destroyed through
/// vrampool; a later wrap of the same cudarc stream makes a new handle).
fn unregister(k: usize, id: crate::StreamId) {
    let _w = lock(&WRITERS);
    let map = WRAPPED.load_full();
    if map.get(&k).is_some_and(|h| h.id() == id) {
        let mut next = HashMap::clone(&map);
        let gone = next.remove(&k);
        WRAPPED.store(Arc::new(next));
        // Once out of the table: dropping the last handle may make cudarc call the driver.
        drop(gone);
    }
}

/// A cudarc driver error as vrampool's.
pub(crate) fn cudarc_driver_error(call: &'static str, e: DriverError) -> Error {
    driver_error(call, e.0)
}

fn cudarc_error(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| cudarc_driver_error(call, e)
}

impl CudaDevice {
    /// The device of a cudarc context: `ctx` must be a primary context (`CudaContext::new`),
    /// which is the one vrampool uses; a non-primary one is refused
    /// ([`Error::InvalidArgument`]).
    pub fn from_cudarc(ctx: &Arc<CudaContext>) -> Result<CudaDevice> {
        if !ctx.is_primary() {
            return Err(Error::InvalidArgument(format!(
                "cudarc context of device {} is not its primary context: vrampool allocates on the \
                 primary context (cudarc's CudaContext::new)",
                ctx.ordinal()
            )));
        }
        let dev = CudaDevice::new(ctx.ordinal())?;
        if dev.context_raw() != ctx.cu_ctx() as u64 {
            return Err(Error::InvalidArgument(format!(
                "cudarc context {:#x} is not device {}'s primary context {:#x}",
                ctx.cu_ctx() as u64,
                ctx.ordinal(),
                dev.context_raw()
            )));
        }
        Ok(dev)
    }

    /// A cudarc context on this device's primary context (cudarc's `CudaContext::new`, the
    /// same context vrampool uses). Each call makes a new cudarc handle of that one context:
    /// call it once and share the `Arc`, since cudarc keeps its multi-stream bookkeeping per
    /// handle.
    pub fn cudarc_context(&self) -> Result<Arc<CudaContext>> {
        let _scope = self.inner.enter()?;
        let missing = missing_symbols(INTEROP_SYMBOLS).map_err(Error::NoDevice)?;
        if !missing.is_empty() {
            return Err(Error::NoDevice(format!("the CUDA driver is too old: it lacks {}", missing.join(", "))));
        }
        let ctx = CudaContext::new(self.ordinal()).map_err(cudarc_error("CudaContext::new"))?;
        if ctx.cu_ctx() as usize != self.inner.ctx {
            return Err(Error::InvalidArgument(format!(
                "cudarc's context for device {} ({:#x}) is not the primary context ({:#x})",
                self.ordinal(),
                ctx.cu_ctx() as usize,
                self.inner.ctx
            )));
        }
        Ok(ctx)
    }

    /// The [`Stream`] for a cudarc stream of this device's primary context, to allocate on it
    /// and to use pool memory on it. Wrapping the same `Arc` again gives the same handle (the
    /// same [`crate::StreamId`]) until the stream is destroyed through vrampool
    /// ([`crate::Pool::destroy_stream`] or [`crate::Device::destroy_stream`], which only
    /// mark a wrapped stream destroyed: cudarc still owns it).
    ///
    /// The handle (and so every pool that served it, until `destroy_stream`) keeps the cudarc
    /// stream alive. Fails for a stream of another context, and for cudarc's per-thread
    /// stream (its handle names a different stream on each thread).
    pub fn wrap_cudarc_stream(&self, stream: &Arc<cudarc::driver::CudaStream>) -> Result<Stream> {
        let _scope = self.inner.enter()?;
        if stream.context().cu_ctx() as usize != self.inner.ctx {
            return Err(Error::InvalidArgument(format!(
                "cudarc stream of context {:#x}, not device {}'s primary context {:#x}",
                stream.context().cu_ctx() as usize,
                self.ordinal(),
                self.inner.ctx
            )));
        }
        let raw = stream.cu_stream() as usize;
        if raw == PER_THREAD_STREAM {
            return Err(Error::InvalidArgument(
                "cudarc's per-thread stream names a different stream on each thread: wrap a stream of its own".into(),
            ));
        }
        if let Some(found) = wrapped_stream(stream) {
            return Ok(found);
        }
        let _w = lock(&WRITERS);
        if let Some(found) = wrapped_stream(stream) {
            return Ok(found);
        }
        let backend = CudaStream {
            raw,
            owned_live: AtomicBool::new(false),
            owned: false,
            device: self.inner.clone(),
            cudarc: Some(Arc::clone(stream)),
        };
        let handle = implement::new_stream(raw as u64, Box::new(backend));
        let k = key(stream);
        implement::on_destroy(&handle, Box::new(move |s| unregister(k, s.id())));
        let mut next = HashMap::clone(&WRAPPED.load_full());
        // A destroyed handle left under the key (its hook has not run yet) is replaced.
        next.insert(k, handle.clone());
        WRAPPED.store(Arc::new(next));
        Ok(handle)
    }

    /// A new cudarc stream (`ctx.new_stream()`, non-blocking) on this device's primary
    /// context, wrapped: [`Stream::cudarc_stream`] gives it back to cudarc. `ctx` is the
    /// cudarc handle to make it on ([`CudaDevice::cudarc_context`], or the application's own).
    pub fn create_cudarc_stream(&self, ctx: &Arc<CudaContext>) -> Result<Stream> {
        let _scope = self.inner.enter()?;
        if ctx.cu_ctx() as usize != self.inner.ctx {
            return Err(Error::InvalidArgument("cudarc context is not this device's primary context".into()));
        }
        let stream = ctx.new_stream().map_err(cudarc_error("CudaContext::new_stream"))?;
        self.wrap_cudarc_stream(&stream)
    }

    /// Lend `stream`, a stream of this device that vrampool created or wrapped from a raw
    /// handle, to cudarc (`wrap_borrowed_stream`: cudarc never destroys it). For a stream
    /// made from cudarc, this is the `Arc` it was made from.
    ///
    /// # Safety
    /// Unless the stream came from cudarc, the returned `Arc` (and every clone of it) must
    /// not be used once every clone of `stream` is dropped or the stream destroyed.
    pub unsafe fn cudarc_stream_of(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &Stream,
    ) -> Result<Arc<cudarc::driver::CudaStream>> {
        let _scope = self.inner.enter()?;
        let h = self.inner.stream(stream)?;
        if let Some(s) = &h.cudarc {
            return Ok(Arc::clone(s));
        }
        if ctx.cu_ctx() as usize != self.inner.ctx {
            return Err(Error::InvalidArgument("cudarc context is not this device's primary context".into()));
        }
        // SAFETY: a live stream of this context (checked just above); the caller keeps it
        // alive while cudarc uses it, and cudarc's wrapper never destroys it.
        Ok(unsafe { ctx.wrap_borrowed_stream(h.raw()) })
    }
}

impl Stream {
    /// The cudarc stream this handle was made from ([`CudaDevice::wrap_cudarc_stream`]);
    /// `None` for other streams.
    pub fn cudarc_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        implement::stream_backend::<CudaStream>(self)?.cudarc.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_streams_have_no_cudarc_stream() {
        let sim = crate::SimDevice::new(1 << 30);
        let s = sim.new_stream().unwrap();
        assert!(s.cudarc_stream().is_none());
    }

    /// With a GPU: the same cudarc stream wraps to the same handle, the handle gives the
    /// stream back, destroying the handle forgets it, and a wrap after that is a new stream.
    #[test]
    fn a_cudarc_stream_wraps_to_one_handle_until_destroyed() {
        let Ok(dev) = CudaDevice::new(0) else { return };
        let ctx = dev.cudarc_context().unwrap();
        assert_eq!(CudaDevice::from_cudarc(&ctx).unwrap().context_raw(), dev.context_raw());
        let cs = ctx.new_stream().unwrap();
        let a = dev.wrap_cudarc_stream(&cs).unwrap();
        let b = dev.wrap_cudarc_stream(&cs).unwrap();
        assert_eq!(a.id(), b.id());
        assert!(Arc::ptr_eq(a.cudarc_stream().unwrap(), &cs));
        assert_eq!(wrapped_stream(&cs).map(|s| s.id()), Some(a.id()));
        crate::Device::destroy_stream(&dev, &a).unwrap();
        assert!(wrapped_stream(&cs).is_none());
        let c = dev.wrap_cudarc_stream(&cs).unwrap();
        assert_ne!(c.id(), a.id());
        // cudarc still owns the stream: it works after vrampool's handle was destroyed.
        cs.synchronize().unwrap();
        assert!(dev.wrap_cudarc_stream(&ctx.per_thread_stream()).is_err());
    }
}
