//! The walk over an [`Extents`]' granule bits: every free run in address order, handed to
//! a closure that says whether to stop, go on, or go on from a granule further up.
//!
//! Every search of the extents is one (first fit, the scored choice, a failure's
//! confirmation, `largest_free`, `for_each_free`), so it holds the bitmap's reading rules in
//! one place: absent chunks read as free without being made, bits past the last granule read
//! as taken, and full words are passed in a tight loop. A walk reads; it never writes a bit,
//! so what it finds is a snapshot that a claim must confirm.

use super::{Extents, BITS, CHUNK};
use crate::sync::atomic::Ordering;

/// What a walk's closure says about the run it was handed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Next {
    /// The walk is over.
    Stop,
    /// Walk on past the run.
    On,
    /// Drop the run and walk on from this granule, past the run's start.
    From(u64),
}

impl Extents {
    /// Walk the free runs from granule `from` in address order, in granules: `f(start, len)`
    /// for each maximal run of at least `min_len` granules when it ends, or, as soon as the
    /// current run reaches `stop_at` granules, once for it. What `f` answers ([`Next`]): stop;
    /// walk on (past a run that ended; a run handed at `stop_at` stops the walk all the same);
    /// or drop the run and walk on from a granule past its start. Absent chunks count as free
    /// without being made. Returns the first word the walk found with a free granule (None if
    /// every word it read was full), whatever the runs' lengths: where the hint may go.
    ///
    /// Runs shorter than `min_len` are not handed to `f` (a first fit for `k` granules
    /// passes `k`; a large block's walk used to call `f` for every short run it passed, most
    /// of a few granules on train_gpt2's warm passes). With `min_len` longer than a word, the
    /// runs held inside a word are skipped whole: only the free bits at a word's two ends can
    /// belong to a run that long.
    ///
    /// `Next::From` is how a first fit passes what its judge refuses without leaving the walk.
    /// Past a refused candidate the judge often names a granule beyond the run handed at
    /// `stop_at` (a row of dormant pages, say), and each such answer used to end the walk for
    /// another to start there: on threads_streams' warm pass, four walks a placement.
    pub(super) fn walk(
        &self,
        from: u64,
        stop_at: u64,
        min_len: u64,
        f: &mut dyn FnMut(u64, u64) -> Next,
    ) -> Option<usize> {
        debug_assert!(min_len > 0, "a run is at least a granule");
        let (mut start, mut len) = (0u64, 0u64);
        let mut first = None;
        // Granules below this one read as taken: where the walk (re)starts.
        let mut floor = from;
        let mut i = (from / BITS) as usize;
        // `Next::From(g)`: drop the run, go on from granule `g`; else whether to stop.
        macro_rules! answer {
            ($range:lifetime, $next:expr, $stop:expr) => {
                match $next {
                    Next::From(g) => {
                        debug_assert!(g > start, "a walk moves on");
                        (len, floor, i) = (0, g, (g / BITS) as usize);
                        continue $range;
                    }
                    Next::Stop => return first,
                    Next::On if $stop => return first,
                    Next::On => {}
                }
            };
        }
        'range: loop {
            while i < self.words {
                let chunk_end = ((i / CHUNK + 1) * CHUNK).min(self.words);
                let Some(chunk) = self.bits.chunk(i / CHUNK) else {
                    // An absent chunk: all free, up to the end of the range.
                    first.get_or_insert(i);
                    let g = (i as u64 * BITS).max(floor);
                    if len == 0 {
                        start = g;
                    }
                    // Saturating: a `From` may name a granule past the last (in its word).
                    len += (chunk_end as u64 * BITS).min(self.granules).saturating_sub(g);
                    i = chunk_end;
                    if len >= stop_at {
                        answer!('range, f(start, len), true);
                    }
                    continue;
                };
                while i < chunk_end {
                    if len == 0 {
                        // Outside a run, full words are passed in a tight loop: in a packed pool
                        // most of a walk's words are full (three in four on train_gpt2's warm
                        // pass). A word past the end is never full (its bits past the last
                        // granule stay clear), so it goes the long way below.
                        let base = i / CHUNK * CHUNK;
                        i += chunk[i - base..chunk_end - base]
                            .iter()
                            .take_while(|w| w.load(Ordering::Acquire) == u64::MAX)
                            .count();
                        if i == chunk_end {
                            break;
                        }
                    }
                    let g = i as u64 * BITS;
                    let below = if floor > g { (1u64 << (floor - g)) - 1 } else { 0 };
                    let taken = chunk.get(i % CHUNK).map_or(u64::MAX, |w| w.load(Ordering::Acquire)) | self.past_end(i);
                    if taken != u64::MAX {
                        first.get_or_insert(i);
                    }
                    let taken = taken | below;
                    i += 1;
                    if taken == 0 {
                        if len == 0 {
                            start = g;
                        }
                        len += BITS;
                        if len >= stop_at {
                            answer!('range, f(start, len), true);
                        }
                        continue;
                    }
                    let mut pos = 0u64;
                    while pos < BITS {
                        // Free bits from `pos` (all the rest when nothing above is taken).
                        let z = u64::from((taken >> pos).trailing_zeros()).min(BITS - pos);
                        if z > 0 {
                            if len == 0 {
                                start = g + pos;
                            }
                            len += z;
                            if len >= stop_at {
                                answer!('range, f(start, len), true);
                            }
                            pos += z;
                            if pos >= BITS {
                                break; // the run may go on into the next word
                            }
                        }
                        // The bit at `pos` is taken: the run, if any, ends here.
                        if len >= min_len {
                            answer!('range, f(start, len), false);
                        }
                        len = 0;
                        pos = if min_len > BITS {
                            // Every run from here to the word's top free bits lies inside the
                            // word, shorter than `min_len`: on to those bits (none when its top
                            // bit is taken).
                            BITS - u64::from(taken.leading_zeros())
                        } else {
                            pos + u64::from((taken >> pos).trailing_ones())
                        };
                    }
                }
            }
            if len >= min_len {
                // The range's end.
                if let Next::From(g) = f(start, len) {
                    (len, floor, i) = (0, g, (g / BITS) as usize);
                    continue 'range;
                }
            }
            return first;
        }
    }

    /// The largest run of free bytes (0 if none): a walk, exact when quiet.
    pub fn largest_free(&self) -> u64 {
        let mut best = 0;
        self.walk(0, u64::MAX, 1, &mut |_, l| {
            best = best.max(l);
            Next::On
        });
        best << self.shift
    }

    /// Call `f(addr, len)` on every maximal free run, lowest first, up to the end of the
    /// range (chunks never touched included, and not made): a walk, exact when quiet.
    pub fn for_each_free(&self, mut f: impl FnMut(u64, u64)) {
        self.walk(0, u64::MAX, 1, &mut |s, l| {
            f(self.base + (s << self.shift), l << self.shift);
            Next::On
        });
    }
}
