//! The dormant pages a pool keeps: as many as pay for themselves.
//!
//! A loan leaves the lender's page mapped and dormant (`LENT`, see
//! [`crate::arena::pages`]); a placement that later lands on it while the memory's page is
//! free takes the memory back with no device call (a *switch*). That is what keeps a server
//! that repeats its layouts from mapping once warm. But placements judge the dormant pages
//! they pass that may have come alive (*awake*, see [`crate::arena::pages`]'s `wake`: their
//! memory's page fell free since they were last found dead), and in a multi-threaded steady
//! state most of those are dead again: the 16-thread random window on the simulator judged
//! about 11,000 dormant pages for each one it switched back, the replays of single-stream
//! traces 21–89, when every page passed was judged (`docs/BENCHMARKS.md`, fifteenth
//! session). Asleep pages are passed without a judgement, and count as an eighth of one
//! ([`PASSES_PER_JUDGEMENT`]): what the bound weighs is what the walks pay. So the pool keeps
//! dormant pages up to a
//! factor of its mapped pages, and the factor follows what they pay: every
//! [`EVAL_CHECKS`] dormant pages judged, if those judgements brought fewer than one switch
//! per [`COSTLY`], the factor halves (down to 1); more than one per [`PAYING`], it doubles
//! (up to [`MOST_PER_MAPPED`]). Past the bound, after a placement that mapped past the peak,
//! the oldest (lowest) dormant pages whose work is done are unmapped, down to three quarters
//! of it: a driver call each (about 20 µs), and memory that can no longer come back there.
//!
//! # Invariants
//!
//! * Only the bound moves: which pages are dormant, and what a switch or an unmap may do,
//!   are the page map's ([`crate::arena::pages::PageMap::unmap_lent`] unmaps only pages no
//!   stream's work can touch). A wrong factor costs time, driver calls or memory held
//!   (placements that could have switched lend or map instead), never a byte's safety.
//! * One thread evaluates and unmaps at a time (a try-flag); the others go on. Counts are
//!   added once a walk, to a [`Tally`] striped by thread, so the walks do not contend on
//!   them.

use std::cell::Cell;

use super::PoolInner;
use crate::arena::tally::Tally;
use crate::stats::Counters;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The most dormant pages a pool keeps per page mapped, and the factor it starts at: at 8
/// every replay maps and unmaps exactly what it did unbounded (at 4, the warm passes began to
/// unmap and map again: bert_dynamic 0.5 GiB), while 16 demo workers on an H100, unbounded,
/// had lent 21,500–25,100 pages in 15 s and placed a large block in 157–273 µs instead of
/// 18–35 (fourteenth session).
pub const MOST_PER_MAPPED: u64 = 8;
/// Dormant pages kept whatever the pool maps.
pub const FLOOR: u64 = 256;
/// Dormant pages judged between two looks at what they paid.
pub const EVAL_CHECKS: u64 = 1 << 16;
/// Asleep dormant pages a walk passes for the cost of one judgement: about 1 ns a page
/// passed (its word and an awake bit read in a run) against 6–8 ns a judgement (four
/// dependent loads), in profiles of the 1-thread random window on the development machine.
/// Counted at full cost, passes made the bound halve on warm passes of multi-stream traces
/// whose dormant pages were mostly asleep, which then unmapped and mapped again
/// (resnet50_4streams: 1.3–1.7 GiB unmapped a pass against none; at a quarter, threads_streams
/// still unmapped 574 MiB), and the 8-thread `server` shape traded 1.5–1.7 times the pages.
/// The random window on 4 threads pays for it: it keeps about three times the dormant pages
/// and switches memory back and forth between them (`docs/BENCHMARKS.md`, twenty-eighth
/// session).
pub const PASSES_PER_JUDGEMENT: u64 = 8;
/// Judgements per switch above which dormant pages cost more than they pay.
pub const COSTLY: u64 = 1024;
/// Judgements per switch below which they pay.
pub const PAYING: u64 = 256;

/// The bound on dormant pages and what it is measured by.
pub(crate) struct Dormant {
    /// Dormant pages kept per page mapped (1 to [`MOST_PER_MAPPED`]).
    factor: AtomicU64,
    /// Dormant pages judged by placements, ever, in passes (a judgement is
    /// [`PASSES_PER_JUDGEMENT`]).
    checks: Tally,
    /// `checks` at the last look.
    checks_then: AtomicU64,
    /// Pages switched back, as `Stats::pages_switched` read at the last look.
    switched_then: AtomicU64,
    /// A thread is evaluating or unmapping.
    busy: AtomicBool,
}

impl Default for Dormant {
    fn default() -> Self {
        Dormant {
            factor: AtomicU64::new(MOST_PER_MAPPED),
            checks: Tally::new(0),
            checks_then: AtomicU64::new(0),
            switched_then: AtomicU64::new(0),
            busy: AtomicBool::new(false),
        }
    }
}

impl Dormant {
    /// A count of the dormant pages one walk judges, added to the pool's when dropped (one
    /// add a walk, not one a page).
    pub(crate) fn judging(&self) -> Judged<'_> {
        Judged { dormant: self, n: Cell::new(0) }
    }

    /// Pages judged since the last look (passes of asleep ones counted at their share).
    fn judged_since(&self) -> u64 {
        self.checks.get().wrapping_sub(self.checks_then.load(Ordering::Relaxed)) / PASSES_PER_JUDGEMENT
    }

    /// Dormant pages kept per page mapped now.
    pub(crate) fn factor(&self) -> u64 {
        self.factor.load(Ordering::Relaxed)
    }

    /// The next factor, from what the dormant pages judged since the last look paid.
    fn next_factor(factor: u64, checks: u64, switched: u64) -> u64 {
        if checks > COSTLY.saturating_mul(switched) {
            (factor / 2).max(1)
        } else if checks < PAYING.saturating_mul(switched) {
            (factor * 2).min(MOST_PER_MAPPED)
        } else {
            factor
        }
    }
}

/// See [`Dormant::judging`]: counted in passes.
pub(crate) struct Judged<'a> {
    dormant: &'a Dormant,
    n: Cell<u64>,
}

impl Judged<'_> {
    /// One more dormant page judged.
    pub(crate) fn one(&self) {
        self.n.set(self.n.get() + PASSES_PER_JUDGEMENT);
    }

    /// `pages` asleep dormant pages passed without a judgement.
    pub(crate) fn passed(&self, pages: u64) {
        self.n.set(self.n.get() + pages);
    }
}

impl Drop for Judged<'_> {
    fn drop(&mut self) {
        let n = self.n.get();
        if n > 0 {
            self.dormant.checks.add(n);
        }
    }
}

impl PoolInner {
    /// After a placement that mapped past the peak: look at what the dormant pages paid
    /// (every [`EVAL_CHECKS`] judged), and unmap those beyond the bound.
    pub(crate) fn bound_dormant(&self) {
        let d = &self.dormant;
        let page = self.pages.page_size();
        let bound = |factor: u64| (self.pages.mapped_bytes() / page * factor).max(FLOOR);
        let due = d.judged_since() >= EVAL_CHECKS;
        if (!due && self.pages.lent_pages() <= bound(d.factor())) || d.busy.swap(true, Ordering::AcqRel) {
            return;
        }
        if due {
            let switched = Counters::get(&self.counters.pages_switched);
            let paid = switched.saturating_sub(d.switched_then.swap(switched, Ordering::Relaxed));
            let now = d.checks.get();
            let checks = now.wrapping_sub(d.checks_then.swap(now, Ordering::Relaxed)) / PASSES_PER_JUDGEMENT;
            let next = Dormant::next_factor(d.factor(), checks, paid);
            if next != d.factor() {
                tracing::debug!(checks, switched = paid, factor = next, "dormant pages' bound");
                d.factor.store(next, Ordering::Relaxed);
            }
        }
        let b = bound(d.factor());
        if self.pages.lent_pages() > b {
            self.unmap_lent(b / 4 * 3);
        }
        d.busy.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_factor_halves_when_dormant_pages_cost_and_doubles_when_they_pay() {
        assert_eq!(Dormant::next_factor(8, 10_000 * 10, 10), 4, "10,000 judged a switch");
        assert_eq!(Dormant::next_factor(1, 1 << 20, 0), 1, "never below one per page mapped");
        assert_eq!(Dormant::next_factor(2, 50 * 100, 100), 4, "50 judged a switch");
        assert_eq!(Dormant::next_factor(8, 0, 1), 8, "never above the most");
        assert_eq!(Dormant::next_factor(4, 500 * 10, 10), 4, "in between: kept");
    }

    #[test]
    fn asleep_pages_passed_weigh_an_eighth_of_a_judgement() {
        let d = Dormant::default();
        {
            let walk = d.judging();
            walk.one();
            walk.passed(2 * PASSES_PER_JUDGEMENT);
        }
        assert_eq!(d.judged_since(), 3, "one judgement and sixteen passes");
        {
            let walk = d.judging();
            walk.passed(PASSES_PER_JUDGEMENT - 1);
        }
        assert_eq!(d.judged_since(), 3, "passes add up across walks, a judgement's worth at a time");
        d.judging().passed(1);
        assert_eq!(d.judged_since(), 4);
    }
}
