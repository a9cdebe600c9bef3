//! A trace resolved before it is timed: ids and streams turned into dense indexes.
//!
//! A trace names blocks by id and streams by number, and a replay that looks both up in hash
//! maps as it goes pays two hashes an event inside its timed loop (SipHash, std's default:
//! 26 ns an event on the 2-core development machine, where a warm pass of moe_decode takes
//! the pool 40 ns). That cost is the harness's: added to every allocator's time it pulls
//! their ratios towards 1, and the pool's replay, which looked up the stream too, paid 11 ns
//! an event more than the best-fit pass it is compared with. So the ids are
//! resolved once, untimed: each allocation gets a *slot* (one freed earlier if there is one),
//! and its free names the same slot; each stream gets a *lane*, in the order
//! streams first appear. A timed loop then indexes two vectors.
//!
//! The events keep the trace's order and count: a free of an id not live (a trace that lost
//! its allocation) stays in the plan as a step that does nothing, and an id allocated again
//! while live (a trace that lost a free) reuses its slot, so the replay drops the older
//! block there, as it did with the maps.

use std::collections::HashMap;

use super::Trace;

/// What one event of a [`Plan`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Allocate `size` bytes into the slot (dropping any block still there).
    Alloc {
        /// Bytes asked for.
        size: usize,
    },
    /// Free the slot's block, on the step's lane.
    Free,
    /// Nothing: the free of an id that is not live.
    Skip,
}

/// One event of a [`Plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// What it does.
    pub act: Act,
    /// The block's slot: an index below [`Plan::slots`].
    pub slot: u32,
    /// The stream's lane: an index into [`Plan::streams`].
    pub lane: u32,
}

/// A trace with its ids and streams resolved (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// One step per event of the trace, in its order.
    pub steps: Vec<Step>,
    /// Slots the steps use: the most blocks live at once.
    pub slots: usize,
    /// The trace's stream numbers, by lane (in the order they first appear).
    pub streams: Vec<u32>,
}

impl Trace {
    /// The trace resolved for a timed replay (see [`Plan`]).
    pub fn plan(&self) -> Plan {
        let mut lanes: HashMap<u32, u32> = HashMap::new();
        let mut streams = Vec::new();
        let mut live: HashMap<u64, u32> = HashMap::new();
        let mut spare: Vec<u32> = Vec::new();
        let mut slots = 0u32;
        let mut steps = Vec::with_capacity(self.ops.len());
        for op in &self.ops {
            let lane = *lanes.entry(op.stream).or_insert_with(|| {
                streams.push(op.stream);
                streams.len() as u32 - 1
            });
            let step = if op.alloc {
                let slot = *live.entry(op.id).or_insert_with(|| {
                    // Freed slots first: the replay's vector of live blocks stays as long as
                    // the most blocks live at once.
                    spare.pop().unwrap_or_else(|| {
                        slots += 1;
                        slots - 1
                    })
                });
                Step { act: Act::Alloc { size: op.size }, slot, lane }
            } else if let Some(slot) = live.remove(&op.id) {
                spare.push(slot);
                Step { act: Act::Free, slot, lane }
            } else {
                Step { act: Act::Skip, slot: 0, lane }
            };
            steps.push(step);
        }
        Plan { steps, slots: slots as usize, streams }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_plan_gives_each_live_id_its_own_slot_and_each_free_the_slot_of_its_allocation() {
        let t = Trace::parse("a,7,100,3\na,9,50,0\nf,7,0,0\na,4,70,3\nf,9,0,3\nf,4,0,3\n".as_bytes()).unwrap();
        let p = t.plan();
        assert_eq!(p.streams, vec![3, 0]);
        assert_eq!(p.slots, 2, "two blocks live at most");
        let acts: Vec<(Act, u32, u32)> = p.steps.iter().map(|s| (s.act, s.slot, s.lane)).collect();
        assert_eq!(
            acts,
            vec![
                (Act::Alloc { size: 100 }, 0, 0),
                (Act::Alloc { size: 50 }, 1, 1),
                (Act::Free, 0, 1),
                (Act::Alloc { size: 70 }, 0, 0),
                (Act::Free, 1, 0),
                (Act::Free, 0, 0),
            ]
        );
    }

    #[test]
    fn a_plan_keeps_the_events_of_a_trace_that_lost_a_free_or_an_allocation() {
        // Id 1 allocated twice (a lost free), id 5 freed but never allocated.
        let t = Trace::parse("a,1,10,0\na,1,20,0\nf,5,0,0\nf,1,0,0\n".as_bytes()).unwrap();
        let p = t.plan();
        assert_eq!(p.steps.len(), 4, "one step an event");
        assert_eq!(p.slots, 1);
        assert_eq!(p.steps[1].act, Act::Alloc { size: 20 });
        assert_eq!(p.steps[1].slot, 0, "the second allocation replaces the first in its slot");
        assert_eq!(p.steps[2].act, Act::Skip);
        assert_eq!(p.steps[3].act, Act::Free);
    }
}
