//! RAPIDS RMM's pool and arena resources, loaded from `librmm_shim.so`
//! (`benches/rmm/rmm_shim.cpp`, built on the GPU machine against RMM's headers by
//! `benches/rmm/build.sh`) with `dlopen`: RMM is a C++ header library, and the shim gives
//! `compare` its allocate and deallocate behind C functions. Without `--rmm` none of this
//! runs.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use cudarc::driver::sys;
use vrampool::{CudaDevice, Device, Stream};

use super::workers::Worker;
use super::{die, or_die};

type NewFn = unsafe extern "C" fn(c_int, usize) -> *mut c_void;
type DeleteFn = unsafe extern "C" fn(*mut c_void);
type AllocFn = unsafe extern "C" fn(*mut c_void, usize, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut c_void) -> c_int;
type ReservedFn = unsafe extern "C" fn(*mut c_void, c_int) -> usize;
type ErrorFn = unsafe extern "C" fn() -> *const c_char;

/// Which RMM resource (the shim's `kind`).
#[derive(Clone, Copy, Debug)]
pub(super) enum Kind {
    /// `pool_memory_resource` over `cudaMalloc`, starting empty.
    Pool = 0,
    /// `arena_memory_resource` over `cudaMalloc`, RMM's default arena size (half the free
    /// memory, taken up front).
    Arena = 1,
}

impl Kind {
    pub(super) const ALL: [Kind; 2] = [Kind::Pool, Kind::Arena];

    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Pool => "RMM pool",
            Kind::Arena => "RMM arena",
        }
    }
}

/// The shim's functions. The library stays loaded for the process's life.
pub(super) struct Lib {
    new: NewFn,
    delete: DeleteFn,
    alloc: AllocFn,
    free: FreeFn,
    reserved: ReservedFn,
    last_error: ErrorFn,
}

impl Lib {
    /// Load the shim at `path`, or say why not.
    pub(super) fn load(path: &str) -> Result<Lib, String> {
        let c = CString::new(path).map_err(|_| format!("{path}: a NUL in the path"))?;
        // SAFETY: a NUL-terminated path; the library's initialisers are RMM's and the C++
        // runtime's, which run no code of ours.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(format!("dlopen {path}: {}", dl_error()));
        }
        let sym = |name: &str| -> Result<*mut c_void, String> {
            let n = CString::new(name).map_err(|_| name.to_string())?;
            // SAFETY: `h` is a live handle (never closed); a NUL-terminated name.
            let p = unsafe { libc::dlsym(h, n.as_ptr()) };
            if p.is_null() {
                Err(format!("{path} lacks {name}"))
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol is the shim's `extern "C"` function of exactly this signature
        // (benches/rmm/rmm_shim.cpp).
        unsafe {
            Ok(Lib {
                new: std::mem::transmute::<*mut c_void, NewFn>(sym("vpbench_rmm_new")?),
                delete: std::mem::transmute::<*mut c_void, DeleteFn>(sym("vpbench_rmm_delete")?),
                alloc: std::mem::transmute::<*mut c_void, AllocFn>(sym("vpbench_rmm_alloc")?),
                free: std::mem::transmute::<*mut c_void, FreeFn>(sym("vpbench_rmm_free")?),
                reserved: std::mem::transmute::<*mut c_void, ReservedFn>(sym("vpbench_rmm_reserved")?),
                last_error: std::mem::transmute::<*mut c_void, ErrorFn>(sym("vpbench_rmm_last_error")?),
            })
        }
    }

    fn error(&self) -> String {
        // SAFETY: the shim returns this thread's message, NUL-terminated, valid until its
        // next call on this thread.
        unsafe { CStr::from_ptr((self.last_error)()) }.to_string_lossy().into_owned()
    }

    /// A fresh resource of `kind` on the current device (the primary context of GPU 0, which
    /// the CUDA runtime shares with the driver calls of this program).
    pub(super) fn resource(&self, kind: Kind) -> Resource<'_> {
        // SAFETY: the shim catches every exception; null on failure.
        let ptr = unsafe { (self.new)(kind as c_int, 0) };
        if ptr.is_null() {
            die(&format!("{}: {}", kind.name(), self.error()));
        }
        Resource { lib: self, ptr }
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a NUL-terminated message or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl call on this thread.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// One RMM resource; deleted (its memory given back to cudaMalloc) on drop, which must come
/// before the streams it served are destroyed.
pub(super) struct Resource<'a> {
    lib: &'a Lib,
    ptr: *mut c_void,
}

// SAFETY: RMM's pool and arena resources are thread-safe (a mutex, and per-thread arenas
// over a locked global one); the pointer is only passed to the shim.
unsafe impl Sync for Resource<'_> {}

impl Resource<'_> {
    /// Bytes it holds from cudaMalloc at most so far.
    pub(super) fn peak_reserved(&self) -> u64 {
        // SAFETY: a live resource.
        unsafe { (self.lib.reserved)(self.ptr, 1) as u64 }
    }
}

impl Drop for Resource<'_> {
    fn drop(&mut self) {
        // SAFETY: a live resource, deleted once; every block it handed out is freed by now.
        unsafe { (self.lib.delete)(self.ptr) }
    }
}

/// A thread's use of an RMM resource on its stream.
pub(super) struct Rmm<'a> {
    res: &'a Resource<'a>,
    raw: *mut c_void,
    dev: &'a CudaDevice,
    stream: &'a Stream,
}

impl<'a> Rmm<'a> {
    pub(super) fn new(res: &'a Resource<'a>, dev: &'a CudaDevice, stream: &'a Stream) -> Self {
        Rmm { res, raw: stream.raw() as sys::CUstream as *mut c_void, dev, stream }
    }
}

impl Worker for Rmm<'_> {
    type H = (u64, usize);
    const CHUNK: u64 = 64;
    #[inline(always)]
    fn alloc(&mut self, bytes: usize) -> (u64, usize) {
        // SAFETY: a live resource and a live stream of the current context.
        let p = unsafe { (self.res.lib.alloc)(self.res.ptr, bytes, self.raw) };
        if p.is_null() {
            die(&format!("RMM allocate({bytes}): {}", self.res.lib.error()));
        }
        (p as u64, bytes)
    }
    #[inline(always)]
    fn free(&mut self, (p, bytes): (u64, usize)) {
        // SAFETY: allocated by this resource with this size, freed once, in stream order.
        if unsafe { (self.res.lib.free)(self.res.ptr, p as *mut c_void, bytes, self.raw) } != 0 {
            die(&format!("RMM deallocate({bytes}): {}", self.res.lib.error()));
        }
    }
    fn sync(&mut self) {
        or_die("synchronize", self.dev.synchronize(self.stream));
    }
}
