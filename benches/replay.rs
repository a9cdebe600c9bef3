//! Criterion bench: replaying the shared traces (`benches/traces/`) through a pool on the
//! simulated device, time per trace (divide by the event count for time per operation; the
//! `replay` example prints it, with the memory figure).

use std::io::BufReader;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use vrampool::replay::{replay, Trace};
use vrampool::{Device, PoolConfig, SimDevice};

fn load(name: &str) -> Trace {
    let path = format!("{}/benches/traces/{name}.csv.gz", env!("CARGO_MANIFEST_DIR"));
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Trace::parse(BufReader::new(flate2::read::GzDecoder::new(file))).unwrap()
}

fn traces(c: &mut Criterion) {
    let dev: Arc<dyn Device> = Arc::new(SimDevice::new(16 << 30));
    let mut g = c.benchmark_group("replay");
    g.sample_size(10);
    for name in ["gpt2_decode", "resnet_varbatch", "train_gpt2"] {
        let t = load(name);
        g.bench_function(name, |b| b.iter(|| replay(&t, &dev, PoolConfig::default()).unwrap()));
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_secs(1));
    targets = traces
}
criterion_main!(benches);
