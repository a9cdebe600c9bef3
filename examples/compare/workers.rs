//! The allocators `compare` measures, behind one interface, so that every workload is the
//! same code for all of them: vrampool through a `StreamCache`, `cuMemAlloc`, `cuMemAllocAsync`,
//! the mutex best-fit and vrampool's C ABI. Each adapter only allocates, frees and waits for
//! its stream; the workloads and their timing are `main`'s.

use std::ffi::c_void;

use cudarc::driver::sys;
use vrampool::ffi::{vrampool_free, vrampool_malloc};
use vrampool::{Block, CudaDevice, Device, Stream, StreamCache};

use super::bestfit::BestFit;
use super::{abi_error, ck, die, or_die, BESTFIT_RANGE, GIB};

pub(super) trait Worker {
    type H;
    /// Pairs between two looks at the clock or the stop flag.
    const CHUNK: u64;
    fn alloc(&mut self, bytes: usize) -> Self::H;
    fn free(&mut self, h: Self::H);
    /// Wait until the work this worker enqueued is done.
    fn sync(&mut self);
}

/// vrampool through the calling thread's cache for its stream.
pub(super) struct Vram<'a> {
    pub(super) cache: StreamCache,
    pub(super) dev: &'a CudaDevice,
    pub(super) stream: &'a Stream,
}

impl Worker for Vram<'_> {
    type H = Block;
    const CHUNK: u64 = 64;
    #[inline(always)]
    fn alloc(&mut self, bytes: usize) -> Block {
        match self.cache.alloc(bytes) {
            Ok(b) => b,
            Err(e) => die(&format!("vrampool alloc of {bytes} B: {e}")),
        }
    }
    #[inline(always)]
    fn free(&mut self, b: Block) {
        drop(b);
    }
    fn sync(&mut self) {
        or_die("synchronize", self.dev.synchronize(self.stream));
    }
}

/// cuMemAlloc/cuMemFree: synchronous, no stream.
pub(super) struct CuMem;

impl Worker for CuMem {
    type H = u64;
    const CHUNK: u64 = 1;
    #[inline(always)]
    fn alloc(&mut self, bytes: usize) -> u64 {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; the context is current on this thread.
        ck("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) });
        p
    }
    #[inline(always)]
    fn free(&mut self, p: u64) {
        // SAFETY: `p` came from cuMemAlloc and is freed once; nothing uses it.
        ck("cuMemFree", unsafe { sys::cuMemFree_v2(p) });
    }
    fn sync(&mut self) {}
}

/// cuMemAllocAsync/cuMemFreeAsync on one stream, from the device's current (default) pool.
pub(super) struct CuAsync<'a> {
    pub(super) raw: sys::CUstream,
    pub(super) dev: &'a CudaDevice,
    pub(super) stream: &'a Stream,
}

impl<'a> CuAsync<'a> {
    pub(super) fn new(dev: &'a CudaDevice, stream: &'a Stream) -> Self {
        CuAsync { raw: stream.raw() as sys::CUstream, dev, stream }
    }
}

impl Worker for CuAsync<'_> {
    type H = u64;
    const CHUNK: u64 = 16;
    #[inline(always)]
    fn alloc(&mut self, bytes: usize) -> u64 {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: a live stream of the current context; writes one device pointer.
        ck("cuMemAllocAsync", unsafe { sys::cuMemAllocAsync(&mut p, bytes, self.raw) });
        p
    }
    #[inline(always)]
    fn free(&mut self, p: u64) {
        // SAFETY: `p` came from cuMemAllocAsync and is freed once, in stream order.
        ck("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(p, self.raw) });
    }
    fn sync(&mut self) {
        or_die("synchronize", self.dev.synchronize(self.stream));
    }
}

/// The mutex best-fit pool over a `cuMemAlloc` range; tracks the highest address it handed out.
pub(super) struct Bf<'a> {
    pub(super) bf: &'a BestFit,
    pub(super) high: u64,
}

impl Worker for Bf<'_> {
    type H = (u64, u64);
    const CHUNK: u64 = 64;
    #[inline(always)]
    fn alloc(&mut self, bytes: usize) -> (u64, u64) {
        let s = bytes as u64;
        match self.bf.alloc(s) {
            Some(a) => {
                self.high = self.high.max(a + s.next_multiple_of(256));
                (a, s)
            }
            None => die(&format!("best-fit: no room for {bytes} B in its {} GiB range", BESTFIT_RANGE / GIB)),
        }
    }
    #[inline(always)]
    fn free(&mut self, (a, s): (u64, u64)) {
        self.bf.free(a, s);
    }
    fn sync(&mut self) {}
}

/// vrampool through its C ABI: the registry's pool of GPU 0, this worker's `CUstream`.
pub(super) struct CAbi<'a> {
    pub(super) raw: u64,
    pub(super) dev: &'a CudaDevice,
    pub(super) stream: &'a Stream,
}

impl<'a> CAbi<'a> {
    pub(super) fn new(dev: &'a CudaDevice, stream: &'a Stream) -> Self {
        CAbi { raw: stream.raw(), dev, stream }
    }
}

impl Worker for CAbi<'_> {
    type H = (u64, usize);
    const CHUNK: u64 = 64;
    #[inline(always)]
    fn alloc(&mut self, bytes: usize) -> (u64, usize) {
        // SAFETY: a live stream of GPU 0's primary context, which the registry's pool uses.
        let p = unsafe { vrampool_malloc(bytes as isize, 0, self.raw as *mut c_void) };
        if p.is_null() {
            die(&format!("vrampool_malloc({bytes}): {}", abi_error()));
        }
        (p as u64, bytes)
    }
    #[inline(always)]
    fn free(&mut self, (p, bytes): (u64, usize)) {
        // SAFETY: allocated by `alloc` with this size, device and stream; freed once.
        unsafe { vrampool_free(p as *mut c_void, bytes as isize, 0, self.raw as *mut c_void) };
    }
    fn sync(&mut self) {
        or_die("synchronize", self.dev.synchronize(self.stream));
    }
}
