//! The C ABI as the benches call it: the registry on the simulator, and `malloc`/`free`
//! through the exported functions on device 0's default stream (NULL). Included by path
//! from bench files.
#![allow(dead_code)]

use std::ffi::c_void;

use vrampool::ffi::{vrampool_free, vrampool_free_any, vrampool_last_error, vrampool_malloc};
use vrampool::registry::{self, Config, DeviceChoice};

const NULL: *mut c_void = std::ptr::null_mut();

/// Point the registry at the simulator, as large as benches/pool.rs's (a random window's
/// peak fits many times). Before the registry's first use.
pub fn setup() {
    let config = Config { device: DeviceChoice::Sim, sim_bytes: 64 << 30, ..Config::default() };
    registry::configure(config).expect("the bench configures the registry before its first use");
}

/// `vrampool_malloc(size, 0, NULL)`, which must succeed.
pub fn malloc(size: usize) -> *mut c_void {
    // SAFETY: the simulator takes any stream value; NULL is its default stream.
    let p = unsafe { vrampool_malloc(size as isize, 0, NULL) };
    if p.is_null() {
        // SAFETY: a NUL-terminated string the library keeps until this thread's next call.
        let why = unsafe { std::ffi::CStr::from_ptr(vrampool_last_error()) };
        panic!("vrampool_malloc({size}) failed: {}", why.to_string_lossy());
    }
    p
}

/// `vrampool_free(p, size, 0, NULL)` of a block from [`malloc`].
pub fn free(p: *mut c_void, size: usize) {
    // SAFETY: a block of this size from `malloc` on the same device and stream.
    unsafe { vrampool_free(p, size as isize, 0, NULL) }
}

/// `vrampool_free_any(p, ...)` of a block from [`malloc`] (by its address alone, as the
/// PyTorch allocator's deleter frees), which must succeed.
pub fn free_any(p: *mut c_void) {
    // SAFETY: a live block from `malloc`; no size, device or stream is asked back.
    let rc = unsafe { vrampool_free_any(p, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(rc, 0, "vrampool_free_any");
}
