//! Cheap timestamps for the time the slow paths count (`Stats::ladder_ns`, `release_ns`,
//! `map_ns`, `unmap_ns`).
//!
//! Every climb of the ladder and every free around the caches is timed, so a clock read is
//! on every miss: a `std::time::Instant` read is a `clock_gettime` call, and on the
//! development machine those calls were a sixth of an uncached 8 MiB pair's time
//! (`docs/BENCHMARKS.md`, tenth session). On x86-64 with an invariant TSC (one that runs at
//! a constant rate in every power state and is the same on every core: CPUID leaf
//! `0x8000_0007`, EDX bit 8), the counters add up TSC ticks instead (`rdtsc`, a few ns), and
//! ticks become nanoseconds when the counters are read, at a rate measured once: at the
//! first read, over the time since the process's first tick, at least 10 ms of it (a read
//! sooner waits for the rest; a window of 200 µs was off by 5% at times on a busy virtual
//! machine). Once, so that a counter reads the same every time: a rate measured at each
//! read made the C ABI's statistics change length between two calls on a quiet pool.
//! Elsewhere a tick is a nanosecond of `Instant` since that first tick.
//!
//! Only statistics depend on this: no decision of the pool reads a tick.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where the process's ticks start.
struct Origin {
    instant: Instant,
    /// The TSC when `instant` was read; `None` where ticks are `Instant`'s nanoseconds.
    tsc_at: Option<u64>,
}

/// The least time over which the TSC's rate is measured against `Instant`.
const CALIBRATION: Duration = Duration::from_millis(10);

static ORIGIN: OnceLock<Origin> = OnceLock::new();
/// Nanoseconds per TSC tick, measured at the first read of a count.
static RATE: OnceLock<f64> = OnceLock::new();

fn origin() -> &'static Origin {
    ORIGIN.get_or_init(|| {
        let tsc = invariant_tsc();
        Origin { instant: Instant::now(), tsc_at: tsc.then(read_tsc) }
    })
}

/// A timestamp in ticks: only the difference of two means anything ([`to_ns`]).
#[inline]
pub(crate) fn ticks() -> u64 {
    let o = origin();
    match o.tsc_at {
        Some(_) => read_tsc(),
        None => u64::try_from(o.instant.elapsed().as_nanos()).unwrap_or(u64::MAX),
    }
}

/// `ticks` (a sum of tick differences) in nanoseconds.
pub(crate) fn to_ns(ticks: u64) -> u64 {
    let o = origin();
    let Some(start) = o.tsc_at else { return ticks };
    let rate = RATE.get_or_init(|| {
        if let Some(rest) = CALIBRATION.checked_sub(o.instant.elapsed()) {
            std::thread::sleep(rest);
        }
        let (ns, elapsed) = (o.instant.elapsed().as_nanos() as f64, read_tsc().wrapping_sub(start) as f64);
        if elapsed >= 1.0 {
            ns / elapsed
        } else {
            0.0
        }
    });
    (ticks as f64 * rate) as u64
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
        let (t0, i0) = (ticks(), Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (t1, i1) = (ticks(), Instant::now());
        let ns = to_ns(t1 - t0) as f64;
        let real = (i1 - i0).as_nanos() as f64;
        assert!((ns / real - 1.0).abs() < 0.05, "{ns} ns by ticks against {real} by Instant");
    }

    #[test]
    fn a_count_reads_the_same_every_time() {
        let t = 123_456_789;
        let first = to_ns(t);
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(to_ns(t), first, "a counter's value must not move while nothing adds to it");
    }
}
