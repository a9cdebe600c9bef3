//! A downstream crate's view of `CudaBuffer`: compiled by every `cargo test` (no GPU needed),
//! this file is the proof that `&CudaBuffer<f32>` (and its views) is accepted wherever
//! cudarc 0.19 takes a `DevicePtr<f32>` or a `DevicePtrMut<f32>` and as a kernel argument.
//! It names cudarc only through `vrampool::cudarc`, as a server would. The functions below
//! are ordinary user code, type-checked by every build of this file (the GPU test at the end
//! calls them), and that test runs them and checks the numbers:
//! `cargo test --release --test cudarc_api -- --ignored --nocapture`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use vrampool::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, LaunchConfig,
    PushKernelArg,
};
use vrampool::{CudaBuffer, CudaBufferView, CudaBufferViewMut, Device};

/// What cudarc's generic copy functions ask of their device arguments.
fn takes_device_ptr<P: DevicePtr<f32>>(_: &P) {}
fn takes_device_ptr_mut<P: DevicePtrMut<f32>>(_: &mut P) {}

/// The trait bounds, checked where the compiler sees them.
#[test]
fn cuda_buffers_and_their_views_meet_cudarcs_slice_traits() {
    fn read<P: DevicePtr<f32>>() {}
    fn write<P: DevicePtrMut<f32>>() {}
    fn arg<'a, A>()
    where
        vrampool::cudarc::driver::LaunchArgs<'a>: PushKernelArg<A>,
    {
    }
    read::<CudaBuffer<'static, f32>>();
    write::<CudaBuffer<'static, f32>>();
    read::<CudaBufferView<'static, f32>>();
    read::<CudaBufferViewMut<'static, f32>>();
    write::<CudaBufferViewMut<'static, f32>>();
    arg::<&CudaBuffer<'static, f32>>();
    arg::<&mut CudaBuffer<'static, f32>>();
    arg::<&CudaBufferView<'static, f32>>();
    arg::<&mut CudaBufferViewMut<'static, f32>>();
}

/// htod into the buffer, zero its first half, dtoh it back: `memcpy_htod`, `memset_zeros`,
/// `memcpy_dtoh`, `clone_dtoh` on a buffer and on its views.
fn round_trip(stream: &Arc<CudaStream>, buf: &mut CudaBuffer<f32>, src: &[f32]) -> Result<Vec<f32>, DriverError> {
    takes_device_ptr(buf);
    takes_device_ptr_mut(buf);
    stream.memcpy_htod(src, buf)?;
    let half = buf.len() / 2;
    let mut head = buf.slice_mut(..half).expect("in bounds");
    stream.memset_zeros(&mut head)?;
    let tail = buf.slice(half..).expect("in bounds");
    let mut tail_host = vec![0.0f32; tail.len()];
    stream.memcpy_dtoh(&tail, &mut tail_host)?;
    let all = stream.clone_dtoh(buf)?;
    assert_eq!(all[half..], tail_host[..]);
    Ok(all)
}

/// `y = a * x` by a kernel, with both buffers as kernel arguments (`&` and `&mut`).
fn scale(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    x: &CudaBuffer<f32>,
    y: &mut CudaBuffer<f32>,
    a: f32,
) -> Result<(), DriverError> {
    let n = x.len();
    let cfg = LaunchConfig::for_num_elems(n as u32);
    let mut launch = stream.launch_builder(f);
    launch.arg(y).arg(x).arg(&a).arg(&n);
    // SAFETY: `scale(float* y, const float* x, float a, size_t n)` takes these four
    // arguments; both buffers hold `n` floats.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// A vrampool buffer and a cudarc slice in one copy, both ways (`memcpy_dtod`, `clone_dtod`).
fn mixed(stream: &Arc<CudaStream>, buf: &mut CudaBuffer<f32>, slice: &mut CudaSlice<f32>) -> Result<(), DriverError> {
    stream.memcpy_dtod(buf, slice)?;
    stream.memcpy_dtod(slice, buf)?;
    let copy: CudaSlice<f32> = stream.clone_dtod(buf)?;
    assert_eq!(copy.len(), DeviceSlice::len(&*buf));
    Ok(())
}

const SCALE_SRC: &str = r#"
extern "C" __global__ void scale(float* y, const float* x, float a, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
"#;

#[test]
#[ignore = "needs a CUDA GPU and NVRTC"]
fn the_downstream_functions_compute_the_right_numbers_on_the_gpu() {
    const N: usize = 100_003;
    let ctx = CudaContext::new(0).expect("this test needs a CUDA GPU");
    let dev = vrampool::CudaDevice::from_cudarc(&ctx).unwrap();
    let pool = vrampool::Pool::new(dev.clone(), vrampool::PoolConfig::default()).unwrap();
    let cs = ctx.new_stream().unwrap();
    let s = dev.wrap_cudarc_stream(&cs).unwrap();
    let ptx = vrampool::cudarc::nvrtc::compile_ptx(SCALE_SRC).expect("NVRTC");
    let f = ctx.load_module(ptx).unwrap().load_function("scale").unwrap();

    let src: Vec<f32> = (0..N).map(|i| i as f32 - 50_000.0).collect();
    let mut x = pool.alloc_cuda_buffer::<f32>(N, &s).unwrap();
    let got = round_trip(&cs, &mut x, &src).unwrap();
    let half = N / 2;
    assert!(got[..half].iter().all(|&v| v == 0.0), "the first half was zeroed");
    assert_eq!(got[half..], src[half..]);

    let mut y = pool.alloc_cuda_buffer::<f32>(N, &s).unwrap();
    scale(&cs, &f, &x, &mut y, -2.0).unwrap();
    let out = cs.clone_dtoh(&y).unwrap();
    assert!(out.iter().zip(&got).all(|(&o, &g)| o == -2.0 * g), "y = -2 x");

    let mut slice = cs.alloc_zeros::<f32>(N).unwrap();
    mixed(&cs, &mut y, &mut slice).unwrap();
    assert_eq!(cs.clone_dtoh(&slice).unwrap(), out);
    cs.synchronize().unwrap();
    ctx.check_err().unwrap();
    drop((x, y));
    pool.trim().unwrap();
    pool.check().unwrap();
    println!("{}: buffers of {N} floats through cudarc's copies, memset and a kernel", dev.name());
}
