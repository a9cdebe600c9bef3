//! `vrampool_snapshot`: a device's memory segment by segment and block by block, for
//! PyTorch's `torch.cuda.memory_snapshot` (and its memory_viz pictures) and for C tools.
//!
//! **Why the ABI and not the pool.** [`Pool::snapshot`](crate::Pool::snapshot) infers what
//! is live from the tiers: the pool keeps no record of its live blocks on the hit path, so
//! blocks side by side show as one live extent. The ABI keeps one: its live-block table has
//! a slot at every block's start with the bytes asked for and the stream. So each live
//! extent of the pool's picture is cut here at the table's live blocks, each with its
//! requested bytes and the stream handle the program passed. Live memory no block of the
//! table starts in (a block of the Rust API on the registry's pool, or one allocated while
//! the picture was taken) stays one live extent with nothing asked for and no stream.
//! CUDA graph pools are pools of their own, with their live blocks in their own map; their
//! extents carry the pool's id.
//!
//! **Not a stop of the world.** Pending frees of other threads are settled first, then the
//! pool's picture and the table are read, each without a lock, while other threads go on:
//! a block allocated or freed meanwhile may show in either state, and a slot published
//! again while it is read may show words of both blocks, cut to the live memory the picture
//! saw (`Table::peek`; exact on a quiet device, as the pool's picture is). A block kept
//! whole in a boxed record (one given to `vrampool_record_stream`) is reported from its
//! slot's words alone, its record never read: a free racing the read may drop it. Such a
//! block shows its capacity as its bytes asked for and no stream.

use std::ffi::c_void;

use super::device;
use super::graph::{self, PoolId};
use super::words;
use super::{vrampool_extent, vrampool_extent_state};
use crate::live::GRAIN;
use crate::pool::class_and_size;
use crate::registry::{self, Entry};
use crate::{BlockState, Result, Snapshot, StreamId};

/// A live block as the picture shows it: (address, bytes held, bytes asked for, stream
/// handle), lowest address first.
type Live = (u64, u64, u64, u64);

/// Device `ordinal`'s extents, lowest address first in each pool: the main pool, then each
/// graph pool. A device the ABI has not used has none (and nothing is made for it).
pub(super) fn extents(ordinal: usize) -> Result<Vec<vrampool_extent>> {
    registry::config()?;
    registry::served(ordinal)?;
    let Some(dev) = device::existing(ordinal) else { return Ok(Vec::new()) };
    super::foreign::settle(true);
    let snapshot = dev.entry.pool.snapshot();
    let live = table_blocks(dev, &snapshot);
    let mut out = Vec::new();
    picture(&snapshot, &live, (0, 0), |id| raw_of(dev.entry, id), &mut out);
    for g in graph::pictures(ordinal) {
        // A graph pool's free memory is its one internal stream's, which no handle of the
        // program names; its live blocks carry the handles they were allocated with.
        picture(&g.snapshot, &g.live, g.id, |_| None, &mut out);
    }
    Ok(out)
}

/// The table's blocks in the live extents of `snapshot`, `dev`'s pool's picture. Only the
/// slots of live memory are read, block to block: the table has a slot per 256 bytes of the
/// whole range, and a walk of every slot ever written read millions of them a picture.
fn table_blocks(dev: &device::AbiDevice, snapshot: &Snapshot) -> Vec<Live> {
    let streams = &dev.entry.streams;
    let mut out = Vec::new();
    for e in snapshot.extents().filter(|e| e.state == BlockState::Live) {
        let (Some(first), Some(last)) =
            (dev.table.index(e.addr), dev.table.index((e.addr + e.bytes - 1) / GRAIN * GRAIN))
        else {
            continue;
        };
        let mut idx = first;
        while idx <= last {
            let Some(w) = dev.table.peek(idx) else {
                idx += 1;
                continue;
            };
            let held = class_and_size(w.size).1;
            let (asked, raw) = if w.ext {
                (held, 0)
            } else {
                let (len, token) = words::unpack(w.info);
                (len, streams.by_token(token).map_or(0, |r| r.raw))
            };
            out.push((dev.table.address(idx), held, asked, raw));
            idx = idx.saturating_add((held / GRAIN).max(1) as usize);
        }
    }
    out
}

/// The raw handle the program gave the stream `id` of `entry`, if the registry knows it.
fn raw_of(entry: &Entry, id: StreamId) -> Option<u64> {
    entry.streams.by_id(id).map(|r| r.raw)
}

/// `snapshot`'s extents into `out`, each live extent cut at the blocks of `live` that start
/// in it.
fn picture(
    snapshot: &Snapshot,
    live: &[Live],
    pool: PoolId,
    raw_of: impl Fn(StreamId) -> Option<u64>,
    out: &mut Vec<vrampool_extent>,
) {
    for seg in &snapshot.segments {
        let base = vrampool_extent {
            segment: seg.addr,
            segment_bytes: seg.bytes,
            addr: 0,
            bytes: 0,
            requested: 0,
            stream: std::ptr::null_mut(),
            pool_a: pool.0,
            pool_b: pool.1,
            state: vrampool_extent_state::VRAMPOOL_EXTENT_FREE,
        };
        for e in &seg.extents {
            let end = e.addr + e.bytes;
            let state = match e.state {
                BlockState::Live => vrampool_extent_state::VRAMPOOL_EXTENT_LIVE,
                BlockState::Cached => vrampool_extent_state::VRAMPOOL_EXTENT_CACHED,
                BlockState::Retiring => vrampool_extent_state::VRAMPOOL_EXTENT_RETIRING,
                BlockState::Free => vrampool_extent_state::VRAMPOOL_EXTENT_FREE,
            };
            let stream = e.stream.and_then(&raw_of).map_or(std::ptr::null_mut(), handle);
            let whole = vrampool_extent { addr: e.addr, bytes: e.bytes, stream, state, ..base };
            if e.state != BlockState::Live {
                out.push(whole);
                continue;
            }
            // The blocks starting in the extent, cut off at its end: on a pool that is not
            // quiet a block read from the table may reach past memory the picture saw live.
            let mut at = e.addr;
            let first = live.partition_point(|b| b.0 < e.addr);
            for &(addr, held, asked, raw) in live[first..].iter().take_while(|b| b.0 < end) {
                if addr < at {
                    continue;
                }
                if addr > at {
                    out.push(vrampool_extent { addr: at, bytes: addr - at, requested: 0, ..whole });
                }
                let stop = addr.saturating_add(held.max(1)).min(end);
                out.push(vrampool_extent { addr, bytes: stop - addr, requested: asked, stream: handle(raw), ..whole });
                at = stop;
            }
            if at < end {
                out.push(vrampool_extent { addr: at, bytes: end - at, requested: 0, ..whole });
            }
        }
    }
}

fn handle(raw: u64) -> *mut c_void {
    raw as usize as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Extent, Segment};

    fn extent(addr: u64, bytes: u64, state: BlockState) -> Extent {
        Extent { addr, bytes, state, stream: None, requested: None, site: None }
    }

    fn cut(extents: Vec<Extent>, live: &[Live]) -> Vec<(u64, u64, u64, u64, vrampool_extent_state)> {
        let bytes = extents.iter().map(|e| e.bytes).sum();
        let addr = extents[0].addr;
        let snapshot = Snapshot {
            device: String::new(),
            page_size: 2 << 20,
            exact: true,
            sites_tracked: false,
            live_bytes: 0,
            cached_bytes: 0,
            retiring_bytes: 0,
            free_bytes: 0,
            stats: Default::default(),
            segments: vec![Segment { addr, bytes, extents }],
        };
        let mut out = Vec::new();
        picture(&snapshot, live, (0, 0), |_| None, &mut out);
        assert!(out.iter().all(|e| e.segment == addr && e.segment_bytes == bytes));
        out.iter().map(|e| (e.addr, e.bytes, e.requested, e.stream as u64, e.state)).collect()
    }

    use vrampool_extent_state::*;

    #[test]
    fn a_live_extent_is_cut_at_every_block_of_the_table_and_covered_end_to_end() {
        let got = cut(
            vec![extent(0, 1024, BlockState::Live), extent(1024, 1024, BlockState::Free)],
            &[(0, 256, 200, 7), (512, 256, 256, 0)],
        );
        assert_eq!(
            got,
            [
                (0, 256, 200, 7, VRAMPOOL_EXTENT_LIVE),
                (256, 256, 0, 0, VRAMPOOL_EXTENT_LIVE),
                (512, 256, 256, 0, VRAMPOOL_EXTENT_LIVE),
                (768, 256, 0, 0, VRAMPOOL_EXTENT_LIVE),
                (1024, 1024, 0, 0, VRAMPOOL_EXTENT_FREE),
            ]
        );
    }

    #[test]
    fn a_block_outside_live_memory_or_past_its_end_does_not_spill_over() {
        // A block the table still shows over memory the picture saw free (freed between the
        // two reads), and one reaching past its live extent.
        let got = cut(
            vec![extent(0, 512, BlockState::Live), extent(512, 512, BlockState::Cached)],
            &[(256, 1024, 1000, 3), (512, 256, 256, 0)],
        );
        assert_eq!(
            got,
            [
                (0, 256, 0, 0, VRAMPOOL_EXTENT_LIVE),
                (256, 256, 1000, 3, VRAMPOOL_EXTENT_LIVE),
                (512, 512, 0, 0, VRAMPOOL_EXTENT_CACHED),
            ]
        );
    }
}
