//! loom models of the address space's handoffs: a stream's take of its own free memory
//! racing the return of the chunk that holds it, a free's fence racing another stream's
//! claim of the same granules (the claimer must see the fence, or not get the memory), and a
//! page loan racing a placement that claimed part of the borrowing page before it was mapped
//! (the placement must read the loaned memory's fences once it holds the page), and a partial
//! free inside a chunk whose summary speaks for it racing a claim of that chunk's granules.
//!
//! Tiny configurations (a stream arena of one 2 MiB chunk; a space of two chunks) and two
//! threads:
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p loom_tests --release --test space`
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use vrampool::arena::pages::Backing;
use vrampool::arena::{fence_word, PageMap, Space, StreamArena, CHUNK, GRANULE};

const BASE: u64 = 1 << 30;

/// A stream's arena holds one chunk with one live block. One thread frees the block (the
/// chunk falls wholly free) and gives the chunk back; another thread of the same stream
/// allocates at the same time. The block handed out and the chunk given back never meet:
/// either the allocation got memory of the chunk and the chunk stayed, or the chunk went
/// and the allocation found nothing.
#[test]
fn a_same_stream_take_racing_its_chunk_s_return_never_gets_memory_that_left() {
    loom::model(|| {
        let a = Arc::new(StreamArena::new(1).unwrap());
        let idx = a.reserve(BASE).unwrap();
        a.publish(idx);
        let b = a.alloc(CHUNK).unwrap();
        let a1 = a.clone();
        let returner = thread::spawn(move || {
            assert_eq!(a1.free(b, CHUNK, idx), Some(true), "the chunk is wholly free after its one block");
            a1.take(idx)
        });
        let got = a.alloc(1024);
        let returned = returner.join().unwrap();
        match (got, returned) {
            (Some(x), None) => {
                assert!((BASE..BASE + CHUNK).contains(&x));
                assert_eq!(a.free(x, 1024, idx), Some(true));
            }
            (None, Some(c)) => {
                assert_eq!(c, BASE);
                assert_eq!(a.free_bytes(), 0, "nothing left in the arena once its chunk went");
            }
            (Some(x), Some(c)) => panic!("block {x:#x} handed out from chunk {c:#x}, which was given back"),
            // The free made room for 1 KiB at every moment but while the chunk was in flight
            // between free pieces: an allocation seeing that says so only once quiet, and
            // the returner's take then fails or succeeds, never both.
            (None, None) => panic!("a wholly free chunk was neither taken nor handed out"),
        }
    });
}

/// One thread frees a granule with stream 1's fence; another claims the same granule for
/// stream 2, judging the fence it reads. Whenever the claim gets the granule, it saw the
/// fence the free wrote (the free stores it before clearing the bit).
#[test]
fn a_claim_of_freed_granules_sees_the_fence_of_their_free() {
    loom::model(|| {
        let s = Arc::new(Space::new(BASE, 2 * CHUNK, CHUNK).unwrap());
        let a = s.alloc_large(GRANULE, &mut |_, _| Ok(())).unwrap();
        let fence = fence_word(1, 7);
        let s1 = s.clone();
        let freer = thread::spawn(move || assert!(s1.free(a, GRANULE, fence)));
        // Without a yield here loom never ran the free before the claim's walk: the claim
        // always took the next granule, and the model checked nothing.
        thread::yield_now();
        let mut seen = None;
        let got = s.alloc_large(GRANULE, &mut |addr, len| {
            s.fences(addr, len, |_, _, w| {
                seen = Some(w);
                true
            });
            Ok(())
        });
        freer.join().unwrap();
        if got == Some(a) {
            assert_eq!(seen, Some(fence), "the freed granule was claimed without its fence");
        }
    });
}

/// A chunk was freed whole with one fence, so its summary speaks for all its granules; then
/// its first granule became a block again. One thread frees that block with a new fence;
/// another claims a granule and reads its fence once it holds it. The claimer sees the new
/// fence on the freed granule and the old one on any other: the partial free's summary
/// (`MIXED`), stored before its bit clears, never leaves the chunk's old fence in view.
#[test]
fn a_chunk_summary_never_hides_a_partial_free_from_its_claimer() {
    loom::model(|| {
        let s = Arc::new(Space::new(BASE, 2 * CHUNK, CHUNK).unwrap());
        let (old, new) = (fence_word(1, 3), fence_word(2, 8));
        let whole = s.alloc_large(CHUNK, &mut |_, _| Ok(())).unwrap();
        assert!(s.free(whole, CHUNK, old));
        let b = s.alloc_large(GRANULE, &mut |_, _| Ok(())).unwrap();
        assert_eq!(b, whole);
        let s1 = s.clone();
        let freer = thread::spawn(move || assert!(s1.free(b, GRANULE, new)));
        thread::yield_now();
        let got = s.alloc_large(GRANULE, &mut |_, _| Ok(())).unwrap();
        let seen = fences_of(&s, got, GRANULE);
        freer.join().unwrap();
        let want = if got == b { new } else { old };
        assert_eq!(seen, [want], "granule {got:#x} claimed with the wrong fence");
    });
}

/// The fences of the granules at `[addr, addr + len)`.
fn fences_of(s: &Space, addr: u64, len: u64) -> Vec<u64> {
    let mut v = Vec::new();
    s.fences(addr, len, |_, _, w| {
        v.push(w);
        true
    });
    v
}

/// Page 0 is unmapped, its granules never used (fence 0); page 1 is mapped and free, its
/// memory last used by stream 2's work not yet seen complete. A placement of stream 1 has
/// claimed granules of page 0 and judged their fences at its walk (clean); before it
/// acquires the page, another placement's acquire of page 0 may lend page 1's memory there,
/// carrying its fences over. Whenever the memory under page 0 is the loaned one, the first
/// placement reads the loan's fences once its acquire returns: judging after the acquire
/// (`judge_held`) sees the history, where the walk's judgement alone (the clean `walk`
/// below) handed out memory still in use.
#[test]
fn a_loan_onto_a_page_shows_its_history_to_a_placement_that_claimed_it_before() {
    loom::model(|| {
        let (page, target, lender) = (CHUNK, BASE, BASE + CHUNK);
        let s = Arc::new(Space::new(BASE, 2 * page, page).unwrap());
        let m = Arc::new(PageMap::new(BASE, 2 * page, page).unwrap());
        let busy = fence_word(2, 5);
        let at_lender = s.alloc_large(page, &mut |a, l| if a == lender { Ok(()) } else { Err(a + l - 1) });
        assert_eq!(at_lender, Some(lender));
        m.acquire(lender, page, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
        assert!(s.free(lender, page, busy));
        assert!(m.release(lender, page));
        // The first placement's walk, before the other placement starts.
        let walk = fences_of(&s, target, GRANULE);
        assert_eq!(walk, [0], "the walk judged an unused page");
        let lent = Arc::new(AtomicBool::new(false));
        let other = {
            let (s, m, lent) = (s.clone(), m.clone(), lent.clone());
            thread::spawn(move || {
                let (s2, m2) = (s.clone(), m.clone());
                m.acquire(target + page / 2, GRANULE, true, &mut |to, len| {
                    let mut alias = |from: u64, to: u64, l: usize| {
                        s2.copy_fences(from, to, l as u64);
                        Ok(())
                    };
                    if m2.lend(to, len, &mut |_, _| true, &mut alias) {
                        lent.store(true, Ordering::Release);
                        return Ok(Backing::Lent);
                    }
                    Ok(Backing::Fresh)
                })
                .unwrap();
            })
        };
        m.acquire(target, GRANULE, true, &mut |_, _| Ok(Backing::Fresh)).unwrap();
        let held = fences_of(&s, target, GRANULE);
        other.join().unwrap();
        if lent.load(Ordering::Acquire) {
            assert_eq!(held, [busy], "the loaned memory's history was not there once the page was held");
        }
    });
}
