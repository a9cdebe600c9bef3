//! loom models of the stream depot (T1): magazine exchange between thread caches through one
//! depot, two takers racing for one full magazine, and two givers racing for the last slot.
//!
//! The depot's stack nodes are reclaimed through an explicit crossbeam-epoch `Collector` per
//! model. Each model checks at the end that every block is in exactly one place and that
//! `blocks()` and `full_count()` agree with what the depot holds.
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p loom_tests --release --test depot`
#![cfg(loom)]

use crossbeam_epoch::Collector;
use loom::sync::Arc;
use loom::thread;
use vrampool::cache::depot::Depot;
use vrampool::cache::magazine::{Magazine, MAG_CAP};

fn mag(blocks: &[u64]) -> Box<Magazine> {
    let mut m = Magazine::boxed();
    for &a in blocks {
        assert!(m.push(a, MAG_CAP));
    }
    m
}

/// Drain the (quiet) depot, check its counters against what it held, and return its blocks.
fn drain_checked(d: &Depot, collector: &Collector) -> Vec<u64> {
    let h = collector.register();
    let g = h.pin();
    let (count, blocks) = (d.full_count(), d.blocks());
    let mut visited = 0;
    d.for_each_block(|_| visited += 1, &g);
    assert_eq!(visited, blocks, "blocks() agrees with the magazines held");
    let mags = d.drain(&g);
    assert_eq!(mags.len(), count, "full_count() agrees with the magazines held");
    assert_eq!(mags.iter().map(|m| m.len()).sum::<usize>(), blocks);
    assert_eq!((d.full_count(), d.blocks()), (0, 0));
    mags.iter().flat_map(|m| m.blocks().to_vec()).collect()
}

fn assert_exactly_once(mut got: Vec<u64>, want: &[u64]) {
    got.sort_unstable();
    assert_eq!(got, want, "every block exactly once");
}

/// Thread A gives a full magazine {1,2} while thread B takes a full one (the depot already
/// holds {3,4}), drains it as a thread cache would, and gives the empty one back.
#[test]
fn a_full_magazine_given_while_another_is_taken_moves_whole() {
    loom::model(|| {
        let collector = Arc::new(Collector::new());
        let d = Arc::new(Depot::new(4));
        {
            let h = collector.register();
            d.put_full(mag(&[3, 4]), &h.pin()).unwrap();
        }
        let a = {
            let (d, c) = (d.clone(), collector.clone());
            thread::spawn(move || {
                let h = c.register();
                d.put_full(mag(&[1, 2]), &h.pin()).unwrap();
            })
        };
        let b = {
            let (d, c) = (d.clone(), collector.clone());
            thread::spawn(move || {
                let h = c.register();
                let g = h.pin();
                let mut m = d.take_full(&g).expect("{3,4} is always there to take");
                let mut got = vec![];
                m.drain(|x| got.push(x));
                d.put_empty(m, &g);
                got
            })
        };
        a.join().unwrap();
        let mut all = b.join().unwrap();
        assert_eq!(all.len(), 2, "a magazine moves whole");
        all.extend(drain_checked(&d, &collector));
        assert_exactly_once(all, &[1, 2, 3, 4]);
        let h = collector.register();
        let g = h.pin();
        assert!(d.take_empty(&g).unwrap().is_empty());
        assert!(d.take_empty(&g).is_none());
    });
}

/// Two threads race `take_full` on a depot holding one full magazine: exactly one gets it.
#[test]
fn two_takers_racing_for_one_magazine_exactly_one_gets_it() {
    loom::model(|| {
        let collector = Arc::new(Collector::new());
        let d = Arc::new(Depot::new(2));
        {
            let h = collector.register();
            d.put_full(mag(&[1, 2]), &h.pin()).unwrap();
        }
        let taker = |d: Arc<Depot>, c: Arc<Collector>| {
            move || {
                let h = c.register();
                let g = h.pin();
                d.take_full(&g).map(|m| m.blocks().to_vec())
            }
        };
        let t = thread::spawn(taker(d.clone(), collector.clone()));
        let mine = taker(d.clone(), collector.clone())();
        let theirs = t.join().unwrap();
        assert!(mine.is_some() != theirs.is_some(), "exactly one taker gets the magazine");
        let mut all: Vec<u64> = mine.into_iter().chain(theirs).flatten().collect();
        all.extend(drain_checked(&d, &collector));
        assert_exactly_once(all, &[1, 2]);
    });
}

/// Two threads race `put_full` with room for one: exactly one succeeds, the other gets its
/// magazine back intact.
#[test]
fn two_givers_racing_for_the_last_slot_exactly_one_succeeds() {
    loom::model(|| {
        let collector = Arc::new(Collector::new());
        let d = Arc::new(Depot::new(1));
        let giver = |d: Arc<Depot>, c: Arc<Collector>, blocks: [u64; 2]| {
            move || {
                let h = c.register();
                d.put_full(mag(&blocks), &h.pin()).map_err(|m| {
                    assert_eq!(m.blocks(), &blocks, "a refused magazine comes back intact");
                    m.blocks().to_vec()
                })
            }
        };
        let t = thread::spawn(giver(d.clone(), collector.clone(), [1, 2]));
        let mine = giver(d.clone(), collector.clone(), [3, 4])();
        let theirs = t.join().unwrap();
        assert!(mine.is_ok() != theirs.is_ok(), "exactly one giver succeeds");
        assert_eq!((d.full_count(), d.blocks()), (1, 2));
        let mut all: Vec<u64> = mine.err().into_iter().chain(theirs.err()).flatten().collect();
        all.extend(drain_checked(&d, &collector));
        assert_exactly_once(all, &[1, 2, 3, 4]);
    });
}
