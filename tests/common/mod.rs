//! Helpers for the GPU tests: a device, two test kernels and their launch.
//!
//! The kernels are compiled with NVRTC when `libnvrtc` is present; otherwise the same kernels,
//! written by hand in PTX, are used, so the tests need only the driver.
#![allow(dead_code)]

use std::ffi::{c_void, CString};
use std::time::Instant;

use cudarc::driver::sys;
use vrampool::{CudaDevice, Stream};

/// GPU 0; panics (these tests are `#[ignore]`d and need one).
pub fn device() -> CudaDevice {
    match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => panic!("this test needs a CUDA GPU: {e}"),
    }
}

pub fn ok(call: &str, rc: sys::CUresult) {
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "{call} failed");
}

/// The value `fill` writes at word `i`.
pub fn pattern(i: usize, seed: u32) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ seed
}

/// The test kernels in CUDA C, for NVRTC: `fill` and `check`.
pub const CUDA_SRC: &str = r#"
extern "C" __global__ void fill(unsigned int* p, size_t n, unsigned int seed) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        p[i] = ((unsigned int)i * 2654435761u) ^ seed;
}
extern "C" __global__ void check(const unsigned int* p, size_t n, unsigned int seed, unsigned int* bad) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned int local = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        if (p[i] != (((unsigned int)i * 2654435761u) ^ seed)) local++;
    if (local) atomicAdd(bad, local);
}
"#;

/// The same two kernels by hand, for machines without NVRTC.
pub const PTX_SRC: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry fill(
    .param .u64 fill_p,
    .param .u64 fill_n,
    .param .u32 fill_seed
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [fill_p];
    ld.param.u64 %rd2, [fill_n];
    ld.param.u32 %r1, [fill_seed];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd3, %r2, %r3;
    cvt.u64.u32 %rd4, %r4;
    add.u64 %rd3, %rd3, %rd4;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd5, %r5, %r3;
$Lfill_loop:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra $Lfill_done;
    cvt.u32.u64 %r6, %rd3;
    mul.lo.s32 %r6, %r6, -1640531535;
    xor.b32 %r6, %r6, %r1;
    shl.b64 %rd6, %rd3, 2;
    add.u64 %rd7, %rd1, %rd6;
    st.global.u32 [%rd7], %r6;
    add.u64 %rd3, %rd3, %rd5;
    bra.uni $Lfill_loop;
$Lfill_done:
    ret;
}

.visible .entry check(
    .param .u64 check_p,
    .param .u64 check_n,
    .param .u32 check_seed,
    .param .u64 check_bad
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [check_p];
    ld.param.u64 %rd2, [check_n];
    ld.param.u32 %r1, [check_seed];
    ld.param.u64 %rd8, [check_bad];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd8, %rd8;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd3, %r2, %r3;
    cvt.u64.u32 %rd4, %r4;
    add.u64 %rd3, %rd3, %rd4;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd5, %r5, %r3;
    mov.u32 %r7, 0;
$Lcheck_loop:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra $Lcheck_end;
    cvt.u32.u64 %r6, %rd3;
    mul.lo.s32 %r6, %r6, -1640531535;
    xor.b32 %r6, %r6, %r1;
    shl.b64 %rd6, %rd3, 2;
    add.u64 %rd7, %rd1, %rd6;
    ld.global.u32 %r8, [%rd7];
    setp.ne.u32 %p2, %r8, %r6;
    selp.u32 %r9, 1, 0, %p2;
    add.u32 %r7, %r7, %r9;
    add.u64 %rd3, %rd3, %rd5;
    bra.uni $Lcheck_loop;
$Lcheck_end:
    setp.eq.u32 %p1, %r7, 0;
    @%p1 bra $Lcheck_done;
    atom.global.add.u32 %r9, [%rd8], %r7;
$Lcheck_done:
    ret;
}
"#;

/// The `fill` and `check` kernels, loaded into the device's primary context.
pub struct Kernels {
    dev: CudaDevice,
    module: sys::CUmodule,
    fill: sys::CUfunction,
    check: sys::CUfunction,
    /// "NVRTC" or "hand-written PTX".
    pub source: &'static str,
}

const BLOCKS: u32 = 1024;
const THREADS: u32 = 256;

impl Kernels {
    pub fn load(dev: &CudaDevice) -> Kernels {
        // SAFETY: only tries to open the library.
        let have_nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        // VRAMPOOL_TEST_PTX=1 forces the hand-written kernels, to test them where NVRTC exists.
        let have_nvrtc = have_nvrtc && std::env::var_os("VRAMPOOL_TEST_PTX").is_none();
        let compiled = if have_nvrtc {
            let t = Instant::now();
            // cudarc panics on a missing NVRTC symbol; either failure falls back to the PTX.
            match std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx(CUDA_SRC)) {
                Ok(Ok(ptx)) => {
                    println!("kernels compiled by NVRTC in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
                    Some(ptx.to_src())
                }
                Ok(Err(e)) => {
                    println!("NVRTC failed ({e:?}): using the hand-written PTX kernels");
                    None
                }
                Err(_) => {
                    println!("NVRTC could not be used: using the hand-written PTX kernels");
                    None
                }
            }
        } else {
            println!("libnvrtc not found (or VRAMPOOL_TEST_PTX set): using the hand-written PTX kernels");
            None
        };
        let (ptx, source) = match compiled {
            Some(ptx) => (ptx, "NVRTC"),
            None => (PTX_SRC.to_string(), "hand-written PTX"),
        };
        let image = CString::new(ptx).expect("PTX contains a NUL");
        dev.bind_context().expect("bind the primary context");
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; our context is current.
        ok("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) });
        let get = |name: &str| {
            let cname = CString::new(name).unwrap();
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: a live module and a NUL-terminated name.
            ok("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut f, module, cname.as_ptr()) });
            f
        };
        let (fill, check) = (get("fill"), get("check"));
        Kernels { dev: dev.clone(), module, fill, check, source }
    }

    fn launch(&self, f: sys::CUfunction, stream: &Stream, params: &mut [*mut c_void]) {
        self.dev.bind_context().expect("bind the primary context");
        // SAFETY: `params` point at locals of the caller that match the kernel's signature;
        // the driver copies them before returning.
        ok("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                BLOCKS,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream.raw() as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        });
    }

    /// `p[i] = pattern(i, seed)` for `i < n` (u32 words), on `stream`.
    pub fn fill(&self, stream: &Stream, p: u64, n: usize, seed: u32) {
        let (mut p, mut n, mut seed) = (p, n as u64, seed);
        let mut params =
            [(&mut p as *mut u64).cast::<c_void>(), (&mut n as *mut u64).cast(), (&mut seed as *mut u32).cast()];
        self.launch(self.fill, stream, &mut params);
    }

    /// `*bad += |{ i < n : p[i] != pattern(i, seed) }|`, on `stream`.
    pub fn check(&self, stream: &Stream, p: u64, n: usize, seed: u32, bad: u64) {
        let (mut p, mut n, mut seed, mut bad) = (p, n as u64, seed, bad);
        let mut params = [
            (&mut p as *mut u64).cast::<c_void>(),
            (&mut n as *mut u64).cast(),
            (&mut seed as *mut u32).cast(),
            (&mut bad as *mut u64).cast(),
        ];
        self.launch(self.check, stream, &mut params);
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if self.dev.bind_context().is_ok() {
            // SAFETY: the module is ours; tests synchronize before dropping the kernels.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

/// Median, mean and minimum of samples in µs.
pub fn stats(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(|a, b| a.total_cmp(b));
    let n = samples.len();
    let median = if n % 2 == 1 { samples[n / 2] } else { (samples[n / 2 - 1] + samples[n / 2]) / 2.0 };
    let mean = samples.iter().sum::<f64>() / n as f64;
    (median, mean, samples[0])
}

/// Microseconds since `t`.
pub fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}
