//! loom models of the C ABI's live-block table (`vrampool::live`): the owner's plain free
//! against another thread's claim and settlement (Dekker's protocol on the owner's
//! announcement, with loom's `SeqCst` fences for the `light_fence`/`heavy_fence` pair), a
//! stale claim against the slot's republication, and `record_stream`'s busy claim against
//! the owner's free. Each model checks that every publication is taken from the table at
//! most once, and that what a thread takes are the words that were published.
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p loom_tests --release --target-dir target-loom --test live`
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use vrampool::live::{claimers_fence, Owners, Settled, Table, Words};

const BASE: u64 = 1 << 30;
const OWNER: usize = 1;

fn words(n: u64) -> Words {
    Words { info: n, size: n * 256, ext: false }
}

fn setup() -> (Arc<Table>, Arc<Owners>) {
    let table = Table::new(BASE, 4 * 256).expect("a table of four slots");
    (Arc::new(table), Arc::new(Owners::new(2, true)))
}

/// Settle `claim` as the ABI's batch does: fence, then settle again while the owner's window
/// covers it.
fn settle(table: &Table, owners: &Owners, claim: &vrampool::live::Claim) -> Settled {
    assert!(claimers_fence(owners));
    loop {
        match table.settle(claim, owners) {
            Settled::Wait => thread::yield_now(),
            done => return done,
        }
    }
}

/// The owner frees its block while another thread claims it: exactly one of them takes it,
/// and the claimer sees the published words.
#[test]
fn the_owner_and_a_claimer_never_both_take_a_block() {
    loom::model(|| {
        let (table, owners) = setup();
        let me = owners.acquire().expect("an owner record");
        assert_eq!(me, OWNER);
        table.publish(1, me, words(7));
        let taken = Arc::new(AtomicUsize::new(0));
        let claimer = {
            let (table, owners, taken) = (table.clone(), owners.clone(), taken.clone());
            thread::spawn(move || {
                if let Ok(claim) = table.claim(1, |w| w == words(7)) {
                    assert_eq!(claim.words, words(7), "a claim reads the published words");
                    if settle(&table, &owners, &claim) == Settled::Won {
                        table.release(&claim);
                        taken.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        if table.free_owned(1, owners.get(me), me, 7) == Some(7 * 256) {
            taken.fetch_add(1, Ordering::Relaxed);
        }
        claimer.join().unwrap();
        assert_eq!(taken.load(Ordering::Relaxed), 1, "the block is taken exactly once");
        assert!(table.claim(1, |_| true).is_err(), "the slot is free");
    });
}

/// The owner frees its block, gets it back from the pool and publishes it again at the same
/// slot while another thread claims the slot: whichever publication the claim was taken on,
/// it settles against that one only, and each publication is taken exactly once.
#[test]
fn a_claim_settles_against_the_publication_it_was_taken_on() {
    loom::model(|| {
        let (table, owners) = setup();
        let me = owners.acquire().expect("an owner record");
        table.publish(2, me, words(1));
        // How many times publication 1 and 2 were taken.
        let taken = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let claimer = {
            let (table, owners, taken) = (table.clone(), owners.clone(), taken.clone());
            thread::spawn(move || {
                if let Ok(claim) = table.claim(2, |_| true) {
                    if settle(&table, &owners, &claim) == Settled::Won {
                        table.release(&claim);
                        taken[claim.words.info as usize - 1].fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let mut republished = false;
        if table.free_owned(2, owners.get(me), me, 1).is_some() {
            taken[0].fetch_add(1, Ordering::Relaxed);
            // The pool hands the block back to this thread: published again.
            table.publish(2, me, words(2));
            republished = true;
            if table.free_owned(2, owners.get(me), me, 2).is_some() {
                taken[1].fetch_add(1, Ordering::Relaxed);
            }
        }
        claimer.join().unwrap();
        assert_eq!(taken[0].load(Ordering::Relaxed), 1, "the first publication is taken exactly once");
        let second = taken[1].load(Ordering::Relaxed);
        assert_eq!(second, republished as usize, "the second publication is taken once if it was made");
        assert!(table.claim(2, |_| true).is_err(), "the slot is free");
    });
}

/// Another thread's `record_stream` holds the slot busy and rewrites its words while the
/// owner frees it: the owner's free waits or wins, takes the block exactly once, and takes
/// the rewritten words if the busy claim won.
#[test]
fn a_busy_claim_and_the_owners_free_agree_on_the_words() {
    loom::model(|| {
        let (table, owners) = setup();
        let me = owners.acquire().expect("an owner record");
        table.publish(0, me, words(3));
        let recorded = Words { info: 0xe0, size: 3 * 256, ext: true };
        let recorder = {
            let (table, owners) = (table.clone(), owners.clone());
            thread::spawn(move || match table.claim_busy(0) {
                Ok(claim) => match table.settle_now(&claim, &owners) {
                    Some(Settled::Won) => {
                        table.unbusy(&claim, recorded);
                        true
                    }
                    _ => false,
                },
                Err(_) => false,
            })
        };
        let freed = match table.free_owned(0, owners.get(me), me, 3) {
            Some(size) => Words { info: 3, size, ext: false },
            None => table.free_owned_with(0, owners.get(me), me, |_| true).expect("the owner's free takes the block"),
        };
        let rewrote = recorder.join().unwrap();
        assert_eq!(freed, if rewrote { recorded } else { words(3) }, "the owner frees the words the slot held");
        assert!(table.claim(0, |_| true).is_err(), "the slot is free");
    });
}

/// Two other threads free the same block (a racing double free): exactly one claim takes it.
#[test]
fn two_claimers_never_both_take_a_block() {
    loom::model(|| {
        let (table, owners) = setup();
        let me = owners.acquire().expect("an owner record");
        table.publish(3, me, words(5));
        let claimer = |table: Arc<Table>, owners: Arc<Owners>| {
            move || match table.claim(3, |_| true) {
                Ok(claim) => {
                    let won = settle(&table, &owners, &claim) == Settled::Won;
                    if won {
                        table.release(&claim);
                    }
                    won
                }
                Err(_) => false,
            }
        };
        let t = thread::spawn(claimer(table.clone(), owners.clone()));
        let mine = claimer(table.clone(), owners.clone())();
        let theirs = t.join().unwrap();
        assert!(mine != theirs, "exactly one claimer takes the block");
    });
}
