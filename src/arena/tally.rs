//! A byte count that many threads change and few read: [`Tally`], striped over cache lines
//! by thread.
//!
//! # Why
//!
//! The extents count their free bytes on every allocation and free. One counter is one cache
//! line every thread writes: with two threads placing large blocks, its transfers took 40%
//! of each pair's time (`perf` on the arena's hot pair). Here each thread adds to a stripe
//! of its own (given in turn at its first count, so up to [`STRIPES`] threads never share a
//! line); the count is read on cold paths only (the pool's books, a cache's growth check),
//! where summing the stripes is cheap.
//!
//! # Invariants
//!
//! * The count is `base` plus the wrapping sum of the stripes; a stripe alone may read as
//!   negative (a block allocated on one thread and freed on another).
//! * Once quiet, the count is exact. A read racing changes sees each stripe at its own
//!   moment, so it may be off by the changes in flight, never by more.
//!
//! Lock-free: each change is one RMW on one stripe; a read is a load of each.

use crossbeam_utils::CachePadded;

use crate::sync::atomic::{AtomicU64, Ordering};

/// Stripes: more than the threads that place blocks at once on most hosts (under loom two,
/// which keeps the models small and still lets a model's threads collide or not).
#[cfg(not(loom))]
const STRIPES: usize = 16;
#[cfg(loom)]
const STRIPES: usize = 2;

/// A count striped by thread. See the module docs.
pub struct Tally {
    base: u64,
    stripes: [CachePadded<AtomicU64>; STRIPES],
}

#[cfg(not(loom))]
crate::sync::thread_local! {
    /// This thread's stripe + 1 (0: none given yet).
    static STRIPE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Stripes given out so far: threads take them in turn, so the first [`STRIPES`] threads
/// to count never share one (a hash of thread-local addresses, tried first, put two of eight
/// threads on one stripe).
#[cfg(not(loom))]
static NEXT: crate::sync::atomic::AtomicUsize = crate::sync::atomic::AtomicUsize::new(0);

/// The calling thread's stripe, given on its first count. A thread that is exiting (its
/// thread-locals gone) uses stripe 0.
#[cfg(not(loom))]
#[inline]
fn stripe() -> usize {
    STRIPE
        .try_with(|s| match s.get() {
            0 => {
                let mine = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
                s.set(mine + 1);
                mine
            }
            n => n - 1,
        })
        .unwrap_or(0)
}

/// Under loom the stripe must be the same in every execution of a model (an address is
/// not: loom replays schedules and checks what each thread did), so it comes from the
/// model's own thread number.
#[cfg(loom)]
fn stripe() -> usize {
    let id = format!("{:?}", loom::thread::current().id());
    id.bytes().fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(usize::from(b))) % STRIPES
}

impl Tally {
    /// A tally at `base`.
    pub fn new(base: u64) -> Tally {
        Tally { base, stripes: std::array::from_fn(|_| CachePadded::new(AtomicU64::new(0))) }
    }

    /// Add `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.stripes[stripe()].fetch_add(n, Ordering::AcqRel);
    }

    /// Take `n` away.
    #[inline]
    pub fn sub(&self, n: u64) {
        self.stripes[stripe()].fetch_sub(n, Ordering::AcqRel);
    }

    /// The count (exact once quiet; see the module docs).
    pub fn get(&self) -> u64 {
        self.stripes.iter().fold(self.base, |sum, s| sum.wrapping_add(s.load(Ordering::Acquire)))
    }
}

impl std::fmt::Debug for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Tally").field(&self.get()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_exact_once_threads_stop_whichever_stripes_they_used() {
        let t = Tally::new(1 << 30);
        std::thread::scope(|s| {
            for i in 0..8u64 {
                let t = &t;
                s.spawn(move || {
                    for _ in 0..1000 {
                        t.sub(4096 + i);
                        t.add(4096 + i);
                    }
                    t.sub(i);
                });
            }
        });
        assert_eq!(t.get(), (1 << 30) - (0..8).sum::<u64>());
    }

    #[test]
    fn a_stripe_may_go_negative_and_the_sum_still_holds() {
        let t = Tally::new(100);
        std::thread::scope(|s| {
            s.spawn(|| t.sub(60));
        });
        t.add(10);
        t.sub(50);
        assert_eq!(t.get(), 0);
    }
}
