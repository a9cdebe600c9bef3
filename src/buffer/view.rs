//! Views of a sub-range of a [`super::Buffer`], and the host copies (every copy of a buffer
//! goes through a view: a buffer is its own whole view).
//!
//! A view is an address and a length inside its buffer (checked when the view is made: a
//! range reversed or past the end is an error), and the buffer's block, borrowed: a use of
//! the view on another stream is recorded on the block, which is what its free waits for.
//! `BufferViewMut` is made only from `&mut Buffer` (or by splitting one), so two writable
//! views never overlap.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use bytemuck::Pod;

use super::Elem;
use crate::device::Stream;
use crate::error::{Error, Result};
use crate::{Block, Pool};

/// `[start, end)` of `range` over `len` elements, or why not.
pub(super) fn bounds(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e)),
        _ => Err(Error::InvalidArgument(format!(
            "range ({:?}, {:?}) is not inside a buffer of {len} elements",
            range.start_bound(),
            range.end_bound()
        ))),
    }
}

/// Check that `[ptr, ptr + bytes)` is memory of `pool`, so that a copy with the wrong pool
/// is an error here rather than a fault on the device.
fn in_pool(pool: &Pool, ptr: u64, bytes: usize) -> Result<()> {
    let (base, range) = pool.address_range();
    let inside = ptr >= base && (bytes as u64) <= range && ptr - base <= range - bytes as u64;
    if inside {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "buffer [{ptr:#x}, +{bytes}) is not memory of this pool ([{base:#x}, +{range}))"
        )))
    }
}

fn same_len(what: &str, host: usize, device: usize) -> Result<()> {
    if host == device {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("{what} of {host} elements for a buffer (view) of {device}")))
    }
}

/// Elements `[start, end)` of a buffer, readable.
pub struct BufferView<'a, T> {
    ptr: u64,
    len: usize,
    block: &'a Block,
    _elem: PhantomData<&'a [T]>,
}

/// Elements `[start, end)` of a buffer, writable: no other view overlaps it.
pub struct BufferViewMut<'a, T> {
    ptr: u64,
    len: usize,
    block: &'a Block,
    _elem: PhantomData<&'a mut [T]>,
}

impl<T> Clone for BufferView<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for BufferView<'_, T> {}

impl<'a, T: Pod> BufferView<'a, T> {
    pub(super) fn new(block: &'a Block, ptr: u64, len: usize) -> Self {
        BufferView { ptr, len, block, _elem: PhantomData }
    }

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

    /// Bytes of its elements.
    #[inline]
    pub fn num_bytes(&self) -> usize {
        self.len * Elem::<T>::SIZE
    }

    /// The device address of the view's first element (a multiple of `align_of::<T>()`).
    #[inline]
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The block of the buffer the view is part of.
    pub fn block(&self) -> &'a Block {
        self.block
    }

    /// Elements `range` of this view (indices relative to it).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<BufferView<'a, T>> {
        let (s, e) = bounds(range, self.len)?;
        Ok(BufferView::new(self.block, self.ptr + (s * Elem::<T>::SIZE) as u64, e - s))
    }

    /// The view split at element `mid`: `[0, mid)` and `[mid, len)`.
    pub fn split_at(&self, mid: usize) -> Result<(BufferView<'a, T>, BufferView<'a, T>)> {
        Ok((self.slice(..mid)?, self.slice(mid..)?))
    }

    /// Copy the view into `dst` (exactly [`BufferView::len`] elements) on `stream`; returns
    /// once the copy is done on the device. `pool` is the pool the buffer came from.
    pub fn copy_to_host(&self, pool: &Pool, dst: &mut [T], stream: &Stream) -> Result<()> {
        same_len("host slice", dst.len(), self.len)?;
        if self.len == 0 {
            return Ok(());
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        in_pool(pool, self.ptr, bytes.len())?;
        pool.device().copy_from_device(bytes, self.ptr, stream)
    }

    /// The view's elements, copied to the host on `stream`.
    pub fn to_vec(&self, pool: &Pool, stream: &Stream) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.copy_to_host(pool, &mut out, stream)?;
        Ok(out)
    }
}

impl<'a, T: Pod> BufferViewMut<'a, T> {
    pub(super) fn new(block: &'a Block, ptr: u64, len: usize) -> Self {
        BufferViewMut { ptr, len, block, _elem: PhantomData }
    }

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

    /// Bytes of its elements.
    #[inline]
    pub fn num_bytes(&self) -> usize {
        self.len * Elem::<T>::SIZE
    }

    /// The device address of the view's first element.
    #[inline]
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The block of the buffer the view is part of.
    pub fn block(&self) -> &'a Block {
        self.block
    }

    /// This view, read-only.
    pub fn as_view(&self) -> BufferView<'_, T> {
        BufferView::new(self.block, self.ptr, self.len)
    }

    /// Elements `range` of this view (indices relative to it), writable, borrowing it.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<BufferViewMut<'_, T>> {
        let (s, e) = bounds(range, self.len)?;
        Ok(BufferViewMut::new(self.block, self.ptr + (s * Elem::<T>::SIZE) as u64, e - s))
    }

    /// Elements `range` of this view, writable, for as long as the view was.
    pub fn into_slice(self, range: impl RangeBounds<usize>) -> Result<BufferViewMut<'a, T>> {
        let (s, e) = bounds(range, self.len)?;
        Ok(BufferViewMut::new(self.block, self.ptr + (s * Elem::<T>::SIZE) as u64, e - s))
    }

    /// The view split at element `mid` into two writable views, `[0, mid)` and `[mid, len)`.
    pub fn split_at_mut(self, mid: usize) -> Result<(BufferViewMut<'a, T>, BufferViewMut<'a, T>)> {
        if mid > self.len {
            return Err(Error::InvalidArgument(format!("split at {mid} of a view of {} elements", self.len)));
        }
        let right = self.ptr + (mid * Elem::<T>::SIZE) as u64;
        Ok((BufferViewMut::new(self.block, self.ptr, mid), BufferViewMut::new(self.block, right, self.len - mid)))
    }

    /// Copy `src` (exactly [`BufferViewMut::len`] elements) into the view on `stream`;
    /// returns once the copy is done on the device. `pool` is the pool the buffer came from.
    pub fn copy_from_host(&mut self, pool: &Pool, src: &[T], stream: &Stream) -> Result<()> {
        same_len("host slice", src.len(), self.len)?;
        if self.len == 0 {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(src);
        in_pool(pool, self.ptr, bytes.len())?;
        pool.device().copy_to_device(self.ptr, bytes, stream)
    }

    /// Copy the view into `dst` on `stream` (see [`BufferView::copy_to_host`]).
    pub fn copy_to_host(&self, pool: &Pool, dst: &mut [T], stream: &Stream) -> Result<()> {
        self.as_view().copy_to_host(pool, dst, stream)
    }

    /// Set every byte of the view to zero on `stream`, asynchronously (in stream order). On
    /// a stream other than the buffer's, the use is recorded: the buffer's free waits for it.
    pub fn fill_zeros(&mut self, pool: &Pool, stream: &Stream) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let bytes = self.num_bytes();
        in_pool(pool, self.ptr, bytes)?;
        pool.device().memset(self.ptr, 0, bytes, stream)?;
        self.block.record_stream(stream);
        Ok(())
    }
}

impl<T> fmt::Debug for BufferView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferView").field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}

impl<T> fmt::Debug for BufferViewMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferViewMut").field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}
