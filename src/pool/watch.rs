//! What a thread's cache watches of its pool at its cold-path calls, to set its reach and
//! its mode: whether the pool grows ([`GrowthWatch`]), and how many of the live large
//! blocks stay put ([`Pinned`]).
//!
//! Each watch is one cache's own, in plain cells: it reads the pool's counters (relaxed
//! loads, written only on slow paths) at calls that are slow already, and nothing on the
//! hit path. Two caches may see the pool differently for a while; each only sets its own
//! reach, so nothing needs them to agree.

use std::cell::Cell;

/// After the pool took more of its arena than before (the bytes out of the space — live,
/// cached, retiring or held by streams — a growth step past the high last counted: see
/// [`GrowthWatch`]), a thread's cache borrows no large block (`local::BORROW_CLASSES_LARGE`)
/// for this many of its cold-path calls. A block borrowed while the pool grows is often
/// one that lives as long as the program (weights loaded on four streams at once
/// borrowed 35 MiB of larger blocks on `threads_streams`: peak reserved ÷ peak live
/// 1.083–1.105 with borrowing, 1.048–1.060 without), and every byte it wastes then is a
/// byte of the peak, or of a reserve ([`crate::Pool::reserve`]) the pool grows into; in the
/// steady state the high stays put and borrowing only saves misses.
pub(crate) const GROWTH_COLD_CALLS: u32 = 256;

/// Whether a pool is growing, from the bytes out of its space as one cache sees them at its
/// cold-path calls: it is for [`GROWTH_COLD_CALLS`] calls after they rose a growth step
/// ([`growth_step`]) past the high last counted. Any new high at all used to count, and in
/// a steady state the high still creeps up now and then (the largest value of a random
/// walk grows with time): four threads' random window (simulator, 2 cores, eight runs
/// each) missed their caches on 1.55–2.05% of allocations so, and on 1.07–1.66% with the
/// step, as without the rule; `threads_streams`, the trace the rule is for, read 1.048–1.056
/// either way. Loading weights moves the bytes by many steps.
pub(crate) struct GrowthWatch {
    counted: Cell<u64>,
    left: Cell<u32>,
}

impl GrowthWatch {
    /// Growing from the start: a new cache's first calls are a pool's first use as often
    /// as not.
    pub(crate) fn new(held: u64) -> GrowthWatch {
        GrowthWatch { counted: Cell::new(held), left: Cell::new(GROWTH_COLD_CALLS) }
    }

    /// One cold-path call that sees `held` bytes out of the space: whether the pool grows.
    pub(crate) fn observe(&self, held: u64) -> bool {
        let counted = self.counted.get();
        if held >= counted.saturating_add(growth_step(counted)) {
            self.counted.set(held);
            self.left.set(GROWTH_COLD_CALLS);
        } else {
            self.left.set(self.left.get().saturating_sub(1));
        }
        self.left.get() > 0
    }
}

/// How far past the high last counted the bytes out of the space must go to count as
/// growth: a 64th of that high, and at least a chunk.
fn growth_step(high: u64) -> u64 {
    (high / 64).max(crate::arena::stream::CHUNK)
}

/// The allocations of a cache ([`Pinned`]'s period) over which large blocks placed anywhere
/// in the pool count as coming and going. Counted in allocations, not time, so that a slow
/// or loaded machine makes the same judgement as a fast one.
pub(crate) const PINNED_PERIOD: u64 = 1024;

/// The bytes of live large blocks (above the largest cached class) that stay put, as one
/// cache sees them: every live large byte, less every large byte placed anywhere in the pool
/// over this cache's last one to two [`PINNED_PERIOD`]s of allocations. A server's KV cache
/// and weights are placed once and stay: they come out whole. A workload whose large blocks
/// turn over comes out near nothing, since what it placed lately is at least what it holds.
/// A block placed lately and freed since is subtracted anyway, so the estimate errs low: a
/// cache that underestimates keeps the rule that ignores large blocks
/// (`PoolInner::short_of_memory`).
pub(crate) struct Pinned {
    /// This cache's cold-path calls so far.
    cold_calls: Cell<u64>,
    /// This cache's allocations, and the large bytes placed pool-wide, when the period now
    /// running began.
    began_at: Cell<u64>,
    placed_then: Cell<u64>,
    /// Large bytes placed in the last whole period; before the first, all of them.
    last_period: Cell<u64>,
}

impl Pinned {
    /// Nothing is known to stay put until a whole period has passed; `placed` is the pool's
    /// large bytes ever placed, now.
    pub(crate) fn new(placed: u64) -> Pinned {
        Pinned {
            cold_calls: Cell::new(0),
            began_at: Cell::new(0),
            placed_then: Cell::new(placed),
            last_period: Cell::new(u64::MAX),
        }
    }

    /// One cold-path call: `hits` is the cache's hit-path allocations so far, `live` and
    /// `placed` the pool's live and ever-placed large bytes. The pinned bytes.
    pub(crate) fn observe(&self, hits: u64, live: u64, placed: u64) -> u64 {
        self.cold_calls.set(self.cold_calls.get() + 1);
        let allocs = hits + self.cold_calls.get();
        if allocs.saturating_sub(self.began_at.get()) >= PINNED_PERIOD {
            self.last_period.set(placed.saturating_sub(self.placed_then.get()));
            self.began_at.set(allocs);
            self.placed_then.set(placed);
        }
        let lately = self.last_period.get().saturating_add(placed.saturating_sub(self.placed_then.get()));
        live.saturating_sub(lately)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::atomic::Ordering;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// Runs `calls` cold-path calls of a cache that made no hits, with the pool's large
    /// bytes as `live` and `placed` say; the last call's estimate.
    fn calls(p: &Pinned, n: u64, live: u64, placed: impl Fn(u64) -> u64) -> u64 {
        (0..n).map(|i| p.observe(0, live, placed(i))).last().unwrap_or(0)
    }

    #[test]
    fn a_kv_cache_placed_once_is_pinned_after_a_whole_period() {
        let kv = 60 * GIB;
        let p = Pinned::new(kv);
        assert_eq!(p.observe(0, kv, kv), 0, "nothing is known to stay put at first");
        assert_eq!(calls(&p, PINNED_PERIOD - 2, kv, |_| kv), 0, "nor before a whole period");
        assert_eq!(calls(&p, PINNED_PERIOD, kv, |_| kv), kv, "a period with no large placement pins it all");
    }

    #[test]
    fn large_blocks_that_turn_over_are_not_pinned() {
        let p = Pinned::new(0);
        // 1 GiB of large blocks live, a 64 MiB one placed at every call: 64 GiB a period.
        let est = calls(&p, 3 * PINNED_PERIOD, GIB, |i| 64 * MIB * (i + 1));
        assert_eq!(est, 0);
    }

    #[test]
    fn what_was_placed_lately_comes_off_what_is_live() {
        let p = Pinned::new(0);
        let kv = 10 * GIB;
        calls(&p, 2 * PINNED_PERIOD, kv, |_| kv);
        // Logits of 16 MiB, one every 64 calls, beside the KV cache.
        let placed = |i: u64| kv + 16 * MIB * (i / 64);
        let est = calls(&p, 2 * PINNED_PERIOD, kv + 16 * MIB, placed);
        assert!(est <= kv + 16 * MIB - 16 * MIB * (PINNED_PERIOD / 64), "{est}: the period's logits are off");
        assert!(est >= kv + 16 * MIB - 16 * MIB * (2 * PINNED_PERIOD / 64), "{est}: at most two periods' are");
    }

    /// The counts `Pinned` reads go back to nothing when every large block is back, by
    /// whichever path it came and went.
    #[test]
    fn every_large_block_is_off_the_live_count_once_freed() {
        use crate::{Device, Pool, PoolConfig, SimDevice};
        for config in [PoolConfig::default(), PoolConfig { track_sites: true, ..PoolConfig::default() }] {
            let dev = SimDevice::new(1 << 30);
            let pool = Pool::new(dev.clone(), config).unwrap();
            let (s, other, doomed) = (dev.new_stream().unwrap(), dev.new_stream().unwrap(), dev.new_stream().unwrap());
            let cache = pool.stream_cache(&s).unwrap();
            let live = || pool.inner.large_live.load(Ordering::Relaxed);
            let mut blocks = vec![pool.alloc(9 << 20, &s).unwrap(), cache.alloc(5 << 20).unwrap()];
            blocks.push(pool.alloc(6 << 20, &doomed).unwrap());
            let shared = cache.alloc(12 << 20).unwrap();
            shared.record_stream(&other);
            blocks.push(shared);
            blocks.push(pool.alloc(3 << 20, &s).unwrap());
            assert!(live() >= (9 + 5 + 6 + 12) << 20, "{}", live());
            let placed = pool.inner.large_placed.load(Ordering::Relaxed);
            assert!(placed >= live());
            let last = blocks.split_off(2);
            drop(blocks);
            dev.synchronize(&doomed).unwrap();
            dev.destroy_stream(&doomed).unwrap();
            drop(last);
            pool.trim().unwrap();
            assert_eq!(live(), 0, "every large block went back");
            assert_eq!(pool.inner.large_placed.load(Ordering::Relaxed), placed, "placements only add");
        }
    }

    #[test]
    fn hits_count_towards_the_period() {
        let p = Pinned::new(GIB);
        p.observe(0, GIB, GIB);
        assert_eq!(p.observe(PINNED_PERIOD, GIB, GIB), GIB, "a period of hits and one call");
    }

    #[test]
    fn a_rise_of_a_step_counts_as_growth_for_the_next_cold_calls() {
        let w = GrowthWatch::new(100 * MIB);
        for _ in 0..GROWTH_COLD_CALLS {
            w.observe(100 * MIB);
        }
        assert!(!w.observe(100 * MIB), "a pool that stays put stops growing");
        assert!(w.observe(100 * MIB + growth_step(100 * MIB)), "a step up is growth");
        for _ in 1..GROWTH_COLD_CALLS {
            assert!(w.observe(100 * MIB), "for the calls that follow it");
        }
        assert!(!w.observe(100 * MIB));
    }

    #[test]
    fn a_high_that_creeps_up_by_less_than_a_step_is_not_growth_until_it_adds_up_to_one() {
        let w = GrowthWatch::new(512 * MIB);
        for _ in 0..GROWTH_COLD_CALLS {
            w.observe(512 * MIB);
        }
        let step = growth_step(512 * MIB);
        assert_eq!(step, 8 * MIB, "a 64th of the high");
        // New highs one 64 KiB granule at a time, as a steady state makes them.
        let mut held = 512 * MIB;
        while held + (64 << 10) < 512 * MIB + step {
            held += 64 << 10;
            assert!(!w.observe(held), "a creep of {} KiB is not growth", (held - 512 * MIB) >> 10);
        }
        assert!(w.observe(512 * MIB + step), "a whole step from the last counted high is");
    }

    #[test]
    fn a_small_pool_grows_by_a_chunk_at_least() {
        assert_eq!(growth_step(0), crate::arena::stream::CHUNK);
        assert_eq!(growth_step(64 * MIB), crate::arena::stream::CHUNK);
        let w = GrowthWatch::new(0);
        for _ in 0..GROWTH_COLD_CALLS {
            w.observe(0);
        }
        assert!(!w.observe(MIB));
        assert!(w.observe(2 * MIB));
    }
}
