//! Which physical memory each page shows: the ids behind `phys`, their reference counts
//! (`refs`) and the page whose blocks use each (`active`), and the walks that check them.
//!
//! A page mapped afresh gets an unused id; a loan makes a second page show the same id
//! ([`super::lend`]), so an id's count is the number of pages showing its memory, and the
//! memory goes back to the device only when the last of them is unmapped.
//!
//! # Invariants
//!
//! * An id with count 0 shows nowhere and may be given to fresh memory at once; one with
//!   count ≥ 1 is shown by exactly that many `MAPPED` or `LENT` pages once quiet
//!   ([`PageMap::walk_doubly_mapped`] reports a difference).
//! * At most one `MAPPED` page shows an id: the others are `LENT`.

use super::*;

impl PageMap {
    /// Page `q` shows fresh memory: give it an unused id. Ids are as many as pages and at
    /// most as many are in use as pages show memory, so one is always free; the search
    /// goes round from where the last one ended.
    pub(super) fn show_fresh(&self, q: usize) {
        let n = self.refs.len() as u64;
        for _ in 0..n {
            let id = (self.next_id.fetch_add(1, Ordering::AcqRel) % n) as usize;
            let Some(r) = self.refs.get(id, true) else { continue };
            if r.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.forget_lenders(id as u64 + 1);
                if let Some(w) = self.phys.get(q, true) {
                    w.store(id as u64 + 1, Ordering::Release);
                }
                if let Some(a) = self.active.get(id, true) {
                    a.store(q as u64 + 1, Ordering::Release);
                }
                return;
            }
        }
    }

    /// The refs word of the memory page `q` shows.
    pub(super) fn refs_of(&self, q: usize) -> Option<&AtomicU64> {
        let id = self.phys.get(q, false)?.load(Ordering::Acquire).checked_sub(1)?;
        self.refs.get(id as usize, false)
    }

    /// Whether other pages (lent ones) show the memory page `q` shows.
    pub(super) fn shared(&self, q: usize) -> bool {
        self.refs_of(q).is_some_and(|r| r.load(Ordering::Acquire) > 1)
    }

    /// One page more shows the memory page `q` shows.
    pub(super) fn add_ref(&self, q: usize) {
        if let Some(r) = self.refs_of(q) {
            r.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Page `q` no longer shows its memory; true if no page does any more.
    pub(super) fn drop_ref(&self, q: usize) -> bool {
        self.refs_of(q).is_some_and(|r| r.fetch_sub(1, Ordering::AcqRel) == 1)
    }

    /// The id (+1) of the memory page `q` shows, 0 if none (for walks).
    pub(super) fn phys_of(&self, q: usize) -> u64 {
        self.phys.get(q, false).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Bytes of physical memory shown by mapped or lent pages, by a walk (exact when quiet):
    /// what `mapped_bytes` must agree with.
    pub fn walk_physical(&self) -> u64 {
        let mut ids = Vec::new();
        for c in 0..self.words.chunks() {
            let Some(chunk) = self.words.chunk(c) else { continue };
            for (j, w) in chunk.iter().enumerate() {
                let st = w.load(Ordering::Acquire) & STATE;
                if st == MAPPED || st == LENT {
                    ids.push(self.phys_of(c * CHUNK + j));
                }
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids.len() as u64 * self.page_size()
    }

    /// The ids (+1) shown by more than one mapped page, by a walk (exact when quiet): a
    /// memory serves the blocks of one page at a time, so this is empty once quiet.
    pub fn walk_doubly_mapped(&self) -> Vec<(u64, Vec<u64>)> {
        let mut by_id: std::collections::BTreeMap<u64, Vec<u64>> = std::collections::BTreeMap::new();
        for c in 0..self.words.chunks() {
            let Some(chunk) = self.words.chunk(c) else { continue };
            for (j, w) in chunk.iter().enumerate() {
                if w.load(Ordering::Acquire) & STATE == MAPPED {
                    by_id.entry(self.phys_of(c * CHUNK + j)).or_default().push(self.page_addr(c * CHUNK + j));
                }
            }
        }
        let shown: u64 = (0..self.words.len())
            .filter(|&q| {
                self.word(q, false).is_some_and(|w| matches!(w.load(Ordering::Acquire) & STATE, MAPPED | LENT))
            })
            .count() as u64;
        let refs: u64 =
            (0..self.refs.len()).map(|i| self.refs.get(i, false).map_or(0, |r| r.load(Ordering::Acquire))).sum();
        let mut v: Vec<(u64, Vec<u64>)> = by_id.into_iter().filter(|(_, v)| v.len() > 1).collect();
        if refs != shown {
            v.push((u64::MAX, vec![refs, shown]));
        }
        v
    }

    /// Bytes of physical memory that only lent pages show (held, serving nothing until the
    /// lent pages are unmapped), by a walk: exact when quiet.
    pub fn walk_lent_only(&self) -> u64 {
        let (mut shown, mut lent) = (Vec::new(), Vec::new());
        for c in 0..self.words.chunks() {
            let Some(chunk) = self.words.chunk(c) else { continue };
            for (j, w) in chunk.iter().enumerate() {
                match w.load(Ordering::Acquire) & STATE {
                    MAPPED => shown.push(self.phys_of(c * CHUNK + j)),
                    LENT => lent.push(self.phys_of(c * CHUNK + j)),
                    _ => {}
                }
            }
        }
        shown.sort_unstable();
        lent.sort_unstable();
        lent.dedup();
        lent.iter().filter(|id| shown.binary_search(id).is_err()).count() as u64 * self.page_size()
    }
}
