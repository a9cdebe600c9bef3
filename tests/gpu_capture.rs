//! The C ABI under a real CUDA graph capture, as PyTorch drives it: the graph pool opened
//! before `cuStreamBeginCapture` (GLOBAL mode, PyTorch's default) and closed after
//! `cuStreamEndCapture`. The capture must survive every call vrampool makes meanwhile: an
//! ordinary allocation on the capturing stream (refused, without asking the driver for the
//! stream's id, which would invalidate the capture), allocations from the pool, frees, and
//! another thread's cold allocations (event queries, which GLOBAL mode forbids on every
//! thread unless the calling thread is RELAXED). Then the graph replays, writing what it
//! captured into memory nothing else was given. And the Rust pool beside a capture that
//! nothing declares to it (a cudarc server capturing a step that allocates nothing): its slow
//! paths on another thread must not invalidate the capture. Ignored without a GPU:
//! `cargo test --release --features cuda --test gpu_capture -- --ignored`.
#![cfg(feature = "cuda")]

#[path = "support/cuda_registry.rs"]
mod cuda_registry;

use std::ffi::{c_void, CStr};

use cuda_registry::cuda_registry;
use vrampool::cudarc::driver::sys;
use vrampool::ffi::*;
use vrampool::{Device, Pool, PoolConfig, Stats};

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (11, 0);
const CAPTURING: i32 = 9; // VRAMPOOL_ERROR_STREAM_CAPTURING

fn last_error() -> Option<String> {
    let p = vrampool_last_error();
    // SAFETY: a NUL-terminated string, valid until this thread's next call.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn check(rc: sys::CUresult, what: &str) {
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "{what}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capture_survives_vrampool_and_replays_into_its_own_pool() {
    let Some(dev) = cuda_registry() else { return };
    let capture = dev.create_stream().unwrap();
    let replay = dev.create_stream().unwrap();
    let other = dev.create_stream().unwrap();
    let (cs, rs) = (capture.raw() as usize as sys::CUstream, replay.raw() as usize as sys::CUstream);
    // The capturing stream is known to the registry before the capture (as PyTorch's are).
    // SAFETY: live streams of the primary context.
    let warm = unsafe { vrampool_malloc(4096, 0, cs.cast()) };
    assert!(!warm.is_null(), "{:?}", last_error());
    // SAFETY: as above; freed once.
    unsafe { vrampool_free(warm, 4096, 0, cs.cast()) };

    assert_eq!(vrampool_begin_allocate_to_pool(0, POOL.0, POOL.1), 0, "{:?}", last_error());
    // SAFETY: a live stream of the bound context.
    check(
        unsafe { sys::cuStreamBeginCapture_v2(cs, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) },
        "begin capture",
    );

    // An ordinary allocation on the capturing stream is refused, and harms nothing.
    // SAFETY: as above.
    assert!(unsafe { vrampool_malloc(MIB as isize, 0, cs.cast()) }.is_null());
    assert_eq!(vrampool_last_error_code(), CAPTURING, "{:?}", last_error());
    let _ = last_error();
    // The pool serves the capture; the graph writes 0x5a over the block and frees it.
    // SAFETY: as above.
    let p = unsafe { vrampool_malloc_to_pool(MIB as isize, 0, cs.cast(), POOL.0, POOL.1) } as u64;
    assert_ne!(p, 0, "{:?}", last_error());
    // SAFETY: a live block of MIB bytes; the memset is captured into the graph.
    check(unsafe { sys::cuMemsetD8Async(p, 0x5a, MIB, cs) }, "captured memset");
    // Another thread's cold allocations meanwhile (maps, events, their queries).
    std::thread::scope(|sc| {
        sc.spawn(|| {
            dev.bind_context().unwrap();
            for k in 1..=8 {
                let size = k * 8 * MIB;
                // SAFETY: a live stream of the context.
                let q = unsafe { vrampool_malloc(size as isize, 0, other.raw() as usize as *mut c_void) };
                assert!(!q.is_null(), "{:?}", last_error());
                dev.memset(q as u64, 1, size, &other).unwrap();
                // SAFETY: freed once, on its stream.
                unsafe { vrampool_free(q, size as isize, 0, other.raw() as usize as *mut c_void) };
            }
            assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
        });
    });
    // SAFETY: the block was allocated with these arguments; its last use is captured.
    unsafe { vrampool_free(p as *mut c_void, MIB as isize, 0, cs.cast()) };
    assert_eq!(last_error(), None);

    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the capture began on this stream.
    check(unsafe { sys::cuStreamEndCapture(cs, &mut graph) }, "the capture survived every vrampool call");
    assert_eq!(vrampool_end_allocate_to_pool(0, POOL.0, POOL.1), 0, "{:?}", last_error());

    // Eager allocations after the capture never get the graph's memory.
    let eager: Vec<u64> = (0..32)
        .map(|_| {
            // SAFETY: a live stream.
            let q = unsafe { vrampool_malloc(MIB as isize, 0, cs.cast()) } as u64;
            assert_ne!(q, 0, "{:?}", last_error());
            dev.memset(q, 0x11, MIB, &capture).unwrap();
            q
        })
        .collect();
    assert!(!eager.contains(&p), "an eager allocation got the graph's memory");

    // The replay writes the captured address; nothing else wrote there since.
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a graph just captured; its exec is destroyed below.
    check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "instantiate");
    // SAFETY: as above.
    check(unsafe { sys::cuGraphLaunch(exec, rs) }, "replay");
    dev.synchronize(&replay).unwrap();
    dev.synchronize(&capture).unwrap();
    let mut back = vec![0u8; MIB];
    dev.copy_from_device(&mut back, p, &replay).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a), "the replay wrote its pool's memory");
    for &q in &eager {
        let mut b = vec![0u8; 4096];
        dev.copy_from_device(&mut b, q, &capture).unwrap();
        assert!(b.iter().all(|&x| x == 0x11), "the replay touched an eager block");
        // SAFETY: freed once, on its stream.
        unsafe { vrampool_free(q as *mut c_void, MIB as isize, 0, cs.cast()) };
    }

    // SAFETY: made above, not used after.
    unsafe {
        check(sys::cuGraphExecDestroy(exec), "destroy exec");
        check(sys::cuGraphDestroy(graph), "destroy graph");
    }
    assert_eq!(vrampool_release_pool(0, POOL.0, POOL.1), 0, "{:?}", last_error());
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    let mut buf = vec![0u8; 16384];
    // SAFETY: `buf` has its length writable.
    let n = unsafe { vrampool_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
    let stats: serde_json::Value = serde_json::from_slice(&buf[..n]).unwrap();
    assert_eq!(stats["graph_pools"], 0, "the released pool was given back: {stats}");
    assert_eq!(stats["allocated_bytes"], 0);
    assert_eq!(stats["abi_internal_errors"], 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn another_threads_capture_survives_the_rust_pools_slow_paths() {
    let dev = vrampool::CudaDevice::new(0).expect("this test needs a CUDA GPU");
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let (capture, work, side) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let cs = capture.raw() as usize as sys::CUstream;
    // Allocated before the capture, as a graph's buffers are; the graph writes 0x5a over it.
    let target = pool.alloc(MIB, &capture).unwrap();
    dev.synchronize(&capture).unwrap();
    let before: Stats = pool.stats();

    // SAFETY: a live stream of the primary context, bound on this thread by `alloc`.
    check(
        unsafe { sys::cuStreamBeginCapture_v2(cs, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) },
        "begin capture",
    );
    // SAFETY: a live block of MIB bytes; the memset is captured into the graph.
    check(unsafe { sys::cuMemsetD8Async(target.device_ptr(), 0x5a, MIB, cs) }, "captured memset");
    std::thread::scope(|sc| {
        sc.spawn(|| {
            // Maps: blocks above the cached classes, each larger than the last.
            for k in 1..=8 {
                let b = pool.alloc(k * 8 * MIB, &work).unwrap();
                dev.memset(b.device_ptr(), 1, b.len(), &work).unwrap();
            }
            // Event records and queries: blocks used on two streams, freed while in use.
            for _ in 0..64 {
                let b = pool.alloc(256 << 10, &work).unwrap();
                dev.memset(b.device_ptr(), 2, b.len(), &work).unwrap();
                b.record_stream(&side);
            }
            // The trim's waits for events and its unmaps.
            pool.trim().unwrap();
        });
    });
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the capture began on this stream.
    check(unsafe { sys::cuStreamEndCapture(cs, &mut graph) }, "the capture survived the pool's slow paths");

    let after = pool.stats();
    assert!(after.unmapped_bytes > before.unmapped_bytes, "the trim unmapped: {after:?}");
    assert!(after.events_recorded > before.events_recorded, "frees recorded events: {after:?}");
    assert!(after.batches_retired > before.batches_retired, "events were seen complete: {after:?}");

    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a graph just captured; its exec and the graph are destroyed below.
    unsafe {
        check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "instantiate");
        check(sys::cuGraphLaunch(exec, cs), "replay");
    }
    let mut back = vec![0u8; MIB];
    dev.copy_from_device(&mut back, target.device_ptr(), &capture).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a), "the replay wrote the graph's buffer");
    // SAFETY: made above, not used after (the copy synchronized the stream).
    unsafe {
        check(sys::cuGraphExecDestroy(exec), "destroy exec");
        check(sys::cuGraphDestroy(graph), "destroy graph");
    }
}
