//! A Rust inference server's workers on cudarc with vrampool buffers: N threads, each with its
//! own cudarc stream and `StreamCache`, serve requests through a two-layer MLP
//! (`relu(x W1 + b1) W2 + b2`, four NVRTC kernels: matmul, bias+relu, matmul, bias) on
//! buffers allocated per request, and check every result against a host computation. On the
//! simulator (no GPU) the same chain runs as host functions on the simulated streams.
//!
//! `cargo run --release --example cudarc_worker` — on the GPU when there is one, else on the
//! simulator. Options: `--workers N` (default 8 on the GPU, 4 on the simulator),
//! `--requests N` per worker (default 400 / 100), `--batch N` (rows per request, default 16),
//! `--alloc vrampool|cudarc|both` (GPU only: `cudarc` runs the same work on cudarc's own
//! `alloc`, i.e. `cuMemAllocAsync`, and `both` runs both in this process, one after the
//! other, and prints the ratio), `--check-every N` (check every Nth request, default 1),
//! `--warmup N` (requests per worker before the timed ones, default 20: the pool maps its
//! pages and cudarc's memory pool grows there, and both are checked too). Prints the time
//! per request (allocation, upload, the four kernels, download, free) and fails if any
//! result differs from the host's.
//!
//! The kernels are compiled with `--fmad=false` (hand-written PTX with `.rn` arithmetic
//! where NVRTC is missing), so the GPU adds and multiplies as the host does, in the same
//! order: results agree to the last bit, and the check allows 1e-5 relative error only for
//! safety.

use std::sync::Arc;
use std::time::Instant;

use vrampool::cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use vrampool::cudarc::nvrtc::{CompileOptions, Ptx};
use vrampool::{Buffer, CudaBuffer, CudaDevice, Device, Pool, PoolConfig, SimDevice, Stream, StreamCache};

type Error = Box<dyn std::error::Error + Send + Sync>;

const D_IN: usize = 256;
const HIDDEN: usize = 512;
const D_OUT: usize = 128;

// ---------------------------------------------------------------------------------------
// Options and shared pieces

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn num(name: &str, default: usize) -> Result<usize, Error> {
    match arg(name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| format!("{name} wants a number, not {v:?}").into()),
    }
}

/// xorshift64*: deterministic inputs, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// The model's weights, on the host.
struct Weights {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

impl Weights {
    fn random() -> Weights {
        let mut rng = Rng::new(42);
        Weights {
            w1: rng.fill(D_IN * HIDDEN, 1.0 / (D_IN as f32).sqrt()),
            b1: rng.fill(HIDDEN, 0.1),
            w2: rng.fill(HIDDEN * D_OUT, 1.0 / (HIDDEN as f32).sqrt()),
            b2: rng.fill(D_OUT, 0.1),
        }
    }
}

/// `out[r][c] = sum_i x[r][i] w[i][c]` (row-major), summed over `i` in order for each output,
/// as one GPU thread does; multiply then add, never fused.
fn matmul_host(x: &[f32], w: &[f32], out: &mut [f32], rows: usize, k: usize, cols: usize) {
    for r in 0..rows {
        let acc = &mut out[r * cols..(r + 1) * cols];
        acc.fill(0.0);
        for i in 0..k {
            let xi = x[r * k + i];
            for (a, &wv) in acc.iter_mut().zip(&w[i * cols..(i + 1) * cols]) {
                *a += xi * wv;
            }
        }
    }
}

/// `v[r][c] += b[c]`, then `max(v, 0)` when `relu`.
fn bias_act_host(v: &mut [f32], b: &[f32], cols: usize, relu: bool) {
    for row in v.chunks_mut(cols) {
        for (a, &bv) in row.iter_mut().zip(b) {
            *a += bv;
            if relu && *a < 0.0 {
                *a = 0.0;
            }
        }
    }
}

/// The reference: the whole MLP on the host.
fn mlp_host(wt: &Weights, x: &[f32], rows: usize) -> Vec<f32> {
    let mut h = vec![0.0; rows * HIDDEN];
    matmul_host(x, &wt.w1, &mut h, rows, D_IN, HIDDEN);
    bias_act_host(&mut h, &wt.b1, HIDDEN, true);
    let mut y = vec![0.0; rows * D_OUT];
    matmul_host(&h, &wt.w2, &mut y, rows, HIDDEN, D_OUT);
    bias_act_host(&mut y, &wt.b2, D_OUT, false);
    y
}

/// Elements that differ by more than 1e-5 relative, and the largest absolute difference.
fn compare(got: &[f32], want: &[f32]) -> (usize, f32) {
    let mut bad = 0;
    let mut worst = 0.0f32;
    for (&g, &w) in got.iter().zip(want) {
        let d = (g - w).abs();
        worst = worst.max(d);
        // A NaN difference counts as wrong.
        if d.is_nan() || d > 1e-5 * (1.0 + w.abs()) {
            bad += 1;
        }
    }
    (bad + got.len().abs_diff(want.len()), worst)
}

/// One worker's figures.
#[derive(Default)]
struct Report {
    latencies_us: Vec<f64>,
    checked: usize,
    wrong: usize,
    worst: f32,
}

impl Report {
    fn check(&mut self, wt: &Weights, x: &[f32], y: &[f32], rows: usize) {
        let (bad, worst) = compare(y, &mlp_host(wt, x, rows));
        self.checked += 1;
        self.wrong += bad;
        self.worst = self.worst.max(worst);
    }
}

/// Print a run's figures; an error if any result was wrong. Returns the mean µs per request.
fn summarize(what: &str, plan: &Plan, reports: Vec<Report>, wall: f64) -> Result<f64, Error> {
    let mut lat: Vec<f64> = reports.iter().flat_map(|r| r.latencies_us.iter().copied()).collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    let n = lat.len().max(1);
    let mean = lat.iter().sum::<f64>() / n as f64;
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied();
    let (checked, wrong) = reports.iter().fold((0, 0), |(c, w), r| (c + r.checked, w + r.wrong));
    let worst = reports.iter().map(|r| r.worst).fold(0.0, f32::max);
    println!(
        "{what}: {} requests ({} timed) in {wall:.2} s ({:.0} requests/s); per request {mean:.1} µs mean, \
         {:.1} median, {:.1} p99; {checked} checked against the host, {wrong} wrong elements, largest difference {worst:e}",
        plan.workers * (plan.warmup + plan.requests),
        lat.len(),
        (plan.workers * (plan.warmup + plan.requests)) as f64 / wall,
        pct(0.5).unwrap_or(0.0),
        pct(0.99).unwrap_or(0.0),
    );
    if wrong > 0 {
        return Err(format!("{what}: {wrong} elements differ from the host's result").into());
    }
    Ok(mean)
}

struct Plan {
    workers: usize,
    requests: usize,
    warmup: usize,
    batch: usize,
    check_every: usize,
}

impl Plan {
    fn from_args(workers: usize, requests: usize) -> Result<Plan, Error> {
        Ok(Plan {
            workers: num("--workers", workers)?.max(1),
            requests: num("--requests", requests)?,
            warmup: num("--warmup", 20)?,
            batch: num("--batch", 16)?.max(1),
            check_every: num("--check-every", 1)?.max(1),
        })
    }

    /// Whether request `r` (warm-up first) is timed.
    fn timed(&self, r: usize) -> bool {
        r >= self.warmup
    }
}

fn main() -> Result<(), Error> {
    let alloc = arg("--alloc").unwrap_or_else(|| "vrampool".into());
    if !matches!(alloc.as_str(), "vrampool" | "cudarc" | "both") {
        return Err(format!("--alloc wants vrampool, cudarc or both, not {alloc:?}").into());
    }
    let weights = Weights::random();
    // vrampool's CudaDevice first: it looks for the driver without panicking (cudarc's
    // loader panics when libcuda is missing).
    match CudaDevice::new(0) {
        Ok(dev) => {
            let plan = Plan::from_args(8, 400)?;
            gpu::run(&dev, &plan, &weights, &alloc)
        }
        Err(why) => {
            println!("no CUDA GPU ({why}): the simulator");
            if alloc != "vrampool" {
                return Err("--alloc cudarc and both need a CUDA GPU".into());
            }
            let plan = Plan::from_args(4, 100)?;
            sim::run(&plan, &weights)
        }
    }
}

// ---------------------------------------------------------------------------------------
// The GPU: cudarc streams, NVRTC kernels, vrampool's `CudaBuffer` or cudarc's `CudaSlice`

mod gpu {
    use super::*;

    const KERNELS: &str = r#"
extern "C" __global__ void matmul(const float* x, const float* w, float* out, int rows, int k, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int r = blockIdx.y;
    if (c >= cols || r >= rows) return;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc += x[r * k + i] * w[i * cols + c];
    out[r * cols + c] = acc;
}
extern "C" __global__ void bias_act(float* v, const float* b, int rows, int cols, int relu) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int r = blockIdx.y;
    if (c >= cols || r >= rows) return;
    float a = v[r * cols + c] + b[c];
    if (relu && a < 0.0f) a = 0.0f;
    v[r * cols + c] = a;
}
"#;

    /// The same kernels by hand (`.rn` arithmetic: never contracted into a fused multiply-add).
    const KERNELS_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry matmul(
    .param .u64 mm_x, .param .u64 mm_w, .param .u64 mm_out,
    .param .u32 mm_rows, .param .u32 mm_k, .param .u32 mm_cols
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<12>;
    .reg .f32 %f<5>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [mm_x];
    ld.param.u64 %rd2, [mm_w];
    ld.param.u64 %rd3, [mm_out];
    ld.param.u32 %r1, [mm_rows];
    ld.param.u32 %r2, [mm_k];
    ld.param.u32 %r3, [mm_cols];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mov.u32 %r6, %tid.x;
    mad.lo.s32 %r7, %r4, %r5, %r6;          // c
    mov.u32 %r8, %ctaid.y;                  // r
    setp.ge.s32 %p1, %r7, %r3;
    setp.ge.s32 %p2, %r8, %r1;
    or.pred %p1, %p1, %p2;
    @%p1 bra $Lmm_done;
    mov.f32 %f1, 0f00000000;                // acc
    mul.lo.s32 %r9, %r8, %r2;               // r * k
    mul.wide.s32 %rd4, %r9, 4;
    add.s64 %rd4, %rd1, %rd4;               // &x[r * k]
    mul.wide.s32 %rd5, %r7, 4;
    add.s64 %rd5, %rd2, %rd5;               // &w[c]
    mul.wide.s32 %rd6, %r3, 4;              // a row of w, in bytes
    mov.u32 %r10, 0;                        // i
$Lmm_loop:
    setp.ge.s32 %p1, %r10, %r2;
    @%p1 bra $Lmm_store;
    ld.global.f32 %f2, [%rd4];
    ld.global.f32 %f3, [%rd5];
    mul.rn.f32 %f4, %f2, %f3;
    add.rn.f32 %f1, %f1, %f4;
    add.s64 %rd4, %rd4, 4;
    add.s64 %rd5, %rd5, %rd6;
    add.s32 %r10, %r10, 1;
    bra.uni $Lmm_loop;
$Lmm_store:
    mad.lo.s32 %r11, %r8, %r3, %r7;         // r * cols + c
    mul.wide.s32 %rd7, %r11, 4;
    add.s64 %rd7, %rd3, %rd7;
    st.global.f32 [%rd7], %f1;
$Lmm_done:
    ret;
}

.visible .entry bias_act(
    .param .u64 ba_v, .param .u64 ba_b,
    .param .u32 ba_rows, .param .u32 ba_cols, .param .u32 ba_relu
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<12>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [ba_v];
    ld.param.u64 %rd2, [ba_b];
    ld.param.u32 %r1, [ba_rows];
    ld.param.u32 %r2, [ba_cols];
    ld.param.u32 %r3, [ba_relu];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mov.u32 %r6, %tid.x;
    mad.lo.s32 %r7, %r4, %r5, %r6;          // c
    mov.u32 %r8, %ctaid.y;                  // r
    setp.ge.s32 %p1, %r7, %r2;
    setp.ge.s32 %p2, %r8, %r1;
    or.pred %p1, %p1, %p2;
    @%p1 bra $Lba_done;
    mad.lo.s32 %r9, %r8, %r2, %r7;          // r * cols + c
    mul.wide.s32 %rd3, %r9, 4;
    add.s64 %rd3, %rd1, %rd3;
    mul.wide.s32 %rd4, %r7, 4;
    add.s64 %rd4, %rd2, %rd4;
    ld.global.f32 %f1, [%rd3];
    ld.global.f32 %f2, [%rd4];
    add.rn.f32 %f1, %f1, %f2;
    setp.ne.s32 %p3, %r3, 0;
    setp.lt.f32 %p2, %f1, 0f00000000;
    and.pred %p2, %p2, %p3;
    @%p2 mov.f32 %f1, 0f00000000;
    st.global.f32 [%rd3], %f1;
$Lba_done:
    ret;
}
"#;

    /// The two kernels, compiled by NVRTC when it is there (else the PTX above).
    struct Kernels {
        matmul: CudaFunction,
        bias_act: CudaFunction,
        from: &'static str,
    }

    impl Kernels {
        fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, Error> {
            // SAFETY: only tries to open the library.
            let have_nvrtc = unsafe { vrampool::cudarc::nvrtc::sys::is_culib_present() }
                && std::env::var_os("VRAMPOOL_EXAMPLE_PTX").is_none();
            let opts = || CompileOptions { fmad: Some(false), ..Default::default() };
            // cudarc panics on a missing NVRTC symbol: either failure falls back to the PTX.
            let compiled = have_nvrtc
                .then(|| {
                    std::panic::catch_unwind(|| vrampool::cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts()))
                        .ok()
                        .and_then(Result::ok)
                })
                .flatten();
            let (module, from): (Arc<CudaModule>, _) = match compiled {
                Some(ptx) => (ctx.load_module(ptx)?, "NVRTC"),
                None => (ctx.load_module(Ptx::from_src(KERNELS_PTX))?, "hand-written PTX"),
            };
            Ok(Kernels { matmul: module.load_function("matmul")?, bias_act: module.load_function("bias_act")?, from })
        }
    }

    fn grid(rows: usize, cols: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (cols.div_ceil(128) as u32, rows as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// One request's chain on `$cs`, its buffers made by `$alloc` (an expression of a length
    /// that gives a device buffer of f32: a vrampool `CudaBuffer` or a cudarc `CudaSlice`), the
    /// weights `$w`; leaves the result in `$y_host`. A macro, not a generic function: cudarc's
    /// `PushKernelArg` impls hold only for argument lifetimes that outlive the builder, which
    /// a generic bound cannot say.
    macro_rules! request {
        ($k:expr, $cs:expr, $w:expr, $alloc:expr, $x_host:expr, $y_host:expr, $rows:expr) => {{
            let (k, cs, w, rows) = ($k, $cs, $w, $rows);
            let (ri, di, hi, oi) = (rows as i32, D_IN as i32, HIDDEN as i32, D_OUT as i32);
            let mut x = $alloc(rows * D_IN)?;
            cs.memcpy_htod($x_host, &mut x)?;
            let mut h = $alloc(rows * HIDDEN)?;
            // SAFETY: the kernels' signatures, each buffer holding what its dimensions say.
            unsafe {
                cs.launch_builder(&k.matmul)
                    .arg(&x)
                    .arg(&w.0)
                    .arg(&mut h)
                    .arg(&ri)
                    .arg(&di)
                    .arg(&hi)
                    .launch(grid(rows, HIDDEN))?;
                cs.launch_builder(&k.bias_act)
                    .arg(&mut h)
                    .arg(&w.1)
                    .arg(&ri)
                    .arg(&hi)
                    .arg(&1i32)
                    .launch(grid(rows, HIDDEN))?;
            }
            let mut y = $alloc(rows * D_OUT)?;
            // SAFETY: as above.
            unsafe {
                cs.launch_builder(&k.matmul)
                    .arg(&h)
                    .arg(&w.2)
                    .arg(&mut y)
                    .arg(&ri)
                    .arg(&hi)
                    .arg(&oi)
                    .launch(grid(rows, D_OUT))?;
                cs.launch_builder(&k.bias_act)
                    .arg(&mut y)
                    .arg(&w.3)
                    .arg(&ri)
                    .arg(&oi)
                    .arg(&0i32)
                    .launch(grid(rows, D_OUT))?;
            }
            // Into pageable memory: returns once the copy (and so the chain) is done.
            cs.memcpy_dtoh(&y, $y_host)?;
            drop((x, h, y));
        }};
    }

    /// What every worker shares: the context, the pool and the kernels.
    struct Gpu {
        ctx: Arc<CudaContext>,
        dev: CudaDevice,
        pool: Pool,
        k: Kernels,
    }

    /// A vrampool buffer on the cache's stream holding a copy of `v`.
    fn upload<'c>(cache: &'c StreamCache, cs: &Arc<CudaStream>, v: &[f32]) -> Result<CudaBuffer<'c, f32>, Error> {
        let mut b = cache.alloc_cuda_buffer::<f32>(v.len())?;
        cs.memcpy_htod(v, &mut b)?;
        Ok(b)
    }

    /// A worker: its own cudarc stream, its `StreamCache` (vrampool) or cudarc's allocator,
    /// its own copy of the weights (a `CudaBuffer` is `Send`, not `Sync`: each thread holds
    /// its own), `plan.requests` requests.
    fn worker(id: usize, g: &Gpu, wt: &Weights, plan: &Plan, on_vrampool: bool) -> Result<Report, Error> {
        let cs = g.ctx.new_stream()?;
        let mut rng = Rng::new(1000 + id as u64);
        let mut rep = Report::default();
        let mut y_host = vec![0.0f32; plan.batch * D_OUT];
        if on_vrampool {
            let s = g.dev.wrap_cudarc_stream(&cs)?;
            let cache = g.pool.stream_cache(&s)?;
            let w = (
                upload(&cache, &cs, &wt.w1)?,
                upload(&cache, &cs, &wt.b1)?,
                upload(&cache, &cs, &wt.w2)?,
                upload(&cache, &cs, &wt.b2)?,
            );
            let alloc = |n: usize| cache.alloc_cuda_buffer::<f32>(n);
            for r in 0..plan.warmup + plan.requests {
                let x_host = rng.fill(plan.batch * D_IN, 1.0);
                let t = Instant::now();
                request!(&g.k, &cs, &w, alloc, &x_host, &mut y_host, plan.batch);
                if plan.timed(r) {
                    rep.latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
                }
                if r % plan.check_every == 0 {
                    rep.check(wt, &x_host, &y_host, plan.batch);
                }
            }
            drop(w);
            drop(cache);
            // The pool lets go of the stream (and of its cudarc Arc) once its blocks are back.
            g.pool.destroy_stream(&s)?;
        } else {
            let w = (cs.clone_htod(&wt.w1)?, cs.clone_htod(&wt.b1)?, cs.clone_htod(&wt.w2)?, cs.clone_htod(&wt.b2)?);
            // SAFETY: every element is written (upload or kernel) before it is read.
            let alloc = |n: usize| unsafe { cs.alloc::<f32>(n) };
            for r in 0..plan.warmup + plan.requests {
                let x_host = rng.fill(plan.batch * D_IN, 1.0);
                let t = Instant::now();
                request!(&g.k, &cs, &w, alloc, &x_host, &mut y_host, plan.batch);
                if plan.timed(r) {
                    rep.latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
                }
                if r % plan.check_every == 0 {
                    rep.check(wt, &x_host, &y_host, plan.batch);
                }
            }
        }
        cs.synchronize()?;
        Ok(rep)
    }

    /// Every worker once, on one allocator; returns the mean µs per request.
    fn serve(g: &Gpu, wt: &Weights, plan: &Plan, on_vrampool: bool) -> Result<f64, Error> {
        let t = Instant::now();
        let reports: Vec<Result<Report, Error>> = std::thread::scope(|scope| {
            let handles: Vec<_> =
                (0..plan.workers).map(|id| scope.spawn(move || worker(id, g, wt, plan, on_vrampool))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a worker panicked".into()))).collect()
        });
        let wall = t.elapsed().as_secs_f64();
        let reports = reports.into_iter().collect::<Result<Vec<_>, _>>()?;
        let what = if on_vrampool { "vrampool CudaBuffer (StreamCache)" } else { "cudarc alloc (cuMemAllocAsync)" };
        summarize(&format!("{what}, {} workers", plan.workers), plan, reports, wall)
    }

    pub(super) fn run(dev: &CudaDevice, plan: &Plan, wt: &Weights, alloc: &str) -> Result<(), Error> {
        let ctx = dev.cudarc_context()?;
        let pool = Pool::new(dev.clone(), PoolConfig::default())?;
        let k = Kernels::load(&ctx)?;
        println!(
            "device: {} (CUDA); kernels from {}; MLP {D_IN}→{HIDDEN}→{D_OUT}, batch {}; {} workers × {} requests (after {} warm-up)",
            dev.name(),
            k.from,
            plan.batch,
            plan.workers,
            plan.requests,
            plan.warmup
        );
        let g = Gpu { ctx, dev: dev.clone(), pool, k };
        let mut means = Vec::new();
        if alloc != "cudarc" {
            means.push(serve(&g, wt, plan, true)?);
            let st = g.pool.stats();
            println!(
                "  pool: {} allocations, T0 hit rate {:.4}, peak reserved {:.1} MiB, {} events recorded",
                st.allocs,
                st.t0_hit_rate(),
                st.peak_reserved_bytes as f64 / (1 << 20) as f64,
                st.events_recorded
            );
        }
        if alloc != "vrampool" {
            means.push(serve(&g, wt, plan, false)?);
        }
        if let [v, c] = means[..] {
            println!("time per request, cudarc alloc ÷ vrampool: {:.2}", c / v);
        }
        g.ctx.check_err()?;
        g.pool.trim()?;
        g.pool.check()?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The simulator: the same chain as host functions on the simulated streams

mod sim {
    use super::*;

    /// `n` floats of simulated device memory at `addr`.
    ///
    /// # Safety
    /// `addr` is a live buffer of at least `n` floats on a simulated device (whose device
    /// addresses are host addresses of mapped pages), used by nothing else meanwhile.
    unsafe fn floats<'a>(addr: u64, n: usize) -> &'a mut [f32] {
        // SAFETY: by the contract.
        unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, n) }
    }

    /// A simulated stream to run the chain's "kernels" on, as host functions in stream order.
    struct SimStream<'a> {
        dev: &'a SimDevice,
        s: &'a Stream,
    }

    impl SimStream<'_> {
        #[allow(clippy::too_many_arguments)]
        fn matmul(&self, x: u64, w: u64, out: u64, rows: usize, k: usize, cols: usize) -> Result<(), Error> {
            self.dev.enqueue(self.s, move || {
                // SAFETY: the three buffers are live until the request's download, which
                // comes after this function in stream order; `out` is no other buffer.
                let (x, w, out) = unsafe { (floats(x, rows * k), floats(w, k * cols), floats(out, rows * cols)) };
                matmul_host(x, w, out, rows, k, cols);
            })?;
            Ok(())
        }

        fn bias_act(&self, v: u64, b: u64, rows: usize, cols: usize, relu: bool) -> Result<(), Error> {
            self.dev.enqueue(self.s, move || {
                // SAFETY: as in `matmul`.
                let (v, b) = unsafe { (floats(v, rows * cols), floats(b, cols)) };
                bias_act_host(v, b, cols, relu);
            })?;
            Ok(())
        }
    }

    fn worker(id: usize, dev: &SimDevice, pool: &Pool, wt: &Weights, plan: &Plan) -> Result<Report, Error> {
        let s = dev.new_stream()?;
        let cache = pool.stream_cache(&s)?;
        let mut rng = Rng::new(1000 + id as u64);
        let mut rep = Report::default();
        let up = |v: &[f32]| pool.alloc_from_host(v, &s);
        let (w1, b1, w2, b2) = (up(&wt.w1)?, up(&wt.b1)?, up(&wt.w2)?, up(&wt.b2)?);
        let rows = plan.batch;
        let mut y_host = vec![0.0f32; rows * D_OUT];
        let run = SimStream { dev, s: &s };
        for r in 0..plan.warmup + plan.requests {
            let x_host = rng.fill(rows * D_IN, 1.0);
            let t = Instant::now();
            let mut x: Buffer<f32> = cache.alloc_buffer(rows * D_IN)?;
            x.copy_from_host(pool, &x_host, &s)?;
            let h: Buffer<f32> = cache.alloc_buffer(rows * HIDDEN)?;
            run.matmul(x.device_ptr(), w1.device_ptr(), h.device_ptr(), rows, D_IN, HIDDEN)?;
            run.bias_act(h.device_ptr(), b1.device_ptr(), rows, HIDDEN, true)?;
            let y: Buffer<f32> = cache.alloc_buffer(rows * D_OUT)?;
            run.matmul(h.device_ptr(), w2.device_ptr(), y.device_ptr(), rows, HIDDEN, D_OUT)?;
            run.bias_act(y.device_ptr(), b2.device_ptr(), rows, D_OUT, false)?;
            // In stream order after the host functions: returns once they and the copy ran.
            y.copy_to_host(pool, &mut y_host, &s)?;
            drop((x, h, y));
            if plan.timed(r) {
                rep.latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
            }
            if r % plan.check_every == 0 {
                rep.check(wt, &x_host, &y_host, rows);
            }
        }
        drop((w1, b1, w2, b2));
        drop(cache);
        pool.destroy_stream(&s)?;
        Ok(rep)
    }

    pub(super) fn run(plan: &Plan, wt: &Weights) -> Result<(), Error> {
        let dev = SimDevice::new(16 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default())?;
        println!(
            "device: {} (simulated: no CUDA GPU); the chain runs as host functions on the simulated streams; \
             MLP {D_IN}→{HIDDEN}→{D_OUT}, batch {}; {} workers × {} requests (after {} warm-up)",
            dev.name(),
            plan.batch,
            plan.workers,
            plan.requests,
            plan.warmup
        );
        let t = Instant::now();
        let reports: Vec<Result<Report, Error>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..plan.workers)
                .map(|id| (id, &dev, &pool))
                .map(|(id, dev, pool)| scope.spawn(move || worker(id, dev, pool, wt, plan)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a worker panicked".into()))).collect()
        });
        let wall = t.elapsed().as_secs_f64();
        let reports = reports.into_iter().collect::<Result<Vec<_>, _>>()?;
        summarize(&format!("vrampool Buffer (StreamCache), {} workers", plan.workers), plan, reports, wall)?;
        let st = pool.stats();
        println!(
            "  pool: {} allocations, T0 hit rate {:.4}, peak reserved {:.1} MiB",
            st.allocs,
            st.t0_hit_rate(),
            st.peak_reserved_bytes as f64 / (1 << 20) as f64
        );
        pool.trim()?;
        pool.check()?;
        Ok(())
    }
}
