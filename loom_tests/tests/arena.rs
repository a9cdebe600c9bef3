//! loom models of the arena's lock-free protocols: buddy coalescing, allocation racing a
//! merge, unrelated frees and releases, the page map's map-once and unmap handshakes, and its
//! free-page hints for loans, and the marks its scans for mapped pages pass groups by.
//!
//! Tiny configurations (a 1 KiB arena: four 256 B leaves, orders 8..=10; page maps of one or
//! two pages) and two threads, so each model runs in seconds at `LOOM_MAX_PREEMPTIONS=3`:
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p loom_tests --release --test arena`
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use vrampool::arena::pages::{Backing, Lent};
use vrampool::arena::{Acquire, Arena, PageMap};
use vrampool::Error;

const RANGE: u64 = 1024;
const PAGE: u64 = 4096;

fn free_blocks(a: &Arena) -> Vec<(u64, u64)> {
    let mut v = vec![];
    a.for_each_free(|x, l| v.push((x, l)));
    v.sort_unstable();
    v
}

/// Two threads free sibling buddies (0 and 256) while the other half of the range is already
/// free: whichever sets its bit second sees the first and merges, so the arena always ends
/// as one free block of the whole range.
#[test]
fn sibling_buddies_freed_concurrently_always_coalesce() {
    loom::model(|| {
        let a = Arc::new(Arena::new(0, RANGE).unwrap());
        let x: Vec<u64> = (0..4).map(|_| a.alloc(256).unwrap()).collect();
        assert_eq!(x, [0, 256, 512, 768]);
        assert!(a.free(512, 256) && a.free(768, 256));
        let a1 = a.clone();
        let t = thread::spawn(move || assert!(a1.free(0, 256)));
        assert!(a.free(256, 256));
        t.join().unwrap();
        assert_eq!(a.free_bytes(), RANGE);
        assert!(a.is_whole(), "not coalesced: {:?}", free_blocks(&a));
    });
}

/// One thread frees the last piece, which merges twice up to the whole range, while the other
/// allocates 256 B. The allocation must succeed (768 B are free throughout, some of it only
/// in flight), never overlap the live block, and leave exact accounting; freeing it then
/// coalesces everything.
#[test]
fn alloc_racing_the_coalescing_of_its_parent() {
    loom::model(|| {
        let a = Arc::new(Arena::new(0, RANGE).unwrap());
        for _ in 0..4 {
            a.alloc(256).unwrap();
        }
        assert!(a.free(256, 256) && a.free(512, 256) && a.free(768, 256));
        let a1 = a.clone();
        let t = thread::spawn(move || assert!(a1.free(0, 256)));
        let got = a.alloc(256).expect("768 B were free all along");
        t.join().unwrap();
        assert_eq!(got % 256, 0);
        assert!(got < RANGE);
        assert_eq!(a.free_bytes(), RANGE - 256);
        let free = free_blocks(&a);
        assert_eq!(free.iter().map(|&(_, l)| l).sum::<u64>(), RANGE - 256);
        for &(x, l) in &free {
            assert!(x + l <= got || got + 256 <= x, "free {x}+{l} overlaps live {got}");
        }
        assert!(a.free(got, 256));
        assert!(a.is_whole(), "not coalesced: {:?}", free_blocks(&a));
    });
}

/// An exact-size allocation (768 B: a 1 KiB block whose 256 B tail goes back) racing a free
/// that completes the whole range: it must find the range once the merge is done.
#[test]
fn exact_size_alloc_racing_a_merge_waits_for_it() {
    loom::model(|| {
        let a = Arc::new(Arena::new(0, RANGE).unwrap());
        let x = a.alloc(512).unwrap();
        let y = a.alloc(512).unwrap();
        assert!(a.free(y, 512));
        let a1 = a.clone();
        let t = thread::spawn(move || assert!(a1.free(x, 512)));
        // Until the free's merge is visible, the largest block is 512: alloc may only fail if
        // it saw the arena before the free began, never during the merge.
        let got = a.alloc(768);
        t.join().unwrap();
        match got {
            Some(z) => {
                assert_eq!(z, 0);
                assert_eq!(a.free_bytes(), 256);
                assert_eq!(free_blocks(&a), [(768, 256)]);
                assert!(a.free(z, 768));
            }
            None => assert_eq!(a.free_bytes(), RANGE),
        }
        assert!(a.is_whole());
    });
}

/// An exact-size allocation (768 B) races a 256 B one on a wholly free 1 KiB arena. The small
/// one must always succeed: if the big one took the range first, its 256 B tail is in flight
/// back to the arena, and the failure check waits for it instead of answering `None`.
#[test]
fn alloc_racing_an_exact_size_tail_return_never_fails_spuriously() {
    loom::model(|| {
        let a = Arc::new(Arena::new(0, RANGE).unwrap());
        let a1 = a.clone();
        let t = thread::spawn(move || a1.alloc(768));
        let small = a.alloc(256).expect("256 B are always free or in flight back");
        let big = t.join().unwrap();
        match big {
            Some(b) => {
                assert_eq!((b, small), (0, 768));
                assert_eq!(a.free_bytes(), 0);
                assert!(a.free(b, 768));
            }
            None => assert_eq!((small, a.free_bytes()), (0, RANGE - 256)),
        }
        assert!(a.free(small, 256));
        assert!(a.is_whole());
    });
}

/// Frees of unrelated blocks (0 and [512, 1024), with 256 live between them) race: both land,
/// neither merges, and the accounting is exact.
#[test]
fn frees_of_unrelated_blocks_race_without_damage() {
    loom::model(|| {
        let a = Arc::new(Arena::new(0, RANGE).unwrap());
        assert_eq!(a.alloc(256), Some(0));
        assert_eq!(a.alloc(256), Some(256));
        assert_eq!(a.alloc(512), Some(512));
        let a1 = a.clone();
        let t = thread::spawn(move || assert!(a1.free(0, 256)));
        assert!(a.free(512, 512));
        t.join().unwrap();
        assert_eq!(free_blocks(&a), [(0, 256), (512, 512)]);
        assert_eq!(a.free_bytes(), RANGE - 256);
        assert!(a.free(256, 256));
        assert!(a.is_whole());
    });
}

/// A stand-in for the device: one "backed" flag per page; mapping a backed page or unmapping
/// an unbacked one is a bug the model catches.
struct Device {
    backed: [AtomicBool; 2],
    maps: AtomicUsize,
    unmaps: AtomicUsize,
}

impl Device {
    fn new() -> Device {
        Device {
            backed: [AtomicBool::new(false), AtomicBool::new(false)],
            maps: AtomicUsize::new(0),
            unmaps: AtomicUsize::new(0),
        }
    }
    fn map(&self, addr: u64) -> Result<(), Error> {
        assert!(!self.backed[(addr / PAGE) as usize].swap(true, Ordering::AcqRel), "page mapped twice");
        self.maps.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
    fn unmap(&self, addr: u64) -> Result<(), Error> {
        assert!(self.backed[(addr / PAGE) as usize].swap(false, Ordering::AcqRel), "unmapped an unmapped page");
        self.unmaps.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
    fn is_backed(&self, addr: u64) -> bool {
        self.backed[(addr / PAGE) as usize].load(Ordering::Acquire)
    }
}

fn counts(m: &PageMap) -> Vec<(u64, u64)> {
    let mut v = vec![];
    m.for_each_mapped(|a, c| v.push((a, c)));
    v
}

/// Two threads acquire blocks on the same unmapped page: the page is mapped exactly once,
/// both find it backed when they return, and it ends with count 2.
#[test]
fn racing_acquires_map_a_page_once() {
    loom::model(|| {
        let m = Arc::new(PageMap::new(0, PAGE, PAGE).unwrap());
        let d = Arc::new(Device::new());
        let (m1, d1) = (m.clone(), d.clone());
        let t = thread::spawn(move || {
            m1.acquire(0, 256, true, &mut |a, _| d1.map(a).map(|()| Backing::Fresh)).unwrap();
            assert!(d1.is_backed(0));
        });
        m.acquire(256, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        assert!(d.is_backed(0));
        t.join().unwrap();
        assert_eq!(d.maps.load(Ordering::Acquire), 1);
        assert_eq!(counts(&m), [(0, 2)]);
        assert_eq!(m.mapped_bytes(), PAGE);
    });
}

/// A page mapped in a group of pages never mapped before, while another thread scans for
/// mapped pages: the scan passes a group whose mark it does not see, so the mark is made
/// before the map call returns, and a scan that follows the map (through a flag) finds the
/// page; one racing it finds the page or nothing. Fails with the groups' marks left out.
#[test]
fn a_scan_after_a_map_finds_its_page_in_a_group_never_mapped_before() {
    loom::model(|| {
        // Page 64 is the first of the second group of 64 pages.
        let m = Arc::new(PageMap::new(0, 65 * PAGE, PAGE).unwrap());
        let done = Arc::new(AtomicBool::new(false));
        let (m1, done1) = (m.clone(), done.clone());
        let t = thread::spawn(move || {
            m1.acquire(64 * PAGE, 256, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
            done1.store(true, Ordering::Release);
        });
        let after = done.load(Ordering::Acquire);
        let found = m.next_mapped(0);
        if after {
            assert_eq!(found, Some(64 * PAGE), "a scan after the map missed its page");
        } else {
            assert!(found.is_none() || found == Some(64 * PAGE));
        }
        t.join().unwrap();
        assert_eq!(m.next_mapped(0), Some(64 * PAGE));
    });
}

/// An acquire of a free-but-mapped page races `unmap_free(0)`: either the unmap comes first
/// and the acquire maps the page again, or the acquire's reference stops the unmap. The page
/// is never unmapped under the block, and the books match the device.
#[test]
fn acquire_racing_unmap_free_never_loses_the_page() {
    loom::model(|| {
        let m = Arc::new(PageMap::new(0, PAGE, PAGE).unwrap());
        let d = Arc::new(Device::new());
        m.acquire(0, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        assert!(m.release(0, 256));
        let (m1, d1) = (m.clone(), d.clone());
        let t = thread::spawn(move || {
            m1.unmap_free(0, &mut |a, _, _| d1.unmap(a));
        });
        m.acquire(0, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        assert!(d.is_backed(0), "acquire returned on an unbacked page");
        t.join().unwrap();
        assert!(d.is_backed(0));
        assert_eq!(d.maps.load(Ordering::Acquire) - d.unmaps.load(Ordering::Acquire), 1);
        assert_eq!(counts(&m), [(0, 1)]);
        assert_eq!(m.mapped_bytes(), PAGE);
        assert_eq!(m.free_mapped_pages(), 0);
    });
}

/// Releases of two blocks on the same page race, and an acquire that may not map fails
/// cleanly on an unmapped page: counts end at zero and the page is free but mapped.
#[test]
fn releases_race_and_needs_map_rolls_back() {
    loom::model(|| {
        let m = Arc::new(PageMap::new(0, 2 * PAGE, PAGE).unwrap());
        let d = Arc::new(Device::new());
        m.acquire(0, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        m.acquire(512, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        let m1 = m.clone();
        let t = thread::spawn(move || {
            assert!(m1.release(0, 256));
            // Spans page 0 (mapped) and page 1 (not): refused, page 0 left as it was.
            assert_eq!(m1.acquire(PAGE - 256, 512, false, &mut |_, _| Ok(Backing::Fresh)), Err(Acquire::NeedsMap));
        });
        assert!(m.release(512, 256));
        t.join().unwrap();
        assert_eq!(counts(&m), [(0, 0)]);
        assert_eq!(m.free_mapped_pages(), 1);
        assert_eq!(m.unmap_free(0, &mut |a, _, _| d.unmap(a)), PAGE);
        assert_eq!(m.mapped_bytes(), 0);
    });
}

/// The pages a lender is offered: a lend towards `target` whose judge refuses every page,
/// so it only walks the free-page hints (cleaning stale ones) and changes nothing else.
fn offered(m: &PageMap, target: u64) -> Vec<u64> {
    let mut seen = vec![];
    let lent = m.lend(
        target,
        PAGE as usize,
        &mut |from, _| {
            seen.push(from);
            false
        },
        &mut |_, _, _| Ok(()),
    );
    assert!(!lent, "the judge refused every page");
    seen
}

/// A page is freed while a lender walks the free-page hints and finds that page's hint stale
/// (it was freed once, then taken again): the lender drops the hint, then looks at the page
/// again. Whatever the interleaving, the free page keeps a hint, so the next loan is offered
/// it. (Without the second look, the lender's clear can land after the free's set and the
/// page is lost to loans.)
#[test]
fn a_page_freed_while_a_lender_drops_its_stale_hint_stays_offered() {
    loom::model(|| {
        let m = Arc::new(PageMap::new(0, 2 * PAGE, PAGE).unwrap());
        let d = Arc::new(Device::new());
        m.acquire(0, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        assert!(m.release(0, 256));
        // Taken again: its hint is now stale.
        m.acquire(0, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        // Page 1 is free too, so that the lender looks at all (it never lends a page to
        // itself: page 1 is the target).
        m.acquire(PAGE, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
        assert!(m.release(PAGE, 256));
        let m1 = m.clone();
        let t = thread::spawn(move || {
            assert!(m1.release(0, 256));
        });
        offered(&m, PAGE);
        t.join().unwrap();
        assert_eq!(m.free_mapped_pages(), 2);
        assert_eq!(offered(&m, PAGE), [0], "the free page lost its hint");
    });
}

/// Two lenders walk the free-page hints at once and both refuse what they are offered: one
/// may hold the page (to judge it) while the other meets it held, takes its hint for stale
/// and drops it. The holder gives the page back free and sets the hint again, so the page
/// is offered to the next loan whatever the interleaving.
#[test]
fn a_page_a_lender_gives_back_stays_offered() {
    loom::model(|| {
        let m = Arc::new(PageMap::new(0, 2 * PAGE, PAGE).unwrap());
        let d = Arc::new(Device::new());
        for page in [0, PAGE] {
            m.acquire(page, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
            assert!(m.release(page, 256));
        }
        let m1 = m.clone();
        let t = thread::spawn(move || {
            offered(&m1, PAGE);
        });
        offered(&m, PAGE);
        t.join().unwrap();
        assert_eq!(offered(&m, PAGE), [0], "the page given back lost its hint");
    });
}

/// Map page 0, free it, and lend its memory to a block on page 1: page 0 is lent, asleep
/// (dead) behind that block.
fn lend_page_0_to_a_block_on_page_1(m: &PageMap, d: &Device) {
    m.acquire(0, 256, true, &mut |a, _| d.map(a).map(|()| Backing::Fresh)).unwrap();
    assert!(m.release(0, 256));
    let mut lend = |a, l| match m.lend(a, l, &mut |_, _| true, &mut |_, _, _| Ok(())) {
        true => Ok(Backing::Lent),
        false => Err(Error::NotPermitted("nothing to lend")),
    };
    m.acquire(PAGE, 256, true, &mut lend).unwrap();
    assert_eq!(m.lent(0), Lent::Asleep);
}

/// A lent page is judged (its memory's page found busy, so it is put to sleep) while that
/// page falls free and wakes it: the judgement clears the awake bit, then judges again. Whatever
/// the interleaving, the lent page is left awake, so a placement can still take its memory
/// back. (Without the second judgement, the clear can land after the wake's set and the page
/// sleeps with its memory free: never switched back.)
#[test]
fn a_lent_page_woken_while_a_judgement_puts_it_to_sleep_stays_awake() {
    loom::model(|| {
        let m = Arc::new(PageMap::new(0, 2 * PAGE, PAGE).unwrap());
        let d = Arc::new(Device::new());
        lend_page_0_to_a_block_on_page_1(&m, &d);
        // Freed (page 0 wakes), then taken again: page 0 is awake with its memory busy.
        assert!(m.release(PAGE, 256));
        m.acquire(PAGE, 256, false, &mut |_, _| Err(Error::NotPermitted("mapped already"))).unwrap();
        assert_eq!(m.lent(0), Lent::Awake);
        let m1 = m.clone();
        let t = thread::spawn(move || {
            assert!(m1.release(PAGE, 256));
        });
        let judged = m.switch_source(0);
        t.join().unwrap();
        assert!(judged.is_none() || judged == Some(PAGE));
        assert_eq!(m.walk_asleep_switchable(), Vec::<u64>::new(), "a lent page sleeps with its memory free");
        assert_eq!(m.switch_source(0), Some(PAGE));
    });
}

/// A placement's mapper for the model of dead lent pages: maps fresh memory, takes memory
/// back where the page map offers it, and unmaps a dead lent page only if `remap`.
struct Remapper<'a> {
    d: &'a Device,
    remap: bool,
}

impl vrampool::arena::pages::Mapper for Remapper<'_> {
    fn map(&mut self, addr: u64, _: usize) -> Result<Backing, Error> {
        self.d.map(addr).map(|()| Backing::Fresh)
    }
    fn switch(&mut self, _: u64, _: u64) -> bool {
        true
    }
    fn remaps(&self) -> bool {
        self.remap
    }
    fn unmap_dead(&mut self, addr: u64, _: usize, freed: u64) -> Result<(), Error> {
        assert!(self.remap, "asked to unmap by a mapper that does not remap");
        assert_eq!(freed, 0, "a lent page's memory is shown at its active page too");
        self.d.unmap(addr)
    }
}

/// A block lands on a lent page whose memory is busy (a *dead* page, which the cheapest run
/// of a placement that may map takes): the page is unmapped there and mapped afresh, while
/// another thread frees the memory's page and places a block on the lent page too, taking
/// the memory back. Whatever the interleaving, only one of them wins the page: a block is
/// never left on an unmapped page, no memory ends up active at two pages, and the device's
/// maps and unmaps match the books. (With the page unmapped without the page map's claim,
/// both threads take the page, and the model fails.)
#[test]
fn a_dead_lent_page_remapped_while_its_memory_comes_back_stays_backed() {
    loom::model(|| {
        let m = Arc::new(PageMap::new(0, 2 * PAGE, PAGE).unwrap());
        let d = Arc::new(Device::new());
        lend_page_0_to_a_block_on_page_1(&m, &d);
        let (m1, d1) = (m.clone(), d.clone());
        let t = thread::spawn(move || {
            assert!(m1.release(PAGE, 256));
            // Another block on page 0: its memory comes back if page 1 is free by then.
            m1.acquire(512, 256, false, &mut Remapper { d: &d1, remap: false }).is_ok()
        });
        m.acquire(0, 256, true, &mut Remapper { d: &d, remap: true }).unwrap();
        assert!(d.is_backed(0), "a block on an unmapped page");
        let other = t.join().unwrap();
        assert!(d.is_backed(0));
        assert_eq!(counts(&m).into_iter().find(|&(a, _)| a == 0), Some((0, 1 + u64::from(other))));
        assert_eq!(m.walk_doubly_mapped(), vec![], "memory active at two pages");
        // The memory page 0 lent stays at page 1; a remap added fresh memory at page 0.
        let remapped = d.unmaps.load(Ordering::Acquire) as u64;
        assert_eq!(d.maps.load(Ordering::Acquire) as u64, 1 + remapped);
        assert_eq!(m.mapped_bytes(), (1 + remapped) * PAGE, "the books and the device disagree");
    });
}

/// A search cleaning stale hints races a setter under those hints (a two-level bitmap: a root
/// over two leaf nodes). The clear-then-recheck of the hint must never lose the new bit: a
/// search afterwards still finds it through the hints.
#[test]
fn hint_cleaning_racing_a_set_loses_no_bit() {
    use vrampool::arena::HBitmap;
    loom::model(|| {
        let b = Arc::new(HBitmap::new(4097));
        b.set(0);
        assert!(b.try_clear(0)); // stale hints over bit 0 in the root and the leaf node
        let b1 = b.clone();
        let t = thread::spawn(move || {
            b1.set(5);
        });
        let seen = b.find_first_set();
        assert!(seen.is_none() || seen == Some(5));
        t.join().unwrap();
        assert_eq!(b.find_first_set(), Some(5));
    });
}
