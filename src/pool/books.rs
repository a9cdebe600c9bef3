//! The pool's books: the [`Stats`] snapshot, derived from the tiers' counters, and
//! [`PoolInner::check`], which walks every tier and proves invariant 3 of the design.
//!
//! `allocated_bytes` is derived — bytes the arenas have handed out less the bytes the tiers
//! hold — so that the hot path keeps no byte counter of its own; tests compare it with their
//! own count of live bytes, which is how a lost block shows up.

use super::PoolInner;
use crate::class;
use crate::error::{Error, Result};
use crate::stats::{Counters, Stats};
use crate::sync::atomic::Ordering;
use crate::sync::epoch;

impl PoolInner {
    /// Bytes free in the arenas: the space's free runs and every stream's free pieces.
    fn arena_free(&self) -> u64 {
        self.space.free_bytes() + self.states().iter().map(|st| st.arena.free_bytes()).sum::<u64>()
    }

    /// Bytes in live blocks now: every byte the arenas handed out is live, cached or
    /// retiring (invariant 3), so live = handed out − cached − retiring: no counter on the
    /// hot path. A snapshot, exact when the pool is quiet.
    pub(crate) fn allocated_now(&self) -> u64 {
        let (thread, depot, retiring) = self.tier_bytes();
        let held = self.space.len() - self.arena_free();
        held.saturating_sub(thread + depot).saturating_sub(retiring)
    }

    /// The figures' peaks start again from now (`Pool::reset_peak_stats`).
    pub(crate) fn reset_peaks(&self) {
        self.pages.reset_shown_peak();
        self.counters.peak_allocated.store(self.allocated_now(), Ordering::Release);
    }

    pub(crate) fn sample_peak(&self) {
        let now = self.allocated_now();
        self.counters.peak_allocated.fetch_max(now, Ordering::AcqRel);
    }

    /// (thread caches, depots, retiring) bytes, from the tiers' counters.
    fn tier_bytes(&self) -> (u64, u64, u64) {
        let mut depot = 0;
        for st in self.states() {
            for (class, d) in st.depots.iter().enumerate() {
                depot += d.blocks() as u64 * class::size_of_class(class);
            }
        }
        let thread: u64 = self.caches.load().iter().map(|(c, _)| Counters::get(&c.counters.cached_bytes)).sum();
        (thread, depot, self.cross.pending_bytes())
    }

    /// Every free piece of every arena, sorted by address.
    fn free_pieces(&self) -> Vec<(u64, u64)> {
        self.free_pieces_tagged().into_iter().map(|(a, l, _)| (a, l)).collect()
    }

    /// Every free piece of every arena, sorted by address, each with whether it is the
    /// space's (a piece of a stream's chunk is not).
    fn free_pieces_tagged(&self) -> Vec<(u64, u64, bool)> {
        let mut free = Vec::new();
        self.space.for_each_free(|a, l| free.push((a, l, true)));
        for st in self.states() {
            st.arena.for_each_free(|a, l| free.push((a, l, false)));
        }
        free.sort_unstable();
        free
    }

    /// (largest free stretch of mapped memory, free mapped bytes). A stretch is what one
    /// block could take: the space's free pieces join across the mapped pages they span,
    /// but a piece of a stream's chunk stands alone, since no buddy block spans two pieces
    /// or a chunk's edge. Joined, a chunk's free buddies read as one stretch of nearly 2 MiB,
    /// and at 39 of 9,049 refusals of `tests/near_limit.rs`'s brim case the figure was the
    /// request or more while no stretch of the space was: an out-of-memory error that said
    /// there was room.
    pub(super) fn free_mapped(&self) -> (u64, u64) {
        let page = self.pages.page_size();
        let mut mapped = Vec::new();
        self.pages.for_each_mapped(|p, _| mapped.push(p));
        mapped.sort_unstable();
        let (mut largest, mut total, mut run_end, mut run_len) = (0u64, 0u64, u64::MAX, 0u64);
        for (a, l, joins) in self.free_pieces_tagged() {
            let end = a + l;
            let first = mapped.partition_point(|&p| p + page <= a);
            for &p in mapped[first..].iter().take_while(|&&p| p < end) {
                let (lo, hi) = (a.max(p), end.min(p + page));
                total += hi - lo;
                run_len = if joins && lo == run_end { run_len + (hi - lo) } else { hi - lo };
                // Nothing joins a chunk's piece, not even the next piece of the space.
                run_end = if joins { hi } else { u64::MAX };
                largest = largest.max(run_len);
            }
        }
        (largest, total)
    }

    pub(crate) fn stats(&self) -> Stats {
        let c = &self.counters;
        let f = &self.folded;
        let (thread_cached, depot, retiring) = self.tier_bytes();
        // Allocations through caches: misses here, hits added below.
        let (mut allocs, mut t0, mut t1, mut frees) =
            (Counters::get(&f.misses), Counters::get(&f.t0_hits), Counters::get(&f.t1_hits), Counters::get(&f.frees));
        let caches = self.caches.load();
        for (cs, _) in caches.iter() {
            let k = &cs.counters;
            allocs += Counters::get(&k.misses);
            t0 += Counters::get(&k.t0_hits);
            t1 += Counters::get(&k.t1_hits);
            frees += Counters::get(&k.frees);
        }
        allocs += t0 + t1;
        let allocated = self.allocated_now();
        let peak_allocated = c.peak_allocated.fetch_max(allocated, Ordering::AcqRel).max(allocated);
        let (largest_free_mapped, free_mapped_bytes) = self.free_mapped();
        let states = self.states();
        #[allow(deprecated)]
        Stats {
            allocated_bytes: allocated,
            reserved_bytes: self.pages.mapped_bytes(),
            peak_allocated_bytes: peak_allocated,
            peak_reserved_bytes: self.pages.shown_peak_bytes(),
            cached_bytes: thread_cached + depot,
            thread_cached_bytes: thread_cached,
            depot_bytes: depot,
            open_batch_bytes: 0,
            retiring_bytes: retiring,
            stream_free_bytes: states.iter().map(|st| st.arena.free_bytes()).sum(),
            stream_chunks: states.iter().map(|st| st.arena.held_chunks() as u64).sum(),
            live_blocks: Counters::get(&c.live_blocks).wrapping_add(allocs).wrapping_sub(frees),
            allocs: Counters::get(&c.allocs) + allocs,
            t0_hits: t0,
            t1_hits: t1,
            thread_caches: caches.len() as u64,
            same_stream_reuses: Counters::get(&c.same_stream_reuses),
            covered_reuses: Counters::get(&c.covered_reuses),
            hurries_skipped: Counters::get(&c.hurries_skipped),
            records_asked: Counters::get(&c.records_asked),
            events_queried: Counters::get(&c.events_queried),
            events_recorded: Counters::get(&c.events_recorded),
            batches_retired: Counters::get(&c.batches_retired),
            device_waits: Counters::get(&c.device_waits),
            ladder_flushes: Counters::get(&c.ladder_flushes),
            ladder_maps: Counters::get(&c.ladder_maps),
            ladder_waits: Counters::get(&c.ladder_waits),
            ladder_ns: Counters::get_ns(&c.ladder_ns),
            release_ns: Counters::get_ns(&c.release_ns),
            map_ns: Counters::get_ns(&c.map_ns),
            unmap_ns: Counters::get_ns(&c.unmap_ns),
            // The four kinds of event call, each timed on its own; their sum is the whole.
            event_ns: [&c.query_ns, &c.record_ns, &c.wait_ns, &c.capture_ns].into_iter().map(Counters::get_ns).sum(),
            query_ns: Counters::get_ns(&c.query_ns),
            record_ns: Counters::get_ns(&c.record_ns),
            reuse_records: Counters::get(&c.reuse_records),
            reuse_record_ns: Counters::get_ns(&c.reuse_record_ns),
            wait_ns: Counters::get_ns(&c.wait_ns),
            capture_ns: Counters::get_ns(&c.capture_ns),
            ladder_steals: Counters::get(&c.ladder_steals),
            ooms: Counters::get(&c.ooms),
            oom_handler_calls: Counters::get(&self.on_oom.calls),
            oom_rescues: Counters::get(&self.on_oom.rescues),
            ladder_rungs: std::array::from_fn(|i| Counters::get(&c.rungs[i])),
            ladder_rung_ns: std::array::from_fn(|i| Counters::get_ns(&c.rung_ns[i])),
            mapped_bytes: Counters::get(&c.mapped),
            pages_lent: Counters::get(&c.pages_lent),
            pages_switched: Counters::get(&c.pages_switched),
            lent_bytes: self.pages.lent_pages() * self.pages.page_size(),
            unmapped_bytes: Counters::get(&c.unmapped),
            floor_bytes: self.floor_bytes(),
            largest_free_block: self.space.largest_free().max(if states.iter().any(|s| s.arena.free_chunks() > 0) {
                crate::arena::CHUNK
            } else {
                0
            }),
            arena_free_bytes: self.arena_free(),
            free_mapped_bytes,
            largest_free_mapped,
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        let broken = |what: String| Err(Error::InvariantBroken(what));
        let st = self.stats();
        let page = self.pages.page_size();
        let states = self.states();
        // Free pieces of the space (chunks held count as used there) and of every arena.
        let mut space_free = Vec::new();
        self.space.for_each_free(|a, l| space_free.push((a, l)));
        let free = self.free_pieces();
        let free_total: u64 = free.iter().map(|f| f.1).sum();
        if free_total != st.arena_free_bytes {
            return broken(format!("free pieces sum to {free_total}, counters say {}", st.arena_free_bytes));
        }
        // Every chunk a stream holds is known by its owner word, and lies outside the
        // space's free runs.
        let mut chunks: Vec<(u64, u64)> = Vec::new();
        for s in &states {
            let mut problem = None;
            s.arena.for_each_chunk(|idx, addr| {
                if self.space.owner(addr) != Some((s.slot, idx)) && problem.is_none() {
                    problem = Some(format!(
                        "chunk {addr:#x} of slot {} (index {idx}): owner {:?}",
                        s.slot,
                        self.space.owner(addr)
                    ));
                }
                chunks.push((addr, crate::arena::CHUNK));
            });
            if let Some(p) = problem {
                return broken(p);
            }
        }
        // Every block in a tier, walked, against the tiers' counters: the counters are what
        // `allocated_bytes` is derived from.
        let mut tiers: Vec<(u64, u64)> = Vec::new();
        let guard = epoch::pin();
        let mut thread_walked = 0;
        for (cs, _) in self.caches.load().iter() {
            let mut mine = 0;
            let mut entries = Ok(());
            let walked = cs.try_steal(|c| {
                // SAFETY: try_steal holds the handshake while this runs.
                unsafe {
                    entries = c.check_hot_entries();
                    c.for_each_block(|class, a| {
                        let s = class::size_of_class(class);
                        mine += s;
                        tiers.push((a, s));
                    })
                }
            });
            if !walked {
                // A thread is inside its cache: the pool is not quiet, and a walk cannot
                // be exact. Check only what does not move.
                return Ok(());
            }
            entries.or_else(|why| broken(format!("a thread cache's hot entries are wrong: {why}")))?;
            thread_walked += mine;
        }
        let (mut depot_walked, mut queued_walked) = (0, 0);
        for s in &states {
            for (class, d) in s.depots.iter().enumerate() {
                let size = class::size_of_class(class);
                d.for_each_block(
                    |a| {
                        depot_walked += size;
                        tiers.push((a, size));
                    },
                    &guard,
                );
            }
        }
        self.cross.for_each_span(
            |sp| {
                queued_walked += sp.size;
                tiers.push((sp.addr, sp.size));
            },
            &guard,
        );
        drop(guard);
        if thread_walked != st.thread_cached_bytes || depot_walked != st.depot_bytes {
            return broken(format!(
                "thread caches hold {thread_walked} B (counters: {}), depots {depot_walked} B (counters: {})",
                st.thread_cached_bytes, st.depot_bytes
            ));
        }
        if queued_walked != st.retiring_bytes {
            return broken(format!("retire queue holds {queued_walked} B, counter says {}", st.retiring_bytes));
        }
        // No block is in two places: tiers and free pieces never overlap, and the space's
        // free runs never overlap a chunk.
        let mut all: Vec<(u64, u64)> = tiers.iter().chain(free.iter()).copied().collect();
        all.sort_unstable();
        let mut outer: Vec<(u64, u64)> = chunks.iter().chain(space_free.iter()).copied().collect();
        outer.sort_unstable();
        for w in all.windows(2).chain(outer.windows(2)) {
            if w[0].0 + w[0].1 > w[1].0 {
                return broken(format!(
                    "{:#x}+{} and {:#x}+{} overlap (tiers, free pieces or chunks)",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ));
            }
        }
        // Pages: a page holds a count exactly when a chunk or a large block lies on it, and
        // every byte held lies on a mapped page.
        let held_in_space = self.space.len() - self.space.free_bytes();
        let free_on = |free: &[(u64, u64)], p: u64| -> u64 {
            let end = p + page;
            let i = free.partition_point(|f| f.0 + f.1 <= p);
            free[i..].iter().take_while(|f| f.0 < end).map(|f| (f.0 + f.1).min(end) - f.0.max(p)).sum()
        };
        let (mut mapped, mut held_on_mapped, mut space_held_on_mapped, mut problem) = (0u64, 0u64, 0u64, None);
        self.pages.for_each_mapped(|p, count| {
            mapped += page;
            let h = page - free_on(&space_free, p);
            space_held_on_mapped += h;
            held_on_mapped += page - free_on(&free, p);
            if (count == 0) != (h == 0) && problem.is_none() {
                problem = Some(format!("page {p:#x}: {count} blocks on it but {h} B held"));
            }
        });
        if let Some(p) = problem {
            return broken(p);
        }
        // Physical memory: each memory mapped or lent counted once (a loan shows one memory at
        // two pages), against the counter.
        let doubly = self.pages.walk_doubly_mapped();
        if !doubly.is_empty() {
            return broken(format!("memory mapped at two pages that serve blocks: {doubly:x?}"));
        }
        let unhinted = self.pages.walk_unhinted_free();
        if !unhinted.is_empty() {
            return broken(format!("free pages no loan can find (no hint): {unhinted:x?}"));
        }
        let asleep = self.pages.walk_asleep_switchable();
        if !asleep.is_empty() {
            return broken(format!("lent pages whose memory is free, asleep (never switched back): {asleep:x?}"));
        }
        let physical = self.pages.walk_physical();
        if physical != st.reserved_bytes {
            return broken(format!(
                "{physical} B of memory mapped ({mapped} B of pages), counter says {}",
                st.reserved_bytes
            ));
        }
        if space_held_on_mapped != held_in_space {
            return broken(format!("{} B held on unmapped pages", held_in_space - space_held_on_mapped));
        }
        let free_mapped = mapped - held_on_mapped;
        // Memory only lent pages still show is held, serving nothing until they go.
        let lent_only = self.pages.walk_lent_only();
        let in_tiers = st.allocated_bytes + st.cached_bytes + st.retiring_bytes;
        if st.reserved_bytes != in_tiers + free_mapped + lent_only {
            return broken(format!(
                "reserved {} != allocated {} + cached {} + retiring {} + free-but-mapped {free_mapped} + lent {lent_only}",
                st.reserved_bytes, st.allocated_bytes, st.cached_bytes, st.retiring_bytes
            ));
        }
        Ok(())
    }
}
