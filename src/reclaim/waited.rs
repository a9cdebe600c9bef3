//! What a stream has already been made to wait for on the device.
//!
//! A device wait (`stream_wait_event`) orders every later item of the waiting stream after
//! the other stream's work up to the event, for good: stream order is transitive. So once
//! stream S has waited on stream T's event number `n`, memory that T freed under a fence of
//! `n` or less is as safe for S as memory S freed itself, and a placement for S may take it
//! at once, with no event polled and no second wait. Where a stream takes memory that another
//! freed a while before, most waits a placement would set up are of this kind (the `server`
//! example: five to six in seven, on the simulator and on an H200), and under a busy driver
//! each costs an event record and a wait. Where it takes memory freed since its last wait
//! (the demo, whose streams record an event every 64 frees) a new wait is still needed.
//!
//! # Invariants
//!
//! * A wait is noted only after it is enqueued on the stream ([`Waited::wait`] notes it
//!   once the `stream_wait_event` call has returned). A placement that relies on the note then enqueues
//!   its work after the wait: it read the note (acquire) after the writer's release, which
//!   follows the writer's enqueue. Noting first would let another thread's work run ahead of
//!   the wait (the loom model `a_wait_is_relied_on_only_once_it_is_enqueued`, in
//!   `loom_tests/tests/reclaim.rs`, fails that way).
//! * Notes only grow (`fetch_max`), and a missing one only costs a wait: slots past
//!   [`WAITED_SLOTS`] are never noted.
//!
//! Lock-free because placements for one stream run on every worker thread at once; one
//! atomic word per other stream, made lazily a chunk at a time.

use crate::arena::words::LazyWords;
use crate::sync::atomic::Ordering;

/// Slots whose waits a stream remembers; waits on streams of higher slots are made each time.
pub const WAITED_SLOTS: usize = 4096;

/// For one stream: per other stream's slot, the newest event of it this stream has been made
/// to wait on (its number + 1; 0 for none).
pub struct Waited {
    words: LazyWords,
}

impl Default for Waited {
    fn default() -> Self {
        Waited { words: LazyWords::new(WAITED_SLOTS) }
    }
}

impl Waited {
    /// Whether this stream has already been made to wait on event `seq`, or a later one, of
    /// the stream of `slot`: memory fenced `seq` there is then ready for it.
    pub fn covers(&self, slot: u32, seq: u64) -> bool {
        self.words.get(slot as usize, false).is_some_and(|w| w.load(Ordering::Acquire) > seq)
    }

    /// Make this stream wait on event `seq` of the stream of `slot` with `enqueue` (the
    /// device call; true when the wait is enqueued), and note the wait once it is. Returns
    /// `enqueue`'s answer.
    pub fn wait(&self, slot: u32, seq: u64, enqueue: impl FnOnce() -> bool) -> bool {
        let enqueued = enqueue();
        if enqueued {
            // After the enqueue: a placement that reads this enqueues its work after the wait.
            if let Some(w) = self.words.get(slot as usize, true) {
                w.fetch_max(seq.saturating_add(1), Ordering::AcqRel);
            }
        }
        enqueued
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_wait_covers_its_event_and_every_earlier_one_of_that_stream_only() {
        let w = Waited::default();
        assert!(!w.covers(3, 0), "nothing waited for yet");
        assert!(w.wait(3, 7, || true));
        assert!(w.covers(3, 0) && w.covers(3, 7));
        assert!(!w.covers(3, 8), "a later event is not waited for");
        assert!(!w.covers(2, 1) && !w.covers(4, 1), "other streams are not waited for");
        assert!(w.wait(3, 5, || true));
        assert!(w.covers(3, 7), "an older wait does not undo a newer one");
    }

    #[test]
    fn a_wait_that_could_not_be_enqueued_covers_nothing() {
        let w = Waited::default();
        assert!(!w.wait(3, 7, || false));
        assert!(!w.covers(3, 1));
    }

    #[test]
    fn slots_past_the_table_are_never_covered() {
        let w = Waited::default();
        assert!(w.wait(WAITED_SLOTS as u32, 1, || true), "the wait is made all the same");
        assert!(!w.covers(WAITED_SLOTS as u32, 0));
    }
}
