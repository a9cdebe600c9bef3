//! T0: the per-thread cache of one (pool, stream), and the handshake that lets another
//! thread take its blocks while it is idle.
//!
//! A thread cache holds, per size class, two magazines (Bonwick's "loaded" and "previous"),
//! serves allocations and frees from them, and trades a whole magazine with the stream's
//! depot (T1) only when both are empty (or both full). What the magazines hold, the hot
//! entries the hit paths read, and how an allocation borrows a block of a larger class are
//! `Mags` (in `cache::mags`), plain data with no synchronisation of its own. This module is
//! who may touch it: [`CacheShared`] wraps it with the handshake below, the counters and the
//! trades with the depot, and each of its operations takes the handshake, or requires its
//! caller to hold it, before it reaches the magazines.
//!
//! **The idle-cache handshake.** The pool must be able to take the blocks of a cache whose
//! thread sits idle (for `trim()` and the out-of-memory ladder) without that thread's help.
//! It is an asymmetric Dekker handshake on two flags:
//!
//! ```text
//! owner (every operation)              thief
//!   in_use = true                        steal = true
//!   light_fence()                        heavy_fence()
//!   if steal { in_use = false; wait }    if in_use { steal = false; skip: owner is busy }
//!   ... use the magazines ...            ... take the magazines ...
//!   in_use = false (Release)             steal = false (Release)
//! ```
//!
//! With both fences SeqCst, at least one side sees the other's flag, so the two never use
//! the magazines at once. In production the owner's fence is only a compiler fence and the
//! thief's is `membarrier(2)`, which forces a full barrier on every running thread of the
//! process: the owner pays nothing on its hot path and the rare thief pays a system call
//! (see [`crate::sync::light_fence`]). Under loom both are `fence(SeqCst)`, which is what
//! the model checks.
//!
//! A reader that must see a busy cache (a snapshot) keeps `steal` up and waits for
//! `in_use` to fall instead of skipping ([`CacheShared::steal_waiting`]): every operation
//! whose `light_fence` comes after the thief's `heavy_fence` sees `steal` and backs off, so
//! the wait ends with the operation in progress at the fence, the last that can hold the
//! magazines. The trim and the out-of-memory ladder still skip busy caches: they want
//! idle memory, not to stall a working thread.
//!
//! The owner's own thread may take the cache between its operations as a thief would (the
//! ladder and the trim look at every cache): it raises `steal` against other thieves but
//! makes no barrier, since its own flag and magazines are ordered with it by program order
//! ([`CacheShared::take_own_or_steal`]; loom:
//! `an_owner_taking_its_own_cache_unfenced_races_a_thief_safely`). That rests on the cache
//! being entered only by the thread that made it, as every cache of a pool is.
//!
//! Counters are written only by whoever holds the magazines (the owner inside an operation,
//! or a thief that won the handshake) with plain relaxed load + store, and read by
//! `stats()` at any time: a snapshot, exact when the pool is quiet.

use crate::cache::depot::Depot;
use crate::cache::magazine::{Magazine, MAG_CAP};
use crate::cache::mags::{hot_index, Mags};
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::epoch::Guard;
use crate::sync::{current_thread, heavy_fence, light_fence, ThreadId, UnsafeCell};

pub use crate::cache::mags::REACH_MAX;

/// Per-cache counters. Single writer at a time (see the module docs).
#[derive(Default, Debug)]
pub struct CacheCounters {
    /// Allocations this cache passed on to the arena (misses of both T0 and T1).
    pub misses: AtomicU64,
    /// Allocations served from this cache's own magazines.
    pub t0_hits: AtomicU64,
    /// Allocations served by a magazine from the stream's depot.
    pub t1_hits: AtomicU64,
    /// Frees taken by this cache.
    pub frees: AtomicU64,
    /// Bytes in this cache's magazines now.
    pub cached_bytes: AtomicU64,
    /// Bytes this cache has reserved from the pool's cache budget (at least
    /// `cached_bytes`); grown and shrunk on slow paths only.
    pub budget: AtomicU64,
}

/// Add to a single-writer counter without a read-modify-write instruction.
#[inline]
pub fn bump(c: &AtomicU64, by: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(by), Ordering::Relaxed);
}

/// Subtract from a single-writer counter.
#[inline]
pub fn drop_by(c: &AtomicU64, by: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_sub(by), Ordering::Relaxed);
}

/// A block the hit path took: its address, and the class (and size) it came from, which
/// may be larger than the one asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    /// The block's address.
    pub addr: u64,
    /// Its class.
    pub class: usize,
    /// Bytes per block of its class.
    pub size: u64,
}

/// A size class as a cache sees it: its index, its block size and its magazine capacity.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    /// The class index.
    pub class: usize,
    /// Bytes per block.
    pub size: u64,
    /// Blocks per magazine.
    pub cap: usize,
}

/// What a miss or an overflow asks of the caller, once it is outside the cache.
#[derive(Debug, PartialEq, Eq)]
pub enum Spill {
    /// Nothing: the operation completed inside the cache.
    None,
    /// These blocks could not be kept (the depot is full, or the cache is over its byte
    /// bound): retire them on the stream.
    Retire(Vec<u64>),
}

/// How long a thread cache must go unused before the pool takes its blocks short of its
/// last resort: far longer than any slow path of its owner's (a map is ~40 µs, a ladder
/// climb well under a millisecond), far shorter than a server's idle worker waits.
pub const IDLE_AFTER_MS: u64 = 50;

/// Milliseconds since the first call: the clock of [`CacheShared::idle`], read by thieves
/// only (never on an owner's path).
fn idle_clock() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64
}

/// The part of a thread cache that other threads may reach: the magazines (behind the
/// handshake), the flags and the counters. Aligned to its own cache lines: its owner writes
/// it on every operation, and no other thread's data may share a line with it.
#[repr(C, align(128))]
pub struct CacheShared {
    in_use: AtomicBool,
    /// Counters (see [`CacheCounters`]).
    pub counters: CacheCounters,
    steal: AtomicBool,
    /// Set by the owner at the end of every operation, cleared by [`CacheShared::idle`]:
    /// a cache found unset made no operation since the last look (second chance, as a
    /// clock's reference bit).
    touched: AtomicBool,
    /// When a thief last found `touched` set (milliseconds of [`idle_clock`]); written by
    /// thieves only.
    seen_busy: AtomicU64,
    /// The thread that made the cache (its owner).
    owner: ThreadId,
    /// Whether the owning thread has let go of the cache (flushed or exited).
    retired: AtomicBool,
    mags: UnsafeCell<Mags>,
}

// SAFETY: the magazines inside the UnsafeCell are only touched by the one party that holds
// the handshake (the owner between `enter` and `exit`, or a thief that won `try_steal`), and
// the flags and counters are atomics.
unsafe impl Sync for CacheShared {}
// SAFETY: as above; the contents are plain data.
unsafe impl Send for CacheShared {}

/// Magazine capacity of a class of `size` bytes: magazines of large classes hold fewer
/// blocks, so a magazine never holds much more than `mag_bytes` (but always at least one).
#[inline]
pub fn mag_cap(size: u64, mag_bytes: u64) -> usize {
    (mag_bytes / size.max(1)).clamp(1, MAG_CAP as u64) as usize
}

impl CacheShared {
    /// A cache for `classes` size classes, with no magazines yet.
    pub fn new(classes: usize) -> CacheShared {
        CacheShared {
            in_use: AtomicBool::new(false),
            steal: AtomicBool::new(false),
            touched: AtomicBool::new(false),
            seen_busy: AtomicU64::new(0),
            owner: current_thread().id(),
            mags: UnsafeCell::new(Mags::new(classes)),
            retired: AtomicBool::new(false),
            counters: CacheCounters::default(),
        }
    }

    /// Enter an operation as the owner. False while a thief holds the magazines: the caller
    /// waits ([`CacheShared::wait_for_thief`]) and tries again.
    #[inline]
    pub fn enter(&self) -> bool {
        self.in_use.store(true, Ordering::Relaxed);
        light_fence();
        // Acquire: if a thief just finished, its writes to the magazines are visible.
        if self.steal.load(Ordering::Acquire) {
            self.in_use.store(false, Ordering::Release);
            return false;
        }
        true
    }

    /// Leave an operation: Release publishes the magazines to a later thief.
    #[inline]
    pub fn exit(&self) {
        // Relaxed: a hint for thieves, on the line the owner has just written anyway.
        self.touched.store(true, Ordering::Relaxed);
        self.in_use.store(false, Ordering::Release);
    }

    /// Whether the owner is the calling thread, or has made no operation for at least
    /// [`IDLE_AFTER_MS`] as far as thieves have seen: a thread that sits idle, whose blocks the pool may take back
    /// without slowing it down. Each call clears the owner's mark and notes the time when
    /// it was set, so a working thread's cache is passed over, also while its owner is in
    /// a slow path of its own (a few looks in a row may find no new operation then). A
    /// hint: a race with the owner only makes a steal that the handshake still makes safe.
    pub fn idle(&self) -> bool {
        // The caller's own cache (for another stream: one thread driving several) is not in
        // use while its owner is here, and taking it contends with no one.
        if self.owned_here() {
            return true;
        }
        let now = idle_clock();
        if self.touched.load(Ordering::Relaxed) {
            self.touched.store(false, Ordering::Relaxed);
            self.seen_busy.store(now, Ordering::Relaxed);
            return false;
        }
        now.saturating_sub(self.seen_busy.load(Ordering::Relaxed)) >= IDLE_AFTER_MS
    }

    /// The whole allocation hit path for a caller's fast path: enter, take a block of the
    /// smallest class within `class`'s reach whose loaded magazine holds one (see
    /// [`CacheShared::set_reach`]), exit. `size` is `class`'s. Returns the block and the
    /// class it came from. None, with
    /// nothing changed, when a thief holds the cache or no such magazine holds a block: the
    /// caller then takes its slow path (which waits, swaps, refills). A leaf: no call, so a
    /// caller inlining it keeps its fast path free of register saves.
    #[inline(always)]
    pub fn try_pop_fast(&self, class: usize, size: u64) -> Option<Hit> {
        if !self.enter() {
            return None;
        }
        // SAFETY: entered above.
        let got = unsafe { self.mags() }.fit(class, size);
        if let Some(hit) = got {
            self.count_hit(hit.size);
        }
        self.exit();
        got
    }

    /// Let an allocation of class `c` take a block of up to `within(c)` larger classes (at
    /// most [`REACH_MAX`]) on the hit path, when its own loaded magazine is empty and theirs
    /// are not. A block so taken is used whole and goes back to its own class when freed.
    ///
    /// # Safety
    /// The caller holds the handshake.
    pub unsafe fn set_reach(&self, within: impl Fn(usize) -> usize) {
        // SAFETY: the caller holds the handshake.
        let mags = unsafe { self.mags() };
        for c in 0..mags.classes.len() {
            mags.reach[c] = ((1u32 << within(c).min(REACH_MAX)) - 1) as u16;
        }
    }

    /// The whole free hit path for a caller's fast path: enter, push onto the loaded
    /// magazine within the cache's byte bound, exit. False, with nothing changed, otherwise
    /// (see [`CacheShared::try_pop_fast`]).
    #[inline(always)]
    pub fn try_push_fast(&self, class: usize, size: u64, addr: u64) -> bool {
        if !self.enter() {
            return false;
        }
        let limit = self.counters.budget.load(Ordering::Relaxed);
        // SAFETY: entered above.
        let kept = unsafe { self.push(Slot { class, size, cap: 0 }, addr, limit) };
        self.exit();
        kept
    }

    /// Wait until a thief has let go (it holds the magazines only while moving them).
    pub fn wait_for_thief(&self) {
        while self.steal.load(Ordering::Acquire) {
            crate::sync::yield_now();
        }
    }

    /// Enter, waiting out any thief.
    #[inline]
    pub fn enter_wait(&self) {
        while !self.enter() {
            self.wait_for_thief();
        }
    }

    /// # Safety
    /// The caller holds the handshake (between `enter` and `exit`, or inside a won steal).
    #[inline]
    #[allow(clippy::mut_from_ref)]
    unsafe fn mags(&self) -> &mut Mags {
        // SAFETY: the caller holds the handshake, so no other party touches the magazines;
        // the reference does not outlive the caller's hold (it is used within one operation).
        self.mags.with_mut(|p| unsafe { &mut *p })
    }

    /// The hit path: a block of class `class` from the loaded magazine. Everything else
    /// (the previous magazine, the depot) is [`CacheShared::pop_slow`], kept out of line so
    /// this stays a handful of instructions.
    ///
    /// # Safety
    /// The caller has entered (and not yet exited).
    #[inline(always)]
    pub unsafe fn pop(&self, class: usize, size: u64) -> Option<u64> {
        // SAFETY: the caller holds the handshake.
        let a = unsafe { self.mags() }.take(hot_index(class))?;
        self.count_hit(size);
        Some(a)
    }

    /// After [`CacheShared::pop`] missed: swap in the previous magazine if it holds a block,
    /// and take one. No depot, no epoch pin.
    ///
    /// # Safety
    /// The caller has entered (and not yet exited).
    pub unsafe fn pop_prev(&self, class: usize, size: u64) -> Option<u64> {
        // SAFETY: the caller holds the handshake.
        self.swap_in_prev(unsafe { self.mags() }, class, size)
    }

    /// The previous magazine of `class` loaded in place of the empty loaded one, and a
    /// block from it; None (nothing opened) if it is empty too.
    fn swap_in_prev(&self, mags: &mut Mags, class: usize, size: u64) -> Option<u64> {
        // The previous magazine is not described by the hot entry: look before opening.
        if mags.classes.get(class)?.as_ref()?.prev.is_empty() {
            return None;
        }
        let cm = mags.open(class)?;
        std::mem::swap(&mut cm.loaded, &mut cm.prev);
        let a = cm.loaded.pop();
        mags.close(class);
        self.count_hit(size);
        a
    }

    /// After [`CacheShared::pop`] missed: swap in the previous magazine, or trade the empty
    /// loaded one for a full one from `depot`.
    ///
    /// # Safety
    /// The caller has entered (and not yet exited), and `class` is below the class count.
    #[cold]
    #[inline(never)]
    pub unsafe fn pop_slow(&self, slot: Slot, depot: &Depot, guard: impl FnOnce() -> Guard) -> Option<u64> {
        let Slot { class, size, .. } = slot;
        // SAFETY: the caller holds the handshake.
        let mags = unsafe { self.mags() };
        if class >= mags.classes.len() {
            return None;
        }
        if let Some(a) = self.swap_in_prev(mags, class, size) {
            return Some(a);
        }
        // Both empty: the loaded one goes to the depot's empties and a full one is loaded.
        let g = guard();
        let full = depot.take_full(&g)?;
        // The class exists (checked above), so this makes its magazines if need be. Opened
        // here and closed below: a class closed without being opened would reload its hot
        // entry from the loaded magazine's stale count.
        let cm = mags.open_or_make(slot)?;
        let empty = std::mem::replace(&mut cm.loaded, full);
        depot.put_empty(empty, &g);
        let c = &self.counters;
        // The magazine's blocks moved from the depot into this cache.
        bump(&c.cached_bytes, cm.loaded.len() as u64 * size);
        let a = cm.loaded.pop();
        mags.close(class);
        bump(&c.t1_hits, 1);
        drop_by(&c.cached_bytes, size);
        a
    }

    #[inline(always)]
    fn count_hit(&self, size: u64) {
        let c = &self.counters;
        bump(&c.t0_hits, 1);
        drop_by(&c.cached_bytes, size);
    }

    /// After a miss in `class` and its depot: take a block of a larger class within the
    /// class's reach (see [`CacheShared::set_reach`]) from this cache, if it holds one: from
    /// a loaded magazine as the hit path would (it has looked already, unless a thief kept
    /// it out), else from the smallest such class's previous magazine, which no hot entry
    /// describes. The block is used whole (its capacity is its own class's size): memory
    /// the cache already holds serves the request instead of new memory from the arena.
    ///
    /// # Safety
    /// The caller holds the handshake.
    pub unsafe fn pop_larger(&self, class: usize) -> Option<Hit> {
        // SAFETY: the caller holds the handshake.
        let mags = unsafe { self.mags() };
        let c = hot_index(class) as usize;
        let hit = mags.take_larger(c).or_else(|| {
            let reach = mags.reach[c];
            (0..REACH_MAX).filter(|j| reach >> j & 1 == 1).map(|j| c + 1 + j).find_map(|from| {
                let cm = mags.classes.get_mut(from)?.as_mut()?;
                let addr = cm.prev.pop()?;
                Some(Hit { addr, class: from, size: u64::from(cm.size) })
            })
        })?;
        self.count_hit(hit.size);
        Some(hit)
    }

    /// The free path: put a block of `slot`'s class in the loaded magazine. False when
    /// that is not possible here (the magazine is full, the cache is at `limit` bytes, the
    /// class has no magazines yet): the caller then calls [`CacheShared::push_slow`].
    /// `slot.cap` is not read: the loaded magazine's entry carries the class's capacity.
    ///
    /// # Safety
    /// The caller has entered (and not yet exited).
    #[inline(always)]
    pub unsafe fn push(&self, slot: Slot, addr: u64, limit: u64) -> bool {
        let c = &self.counters;
        let cached = c.cached_bytes.load(Ordering::Relaxed);
        if cached + slot.size > limit {
            return false;
        }
        // SAFETY: the caller holds the handshake.
        if !unsafe { self.mags() }.put(hot_index(slot.class), addr) {
            return false;
        }
        c.cached_bytes.store(cached + slot.size, Ordering::Relaxed);
        bump(&c.frees, 1);
        true
    }

    /// After [`CacheShared::push`] refused: swap in the previous magazine if it is empty,
    /// else give the previous (full) one to `depot` and load an empty one. Returns the blocks
    /// that could not be kept (past `limit`, or past the depot's bound), which the caller
    /// retires once outside.
    ///
    /// # Safety
    /// The caller has entered (and not yet exited).
    #[cold]
    #[inline(never)]
    pub unsafe fn push_slow(
        &self,
        slot: Slot,
        addr: u64,
        limit: u64,
        depot: &Depot,
        guard: impl FnOnce() -> Guard,
    ) -> Spill {
        let Slot { class, size, .. } = slot;
        let c = &self.counters;
        bump(&c.frees, 1);
        if c.cached_bytes.load(Ordering::Relaxed) + size > limit {
            return Spill::Retire(vec![addr]);
        }
        // SAFETY: the caller holds the handshake.
        let mags = unsafe { self.mags() };
        let spill = self.push_slow_in(mags, slot, addr, depot, guard);
        mags.close(class);
        spill
    }

    fn push_slow_in(
        &self,
        mags: &mut Mags,
        slot: Slot,
        addr: u64,
        depot: &Depot,
        guard: impl FnOnce() -> Guard,
    ) -> Spill {
        let size = slot.size;
        let c = &self.counters;
        let Some(cm) = mags.open_or_make(slot) else { return Spill::Retire(vec![addr]) };
        let cap = cm.cap as usize;
        if cm.loaded.push(addr, cap) {
            bump(&c.cached_bytes, size);
            return Spill::None;
        }
        if cm.prev.is_empty() {
            std::mem::swap(&mut cm.loaded, &mut cm.prev);
            cm.loaded.push(addr, cap);
            bump(&c.cached_bytes, size);
            return Spill::None;
        }
        // Both full: the previous magazine goes to the depot (or, past its bound, to
        // retire), the loaded one becomes previous, and an empty one is loaded.
        let g = guard();
        let empty = depot.take_empty(&g).unwrap_or_else(Magazine::boxed);
        let full = std::mem::replace(&mut cm.prev, std::mem::replace(&mut cm.loaded, empty));
        drop_by(&c.cached_bytes, full.len() as u64 * size);
        if let Err(mut full) = depot.put_full(full, &g) {
            let mut out = Vec::with_capacity(full.len() + 1);
            full.drain(|a| out.push(a));
            depot.put_empty(full, &g);
            out.push(addr);
            return Spill::Retire(out);
        }
        cm.loaded.push(addr, cap);
        bump(&c.cached_bytes, size);
        Spill::None
    }

    /// Move every cached block out: full magazines to `depots[class]` when `to_depots` and
    /// it has room, every other block to `retire(class, addr)`. The caller holds the
    /// handshake (as owner or as a thief that won).
    ///
    /// # Safety
    /// The caller holds the handshake.
    pub unsafe fn drain(&self, depots: &[Depot], to_depots: bool, mut retire: impl FnMut(usize, u64), guard: &Guard) {
        // SAFETY: the caller holds the handshake.
        let mags = unsafe { self.mags() };
        mags.open_all();
        for (class, slot) in mags.classes.iter_mut().enumerate() {
            let Some(cm) = slot.take() else { continue };
            for m in [cm.loaded, cm.prev] {
                if m.is_empty() {
                    continue;
                }
                let bytes = m.len() as u64 * u64::from(cm.size);
                drop_by(&self.counters.cached_bytes, bytes);
                let m = match depots.get(class) {
                    Some(d) if to_depots => match d.put_full(m, guard) {
                        Ok(()) => continue,
                        Err(m) => m,
                    },
                    _ => m,
                };
                let mut m = m;
                m.drain(|a| retire(class, a));
            }
        }
        mags.close_all();
    }

    /// Move whole magazines of the `classes` out, largest classes first, until at least
    /// `target` bytes have left (or none is left); each block goes to `retire(class, addr)`.
    /// Returns the bytes moved. Large blocks are the ones a cache hits least and the arena
    /// wants most.
    ///
    /// # Safety
    /// The caller holds the handshake.
    pub unsafe fn drain_some(
        &self,
        target: u64,
        classes: std::ops::Range<usize>,
        mut retire: impl FnMut(usize, u64),
    ) -> u64 {
        // SAFETY: the caller holds the handshake.
        let mags = unsafe { self.mags() };
        let mut moved = 0;
        // Only the classes asked for are opened: the ladder's rung 0 asks for the large
        // ones before every block no cache holds, and opening all of them each time was a
        // walk of every class for a few.
        for class in (classes.start..classes.end.min(mags.classes.len())).rev() {
            if moved >= target {
                break;
            }
            mags.open(class);
            if let Some(cm) = mags.classes[class].as_mut() {
                let size = u64::from(cm.size);
                for m in [&mut cm.prev, &mut cm.loaded] {
                    if moved >= target {
                        break;
                    }
                    if m.is_empty() {
                        // Rung 0 asks every large class before each block no cache holds;
                        // most of them are empty, and the count's store is not free.
                        continue;
                    }
                    let bytes = m.len() as u64 * size;
                    m.drain(|a| retire(class, a));
                    moved += bytes;
                    drop_by(&self.counters.cached_bytes, bytes);
                }
            }
            mags.close(class);
        }
        moved
    }

    /// Whether the calling thread is the one that made this cache (its owner).
    fn owned_here(&self) -> bool {
        self.owner == current_thread().id()
    }

    /// As a thief: take the handshake if the owner is not inside an operation (and no other
    /// thief holds it). On success run `f` with the magazines held, then let go; returns
    /// whether `f` ran.
    pub fn try_steal(&self, f: impl FnOnce(&Self)) -> bool {
        self.steal_with(f, || false, true)
    }

    /// [`CacheShared::try_steal`] for a caller that may be the cache's owner (the ladder and
    /// the trim look at every cache, their own thread's among them). The owner's take needs
    /// no barrier: its own operations are ordered with it by program order, and other
    /// thieves by the `steal` flag. The barrier interrupts every core running the process,
    /// and the ladder's idle-cache rung found its own thread's cache on most visits: on the
    /// random window, 228 `membarrier` calls in a run of 300,000 pairs a thread (and as many
    /// to warm up) on two threads, 563 on four (`docs/BENCHMARKS.md`, thirty-ninth
    /// session). Another thread's
    /// cache is stolen as `try_steal` does.
    ///
    /// # Safety
    /// The cache is entered (its owner's operations) only by the thread that made it, as
    /// every cache a pool registers is: a `ThreadCache` is made on its thread, is not `Send`,
    /// and is reached only through that thread's locals.
    pub unsafe fn take_own_or_steal(&self, f: impl FnOnce(&Self)) -> bool {
        self.steal_with(f, || false, !self.owned_here())
    }

    /// As a reader that must see this cache (a snapshot): take the handshake, waiting for
    /// the owner's operation in progress to end instead of giving up on it. Once the steal
    /// flag is up and the fence has passed, every later `enter` of the owner backs off, so
    /// the owner leaves after at most the operation it is in (and then waits in
    /// `enter_wait` until `f` is done). A busy owner thus cannot keep the reader out, as it
    /// can keep out [`CacheShared::try_steal`], which only takes a cache it finds between
    /// operations. `patient` is asked between looks and ends the wait when it says no
    /// (an operation that waits on the device can take a while); it also waits out another
    /// thief. On the owner's own thread it tries once. Returns whether `f` ran.
    pub fn steal_waiting(&self, f: impl FnOnce(&Self), patient: impl FnMut() -> bool) -> bool {
        if self.owned_here() {
            // The owner may be inside an operation further up its own stack.
            return self.try_steal(f);
        }
        self.steal_with(f, patient, true)
    }

    /// The thief's side of the handshake: raise `steal`, fence (unless the caller is the
    /// owner, with `fence` false), and run `f` once `in_use` is down, asking `patient`
    /// before each further look at either flag (never patient: one look each).
    fn steal_with(&self, f: impl FnOnce(&Self), mut patient: impl FnMut() -> bool, fence: bool) -> bool {
        // Another thief (a trim, a ladder taking idle caches) holds the flag only while it
        // moves the magazines. Read before each swap: a waiter writes the flag (and takes
        // its line from that thief) only when it may win it.
        while self.steal.load(Ordering::Acquire) || self.steal.swap(true, Ordering::AcqRel) {
            if !patient() {
                return false;
            }
            crate::sync::yield_now();
        }
        if fence && !heavy_fence() {
            self.steal.store(false, Ordering::Release);
            return false;
        }
        // Acquire: pairs with the owner's Release in `exit` (or in `enter`'s backing off),
        // so its last writes to the magazines are visible.
        while self.in_use.load(Ordering::Acquire) {
            if !patient() {
                self.steal.store(false, Ordering::Release);
                return false;
            }
            crate::sync::yield_now();
        }
        f(self);
        self.steal.store(false, Ordering::Release);
        true
    }

    /// Mark the cache let go by its owner (after its last flush).
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// Whether the owner has let go of the cache.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Check that the hot entries the hit paths read agree with the magazines (a wrong one
    /// would make the hit path pass over a block, or take from or put past a magazine's
    /// end).
    ///
    /// # Safety
    /// The caller holds the handshake, or the pool is quiet (no thread uses the cache).
    pub unsafe fn check_hot_entries(&self) -> Result<(), String> {
        // SAFETY: per the contract.
        unsafe { self.mags() }.check()
    }

    /// Visit every cached block (for checks on a quiet pool).
    ///
    /// # Safety
    /// The caller holds the handshake, or the pool is quiet (no thread uses the cache).
    pub unsafe fn for_each_block(&self, mut f: impl FnMut(usize, u64)) {
        // SAFETY: per the contract.
        let mags = unsafe { self.mags() };
        for (class, slot) in mags.classes.iter().enumerate() {
            if let Some(cm) = slot {
                // The loaded magazine's count is the hot entry's.
                let loaded = &cm.loaded.slots()[..mags.lens[class] as usize];
                loaded.iter().chain(cm.prev.blocks()).for_each(|&a| f(class, a));
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
