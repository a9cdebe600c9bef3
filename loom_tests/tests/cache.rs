//! loom models of the thread-cache tier (T0) and its neighbours: the idle-cache handshake
//! (owner operations racing a thief, and racing a reader that waits for them), the
//! thread-exit flush racing the pool's trim, and an allocating thread racing the
//! out-of-memory ladder's flush of caches and depots.
//!
//! Tiny configurations: one size class, magazines of 1–2 blocks, depots that keep one full
//! magazine, 2 threads. The magazines live in the facade's `UnsafeCell`, so loom itself
//! fails any interleaving where owner and thief touch them without a happens-before edge.
//! Every model ends by checking that each block is in exactly one place and that the
//! cache's `cached_bytes` counter agrees with what the cache holds.
//!
//! Blocks that leave a cache go back to the arena; the models stand a lock-free stack in
//! for it (the arena's own protocols have models of their own). Each model registers with
//! an explicit crossbeam-epoch `Collector` (the depot's nodes are reclaimed through it).
//!
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS=2 cargo test -p loom_tests --release --test cache`
#![cfg(loom)]

use std::cell::RefCell;

use crossbeam_epoch::{Collector, LocalHandle};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use vrampool::cache::depot::Depot;
use vrampool::cache::magazine::Magazine;
use vrampool::cache::thread::{CacheShared, Slot, Spill};
use vrampool::reclaim::{Span, Stack};

/// The one size class of every model.
const SIZE: u64 = 256;
/// No byte bound: the models exercise the magazine and depot paths, not the cache's limit.
const NO_LIMIT: u64 = u64::MAX;

fn slot(cap: usize) -> Slot {
    Slot { class: 0, size: SIZE, cap }
}

fn span(addr: u64) -> Span {
    Span { addr, size: SIZE }
}

/// An allocation as `ThreadCache::alloc` makes it: the hit path (the loaded magazine), else
/// once any thief is gone the loaded magazine again, the previous one or a full magazine
/// from the depot.
fn alloc(cs: &CacheShared, s: Slot, depot: &Depot, h: &LocalHandle) -> Option<u64> {
    if let Some(hit) = cs.try_pop_fast(0, SIZE) {
        assert_eq!((hit.class, hit.size), (0, SIZE), "the only class's block");
        return Some(hit.addr);
    }
    cs.enter_wait();
    // SAFETY: entered above; class 0 exists.
    let got = unsafe { cs.pop(0, SIZE).or_else(|| cs.pop_slow(s, depot, || h.pin())) };
    cs.exit();
    got
}

/// A free as `ThreadCache::free` makes it: the loaded magazine, else the slow path that
/// trades with the depot. Returns the blocks the cache could not keep (the caller retires
/// them once outside, as the pool does).
fn free(cs: &CacheShared, s: Slot, addr: u64, depot: &Depot, h: &LocalHandle) -> Vec<u64> {
    cs.enter_wait();
    // SAFETY: entered above.
    let spill = unsafe {
        if cs.push(s, addr, NO_LIMIT) {
            Spill::None
        } else {
            cs.push_slow(s, addr, NO_LIMIT, depot, || h.pin())
        }
    };
    cs.exit();
    match spill {
        Spill::None => Vec::new(),
        Spill::Retire(v) => v,
    }
}

/// The blocks of a cache nobody uses any more (after every thread joined), checked against
/// its `cached_bytes` counter.
fn cache_contents(cs: &CacheShared) -> Vec<u64> {
    let mut v = Vec::new();
    // SAFETY: quiet: every other thread has joined (or, in the exit model, let go).
    unsafe { cs.for_each_block(|_, a| v.push(a)) };
    // SAFETY: as above.
    unsafe { cs.check_hot_entries() }.expect("the hit path's summary agrees with the magazines");
    assert_eq!(
        cs.counters.cached_bytes.load(Ordering::Relaxed),
        v.len() as u64 * SIZE,
        "cached_bytes agrees with the blocks the cache holds"
    );
    v
}

/// The blocks of a quiet depot, checked against its counters.
fn depot_contents(d: &Depot, h: &LocalHandle) -> Vec<u64> {
    let g = h.pin();
    let (count, blocks) = (d.full_count(), d.blocks());
    let mags = d.drain(&g);
    assert_eq!(mags.len(), count, "full_count() agrees with the magazines held");
    let v: Vec<u64> = mags.iter().flat_map(|m| m.blocks().to_vec()).collect();
    assert_eq!(v.len(), blocks, "blocks() agrees with the magazines held");
    v
}

/// The blocks that went back to the (stand-in) arena.
fn retire_contents(r: &Stack<Span>, _h: &LocalHandle) -> Vec<u64> {
    let mut v: Vec<u64> = r
        .take_all()
        .map(|s| {
            assert_eq!(s.size, SIZE);
            s.addr
        })
        .collect();
    v.sort_unstable();
    v
}

fn assert_exactly_once(mut got: Vec<u64>, want: &[u64]) {
    got.sort_unstable();
    assert_eq!(got, want, "every block exactly once: none lost, none in two places");
}

/// A cache whose loaded magazine holds `blocks` (filled by frees, as an owner would).
fn filled_cache(blocks: &[u64], cap: usize, depot: &Depot, h: &LocalHandle) -> CacheShared {
    let cs = CacheShared::new(1);
    for &a in blocks {
        assert!(free(&cs, slot(cap), a, depot, h).is_empty());
    }
    cs
}

/// The handshake models' world: a cache whose loaded magazine holds blocks 1 and 2 (the
/// owner holds block 3, live), its stream's depot, and the retire queue a thief's and the
/// owner's spills go to. The thread that makes it is the cache's owner.
struct Handshake {
    collector: Arc<Collector>,
    depot: Arc<Depot>,
    cs: Arc<CacheShared>,
    retire: Arc<Stack<Span>>,
}

impl Handshake {
    fn new() -> Handshake {
        let collector = Arc::new(Collector::new());
        let depot = Arc::new(Depot::new(1));
        let cs = Arc::new(filled_cache(&[1, 2], 2, &depot, &collector.register()));
        Handshake { collector, depot, cs, retire: Arc::new(Stack::new()) }
    }

    fn share(&self) -> Handshake {
        Handshake {
            collector: self.collector.clone(),
            depot: self.depot.clone(),
            cs: self.cs.clone(),
            retire: self.retire.clone(),
        }
    }

    /// The owner's part: allocate one block, free block 3; returns the block it holds.
    fn owner_turn(&self) -> Option<u64> {
        let h = self.collector.register();
        let got = alloc(&self.cs, slot(2), &self.depot, &h);
        for a in free(&self.cs, slot(2), 3, &self.depot, &h) {
            self.retire.push(span(a));
        }
        got
    }

    /// A thief's take as the pool's trim and ladder make it: drain the magazines inside
    /// the handshake (`steal` runs the closure only while holding it), retire the blocks
    /// once outside. Returns whether the closure ran.
    fn take(&self, steal: impl FnOnce(&CacheShared, &mut dyn FnMut(&CacheShared)) -> bool) -> bool {
        let h = self.collector.register();
        let mut taken = Vec::new();
        let ran = steal(&self.cs, &mut |c| {
            let g = h.pin();
            // SAFETY: the steal holds the handshake while this runs.
            unsafe { c.drain(&[], false, |_, a| taken.push(a), &g) }
        });
        assert!(ran || taken.is_empty(), "a refused thief takes nothing");
        for &a in &taken {
            self.retire.push(span(a));
        }
        ran
    }

    /// Every block is in exactly one of the owner's hands, the cache, the depot and the
    /// retire queue, and `cached_bytes` matches the cache.
    fn check(&self, in_hands: Option<u64>) {
        let h = self.collector.register();
        let mut all: Vec<u64> = in_hands.into_iter().collect();
        all.extend(cache_contents(&self.cs));
        all.extend(depot_contents(&self.depot, &h));
        all.extend(retire_contents(&self.retire, &h));
        assert_exactly_once(all, &[1, 2, 3]);
    }
}

/// The idle-cache handshake. The owner allocates one block and frees another (fast paths
/// and, when the thief got there first, the slow ones), while a thief takes whatever the
/// cache holds as `steal_idle_caches` does. loom's cell checking fails any run where the
/// two touch the magazines at once; at the end each block is in exactly one place.
#[test]
fn owner_and_thief_never_hold_the_magazines_together() {
    loom::model(|| {
        let world = Handshake::new();
        let owner = {
            let world = world.share();
            thread::spawn(move || world.owner_turn())
        };
        world.take(|cs, f| cs.try_steal(f));
        world.check(owner.join().unwrap());
    });
}

/// The waiting reader (a snapshot's walk). The owner allocates one block and frees another
/// while a reader keeps the steal flag up and waits for the owner's operation to end, then
/// takes whatever the cache holds. loom's cell checking fails any run where the two touch
/// the magazines at once; the reader always gets in (it never gives up here), and each
/// block ends in exactly one place.
#[test]
fn a_waiting_reader_always_gets_in_and_never_beside_the_owner() {
    loom::model(|| {
        // Made here, so this thread is the owner (on the owner's own thread a reader only
        // tries once).
        let world = Handshake::new();
        let reader = {
            let world = world.share();
            thread::spawn(move || world.take(|cs, f| cs.steal_waiting(f, || true)))
        };
        let in_hands = world.owner_turn();
        assert!(reader.join().unwrap(), "a patient reader always gets the cache");
        world.check(in_hands);
    });
}

/// The owner takes its own cache (as the ladder's idle-cache rung and the trim do, looking
/// at every cache) without the thief's barrier, while a thief on another thread steals it.
/// Made on this thread, so this thread is the owner: its own operation and its take are
/// ordered by program order, and the two takes by the `steal` flag. loom's cell checking
/// fails any run where two of them touch the magazines at once (with the owner's take
/// skipping the `steal` flag too, this model fails); each block ends in exactly one place.
#[test]
fn an_owner_taking_its_own_cache_unfenced_races_a_thief_safely() {
    loom::model(|| {
        let world = Handshake::new();
        let thief = {
            let world = world.share();
            thread::spawn(move || world.take(|cs, f| cs.try_steal(f)))
        };
        let in_hands = world.owner_turn();
        // SAFETY: this thread made the cache and is the only one to enter it.
        world.take(|cs, f| unsafe { cs.take_own_or_steal(f) });
        thief.join().unwrap();
        world.check(in_hands);
    });
}

/// The part of a thread that owns a cache, kept in a loom thread-local as the pool keeps
/// its `ThreadCache`s: dropped at thread exit, it flushes the cache (full magazines to the
/// depot, the rest to the stream's retire queue) and marks it let go.
struct Owner {
    cs: Arc<CacheShared>,
    depot: Arc<Depot>,
    retire: Arc<Stack<Span>>,
    collector: Arc<Collector>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        let h = self.collector.register();
        let g = h.pin();
        let mut out = Vec::new();
        self.cs.enter_wait();
        // SAFETY: entered above.
        unsafe {
            self.cs.drain(std::slice::from_ref(&*self.depot), true, |_, a| out.push(a), &g);
        }
        self.cs.exit();
        for a in out {
            self.retire.push(span(a));
        }
        self.cs.retire();
    }
}

loom::thread_local! {
    static OWNER: RefCell<Option<Owner>> = RefCell::new(None);
}

/// The thread-exit flush racing the pool's trim. The owner thread allocates a block and
/// frees it and another (its loaded magazine of 2 overflows into the previous one), then
/// exits; its thread-local's destructor flushes. Meanwhile the main thread steals the cache
/// as `trim()` does. At the end every block is exactly once in the depot or the retire
/// queue, and the cache is empty.
///
/// loom 0.7's `JoinHandle::join` returns once the closure has returned, *before* the
/// thread's thread-locals are dropped (as `std::thread::scope`, rust#116179), so after
/// `join` the model waits for `is_retired()`, the flag the destructor sets last.
#[test]
fn a_thread_exit_flush_racing_a_trim_loses_and_duplicates_nothing() {
    loom::model(|| {
        let collector = Arc::new(Collector::new());
        let depot = Arc::new(Depot::new(1));
        let retire: Arc<Stack<Span>> = Arc::new(Stack::new());
        let cs = {
            let h = collector.register();
            // Loaded magazine [1, 2] from the owner's earlier frees; it holds block 3.
            Arc::new(filled_cache(&[1, 2], 2, &depot, &h))
        };
        let owner = {
            let (cs, depot, retire, c) = (cs.clone(), depot.clone(), retire.clone(), collector.clone());
            thread::spawn(move || {
                let h = c.register();
                OWNER.with(|o| {
                    *o.borrow_mut() = Some(Owner {
                        cs: cs.clone(),
                        depot: depot.clone(),
                        retire: retire.clone(),
                        collector: c.clone(),
                    })
                });
                let got = alloc(&cs, slot(2), &depot, &h);
                for a in got.into_iter().chain([3]) {
                    for spilled in free(&cs, slot(2), a, &depot, &h) {
                        retire.push(span(spilled));
                    }
                }
                // Returning ends the thread: OWNER's destructor flushes.
            })
        };
        let h = collector.register();
        let mut taken = Vec::new();
        cs.try_steal(|c| {
            let g = h.pin();
            // SAFETY: try_steal holds the handshake while this runs.
            unsafe { c.drain(&[], false, |_, a| taken.push(a), &g) }
        });
        for a in taken {
            retire.push(span(a));
        }
        owner.join().unwrap();
        while !cs.is_retired() {
            thread::yield_now();
        }
        assert!(cache_contents(&cs).is_empty(), "a flushed cache holds nothing");
        let mut all = depot_contents(&depot, &h);
        all.extend(retire_contents(&retire, &h));
        assert_exactly_once(all, &[1, 2, 3]);
    });
}

/// Where each block is, for the out-of-memory model: `FREE` while it sits in a tier
/// (cache, depot, retire queue), `TAKEN` while a thread holds it (allocated, or in flight
/// between tiers). Every removal from a tier CASes FREE→TAKEN and every insertion
/// TAKEN→FREE, so a block handed out twice, or put in two tiers, fails a CAS at once.
struct Tags(Vec<AtomicBool>);

const FREE: bool = false;
const TAKEN: bool = true;

impl Tags {
    fn new(taken: &[bool]) -> Tags {
        Tags(taken.iter().map(|&t| AtomicBool::new(t)).collect())
    }

    /// The block left a tier. Relaxed suffices: a CAS always reads the latest value of
    /// its own location, and that is all the check needs.
    fn removed(&self, a: u64) {
        let r = self.0[a as usize].compare_exchange(FREE, TAKEN, Ordering::Relaxed, Ordering::Relaxed);
        assert!(r.is_ok(), "block {a} removed from a tier while not in one (handed out twice)");
    }

    /// The block entered a tier.
    fn inserted(&self, a: u64) {
        let r = self.0[a as usize].compare_exchange(TAKEN, FREE, Ordering::Relaxed, Ordering::Relaxed);
        assert!(r.is_ok(), "block {a} put in a tier while already in one");
    }

    fn all_free(&self) -> bool {
        self.0.iter().all(|t| t.load(Ordering::Relaxed) == FREE)
    }
}

/// The out-of-memory flush racing allocations. Blocks 0..4: block 0 in thread A's cache
/// (magazines of 1), block 1 in a full magazine in the depot (which keeps one), blocks 2
/// and 3 live in A's hands. A allocates twice (a hit, then a miss that trades its empty
/// magazine for the depot's full one) and frees all four: the fast path, a swap with the
/// previous magazine, an overflow of the previous magazine into the depot, and an overflow
/// that finds the depot full again and spills to the retire queue. Thread B runs the
/// ladder's flush as the pool runs it for other threads: steal A's cache into the retire
/// queue, then empty the depot into it. Invariants: no block is ever in two places (the
/// tags), and at the end every block is in exactly one tier.
#[test]
fn an_out_of_memory_flush_racing_allocations_keeps_every_block_once() {
    loom::model(|| {
        let collector = Arc::new(Collector::new());
        let depot = Arc::new(Depot::new(1));
        let retire: Arc<Stack<Span>> = Arc::new(Stack::new());
        let tags = Arc::new(Tags::new(&[FREE, FREE, TAKEN, TAKEN]));
        let cs = {
            let h = collector.register();
            let mut m = Magazine::boxed();
            assert!(m.push(1, 1));
            depot.put_full(m, &h.pin()).unwrap();
            Arc::new(filled_cache(&[0], 1, &depot, &h))
        };
        let a = {
            let (cs, depot, retire, tags, c) =
                (cs.clone(), depot.clone(), retire.clone(), tags.clone(), collector.clone());
            thread::spawn(move || {
                let h = c.register();
                let mut held = vec![2, 3];
                for _ in 0..2 {
                    if let Some(x) = alloc(&cs, slot(1), &depot, &h) {
                        tags.removed(x);
                        held.push(x);
                    }
                }
                for x in held {
                    // Tagged before the push: once in the cache (or, through an overflow,
                    // the depot) a thief may take it.
                    tags.inserted(x);
                    for spilled in free(&cs, slot(1), x, &depot, &h) {
                        tags.removed(spilled);
                        tags.inserted(spilled);
                        retire.push(span(spilled));
                    }
                }
            })
        };
        let h = collector.register();
        // B: other threads' idle caches (`steal_idle_caches`)...
        let mut out = Vec::new();
        cs.try_steal(|c| {
            let g = h.pin();
            // SAFETY: try_steal holds the handshake while this runs.
            unsafe {
                c.drain(
                    &[],
                    false,
                    |_, x| {
                        tags.removed(x);
                        out.push(x);
                    },
                    &g,
                )
            }
        });
        // ... and the depots (`flush_depots`), magazine by magazine.
        {
            let g = h.pin();
            while let Some(mut m) = depot.take_full(&g) {
                m.drain(|x| {
                    tags.removed(x);
                    out.push(x);
                });
                depot.put_empty(m, &g);
            }
        }
        for x in out {
            tags.inserted(x);
            retire.push(span(x));
        }
        a.join().unwrap();
        assert!(tags.all_free(), "every block ends in a tier");
        let mut all = cache_contents(&cs);
        all.extend(depot_contents(&depot, &h));
        all.extend(retire_contents(&retire, &h));
        assert_exactly_once(all, &[0, 1, 2, 3]);
    });
}
