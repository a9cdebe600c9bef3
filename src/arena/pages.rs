//! The page map: which physical pages are mapped under the arena's range, and how many live
//! blocks lie on each.
//!
//! # What it owns
//!
//! One `AtomicU64` per page of the range, packing `count << 2 | state`: `state` is one of
//! [`UNMAPPED`], [`MAPPING`], [`MAPPED`], [`UNMAPPING`]; `count` is the number of live blocks
//! that overlap the page. The words live in chunks of up to 512 made the first time a page in
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

use crate::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
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
const ONE: u64 = 4;
/// Page words per chunk.
const CHUNK: usize = 512;
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

struct Chunk {
    words: Box<[AtomicU64]>,
}

/// The page map of one address range. See the module docs.
pub struct PageMap {
    base: u64,
    range: u64,
    page_shift: u32,
    pages: usize,
    dir: Box<[AtomicPtr<Chunk>]>,
    mapped: AtomicU64,
    peak: AtomicU64,
    /// Pages `MAPPED` with count 0. Updated after the CAS that changes a page, so it may dip
    /// below zero for a moment (wrapping); read through `free_mapped_pages`.
    free_mapped: AtomicU64,
}

// SAFETY: all shared state is atomic; chunk pointers are owned by the map and freed only in
// `Drop`, which needs exclusive access.
unsafe impl Send for PageMap {}
// SAFETY: as above; `&PageMap` reads chunks only through atomics and never frees them.
unsafe impl Sync for PageMap {}

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
        let dir = (0..pages.div_ceil(CHUNK)).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect();
        Ok(PageMap {
            base,
            range,
            page_shift: page.trailing_zeros(),
            pages,
            dir,
            mapped: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            free_mapped: AtomicU64::new(0),
        })
    }

    /// The page size in bytes.
    pub fn page_size(&self) -> u64 {
        1 << self.page_shift
    }

    fn chunk(slot: &AtomicPtr<Chunk>) -> Option<&Chunk> {
        let p = slot.load(Ordering::Acquire);
        // SAFETY: a non-null slot holds a chunk published by `word` from `Box::into_raw` with
        // a release CAS, freed only in `Drop`, which cannot run while `&self` lives.
        unsafe { p.as_ref() }
    }

    /// The word of page `p`, making its chunk when `make`.
    fn word(&self, p: usize, make: bool) -> Option<&AtomicU64> {
        let slot = self.dir.get(p / CHUNK)?;
        let chunk = match Self::chunk(slot) {
            Some(c) => c,
            None if !make => return None,
            None => {
                let len = CHUNK.min(self.pages - p / CHUNK * CHUNK);
                let fresh = Box::into_raw(Box::new(Chunk { words: (0..len).map(|_| AtomicU64::new(0)).collect() }));
                match slot.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
                    // SAFETY: published just now; lives until `Drop` (see `chunk`).
                    Ok(_) => unsafe { &*fresh },
                    Err(theirs) => {
                        // SAFETY: `fresh` was never shared: the CAS that would publish it failed.
                        drop(unsafe { Box::from_raw(fresh) });
                        // SAFETY: non-null (the CAS failed against it), published as in `chunk`.
                        unsafe { &*theirs }
                    }
                }
            }
        };
        chunk.words.get(p % CHUNK)
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
    /// through `map(page_addr, page_bytes)` (one page per call) when `may_map`. On failure
    /// the references this call took are given back, and a page whose map failed is left
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
        for p in first..=last {
            if let Err(e) = self.acquire_page(p, may_map, map) {
                self.release_pages(first, p);
                return Err(e);
            }
        }
        Ok(())
    }

    fn acquire_page(
        &self,
        p: usize,
        may_map: bool,
        map: &mut dyn FnMut(u64, usize) -> Result<(), Error>,
    ) -> Result<(), Acquire> {
        let Some(w) = self.word(p, true) else {
            return Err(Acquire::Failed(Error::InvalidArgument("page map: page out of range".into())));
        };
        let mut cur = w.load(Ordering::Acquire);
        loop {
            match cur & STATE {
                MAPPED => match w.compare_exchange_weak(cur, cur + ONE, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        if cur >> 2 == 0 {
                            self.free_mapped.fetch_sub(1, Ordering::AcqRel);
                        }
                        return Ok(());
                    }
                    Err(now) => cur = now,
                },
                UNMAPPED if !may_map => return Err(Acquire::NeedsMap),
                UNMAPPED => {
                    match w.compare_exchange_weak(cur, ONE | MAPPING, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => {}
                        Err(now) => {
                            cur = now;
                            continue;
                        }
                    }
                    let page = self.page_size();
                    // `page` is a divisor of a range that fits in memory maps; usize is 64-bit
                    // on every target the pool supports, so the cast is exact.
                    return match map(self.page_addr(p), page as usize) {
                        Ok(()) => {
                            // We alone write the word while it is MAPPING: a store will do.
                            w.store(ONE | MAPPED, Ordering::Release);
                            let now = self.mapped.fetch_add(page, Ordering::AcqRel) + page;
                            self.peak.fetch_max(now, Ordering::AcqRel);
                            Ok(())
                        }
                        Err(e) => {
                            w.store(UNMAPPED, Ordering::Release);
                            Err(Acquire::Failed(e))
                        }
                    };
                }
                // MAPPING or UNMAPPING: another thread is in a device call for this page.
                _ => {
                    yield_now();
                    cur = w.load(Ordering::Acquire);
                }
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
                if cur & STATE != MAPPED || cur >> 2 == 0 {
                    ok = false;
                    break;
                }
                match w.compare_exchange_weak(cur, cur - ONE, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        if cur >> 2 == 1 {
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

    /// Unmap wholly free mapped pages, highest address first (placement is lowest first, so
    /// high pages are the least likely to be wanted again), until at most `keep_bytes` of free
    /// mapped pages remain. A page whose unmap fails stays mapped. Returns the bytes unmapped.
    pub fn unmap_free(&self, keep_bytes: u64, unmap: &mut dyn FnMut(u64, usize) -> Result<(), Error>) -> u64 {
        let page = self.page_size();
        let mut unmapped = 0;
        for (c, slot) in self.dir.iter().enumerate().rev() {
            let Some(chunk) = Self::chunk(slot) else { continue };
            for (j, w) in chunk.words.iter().enumerate().rev() {
                if self.free_mapped_pages().saturating_mul(page) <= keep_bytes {
                    return unmapped;
                }
                if w.compare_exchange(MAPPED, UNMAPPING, Ordering::AcqRel, Ordering::Acquire).is_err() {
                    continue;
                }
                self.free_mapped.fetch_sub(1, Ordering::AcqRel);
                match unmap(self.page_addr(c * CHUNK + j), page as usize) {
                    Ok(()) => {
                        self.mapped.fetch_sub(page, Ordering::AcqRel);
                        w.store(UNMAPPED, Ordering::Release);
                        unmapped += page;
                    }
                    Err(_) => {
                        w.store(MAPPED, Ordering::Release);
                        self.free_mapped.fetch_add(1, Ordering::AcqRel);
                    }
                }
            }
        }
        unmapped
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

    /// Call `f(page_addr, count)` for every mapped page, lowest first: a walk, for checks.
    pub fn for_each_mapped(&self, mut f: impl FnMut(u64, u64)) {
        for (c, slot) in self.dir.iter().enumerate() {
            let Some(chunk) = Self::chunk(slot) else { continue };
            for (j, w) in chunk.words.iter().enumerate() {
                let v = w.load(Ordering::Acquire);
                if v & STATE == MAPPED {
                    f(self.page_addr(c * CHUNK + j), v >> 2);
                }
            }
        }
    }
}

impl Drop for PageMap {
    fn drop(&mut self) {
        for slot in self.dir.iter() {
            let p = slot.swap(std::ptr::null_mut(), Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: `p` came from `Box::into_raw` in `word`, published once; we own the
                // map exclusively now and the swap leaves null, so it is freed once.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 1 << 21;

    fn ok_map(log: &mut Vec<u64>) -> impl FnMut(u64, usize) -> Result<(), Error> + '_ {
        move |a, _| {
            log.push(a);
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
        assert_eq!(log, vec![P, 2 * P, 3 * P]);
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
        let err = Error::Device { call: "map", code: -1, message: "no".into() };
        let e2 = err.clone();
        let r = m.acquire(0, 3 * P, true, &mut |a, _| if a == 2 * P { Err(e2.clone()) } else { Ok(()) });
        assert_eq!(r, Err(Acquire::Failed(err)));
        let mut seen = vec![];
        m.for_each_mapped(|a, c| seen.push((a, c)));
        assert_eq!(seen, vec![(0, 0), (P, 0)]);
        assert_eq!(m.free_mapped_pages(), 2);
        assert_eq!(m.unmap_free(0, &mut |_, _| Ok(())), 2 * P);
        assert_eq!(m.mapped_bytes(), 0);
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
        m.acquire(0, 6 * P, true, &mut |_, _| Ok(())).unwrap();
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
    fn metadata_grows_with_use() {
        let m = PageMap::new(0, 1 << 40, P).unwrap();
        m.acquire((1 << 40) - P, P, true, &mut |_, _| Ok(())).unwrap();
        let made = m.dir.iter().filter(|s| PageMap::chunk(s).is_some()).count();
        assert_eq!(made, 1);
    }
}
