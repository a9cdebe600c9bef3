//! Cheap timestamps for the time the slow paths count (`Stats::ladder_ns`, `release_ns`,
//! `map_ns`, `unmap_ns`).
//!
//! Every climb of the ladder and every free around the caches is timed, so a clock read is
//! on every miss: a `std::time::Instant` read is a `clock_gettime` call, and on the
//! development machine those calls were a sixth of an uncached 8 MiB pair's time
//! (`docs/BENCHMARKS.md`, tenth session). On x86-64 with an invariant TSC (one that runs at
//! a constant rate in every power state and is the same on every core: CPUID leaf
//! `0x8000_0007`, EDX bit 8), the counters add up TSC ticks instead (`rdtsc`, a few ns), and
//! ticks become nanoseconds when the counters are read: at the rate the TSC and `Instant`
//! both ran at since this process's first tick. Elsewhere a tick is a nanosecond of
//! `Instant` since that first tick.
//!
//! Only statistics depend on this: no decision of the pool reads a tick.

use std::sync::OnceLock;
use std::time::Instant;

/// Where the process's ticks start, read once.
struct Origin {
    instant: Instant,
    /// The TSC when `instant` was read.
    tsc_at: u64,
    /// Whether ticks are TSC ticks.
    tsc: bool,
}

static ORIGIN: OnceLock<Origin> = OnceLock::new();

fn origin() -> &'static Origin {
    ORIGIN.get_or_init(|| {
        let tsc = invariant_tsc();
        Origin { instant: Instant::now(), tsc_at: if tsc { read_tsc() } else { 0 }, tsc }
    })
}

/// A timestamp in ticks: only the difference of two means anything ([`to_ns`]).
#[inline]
pub(crate) fn ticks() -> u64 {
    let o = origin();
    if o.tsc {
        read_tsc()
    } else {
        u64::try_from(o.instant.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// `ticks` (a sum of tick differences) in nanoseconds.
pub(crate) fn to_ns(ticks: u64) -> u64 {
    let o = origin();
    if !o.tsc {
        return ticks;
    }
    let ns = o.instant.elapsed().as_nanos() as f64;
    let elapsed = read_tsc().wrapping_sub(o.tsc_at) as f64;
    if elapsed < 1.0 {
        return 0;
    }
    (ticks as f64 * ns / elapsed) as u64
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn read_tsc() -> u64 {
    // SAFETY: `rdtsc` exists on every x86-64 processor and has no preconditions.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn read_tsc() -> u64 {
    0
}

/// Whether the processor's TSC is invariant (see the module docs).
#[cfg(target_arch = "x86_64")]
fn invariant_tsc() -> bool {
    use core::arch::x86_64::__cpuid;
    // `__cpuid` is a safe function in newer Rust and an unsafe one in the oldest this crate
    // builds with (1.82).
    #[allow(unused_unsafe)]
    // SAFETY: `cpuid` exists on every x86-64 processor; leaf 0x8000_0000 gives the highest
    // extended leaf, and 0x8000_0007 is asked only when it is at most that.
    unsafe {
        __cpuid(0x8000_0000).eax >= 0x8000_0007 && __cpuid(0x8000_0007).edx & (1 << 8) != 0
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn invariant_tsc() -> bool {
    false
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn ticks_over_a_sleep_read_as_about_its_length_in_ns() {
        // Let the rate settle past the origin first, as any pool's does.
        let _ = ticks();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (t0, i0) = (ticks(), Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (t1, i1) = (ticks(), Instant::now());
        let ns = to_ns(t1 - t0) as f64;
        let real = (i1 - i0).as_nanos() as f64;
        assert!((ns / real - 1.0).abs() < 0.05, "{ns} ns by ticks against {real} by Instant");
    }
}
