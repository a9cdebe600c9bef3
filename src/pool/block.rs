//! [`Block`]: a piece of device memory handed out by a pool.
//!
//! A block is plain data — address, sizes, class, stream id and a raw pointer to the pool's
//! state — so that handing one out and taking it back touches no shared counter: no `Arc`
//! clone per block. The pool's state outlives every block (see [`super::Pool`]'s drop).

use std::cell::Cell;
use std::fmt;
use std::ptr::NonNull;

use super::{local, PoolInner};
use crate::cache::thread::Hit;
use crate::device::{Stream, StreamId};

/// The class of a block that no cache holds (larger than the largest cached class, made
/// where the thread has no cache, or used on other streams). Classes sit in the low byte of
/// a block's size (sizes are multiples of 256), and no class is this high.
pub(crate) const NO_CLASS: u64 = 0xFF;
const _: () = assert!(crate::class::MAX_CLASSES < NO_CLASS as usize && crate::ALIGN == 256);

/// Where a pool placed a block: its address and its size-and-class word (see
/// [`Block::size_class`]). The rest of a block (the bytes asked for, its stream, its pool)
/// is the allocating caller's, so an allocation's hit path and its slow paths meet on these
/// two words, in registers, and the block is built once, after they meet.
///
/// Built in each path instead, the block went through the slow path's result slot in
/// memory: the hit path stored it there field by field and the caller's move read it back
/// with 16-byte loads, which cannot forward from 8-byte stores. That stall made
/// `let b = cache.alloc(n)?; use(b.device_ptr()); drop(b)` cost 19 ns a pair instead of 5,
/// and the hot pair of the benches 5.8 ns instead of 4.6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    pub(crate) addr: u64,
    pub(crate) size_class: u64,
}

/// A size-and-class word's (class, size in bytes); the class is [`NO_CLASS`] for a block no
/// cache holds.
#[inline(always)]
pub(crate) const fn class_and_size(size_class: u64) -> (u64, u64) {
    (size_class & NO_CLASS, size_class & !NO_CLASS)
}

impl Placed {
    /// Where an empty block (a zero-byte request) is: nowhere, holding nothing.
    pub(crate) const EMPTY: Placed = Placed { addr: 0, size_class: NO_CLASS };

    /// A block of `class` (`size` bytes, a multiple of 256), which a cache may hold.
    #[inline(always)]
    pub(crate) fn cached(addr: u64, size: u64, class: usize) -> Placed {
        debug_assert!(size % crate::ALIGN == 0 && (class as u64) < NO_CLASS);
        Placed { addr, size_class: size | class as u64 }
    }

    /// Where a cache's block is: at its address, holding its class's size.
    #[inline(always)]
    pub(crate) fn taken(hit: Hit) -> Placed {
        Placed::cached(hit.addr, hit.size, hit.class)
    }

    /// A block of `size` bytes (a multiple of 256) that no cache holds.
    #[inline(always)]
    pub(crate) fn uncached(addr: u64, size: u64) -> Placed {
        debug_assert!(size % crate::ALIGN == 0);
        Placed { addr, size_class: size | NO_CLASS }
    }
}

/// A block of device memory from a [`super::Pool`]. Dropping it frees it in stream order on
/// its stream. `Send`, not `Sync`: one thread holds it at a time; any thread may drop it.
///
/// Every field is a whole word and the pool pointer is never null (an empty block's is
/// never followed), so `Result<Block, Error>` is the size of a block and a block moves as
/// whole words: a half-word field or a separate tag made the compiler copy blocks with
/// 16-byte moves over 8-byte stores, which stall store forwarding and cost the hit path half
/// its time. (The allocation paths avoid the same stall by meeting on `Placed`.)
pub struct Block {
    pub(crate) addr: u64,
    pub(crate) len: usize,
    /// The bytes the block holds (its class's size, or the arena's size for it; 0 only for
    /// an empty block), a multiple of 256, with the size class in its low byte, or
    /// [`NO_CLASS`]: for a block no cache holds, and for one used on other streams
    /// (`record_stream` sets it), so the free's hit path, which looks up the class's
    /// magazine, needs no other test to send such a block down the slow path. One word for
    /// both keeps a block at six words.
    pub(crate) size_class: Cell<u64>,
    pub(crate) stream: StreamId,
    /// The pool's state (never followed for an empty block, `size == 0`, which owns nothing).
    pub(crate) pool: NonNull<PoolInner>,
    /// Other streams the block was used on (`record_stream`): null until first used, then a
    /// `Box<Vec<Stream>>` owned by the block. A raw pointer, not an `Option<Box<..>>`, so
    /// the common block carries one null word and has no drop glue of its own.
    pub(crate) used_on: Cell<*mut Vec<Stream>>,
}

// SAFETY: the pool pointer names a `PoolInner`, which is `Sync` and outlives every block;
// the rest is plain data or `Send` (`Stream`).
unsafe impl Send for Block {}

impl Block {
    /// The block `pool` placed `at` for a request of `len` bytes on `stream`.
    #[inline(always)]
    pub(crate) fn new(pool: NonNull<PoolInner>, stream: StreamId, len: usize, at: Placed) -> Block {
        Block {
            addr: at.addr,
            len,
            size_class: Cell::new(at.size_class),
            stream,
            pool,
            used_on: Cell::new(std::ptr::null_mut()),
        }
    }

    /// The device address (aligned to 256 bytes; 0 for an empty block).
    #[inline]
    pub fn device_ptr(&self) -> u64 {
        self.addr
    }

    /// Bytes asked for.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block is empty (a zero-byte request).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes usable at [`Block::device_ptr`] (at least [`Block::len`]: the size class).
    #[inline]
    pub fn capacity(&self) -> usize {
        self.size() as usize
    }

    #[inline(always)]
    pub(crate) fn size(&self) -> u64 {
        class_and_size(self.size_class.get()).1
    }

    #[inline(always)]
    pub(crate) fn class(&self) -> u64 {
        class_and_size(self.size_class.get()).0
    }

    /// The id of the stream the block was allocated on, and will be freed on.
    #[inline]
    pub fn stream_id(&self) -> StreamId {
        self.stream
    }

    /// Say that the block was also used on `other`: its free then waits for the work
    /// enqueued on `other` before the free, as well as its own stream's.
    pub fn record_stream(&self, other: &Stream) {
        if self.size() == 0 || other.id() == self.stream {
            return;
        }
        let used = self.used_on.get();
        if used.is_null() {
            self.used_on.set(Box::into_raw(Box::new(vec![other.clone()])));
            self.size_class.set(self.size() | NO_CLASS);
            return;
        }
        // SAFETY: a non-null `used_on` is a `Box<Vec<Stream>>` owned by this block; the block
        // is not `Sync`, so no other reference to the vector exists during this call.
        let used = unsafe { &mut *used };
        if !used.iter().any(|s| s == other) {
            used.push(other.clone());
        }
    }
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("ptr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("capacity", &self.size())
            .field("stream", &self.stream)
            .finish()
    }
}

impl Drop for Block {
    #[inline]
    fn drop(&mut self) {
        // A block of no class (uncached, or used on other streams) finds no magazine on the
        // hit path, and an empty one no cache (its pool pointer is dangling): all fall to
        // `drop_slow`, which tells them apart, so the hit path tests none of them.
        if local::try_free_fast(self.pool, self) {
            return;
        }
        self.drop_slow();
    }
}

impl Block {
    /// Everything but the cache's hit path, out of line so the hit path stays a leaf.
    #[cold]
    #[inline(never)]
    fn drop_slow(&mut self) {
        if self.size() == 0 {
            return;
        }
        let pool = self.pool;
        let used = self.used_on.get();
        // A block used on other streams has no class (`record_stream` clears it).
        debug_assert!(used.is_null() || self.class() == NO_CLASS);
        if self.class() != NO_CLASS && local::free_slow(pool, self) {
            return;
        }
        let used_on = if used.is_null() {
            Vec::new()
        } else {
            // SAFETY: a non-null `used_on` is a `Box<Vec<Stream>>` owned by this block, taken
            // back exactly once, here.
            *unsafe { Box::from_raw(used) }
        };
        // SAFETY: the pool's state outlives every block.
        let pool = unsafe { pool.as_ref() };
        pool.free_slow(self.addr, self.size(), self.stream, used_on);
    }
}
