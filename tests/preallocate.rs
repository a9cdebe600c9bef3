//! Pre-allocation: after `Pool::reserve(N)`, requests whose live bytes stay well under N
//! make no device map call. The bound the docs state (`Pool::reserve`, measured, not
//! promised for every sequence): live bytes (as asked) at most half the reserve, which
//! leaves room for the rounding to size classes (at
//! most an eighth), the stream's 2 MiB chunks for small blocks, and first-fit placement's
//! fragmentation. The device's own count of mapped bytes (`SimDevice::mapped_bytes_total`,
//! which counts page loans too) must not move after the reserve.

use vrampool::{Pool, PoolConfig, SimDevice};

#[path = "support/xorshift.rs"]
mod xorshift;
use xorshift::Rng;

impl Rng {
    /// Log-uniform 256 B – 8 MiB.
    fn size(&mut self) -> usize {
        let bits = 8 + self.next() % 16;
        (256 + self.next() % (1 << bits)) as usize
    }
}

#[test]
fn requests_under_half_the_reserve_never_map() {
    const RESERVE: u64 = 256 << 20;
    for seed in 1..=4u64 {
        let dev = SimDevice::new(4 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        pool.reserve(RESERVE).unwrap();
        let mapped = dev.mapped_bytes_total();
        assert!(mapped >= RESERVE, "the reserve mapped {mapped} bytes");
        let streams: Vec<_> = (0..2).map(|_| dev.new_stream().unwrap()).collect();
        let cache = pool.stream_cache(&streams[0]).unwrap();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
        let mut live: Vec<vrampool::Block> = Vec::new();
        let mut live_bytes = 0usize;
        for _ in 0..20_000 {
            if !live.is_empty() && rng.next() % 2 == 0 {
                let b = live.swap_remove((rng.next() % live.len() as u64) as usize);
                live_bytes -= b.len();
                drop(b);
                continue;
            }
            let size = rng.size();
            if live_bytes + size > (RESERVE / 2) as usize {
                continue;
            }
            // Both paths: a worker's cache, and the pool on a second stream.
            let b = if rng.next() % 2 == 0 { cache.alloc(size) } else { pool.alloc(size, &streams[1]) };
            live.push(b.unwrap());
            live_bytes += size;
        }
        drop(live);
        assert_eq!(
            dev.mapped_bytes_total(),
            mapped,
            "seed {seed}: requests under half the reserve mapped more ({:?})",
            pool.stats()
        );
        pool.check().unwrap();
    }
}
