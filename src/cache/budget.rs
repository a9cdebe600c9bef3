//! The bound on every cache of a pool together: thread caches reserve bytes from one
//! [`Budget`] in chunks, and depots charge each magazine they accept.
//!
//! A thread cache compares against its own reservation on every free (a plain load); it
//! touches the shared counter only when the reservation must grow or shrink, on slow
//! paths. So the hot path has no read-modify-write, and the pool's caches never hold more
//! than the budget's maximum.

use crate::sync::atomic::{AtomicU64, Ordering};

/// Bytes the caches may hold, pool-wide.
#[derive(Debug)]
pub struct Budget {
    used: AtomicU64,
    max: u64,
}

impl Budget {
    /// A budget of `max` bytes.
    pub fn new(max: u64) -> Budget {
        Budget { used: AtomicU64::new(0), max }
    }

    /// Take `bytes` if they fit under the maximum.
    pub fn try_take(&self, bytes: u64) -> bool {
        let mut now = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = now.checked_add(bytes).filter(|&n| n <= self.max) else { return false };
            match self.used.compare_exchange_weak(now, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(seen) => now = seen,
            }
        }
    }

    /// Give back bytes taken earlier.
    pub fn give(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Bytes taken now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The maximum.
    pub fn max(&self) -> u64 {
        self.max
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_budget_never_goes_past_its_maximum() {
        let b = Budget::new(100);
        assert!(b.try_take(60));
        assert!(!b.try_take(41));
        assert!(b.try_take(40));
        b.give(100);
        assert_eq!(b.used(), 0);
        assert!(!b.try_take(u64::MAX), "no overflow");
    }

    #[test]
    fn racing_takers_share_the_maximum_exactly() {
        let b = Budget::new(1000);
        let won = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if b.try_take(7) {
                            won.fetch_add(7, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(won.into_inner(), b.used());
        assert!(b.used() <= 1000 && b.used() > 1000 - 7);
    }
}
