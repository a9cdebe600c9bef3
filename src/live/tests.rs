//! The table's protocol on one thread at a time, and under real threads (the loom models
//! in `loom_tests/tests/live.rs` check the interleavings).

use super::*;

const BASE: u64 = 1 << 40;

fn table() -> Table {
    Table::new(BASE, 1 << 30).unwrap()
}

fn words(info: u64) -> Words {
    Words { info, size: info * 256, ext: false }
}

#[test]
fn only_block_starts_have_slots() {
    let t = table();
    assert_eq!(t.index(BASE), Some(0));
    assert_eq!(t.index(BASE + 512), Some(2));
    assert_eq!(t.address(2), BASE + 512);
    for bad in [0, BASE - 256, BASE + 1, BASE + 255, BASE + (1 << 30), u64::MAX] {
        assert_eq!(t.index(bad), None, "{bad:#x}");
    }
}

#[test]
fn the_owner_frees_what_it_published_once() {
    let t = table();
    let owners = Owners::new(4, true);
    let me = owners.acquire().unwrap();
    t.publish(3, me, words(7));
    assert_eq!(t.owner(3), Ok(me));
    // Wrong info word: nothing changes.
    assert_eq!(t.free_owned(3, owners.get(me), me, 8), None);
    assert_eq!(t.free_owned(3, owners.get(me), me, 7), Some(7 * 256));
    assert_eq!(t.free_owned(3, owners.get(me), me, 7), None);
    assert_eq!(t.free_owned_with(3, owners.get(me), me, |_| true), Err(Refusal::NotLive { ever: true }));
    assert_eq!(t.free_owned_with(4, owners.get(me), me, |_| true), Err(Refusal::NotLive { ever: false }));
    assert!(owners.get(me).announced().is_none());
}

#[test]
fn a_slot_reused_gets_a_new_generation() {
    let t = table();
    let owners = Owners::new(4, true);
    let a = t.claim_after_publish(0, words(1));
    t.release(&a);
    let b = t.claim_after_publish(0, words(1));
    assert_ne!(a, b, "the same tag twice at one slot");
    assert_eq!(t.settle(&b, &owners), Settled::Won);
    // A stale claim cannot settle against the new generation.
    assert_eq!(t.settle(&a, &owners), Settled::Lost);
}

impl Table {
    fn claim_after_publish(&self, idx: usize, w: Words) -> Claim {
        self.publish(idx, 0, w);
        self.claim(idx, |_| true).unwrap()
    }
}

#[test]
fn a_claim_refuses_what_is_not_live_or_does_not_match() {
    let t = table();
    let owners = Owners::new(4, true);
    assert_eq!(t.claim(0, |_| true), Err(Refusal::NotLive { ever: false }));
    t.publish(0, 1, words(5));
    assert_eq!(t.claim(0, |w| w.info == 6), Err(Refusal::Mismatch));
    let c = t.claim(0, |w| w.info == 5).unwrap();
    assert_eq!(c.words, words(5));
    assert_eq!(t.claim(0, |_| true), Err(Refusal::Claimed));
    // The owner's own free now refuses: the block is being freed elsewhere.
    assert_eq!(t.free_owned(0, owners.get(1), 1, 5), None);
    assert_eq!(t.free_owned_with(0, owners.get(1), 1, |_| true), Err(Refusal::Claimed));
    assert!(claimers_fence(&owners));
    assert_eq!(t.settle(&c, &owners), Settled::Won);
    t.release(&c);
    assert_eq!(t.claim(0, |_| true), Err(Refusal::NotLive { ever: true }));
}

#[test]
fn a_claim_waits_while_the_owner_announces_the_slot() {
    let t = table();
    let owners = Owners::new(4, true);
    t.publish(9, 2, words(1));
    let c = t.claim(9, |_| true).unwrap();
    owners.get(2).announce(9);
    assert_eq!(t.settle(&c, &owners), Settled::Wait);
    owners.get(2).clear();
    assert_eq!(t.settle(&c, &owners), Settled::Won);
}

#[test]
fn undo_and_busy_give_the_slot_back_live() {
    let t = table();
    let owners = Owners::new(4, false);
    t.publish(1, 1, words(3));
    let c = t.claim(1, |_| true).unwrap();
    t.undo(&c);
    assert_eq!(t.owner(1), Ok(1));
    let b = t.claim_busy(1).unwrap();
    assert_eq!(t.settle_now(&b, &owners), Some(Settled::Won));
    t.unbusy(&b, Words { info: 0xabc, size: 512, ext: true });
    assert_eq!(t.words(1), Words { info: 0xabc, size: 512, ext: true });
    // A boxed slot misses the owner's hot path, and its whole path sees the words.
    assert_eq!(t.free_owned(1, owners.get(1), 1, 0xabc), None);
    let w = t.free_owned_with(1, owners.get(1), 1, |w| w.ext).unwrap();
    assert_eq!(w.info, 0xabc);
}

#[test]
fn owner_records_are_handed_out_once_and_reused() {
    let owners = Owners::new(3, true);
    let a = owners.acquire().unwrap();
    let b = owners.acquire().unwrap();
    assert!(a != 0 && b != 0 && a != b);
    assert_eq!(owners.acquire(), None);
    owners.release(a);
    assert_eq!(owners.acquire(), Some(a));
}

#[test]
fn a_racing_owner_and_claimers_free_each_block_exactly_once() {
    // Owner thread publishes and frees; two other threads try to free the same blocks.
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    const N: usize = 20_000;
    let t = Arc::new(table());
    let owners = Arc::new(Owners::new(4, crate::sync::heavy_fence()));
    let freed = Arc::new((0..N).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>());
    let published = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        let (t2, o2, f2, p2) = (t.clone(), owners.clone(), freed.clone(), published.clone());
        s.spawn(move || {
            // Owner windows are sound only with `membarrier` (see the module docs).
            let me = if o2.asymmetric() { o2.acquire().unwrap() } else { 0 };
            for i in 0..N {
                t2.publish(i, me, words(i as u64 + 1));
                p2.store(i + 1, Ordering::Release);
                if i % 2 == 0 && me != 0 && t2.free_owned(i, o2.get(me), me, i as u64 + 1).is_some() {
                    f2[i].fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        for _ in 0..2 {
            let (t2, o2, f2, p2) = (t.clone(), owners.clone(), freed.clone(), published.clone());
            s.spawn(move || {
                let mut claims = Vec::new();
                let mut next = 0;
                while next < N {
                    let upto = p2.load(Ordering::Acquire);
                    while next < upto {
                        if let Ok(c) = t2.claim(next, |_| true) {
                            claims.push(c);
                        }
                        next += 1;
                    }
                    if claims.len() > 64 || next == N {
                        while !claims.is_empty() {
                            assert!(claimers_fence(&o2));
                            claims.retain(|c| match t2.settle(c, &o2) {
                                Settled::Won => {
                                    t2.release(c);
                                    f2[c.index()].fetch_add(1, Ordering::Relaxed);
                                    false
                                }
                                Settled::Lost => false,
                                Settled::Wait => true,
                            });
                        }
                    }
                }
            });
        }
    });
    for (i, f) in freed.iter().enumerate() {
        assert_eq!(f.load(Ordering::Relaxed), 1, "block {i} freed {} times", f.load(Ordering::Relaxed));
    }
}
