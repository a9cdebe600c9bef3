use std::time::Instant;
use vrampool::{Pool, PoolConfig, SimDevice};
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn size(&mut self) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (256.0 * (16384.0f64).powf(u)) as usize
    }
}
fn main() {
    let dev = SimDevice::new(64 << 30);
    let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
    let s = dev.new_stream().unwrap();
    let cache = pool.stream_cache(&s).unwrap();
    let mut rng = Rng(7);
    let mut w: Vec<_> = (0..64).map(|_| cache.alloc(rng.size()).unwrap()).collect();
    for round in 0..6 {
        let t = Instant::now();
        let n = 1_000_000;
        for _ in 0..n {
            let i = (rng.next() % 64) as usize;
            w[i] = cache.alloc(rng.size()).unwrap();
        }
        let st = pool.stats();
        println!("round {round}: {:.1} ns/pair; t0 {:.3} t1 {:.3}; events {} batches {} flushes {} maps {} reserved {} MiB cached {} MiB thread {} depot {} open {} retiring {}",
            t.elapsed().as_nanos() as f64 / n as f64, st.t0_hit_rate(), st.t1_hit_rate(), st.events_recorded, st.batches_retired, st.ladder_flushes, st.ladder_maps,
            st.reserved_bytes >> 20, st.cached_bytes >> 20, st.thread_cached_bytes >> 20, st.depot_bytes >> 20, st.open_batch_bytes >> 20, st.retiring_bytes >> 20);
    }
}
