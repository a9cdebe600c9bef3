//! [`PoolConfig`]: how a pool behaves, every knob with its default and the reason for it.
//! The figures behind the defaults are in `docs/BENCHMARKS.md`.

use crate::class;

/// How a pool behaves. `Default` gives what most servers want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Most physical memory the pool may map, in bytes. `None`: 80% of the device's memory.
    pub max_reserved: Option<u64>,
    /// Free mapped bytes kept between trims; past it, wholly free pages no stream's work can
    /// touch are unmapped as events complete (as `cudaMemPoolAttrReleaseThreshold`). Default
    /// `u64::MAX`: keep them, since pages reused soon would only be mapped again (~40 µs a
    /// page on an H200, under a driver lock every mapping thread shares);
    /// `trade_pages_on_map` keeps the footprint down instead.
    pub release_threshold: u64,
    /// Bytes of address space to reserve (rounded up to a power of two). `None`: four times
    /// the device's memory.
    pub address_range: Option<u64>,
    /// No longer used: freed memory does not wait in batches (it goes back to its stream's
    /// arena at once, with a fence; see `IMPLEMENTATION.md`). Kept so that code setting it
    /// still builds.
    #[deprecated(note = "ignored: freed memory goes back to the arena at once, behind a fence")]
    pub batch_blocks: u64,
    /// No longer used, as `batch_blocks`.
    #[deprecated(note = "ignored: freed memory goes back to the arena at once, behind a fence")]
    pub batch_bytes: u64,
    /// No longer used: a large block freed on a stream is reused by that stream through the
    /// arena, at any size.
    #[deprecated(note = "ignored: same-stream reuse goes through the arena")]
    pub reuse_slack_div: u64,
    /// No longer used: a stream reuses its own freed memory without waiting for an event,
    /// so there is nothing to poll for before mapping.
    #[deprecated(note = "ignored: same-stream reuse needs no event")]
    pub poll_before_map: std::time::Duration,
    /// The largest size class kept in the caches (rounded to a class); larger requests go
    /// to the arena directly. Default 4 MiB: larger blocks held in busy threads' caches were
    /// memory other threads' requests then mapped afresh (`IMPLEMENTATION.md`).
    pub largest_cached_class: u64,
    /// Most bytes one thread's cache for one stream may hold.
    pub thread_cache_bytes: u64,
    /// A magazine holds at most this many bytes (and at most 32 blocks, at least one).
    pub magazine_bytes: u64,
    /// Most full magazines a stream's depot keeps per size class.
    pub depot_magazines: usize,
    /// When a miss must map pages past the pool's peak while wholly free pages stay mapped
    /// where it did not fit, trade those instead (lend their memory to where the request
    /// lands, or on a device that cannot map memory twice, unmap them first): the pool
    /// keeps its peak rather than grow it. Below the peak nothing is traded. Default true:
    /// the memory figure first. A steady state that sits at its peak keeps trading, and its
    /// misses climb the ladder more often: false holds more and runs faster (the random
    /// window on an H100: 2.5–5.5× the throughput for 17–28% more reserved; the `server`
    /// example on the simulator with an H200's costs: 1.66–1.68× peak live instead of
    /// 1.10–1.15 for 10–26% less time; `docs/BENCHMARKS.md`, sixteenth session).
    pub trade_pages_on_map: bool,
    /// Blocks of this many bytes or more are placed first fit at 64 KiB granularity in the
    /// pool's extents (the next block starts where the last ended); smaller ones come from
    /// their stream's buddy arena over 2 MiB chunks. Between 512 KiB (from where size
    /// classes are whole granules, so cached blocks lose nothing to the granule) and 2 MiB.
    /// Default 512 KiB: blocks of a chunk's size share no chunk with small ones, which would
    /// keep the chunk from going back when they are freed (8 threads near their limit held
    /// 36 chunks half empty at 2 MiB, 12 at 512 KiB); on the shared traces it costs nothing.
    pub large_block_threshold: u64,
    /// Pages mapped in one device call, as one physical allocation, when a block lands on
    /// several unmapped pages in a row (1..=[`PoolConfig::MAX_MAP_RUN_PAGES`]). On CUDA a map costs per allocation, not per
    /// page, so longer runs make growth far cheaper; but a run is unmapped only whole and its
    /// pages cannot be lent (a loan maps a whole allocation again: the driver takes no offset
    /// into one), so the pool holds more. The costs and the trade, measured on an H200:
    /// `benches/vmm_probe.c`, `docs/BENCHMARKS.md`. Default 1: the memory figure first. The
    /// registry's pools (the C ABI's, PyTorch's) default to
    /// [`crate::registry::REGISTRY_MAP_RUN_PAGES`] instead (`VRAMPOOL_MAP_RUN_PAGES`).
    pub map_run_pages: usize,
    /// Most bytes all caches of the pool together (thread caches and depots) may hold.
    /// `None`: half of `max_reserved`.
    pub max_cached_bytes: Option<u64>,
    /// Let a stream take memory another stream freed before the host has seen that stream's
    /// work on it complete, by making it wait for that work on the device
    /// (`stream_wait_event`), as `cuMemAllocAsync` does with
    /// `cudaMemPoolReuseAllowInternalDependencies`. Only where the pool would otherwise map
    /// past its peak. Default true: the footprint of a busy server does not grow with how far
    /// its GPU runs behind. A stream remembers the waits it made, and memory they cover is
    /// then ready for it on every rung with no further wait. False keeps streams independent
    /// at the cost of memory.
    pub cross_stream_waits: bool,
    /// Bytes mapped when the pool is made and kept mapped through `trim()` and the release
    /// threshold (a floor), so that the first requests pay no mapping. Default 0. What the
    /// floor holds without mapping more: [`Pool::reserve`](super::Pool::reserve).
    pub preallocate: u64,
    /// Record every live block's size, stream and allocation site (the file and line of the
    /// `alloc` call) for [`Pool::snapshot`](super::Pool::snapshot) and
    /// [`Pool::leaks`](super::Pool::leaks). A debugging aid: it keeps the caches empty
    /// (every allocation and free takes the slow paths, where the record is made in a
    /// lock-free map), so that when it is off the hit path carries nothing for it. Default
    /// false.
    pub track_sites: bool,
    /// Write every allocation and free to this file as a trace (CSV `op,id,size,stream`,
    /// what `examples/replay.rs` and [`crate::replay`] play), so that a server's own
    /// workload can be replayed offline against other configurations and allocators. Lines
    /// are buffered; [`Pool::flush_trace`](super::Pool::flush_trace) writes them out (and a
    /// dropped pool does). Like `track_sites`, it keeps the caches empty (every allocation
    /// and free takes the slow paths, where the line is written under a lock, in the order
    /// the events happened): a measuring tool, not for production runs. A path that cannot
    /// be created fails [`Pool::new`](super::Pool::new). Default `None`.
    pub record_trace: Option<std::path::PathBuf>,
    /// Test-only: treat every fence and retire event as complete and skip device waits, so
    /// memory freed on one stream can be handed to another before the GPU is done with it.
    /// Exists so that stress tests can show they catch a broken guard; never set it otherwise.
    #[doc(hidden)]
    pub break_event_guard_for_tests: bool,
}

impl PoolConfig {
    /// The longest run [`PoolConfig::map_run_pages`] may ask for (longer values are taken as
    /// this).
    pub const MAX_MAP_RUN_PAGES: usize = crate::arena::MAX_RUN;
}

impl Default for PoolConfig {
    #[allow(deprecated)]
    fn default() -> Self {
        PoolConfig {
            max_reserved: None,
            release_threshold: u64::MAX,
            address_range: None,
            batch_blocks: 64,
            batch_bytes: 64 << 20,
            reuse_slack_div: 8,
            poll_before_map: std::time::Duration::from_micros(200),
            largest_cached_class: class::DEFAULT_LARGEST_CLASS,
            thread_cache_bytes: 256 << 20,
            magazine_bytes: 8 << 20,
            depot_magazines: 8,
            max_cached_bytes: None,
            trade_pages_on_map: true,
            map_run_pages: 1,
            large_block_threshold: 512 << 10,
            cross_stream_waits: true,
            preallocate: 0,
            track_sites: false,
            record_trace: None,
            break_event_guard_for_tests: false,
        }
    }
}
