//! A stream handle declared destroyed (`vrampool_stream_destroyed`) names a new stream from
//! then on, for every thread's allocations through the C ABI: none is served from a cache
//! of the old stream, which each thread's memo of the handle still points at. (A block
//! cached for the old stream was freed in its order; handed to the new stream, which does
//! not wait for the old one, it could be written while the old stream's work still reads
//! it.) On the simulator, where the handle's value is its key whatever the stream, so only
//! the memo's gate can tell; also for a stream the memo keeps among its recent ones. One
//! test: the registry is process-wide.

use std::ffi::c_void;
use std::sync::mpsc;

#[path = "support/cached_stream.rs"]
mod cached_stream;

use cached_stream::cached_stream;
use vrampool::ffi::*;
use vrampool::registry::{self, Config, DeviceChoice};
use vrampool::StreamId;

const SIZE: usize = 4096;

fn malloc(raw: u64) -> u64 {
    // SAFETY: the simulator takes any stream value.
    let p = unsafe { vrampool_malloc(SIZE as _, 0, raw as *mut c_void) };
    assert!(!p.is_null());
    p as u64
}

fn free(p: u64, raw: u64) {
    // SAFETY: a block this test allocated with the same size and stream.
    unsafe { vrampool_free(p as *mut c_void, SIZE as _, 0, raw as *mut c_void) };
}

fn id_of(raw: u64) -> StreamId {
    // SAFETY: as above.
    unsafe { registry::stream(0, raw) }.unwrap().id()
}

/// Allocate and free on `raw` until this thread's cache for it holds a block; returns the
/// address of the last block allocated (cached now).
fn warm(raw: u64) -> u64 {
    let blocks: Vec<u64> = (0..4).map(|_| malloc(raw)).collect();
    for &p in &blocks {
        free(p, raw);
    }
    blocks[3]
}

#[test]
fn a_handle_declared_destroyed_is_a_new_stream_for_every_thread() {
    let config = Config { device: DeviceChoice::Sim, sim_bytes: 1 << 30, ..Config::default() };
    registry::configure(config).unwrap();
    let (mine, theirs) = (0x5150u64, 0x5151u64);

    // Another thread's memo names `theirs`, with blocks cached for it; this thread's names
    // `mine`.
    let (to_them, from_me) = mpsc::channel::<()>();
    let (to_me, from_them) = mpsc::channel::<u64>();
    let them = std::thread::spawn(move || {
        to_me.send(warm(theirs)).unwrap();
        from_me.recv().unwrap();
        let p = malloc(theirs);
        free(p, theirs);
        to_me.send(p).unwrap();
        // Alive (with its cache) until the picture is taken.
        from_me.recv().unwrap();
    });
    let cached = from_them.recv().unwrap();
    let old_theirs = id_of(theirs);
    assert_eq!(cached_stream(cached), Some(old_theirs));
    warm(mine);
    let old_mine = id_of(mine);
    // This thread alternates with a second stream, so its memo keeps `mine` among its recent
    // streams; each block still lands on the stream it was asked on.
    let second = 0x5152u64;
    for _ in 0..3 {
        for raw in [second, mine] {
            let p = malloc(raw);
            free(p, raw);
            assert_eq!(cached_stream(p), Some(id_of(raw)), "{p:#x} on {raw:#x}");
        }
    }
    warm(second);

    // SAFETY: the simulator's streams are never destroyed under us.
    unsafe {
        assert_eq!(vrampool_stream_destroyed(0, theirs as *mut c_void), 0);
        assert_eq!(vrampool_stream_destroyed(0, mine as *mut c_void), 0);
    }
    to_them.send(()).unwrap();
    let p_theirs = from_them.recv().unwrap();
    let p_mine = malloc(mine);
    free(p_mine, mine);

    for (p, raw, old) in [(p_theirs, theirs, old_theirs), (p_mine, mine, old_mine)] {
        let new = id_of(raw);
        assert_ne!(new, old, "the handle names a new stream");
        assert_eq!(cached_stream(p), Some(new), "{p:#x}, allocated on {raw:#x} after its old stream was destroyed");
    }
    to_them.send(()).unwrap();
    them.join().unwrap();
}
