//! What the live-block table keeps of a block, and the block rebuilt from it.
//!
//! A live block handed to C is kept as its slot's words, not as a [`Block`] value: the info
//! word packs the bytes asked for (40 bits) and the stream's token (24 bits), the size word
//! is the block's size-and-class word; its address is the slot's and its pool the device's.
//! Storing the six words of a `Block` and reading them back on free cost 1.3 ns a pair more
//! (8-byte stores read back by the block's moves), so the block is taken apart on
//! allocation and rebuilt on free, field by field: this file is the one place that knows
//! `Block`'s fields, and must follow them if they change. A block that does not fit the
//! packing (a request of 1 TiB or more) or that was used on other streams (`record_stream`,
//! which gives it a list of streams) is kept whole in a boxed [`Ext`] instead.

use std::cell::Cell;
use std::ptr::NonNull;

use crate::device::StreamId;
use crate::pool::PoolInner;
use crate::Block;

const LEN_BITS: u32 = 40;
/// The largest request whose length packs into an info word.
pub(crate) const MAX_PACKED_LEN: u64 = (1 << LEN_BITS) - 1;
/// The largest stream token that packs into an info word.
pub(crate) const MAX_TOKEN: u32 = (1 << (64 - LEN_BITS)) - 1;
const _: () = assert!(crate::registry::MAX_STREAMS as u64 <= MAX_TOKEN as u64);

/// The info word of a block of `len` bytes (at most [`MAX_PACKED_LEN`]) on stream `token`.
#[inline(always)]
pub(crate) fn pack(len: u64, token: u32) -> u64 {
    debug_assert!(len <= MAX_PACKED_LEN);
    len | token_bits(token)
}

/// The stream token's part of an info word.
#[inline(always)]
pub(crate) fn token_bits(token: u32) -> u64 {
    (token as u64) << LEN_BITS
}

/// (bytes asked for, stream token) of an info word made by [`pack`].
#[inline(always)]
pub(crate) fn unpack(info: u64) -> (u64, u32) {
    (info & MAX_PACKED_LEN, (info >> LEN_BITS) as u32)
}

/// A block taken apart: what the table keeps, and what its free checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parts {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) size_class: u64,
    pub(crate) stream: StreamId,
    pub(crate) pool: NonNull<PoolInner>,
}

/// (address, bytes asked for, size-and-class word) of a block the pool just handed out,
/// read in place: moving the block to take it apart copied it through memory, and reading
/// the copy back with wider loads than its stores stalled (as `Block`'s docs describe). The
/// caller then forgets the block, and owns what it held.
#[inline(always)]
pub(crate) fn view(block: &Block) -> (u64, u64, u64) {
    // A fresh block was used on no other stream: nothing else to keep.
    debug_assert!(block.used_on.get().is_null());
    (block.addr, block.len as u64, block.size_class.get())
}

/// The block `parts` were taken from.
///
/// # Safety
/// `parts` are a block's ([`view`], its stream and its pool), forgotten and not rebuilt
/// since, and `parts.pool` is the pool that handed it out.
#[inline(always)]
pub(crate) unsafe fn rebuild(parts: Parts) -> Block {
    Block {
        addr: parts.addr,
        len: parts.len as usize,
        size_class: Cell::new(parts.size_class),
        stream: parts.stream,
        pool: parts.pool,
        used_on: Cell::new(std::ptr::null_mut()),
    }
}

/// A live block kept whole: its info word points here (the slot's `EXT` flag set).
pub(crate) struct Ext {
    pub(crate) block: Block,
    /// The stream token it was allocated with.
    pub(crate) token: u32,
}

impl Ext {
    /// Box `block` and give the info word that owns it.
    pub(crate) fn into_info(block: Block, token: u32) -> u64 {
        Box::into_raw(Box::new(Ext { block, token })) as u64
    }

    /// The record behind an `EXT` info word, borrowed.
    ///
    /// # Safety
    /// `info` came from [`Ext::into_info`], is not yet taken back, and the caller holds the
    /// slot (the table's invariant 3), so nobody frees or changes the record meanwhile.
    pub(crate) unsafe fn peek<'a>(info: u64) -> &'a Ext {
        // SAFETY: as the caller promises.
        unsafe { &*(info as *const Ext) }
    }

    /// Take the record behind an `EXT` info word back.
    ///
    /// # Safety
    /// As [`Ext::peek`], and the slot no longer names the record (it was freed or rewritten
    /// by the caller), so it is taken back once.
    pub(crate) unsafe fn take(info: u64) -> Box<Ext> {
        // SAFETY: as the caller promises: the pointer came from Box::into_raw.
        unsafe { Box::from_raw(info as *mut Ext) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Pool, PoolConfig, SimDevice};

    #[test]
    fn info_words_pack_length_and_token() {
        for (len, token) in [(1, 1), (MAX_PACKED_LEN, MAX_TOKEN), (4096, 7), (0, 0)] {
            assert_eq!(unpack(pack(len, token)), (len, token));
        }
    }

    #[test]
    fn a_block_taken_apart_and_rebuilt_frees_as_the_original() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let s = dev.new_stream().unwrap();
        for len in [1usize, 256, 4097, 1 << 20, 100 << 20] {
            let b = pool.alloc(len, &s).unwrap();
            let (ptr, cap) = (b.device_ptr(), b.capacity());
            let (addr, blen, size_class) = view(&b);
            assert_eq!((addr, blen), (ptr, len as u64));
            let parts = Parts { addr, len: blen, size_class, stream: b.stream_id(), pool: b.pool };
            std::mem::forget(b);
            // SAFETY: just forgotten, rebuilt once.
            let b = unsafe { rebuild(parts) };
            assert_eq!((b.device_ptr(), b.len(), b.capacity(), b.stream_id()), (ptr, len, cap, s.id()));
            drop(b);
            assert_eq!(pool.stats().allocated_bytes, 0, "{len}");
        }
        pool.trim().unwrap();
        pool.check().unwrap();
    }
}
