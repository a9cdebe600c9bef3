//! The page map: which physical pages are mapped under the arena's range, and how many live
//! blocks lie on each.
//!
//! # What it owns
//!
//! One `AtomicU64` per page of the range, packing `count << 4 | cont << 3 | state`: `state` is one of
//! [`UNMAPPED`], [`MAPPING`], [`MAPPED`], [`UNMAPPING`], [`LENT`]; `count` is the number of live blocks
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
//! * `mapped_bytes` = pages `MAPPED` × page size, once quiet: the physical memory held. A
//!   `LENT` page's memory shows at another page too (see [`lend`]), which counts it.
//!
//! # Why it is lock-free, and its one wait
//!
//! Taking a reference on a mapped page, dropping one, and claiming a free page to unmap are
//! single-word CASes. A thread that finds a page `MAPPING` or `UNMAPPING` yields until the
//! thread doing the device call finishes: two threads must not map one page twice, and the
//! second has nothing to do with the page until the first is done. That is the only wait, on
//! device calls (tens of µs), never on another thread's bookkeeping.

mod lend;
mod phys;
mod wake;

use super::hbitmap::HBitmap;
use super::words::{LazyWords, CHUNK};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::yield_now;
use crate::Error;
use lend::HintWord;
use wake::Wake;
pub use wake::{Lent, SLOTS};

/// The page is not backed by physical memory.
pub const UNMAPPED: u64 = 0;
/// A thread is mapping the page (and holds count 1 on it).
pub const MAPPING: u64 = 1;
/// The page is mapped.
pub const MAPPED: u64 = 2;
/// A thread is unmapping the page (count 0).
pub const UNMAPPING: u64 = 3;
/// The page's memory was lent to another page (see [`lend`]): still mapped here, for work
/// queued before the loan, but serving nothing; unmapped once that work is done.
pub const LENT: u64 = 4;

const STATE: u64 = 7;
/// Set on every page of a run but its first: the page was mapped in one call with the page
/// before it, and can only be unmapped with it.
const CONT: u64 = 8;
/// The pages one bit of `PageMap::groups` stands for.
const GROUP: usize = 64;
const COUNT_SHIFT: u32 = 4;
const ONE: u64 = 1 << COUNT_SHIFT;
/// A page held by a loan or a return in progress (see [`lend`]): `MAPPING` with count 1, so
/// others wait for it as for a mapper.
const HELD: u64 = ONE | MAPPING;

/// Whether a page word says the page is free: mapped, with no block on it (a run's page or
/// not).
#[inline]
fn is_free(v: u64) -> bool {
    v & !CONT == MAPPED
}
/// The most pages a map may map in one call (see [`PageMap::with_max_run`]).
pub const MAX_RUN: usize = 64;
/// The most pages a map may cover (its directory is made eagerly: 2^30 / 512 pointers).
const MAX_PAGES: u64 = 1 << 30;

/// Pages taken off a counter by one call, subtracted when the call is done (on every path
/// out of it, failures included, so the pages its failure gives back are not counted twice).
struct TakenOff<'a>(&'a AtomicU64, std::cell::Cell<u64>);

impl Drop for TakenOff<'_> {
    fn drop(&mut self) {
        let n = self.1.get();
        if n > 0 {
            self.0.fetch_sub(n, Ordering::AcqRel);
        }
    }
}

/// Why [`PageMap::acquire`] failed; the pages it had taken are given back either way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// A page is unmapped and the caller did not allow mapping.
    NeedsMap,
    /// A page's memory is lent elsewhere, until work queued on it completes.
    Lent,
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
    /// The most bytes mapped at once since the figures' peaks were last reset
    /// ([`PageMap::reset_shown_peak`]): what `Stats` shows. `peak` is the pool's own, which
    /// its growth rules compare against, and is never reset.
    shown_peak: AtomicU64,
    /// Pages `MAPPED` with count 0. Updated after the CASes that change pages (once per call,
    /// for all the pages it changed), so it may dip below zero for a moment (wrapping); read
    /// through `free_mapped_pages`.
    free_mapped: AtomicU64,
    /// The most pages mapped in one call.
    max_run: usize,
    /// Per page mapped or lent, the id (+1) of the physical memory it shows: pages show the
    /// same memory after a loan (see [`lend`]).
    phys: LazyWords,
    /// Per physical memory id, the pages that show it; its memory is freed when the last
    /// of them is unmapped.
    refs: LazyWords,
    /// Where the search for an unused id starts.
    next_id: AtomicU64,
    /// Per physical memory id, the page (+1) whose blocks use it; the others showing it are
    /// `LENT`.
    active: LazyWords,
    /// Pages `LENT` now.
    lent: AtomicU64,
    /// Pages that may be `MAPPED` with count 0, the highest first (bit `pages - 1 - p` for
    /// page `p`): where [`lend`] looks for memory to lend, instead of reading every page's
    /// word from the top of the range (thousands a loan on a trace of a few GiB). A hint:
    /// every page that becomes free sets its bit after its word says so, and a lender that
    /// finds a bit over a page that is not free clears it, then reads the page again and
    /// sets it back if the page became free meanwhile (see [`lend`]), so no free page is
    /// left without its bit once quiet.
    free_hint: HBitmap,
    /// One past the highest page ever mapped: no page at or above it is `MAPPED`, so
    /// [`PageMap::next_mapped`] stops there instead of reading the rest of a chunk of page
    /// words (tens of thousands) each time a placement meets the top of the mapped range.
    /// Raised before a run's words say `MAPPED`, never lowered (pages above the highest
    /// mapped page only cost a scan their words).
    top: AtomicU64,
    /// A bit per group of [`GROUP`] pages: set (for good) before any page of the group is
    /// first mapped, so a group whose bit is clear has never had a page mapped, lent or
    /// borrowed. [`PageMap::next_mapped`] passes such a group without reading its words: the
    /// pages between the large blocks and the chunks' half of the range are made words that
    /// were never mapped, and a placement that met an unmapped page read 246 of them a call
    /// on the one-thread random window.
    groups: LazyWords,
    /// Which lent pages could switch back now (see [`wake`]).
    wake: Wake,
}

/// What [`PageMap::acquire`] asks of its caller for pages it cannot take as they are.
pub trait Mapper {
    /// Put memory under `[addr, addr + len)`, pages this call holds for mapping (unmapped
    /// until now): new memory, or memory lent by free pages ([`PageMap::lend`]).
    fn map(&mut self, addr: u64, len: usize) -> Result<Backing, Error>;
    /// The lent page at `to` may take its memory back from the page it was lent to, at
    /// `from`, which is free and claimed for the move: judge whether the work queued on
    /// `from` is ordered before the caller's, and carry `from`'s fences over to `to`. False
    /// (the default): `to` stays lent.
    fn switch(&mut self, from: u64, to: u64) -> bool {
        let _ = (from, to);
        false
    }
    /// Whether a lent page the block needs whose memory cannot come back (the page it serves
    /// is busy) is unmapped and mapped afresh ([`Mapper::unmap_dead`]) rather than failing
    /// the acquisition. False (the default).
    fn remaps(&self) -> bool {
        false
    }
    /// Unmap such a page, which the page map has claimed for it, as
    /// [`PageMap::unmap_lent`]'s `unmap` would (`freed`: the memory that goes with it, none
    /// while another page shows it); then it is mapped like any unmapped page. An error
    /// leaves it lent, and the acquisition fails on it.
    fn unmap_dead(&mut self, addr: u64, len: usize, freed: u64) -> Result<(), Error> {
        let _ = (addr, len, freed);
        Err(Error::NotPermitted("a lent page is taken back only where its memory is free"))
    }
}

impl<F: FnMut(u64, usize) -> Result<Backing, Error>> Mapper for F {
    fn map(&mut self, addr: u64, len: usize) -> Result<Backing, Error> {
        self(addr, len)
    }
}

/// Where a map callback got the memory it put under a run of pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// New physical memory.
    Fresh,
    /// Memory lent by free pages mapped elsewhere ([`PageMap::lend`]): no new memory.
    Lent,
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
            shown_peak: AtomicU64::new(0),
            free_mapped: AtomicU64::new(0),
            max_run: MAX_RUN,
            phys: LazyWords::new(pages),
            refs: LazyWords::new(pages),
            next_id: AtomicU64::new(0),
            active: LazyWords::new(pages),
            lent: AtomicU64::new(0),
            free_hint: HBitmap::new(pages),
            top: AtomicU64::new(0),
            groups: LazyWords::new(pages.div_ceil(GROUP).div_ceil(64)),
            wake: Wake::new(pages),
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
    pub fn acquire(&self, addr: u64, len: u64, may_map: bool, map: &mut dyn Mapper) -> Result<(), Acquire> {
        let Some((first, last)) = self.span(addr, len) else {
            return Err(Acquire::Failed(Error::InvalidArgument(format!(
                "page map: [{addr:#x}, +{len:#x}) is not inside the range"
            ))));
        };
        // Free mapped pages this call took a first reference on, counted off `free_mapped`
        // once, when the call returns (one shared write, not one per page of a large block).
        let took_free = TakenOff(&self.free_mapped, std::cell::Cell::new(0));
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
                                took_free.1.set(took_free.1.get() + 1);
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
                    // Its memory serves another page: take it back if that page is free.
                    LENT if self.reactivate(p, map) => break true,
                    // Else, where the mapper says so, unmap the page and map it afresh; if
                    // another thread took it meanwhile, look again.
                    LENT if may_map && map.remaps() => {
                        if self.unmap_run(p, p, LENT, &mut |a, l, freed| map.unmap_dead(a, l, freed)).is_none() {
                            let now = w.load(Ordering::Acquire);
                            if now == cur {
                                break false;
                            }
                            cur = now;
                            continue;
                        }
                        cur = w.load(Ordering::Acquire);
                    }
                    LENT => break false,
                    // MAPPING or UNMAPPING: another thread is in a device call for this page.
                    _ => {
                        yield_now();
                        cur = w.load(Ordering::Acquire);
                    }
                }
            };
            if !done {
                // Needs a map the caller does not allow, or its memory is lent: the run
                // pending (if any) goes unmapped, and the pages taken go back.
                let lent = w.load(Ordering::Acquire) & STATE == LENT;
                let (f, to, _) = fail(run, Acquire::NeedsMap);
                self.release_pages(f, to.min(p));
                return Err(if lent { Acquire::Lent } else { Acquire::NeedsMap });
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
    fn map_run(&self, s: usize, n: usize, map: &mut dyn Mapper) -> Result<(), Error> {
        let page = self.page_size();
        // `page * n` is at most MAX_RUN pages of a range that fits in memory maps; usize is
        // 64-bit on every target the pool supports, so the cast is exact.
        match map.map(self.page_addr(s), (page * n as u64) as usize) {
            Ok(backing) => {
                // Before the words: a scan that finds one of them mapped also reads `top`
                // past it, and their groups marked.
                self.top.fetch_max((s + n) as u64, Ordering::AcqRel);
                self.mark_groups(s, n);
                for q in s..s + n {
                    if backing == Backing::Fresh {
                        self.show_fresh(q);
                    }
                    if let Some(w) = self.word(q, false) {
                        // We alone write the word while it is MAPPING: a store will do.
                        let cont = if q > s { CONT } else { 0 };
                        w.store(ONE | MAPPED | cont, Ordering::Release);
                    }
                }
                if backing == Backing::Fresh {
                    let now = self.mapped.fetch_add(page * n as u64, Ordering::AcqRel) + page * n as u64;
                    self.peak.fetch_max(now, Ordering::AcqRel);
                    self.shown_peak.fetch_max(now, Ordering::AcqRel);
                }
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
        // Pages this call leaves free, added to `free_mapped` once at the end.
        let mut freed = 0;
        // Their free-page hints, gathered a bitmap word at a time: one RMW per 64 pages.
        let mut hints = HintWord::default();
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
                            freed += 1;
                            hints.add(self, p);
                            self.wake_lenders(p);
                        }
                        break;
                    }
                    Err(now) => cur = now,
                }
            }
        }
        hints.flush(self);
        if freed > 0 {
            self.free_mapped.fetch_add(freed, Ordering::AcqRel);
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
    /// `unmap(addr, len, freed)` is told the bytes of physical memory the unmap gives back to
    /// the device (less than `len` where other pages still show the memory, see [`lend`]).
    pub fn unmap_free(&self, keep_bytes: u64, unmap: &mut dyn FnMut(u64, usize, u64) -> Result<(), Error>) -> u64 {
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
            if !is_free(v) || self.shared(p) {
                // A page whose memory lent pages also show goes after them (its memory would
                // not be freed).
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
            if let Some(bytes) = self.unmap_run(head, end, MAPPED, unmap) {
                unmapped += bytes;
            }
            p = head;
        }
        unmapped
    }

    /// Claim every page of the run `head..=end` (`from` — MAPPED with count 0, or LENT —
    /// → UNMAPPING), unmap it in one call and mark it UNMAPPED; the physical memory only
    /// these pages showed is freed. If a page is taken meanwhile, or the unmap fails, the
    /// pages claimed go back as they were. Returns the bytes unmapped.
    fn unmap_run(
        &self,
        head: usize,
        end: usize,
        from: u64,
        unmap: &mut dyn FnMut(u64, usize, u64) -> Result<(), Error>,
    ) -> Option<u64> {
        let page = self.page_size();
        let mut claimed = Vec::with_capacity(end - head + 1);
        let back = |claimed: Vec<(u64, &AtomicU64)>| {
            for (q, (c, w)) in (head..).zip(claimed) {
                self.give_back(q, w, from | c);
            }
        };
        for q in head..=end {
            let Some(w) = self.word(q, false) else {
                back(claimed);
                return None;
            };
            let cont = if q > head { CONT } else { 0 };
            if w.compare_exchange(from | cont, UNMAPPING | cont, Ordering::AcqRel, Ordering::Acquire).is_err() {
                back(claimed);
                return None;
            }
            claimed.push((cont, w));
        }
        let n = claimed.len() as u64;
        let state_count = if from == LENT { &self.lent } else { &self.free_mapped };
        state_count.fetch_sub(n, Ordering::AcqRel);
        // The memory these pages alone show goes with them. Out of `mapped` before the unmap
        // call: the caller gives that much budget back once the device has it, and a mapper
        // may then map at once; were it still counted here, its `mapped` (and so the peak)
        // would briefly count it twice. Their refs drop only once the unmap is done: an id
        // with no ref may be given to fresh memory at once, and a failed unmap keeps its
        // pages. No other page can start showing memory only these show meanwhile (it would
        // have to be lent by one of them, and they are claimed).
        let alone: Vec<bool> =
            (head..=end).map(|q| self.refs_of(q).is_some_and(|r| r.load(Ordering::Acquire) == 1)).collect();
        let freed = alone.iter().filter(|&&a| a).count() as u64 * page;
        self.mapped.fetch_sub(freed, Ordering::AcqRel);
        match unmap(self.page_addr(head), (page * n) as usize, freed) {
            Ok(()) => {
                for q in head..=end {
                    if from == LENT {
                        self.untrack_lender(self.phys_of(q), q);
                    }
                    self.drop_ref(q);
                    if let Some(w) = self.phys.get(q, false) {
                        w.store(0, Ordering::Release);
                    }
                }
                for (_, w) in claimed {
                    w.store(UNMAPPED, Ordering::Release);
                }
                Some(page * n)
            }
            Err(_) => {
                self.mapped.fetch_add(freed, Ordering::AcqRel);
                back(claimed);
                state_count.fetch_add(n, Ordering::AcqRel);
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

    /// The most bytes mapped at once since [`PageMap::reset_shown_peak`] (or ever).
    pub fn shown_peak_bytes(&self) -> u64 {
        self.shown_peak.load(Ordering::Acquire)
    }

    /// Start the shown peak again from what is mapped now. A map racing the reset may have
    /// raised the peak before the store: the last `fetch_max` takes it again.
    pub fn reset_shown_peak(&self) {
        self.shown_peak.store(self.mapped_bytes(), Ordering::Release);
        self.shown_peak.fetch_max(self.mapped_bytes(), Ordering::AcqRel);
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

    /// Whether the page holding `page_addr` is anything but unmapped (mapped, lent, or in a
    /// device call).
    pub fn in_use(&self, page_addr: u64) -> bool {
        self.span(page_addr, 1)
            .and_then(|(p, _)| self.word(p, false))
            .is_some_and(|w| w.load(Ordering::Acquire) & STATE != UNMAPPED)
    }

    /// The lowest mapped page at or above `addr`, if any: a scan of the page words (whole
    /// chunks never made are skipped at once), for placements that look for mapped memory.
    pub fn next_mapped(&self, addr: u64) -> Option<u64> {
        self.next_where(addr, |v| v & STATE == MAPPED)
    }

    /// The lowest page at or above `addr` that is not unmapped (mapped, lent, or in a device
    /// call), if any: as [`PageMap::next_mapped`] scans.
    pub fn next_in_use(&self, addr: u64) -> Option<u64> {
        self.next_where(addr, |v| v & STATE != UNMAPPED)
    }

    /// The lowest page at or above `addr` whose word `pick` takes, by a scan of the page words
    /// (whole chunks never made, and groups never mapped, are passed at once). `pick` must
    /// take no `UNMAPPED` word: a page never mapped is never read (nor one whose first map
    /// is in flight, which a scan may miss anyway).
    fn next_where(&self, addr: u64, pick: impl Fn(u64) -> bool) -> Option<u64> {
        let mut p = (addr.checked_sub(self.base)? >> self.page_shift) as usize;
        // Pages at or above `top` have never been mapped (see its docs); a run mapped while
        // this scan goes on may be missed, as one mapped just behind the scan would be.
        let end = (self.top.load(Ordering::Acquire) as usize).min(self.words.len());
        while p < end {
            let base = p / CHUNK * CHUNK;
            let stop = (base + CHUNK).min(end);
            let Some(chunk) = self.words.chunk(p / CHUNK) else {
                p = stop;
                continue;
            };
            while p < stop {
                let group_end = ((p / GROUP + 1) * GROUP).min(stop);
                if self.group_marked(p / GROUP) {
                    let words = &chunk[(p - base).min(chunk.len())..(group_end - base).min(chunk.len())];
                    if let Some(j) = words.iter().position(|w| pick(w.load(Ordering::Acquire))) {
                        return Some(self.page_addr(p + j));
                    }
                }
                p = group_end;
            }
        }
        None
    }

    /// Mark the groups of pages `s..s + n` as having had a page mapped (see `groups`).
    fn mark_groups(&self, s: usize, n: usize) {
        for g in s / GROUP..=(s + n - 1) / GROUP {
            if let Some(w) = self.groups.get(g / 64, true) {
                let bit = 1u64 << (g % 64);
                if w.load(Ordering::Acquire) & bit == 0 {
                    w.fetch_or(bit, Ordering::AcqRel);
                }
            }
        }
    }

    /// Whether group `g` has ever had a page mapped (see `groups`).
    fn group_marked(&self, g: usize) -> bool {
        self.groups.get(g / 64, false).is_some_and(|w| w.load(Ordering::Acquire) & (1 << (g % 64)) != 0)
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
mod tests;
