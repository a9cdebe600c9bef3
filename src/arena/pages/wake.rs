//! Which lent pages could take their memory back now: the *awake* ones.
//!
//! A lent page (see [`lend`](super::lend)) serves a block again only by a switch, which needs
//! the page its memory went to (the memory's *active* page) free. Judging that took four
//! dependent loads (the page's word, its memory's id, the id's active page, that page's
//! word), and placements judged every lent page they passed: in a steady state most are
//! dead, their memory busy where it went, and the 1-thread random window judged 57 a walk on
//! average and up to 511 (`docs/BENCHMARKS.md`, twenty-eighth session), about half of its
//! time below the caches. But a dead lent page can come alive only when its memory's active
//! page falls free, an event the page map sees. So each lent page has an *awake* bit: set
//! for the memory's lent pages when its active page falls free, cleared by a judgement that
//! finds that page busy. A placement passes an asleep page with its word and one bit.
//!
//! # What it owns
//!
//! Per memory id, [`SLOTS`] slots naming (page + 1) the lent pages that show it: what a page
//! falling free reads to wake them. A lent page that finds every slot taken is *untracked*:
//! awake until it stops being lent (judged each time, as before this module). And the two
//! bit sets over pages, awake and untracked, in lazily made words.
//!
//! # Invariants
//!
//! * Every `LENT` page is in one of its memory's slots or untracked, once quiet.
//! * Once quiet, every `LENT` page whose memory's active page is free is awake. Walks rely on
//!   nothing else: an awake page whose memory is busy costs one judgement, and a bit left on
//!   a page that stopped being lent is never read as anything (its word is checked first).
//!
//! # Why no wake is lost, without a lock
//!
//! The slots of one memory change only while its active page is held (a loan from it, a
//! switch back to one of its lent pages), or by the unmapping of one of its lent pages
//! (which only empties that page's slot); a wake reads them after the active page fell free,
//! which the holder's changes happen before. A page falls free by an RMW or store on its word,
//! *then* sets its lenders' bits with an RMW; a judgement that finds the active page busy
//! clears the bit with an RMW, *then* judges again. If the clear comes after the set in the
//! bit word's order, it reads from it, so the second judgement sees the page free and sets
//! the bit back; if before, the set comes after it. Either way the bit is left set (the
//! `HBitmap` hints and the free-page hints of [`lend`](super::lend) rest on the same
//! argument; `loom_tests/tests/arena.rs` models this one).

use super::*;

/// Lent pages one memory names for its wakes; more go untracked. Eight: on the 1-thread
/// random window, with four slots 0.49 M of 0.80 M judgements in 5 M pairs were of untracked
/// pages, with eight 24 thousand of 0.35 M, with sixteen none of 0.32 M
/// (`docs/BENCHMARKS.md`, twenty-eighth session).
pub const SLOTS: usize = 8;

/// The lenders' slots and the awake and untracked bits. See the module docs.
pub(super) struct Wake {
    /// `SLOTS` words per memory id: a lent page showing it (+1), or 0.
    slots: LazyWords,
    /// A bit per page: lent, and its memory's active page may be free.
    awake: LazyWords,
    /// A bit per page: lent, and in none of its memory's slots.
    untracked: LazyWords,
}

/// A lent page as a placement sees it before judging it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lent {
    /// Not lent.
    No,
    /// Lent, and its memory's active page has not fallen free since a judgement found it
    /// busy: no switch is possible.
    Asleep,
    /// Lent, and worth a judgement ([`PageMap::switch_source`]).
    Awake,
}

/// The word holding page `p`'s bit in a bit set, and the bit.
fn bit_of(bits: &LazyWords, p: usize, make: bool) -> Option<(&AtomicU64, u64)> {
    Some((bits.get(p / 64, make)?, 1u64 << (p % 64)))
}

fn set_bit(bits: &LazyWords, p: usize) {
    if let Some((w, b)) = bit_of(bits, p, true) {
        w.fetch_or(b, Ordering::AcqRel);
    }
}

/// Clear page `p`'s bit; true if this call cleared it.
fn clear_bit(bits: &LazyWords, p: usize) -> bool {
    bit_of(bits, p, false).is_some_and(|(w, b)| w.fetch_and(!b, Ordering::AcqRel) & b != 0)
}

fn has_bit(bits: &LazyWords, p: usize) -> bool {
    bit_of(bits, p, false).is_some_and(|(w, b)| w.load(Ordering::Acquire) & b != 0)
}

impl Wake {
    pub(super) fn new(pages: usize) -> Wake {
        Wake {
            slots: LazyWords::new(pages * SLOTS),
            awake: LazyWords::new(pages.div_ceil(64)),
            untracked: LazyWords::new(pages.div_ceil(64)),
        }
    }

    /// The slots of memory `id` (+1, as `phys` holds it).
    fn slots_of(&self, id: u64, make: bool) -> impl Iterator<Item = &AtomicU64> {
        let first = (id.saturating_sub(1) as usize).saturating_mul(SLOTS);
        let slots = if id == 0 { 0..0 } else { first..first + SLOTS };
        slots.filter_map(move |i| self.slots.get(i, make))
    }
}

impl PageMap {
    /// Page `p` became a lent page of memory `id` (+1): name it in a free slot, or leave it
    /// untracked (and so awake).
    pub(super) fn track_lender(&self, id: u64, p: usize) {
        let named = self
            .wake
            .slots_of(id, true)
            .any(|s| s.compare_exchange(0, p as u64 + 1, Ordering::AcqRel, Ordering::Acquire).is_ok());
        if !named {
            set_bit(&self.wake.untracked, p);
            set_bit(&self.wake.awake, p);
        }
    }

    /// Page `p` stops being a lent page of memory `id` (+1), held by this thread or being
    /// unmapped by it.
    pub(super) fn untrack_lender(&self, id: u64, p: usize) {
        let mine = p as u64 + 1;
        let named = self
            .wake
            .slots_of(id, false)
            .any(|s| s.compare_exchange(mine, 0, Ordering::AcqRel, Ordering::Acquire).is_ok());
        if !named {
            clear_bit(&self.wake.untracked, p);
        }
        clear_bit(&self.wake.awake, p);
    }

    /// Memory `id` (+1) is fresh: no page lends it yet (its slots are empty once its last
    /// page went; emptied here too, so that a slot a failed removal left cannot wake a page
    /// of other memory).
    pub(super) fn forget_lenders(&self, id: u64) {
        for s in self.wake.slots_of(id, false) {
            s.store(0, Ordering::Release);
        }
    }

    /// Page `q` just fell free (its word says so): wake the lent pages of its memory.
    pub(super) fn wake_lenders(&self, q: usize) {
        if !self.shared(q) {
            return;
        }
        let id = self.phys_of(q);
        for s in self.wake.slots_of(id, false) {
            if let Some(p) = s.load(Ordering::Acquire).checked_sub(1) {
                set_bit(&self.wake.awake, p as usize);
            }
        }
    }

    /// Whether the page holding `page_addr` is lent, and if so whether it is worth judging.
    pub fn lent(&self, page_addr: u64) -> Lent {
        let Some((p, _)) = self.span(page_addr, 1) else { return Lent::No };
        match self.word(p, false) {
            Some(w) if w.load(Ordering::Acquire) & STATE == LENT => {
                if has_bit(&self.wake.awake, p) {
                    Lent::Awake
                } else {
                    Lent::Asleep
                }
            }
            _ => Lent::No,
        }
    }

    /// The address of the first page at or after `page_addr` that is not an asleep lent
    /// page: what a placement passing a run of them skips to, reading their words and bits a
    /// chunk and a bit word at a time.
    pub fn past_asleep(&self, page_addr: u64) -> u64 {
        let Some((mut p, _)) = self.span(page_addr, 1) else { return page_addr };
        'chunks: while p < self.words.len() {
            let Some(chunk) = self.words.chunk(p / CHUNK) else { break };
            let mut bits = (usize::MAX, 0u64);
            for w in &chunk[p % CHUNK..] {
                if bits.0 != p / 64 {
                    bits = (p / 64, self.wake.awake.get(p / 64, false).map_or(0, |b| b.load(Ordering::Acquire)));
                }
                if w.load(Ordering::Acquire) & STATE != LENT || bits.1 & (1 << (p % 64)) != 0 {
                    break 'chunks;
                }
                p += 1;
            }
        }
        self.page_addr(p)
    }

    /// The judgement itself: the active page of the memory lent page `p` shows, if it is
    /// free now.
    fn free_twin(&self, p: usize) -> Option<usize> {
        let a = self.active_of(p)?;
        (self.word(a, false)?.load(Ordering::Acquire) == MAPPED).then_some(a)
    }

    /// If the lent page `p` is awake and its memory's active page is free now, that page;
    /// an awake page found busy is put to sleep (see the module docs for the second look).
    pub(super) fn judge_awake(&self, p: usize) -> Option<usize> {
        if !has_bit(&self.wake.awake, p) {
            return None;
        }
        if let Some(a) = self.free_twin(p) {
            return Some(a);
        }
        if has_bit(&self.wake.untracked, p) || !clear_bit(&self.wake.awake, p) {
            return None;
        }
        let again = self.free_twin(p);
        if again.is_some() {
            set_bit(&self.wake.awake, p);
        }
        again
    }

    /// The lent pages whose memory's active page is free but which are asleep, by a walk:
    /// none once quiet, or a placement could never switch them back.
    pub fn walk_asleep_switchable(&self) -> Vec<u64> {
        let mut v = Vec::new();
        for c in 0..self.words.chunks() {
            let Some(chunk) = self.words.chunk(c) else { continue };
            for (j, w) in chunk.iter().enumerate() {
                let p = c * CHUNK + j;
                if w.load(Ordering::Acquire) != LENT || has_bit(&self.wake.awake, p) {
                    continue;
                }
                if self.free_twin(p).is_some() {
                    v.push(self.page_addr(p));
                }
            }
        }
        v
    }
}
