//! Stream capture on raw handles: whether a stream is being captured ([`raw_is_capturing`],
//! which the device's own capture checks use too), and a guard that puts the calling thread in
//! the relaxed capture mode ([`RelaxedCapture`]). The registry's stream keys and the C ABI call
//! them without a `CudaDevice`, which is why they are free functions here and not methods.

use cudarc::driver::sys;
use sys::CUresult;

use super::driver_error;
use crate::error::Result;

/// The calling thread's stream-capture mode set to RELAXED until the guard drops, then
/// set back. In the GLOBAL mode (PyTorch's default for graph capture) the driver refuses
/// `cuEventQuery` and `cuStreamQuery` on *every* thread while any thread captures, and the
/// refusal invalidates that capture; measured on an H200 (driver 580), the RELAXED mode
/// lets both run and the capture survives. PyTorch's caching allocator does the same
/// around its driver calls during capture.
pub(crate) struct RelaxedCapture(sys::CUstreamCaptureMode);

impl RelaxedCapture {
    /// `None` where the driver refuses the exchange (nothing to restore then).
    pub(crate) fn enter() -> Option<RelaxedCapture> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: the driver reads and writes one enum through the pointer; the call needs
        // no context.
        let rc = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        (rc == CUresult::CUDA_SUCCESS).then_some(RelaxedCapture(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.0;
        // SAFETY: as in `enter`; this puts back the mode `enter` took out.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

/// `cuStreamIsCapturing` on a raw handle: whether `raw` is being captured. Unlike
/// `cuStreamGetId`, which fails on a capturing stream and invalidates its capture (in every
/// capture mode, measured on an H200), this is allowed during capture.
pub(crate) fn raw_is_capturing(raw: u64) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller promised a live stream of the current context (or a special
    // handle); the driver validates it and writes one enum.
    let rc = unsafe { sys::cuStreamIsCapturing(raw as usize as sys::CUstream, &mut status) };
    match rc {
        CUresult::CUDA_SUCCESS => Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE),
        // The legacy stream while another stream captures in global mode: it cannot run.
        CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
        rc => Err(driver_error("cuStreamIsCapturing", rc)),
    }
}
