//! loom models of the address space's handoffs: a stream's take of its own free memory
//! racing the return of the chunk that holds it, and a free's fence racing another stream's
//! claim of the same granules (the claimer must see the fence, or not get the memory).
//!
//! Tiny configurations (a stream arena of one 2 MiB chunk; a space of two chunks) and two
//! threads:
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p loom_tests --release --test space`
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use vrampool::arena::{fence_word, Space, StreamArena, CHUNK, GRANULE};

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
        let mut seen = None;
        let got = s.alloc_large(GRANULE, &mut |addr, len| {
            s.fences(addr, len, |_, w| {
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
