//! CUDA graph pools through the C ABI, on the simulator: what a capture allocates stays the
//! pool's own (reused by later allocations into the same pool, never by anything else)
//! until every graph that used the pool is released, its last block freed and the cache
//! emptied; a block given to `record_stream` is not reused even inside the pool; bad calls
//! are refused and change nothing. The same
//! calls under a real capture are in `tests/ffi_cuda.rs`.

use std::ffi::{c_void, CStr};

use vrampool::ffi::*;
use vrampool::registry::{self, Config, DeviceChoice};

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (7, 0);
const STREAM: u64 = 0x51;
const SIDE: u64 = 0x52;

fn last_error() -> Option<String> {
    let p = vrampool_last_error();
    // SAFETY: a NUL-terminated string, valid until this thread's next call.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn to_pool(size: usize, pool: (u64, u64)) -> u64 {
    // SAFETY: simulator handles are opaque values.
    unsafe { vrampool_malloc_to_pool(size as isize, 0, STREAM as *mut c_void, pool.0, pool.1) as u64 }
}

fn malloc(size: usize) -> u64 {
    // SAFETY: as in `to_pool`.
    let p = unsafe { vrampool_malloc(size as isize, 0, STREAM as *mut c_void) } as u64;
    assert_ne!(p, 0, "{:?}", last_error());
    p
}

fn free(p: u64, size: usize) {
    // SAFETY: as in `to_pool`; a refused free changes nothing.
    unsafe { vrampool_free(p as *mut c_void, size as isize, 0, STREAM as *mut c_void) };
}

fn stat(key: &str) -> u64 {
    let mut buf = vec![0u8; 16384];
    // SAFETY: `buf` has its length writable.
    let n = unsafe { vrampool_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
    let json = std::str::from_utf8(&buf[..n]).unwrap();
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {json}"))
}

/// One test, the two parts in turn: the statistics are the process's.
#[test]
fn graph_pools() {
    // A small device, so that a graph pool's pages can stand in the way of an allocation.
    registry::configure(Config { device: DeviceChoice::Sim, sim_bytes: 1 << 30, ..Config::default() }).unwrap();
    a_graph_pools_memory_serves_only_that_pool_until_it_is_released();
    a_shared_pool_stays_until_every_graph_that_used_it_is_released();
    two_branches_of_one_capture_do_not_share_freed_memory();
    freed_graph_memory_stays_mapped_until_the_pool_finishes();
    a_released_pools_block_freed_by_a_later_capture_stays_mapped();
    an_allocation_out_of_memory_gets_the_released_pools_pages();
    bad_graph_pool_calls_are_refused_and_change_nothing();
}

fn a_graph_pools_memory_serves_only_that_pool_until_it_is_released() {
    assert_eq!(to_pool(MIB, POOL), 0, "a pool not opened serves nothing");
    assert!(last_error().unwrap().contains("not open"));

    assert_eq!(vrampool_begin_allocate_to_pool(0, POOL.0, POOL.1), 0, "{:?}", last_error());
    let a = to_pool(MIB, POOL);
    assert_ne!(a, 0, "{:?}", last_error());
    free(a, MIB);
    assert_eq!(last_error(), None);

    // Outside the pool, nothing gets the pool's memory, freed or not.
    let eager: Vec<u64> = (0..64).map(|_| malloc(MIB)).collect();
    assert!(!eager.contains(&a), "an ordinary allocation got a graph pool's memory");
    for &p in &eager {
        free(p, MIB);
    }
    // Inside it, freed memory serves the pool's next allocation (PyTorch's private pools).
    let b = to_pool(MIB, POOL);
    assert_eq!(b, a, "the pool reuses what it freed");

    // A block used on another stream is parked at its free: not even the pool reuses it.
    // SAFETY: as in `to_pool`.
    assert_eq!(unsafe { vrampool_record_stream(b as *mut c_void, SIDE as *mut c_void) }, 0, "{:?}", last_error());
    free(b, MIB);
    let c = to_pool(MIB, POOL);
    assert!(c != 0 && c != b, "a block given to record_stream came back inside the pool");

    assert_eq!(vrampool_end_allocate_to_pool(0, POOL.0, POOL.1), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 1);
    assert_eq!(stat("graph_pool_blocks"), 1);
    assert!(stat("graph_pool_reserved_bytes") >= 2 * MIB as u64);

    // Released with a block still live: the pool stays until that block is freed.
    assert_eq!(vrampool_release_pool(0, POOL.0, POOL.1), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 1);
    free(c, MIB);
    assert_eq!(last_error(), None);
    assert_eq!(stat("graph_pools"), 1, "given back at empty_cache, as PyTorch's private pools");
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 0, "released and every block freed: given back");
    assert_eq!(stat("graph_pool_reserved_bytes"), 0);
    assert_eq!(stat("allocated_bytes"), 0);
}

/// Two graphs captured into one pool (PyTorch's `pool=` argument): the first release keeps
/// the memory, even with no block live, since the other graph still replays into it.
fn a_shared_pool_stays_until_every_graph_that_used_it_is_released() {
    let pool = (21, 0);
    for _ in 0..2 {
        assert_eq!(vrampool_begin_allocate_to_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
        let p = to_pool(MIB, pool);
        assert_ne!(p, 0, "{:?}", last_error());
        free(p, MIB);
        assert_eq!(vrampool_end_allocate_to_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    }
    assert_eq!(stat("graph_pools"), 1, "both captures used the one pool");
    assert_eq!(vrampool_release_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 1, "the second graph still replays into the pool");
    assert!(stat("graph_pool_reserved_bytes") >= MIB as u64);
    assert_eq!(vrampool_release_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 0);
}

/// A capture on two streams (a fork inside the graph): a block freed by one branch is not
/// reused by the other, whose work the graph does not order after it.
fn two_branches_of_one_capture_do_not_share_freed_memory() {
    let pool = (22, 0);
    assert_eq!(vrampool_begin_allocate_to_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    let a = to_pool(MIB, pool);
    // SAFETY: as in `to_pool`, on the side stream.
    let b = unsafe { vrampool_malloc_to_pool(MIB as isize, 0, SIDE as *mut c_void, pool.0, pool.1) } as u64;
    assert!(a != 0 && b != 0, "{:?}", last_error());
    free(a, MIB);
    // SAFETY: as above.
    let c = unsafe { vrampool_malloc_to_pool(MIB as isize, 0, SIDE as *mut c_void, pool.0, pool.1) } as u64;
    assert!(c != 0 && c != a, "the side branch got memory the main branch freed");
    for (p, raw) in [(b, SIDE), (c, SIDE)] {
        // SAFETY: as above; freed once.
        unsafe { vrampool_free(p as *mut c_void, MIB as isize, 0, raw as *mut c_void) };
        assert_eq!(last_error(), None);
    }
    assert_eq!(vrampool_end_allocate_to_pool(0, pool.0, pool.1), 0);
    assert_eq!(vrampool_release_pool(0, pool.0, pool.1), 0);
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 0);
}

/// PyTorch's `test_graph_capture_reset_recapture`: graph 1 is reset (its pool released)
/// while its output lives; graph 2's capture reads that output and frees it. Graph 2
/// replays into it, so the released pool must outlive graph 2's capture: it goes at
/// `empty_cache`, not as the capture ends (which faulted the replay on an H200).
fn a_released_pools_block_freed_by_a_later_capture_stays_mapped() {
    let (first, second) = ((31, 0), (32, 0));
    let dev = registry::device(0).unwrap();
    let stream = registry::default_stream(0).unwrap();
    assert_eq!(vrampool_begin_allocate_to_pool(0, first.0, first.1), 0, "{:?}", last_error());
    let out = to_pool(MIB, first);
    assert_ne!(out, 0, "{:?}", last_error());
    assert_eq!(vrampool_end_allocate_to_pool(0, first.0, first.1), 0);
    assert_eq!(vrampool_release_pool(0, first.0, first.1), 0, "graph 1 reset, its output alive");
    assert_eq!(vrampool_begin_allocate_to_pool(0, second.0, second.1), 0, "{:?}", last_error());
    let next = to_pool(MIB, second);
    free(out, MIB); // graph 2 read graph 1's output, then dropped it
    assert_eq!(last_error(), None);
    assert_eq!(vrampool_end_allocate_to_pool(0, second.0, second.1), 0);
    dev.memset(out, 0x42, MIB, &stream).expect("graph 2's replay can still write what graph 1's pool held");
    dev.synchronize(&stream).unwrap();
    free(next, MIB);
    assert_eq!(vrampool_release_pool(0, second.0, second.1), 0);
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 0, "both released, every block freed: both given back");
}

/// A graph replays into what its freed tensors held: the pool's pages stay mapped through
/// later requests placed elsewhere and through `empty_cache`, until the pool is released;
/// then they go.
fn freed_graph_memory_stays_mapped_until_the_pool_finishes() {
    let pool = (23, 0);
    let dev = registry::device(0).unwrap();
    let stream = registry::default_stream(0).unwrap();
    assert_eq!(vrampool_begin_allocate_to_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    // `small` freed, walled in by `wall`: `large` cannot go where it was.
    let small = to_pool(8 * MIB, pool);
    let wall = to_pool(8 * MIB, pool);
    assert!(small != 0 && wall != 0, "{:?}", last_error());
    free(small, 8 * MIB);
    let large = to_pool(64 * MIB, pool);
    assert_ne!(large, 0, "{:?}", last_error());
    free(large, 64 * MIB);
    free(wall, 8 * MIB);
    assert_eq!(vrampool_end_allocate_to_pool(0, pool.0, pool.1), 0);
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    for (p, len) in [(small, 8 * MIB), (large, 64 * MIB)] {
        dev.memset(p, 0x77, len, &stream).expect("a replay's memory is still mapped");
    }
    dev.synchronize(&stream).unwrap();
    assert_eq!(vrampool_release_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 0);
    assert!(
        dev.memset(small, 0, 4096, &stream).and_then(|_| dev.synchronize(&stream)).is_err(),
        "released memory is unmapped"
    );
}

/// A released pool whose blocks are freed holds device memory until `empty_cache`, or until
/// an allocation runs out of memory: that one gets it back, and succeeds.
fn an_allocation_out_of_memory_gets_the_released_pools_pages() {
    let pool = (41, 0);
    let big = 512 * MIB;
    assert_eq!(vrampool_begin_allocate_to_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    let g = to_pool(big, pool);
    assert_ne!(g, 0, "{:?}", last_error());
    free(g, big);
    assert_eq!(vrampool_end_allocate_to_pool(0, pool.0, pool.1), 0);
    assert_eq!(vrampool_release_pool(0, pool.0, pool.1), 0);
    assert_eq!(stat("graph_pools"), 1);
    // 1 GiB of device, half of it the released pool's: this needs that half.
    let p = malloc(640 * MIB);
    assert_eq!(stat("graph_pools"), 0, "the out-of-memory retry gave the pool back");
    free(p, 640 * MIB);
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
}

fn bad_graph_pool_calls_are_refused_and_change_nothing() {
    let pool = (9, 1);
    assert_ne!(vrampool_end_allocate_to_pool(0, pool.0, pool.1), 0, "no capture into it began");
    assert_ne!(vrampool_release_pool(0, pool.0, pool.1), 0, "it was never opened");
    assert_ne!(vrampool_begin_allocate_to_pool(-1, pool.0, pool.1), 0);
    assert_eq!(vrampool_begin_allocate_to_pool(0, pool.0, pool.1), 0, "{:?}", last_error());
    let p = to_pool(4096, pool);
    assert_ne!(p, 0, "{:?}", last_error());
    let frees = stat("abi_wrong_size_frees");
    free(p, 4097);
    assert!(last_error().unwrap().contains("size"), "a wrong size is refused");
    assert_eq!(stat("abi_wrong_size_frees"), frees + 1);
    // SAFETY: as in `to_pool`; a refused free changes nothing.
    unsafe { vrampool_free(p as *mut c_void, 4096, 0, SIDE as *mut c_void) };
    assert!(last_error().unwrap().contains("stream"), "a wrong stream is refused");
    free(p + 256, 4096);
    assert!(last_error().is_some(), "an interior pointer is refused");
    free(p, 4096);
    assert_eq!(last_error(), None, "the block is still whole after the refusals");
    free(p, 4096);
    assert!(last_error().unwrap().contains("double free"));
    // SAFETY: as in `to_pool`.
    assert_eq!(unsafe { vrampool_malloc_to_pool(-5, 0, STREAM as *mut c_void, pool.0, pool.1) }, std::ptr::null_mut());
    assert!(last_error().is_some());
    assert_eq!(vrampool_end_allocate_to_pool(0, pool.0, pool.1), 0);
    assert_eq!(vrampool_release_pool(0, pool.0, pool.1), 0);
    assert_ne!(vrampool_release_pool(0, pool.0, pool.1), 0, "a released pool is no longer open");
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("graph_pools"), 0);
}
