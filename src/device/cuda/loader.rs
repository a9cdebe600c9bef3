//! Loading the CUDA driver and naming its errors: every driver symbol the `cuda` module calls,
//! the check that they all resolve before the first call, and the driver's result codes as
//! vrampool's [`Error`]s.
//!
//! - **Loading never panics.** cudarc's loader panics when `libcuda` or one of its symbols is
//!   missing, so [`CudaDevice::new`](super::CudaDevice::new) first checks that the library
//!   loads and that every symbol the `cuda` module calls resolves; only then does it call the
//!   driver. Without a driver it returns [`Error::NoDevice`] and
//!   [`auto`](crate::device::auto) falls back to the simulator.

use std::ffi::CStr;
use std::panic::catch_unwind;

use cudarc::driver::sys;
use sys::CUresult;

use crate::error::{Error, Result};

/// Every driver symbol the `cuda` module calls. cudarc's loader
/// panics on a missing one, so they are all looked up before the first call.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamIsCapturing",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuLaunchHostFunc",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemsetD8Async",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemRelease",
    "cuMemUnmap",
    "cuMemRetainAllocationHandle",
    "cuCtxSynchronize",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// Whether the driver library loads and has every symbol we call; `Err` says what is missing.
pub(super) fn driver_present() -> Result<(), String> {
    match missing_symbols(SYMBOLS)? {
        missing if missing.is_empty() => Ok(()),
        missing => Err(format!("the CUDA driver is too old: it lacks {}", missing.join(", "))),
    }
}

/// Which of `names` the CUDA driver library lacks; `Err` if it cannot be loaded at all.
/// cudarc panics when a symbol it calls is missing: look first, for any driver function a
/// program means to call directly.
pub fn missing_symbols<'a>(names: &[&'a str]) -> Result<Vec<&'a str>, String> {
    // SAFETY: is_culib_present only tries to open the library and drops it again.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda) is not installed or not on the library path".into());
    }
    // Loading was just shown to work, so culib() will not take its panicking branch; the
    // catch is a second line of defence should the library vanish in between.
    catch_unwind(|| {
        // SAFETY: culib opens the driver library once, for the life of the process.
        let lib = unsafe { sys::culib() };
        names
            .iter()
            // SAFETY: the symbol is only looked up, never called through this type.
            .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
            .copied()
            .collect::<Vec<_>>()
    })
    .map_err(|_| "the CUDA driver library could not be loaded".to_string())
}

/// The driver's name and words for `rc` ("CUDA_ERROR_OUT_OF_MEMORY: out of memory").
pub(super) fn describe(rc: CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string (or leave it alone on failure);
    // the library is loaded, since no CUresult exists before the driver was found.
    let (rn, rt) = unsafe { (sys::cuGetErrorName(rc, &mut name), sys::cuGetErrorString(rc, &mut text)) };
    let read = |ok: bool, p: *const std::ffi::c_char| {
        if ok && !p.is_null() {
            // SAFETY: the driver returned a pointer to a NUL-terminated static string.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        } else {
            None
        }
    };
    let ok = |r: CUresult| r == CUresult::CUDA_SUCCESS;
    match (read(ok(rn), name), read(ok(rt), text)) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        (Some(n), None) => n,
        (None, Some(t)) => t,
        (None, None) => format!("{rc:?}"),
    }
}

pub(super) fn driver_error(call: &'static str, rc: CUresult) -> Error {
    use CUresult::*;
    match rc {
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        | CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        | CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        | CUDA_ERROR_CAPTURED_EVENT => Error::StreamCapturing,
        _ => Error::Device { call, code: rc as i64, message: describe(rc).into() },
    }
}

pub(super) fn check(call: &'static str, rc: CUresult) -> Result<()> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, rc))
    }
}
