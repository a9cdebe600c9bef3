//! The lock-free buddy arena: tier T3, the global, coalescing allocator over one address range.
//!
//! # What it owns
//!
//! The books of one address range `[base, base + range)` (`range` a power of two): which
//! blocks are free. Not the memory itself (it never touches it) and not the physical pages
//! (the page map does). One [`HBitmap`] per order `k` in `8..=log2(range)` holds the free blocks
//! of that order: bit `i` is the block `[base + i << k, base + (i + 1) << k)`. A `free_bytes`
//! counter, an `in_flight` counter and a `changes` counter complete it.
//!
//! # Invariants
//!
//! * Every byte of the range is, once all operations in progress have returned, in exactly one
//!   place: in one live block (as the caller's) or in exactly one free block of one order.
//! * No two free buddies stay unmerged once the frees that made them free have returned.
//! * `free_bytes` = `range` − Σ rounded sizes of live blocks, once quiet.
//!
//! # The design and why
//!
//! * **Allocation** takes the *lowest* free block of the order it needs
//!   (`find_first_set` then `try_clear`, again on a lost race). With none, it claims the
//!   lowest block of the smallest larger order that has one and splits it down, keeping the
//!   lower half at each step and freeing the upper half. Lowest address first keeps live
//!   memory packed at the bottom of the range, so few physical pages are mapped, and the
//!   pages high in the range are the ones that fall wholly free and can be unmapped.
//! * **Exact sizes** (as Linux's `alloc_pages_exact`): a request is rounded up to a multiple
//!   of 256 bytes, `n`; a block of order `K = ceil(log2 n)` is taken and its unused tail
//!   `[n, 2^K)` given back at once as the largest aligned buddy pieces. A live block of `n`
//!   bytes is then a run of pieces, one per set bit of `n`, largest first, each aligned to its
//!   size; `free` frees exactly those pieces and they coalesce with the tail pieces. The waste
//!   of a buddy system (up to half of every block) is thus bounded to the 256-byte rounding.
//! * **Coalescing without missed merges, without a lock**: buddies at order `k` are bits `2j`
//!   and `2j + 1` of the *same* leaf word. A free `fetch_or`s its bit; if the value it
//!   replaced had the buddy's bit set, it CASes both bits away while both are still set and
//!   frees the parent one order up (and so on). If either bit vanished (an allocation claimed
//!   it, or another freer merged the pair first), it stops: its bit stays free, or the other
//!   freer carries the merge on. Of two frees of a pair of buddies, the one whose `fetch_or`
//!   comes second in the word's modification order sees the first one's bit, so a free pair
//!   never stays unmerged. Splitting sets the upper half while the splitter holds the lower
//!   half, so that set can never complete a pair.
//! * **Why no lock**: every step is a single-word RMW on a bitmap word or a counter; a thread
//!   stalled anywhere leaves the others free to go on (at worst the memory it holds mid-split
//!   or mid-merge is not visible to them until it goes on).
//! * **The only wait, and only on the failure path**: a search can miss memory that another
//!   thread holds for a moment between clearing one bit and setting another (mid-split,
//!   mid-merge, or between claiming a block and giving its tail back). Every such window is
//!   bracketed by `in_flight` (incremented before the bit that hides memory is cleared,
//!   decremented after the memory is visible again, with `changes` bumped first). Before
//!   `alloc` answers `None`, it reads `changes`, walks every leaf word of the orders that could
//!   serve it (hints ignored, so a stale or momentarily cleared hint cannot fool it), and
//!   answers `None` only if that walk saw no free block, nothing is in flight and `changes`
//!   did not move; otherwise it searches again, spinning with `spin_hint`. No thread spins
//!   while it holds memory in flight, so the spin always waits on bounded work of others.
//!   Every write to the counters and the words is an `AcqRel` RMW, so a walk that read a word
//!   in its hidden state also sees the `in_flight` increment made before it.
//! * **Trust**: the arena checks what it can (range, alignment, a free of a bit already free),
//!   but a double free of a block that has since merged into a larger free block cannot be
//!   seen in the bitmaps; the pool above keeps the books of live blocks and refuses those.

use super::hbitmap::HBitmap;
use crate::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use crate::sync::spin_hint;
use crate::Error;

/// log2 of the smallest block.
pub const MIN_ORDER: u32 = 8;
/// The smallest block, and the alignment of every address the arena hands out.
pub const MIN_BLOCK: u64 = 1 << MIN_ORDER;
/// log2 of the largest range an arena may cover (256 TiB).
pub const MAX_RANGE_ORDER: u32 = 48;

/// `ceil(log2(n))` for `n >= 1`.
fn ceil_log2(n: u64) -> u32 {
    if n <= 1 {
        0
    } else {
        u64::BITS - (n - 1).leading_zeros()
    }
}

/// The lock-free buddy arena over one address range. See the module docs.
#[derive(Debug)]
pub struct Arena {
    base: u64,
    range: u64,
    /// The largest order: blocks merge up to it and no further. log2(range) for an arena
    /// over a whole range; less for a chunked one ([`Arena::chunked`]).
    top: u32,
    /// Free blocks of the top order (a snapshot, for policy: exact when quiet).
    top_free: AtomicUsize,
    /// Free blocks per order, index `k - MIN_ORDER`.
    free: Box<[HBitmap]>,
    free_bytes: AtomicU64,
    /// Operations that hold free memory out of sight for a moment.
    in_flight: AtomicUsize,
    /// Bumped when such an operation ends.
    changes: AtomicUsize,
}

/// Marks an operation that may hide free memory from searches, from `enter` to drop.
struct InFlight<'a>(&'a Arena);

impl<'a> InFlight<'a> {
    fn enter(arena: &'a Arena) -> InFlight<'a> {
        arena.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(arena)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        // `changes` first: a failing search that sees `in_flight` fall also sees the change.
        self.0.changes.fetch_add(1, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Arena {
    /// An arena over `[base, base + range)`, wholly free. `range` must be a power of two of at
    /// least 256 bytes (and at most 2^48), `base` 256-aligned, and the range must not wrap.
    pub fn new(base: u64, range: u64) -> Result<Arena, Error> {
        Arena::new_checked(base, range)?;
        let arena = Arena::empty(base, range, range.trailing_zeros());
        arena.add_top(0);
        Ok(arena)
    }

    /// An arena over `[base, base + range)` whose blocks merge only up to `1 << top_order`
    /// bytes (a *chunk*), holding nothing at first: chunks come and go whole with
    /// [`Arena::add_top`] and [`Arena::take_top`]. Same bounds on `base` and `range` as
    /// [`Arena::new`]; `top_order` at least `MIN_ORDER` and at most log2(range).
    pub fn chunked(base: u64, range: u64, top_order: u32) -> Result<Arena, Error> {
        Arena::new_checked(base, range)?;
        if !(MIN_ORDER..=range.trailing_zeros()).contains(&top_order) {
            return Err(Error::InvalidArgument(format!("chunk order {top_order} out of range for {range:#x}")));
        }
        Ok(Arena::empty(base, range, top_order))
    }

    fn new_checked(base: u64, range: u64) -> Result<(), Error> {
        if !range.is_power_of_two() || !(MIN_BLOCK..=1 << MAX_RANGE_ORDER).contains(&range) {
            return Err(Error::InvalidArgument(format!(
                "arena range {range:#x} must be a power of two between 256 B and 2^{MAX_RANGE_ORDER} B"
            )));
        }
        if base % MIN_BLOCK != 0 || base.checked_add(range).is_none() {
            return Err(Error::InvalidArgument(format!(
                "arena base {base:#x} must be 256-byte aligned and the range must fit below 2^64"
            )));
        }
        Ok(())
    }

    fn empty(base: u64, range: u64, top: u32) -> Arena {
        let free: Box<[HBitmap]> = (MIN_ORDER..=top).map(|k| HBitmap::new((range >> k) as usize)).collect();
        Arena {
            base,
            range,
            top,
            top_free: AtomicUsize::new(0),
            free,
            free_bytes: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            changes: AtomicUsize::new(0),
        }
    }

    /// The largest order a block reaches by merging (see [`Arena::chunked`]).
    pub fn top_order(&self) -> u32 {
        self.top
    }

    /// Give the arena the free top-order block `i` (bytes `[i << top, (i + 1) << top)` of the
    /// range), which it did not hold. False if `i` is out of range or already free.
    pub fn add_top(&self, i: usize) -> bool {
        self.free_order(i, self.top).is_some()
    }

    /// Take back the top-order block `i` if it is wholly free now; true if this call took it.
    pub fn take_top(&self, i: usize) -> bool {
        if !self.bitmap(self.top).try_clear(i) {
            return false;
        }
        self.top_free.fetch_sub(1, Ordering::AcqRel);
        self.free_bytes.fetch_sub(1 << self.top, Ordering::AcqRel);
        true
    }

    /// The lowest wholly free top-order block, if any (a hint: claim it with
    /// [`Arena::take_top`]).
    pub fn first_free_top(&self) -> Option<usize> {
        self.bitmap(self.top).find_first_set()
    }

    /// Wholly free top-order blocks (a snapshot).
    pub fn free_tops(&self) -> usize {
        self.top_free.load(Ordering::Acquire)
    }

    /// The first address of the range.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The size of the range in bytes.
    pub fn range(&self) -> u64 {
        self.range
    }

    /// The free blocks of order `k`; callers keep `k` in `MIN_ORDER..=top`.
    fn bitmap(&self, k: u32) -> &HBitmap {
        &self.free[(k.clamp(MIN_ORDER, self.top) - MIN_ORDER) as usize]
    }

    /// Claim the lowest free block of order `k`. With `guard`, the claim is marked in flight
    /// from just before the bit is cleared; the guard comes back with the block.
    fn claim(&self, k: u32, guard: bool) -> Option<(usize, Option<InFlight<'_>>)> {
        let bits = self.bitmap(k);
        loop {
            let i = bits.find_first_set()?;
            let g = guard.then(|| InFlight::enter(self));
            if bits.try_clear(i) {
                if k == self.top {
                    self.top_free.fetch_sub(1, Ordering::AcqRel);
                }
                return Some((i, g));
            }
        }
    }

    /// Take a block of order `k`: claim one, or claim a larger one and split it down. With
    /// `hold`, the result stays marked in flight (its tail is still to be given back).
    fn take(&self, k: u32, hold: bool) -> Option<(usize, Option<InFlight<'_>>)> {
        if let Some(got) = self.claim(k, hold) {
            return Some(got);
        }
        for kk in k + 1..=self.top {
            if let Some((i, g)) = self.claim(kk, true) {
                let mut i = i;
                for lvl in (k..kk).rev() {
                    i <<= 1;
                    // The lower half is ours, so this set never completes a pair.
                    self.bitmap(lvl).set(i | 1);
                }
                return Some((i, if hold { g } else { None }));
            }
        }
        None
    }

    /// Free the block `i` of order `k`, merging with its buddies. Returns the (index, order)
    /// of the free block the memory ended up in; None if the bit was already free (a double
    /// free caught at this order; nothing changed) or `i` is out of range.
    fn free_order(&self, i: usize, k: u32) -> Option<(usize, u32)> {
        let _g = InFlight::enter(self);
        let got = self.merge_free(i, k)?;
        self.free_bytes.fetch_add(1 << k, Ordering::AcqRel);
        Some(got)
    }

    /// [`Arena::free_order`]'s bitmap work alone: the caller holds an [`InFlight`] across it
    /// and counts the bytes, once for all the pieces of one block (a free of a 768-byte block
    /// is two pieces; one guard and one counter update instead of two of each).
    fn merge_free(&self, i: usize, k: u32) -> Option<(usize, u32)> {
        let first = self.bitmap(k).set(i)?;
        if first.was_set {
            return None;
        }
        let (mut i, mut k, mut buddy) = (i, k, first.buddy_was_set);
        while buddy && k < self.top {
            if !self.bitmap(k).try_clear_pair(i) {
                break;
            }
            i >>= 1;
            k += 1;
            match self.bitmap(k).set(i) {
                Some(s) => buddy = s.buddy_was_set && !s.was_set,
                None => break,
            }
        }
        if k == self.top {
            self.top_free.fetch_add(1, Ordering::AcqRel);
        }
        Some((i, k))
    }

    /// Allocate `bytes`, rounded up to a multiple of 256: the lowest-addressed fit, aligned to
    /// the power of two at or above the rounded size. `None` for 0 bytes, more than the range,
    /// or when no free block can hold it.
    pub fn alloc(&self, bytes: u64) -> Option<u64> {
        if bytes == 0 || bytes > 1 << self.top {
            return None;
        }
        let n = bytes.div_ceil(MIN_BLOCK) * MIN_BLOCK;
        let k = ceil_log2(n).max(MIN_ORDER);
        let tail = n != 1 << k;
        loop {
            if let Some((i, guard)) = self.take(k, tail) {
                // The tail goes back below, under the guard `take` kept for it.
                self.free_bytes.fetch_sub(n, Ordering::AcqRel);
                let off = (i as u64) << k;
                let mut at = n;
                while at < 1 << k {
                    let piece = at & at.wrapping_neg();
                    let pk = piece.trailing_zeros();
                    // Pieces of a block just claimed: their bits are clear, so these succeed.
                    let _ = self.merge_free(((off + at) >> pk) as usize, pk);
                    at += piece;
                }
                drop(guard);
                return Some(self.base + off);
            }
            if self.surely_full(k) {
                return None;
            }
            spin_hint();
        }
    }

    /// The failure check (see the module docs): true only if a walk of the leaf words of every
    /// order from `k` up saw nothing free, while nothing was in flight and nothing changed.
    fn surely_full(&self, k: u32) -> bool {
        let before = self.changes.load(Ordering::Acquire);
        fence(Ordering::SeqCst);
        let seen = (k..=self.top).any(|o| self.bitmap(o).any_set());
        fence(Ordering::SeqCst);
        !seen && self.in_flight.load(Ordering::Acquire) == 0 && self.changes.load(Ordering::Acquire) == before
    }

    /// Free a block `alloc(bytes)` returned at `addr`. False (and nothing changed) when the
    /// address and size cannot be a block of this arena; false also when a piece was already
    /// free (a double free caught by the bitmaps; the other pieces are freed).
    pub fn free(&self, addr: u64, bytes: u64) -> bool {
        self.free_block(addr, bytes).is_some()
    }

    /// [`Arena::free`], saying also whether the free left a wholly free top-order block
    /// (`Some(Some(i))`: block `i` of [`Arena::top_order`]), for a chunked arena whose owner
    /// gives whole chunks back. None when the free was refused (as `free`'s false).
    pub fn free_block(&self, addr: u64, bytes: u64) -> Option<Option<usize>> {
        if bytes == 0 || bytes > 1 << self.top || addr < self.base {
            return None;
        }
        let off = addr - self.base;
        let n = bytes.div_ceil(MIN_BLOCK) * MIN_BLOCK;
        let k = ceil_log2(n).max(MIN_ORDER);
        if off >= self.range || off % (1 << k) != 0 {
            return None;
        }
        let mut at = off;
        let mut freed = 0;
        let mut whole = None;
        let guard = InFlight::enter(self);
        for b in (MIN_ORDER..=k).rev() {
            if n & (1 << b) != 0 {
                if let Some((i, order)) = self.merge_free((at >> b) as usize, b) {
                    freed += 1 << b;
                    if order == self.top {
                        whole = Some(i);
                    }
                }
                at += 1 << b;
            }
        }
        self.free_bytes.fetch_add(freed, Ordering::AcqRel);
        drop(guard);
        (freed == n).then_some(whole)
    }

    /// The size of the largest free block (0 if none): exact when no operation is in flight.
    pub fn largest_free(&self) -> u64 {
        (MIN_ORDER..=self.top).rev().find(|&k| self.bitmap(k).find_first_set().is_some()).map_or(0, |k| 1 << k)
    }

    /// Free bytes: `range` − Σ rounded sizes of live blocks, exact when quiet.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes.load(Ordering::Acquire)
    }

    /// Call `f(addr, len)` on every free block, order by order from the smallest: a walk, exact
    /// when quiet.
    pub fn for_each_free(&self, mut f: impl FnMut(u64, u64)) {
        for k in MIN_ORDER..=self.top {
            self.bitmap(k).walk(&mut |i| {
                f(self.base + ((i as u64) << k), 1 << k);
                true
            });
        }
    }

    /// True when the whole range is one free block (fully coalesced), checked by a walk.
    pub fn is_whole(&self) -> bool {
        let mut blocks = vec![];
        self.for_each_free(|a, l| blocks.push((a, l)));
        blocks == [(self.base, self.range)]
    }

    /// True when every free byte is in wholly free top-order blocks (fully coalesced), by a
    /// walk: what a chunked arena must show once quiet.
    pub fn is_coalesced(&self) -> bool {
        let mut partial = false;
        self.for_each_free(|_, l| partial |= l != 1 << self.top);
        !partial
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(a: &Arena) -> Vec<(u64, u64)> {
        let mut v = vec![];
        a.for_each_free(|x, l| v.push((x, l)));
        v.sort_unstable();
        v
    }

    #[test]
    fn new_validates_range_and_base() {
        assert!(Arena::new(0, 1000).is_err());
        assert!(Arena::new(0, 128).is_err());
        assert!(Arena::new(100, 1 << 20).is_err());
        assert!(Arena::new(u64::MAX - 255, 1 << 20).is_err());
        assert!(Arena::new(0, 1 << 49).is_err());
        let a = Arena::new(1 << 30, 1 << 20).unwrap();
        assert_eq!((a.base(), a.range(), a.free_bytes(), a.largest_free()), (1 << 30, 1 << 20, 1 << 20, 1 << 20));
        assert!(a.is_whole());
    }

    #[test]
    fn zero_and_oversized_requests_return_none() {
        let a = Arena::new(0, 4096).unwrap();
        assert_eq!(a.alloc(0), None);
        assert_eq!(a.alloc(4097), None);
        assert_eq!(a.alloc(u64::MAX), None);
        assert!(a.is_whole());
    }

    #[test]
    fn lowest_address_first_and_split_frees_upper_halves() {
        let a = Arena::new(0, 4096).unwrap();
        assert_eq!(a.alloc(256), Some(0));
        assert_eq!(blocks(&a), vec![(256, 256), (512, 512), (1024, 1024), (2048, 2048)]);
        assert_eq!(a.alloc(1), Some(256));
        assert_eq!(a.alloc(300), Some(512));
        assert_eq!(a.free_bytes(), 4096 - 256 - 256 - 512);
    }

    #[test]
    fn exact_size_gives_the_tail_back_in_buddy_pieces() {
        let a = Arena::new(0, 4096).unwrap();
        // 5 * 256 = 1280: takes 2048, keeps [0, 1280), gives back 256 @1280 and 512 @1536.
        assert_eq!(a.alloc(1280), Some(0));
        assert_eq!(blocks(&a), vec![(1280, 256), (1536, 512), (2048, 2048)]);
        assert_eq!(a.free_bytes(), 4096 - 1280);
        assert_eq!(a.largest_free(), 2048);
        assert!(a.free(0, 1280));
        assert!(a.is_whole());
        assert_eq!(a.free_bytes(), 4096);
    }

    #[test]
    fn free_refuses_bad_blocks_without_damage() {
        let a = Arena::new(4096, 4096).unwrap();
        let x = a.alloc(512).unwrap();
        assert!(!a.free(x + 256, 512), "misaligned for its size");
        assert!(!a.free(0, 256), "below the range");
        assert!(!a.free(4096 + 4096, 256), "past the range");
        assert!(!a.free(x, 0));
        assert!(!a.free(x, 1 << 40));
        assert!(a.free(x, 512));
        assert!(!a.free(x + 3, 256));
        assert!(a.is_whole());
    }

    #[test]
    fn double_free_of_an_unmerged_block_is_caught() {
        let a = Arena::new(0, 4096).unwrap();
        let x = a.alloc(256).unwrap();
        let _y = a.alloc(256).unwrap();
        assert!(a.free(x, 256));
        assert!(!a.free(x, 256));
        assert_eq!(a.free_bytes(), 4096 - 256);
    }

    #[test]
    fn exhaustion_returns_none_then_recovers() {
        let a = Arena::new(0, 2048).unwrap();
        let v: Vec<u64> = (0..8).map(|_| a.alloc(256).unwrap()).collect();
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.largest_free(), 0);
        for x in v {
            assert!(a.free(x, 256));
        }
        assert!(a.is_whole());
    }
}
