//! `vrampool_snapshot` while threads allocate and free through the C ABI, on the simulator:
//! every picture covers its segments end to end in address order, however the pool moves
//! under it; and once the threads stop, every block they still hold is in it, one extent
//! each, with the bytes asked for and the stream it was allocated on, and nothing else is
//! live. (Each case against bad arguments is in `tests/c/abi_test.c`.)

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use vrampool::ffi::*;
use vrampool::registry::{self, Config, DeviceChoice};

const THREADS: usize = 4;

fn take() -> Vec<vrampool_extent> {
    let mut count = 0usize;
    // SAFETY: `count` is writable; no array with capacity 0.
    assert_eq!(unsafe { vrampool_snapshot(0, std::ptr::null_mut(), 0, &mut count) }, 0);
    loop {
        let mut out = Vec::with_capacity(count + 64);
        // SAFETY: room for `out.capacity()` extents, `count` writable.
        let rc = unsafe { vrampool_snapshot(0, out.as_mut_ptr(), out.capacity(), &mut count) };
        assert_eq!(rc, 0);
        if count <= out.capacity() {
            // SAFETY: the call wrote `count` extents.
            unsafe { out.set_len(count) };
            return out;
        }
    }
}

fn assert_covered(extents: &[vrampool_extent]) {
    let mut prev: Option<&vrampool_extent> = None;
    for e in extents {
        assert!(e.bytes > 0, "{e:?}");
        let same = prev.filter(|p| p.segment == e.segment && (p.pool_a, p.pool_b) == (e.pool_a, e.pool_b));
        match same {
            Some(p) => assert_eq!(e.addr, p.addr + p.bytes, "a gap or an overlap before {e:?}"),
            None => {
                if let Some(p) = prev {
                    assert_eq!(p.addr + p.bytes, p.segment + p.segment_bytes, "segment not covered: {p:?}");
                }
                assert_eq!(e.addr, e.segment, "segment not covered from its start: {e:?}");
            }
        }
        prev = Some(e);
    }
    if let Some(p) = prev {
        assert_eq!(p.addr + p.bytes, p.segment + p.segment_bytes, "segment not covered: {p:?}");
    }
}

/// A size from 1 B to 8 MiB, log-spread, from a xorshift state.
fn size(x: &mut u64) -> usize {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    let shift = *x % 23;
    1 + (*x >> 32) as usize % (1usize << shift)
}

#[test]
fn a_snapshot_shows_every_block_held_and_covers_memory_while_threads_run() {
    registry::configure(Config { device: DeviceChoice::Sim, sim_bytes: 2 << 30, ..Config::default() }).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (stop, started) = (stop.clone(), started.clone());
            std::thread::spawn(move || {
                let stream = (0x700 + t) as *mut c_void;
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                let mut held: Vec<(u64, usize)> = Vec::new();
                started.wait();
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) || rounds < 2_000 {
                    rounds += 1;
                    if held.len() < 24 {
                        let n = size(&mut x);
                        // SAFETY: simulator handles are opaque values.
                        let p = unsafe { vrampool_malloc(n as isize, 0, stream) } as u64;
                        assert_ne!(p, 0);
                        held.push((p, n));
                    } else {
                        let (p, n) = held.swap_remove((x % held.len() as u64) as usize);
                        // SAFETY: a block of ours, freed once with its size and stream.
                        unsafe { vrampool_free(p as *mut c_void, n as isize, 0, stream) };
                    }
                }
                (stream as u64, held)
            })
        })
        .collect();
    started.wait();
    let mut pictures = 0;
    while pictures < 40 {
        assert_covered(&take());
        pictures += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let held: Vec<(u64, Vec<(u64, usize)>)> = workers.into_iter().map(|w| w.join().unwrap()).collect();

    let quiet = take();
    assert_covered(&quiet);
    let live: Vec<_> = quiet.iter().filter(|e| e.state == vrampool_extent_state::VRAMPOOL_EXTENT_LIVE).collect();
    let mut expected: Vec<(u64, u64, u64)> =
        held.iter().flat_map(|(s, blocks)| blocks.iter().map(move |&(p, n)| (p, n as u64, *s))).collect();
    expected.sort_unstable();
    let shown: Vec<(u64, u64, u64)> = live.iter().map(|e| (e.addr, e.requested, e.stream as u64)).collect();
    assert_eq!(shown, expected, "the live extents of a quiet device are the blocks held");
    assert!(live.iter().all(|e| e.bytes >= e.requested));

    for (s, blocks) in held {
        for (p, n) in blocks {
            // SAFETY: as in the workers.
            unsafe { vrampool_free(p as *mut c_void, n as isize, 0, s as *mut c_void) };
        }
    }
    assert!(take().iter().all(|e| e.state != vrampool_extent_state::VRAMPOOL_EXTENT_LIVE));
}
