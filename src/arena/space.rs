//! The pool's address space (tier T3): one first-fit extent allocator over the whole reserved
//! range, the fence of every free granule, and which stream owns each chunk of small blocks.
//!
//! # What it owns
//!
//! * [`Extents`] of [`GRANULE`]s over `[base, base + len)`: blocks of `large` bytes and more
//!   are placed there first fit, end to end (the next block starts where the last ended, so
//!   no page tail is left to small blocks only); so are the 2 MiB chunks ([`CHUNK`]) that
//!   streams hold for their small blocks (each stream's [`super::StreamArena`]), first fit
//!   from the middle of the range (the chunk floor), and below it only when nothing above
//!   fits.
//! * One fence word per granule (`crate::reclaim::fence`): for a free granule, the stream
//!   that freed it and the event number that makes it safe for other streams, packed by
//!   [`fence_word`]; 0 is "free for everyone". A granule's fence is written by the thread
//!   that frees it, *before* the granule's bit is cleared, and read by an allocator only
//!   after it saw the bit clear (or after claiming it), so the pair is ordered by the
//!   bitmap word's release/acquire.
//! * One summary word per chunk of the range ([`CHUNK`], 32 granules): a read-side cache of
//!   the fences under it. Either a fence word, saying that every free granule of the chunk
//!   carries that fence, or [`MIXED`], saying "read each granule's word". The granule words
//!   stay the truth: every free writes them. A free that covers a whole chunk then stores the
//!   fence in the summary; any other free stores `MIXED` first. A large block's judge thus
//!   reads one word a chunk instead of 32 (a 256 MiB block: 128 loads instead of 4,096, on each
//!   of the two judgements a placement makes).
//!   Why `MIXED` needs no more care: it only sends readers to the granule words, which are
//!   always right. Why a summary fence is right when read: it is stored only by a free that holds
//!   every granule of the chunk, so no other free of that chunk runs meanwhile, and every later
//!   free of any part of it stores `MIXED` before it clears its bits. A reader that holds
//!   granules (or saw them free) acquired the bitmap word after their last free's release, so
//!   it sees that free's summary or a later one. An untouched chunk's summary is 0: no granule
//!   was ever freed, so all read as fence 0.
//! * One owner word per chunk: the stream (its pool-local slot) and the local index under
//!   which it holds the chunk, written before the chunk serves blocks and cleared after it
//!   stopped, so a free finds its block's arena from the address alone.
//!
//! # Why
//!
//! One range for every size keeps pages shared: a page wholly free of large blocks can hold
//! a chunk, and the other way round. Chunks still start from the middle of it, away from the
//! large blocks, because a chunk among large blocks splits the free run around it for as
//! long as one small block lives there: the next large block then goes higher, on pages
//! that must be mapped or lent. Apart, each kind packs with its own. The pages move between
//! the halves as loans do, with no device wait (`pages::lend`), and the lower half of the
//! range is at least `max_reserved` long (the pool reserves twice that at least), so large
//! blocks never run short of addresses there; a chunk takes a run below the floor only when
//! none above it fits, or when its pool holds a reserve (mapped low, for every size). On the shared traces (simulator, `docs/BENCHMARKS.md`, twenty-fourth
//! session) peak reserved ÷ peak live fell on seven of ten (gpt2_train_4streams 1.073 →
//! 1.026, pipeline_side_stream 1.082 → 1.062) and rose on two (bert_dynamic 1.044 → 1.052,
//! threads_streams 1.043 → 1.046); what it costs elsewhere is in `IMPLEMENTATION.md`.
//!
//! The fences let freed memory go back at once — reusable by its own stream straight away, by
//! another once the fence's event is complete or the other stream waits on it on the
//! device — instead of waiting in a batch for the host to see an event.
//!
//! Lock-free as its parts are: the extents are CAS walks, fences and owners single words.

use super::extent::Extents;
pub use super::stream::{CHUNK, CHUNK_ORDER};
use super::words::LazyWords;
use crate::error::{Error, Result};
use crate::sync::atomic::Ordering;

/// Granule of the extents: every large block's address and size are multiples of it.
pub const GRANULE: u64 = 64 << 10;
const GRANULE_SHIFT: u32 = GRANULE.trailing_zeros();
/// Bits of a fence word for the event number; the stream's slot is above them.
pub const SEQ_BITS: u32 = 44;
/// The most stream slots a pool gives out (slot 0 means "free for everyone"). One short of
/// what the slot bits hold, so that no fence word is [`MIXED`].
pub const MAX_SLOTS: u32 = (1 << (64 - SEQ_BITS)) - 2;
/// A chunk summary that says nothing: read each granule's fence. No fence word equals it
/// (slots stop below the all-ones slot).
pub const MIXED: u64 = u64::MAX;
/// Granules per chunk, the span of one summary word.
const PER_CHUNK: u64 = CHUNK / GRANULE;

/// The fence word of memory freed on the stream of `slot` (1..=[`MAX_SLOTS`]) that is safe
/// for other streams once that stream's event number `seq` is complete.
#[inline]
pub fn fence_word(slot: u32, seq: u64) -> u64 {
    (u64::from(slot) << SEQ_BITS) | (seq & ((1 << SEQ_BITS) - 1))
}

/// (slot, seq) of a fence word; slot 0 is memory free for everyone.
#[inline]
pub fn fence_parts(word: u64) -> (u32, u64) {
    ((word >> SEQ_BITS) as u32, word & ((1 << SEQ_BITS) - 1))
}

/// The address space of a pool. See the module docs.
pub struct Space {
    base: u64,
    len: u64,
    extents: Extents,
    /// One per granule.
    fences: LazyWords,
    /// One per chunk: the fence every free granule under it carries, or [`MIXED`].
    summaries: LazyWords,
    /// One per chunk: `(slot << 32 | idx) + 1`, or 0.
    owners: LazyWords,
    large: u64,
    /// Where chunks are placed from (see the module docs).
    chunk_floor: u64,
}

impl std::fmt::Debug for Space {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Space").field("base", &self.base).field("len", &self.len).finish_non_exhaustive()
    }
}

impl Space {
    /// The space over `[base, base + len)`: both multiples of [`CHUNK`], `len` at least one
    /// chunk. Blocks of `large` bytes and more are large (placed in the extents directly).
    pub fn new(base: u64, len: u64, large: u64) -> Result<Space> {
        if base % CHUNK != 0 || len % CHUNK != 0 || len == 0 {
            return Err(Error::InvalidArgument(format!(
                "space [{base:#x}, +{len:#x}) must be whole chunks of {CHUNK:#x} bytes"
            )));
        }
        Ok(Space {
            base,
            len,
            extents: Extents::new(base, len, GRANULE)?,
            fences: LazyWords::new((len >> GRANULE_SHIFT) as usize),
            summaries: LazyWords::new((len >> CHUNK_ORDER) as usize),
            owners: LazyWords::new((len >> CHUNK_ORDER) as usize),
            large: large.clamp(GRANULE, CHUNK),
            chunk_floor: base + (len / 2).next_multiple_of(CHUNK),
        })
    }

    /// The first address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes covered.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it covers no byte (never, for a space [`Space::new`] made).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a block of `size` bytes goes to the extents (else to a stream's chunks).
    #[inline]
    pub fn is_large(&self, size: u64) -> bool {
        size >= self.large
    }

    /// The smallest size [`Space::is_large`] sends to the extents (the threshold the space
    /// was made with, clamped to a granule – a chunk).
    pub fn large_threshold(&self) -> u64 {
        self.large
    }

    /// The bytes a request of `bytes` occupies: whole granules for a large block, 256-byte
    /// multiples otherwise. None on overflow.
    pub fn size_for(&self, bytes: u64) -> Option<u64> {
        let align = if self.is_large(bytes) { GRANULE } else { crate::pool::ALIGN };
        bytes.checked_next_multiple_of(align)
    }

    /// A large block of `size` bytes (granules), first fit among the runs `accept` takes
    /// (see [`Extents::alloc_with`]).
    pub fn alloc_large(&self, size: u64, accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>) -> Option<u64> {
        self.extents.alloc_with(size, 1, accept)
    }

    /// A large block of `size` bytes in the run `score` rates best among those `accept`
    /// takes (see [`Extents::alloc_scored_with`]).
    pub fn alloc_large_scored(
        &self,
        size: u64,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
        score: &mut dyn FnMut(u64, u64) -> u64,
    ) -> Option<u64> {
        self.extents.alloc_scored_with(size, accept, score)
    }

    /// A large block of `size` bytes at `addr`, a run the caller chose among the free ones
    /// ([`Space::for_each_free`]), judged by `accept` once claimed (see
    /// [`Extents::claim_at`]): the address, or None with nothing claimed.
    pub fn claim_large_at(
        &self,
        addr: u64,
        size: u64,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
    ) -> Option<u64> {
        self.extents.claim_at(addr, size, accept)
    }

    /// A chunk (CHUNK-aligned), first fit from the chunk floor among those `accept` takes;
    /// below the floor only when no chunk-sized run is free above it at all (see the module
    /// docs), or, with `below_if_refused`, whenever `accept` refused every run above. A run
    /// above that `accept` refuses (its page not mapped, where the placement may not map)
    /// otherwise sends the placement on to its next rung, not below the floor: there a chunk
    /// would split the large blocks' free runs again.
    pub fn alloc_chunk(
        &self,
        below_if_refused: bool,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
    ) -> Option<u64> {
        let (size, align) = (CHUNK, CHUNK / GRANULE);
        self.extents.alloc_above(size, align, self.chunk_floor, accept).or_else(|| {
            if !below_if_refused && self.extents.has_room_above(size, align, self.chunk_floor) {
                None
            } else {
                self.extents.alloc_with(size, align, accept)
            }
        })
    }

    /// Where chunks are placed from: the middle of the range (see the module docs).
    pub fn chunk_floor(&self) -> u64 {
        self.chunk_floor
    }

    /// Call `f(start, end, fence word)` on each run of granules of `[addr, addr + len)` that
    /// carry the same fence word (`start` and `end` are addresses, a run cut at the range's
    /// ends), lowest first, until it returns false. Runs, not granules: a large block's
    /// granules mostly share one fence (its free wrote them together), and a judge needs each
    /// word once; the words are read a chunk's slice at a time.
    pub fn fences(&self, addr: u64, len: u64, mut f: impl FnMut(u64, u64, u64) -> bool) {
        let Some(off) = addr.checked_sub(self.base) else { return };
        let (first, end) = (off >> GRANULE_SHIFT, (off + len).div_ceil(GRANULE));
        let at = |g: u64| self.base + (g << GRANULE_SHIFT);
        // The run so far: its first granule and word.
        let mut run: Option<(u64, u64)> = None;
        let mut step = |g: u64, w: u64, run: &mut Option<(u64, u64)>| -> bool {
            match *run {
                Some((_, rw)) if rw == w => true,
                Some((s, rw)) => {
                    *run = Some((g, w));
                    f(at(s), at(g), rw)
                }
                None => {
                    *run = Some((g, w));
                    true
                }
            }
        };
        let mut going = true;
        let mut g = first;
        while going && g < end {
            let c = g / PER_CHUNK;
            let stop = ((c + 1) * PER_CHUNK).min(end);
            // Acquire: pairs with the release of a whole-chunk free's summary, as the granule
            // words' loads do with theirs (module docs).
            let summary = self.summaries.get(c as usize, false).map_or(0, |w| w.load(Ordering::Acquire));
            if summary != MIXED {
                going = step(g, summary, &mut run);
            } else {
                self.fences.slices(g as usize, stop as usize, false, |i, words| {
                    going = match words {
                        // A granule whose word was never made was never freed by anyone: clean.
                        None => step(i as u64, 0, &mut run),
                        Some(words) => {
                            words.iter().zip(i as u64..).all(|(w, g)| step(g, w.load(Ordering::Acquire), &mut run))
                        }
                    };
                    going
                });
            }
            g = stop;
        }
        if let (true, Some((s, w))) = (going, run) {
            f(at(s), at(end), w);
        }
    }

    /// Give the free granules of `[to, to + len)` the fences of those at the same offsets of
    /// `[from, from + len)`: memory that moves from one address to the other (a loan taken
    /// back, see `arena::pages::lend`) carries the record of its last users with it.
    pub fn copy_fences(&self, from: u64, to: u64, len: u64) {
        let (Some(f), Some(t)) = (from.checked_sub(self.base), to.checked_sub(self.base)) else { return };
        // The granule words become the truth under `to`: its chunks' summaries say so first.
        self.mark_mixed(to, len);
        for i in 0..len.div_ceil(GRANULE) {
            let src =
                self.fences.get(((f >> GRANULE_SHIFT) + i) as usize, false).map_or(0, |w| w.load(Ordering::Acquire));
            if let Some(w) = self.fences.get(((t >> GRANULE_SHIFT) + i) as usize, src != 0) {
                w.store(src, Ordering::Release);
            }
        }
    }

    /// Free `[addr, addr + size)` (a large block or a chunk this space handed out) with
    /// `fence` on each of its granules. False, with nothing changed, if it is not one.
    pub fn free(&self, addr: u64, size: u64, fence: u64) -> bool {
        if !self.is_extent(addr, size) {
            return false;
        }
        let (first, end) = ((addr - self.base) >> GRANULE_SHIFT, (addr - self.base + size).div_ceil(GRANULE));
        // Chunks the block covers only in part: their summaries stop speaking for them
        // before any granule word changes (module docs).
        let whole = (first.next_multiple_of(PER_CHUNK), end / PER_CHUNK * PER_CHUNK);
        if whole.0 >= whole.1 {
            self.mark_mixed(addr, size);
        } else {
            if first < whole.0 {
                self.mark_mixed(addr, 1);
            }
            if whole.1 < end {
                self.mark_mixed(addr + size - 1, 1);
            }
        }
        // A chunk never made reads as fence 0: only a real fence needs it made.
        self.fences.slices(first as usize, end as usize, fence != 0, |_, words| {
            for w in words.into_iter().flatten() {
                // Release: an allocator that sees the granule free (the bitmap word's
                // acquire, after the free's release) sees this fence.
                w.store(fence, Ordering::Release);
            }
            true
        });
        // The chunks it covers whole: every granule word under them is `fence` now, and no
        // other free can touch them until these bits clear.
        for c in whole.0 / PER_CHUNK..whole.1 / PER_CHUNK {
            if let Some(w) = self.summaries.get(c as usize, fence != 0) {
                w.store(fence, Ordering::Release);
            }
        }
        self.extents.free(addr, size)
    }

    /// Say of every chunk `[addr, addr + len)` touches that its granules are to be read one
    /// by one.
    fn mark_mixed(&self, addr: u64, len: u64) {
        let (off, end) = (addr - self.base, addr - self.base + len);
        for c in off >> CHUNK_ORDER..end.div_ceil(CHUNK) {
            if let Some(w) = self.summaries.get(c as usize, true) {
                w.store(MIXED, Ordering::Release);
            }
        }
    }

    /// Give back a block claimed and not handed out, leaving its granules' fences as they
    /// were (a device wait it needed could not be set up, say).
    pub fn give_back(&self, addr: u64, size: u64) -> bool {
        self.extents.free(addr, size)
    }

    /// Whether `[addr, addr + size)` is inside the space and granule-aligned.
    fn is_extent(&self, addr: u64, size: u64) -> bool {
        addr >= self.base
            && (addr - self.base) % GRANULE == 0
            && size > 0
            && size <= self.len
            && addr - self.base <= self.len - size
    }

    fn owner_word(&self, addr: u64, make: bool) -> Option<&crate::sync::atomic::AtomicU64> {
        let off = addr.checked_sub(self.base).filter(|&o| o < self.len)?;
        self.owners.get((off >> CHUNK_ORDER) as usize, make)
    }

    /// Say that the stream of `slot` holds the chunk at `chunk` under local index `idx`.
    pub fn set_owner(&self, chunk: u64, slot: u32, idx: usize) {
        if let Some(w) = self.owner_word(chunk, true) {
            w.store(((u64::from(slot) << 32) | idx as u64) + 1, Ordering::Release);
        }
    }

    /// The chunk at `chunk` is no longer any stream's.
    pub fn clear_owner(&self, chunk: u64) {
        if let Some(w) = self.owner_word(chunk, false) {
            w.store(0, Ordering::Release);
        }
    }

    /// (slot, local index) of the stream that holds the chunk `addr` lies in, if any.
    #[inline]
    pub fn owner(&self, addr: u64) -> Option<(u32, usize)> {
        let w = self.owner_word(addr, false)?.load(Ordering::Acquire).checked_sub(1)?;
        Some(((w >> 32) as u32, (w & u64::from(u32::MAX)) as usize))
    }

    /// Free bytes of the extents (chunks held by streams count as used here).
    pub fn free_bytes(&self) -> u64 {
        self.extents.free_bytes()
    }

    /// The largest free run of the extents (a walk, exact when quiet).
    pub fn largest_free(&self) -> u64 {
        self.extents.largest_free()
    }

    /// Every free run of the extents, lowest first (a walk, exact when quiet).
    pub fn for_each_free(&self, f: impl FnMut(u64, u64)) {
        self.extents.for_each_free(f);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BASE: u64 = 1 << 40;

    #[test]
    fn fences_pack_and_unpack() {
        assert_eq!(fence_parts(fence_word(5, 1234)), (5, 1234));
        assert_eq!(fence_parts(fence_word(MAX_SLOTS, (1 << SEQ_BITS) - 1)), (MAX_SLOTS, (1 << SEQ_BITS) - 1));
        assert_eq!(fence_parts(0), (0, 0));
    }

    #[test]
    fn a_freed_block_carries_its_fence_until_claimed_and_freed_again() {
        let s = Space::new(BASE, 64 * CHUNK, 2 * CHUNK).unwrap();
        let a = s.alloc_large(3 * GRANULE, &mut |_, _| Ok(())).unwrap();
        assert_eq!(a, BASE);
        assert!(s.free(a, 3 * GRANULE, fence_word(2, 7)));
        let mut seen = vec![];
        s.fences(a, 4 * GRANULE, |g, end, f| {
            seen.push((g - BASE, end - BASE, f));
            true
        });
        let f = fence_word(2, 7);
        assert_eq!(seen, vec![(0, 3 * GRANULE, f), (3 * GRANULE, 4 * GRANULE, 0)], "one call a run");
        // Refused for its fence: the search goes on past the granule.
        let b = s.alloc_large(GRANULE, &mut |g, _| if g < BASE + 3 * GRANULE { Err(g) } else { Ok(()) });
        assert_eq!(b, Some(BASE + 3 * GRANULE));
        assert!(!s.free(BASE + 1, GRANULE, 0), "misaligned");
        assert!(!s.free(BASE + 64 * CHUNK, GRANULE, 0), "outside");
    }

    /// Each granule's fence, as `fences` reports them, for `[addr, addr + len)`.
    fn per_granule(s: &Space, addr: u64, len: u64) -> Vec<u64> {
        let mut v = vec![];
        s.fences(addr, len, |g, end, f| {
            v.extend(std::iter::repeat_n(f, ((end - g) / GRANULE) as usize));
            true
        });
        v
    }

    #[test]
    fn a_chunk_s_summary_never_hides_a_later_partial_free() {
        let s = Space::new(BASE, 8 * CHUNK, 2 * CHUNK).unwrap();
        let (old, new, edge) = (fence_word(1, 5), fence_word(2, 9), fence_word(3, 4));
        // Two chunks and a granule more: the chunks' summaries speak, the edge's does not.
        let a = s.alloc_large(2 * CHUNK + GRANULE, &mut |_, _| Ok(())).unwrap();
        assert!(s.free(a, 2 * CHUNK + GRANULE, old));
        let n = (2 * PER_CHUNK + 2) as usize;
        assert_eq!(per_granule(&s, a, n as u64 * GRANULE), [vec![old; n - 1], vec![0]].concat());
        // A block over part of the first chunk, freed with another fence: the chunk's other
        // granules keep the old one.
        let b = s.alloc_large(3 * GRANULE, &mut |_, _| Ok(())).unwrap();
        assert_eq!(b, a);
        assert!(s.free(b, 3 * GRANULE, new));
        let mut want = vec![old; n - 1];
        want[..3].fill(new);
        want.push(0);
        assert_eq!(per_granule(&s, a, n as u64 * GRANULE), want);
        // A block from the middle of the second chunk into the next: both partial.
        let c = s.alloc_large(2 * CHUNK, &mut |x, _| if x < a + CHUNK + GRANULE { Err(a + CHUNK) } else { Ok(()) });
        assert_eq!(c, Some(a + CHUNK + GRANULE));
        assert!(s.free(a + CHUNK + GRANULE, 2 * CHUNK, edge));
        want[PER_CHUNK as usize + 1..].fill(edge);
        want.truncate(n);
        assert_eq!(per_granule(&s, a, n as u64 * GRANULE), want);
        // The first chunk freed whole again: one fence for all of it.
        let d = s.alloc_large(CHUNK, &mut |_, _| Ok(())).unwrap();
        assert_eq!(d, a);
        assert!(s.free(d, CHUNK, 0));
        assert_eq!(per_granule(&s, a, CHUNK), vec![0; PER_CHUNK as usize]);
    }

    #[test]
    fn a_copy_of_fences_onto_a_summarised_chunk_shows_through() {
        let s = Space::new(BASE, 8 * CHUNK, 2 * CHUNK).unwrap();
        let a = s.alloc_large(2 * CHUNK, &mut |_, _| Ok(())).unwrap();
        assert!(s.free(a, CHUNK, fence_word(1, 1)));
        assert!(s.free(a + CHUNK, CHUNK, fence_word(2, 2)));
        s.copy_fences(a + CHUNK, a, CHUNK / 2);
        let half = (PER_CHUNK / 2) as usize;
        assert_eq!(per_granule(&s, a, CHUNK), [vec![fence_word(2, 2); half], vec![fence_word(1, 1); half]].concat());
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A large block of this many granules.
        Alloc(u64),
        /// Free the live block at this index (mod the count) with this fence.
        Free(usize, u64),
        /// Copy the fences of this many granules from one granule to another (a loan).
        Copy(u64, u64, u64),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            4 => (1u64..80).prop_map(Op::Alloc),
            4 => (any::<usize>(), 0u64..4).prop_map(|(i, f)| Op::Free(i, f)),
            1 => (0u64..128, 0u64..128, 1u64..40).prop_map(|(a, b, n)| Op::Copy(a, b, n)),
        ];
        proptest::collection::vec(op, 1..120)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Whatever frees, whole chunks or parts, and copies came before, `fences` reports
        /// for every granule the fence its last write gave it: the summaries change only
        /// how many words are read.
        #[test]
        fn fences_read_through_summaries_match_a_granule_by_granule_model(ops in ops()) {
            const GRANULES: u64 = 4 * PER_CHUNK;
            let s = Space::new(BASE, GRANULES * GRANULE, 2 * CHUNK).unwrap();
            let mut model = vec![0u64; GRANULES as usize];
            let mut live: Vec<(u64, u64)> = vec![];
            for op in ops {
                match op {
                    Op::Alloc(k) => {
                        if let Some(a) = s.alloc_large(k * GRANULE, &mut |_, _| Ok(())) {
                            live.push((a, k));
                        }
                    }
                    Op::Free(i, f) if !live.is_empty() => {
                        let (a, k) = live.swap_remove(i % live.len());
                        let fence = if f == 0 { 0 } else { fence_word(f as u32, 100 + i as u64 % 7) };
                        prop_assert!(s.free(a, k * GRANULE, fence));
                        let g = ((a - BASE) / GRANULE) as usize;
                        model[g..g + k as usize].fill(fence);
                    }
                    Op::Free(..) => {}
                    // A loan moves a page's memory to another page: the ranges never overlap.
                    Op::Copy(from, to, n) if from.abs_diff(to) >= n && from.max(to) + n <= GRANULES => {
                        s.copy_fences(BASE + from * GRANULE, BASE + to * GRANULE, n * GRANULE);
                        let src = model[from as usize..(from + n) as usize].to_vec();
                        model[to as usize..(to + n) as usize].copy_from_slice(&src);
                    }
                    Op::Copy(..) => {}
                }
                prop_assert_eq!(&per_granule(&s, BASE, GRANULES * GRANULE), &model);
            }
        }
    }

    #[test]
    fn no_fence_word_reads_as_mixed() {
        assert_ne!(fence_word(MAX_SLOTS, u64::MAX), MIXED);
    }

    #[test]
    fn chunks_are_aligned_and_their_owner_is_found_from_any_address_in_them() {
        let s = Space::new(BASE, 64 * CHUNK, 2 * CHUNK).unwrap();
        let x = s.alloc_large(GRANULE, &mut |_, _| Ok(())).unwrap();
        let c = s.alloc_chunk(false, &mut |_, _| Ok(())).unwrap();
        assert_eq!((x, c), (BASE, BASE + 32 * CHUNK), "the chunk starts at the floor");
        s.set_owner(c, 3, 9);
        assert_eq!(s.owner(c + 12345), Some((3, 9)));
        assert_eq!(s.owner(x), None);
        s.clear_owner(c);
        assert_eq!(s.owner(c), None);
        assert_eq!(s.owner(BASE - 1), None);
    }

    #[test]
    fn chunks_pack_from_the_floor_and_large_blocks_from_the_bottom() {
        let s = Space::new(BASE, 8 * CHUNK, 2 * CHUNK).unwrap();
        let any = &mut |_, _| Ok(());
        assert_eq!(s.chunk_floor(), BASE + 4 * CHUNK);
        let chunks: Vec<u64> = (0..4).map(|_| s.alloc_chunk(false, any).unwrap()).collect();
        assert_eq!(chunks, (4..8).map(|i| BASE + i * CHUNK).collect::<Vec<_>>(), "first fit above the floor");
        assert_eq!(s.alloc_large(3 * GRANULE, any), Some(BASE), "large blocks start at the bottom");
        assert_eq!(s.alloc_large(2 * CHUNK, any), Some(BASE + 3 * GRANULE), "and pack below the chunks");
    }

    #[test]
    fn a_chunk_goes_below_the_floor_only_when_no_room_is_left_above() {
        let s = Space::new(BASE, 8 * CHUNK, 2 * CHUNK).unwrap();
        let any = &mut |_, _| Ok(());
        let above: Vec<u64> = (0..4).map(|_| s.alloc_chunk(false, any).unwrap()).collect();
        assert_eq!(s.alloc_chunk(false, any), Some(BASE), "the upper half is full: the lowest fit below");
        // Room above that `accept` refuses (say, unmapped where the rung may not map) is
        // still room: no chunk goes below for it.
        assert!(s.free(above[1], CHUNK, fence_word(1, 1)));
        let floor = s.chunk_floor();
        let refuse_above = &mut |a: u64, _| if a >= floor { Err(a) } else { Ok(()) };
        assert_eq!(s.alloc_chunk(false, refuse_above), None);
        assert_eq!(s.alloc_chunk(true, refuse_above), Some(BASE + CHUNK), "asked to: the lowest fit below");
        assert!(s.free(BASE + CHUNK, CHUNK, fence_word(1, 2)));
        assert_eq!(s.alloc_chunk(false, any), Some(above[1]), "freed above the floor: taken again first");
        assert_eq!(s.alloc_chunk(false, any), Some(BASE + CHUNK));
    }

    #[test]
    fn a_give_back_keeps_the_fences() {
        let s = Space::new(BASE, 8 * CHUNK, 2 * CHUNK).unwrap();
        let a = s.alloc_large(GRANULE, &mut |_, _| Ok(())).unwrap();
        s.free(a, GRANULE, fence_word(1, 3));
        let b = s.alloc_large(GRANULE, &mut |_, _| Ok(())).unwrap();
        assert_eq!(a, b);
        assert!(s.give_back(b, GRANULE));
        s.fences(a, GRANULE, |_, _, f| {
            assert_eq!(f, fence_word(1, 3));
            true
        });
    }

    #[test]
    fn fence_runs_cross_word_chunks_and_stop_when_asked() {
        // 3 word chunks of granules; a block across the first boundary, freed in two parts.
        let words = crate::arena::words::CHUNK as u64;
        let s = Space::new(BASE, 3 * words * GRANULE, 2 * CHUNK).unwrap();
        let a = s.alloc_large((words + 20) * GRANULE, &mut |_, _| Ok(())).unwrap();
        assert!(s.free(a, (words - 10) * GRANULE, fence_word(4, 1)));
        assert!(s.free(a + (words - 10) * GRANULE, 30 * GRANULE, fence_word(5, 2)));
        let mut seen = vec![];
        s.fences(a, 3 * words * GRANULE, |g, end, f| {
            seen.push(((g - BASE) / GRANULE, (end - BASE) / GRANULE, f));
            true
        });
        let want = vec![
            (0, words - 10, fence_word(4, 1)),
            (words - 10, words + 20, fence_word(5, 2)),
            (words + 20, 3 * words, 0),
        ];
        assert_eq!(seen, want, "runs merge across the word chunk's end, and untouched chunks read as 0");
        let mut calls = 0;
        s.fences(a, 3 * words * GRANULE, |_, _, _| {
            calls += 1;
            false
        });
        assert_eq!(calls, 1);
    }
}
