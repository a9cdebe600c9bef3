//! What a program says about running out of memory, on the simulated device: its
//! out-of-memory handler (`Pool::set_out_of_memory_handler`), its word before an allocation
//! fails, and the pool's limit changed at run time (`Pool::set_max_reserved`).
//!
//! Every pool here has a limit of 32 MiB on a 64 MiB device; the handlers' tests keep
//! "spare" blocks, memory the program holds only while memory lasts, which the handlers give
//! up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vrampool::{Block, Error, Pool, PoolConfig, SimDevice, Stream, OOM_HANDLER_ROUNDS};

const MIB: usize = 1 << 20;

fn pool() -> (SimDevice, Pool, Stream) {
    let dev = SimDevice::new(64 << 20);
    let pool = Pool::new(dev.clone(), PoolConfig { max_reserved: Some(32 << 20), ..PoolConfig::default() }).unwrap();
    let s = dev.new_stream().unwrap();
    (dev, pool, s)
}

/// Blocks of `bytes` each, `n` of them, held where a handler can take them.
fn spares(pool: &Pool, s: &Stream, n: usize, bytes: usize) -> Arc<Mutex<Vec<Block>>> {
    Arc::new(Mutex::new((0..n).map(|_| pool.alloc(bytes, s).unwrap()).collect()))
}

fn out_of_memory(r: Result<Block, Error>) -> bool {
    matches!(r, Err(Error::OutOfMemory(_)))
}

#[test]
fn a_handler_that_frees_a_spare_block_saves_the_allocation() {
    let (_dev, pool, s) = pool();
    let spare = spares(&pool, &s, 1, 24 * MIB);
    let asked = Arc::new(AtomicU64::new(0));
    let (evict, seen) = (Arc::clone(&spare), Arc::clone(&asked));
    pool.set_out_of_memory_handler(move |oom| {
        seen.store(oom.requested, Ordering::Relaxed);
        evict.lock().unwrap().pop().is_some()
    });
    let b = pool.alloc(24 * MIB, &s).expect("the handler made room");
    assert_eq!(asked.load(Ordering::Relaxed), 24 * MIB as u64, "the handler saw the request's figures");
    assert!(spare.lock().unwrap().is_empty());
    let st = pool.stats();
    assert_eq!((st.oom_handler_calls, st.oom_rescues, st.ooms), (1, 1, 0));
    drop(b);
    pool.check().unwrap();
}

#[test]
fn a_handler_that_declines_and_no_handler_fail_as_before() {
    let (_dev, pool, s) = pool();
    let spare = spares(&pool, &s, 1, 24 * MIB);
    pool.set_out_of_memory_handler(|_| false);
    assert!(out_of_memory(pool.alloc(24 * MIB, &s)));
    assert_eq!((pool.stats().oom_handler_calls, pool.stats().ooms), (1, 1));
    pool.clear_out_of_memory_handler();
    assert!(out_of_memory(pool.alloc(24 * MIB, &s)));
    let st = pool.stats();
    assert_eq!((st.oom_handler_calls, st.oom_rescues, st.ooms), (1, 0, 2), "a removed handler is not asked");
    assert_eq!(spare.lock().unwrap().len(), 1, "nothing the program held was touched");
    pool.check().unwrap();
}

#[test]
fn a_handler_that_frees_nothing_is_asked_a_bounded_number_of_times() {
    let (_dev, pool, s) = pool();
    let _spare = spares(&pool, &s, 1, 24 * MIB);
    pool.set_out_of_memory_handler(|_| true);
    assert!(out_of_memory(pool.alloc(24 * MIB, &s)));
    let st = pool.stats();
    assert_eq!((st.oom_handler_calls, st.oom_rescues, st.ooms), (OOM_HANDLER_ROUNDS, 0, 1));
}

#[test]
fn a_handler_is_never_called_from_inside_itself() {
    let (_dev, pool, s) = pool();
    let _spare = spares(&pool, &s, 1, 24 * MIB);
    let pool = Arc::new(pool);
    let inner = Arc::new(Mutex::new(None));
    let (p, s2, got) = (Arc::downgrade(&pool), s.clone(), Arc::clone(&inner));
    pool.set_out_of_memory_handler(move |_| {
        // An allocation of the handler's own that cannot fit either: it fails at once.
        if let Some(p) = p.upgrade() {
            *got.lock().unwrap() = Some(out_of_memory(p.alloc(24 * MIB, &s2)));
        }
        false
    });
    assert!(out_of_memory(pool.alloc(24 * MIB, &s)));
    assert_eq!(*inner.lock().unwrap(), Some(true), "the handler's own allocation failed with out-of-memory");
    let st = pool.stats();
    assert_eq!((st.oom_handler_calls, st.ooms), (1, 2), "asked once; both allocations failed");
    pool.clear_out_of_memory_handler();
    pool.check().unwrap();
}

#[test]
fn a_handler_that_panics_fails_the_allocation_and_leaves_the_pool_whole() {
    let (_dev, pool, s) = pool();
    let spare = spares(&pool, &s, 1, 24 * MIB);
    pool.set_out_of_memory_handler(|_| panic!("a handler's bug"));
    assert!(out_of_memory(pool.alloc(24 * MIB, &s)), "the panic does not reach the caller");
    pool.check().unwrap();
    spare.lock().unwrap().clear();
    let b = pool.alloc(24 * MIB, &s).expect("the pool still serves");
    assert_eq!(pool.stats().oom_handler_calls, 1);
    drop(b);
    pool.check().unwrap();
}

#[test]
fn threads_that_run_out_at_once_are_each_served_by_the_spares_the_handler_frees() {
    let (dev, pool, s) = pool();
    // Four spares of 7 MiB fill 28 of the 32 MiB: no thread's 7 MiB fits beside them.
    let spare = spares(&pool, &s, 4, 7 * MIB);
    let evict = Arc::clone(&spare);
    pool.set_out_of_memory_handler(move |_| evict.lock().unwrap().pop().is_some());
    let got: Vec<bool> = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let (pool, own) = (&pool, dev.new_stream().unwrap());
                sc.spawn(move || {
                    let b = pool.alloc(7 * MIB, &own);
                    let ok = b.is_ok();
                    // Held until every thread has its block: the spares are what serve them.
                    (ok, b)
                })
            })
            .collect();
        let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        results.into_iter().map(|(ok, _b)| ok).collect()
    });
    assert_eq!(got, vec![true; 4], "every thread was served");
    let st = pool.stats();
    assert_eq!(st.ooms, 0);
    assert!(st.oom_rescues >= 1 && st.oom_rescues <= st.oom_handler_calls);
    pool.clear_out_of_memory_handler();
    pool.check().unwrap();
}

#[test]
fn a_lowered_limit_refuses_what_it_no_longer_fits_and_a_raised_one_serves_it_again() {
    let (_dev, pool, s) = pool();
    assert_eq!(pool.max_reserved(), 32 << 20);
    pool.set_max_reserved(16 << 20).unwrap();
    assert_eq!(pool.max_reserved(), 16 << 20);
    match pool.alloc(24 * MIB, &s) {
        Err(Error::OutOfMemory(oom)) => assert_eq!(oom.max_reserved, 16 << 20, "the error names the limit now"),
        other => panic!("24 MiB under a 16 MiB limit: {other:?}"),
    }
    let small = pool.alloc(8 * MIB, &s).expect("what fits under the limit is served");
    pool.set_max_reserved(32 << 20).unwrap();
    let b = pool.alloc(24 * MIB, &s).expect("the limit raised again serves it");
    assert!(pool.stats().peak_reserved_bytes <= 32 << 20);
    drop((small, b));
    pool.check().unwrap();
}

#[test]
fn memory_mapped_above_a_lowered_limit_serves_until_it_is_unmapped() {
    let (_dev, pool, s) = pool();
    let b = pool.alloc(24 * MIB, &s).unwrap();
    pool.set_max_reserved(8 << 20).unwrap();
    assert!(pool.stats().reserved_bytes >= 24 << 20, "nothing live is taken away");
    drop(b);
    // Mapped already: reused without mapping, as PyTorch reuses cached blocks above its
    // memory fraction.
    drop(pool.alloc(16 * MIB, &s).expect("free memory mapped before the change serves"));
    pool.trim().unwrap();
    assert!(pool.stats().reserved_bytes <= 8 << 20, "{:?}", pool.stats());
    assert!(out_of_memory(pool.alloc(16 * MIB, &s)), "once unmapped, 16 MiB needs more than the limit");
    let c = pool.alloc(6 * MIB, &s).expect("what fits under the limit is served");
    assert!(pool.stats().reserved_bytes <= 8 << 20, "{:?}", pool.stats());
    drop(c);
    pool.check().unwrap();
}

#[test]
fn a_limit_above_the_one_the_pool_was_made_with_is_refused() {
    let (_dev, pool, _s) = pool();
    assert!(matches!(pool.set_max_reserved(33 << 20), Err(Error::InvalidArgument(_))));
    assert_eq!(pool.max_reserved(), 32 << 20, "a refused change changes nothing");
    assert!(
        matches!(pool.alloc(40 * MIB, &_s), Err(Error::TooLarge { limit, .. }) if limit == 32 << 20),
        "above the ceiling a request can never be served"
    );
}

#[test]
fn a_handler_may_flush_and_trim_the_pool_whose_allocation_it_serves() {
    let (dev, pool, s) = pool();
    let other = dev.new_stream().unwrap();
    // This thread's caches hold blocks of two streams; the handler drops them all.
    drop((0..16).map(|_| pool.alloc(64 << 10, &s).unwrap()).collect::<Vec<_>>());
    drop((0..16).map(|_| pool.alloc(64 << 10, &other).unwrap()).collect::<Vec<_>>());
    let spare = spares(&pool, &s, 1, 24 * MIB);
    let pool = Arc::new(pool);
    let (p, evict) = (Arc::downgrade(&pool), Arc::clone(&spare));
    pool.set_out_of_memory_handler(move |_| {
        let Some(p) = p.upgrade() else { return false };
        let freed = evict.lock().unwrap().pop().is_some();
        p.flush_thread_cache();
        p.trim().is_ok() && freed
    });
    let b = pool.alloc(24 * MIB, &s).expect("served after the handler emptied and trimmed the pool");
    let small = pool.alloc(64 << 10, &s).expect("the thread's cache is made again");
    assert_eq!(pool.stats().oom_rescues, 1);
    pool.clear_out_of_memory_handler();
    drop((b, small));
    pool.check().unwrap();
}
