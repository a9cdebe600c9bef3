//! loom models of stream-ordered reclamation: the fence a free gets racing an event's record
//! (the same-stream handoff: the event must cover the free, or the free must wait for a
//! later event), a cross-stream take through a device wait (the event waited on covers the
//! free), a poller racing the device's completion of events, and the retire/event handoff
//! of blocks used on several streams (released by a poller, or taken early behind a device
//! wait), a block queued behind a stamp in another stream's log (the copy-stream handoff),
//! a free racing the stream's final event, placements for one stream that trust each
//! other's device waits (`Waited`), and an ask for an event racing a record.
//!
//! A stream is modelled by its queue: an atomic counter whose `fetch_add` is an enqueue
//! (the driver's queue lock orders enqueues the same way) and returns the position; an
//! event is the position at which it was recorded, plus a completion flag the "GPU" thread
//! sets. Epoch-reclaimed queues get an explicit crossbeam-epoch `Collector` per model.
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p loom_tests --release --test reclaim`
#![cfg(loom)]

use crossbeam_epoch::{Collector, LocalHandle};
use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use vrampool::reclaim::fence::FenceLog;
use vrampool::reclaim::waited::Waited;
use vrampool::reclaim::{Retire, Span};

/// A fake event: where in its stream's queue it was recorded, and whether the "GPU" has
/// passed it.
struct Ev {
    at: u64,
    done: Arc<AtomicBool>,
}

/// Record an event on `queue` (an enqueue, like `cuEventRecord`).
fn record(queue: &AtomicU64, done: &Arc<AtomicBool>) -> Ev {
    Ev { at: queue.fetch_add(1, Ordering::AcqRel), done: done.clone() }
}

/// What a model's stream is made of: its fence log, its queue (the number of the next
/// item enqueued), the completion of the one event the model records, and the collector
/// its threads pin.
struct Stream {
    collector: Arc<Collector>,
    log: Arc<FenceLog<Ev>>,
    queue: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
}

impl Stream {
    fn new() -> Stream {
        Stream {
            collector: Arc::new(Collector::new()),
            log: Arc::new(FenceLog::new()),
            queue: Arc::new(AtomicU64::new(0)),
            done: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A thread that records one event on the stream (as the pool does for `note_free` or
    /// another stream's request) and returns its number.
    fn spawn_recorder(&self) -> thread::JoinHandle<u64> {
        let (log, queue, done, c) = (self.log.clone(), self.queue.clone(), self.done.clone(), self.collector.clone());
        thread::spawn(move || {
            let h = c.register();
            log.record(|| Ok::<_, ()>(record(&queue, &done)), &h.pin()).unwrap()
        })
    }
}

/// The same-stream handoff: a thread frees a block right after enqueuing the block's last
/// use, while another thread records an event on the stream (as the pool does for
/// `note_free` or another stream's request). Whatever the interleaving, an event whose
/// number is at least the free's fence was recorded after the block's last use, so its
/// completion proves the use is done.
#[test]
fn an_event_numbered_at_or_past_a_free_s_fence_is_recorded_after_its_last_use() {
    loom::model(|| {
        let stream = Stream::new();
        let recorder = stream.spawn_recorder();
        let Stream { collector, log, queue, .. } = stream;
        // The block's last use, then its free.
        let last_use = queue.fetch_add(1, Ordering::AcqRel);
        let fence = log.stamp();
        let seq = recorder.join().unwrap();
        let h = collector.register();
        if seq >= fence {
            let at = log.covering(fence, |e| e.at, &h.pin()).expect("the event is recorded");
            assert!(at > last_use, "event {seq} (at {at}) covers fence {fence} but precedes the use at {last_use}");
        }
    });
}

/// A cross-stream take with a device wait: stream S frees a block (after its last use)
/// while events are recorded on S; a thread of another stream finds the fence incomplete,
/// takes the event covering it (recording one if none does yet) and waits on it. The event
/// waited on is always recorded after the block's last use, and a poller racing the "GPU"
/// never calls the fence complete before the GPU has passed that use.
#[test]
fn a_device_wait_and_a_poll_never_run_ahead_of_the_freed_block_s_last_use() {
    loom::model(|| {
        let Stream { collector, log, queue, .. } = Stream::new();
        // The "GPU" has run every enqueued item below `passed`.
        let passed = Arc::new(AtomicU64::new(0));
        let ev_done = Arc::new(AtomicBool::new(false));
        // Stream S: the block's last use, its free; the fence travels with the memory.
        let last_use = queue.fetch_add(1, Ordering::AcqRel);
        let fence = log.stamp();
        let other = {
            let (log, queue, done, c) = (log.clone(), queue.clone(), ev_done.clone(), collector.clone());
            thread::spawn(move || {
                let h = c.register();
                let g = h.pin();
                if log.is_complete(fence) {
                    return None;
                }
                match log.covering(fence, |e| e.at, &g) {
                    Some(at) => Some(at),
                    None => {
                        log.record(|| Ok::<_, ()>(record(&queue, &done)), &g).unwrap();
                        // A poller may have seen it complete (and dropped it) already.
                        let at = log.covering(fence, |e| e.at, &g);
                        assert!(at.is_some() || log.is_complete(fence), "recorded, neither pending nor complete");
                        at
                    }
                }
            })
        };
        let gpu = {
            let (queue, passed, done) = (queue.clone(), passed.clone(), ev_done.clone());
            thread::spawn(move || {
                // Run everything enqueued so far, then signal the event if it is among it.
                let upto = queue.load(Ordering::Acquire);
                passed.store(upto, Ordering::Release);
                if upto >= 2 {
                    done.store(true, Ordering::Release);
                }
            })
        };
        let h = collector.register();
        log.poll(|e| e.done.load(Ordering::Acquire), &h.pin());
        if log.is_complete(fence) {
            assert!(passed.load(Ordering::Acquire) > last_use, "fence complete before the GPU passed the use");
        }
        if let Some(at) = other.join().unwrap() {
            assert!(at > last_use, "waited on an event (at {at}) before the use at {last_use}");
        }
        gpu.join().unwrap();
    });
}

/// A free racing the stream's destruction: the block's last use was enqueued before the
/// stream was destroyed (the user's part), and its free stamps a fence while the destroyer
/// records the final event. Whatever the interleaving, the final event covers the fence:
/// once it is complete the fence is, and a wait finds it. (Without `FenceLog::bounded`, a
/// stamp read between the final number's claim and its publication is one past it, a
/// number no event carries, and the memory is never released.)
#[test]
fn a_free_racing_the_final_event_is_covered_by_it() {
    loom::model(|| {
        let Stream { collector, log, queue, done } = Stream::new();
        let last_use = queue.fetch_add(1, Ordering::AcqRel);
        let destroyer = {
            let (log, queue, done, c) = (log.clone(), queue.clone(), done.clone(), collector.clone());
            thread::spawn(move || {
                let h = c.register();
                log.finish(|| Ok::<_, ()>(record(&queue, &done)), &h.pin()).unwrap()
            })
        };
        let fence = log.stamp();
        destroyer.join().unwrap();
        let h = collector.register();
        let at = log.covering(fence, |e| e.at, &h.pin()).expect("the final event covers the fence");
        assert!(at > last_use, "the covering event (at {at}) precedes the use at {last_use}");
        done.store(true, Ordering::Release);
        log.poll(|e| e.done.load(Ordering::Acquire), &h.pin());
        assert!(log.is_complete(fence), "the final event is complete, fence {fence} is not");
    });
}

/// The ask (`FenceLog::ask`): a placement on a thread that may not record on a stream (it
/// does not launch there) meets a free's stamp no event covers and asks the stream's next
/// free to record one, while a thread of that stream records an event for its own frees.
/// Whatever the interleaving, the ask is not lost: once all three are done, an event
/// numbered at or past the stamp was claimed, or the ask still stands, for the next free to
/// answer. (Clear the ask after the claim instead of before it, and loom finds the ask made
/// between the two, for a stamp past the claim, wiped out unanswered.)
#[test]
fn an_ask_is_answered_by_an_event_covering_its_stamp_or_it_stands() {
    loom::model(|| {
        let stream = Stream::new();
        let recorder = stream.spawn_recorder();
        let log = stream.log;
        // The fence word the free writes and the placement reads (0: not freed yet).
        let word = Arc::new(AtomicU64::new(0));
        let freer = {
            let (log, word) = (log.clone(), word.clone());
            thread::spawn(move || word.store(log.stamp(), Ordering::Release))
        };
        let stamp = word.load(Ordering::Acquire);
        if stamp != 0 && !log.is_complete(stamp) {
            log.ask();
        }
        recorder.join().unwrap();
        freer.join().unwrap();
        if stamp != 0 {
            assert!(
                log.claimed() >= stamp || log.is_asked(),
                "the ask for stamp {stamp} was cleared, and only event {} was claimed",
                log.claimed()
            );
        }
    });
}

/// A block used on another stream (`record_stream`), queued behind a *stamp* in that
/// stream's fence log rather than an event of its own (`pool::cross`): the freeing thread
/// stamps after the block's last use there, queues the batch, and covers the stamp (records
/// an event unless one is outstanding), while a poller races it, covering and releasing, and
/// the "GPU" runs the stream. Whatever the interleaving, the block is released only once the
/// GPU has passed its last use, and once the GPU is done and the stamp covered, a poll
/// releases it. (Release on the batch alone, without the stamp's judgement, and loom finds
/// the release of memory in use.)
#[test]
fn a_block_behind_a_stamp_in_another_stream_s_log_goes_only_after_its_use_there() {
    /// Record an event unless one is outstanding: the pool's `cover`.
    fn cover(log: &FenceLog<u64>, queue: &AtomicU64, passed: &AtomicU64, g: &crossbeam_epoch::Guard) {
        log.poll(|&at| passed.load(Ordering::Acquire) > at, g);
        if !log.has_pending(g) {
            log.record(|| Ok::<_, ()>(queue.fetch_add(1, Ordering::AcqRel)), g).unwrap();
        }
    }
    loom::model(|| {
        let collector = Arc::new(Collector::new());
        let log: Arc<FenceLog<u64>> = Arc::new(FenceLog::new());
        let queue = Arc::new(AtomicU64::new(0));
        // The "GPU" has run every item enqueued below `passed`.
        let passed = Arc::new(AtomicU64::new(0));
        let r: Arc<Retire<u64>> = Arc::new(Retire::new());
        let last_use = queue.fetch_add(1, Ordering::AcqRel);
        let release_after_use = {
            let passed = passed.clone();
            move |_: Span| assert!(passed.load(Ordering::Acquire) > last_use, "released before the GPU passed its use")
        };
        let poller = {
            let (log, queue, passed, r, c) = (log.clone(), queue.clone(), passed.clone(), r.clone(), collector.clone());
            let release = release_after_use.clone();
            thread::spawn(move || {
                let h = c.register();
                let g = h.pin();
                r.poll(
                    |&seq| {
                        log.is_complete(seq) || {
                            cover(&log, &queue, &passed, &g);
                            log.is_complete(seq)
                        }
                    },
                    release,
                    &g,
                )
                .0
            })
        };
        let gpu = {
            let (queue, passed) = (queue.clone(), passed.clone());
            thread::spawn(move || passed.store(queue.load(Ordering::Acquire), Ordering::Release))
        };
        // The free: stamp after the last use, queue, cover.
        let h = collector.register();
        {
            let g = h.pin();
            let seq = log.stamp();
            r.queue_batch(Some(seq), vec![span(0)], &g);
            cover(&log, &queue, &passed, &g);
        }
        let mut released = poller.join().unwrap();
        gpu.join().unwrap();
        // Everything enqueued is run now; poll until the stamp is covered and released.
        passed.store(queue.load(Ordering::Acquire), Ordering::Release);
        for _ in 0..2 {
            let g = h.pin();
            released += r
                .poll(
                    |&seq| {
                        log.is_complete(seq) || {
                            cover(&log, &queue, &passed, &g);
                            passed.store(queue.load(Ordering::Acquire), Ordering::Release);
                            log.poll(|&at| passed.load(Ordering::Acquire) > at, &g);
                            log.is_complete(seq)
                        }
                    },
                    release_after_use.clone(),
                    &g,
                )
                .0;
        }
        assert_eq!(released, 1, "released exactly once");
        assert_eq!(r.pending_bytes(), 0);
    });
}

fn span(addr: u64) -> Span {
    Span { addr, size: 256 }
}

/// One poll that fails if it releases a span while the "GPU" still uses it; returns the
/// spans released.
fn poll_checked(r: &Retire<Arc<AtomicBool>>, in_use: &AtomicBool, h: &LocalHandle) -> usize {
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

/// One batch of `spans` behind an event the "GPU" thread sets once it stops using their
/// memory, and a poller thread racing to release it ([`poll_checked`]).
struct Race {
    collector: Arc<Collector>,
    r: Arc<Retire<Arc<AtomicBool>>>,
    /// Memory the "GPU" still uses until it sets the event: releasing before must not happen.
    in_use: Arc<AtomicBool>,
    gpu: thread::JoinHandle<()>,
    poller: thread::JoinHandle<usize>,
}

impl Race {
    fn start(spans: Vec<Span>) -> Race {
        let collector = Arc::new(Collector::new());
        let r: Arc<Retire<Arc<AtomicBool>>> = Arc::new(Retire::new());
        let gpu_done = Arc::new(AtomicBool::new(false));
        let in_use = Arc::new(AtomicBool::new(true));
        {
            let h = collector.register();
            r.queue_batch(Some(gpu_done.clone()), spans, &h.pin());
        }
        let gpu = {
            let in_use = in_use.clone();
            thread::spawn(move || {
                in_use.store(false, Ordering::Relaxed);
                gpu_done.store(true, Ordering::Release);
            })
        };
        let poller = {
            let (r, c, in_use) = (r.clone(), collector.clone(), in_use.clone());
            thread::spawn(move || poll_checked(&r, &in_use, &c.register()))
        };
        Race { collector, r, in_use, gpu, poller }
    }

    /// Join both threads, poll once more after the event, and return every span released:
    /// `n` by the caller, the poller's, and the last poll's. Nothing may be left pending.
    fn finish(self, h: &LocalHandle, mut n: usize) -> usize {
        self.gpu.join().unwrap();
        n += self.poller.join().unwrap();
        self.r.poll(|e| e.load(Ordering::Acquire), |_| n += 1, &h.pin());
        assert_eq!(self.r.pending_bytes(), 0);
        n
    }
}

/// The retire/event handoff of blocks used on several streams: a poller never releases a
/// batch before its event completes, two pollers racing release each batch exactly once,
/// and once the event is complete a final poll releases everything.
#[test]
fn a_batch_is_released_once_and_only_after_its_event_completes() {
    loom::model(|| {
        let race = Race::start(vec![span(0), span(256)]);
        let h = race.collector.register();
        let n = poll_checked(&race.r, &race.in_use, &h);
        assert_eq!(race.finish(&h, n), 2, "each span released exactly once");
    });
}

/// Rung 6's early take of a block used on several streams: a thread whose stream needs
/// memory takes the oldest batch before its event completes, making its stream wait on the
/// event on the device first, while a poller races to release the same batch once the
/// "GPU" completes it. Each span is released exactly once, and never while the GPU uses it
/// unless the thread it went to had its stream wait. (Take the wait out of `take` and loom
/// finds the release of memory still in use.)
#[test]
fn a_retiring_batch_taken_early_goes_once_and_only_behind_a_device_wait() {
    loom::model(|| {
        let race = Race::start(vec![span(0)]);
        let h = race.collector.register();
        // The taker's stream: whether it waits on the batch's event (on the device).
        let waited = std::cell::Cell::new(false);
        let mut n = 0;
        race.r.take_while(
            |b| {
                if !b.event().is_some_and(|e| e.load(Ordering::Acquire)) {
                    waited.set(true);
                }
                true
            },
            |_| {
                assert!(waited.get() || !race.in_use.load(Ordering::Relaxed), "taken in use with no device wait");
                n += 1;
            },
            u64::MAX,
            &h.pin(),
        );
        assert_eq!(race.finish(&h, n), 1, "the span released exactly once");
    });
}

/// What a model stream's queue holds, in the order the "driver" took the items.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Item {
    /// A device wait on the other stream's event of this number.
    Wait(u64),
    /// Work using memory the other stream freed under a fence of this number.
    Use(u64),
}

/// Two placements for stream S take memory that stream T freed, each under its own fence,
/// and each needs S ordered after T's event covering it: the first sets up a wait on event
/// 2 of T (covering fences 1 and 2), the second needs fence 2. A placement that finds the
/// wait already noted enqueues its work with no wait of its own. Whatever the interleaving,
/// every use in S's queue comes after a wait that covers it. (Make `Waited::wait` note the
/// wait before it calls `enqueue` and loom finds a use ahead of its wait.)
#[test]
fn a_wait_is_relied_on_only_once_it_is_enqueued() {
    const T: u32 = 1;
    loom::model(|| {
        let waited = Arc::new(Waited::default());
        // S's queue: the driver's lock orders enqueues, as the mutex does here.
        let queue = Arc::new(loom::sync::Mutex::new(Vec::new()));
        let place = |waited: &Waited, queue: &loom::sync::Mutex<Vec<Item>>, fence: u64, covering: u64| {
            if !waited.covers(T, fence) {
                assert!(waited.wait(T, covering, || {
                    queue.lock().unwrap().push(Item::Wait(covering));
                    true
                }));
            }
            queue.lock().unwrap().push(Item::Use(fence));
        };
        let other = {
            let (waited, queue) = (waited.clone(), queue.clone());
            thread::spawn(move || place(&waited, &queue, 1, 2))
        };
        place(&waited, &queue, 2, 2);
        other.join().unwrap();
        let items = queue.lock().unwrap().clone();
        for (i, item) in items.iter().enumerate() {
            if let Item::Use(fence) = *item {
                let behind = items[..i].iter().any(|w| matches!(*w, Item::Wait(e) if e >= fence));
                assert!(behind, "work on memory fenced {fence} ran with no wait before it: {items:?}");
            }
        }
    });
}

/// Two streams' waits share a word of S's table (their slots are a table's length apart).
/// One thread makes S wait on stream A's event and notes it; another does the same for
/// stream B, whose note takes the word over. A placement for S that finds A's wait noted
/// enqueues its work with no wait of its own: whatever the interleaving, that work comes
/// after A's wait in S's queue, and a note that gave way only makes the next placement wait
/// again.
#[test]
fn a_note_that_gives_way_to_another_slot_was_relied_on_only_after_its_wait() {
    use vrampool::reclaim::waited::WAITED_SLOTS;
    const A: u32 = 3;
    const B: u32 = A + WAITED_SLOTS as u32;
    loom::model(|| {
        let waited = Arc::new(Waited::default());
        let queue = Arc::new(loom::sync::Mutex::new(Vec::new()));
        let wait_on = |waited: &Waited, queue: &loom::sync::Mutex<Vec<(u32, u64)>>, slot: u32| {
            assert!(waited.wait(slot, 4, || {
                queue.lock().unwrap().push((slot, 4));
                true
            }));
        };
        let b = {
            let (waited, queue) = (waited.clone(), queue.clone());
            thread::spawn(move || wait_on(&waited, &queue, B))
        };
        let a = {
            let (waited, queue) = (waited.clone(), queue.clone());
            thread::spawn(move || wait_on(&waited, &queue, A))
        };
        thread::yield_now();
        let relied = waited.covers(A, 4);
        if relied {
            queue.lock().unwrap().push((0, 0));
        }
        a.join().unwrap();
        b.join().unwrap();
        let items = queue.lock().unwrap().clone();
        if let Some(at) = items.iter().position(|&i| i == (0, 0)) {
            assert!(items[..at].contains(&(A, 4)), "work relied on A's note ahead of A's wait: {items:?}");
        }
        assert!(!waited.covers(A, 5) && !waited.covers(B, 5), "no note covers an event not waited on");
        assert!(waited.covers(A, 4) || waited.covers(B, 4), "the word holds one of the two notes");
    });
}
