//! The simulated device against hand-made cases: events, stream order, host functions, mapped
//! memory and its counts, costed maps, spins, handle reuse, capture and context faults.

use super::*;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::Duration;

/// Block `stream` until the returned sender is used (or dropped).
fn gate(dev: &SimDevice, stream: &Stream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    dev.enqueue(stream, move || {
        let _ = rx.recv();
    })
    .unwrap();
    tx
}

#[test]
fn an_event_never_recorded_is_complete() {
    let dev = SimDevice::new(1 << 30);
    let ev = dev.create_event().unwrap();
    assert!(dev.query_event(&ev).unwrap());
    dev.synchronize_event(&ev).unwrap();
}

#[test]
fn an_event_completes_only_when_its_stream_reaches_it() {
    let dev = SimDevice::new(1 << 30);
    let s = dev.new_stream().unwrap();
    let open = gate(&dev, &s);
    let ev = dev.create_event().unwrap();
    dev.record_event(&ev, &s).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!dev.query_event(&ev).unwrap(), "complete before the stream reached it");
    drop(open);
    dev.synchronize_event(&ev).unwrap();
    assert!(dev.query_event(&ev).unwrap());
}

#[test]
fn an_event_on_an_idle_stream_is_complete_at_once_and_later_work_still_orders_after_it() {
    let dev = SimDevice::new(1 << 30);
    let s = dev.new_stream().unwrap();
    let idle = dev.create_event().unwrap();
    dev.record_event(&idle, &s).unwrap();
    assert!(dev.query_event(&idle).unwrap(), "nothing runs before it");
    // Work enqueued after it keeps its place in stream order.
    let open = gate(&dev, &s);
    let behind = dev.create_event().unwrap();
    dev.record_event(&behind, &s).unwrap();
    assert!(dev.query_event(&idle).unwrap());
    assert!(!dev.query_event(&behind).unwrap(), "complete before the work queued ahead of it");
    drop(open);
    dev.synchronize_event(&behind).unwrap();
    let last = dev.create_event().unwrap();
    dev.record_event(&last, &s).unwrap();
    dev.synchronize(&s).unwrap();
    assert!(dev.query_event(&behind).unwrap() && dev.query_event(&last).unwrap());
}

#[test]
fn recording_again_replaces_the_earlier_record() {
    let dev = SimDevice::new(1 << 30);
    let fast = dev.new_stream().unwrap();
    let slow = dev.new_stream().unwrap();
    let ev = dev.create_event().unwrap();
    dev.record_event(&ev, &fast).unwrap();
    dev.synchronize(&fast).unwrap();
    assert!(dev.query_event(&ev).unwrap());
    let open = gate(&dev, &slow);
    dev.record_event(&ev, &slow).unwrap();
    assert!(!dev.query_event(&ev).unwrap(), "the new record on the blocked stream must be pending");
    drop(open);
    dev.synchronize_event(&ev).unwrap();
    assert!(dev.query_event(&ev).unwrap());
}

#[test]
fn a_stream_waiting_on_an_event_runs_nothing_after_the_wait_until_it_completes() {
    let dev = SimDevice::new(1 << 30);
    let a = dev.new_stream().unwrap();
    let b = dev.new_stream().unwrap();
    let open = gate(&dev, &a);
    let ev = dev.create_event().unwrap();
    dev.record_event(&ev, &a).unwrap();
    dev.stream_wait_event(&b, &ev).unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    dev.enqueue(&b, move || r.store(true, Ordering::SeqCst)).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert!(!ran.load(Ordering::SeqCst), "work after the wait ran before the event completed");
    drop(open);
    dev.synchronize(&b).unwrap();
    assert!(ran.load(Ordering::SeqCst));
}

#[test]
fn a_device_call_from_inside_a_host_function_fails() {
    let dev = SimDevice::new(1 << 30);
    let s = dev.new_stream().unwrap();
    let (tx, rx) = mpsc::channel();
    let d = dev.clone();
    let s2 = s.clone();
    dev.enqueue(&s, move || {
        let results = [
            d.create_event().err(),
            d.new_stream().err(),
            d.synchronize(&s2).err(),
            d.enqueue(&s2, || {}).err(),
            d.mem_info().err(),
        ];
        tx.send(results).unwrap();
    })
    .unwrap();
    dev.synchronize(&s).unwrap();
    for r in rx.recv().unwrap() {
        assert!(matches!(r, Some(Error::NotPermitted(_))), "got {r:?}");
    }
}

#[test]
fn host_functions_run_in_stream_order() {
    let dev = SimDevice::new(1 << 30);
    let s = dev.new_stream().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..100 {
        let l = Arc::clone(&log);
        dev.enqueue(&s, move || lock(&l).push(i)).unwrap();
    }
    dev.synchronize(&s).unwrap();
    assert_eq!(*lock(&log), (0..100).collect::<Vec<_>>());
}

#[test]
fn mapped_pages_are_memory_and_capacity_is_enforced() {
    let g = 2 << 20;
    let dev = SimDevice::new(4 * g as u64);
    let base = dev.reserve(16 * g as u64).unwrap();
    assert_eq!(base % g as u64, 0);
    dev.map(base, 2 * g).unwrap();
    assert!(dev.map(base, g).is_err(), "mapping over a mapped page must fail");
    dev.map(base + 2 * g as u64, 2 * g).unwrap();
    let over = dev.map(base + 4 * g as u64, g);
    assert!(matches!(over, Err(Error::Device { code: 2, .. })), "got {over:?}");
    let s = dev.new_stream().unwrap();
    dev.memset(base + 100, 0xab, 1000, &s).unwrap();
    let mut back = vec![0u8; 1000];
    dev.copy_from_device(&mut back, base + 100, &s).unwrap();
    assert!(back.iter().all(|&b| b == 0xab));
    dev.copy_to_device(base + g as u64 - 4, &[1, 2, 3, 4, 5, 6, 7, 8], &s).unwrap();
    let mut eight = [0u8; 8];
    dev.copy_from_device(&mut eight, base + g as u64 - 4, &s).unwrap();
    assert_eq!(eight, [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(dev.committed_bytes(), 4 * g as u64);
    // SAFETY: the stream is synchronized; nothing uses the pages any more.
    let across = unsafe { dev.unmap(base, 4 * g) };
    assert!(matches!(across, Err(Error::Device { call: "cuMemUnmap", .. })), "two mappings at once: {across:?}");
    // SAFETY: as above.
    let part = unsafe { dev.unmap(base, g) };
    assert!(matches!(part, Err(Error::Device { call: "cuMemUnmap", .. })), "half a mapping: {part:?}");
    // SAFETY: as above.
    unsafe { dev.unmap(base, 2 * g).unwrap() };
    // SAFETY: as above.
    unsafe { dev.unmap(base + 2 * g as u64, 2 * g).unwrap() };
    assert_eq!(dev.committed_bytes(), 0);
    assert!(dev.memset(base, 0, 16, &s).is_err(), "memset on unmapped memory must fail");
    // SAFETY: nothing is mapped or in use.
    unsafe { dev.release(base, 16 * g as u64).unwrap() };
}

#[test]
fn the_device_counts_what_it_mapped_and_unmapped_over_its_life() {
    let g = 2 << 20;
    let dev = SimDevice::new(8 * g as u64);
    let base = dev.reserve(8 * g as u64).unwrap();
    dev.map(base, 2 * g).unwrap();
    dev.map(base + 2 * g as u64, g).unwrap();
    assert!(dev.map(base, g).is_err(), "a refused map is not counted");
    // SAFETY: nothing uses the pages.
    unsafe { dev.unmap(base, 2 * g).unwrap() };
    dev.map(base, g).unwrap();
    assert_eq!(dev.mapped_bytes_total(), 4 * g as u64);
    assert_eq!(dev.unmapped_bytes_total(), 2 * g as u64);
    assert_eq!(dev.committed_bytes(), dev.mapped_bytes_total() - dev.unmapped_bytes_total());
}

#[test]
fn costed_maps_take_their_time_and_queue_behind_one_driver_lock() {
    let g = 2 << 20;
    let costs = SimCosts { map_call: Duration::from_millis(3), unmap_page: Duration::from_millis(1), ..SimCosts::NONE };
    let dev = SimDevice::builder(64 * g as u64).costs(costs).build();
    assert_eq!(dev.costs(), costs);
    assert!(SimDevice::new(g as u64).costs().is_free(), "SimDevice::new has no costs");
    let base = dev.reserve(16 * g as u64).unwrap();
    let t = std::time::Instant::now();
    std::thread::scope(|s| {
        for i in 0..2u64 {
            let dev = &dev;
            s.spawn(move || dev.map(base + i * 4 * g as u64, 4 * g).unwrap());
        }
    });
    let both = t.elapsed();
    assert!(both >= Duration::from_millis(6), "two 3 ms maps at once took {both:?}: not serialised");
    let t = std::time::Instant::now();
    // SAFETY: nothing uses the pages.
    unsafe { dev.unmap(base, 4 * g).unwrap() };
    assert!(t.elapsed() >= Duration::from_millis(4), "four pages at 1 ms a page");
}

#[test]
fn a_spin_keeps_the_stream_busy_and_spins_add_up() {
    let dev = SimDevice::new(1 << 30);
    let s = dev.new_stream().unwrap();
    let ev = dev.create_event().unwrap();
    let t = std::time::Instant::now();
    dev.spin(&s, 100_000).unwrap();
    dev.record_event(&ev, &s).unwrap();
    assert!(!dev.query_event(&ev).unwrap(), "the stream reached the event during the spin");
    dev.synchronize(&s).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(100));
    let t = std::time::Instant::now();
    for _ in 0..200 {
        dev.spin(&s, 25).unwrap();
    }
    dev.synchronize(&s).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(5), "200 spins of 25 µs took {:?}", t.elapsed());
    assert!(matches!(dev.spin(&s, u64::MAX), Err(Error::InvalidArgument(_))));
}

#[test]
fn raw_handles_are_reused_but_stream_ids_are_not() {
    let dev = SimDevice::new(1 << 30);
    let a = dev.new_stream().unwrap();
    let (raw, id) = (a.raw(), a.id());
    dev.destroy_stream(&a).unwrap();
    assert!(matches!(dev.enqueue(&a, || {}), Err(Error::StreamDestroyed)));
    let b = dev.new_stream().unwrap();
    assert_eq!(b.raw(), raw, "the simulator reuses raw handles, as the driver does");
    assert_ne!(b.id(), id);
    // SAFETY: b is live and outlives the wrapper.
    let w = unsafe { dev.wrap_stream(b.raw()).unwrap() };
    assert_ne!(w.id(), b.id(), "a wrapper is a new handle with its own id");
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    dev.enqueue(&w, move || r.store(true, Ordering::SeqCst)).unwrap();
    dev.synchronize(&b).unwrap();
    assert!(ran.load(Ordering::SeqCst), "the wrapper names the same queue");
}

#[test]
fn a_captured_stream_refuses_work_that_needs_it_to_run() {
    let dev = SimDevice::new(1 << 30);
    let s = dev.new_stream().unwrap();
    let ev = dev.create_event().unwrap();
    dev.begin_capture(&s).unwrap();
    assert!(dev.is_capturing(&s).unwrap());
    assert_eq!(dev.record_event(&ev, &s), Err(Error::StreamCapturing));
    assert_eq!(dev.enqueue(&s, || {}), Err(Error::StreamCapturing));
    dev.end_capture(&s).unwrap();
    dev.record_event(&ev, &s).unwrap();
}

#[test]
fn touching_unmapped_memory_from_a_stream_kills_the_context() {
    let g = 2 << 20;
    let dev = SimDevice::new(4 * g as u64);
    let base = dev.reserve(4 * g as u64).unwrap();
    dev.map(base, g).unwrap();
    let s = dev.new_stream().unwrap();
    let open = gate(&dev, &s);
    dev.memset(base, 1, 64, &s).unwrap();
    // SAFETY: deliberately wrong, to show the simulator faults as a GPU would: the memset
    // queued above runs after the unmap and touches nothing (the worker checks first).
    unsafe { dev.unmap(base, g).unwrap() };
    drop(open);
    assert!(dev.synchronize(&s).is_err());
    assert!(dev.create_event().is_ok(), "creating an event needs no context health here");
    assert!(dev.query_event(&dev.create_event().unwrap()).is_err(), "the fault is sticky");
}
