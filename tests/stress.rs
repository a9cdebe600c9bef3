//! Stress on the simulator: invariants 1 and 2 of the design, checked as the streams see them.
//!
//! Worker threads allocate on their streams, and every block is "used" by host functions run
//! in stream order: a `use` marks the block's 256-byte granules in a shadow table, an `unuse`
//! enqueued right before the block is dropped clears them. A granule found marked by another
//! block means two blocks were live at the same moment *on the streams' clocks*:
//!
//! 1. two live blocks overlap (the pool handed out memory it had not got back), or
//! 2. memory freed on stream A went to stream B before A's work before the free had run.
//!
//! Blocks hop streams (`record_stream`), are dropped on other threads and inside host
//! functions, and streams are made to lag behind the host, so that the pool's event guard is
//! the only thing standing between a free and a too-early reuse. The second test breaks that
//! guard on purpose and checks that the harness sees it.
//!
//! The third runs the same harness through the cache tiers: more threads than streams, so that
//! several threads share each stream's depot; half of them allocate through an explicit
//! [`StreamCache`], the others through `pool.alloc` (the thread-local cache); sizes repeat, so
//! the caches hit; one thread trims the pool midway (taking idle caches' blocks through the
//! handshake), others flush their caches, some exit early (their caches flush on exit); and
//! `max_reserved` is low enough that the out-of-memory ladder runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vrampool::{Block, Device, Pool, PoolConfig, SimDevice, Stats, Stream, StreamCache};

/// Threads and streams of the first two tests (the cache test has its own).
const THREADS: usize = 8;
const STREAMS: usize = 4;
/// Live blocks a thread keeps at most.
const WINDOW: usize = 16;
/// Host functions a stream may have queued and not yet run. Streams lag behind the host, but
/// not without bound: blocks waiting in a queue to be dropped, and batches whose events the
/// stream has not reached, are memory the pool cannot hand out, and an unbounded backlog
/// would end in a legitimate out-of-memory (a server synchronizes now and then too).
const MAX_BACKLOG: u64 = 512;
const GRANULE: u64 = 256;
const RANGE: u64 = 1 << 30;

/// Alloc and free operations of the main run (each block counts twice: its alloc and its
/// free). Debug builds are about 5× slower, so they run a tenth of it by default; the full
/// million is the release figure. `VRAMPOOL_STRESS_OPS` overrides both.
fn default_ops() -> u64 {
    let fallback = if cfg!(debug_assertions) { 100_000 } else { 1_000_000 };
    std::env::var("VRAMPOOL_STRESS_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(fallback)
}

/// The tests share the machine's cores: run them one after the other so that neither's
/// streams lag only because the other is running, and the printed times mean something.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// How far the streams are made to fall behind the host: after a `use`, one time in
/// `one_in` the stream stalls for `min..=max` µs (sleeping, or spinning when short).
#[derive(Clone, Copy)]
struct Lag {
    one_in: u64,
    min_us: u64,
    max_us: u64,
}

struct Run {
    name: &'static str,
    config: PoolConfig,
    ops: u64,
    lag: Lag,
    /// Worker threads; thread `i` allocates on stream `i % streams`.
    threads: usize,
    streams: usize,
    sizes: Sizes,
    churn: Churn,
}

/// The request sizes of a run.
#[derive(Clone, Copy)]
enum Sizes {
    /// Mostly 256 B – 1 MiB log-uniform, now and then sub-granule and up to 8 MiB: few
    /// repeats, so most requests find no block of their class in the caches.
    Spread,
    /// 70% from a few fixed sizes (what a server's steady state looks like: the caches hit),
    /// 30% log-uniform in 256 B – 4 MiB.
    Repeating,
}

/// What a run does to the cache tiers besides allocating and freeing.
#[derive(Clone, Copy, Default)]
struct Churn {
    /// Half the threads allocate through an explicit [`StreamCache`] made inside the thread;
    /// the others through `pool.alloc` (the thread-local cache).
    stream_caches: bool,
    /// Halfway through its share, one thread trims the pool, and two others (one of each
    /// kind) flush their thread caches.
    midway: bool,
    /// Some threads do a quarter share and exit at once, while the others run on: their caches
    /// flush on thread exit. Nobody hands them blocks to drop.
    early_exits: bool,
}

impl Churn {
    fn uses_stream_cache(&self, me: usize) -> bool {
        // Not `me % 2`: with an even number of streams that would give every stream threads
        // of one kind only. This gives each stream both kinds.
        self.stream_caches && (me / 2) % 2 == 0
    }

    /// Threads 3, 4, 11 and 12: two of each kind.
    fn exits_early(&self, me: usize) -> bool {
        self.early_exits && matches!(me % 8, 3 | 4)
    }

    /// Whether `me` trims the pool midway.
    fn trims(&self, me: usize) -> bool {
        self.midway && me == Self::TRIMMER
    }

    /// The thread that trims midway, and the two that flush their caches: 6 allocates through
    /// `pool.alloc`, 8 through a `StreamCache` (whose handle keeps its cache alive across the
    /// flush: that cache is not emptied, and the thread's frees then go to a second cache for
    /// the same stream).
    const TRIMMER: usize = 2;
    const FLUSHERS: [usize; 2] = [6, 8];
}

/// What a run saw.
struct Outcome {
    overlaps: u64,
    first_overlap: Option<String>,
    errors: u64,
    first_error: Option<String>,
    allocs: u64,
    frees: u64,
    hops: u64,
    host_fn_drops: u64,
    cross_thread_drops: u64,
    stream_cache_allocs: u64,
    midway_trim: Option<Duration>,
    stats: Stats,
    shadow_clean: bool,
    elapsed: Duration,
}

/// One word per 256-byte granule of the pool's range: `tag << 8 | users`, 0 when unused. A
/// block has one tag; it has a user per stream between that stream's `use` and `unuse`.
struct Shadow {
    base: u64,
    len: u64,
    cells: Vec<AtomicU64>,
    overlaps: AtomicU64,
    first_overlap: Mutex<Option<String>>,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Shadow {
    /// The shadow of the pool's whole range, `(base, len)` as `Pool::address_range` gives it.
    fn new((base, len): (u64, u64)) -> Shadow {
        Shadow {
            base,
            len,
            cells: (0..len / GRANULE).map(|_| AtomicU64::new(0)).collect(),
            overlaps: AtomicU64::new(0),
            first_overlap: Mutex::new(None),
            errors: AtomicU64::new(0),
            first_error: Mutex::new(None),
        }
    }

    fn granules(&self, addr: u64, len: u64) -> std::ops::Range<usize> {
        let first = (addr - self.base) / GRANULE;
        first as usize..(first + len.div_ceil(GRANULE)) as usize
    }

    /// Whether `[addr, addr + len)` is aligned and inside the pool's range (else it has no
    /// shadow, and that is itself a failure).
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr % GRANULE == 0 && addr >= self.base && addr + len <= self.base + self.len
    }

    /// The `use` host function. Runs on a stream worker: records, never panics.
    fn mark(&self, tag: u64, addr: u64, len: u64, stream: u64) {
        let mut clash = None;
        for g in self.granules(addr, len) {
            let cell = &self.cells[g];
            let mut cur = cell.load(Ordering::Acquire);
            loop {
                let next = if cur == 0 {
                    tag << 8 | 1
                } else if cur >> 8 == tag {
                    // The same block, also used on another stream (`record_stream`).
                    cur + 1
                } else {
                    clash.get_or_insert((g, cur >> 8));
                    break;
                };
                match cell.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(seen) => cur = seen,
                }
            }
        }
        if let Some((g, other)) = clash {
            let at = self.base + g as u64 * GRANULE;
            record(
                &self.overlaps,
                &self.first_overlap,
                format!(
                    "block #{tag} [{addr:#x}, +{len}) used on stream {stream} while block #{other} still held {at:#x}"
                ),
            );
        }
    }

    /// The `unuse` host function. A granule held by another tag is one where `mark` clashed
    /// (already counted): leave it to its holder.
    fn unmark(&self, tag: u64, addr: u64, len: u64) {
        for g in self.granules(addr, len) {
            let cell = &self.cells[g];
            let mut cur = cell.load(Ordering::Acquire);
            loop {
                if cur >> 8 != tag {
                    break;
                }
                let next = if cur & 0xff == 1 { 0 } else { cur - 1 };
                match cell.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(seen) => cur = seen,
                }
            }
        }
    }

    fn error(&self, what: String) {
        record(&self.errors, &self.first_error, what);
    }

    fn is_clean(&self) -> bool {
        self.cells.iter().all(|c| c.load(Ordering::Acquire) == 0)
    }
}

fn record(count: &AtomicU64, first: &Mutex<Option<String>>, what: String) {
    if count.fetch_add(1, Ordering::AcqRel) == 0 {
        *first.lock().unwrap_or_else(|p| p.into_inner()) = Some(what);
    }
}

/// xorshift64*: the test needs cheap, seedable randomness, not quality.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    /// Uniform in `[lo, hi]`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Log-uniform in `[2^lo_bits, 2^hi_bits)`: as many small requests as large ones.
    fn log_uniform(&mut self, lo_bits: u64, hi_bits: u64) -> u64 {
        let k = self.range(lo_bits, hi_bits - 1);
        self.range(1 << k, (2 << k) - 1)
    }

    /// Mostly 256 B – 1 MiB; now and then sub-granule requests and large ones up to 8 MiB.
    fn size(&mut self) -> usize {
        (match self.below(64) {
            0 => self.range(1, 255),
            1 => self.log_uniform(20, 23),
            _ => self.log_uniform(8, 20),
        }) as usize
    }

    /// 70%: one of a few fixed sizes (some not multiples of 256, so the classes round them);
    /// 30%: log-uniform in 256 B – 4 MiB.
    fn repeating_size(&mut self) -> usize {
        const FIXED: [u64; 8] = [256, 1000, 4096, 12_000, 65_536, 200_000, 1 << 20, 3 << 20];
        (if self.below(10) < 7 { FIXED[self.below(FIXED.len() as u64) as usize] } else { self.log_uniform(8, 22) })
            as usize
    }
}

/// A block held by a worker, and the streams that have used it (its own first).
struct Live {
    block: Block,
    tag: u64,
    used_on: Vec<usize>,
}

/// Everything the workers share.
struct World {
    dev: SimDevice,
    pool: Pool,
    streams: Vec<Stream>,
    shadow: Arc<Shadow>,
    next_tag: AtomicU64,
    lag: Lag,
    sizes: Sizes,
    churn: Churn,
    /// Threads that drain an inbox until every thread is done: blocks are handed only to them.
    receivers: Vec<usize>,
    /// Host functions queued on each stream and not yet run.
    backlog: Vec<Arc<AtomicU64>>,
    allocs: AtomicU64,
    frees: AtomicU64,
    hops: AtomicU64,
    host_fn_drops: AtomicU64,
    cross_thread_drops: AtomicU64,
    /// Allocations through an explicit `StreamCache`, and the midway trim's duration.
    stream_cache_allocs: AtomicU64,
    midway_trim: Mutex<Option<Duration>>,
}

impl World {
    fn size(&self, rng: &mut Rng) -> usize {
        match self.sizes {
            Sizes::Spread => rng.size(),
            Sizes::Repeating => rng.repeating_size(),
        }
    }

    fn enqueue(&self, s: usize, f: impl FnOnce() + Send + 'static) {
        let backlog = Arc::clone(&self.backlog[s]);
        while backlog.load(Ordering::Acquire) >= MAX_BACKLOG {
            std::thread::yield_now();
        }
        backlog.fetch_add(1, Ordering::AcqRel);
        let run = move || {
            f();
            backlog.fetch_sub(1, Ordering::AcqRel);
        };
        if let Err(e) = self.dev.enqueue(&self.streams[s], run) {
            self.shadow.error(format!("enqueue on stream {s}: {e}"));
        }
    }

    /// Enqueue `use` of the block on stream `s`, then now and then a stall, so the stream
    /// holds the block for a while and falls behind the host.
    fn use_on(&self, s: usize, l: &Live, rng: &mut Rng) {
        let (shadow, tag, addr, len) = (Arc::clone(&self.shadow), l.tag, l.block.device_ptr(), l.block.capacity());
        self.enqueue(s, move || shadow.mark(tag, addr, len as u64, s as u64));
        if rng.one_in(self.lag.one_in) {
            let us = rng.range(self.lag.min_us, self.lag.max_us);
            self.enqueue(s, move || stall(us));
        }
    }

    fn alloc(&self, s: usize, rng: &mut Rng, cache: Option<&StreamCache>) -> Option<Live> {
        let size = self.size(rng);
        let got = match cache {
            Some(c) => {
                self.stream_cache_allocs.fetch_add(1, Ordering::Relaxed);
                c.alloc(size)
            }
            None => self.pool.alloc(size, &self.streams[s]),
        };
        let block = match got {
            Ok(b) => b,
            Err(e) => {
                self.shadow.error(format!("alloc({size}) on stream {s}: {e}"));
                return None;
            }
        };
        self.allocs.fetch_add(1, Ordering::Relaxed);
        if block.capacity() < size || !self.shadow.covers(block.device_ptr(), block.capacity() as u64) {
            self.shadow.error(format!("alloc({size}) gave {block:?}, outside the pool's range or too small"));
            return None;
        }
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let mut l = Live { block, tag, used_on: vec![s] };
        self.use_on(s, &l, rng);
        if rng.one_in(8) {
            let n = self.streams.len();
            let o = (s + rng.range(1, n as u64 - 1) as usize) % n;
            // As on a GPU, the consumer stream is made to wait for the producer before it
            // touches the block; the pool's part is only the free, via `record_stream`.
            if let Err(e) = self.wait(o, s) {
                self.shadow.error(format!("stream {o} waiting for stream {s}: {e}"));
                return Some(l);
            }
            l.block.record_stream(&self.streams[o]);
            l.used_on.push(o);
            self.use_on(o, &l, rng);
            self.hops.fetch_add(1, Ordering::Relaxed);
        }
        Some(l)
    }

    /// Make stream `waiter` wait for the work enqueued on stream `on` so far.
    fn wait(&self, waiter: usize, on: usize) -> vrampool::Result<()> {
        let ev = self.dev.create_event()?;
        self.dev.record_event(&ev, &self.streams[on])?;
        self.dev.stream_wait_event(&self.streams[waiter], &ev)
    }

    /// End every stream's use of the block (in stream order, before the free), then free it:
    /// here, on another thread, or inside a host function on its own stream.
    fn free(&self, l: Live, rng: &mut Rng, inboxes: &[Sender<Block>], me: usize) {
        for &s in &l.used_on {
            let (shadow, tag, addr, len) = (Arc::clone(&self.shadow), l.tag, l.block.device_ptr(), l.block.capacity());
            self.enqueue(s, move || shadow.unmark(tag, addr, len as u64));
        }
        self.frees.fetch_add(1, Ordering::Relaxed);
        match rng.below(16) {
            0 => {
                // A drop where no device call is allowed: the pool must defer, not fail.
                self.host_fn_drops.fetch_add(1, Ordering::Relaxed);
                let block = l.block;
                self.enqueue(l.used_on[0], move || drop(block));
            }
            1 => {
                // Another receiver: it drains its inbox until no sender is left (`running`).
                let others = self.receivers.iter().filter(|&&r| r != me).count() as u64;
                if others == 0 {
                    drop(l.block);
                    return;
                }
                let k = rng.below(others) as usize;
                let to = *self.receivers.iter().filter(|&&r| r != me).nth(k).unwrap();
                self.cross_thread_drops.fetch_add(1, Ordering::Relaxed);
                let _ = inboxes[to].send(l.block);
            }
            _ => drop(l.block),
        }
    }

    fn worker(&self, me: usize, allocs: u64, inboxes: &[Sender<Block>], inbox: Receiver<Block>, running: &AtomicU64) {
        let s = me % self.streams.len();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (me as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
        // Not `Send`: made here, on the thread that uses it.
        let cache = if self.churn.uses_stream_cache(me) {
            match self.pool.stream_cache(&self.streams[s]) {
                Ok(c) => Some(c),
                Err(e) => {
                    self.shadow.error(format!("stream_cache on stream {s}: {e}"));
                    None
                }
            }
        } else {
            None
        };
        let mut live: Vec<Live> = Vec::with_capacity(WINDOW);
        let mut done = 0;
        while done < allocs && self.shadow.errors.load(Ordering::Relaxed) == 0 {
            // Blocks other threads freed into this one's hands.
            while let Ok(b) = inbox.try_recv() {
                drop(b);
            }
            if live.len() == WINDOW || (!live.is_empty() && rng.one_in(2)) {
                let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                self.free(l, &mut rng, inboxes, me);
            } else {
                done += 1;
                live.extend(self.alloc(s, &mut rng, cache.as_ref()));
                if done == allocs / 2 {
                    self.midway(me);
                }
            }
        }
        while let Some(l) = live.pop() {
            self.free(l, &mut rng, inboxes, me);
        }
        drop(cache);
        running.fetch_sub(1, Ordering::AcqRel);
        if self.churn.exits_early(me) {
            // Nobody hands this thread blocks: it exits now, and its caches flush on exit.
            return;
        }
        // Blocks sent here after this thread's last alloc are live memory until dropped: keep
        // draining until every sender is done (its sends happen before its decrement).
        loop {
            let last = running.load(Ordering::Acquire) == 0;
            while let Ok(b) = inbox.try_recv() {
                drop(b);
            }
            if last {
                break;
            }
            std::thread::yield_now();
        }
    }

    /// Halfway through a thread's share: trim the pool, or flush this thread's caches, while
    /// the other threads run on.
    fn midway(&self, me: usize) {
        if !self.churn.midway {
            return;
        }
        if self.churn.trims(me) {
            let t = Instant::now();
            if let Err(e) = self.pool.trim() {
                self.shadow.error(format!("trim midway: {e}"));
            }
            *self.midway_trim.lock().unwrap_or_else(|p| p.into_inner()) = Some(t.elapsed());
        }
        if Churn::FLUSHERS.contains(&me) {
            self.pool.flush_thread_cache();
        }
    }
}

/// Hold the calling stream worker for `us` microseconds: spin when short (a sleep would
/// overshoot by tens of µs), sleep when long.
fn stall(us: u64) {
    let until = Instant::now() + Duration::from_micros(us);
    if us >= 50 {
        std::thread::sleep(Duration::from_micros(us));
    }
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

fn stress(run: Run) -> Outcome {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dev = SimDevice::new(1 << 30);
    let pool = Pool::new(dev.clone(), run.config).unwrap();
    let streams: Vec<Stream> = (0..run.streams).map(|_| dev.new_stream().unwrap()).collect();
    let world = World {
        dev: dev.clone(),
        pool: pool.clone(),
        streams,
        shadow: Arc::new(Shadow::new(pool.address_range())),
        next_tag: AtomicU64::new(1),
        lag: run.lag,
        sizes: run.sizes,
        churn: run.churn,
        // Not the trimmer either: a trim waits for every stream's work so far, which on a
        // busy 2-core machine took seconds, and the blocks other threads handed it meanwhile
        // (up to 150 MiB) sat in its inbox, live, until the pool ran out.
        receivers: (0..run.threads).filter(|&me| !(run.churn.exits_early(me) || run.churn.trims(me))).collect(),
        backlog: (0..run.streams).map(|_| Arc::new(AtomicU64::new(0))).collect(),
        allocs: AtomicU64::new(0),
        frees: AtomicU64::new(0),
        hops: AtomicU64::new(0),
        host_fn_drops: AtomicU64::new(0),
        cross_thread_drops: AtomicU64::new(0),
        stream_cache_allocs: AtomicU64::new(0),
        midway_trim: Mutex::new(None),
    };
    // Each thread's share of the allocs (half the ops): a thread that exits early does a
    // quarter of a full share, and the full shares make up the difference.
    let weight = |me: usize| if run.churn.exits_early(me) { 1 } else { 4 };
    let total_weight: u64 = (0..run.threads).map(weight).sum();
    let share = |me: usize| (run.ops / 2).saturating_mul(weight(me)).div_ceil(total_weight);
    let start = Instant::now();
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..run.threads).map(|_| channel::<Block>()).unzip();
    let running = AtomicU64::new(run.threads as u64);
    std::thread::scope(|scope| {
        let handles: Vec<_> = receivers
            .into_iter()
            .enumerate()
            .map(|(me, inbox)| {
                let (world, senders, running) = (&world, &senders, &running);
                let allocs = share(me);
                scope.spawn(move || world.worker(me, allocs, senders, inbox, running))
            })
            .collect();
        // Joined one by one, not left to the scope: the scope returns before the threads'
        // thread-local destructors have run (rust#116179), and those flush the threads'
        // caches. A join waits for them.
        for h in handles {
            if let Err(panic) = h.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    // Blocks dropped inside host functions are freed once their streams get there.
    for s in &world.streams {
        dev.synchronize(s).unwrap();
    }
    let elapsed = start.elapsed();
    assert_eq!(dev.host_fn_panics(), 0, "{}: a host function panicked", run.name);
    pool.trim().unwrap();
    pool.check().unwrap();
    let stats = pool.stats();
    let shadow = &world.shadow;
    let lock = |m: &Mutex<Option<String>>| m.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let out = Outcome {
        overlaps: shadow.overlaps.load(Ordering::Acquire),
        first_overlap: lock(&shadow.first_overlap),
        errors: shadow.errors.load(Ordering::Acquire),
        first_error: lock(&shadow.first_error),
        allocs: world.allocs.load(Ordering::Acquire),
        frees: world.frees.load(Ordering::Acquire),
        hops: world.hops.load(Ordering::Acquire),
        host_fn_drops: world.host_fn_drops.load(Ordering::Acquire),
        cross_thread_drops: world.cross_thread_drops.load(Ordering::Acquire),
        stream_cache_allocs: world.stream_cache_allocs.load(Ordering::Acquire),
        midway_trim: *world.midway_trim.lock().unwrap_or_else(|p| p.into_inner()),
        stats,
        shadow_clean: shadow.is_clean(),
        elapsed,
    };
    eprintln!(
        "{}: {} ops ({} allocs + {} frees; {} hopped streams, {} dropped in host fns, {} on other threads) \
         in {:.2?}; overlaps {}, errors {}",
        run.name,
        out.allocs + out.frees,
        out.allocs,
        out.frees,
        out.hops,
        out.host_fn_drops,
        out.cross_thread_drops,
        out.elapsed,
        out.overlaps,
        out.errors
    );
    eprintln!(
        "{}: events recorded {}, batches retired {}, same-stream reuses {}, ladder flushes {}, maps {}, \
         waits {}, steals {}, ooms {}; peak reserved {} MiB (max {} MiB), peak allocated {} MiB",
        run.name,
        stats.events_recorded,
        stats.batches_retired,
        stats.same_stream_reuses,
        stats.ladder_flushes,
        stats.ladder_maps,
        stats.ladder_waits,
        stats.ladder_steals,
        stats.ooms,
        stats.peak_reserved_bytes >> 20,
        pool.max_reserved() >> 20,
        stats.peak_allocated_bytes >> 20
    );
    eprintln!(
        "{}: {} threads on {} streams; T0 hit rate {:.1}% ({}), T1 hit rate {:.1}% ({}) of {} pool allocs; \
         {} through StreamCaches; {} thread caches left registered{}",
        run.name,
        run.threads,
        run.streams,
        100.0 * stats.t0_hit_rate(),
        stats.t0_hits,
        100.0 * stats.t1_hit_rate(),
        stats.t1_hits,
        stats.allocs,
        out.stream_cache_allocs,
        stats.thread_caches,
        out.midway_trim.map(|d| format!("; midway trim took {d:.2?}")).unwrap_or_default()
    );
    if let Some(first) = &out.first_overlap {
        eprintln!("{}: first overlap: {first}", run.name);
    }
    out
}

fn config(max_reserved: u64) -> PoolConfig {
    PoolConfig { address_range: Some(RANGE), max_reserved: Some(max_reserved), ..Default::default() }
}

#[test]
fn no_two_blocks_overlap_on_any_streams_clock() {
    let out = stress(Run {
        name: "stress",
        config: config(256 << 20),
        ops: default_ops(),
        lag: Lag { one_in: 32, min_us: 1, max_us: 20 },
        threads: THREADS,
        streams: STREAMS,
        sizes: Sizes::Spread,
        churn: Churn::default(),
    });
    assert_eq!(out.errors, 0, "first error: {:?}", out.first_error);
    assert_eq!(out.overlaps, 0, "first overlap: {:?}", out.first_overlap);
    assert!(out.allocs + out.frees >= default_ops(), "ran {} ops", out.allocs + out.frees);
    assert_eq!(out.allocs, out.frees);
    assert!(out.shadow_clean, "every use was followed by its unuse, so no granule may stay marked");
    assert_eq!(out.stats.allocs, out.allocs, "the pool counted every alloc");
    assert!(out.hops > 0 && out.host_fn_drops > 0 && out.cross_thread_drops > 0);
    let st = out.stats;
    assert_eq!((st.allocated_bytes, st.live_blocks), (0, 0), "every block was dropped");
    assert_eq!((st.reserved_bytes, st.cached_bytes, st.retiring_bytes), (0, 0, 0), "trim gave everything back");
}

#[test]
fn stress_catches_a_broken_event_guard() {
    // Every fence and retire event counts as complete and no device wait is set up, and the
    // streams stall for 50–200 µs often, so memory freed on a stream goes to other streams
    // while the freeing stream is still using it.
    let config = PoolConfig { break_event_guard_for_tests: true, ..config(256 << 20) };
    let out = stress(Run {
        name: "broken guard",
        config,
        ops: default_ops().min(200_000),
        lag: Lag { one_in: 4, min_us: 50, max_us: 200 },
        threads: THREADS,
        streams: STREAMS,
        sizes: Sizes::Spread,
        churn: Churn::default(),
    });
    assert_eq!(out.errors, 0, "first error: {:?}", out.first_error);
    assert!(out.overlaps > 0, "the harness did not notice memory reused across streams before its free");
}

#[test]
fn caches_under_16_threads_and_6_streams() {
    let ops = default_ops();
    let out = stress(Run {
        name: "caches",
        // 384 MiB for 16 threads whose caches may each hold 256 MiB, and streams that lag:
        // the out-of-memory ladder flushes, maps, waits and takes idle caches' blocks.
        config: config(384 << 20),
        ops,
        lag: Lag { one_in: 32, min_us: 1, max_us: 20 },
        threads: 16,
        streams: 6,
        sizes: Sizes::Repeating,
        churn: Churn { stream_caches: true, midway: true, early_exits: true },
    });
    assert_eq!(out.errors, 0, "first error: {:?}", out.first_error);
    assert_eq!(out.overlaps, 0, "first overlap: {:?}", out.first_overlap);
    assert!(out.allocs + out.frees >= ops, "ran {} ops", out.allocs + out.frees);
    assert_eq!(out.allocs, out.frees);
    assert!(out.shadow_clean, "every use was followed by its unuse, so no granule may stay marked");
    let st = out.stats;
    assert_eq!(st.allocs, out.allocs, "the pool counted every alloc");
    assert!(out.hops > 0 && out.host_fn_drops > 0 && out.cross_thread_drops > 0);
    assert!(out.stream_cache_allocs > 0 && out.stream_cache_allocs < out.allocs, "both ways of allocating ran");
    assert!(out.midway_trim.is_some(), "the midway trim ran");
    assert!(st.t0_hits > 0, "the thread caches hit: {st:?}");
    assert!(st.ladder_flushes > 0 && st.ladder_maps > 0, "the ladder ran: {st:?}");
    assert!(st.peak_reserved_bytes <= 384 << 20, "mapped past max_reserved: {st:?}");
    assert_eq!((st.allocated_bytes, st.live_blocks), (0, 0), "every block was dropped");
    assert_eq!((st.reserved_bytes, st.cached_bytes, st.retiring_bytes), (0, 0, 0), "trim gave everything back");
}
