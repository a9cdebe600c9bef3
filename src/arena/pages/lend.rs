//! Lending: moving the memory of wholly free pages to where a block needs it, without waiting
//! for the device, and back again without a device call.
//!
//! A pool that would grow past its peak while free pages stay mapped where the request does
//! not fit trades pages: their memory goes where the request lands. Unmapping a free page
//! first would need every stream's work on it to be complete (an unmap is the host's, and
//! work still queued would fault), so on a busy device the trade would wait, or the pool
//! would grow. A loan needs no wait: the free page's memory is mapped *also* under the
//! request's page (`Device::alias`), and the free page stays mapped, serving nothing
//! (`LENT`). The new user of the memory is ordered after the old work as any reuse is: by
//! stream order on the same stream, by the old fences' events otherwise — what the
//! caller's judgement (`accept`, [`Mapper::switch`]) checks.
//!
//! A lent page is *dormant*, not gone: when a block later lands on it while the page its
//! memory went to is free, the memory comes back with no device call at all — the two pages
//! swap roles (see [`PageMap::acquire`]). A workload that moves between a few layouts, as a
//! server repeating its requests does, so keeps finding its memory where it needs it, and
//! maps nothing once warm. Lent pages are unmapped, once no work queued on them remains,
//! when memory is given back (trim), and oldest (lowest) first when they outnumber the
//! mapped pages by the pool's bound ([`PageMap::unmap_lent`]'s `keep`): every placement
//! judges each lent page it passes, so a server that keeps lending would otherwise slow down
//! for as long as it runs.
//!
//! # Invariants
//!
//! * Every page mapped or lent names the id of the physical memory it shows (`phys`);
//!   `refs[id]` counts the pages that show it, and `active[id]` names the one whose blocks
//!   use it (`MAPPED`): the others are `LENT`, with count 0, never acquired as they are.
//!   `mapped_bytes` counts each id once; memory goes back to the device when the last page
//!   showing it is unmapped, so a page whose memory lent pages also show is unmapped after
//!   them.
//! * A loan and a return hold the pages they move in `MAPPING` (as a mapper does) while they
//!   judge and call the device, so no unmapper, lender or acquirer can take them meanwhile;
//!   an unmapper claims a `LENT` page (`LENT` → `UNMAPPING`) only when nobody holds it.
//! * Loans are of single pages (runs of one page: the default `map_run_pages`).

use super::*;

/// Free-page hints of pages freed together, gathered one bitmap word at a time (pages in
/// increasing order): a large block's free sets them in one RMW per 64 pages, not one each.
#[derive(Default)]
pub(super) struct HintWord {
    /// The bitmap word and the bits gathered for it.
    pending: Option<(usize, u64)>,
}

impl HintWord {
    /// Page `p` was just left free.
    pub(super) fn add(&mut self, m: &PageMap, p: usize) {
        let bit = m.hint_bit(p);
        let (word, b) = (bit / 64, 1u64 << (bit % 64));
        match &mut self.pending {
            Some((w, mask)) if *w == word => *mask |= b,
            _ => {
                self.flush(m);
                self.pending = Some((word, b));
            }
        }
    }

    /// Set the bits gathered so far.
    pub(super) fn flush(&mut self, m: &PageMap) {
        if let Some((word, mask)) = self.pending.take() {
            m.free_hint.set_word(word, mask);
        }
    }
}

impl PageMap {
    /// Pages `LENT` now.
    pub fn lent_pages(&self) -> u64 {
        self.lent.load(Ordering::Acquire)
    }

    /// The free-page hint bit of page `p`, and the page of bit `p` (the map is its own
    /// inverse): the highest page is bit 0, so that the walk of [`PageMap::lend`] meets the
    /// highest pages first.
    pub(super) fn hint_bit(&self, p: usize) -> usize {
        self.words.len() - 1 - p
    }

    /// Say that page `p` may be free now (its word says `MAPPED` with count 0): called after
    /// the write that made it so.
    pub(super) fn hint_free(&self, p: usize) {
        self.free_hint.set(self.hint_bit(p));
    }

    /// The free pages (`MAPPED` with count 0) whose hint is not set, by a walk: none once
    /// quiet, or a loan could never be offered them.
    pub fn walk_unhinted_free(&self) -> Vec<u64> {
        let mut v = Vec::new();
        self.for_each_mapped(|addr, count| {
            let p = ((addr - self.base) >> self.page_shift) as usize;
            if count == 0 && !self.free_hint.contains(self.hint_bit(p)) {
                v.push(addr);
            }
        });
        v
    }

    /// Let go of page `p` (word `w`), held by this thread, with the word `v` it had before.
    /// A page that goes back free gets its hint again: another lender may have met it held,
    /// taken its hint for stale and dropped it.
    pub(super) fn give_back(&self, p: usize, w: &AtomicU64, v: u64) {
        w.store(v, Ordering::Release);
        if is_free(v) {
            self.hint_free(p);
            // Its memory's lent pages judged it busy while it was held.
            self.wake_lenders(p);
        }
    }

    /// Drop the hint of page `p` (word `w`), seen not free, then look at the page again, in
    /// case it was freed between the two and its free's bit went before our clear: the clear
    /// is an RMW that the free's RMW on the bit is ordered against (as in `hbitmap`), so the
    /// second look sees any free whose bit the clear removed, and sets the bit back.
    fn drop_hint(&self, p: usize, w: &AtomicU64) {
        if self.free_hint.try_clear(self.hint_bit(p)) && is_free(w.load(Ordering::Acquire)) {
            self.hint_free(p);
        }
    }

    /// The page index (+1) whose blocks use the memory page `q` shows.
    pub(super) fn active_of(&self, q: usize) -> Option<usize> {
        let id = self.phys.get(q, false)?.load(Ordering::Acquire).checked_sub(1)?;
        let a = self.active.get(id as usize, false)?.load(Ordering::Acquire).checked_sub(1)?;
        Some(a as usize)
    }

    /// If the page at `page_addr` is lent and the page its memory serves is free now, that
    /// page's address: a block landing on the lent page would take the memory back from it
    /// (a hint for placements, which must not want that page too). An asleep page (see
    /// [`wake`]) is answered at once.
    pub fn switch_source(&self, page_addr: u64) -> Option<u64> {
        let (p, _) = self.span(page_addr, 1)?;
        if self.word(p, false)?.load(Ordering::Acquire) != LENT {
            return None;
        }
        self.judge_awake(p).map(|a| self.page_addr(a))
    }

    /// Lend the memory of a wholly free single-page run, highest first, to the page at `to`,
    /// which the caller holds for mapping (inside [`Mapper::map`] of [`PageMap::acquire`]):
    /// `accept(from, len)` must take the page (the work queued on it is ordered before the
    /// new user's), and `alias(from, to, len)` maps its memory at `to`. True when lent: the
    /// mapper then answers [`Backing::Lent`].
    pub fn lend(
        &self,
        to: u64,
        len: usize,
        accept: &mut dyn FnMut(u64, u64) -> bool,
        alias: &mut dyn FnMut(u64, u64, usize) -> Result<(), Error>,
    ) -> bool {
        let page = self.page_size();
        let Some((target, last)) = self.span(to, len as u64) else { return false };
        if target != last || len as u64 != page || self.free_mapped_pages() == 0 {
            return false;
        }
        let mut lent = false;
        // The hints, highest page first; each candidate is judged by its word.
        self.free_hint.walk(&mut |bit| {
            let p = self.hint_bit(bit);
            let Some(w) = self.word(p, false) else { return true };
            let v = w.load(Ordering::Acquire);
            if !is_free(v) {
                self.drop_hint(p, w);
                return true;
            }
            // A run of one page (free pages of longer runs keep their hints: never lent, they
            // may be unmapped or taken by blocks).
            let single = v & CONT == 0 && self.word(p + 1, false).is_none_or(|w| w.load(Ordering::Acquire) & CONT == 0);
            if !single || p == target {
                return true;
            }
            // Held while judged and aliased: no block, unmapper or other lender can take it.
            if w.compare_exchange(MAPPED, HELD, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return true;
            }
            let from = self.page_addr(p);
            if !accept(from, page) || alias(from, to, len).is_err() {
                self.give_back(p, w, MAPPED);
                return true;
            }
            let id = self.phys_of(p);
            if let Some(t) = self.phys.get(target, true) {
                t.store(id, Ordering::Release);
            }
            self.add_ref(target);
            if let Some(a) = id.checked_sub(1).and_then(|id| self.active.get(id as usize, false)) {
                a.store(target as u64 + 1, Ordering::Release);
            }
            // The memory is counted once, as before; the borrower's mapper answers
            // `Backing::Lent` and adds nothing to `mapped`. The lender leaves the free pages.
            self.free_mapped.fetch_sub(1, Ordering::AcqRel);
            self.lent.fetch_add(1, Ordering::AcqRel);
            // Asleep: its memory's page is held for a block.
            self.track_lender(id, p);
            w.store(LENT, Ordering::Release);
            self.drop_hint(p, w);
            lent = true;
            false
        });
        lent
    }

    /// The lent page `p` is wanted by a block: if the page its memory serves is free, hold
    /// both, let `map.switch` judge and carry the fences over, and make `p` the memory's
    /// active page with the caller's reference (count 1), the other page lent. False, with
    /// nothing changed, otherwise.
    pub(super) fn reactivate(&self, p: usize, map: &mut dyn Mapper) -> bool {
        let Some(w) = self.word(p, false) else { return false };
        if w.compare_exchange(LENT, HELD, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        // Held: `p` shows the same memory until we let go.
        let id = self.phys_of(p);
        let twin = self.active_of(p).filter(|&a| a != p).and_then(|a| Some((a, self.word(a, false)?)));
        let Some((a, aw)) = twin else {
            w.store(LENT, Ordering::Release);
            return false;
        };
        if aw.compare_exchange(MAPPED, HELD, Ordering::AcqRel, Ordering::Acquire).is_err() {
            w.store(LENT, Ordering::Release);
            return false;
        }
        // `a` may have been unmapped and mapped afresh since it was named the active page:
        // only the page still showing the same memory will do.
        if self.phys_of(a) != id || !map.switch(self.page_addr(a), self.page_addr(p)) {
            self.give_back(a, aw, MAPPED);
            w.store(LENT, Ordering::Release);
            return false;
        }
        if let Some(act) = id.checked_sub(1).and_then(|id| self.active.get(id as usize, false)) {
            act.store(p as u64 + 1, Ordering::Release);
        }
        // `a` takes `p`'s place among the memory's lent pages, asleep: `p` gets a block.
        self.untrack_lender(id, p);
        self.track_lender(id, a);
        // `a` leaves the free mapped pages for LENT; `p` leaves LENT with the caller's block:
        // the lent count is unchanged.
        self.free_mapped.fetch_sub(1, Ordering::AcqRel);
        aw.store(LENT, Ordering::Release);
        w.store(ONE | MAPPED, Ordering::Release);
        true
    }

    /// Unmap the `LENT` pages that `accept(from, len)` says no work can touch any more (their
    /// memory stays with the page it serves; `unmap` is told how much memory goes back, as in
    /// [`PageMap::unmap_free`]), lowest first, until at most `keep` remain. Returns the bytes
    /// unmapped.
    pub fn unmap_lent(
        &self,
        keep: u64,
        accept: &mut dyn FnMut(u64, u64) -> bool,
        unmap: &mut dyn FnMut(u64, usize, u64) -> Result<(), Error>,
    ) -> u64 {
        let page = self.page_size();
        let mut unmapped = 0;
        for c in 0..self.words.chunks() {
            let Some(chunk) = self.words.chunk(c) else { continue };
            for (j, w) in chunk.iter().enumerate() {
                if self.lent_pages() <= keep {
                    return unmapped;
                }
                let p = c * CHUNK + j;
                if w.load(Ordering::Acquire) != LENT || !accept(self.page_addr(p), page) {
                    continue;
                }
                if let Some(bytes) = self.unmap_run(p, p, LENT, unmap) {
                    unmapped += bytes;
                }
            }
        }
        unmapped
    }
}
