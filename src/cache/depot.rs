//! The stream depot (T1): the full and empty magazines of ONE (stream, size class).
//!
//! Thread caches (T0) of every thread that uses the stream exchange *whole* magazines here: a
//! thread whose magazines are both empty takes a full one and gives back an empty one; a
//! thread whose magazines are both full gives a full one and takes an empty one. Blocks in
//! the depot's full magazines may be reused on the depot's stream at once, with no event:
//! stream order already runs their old use before any new one.
//!
//! **What it owns.** Two [`EpochStack`]s of boxed [`Magazine`]s (full ones and empty ones)
//! and three counters. A magazine is owned by exactly one party at a time: a thread cache,
//! or the depot (inside one stack node), or whoever took it out; moving it in or out is one
//! CAS on a stack head.
//!
//! **Invariants.**
//! - The full stack never holds more than `limit` magazines, not even transiently: a putter
//!   reserves a slot on `full_count` (a CAS loop that stays below `limit`) *before* pushing,
//!   and a taker gives the slot back only *after* its pop; the reservation is Acquire and the
//!   release is Release, so a slot is reused only once the pop that freed it is visible in
//!   the stack's own order. So `full stack length <= full_count <= limit` at all times. The
//!   empty stack is bounded the same way on its own counter (extra empties are freed).
//! - `blocks` is the number of blocks in the full stack's magazines, added before the push
//!   and subtracted after the pop (so it never underflows); like `full_count` it is exact
//!   when the depot is quiet and a snapshot otherwise.
//! - Empty magazines hold no block; blocks are never in the empty stack.
//!
//! **Why lock-free.** Many worker threads share one stream and so one depot per class; a
//! lock here would serialise exactly the threads the cache tiers exist to keep apart. A
//! Treiber stack pops one node with one CAS; the ABA problem and use-after-free of a popped
//! node (another thread may still be reading its `next`) are ruled out by crossbeam-epoch:
//! popped nodes are destroyed only when every thread pinned at the time has unpinned, so a
//! node's address cannot be reused while anyone may still compare against it.
//!
//! Dropping a depot frees its magazines but not the blocks in them (they are plain
//! addresses): the owner drains it first (see [`Depot::drain`]) and retires the blocks.

use std::mem::ManuallyDrop;
use std::ptr;

use super::budget::Budget;
use super::magazine::Magazine;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::epoch::{self, Atomic, Guard, Owned, Shared};
use crate::sync::Arc;
use crate::sync::UnsafeCell;

struct Node<T> {
    /// Written once before the node is published, read (moved out) once by the thread whose
    /// CAS unlinked the node. `ManuallyDrop`: the node's deferred destruction must not drop
    /// the item again. In the facade's `UnsafeCell` so loom checks the handoff.
    item: UnsafeCell<ManuallyDrop<T>>,
    /// Read by any thread that saw the node as the head; written only before publication.
    next: Atomic<Node<T>>,
}

/// A lock-free Treiber stack with push, pop-one and take-all; nodes are reclaimed with
/// crossbeam-epoch, so every operation takes the caller's [`Guard`].
pub struct EpochStack<T> {
    head: Atomic<Node<T>>,
}

// SAFETY: the stack owns its items and hands each one to exactly one thread (the one whose
// CAS or swap unlinked its node); no `&T` is ever shared between threads, and other threads
// touch only a node's `next`. So the stack is Send and Sync whenever items can be sent.
unsafe impl<T: Send> Send for EpochStack<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for EpochStack<T> {}

impl<T> Default for EpochStack<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> EpochStack<T> {
    /// An empty stack.
    pub fn new() -> Self {
        EpochStack { head: Atomic::null() }
    }

    /// Push one item.
    pub fn push(&self, item: T, guard: &Guard) {
        let mut node = Owned::new(Node { item: UnsafeCell::new(ManuallyDrop::new(item)), next: Atomic::null() });
        let mut head = self.head.load(Ordering::Relaxed, guard);
        loop {
            // The node is still ours: no one else can see this store.
            node.next.store(head, Ordering::Relaxed);
            // Release: whoever acquires the head sees the item and `next`.
            match self.head.compare_exchange(head, node, Ordering::Release, Ordering::Relaxed, guard) {
                Ok(_) => return,
                Err(e) => {
                    head = e.current;
                    node = e.new;
                }
            }
        }
    }

    /// Pop the most recently pushed item.
    pub fn pop(&self, guard: &Guard) -> Option<T> {
        let mut head = self.head.load(Ordering::Acquire, guard);
        loop {
            // SAFETY: a non-null head was reachable while we are pinned, so its destruction
            // (deferred by whoever unlinks it) cannot run before we unpin.
            let h = unsafe { head.as_ref() }?;
            let next = h.next.load(Ordering::Relaxed, guard);
            // AcqRel: Acquire pairs with the pushes (through the head's release sequence);
            // Release keeps this RMW a plain link of that sequence for later readers.
            match self.head.compare_exchange(head, next, Ordering::AcqRel, Ordering::Acquire, guard) {
                Ok(_) => {
                    // SAFETY: our CAS unlinked the node, so we are the one thread that moves
                    // its item out; the item is in `ManuallyDrop`, so the node's destruction
                    // will not drop it again. Its write happened before the Release push we
                    // acquired.
                    let item = h.item.with(|p| unsafe { ptr::read(p) });
                    // SAFETY: the node is unlinked: no new reader can reach it, and the epoch
                    // defers its destruction until every current reader has unpinned.
                    unsafe { guard.defer_destroy(head) };
                    return Some(ManuallyDrop::into_inner(item));
                }
                Err(e) => head = e.current,
            }
        }
    }

    /// Take every item at once, most recently pushed first.
    pub fn take_all(&self, guard: &Guard) -> Vec<T> {
        // AcqRel: Acquire pairs with every push of the chain (release sequence of the head).
        let mut cur = self.head.swap(Shared::null(), Ordering::AcqRel, guard);
        let mut out = Vec::new();
        // SAFETY: the whole chain is unlinked by our swap; its nodes stay allocated while we
        // are pinned (their destruction is deferred below, after our last access).
        while let Some(n) = unsafe { cur.as_ref() } {
            let next = n.next.load(Ordering::Relaxed, guard);
            // SAFETY: our swap unlinked this node, so we alone move its item out (once; the
            // item is in `ManuallyDrop`).
            let item = n.item.with(|p| unsafe { ptr::read(p) });
            out.push(ManuallyDrop::into_inner(item));
            // SAFETY: unlinked, and other threads that may still read its `next` are pinned,
            // so the epoch waits for them.
            unsafe { guard.defer_destroy(cur) };
            cur = next;
        }
        out
    }

    /// Whether the stack looks empty (a snapshot).
    pub fn is_empty(&self, guard: &Guard) -> bool {
        self.head.load(Ordering::Acquire, guard).is_null()
    }
}

impl<T> Drop for EpochStack<T> {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no other thread can reach the stack, so its nodes (still
        // linked, hence still holding their items) can be freed at once, each exactly once.
        unsafe {
            let guard = epoch::unprotected();
            let mut cur = self.head.load(Ordering::Relaxed, guard);
            while !cur.is_null() {
                let node = cur.into_owned();
                cur = node.next.load(Ordering::Relaxed, guard);
                node.item.with_mut(|p| ManuallyDrop::drop(&mut *p));
            }
        }
    }
}

/// Reserve one of `limit` slots on `count`; false if all are taken.
fn reserve(count: &AtomicUsize, limit: usize) -> bool {
    let mut n = count.load(Ordering::Relaxed);
    loop {
        if n >= limit {
            return false;
        }
        // Acquire: pairs with the Release of `release`, so the pop that freed the slot comes
        // before our push in the stack's order (the bound holds even transiently).
        match count.compare_exchange(n, n + 1, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => n = now,
        }
    }
}

/// Give back `k` slots on `count`, after the pops that emptied them.
fn release(count: &AtomicUsize, k: usize) {
    if k > 0 {
        count.fetch_sub(k, Ordering::Release);
    }
}

/// The full and empty magazines of one (stream, size class). See the module documentation.
pub struct Depot {
    full: EpochStack<Box<Magazine>>,
    empty: EpochStack<Box<Magazine>>,
    full_count: AtomicUsize,
    empty_count: AtomicUsize,
    blocks: AtomicUsize,
    limit: usize,
    /// The pool-wide cache budget this depot charges for the magazines it holds, and the
    /// size of its blocks. None: bounded by `limit` alone.
    budget: Option<(Arc<Budget>, u64)>,
}

impl Depot {
    /// A depot holding at most `limit` full magazines (and at most `limit` empty ones).
    pub fn new(limit: usize) -> Depot {
        Depot {
            full: EpochStack::new(),
            empty: EpochStack::new(),
            full_count: AtomicUsize::new(0),
            empty_count: AtomicUsize::new(0),
            blocks: AtomicUsize::new(0),
            limit,
            budget: None,
        }
    }

    /// A depot that also charges `budget` for every block it holds (`block_size` bytes each),
    /// refusing magazines past the budget's maximum.
    pub fn with_budget(limit: usize, budget: Arc<Budget>, block_size: u64) -> Depot {
        Depot { budget: Some((budget, block_size)), ..Depot::new(limit) }
    }

    fn charge(&self, blocks: usize) -> bool {
        match &self.budget {
            Some((b, size)) => b.try_take(blocks as u64 * size),
            None => true,
        }
    }

    fn refund(&self, blocks: usize) {
        if let Some((b, size)) = &self.budget {
            b.give(blocks as u64 * size);
        }
    }

    /// Give a full magazine. `Err(mag)`, untouched, if the depot already holds `limit` full
    /// ones (the caller then retires its blocks).
    pub fn put_full(&self, mag: Box<Magazine>, guard: &Guard) -> Result<(), Box<Magazine>> {
        if !reserve(&self.full_count, self.limit) {
            return Err(mag);
        }
        if !self.charge(mag.len()) {
            release(&self.full_count, 1);
            return Err(mag);
        }
        // Before the push, so `blocks` never counts less than the stack holds being popped.
        self.blocks.fetch_add(mag.len(), Ordering::Relaxed);
        self.full.push(mag, guard);
        Ok(())
    }

    /// Take a full magazine, the most recently given one.
    pub fn take_full(&self, guard: &Guard) -> Option<Box<Magazine>> {
        let mag = self.full.pop(guard)?;
        self.blocks.fetch_sub(mag.len(), Ordering::Relaxed);
        self.refund(mag.len());
        release(&self.full_count, 1);
        Some(mag)
    }

    /// Give an empty magazine; kept if fewer than `limit` empties are held, freed otherwise.
    pub fn put_empty(&self, mag: Box<Magazine>, guard: &Guard) {
        debug_assert!(mag.is_empty(), "an empty magazine holds no block");
        if reserve(&self.empty_count, self.limit) {
            self.empty.push(mag, guard);
        }
    }

    /// Take an empty magazine, if one is held.
    pub fn take_empty(&self, guard: &Guard) -> Option<Box<Magazine>> {
        let mag = self.empty.pop(guard)?;
        release(&self.empty_count, 1);
        Some(mag)
    }

    /// Full magazines held (a snapshot; never more than `limit`).
    pub fn full_count(&self) -> usize {
        self.full_count.load(Ordering::Relaxed)
    }

    /// Blocks in the full magazines held (a snapshot of a maintained counter).
    pub fn blocks(&self) -> usize {
        self.blocks.load(Ordering::Relaxed)
    }

    /// Take every full magazine (trim, out-of-memory flush).
    // Boxed on purpose: magazines move between tiers as `Box`es, never copied.
    #[allow(clippy::vec_box)]
    pub fn drain(&self, guard: &Guard) -> Vec<Box<Magazine>> {
        let mags = self.full.take_all(guard);
        let n: usize = mags.iter().map(|m| m.len()).sum();
        self.blocks.fetch_sub(n, Ordering::Relaxed);
        self.refund(n);
        release(&self.full_count, mags.len());
        mags
    }

    /// Visit every block in the full magazines (for checks on a quiet pool). The magazines
    /// are taken out for the visit and put back in the same order, keeping their slots, so
    /// this is sound at any time; a concurrent `take_full` may just find none meanwhile.
    pub fn for_each_block(&self, mut f: impl FnMut(u64), guard: &Guard) {
        let mags = self.full.take_all(guard);
        for m in &mags {
            m.blocks().iter().for_each(|&a| f(a));
        }
        // Oldest first, so the warmest ends on top again; slots and `blocks` were never given
        // back, so no count changes.
        for m in mags.into_iter().rev() {
            self.full.push(m, guard);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::cache::magazine::MAG_CAP;
    use std::collections::HashSet;
    use std::sync::atomic::AtomicBool;

    fn mag(blocks: impl IntoIterator<Item = u64>) -> Box<Magazine> {
        let mut m = Magazine::boxed();
        for a in blocks {
            assert!(m.push(a, MAG_CAP));
        }
        m
    }

    #[test]
    fn epoch_stack_is_lifo_and_take_all_empties_it() {
        let s = EpochStack::new();
        let g = epoch::pin();
        for i in 0..5 {
            s.push(vec![i], &g);
        }
        assert_eq!(s.pop(&g), Some(vec![4]));
        assert_eq!(s.take_all(&g), vec![vec![3], vec![2], vec![1], vec![0]]);
        assert!(s.is_empty(&g) && s.pop(&g).is_none());
        s.push(vec![9], &g);
        drop(s); // frees the item still held
    }

    #[test]
    fn put_and_take_round_trip() {
        let d = Depot::new(2);
        let g = epoch::pin();
        assert!(d.take_full(&g).is_none() && d.take_empty(&g).is_none());
        d.put_full(mag([1, 2, 3]), &g).unwrap();
        d.put_full(mag([4]), &g).unwrap();
        let back = d.put_full(mag([5, 6]), &g).unwrap_err();
        assert_eq!(back.blocks(), &[5, 6], "rejected magazine comes back intact");
        assert_eq!((d.full_count(), d.blocks()), (2, 4));
        let mut seen = vec![];
        d.for_each_block(|a| seen.push(a), &g);
        seen.sort_unstable();
        assert_eq!(seen, vec![1, 2, 3, 4]);
        assert_eq!((d.full_count(), d.blocks()), (2, 4), "visiting changes nothing");
        let m = d.take_full(&g).unwrap();
        assert_eq!(m.blocks(), &[4], "most recent first");
        assert_eq!((d.full_count(), d.blocks()), (1, 3));
        let mut m = m;
        m.drain(|_| {});
        d.put_empty(m, &g);
        d.put_empty(Magazine::boxed(), &g);
        d.put_empty(Magazine::boxed(), &g); // over the limit: freed
        assert!(d.take_empty(&g).is_some() && d.take_empty(&g).is_some());
        assert!(d.take_empty(&g).is_none());
        let all = d.drain(&g);
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].blocks(), &[1, 2, 3]);
        assert_eq!((d.full_count(), d.blocks()), (0, 0));
        // Dropping a depot that still holds magazines frees them.
        d.put_full(mag([7]), &g).unwrap();
        d.put_empty(Magazine::boxed(), &g);
    }

    #[test]
    fn the_limit_holds_under_racing_puts() {
        const LIMIT: usize = 5;
        let d = Depot::new(LIMIT);
        // Phase 1: 4 threads × 8 puts, no takes: exactly LIMIT succeed, the rest come back.
        let rejected: Vec<Vec<Box<Magazine>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4u64)
                .map(|t| {
                    let d = &d;
                    s.spawn(move || {
                        let mut back = vec![];
                        for i in 0..8u64 {
                            let base = (t * 8 + i) * 10;
                            if let Err(m) = d.put_full(mag([base, base + 1]), &epoch::pin()) {
                                assert_eq!(m.blocks(), &[base, base + 1], "rejected intact");
                                back.push(m);
                            }
                        }
                        back
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let n_rejected: usize = rejected.iter().map(Vec::len).sum();
        assert_eq!(n_rejected, 32 - LIMIT);
        assert_eq!((d.full_count(), d.blocks()), (LIMIT, 2 * LIMIT));
        let held = d.drain(&epoch::pin());
        assert_eq!(held.len(), LIMIT);
        let mut all: Vec<u64> =
            held.iter().chain(rejected.iter().flatten()).flat_map(|m| m.blocks().to_vec()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..32u64).flat_map(|i| [i * 10, i * 10 + 1]).collect::<Vec<_>>());

        // Phase 2: 4 threads, 4 magazines, room for 2: puts and takes churn (some puts are
        // refused) while an observer checks the bound.
        let d = Depot::new(2);
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let (d, done) = (&d, &done);
            s.spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    assert!(d.full_count() <= 2);
                }
            });
            let hs: Vec<_> = (0..4u64)
                .map(|t| {
                    s.spawn(move || {
                        let mut mine = mag([t]);
                        for i in 0..20_000 {
                            let g = epoch::pin();
                            match d.put_full(mine, &g) {
                                Ok(()) => {
                                    // Take one back (perhaps another thread's).
                                    mine = loop {
                                        if let Some(m) = d.take_full(&g) {
                                            break m;
                                        }
                                    };
                                }
                                Err(m) => mine = m,
                            }
                            if i % 64 == 0 {
                                assert!(d.full_count() <= 2);
                            }
                        }
                        mine
                    })
                })
                .collect();
            let mut got: Vec<u64> = hs.into_iter().flat_map(|h| h.join().unwrap().blocks().to_vec()).collect();
            done.store(true, Ordering::Relaxed);
            got.sort_unstable();
            assert_eq!(got, vec![0, 1, 2, 3]);
        });
        assert_eq!((d.full_count(), d.blocks()), (0, 0));
    }

    #[test]
    fn threads_exchanging_magazines_lose_and_duplicate_nothing() {
        const THREADS: u64 = 4;
        const PER_THREAD: u64 = 3; // magazines each thread starts with
        const CAP: usize = 8;
        let d = Depot::new(4);
        let held: Vec<Vec<Box<Magazine>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..THREADS)
                .map(|t| {
                    let d = &d;
                    s.spawn(move || {
                        let mut held: Vec<Box<Magazine>> = (0..PER_THREAD)
                            .map(|m| {
                                let base = (t * PER_THREAD + m) * 1000;
                                mag((0..(m + 1) * 2).map(|i| base + i))
                            })
                            .collect();
                        held.push(Magazine::boxed());
                        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                        for _ in 0..20_000 {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            let g = epoch::pin();
                            match rng % 4 {
                                // Both magazines full: give a full one, take an empty one.
                                0 => {
                                    if let Some(i) = held.iter().position(|m| !m.is_empty()) {
                                        let m = held.swap_remove(i);
                                        let snapshot = m.blocks().to_vec();
                                        match d.put_full(m, &g) {
                                            Ok(()) => held.extend(d.take_empty(&g)),
                                            Err(m) => {
                                                assert_eq!(m.blocks(), &snapshot[..]);
                                                held.push(m);
                                            }
                                        }
                                    }
                                }
                                // Both empty: take a full one, give an empty one.
                                1 => {
                                    if let Some(m) = d.take_full(&g) {
                                        held.push(m);
                                        if let Some(i) = held.iter().position(|m| m.is_empty()) {
                                            d.put_empty(held.swap_remove(i), &g);
                                        }
                                    }
                                }
                                // Allocations and frees move blocks between own magazines.
                                _ => {
                                    let n = held.len();
                                    if n >= 2 {
                                        let (a, b) = ((rng >> 8) as usize % n, (rng >> 16) as usize % n);
                                        if a != b {
                                            if let Some(x) = held[a].pop() {
                                                if !held[b].push(x, CAP) {
                                                    held[a].push(x, MAG_CAP);
                                                }
                                            }
                                        }
                                    }
                                    if held.iter().all(|m| !m.is_empty()) {
                                        held.extend(d.take_empty(&g));
                                    }
                                }
                            }
                        }
                        held
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let g = epoch::pin();
        let in_depot = d.blocks();
        assert!(d.full_count() <= 4);
        let mut visited = 0;
        d.for_each_block(|_| visited += 1, &g);
        assert_eq!(visited, in_depot);
        let drained = d.drain(&g);
        assert_eq!(drained.iter().map(|m| m.len()).sum::<usize>(), in_depot);
        while let Some(e) = d.take_empty(&g) {
            assert!(e.is_empty(), "no block hides in an empty magazine");
        }
        let mut all: Vec<u64> = drained.iter().chain(held.iter().flatten()).flat_map(|m| m.blocks().to_vec()).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "a block is duplicated");
        let want: HashSet<u64> = (0..THREADS)
            .flat_map(|t| {
                (0..PER_THREAD).flat_map(move |m| (0..(m + 1) * 2).map(move |i| (t * PER_THREAD + m) * 1000 + i))
            })
            .collect();
        assert_eq!(all.into_iter().collect::<HashSet<_>>(), want, "every block exactly once");
        assert_eq!((d.full_count(), d.blocks()), (0, 0));
    }
}
