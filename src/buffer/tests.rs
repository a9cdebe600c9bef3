//! Typed buffers on the simulated device.

use std::ops::Bound;

use super::*;
use crate::{PoolConfig, SimDevice};

fn setup() -> (SimDevice, Pool, Stream) {
    let dev = SimDevice::new(1 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    (dev, pool, s)
}

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.5 - 7.0).collect()
}

/// Nothing is left anywhere once every buffer is dropped and the pool trimmed.
fn assert_empty(pool: &Pool) {
    pool.trim().unwrap();
    pool.check().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocated_bytes, st.reserved_bytes, st.live_blocks), (0, 0, 0), "{st:?}");
}

#[test]
fn a_buffer_moves_as_a_block_does() {
    use std::mem::size_of;
    assert_eq!(size_of::<Buffer<f32>>(), size_of::<Block>());
    assert_eq!(size_of::<Result<Buffer<[u8; 3]>>>(), size_of::<Result<Block>>());
    assert_eq!(size_of::<Result<Buffer<f64>>>(), size_of::<Block>());
}

#[test]
fn a_buffer_is_its_elements_bytes_and_round_trips_through_the_host() {
    let (_dev, pool, s) = setup();
    let src = ramp(1000);
    let mut b = pool.alloc_buffer::<f32>(src.len(), &s).unwrap();
    assert_eq!((b.len(), b.num_bytes(), b.is_empty()), (1000, 4000, false));
    assert_eq!(b.device_ptr() % crate::ALIGN, 0);
    assert_eq!(b.stream_id(), s.id());
    assert_eq!(pool.stats().allocated_bytes, b.as_block().capacity() as u64);
    b.copy_from_host(&pool, &src, &s).unwrap();
    assert_eq!(b.to_vec(&pool, &s).unwrap(), src);
    let block = b.into_block();
    assert_eq!(block.len(), 4000, "the block keeps the bytes asked for");
    drop(block);
    assert_empty(&pool);
}

#[test]
fn elements_of_a_size_that_is_not_a_power_of_two_count_right() {
    let (_dev, pool, s) = setup();
    let src: Vec<[f32; 3]> = (0..77).map(|i| [i as f32, -(i as f32), 0.25]).collect();
    let b = pool.alloc_from_host(&src, &s).unwrap();
    assert_eq!((b.len(), b.num_bytes()), (77, 77 * 12));
    assert_eq!(b.slice(70..).unwrap().to_vec(&pool, &s).unwrap(), src[70..]);
}

#[test]
fn a_zeroed_buffer_is_zero_even_in_memory_that_held_data() {
    let (_dev, pool, s) = setup();
    let dirty = pool.alloc_from_host(&vec![u32::MAX; 4096], &s).unwrap();
    let addr = dirty.device_ptr();
    drop(dirty);
    let z = pool.alloc_zeroed::<u32>(4096, &s).unwrap();
    assert_eq!(z.device_ptr(), addr, "the same memory came back (same stream, same class)");
    assert!(z.to_vec(&pool, &s).unwrap().iter().all(|&w| w == 0));
}

#[test]
fn an_overflowing_length_is_an_error_and_allocates_nothing() {
    let (_dev, pool, s) = setup();
    let cache = pool.stream_cache(&s).unwrap();
    let before = pool.stats();
    for r in [
        pool.alloc_buffer::<u64>(usize::MAX / 4, &s).map(Buffer::into_block),
        pool.alloc_zeroed::<u64>(usize::MAX / 8 + 1, &s).map(Buffer::into_block),
        cache.alloc_buffer::<[u8; 3]>(usize::MAX / 2).map(Buffer::into_block),
    ] {
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }
    let r = pool.alloc_buffer::<u8>(usize::MAX, &s);
    assert!(matches!(r, Err(Error::TooLarge { .. })), "fits usize but no pool: the pool's own error, {r:?}");
    let after = pool.stats();
    assert_eq!((after.allocs, after.live_blocks, after.allocated_bytes), (before.allocs, 0, 0));
    pool.check().unwrap();
}

#[test]
fn a_stream_cache_makes_buffers_on_its_hit_path() {
    let (_dev, pool, s) = setup();
    let cache = pool.stream_cache(&s).unwrap();
    let a = cache.alloc_buffer::<f32>(256).unwrap();
    let addr = a.device_ptr();
    drop(a);
    let hits = pool.stats().t0_hits;
    let b = cache.alloc_buffer::<u16>(512).unwrap();
    assert_eq!(b.device_ptr(), addr, "1 KiB either way: the same block");
    assert_eq!(pool.stats().t0_hits, hits + 1);
    assert_eq!(b.len(), 512);
}

#[test]
fn views_read_and_write_their_own_elements_only() {
    let (_dev, pool, s) = setup();
    let src = ramp(64);
    let mut b = pool.alloc_from_host(&src, &s).unwrap();
    let v = b.slice(3..7).unwrap();
    assert_eq!((v.len(), v.device_ptr()), (4, b.device_ptr() + 12));
    assert_eq!(v.to_vec(&pool, &s).unwrap(), src[3..7]);
    assert_eq!(v.slice(1..=2).unwrap().to_vec(&pool, &s).unwrap(), src[4..6], "a view of a view");
    let (l, r) = b.view().split_at(10).unwrap();
    assert_eq!((l.len(), r.len(), r.device_ptr()), (10, 54, b.device_ptr() + 40));

    let mut expect = src.clone();
    b.slice_mut(60..).unwrap().copy_from_host(&pool, &[1.0; 4], &s).unwrap();
    expect[60..].fill(1.0);
    let (mut left, mut right) = b.view_mut().split_at_mut(32).unwrap();
    left.slice_mut(..2).unwrap().fill_zeros(&pool, &s).unwrap();
    right.slice_mut(0..1).unwrap().copy_from_host(&pool, &[9.0], &s).unwrap();
    expect[..2].fill(0.0);
    expect[32] = 9.0;
    assert_eq!(b.to_vec(&pool, &s).unwrap(), expect);
}

#[test]
fn ranges_out_of_bounds_are_errors_never_panics() {
    let (_dev, pool, s) = setup();
    let mut b = pool.alloc_buffer::<u32>(10, &s).unwrap();
    let bad: [(Bound<usize>, Bound<usize>); 5] = [
        (Bound::Included(4), Bound::Excluded(3)),
        (Bound::Included(0), Bound::Excluded(11)),
        (Bound::Included(0), Bound::Included(usize::MAX)),
        (Bound::Excluded(usize::MAX), Bound::Unbounded),
        (Bound::Included(11), Bound::Unbounded),
    ];
    for r in bad {
        assert!(matches!(b.slice(r), Err(Error::InvalidArgument(_))), "{r:?}");
        assert!(matches!(b.slice_mut(r), Err(Error::InvalidArgument(_))), "{r:?}");
    }
    assert!(b.view().split_at(11).is_err() && b.view_mut().split_at_mut(11).is_err());
    assert!(b.slice(10..).unwrap().is_empty() && b.slice(..=9).unwrap().len() == 10);
}

#[test]
fn copies_refuse_the_wrong_length_and_the_wrong_pool() {
    let (dev, pool, s) = setup();
    let other = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let mut b = pool.alloc_buffer::<u32>(8, &s).unwrap();
    assert!(matches!(b.copy_from_host(&pool, &[0; 7], &s), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.copy_to_host(&pool, &mut [0; 9], &s), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.copy_from_host(&other, &[0; 8], &s), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.to_vec(&other, &s), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.fill_zeros(&other, &s), Err(Error::InvalidArgument(_))));
    b.copy_from_host(&pool, &[5; 8], &s).unwrap();
    assert_eq!(b.to_vec(&pool, &s).unwrap(), [5; 8]);
}

#[test]
fn an_empty_buffer_copies_nothing_and_holds_nothing() {
    let (_dev, pool, s) = setup();
    let mut b = pool.alloc_buffer::<f64>(0, &s).unwrap();
    assert!(b.is_empty() && b.device_ptr() == 0);
    b.copy_from_host(&pool, &[], &s).unwrap();
    b.fill_zeros(&pool, &s).unwrap();
    assert!(b.to_vec(&pool, &s).unwrap().is_empty());
    assert_eq!(pool.stats().allocated_bytes, 0);
}

/// `fill_zeros` on a stream other than the buffer's is asynchronous: the buffer's memory must
/// not go to anyone before that stream has run the memset, however soon the buffer is dropped.
#[test]
fn a_buffer_zeroed_on_another_stream_is_not_reused_before_that_stream_gets_there() {
    let (dev, pool, s) = setup();
    let other = dev.new_stream().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    dev.enqueue(&other, move || {
        let _ = rx.recv();
    })
    .unwrap();
    let mut b = pool.alloc_buffer::<u8>(1 << 20, &s).unwrap();
    let addr = b.device_ptr();
    b.fill_zeros(&pool, &other).unwrap();
    drop(b);
    let again = pool.alloc_buffer::<u8>(1 << 20, &s).unwrap();
    assert_ne!(again.device_ptr(), addr, "reused while the stream that zeroes it is blocked");
    drop(tx);
    dev.synchronize(&other).unwrap();
    drop(again);
    assert_empty(&pool);
}
