//! Placement and release: where the arena puts a block for a stream, and where a freed block
//! goes.
//!
//! A small block (under `large_block_threshold`) comes from the stream's own arena
//! ([`StreamArena`](crate::arena::StreamArena)), which takes a 2 MiB chunk from the space when
//! it has no room; a large block, and a chunk, come from the space's extents, first fit among
//! the runs that the placement's [`Mode`] accepts:
//!
//! - [`Reuse`]: whose freed memory may be taken. A granule freed on the requesting stream,
//!   or free for everyone, always; one freed on another stream when its fence's event is
//!   complete or an earlier device wait of the requesting stream covers it
//!   ([`Reuse::Ready`]), or also when neither holds, with the requesting stream made to wait
//!   on that event on the device ([`Reuse::Wait`]). A wait is remembered
//!   ([`crate::reclaim::waited`]) because it orders the stream for good: the memory it
//!   covers needs nothing more.
//! - [`Mapping`]: whether the block may land on unmapped pages, and up to what: none
//!   (prefer memory already mapped), the pool's peak, or `max_reserved`.
//!
//! Near its limit (seven eighths of `max_reserved` mapped) a large block is not placed first
//! fit but in the run needing the fewest pages it does not find mapped (or lent with their
//! memory free to come back), then in the tightest such run, with the far end of each run a
//! candidate too: there, every page a placement touches for the first time is one the pool
//! may not have, and first fit took the lowest run however many it needed; among runs on
//! mapped pages this is best fit, which leaves the larger free runs whole for the requests
//! that need them. In the near-limit stress (`tests/near_limit.rs`) the brim case, which
//! lives at its limit, refused 5,399–5,607 requests at or below 95% of the limit in four
//! runs with first fit, 4,400–4,677 in three with the placements that may map scored, and
//! 4,200–4,234 in three with every large placement scored. Away from the limit, a large
//! block that may borrow memory for its pages (past the pool's peak) goes first to the run
//! whose pages cost the fewest driver calls, where a lent page whose memory is busy
//! elsewhere is unmapped and mapped afresh rather than ruling the run out (module
//! `cheapest`); the next cheapest if the judgement refuses that run, first fit after a
//! few. A large block of [`FEW_DEAD_SHARE`] pages or more placed where it may not map (the
//! ladder's rungs 1–3, 5 and 6) still takes its first-fit run when at most one page in
//! `FEW_DEAD_SHARE` of it needs a driver call (lent with its memory busy elsewhere, or
//! unmapped), rather than the higher run on mapped pages the walk goes on to find: those
//! pages are mapped afresh (lent, past the peak), as on the cheapest run. And, as the
//! ladder's last step, a small block that its stream's chunks cannot hold, when no free
//! page-sized run is left for a chunk, takes a run of the extents like a large block (at
//! whole granules) rather than fail: at the limit the free memory is mostly the gaps
//! between large blocks.
//!
//! Whether a run's freed memory may be taken by the stream is the judgement's question
//! (module `judge`); this module asks it of the runs it walks and holds.
//!
//! A freed block goes back at once: a small one to its stream's arena (whole chunks beyond a
//! few go back to the space), a large one (or a small one that no stream's chunk holds) to
//! the space with its stream's fence on every granule. No event, no batch, no device call:
//! frees inside host functions and thread-local destructors take this path too.

use super::cheapest;
use super::judge::Judge;
use super::{PoolInner, StreamState};
use crate::arena::pages::{Backing, Lent, Mapper};
use crate::arena::{fence_parts, fence_word, Acquire, CHUNK, GRANULE};
use crate::error::{Error, OutOfMemory, Result};
use crate::reclaim::Span;
use crate::stats::Counters;
use crate::sync::atomic::Ordering;

/// Wholly free chunks a stream's arena keeps; more go back to the space as they fall free.
/// Two keep a stream that allocates and frees small blocks from taking and giving back a
/// chunk at every turn; the ladder takes kept chunks back when another stream needs them.
pub const KEEP_FREE_CHUNKS: usize = 2;

/// Whose freed memory a placement may take (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reuse {
    /// The stream's own, everyone's, and other streams' whose fence is complete or covered
    /// by a device wait the stream made earlier.
    Ready,
    /// Also other streams' whose fence is not complete, behind a device-side wait.
    Wait,
}

/// Which pages a placement may map (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// None: only memory on pages mapped already.
    Forbidden,
    /// Up to the pool's peak: growth that costs no memory the pool has not held before.
    WithinPeak,
    /// Up to `max_reserved`.
    Allowed,
}

/// How a placement may find memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mode {
    pub(crate) reuse: Reuse,
    pub(crate) mapping: Mapping,
}

impl Mode {
    pub(crate) const READY: Mode = Mode { reuse: Reuse::Ready, mapping: Mapping::Forbidden };
}

/// What a placement for one stream does where its block lands on pages it cannot take as
/// they are (see [`crate::arena::pages::Mapper`]).
struct Pager<'a> {
    pool: &'a PoolInner,
    st: &'a StreamState,
    /// The most bytes the pool may map (its peak, or `max_reserved`).
    limit: u64,
    /// Whether memory of free pages may come by loan (past the peak).
    lend: bool,
    /// Whether lent pages whose memory cannot come back are unmapped and mapped afresh
    /// (the cheapest run's, module `cheapest`).
    remap: bool,
    /// The pages of the placement being acquired, which never lend to it: the page map
    /// acquires a run lowest first, so a free mapped page further up the run still looks
    /// free when a page below it needs memory, and lending from it would leave it lent with
    /// its memory busy under the same block, to be unmapped and mapped again a moment later
    /// (seen on train_gpt2's 1,148 MiB blocks in its warm passes).
    block: std::ops::Range<u64>,
}

impl Mapper for Pager<'_> {
    fn map(&mut self, addr: u64, len: usize) -> Result<Backing> {
        let pool = self.pool;
        // Past the peak, the memory of free pages mapped where the request did not fit comes
        // to the request's pages (a loan: see `arena::pages::lend`) before new memory does.
        if self.lend
            && pool.pages.mapped_bytes() + len as u64 > pool.pages.peak_mapped_bytes()
            && pool.lend_to(self.st, addr, len, &self.block)
        {
            return Ok(Backing::Lent);
        }
        pool.map_pages(addr, len, self.limit).map(|()| Backing::Fresh)
    }

    fn remaps(&self) -> bool {
        self.remap
    }

    fn unmap_dead(&mut self, addr: u64, len: usize, freed: u64) -> Result<()> {
        self.pool.unmap_checked(addr, len, freed)
    }

    fn switch(&mut self, from: u64, to: u64) -> bool {
        // The memory comes back from `from` if the work queued there is ordered before this
        // stream's (its own, or complete), and carries `from`'s fences with it.
        let pool = self.pool;
        let page = pool.pages.page_size();
        let ok = pool.switch_allowed(self.st, from);
        if ok {
            pool.space.copy_fences(from, to, page);
            Counters::bump(&pool.counters.pages_switched, 1);
        }
        ok
    }
}

/// Walks a placement makes when its claim lands on a lent page that another thread's
/// placement got to first.
const CLAIM_TRIES: usize = 3;

/// Cheapest runs a placement past the peak tries, each without the pages the claims before
/// it refused, before it walks first fit (module `cheapest`).
const CHEAPEST_TRIES: usize = 4;

/// A large block of at least this many pages, placed on mapped memory (the rungs that may
/// not map), takes its first-fit run even where up to one page in this many must be mapped
/// afresh: a lent page whose memory serves a live block elsewhere, or an unmapped one.
///
/// Why: a block that leaves its first-fit run for a few such pages lands hundreds of MiB
/// higher, on free pages the blocks after it would have taken, and those then need runs
/// that only loans give. On train_gpt2's second pass one dead page under a 1,148 MiB block
/// moved it 288 MiB up, and the pass moved 876 MiB of pages in and 290 out (0.20 of its
/// peak); with the dead page remapped, 22 MiB and 22 (simulator). Why this share: at one page
/// in 32 the rule reached blocks of 64 MiB, whose dead pages come back every pass
/// (bert_dynamic's third pass moved 1.57 of its peak instead of 0.22), and at one in 64
/// train_bert_mlm's third and fourth passes moved more (`docs/BENCHMARKS.md`, forty-third
/// session).
pub(crate) const FEW_DEAD_SHARE: u64 = 128;

impl PoolInner {
    /// Whether `st` may take back the memory of the page at `from` (lent pages' memory,
    /// serving there now and free): every fence on it lets `st` reuse it at once.
    fn switch_allowed(&self, st: &StreamState, from: u64) -> bool {
        Judge::new(self, st, Reuse::Ready).accepts(from, self.pages.page_size())
    }

    /// Place `size` bytes (as `Space::size_for` gives) for `st`'s stream: the address, or None
    /// when `mode` finds no room (nothing changed then).
    pub(crate) fn place(&self, st: &StreamState, size: u64, mode: Mode) -> Result<Option<u64>> {
        if self.space.is_large(size) {
            return self.claim_extent(st, size, false, mode);
        }
        // Other threads may fill a chunk this one just added: try a few times.
        for _ in 0..3 {
            if let Some(a) = st.arena.alloc(size) {
                return Ok(Some(a));
            }
            let Some(chunk) = self.claim_extent(st, CHUNK, true, mode)? else { return Ok(None) };
            if !self.adopt_chunk(st, chunk) {
                return Ok(None);
            }
        }
        Ok(st.arena.alloc(size))
    }

    /// The ladder's last resort for a small block near the limit, when neither its stream's
    /// chunks nor a new chunk can hold it: a run of the space, as a large block, at whole
    /// granules. A chunk needs a free page-sized run, which a full pool seldom has; the
    /// pieces between large blocks, shorter than a page, are what it has left (in the
    /// near-limit stress, 25–50 MiB of them when half-megabyte requests were refused). Only
    /// last: the rungs before may free a chunk for it, and a small block among the large
    /// ones cuts the runs they need (sent there first, from 64 KiB up, small blocks made that
    /// stress refuse no fewer requests). Never away from the limit, where the pool may still
    /// map a page for a chunk. Such a block is told from a chunk's by its address: no stream
    /// owns it ([`PoolInner::in_extents`]).
    pub(crate) fn place_small_in_extents(&self, st: &StreamState, size: u64, mode: Mode) -> Result<Option<u64>> {
        if self.space.is_large(size) || !self.near_limit() {
            return Ok(None);
        }
        self.claim_extent(st, size.next_multiple_of(GRANULE), false, mode)
    }

    /// Whether a block lies in the space's extents rather than in a stream's chunk: every
    /// large block, and a small one placed there near the limit
    /// ([`PoolInner::place_small_in_extents`]), which spans its size in whole granules.
    pub(crate) fn in_extents(&self, span: Span) -> bool {
        self.space.is_large(span.size) || self.space.owner(span.addr).is_none()
    }

    /// A run of the space for `st` (a large block of `size` bytes, or a chunk), its pages
    /// taken and any device wait it needs set up.
    fn claim_extent(&self, st: &StreamState, size: u64, chunk: bool, mode: Mode) -> Result<Option<u64>> {
        let mut judge = Judge::new(self, st, mode.reuse);
        let page = self.pages.page_size();
        let pages = &self.pages;
        // Past a refused page, the pages after it that no block could use now either (lent
        // with their memory busy elsewhere, or unmapped where mapping is forbidden): the walk
        // resumes after them at once. Lent pages gather at the top of the mapped range (the
        // highest free pages lend first), and a walk judging each on its own met dozens.
        // Dormant pages this walk judged, for their bound (added when the walk ends).
        let judged = self.dormant.judging();
        // Set once claims on lent pages kept losing their memory to other threads (below):
        // the walk then passes over every lent page, judging none.
        let avoid_lent = std::cell::Cell::new(false);
        // Set while the cheapest run is claimed (module `cheapest`): its lent pages whose
        // memory cannot come back are unmapped and mapped afresh, where their work is done.
        let remap_dead = std::cell::Cell::new(false);
        // Whether the run being claimed may map pages: a run claimed with its dead pages
        // remapped may, even on a rung that may not (the lowest run with few dead pages).
        let may_map = || mode.mapping != Mapping::Forbidden || remap_dead.get();
        // How many pages of a first-fit run may need a driver call on a rung that may not
        // map (0: none), and the lowest run the walk passed that needs no more.
        let few_dead = self.few_dead_pages(size, chunk, mode);
        let lowest_few_dead = std::cell::Cell::new(None);
        // Asleep lent pages (their memory busy where it went, see `arena::pages::wake`) are
        // passed a run at a time without a judgement, and weigh an eighth of one in the
        // dormant pages' bound (`dormant::PASSES_PER_JUDGEMENT`).
        let skip_dead = |mut q: u64| loop {
            let lent = pages.lent(q);
            if lent == Lent::Asleep {
                let next = pages.past_asleep(q);
                if !avoid_lent.get() {
                    judged.passed((next - q) / page);
                }
                q = next;
            } else if lent == Lent::Awake {
                if !avoid_lent.get() {
                    judged.one();
                    if pages.switch_source(q).is_some() {
                        return q;
                    }
                }
                q += page;
            } else if mode.mapping == Mapping::Forbidden && !pages.is_mapped(q) {
                match pages.next_mapped(q) {
                    Some(m) if m > q => q = m,
                    Some(_) => return q,
                    None => return u64::MAX,
                }
            } else {
                return q;
            }
        };
        // The candidate this closure last took: the extents ask again once they have claimed
        // it, and the answer would be the same work for nothing (see below).
        let mut taken = None;
        let mut accept = |addr: u64, len: u64| -> std::result::Result<(), u64> {
            // The walk only chooses a run: the judgement that counts, and the waits set up,
            // are made again once the pages are held (`judge_held`), and the pages are taken
            // by `acquire`, which fails on any that changed. So the second question about a
            // claimed candidate, right after the walk took it, is answered from memory: on
            // a 64 MiB block that second look was a third of the pair's fence reads.
            if taken.take() == Some((addr, len)) {
                return Ok(());
            }
            judge.start_over();
            // A lent page serves a block only by taking its memory back, which needs the page
            // it went to free and not wanted by the same block; without mapping, only mapped
            // pages (or those) will do.
            let mut p = addr / page * page;
            let mut sources = Vec::new();
            // Pages that need a driver call, counted while the first such run is looked for;
            // the first one's answer is where the walk goes on from, as without the count.
            let counting = few_dead > 0 && lowest_few_dead.get().is_none() && !remap_dead.get();
            let mut dead = 0;
            let mut past_first_dead = None;
            // Refuse the run, going on from `$past`, unless the page at `p` is one more the
            // count may take (it must be unmappable now: its work done).
            macro_rules! refuse {
                ($past:expr, $unmappable:expr) => {{
                    let past = $past;
                    if counting && dead < few_dead && $unmappable {
                        dead += 1;
                        past_first_dead.get_or_insert(past);
                        p += page;
                        continue;
                    }
                    return Err(past_first_dead.unwrap_or(past));
                }};
            }
            while p < addr + len {
                let state = pages.lent(p);
                let lent = state != Lent::No;
                if lent {
                    if avoid_lent.get() {
                        return Err(skip_dead(p + page) - 1);
                    }
                    if remap_dead.get() {
                        // Its memory comes back if it can (and this stream may take it), else
                        // the page is unmapped and mapped afresh, which needs its work done.
                        let back = pages.switch_source(p).is_some_and(|s| self.switch_allowed(st, s));
                        if !back && !self.may_unmap(p, page) {
                            return Err(p + page - 1);
                        }
                        p += page;
                        continue;
                    }
                    if state == Lent::Asleep {
                        judged.passed(1);
                        refuse!(skip_dead(p + page) - 1, self.may_unmap(p, page));
                    }
                    judged.one();
                    let free_elsewhere = pages
                        .switch_source(p)
                        .filter(|s| !(addr / page * page..addr + len).contains(s) && !sources.contains(s));
                    let Some(source) = free_elsewhere else {
                        refuse!(skip_dead(p + page) - 1, self.may_unmap(p, page))
                    };
                    // The memory comes back only if the work queued on it allows (as
                    // `Pager::switch` will judge): else the claim would fail after the walk,
                    // when another candidate, or fresh pages, would have done.
                    if !self.switch_allowed(st, source) {
                        return Err(past_first_dead.unwrap_or(p + page - 1));
                    }
                    sources.push(source);
                }
                if !may_map() && !lent && !pages.is_mapped(p) {
                    // Skip every unmapped page from here at once: the untouched rest of the
                    // range is one free run.
                    refuse!(pages.next_mapped(p).map_or(u64::MAX - 1, |m| m - 1), true);
                }
                p += page;
            }
            // On a refused fence, skip the granules after it that carry the same one.
            let mut bad = None;
            self.space.fences(addr, len, |_, end, w| {
                if judge.fence_ok(w) {
                    return true;
                }
                bad = Some(end - 1);
                false
            });
            if let Some(past) = past_first_dead {
                // A run with few dead pages: remembered, and passed as before.
                if bad.is_none() {
                    lowest_few_dead.set(Some(addr));
                }
                return Err(bad.map_or(past, |b| b.min(past)));
            }
            if bad.is_none() {
                taken = Some((addr, len));
            }
            bad.map_or(Ok(()), Err)
        };
        let limit = match mode.mapping {
            Mapping::Forbidden => 0,
            Mapping::WithinPeak => self.max_reserved().min(self.pages.peak_mapped_bytes()),
            Mapping::Allowed => self.max_reserved(),
        };
        let lend = mode.mapping == Mapping::Allowed && self.lends_pages();
        let mut tries = 0;
        // Past the peak, a large block goes to the run that costs the fewest driver calls
        // (module `cheapest`); first fit after `CHEAPEST_TRIES` refused ones.
        let by_cost = lend && !chunk && size > page && !self.near_limit();
        // Pages of the cheapest runs whose claim the judgement refused (a fence of another
        // stream's work not complete, a dead page whose work is not done): the next cheapest
        // run is looked for without them, a few times, before first fit.
        let mut barred = Vec::new();
        let mut cheapest = by_cost.then(|| cheapest::cheapest_run(&self.space, pages, size, &barred)).flatten();
        // The lowest run with few dead pages, once the walk found a higher one: claimed as the
        // cheapest run is, mapping what it needs (lent past the peak), once.
        let (mut fix_dead_at, mut fix_tried) = (None, false);
        let (addr, held) = loop {
            let fixing = fix_dead_at.is_some();
            remap_dead.set(fixing);
            let got = if let Some(at) = fix_dead_at.take() {
                self.space.claim_large_at(at, size, &mut accept)
            } else if let Some((at, _)) = cheapest.take() {
                remap_dead.set(true);
                let mut refused = None;
                let got = self
                    .space
                    .claim_large_at(at, size, &mut |a, l| accept(a, l).inspect_err(|&past| refused = Some(past)));
                if let Some(past) = refused.filter(|_| got.is_none() && barred.len() < CHEAPEST_TRIES) {
                    barred.push(past / page * page);
                    cheapest = cheapest::cheapest_run(&self.space, pages, size, &barred);
                }
                got
            } else if chunk {
                // A pool holding a reserve (`Pool::reserve`) maps it low, for blocks of every
                // size: its chunks may take reserved pages below the chunk floor rather than
                // map, which the reserve's promise (no map while little is live) needs.
                self.space.alloc_chunk(self.floor_bytes() > 0, &mut accept)
            } else if self.near_limit() {
                // Near the limit every page a block needs beyond those it finds mapped may be
                // one the pool cannot have: the run needing the fewest, then the tightest
                // (module docs).
                let mut score = |addr: u64, run: u64| {
                    let first = addr / page * page;
                    let new = (first..addr + size)
                        .step_by(page as usize)
                        .filter(|&q| !pages.is_mapped(q) && pages.switch_source(q).is_none())
                        .count() as u64;
                    (new << 40) | run.min((1 << 40) - 1)
                };
                self.space.alloc_large_scored(size, &mut accept, &mut score)
            } else {
                self.space.alloc_large(size, &mut accept)
            };
            let Some(addr) = got else {
                if remap_dead.get() {
                    continue;
                }
                return Ok(Self::missed("no run", size, chunk, mode));
            };
            // Once: the run stays remembered, so the walks after a failed claim of it (its
            // pages taken meanwhile, or the device out of memory) count nothing again.
            if let Some(low) = lowest_few_dead.get().filter(|&low| low < addr && !fix_tried) {
                fix_tried = true;
                self.space.give_back(addr, size);
                fix_dead_at = Some(low);
                continue;
            }
            if mode.mapping == Mapping::WithinPeak && !self.maps_fit(addr, size, limit) {
                // Its maps would pass the peak part of the way through: the first pages would
                // be mapped afresh and left free when the rest failed (one for each of the 37
                // placements of bert_dynamic's second pass that went on to rung 7).
                self.space.give_back(addr, size);
                return Ok(Self::missed("past the peak", size, chunk, mode));
            }
            let block = addr / page * page..(addr + size).next_multiple_of(page);
            // The few dead pages are mapped as a placement past the peak maps: lent there.
            let (limit, lend) = if fixing { (self.max_reserved(), true) } else { (limit, lend) };
            let mut map = Pager { pool: self, st, limit, lend, remap: remap_dead.get(), block };
            match self.pages.acquire(addr, size, may_map(), &mut map) {
                Ok(()) => {}
                Err(why) => {
                    self.space.give_back(addr, size);
                    if remap_dead.get() {
                        // The cheapest run could not be had as judged: first fit, as before.
                        continue;
                    }
                    match why {
                        // A lent page the walk judged could come back could not (another
                        // thread took its memory's page meanwhile): walk again, which now
                        // passes over it, rather than fail the rung (the last one unmaps
                        // every free page).
                        Acquire::Lent if tries < CLAIM_TRIES => {
                            tries += 1;
                            continue;
                        }
                        // Where the placement may map, a busy server's threads taking lent
                        // pages' memory from under each other must not send it to the host
                        // waits (H100, `server`: one or two placements in most runs): one
                        // more walk, over pages that are not lent, which it maps or borrows.
                        // A lent page unmapped under the claim reads as needing a map, which
                        // a placement that may map needs for no other reason.
                        Acquire::Lent | Acquire::NeedsMap if mode.mapping == Mapping::Allowed && !avoid_lent.get() => {
                            avoid_lent.set(true);
                            continue;
                        }
                        Acquire::NeedsMap => return Ok(Self::missed("a page needs mapping", size, chunk, mode)),
                        Acquire::Lent => return Ok(Self::missed("lent pages taken meanwhile", size, chunk, mode)),
                        // Over budget, or the device itself is out of memory: the next rung.
                        Acquire::Failed(Error::OutOfMemory(_)) | Acquire::Failed(Error::Device { code: 2, .. }) => {
                            return Ok(Self::missed("out of memory mapping", size, chunk, mode))
                        }
                        Acquire::Failed(e) => return Err(e),
                    }
                }
            }
            match self.judge_held(st, addr, size, mode.reuse) {
                Some(held) => break (addr, held),
                None => {
                    self.pages.release(addr, size);
                    self.space.give_back(addr, size);
                    if tries < CLAIM_TRIES {
                        tries += 1;
                        continue;
                    }
                    return Ok(Self::missed("fences changed under the claim", size, chunk, mode));
                }
            }
        };
        if !held.waits.is_empty() && !held.settle() {
            self.pages.release(addr, size);
            self.space.give_back(addr, size);
            return Ok(Self::missed("a device wait could not be set up", size, chunk, mode));
        }
        if held.own {
            Counters::bump(&self.counters.same_stream_reuses, 1);
        }
        if held.covered {
            Counters::bump(&self.counters.covered_reuses, 1);
        }
        Ok(Some(addr))
    }

    /// How many pages of a large block's first-fit run may need a driver call on a rung that
    /// may not map ([`FEW_DEAD_SHARE`]): 0 for a chunk, a block under `FEW_DEAD_SHARE` pages,
    /// a placement that may map anyway, and near the limit (where runs are scored instead).
    /// A device that cannot map memory at two addresses has no lent pages, and its unmapped
    /// pages could not be mapped without growing: 0 there too, as when pages are not traded.
    fn few_dead_pages(&self, size: u64, chunk: bool, mode: Mode) -> u64 {
        let pages = size.div_ceil(self.pages.page_size());
        let applies = !chunk && mode.mapping == Mapping::Forbidden && self.lends_pages() && !self.near_limit();
        if applies {
            pages / FEW_DEAD_SHARE
        } else {
            0
        }
    }

    /// Whether a placement past the peak borrows free pages' memory (module `arena::pages::lend`)
    /// rather than map new memory: pages are traded, on a device that maps memory at two
    /// addresses.
    fn lends_pages(&self) -> bool {
        self.config.trade_pages_on_map && self.device.can_alias()
    }

    /// A placement that may map failed: say why at debug level (the next rung is the host
    /// waits, which a busy server should seldom reach). No address.
    #[cold]
    fn missed(why: &'static str, size: u64, chunk: bool, mode: Mode) -> Option<u64> {
        if mode.mapping == Mapping::Allowed {
            tracing::debug!(why, size, chunk, reuse = ?mode.reuse, "a placement that may map failed");
        }
        None
    }

    /// The fences of a block whose pages this placement now holds, judged again: the memory
    /// under it is fixed from here (a held page is neither lent nor switched), but between
    /// the walk and the claim another placement's loan (onto a page unmapped at the walk) or
    /// switch back (onto a lent page) may have put memory with another history under
    /// granules the walk judged. Incomplete fences of other streams are taken with a device
    /// wait where the pool allows them (a loan may have set up the same wait already: a
    /// second one costs nothing); else the placement fails. The judge, with the waits to
    /// set up, or None.
    fn judge_held<'a>(&'a self, st: &'a StreamState, addr: u64, size: u64, reuse: Reuse) -> Option<Judge<'a>> {
        let reuse = if self.config.cross_stream_waits { Reuse::Wait } else { reuse };
        let mut judge = Judge::new(self, st, reuse);
        judge.accepts(addr, size).then_some(judge)
    }

    /// Lend the memory of wholly free pages to the `len` bytes at `to`, which a placement for
    /// `st` holds for mapping: pages whose every fence lets `st` reuse them at once (freed on
    /// its own stream, or complete), so the new use is ordered after the old; never pages of
    /// `block`, the placement's own. True when lent.
    fn lend_to(&self, st: &StreamState, to: u64, len: usize, block: &std::ops::Range<u64>) -> bool {
        let mut alias = |from: u64, to: u64, l: usize| {
            Counters::timed(&self.counters.map_ns, || self.device.alias(from, to, l))?;
            // The memory's history goes with it: should the placement be rolled back (another
            // of its pages cannot be had), `to` is left free holding memory whose last users
            // only `from`'s fences name; its own fences are of memory long unmapped.
            self.space.copy_fences(from, to, l as u64);
            Counters::bump(&self.counters.mapped, l as u64);
            Ok(())
        };
        // Pages `st` may take at once first; then, since the alternative is fresh memory, a
        // page other streams' work still uses, with `st` made to wait for that work on the
        // device (set up before the memory is shown at `to`, so `st`'s use comes after).
        let lent = [Reuse::Ready, Reuse::Wait].into_iter().any(|reuse| {
            let mut judge = Judge::new(self, st, reuse);
            let mut accept = |from: u64, l: u64| {
                !block.contains(&from) && judge.accepts(from, l) && (judge.waits.is_empty() || judge.settle())
            };
            self.pages.lend(to, len, &mut accept, &mut alias)
        });
        if lent {
            Counters::bump(&self.counters.pages_lent, 1);
        }
        lent
    }

    /// Unmap the lent pages no stream's work can touch any more (their memory stays where
    /// it was lent), lowest first, until at most `keep` remain; returns the bytes unmapped.
    pub(crate) fn unmap_lent(&self, keep: u64) -> u64 {
        let mut accept = |from: u64, len: u64| self.may_unmap(from, len);
        let mut unmap = |page: u64, len: usize, freed: u64| self.unmap_checked(page, len, freed);
        let n = self.pages.unmap_lent(keep, &mut accept, &mut unmap);
        if n > 0 {
            tracing::debug!(bytes = n, "unmap lent pages")
        }
        n
    }

    /// Give `st`'s arena the chunk at `chunk` (claimed, its pages taken). False, with the
    /// chunk given back, if the arena holds as many chunks as it can.
    fn adopt_chunk(&self, st: &StreamState, chunk: u64) -> bool {
        let Some(idx) = st.arena.reserve(chunk) else {
            self.free_extent(chunk, CHUNK, fence_word(st.slot, st.fence.stamp()));
            return false;
        };
        // Before the chunk serves a block: a block's free finds its arena through it.
        self.space.set_owner(chunk, st.slot, idx);
        st.arena.publish(idx);
        true
    }

    /// Take `st`'s wholly free chunk `idx` back to the space, fenced by `st`'s stream.
    /// False if it is not wholly free (any more).
    pub(crate) fn return_chunk(&self, st: &StreamState, idx: usize) -> bool {
        let Some(chunk) = st.arena.take(idx) else { return false };
        self.space.clear_owner(chunk);
        st.arena.unreserve(idx);
        self.free_extent(chunk, CHUNK, fence_word(st.slot, st.fence.stamp()));
        true
    }

    /// Every wholly free chunk of `st` back to the space (all but `keep`); returns how many.
    pub(crate) fn return_free_chunks(&self, st: &StreamState, keep: usize) -> usize {
        let mut n = 0;
        while st.arena.free_chunks() > keep {
            let Some(idx) = st.arena.first_free_chunk() else { break };
            if self.return_chunk(st, idx) {
                n += 1;
            }
        }
        n
    }

    /// A run of the space goes back with `fence` on its granules, then its pages (in that
    /// order: an unmapper that finds the page free reads the fences after it, see
    /// [`PoolInner::may_unmap`]).
    fn free_extent(&self, addr: u64, size: u64, fence: u64) {
        let freed = self.space.free(addr, size, fence);
        debug_assert!(freed, "{addr:#x}+{size:#x} is not a run of the space");
        if freed {
            self.pages.release(addr, size);
        }
    }

    /// A block freed on `st`'s stream: back to the arena at once (see the module docs).
    pub(crate) fn release(&self, st: &StreamState, span: Span) {
        tracing::trace!(addr = span.addr, size = span.size, stream = st.stream.id(), "retire to the arena");
        if self.space.is_large(span.size) {
            self.free_extent(span.addr, span.size, fence_word(st.slot, st.fence.stamp()));
        } else {
            self.release_small(Some(st), span);
        }
        // After the stamp: an event recorded now covers this free.
        self.note_free(st, span.size);
    }

    /// A block no stream's work can still touch (its events all seen complete): free for
    /// everyone.
    pub(crate) fn release_clean(&self, span: Span) {
        if self.space.is_large(span.size) {
            self.free_extent(span.addr, span.size, 0);
        } else {
            self.release_small(None, span);
        }
    }

    /// A small block back to the arena of the stream that holds its chunk (`st`, when the
    /// caller knows it, else free for everyone), or, placed in the extents near the limit (no
    /// stream owns its address, and its size is whole granules), back there as a large block
    /// goes: with `st`'s fence, stamped only then (a chunk's blocks need none).
    fn release_small(&self, st: Option<&StreamState>, span: Span) {
        let Some((slot, idx)) = self.space.owner(span.addr) else {
            let fence = st.map_or(0, |st| fence_word(st.slot, st.fence.stamp()));
            self.free_extent(span.addr, span.size, fence);
            return;
        };
        let held;
        let owner = match st {
            Some(st) if st.slot == slot => st,
            _ => match self.state_by_slot(slot) {
                Some(s) => {
                    held = s;
                    &held
                }
                None => {
                    debug_assert!(false, "slot {slot} holds a chunk but has no state");
                    return;
                }
            },
        };
        let whole = owner.arena.free(span.addr, span.size, idx);
        debug_assert!(whole.is_some(), "{:#x}+{} refused by its arena", span.addr, span.size);
        if whole == Some(true) && owner.arena.free_chunks() > KEEP_FREE_CHUNKS {
            self.return_chunk(owner, idx);
        }
    }

    /// Map pages under the budget `limit` (at most `max_reserved`): the budget is taken
    /// before the device call, so two threads can never map past it together.
    pub(crate) fn map_pages(&self, page: u64, len: usize, limit: u64) -> Result<()> {
        let len64 = len as u64;
        let before = self.map_budget.fetch_add(len64, Ordering::AcqRel);
        if before + len64 > limit {
            self.map_budget.fetch_sub(len64, Ordering::AcqRel);
            return Err(Error::OutOfMemory(Box::new(OutOfMemory {
                requested: len64,
                reserved: before,
                allocated: 0,
                cached: 0,
                retiring: 0,
                largest_free: 0,
                max_reserved: self.max_reserved(),
            })));
        }
        let r = Counters::timed(&self.counters.map_ns, || self.device.map(page, len));
        tracing::debug!(page, len, ok = r.is_ok(), "map");
        match r {
            Ok(()) => Counters::bump(&self.counters.mapped, len64),
            Err(_) => {
                self.map_budget.fetch_sub(len64, Ordering::AcqRel);
            }
        }
        r
    }

    /// Whether mapping the unmapped pages under `[addr, addr + size)` keeps the memory mapped
    /// within `limit` (as [`PoolInner::map_pages`] will judge each; a forecast, since other
    /// threads map meanwhile).
    fn maps_fit(&self, addr: u64, size: u64, limit: u64) -> bool {
        let page = self.pages.page_size();
        let unmapped =
            (addr / page * page..addr + size).step_by(page as usize).filter(|&q| !self.pages.in_use(q)).count();
        self.map_budget.load(Ordering::Acquire) + unmapped as u64 * page <= limit
    }

    /// Whether the pages `[addr, addr + len)`, wholly free and claimed for unmapping, may go:
    /// no stream's work may still use any of their granules, so every fence on them must be
    /// complete (a device-side wait does not help: unmapping is the host's).
    pub(crate) fn may_unmap(&self, addr: u64, len: u64) -> bool {
        let reg = self.registry.load();
        let mut ok = true;
        self.space.fences(addr, len, |_, _, w| {
            let (slot, seq) = fence_parts(w);
            ok = slot == 0 || reg.slots.get(slot as usize - 1).is_some_and(|e| e.fence.is_complete(seq));
            ok
        });
        ok
    }

    /// Unmap `len` bytes of pages at `page` that the page map claimed for unmapping (free
    /// pages, or lent ones), if every fence on them is complete; `freed` bytes of memory go
    /// back to the budget (a lent page's memory stays at the page it was lent to, unless that
    /// page went first), and the bytes count in `Stats::unmapped_bytes`. Every unmap the
    /// pool makes comes here.
    fn unmap_checked(&self, page: u64, len: usize, freed: u64) -> Result<()> {
        if !self.may_unmap(page, len as u64) {
            return Err(Error::NotPermitted("a stream's work may still use the page"));
        }
        let r = Counters::timed(&self.counters.unmap_ns, || {
            // SAFETY: the page map hands out only pages no held block overlaps (a lent page
            // holds none and serves none), claimed for unmapping so none can be taken
            // meanwhile, and every fence on them is complete: no work queued on any stream
            // can use them.
            unsafe { self.device.unmap(page, len) }
        });
        if r.is_ok() {
            self.map_budget.fetch_sub(freed, Ordering::AcqRel);
            Counters::bump(&self.counters.unmapped, len as u64);
        }
        r
    }

    /// Unmap wholly free pages no stream's work can touch, highest first, until at most
    /// `keep` free mapped bytes remain (more if the floor of [`crate::Pool::reserve`] needs
    /// them); returns the bytes unmapped.
    pub(crate) fn unmap_free(&self, keep: u64) -> u64 {
        let page = self.pages.page_size();
        let free = self.pages.free_mapped_pages() * page;
        let held = self.pages.mapped_bytes().saturating_sub(free);
        let keep = keep.max(self.floor_bytes().saturating_sub(held));
        let mut unmap = |page: u64, len: usize, freed: u64| self.unmap_checked(page, len, freed);
        let n = self.pages.unmap_free(keep, &mut unmap);
        if n > 0 {
            tracing::debug!(bytes = n, keep, "unmap free pages")
        }
        n
    }
}
