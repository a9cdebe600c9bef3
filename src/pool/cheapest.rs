//! Where a large block that must map goes: the free run whose pages cost the fewest driver
//! calls, not the lowest one.
//!
//! Past the pool's peak (the ladder's rung 7), first fit took the lowest free run whose
//! pages could all be had, and a lent page whose memory is busy where it went (*dead*) could
//! not be had at all. In a warm pool every run a large block had used before held a few such
//! pages, so the block went on to pages never mapped at the top of the large blocks' half and
//! borrowed memory for each of them, a map a page: on train_gpt2 the second and fourth
//! 1,148 MiB blocks of every pass went to a new address (9,748, 12,022, 14,318 MiB from the
//! base) and lent 557–563 pages, while the run the block had used a pass before held 405
//! free mapped pages, 155 lent ones whose memory was free to come back, and 14 dead ones
//! (`docs/BENCHMARKS.md`, twenty-ninth session). The dormant pages grew by a pass's loans
//! every pass and the loans never stopped.
//!
//! So a placement that may map weighs each candidate by what its pages cost: nothing for a
//! mapped page, a little for a lent one whose memory can come back (the page it leaves is
//! dead behind the block: [`SWITCH_COST`]), a map for an unmapped one, an unmap and a map
//! for a dead one ([`MAP_COST`], [`REMAP_COST`], about an H200's 40 µs and 29 µs), and
//! takes the cheapest run, the lowest among equals. The dead pages of the run
//! it takes are unmapped there and mapped afresh
//! ([`crate::arena::pages::Mapper::unmap_dead`]): the same calls an unmap of dormant pages
//! makes, judged the same way (every fence on the page complete). Asking more of a run with
//! dead pages (at most half the cost of pages never mapped, or a third) moved single traces
//! either way and the ten together no better (`docs/BENCHMARKS.md`, twenty-ninth session).
//!
//! # Invariants
//!
//! * Only a preference: the run chosen is claimed and judged as any other. If the judgement
//!   refuses it (memory another stream freed, its event not complete; a dead page whose
//!   work is not done), the page it refused is barred and the next cheapest run tried, a few
//!   times, then first fit. First fit at once took the lowest run it could have however
//!   many maps it needed: resnet50_4streams' 49 MiB blocks, about nine times a pass, mapped
//!   about 25 fresh pages each while a run needing a few stood free higher up.
//! * Every free run is a candidate, those above the chunk floor (among the streams' chunks)
//!   too. The code meant to look only below it and, adding the space's base to a floor that
//!   already held it, looked everywhere; capped at the floor for real, the second passes
//!   moved more: bert_dynamic 1.40 peaks against 0.77, resnet_varbatch 0.27 against 0.09,
//!   pipeline_side_stream 1.11 against 1.05 (`docs/BENCHMARKS.md`, thirty-second session).
//!   The chunks' half is where free runs are long: a block that must map finds one there
//!   that needs few maps when the large blocks' half has none.
//! * A page another thread is mapping or unmapping rules a run out.

use std::collections::VecDeque;

use crate::arena::pages::{Lent, PageMap};
use crate::arena::Space;

/// What mapping an unmapped page of the run costs, in units of about 10 µs on an H200
/// (one page mapped, the memory lent or new).
pub(crate) const MAP_COST: u64 = 4;
/// What taking back the memory of a lent page costs: no driver call, but the page the
/// memory leaves is dead behind the block, for a later block to map or remap. At 0 (free),
/// bert_dynamic's cold pass remapped 542 pages and lent 770 (where e524a11 lent 265); at 1,
/// 185 and 447, and the ten traces' second passes moved 7.81 times a peak in all against
/// 8.86 (`docs/BENCHMARKS.md`, twenty-ninth session).
pub(crate) const SWITCH_COST: u64 = 1;
/// What a dead lent page of the run costs: an unmap (~29 µs) and a map.
pub(crate) const REMAP_COST: u64 = 7;

/// What one page of a candidate run costs; None: no block can have it now (or this
/// placement found it refused: `barred`).
fn page_cost(pages: &PageMap, barred: &[u64], q: u64) -> Option<u64> {
    if barred.contains(&q) {
        return None;
    }
    match pages.lent(q) {
        Lent::Awake if pages.switch_source(q).is_some() => Some(SWITCH_COST),
        Lent::Awake | Lent::Asleep => Some(REMAP_COST),
        Lent::No if pages.is_mapped(q) => Some(0),
        Lent::No if !pages.in_use(q) => Some(MAP_COST),
        // Mapping or unmapping: another thread is in a device call for it.
        Lent::No => None,
    }
}

/// The cheapest place for `size` bytes among the space's free runs, with its cost: each
/// run's start, and every page boundary in it, a window of the block's pages slid a page at
/// a time. Windows wholly on pages never mapped are skipped once one of them was weighed:
/// they all cost the same. Windows over a page of `barred` (pages a claim of this placement
/// refused) are not candidates. None when no run fits.
pub(crate) fn cheapest_run(space: &Space, pages: &PageMap, size: u64, barred: &[u64]) -> Option<(u64, u64)> {
    let mut best: Option<(u64, u64)> = None;
    space.for_each_free(|run, len| {
        if len < size {
            return;
        }
        if let Some(found) = cheapest_in(pages, barred, run, run + len, size) {
            if best.is_none_or(|b| found < b) {
                best = Some(found);
            }
        }
    });
    best.map(|(cost, addr)| (addr, cost))
}

/// The cheapest window of `size` bytes in the free run `[run, end)`: (cost, address).
fn cheapest_in(pages: &PageMap, barred: &[u64], run: u64, end: u64, size: u64) -> Option<(u64, u64)> {
    let page = pages.page_size();
    let span = |a: u64| (a / page * page, (a + size - 1) / page * page);
    let all_new = size.div_ceil(page) * MAP_COST;
    let mut best: Option<(u64, u64)> = None;
    // A window's page costs in order (None: a page no block can have now), their sum, and
    // how many are None and how many dead.
    let mut w = Window::default();
    let consider = |w: &Window, a: u64, best: &mut Option<(u64, u64)>| {
        if w.barred == 0 && best.is_none_or(|b| w.sum < b.0) {
            *best = Some((w.sum, a));
        }
    };
    let fill = |a: u64, w: &mut Window| {
        *w = Window::default();
        let (first, last) = span(a);
        for q in (first..=last).step_by(page as usize) {
            w.push(page_cost(pages, barred, q));
        }
    };
    fill(run, &mut w);
    consider(&w, run, &mut best);
    // The page-aligned windows, slid a page at a time.
    let mut a = run.next_multiple_of(page);
    if a + size <= end {
        fill(a, &mut w);
    }
    while a + size <= end && best.is_none_or(|b| b.0 > 0) {
        consider(&w, a, &mut best);
        if w.barred == 0 && w.dead == 0 && w.sum == all_new {
            // Every page of this window needs a map, as every later one does until a page in
            // use: go on to the first window that reaches one.
            match pages.next_in_use(a + size) {
                Some(q) if q < end => {
                    a = (q + 1).saturating_sub(size).next_multiple_of(page).max(a + page);
                    if a + size <= end {
                        fill(a, &mut w);
                    }
                    continue;
                }
                _ => break,
            }
        }
        if a + page + size > end {
            break;
        }
        w.pop();
        w.push(page_cost(pages, barred, span(a + page).1));
        a += page;
    }
    best
}

/// The pages of a candidate window and what they cost (see [`cheapest_in`]).
#[derive(Default)]
struct Window {
    costs: VecDeque<Option<u64>>,
    sum: u64,
    barred: u64,
    dead: u64,
}

impl Window {
    fn push(&mut self, c: Option<u64>) {
        self.tally(c, true);
        self.costs.push_back(c);
    }

    fn pop(&mut self) {
        if let Some(c) = self.costs.pop_front() {
            self.tally(c, false);
        }
    }

    fn tally(&mut self, c: Option<u64>, add: bool) {
        let (sum, barred, dead) = (c.unwrap_or(0), u64::from(c.is_none()), u64::from(c == Some(REMAP_COST)));
        if add {
            (self.sum, self.barred, self.dead) = (self.sum + sum, self.barred + barred, self.dead + dead);
        } else {
            (self.sum, self.barred, self.dead) = (self.sum - sum, self.barred - barred, self.dead - dead);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::arena::pages::Backing;
    use crate::arena::CHUNK;
    use crate::Error;

    const P: u64 = CHUNK;
    const BASE: u64 = 64 * P;

    /// A space and its page map over the same 32 pages, every granule free, pages `mapped`
    /// mapped and free.
    fn world(mapped: std::ops::Range<u64>) -> (Space, PageMap) {
        let space = Space::new(BASE, 32 * P, 2 * CHUNK).unwrap();
        let pages = PageMap::new(BASE, 32 * P, P).unwrap();
        for q in mapped {
            pages.acquire(BASE + q * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
            assert!(pages.release(BASE + q * P, P));
        }
        (space, pages)
    }

    /// Hold the space's granules over pages `from..to` (no page taken): runs there are not
    /// free. Returns the block, for `Space::give_back`.
    fn hold(space: &Space, from: u64, to: u64) -> (u64, u64) {
        let (at, len) = (BASE + from * P, (to - from) * P);
        assert_eq!(space.claim_large_at(at, len, &mut |_, _| Ok(())), Some(at));
        (at, len)
    }

    /// Lend page 1's memory to a block on page 20: page 1 is dead while that block lives.
    fn kill_page_1(pages: &PageMap) {
        let mut lend = |a: u64, l: usize| match pages.lend(a, l, &mut |from, _| from == BASE + P, &mut |_, _, _| Ok(()))
        {
            true => Ok(Backing::Lent),
            false => Err(Error::NotPermitted("nothing to lend")),
        };
        pages.acquire(BASE + 20 * P, P, true, &mut lend).unwrap();
        assert_eq!(pages.switch_source(BASE + P), None);
    }

    #[test]
    fn a_block_that_must_map_goes_where_the_fewest_pages_need_it_not_to_the_lowest_run() {
        let (space, pages) = world(10..14);
        assert_eq!(cheapest_run(&space, &pages, 3 * P, &[]), Some((BASE + 10 * P, 0)), "on mapped pages");
        // Half a page more: one map whichever side, and the lower window among equals.
        assert_eq!(cheapest_run(&space, &pages, 4 * P + P / 2, &[]), Some((BASE + 9 * P, MAP_COST)));
        // No free run over a mapped page: the lowest run, every page a map.
        let (at, len) = hold(&space, 8, 32);
        assert_eq!(cheapest_run(&space, &pages, 3 * P, &[]), Some((BASE, 3 * MAP_COST)));
        assert!(space.give_back(at, len));
        // Granules taken cut the runs: two of the mapped pages are left free, and a map.
        let taken = space.alloc_large(12 * P, &mut |_, _| Ok(())).unwrap();
        assert_eq!(taken, BASE);
        assert_eq!(cheapest_run(&space, &pages, 3 * P, &[]), Some((BASE + 12 * P, MAP_COST)));
    }

    #[test]
    fn a_dead_lent_page_weighs_an_unmap_and_a_map() {
        let (space, pages) = world(0..4);
        kill_page_1(&pages);
        assert_eq!(cheapest_run(&space, &pages, 4 * P, &[]), Some((BASE, REMAP_COST)), "one remap, not two maps");
        // Where the maps saved are fewer than a remap costs, the run goes elsewhere.
        assert_eq!(cheapest_run(&space, &pages, P + P / 2, &[]), Some((BASE + 2 * P, 0)));
    }

    #[test]
    fn a_dead_page_is_remapped_wherever_that_costs_less_than_the_maps_it_saves() {
        let (space, pages) = world(0..2);
        kill_page_1(&pages);
        // Away from the block on page 20 (its pages' runs held): pages 0 and 1, one remap
        // (7) against two maps (8).
        let (at, len) = hold(&space, 16, 32);
        assert_eq!(cheapest_run(&space, &pages, 2 * P, &[]), Some((BASE, REMAP_COST)));
        // Three pages: a remap and a map (11) against three maps (12); the window past the
        // dead page needs three as well.
        assert_eq!(cheapest_run(&space, &pages, 3 * P, &[]), Some((BASE, REMAP_COST + MAP_COST)));
        assert!(space.give_back(at, len));
        // Beside the block on page 20 (sharing its page), one map is cheaper still.
        assert_eq!(cheapest_run(&space, &pages, 2 * P, &[]), Some((BASE + 19 * P, MAP_COST)));
    }

    #[test]
    fn no_window_over_a_barred_page_is_a_candidate() {
        let (space, pages) = world(10..14);
        // Page 12 refused: no three-page window of the mapped four avoids it; the one from
        // page 9 maps one page, any past page 12 two or more.
        let barred = [BASE + 12 * P];
        assert_eq!(cheapest_run(&space, &pages, 3 * P, &barred), Some((BASE + 9 * P, MAP_COST)));
        assert_eq!(cheapest_run(&space, &pages, 2 * P, &barred), Some((BASE + 10 * P, 0)));
    }
}
