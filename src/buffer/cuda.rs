//! [`CudaBuffer<T>`]: a [`Buffer<T>`] on a cudarc stream, accepted wherever cudarc 0.19
//! takes a device slice (`DeviceSlice`, `DevicePtr`, `DevicePtrMut`) and as a kernel argument
//! (`PushKernelArg`), with its views.
//!
//! - **The stream is borrowed, not cloned.** A `CudaBuffer<'s, T>` holds `&'s Arc<CudaStream>`
//!   (cudarc's `DeviceSlice::stream` must hand out an `&Arc`), borrowed from the [`Stream`] it
//!   was allocated on, whose handle holds the cudarc `Arc`
//!   ([`crate::CudaDevice::wrap_cudarc_stream`]). Cloning the `Arc` per allocation would put
//!   an atomic read-modify-write on the allocation's hit path and another on the free's;
//!   the lifetime costs nothing at run time.
//! - **cudarc's contract for `device_ptr(&other)`** (its docs on `DevicePtr`/`DevicePtrMut`):
//!   `other` must wait for earlier writes (for `_mut`, reads and writes) before the returned
//!   pointer is used, and the buffer must not be freed before `other`'s use is done. On the
//!   buffer's own stream, stream order gives both and the call does nothing. On another
//!   stream it makes `other` wait for the buffer's stream (an event: all of that stream's
//!   work so far, which covers every earlier use there; skipped when the user turned
//!   cudarc's event tracking off, as cudarc's own slices do), then records the use on the
//!   block (`Block::record_stream`: the free waits for `other`'s work enqueued before it),
//!   so the guard it returns is `SyncOnDrop::Sync(None)`. When `other` was never wrapped by
//!   vrampool there is no handle to record the use on: the guard then synchronizes `other`
//!   when dropped (after cudarc has enqueued the operation), so the use is over before the
//!   buffer can be freed. Wrap every stream that uses buffers
//!   (`CudaDevice::wrap_cudarc_stream`) to keep cross-stream use asynchronous.
//! - **What is not tracked**: work enqueued on the buffer's own stream *after* a use on
//!   another stream is not ordered after that use (as with PyTorch's `record_stream`): when
//!   such work writes the buffer, make the buffer's stream wait for the other one
//!   (`own.join(&other)`).
//! - **Kernel arguments**: cudarc's launch builder does not tell an argument its stream, so
//!   `arg(&buf)` pushes the address and nothing else: launched on the buffer's own stream
//!   that is all it needs; launched on another stream, call [`CudaBuffer::use_on`] with that
//!   stream first (the same wait and record as `device_ptr`).

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{
    sys::CUdeviceptr, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use super::view::bounds;
use super::{Buffer, Elem};
use crate::device::cuda::wrapped_stream;
use crate::device::{Stream, StreamId};
use crate::error::{Error, Result};
use crate::{Block, Pool, StreamCache};

/// The cudarc stream behind `stream`, or why there is none.
fn cudarc_of(stream: &Stream) -> Result<&Arc<CudaStream>> {
    stream.cudarc_stream().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "stream {} was not made from a cudarc stream (CudaDevice::wrap_cudarc_stream)",
            stream.id()
        ))
    })
}

/// Whether `a` and `b` are one stream (the same `Arc`, or two handles of one `CUstream` in
/// one context).
#[inline(always)]
fn same_stream(a: &CudaStream, b: &CudaStream) -> bool {
    std::ptr::eq(a, b) || a == b
}

/// The vrampool handle of `other` to record a use of a buffer of `own`'s context on.
fn recordable(own: &CudaStream, other: &CudaStream) -> Option<Stream> {
    let s = wrapped_stream(other)?;
    (other.context().cu_ctx() == own.context().cu_ctx()).then_some(s)
}

/// `device_ptr`'s work for a use of `block` (on `own`) on `other` (see the module docs).
#[inline(always)]
fn enter<'a>(block: &Block, own: &CudaStream, other: &'a CudaStream) -> SyncOnDrop<'a> {
    if same_stream(own, other) {
        SyncOnDrop::Sync(None)
    } else {
        cross_stream(block, own, other)
    }
}

#[cold]
#[inline(never)]
fn cross_stream<'a>(block: &Block, own: &CudaStream, other: &'a CudaStream) -> SyncOnDrop<'a> {
    if own.context().is_event_tracking() {
        // cudarc's way to report a failure where no Result can be returned: the next call
        // on that context returns it.
        other.context().record_err(other.join(own));
    }
    match recordable(own, other) {
        Some(s) => {
            block.record_stream(&s);
            SyncOnDrop::Sync(None)
        }
        None => SyncOnDrop::Sync(Some(other)),
    }
}

/// [`CudaBuffer::use_on`]'s work, shared with the views.
fn use_on(block: &Block, own: &CudaStream, other: &CudaStream) -> Result<()> {
    if same_stream(own, other) {
        return Ok(());
    }
    let s = recordable(own, other).ok_or_else(|| {
        Error::InvalidArgument(
            "the stream is not known to vrampool (CudaDevice::wrap_cudarc_stream) or is of another context: \
             a use there cannot be recorded"
                .into(),
        )
    })?;
    other.join(own).map_err(|e| crate::device::cuda::cudarc_driver_error("cuStreamWaitEvent", e))?;
    block.record_stream(&s);
    Ok(())
}

/// `len` elements of `T` from a pool on a [`crate::CudaDevice`], for use on a cudarc stream:
/// accepted by cudarc 0.19's copies, memsets and kernel launches (`DevicePtr<T>`,
/// `DevicePtrMut<T>`, `PushKernelArg`). Dropping it frees it in stream order on its stream.
/// `Send`, not `Sync`, as a [`Block`] (a use on another stream is recorded on the block
/// without a lock): data that several threads read is one buffer per thread, or a cudarc
/// `CudaSlice`.
///
/// Made by [`Pool::alloc_cuda_buffer`], [`Pool::alloc_cuda_zeroed`],
/// [`StreamCache::alloc_cuda_buffer`] or [`Buffer::with_cudarc_stream`], on a [`Stream`]
/// made from a cudarc stream; `'s` is that handle's borrow. Used on another stream through
/// cudarc's API, it makes that stream wait and records the use (see the module docs of
/// `vrampool::buffer` in the crate's source, and [`CudaBuffer::use_on`] for kernel launches).
///
/// ```no_run
/// use vrampool::cudarc::driver::{CudaContext, DevicePtr};
/// use vrampool::{CudaDevice, Pool, PoolConfig};
/// let ctx = CudaContext::new(0)?;
/// let dev = CudaDevice::from_cudarc(&ctx)?;
/// let pool = Pool::new(dev.clone(), PoolConfig::default())?;
/// let cs = ctx.new_stream()?;
/// let s = dev.wrap_cudarc_stream(&cs)?;
/// let mut x = pool.alloc_cuda_buffer::<f32>(1024, &s)?;
/// cs.memcpy_htod(&vec![1.0f32; 1024], &mut x)?;
/// let back: Vec<f32> = cs.clone_dtoh(&x)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaBuffer<'s, T> {
    buf: Buffer<T>,
    /// The device address, as a field: a kernel argument is a pointer to it.
    ptr: CUdeviceptr,
    stream: &'s Arc<CudaStream>,
}

impl<'s, T: Pod> CudaBuffer<'s, T> {
    fn new(buf: Buffer<T>, stream: &'s Arc<CudaStream>) -> Self {
        CudaBuffer { ptr: buf.device_ptr(), buf, stream }
    }

    /// Elements in the buffer.
    #[inline]
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer holds no element.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The device address (a `CUdeviceptr`), for code that calls the driver itself; cudarc's
    /// API takes the buffer.
    #[inline]
    pub fn cu_device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The id of the vrampool stream the buffer was allocated on, and will be freed on.
    #[inline]
    pub fn stream_id(&self) -> StreamId {
        self.buf.stream_id()
    }

    /// The cudarc stream the buffer belongs to (as `DeviceSlice::stream`).
    #[inline]
    pub fn cudarc_stream(&self) -> &'s Arc<CudaStream> {
        self.stream
    }

    /// The typed buffer underneath (read-only: swapping it for another would break the tie
    /// between the memory and its stream).
    pub fn as_buffer(&self) -> &Buffer<T> {
        &self.buf
    }

    /// The typed buffer underneath, without the cudarc stream.
    pub fn into_buffer(self) -> Buffer<T> {
        self.buf
    }

    /// Prepare the buffer for work on `other`, a stream other than its own, that cudarc
    /// cannot tell it about (a kernel launch: `launch_builder` does not give its arguments
    /// its stream): `other` waits for the buffer's stream's work so far, and the buffer's
    /// free waits for `other`'s work enqueued before the free. Call it before the launch.
    /// [`Error::InvalidArgument`] when `other` was not wrapped by vrampool (the use could
    /// not be recorded) or is of another context. Does nothing on the buffer's own stream.
    pub fn use_on(&self, other: &CudaStream) -> Result<()> {
        use_on(self.buf.as_block(), self.stream, other)
    }

    /// The whole buffer as a view.
    pub fn view(&self) -> CudaBufferView<'_, T> {
        CudaBufferView {
            ptr: self.ptr,
            len: self.len(),
            block: self.buf.as_block(),
            stream: self.stream,
            _elem: PhantomData,
        }
    }

    /// The whole buffer as a writable view.
    pub fn view_mut(&mut self) -> CudaBufferViewMut<'_, T> {
        CudaBufferViewMut {
            ptr: self.ptr,
            len: self.len(),
            block: self.buf.as_block(),
            stream: self.stream,
            _elem: PhantomData,
        }
    }

    /// Elements `range` as a view (cudarc's `slice`); [`Error::InvalidArgument`] when the
    /// range is reversed or past the end.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<CudaBufferView<'_, T>> {
        self.view().into_slice(range)
    }

    /// Elements `range` as a writable view; [`Error::InvalidArgument`] when the range is
    /// reversed or past the end.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<CudaBufferViewMut<'_, T>> {
        self.view_mut().into_slice(range)
    }
}

impl<T> fmt::Debug for CudaBuffer<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("buffer", &self.buf)
            .field("cu_stream", &format_args!("{:p}", self.stream.cu_stream()))
            .finish()
    }
}

/// Elements `[start, end)` of a [`CudaBuffer`], readable (`DevicePtr<T>`).
pub struct CudaBufferView<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    block: &'a Block,
    stream: &'a Arc<CudaStream>,
    _elem: PhantomData<&'a [T]>,
}

/// Elements `[start, end)` of a [`CudaBuffer`], writable (`DevicePtrMut<T>`): no other view
/// overlaps it.
pub struct CudaBufferViewMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    block: &'a Block,
    stream: &'a Arc<CudaStream>,
    _elem: PhantomData<&'a mut [T]>,
}

impl<T> Clone for CudaBufferView<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for CudaBufferView<'_, T> {}

impl<'a, T: Pod> CudaBufferView<'a, T> {
    /// Elements in the view.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no element.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the view's first element.
    #[inline]
    pub fn cu_device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Elements `range` of this view (indices relative to it).
    pub fn into_slice(self, range: impl RangeBounds<usize>) -> Result<CudaBufferView<'a, T>> {
        let (s, e) = bounds(range, self.len)?;
        Ok(CudaBufferView { ptr: self.ptr + (s * Elem::<T>::SIZE) as u64, len: e - s, ..self })
    }

    /// See [`CudaBuffer::use_on`].
    pub fn use_on(&self, other: &CudaStream) -> Result<()> {
        use_on(self.block, self.stream, other)
    }
}

impl<'a, T: Pod> CudaBufferViewMut<'a, T> {
    /// Elements in the view.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no element.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the view's first element.
    #[inline]
    pub fn cu_device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// This view, read-only.
    pub fn as_view(&self) -> CudaBufferView<'_, T> {
        CudaBufferView { ptr: self.ptr, len: self.len, block: self.block, stream: self.stream, _elem: PhantomData }
    }

    /// Elements `range` of this view (indices relative to it), writable.
    pub fn into_slice(self, range: impl RangeBounds<usize>) -> Result<CudaBufferViewMut<'a, T>> {
        let (s, e) = bounds(range, self.len)?;
        Ok(CudaBufferViewMut { ptr: self.ptr + (s * Elem::<T>::SIZE) as u64, len: e - s, ..self })
    }

    /// The view split at element `mid` into two writable views, `[0, mid)` and `[mid, len)`.
    pub fn split_at_mut(self, mid: usize) -> Result<(CudaBufferViewMut<'a, T>, CudaBufferViewMut<'a, T>)> {
        if mid > self.len {
            return Err(Error::InvalidArgument(format!("split at {mid} of a view of {} elements", self.len)));
        }
        let right = CudaBufferViewMut {
            ptr: self.ptr + (mid * Elem::<T>::SIZE) as u64,
            len: self.len - mid,
            block: self.block,
            stream: self.stream,
            _elem: PhantomData,
        };
        Ok((CudaBufferViewMut { len: mid, ..self }, right))
    }

    /// See [`CudaBuffer::use_on`].
    pub fn use_on(&self, other: &CudaStream) -> Result<()> {
        use_on(self.block, self.stream, other)
    }
}

impl<T> fmt::Debug for CudaBufferView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBufferView").field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}

impl<T> fmt::Debug for CudaBufferViewMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBufferViewMut")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

// cudarc's traits. `DeviceSlice::len` is in elements; `stream` is the buffer's.

impl<T: Pod> DeviceSlice<T> for CudaBuffer<'_, T> {
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T: Pod> DevicePtr<T> for CudaBuffer<'_, T> {
    #[inline]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, enter(self.buf.as_block(), self.stream, stream))
    }
}

impl<T: Pod> DevicePtrMut<T> for CudaBuffer<'_, T> {
    #[inline]
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, enter(self.buf.as_block(), self.stream, stream))
    }
}

impl<T: Pod> DeviceSlice<T> for CudaBufferView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T: Pod> DevicePtr<T> for CudaBufferView<'_, T> {
    #[inline]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, enter(self.block, self.stream, stream))
    }
}

impl<T: Pod> DeviceSlice<T> for CudaBufferViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T: Pod> DevicePtr<T> for CudaBufferViewMut<'_, T> {
    #[inline]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, enter(self.block, self.stream, stream))
    }
}

impl<T: Pod> DevicePtrMut<T> for CudaBufferViewMut<'_, T> {
    #[inline]
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, enter(self.block, self.stream, stream))
    }
}

// Kernel arguments: a pointer to the `CUdeviceptr` field, pushed through cudarc's own impl
// for `&u64` (cudarc's `LaunchArgs` keeps its argument list to itself).

// SAFETY: the argument pushed is a pointer to `arg.ptr`, a `CUdeviceptr` (`u64`, the
// parameter type of a kernel's pointer argument) inside `arg`, which is borrowed for 'b, so
// it outlives the launch arguments ('b: 'a); the driver copies it at launch.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaBuffer<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CudaBuffer<'_, T>) -> &mut Self {
        <Self as PushKernelArg<&'b CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for `&CudaBuffer`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaBuffer<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CudaBuffer<'_, T>) -> &mut Self {
        let arg: &'b CudaBuffer<'_, T> = arg;
        <Self as PushKernelArg<&'b CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for `&CudaBuffer`: `arg.ptr` lives inside the view, borrowed for 'b.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaBufferView<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CudaBufferView<'_, T>) -> &mut Self {
        <Self as PushKernelArg<&'b CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for `&CudaBuffer`: `arg.ptr` lives inside the view, borrowed for 'b.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaBufferViewMut<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CudaBufferViewMut<'_, T>) -> &mut Self {
        let arg: &'b CudaBufferViewMut<'_, T> = arg;
        <Self as PushKernelArg<&'b CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

impl<T: Pod> Buffer<T> {
    /// This buffer on the cudarc stream of `stream`, which must be the stream it was
    /// allocated on, made from a cudarc stream. On an error the buffer is dropped (freed).
    pub fn with_cudarc_stream(self, stream: &Stream) -> Result<CudaBuffer<'_, T>> {
        if stream.id() != self.stream_id() {
            return Err(Error::InvalidArgument(format!(
                "buffer of stream {} given stream {}",
                self.stream_id(),
                stream.id()
            )));
        }
        Ok(CudaBuffer::new(self, cudarc_of(stream)?))
    }
}

impl Pool {
    /// Allocate a [`CudaBuffer`] of `len` elements of `T` on `stream`, a stream made from a
    /// cudarc stream ([`crate::CudaDevice::wrap_cudarc_stream`]); the buffer borrows the
    /// handle. The hit path is [`Pool::alloc_buffer`]'s. [`Error::InvalidArgument`] for a
    /// stream not made from cudarc, or a length that overflows.
    #[inline]
    #[track_caller]
    pub fn alloc_cuda_buffer<'s, T: Pod>(&self, len: usize, stream: &'s Stream) -> Result<CudaBuffer<'s, T>> {
        let cs = cudarc_of(stream)?;
        Ok(CudaBuffer::new(self.alloc_buffer(len, stream)?, cs))
    }

    /// [`Pool::alloc_cuda_buffer`], then every byte set to zero on `stream` (in stream
    /// order).
    #[track_caller]
    pub fn alloc_cuda_zeroed<'s, T: Pod>(&self, len: usize, stream: &'s Stream) -> Result<CudaBuffer<'s, T>> {
        let cs = cudarc_of(stream)?;
        Ok(CudaBuffer::new(self.alloc_zeroed(len, stream)?, cs))
    }
}

impl StreamCache {
    /// Allocate a [`CudaBuffer`] of `len` elements of `T` on the cache's stream, which must
    /// have been made from a cudarc stream; the buffer borrows the cache. The hit path is
    /// [`StreamCache::alloc_buffer`]'s.
    #[inline]
    #[track_caller]
    pub fn alloc_cuda_buffer<T: Pod>(&self, len: usize) -> Result<CudaBuffer<'_, T>> {
        let cs = cudarc_of(self.stream())?;
        Ok(CudaBuffer::new(self.alloc_buffer(len)?, cs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PoolConfig, SimDevice};

    #[test]
    fn a_stream_not_made_from_cudarc_gets_no_cuda_buffer_and_allocates_nothing() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let s = dev.new_stream().unwrap();
        assert!(matches!(pool.alloc_cuda_buffer::<f32>(16, &s), Err(Error::InvalidArgument(_))));
        assert!(matches!(pool.alloc_cuda_zeroed::<f32>(16, &s), Err(Error::InvalidArgument(_))));
        let cache = pool.stream_cache(&s).unwrap();
        assert!(matches!(cache.alloc_cuda_buffer::<f32>(16), Err(Error::InvalidArgument(_))));
        assert_eq!(pool.stats().allocs, 0);
        let b = pool.alloc_buffer::<f32>(16, &s).unwrap();
        assert!(matches!(b.with_cudarc_stream(&s), Err(Error::InvalidArgument(_))));
        assert_eq!(pool.stats().live_blocks, 0, "the buffer was freed with the error");
    }

    #[test]
    fn a_cuda_buffer_is_a_block_and_a_borrowed_stream() {
        // The layout promise of the module docs: the buffer, its address, one reference.
        assert_eq!(std::mem::size_of::<CudaBuffer<'static, f32>>(), std::mem::size_of::<Block>() + 16);
        assert_eq!(std::mem::size_of::<Buffer<f32>>(), std::mem::size_of::<Block>());
    }
}
