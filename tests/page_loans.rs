//! Page loans racing placements: large blocks (512 KiB – 12.5 MiB, so that neighbours share
//! pages at their edges) on four threads, each on its own stream, with the device busy (every
//! allocation is followed by 10–30 µs of work on its stream), so that freed memory still has
//! work of its last stream queued when the pool lends its pages elsewhere. Every block is
//! filled with a pattern naming it by a host function on its stream and checked by another
//! right before its free; some are also read on a shared copy stream (`record_stream`, after
//! an event: the user's part of the contract).
//!
//! A wrong word means two blocks shared memory on the streams' clocks. Found this way: a
//! placement that had claimed part of an unmapped page in the space, while another placement
//! lent memory to that page, used the memory without judging its history; every placement
//! now judges its block's fences again once its pages are held (`PoolInner::judge_held`).
//! Before that, this test saw 6–13 wrong blocks a run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vrampool::{Block, Device, Pool, PoolConfig, SimDevice};

/// Where the pattern is written and checked: one word every 64 KiB (a page is 2 MiB).
const STRIDE: u64 = 64 << 10;

#[path = "support/xorshift.rs"]
mod xorshift;
use xorshift::Rng;

#[path = "support/stall.rs"]
mod stall;
use stall::stalled;

/// Wrong blocks seen by host functions, and the first one's description.
#[derive(Default)]
struct Seen {
    wrong: AtomicU64,
    first: Mutex<Option<String>>,
}

impl Seen {
    fn check(&self, addr: u64, len: u64, tag: u64, at: &str) {
        let mut off = 0;
        while off < len {
            // SAFETY: the block is live on this stream's clock (its free is enqueued after
            // this check, or behind the events of every stream it is used on), and the
            // simulator's device addresses are host addresses, 8-byte aligned.
            let v = unsafe { ((addr + off) as *const u64).read_volatile() };
            if v != tag ^ off {
                self.wrong.fetch_add(1, Ordering::Relaxed);
                let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert_with(|| format!("{at}: block {addr:#x}+{len:#x}, word at {off:#x}: {v:#x}"));
                return;
            }
            off += STRIDE;
        }
    }
}

fn run(seed: u64) -> (u64, Option<String>, vrampool::Stats) {
    let dev = SimDevice::new(64 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let copy = dev.new_stream().unwrap();
    let seen = Arc::new(Seen::default());
    let tags = AtomicU64::new(1);
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let (pool, dev, copy, seen, tags) = (&pool, &dev, &copy, &seen, &tags);
            sc.spawn(move || {
                let s = dev.new_stream().unwrap();
                let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((t + 1) * 7919));
                let mut live: Vec<(Block, u64)> = Vec::new();
                let check_and_free = |b: Block, tag: u64, rng: &mut Rng| {
                    let (addr, len) = (b.device_ptr(), b.len() as u64);
                    let on_own = Arc::clone(seen);
                    dev.enqueue(&s, move || on_own.check(addr, len, tag, "own stream")).unwrap();
                    if rng.next() % 8 == 0 {
                        let ev = dev.create_event().unwrap();
                        dev.record_event(&ev, &s).unwrap();
                        dev.stream_wait_event(copy, &ev).unwrap();
                        let on_copy = Arc::clone(seen);
                        dev.enqueue(copy, move || on_copy.check(addr, len, tag, "copy stream")).unwrap();
                        b.record_stream(copy);
                    }
                    drop(b);
                };
                for _ in 0..3000 {
                    if live.len() > 12 || (!live.is_empty() && rng.next() % 3 == 0) {
                        let i = (rng.next() % live.len() as u64) as usize;
                        let (b, tag) = live.swap_remove(i);
                        check_and_free(b, tag, &mut rng);
                        continue;
                    }
                    let size = (512 << 10) + (rng.next() % (12 << 20)) as usize;
                    let b = pool.alloc(size, &s).unwrap();
                    let tag = tags.fetch_add(1, Ordering::Relaxed) << 32;
                    let (addr, len, busy) = (b.device_ptr(), b.len() as u64, 10 + rng.next() % 20);
                    dev.enqueue(&s, move || {
                        let mut off = 0;
                        while off < len {
                            // SAFETY: as in `Seen::check`; the block was handed to this stream.
                            unsafe { ((addr + off) as *mut u64).write_volatile(tag ^ off) };
                            off += STRIDE;
                        }
                        let t = std::time::Instant::now();
                        while t.elapsed().as_micros() < u128::from(busy) {}
                    })
                    .unwrap();
                    live.push((b, tag));
                }
                for (b, tag) in live.drain(..) {
                    check_and_free(b, tag, &mut rng);
                }
                dev.synchronize(&s).unwrap();
            });
        }
    });
    dev.synchronize(&copy).unwrap();
    let stats = pool.stats();
    pool.trim().unwrap();
    pool.check().unwrap();
    let first = seen.first.lock().unwrap_or_else(|e| e.into_inner()).take();
    (seen.wrong.load(Ordering::Relaxed), first, stats)
}

#[test]
fn no_memory_shows_under_two_blocks_while_pages_are_lent() {
    for seed in 1..=3 {
        let (wrong, first, stats) = run(seed);
        assert!(stats.pages_lent > 0, "seed {seed}: no page was lent, the test tests nothing ({stats:?})");
        assert_eq!(wrong, 0, "seed {seed}: {wrong} blocks saw another block's words; first: {first:?}");
    }
}

/// A 2 MiB page of the simulator.
const PAGE: usize = 2 << 20;

/// A default pool on a 1 GiB simulated device, and one stream.
fn one_stream() -> (SimDevice, Pool, vrampool::Stream) {
    let dev = SimDevice::new(1 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    (dev, pool, s)
}

/// A placement that must map some of its pages never borrows the memory of its own free
/// pages further up the run: the page that lent would be dead under the same block, and
/// unmapped and mapped again a moment later. Here a block whose run starts on two dead lent
/// pages (their memory serves a live block) has free mapped pages above them in its own run
/// and nothing free elsewhere: its two dead pages are unmapped and mapped afresh, and
/// nothing else is.
#[test]
fn a_placement_never_borrows_from_the_pages_it_is_taking() {
    let (dev, pool, s) = one_stream();
    let a = pool.alloc(2 * PAGE, &s).unwrap();
    let base = a.device_ptr();
    let b = pool.alloc(6 * PAGE, &s).unwrap();
    assert_eq!(b.device_ptr(), base + 2 * PAGE as u64, "b right above a");
    drop(a);
    pool.flush_thread_cache();
    // Three pages past the peak: two borrow a's pages' memory, which leaves them lent and
    // dead while c lives; the third is new memory.
    let lent = pool.stats().pages_lent;
    let c = pool.alloc(3 * PAGE, &s).unwrap();
    assert_eq!(pool.stats().pages_lent - lent, 2, "c borrowed a's two pages");
    drop(b);
    pool.flush_thread_cache();
    // The stream's final event covers every free: once it completes, a's pages may be
    // unmapped. The next block is another stream's.
    pool.destroy_stream(&s).unwrap();
    let s2 = dev.new_stream().unwrap();
    // Eight pages: a's two dead pages and b's six free ones cost two remaps, where any run
    // above c costs eight maps.
    let before = pool.stats();
    let d = pool.alloc(8 * PAGE, &s2).unwrap();
    let after = pool.stats();
    assert_eq!(d.device_ptr(), base, "d over a's and b's pages");
    assert_eq!(after.unmapped_bytes - before.unmapped_bytes, 2 * PAGE as u64, "only the two dead pages unmapped");
    assert_eq!(after.pages_lent, before.pages_lent, "nothing was free outside d's run to borrow");
    drop((c, d));
    pool.flush_thread_cache();
    dev.synchronize(&s2).unwrap();
    pool.check().unwrap();
}

/// A placement that may map only up to the pool's peak (the ladder's fourth rung) maps
/// nothing when its pages would pass the peak part of the way through: mapping the first of
/// them and failing on the rest left pages mapped that the next rung's placement, free to
/// go elsewhere, did not use. Here the first fit below the peak (three pages trimmed away)
/// can map only two of its three pages; the block goes to a run that needs one map.
#[test]
fn a_placement_within_the_peak_maps_nothing_it_cannot_finish() {
    let (dev, pool, s) = one_stream();
    let a = pool.alloc(3 * PAGE, &s).unwrap();
    let base = a.device_ptr();
    let b = pool.alloc(PAGE, &s).unwrap();
    let x = pool.alloc(2 * PAGE, &s).unwrap();
    assert_eq!(x.device_ptr(), base + 4 * PAGE as u64, "a, b and x in a row");
    drop(a);
    pool.flush_thread_cache();
    // a's three pages go: the peak stays at six pages, three of them mapped.
    pool.trim().unwrap();
    // A small block's chunk maps one page within the peak: two pages of room are left.
    let small = pool.alloc(1024, &s).unwrap();
    drop(x);
    pool.flush_thread_cache();
    let mapped = dev.mapped_bytes_total();
    let c = pool.alloc(3 * PAGE, &s).unwrap();
    assert_eq!(c.device_ptr(), base + 4 * PAGE as u64, "over x's two free pages and one more");
    assert_eq!(dev.mapped_bytes_total() - mapped, PAGE as u64, "one page mapped, none at a's address");
    drop((b, c, small));
    pool.flush_thread_cache();
    dev.synchronize(&s).unwrap();
    pool.check().unwrap();
}

/// A block that must map past the peak goes to the next cheapest run when the cheapest one
/// holds memory another stream freed and this one may not take yet (that stream is
/// stalled: its event cannot complete): before, it walked first fit, which took the lowest
/// run it could have, however many pages that run needed (resnet50_4streams' 49 MiB blocks
/// mapped about 25 pages each so, about nine times a pass). Here the cheapest run (a's four
/// pages, freed on another stream, and one page to map) is refused; a run of five unmapped
/// pages lies below the next cheapest (c's three free pages and two to map): the block
/// goes to c's run and maps two pages.
#[test]
fn a_placement_past_the_peak_refused_its_cheapest_run_takes_the_next_cheapest() {
    let (dev, pool, s2) = one_stream();
    let s1 = dev.new_stream().unwrap();
    let p = PAGE as u64;
    let sizes = [4, 1, 1, 5, 1, 3, 2, 2]; // a, g, b, n, k, c, e, f in a row
                                          // a is s1's, the rest s2's.
    let on = |i: usize| if i == 0 { &s1 } else { &s2 };
    let mut blocks: Vec<_> = sizes.iter().enumerate().map(|(i, &n)| pool.alloc(n * PAGE, on(i)).unwrap()).collect();
    let base = blocks[0].device_ptr();
    let at: Vec<u64> = blocks.iter().map(|b| (b.device_ptr() - base) / p).collect();
    assert_eq!(at, [0, 4, 5, 6, 11, 12, 15, 17], "the blocks in a row");
    let [a, g, b, n, k, c, e, f] = std::array::from_fn(|_| blocks.remove(0));
    // g's, n's and e's pages go; h maps as many above f, so that the pool is at its peak.
    drop((g, n, e));
    pool.flush_thread_cache();
    dev.synchronize(&s2).unwrap();
    pool.trim().unwrap();
    let h = pool.alloc(8 * PAGE, &s2).unwrap();
    assert_eq!(h.device_ptr(), base + 19 * p, "h above f");
    assert_eq!(pool.stats().reserved_bytes, pool.stats().peak_reserved_bytes, "at the peak");
    // a goes back on s1, which is stalled (s2 may not take a's memory without a wait), c on
    // s2.
    let tx = stalled(&dev, &s1);
    drop((a, c));
    pool.flush_thread_cache();
    let mapped = dev.mapped_bytes_total();
    let d = pool.alloc(5 * PAGE, &s2).unwrap();
    assert_eq!(d.device_ptr(), base + 12 * p, "d over c's pages, not over n's unmapped ones");
    assert_eq!(dev.mapped_bytes_total() - mapped, 2 * p, "two pages mapped");
    drop(tx);
    drop((b, k, f, h, d));
    pool.flush_thread_cache();
    dev.synchronize(&s1).unwrap();
    dev.synchronize(&s2).unwrap();
    pool.check().unwrap();
}

/// A large block that may only take mapped memory (the ladder's first rungs) keeps its
/// first-fit run when one page of it is dead (lent, its memory serving a live block
/// elsewhere): that page is unmapped and mapped afresh, rather than the block going to the
/// next run of mapped free pages, far above. Moved up, it would take the pages the blocks
/// after it had, which then need loans (train_gpt2's second pass moved a fifth of its peak
/// so). Here x's page lends its memory to w and stays dead under the run x and y leave;
/// the next run on mapped pages is z's, above a guard block.
#[test]
fn a_large_block_keeps_its_first_fit_run_over_a_few_dead_pages() {
    let dev = SimDevice::new(2 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    let p = PAGE as u64;
    let x = pool.alloc(PAGE, &s).unwrap();
    let base = x.device_ptr();
    let y = pool.alloc(129 * PAGE, &s).unwrap();
    let guard = pool.alloc(PAGE, &s).unwrap();
    let z = pool.alloc(130 * PAGE, &s).unwrap();
    assert_eq!(z.device_ptr(), base + 131 * p, "x, y, the guard and z in a row");
    drop(x);
    pool.flush_thread_cache();
    // Two pages past the peak, with x's free page the only one to lend: w borrows it.
    let lent = pool.stats().pages_lent;
    let w = pool.alloc(2 * PAGE, &s).unwrap();
    assert_eq!(pool.stats().pages_lent - lent, 1, "w borrowed x's page");
    drop((y, z));
    pool.flush_thread_cache();
    // The stream's final event covers every free: x's dead page may be unmapped once it
    // completes. The block is another stream's.
    pool.destroy_stream(&s).unwrap();
    let s2 = dev.new_stream().unwrap();
    let (before, mapped, unmapped) = (pool.stats(), dev.mapped_bytes_total(), dev.unmapped_bytes_total());
    let q = pool.alloc(130 * PAGE, &s2).unwrap();
    let after = pool.stats();
    assert_eq!(q.device_ptr(), base, "q over x's dead page and y's free ones, not z's pages");
    assert_eq!(dev.unmapped_bytes_total() - unmapped, p, "x's dead page unmapped");
    assert_eq!(dev.mapped_bytes_total() - mapped, p, "and mapped again, by a loan at the peak");
    assert_eq!(after.reserved_bytes, before.reserved_bytes, "the pool held no more memory");
    let unmapping_rungs = |s: &vrampool::Stats| s.ladder_rungs[0] + s.ladder_rungs[1];
    assert_eq!(unmapping_rungs(&after) - unmapping_rungs(&before), 1, "placed by a rung that may not map");
    drop((guard, w, q));
    pool.flush_thread_cache();
    dev.synchronize(&s2).unwrap();
    pool.check().unwrap();
}
