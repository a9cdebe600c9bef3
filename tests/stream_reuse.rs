//! Reuse across streams through the Pool API, on the simulated device: a stream's own
//! frees at once, another stream's once its event is seen complete or behind a device wait,
//! the events the pool records for it, and blocks used on several streams.

use vrampool::{Block, Device, Pool, PoolConfig, SimDevice, Stream};

#[path = "support/sim_pool.rs"]
mod sim_pool;
use sim_pool::{all_given_back, pool, runs_only_after_release, stalled};

#[test]
fn same_stream_reuse_needs_no_event() {
    let (_dev, pool, s) = pool(1 << 30);
    let a = pool.alloc(1 << 20, &s).unwrap();
    let addr = a.device_ptr();
    drop(a);
    let before = pool.stats().events_recorded;
    let b = pool.alloc(1 << 20, &s).unwrap();
    assert_eq!(b.device_ptr(), addr);
    assert_eq!(pool.stats().events_recorded, before);
    assert_eq!(pool.stats().t0_hits, 1, "served by the thread cache");
}

#[test]
fn another_stream_does_not_get_memory_freed_on_a_stream_that_has_not_reached_the_free() {
    let (dev, pool, s) = pool(1 << 30);
    let other = dev.new_stream().unwrap();
    let tx = stalled(&dev, &s);
    let a = pool.alloc(1 << 20, &s).unwrap();
    let addr = a.device_ptr();
    drop(a);
    let b = pool.alloc(1 << 20, &other).unwrap();
    assert_ne!(b.device_ptr(), addr, "handed to another stream while the freeing stream is blocked");
    drop(tx);
    drop(b);
    all_given_back(&pool);
}

#[test]
fn a_block_used_on_a_busy_stream_serves_the_next_request_behind_a_device_wait() {
    // Freed while its other stream is still busy, a `record_stream` block's memory goes to
    // the next request of its stream once that stream waits for the busy one on the device:
    // rather than new pages, and without the host waiting.
    let (dev, pool, s) = pool(1 << 30);
    let copy = dev.new_stream().unwrap();
    let tx = stalled(&dev, &copy);
    const BIG: usize = 96 << 20;
    let a = pool.alloc(BIG, &s).unwrap();
    let addr = a.device_ptr();
    a.record_stream(&copy);
    drop(a);
    let waits = pool.stats().device_waits;
    let b = pool.alloc(BIG, &s).unwrap();
    let st = pool.stats();
    assert_eq!(b.device_ptr(), addr, "the retiring block's memory, not new pages ({st:?})");
    assert_eq!(st.reserved_bytes, BIG as u64, "no page mapped for the second block");
    assert!(st.device_waits > waits, "the stream waits for the copy stream on the device");
    // Work on `s` after the new block runs only once the copy stream is past the old use.
    runs_only_after_release(&dev, &s, tx, "the copy stream's work");
    drop(b);
    all_given_back(&pool);
}

#[test]
fn once_a_stream_has_waited_for_another_the_memory_freed_before_that_wait_is_ready_for_it() {
    // Two large blocks freed on a stalled stream `t`: the first request of `s` takes one
    // behind a device wait; the second takes the other at once, with no second wait, since
    // the first already put `s` after that work. And `s`'s work still waits for `t`'s.
    // (Blocks of 16 MiB: fewer bytes freed than make the pool record an event on its own,
    // so both frees are fenced by the same event.)
    let (dev, pool, s) = pool(1 << 30);
    let t = dev.new_stream().unwrap();
    const BIG: usize = 16 << 20;
    let a1 = pool.alloc(BIG, &t).unwrap();
    let a2 = pool.alloc(BIG, &t).unwrap();
    let tx = stalled(&dev, &t);
    let addrs = [a1.device_ptr(), a2.device_ptr()];
    drop((a1, a2));
    let before = pool.stats();
    let b1 = pool.alloc(BIG, &s).unwrap();
    let first = pool.stats();
    assert!(addrs.contains(&b1.device_ptr()), "the memory `t` freed, not new pages ({first:?})");
    assert_eq!(first.device_waits, before.device_waits + 1, "`s` waits for `t` on the device");
    let b2 = pool.alloc(BIG, &s).unwrap();
    let second = pool.stats();
    assert!(addrs.contains(&b2.device_ptr()), "the other block `t` freed ({second:?})");
    assert_eq!(second.device_waits, first.device_waits, "no second wait");
    assert_eq!(second.covered_reuses, first.covered_reuses + 1, "taken as covered by the first wait");
    assert_eq!(second.reserved_bytes, before.reserved_bytes, "no page mapped");
    runs_only_after_release(&dev, &s, tx, "`t`'s work");
    drop((b1, b2));
    all_given_back(&pool);
}

/// Two streams of a pool that makes no device waits (as a server that wants its streams
/// independent): `t` freed an 8 MiB block at the returned address and is then stalled
/// until the returned sender drops, so no event on `t` can complete meanwhile.
struct StalledFree {
    dev: SimDevice,
    pool: Pool,
    s: Stream,
    t: Stream,
    addr: u64,
    tx: std::sync::mpsc::Sender<()>,
}

const STALLED_BIG: usize = 8 << 20;

fn stalled_free() -> StalledFree {
    stalled_free_by(|f| f())
}

/// [`stalled_free`], with `t`'s block allocated and freed by `on_t` (which runs the closure
/// it is given: on this thread, or on another that then owns `t`).
fn stalled_free_by(on_t: impl FnOnce(&(dyn Fn() -> u64 + Sync)) -> u64) -> StalledFree {
    let dev = SimDevice::new(1 << 30);
    let config = PoolConfig { cross_stream_waits: false, ..PoolConfig::default() };
    let pool = Pool::new(dev.clone(), config).unwrap();
    let (s, t) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let addr = on_t(&|| pool.alloc(STALLED_BIG, &t).unwrap().device_ptr());
    let tx = stalled(&dev, &t);
    StalledFree { dev, pool, s, t, addr, tx }
}

#[test]
fn memory_another_stream_freed_is_covered_by_an_event_once_a_placement_meets_it() {
    // A free on `t` is fenced by `t`'s next event, which the pool records on its own only
    // every 64 frees or 64 MiB. A placement for `s` that meets such a fence records it (here
    // on a stalled `t`, so that placement goes on to new pages): once `t` has run past the
    // free, the next request of `s` takes that memory where it is mapped, with no device
    // wait (turned off here, as a server that wants its streams independent does).
    let StalledFree { dev, pool, s, t, addr, tx } = stalled_free();
    let events = pool.stats().events_recorded;
    let x = pool.alloc(2 << 20, &s).unwrap();
    assert!(x.device_ptr() >= addr + STALLED_BIG as u64, "not on the memory `t` freed while `t` is stalled");
    assert!(pool.stats().events_recorded > events, "an event recorded on `t` for its free");
    drop(tx);
    dev.synchronize(&t).unwrap();
    let mapped = dev.mapped_bytes_total();
    let y = pool.alloc(STALLED_BIG, &s).unwrap();
    let st = pool.stats();
    assert_eq!(y.device_ptr(), addr, "the memory `t` freed ({st:?})");
    assert_eq!(dev.mapped_bytes_total(), mapped, "no page mapped");
    assert_eq!(st.device_waits, 0);
    drop((x, y));
    dev.synchronize(&s).unwrap();
    all_given_back(&pool);
}

#[test]
fn records_for_another_streams_placement_are_counted_apart_from_those_for_frees() {
    // The placement for `s` that meets the stalled `t`'s free records `t`'s event (a
    // hurry, as this thread allocated on `t` too): a record made for another stream's
    // placement. The frees of `s` then reach the cadence that records `s`'s own event. Both
    // count in `events_recorded`; only the first in `reuse_records`.
    let StalledFree { dev, pool, s, t, tx, .. } = stalled_free();
    let before = pool.stats();
    let x = pool.alloc(2 << 20, &s).unwrap();
    let hurried = pool.stats();
    assert_eq!(hurried.events_recorded, before.events_recorded + 1, "`t`'s event, for `s`'s placement");
    assert_eq!(hurried.reuse_records, before.reuse_records + 1, "counted as made for a placement");
    assert!(hurried.reuse_record_ns <= hurried.record_ns, "its time is part of the records' time");
    // 64 MiB freed on `s`: the cadence records an event for those frees.
    for _ in 0..8 {
        drop(pool.alloc(STALLED_BIG, &s).unwrap());
    }
    let freed = pool.stats();
    assert!(freed.events_recorded > hurried.events_recorded, "`s`'s event for its frees ({freed:?})");
    assert_eq!(freed.reuse_records, hurried.reuse_records, "not made for a placement");
    drop(tx);
    drop(x);
    dev.synchronize(&s).unwrap();
    dev.synchronize(&t).unwrap();
    all_given_back(&pool);
}

/// Run `f` on a thread of its own (whose thread caches go when it ends), and return what it
/// returns.
fn on_another_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|sc| sc.spawn(f).join().unwrap())
}

#[test]
fn a_placement_asks_the_stream_of_another_thread_for_its_event_and_its_next_free_records_it() {
    // `t` is another thread's stream: that thread allocates and frees there; this one never
    // does. A placement for `s` that meets `t`'s free, not covered by an event yet, must not
    // record one on `t` (on a GPU it would wait behind the other thread's launches): it asks,
    // and `t`'s next free records the event, below the cadence of 64 frees. Once `t` has
    // run past it, `s` takes the memory where it is mapped.
    let StalledFree { dev, pool, s, t, addr, tx } = stalled_free_by(|f| on_another_thread(f));
    let before = pool.stats();
    let x = pool.alloc(2 << 20, &s).unwrap();
    let asked = pool.stats();
    assert!(x.device_ptr() >= addr + STALLED_BIG as u64, "not on the memory `t` freed while `t` is stalled");
    assert_eq!(asked.events_recorded, before.events_recorded, "nothing recorded on `t` from this thread");
    assert_eq!(asked.records_asked, before.records_asked + 1, "`t` asked for its event");
    on_another_thread(|| drop(pool.alloc(STALLED_BIG, &t).unwrap()));
    let answered = pool.stats();
    assert_eq!(answered.events_recorded, asked.events_recorded + 1, "`t`'s next free recorded it ({answered:?})");
    assert_eq!(answered.reuse_records, asked.reuse_records, "on the thread that frees there, for its frees");
    drop(tx);
    dev.synchronize(&t).unwrap();
    let mapped = dev.mapped_bytes_total();
    let y = pool.alloc(STALLED_BIG, &s).unwrap();
    assert_eq!(y.device_ptr(), addr, "the memory `t` freed ({:?})", pool.stats());
    assert_eq!(dev.mapped_bytes_total(), mapped, "no page mapped");
    drop((x, y));
    dev.synchronize(&s).unwrap();
    all_given_back(&pool);
}

#[test]
fn a_small_block_of_another_stream_queued_first_does_not_hold_back_a_large_one() {
    // Only its own stream may take a small `record_stream` block before its events complete
    // (its memory goes back to that stream's chunk); a large one any stream may. Queued
    // first, the small block must not keep the large one from serving the next request.
    let (dev, pool, s) = pool(1 << 30);
    let other = dev.new_stream().unwrap();
    let copy = dev.new_stream().unwrap();
    let tx = stalled(&dev, &copy);
    let small = pool.alloc(4096, &other).unwrap();
    small.record_stream(&copy);
    drop(small);
    const BIG: usize = 96 << 20;
    let a = pool.alloc(BIG, &s).unwrap();
    let addr = a.device_ptr();
    a.record_stream(&copy);
    drop(a);
    let before = pool.stats();
    let b = pool.alloc(BIG, &s).unwrap();
    let st = pool.stats();
    assert_eq!(b.device_ptr(), addr, "the large retiring block's memory, not new pages ({st:?})");
    assert_eq!(st.reserved_bytes, before.reserved_bytes, "no page mapped for the second block");
    assert!(st.device_waits > before.device_waits, "`s` waits for the copy stream on the device");
    assert_eq!(st.retiring_bytes, 4096, "the small block still waits for its events");
    drop(tx);
    drop(b);
    all_given_back(&pool);
}

#[test]
fn a_stream_gets_no_new_event_while_its_last_one_is_pending() {
    let (dev, pool, s) = pool(1 << 30);
    // Blocks above the largest cached class go back to the arena at each free: 13 of 5 MiB
    // pass the bytes after which a stream gets an event.
    let free_a_batch = || {
        for _ in 0..13 {
            drop(pool.alloc(5 << 20, &s).unwrap());
        }
    };
    let recorded = || pool.stats().events_recorded;
    dev.spin(&s, 2_000_000).unwrap();
    free_a_batch();
    let first = recorded();
    assert!(first > 0, "a batch of frees records an event");
    free_a_batch();
    assert_eq!(recorded(), first, "the device is still behind the last event: no new one");
    dev.synchronize(&s).unwrap();
    free_a_batch();
    assert_eq!(recorded(), first + 1, "the last event complete: the next batch records");
}

/// A pool on a fresh simulator, a worker's stream and a copy stream, and `n` blocks of 1 MiB
/// allocated on the worker's.
fn work_and_copy(n: usize) -> (SimDevice, Pool, Stream, Stream, Vec<Block>) {
    let (dev, pool, work) = pool(1 << 30);
    let copy = dev.new_stream().unwrap();
    let blocks = (0..n).map(|_| pool.alloc(1 << 20, &work).unwrap()).collect();
    (dev, pool, work, copy, blocks)
}

#[test]
fn blocks_used_on_a_busy_stream_share_its_outstanding_event() {
    let (dev, pool, work, copy, blocks) = work_and_copy(32);
    // Both streams behind for a while: the events recorded for the first block stay pending.
    dev.spin(&work, 2_000_000).unwrap();
    dev.spin(&copy, 2_000_000).unwrap();
    let before = pool.stats().events_recorded;
    for b in blocks {
        b.record_stream(&copy);
    }
    let recorded = pool.stats().events_recorded - before;
    assert!(recorded <= 2, "one outstanding event per stream covers every block: {recorded} recorded for 32 blocks");
    assert_eq!(pool.stats().retiring_bytes, 32 << 20, "no block is back before both streams get past it");
    // Once the streams are done, the blocks come back: the stamps made after the first
    // events get the events that cover them.
    dev.synchronize(&work).unwrap();
    dev.synchronize(&copy).unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.stats().retiring_bytes, 0);
    pool.check().unwrap();
}

#[test]
fn the_largest_free_stretch_is_what_one_block_could_take() {
    let (_dev, pool, s) = pool(1 << 30);
    // One small block: its stream's chunk of 2 MiB, the rest free in buddies of 4 KiB to
    // 1 MiB, side by side.
    let small = pool.alloc(4096, &s).unwrap();
    let st = pool.stats();
    assert_eq!(st.free_mapped_bytes, (2 << 20) - 4096, "the rest of the chunk is free: {st:?}");
    assert_eq!(st.largest_free_mapped, 1 << 20, "no block spans two of a chunk's pieces: {st:?}");
    drop(small);
}

#[test]
fn blocks_behind_a_stream_destroyed_before_its_next_event_still_come_back() {
    let (dev, pool, work, copy, blocks) = work_and_copy(8);
    dev.spin(&copy, 50_000).unwrap();
    // The first free records the copy stream's event; the later ones wait for its next,
    // which never comes: the stream is destroyed first, and its final event covers them.
    for b in blocks {
        b.record_stream(&copy);
    }
    dev.destroy_stream(&copy).unwrap();
    dev.synchronize(&work).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    pool.trim().unwrap();
    pool.check().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocated_bytes, st.retiring_bytes), (0, 0), "{st:?}");
}
