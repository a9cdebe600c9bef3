//! `CudaDevice` on a real GPU. Every test is ignored by default; run them with
//! `cargo test --release --features cuda --test gpu_device -- --ignored --nocapture --test-threads=1`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{device, ok, pattern, stats, us, Kernels};
use cudarc::driver::sys;
use vrampool::{Device, Error, Stream};

const MIB: u64 = 1 << 20;

/// Block `stream` with a host function until the returned sender is used or dropped.
fn gate(dev: &dyn Device, stream: &Stream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    dev.launch_host_fn(
        stream,
        Box::new(move || {
            let _ = rx.recv();
        }),
    )
    .unwrap();
    tx
}

/// A flag that a host function on `stream` sets once the stream's work reaches it.
fn reached(dev: &dyn Device, stream: &Stream) -> Arc<AtomicBool> {
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    dev.launch_host_fn(stream, Box::new(move || r.store(true, Ordering::SeqCst))).unwrap();
    ran
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_pages_hold_a_kernel_pattern_across_streams() {
    let dev = device();
    let g = dev.granularity();
    println!("{} (ordinal {}), granularity {} KiB", dev.name(), dev.ordinal(), g >> 10);
    let kernels = Kernels::load(&dev);
    println!("kernels from {}", kernels.source);

    let range = 64 * MIB;
    let base = dev.reserve(range).unwrap();
    assert_eq!(base % g as u64, 0, "reservation not aligned to the granularity");
    // Page 0 holds the mismatch counter; pages 1..=4 the pattern, mapped in three calls
    // (two pages as one allocation, then one and one): a kernel writes across all of them,
    // and page 3 alone can later be unmapped.
    let bad = base;
    let data = base + g as u64;
    let pages = 4;
    let words = pages * g / 4;
    dev.map(bad, g).unwrap();
    dev.map(data, 2 * g).unwrap();
    dev.map(data + 2 * g as u64, g).unwrap();
    dev.map(data + 3 * g as u64, g).unwrap();

    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let seed = 0x5eed_1234;
    kernels.fill(&a, data, words, seed);
    let ev = dev.create_event().unwrap();
    dev.record_event(&ev, &a).unwrap();
    dev.memset(bad, 0, 8, &b).unwrap();
    dev.stream_wait_event(&b, &ev).unwrap();
    kernels.check(&b, data, words, seed, bad);
    // A wrong seed must be caught everywhere, or `check` proves nothing.
    kernels.check(&b, data, words, seed ^ 1, bad + 4);
    let mut counts = [0u8; 8];
    dev.copy_from_device(&mut counts, bad, &b).unwrap();
    let good_run = u32::from_le_bytes(counts[..4].try_into().unwrap());
    let wrong_seed = u32::from_le_bytes(counts[4..].try_into().unwrap());
    println!("check on stream B: {good_run} mismatches of {words} words; with a wrong seed: {wrong_seed}");
    assert_eq!(good_run, 0, "the pattern written on stream A was not seen on stream B");
    assert_eq!(wrong_seed as usize, words, "the check kernel does not detect mismatches");

    // A few words read back on the host: each page's first and last word and one in between.
    for page in 0..pages {
        for i in [page * g / 4, page * g / 4 + 12_345, (page + 1) * g / 4 - 1] {
            let mut w = [0u8; 4];
            dev.copy_from_device(&mut w, data + 4 * i as u64, &a).unwrap();
            assert_eq!(u32::from_le_bytes(w), pattern(i, seed), "word {i} (page {page})");
        }
    }
    // And a write from the host, read back across a page boundary.
    let at = data + g as u64 - 8;
    dev.copy_to_device(at, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], &b).unwrap();
    let mut back = [0u8; 16];
    dev.copy_from_device(&mut back, at, &a).unwrap();
    assert_eq!(back, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);

    // One page of the middle unmapped alone; the others keep their contents. Half of the
    // two-page allocation cannot be unmapped: the driver refuses part of a mapping.
    dev.synchronize(&a).unwrap();
    dev.synchronize(&b).unwrap();
    // SAFETY: both streams are synchronized; nothing uses the pages any more.
    let half = unsafe { dev.unmap(data, g) };
    assert!(half.is_err(), "unmapping half of one mapping must fail: {half:?}");
    // SAFETY: both streams are synchronized; nothing uses page 2 any more.
    unsafe { dev.unmap(data + 2 * g as u64, g).unwrap() };
    let mut w = [0u8; 4];
    let i = 3 * g / 4 + 7;
    dev.copy_from_device(&mut w, data + 4 * i as u64, &a).unwrap();
    assert_eq!(u32::from_le_bytes(w), pattern(i, seed), "page 3 lost its contents when page 2 was unmapped");

    assert!(matches!(dev.map(data + 1, g), Err(Error::InvalidArgument(_))));
    assert!(matches!(dev.map(data, g + 1), Err(Error::InvalidArgument(_))));
    let twice = dev.map(data, g);
    assert!(matches!(twice, Err(Error::Device { call: "cuMemMap", .. })), "mapping a mapped page: {twice:?}");

    drop(kernels);
    // SAFETY: the streams are idle; nothing uses the range.
    unsafe {
        dev.unmap(bad, g).unwrap();
        dev.unmap(data, 2 * g).unwrap();
        dev.unmap(data + 3 * g as u64, g).unwrap();
        dev.release(base, range).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_functions_run_in_order() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let t = Instant::now();
    for i in 0..1000 {
        let l = Arc::clone(&log);
        dev.launch_host_fn(&s, Box::new(move || l.lock().unwrap().push(i))).unwrap();
    }
    dev.synchronize(&s).unwrap();
    println!("1000 host functions launched and run in {:.2} ms", t.elapsed().as_secs_f64() * 1e3);
    assert_eq!(*log.lock().unwrap(), (0..1000).collect::<Vec<_>>());

    // Every device call from inside a host function is refused before it reaches the driver.
    let (tx, rx) = mpsc::channel();
    let (d, s2) = (dev.clone(), s.clone());
    dev.launch_host_fn(
        &s,
        Box::new(move || {
            let results = [
                d.create_event().err(),
                d.create_stream().err(),
                d.synchronize(&s2).err(),
                d.launch_host_fn(&s2, Box::new(|| {})).err(),
                d.mem_info().err(),
                d.reserve(2 * MIB).err(),
                d.is_capturing(&s2).err(),
            ];
            tx.send(results).unwrap();
        }),
    )
    .unwrap();
    dev.synchronize(&s).unwrap();
    for r in rx.recv().unwrap() {
        assert!(matches!(r, Some(Error::NotPermitted(_))), "got {r:?}");
    }

    // A panicking host function is contained; the stream carries on.
    dev.launch_host_fn(&s, Box::new(|| panic!("deliberate panic in a host function (expected)"))).unwrap();
    let ran = reached(&dev, &s);
    dev.synchronize(&s).unwrap();
    assert!(ran.load(Ordering::SeqCst));
    assert_eq!(dev.host_fn_panics(), 1);

    // The last handles of a stream and an event dropped inside a host function: destroyed
    // later, by the next call made elsewhere.
    let other = dev.create_stream().unwrap();
    let ev = dev.create_event().unwrap();
    dev.launch_host_fn(&s, Box::new(move || drop((other, ev)))).unwrap();
    dev.synchronize(&s).unwrap();
    dev.mem_info().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_follow_cuda_rules() {
    let dev = device();
    let ev = dev.create_event().unwrap();
    assert!(dev.query_event(&ev).unwrap(), "an event never recorded is complete");
    dev.synchronize_event(&ev).unwrap();

    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let open = gate(&dev, &a);
    dev.record_event(&ev, &a).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!dev.query_event(&ev).unwrap(), "complete before the stream reached it");

    dev.stream_wait_event(&b, &ev).unwrap();
    let ran = reached(&dev, &b);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!ran.load(Ordering::SeqCst), "stream B ran past its wait before the event completed");
    assert!(!dev.query_event(&ev).unwrap());

    open.send(()).unwrap();
    dev.synchronize(&b).unwrap();
    assert!(ran.load(Ordering::SeqCst));
    assert!(dev.query_event(&ev).unwrap());

    // Recording again replaces the earlier (complete) record.
    let open = gate(&dev, &a);
    dev.record_event(&ev, &a).unwrap();
    assert!(!dev.query_event(&ev).unwrap(), "the new record on the blocked stream must be pending");
    drop(open);
    dev.synchronize_event(&ev).unwrap();
    assert!(dev.query_event(&ev).unwrap());

    assert!(!dev.is_capturing(&a).unwrap());
    // An event of another device kind is refused, not misread.
    let sim = vrampool::SimDevice::new(1 << 30);
    let foreign = sim.create_event().unwrap();
    assert!(matches!(dev.query_event(&foreign), Err(Error::InvalidArgument(_))));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_reused_event_carries_only_its_new_record() {
    let dev = device();
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let c = dev.create_stream().unwrap();
    // An event recorded behind a gate on A, waited on by C, then dropped while pending.
    let open = gate(&dev, &a);
    let old = dev.create_event().unwrap();
    dev.record_event(&old, &a).unwrap();
    dev.stream_wait_event(&c, &old).unwrap();
    let ran = reached(&dev, &c);
    drop(old);
    // Events made now (one of them the spare) and recorded on idle B complete at once: none
    // inherits A's pending record.
    let fresh: Vec<_> = (0..4).map(|_| dev.create_event().unwrap()).collect();
    for ev in &fresh {
        dev.record_event(ev, &b).unwrap();
    }
    dev.synchronize(&b).unwrap();
    for ev in &fresh {
        assert!(dev.query_event(ev).unwrap(), "a reused event still names its old record");
    }
    // C's wait, enqueued before the reuse, still holds C behind A.
    std::thread::sleep(Duration::from_millis(50));
    assert!(!ran.load(Ordering::SeqCst), "a wait lost its record when the event was reused");
    open.send(()).unwrap();
    dev.synchronize(&c).unwrap();
    assert!(ran.load(Ordering::SeqCst));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_freshly_opened_device_hands_out_stocked_events_without_creating_any() {
    let dev = vrampool::CudaDevice::new(0).unwrap();
    let stocked = dev.events_created();
    assert!(stocked > 0, "the device opened without a stock of events");
    // As many events held at once as the stock: all come from it.
    let held: Vec<_> = (0..stocked).map(|_| dev.create_event().unwrap()).collect();
    assert_eq!(dev.events_created(), stocked);
    // One more than the stock is a real creation, and dropping them all destroys none
    // that the next round cannot take back.
    let extra = dev.create_event().unwrap();
    assert_eq!(dev.events_created(), stocked + 1);
    drop(held);
    drop(extra);
    let again: Vec<_> = (0..=stocked).map(|_| dev.create_event().unwrap()).collect();
    assert_eq!(dev.events_created(), stocked + 1);
    drop(again);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wrapped_streams_get_fresh_ids() {
    let dev = device();
    dev.bind_context().unwrap();
    let mut raw: sys::CUstream = std::ptr::null_mut();
    // SAFETY: our context is current.
    ok("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, 1) });
    // SAFETY: `raw` is a live stream of the primary context and outlives both wrappers.
    let (w1, w2) = unsafe { (dev.wrap_stream(raw as u64).unwrap(), dev.wrap_stream(raw as u64).unwrap()) };
    assert_eq!(w1.raw(), w2.raw());
    assert_ne!(w1.id(), w2.id(), "two wrappers of one raw stream share an id");
    let ran = reached(&dev, &w1);
    dev.synchronize(&w2).unwrap();
    assert!(ran.load(Ordering::SeqCst), "the wrappers name the same stream");
    // Destroying a wrapper only marks it; the raw stream stays usable.
    dev.destroy_stream(&w1).unwrap();
    assert_eq!(dev.synchronize(&w1), Err(Error::StreamDestroyed));
    dev.synchronize(&w2).unwrap();
    let old_ids = [w1.id(), w2.id()];
    drop((w1, w2));
    dev.bind_context().unwrap();
    // SAFETY: no wrapper of `raw` is left.
    ok("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(raw) });

    let mut again: sys::CUstream = std::ptr::null_mut();
    // SAFETY: our context is current.
    ok("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut again, 1) });
    println!("raw stream {raw:p} destroyed; the next one is {again:p} (reused: {})", raw == again);
    // SAFETY: `again` is live and outlives the wrapper.
    let w3 = unsafe { dev.wrap_stream(again as u64).unwrap() };
    assert!(!old_ids.contains(&w3.id()), "a wrapper of a new stream reuses an old id");
    dev.synchronize(&w3).unwrap();
    drop(w3);
    dev.bind_context().unwrap();
    // SAFETY: no wrapper of `again` is left.
    ok("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(again) });

    // Streams vrampool owns: destroyed once, then refused.
    let s = dev.create_stream().unwrap();
    let s2 = s.clone();
    dev.destroy_stream(&s).unwrap();
    assert_eq!(dev.destroy_stream(&s2), Err(Error::StreamDestroyed), "a clone names the same, destroyed stream");
    assert_eq!(dev.launch_host_fn(&s2, Box::new(|| {})), Err(Error::StreamDestroyed));
    drop((s, s2));
    // The legacy default stream can be wrapped too.
    // SAFETY: the legacy default stream lives as long as the context.
    let legacy = unsafe { dev.wrap_stream(0).unwrap() };
    let ran = reached(&dev, &legacy);
    dev.synchronize(&legacy).unwrap();
    assert!(ran.load(Ordering::SeqCst));
    // A stream of another device kind is refused.
    let sim = vrampool::SimDevice::new(1 << 30);
    let foreign = sim.create_stream().unwrap();
    assert!(matches!(dev.synchronize(&foreign), Err(Error::InvalidArgument(_))));
}

/// Time `reps` runs of `f`, in µs.
fn time(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            us(t)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_costs() {
    const REPS: usize = 64;
    let dev = device();
    let g = dev.granularity();
    let mut rows: Vec<(String, Vec<f64>)> = Vec::new();
    let mut row = |name: &str, samples: Vec<f64>| rows.push((name.to_string(), samples));

    // Address space.
    let big = 512u64 << 30;
    let (mut res, mut rel) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        let t = Instant::now();
        let base = dev.reserve(big).unwrap();
        res.push(us(t));
        let t = Instant::now();
        // SAFETY: nothing mapped or used.
        unsafe { dev.release(base, big).unwrap() };
        rel.push(us(t));
    }
    row("reserve 512 GiB (Device::reserve)", res);
    row("release 512 GiB (Device::release)", rel);

    // One page, call by call, straight to the driver.
    let range = 256 * g as u64;
    let base = dev.reserve(range).unwrap();
    dev.bind_context().unwrap();
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev.device_raw(),
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    let access = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let (mut create, mut map, mut set, mut release, mut unmap) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..REPS {
        let mut h = 0;
        // Our context is current and `base` is a reserved page, unmapped at the top of the loop.
        let t = Instant::now();
        // SAFETY: see above; each call acts on the page or handle of this iteration.
        ok("cuMemCreate", unsafe { sys::cuMemCreate(&mut h, g, &prop, 0) });
        create.push(us(t));
        let t = Instant::now();
        // SAFETY: see above; each call acts on the page or handle of this iteration.
        ok("cuMemMap", unsafe { sys::cuMemMap(base, g, 0, h, 0) });
        map.push(us(t));
        let t = Instant::now();
        // SAFETY: see above; each call acts on the page or handle of this iteration.
        ok("cuMemSetAccess", unsafe { sys::cuMemSetAccess(base, g, &access, 1) });
        set.push(us(t));
        let t = Instant::now();
        // SAFETY: see above; each call acts on the page or handle of this iteration.
        ok("cuMemRelease", unsafe { sys::cuMemRelease(h) });
        release.push(us(t));
        let t = Instant::now();
        // SAFETY: see above; each call acts on the page or handle of this iteration.
        ok("cuMemUnmap", unsafe { sys::cuMemUnmap(base, g) });
        unmap.push(us(t));
    }
    row("  cuMemCreate (1 page)", create);
    row("  cuMemMap (1 page)", map);
    row("  cuMemSetAccess (1 page)", set);
    row("  cuMemRelease (mapped handle)", release);
    row("  cuMemUnmap (1 page, frees it)", unmap);

    // The same through the trait.
    let (mut m1, mut u1) = (vec![], vec![]);
    for _ in 0..REPS {
        let t = Instant::now();
        dev.map(base, g).unwrap();
        m1.push(us(t));
        let t = Instant::now();
        // SAFETY: nothing uses the page.
        unsafe { dev.unmap(base, g).unwrap() };
        u1.push(us(t));
    }
    row("Device::map, 1 page", m1);
    row("Device::unmap, 1 page", u1);

    // Runs of 64 pages (128 MiB at 2 MiB pages), and what the free memory does.
    let run = 64;
    let free0 = dev.mem_info().unwrap().free;
    let (mut m64, mut u64_) = (vec![], vec![]);
    let mut free_mapped = 0;
    for rep in 0..16 {
        let t = Instant::now();
        dev.map(base, run * g).unwrap();
        m64.push(us(t));
        if rep == 0 {
            free_mapped = dev.mem_info().unwrap().free;
        }
        let t = Instant::now();
        // SAFETY: nothing uses the pages.
        unsafe { dev.unmap(base, run * g).unwrap() };
        u64_.push(us(t));
    }
    let free_after = dev.mem_info().unwrap().free;
    let per_page = |v: &[f64]| v.iter().map(|x| x / run as f64).collect::<Vec<_>>();
    row("Device::map, 64 pages (per page)", per_page(&m64));
    row("Device::unmap, 64 pages (per page)", per_page(&u64_));
    row("Device::map, 64 pages (whole call)", m64);
    row("Device::unmap, 64 pages (whole call)", u64_);
    // SAFETY: nothing mapped or used.
    unsafe { dev.release(base, range).unwrap() };

    // Events, host functions.
    let s = dev.create_stream().unwrap();
    let mut evs = Vec::with_capacity(REPS);
    row("create_event", time(REPS, || evs.push(dev.create_event().unwrap())));
    let ev = dev.create_event().unwrap();
    row("record_event (idle stream)", time(REPS, || dev.record_event(&ev, &s).unwrap()));
    dev.synchronize(&s).unwrap();
    row("query_event (complete)", time(REPS, || assert!(dev.query_event(&ev).unwrap())));
    row("is_capturing", time(REPS, || assert!(!dev.is_capturing(&s).unwrap())));
    row("mem_info", time(REPS, || assert!(dev.mem_info().unwrap().total > 0)));
    row("synchronize (idle stream)", time(REPS, || dev.synchronize(&s).unwrap()));
    row(
        "host fn round trip (launch + synchronize)",
        time(REPS, || {
            dev.launch_host_fn(&s, Box::new(|| {})).unwrap();
            dev.synchronize(&s).unwrap();
        }),
    );
    drop(evs);

    println!();
    println!("{} — granularity {} KiB, {REPS} repetitions (64-page rows: 16)", dev.name(), g >> 10);
    println!("{:<44} {:>11} {:>11} {:>11}", "operation", "median µs", "mean µs", "min µs");
    println!("{}", "-".repeat(80));
    for (name, mut v) in rows {
        let (median, mean, min) = stats(&mut v);
        println!("{name:<44} {median:>11.2} {mean:>11.2} {min:>11.2}");
    }
    println!();
    let mib = |b: u64| b as f64 / MIB as f64;
    println!("mem_info().free before mapping:        {:>12.1} MiB", mib(free0));
    println!(
        "after mapping {run} pages ({} MiB):       {:>12.1} MiB  (fell by {:.1} MiB)",
        (run * g) >> 20,
        mib(free_mapped),
        mib(free0) - mib(free_mapped)
    );
    println!(
        "after unmapping them:                  {:>12.1} MiB  (rose by {:.1} MiB)",
        mib(free_after),
        mib(free_after) - mib(free_mapped)
    );
    assert!(free0.saturating_sub(free_mapped) >= (run * g) as u64, "mapping did not take physical memory");
    // Most of it, not all: the driver may keep page tables or other books for the range.
    assert!(
        free_after.saturating_sub(free_mapped) >= (run * g) as u64 * 9 / 10,
        "unmapping did not give the memory back at once"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_map_that_runs_out_of_memory_part_way_unmaps_what_it_mapped() {
    let dev = device();
    let g = dev.granularity() as u64;
    // More than the whole device, so cuMemCreate fails after many pages were mapped.
    let bytes = (dev.total_memory() / g + 4096) * g;
    let base = dev.reserve(bytes).unwrap();
    let before = dev.mem_info().unwrap().free;
    let t = Instant::now();
    let r = dev.map(base, bytes as usize);
    let took = t.elapsed();
    let after = dev.mem_info().unwrap().free;
    println!(
        "map of {:.1} GiB on a {:.1} GiB device: {r:?} after {:.2} s; free {:.1} MiB before, {:.1} MiB after",
        bytes as f64 / (1u64 << 30) as f64,
        dev.total_memory() as f64 / (1u64 << 30) as f64,
        took.as_secs_f64(),
        before as f64 / MIB as f64,
        after as f64 / MIB as f64
    );
    assert!(matches!(r, Err(Error::Device { call: "cuMemCreate", .. })), "got {r:?}");
    assert!(after + 64 * MIB >= before, "the pages mapped before the failure were not given back");
    // Nothing is left mapped: every page can be mapped again.
    dev.map(base, 4 * g as usize).unwrap();
    // SAFETY: nothing uses the pages or the range.
    unsafe {
        dev.unmap(base, 4 * g as usize).unwrap();
        dev.release(base, bytes).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_spin_keeps_the_stream_busy_on_the_device() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let ev = dev.create_event().unwrap();
    // One long spin: the stream has not reached the event until the time has passed.
    let t = Instant::now();
    dev.spin(&s, 20_000).unwrap();
    dev.record_event(&ev, &s).unwrap();
    let launched = t.elapsed();
    assert!(!dev.query_event(&ev).unwrap(), "the event completed before the spin could have ended");
    dev.synchronize(&s).unwrap();
    let long = t.elapsed();
    // Many short ones add up on the device: a busy stream after every allocation.
    let t = Instant::now();
    for _ in 0..500 {
        dev.spin(&s, 20).unwrap();
    }
    let queued = t.elapsed();
    dev.synchronize(&s).unwrap();
    let short = t.elapsed();
    println!(
        "spin kernel from {}: 20 ms spin launched in {:.1} µs, done after {:.2} ms; 500 × 20 µs queued in {:.1} µs, done after {:.2} ms",
        dev.spin_kernel_source().unwrap_or("?"),
        launched.as_secs_f64() * 1e6,
        long.as_secs_f64() * 1e3,
        queued.as_secs_f64() * 1e6,
        short.as_secs_f64() * 1e3
    );
    assert!(long >= Duration::from_millis(20), "{long:?}");
    assert!(short >= Duration::from_millis(10), "{short:?}");
    assert!(dev.spin(&s, vrampool::device::MAX_SPIN_MICROS + 1).is_err());
}
