//! The C ABI on a real GPU: `CUstream` handles keyed by the driver's stream id (a handle
//! value reused by the driver names a new stream), blocks written by the device, frees on
//! other threads, `record_stream`, the legacy and per-thread default streams, and the
//! statistics back at zero. Ignored without a GPU (and skipped if none is found):
//! `cargo test --release --test ffi_cuda -- --ignored`.
#![cfg(feature = "cuda")]

#[path = "support/cached_stream.rs"]
mod cached_stream;
#[path = "support/cuda_registry.rs"]
mod cuda_registry;

use std::ffi::{c_void, CStr};

use cached_stream::cached_stream;
use cuda_registry::cuda_registry;
use vrampool::ffi::*;
use vrampool::registry;
use vrampool::{CudaDevice, Device, Stream};

const PER_THREAD: u64 = 0x2;

fn last_error() -> Option<String> {
    let p = vrampool_last_error();
    // SAFETY: a NUL-terminated string, valid until this thread's next call.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn malloc(size: usize, raw: u64) -> u64 {
    // SAFETY: `raw` is a live stream of GPU 0's primary context, or a special handle.
    let p = unsafe { vrampool_malloc(size as isize, 0, raw as *mut c_void) } as u64;
    assert!(p != 0, "vrampool_malloc({size}, stream {raw:#x}): {:?}", last_error());
    p
}

fn free(p: u64, size: usize, raw: u64) {
    // SAFETY: as in `malloc`; the block is freed once.
    unsafe { vrampool_free(p as *mut c_void, size as isize, 0, raw as *mut c_void) };
    assert_eq!(last_error(), None, "vrampool_free({p:#x})");
}

fn stat(key: &str) -> u64 {
    let mut buf = vec![0u8; 8192];
    // SAFETY: `buf` has its length writable.
    let n = unsafe { vrampool_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
    let json = std::str::from_utf8(&buf[..n]).unwrap();
    let pat = format!("\"{key}\":");
    let at = json.find(&pat).unwrap_or_else(|| panic!("no {key}: {json}")) + pat.len();
    json[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

/// Write `byte` over the block on `stream` and read it back.
fn touch(dev: &CudaDevice, p: u64, size: usize, byte: u8, stream: &Stream) {
    dev.memset(p, byte, size, stream).unwrap();
    let mut back = vec![0u8; size.min(4096)];
    dev.copy_from_device(&mut back, p, stream).unwrap();
    assert!(back.iter().all(|&b| b == byte));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_c_abi_on_cuda_streams() {
    let Some(dev) = cuda_registry() else { return };

    // Legacy default stream, and the calling thread's per-thread stream.
    let legacy = malloc(1 << 20, 0);
    free(legacy, 1 << 20, 0);
    let pt = malloc(4096, PER_THREAD);
    free(pt, 4096, PER_THREAD);

    // A handle value the driver reuses names a new stream for the registry.
    let s1 = dev.create_stream().unwrap();
    let h = s1.raw();
    // SAFETY: a live stream of the primary context.
    let first = unsafe { registry::stream(0, h) }.unwrap();
    let p = malloc(65536, h);
    touch(&dev, p, 65536, 0x5a, &s1);
    free(p, 65536, h);
    vrampool_empty_cache();
    // This thread's memo names `h`, with a block cached for it.
    let q = malloc(4096, h);
    free(q, 4096, h);
    assert_eq!(cached_stream(q), Some(first.id()));
    // SAFETY: s1 is still live.
    assert_eq!(unsafe { vrampool_stream_destroyed(0, h as usize as *mut c_void) }, 0, "{:?}", last_error());
    dev.destroy_stream(&s1).unwrap();
    let s2 = dev.create_stream().unwrap();
    if s2.raw() == h {
        // SAFETY: as above.
        let second = unsafe { registry::stream(0, h) }.unwrap();
        assert_ne!(first.id(), second.id(), "a reused handle value is a new stream");
        // The memo's hot path (no driver call) does not serve the old stream's cache.
        let q = malloc(4096, h);
        touch(&dev, q, 4096, 0x3c, &s2);
        free(q, 4096, h);
        assert_eq!(cached_stream(q), Some(second.id()), "allocated on the new stream");
    } else {
        eprintln!("the driver gave the new stream another handle: the reuse case was not run");
    }

    // Threads, each its own stream, freeing each other's blocks; record_stream.
    let streams: Vec<Stream> = (0..4).map(|_| dev.create_stream().unwrap()).collect();
    let blocks: Vec<Vec<(u64, usize, u64)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let dev = dev.clone();
                let other = streams[(i + 1) % streams.len()].raw();
                sc.spawn(move || {
                    dev.bind_context().unwrap();
                    let mut mine = Vec::new();
                    for k in 0..500 {
                        let size = 256 * (1 + (k * 31 + i) % 4000);
                        let p = malloc(size, s.raw());
                        if k % 50 == 0 {
                            touch(&dev, p, size, k as u8, s);
                        }
                        if k % 7 == 0 {
                            // SAFETY: a live block and a live stream of the context.
                            assert_eq!(unsafe { vrampool_record_stream(p as *mut c_void, other as *mut c_void) }, 0);
                        }
                        mine.push((p, size, s.raw()));
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Freed by threads that did not allocate them (those have exited), each with the
    // stream the block was allocated on.
    std::thread::scope(|sc| {
        for part in &blocks {
            let dev = dev.clone();
            sc.spawn(move || {
                dev.bind_context().unwrap();
                for &(p, size, raw) in part {
                    free(p, size, raw);
                }
            });
        }
    });
    for s in &streams {
        dev.synchronize(s).unwrap();
    }
    assert!(stat("abi_foreign_frees") > 0);
    assert_eq!(stat("allocated_bytes"), 0);
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
    assert_eq!(stat("allocated_bytes"), 0);
    assert_eq!(stat("reserved_bytes"), 0);
    assert_eq!(stat("abi_internal_errors"), 0);
    for s in streams.iter().chain([&s2]) {
        // SAFETY: the stream is still live.
        assert_eq!(unsafe { vrampool_stream_destroyed(0, s.raw() as usize as *mut c_void) }, 0, "{:?}", last_error());
        dev.destroy_stream(s).unwrap();
    }
    // Nothing touches the destroyed handles: an empty_cache after them is safe.
    assert_eq!(vrampool_empty_cache(), 0, "{:?}", last_error());
}
