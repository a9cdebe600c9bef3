//! The real work on every block: write a pattern that names the block, and check it before
//! the block is freed. On a GPU two NVRTC kernels; on the simulator host functions on the
//! block's stream (`SimDevice::enqueue`), reading and writing the device memory itself.
//!
//! The pattern is one 64-bit word every 256 bytes of the block's capacity, derived from a
//! tag unique to the allocation and the word's index. Every block starts on a 256-byte
//! boundary, so two blocks that overlap share word positions: a block handed out while
//! another stream still used its memory shows up as a wrong word in one of the two checks.
//! A check that finds any wrong word counts one corrupted block.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use vrampool::{SimDevice, Stream};

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Bytes between pattern words.
pub const STRIDE: u64 = 256;

/// The word at index `k` of the block tagged `tag` (never 0: fresh memory reads 0).
pub fn word(tag: u64, k: u64) -> u64 {
    (tag ^ (k << 40)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// What the workers do on the device.
pub trait Work: Send + Sync {
    /// A stream for a worker (or the copy stream).
    fn new_stream(&self) -> Result<Stream, Error>;
    /// Write the pattern of `tag` over `capacity` bytes at `addr`, in order on `stream`.
    fn fill(&self, addr: u64, capacity: u64, tag: u64, stream: &Stream) -> Result<(), Error>;
    /// Check it, in order on `stream`; a wrong word counts a corrupted block.
    fn check(&self, addr: u64, capacity: u64, tag: u64, stream: &Stream) -> Result<(), Error>;
    /// Corrupted blocks so far: exact once every stream is synchronized.
    fn corrupted(&self) -> Result<u64, Error>;
    /// Checks run so far (as `corrupted`).
    fn checks(&self) -> u64;
    /// What runs the work, for the log.
    fn what(&self) -> String;
    /// How long the workers' threads spent handing the work to the device (kernel launches,
    /// or host functions enqueued), for comparison with the pool's own event calls, which
    /// wait in the same driver: the calls and their nanoseconds, over all threads.
    fn submitted(&self) -> (u64, u64);
}

/// Calls that handed work to the device, and the time the calling threads spent in them.
#[derive(Default)]
pub struct Submitted {
    calls: AtomicU64,
    nanos: AtomicU64,
}

impl Submitted {
    /// Run `submit`, counting it and its time.
    fn time<T>(&self, submit: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = submit();
        self.nanos.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        r
    }

    /// The calls so far and their time in nanoseconds.
    pub fn read(&self) -> (u64, u64) {
        (self.calls.load(Ordering::Relaxed), self.nanos.load(Ordering::Relaxed))
    }
}

/// The simulator: host functions on the block's stream.
pub struct SimWork {
    dev: SimDevice,
    bad: Arc<AtomicU64>,
    checks: Arc<AtomicU64>,
    submitted: Submitted,
}

impl SimWork {
    pub fn new(dev: SimDevice) -> SimWork {
        SimWork { dev, bad: Arc::default(), checks: Arc::default(), submitted: Submitted::default() }
    }
}

impl Work for SimWork {
    fn new_stream(&self) -> Result<Stream, Error> {
        Ok(self.dev.new_stream()?)
    }

    fn fill(&self, addr: u64, capacity: u64, tag: u64, stream: &Stream) -> Result<(), Error> {
        let (dev, bad) = (self.dev.clone(), Arc::clone(&self.bad));
        let fill = move || {
            // Memory unmapped under a block still in use is corruption too (a GPU would
            // fault); a host thread must not touch it.
            if !dev.is_mapped(addr, capacity as usize) {
                bad.fetch_add(1, Ordering::Relaxed);
                return;
            }
            for k in 0..capacity / STRIDE {
                // SAFETY: the block is live (its free is enqueued after this work, in stream
                // order on its stream, or behind the events of every stream it was used on),
                // its capacity lies on mapped pages (just checked), and the simulator's device
                // addresses are host addresses; 256-byte alignment makes each word aligned.
                unsafe { ((addr + k * STRIDE) as *mut u64).write_volatile(word(tag, k)) };
            }
        };
        self.submitted.time(|| self.dev.enqueue(stream, fill))?;
        Ok(())
    }

    fn check(&self, addr: u64, capacity: u64, tag: u64, stream: &Stream) -> Result<(), Error> {
        let (dev, bad, checks) = (self.dev.clone(), Arc::clone(&self.bad), Arc::clone(&self.checks));
        let check = move || {
            checks.fetch_add(1, Ordering::Relaxed);
            if !dev.is_mapped(addr, capacity as usize) {
                bad.fetch_add(1, Ordering::Relaxed);
                return;
            }
            // SAFETY: as in `fill`.
            let wrong = (0..capacity / STRIDE)
                .any(|k| unsafe { ((addr + k * STRIDE) as *const u64).read_volatile() } != word(tag, k));
            if wrong {
                bad.fetch_add(1, Ordering::Relaxed);
            }
        };
        self.submitted.time(|| self.dev.enqueue(stream, check))?;
        Ok(())
    }

    fn corrupted(&self) -> Result<u64, Error> {
        Ok(self.bad.load(Ordering::Acquire))
    }

    fn checks(&self) -> u64 {
        self.checks.load(Ordering::Acquire)
    }

    fn what(&self) -> String {
        "host functions on the simulated streams".into()
    }

    fn submitted(&self) -> (u64, u64) {
        self.submitted.read()
    }
}

#[cfg(feature = "cuda")]
pub mod gpu {
    //! The GPU: two NVRTC kernels on each stream's cudarc handle.

    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use vrampool::cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
    use vrampool::{Block, CudaDevice, Device, Pool, Stream};

    use super::{Error, Submitted, Work, STRIDE};

    /// `word()` of the parent module, on the device; `check` runs as one thread block so that
    /// a block's check adds at most 1 to the count.
    const KERNELS: &str = r#"
__device__ unsigned long long word(unsigned long long tag, unsigned long long k) {
    return ((tag ^ (k << 40)) * 0x9e3779b97f4a7c15ULL) | 1ULL;
}
extern "C" __global__ void fill(unsigned long long base, unsigned long long words, unsigned long long tag) {
    for (unsigned long long k = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; k < words;
         k += (unsigned long long)gridDim.x * blockDim.x) {
        *(unsigned long long*)(base + k * 256ULL) = word(tag, k);
    }
}
extern "C" __global__ void check(unsigned long long base, unsigned long long words, unsigned long long tag,
                                 unsigned long long counter) {
    __shared__ int wrong;
    if (threadIdx.x == 0) wrong = 0;
    __syncthreads();
    for (unsigned long long k = threadIdx.x; k < words; k += blockDim.x) {
        if (*(const unsigned long long*)(base + k * 256ULL) != word(tag, k)) wrong = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0 && wrong) atomicAdd((unsigned int*)counter, 1u);
}
"#;

    pub struct GpuWork {
        dev: CudaDevice,
        ctx: Arc<CudaContext>,
        fill: CudaFunction,
        check: CudaFunction,
        /// A device word counting corrupted blocks, in a block of the pool held for the run.
        counter: Mutex<Option<(Block, Stream)>>,
        counter_addr: u64,
        checks: AtomicU64,
        submitted: Submitted,
    }

    impl GpuWork {
        /// Compile the kernels and set up the counter, from `pool` on `dev`.
        pub fn new(dev: &CudaDevice, pool: &Pool) -> Result<GpuWork, Error> {
            let ctx = dev.cudarc_context()?;
            // SAFETY: only tries to open the library.
            if !unsafe { vrampool::cudarc::nvrtc::sys::is_culib_present() } {
                return Err("NVRTC is not installed".into());
            }
            // cudarc panics on a missing NVRTC symbol: treated as a failure to compile.
            let ptx = std::panic::catch_unwind(|| vrampool::cudarc::nvrtc::compile_ptx(KERNELS))
                .map_err(|_| "NVRTC could not be loaded")??;
            let module = ctx.load_module(ptx)?;
            let stream = dev.create_cudarc_stream(&ctx)?;
            let block = pool.alloc(256, &stream)?;
            dev.memset(block.device_ptr(), 0, 256, &stream)?;
            dev.synchronize(&stream)?;
            Ok(GpuWork {
                dev: dev.clone(),
                fill: module.load_function("fill")?,
                check: module.load_function("check")?,
                counter_addr: block.device_ptr(),
                counter: Mutex::new(Some((block, stream))),
                ctx,
                checks: AtomicU64::new(0),
                submitted: Submitted::default(),
            })
        }

        /// `cuEventCreate` calls the device made over the run.
        pub fn events_created(&self) -> u64 {
            self.dev.events_created()
        }

        /// Give the counter's block back (before the pool's last check).
        pub fn release(&self) {
            drop(self.counter.lock().unwrap_or_else(|p| p.into_inner()).take());
        }
    }

    fn cudarc(stream: &Stream) -> Result<&Arc<vrampool::cudarc::driver::CudaStream>, Error> {
        stream.cudarc_stream().ok_or_else(|| "not a cudarc stream".into())
    }

    impl Work for GpuWork {
        fn new_stream(&self) -> Result<Stream, Error> {
            Ok(self.dev.create_cudarc_stream(&self.ctx)?)
        }

        fn fill(&self, addr: u64, capacity: u64, tag: u64, stream: &Stream) -> Result<(), Error> {
            let words = capacity / STRIDE;
            let cfg = LaunchConfig {
                grid_dim: (words.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let s = cudarc(stream)?;
            self.submitted.time(|| {
                // SAFETY: the kernel's signature; it writes `words` words of a live block of
                // `capacity` bytes, in order on the block's stream (or one made to wait for it).
                unsafe { s.launch_builder(&self.fill).arg(&addr).arg(&words).arg(&tag).launch(cfg) }
            })?;
            Ok(())
        }

        fn check(&self, addr: u64, capacity: u64, tag: u64, stream: &Stream) -> Result<(), Error> {
            let words = capacity / STRIDE;
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            let counter = self.counter_addr;
            let s = cudarc(stream)?;
            self.submitted.time(|| {
                // SAFETY: as `fill`, reading; the counter is a live word of the pool.
                unsafe { s.launch_builder(&self.check).arg(&addr).arg(&words).arg(&tag).arg(&counter).launch(cfg) }
            })?;
            self.checks.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }

        fn corrupted(&self) -> Result<u64, Error> {
            let guard = self.counter.lock().unwrap_or_else(|p| p.into_inner());
            let Some((block, stream)) = guard.as_ref() else { return Err("the counter was released".into()) };
            let mut b = [0u8; 4];
            self.dev.copy_from_device(&mut b, block.device_ptr(), stream)?;
            Ok(u64::from(u32::from_le_bytes(b)))
        }

        fn checks(&self) -> u64 {
            self.checks.load(Ordering::Acquire)
        }

        fn what(&self) -> String {
            "NVRTC kernels on cudarc streams".into()
        }

        fn submitted(&self) -> (u64, u64) {
            self.submitted.read()
        }
    }
}
