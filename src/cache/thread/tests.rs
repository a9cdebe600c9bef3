//! The thread cache against hand-made cases: its hit and slow paths, the trades with the
//! depot, the byte bound, a thief's take, and the hot entries after every change.

use super::*;
use crate::sync::epoch;

const SIZE: u64 = 256;

fn pin() -> Guard {
    epoch::pin()
}

/// The fast path, then the slow one, as a thread cache runs them.
unsafe fn push(c: &CacheShared, slot: Slot, addr: u64, limit: u64, d: &Depot) -> Spill {
    // SAFETY: the caller has entered.
    if unsafe { c.push(slot, addr, limit) } {
        return Spill::None;
    }
    // SAFETY: as above.
    unsafe { c.push_slow(slot, addr, limit, d, pin) }
}

unsafe fn pop(c: &CacheShared, class: usize, size: u64, d: &Depot) -> Option<u64> {
    let slot = Slot { class, size, cap: 8 };
    // SAFETY: the caller has entered.
    unsafe { c.pop(class, size).or_else(|| c.pop_slow(slot, d, pin)) }
}

#[test]
fn a_freed_block_is_the_next_one_allocated() {
    let c = CacheShared::new(4);
    let d = Depot::new(4);
    assert!(c.enter());
    // SAFETY: entered.
    unsafe {
        assert_eq!(push(&c, Slot { class: 1, size: SIZE, cap: 8 }, 0x1000, u64::MAX, &d), Spill::None);
        assert_eq!(pop(&c, 1, SIZE, &d), Some(0x1000));
        assert_eq!(pop(&c, 1, SIZE, &d), None, "empty, and the depot too");
    }
    c.exit();
    assert_eq!(c.counters.t0_hits.load(Ordering::Relaxed), 1);
    assert_eq!(c.counters.cached_bytes.load(Ordering::Relaxed), 0);
}

#[test]
fn a_slow_pop_that_finds_nothing_hands_out_nothing_twice() {
    let c = CacheShared::new(1);
    let d = Depot::new(1);
    let slot = Slot { class: 0, size: SIZE, cap: 8 };
    assert!(c.enter());
    // SAFETY: entered.
    unsafe {
        // The slow path makes the class's magazines; the hit path then takes the block,
        // which leaves the loaded magazine's own count stale (the hot entry's is 0).
        assert_eq!(c.push_slow(slot, 0x100, u64::MAX, &d, pin), Spill::None);
        assert_eq!(c.pop(0, SIZE), Some(0x100));
        assert_eq!(c.pop_slow(slot, &d, pin), None, "nothing in the previous magazine or the depot");
        assert_eq!(c.pop(0, SIZE), None, "the block already handed out is not handed out again");
    }
    c.exit();
    assert_eq!(c.counters.cached_bytes.load(Ordering::Relaxed), 0);
}

#[test]
fn overflow_goes_to_the_depot_whole_and_comes_back_whole() {
    let c = CacheShared::new(1);
    let d = Depot::new(4);
    assert!(c.enter());
    // SAFETY: entered.
    unsafe {
        for a in 0..5u64 {
            assert_eq!(push(&c, Slot { class: 0, size: SIZE, cap: 2 }, a * 256, u64::MAX, &d), Spill::None);
        }
    }
    c.exit();
    assert_eq!(d.full_count(), 1, "one full magazine of 2 went to the depot");
    assert_eq!(c.counters.cached_bytes.load(Ordering::Relaxed), 3 * SIZE);
    let other = CacheShared::new(1);
    assert!(other.enter());
    // SAFETY: entered.
    unsafe {
        let got: Vec<_> = (0..2).map(|_| pop(&other, 0, SIZE, &d).unwrap()).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(other.counters.t1_hits.load(Ordering::Relaxed), 1);
    }
    other.exit();
}

#[test]
fn a_cache_over_its_byte_bound_hands_frees_back() {
    let c = CacheShared::new(1);
    let d = Depot::new(1);
    assert!(c.enter());
    // SAFETY: entered.
    unsafe {
        assert_eq!(push(&c, Slot { class: 0, size: SIZE, cap: 8 }, 0, SIZE, &d), Spill::None);
        assert_eq!(push(&c, Slot { class: 0, size: SIZE, cap: 8 }, 256, SIZE, &d), Spill::Retire(vec![256]));
    }
    c.exit();
}

#[test]
fn a_waiting_reader_gets_a_busy_cache_once_its_operation_ends_and_holds_off_the_next() {
    use std::sync::mpsc::channel;
    let c = std::sync::Arc::new(CacheShared::new(1));
    let d = Depot::new(1);
    assert!(c.enter());
    // SAFETY: entered.
    unsafe { push(&c, Slot { class: 0, size: SIZE, cap: 8 }, 0x100, u64::MAX, &d) };
    let (waiting_tx, waiting) = channel();
    let (reading_tx, reading) = channel();
    let (release, release_rx) = channel::<()>();
    let reader = {
        let c = c.clone();
        std::thread::spawn(move || {
            let mut seen = vec![];
            let mut told = false;
            let got = c.steal_waiting(
                |c| {
                    // SAFETY: steal_waiting holds the handshake while this runs.
                    unsafe { c.for_each_block(|_, a| seen.push(a)) };
                    reading_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                },
                || {
                    if !told {
                        told = true;
                        waiting_tx.send(()).unwrap();
                    }
                    true
                },
            );
            (got, seen)
        })
    };
    waiting.recv().unwrap();
    // The reader has seen the owner inside and waits, its flag up: the owner leaves.
    c.exit();
    reading.recv().unwrap();
    assert!(!c.enter(), "the owner's next operation waits while the reader holds the magazines");
    release.send(()).unwrap();
    assert_eq!(reader.join().unwrap(), (true, vec![0x100]));
    assert!(c.enter(), "the owner gets back in once the reader is done");
    c.exit();
}

#[test]
fn an_impatient_reader_leaves_a_busy_cache_as_it_found_it() {
    let c = std::sync::Arc::new(CacheShared::new(1));
    assert!(c.enter());
    let reader = {
        let c = c.clone();
        std::thread::spawn(move || c.steal_waiting(|_| panic!("read while the owner is inside"), || false))
    };
    assert!(!reader.join().unwrap());
    c.exit();
    assert!(c.enter(), "the reader's flag came down when it gave up");
    c.exit();
}

#[test]
fn a_thief_takes_an_idle_cache_but_not_a_busy_one() {
    let c = CacheShared::new(1);
    let d = Depot::new(1);
    assert!(c.enter());
    // SAFETY: entered.
    unsafe { push(&c, Slot { class: 0, size: SIZE, cap: 8 }, 0x100, u64::MAX, &d) };
    assert!(!c.try_steal(|_| {}), "the owner is inside an operation");
    c.exit();
    let mut taken = vec![];
    let g = pin();
    // SAFETY: try_steal holds the handshake while the closure runs.
    assert!(c.try_steal(|c| unsafe { c.drain(&[], false, |_, a| taken.push(a), &g) }));
    assert_eq!(taken, vec![0x100]);
    assert_eq!(c.counters.cached_bytes.load(Ordering::Relaxed), 0);
    assert!(c.enter(), "the owner gets back in once the thief is done");
    c.exit();
}

#[test]
fn only_a_thief_on_another_thread_interrupts_every_core_to_take_a_cache() {
    let fences = || crate::sync::HEAVY_FENCES.with(|n| n.get());
    let c = std::sync::Arc::new(CacheShared::new(1));
    let before = fences();
    // SAFETY: this thread made the cache and is the only one to enter it.
    assert!(unsafe { c.take_own_or_steal(|_| {}) }, "the owner takes its own idle cache");
    assert_eq!(fences(), before, "the owner is ordered with itself: no barrier");
    assert!(c.enter());
    // SAFETY: as above.
    assert!(!unsafe { c.take_own_or_steal(|_| {}) }, "not from inside its own operation");
    c.exit();
    let thief = std::sync::Arc::clone(&c);
    let fenced = std::thread::spawn(move || {
        let before = fences();
        // SAFETY: the cache's maker (the test's thread) is the only one to enter it.
        assert!(unsafe { thief.take_own_or_steal(|_| {}) }, "the owner is between operations");
        fences() - before
    });
    assert_eq!(fenced.join().unwrap(), 1, "another thread must fence the owner's flag");
}

/// A cache of `classes` classes holding one block of each `(class, addr)`, the block of
/// class `c` being `SIZE << c` bytes, and with `within` as every class's reach.
fn holding(classes: usize, within: usize, blocks: &[(usize, u64)]) -> CacheShared {
    let (c, d) = (CacheShared::new(classes), Depot::new(4));
    assert!(c.enter());
    // SAFETY: entered.
    unsafe {
        c.set_reach(|_| within);
        for &(class, addr) in blocks {
            let slot = Slot { class, size: SIZE << class, cap: 8 };
            assert_eq!(push(&c, slot, addr, u64::MAX, &d), Spill::None);
        }
    }
    c.exit();
    c
}

fn entries_agree(c: &CacheShared) {
    // SAFETY: no other thread has the cache.
    assert_eq!(unsafe { c.check_hot_entries() }, Ok(()));
}

#[test]
fn the_hit_path_takes_its_own_class_first_then_the_smallest_larger_one_within_reach() {
    let c = holding(6, 2, &[(1, 0x1000), (3, 0x3000), (4, 0x4000)]);
    let hit = |class, addr| Some(Hit { addr, class, size: SIZE << class });
    entries_agree(&c);
    assert_eq!(c.try_pop_fast(1, SIZE << 1), hit(1, 0x1000), "its own class first");
    entries_agree(&c);
    assert_eq!(c.try_pop_fast(1, SIZE << 1), hit(3, 0x3000), "then the smallest larger class that holds a block");
    entries_agree(&c);
    assert_eq!(c.try_pop_fast(1, SIZE << 1), None, "class 4 is three classes up: out of reach");
    assert_eq!(c.try_pop_fast(2, SIZE << 2), hit(4, 0x4000));
    entries_agree(&c);
    assert_eq!(c.try_pop_fast(0, SIZE), None, "nothing is left");
    assert_eq!(c.counters.t0_hits.load(Ordering::Relaxed), 3);
    assert_eq!(c.counters.cached_bytes.load(Ordering::Relaxed), 0, "each block counted at its own class's size");
}

#[test]
fn the_slow_path_borrows_from_a_previous_magazine_the_hit_path_cannot_see() {
    // Nine blocks of class 3 with magazines of 8: the first eight end up in the
    // previous magazine, the ninth in the loaded one, which the hit path then empties.
    let blocks: Vec<(usize, u64)> = (0..9).map(|i| (3, 0x3000 + i)).collect();
    let c = holding(6, 2, &blocks);
    assert_eq!(c.try_pop_fast(3, SIZE << 3).map(|h| h.addr), Some(0x3008));
    assert_eq!(c.try_pop_fast(1, SIZE << 1), None, "no loaded magazine within reach holds a block");
    assert!(c.enter());
    // SAFETY: entered.
    let got = unsafe { c.pop_larger(1) };
    c.exit();
    assert_eq!(got, Some(Hit { addr: 0x3007, class: 3, size: SIZE << 3 }), "class 3's previous magazine");
    entries_agree(&c);
    assert_eq!(c.counters.cached_bytes.load(Ordering::Relaxed), 7 * (SIZE << 3));
}

#[test]
fn without_a_reach_and_past_the_classes_the_hit_path_takes_nothing_else() {
    let c = holding(4, 0, &[(2, 0x2000)]);
    assert_eq!(c.try_pop_fast(1, SIZE << 1), None, "a reach of 0 is the class alone");
    for class in [4, 200, 255, 256, usize::MAX] {
        assert_eq!(c.try_pop_fast(class, SIZE), None, "class {class} is not one of the cache's");
    }
    let fresh = CacheShared::new(4);
    assert_eq!(fresh.try_pop_fast(0, SIZE), None);
    entries_agree(&c);
    entries_agree(&fresh);
}

#[test]
fn the_hot_entries_follow_every_magazine_change() {
    // Classes at both ends of a bit word and across it, cap 8: fills, overflows into
    // the previous magazine and the depot, then empties through every path.
    let d = Depot::new(4);
    let c = holding(130, 3, &[]);
    for class in [0, 62, 63, 64, 65, 127, 128, 129] {
        let slot = Slot { class, size: SIZE, cap: 8 };
        assert!(c.enter());
        for i in 0..20 {
            // SAFETY: entered.
            assert_eq!(unsafe { push(&c, slot, (class as u64) << 20 | i, u64::MAX, &d) }, Spill::None);
        }
        c.exit();
        entries_agree(&c);
        let mut got = 0;
        while c.try_pop_fast(class, SIZE).is_some() {
            got += 1;
            entries_agree(&c);
        }
        assert!(c.enter());
        // SAFETY: entered.
        while unsafe { pop(&c, class, SIZE, &d) }.is_some() {
            got += 1;
        }
        c.exit();
        entries_agree(&c);
        assert_eq!(got, 20, "class {class}: every block came back once");
    }
}
