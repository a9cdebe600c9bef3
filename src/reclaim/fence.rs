//! Fences: how memory freed on one stream becomes safe for another, with no host wait.
//!
//! Memory freed on stream S is reusable at once by later work on S (stream order serialises
//! the old use before the new one), so a free does not wait for anything: it only stamps the
//! memory with a *fence*, the number of the next event to be recorded on S. Another stream T
//! may use that memory once an event of S with that number or a later one is complete, or
//! once T is made to wait on such an event *on the device* (`stream_wait_event`).
//!
//! # What it owns
//!
//! One [`FenceLog`] per stream: `claimed`, the number of the last event claimed for
//! recording on the stream; `complete`, the highest number of an event seen complete; the
//! stream's final event number once it is destroyed; the events recorded and not yet seen
//! complete, in a [`Fifo`], oldest first; and whether a thread that may not record on the
//! stream has asked for an event ([`FenceLog::ask`]).
//!
//! # Invariants
//!
//! * A free stamps `claimed + 1` (read after a `SeqCst` fence), and an event is recorded on
//!   the stream only after its number was claimed (with a `SeqCst` fence in between). So
//!   the event numbered `q` is recorded after every free stamped `q` or less: either the
//!   free's read of `claimed` saw the claim of `q` (and stamped more), or the recorder's
//!   record saw the work the free's block was used by (both sides' fences order the pair).
//!   Hence **event `q` complete ⇒ every piece of work before every free stamped ≤ `q` is
//!   done**, whatever order events numbered below `q` complete in.
//! * `complete` only grows, and only to the number of an event seen complete.
//! * An ask is never lost: a record takes the ask before it claims its number, so an ask it
//!   takes was made after a stamp that the new event covers, and an ask made after it
//!   stands for the next record (loom model:
//!   `an_ask_is_answered_by_an_event_covering_its_stamp_or_it_stands`).
//! * After the stream is destroyed, frees stamp its final event's number: nothing new can
//!   run on the stream, so that event covers every use of every block freed after it.
//!   A free racing the destruction may still read `claimed` after the final number was
//!   claimed and before it was published, and stamp one past it, a number no event will
//!   ever carry. So once the stream is finished every stamp is read as at most the final
//!   number ([`FenceLog::is_complete`], [`FenceLog::covering`]): that is safe because the
//!   user enqueues nothing on a stream once they destroy it, so the final event follows
//!   every use of every block freed on it, whatever the stamp says.
//!
//! # Why it is lock-free
//!
//! Every thread that frees on a stream stamps fences, and any thread may resolve them: a
//! lock here would serialise the frees the thread caches exist to keep apart. The counters
//! are single atomics; the events sit in a Michael–Scott queue whose nodes are reclaimed with
//! crossbeam-epoch, since a poller may query an event while another thread pops it. `E` is
//! the event type, generic so that loom models can use a fake event.

use super::Fifo;
use crate::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use crate::sync::epoch::Guard;

/// An event recorded on the stream, with its number.
struct Recorded<E> {
    seq: u64,
    event: E,
}

/// The fence state of one stream. See the module docs.
pub struct FenceLog<E> {
    claimed: AtomicU64,
    complete: AtomicU64,
    /// The final event's number once the stream is destroyed; 0 while it lives.
    final_seq: AtomicU64,
    /// Whether a thread that may not record on the stream waits on a stamp no event covers
    /// yet ([`FenceLog::ask`]): cleared by the next record, as it claims its number.
    asked: AtomicBool,
    events: Fifo<Recorded<E>>,
}

impl<E: Send + Sync> Default for FenceLog<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Send + Sync> FenceLog<E> {
    /// A stream with no event recorded yet.
    pub fn new() -> Self {
        FenceLog {
            claimed: AtomicU64::new(0),
            complete: AtomicU64::new(0),
            final_seq: AtomicU64::new(0),
            asked: AtomicBool::new(false),
            events: Fifo::new(),
        }
    }

    /// The fence a free made now gets: the number of the next event to be recorded (the
    /// final event's, once the stream is destroyed). Called after the freed block's last
    /// use on the stream was enqueued.
    pub fn stamp(&self) -> u64 {
        // Orders the block's last use (enqueued before this call) before the read of
        // `claimed`: see the module docs' first invariant.
        fence(Ordering::SeqCst);
        match self.final_seq.load(Ordering::Acquire) {
            0 => self.claimed.load(Ordering::Acquire) + 1,
            f => f,
        }
    }

    /// Whether every free stamped `seq` or less is known safe for other streams.
    #[inline]
    pub fn is_complete(&self, seq: u64) -> bool {
        let complete = self.complete.load(Ordering::Acquire);
        // `bounded(seq) <= seq`: the final number is read only where `complete` falls short.
        complete >= seq || complete >= self.bounded(seq)
    }

    /// `seq` read as at most the final event's number once the stream is destroyed (see the
    /// module docs: a stamp racing the destruction may exceed it).
    fn bounded(&self, seq: u64) -> u64 {
        match self.final_seq.load(Ordering::Acquire) {
            0 => seq,
            f => seq.min(f),
        }
    }

    /// The highest number of an event seen complete.
    pub fn completed(&self) -> u64 {
        self.complete.load(Ordering::Acquire)
    }

    /// The number of the last event claimed for recording.
    pub fn claimed(&self) -> u64 {
        self.claimed.load(Ordering::Acquire)
    }

    /// Record a new event on the stream with `record` (which creates and records it), after
    /// claiming its number. Returns the number. If `record` fails, the number stays claimed
    /// with no event: fences it would have covered wait for a later one.
    ///
    /// Answers every ask made so far ([`FenceLog::ask`]), and only those: the ask is taken
    /// before the number is claimed, so an ask it takes was made after a stamp that read
    /// `claimed` before this claim, which the new event covers; a later ask stays, for the
    /// next record. A failed record puts back the ask it took.
    pub fn record<Er>(&self, record: impl FnOnce() -> Result<E, Er>, guard: &Guard) -> Result<u64, Er> {
        // AcqRel: an ask taken here happened after the stamp it was made for, so that
        // stamp's read of `claimed` happens before the claim below and cannot see it.
        let asked = self.asked.swap(false, Ordering::AcqRel);
        let seq = self.claimed.fetch_add(1, Ordering::AcqRel) + 1;
        // The other half of the pair in `stamp`.
        fence(Ordering::SeqCst);
        let event = match record() {
            Ok(event) => event,
            Err(e) => {
                if asked {
                    self.asked.store(true, Ordering::Release);
                }
                return Err(e);
            }
        };
        self.events.push(Recorded { seq, event }, guard);
        Ok(seq)
    }

    /// Ask for an event covering the stamps made so far, from a thread that may not record
    /// one on the stream itself (in the pool: a thread that does not launch there, where a
    /// record would wait behind another thread's launches): the stream's next free records
    /// it ([`FenceLog::is_asked`]). Returns whether the ask is new. An ask is never lost:
    /// once made, the next record covers the stamps it was made for, or it stands.
    pub fn ask(&self) -> bool {
        !self.asked.load(Ordering::Relaxed) && !self.asked.swap(true, Ordering::AcqRel)
    }

    /// Whether an ask stands that no record has answered yet.
    pub fn is_asked(&self) -> bool {
        self.asked.load(Ordering::Relaxed)
    }

    /// The stream is being destroyed: record its final event (as [`FenceLog::record`]);
    /// every later stamp is that event's number.
    pub fn finish<Er>(&self, record: impl FnOnce() -> Result<E, Er>, guard: &Guard) -> Result<u64, Er> {
        let seq = self.record(record, guard)?;
        self.final_seq.store(seq, Ordering::Release);
        Ok(seq)
    }

    /// Whether the stream was destroyed ([`FenceLog::finish`]).
    pub fn is_finished(&self) -> bool {
        self.final_seq.load(Ordering::Acquire) != 0
    }

    /// Pop every event, oldest first, that `query` says is complete, raising `complete` to
    /// its number; stop at the first that is not. Returns whether `complete` rose.
    pub fn poll(&self, mut query: impl FnMut(&E) -> bool, guard: &Guard) -> bool {
        let before = self.completed();
        // `complete` rises before the event leaves the queue: whoever no longer finds the
        // event there finds its number complete.
        let mut done = |r: &Recorded<E>| {
            let done = query(&r.event);
            if done {
                self.complete.fetch_max(r.seq, Ordering::AcqRel);
            }
            done
        };
        while self.events.pop_if(&mut done, |_| (), guard).is_some() {}
        self.completed() > before
    }

    /// Run `f` on the oldest recorded event whose number is `seq` or more (one that covers
    /// every free stamped `seq` or less), if there is one.
    pub fn covering<R>(&self, seq: u64, f: impl FnOnce(&E) -> R, guard: &Guard) -> Option<R> {
        self.covering_numbered(seq, |_, e| f(e), guard)
    }

    /// As [`FenceLog::covering`], with the event's own number passed to `f` too (a stream
    /// made to wait on it is ordered after every free stamped that number or less).
    pub fn covering_numbered<R>(&self, seq: u64, f: impl FnOnce(u64, &E) -> R, guard: &Guard) -> Option<R> {
        let seq = self.bounded(seq);
        let mut found = None;
        self.events.for_each(
            |r| {
                if found.is_none() && r.seq >= seq {
                    found = Some((r.seq, &r.event as *const E));
                }
            },
            guard,
        );
        // SAFETY: the event lives in a queue node that the guard keeps from being reclaimed
        // (a popped node is destroyed only once every thread pinned at the time has
        // unpinned), and items are only ever read in place.
        found.map(|(n, e)| f(n, unsafe { &*e }))
    }

    /// Run `f` on the oldest recorded event not yet seen complete, if any.
    pub fn with_oldest<R>(&self, f: impl FnOnce(&E) -> R, guard: &Guard) -> Option<R> {
        self.events.with_front(|r| f(&r.event), guard)
    }

    /// Whether an event is recorded and not yet seen complete.
    pub fn has_pending(&self, guard: &Guard) -> bool {
        !self.events.is_empty(guard)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::epoch;
    use std::sync::atomic::AtomicBool;

    fn log() -> FenceLog<AtomicBool> {
        FenceLog::new()
    }

    #[test]
    fn an_ask_stands_until_a_record_answers_it_and_a_failed_record_leaves_it() {
        let (l, g) = (log(), epoch::pin());
        l.stamp();
        assert!(l.ask(), "a new ask");
        assert!(!l.ask(), "one already stands");
        assert_eq!(l.record(|| Err::<AtomicBool, _>(()), &g), Err(()));
        assert!(l.is_asked(), "no event came of the failed record: the ask stands");
        l.record(|| Ok::<_, ()>(AtomicBool::new(false)), &g).unwrap();
        assert!(!l.is_asked(), "answered");
    }

    #[test]
    fn a_free_is_covered_by_the_next_event_recorded() {
        let (l, g) = (log(), epoch::pin());
        let fence = l.stamp();
        assert!(!l.is_complete(fence), "nothing recorded yet");
        assert_eq!(l.record(|| Ok::<_, ()>(AtomicBool::new(false)), &g), Ok(fence));
        assert!(!l.poll(|e| e.load(Ordering::Acquire), &g), "recorded, not complete");
        assert!(l.covering(fence, |_| (), &g).is_some());
        l.with_oldest(|e| e.store(true, Ordering::Release), &g);
        assert!(l.poll(|e| e.load(Ordering::Acquire), &g));
        assert!(l.is_complete(fence));
        assert!(!l.is_complete(l.stamp()), "a later free waits for a later event");
    }

    #[test]
    fn a_later_event_complete_covers_earlier_fences_whatever_the_order() {
        let (l, g) = (log(), epoch::pin());
        let first = l.stamp();
        l.record(|| Ok::<_, ()>(AtomicBool::new(false)), &g).unwrap();
        let second = l.stamp();
        l.record(|| Ok::<_, ()>(AtomicBool::new(true)), &g).unwrap();
        assert!(first < second);
        assert!(!l.poll(|e| e.load(Ordering::Acquire), &g), "polling stops at the first incomplete event");
        assert!(l.covering(second, |e| e.load(Ordering::Acquire), &g).unwrap(), "the event covering the later fence");
        l.with_oldest(|e| e.store(true, Ordering::Release), &g);
        assert!(l.poll(|e| e.load(Ordering::Acquire), &g));
        assert!(l.is_complete(first) && l.is_complete(second));
    }

    #[test]
    fn a_failed_record_leaves_fences_for_a_later_event() {
        let (l, g) = (log(), epoch::pin());
        let fence = l.stamp();
        assert_eq!(l.record(|| Err::<AtomicBool, _>("capturing"), &g), Err("capturing"));
        assert!(l.covering(fence, |_| (), &g).is_none());
        let seq = l.record(|| Ok::<_, ()>(AtomicBool::new(true)), &g).unwrap();
        assert!(seq > fence);
        l.poll(|e| e.load(Ordering::Acquire), &g);
        assert!(l.is_complete(fence));
    }

    #[test]
    fn after_the_final_event_every_free_is_stamped_with_it() {
        let (l, g) = (log(), epoch::pin());
        let f = l.finish(|| Ok::<_, ()>(AtomicBool::new(false)), &g).unwrap();
        assert!(l.is_finished());
        assert_eq!(l.stamp(), f);
        assert_eq!(l.stamp(), f, "no work can follow the final event");
    }

    #[test]
    fn a_stamp_racing_the_final_event_is_covered_by_it() {
        // The free read `claimed` after the final number was claimed, before it was
        // published: it stamped one past the final event, a number never recorded.
        let (l, g) = (log(), epoch::pin());
        let mut late = 0;
        let f = l
            .finish(
                || {
                    late = l.stamp();
                    Ok::<_, ()>(AtomicBool::new(false))
                },
                &g,
            )
            .unwrap();
        assert_eq!(late, f + 1);
        assert!(!l.is_complete(late), "the final event is not complete yet");
        assert!(l.covering(late, |_| (), &g).is_some(), "the final event covers the late stamp");
        l.with_oldest(|e| e.store(true, Ordering::Release), &g);
        assert!(l.poll(|e| e.load(Ordering::Acquire), &g));
        assert!(l.is_complete(late), "once the final event is complete, so is every stamp");
    }
}
