//! The live-block table of the C ABI: from a block's device address to the words its free
//! needs, in O(1), without a lock, and with no atomic read-modify-write on the common path.
//!
//! A C caller gives back a pointer and a size, not a [`crate::Block`], so the ABI must find
//! what the pool handed out from the address alone, refuse what it never handed out, and
//! take each block back exactly once even when two threads race to free it.
//!
//! **What it owns.** One [`Slot`] per 256 bytes of the pool's reserved range, directly
//! indexed by `(address − base) / 256`: every block address is 256-aligned inside the range,
//! so a block's slot is found with a subtraction and a shift, and an address outside the
//! range or off the 256-byte grid is refused before any slot is read. A slot is three words:
//! the **tag** (state, owner, generation), the **info** word and the **size** word (the ABI's
//! own, opaque here). The table is one anonymous mapping reserved without swap; its pages
//! are zero until first written, so only the parts of the range where blocks start cost
//! memory: 24 bytes per 256-byte block at worst (9.4% of bytes held in 256-byte blocks,
//! 0.6% in 4 KiB blocks), one 4 KiB page per block for blocks 43 KiB and more apart (0.2% of
//! 2 MiB blocks), and nothing for the untouched range.
//!
//! **Tag.** `state` (2 bits: free, live, claimed, busy) · `EXT` (1 bit: the info word points
//! to a boxed record) · `owner` (13 bits: the index of the [`Owner`] record of the thread
//! that allocated, 0 for none) · `generation` (48 bits, bumped by each publication, so a tag
//! value is never seen twice at one slot and no compare-and-swap can be fooled by ABA).
//!
//! **Why no read-modify-write on the common path.** One locked instruction costs more than
//! the pool's whole allocation and free (measured on the development machine: 4.1 ns for
//! `pool.alloc` + drop, 12.9 ns with one compare-and-swap added, 5.9 ns with a plain load and
//! store instead). So the thread that allocated a block (its *owner*) frees it with plain
//! loads and stores, and only other threads use compare-and-swap:
//!
//! - **Publish** (the owner, on allocation): info and size, then the tag `live` with the
//!   next generation, a release store. The slot was free (the block was the pool's), and
//!   nobody writes a free slot, so no read-modify-write is needed.
//! - **Owner's free**: announce the slot in the owner's record (`ann`, a plain release
//!   store), [`light_fence`], load the tag; if it is `live`, ours, and the info word matches
//!   what the caller passes, store `free` and clear the announcement. The block then goes
//!   back to the pool.
//! - **Foreign free** (any other thread): compare-and-swap `live → claimed`. That alone does
//!   not exclude the owner, who may have loaded `live` just before and be about to store
//!   `free`. The claim is *settled* later: after [`heavy_fence`] (a `membarrier` system call:
//!   every running thread executes a full barrier), the claimer reads the owner's
//!   announcement. This is Dekker's protocol with an asymmetric fence pair: the owner writes
//!   its announcement then reads the tag, the claimer writes the tag then reads the
//!   announcement, so at least one sees the other. If the announcement names the slot, the
//!   owner is inside its window: wait. Otherwise the tag decides: still `claimed`, and the
//!   claimer won (any owner window that starts later sees `claimed` and refuses); anything
//!   else, and the owner's free won (the claim was a racing double free, refused without
//!   touching the pool). One `membarrier` settles any number of claims, so the ABI settles
//!   foreign frees in batches (see `ffi::foreign`).
//! - **Busy**: `record_stream` changes a live slot's words; it claims the slot `busy` the
//!   same way, settles at once, rewrites the words and stores `live` again.
//!
//! Owner windows use only a compiler fence, so they are sound only where claimers settle
//! with `membarrier`. Where it is unavailable ([`Owners::asymmetric`] is false) the ABI
//! takes no owner records: every block has owner 0, every free is a claim, and a claim on
//! a block without an owner settles at once (no owner window can cover it).
//!
//! **Invariants.** (1) A slot's info and size words are written only while its tag is `free`
//! (publication) or while one thread holds it `busy`; any such write changes the tag, so a
//! compare-and-swap from a tag value proves the words read after loading it are the words of
//! that value. (2) Only the owner stores to a tag without compare-and-swap, and only after
//! loading `live` inside its announced window, or while publishing a free slot. (3) A boxed
//! record behind an `EXT` info word is read only by a thread that holds the slot: the owner
//! inside its window having loaded `live`, or a settled claimer. (4) The thread that takes a
//! slot from `live` to `free` is the one that gives the block back to the pool, so every
//! block is freed at most once whatever the callers do.

mod owners;
mod storage;

pub use owners::{Owner, Owners};

use crate::error::Result;
use crate::sync::atomic::{fence, AtomicU64, Ordering};
use crate::sync::{heavy_fence, light_fence, spin_hint, yield_now};
use storage::Storage;

/// Bytes of address space per slot: every block address is a multiple of this.
pub const GRAIN: u64 = crate::ALIGN;

const STATE: u64 = 0b11;
const FREE: u64 = 0;
const LIVE: u64 = 1;
const CLAIMED: u64 = 2;
const BUSY: u64 = 3;
/// The info word points to a boxed record of the ABI's.
pub const EXT: u64 = 0b100;
const OWNER_SHIFT: u32 = 3;
/// Owner records: index 0 means "no owner" (every free of such a block is foreign).
pub const MAX_OWNERS: usize = 1 << 13;
const OWNER_MASK: u64 = ((MAX_OWNERS as u64) - 1) << OWNER_SHIFT;
const GEN_SHIFT: u32 = 16;
const GEN_ONE: u64 = 1 << GEN_SHIFT;
const GEN_MASK: u64 = !(GEN_ONE - 1);

/// One slot: a tag and two words the ABI gives meaning to.
#[derive(Default)]
pub struct Slot {
    tag: AtomicU64,
    info: AtomicU64,
    size: AtomicU64,
}

/// What a live slot holds besides its tag: the ABI's two words, and whether `info` points to
/// a boxed record (`ext`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Words {
    /// The info word (the ABI's; a pointer when `ext`).
    pub info: u64,
    /// The size word (the ABI's).
    pub size: u64,
    /// Whether `info` points to a boxed record.
    pub ext: bool,
}

/// Why a slot refused a free or a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No live block starts here: never allocated (`ever` false), or already freed.
    NotLive {
        /// Whether a block was ever published at this slot.
        ever: bool,
    },
    /// Another thread freed the block and the free is not settled yet (or the block is
    /// claimed by a concurrent `record_stream`).
    Claimed,
    /// The caller's check refused the slot's words (wrong size or stream).
    Mismatch,
    /// The block is owned by another thread: its free is a claim ([`Table::claim`]).
    Foreign,
}

/// A claim taken on a slot by a thread other than its owner; it must be settled before the
/// claimer may act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    idx: usize,
    /// The slot's tag while claimed (a value unique to this claim: it holds the generation).
    tag: u64,
    /// The words, as of the claim.
    pub words: Words,
}

impl Claim {
    /// The slot's index.
    pub fn index(&self) -> usize {
        self.idx
    }

    /// The owner index of the claimed block (0: none).
    pub fn owner(&self) -> usize {
        owner_of(self.tag)
    }
}

/// How a claim settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The claimer holds the slot: no owner's free will take it.
    Won,
    /// The owner's free took the block first (the claim was a racing double free).
    Lost,
    /// The owner is inside its free window on this slot: settle again later.
    Wait,
}

#[inline(always)]
fn owner_of(tag: u64) -> usize {
    ((tag & OWNER_MASK) >> OWNER_SHIFT) as usize
}

#[inline(always)]
fn live_tag(owner: usize, ext: bool) -> u64 {
    LIVE | if ext { EXT } else { 0 } | (owner as u64) << OWNER_SHIFT
}

/// The claimers' side of the fence pair, run once before settling any number of claims.
/// False if it cannot be had (the claims must then wait).
pub fn claimers_fence(owners: &Owners) -> bool {
    if owners.asymmetric() {
        heavy_fence()
    } else {
        fence(Ordering::SeqCst);
        true
    }
}

/// The table over one pool's reserved range.
pub struct Table {
    base: u64,
    slots: Storage,
}

/// A table's hot-path handle: its base, slots and length by value, so that a caller who
/// keeps one (the C ABI's thread memo) reaches a slot without first loading the table.
#[derive(Clone, Copy)]
pub struct TableView<'a> {
    base: u64,
    slots: *const Slot,
    len: usize,
    _table: std::marker::PhantomData<&'a Table>,
}

impl<'a> TableView<'a> {
    /// A view of no table: no address has a slot in it.
    pub const EMPTY: TableView<'static> =
        TableView { base: 0, slots: std::ptr::null(), len: 0, _table: std::marker::PhantomData };

    /// The slot index of a block starting at `addr` (as [`Table::index`]).
    #[inline(always)]
    pub fn index(&self, addr: u64) -> Option<usize> {
        let off = addr.wrapping_sub(self.base);
        let idx = (off / GRAIN) as usize;
        (off % GRAIN == 0 && idx < self.len).then_some(idx)
    }

    /// [`Table::publish`] at the slot of `addr`, a block the pool just handed out (so
    /// 256-aligned, as the pool promises; only the range is checked here). False, with
    /// nothing written, if `addr` is outside the table (a pool that broke its promise): a
    /// check and a branch, not an assertion, whose message arguments would cost the hot path
    /// a stack frame.
    #[inline(always)]
    #[must_use]
    pub fn publish_at(&self, addr: u64, owner: usize, words: Words) -> bool {
        debug_assert_eq!(addr.wrapping_sub(self.base) % GRAIN, 0);
        let idx = (addr.wrapping_sub(self.base) / GRAIN) as usize;
        if idx >= self.len {
            return false;
        }
        // SAFETY: in bounds of the table's slots, which outlive `'a`.
        publish(unsafe { &*self.slots.add(idx) }, owner, words);
        true
    }

    /// The owner's free of the block at `idx`, on the hot path: if the slot is live, owned
    /// by `me` (index `me_id`), not boxed, and its info word is `info`, mark it free and
    /// return its size word. `None` changes nothing: take [`Table::free_owned_with`].
    #[inline(always)]
    pub fn free_owned(&self, idx: usize, me: &Owner, me_id: usize, info: u64) -> Option<u64> {
        self.free_owned_if(idx, me, me_id, |i| i == info).map(|(_, size)| size)
    }

    /// As [`TableView::free_owned`], whatever the block's info word: returns it with the
    /// size word (the free by address alone, `vrampool_free_any`).
    #[inline(always)]
    pub fn free_owned_any(&self, idx: usize, me: &Owner, me_id: usize) -> Option<(u64, u64)> {
        self.free_owned_if(idx, me, me_id, |_| true)
    }

    /// The owner's hot-path free: if the slot is live, owned by `me`, not boxed, and `wanted`
    /// takes its info word, mark it free and return (info, size).
    #[inline(always)]
    fn free_owned_if(
        &self,
        idx: usize,
        me: &Owner,
        me_id: usize,
        wanted: impl FnOnce(u64) -> bool,
    ) -> Option<(u64, u64)> {
        // Not an assertion (as in `publish_at`): an index out of range is no slot of this
        // owner's.
        if idx >= self.len {
            return None;
        }
        // SAFETY: in bounds of the table's slots, which outlive `'a`.
        let slot = unsafe { &*self.slots.add(idx) };
        me.announce(idx);
        light_fence();
        let tag = slot.tag.load(Ordering::Acquire);
        let out = if tag & !GEN_MASK == live_tag(me_id, false) {
            let info = slot.info.load(Ordering::Relaxed);
            wanted(info).then(|| {
                let size = slot.size.load(Ordering::Relaxed);
                owner_store(&slot.tag, tag & GEN_MASK | FREE);
                (info, size)
            })
        } else {
            None
        };
        me.clear();
        out
    }
}

// SAFETY: a view only reaches slots through `&Slot`, whose fields are atomics, for as long
// as the table lives (`'a`).
unsafe impl Send for TableView<'_> {}
// SAFETY: as above.
unsafe impl Sync for TableView<'_> {}

/// Publish into a free slot (see [`Table::publish`]).
#[inline(always)]
fn publish(slot: &Slot, owner: usize, words: Words) {
    debug_assert!(owner < MAX_OWNERS);
    // Relaxed: the free slot was last written by whoever freed it, before the block went
    // back to the pool, and the pool's hand-off orders that before this allocation.
    let old = slot.tag.load(Ordering::Relaxed);
    debug_assert_eq!(old & STATE, FREE, "publishing over a slot in use");
    slot.info.store(words.info, Ordering::Relaxed);
    slot.size.store(words.size, Ordering::Relaxed);
    let gen = (old & GEN_MASK).wrapping_add(GEN_ONE);
    // Release: whoever loads this tag (acquire) sees the words.
    slot.tag.store(gen | live_tag(owner, words.ext), Ordering::Release);
}

impl Table {
    /// A table over `[base, base + bytes)`, `bytes` a multiple of [`GRAIN`].
    pub fn new(base: u64, bytes: u64) -> Result<Table> {
        Ok(Table { base, slots: Storage::new((bytes / GRAIN) as usize)? })
    }

    /// The slot index of a block starting at `addr`; `None` if no block can start there
    /// (outside the range, or off the 256-byte grid).
    #[inline(always)]
    pub fn index(&self, addr: u64) -> Option<usize> {
        let off = addr.wrapping_sub(self.base);
        let idx = (off / GRAIN) as usize;
        (off % GRAIN == 0 && idx < self.slots.len()).then_some(idx)
    }

    /// The address of slot `idx`.
    pub fn address(&self, idx: usize) -> u64 {
        self.base + idx as u64 * GRAIN
    }

    #[inline(always)]
    fn slot(&self, idx: usize) -> &Slot {
        self.slots.get(idx)
    }

    /// Publish a block the pool just handed out, starting at slot `idx`, owned by `owner`
    /// (0: none). The slot is free (the pool held the block) and nobody writes a free slot,
    /// so plain stores do.
    #[inline(always)]
    pub fn publish(&self, idx: usize, owner: usize, words: Words) {
        publish(self.slot(idx), owner, words);
    }

    /// The table's hot-path handle.
    pub fn view(&self) -> TableView<'_> {
        TableView {
            base: self.base,
            slots: self.slots.as_ptr(),
            len: self.slots.len(),
            _table: std::marker::PhantomData,
        }
    }

    /// As [`TableView::free_owned`].
    #[inline(always)]
    pub fn free_owned(&self, idx: usize, me: &Owner, me_id: usize, info: u64) -> Option<u64> {
        self.view().free_owned(idx, me, me_id, info)
    }

    /// The owner's free of the block at `idx` by the whole path: inside the owner's window,
    /// `check` sees the slot's words (it may read a boxed record: the owner holds the slot
    /// while it runs) and accepts or refuses them. Fails without change if the slot is not
    /// live, owned by another thread ([`Refusal::Foreign`]), or refused; on success the slot is free and its words are
    /// returned (a boxed record is now the caller's).
    pub fn free_owned_with(
        &self,
        idx: usize,
        me: &Owner,
        me_id: usize,
        check: impl FnOnce(Words) -> bool,
    ) -> Result<Words, Refusal> {
        let slot = self.slot(idx);
        let mut spins = 0;
        let tag = loop {
            me.announce(idx);
            light_fence();
            let tag = slot.tag.load(Ordering::Acquire);
            if tag & STATE != BUSY {
                break tag;
            }
            // A `record_stream` on another thread holds the slot for a moment, and may be
            // waiting for this window to close: close it, and open it again only once the
            // slot is no longer busy (re-announcing at once could starve the other thread).
            me.clear();
            while slot.tag.load(Ordering::Acquire) & STATE == BUSY {
                backoff(&mut spins);
            }
        };
        let out = match tag & STATE {
            LIVE if owner_of(tag) != me_id || me_id == 0 => Err(Refusal::Foreign),
            LIVE => {
                let words = read_words(slot, tag);
                if check(words) {
                    owner_store(&slot.tag, tag & GEN_MASK | FREE);
                    Ok(words)
                } else {
                    Err(Refusal::Mismatch)
                }
            }
            FREE => Err(Refusal::NotLive { ever: tag & GEN_MASK != 0 }),
            _ => Err(Refusal::Claimed),
        };
        me.clear();
        out
    }

    /// The slot's words now, for diagnosis only (they may change at any moment; a boxed
    /// record behind them must not be read).
    pub fn words(&self, idx: usize) -> Words {
        let slot = self.slot(idx);
        read_words(slot, slot.tag.load(Ordering::Acquire))
    }

    /// The slot's state as a thread that does not hold it sees it: its owner, and whether a
    /// block is live there. For diagnosis and to pick the owner's or the foreign path.
    pub fn owner(&self, idx: usize) -> Result<usize, Refusal> {
        let tag = self.slot(idx).tag.load(Ordering::Acquire);
        match tag & STATE {
            LIVE | BUSY => Ok(owner_of(tag)),
            FREE => Err(Refusal::NotLive { ever: tag & GEN_MASK != 0 }),
            _ => Err(Refusal::Claimed),
        }
    }

    /// Claim the live block at `idx` for a free by a thread that does not own it. `check`
    /// sees the words first (never a boxed record's contents: the slot is not held yet; a
    /// boxed slot is checked once the claim has settled) and may refuse. The claim must then
    /// be settled ([`Table::settle`]) before the block is touched.
    pub fn claim(&self, idx: usize, check: impl Fn(Words) -> bool) -> Result<Claim, Refusal> {
        self.take(idx, CLAIMED, check)
    }

    /// As [`Table::claim`], for `record_stream`: the slot is held `busy`, and after settling
    /// the claimer must end it with [`Table::unbusy`].
    pub fn claim_busy(&self, idx: usize) -> Result<Claim, Refusal> {
        self.take(idx, BUSY, |_| true)
    }

    fn take(&self, idx: usize, to: u64, check: impl Fn(Words) -> bool) -> Result<Claim, Refusal> {
        let slot = self.slot(idx);
        let mut spins = 0;
        let mut tag = slot.tag.load(Ordering::Acquire);
        loop {
            match tag & STATE {
                LIVE => {}
                FREE => return Err(Refusal::NotLive { ever: tag & GEN_MASK != 0 }),
                CLAIMED => return Err(Refusal::Claimed),
                _ => {
                    backoff(&mut spins);
                    tag = slot.tag.load(Ordering::Acquire);
                    continue;
                }
            }
            let words = read_words(slot, tag);
            if !words.ext && !check(words) {
                return Err(Refusal::Mismatch);
            }
            let claimed = tag & !STATE | to;
            // AcqRel: the claim is ordered before the settling fence; acquire pairs with
            // the publication (or the last `unbusy`) for the words.
            match slot.tag.compare_exchange(tag, claimed, Ordering::AcqRel, Ordering::Acquire) {
                // The tag did not change since the words were read, so they are its words
                // (invariant 1).
                Ok(_) => return Ok(Claim { idx, tag: claimed, words }),
                Err(now) => tag = now,
            }
        }
    }

    /// Settle `claim`: once [`claimers_fence`] has run since the claim was taken, see
    /// whether its owner's free could still take the block (see the module docs).
    pub fn settle(&self, claim: &Claim, owners: &Owners) -> Settled {
        let owner = claim.owner();
        if owner != 0 && owners.get(owner).announced() == Some(claim.idx) {
            return Settled::Wait;
        }
        // Acquire: if the owner's window ended (its release store was read above), its
        // store to the tag is seen here.
        if self.slot(claim.idx).tag.load(Ordering::Acquire) == claim.tag {
            Settled::Won
        } else {
            Settled::Lost
        }
    }

    /// Settle `claim` now: the claimers' fence, then wait while the owner is inside its
    /// window. For claims that must be settled before the call returns (`record_stream`, a
    /// boxed block's free). `None` if the fence cannot be had; the claim is then undone if
    /// it still holds.
    pub fn settle_now(&self, claim: &Claim, owners: &Owners) -> Option<Settled> {
        if claim.owner() != 0 && !claimers_fence(owners) {
            self.undo(claim);
            return None;
        }
        let mut spins = 0;
        loop {
            match self.settle(claim, owners) {
                Settled::Wait => backoff(&mut spins),
                done => return Some(done),
            }
        }
    }

    /// Give up a claim that has not been acted on: the slot is live again, as it was.
    pub fn undo(&self, claim: &Claim) {
        let live = claim.tag & !STATE | LIVE;
        // Fails only if the owner's free took the block meanwhile: then nothing is ours.
        let _ = self.slot(claim.idx).tag.compare_exchange(claim.tag, live, Ordering::Release, Ordering::Relaxed);
    }

    /// End a settled, won claim by freeing the slot: the block is the claimer's to give
    /// back to the pool.
    pub fn release(&self, claim: &Claim) {
        // Relaxed: the block's return to the pool orders this before the next publication.
        self.slot(claim.idx).tag.store(claim.tag & GEN_MASK | FREE, Ordering::Relaxed);
    }

    /// End a settled, won `busy` claim: the slot is live again with `words`.
    pub fn unbusy(&self, claim: &Claim, words: Words) {
        let slot = self.slot(claim.idx);
        slot.info.store(words.info, Ordering::Relaxed);
        slot.size.store(words.size, Ordering::Relaxed);
        // The generation is bumped: the words changed, and a claimer that read the old
        // words must not succeed with them (invariant 1).
        let gen = (claim.tag & GEN_MASK).wrapping_add(GEN_ONE);
        slot.tag.store(gen | live_tag(claim.owner(), words.ext), Ordering::Release);
    }

    /// Every slot holding a live, claimed or busy block: `(index, words)`, in index order.
    /// Exact when nothing runs concurrently (tests, the fuzzer's checks); otherwise as
    /// [`Table::peek`] reads each slot.
    pub fn live_slots(&self) -> Vec<(usize, Words)> {
        self.slots.touched(|idx, slot| peek(slot).map(|w| (idx, w)))
    }

    /// The words of slot `idx` if it holds a live, claimed or busy block, read without
    /// holding the slot: for pictures (`vrampool_snapshot`), never for a free. A slot whose
    /// tag changes while its words are read is read again, a few times, then taken as
    /// holding none. That catches a slot freed or published meanwhile as far as the tag
    /// shows it, not always: the words are written with plain stores that nothing orders
    /// for a reader holding nothing, so on a slot published again during the read they may
    /// mix two blocks. Nothing relies on them: they are only reported, the picture cuts them
    /// to the live memory it saw, and an `EXT` info word is never dereferenced here. Making
    /// them exact would cost the allocation path a fence, for a debugging picture.
    pub fn peek(&self, idx: usize) -> Option<Words> {
        peek(self.slot(idx))
    }
}

fn peek(slot: &Slot) -> Option<Words> {
    for _ in 0..4 {
        let tag = slot.tag.load(Ordering::Acquire);
        if tag & STATE == FREE {
            return None;
        }
        let words = read_words(slot, tag);
        fence(Ordering::Acquire);
        if slot.tag.load(Ordering::Relaxed) == tag {
            return Some(words);
        }
    }
    None
}

/// The owner's store to a tag it loaded `live` inside its window. A plain store: in C11 it
/// is ordered after any claim that succeeded on the value the owner loaded (the claim's
/// compare-and-swap read that value as its immediate predecessor, and the store comes after
/// the value the owner read), so a claimer that later synchronizes with the owner sees it.
/// loom keeps modification orders partial and does not derive that order for a plain store
/// after a concurrent read-modify-write, so under loom the store is a swap, whose place in
/// the order loom does track: the same order C11 gives the plain store.
#[inline(always)]
fn owner_store(tag: &AtomicU64, value: u64) {
    #[cfg(not(loom))]
    tag.store(value, Ordering::Relaxed);
    #[cfg(loom)]
    tag.swap(value, Ordering::Relaxed);
}

#[inline(always)]
fn read_words(slot: &Slot, tag: u64) -> Words {
    Words { info: slot.info.load(Ordering::Relaxed), size: slot.size.load(Ordering::Relaxed), ext: tag & EXT != 0 }
}

/// Wait a little for another thread inside a short window (spin, then yield).
fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        spin_hint();
    } else {
        yield_now();
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
