//! Model tests of the arena and the page map against simple sequential references, and a
//! multithreaded stress of the arena with an ownership shadow.

use super::pages::Backing;
use super::pages::MAX_RUN;
use super::*;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::Error;
use proptest::prelude::*;

const BASE: u64 = 1 << 32;
const RANGE: u64 = 1 << 20;

fn rounded(bytes: u64) -> u64 {
    bytes.div_ceil(MIN_BLOCK) * MIN_BLOCK
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (1u64..=64 * 1024).prop_map(Op::Alloc),
        2 => (1u64..=2048).prop_map(Op::Alloc),
        1 => Just(Op::Alloc(0)),
        1 => (RANGE + 1..=4 * RANGE).prop_map(Op::Alloc),
        6 => any::<usize>().prop_map(Op::Free),
    ];
    prop::collection::vec(op, 1..300)
}

/// Every check the model can make of the arena at a quiet moment.
fn check_arena(a: &Arena, live: &[(u64, u64)]) -> Result<(), TestCaseError> {
    let live_bytes: u64 = live.iter().map(|&(_, b)| rounded(b)).sum();
    prop_assert_eq!(a.free_bytes(), RANGE - live_bytes);
    let mut free = vec![];
    a.for_each_free(|x, l| free.push((x, l)));
    free.sort_unstable();
    prop_assert_eq!(free.iter().map(|&(_, l)| l).sum::<u64>(), a.free_bytes());
    for w in free.windows(2) {
        prop_assert!(w[0].0 + w[0].1 <= w[1].0, "free pieces overlap: {:?}", w);
    }
    for &(x, l) in &free {
        prop_assert!(x >= BASE && x + l <= BASE + RANGE && (x - BASE) % l == 0);
        for &(y, b) in live {
            prop_assert!(x + l <= y || y + rounded(b) <= x, "free piece {:#x}+{} overlaps live {:#x}+{}", x, l, y, b);
        }
        // Coalescing: a free piece's buddy is never free too.
        if l < RANGE {
            let buddy = BASE + ((x - BASE) ^ l);
            prop_assert!(free.binary_search(&(buddy, l)).is_err(), "unmerged buddies at {:#x}/{}", x, l);
        }
    }
    let largest = free.iter().map(|&(_, l)| l).max().unwrap_or(0);
    prop_assert_eq!(a.largest_free(), largest);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn arena_matches_the_sequential_model(ops in ops()) {
        let a = Arena::new(BASE, RANGE).unwrap();
        let mut live: Vec<(u64, u64)> = vec![];
        for op in ops {
            match op {
                Op::Alloc(bytes) => match a.alloc(bytes) {
                    Some(x) => {
                        prop_assert!(bytes > 0 && bytes <= RANGE);
                        prop_assert_eq!(x % MIN_BLOCK, 0);
                        prop_assert!(x >= BASE && x + rounded(bytes) <= BASE + RANGE);
                        for &(y, b) in &live {
                            prop_assert!(x + rounded(bytes) <= y || y + rounded(b) <= x, "overlap");
                        }
                        live.push((x, bytes));
                    }
                    None => {
                        if bytes > 0 && bytes <= RANGE {
                            // Only if no free block of the needed order exists.
                            let need = rounded(bytes).next_power_of_two();
                            prop_assert!(a.largest_free() < need, "refused {} with {} free", bytes, a.largest_free());
                        }
                    }
                },
                Op::Free(i) => {
                    if !live.is_empty() {
                        let (x, b) = live.swap_remove(i % live.len());
                        prop_assert!(a.free(x, b));
                    }
                }
            }
            check_arena(&a, &live)?;
        }
        for (x, b) in live.drain(..) {
            prop_assert!(a.free(x, b));
        }
        check_arena(&a, &live)?;
        prop_assert!(a.is_whole());
    }
}

const PAGE: u64 = 4096;
const PAGES: u64 = 16;

#[derive(Debug, Clone)]
enum PageOp {
    Acquire(u64, u64, bool),
    Release(usize),
    Unmap(u64),
}

fn page_ops() -> impl Strategy<Value = Vec<PageOp>> {
    let op = prop_oneof![
        4 => (0..PAGES * PAGE, 1..4 * PAGE, prop::bool::weighted(0.8)).prop_map(|(a, l, m)| PageOp::Acquire(a, l, m)),
        3 => any::<usize>().prop_map(PageOp::Release),
        1 => (0..4u64).prop_map(|k| PageOp::Unmap(k * PAGE)),
    ];
    prop::collection::vec(op, 1..200)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn page_map_counts_match_the_model(ops in page_ops()) {
        let m = PageMap::new(0, PAGES * PAGE, PAGE).unwrap();
        let mut live: Vec<(u64, u64)> = vec![];
        let mut mapped = [false; PAGES as usize];
        // What each map call mapped: an unmap must name exactly one of these.
        let mut runs: Vec<(u64, u64)> = vec![];
        for op in ops {
            match op {
                PageOp::Acquire(addr, len, may_map) => {
                    let mut bad = false;
                    let r = m.acquire(addr, len, may_map, &mut |a, l| {
                        let l = l as u64;
                        bad |= l == 0 || l % PAGE != 0 || l > MAX_RUN as u64 * PAGE;
                        for p in a / PAGE..(a + l) / PAGE {
                            bad |= mapped[p as usize];
                            mapped[p as usize] = true;
                        }
                        runs.push((a, l));
                        Ok(Backing::Fresh)
                    });
                    prop_assert!(!bad, "mapped a page twice, or a run of a bad length");
                    let fits = addr + len <= PAGES * PAGE;
                    match r {
                        Ok(()) => { prop_assert!(fits); live.push((addr, len)); }
                        Err(Acquire::NeedsMap) => prop_assert!(!may_map),
                        Err(Acquire::Lent) => prop_assert!(false, "nothing is lent here"),
                        Err(Acquire::Failed(_)) => prop_assert!(!fits),
                    }
                }
                PageOp::Release(i) => {
                    if !live.is_empty() {
                        let (a, l) = live.swap_remove(i % live.len());
                        prop_assert!(m.release(a, l));
                    }
                }
                PageOp::Unmap(keep) => {
                    let mut bad = false;
                    m.unmap_free(keep, &mut |a, l, _| {
                        let l = l as u64;
                        match runs.iter().position(|&r| r == (a, l)) {
                            Some(i) => { runs.swap_remove(i); }
                            None => bad = true,
                        }
                        for p in a / PAGE..(a + l) / PAGE {
                            let pa = p * PAGE;
                            bad |= !mapped[p as usize] || live.iter().any(|&(x, n)| x < pa + PAGE && pa < x + n);
                            mapped[p as usize] = false;
                        }
                        Ok(())
                    });
                    prop_assert!(!bad, "unmapped a page in use, or not exactly one run");
                    // Past `keep`, every run still mapped has a live page.
                    if m.free_mapped_pages() * PAGE > keep {
                        for &(a, l) in &runs {
                            prop_assert!(live.iter().any(|&(x, n)| x < a + l && a < x + n), "a free run stayed mapped");
                        }
                    }
                }
            }
            let mut counts = [0u64; PAGES as usize];
            for &(x, l) in &live {
                for p in x / PAGE..=(x + l - 1) / PAGE {
                    counts[p as usize] += 1;
                }
            }
            let mut seen = [None; PAGES as usize];
            m.for_each_mapped(|a, c| seen[(a / PAGE) as usize] = Some(c));
            for p in 0..PAGES as usize {
                prop_assert_eq!(seen[p].is_some(), mapped[p]);
                prop_assert_eq!(seen[p].unwrap_or(0), counts[p]);
            }
            let free_mapped = (0..PAGES as usize).filter(|&p| mapped[p] && counts[p] == 0).count() as u64;
            prop_assert_eq!(m.free_mapped_pages(), free_mapped);
            prop_assert_eq!(m.mapped_bytes(), mapped.iter().filter(|&&x| x).count() as u64 * PAGE);
        }
        for (a, l) in live.drain(..) {
            prop_assert!(m.release(a, l));
        }
        m.unmap_free(0, &mut |_, _, _| Ok(()));
        prop_assert_eq!(m.mapped_bytes(), 0);
        let mut any = false;
        m.for_each_mapped(|_, _| any = true);
        prop_assert!(!any);
    }
}

/// xorshift64*: a tiny deterministic generator for the stress test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn four_threads_never_overlap_and_everything_coalesces() {
    const RANGE: u64 = 64 << 20;
    const OPS: usize = 20_000;
    let a = Arena::new(BASE, RANGE).unwrap();
    let shadow: Vec<AtomicU64> = (0..RANGE / MIN_BLOCK).map(|_| AtomicU64::new(0)).collect();
    std::thread::scope(|s| {
        for t in 1..=4u64 {
            let (a, shadow) = (&a, &shadow);
            s.spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ t);
                let mut mine: Vec<(u64, u64)> = vec![];
                for _ in 0..OPS {
                    if mine.len() < 48 && (mine.is_empty() || rng.next() % 2 == 0) {
                        // log-uniform-ish sizes, 1 B to 64 KiB
                        let bytes = 1 + rng.next() % (1 << (rng.next() % 17));
                        let x = a.alloc(bytes).expect("the arena is far from full");
                        let g = (x - BASE) / MIN_BLOCK;
                        for i in g..g + rounded(bytes) / MIN_BLOCK {
                            let prev = shadow[i as usize].compare_exchange(0, t, Ordering::AcqRel, Ordering::Acquire);
                            assert_eq!(prev, Ok(0), "granule {i} already owned");
                        }
                        mine.push((x, bytes));
                    } else {
                        let (x, bytes) = mine.swap_remove((rng.next() % mine.len() as u64) as usize);
                        let g = (x - BASE) / MIN_BLOCK;
                        for i in g..g + rounded(bytes) / MIN_BLOCK {
                            let prev = shadow[i as usize].compare_exchange(t, 0, Ordering::AcqRel, Ordering::Acquire);
                            assert_eq!(prev, Ok(t), "granule {i} lost its owner");
                        }
                        assert!(a.free(x, bytes));
                    }
                }
                for (x, bytes) in mine {
                    let g = (x - BASE) / MIN_BLOCK;
                    for i in g..g + rounded(bytes) / MIN_BLOCK {
                        shadow[i as usize].store(0, Ordering::Release);
                    }
                    assert!(a.free(x, bytes));
                }
            });
        }
    });
    assert_eq!(a.free_bytes(), RANGE);
    assert!(a.is_whole());
    assert_eq!(a.largest_free(), RANGE);
}

#[test]
fn four_threads_racing_to_exhaustion_get_exact_failures() {
    // Every thread allocates 256 B until refused; the refusals must come only when the arena
    // is truly full (the count of successes is exactly range / 256).
    const RANGE: u64 = 1 << 16;
    let a = Arena::new(0, RANGE).unwrap();
    let got = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                while a.alloc(256).is_some() {
                    got.fetch_add(1, Ordering::AcqRel);
                }
            });
        }
    });
    assert_eq!(got.load(Ordering::Acquire), RANGE / 256);
    assert_eq!(a.free_bytes(), 0);
}

#[test]
fn page_map_concurrent_acquire_maps_once() {
    let m = PageMap::new(0, 64 * PAGE, PAGE).unwrap();
    let maps = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for r in 0..2000u64 {
                    let addr = (r * 7 % 60) * PAGE;
                    let mut map = |_, _| -> Result<Backing, Error> {
                        maps.fetch_add(1, Ordering::AcqRel);
                        Ok(Backing::Fresh)
                    };
                    m.acquire(addr, 3 * PAGE, true, &mut map).unwrap();
                    assert!(m.release(addr, 3 * PAGE));
                    if r % 100 == 0 {
                        m.unmap_free(8 * PAGE, &mut |_, _, _| Ok(()));
                    }
                }
            });
        }
    });
    let mut live = 0;
    m.for_each_mapped(|_, c| live += c);
    assert_eq!(live, 0);
    assert_eq!(m.mapped_bytes(), m.free_mapped_pages() * PAGE);
    let mapped_now = m.mapped_bytes();
    assert_eq!(m.unmap_free(0, &mut |_, _, _| Ok(())), mapped_now);
    assert!(maps.load(Ordering::Acquire) >= 60);
}
