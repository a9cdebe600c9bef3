//! loom models of stream-ordered reclamation: frees racing a batch close, and the
//! retire/event handoff (a poller racing the event's completion and another poller).
//!
//! The event is a loom-visible fake (an `AtomicBool` the "GPU" thread sets); the FIFO's nodes
//! are reclaimed through an explicit crossbeam-epoch `Collector` per model.
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p loom_tests --release --test reclaim`
#![cfg(loom)]

use crossbeam_epoch::{Collector, LocalHandle};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use vrampool::reclaim::{Span, StreamRetire};

fn span(addr: u64) -> Span {
    Span { addr, size: 256 }
}

/// A free racing the close of its stream's batch: the block ends up either in the closed
/// batch or still open, never lost and never in both; the counters agree with where it is.
#[test]
fn a_free_racing_a_batch_close_is_neither_lost_nor_duplicated() {
    loom::model(|| {
        let collector = Collector::new();
        let r: Arc<StreamRetire<AtomicBool>> = Arc::new(StreamRetire::new());
        r.free(span(0));
        let r2 = r.clone();
        let t = thread::spawn(move || {
            r2.free(span(256));
        });
        let handle = collector.register();
        let closed = r.close(|| Ok::<_, ()>(Some(AtomicBool::new(true))), &handle.pin()).unwrap();
        t.join().unwrap();
        let mut seen = vec![];
        r.for_each_span(|s| seen.push(s.addr), &handle.pin());
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 256]);
        assert_eq!(closed + r.open_bytes(), 512);
        assert_eq!(r.pending_bytes(), closed);
    });
}

/// One poll that fails if it releases a span while the "GPU" still uses it; returns the
/// spans released.
fn poll_checked(r: &StreamRetire<Arc<AtomicBool>>, in_use: &AtomicBool, h: &LocalHandle) -> usize {
    let mut n = 0;
    r.poll(
        |e| e.load(Ordering::Acquire),
        |_| {
            assert!(!in_use.load(Ordering::Relaxed), "released while the GPU used it");
            n += 1;
        },
        &h.pin(),
    );
    n
}

/// The retire/event handoff: a poller never releases a batch before its event completes,
/// two pollers racing release each batch exactly once, and once the event is complete a
/// final poll releases everything.
#[test]
fn a_batch_is_released_once_and_only_after_its_event_completes() {
    loom::model(|| {
        let collector = Arc::new(Collector::new());
        let r: Arc<StreamRetire<Arc<AtomicBool>>> = Arc::new(StreamRetire::new());
        let gpu_done = Arc::new(AtomicBool::new(false));
        // Memory the "GPU" still uses until it sets the event: releasing before must not happen.
        let in_use = Arc::new(AtomicBool::new(true));
        r.free(span(0));
        r.free(span(256));
        {
            let h = collector.register();
            r.close(|| Ok::<_, ()>(Some(gpu_done.clone())), &h.pin()).unwrap();
        }
        let gpu = {
            let (done, in_use) = (gpu_done.clone(), in_use.clone());
            thread::spawn(move || {
                in_use.store(false, Ordering::Relaxed);
                done.store(true, Ordering::Release);
            })
        };
        let poller = {
            let (r, c, in_use) = (r.clone(), collector.clone(), in_use.clone());
            thread::spawn(move || poll_checked(&r, &in_use, &c.register()))
        };
        let h = collector.register();
        let mut n = poll_checked(&r, &in_use, &h);
        gpu.join().unwrap();
        n += poller.join().unwrap();
        r.poll(|e| e.load(Ordering::Acquire), |_| n += 1, &h.pin());
        assert_eq!(n, 2, "each span released exactly once");
        assert_eq!(r.pending_bytes(), 0);
    });
}
