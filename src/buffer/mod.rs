//! Typed buffers: [`Buffer<T>`], a pool block holding `len` elements of a plain-old-data
//! `T`, its views ([`BufferView`], [`BufferViewMut`]), and host copies that work on every
//! device; with the `cuda` feature, [`CudaBuffer`], the same tied to a cudarc stream.
//!
//! This module owns the element arithmetic (a length in elements to bytes, checked), the
//! sub-range views and the host copies; the memory is the pool's, untouched.
//!
//! - **A buffer is a block.** `Buffer<T>` is a newtype over [`Block`] (six words, the same
//!   layout), its length in elements derived from the block's bytes, so `alloc_buffer` is
//!   `alloc` after one checked multiply by a constant: the same hit path, no extra word to
//!   move, and `Result<Buffer<T>, Error>` is the size of a block, as `Result<Block, Error>`
//!   is (a test checks). `benches/buffer.rs` compares the two pairs in one run; the hit path
//!   is the block's only where the compiler inlines the pool's `alloc` into the caller (see
//!   `IMPLEMENTATION.md`, known limits), hence `#[inline(always)]` here.
//! - **Invariants**: the block asked for exactly `len * size_of::<T>()` bytes; its address
//!   is aligned to [`crate::ALIGN`] (256 bytes), which every `T` allowed here divides; a view
//!   lies inside its buffer (checked when made). Overflowing lengths and ranges out of bounds
//!   are [`Error::InvalidArgument`], never panics.
//! - **Element types are [`bytemuck::Pod`]**: the ecosystem's plain-old-data trait, which
//!   users derive for their own `#[repr(C)]` structs (`#[derive(Pod, Zeroable)]` checks there
//!   is no padding and every field is `Pod`), and which `half::f16`/`bf16` implement. Any
//!   byte pattern the device leaves is a valid `T` (so a device-to-host copy is safe), zero
//!   bytes are a valid `T` (so [`crate::Pool::alloc_zeroed`] is), and the host copies are
//!   byte casts with no `unsafe` of ours. `bool` and `char` are excluded, rightly: a copy of
//!   device bytes into them could make an invalid value. An own unsafe marker trait would
//!   have made users write `unsafe impl`s and repeat bytemuck's checks by hand. Zero-sized
//!   types and types aligned to more than 256 bytes are refused at compile time (an
//!   associated constant fails to evaluate), so no runtime check sits on the hit path.
//! - **Host copies take the pool**: a buffer knows its stream's id but not its device (a
//!   block carries no device handle, to stay six words), so `copy_from_host`, `copy_to_host`
//!   and `fill_zeros` take the `&Pool` the buffer came from (checked: the range must lie in
//!   the pool's reserved range) and the stream to run on. Copies return once done on the
//!   device (`Device::copy_to_device` / `copy_from_device`), so they need no `record_stream`
//!   on any stream; `fill_zeros` is asynchronous and records a use on a stream other than the
//!   buffer's. Work on the buffer's own stream is not waited for by a copy on another
//!   stream: order the two (an event) as for any cross-stream use.

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;

use bytemuck::Pod;

use crate::device::{Stream, StreamId};
use crate::error::{Error, Result};
use crate::{Block, Pool, StreamCache};

mod view;
pub use view::{BufferView, BufferViewMut};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{CudaBuffer, CudaBufferView, CudaBufferViewMut};

/// Compile-time facts about an element type.
struct Elem<T>(PhantomData<T>);

impl<T: Pod> Elem<T> {
    /// `size_of::<T>()`, evaluated only for types a buffer can hold: a zero-sized `T` or one
    /// aligned past the pool's 256 bytes fails to compile where a buffer of it is made.
    const SIZE: usize = {
        assert!(std::mem::size_of::<T>() != 0, "vrampool buffers cannot hold zero-sized types");
        assert!(
            std::mem::align_of::<T>() as u64 <= crate::ALIGN,
            "vrampool buffers hold types aligned to at most 256 bytes (the pool's block alignment)"
        );
        std::mem::size_of::<T>()
    };
}

/// Bytes of `len` elements of `T`, or the error for a length that overflows.
#[inline(always)]
fn bytes_of<T: Pod>(len: usize) -> Result<usize> {
    match len.checked_mul(Elem::<T>::SIZE) {
        Some(bytes) => Ok(bytes),
        None => Err(overflow(len, Elem::<T>::SIZE)),
    }
}

#[cold]
#[inline(never)]
fn overflow(len: usize, size: usize) -> Error {
    Error::InvalidArgument(format!("a buffer of {len} elements of {size} bytes overflows the address space"))
}

/// `len` elements of `T` in device memory from a [`Pool`]: a [`Block`] with a type. Dropping
/// it frees it in stream order on its stream, as a block. `Send`, not `Sync`.
///
/// Made by [`Pool::alloc_buffer`], [`Pool::alloc_zeroed`], [`Pool::alloc_from_host`] and
/// [`StreamCache::alloc_buffer`], on either device. `T` is any [`bytemuck::Pod`] type
/// aligned to at most 256 bytes and not zero-sized (checked at compile time):
///
/// ```compile_fail
/// # use vrampool::{Pool, PoolConfig, SimDevice};
/// # let dev = SimDevice::new(1 << 30);
/// # let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
/// # let s = dev.new_stream().unwrap();
/// let nothing = pool.alloc_buffer::<()>(4, &s); // zero-sized: does not compile
/// ```
pub struct Buffer<T> {
    block: Block,
    /// `fn() -> T`: the buffer holds no host `T`, so its auto traits are the block's.
    _elem: PhantomData<fn() -> T>,
}

impl<T: Pod> Buffer<T> {
    /// A block of `len * size_of::<T>()` bytes as a buffer.
    #[inline(always)]
    fn from_block(block: Block) -> Buffer<T> {
        debug_assert_eq!(block.len() % Elem::<T>::SIZE, 0);
        Buffer { block, _elem: PhantomData }
    }

    /// Elements in the buffer.
    #[inline]
    pub fn len(&self) -> usize {
        self.block.len() / Elem::<T>::SIZE
    }

    /// Whether the buffer holds no element.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.block.is_empty()
    }

    /// Bytes of its elements (`len() * size_of::<T>()`).
    #[inline]
    pub fn num_bytes(&self) -> usize {
        self.block.len()
    }

    /// The device address of element 0 (aligned to 256 bytes; 0 for an empty buffer).
    #[inline]
    pub fn device_ptr(&self) -> u64 {
        self.block.device_ptr()
    }

    /// The id of the stream the buffer was allocated on, and will be freed on.
    #[inline]
    pub fn stream_id(&self) -> StreamId {
        self.block.stream_id()
    }

    /// Say that the buffer was also used on `other` (see [`Block::record_stream`]).
    pub fn record_stream(&self, other: &Stream) {
        self.block.record_stream(other);
    }

    /// The block underneath.
    pub fn as_block(&self) -> &Block {
        &self.block
    }

    /// The block underneath, untyped (it keeps its stream and its `record_stream` uses).
    pub fn into_block(self) -> Block {
        self.block
    }

    /// The whole buffer as a view.
    #[inline]
    pub fn view(&self) -> BufferView<'_, T> {
        BufferView::new(&self.block, self.device_ptr(), self.len())
    }

    /// The whole buffer as a writable view.
    #[inline]
    pub fn view_mut(&mut self) -> BufferViewMut<'_, T> {
        let (ptr, len) = (self.device_ptr(), self.len());
        BufferViewMut::new(&self.block, ptr, len)
    }

    /// Elements `range` (indices in elements) as a view; [`Error::InvalidArgument`] when
    /// the range is reversed or past the end.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<BufferView<'_, T>> {
        self.view().slice(range)
    }

    /// Elements `range` as a writable view; [`Error::InvalidArgument`] when the range is
    /// reversed or past the end.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<BufferViewMut<'_, T>> {
        self.view_mut().into_slice(range)
    }

    /// Copy `src` (exactly [`Buffer::len`] elements) into the buffer on `stream`; returns
    /// once the copy is done on the device. `pool` is the pool the buffer came from.
    pub fn copy_from_host(&mut self, pool: &Pool, src: &[T], stream: &Stream) -> Result<()> {
        self.view_mut().copy_from_host(pool, src, stream)
    }

    /// Copy the buffer into `dst` (exactly [`Buffer::len`] elements) on `stream`; returns
    /// once the copy is done. `pool` is the pool the buffer came from.
    pub fn copy_to_host(&self, pool: &Pool, dst: &mut [T], stream: &Stream) -> Result<()> {
        self.view().copy_to_host(pool, dst, stream)
    }

    /// The buffer's elements, copied to the host on `stream`.
    pub fn to_vec(&self, pool: &Pool, stream: &Stream) -> Result<Vec<T>> {
        self.view().to_vec(pool, stream)
    }

    /// Set every byte to zero on `stream`, asynchronously (in stream order).
    pub fn fill_zeros(&mut self, pool: &Pool, stream: &Stream) -> Result<()> {
        self.view_mut().fill_zeros(pool, stream)
    }
}

impl<T> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("elem", &std::any::type_name::<T>())
            .field("ptr", &format_args!("{:#x}", self.block.device_ptr()))
            .field("bytes", &self.block.len())
            .field("stream", &self.block.stream_id())
            .finish()
    }
}

impl Pool {
    /// Allocate a buffer of `len` elements of `T` for use on `stream` (see [`Pool::alloc`]:
    /// the same hit path). Its contents are whatever the memory last held.
    /// [`Error::InvalidArgument`] when `len * size_of::<T>()` overflows.
    #[inline(always)]
    #[track_caller]
    pub fn alloc_buffer<T: Pod>(&self, len: usize, stream: &Stream) -> Result<Buffer<T>> {
        let bytes = bytes_of::<T>(len)?;
        self.alloc(bytes, stream).map(Buffer::from_block)
    }

    /// [`Pool::alloc_buffer`], then every byte set to zero on `stream` (in stream order:
    /// work enqueued on `stream` after this call sees zeros).
    #[track_caller]
    pub fn alloc_zeroed<T: Pod>(&self, len: usize, stream: &Stream) -> Result<Buffer<T>> {
        let mut buf = self.alloc_buffer(len, stream)?;
        buf.fill_zeros(self, stream)?;
        Ok(buf)
    }

    /// A buffer holding a copy of `src`, for use on `stream` (the copy is done when this
    /// returns).
    #[track_caller]
    pub fn alloc_from_host<T: Pod>(&self, src: &[T], stream: &Stream) -> Result<Buffer<T>> {
        let mut buf = self.alloc_buffer(src.len(), stream)?;
        buf.copy_from_host(self, src, stream)?;
        Ok(buf)
    }
}

impl StreamCache {
    /// Allocate a buffer of `len` elements of `T` on the cache's stream (see
    /// [`StreamCache::alloc`]: the same hit path). [`Error::InvalidArgument`] when
    /// `len * size_of::<T>()` overflows.
    #[inline(always)]
    #[track_caller]
    pub fn alloc_buffer<T: Pod>(&self, len: usize) -> Result<Buffer<T>> {
        let bytes = bytes_of::<T>(len)?;
        self.alloc(bytes).map(Buffer::from_block)
    }
}

#[cfg(test)]
mod tests;
