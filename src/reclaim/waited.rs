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
//! (the demo, whose streams recorded an event every 64 frees when this was measured) a new
//! wait is still needed.
//!
//! # Invariants
//!
//! * A wait is noted only after it is enqueued on the stream ([`Waited::wait`] notes it
//!   once the `stream_wait_event` call has returned). A placement that relies on the note then enqueues
//!   its work after the wait: it read the note (acquire) after the writer's release, which
//!   follows the writer's enqueue. Noting first would let another thread's work run ahead of
//!   the wait (the loom model `a_wait_is_relied_on_only_once_it_is_enqueued`, in
//!   `loom_tests/tests/reclaim.rs`, fails that way).
//! * A note only grows while it stays, and a missing one only costs a wait. The table has
//!   [`WAITED_SLOTS`] words, direct-mapped by slot: each word holds one slot's note, tagged
//!   with the slot, and a wait on another slot of the same word replaces it (a CAS). Slots
//!   are never reused, so a server that makes a stream per request gives out slots past the
//!   table's size; with slots past it left out, as before, its streams waited on the device
//!   again for memory an earlier wait covered.
//!
//! Lock-free because placements for one stream run on every worker thread at once; one
//! atomic word per table entry, made lazily a chunk at a time.

use crate::arena::words::LazyWords;
use crate::sync::atomic::Ordering;

/// Words of the table: slots `s` and `s + WAITED_SLOTS` share one.
pub const WAITED_SLOTS: usize = 4096;
/// Bits of a note for the event number (+ 1); the slot is above them.
const SEQ_BITS: u32 = crate::arena::space::SEQ_BITS;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// For one stream: per other stream's slot (direct-mapped), the newest event of it this
/// stream has been made to wait on, as `slot << SEQ_BITS | (number + 1)`; 0 for none.
pub struct Waited {
    words: LazyWords,
}

/// The note of event `seq` of the stream of `slot`.
fn note(slot: u32, seq: u64) -> u64 {
    (u64::from(slot) << SEQ_BITS) | seq.saturating_add(1).min(SEQ_MASK)
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
        self.words.get(slot as usize % WAITED_SLOTS, false).is_some_and(|w| {
            let n = w.load(Ordering::Acquire);
            n >> SEQ_BITS == u64::from(slot) && n & SEQ_MASK > seq
        })
    }

    /// Make this stream wait on event `seq` of the stream of `slot` with `enqueue` (the
    /// device call; true when the wait is enqueued), and note the wait once it is. Returns
    /// `enqueue`'s answer.
    pub fn wait(&self, slot: u32, seq: u64, enqueue: impl FnOnce() -> bool) -> bool {
        let enqueued = enqueue();
        if enqueued {
            // After the enqueue: a placement that reads this enqueues its work after the wait.
            if let Some(w) = self.words.get(slot as usize % WAITED_SLOTS, true) {
                let mine = note(slot, seq);
                let mut cur = w.load(Ordering::Acquire);
                // The slot's own newer note stays; another slot's gives way.
                while cur >> SEQ_BITS != u64::from(slot) || cur < mine {
                    match w.compare_exchange_weak(cur, mine, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => break,
                        Err(now) => cur = now,
                    }
                }
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
    fn slots_sharing_a_word_take_it_in_turn_and_never_cover_each_other() {
        let w = Waited::default();
        let (a, b) = (5, 5 + WAITED_SLOTS as u32);
        assert!(w.wait(a, 9, || true));
        assert!(w.covers(a, 9) && !w.covers(b, 0), "slot {b} shares the word, not the note");
        assert!(w.wait(b, 2, || true), "a slot past the table is noted too");
        assert!(w.covers(b, 2) && !w.covers(b, 3));
        assert!(!w.covers(a, 0), "its note gave way: the next take waits again");
        assert!(w.wait(b, 1, || true));
        assert!(w.covers(b, 2), "an older wait of the same slot does not undo a newer one");
    }
}
