//! The page map against hand-made cases.
use super::*;

const P: u64 = 1 << 21;

fn ok_map(log: &mut Vec<(u64, u64)>) -> impl FnMut(u64, usize) -> Result<Backing, Error> + '_ {
    move |a, l| {
        log.push((a, l as u64));
        Ok(Backing::Fresh)
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
    m.acquire(0, 1, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert_eq!(m.acquire(0, 2 * P, false, &mut |_, _| Ok(Backing::Fresh)), Err(Acquire::NeedsMap));
    let mut seen = vec![];
    m.for_each_mapped(|a, c| seen.push((a, c)));
    assert_eq!(seen, vec![(0, 1)]);
}

#[test]
fn map_failure_leaves_page_unmapped_and_rolls_back() {
    let m = PageMap::new(0, 4 * P, P).unwrap();
    m.acquire(P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    let err = Error::Device { call: "map", code: -1, message: Box::new("no".into()) };
    let e2 = err.clone();
    // Page 0 is a run of its own (page 1 is mapped), page 2 another, whose map fails.
    let r = m.acquire(0, 3 * P, true, &mut |a, _| if a == 2 * P { Err(e2.clone()) } else { Ok(Backing::Fresh) });
    assert_eq!(r, Err(Acquire::Failed(err)));
    let mut seen = vec![];
    m.for_each_mapped(|a, c| seen.push((a, c)));
    assert_eq!(seen, vec![(0, 0), (P, 1)], "page 0 mapped but given back, page 1 as before, page 2 unmapped");
    assert_eq!(m.free_mapped_pages(), 1);
    assert_eq!(m.unmap_free(0, &mut |_, _, _| Ok(())), P);
    assert_eq!(m.mapped_bytes(), P);
}

#[test]
fn a_run_goes_back_whole_or_not_at_all() {
    let m = PageMap::new(0, 8 * P, P).unwrap();
    m.acquire(0, 4 * P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    m.release(0, 4 * P);
    m.acquire(3 * P, 1, true, &mut |_, _| panic!("page 3 is mapped")).unwrap();
    assert_eq!(m.free_mapped_pages(), 3);
    assert_eq!(m.unmap_free(0, &mut |_, _, _| panic!("the run has a live page")), 0);
    m.release(3 * P, 1);
    let mut calls = vec![];
    let n = m.unmap_free(0, &mut |a, l, _| {
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
    assert!(matches!(m.acquire(0, 1, true, &mut |_, _| Ok(Backing::Fresh)), Err(Acquire::Failed(_))));
    assert!(matches!(m.acquire(P, 0, true, &mut |_, _| Ok(Backing::Fresh)), Err(Acquire::Failed(_))));
    assert!(matches!(m.acquire(P, u64::MAX, true, &mut |_, _| Ok(Backing::Fresh)), Err(Acquire::Failed(_))));
    assert!(!m.release(P, P));
    m.acquire(P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert!(m.release(P, P));
    assert!(!m.release(P, P), "count is already 0");
    assert_eq!(m.free_mapped_pages(), 1);
}

#[test]
fn unmap_free_keeps_the_lowest_pages_and_skips_live_ones() {
    let m = PageMap::new(0, 8 * P, P).unwrap();
    // One page at a time: six runs of one page.
    for p in 0..6 {
        m.acquire(p * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    }
    m.release(P, 5 * P);
    m.acquire(3 * P, 1, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    // free mapped: pages 1, 2, 4, 5; page 0 and 3 live
    let mut gone = vec![];
    let n = m.unmap_free(2 * P, &mut |a, _, _| {
        gone.push(a);
        Ok(())
    });
    assert_eq!((n, gone), (2 * P, vec![5 * P, 4 * P]));
    let failing = m.unmap_free(0, &mut |_, _, _| Err(Error::NotPermitted("test")));
    assert_eq!(failing, 0);
    assert_eq!(m.free_mapped_pages(), 2);
    assert_eq!(m.unmap_free(0, &mut |_, _, _| Ok(())), 2 * P);
    assert_eq!(m.mapped_bytes(), 2 * P);
    assert_eq!(m.peak_mapped_bytes(), 6 * P);
}

/// What a lend toward `to` is offered, highest first, when its judge refuses every page.
fn offers(m: &PageMap, to: u64) -> Vec<u64> {
    let mut seen = vec![];
    assert!(!m.lend(
        to,
        P as usize,
        &mut |from, _| {
            seen.push(from);
            false
        },
        &mut |_, _, _| Ok(())
    ));
    seen
}

#[test]
fn a_lender_is_offered_the_free_single_pages_highest_first_and_no_others() {
    let m = PageMap::new(0, 16 * P, P).unwrap();
    // Pages 0..6 one at a time, then 8..=9 as one run of two.
    for p in 0..6 {
        m.acquire(p * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    }
    m.acquire(8 * P, 2 * P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    m.release(0, 6 * P);
    m.release(8 * P, 2 * P);
    // Pages 1 and 4 taken again after they were freed; page 5 is where the loan goes.
    m.acquire(P, 1, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    m.acquire(4 * P, 1, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert_eq!(offers(&m, 5 * P), [3 * P, 2 * P, 0], "not the target, the run's pages or pages in use");
    // Freed again: offered again.
    m.release(4 * P, 1);
    assert_eq!(offers(&m, 5 * P), [4 * P, 3 * P, 2 * P, 0]);
    // A loan takes the highest, page 5, which is offered no more.
    assert!(m.lend(7 * P, P as usize, &mut |_, _| true, &mut |_, _, _| Ok(())));
    assert_eq!(m.lent_pages(), 1);
    assert_eq!(offers(&m, 6 * P), [4 * P, 3 * P, 2 * P, 0]);
}

#[test]
fn a_free_page_without_its_hint_is_reported() {
    let m = PageMap::new(0, 4 * P, P).unwrap();
    m.acquire(P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert!(m.walk_unhinted_free().is_empty(), "a page in use needs no hint");
    m.release(P, P);
    assert!(m.walk_unhinted_free().is_empty());
    m.free_hint.try_clear(m.hint_bit(1));
    assert_eq!(m.walk_unhinted_free(), [P]);
}

#[test]
fn pages_being_unmapped_are_no_longer_counted_as_mapped() {
    // The caller's unmap gives the pages' budget back, and another thread may map at once:
    // `mapped` (and so the peak) must not still count them then, or a pool at its limit
    // reads a peak past it.
    let m = PageMap::new(0, 4 * P, P).unwrap();
    m.acquire(0, 2 * P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    m.release(0, 2 * P);
    let mut seen_during = vec![];
    m.unmap_free(0, &mut |_, _, _| {
        seen_during.push(m.mapped_bytes());
        Ok(())
    });
    assert_eq!(seen_during, vec![0], "the run of two pages left `mapped` before its unmap call");
    // A failed unmap counts them again.
    m.acquire(0, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    m.release(0, P);
    assert_eq!(m.unmap_free(0, &mut |_, _, _| Err(Error::NotPermitted("test"))), 0);
    assert_eq!(m.mapped_bytes(), P);
}

#[test]
fn metadata_grows_with_use() {
    let m = PageMap::new(0, 1 << 40, P).unwrap();
    m.acquire((1 << 40) - P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    let made = m.words.chunks_made();
    assert_eq!(made, 1);
}

/// Threads acquire and release single pages of a small map, mapping fresh memory under
/// half of the budget and lending free pages past it, and taking lent pages back where
/// their memory is free: once quiet, each memory shows at one mapped page at most, and the
/// counters agree with a walk.
#[test]
fn loans_and_their_returns_racing_keep_each_memory_at_one_mapped_page() {
    use std::sync::atomic::AtomicU64 as A;
    const PAGES: u64 = 16;
    let m = PageMap::new(0, PAGES * P, P).unwrap();
    let fresh = A::new(0);
    struct Lender<'a> {
        m: &'a PageMap,
        fresh: &'a A,
    }
    impl Mapper for Lender<'_> {
        fn map(&mut self, addr: u64, len: usize) -> Result<Backing, Error> {
            if self.m.mapped_bytes() >= 6 * P && self.m.lend(addr, len, &mut |_, _| true, &mut |_, _, _| Ok(())) {
                return Ok(Backing::Lent);
            }
            self.fresh.fetch_add(1, Ordering::AcqRel);
            Ok(Backing::Fresh)
        }
        fn switch(&mut self, _from: u64, _to: u64) -> bool {
            true
        }
    }
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (m, fresh) = (&m, &fresh);
            s.spawn(move || {
                let mut held: Vec<u64> = Vec::new();
                for r in 0..200_000u64 {
                    let p = (r * 7 + t * 5) % PAGES;
                    if r % 3 != 0 {
                        if m.acquire(p * P, P, true, &mut Lender { m, fresh }).is_ok() {
                            held.push(p);
                        }
                    } else if let Some(q) = held.pop() {
                        assert!(m.release(q * P, P));
                    }
                    if r % 500 == 0 {
                        let fail = r % 1000 == 0;
                        m.unmap_free(4 * P, &mut |_, _, _| {
                            if fail {
                                Err(Error::NotPermitted("test"))
                            } else {
                                Ok(())
                            }
                        });
                    }
                    if r % 700 == 0 {
                        m.unmap_lent(0, &mut |_, _| r % 1400 != 0, &mut |_, _, _| Ok(()));
                    }
                }
                for q in held {
                    assert!(m.release(q * P, P));
                }
            });
        }
    });
    assert_eq!(m.walk_doubly_mapped(), vec![], "no memory serves two mapped pages, refs agree");
    assert_eq!(m.walk_asleep_switchable(), Vec::<u64>::new(), "every lent page whose memory is free is awake");
    assert_eq!(m.walk_physical(), m.mapped_bytes(), "each memory counted once");
    let mut mapped = 0;
    m.for_each_mapped(|_, _| mapped += P);
    assert_eq!(mapped + m.walk_lent_only(), m.mapped_bytes(), "each memory shows at one mapped page at most");
}

/// Lent pages go lowest first (the oldest: loans take fresh pages above the mapped ones), as
/// many as bring them down to `keep`, skipping those the judge refuses; their memory stays
/// where it was lent.
#[test]
fn unmapping_lent_pages_goes_lowest_first_down_to_what_it_keeps() {
    struct LendOnly<'a>(&'a PageMap);
    impl Mapper for LendOnly<'_> {
        fn map(&mut self, addr: u64, len: usize) -> Result<Backing, Error> {
            match self.0.lend(addr, len, &mut |_, _| true, &mut |_, _, _| Ok(())) {
                true => Ok(Backing::Lent),
                false => Err(Error::NotPermitted("nothing to lend")),
            }
        }
        fn switch(&mut self, _from: u64, _to: u64) -> bool {
            false
        }
    }
    let m = PageMap::new(0, 8 * P, P).unwrap();
    // Three pages mapped one call each (a run is never lent), then left free.
    for p in 0..3 {
        m.acquire(p * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    }
    m.release(0, 3 * P);
    for p in 5..8 {
        m.acquire(p * P, P, true, &mut LendOnly(&m)).unwrap();
    }
    assert_eq!(m.lent_pages(), 3);
    let no_memory_freed = &mut |_: u64, _: usize, freed: u64| {
        assert_eq!(freed, 0, "a lent page's memory still serves its block");
        Ok(())
    };
    assert_eq!(m.unmap_lent(2, &mut |_, _| true, no_memory_freed), P);
    let is_lent = |a: u64| m.lent(a) != Lent::No;
    assert!(!is_lent(0) && is_lent(P) && is_lent(2 * P), "the lowest went first");
    assert_eq!(m.unmap_lent(0, &mut |from, _| from != P, no_memory_freed), P);
    assert!(is_lent(P) && !is_lent(2 * P), "a refused page stays, the next goes");
    assert_eq!(m.mapped_bytes(), 3 * P);
}

#[test]
fn next_mapped_finds_the_lowest_mapped_page_at_or_above_and_none_past_the_highest() {
    let m = PageMap::new(0, 64 * P, P).unwrap();
    assert_eq!(m.next_mapped(0), None, "nothing mapped yet");
    for p in [3, 9, 40] {
        m.acquire(p * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    }
    let found = |a: u64| m.next_mapped(a).map(|x| x / P);
    assert_eq!((found(0), found(3 * P), found(4 * P), found(10 * P)), (Some(3), Some(3), Some(9), Some(40)));
    assert_eq!(found(41 * P), None);
    // The highest page unmapped: a scan past the next one finds nothing, though it once
    // reached that high.
    m.release(40 * P, P);
    assert_eq!(m.unmap_free(0, &mut |_, _, _| Ok(())), P);
    assert_eq!((found(10 * P), found(9 * P)), (None, Some(9)));
    // Mapped again, higher than ever: found.
    m.acquire(63 * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert_eq!(found(10 * P), Some(63));
}

/// A scan passes groups of pages never mapped without reading them, so every page a map
/// call makes mapped must mark its own group, the last pages of a run across a group's edge
/// too; a group marked once stays marked when its pages go.
#[test]
fn next_mapped_passes_groups_never_mapped_and_finds_every_page_of_a_run_across_groups() {
    let g = GROUP as u64;
    let m = PageMap::new(0, 4 * g * P, P).unwrap().with_max_run(4);
    // One map call for pages g - 1 ..= g + 2: the run's head in group 0, the rest in group 1.
    let mut calls = 0;
    m.acquire((g - 1) * P, 4 * P, true, &mut |_, _| {
        calls += 1;
        Ok(Backing::Fresh)
    })
    .unwrap();
    m.acquire((3 * g + 5) * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert_eq!(calls, 1, "the run is mapped in one call");
    let found = |a: u64| m.next_mapped(a).map(|x| x / P);
    assert_eq!(found(0), Some(g - 1));
    assert_eq!(found(g * P), Some(g), "the run's pages in the next group are found");
    assert_eq!(found((g + 3) * P), Some(3 * g + 5), "group 2, never mapped, is passed");
    // The run goes: group 1 stays marked, and a scan through it finds the page past it.
    m.release((g - 1) * P, 4 * P);
    assert_eq!(m.unmap_free(0, &mut |_, _, _| Ok(())), 4 * P);
    assert_eq!((found(0), found(g * P)), (Some(3 * g + 5), Some(3 * g + 5)));
    // Mapped again inside the marked group, below the highest page: found.
    m.acquire((g + 7) * P, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert_eq!(found(0), Some(g + 7));
}

/// One memory lent from page to page, further than a memory has slots for its lent pages:
/// while its last page holds a block, every tracked lent page sleeps once judged (the
/// untracked ones stay awake: nothing would wake them); when that page falls free, every one
/// of them is awake and could take the memory back, and a walk passes the asleep ones at once.
#[test]
fn lent_pages_sleep_while_their_memory_is_busy_and_wake_when_it_falls_free() {
    let hops = SLOTS + 3;
    let m = PageMap::new(0, (hops as u64 + 2) * P, P).unwrap();
    let mut lend = |a: u64, l: usize| match m.lend(a, l, &mut |_, _| true, &mut |_, _, _| Ok(())) {
        true => Ok(Backing::Lent),
        false => Err(Error::NotPermitted("nothing to lend")),
    };
    m.acquire(0, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    for k in 1..=hops as u64 {
        assert!(m.release((k - 1) * P, P));
        m.acquire(k * P, P, true, &mut lend).unwrap();
    }
    let last = hops as u64 * P;
    assert_eq!(m.lent_pages(), hops as u64, "one memory, shown by every page up to the last");
    let lenders: Vec<u64> = (0..hops as u64).map(|k| k * P).collect();
    for &p in &lenders {
        assert_eq!(m.switch_source(p), None, "its memory serves the block on the last page");
    }
    let awake = lenders.iter().filter(|&&p| m.lent(p) == Lent::Awake).count();
    assert_eq!(awake, hops - SLOTS, "only the untracked lent pages stay awake");
    assert_eq!(m.past_asleep(0), (SLOTS as u64) * P, "the walk passes the tracked ones in one step");
    assert!(m.release(last, P));
    assert_eq!(m.walk_asleep_switchable(), Vec::<u64>::new());
    for &p in &lenders {
        assert_eq!(m.lent(p), Lent::Awake);
        assert_eq!(m.switch_source(p), Some(last), "the memory can come back to {p:#x}");
    }
    // Back to one lent page: the memory returns to page 0, and the last page sleeps behind it.
    m.acquire(0, P, false, &mut |_, _| Err(Error::NotPermitted("no map"))).unwrap_err();
    struct Back;
    impl Mapper for Back {
        fn map(&mut self, _: u64, _: usize) -> Result<Backing, Error> {
            Err(Error::NotPermitted("no map"))
        }
        fn switch(&mut self, _: u64, _: u64) -> bool {
            true
        }
    }
    m.acquire(0, P, false, &mut Back).unwrap();
    assert_eq!(m.lent(last), Lent::Asleep, "the page the memory left sleeps behind the block on page 0");
    assert_eq!(m.lent(0), Lent::No);
}

/// A block needs a lent page whose memory serves a block elsewhere (a *dead* page): with a
/// mapper that remaps, the page is unmapped (its memory stays where it went) and mapped
/// afresh, and the block gets it; with one that does not, the acquisition fails and leaves
/// everything as it was.
#[test]
fn a_dead_lent_page_is_remapped_only_for_a_mapper_that_remaps() {
    struct Remap {
        remap: bool,
        unmapped: Vec<(u64, u64)>,
        mapped: Vec<u64>,
    }
    impl Mapper for Remap {
        fn map(&mut self, addr: u64, _: usize) -> Result<Backing, Error> {
            self.mapped.push(addr);
            Ok(Backing::Fresh)
        }
        fn remaps(&self) -> bool {
            self.remap
        }
        fn unmap_dead(&mut self, addr: u64, _: usize, freed: u64) -> Result<(), Error> {
            self.unmapped.push((addr, freed));
            Ok(())
        }
    }
    let m = PageMap::new(0, 2 * P, P).unwrap();
    m.acquire(0, P, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
    assert!(m.release(0, P));
    let mut lend = |a: u64, l: usize| match m.lend(a, l, &mut |_, _| true, &mut |_, _, _| Ok(())) {
        true => Ok(Backing::Lent),
        false => Err(Error::NotPermitted("nothing to lend")),
    };
    m.acquire(P, P, true, &mut lend).unwrap();
    assert_eq!(m.switch_source(0), None, "page 0's memory serves the block on page 1");

    let mut keep = Remap { remap: false, unmapped: vec![], mapped: vec![] };
    assert_eq!(m.acquire(0, P, true, &mut keep), Err(Acquire::Lent));
    assert!(keep.unmapped.is_empty() && keep.mapped.is_empty());
    assert_eq!((m.lent_pages(), m.mapped_bytes()), (1, P), "nothing changed");

    let mut remap = Remap { remap: true, unmapped: vec![], mapped: vec![] };
    m.acquire(0, P, true, &mut remap).unwrap();
    assert_eq!(remap.unmapped, [(0, 0)], "unmapped, no memory freed: it stays at page 1");
    assert_eq!(remap.mapped, [0], "then mapped afresh");
    assert_eq!(m.lent_pages(), 0);
    assert_eq!(m.mapped_bytes(), 2 * P, "two memories now, one a page");
    assert_eq!(m.walk_doubly_mapped(), vec![]);
    assert!(m.release(0, P) && m.release(P, P));
}
