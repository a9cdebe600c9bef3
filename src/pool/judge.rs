//! The judgement of a placement: whether the freed memory under the granules it looks at
//! may be taken by its stream now, and which device waits it would need otherwise.
//!
//! Every granule of the space carries the fence of its last free (`arena::fence_word`):
//! the slot of the stream that freed it and the sequence number of that free. A [`Judge`]
//! reads them for one stream and one [`Reuse`]: its own stream's memory is always ready
//! (stream order), memory free for everyone too, another stream's when that stream's event
//! covering the free has completed or an earlier device wait of this stream covers it
//! (`crate::reclaim::waited`), and, under [`Reuse::Wait`] only, another stream's whose
//! work is still queued, with the waits on its events gathered for [`Judge::settle`].
//!
//! # Invariants
//!
//! * A judgement takes no lock and changes nothing it judges: it reads fence words and the
//!   stream registry's fences, and may record an event or ask for one ([`Judge::hurry`])
//!   or, once the placement has claimed its run, make the stream wait ([`Judge::settle`]).
//!   A run whose memory another thread claims meanwhile is claimed by one of them only (the
//!   space's claim), and the loser judges its next run afresh.
//! * With `break_event_guard_for_tests` every fence is ready: what the stress tests use to
//!   show that they catch a broken guard.

use std::sync::Arc;

use super::place::Reuse;
use super::streams::Registry;
use super::{PoolInner, StreamState};
use crate::arena::fence_parts;
use crate::stats::Counters;
use crate::sync::epoch;

/// Judges the fences of the granules a placement looks at, for one stream and one mode, and
/// remembers the device waits the placement would need.
pub(super) struct Judge<'a> {
    pool: &'a PoolInner,
    /// The stream placed for: its slot, and what it has already waited for on the device.
    st: &'a StreamState,
    reuse: Reuse,
    reg: arc_swap::Guard<Arc<Registry>>,
    /// The last fence word judged and the verdict (runs of granules share one).
    memo: Option<(u64, bool)>,
    /// (slot, seq) the placement must wait for, largest seq per slot.
    pub(super) waits: Vec<(u32, u64)>,
    /// Whether a granule this stream freed itself was taken.
    pub(super) own: bool,
    /// Whether a granule was taken because an earlier device wait of this stream covers it.
    pub(super) covered: bool,
    /// The streams whose events this judgement polled, and covered where none was
    /// outstanding ([`Judge::hurry`]).
    hurried: Vec<u32>,
}

impl<'a> Judge<'a> {
    pub(super) fn new(pool: &'a PoolInner, st: &'a StreamState, reuse: Reuse) -> Judge<'a> {
        Judge {
            pool,
            st,
            reuse,
            reg: pool.registry.load(),
            memo: None,
            waits: Vec::new(),
            own: false,
            covered: false,
            hurried: Vec::new(),
        }
    }

    /// Judge afresh every fence of `[addr, addr + len)`: true if all may be taken (the
    /// device waits they need, if any, are then in `waits`).
    pub(super) fn accepts(&mut self, addr: u64, len: u64) -> bool {
        self.start_over();
        self.own = false;
        self.covered = false;
        let mut ok = true;
        self.pool.space.fences(addr, len, |_, _, w| {
            ok = self.fence_ok(w);
            ok
        });
        ok
    }

    /// Forget the verdicts and waits of the runs judged so far: the next fence is judged
    /// afresh.
    pub(super) fn start_over(&mut self) {
        self.waits.clear();
        self.memo = None;
    }

    /// Whether the fence `word` lets the stream take its memory (the verdict of the last
    /// word judged is reused: runs of granules share one).
    pub(super) fn fence_ok(&mut self, word: u64) -> bool {
        if let Some((w, ok)) = self.memo {
            if w == word {
                return ok;
            }
        }
        let ok = self.judge(word);
        self.memo = Some((word, ok));
        ok
    }

    fn judge(&mut self, word: u64) -> bool {
        let (slot, seq) = fence_parts(word);
        if slot == 0 {
            return true;
        }
        if slot == self.st.slot {
            self.own = true;
            return true;
        }
        if self.pool.config.break_event_guard_for_tests {
            return true;
        }
        let Some(entry) = self.reg.slots.get(slot as usize - 1) else { return false };
        if entry.fence.is_complete(seq) {
            return true;
        }
        if self.st.waited.covers(slot, seq) {
            // Stream order already puts this stream after that work: ready as its own is.
            self.covered = true;
            return true;
        }
        if self.hurry(slot, seq) {
            return true;
        }
        if self.reuse != Reuse::Wait || !self.pool.config.cross_stream_waits {
            return false;
        }
        match self.waits.iter_mut().find(|w| w.0 == slot) {
            Some(w) => w.1 = w.1.max(seq),
            None => self.waits.push((slot, seq)),
        }
        true
    }

    /// The first time this judgement meets an incomplete fence of stream `slot`: hurry that
    /// stream's frees along ([`PoolInner::hurry`]: covered at once where this thread
    /// allocates on that stream too, else its next free asked to record). True if the
    /// fence `seq` is complete now. Frees are covered only every 64 blocks or 64 MiB
    /// (`note_free`), so a stream that freed a few large blocks left them refused to every
    /// other stream until its next batch: each placement's walk met the same refused runs
    /// again (about 14 a claim in threads_streams' second pass) and the ladder went on to
    /// device waits or page loans for memory that an event would have freed. Asked once a
    /// judgement and stream.
    pub(super) fn hurry(&mut self, slot: u32, seq: u64) -> bool {
        if self.hurried.contains(&slot) {
            return false;
        }
        self.hurried.push(slot);
        let other = self.reg.slots.get(slot as usize - 1).and_then(|e| e.state.upgrade());
        other.is_some_and(|other| self.pool.hurry(&other, seq, &epoch::pin()))
    }

    /// Make the stream wait on the device for every event the placement needs. False if
    /// one cannot be had (the other stream is being captured, or a device call failed).
    pub(super) fn settle(&self) -> bool {
        let st = self.st;
        let guard = epoch::pin();
        for &(slot, seq) in &self.waits {
            let Some(entry) = self.reg.slots.get(slot as usize - 1) else { return false };
            if st.waited.covers(slot, seq) {
                // Another placement for this stream set up such a wait meanwhile.
                continue;
            }
            let wait =
                |n: u64, ev: &crate::device::Event| st.waited.wait(slot, n, || self.pool.device_wait(&st.stream, ev));
            let Some(waited) = self.pool.wait_covering(&entry.stream, &entry.fence, seq, wait, &guard) else {
                continue;
            };
            if !waited {
                return false;
            }
            Counters::bump(&self.pool.counters.device_waits, 1);
            tracing::debug!(stream = st.stream.id(), on_slot = slot, seq, "device wait");
        }
        true
    }
}
