//! Several traces played at once: one trace whose events are the inputs' merged round robin
//! in proportion to their lengths, each input on streams of its own.
//!
//! Without a GPU there are no recorded multi-stream traces of concurrent models; merging
//! single-program traces makes one: each input keeps its own order, its streams are numbered
//! after the previous inputs' (input `k`'s stream `s` becomes `s + ` the stream count of
//! inputs `0..k`), and its ids become `id × n + k` for `n` inputs, so no two inputs share an
//! id and an id allocated twice in one input (a lost free) stays so. The merge is
//! deterministic: the next event is the one whose position within its input, as a fraction
//! of that input's length, is smallest (ties go to the earlier input), so every input is
//! spread over the whole merged trace and all end together.

use super::{Op, Trace};
use crate::error::{Error, Result};

/// The merge of `traces` described in the module docs.
pub fn interleave(traces: &[Trace]) -> Result<Trace> {
    let n = traces.len() as u64;
    let mut stream_base = Vec::with_capacity(traces.len());
    let mut next_base = 0u32;
    for t in traces {
        stream_base.push(next_base);
        let streams = t.ops.iter().map(|op| op.stream).max().map_or(Some(0), |m| m.checked_add(1));
        next_base = streams
            .and_then(|s| next_base.checked_add(s))
            .ok_or_else(|| Error::InvalidArgument("interleave: too many streams".into()))?;
    }
    let total: usize = traces.iter().map(|t| t.ops.len()).sum();
    let mut ops = Vec::with_capacity(total);
    let mut pos = vec![0usize; traces.len()];
    for _ in 0..total {
        // The input whose next event sits earliest in its own trace: (2p + 1) / 2len, the
        // middle of its slot, compared by cross-multiplying (exact, no floating point).
        let mut best: Option<usize> = None;
        for (k, t) in traces.iter().enumerate() {
            if pos[k] == t.ops.len() {
                continue;
            }
            let key = |k: usize| (2 * pos[k] as u128 + 1, traces[k].ops.len() as u128);
            best = match best {
                Some(b) => {
                    let ((pk, lk), (pb, lb)) = (key(k), key(b));
                    Some(if pk * lb < pb * lk { k } else { b })
                }
                None => Some(k),
            };
        }
        let Some(k) = best else { break };
        let op = traces[k].ops[pos[k]];
        pos[k] += 1;
        let id = op.id.checked_mul(n).and_then(|i| i.checked_add(k as u64));
        let id = id.ok_or_else(|| Error::InvalidArgument(format!("interleave: id {} is too large", op.id)))?;
        ops.push(Op { id, stream: op.stream + stream_base[k], ..op });
    }
    Ok(Trace { ops })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn trace(text: &str) -> Trace {
        Trace::parse(text.as_bytes()).unwrap()
    }

    #[test]
    fn each_input_keeps_its_order_on_its_own_streams_with_its_own_ids() {
        let a = trace("a,1,100,0\na,2,200,1\nf,1,0,0\nf,2,0,1\n");
        let b = trace("a,1,7,0\nf,1,0,0\n");
        let m = interleave(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(m.ops.len(), 6);
        let from = |k: u64| m.ops.iter().filter(move |op| op.id % 2 == k).copied().collect::<Vec<_>>();
        let back = |ops: Vec<Op>, base: u32| {
            ops.into_iter().map(move |op| Op { id: op.id / 2, stream: op.stream - base, ..op })
        };
        assert_eq!(back(from(0), 0).collect::<Vec<_>>(), a.ops);
        assert_eq!(back(from(1), 2).collect::<Vec<_>>(), b.ops, "b's streams come after a's two");
        assert_eq!(m.peak_live(), a.peak_live() + b.peak_live(), "here both peaks overlap");
    }

    #[test]
    fn inputs_are_spread_in_proportion_to_their_lengths() {
        let long = Trace { ops: (0..300).map(|i| Op { alloc: true, id: i, size: 1, stream: 0 }).collect() };
        let short = Trace { ops: (0..100).map(|i| Op { alloc: true, id: i, size: 1, stream: 0 }).collect() };
        let m = interleave(&[long, short]).unwrap();
        // Every window of 40 events holds 30 of the long input's and 10 of the short one's,
        // give or take one.
        for w in m.ops.chunks(40) {
            let shorts = w.iter().filter(|op| op.stream == 1).count();
            assert!((9..=11).contains(&shorts), "{shorts} of 40");
        }
        let last_short = m.ops.iter().rposition(|op| op.stream == 1).unwrap();
        assert!(last_short >= m.ops.len() - 4, "both end together: the short one's last is at {last_short}");
        assert_eq!(interleave(std::slice::from_ref(&m)).unwrap().ops, m.ops, "one input is itself");
    }

    #[test]
    fn ids_that_would_overflow_are_refused() {
        let big = Trace { ops: vec![Op { alloc: true, id: u64::MAX / 2, size: 1, stream: 0 }] };
        assert!(matches!(interleave(&[big.clone(), big.clone(), big]), Err(Error::InvalidArgument(_))));
        assert!(interleave(&[]).unwrap().ops.is_empty());
    }
}
