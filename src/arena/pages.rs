//! The page map: which physical pages are mapped under the arena's range, and how many live
//! blocks lie on each.
//!
//! # What it owns
//!
//! One `AtomicU64` per page of the range, packing `count << 3 | cont << 2 | state`: `state` is one of
//! [`UNMAPPED`], [`MAPPING`], [`MAPPED`], [`UNMAPPING`]; `count` is the number of live blocks
//! that overlap the page; `cont` says the page was mapped in one call with the page before it
//! (a *run*: up to [`MAX_RUN`] pages, one physical allocation, unmapped whole). The words live in chunks of up to 512 made the first time a page in
//! them is touched and published with a CAS into a directory of `AtomicPtr`s (the loser frees
//! its own chunk); chunks are freed when the map drops. Metadata is thus one pointer per 512
//! pages of range (8 bytes per GiB at 2 MiB pages) plus 4 KiB per 1 GiB region in use. It
//! also keeps `mapped`, `peak` and `free_mapped` (pages mapped with count 0) counters. It
//! calls the device through callbacks and never holds a lock while doing so.
//!
//! # Invariants
//!
//! * `count > 0` ⇒ the page is `MAPPED`, or `MAPPING` by the one thread mapping it (which
//!   holds count 1 while it maps).
//! * Only the thread that moved a page into `MAPPING` or `UNMAPPING` writes its word until it
//!   moves it out again; so a page is never mapped twice, nor unmapped under a live block.
//! * `mapped_bytes` = pages `MAPPED` × page size, once quiet.
//!
//! # Why it is lock-free, and its one wait
//!
//! Taking a reference on a mapped page, dropping one, and claiming a free page to unmap are
//! single-word CASes. A thread that finds a page `MAPPING` or `UNMAPPING` yields until the
//! thread doing the device call finishes: two threads must not map one page twice, and the
//! second has nothing to do with the page until the first is done. That is the only wait, on
//! device calls (tens of µs), never on another thread's bookkeeping.

use super::words::{LazyWords, CHUNK};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::yield_now;
use crate::Error;

/// The page is not backed by physical memory.
pub const UNMAPPED: u64 = 0;
/// A thread is mapping the page (and holds count 1 on it).
pub const MAPPING: u64 = 1;
/// The page is mapped.
pub const MAPPED: u64 = 2;
/// A thread is unmapping the page (count 0).
pub const UNMAPPING: u64 = 3;

const STATE: u64 = 3;
/// Set on every page of a run but its first: the page was mapped in one call with the page
/// before it, and can only be unmapped with it.
const CONT: u64 = 4;
const COUNT_SHIFT: u32 = 3;
const ONE: u64 = 1 << COUNT_SHIFT;
/// The most pages a map may map in one call (see [`PageMap::with_max_run`]).
pub const MAX_RUN: usize = 64;
/// The most pages a map may cover (its directory is made eagerly: 2^30 / 512 pointers).
const MAX_PAGES: u64 = 1 << 30;

/// Why [`PageMap::acquire`] failed; the pages it had taken are given back either way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// A page is unmapped and the caller did not allow mapping.
    NeedsMap,
    /// The map callback failed, or the range is not in the map.
    Failed(Error),
}

/// The page map of one address range. See the module docs.
pub struct PageMap {
    base: u64,
    range: u64,
    page_shift: u32,
    /// One word per page.
    words: LazyWords,
    mapped: AtomicU64,
    peak: AtomicU64,
    /// Pages `MAPPED` with count 0. Updated after the CAS that changes a page, so it may dip
    /// below zero for a moment (wrapping); read through `free_mapped_pages`.
    free_mapped: AtomicU64,
    /// The most pages mapped in one call.
    max_run: usize,
}

impl std::fmt::Debug for PageMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageMap")
            .field("base", &self.base)
            .field("range", &self.range)
            .field("page", &self.page_size())
            .field("mapped", &self.mapped_bytes())
            .finish_non_exhaustive()
    }
}

impl PageMap {
    /// A map of `[base, base + range)` in pages of `page` bytes (a power of two), all unmapped.
    /// `base` and `range` must be multiples of `page`.
    pub fn new(base: u64, range: u64, page: u64) -> Result<PageMap, Error> {
        if !page.is_power_of_two() || range == 0 || range % page != 0 || base % page != 0 {
            return Err(Error::InvalidArgument(format!(
                "page map: page {page:#x} must be a power of two dividing base {base:#x} and range {range:#x}"
            )));
        }
        if base.checked_add(range).is_none() || range / page > MAX_PAGES {
            return Err(Error::InvalidArgument(format!("page map: range {range:#x} too large for page {page:#x}")));
        }
        let pages = (range / page) as usize;
        Ok(PageMap {
            base,
            range,
            page_shift: page.trailing_zeros(),
            words: LazyWords::new(pages),
            mapped: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            free_mapped: AtomicU64::new(0),
            max_run: MAX_RUN,
        })
    }

    /// Map at most `pages` pages (1..=[`MAX_RUN`]) in one call. Longer runs map faster (one
    /// physical allocation each) but go back only whole: a run with one live block on one of
    /// its pages stays mapped, so they cost memory on workloads that churn.
    pub fn with_max_run(mut self, pages: usize) -> PageMap {
        self.max_run = pages.clamp(1, MAX_RUN);
        self
    }

    /// The page size in bytes.
    pub fn page_size(&self) -> u64 {
        1 << self.page_shift
    }

    /// The word of page `p`, making its chunk when `make`.
    fn word(&self, p: usize, make: bool) -> Option<&AtomicU64> {
        self.words.get(p, make)
    }

    /// Pages `first..=last` overlapping `[addr, addr + len)`, if that lies in the map.
    fn span(&self, addr: u64, len: u64) -> Option<(usize, usize)> {
        let off = addr.checked_sub(self.base)?;
        let end = off.checked_add(len)?;
        if len == 0 || end > self.range {
            return None;
        }
        Some(((off >> self.page_shift) as usize, ((end - 1) >> self.page_shift) as usize))
    }

    fn page_addr(&self, p: usize) -> u64 {
        self.base + ((p as u64) << self.page_shift)
    }

    /// Take a reference on every page overlapping `[addr, addr + len)`, mapping unmapped ones
    /// through `map(addr, bytes)` when `may_map`: consecutive unmapped pages (up to the map's
    /// run length) are claimed together and mapped in one call, as one physical allocation
    /// (on an H200 one call for 64 pages costs about what 4 single pages do). On failure the
    /// references this call took are given back, and pages whose map failed are left
    /// unmapped: no state is damaged.
    pub fn acquire(
        &self,
        addr: u64,
        len: u64,
        may_map: bool,
        map: &mut dyn FnMut(u64, usize) -> Result<(), Error>,
    ) -> Result<(), Acquire> {
        let Some((first, last)) = self.span(addr, len) else {
            return Err(Acquire::Failed(Error::InvalidArgument(format!(
                "page map: [{addr:#x}, +{len:#x}) is not inside the range"
            ))));
        };
        // Pages this call holds in MAPPING, not yet mapped: `run.0 .. run.0 + run.1`.
        let mut run: Option<(usize, usize)> = None;
        let fail = |run: Option<(usize, usize)>, e: Acquire| {
            let held_to = run.map_or(usize::MAX, |r| r.0);
            if let Some((s, n)) = run {
                self.abandon_run(s, n);
            }
            (first, held_to, e)
        };
        let mut p = first;
        while p <= last {
            let Some(w) = self.word(p, true) else {
                let (f, to, e) =
                    fail(run, Acquire::Failed(Error::InvalidArgument("page map: page out of range".into())));
                self.release_pages(f, to.min(p));
                return Err(e);
            };
            let mut cur = w.load(Ordering::Acquire);
            let done = loop {
                let state = cur & STATE;
                if state != UNMAPPED {
                    // The run of unmapped pages ends here: map it before anything else, so
                    // no page is held in MAPPING while this thread waits on another.
                    if let Some((s, n)) = run.take() {
                        if let Err(e) = self.map_run(s, n, map) {
                            self.release_pages(first, s);
                            return Err(Acquire::Failed(e));
                        }
                    }
                }
                match state {
                    MAPPED => match w.compare_exchange_weak(cur, cur + ONE, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => {
                            if cur >> COUNT_SHIFT == 0 {
                                self.free_mapped.fetch_sub(1, Ordering::AcqRel);
                            }
                            break true;
                        }
                        Err(now) => cur = now,
                    },
                    UNMAPPED if !may_map => break false,
                    UNMAPPED => {
                        let cont = matches!(run, Some((s, n)) if s + n == p && n < self.max_run);
                        let claim = ONE | MAPPING | if cont { CONT } else { 0 };
                        match w.compare_exchange_weak(cur, claim, Ordering::AcqRel, Ordering::Acquire) {
                            Ok(_) => {
                                if cont {
                                    if let Some(r) = run.as_mut() {
                                        r.1 += 1;
                                    }
                                } else {
                                    if let Some((s, n)) = run.take() {
                                        if let Err(e) = self.map_run(s, n, map) {
                                            // `p` is held too: give it back with the run.
                                            self.abandon_run(p, 1);
                                            self.release_pages(first, s);
                                            return Err(Acquire::Failed(e));
                                        }
                                    }
                                    run = Some((p, 1));
                                }
                                break true;
                            }
                            Err(now) => cur = now,
                        }
                    }
                    // MAPPING or UNMAPPING: another thread is in a device call for this page.
                    _ => {
                        yield_now();
                        cur = w.load(Ordering::Acquire);
                    }
                }
            };
            if !done {
                // Needs a map the caller does not allow: no run can be pending (runs are
                // only made when mapping is allowed).
                self.release_pages(first, p);
                return Err(Acquire::NeedsMap);
            }
            p += 1;
        }
        if let Some((s, n)) = run {
            if let Err(e) = self.map_run(s, n, map) {
                self.release_pages(first, s);
                return Err(Acquire::Failed(e));
            }
        }
        Ok(())
    }

    /// Map the `n` pages from `s`, which this thread holds in MAPPING (count 1 each), in one
    /// call; on success they become MAPPED (the first a run head, the rest `CONT`), on failure
    /// UNMAPPED again.
    fn map_run(&self, s: usize, n: usize, map: &mut dyn FnMut(u64, usize) -> Result<(), Error>) -> Result<(), Error> {
        let page = self.page_size();
        // `page * n` is at most MAX_RUN pages of a range that fits in memory maps; usize is
        // 64-bit on every target the pool supports, so the cast is exact.
        match map(self.page_addr(s), (page * n as u64) as usize) {
            Ok(()) => {
                for q in s..s + n {
                    if let Some(w) = self.word(q, false) {
                        // We alone write the word while it is MAPPING: a store will do.
                        let cont = if q > s { CONT } else { 0 };
                        w.store(ONE | MAPPED | cont, Ordering::Release);
                    }
                }
                let now = self.mapped.fetch_add(page * n as u64, Ordering::AcqRel) + page * n as u64;
                self.peak.fetch_max(now, Ordering::AcqRel);
                Ok(())
            }
            Err(e) => {
                self.abandon_run(s, n);
                Err(e)
            }
        }
    }

    /// Give back pages held in MAPPING that will not be mapped.
    fn abandon_run(&self, s: usize, n: usize) {
        for q in s..s + n {
            if let Some(w) = self.word(q, false) {
                w.store(UNMAPPED, Ordering::Release);
            }
        }
    }

    /// Drop one reference on each page `from..to`. False if some page had none (it is left
    /// as it was).
    fn release_pages(&self, from: usize, to: usize) -> bool {
        let mut ok = true;
        for p in from..to {
            let Some(w) = self.word(p, false) else {
                ok = false;
                continue;
            };
            let mut cur = w.load(Ordering::Acquire);
            loop {
                if cur & STATE != MAPPED || cur >> COUNT_SHIFT == 0 {
                    ok = false;
                    break;
                }
                match w.compare_exchange_weak(cur, cur - ONE, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        if cur >> COUNT_SHIFT == 1 {
                            self.free_mapped.fetch_add(1, Ordering::AcqRel);
                        }
                        break;
                    }
                    Err(now) => cur = now,
                }
            }
        }
        ok
    }

    /// Drop the references [`acquire`](Self::acquire) took on the pages overlapping
    /// `[addr, addr + len)`; pages stay mapped ("free but mapped" at count 0). False, leaving
    /// such pages alone, for a range outside the map or a page that held no reference.
    pub fn release(&self, addr: u64, len: u64) -> bool {
        match self.span(addr, len) {
            Some((first, last)) => self.release_pages(first, last + 1),
            None => false,
        }
    }

    /// Unmap wholly free runs of mapped pages (a run is what one map call mapped: it goes
    /// back whole or not at all), highest address first (placement is lowest first, so high
    /// pages are the least likely to be wanted again), until at most `keep_bytes` of free
    /// mapped pages remain. A run whose unmap fails stays mapped. Returns the bytes unmapped.
    pub fn unmap_free(&self, keep_bytes: u64, unmap: &mut dyn FnMut(u64, usize) -> Result<(), Error>) -> u64 {
        let page = self.page_size();
        let mut unmapped = 0;
        let mut p = self.words.len();
        while p > 0 {
            p -= 1;
            if self.free_mapped_pages().saturating_mul(page) <= keep_bytes {
                break;
            }
            let Some(w) = self.word(p, false) else {
                // The whole chunk is absent: skip to its start.
                p -= p % CHUNK;
                continue;
            };
            let v = w.load(Ordering::Acquire);
            if v & STATE != MAPPED || v >> COUNT_SHIFT != 0 {
                continue;
            }
            // The run around `p`: back to its head, forward to its last page.
            let mut head = p;
            while head > 0 && self.word(head, false).is_some_and(|w| w.load(Ordering::Acquire) & CONT != 0) {
                head -= 1;
            }
            let mut end = p;
            while self.word(end + 1, false).is_some_and(|w| w.load(Ordering::Acquire) & CONT != 0) {
                end += 1;
            }
            if let Some(bytes) = self.unmap_run(head, end, unmap) {
                unmapped += bytes;
            }
            p = head;
        }
        unmapped
    }

    /// Claim every page of the run `head..=end` (MAPPED, count 0 → UNMAPPING), unmap it in one
    /// call and mark it UNMAPPED. If a page is taken meanwhile, or the unmap fails, the pages
    /// claimed go back to MAPPED. Returns the bytes unmapped.
    fn unmap_run(
        &self,
        head: usize,
        end: usize,
        unmap: &mut dyn FnMut(u64, usize) -> Result<(), Error>,
    ) -> Option<u64> {
        let page = self.page_size();
        let mut claimed = Vec::with_capacity(end - head + 1);
        for q in head..=end {
            let w = self.word(q, false)?;
            let cont = if q > head { CONT } else { 0 };
            let free = MAPPED | cont;
            if w.compare_exchange(free, UNMAPPING | cont, Ordering::AcqRel, Ordering::Acquire).is_err() {
                for (c, cw) in claimed {
                    let cw: &AtomicU64 = cw;
                    cw.store(MAPPED | c, Ordering::Release);
                }
                return None;
            }
            claimed.push((cont, w));
        }
        let n = claimed.len() as u64;
        self.free_mapped.fetch_sub(n, Ordering::AcqRel);
        // Out of `mapped` before the unmap call: the caller's `unmap` gives the pages' budget
        // back once the device has them, and a mapper may then map at once; were they still
        // counted here, its `mapped` (and so the peak) would briefly count them twice.
        self.mapped.fetch_sub(page * n, Ordering::AcqRel);
        match unmap(self.page_addr(head), (page * n) as usize) {
            Ok(()) => {
                for (_, w) in claimed {
                    w.store(UNMAPPED, Ordering::Release);
                }
                Some(page * n)
            }
            Err(_) => {
                self.mapped.fetch_add(page * n, Ordering::AcqRel);
                for (c, w) in claimed {
                    w.store(MAPPED | c, Ordering::Release);
                }
                self.free_mapped.fetch_add(n, Ordering::AcqRel);
                None
            }
        }
    }

    /// Bytes mapped now.
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped.load(Ordering::Acquire)
    }

    /// The most bytes ever mapped at once.
    pub fn peak_mapped_bytes(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Pages mapped with no live block on them: exact when quiet.
    pub fn free_mapped_pages(&self) -> u64 {
        let v = self.free_mapped.load(Ordering::Acquire);
        // A transient dip below zero reads as a huge number: call it zero.
        if v > u64::MAX / 2 {
            0
        } else {
            v
        }
    }

    /// True if the page holding `page_addr` is mapped.
    pub fn is_mapped(&self, page_addr: u64) -> bool {
        self.span(page_addr, 1)
            .and_then(|(p, _)| self.word(p, false))
            .is_some_and(|w| w.load(Ordering::Acquire) & STATE == MAPPED)
    }

    /// The lowest mapped page at or above `addr`, if any: a scan of the page words (whole
    /// chunks never made are skipped at once), for placements that look for mapped memory.
    pub fn next_mapped(&self, addr: u64) -> Option<u64> {
        let mut p = (addr.checked_sub(self.base)? >> self.page_shift) as usize;
        while p < self.words.len() {
            let Some(chunk) = self.words.chunk(p / CHUNK) else {
                p = (p / CHUNK + 1) * CHUNK;
                continue;
            };
            let start = p % CHUNK;
            if let Some(j) = chunk[start..].iter().position(|w| w.load(Ordering::Acquire) & STATE == MAPPED) {
                return Some(self.page_addr(p - start + start + j));
            }
            p = (p / CHUNK + 1) * CHUNK;
        }
        None
    }

    /// Call `f(page_addr, count)` for every mapped page, lowest first: a walk, for checks.
    pub fn for_each_mapped(&self, mut f: impl FnMut(u64, u64)) {
        for c in 0..self.words.chunks() {
            let Some(chunk) = self.words.chunk(c) else { continue };
            for (j, w) in chunk.iter().enumerate() {
                let v = w.load(Ordering::Acquire);
                if v & STATE == MAPPED {
                    f(self.page_addr(c * CHUNK + j), v >> COUNT_SHIFT);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 1 << 21;

    fn ok_map(log: &mut Vec<(u64, u64)>) -> impl FnMut(u64, usize) -> Result<(), Error> + '_ {
        move |a, l| {
            log.push((a, l as u64));
            Ok(())
        }
    }

    #[test]
    fn new_validates() {
        assert!(PageMap::new(0, P * 4, 3).is_err());
        assert!(PageMap::new(1, P * 4, P).is_err());
        assert!(PageMap::new(0, P * 4 + 1, P).is_err());
        assert!(PageMap::new(0, 0, P).is_err());
        assert!(PageMap::new(0, 1 << 62, 1 << 12).is_err());
    }

    #[test]
    fn acquire_maps_each_page_once_and_counts_blocks() {
        let m = PageMap::new(P, 8 * P, P).unwrap();
        let mut log = vec![];
        m.acquire(P + 100, 2 * P, true, &mut ok_map(&mut log)).unwrap();
        m.acquire(P, 256, true, &mut ok_map(&mut log)).unwrap();
        assert_eq!(log, vec![(P, 3 * P)], "three unmapped pages in a row are one run, mapped in one call");
        let mut seen = vec![];
        m.for_each_mapped(|a, c| seen.push((a, c)));
        assert_eq!(seen, vec![(P, 2), (2 * P, 1), (3 * P, 1)]);
        assert_eq!((m.mapped_bytes(), m.peak_mapped_bytes(), m.free_mapped_pages()), (3 * P, 3 * P, 0));
        assert!(m.release(P + 100, 2 * P));
        assert_eq!(m.free_mapped_pages(), 2);
        assert!(m.is_mapped(3 * P) && !m.is_mapped(4 * P));
    }

    #[test]
    fn needs_map_rolls_back_pages_already_taken() {
        let m = PageMap::new(0, 4 * P, P).unwrap();
        m.acquire(0, 1, true, &mut |_, _| Ok(())).unwrap();
        assert_eq!(m.acquire(0, 2 * P, false, &mut |_, _| Ok(())), Err(Acquire::NeedsMap));
        let mut seen = vec![];
        m.for_each_mapped(|a, c| seen.push((a, c)));
        assert_eq!(seen, vec![(0, 1)]);
    }

    #[test]
    fn map_failure_leaves_page_unmapped_and_rolls_back() {
        let m = PageMap::new(0, 4 * P, P).unwrap();
        m.acquire(P, P, true, &mut |_, _| Ok(())).unwrap();
        let err = Error::Device { call: "map", code: -1, message: Box::new("no".into()) };
        let e2 = err.clone();
        // Page 0 is a run of its own (page 1 is mapped), page 2 another, whose map fails.
        let r = m.acquire(0, 3 * P, true, &mut |a, _| if a == 2 * P { Err(e2.clone()) } else { Ok(()) });
        assert_eq!(r, Err(Acquire::Failed(err)));
        let mut seen = vec![];
        m.for_each_mapped(|a, c| seen.push((a, c)));
        assert_eq!(seen, vec![(0, 0), (P, 1)], "page 0 mapped but given back, page 1 as before, page 2 unmapped");
        assert_eq!(m.free_mapped_pages(), 1);
        assert_eq!(m.unmap_free(0, &mut |_, _| Ok(())), P);
        assert_eq!(m.mapped_bytes(), P);
    }

    #[test]
    fn a_run_goes_back_whole_or_not_at_all() {
        let m = PageMap::new(0, 8 * P, P).unwrap();
        m.acquire(0, 4 * P, true, &mut |_, _| Ok(())).unwrap();
        m.release(0, 4 * P);
        m.acquire(3 * P, 1, true, &mut |_, _| panic!("page 3 is mapped")).unwrap();
        assert_eq!(m.free_mapped_pages(), 3);
        assert_eq!(m.unmap_free(0, &mut |_, _| panic!("the run has a live page")), 0);
        m.release(3 * P, 1);
        let mut calls = vec![];
        let n = m.unmap_free(0, &mut |a, l| {
            calls.push((a, l as u64));
            Ok(())
        });
        assert_eq!((n, calls), (4 * P, vec![(0, 4 * P)]));
        assert_eq!(m.mapped_bytes(), 0);
    }

    #[test]
    fn runs_are_at_most_max_run_pages() {
        let m = PageMap::new(0, (2 * MAX_RUN as u64 + 4) * P, P).unwrap();
        let mut log = vec![];
        m.acquire(0, (MAX_RUN as u64 + 3) * P, true, &mut ok_map(&mut log)).unwrap();
        assert_eq!(log, vec![(0, MAX_RUN as u64 * P), (MAX_RUN as u64 * P, 3 * P)]);
    }

    #[test]
    fn bad_ranges_and_extra_releases_are_refused() {
        let m = PageMap::new(P, 4 * P, P).unwrap();
        assert!(matches!(m.acquire(0, 1, true, &mut |_, _| Ok(())), Err(Acquire::Failed(_))));
        assert!(matches!(m.acquire(P, 0, true, &mut |_, _| Ok(())), Err(Acquire::Failed(_))));
        assert!(matches!(m.acquire(P, u64::MAX, true, &mut |_, _| Ok(())), Err(Acquire::Failed(_))));
        assert!(!m.release(P, P));
        m.acquire(P, P, true, &mut |_, _| Ok(())).unwrap();
        assert!(m.release(P, P));
        assert!(!m.release(P, P), "count is already 0");
        assert_eq!(m.free_mapped_pages(), 1);
    }

    #[test]
    fn unmap_free_keeps_the_lowest_pages_and_skips_live_ones() {
        let m = PageMap::new(0, 8 * P, P).unwrap();
        // One page at a time: six runs of one page.
        for p in 0..6 {
            m.acquire(p * P, P, true, &mut |_, _| Ok(())).unwrap();
        }
        m.release(P, 5 * P);
        m.acquire(3 * P, 1, true, &mut |_, _| Ok(())).unwrap();
        // free mapped: pages 1, 2, 4, 5; page 0 and 3 live
        let mut gone = vec![];
        let n = m.unmap_free(2 * P, &mut |a, _| {
            gone.push(a);
            Ok(())
        });
        assert_eq!((n, gone), (2 * P, vec![5 * P, 4 * P]));
        let failing = m.unmap_free(0, &mut |_, _| Err(Error::NotPermitted("test")));
        assert_eq!(failing, 0);
        assert_eq!(m.free_mapped_pages(), 2);
        assert_eq!(m.unmap_free(0, &mut |_, _| Ok(())), 2 * P);
        assert_eq!(m.mapped_bytes(), 2 * P);
        assert_eq!(m.peak_mapped_bytes(), 6 * P);
    }

    #[test]
    fn pages_being_unmapped_are_no_longer_counted_as_mapped() {
        // The caller's unmap gives the pages' budget back, and another thread may map at once:
        // `mapped` (and so the peak) must not still count them then, or a pool at its limit
        // reads a peak past it.
        let m = PageMap::new(0, 4 * P, P).unwrap();
        m.acquire(0, 2 * P, true, &mut |_, _| Ok(())).unwrap();
        m.release(0, 2 * P);
        let mut seen_during = vec![];
        m.unmap_free(0, &mut |_, _| {
            seen_during.push(m.mapped_bytes());
            Ok(())
        });
        assert_eq!(seen_during, vec![0], "the run of two pages left `mapped` before its unmap call");
        // A failed unmap counts them again.
        m.acquire(0, P, true, &mut |_, _| Ok(())).unwrap();
        m.release(0, P);
        assert_eq!(m.unmap_free(0, &mut |_, _| Err(Error::NotPermitted("test"))), 0);
        assert_eq!(m.mapped_bytes(), P);
    }

    #[test]
    fn metadata_grows_with_use() {
        let m = PageMap::new(0, 1 << 40, P).unwrap();
        m.acquire((1 << 40) - P, P, true, &mut |_, _| Ok(())).unwrap();
        let made = m.words.chunks_made();
        assert_eq!(made, 1);
    }
}
