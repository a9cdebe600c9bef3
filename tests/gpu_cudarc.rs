//! `CudaBuffer` through cudarc on a real GPU: a buffer written by a kernel on stream A and
//! read on stream B with no synchronization by the user must read what A wrote, and its
//! memory must not be reused before B's read is done, however soon it is dropped. Every test
//! is ignored by default; run them with
//! `cargo test --release --test gpu_cudarc -- --ignored --nocapture --test-threads=1`.
//!
//! How a premature reuse would show: B is made slow (a spin kernel) before its read, the
//! buffer is dropped at once, and a new buffer of the same size is allocated on A (where the
//! thread cache hands back the block just freed, when nothing says otherwise) and written
//! with another pattern. A's work runs while B spins, so a read that the pool did not hold
//! the memory for sees the second pattern. A control runs the same sequence with the read
//! made behind vrampool's back (a raw copy, no record) and must see it.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::pattern;
use vrampool::cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use vrampool::cudarc::nvrtc::Ptx;
use vrampool::{CudaBuffer, CudaDevice, Device, Pool, PoolConfig, Stream};

/// The spin kernel: busy for `cycles` clock ticks, one thread.
const SPIN_SRC: &str = r#"
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"#;

/// The same by hand, for machines without NVRTC.
const SPIN_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry spin(
    .param .u64 spin_cycles
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [spin_cycles];
    mov.u64 %rd2, %clock64;
$Lspin:
    mov.u64 %rd3, %clock64;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.s64 %p1, %rd4, %rd1;
    @%p1 bra $Lspin;
    ret;
}
"#;

/// CUDA C through NVRTC when it is there and works, else the hand-written PTX.
fn module(ctx: &Arc<CudaContext>, cuda: &str, ptx: &str) -> (Arc<CudaModule>, &'static str) {
    // SAFETY: only tries to open the library.
    let have_nvrtc =
        unsafe { vrampool::cudarc::nvrtc::sys::is_culib_present() } && std::env::var_os("VRAMPOOL_TEST_PTX").is_none();
    // cudarc panics on a missing NVRTC symbol; either failure falls back to the PTX.
    let compiled = have_nvrtc
        .then(|| std::panic::catch_unwind(|| vrampool::cudarc::nvrtc::compile_ptx(cuda)).ok().and_then(Result::ok))
        .flatten();
    match compiled {
        Some(p) => (ctx.load_module(p).expect("load the NVRTC module"), "NVRTC"),
        None => (ctx.load_module(Ptx::from_src(ptx)).expect("load the PTX module"), "hand-written PTX"),
    }
}

/// One pool on GPU 0 and two cudarc streams, A and B, with the test kernels.
struct Kit {
    ctx: Arc<CudaContext>,
    dev: CudaDevice,
    pool: Pool,
    a: Arc<CudaStream>,
    b: Arc<CudaStream>,
    sa: Stream,
    fill: CudaFunction,
    check: CudaFunction,
    spin: CudaFunction,
    /// Clock ticks per millisecond of the spin kernel.
    ticks_per_ms: i64,
}

impl Kit {
    /// `wrap_b`: whether B is made known to vrampool (the asynchronous path) or not (the
    /// guard then synchronizes B).
    fn new(wrap_b: bool) -> Kit {
        let ctx = CudaContext::new(0).expect("this test needs a CUDA GPU");
        let dev = CudaDevice::from_cudarc(&ctx).unwrap();
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let (a, b) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let sa = dev.wrap_cudarc_stream(&a).unwrap();
        if wrap_b {
            dev.wrap_cudarc_stream(&b).unwrap();
        }
        let (m, from) = module(&ctx, common::CUDA_SRC, common::PTX_SRC);
        let (sm, _) = module(&ctx, SPIN_SRC, SPIN_PTX);
        let khz = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).unwrap();
        println!("{}; kernels from {from}; clock {} MHz", dev.name(), khz / 1000);
        Kit {
            fill: m.load_function("fill").unwrap(),
            check: m.load_function("check").unwrap(),
            spin: sm.load_function("spin").unwrap(),
            ticks_per_ms: i64::from(khz),
            ctx,
            dev,
            pool,
            a,
            b,
            sa,
        }
    }

    fn fill(&self, stream: &Arc<CudaStream>, buf: &mut CudaBuffer<u32>, seed: u32) {
        let n = buf.len();
        let cfg = LaunchConfig { grid_dim: (1024, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: fill(unsigned* p, size_t n, unsigned seed); the buffer holds n words.
        unsafe { stream.launch_builder(&self.fill).arg(buf).arg(&n).arg(&seed).launch(cfg) }.unwrap();
    }

    /// Keep `stream` busy for about `ms` milliseconds.
    fn spin(&self, stream: &Arc<CudaStream>, ms: i64) {
        let cycles = ms * self.ticks_per_ms;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: spin(long long cycles).
        unsafe { stream.launch_builder(&self.spin).arg(&cycles).launch(cfg) }.unwrap();
    }

    /// Page-locked host memory (cacheable: the host reads it word by word), so that a copy
    /// into it is asynchronous.
    fn pinned(&self, n: usize) -> PinnedHostSlice<u32> {
        // SAFETY: the memory is written by a copy before anything reads it.
        unsafe { self.ctx.alloc_pinned_with_flags::<u32>(n, 0) }.unwrap()
    }

    /// No error recorded by cudarc, nothing left in the pool.
    fn finish(self) {
        self.a.synchronize().unwrap();
        self.b.synchronize().unwrap();
        self.ctx.check_err().unwrap();
        self.pool.trim().unwrap();
        self.pool.check().unwrap();
        let st = self.pool.stats();
        assert_eq!((st.live_blocks, st.reserved_bytes), (0, 0), "{st:?}");
    }
}

/// Words of a buffer size: 64 KiB to 6 MiB, some not a multiple of 256 bytes.
const SIZES: [usize; 6] = [16_384, 65_537, 250_000, 262_144, 1 << 20, 1_572_867];

/// How many words of `got` differ from `pattern(_, seed)`.
fn mismatches(got: &[u32], seed: u32) -> usize {
    got.iter().enumerate().filter(|&(i, &w)| w != pattern(i, seed)).count()
}

/// The sequence of the module docs, `rounds` times per size: A slow then writing x; B slow
/// then reading x (through `read`, which must make B wait for A); x dropped; y allocated on
/// A and written with another pattern. Returns, per round, the words of B's read that are not
/// x's pattern, and whether y got x's address.
fn race(
    kit: &Kit,
    rounds: usize,
    read: impl Fn(&Kit, &CudaBuffer<u32>, &mut PinnedHostSlice<u32>),
) -> Vec<(usize, bool)> {
    let mut out = Vec::new();
    for &n in &SIZES {
        let mut host = kit.pinned(n);
        for r in 0..rounds {
            let (s1, s2) = (0x1000 + r as u32, 0xdead_0000 + r as u32);
            let mut x = kit.pool.alloc_cuda_buffer::<u32>(n, &kit.sa).unwrap();
            kit.spin(&kit.a, 20);
            kit.fill(&kit.a, &mut x, s1);
            kit.spin(&kit.b, 40);
            read(kit, &x, &mut host);
            let x_at = x.cu_device_ptr();
            drop(x);
            let mut y = kit.pool.alloc_cuda_buffer::<u32>(n, &kit.sa).unwrap();
            kit.fill(&kit.a, &mut y, s2);
            let reused = y.cu_device_ptr() == x_at;
            // Only now, with y written, does the host wait for B, to read what B read.
            kit.b.synchronize().unwrap();
            let bad = mismatches(host.as_slice().unwrap(), s1);
            // y holds its own pattern in every case.
            assert_eq!(mismatches(&kit.a.clone_dtoh(&y).unwrap(), s2), 0, "y's pattern, size {n}, round {r}");
            out.push((bad, reused));
        }
    }
    out
}

fn report(what: &str, rounds: &[(usize, bool)], took: f64) {
    let bad = rounds.iter().filter(|r| r.0 > 0).count();
    let reused = rounds.iter().filter(|r| r.1).count();
    println!(
        "{what}: {} rounds in {took:.2} s, {bad} with a wrong read, {reused} where the next buffer on A got the same address",
        rounds.len()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_read_on_another_stream_sees_the_write_and_holds_the_memory_until_done() {
    let kit = Kit::new(true);
    let t = Instant::now();
    // memcpy_dtoh into pinned memory: asynchronous, so B's read is still queued behind the
    // spin when the buffer is dropped.
    let rounds = race(&kit, 4, |k, x, host| k.b.memcpy_dtoh(x, host).unwrap());
    report("tracked read on B (wrapped)", &rounds, t.elapsed().as_secs_f64());
    for (i, &(bad, _)) in rounds.iter().enumerate() {
        assert_eq!(bad, 0, "round {i}: B read {bad} words that are not what A wrote");
    }

    // The control: the same sequence, B ordered after A by hand but its read made with a raw
    // copy that vrampool cannot see. The block goes back to A's cache at once and y's pattern
    // lands before B reads: the test can tell a premature reuse.
    let t = Instant::now();
    let control = race(&kit, 2, |k, x, host| {
        k.b.join(&k.a).unwrap();
        let dst = host.as_mut_slice().unwrap();
        // SAFETY: a live buffer of `dst.len()` words, copied into pinned memory that `race`
        // reads only after synchronizing B.
        unsafe { vrampool::cudarc::driver::result::memcpy_dtoh_async(dst, x.cu_device_ptr(), k.b.cu_stream()) }
            .unwrap();
    });
    report("control: untracked raw read on B", &control, t.elapsed().as_secs_f64());
    assert!(
        control.iter().all(|&(bad, reused)| reused && bad > 0),
        "the control did not see the early reuse (spin too short for this GPU?): {control:?}"
    );
    kit.finish();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_read_on_a_stream_vrampool_never_saw_is_made_safe_by_synchronizing() {
    let kit = Kit::new(false);
    let t = Instant::now();
    let rounds = race(&kit, 2, |k, x, host| k.b.memcpy_dtoh(x, host).unwrap());
    report("read on B (not wrapped: the guard synchronizes B)", &rounds, t.elapsed().as_secs_f64());
    assert!(rounds.iter().all(|&(bad, _)| bad == 0), "{rounds:?}");
    kit.finish();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_kernel_on_another_stream_after_use_on_reads_the_write_and_holds_the_memory() {
    let kit = Kit::new(true);
    let sb = kit.dev.wrap_cudarc_stream(&kit.b).unwrap();
    let bad = kit.pool.alloc_cuda_zeroed::<u32>(1, &sb).unwrap();
    let mut reused = 0;
    for (r, &n) in SIZES.iter().cycle().take(24).enumerate() {
        let (s1, s2) = (0x5000 + r as u32, 0xbeef_0000 + r as u32);
        let mut x = kit.pool.alloc_cuda_buffer::<u32>(n, &kit.sa).unwrap();
        kit.spin(&kit.a, 10);
        kit.fill(&kit.a, &mut x, s1);
        kit.spin(&kit.b, 30);
        x.use_on(&kit.b).unwrap();
        let cfg = LaunchConfig { grid_dim: (1024, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: check(const unsigned* p, size_t n, unsigned seed, unsigned* bad).
        unsafe { kit.b.launch_builder(&kit.check).arg(&x).arg(&n).arg(&s1).arg(&bad).launch(cfg) }.unwrap();
        let x_at = x.cu_device_ptr();
        drop(x);
        let mut y = kit.pool.alloc_cuda_buffer::<u32>(n, &kit.sa).unwrap();
        reused += usize::from(y.cu_device_ptr() == x_at);
        kit.fill(&kit.a, &mut y, s2);
    }
    let found = kit.b.clone_dtoh(&bad).unwrap()[0];
    println!("check kernels on B after use_on: {found} wrong words, {reused} of 24 next buffers at the same address");
    assert_eq!(found, 0, "a kernel on B saw words that are not what A wrote");
    let unknown = kit.ctx.new_stream().unwrap();
    let x = kit.pool.alloc_cuda_buffer::<u32>(16, &kit.sa).unwrap();
    assert!(x.use_on(&unknown).is_err(), "a use on a stream vrampool never saw cannot be recorded");
    drop((x, bad));
    kit.finish();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn streams_go_between_cudarc_and_vrampool_with_one_identity() {
    let kit = Kit::new(true);
    let again = kit.dev.wrap_cudarc_stream(&kit.a).unwrap();
    assert_eq!(again.id(), kit.sa.id(), "one cudarc stream, one vrampool stream");
    assert!(Arc::ptr_eq(again.cudarc_stream().unwrap(), &kit.a));

    // A stream made through vrampool's cudarc path, and one vrampool made and lent to cudarc.
    let made = kit.dev.create_cudarc_stream(&kit.ctx).unwrap();
    let cache = kit.pool.stream_cache(&made).unwrap();
    let mut buf = cache.alloc_cuda_buffer::<u32>(4096).unwrap();
    let cs = made.cudarc_stream().unwrap();
    kit.fill(cs, &mut buf, 7);
    assert_eq!(mismatches(&cs.clone_dtoh(&buf).unwrap(), 7), 0);
    drop(buf);

    // A stream vrampool made, lent to cudarc: a kernel launched through cudarc on it runs
    // on vrampool's stream, in its order.
    let own = kit.dev.create_stream().unwrap();
    // SAFETY: `own` outlives `lent` (dropped before the end of this test).
    let lent = unsafe { kit.dev.cudarc_stream_of(&kit.ctx, &own) }.unwrap();
    assert_eq!(lent.cu_stream() as u64, own.raw());
    let mut slice = lent.alloc_zeros::<u32>(4096).unwrap();
    let (n, seed) = (4096usize, 9u32);
    let cfg = LaunchConfig { grid_dim: (16, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: fill(unsigned* p, size_t n, unsigned seed); the slice holds n words.
    unsafe { lent.launch_builder(&kit.fill).arg(&mut slice).arg(&n).arg(&seed).launch(cfg) }.unwrap();
    let b = kit.pool.alloc_buffer::<u32>(4096, &own).unwrap();
    assert!(b.with_cudarc_stream(&own).is_err(), "not a cudarc-made stream: no CudaBuffer");
    kit.dev.synchronize(&own).unwrap();
    assert_eq!(mismatches(&lent.clone_dtoh(&slice).unwrap(), seed), 0);
    drop(slice);
    drop(lent);
    drop(cache);
    kit.pool.destroy_stream(&made).unwrap();
    kit.finish();
}
