//! Driver costs for the simulated device, and the device-time model behind
//! [`Device::spin`](super::Device::spin): what a GPU's driver and engines cost, made visible on
//! a machine without one.
//!
//! **Driver costs** ([`SimCosts`]) are spent on the calling thread, inside the call, as the
//! driver's are:
//!
//! - a map costs `map_call + pages × map_page`, an unmap `unmap_call + pages × unmap_page`;
//!   both are spent while holding one device-wide driver lock, so maps and unmaps from
//!   several threads queue behind each other as they do behind the CUDA driver's lock (they
//!   do not hold the simulator's memory lock meanwhile: streams keep running, as a GPU's do);
//! - creating, recording and querying an event cost their own figure each, with no lock (the
//!   anchors measure them on one thread only, so the model adds no contention of its own).
//!
//! Short costs are spun (a sleep on Linux overshoots by tens of µs); a long one sleeps all
//! but its last 100 µs, then spins, so it stays accurate without holding a core for
//! milliseconds.
//!
//! **Device time** (the default [`Device::spin`](super::Device::spin)) is a timeline per
//! host-function thread (on the simulator, one per stream): a span of `n` µs starts when it
//! was enqueued or when the previous span on that thread ended, whichever is later, and the
//! thread waits until it ends. Waits longer than a few µs sleep, so a 2-core machine can
//! simulate many busy streams; a sleep that overshoots only delays the next span's start,
//! never its end, so a stream with work queued keeps exactly its device throughput, as a GPU
//! running back-to-back kernels does.

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What each driver call of a simulated device costs; every field defaults to zero (no cost).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimCosts {
    /// Fixed cost of one map call (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`).
    pub map_call: Duration,
    /// Added per granularity page the map call covers.
    pub map_page: Duration,
    /// Fixed cost of one unmap call.
    pub unmap_call: Duration,
    /// Added per granularity page the unmap call covers.
    pub unmap_page: Duration,
    /// One `cuEventCreate`.
    pub event_create: Duration,
    /// One `cuEventRecord`.
    pub event_record: Duration,
    /// One `cuEventQuery`.
    pub event_query: Duration,
}

impl SimCosts {
    /// No costs: the simulator as [`SimDevice::new`](super::SimDevice::new) makes it.
    pub const NONE: SimCosts = SimCosts {
        map_call: Duration::ZERO,
        map_page: Duration::ZERO,
        unmap_call: Duration::ZERO,
        unmap_page: Duration::ZERO,
        event_create: Duration::ZERO,
        event_record: Duration::ZERO,
        event_query: Duration::ZERO,
    };

    /// The H200 anchors of the design (driver 580, 2 MiB pages): a one-page map costs 40 µs
    /// and one of 64 pages 173 µs, hence 38 µs a call plus 2.1 µs a page (40.1 and 172.4);
    /// an unmap ~29 µs a page, charged for every page (no multi-page unmap was measured, so
    /// the model takes the page-by-page figure: the dearer reading); event create 0.3 µs,
    /// record and query 0.5 µs.
    pub fn h200() -> SimCosts {
        SimCosts {
            map_call: Duration::from_micros(38),
            map_page: Duration::from_nanos(2_100),
            unmap_call: Duration::ZERO,
            unmap_page: Duration::from_micros(29),
            event_create: Duration::from_nanos(300),
            event_record: Duration::from_nanos(500),
            event_query: Duration::from_nanos(500),
        }
    }

    /// Whether any call costs anything.
    pub fn is_free(&self) -> bool {
        *self == SimCosts::NONE
    }

    /// The cost of mapping `pages` pages in one call.
    pub fn map(&self, pages: u64) -> Duration {
        self.map_call.saturating_add(per_page(self.map_page, pages))
    }

    /// The cost of unmapping `pages` pages in one call.
    pub fn unmap(&self, pages: u64) -> Duration {
        self.unmap_call.saturating_add(per_page(self.unmap_page, pages))
    }
}

fn per_page(cost: Duration, pages: u64) -> Duration {
    cost.saturating_mul(u32::try_from(pages).unwrap_or(u32::MAX))
}

/// The device-wide lock under which map and unmap costs are spent.
#[derive(Default)]
pub(crate) struct DriverLock(Mutex<()>);

impl DriverLock {
    /// Spend `cost` holding the driver lock; returns the guard so the caller does its work
    /// under it as well. `None` (and no lock taken) when the cost is zero.
    pub(crate) fn spend(&self, cost: Duration) -> Option<MutexGuard<'_, ()>> {
        if cost.is_zero() {
            return None;
        }
        // Nothing is ever done under this lock that can panic: poisoning means nothing.
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        spend(cost);
        Some(guard)
    }
}

/// Spend `cost` of the calling thread's time: spinning when short, sleeping the bulk of a
/// long one.
pub(crate) fn spend(cost: Duration) {
    if cost.is_zero() {
        return;
    }
    wait_until(Instant::now() + cost, Duration::from_micros(100));
}

/// Wait until `deadline`, sleeping while more than `spin_tail` is left and spinning after.
fn wait_until(deadline: Instant, spin_tail: Duration) {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > spin_tail {
            std::thread::sleep(left - spin_tail);
        } else {
            std::hint::spin_loop();
        }
    }
}

std::thread_local! {
    /// When the last span of device time run on this thread ends.
    static BUSY_UNTIL: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Run `span` of device time on the calling (host-function) thread, for work enqueued at
/// `enqueued`: it starts at the later of `enqueued` and the end of this thread's previous
/// span, and this returns when it ends. Waits sleep but for the last 5 µs.
pub(crate) fn busy(enqueued: Instant, span: Duration) {
    let start = match BUSY_UNTIL.try_with(Cell::get).ok().flatten() {
        Some(prev) if prev > enqueued => prev,
        _ => enqueued,
    };
    let end = start + span;
    let _ = BUSY_UNTIL.try_with(|c| c.set(Some(end)));
    wait_until(end, Duration::from_micros(5));
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_h200_model_fits_both_map_anchors() {
        let c = SimCosts::h200();
        let one = c.map(1).as_secs_f64() * 1e6;
        let run = c.map(64).as_secs_f64() * 1e6;
        assert!((one - 40.0).abs() < 1.0, "one page: {one} µs");
        assert!((run - 173.0).abs() < 2.0, "64 pages: {run} µs");
        assert_eq!(c.unmap(3), Duration::from_micros(87));
        assert!(SimCosts::NONE.is_free() && SimCosts::default().is_free() && !c.is_free());
    }

    #[test]
    fn a_cost_takes_at_least_its_time() {
        for us in [1, 30, 400] {
            let t = Instant::now();
            spend(Duration::from_micros(us));
            assert!(t.elapsed() >= Duration::from_micros(us));
        }
    }

    #[test]
    fn queued_spans_end_on_the_timeline_not_after_each_other_s_overshoot() {
        // Ten spans of 200 µs all enqueued at one instant end 2 ms after it (plus one wake-up),
        // however late each wait returned: the next span starts where the previous ended.
        let enqueued = Instant::now();
        for _ in 0..10 {
            busy(enqueued, Duration::from_micros(200));
        }
        let took = enqueued.elapsed();
        assert!(took >= Duration::from_millis(2), "{took:?}");
        let end = BUSY_UNTIL.with(Cell::get).unwrap();
        assert_eq!(end - enqueued, Duration::from_millis(2), "the timeline drifted");
    }
}
