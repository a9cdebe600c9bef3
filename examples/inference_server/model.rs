//! What the workers ask for: LLM-serving requests whose sizes come from a real trace, or a
//! trace replayed as it was recorded.
//!
//! **The size model.** `benches/traces/gpt2_decode.csv.gz` (built into the binary) is
//! PyTorch serving GPT-2 on an H200: its short-lived allocations (freed within
//! [`TRANSIENT_EVENTS`] events: activations, logits, attention scratch; not weights, not the
//! KV cache) are the sizes a decode step asks for. The model keeps them sorted and draws one
//! uniformly, so the demo's activations follow the trace's size distribution exactly. A
//! prefill step works on the whole prompt at once: its activations are those sizes times the
//! prompt's length in 16-token units (at most 16 times, at most 64 MiB).
//!
//! **A request**: a batch of 1–8 sequences, a prompt of 16–512 tokens (log-uniform), then
//! 8–128 decode steps. Each of the 12 layers keeps a KV block of `batch × tokens × 3 KiB`
//! (GPT-2's 768-wide K and V in fp16: the trace's 3,072-byte rows), regrown 64 tokens at a
//! time: the new block is allocated before the old one is freed, as a server copying its
//! cache does. Each layer of each step allocates two to four activations, uses them, and
//! frees them.

use std::io::Read;

/// An allocation freed within this many events of the trace is an activation.
pub const TRANSIENT_EVENTS: usize = 16;
/// Layers of the model (GPT-2 small).
pub const LAYERS: usize = 12;
/// Bytes of K and V per token per layer per sequence (768 × 2 × fp16).
pub const KV_BYTES_PER_TOKEN: u64 = 3072;
/// KV blocks grow by this many tokens.
pub const KV_GROWTH: u64 = 64;
/// The largest activation a prefill asks for.
const MAX_ACTIVATION: u64 = 64 << 20;

/// The trace the size model comes from.
pub const MODEL_TRACE: &[u8] = include_bytes!("../../benches/traces/gpt2_decode.csv.gz");

/// One event of a trace.
#[derive(Debug, Clone, Copy)]
pub enum Event {
    Alloc { id: usize, size: u64, stream: usize },
    Free { id: usize },
}

/// A trace: its events, with ids renumbered densely from 0, and how many streams it uses.
pub struct Trace {
    pub events: Vec<Event>,
    pub ids: usize,
    pub streams: usize,
}

/// Parse a trace (`op,id,size,stream`, optionally gzip'd).
pub fn parse_trace(bytes: &[u8]) -> Result<Trace, String> {
    let text = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        flate2::read::GzDecoder::new(bytes).read_to_string(&mut s).map_err(|e| format!("not a gzip'd trace: {e}"))?;
        s
    } else {
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("not a text trace: {e}"))?
    };
    let mut ids = std::collections::HashMap::new();
    let mut streams = std::collections::HashMap::new();
    let mut events = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.trim().split(',').collect();
        if n == 0 && f.first() == Some(&"op") || line.trim().is_empty() {
            continue;
        }
        let bad = || format!("line {}: {line:?} is not op,id,size,stream", n + 1);
        let [op, id, size, stream] = f[..] else { return Err(bad()) };
        match op {
            "a" => {
                let next = ids.len();
                let dense = *ids.entry(id.to_string()).or_insert(next);
                let next = streams.len();
                let s = *streams.entry(stream.to_string()).or_insert(next);
                events.push(Event::Alloc { id: dense, size: size.parse().map_err(|_| bad())?, stream: s });
            }
            "f" => {
                let id = *ids.get(id).ok_or_else(|| format!("line {}: frees id {id}, never allocated", n + 1))?;
                events.push(Event::Free { id });
            }
            _ => return Err(bad()),
        }
    }
    if events.is_empty() {
        return Err("the trace has no events".into());
    }
    Ok(Trace { events, ids: ids.len(), streams: streams.len().max(1) })
}

/// The sizes of a decode step, drawn from a trace.
pub struct SizeModel {
    sorted: Vec<u64>,
}

impl SizeModel {
    /// The model of `trace`'s short-lived allocations.
    pub fn from_trace(trace: &Trace) -> Result<SizeModel, String> {
        let mut born = vec![usize::MAX; trace.ids];
        let mut size = vec![0u64; trace.ids];
        let mut sorted = Vec::new();
        for (i, e) in trace.events.iter().enumerate() {
            match *e {
                Event::Alloc { id, size: s, .. } => {
                    born[id] = i;
                    size[id] = s;
                }
                Event::Free { id } => {
                    if born[id] != usize::MAX && i - born[id] <= TRANSIENT_EVENTS && size[id] > 0 {
                        sorted.push(size[id]);
                    }
                }
            }
        }
        if sorted.is_empty() {
            return Err("the trace has no short-lived allocations to model".into());
        }
        sorted.sort_unstable();
        Ok(SizeModel { sorted })
    }

    /// One activation of a decode step.
    pub fn decode(&self, rng: &mut Rng) -> u64 {
        self.sorted[rng.below(self.sorted.len() as u64) as usize]
    }

    /// One activation of a prefill of `prompt` tokens.
    pub fn prefill(&self, rng: &mut Rng, prompt: u64) -> u64 {
        (self.decode(rng) * (prompt / 16).clamp(1, 16)).min(MAX_ACTIVATION)
    }

    /// (median, 99th percentile) of the decode sizes, for the log.
    pub fn quantiles(&self) -> (u64, u64) {
        let at = |q: f64| self.sorted[((self.sorted.len() - 1) as f64 * q) as usize];
        (at(0.5), at(0.99))
    }

    /// Short-lived allocations the model was built from.
    pub fn samples(&self) -> usize {
        self.sorted.len()
    }
}

/// One request's shape.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub batch: u64,
    pub prompt: u64,
    pub decode_steps: u64,
}

impl Request {
    pub fn draw(rng: &mut Rng) -> Request {
        Request { batch: rng.range(1, 8), prompt: rng.log_uniform(16, 512), decode_steps: rng.range(8, 128) }
    }

    /// Bytes of one layer's KV block holding `tokens` tokens (rounded up to the growth step).
    pub fn kv_bytes(&self, tokens: u64) -> u64 {
        self.batch * tokens.div_ceil(KV_GROWTH) * KV_GROWTH * KV_BYTES_PER_TOKEN
    }
}

/// xorshift64*: deterministic per worker.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Log-uniform in `[lo, hi]`.
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((lo as f64) * (hi as f64 / lo as f64).powf(u)).round().clamp(lo as f64, hi as f64) as u64
    }
}
