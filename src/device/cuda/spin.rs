//! The spin kernel behind `CudaDevice`'s [`Device::spin`](crate::Device::spin): one thread
//! that reads the GPU's global nanosecond timer until the asked time has passed, so a stream
//! is busy for that long on the device, not on a host thread.
//!
//! It is compiled once per device, on first use, by NVRTC when `libnvrtc` is present, and
//! otherwise taken from the same kernel written by hand in PTX (the GPU machine may have the
//! driver only); the module lives as long as the device and is unloaded with it.

use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys;

use super::check;
use crate::error::{Error, Result};

const CUDA_SRC: &str = r#"
extern "C" __global__ void vrampool_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"#;

/// The same kernel by hand, for machines without NVRTC.
const PTX_SRC: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry vrampool_spin(
    .param .u64 vrampool_spin_ns
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [vrampool_spin_ns];
    mov.u64 %rd2, %globaltimer;
$Lspin:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra.uni $Lspin;
    ret;
}
"#;

/// The loaded module and its one function (raw handles as integers, as in `CudaInner`).
pub(super) struct SpinKernel {
    module: usize,
    function: usize,
    /// "NVRTC" or "hand-written PTX".
    pub(super) source: &'static str,
}

/// NVRTC's PTX for the kernel, or why there is none.
fn compile() -> std::result::Result<String, String> {
    // SAFETY: only tries to open the library and drops it again.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("libnvrtc not found".into());
    }
    // cudarc panics on a missing NVRTC symbol: a panic is one more reason to use the PTX.
    match catch_unwind(AssertUnwindSafe(|| cudarc::nvrtc::compile_ptx(CUDA_SRC).map(|p| p.to_src()))) {
        Ok(Ok(ptx)) => Ok(ptx),
        Ok(Err(e)) => Err(format!("NVRTC failed: {e:?}")),
        Err(_) => Err("NVRTC could not be used".into()),
    }
}

impl SpinKernel {
    /// Compile and load the kernel into the current context (the caller has bound it).
    pub(super) fn load() -> Result<SpinKernel> {
        let (ptx, source) = match compile() {
            Ok(ptx) => (ptx, "NVRTC"),
            Err(_) => (PTX_SRC.to_string(), "hand-written PTX"),
        };
        let image = CString::new(ptx).map_err(|_| Error::InvalidArgument("the spin kernel's PTX has a NUL".into()))?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; the caller bound our context.
        check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) })?;
        let name = c"vrampool_spin";
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: a live module and a NUL-terminated name.
        let found =
            check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut function, module, name.as_ptr()) });
        if let Err(e) = found {
            // SAFETY: loaded just above, and nothing was launched from it.
            unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(SpinKernel { module: module as usize, function: function as usize, source })
    }

    /// Enqueue `ns` nanoseconds of spinning on `stream` (the caller has bound our context and
    /// checked the stream).
    pub(super) fn launch(&self, stream: sys::CUstream, ns: u64) -> Result<()> {
        let mut ns = ns;
        let mut params = [(&mut ns as *mut u64).cast::<c_void>()];
        // SAFETY: the function is live for as long as self; its one parameter is a u64, which
        // `params` points at; the driver copies the parameters before returning.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.function as sys::CUfunction,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Unload the module (the caller has bound our context, and no launch is still queued:
    /// the device is being dropped, so no stream of it is left).
    pub(super) fn unload(&self) {
        // SAFETY: our module, unloaded once, from the device's drop.
        unsafe { sys::cuModuleUnload(self.module as sys::CUmodule) };
    }
}
