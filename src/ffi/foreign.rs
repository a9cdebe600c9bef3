//! Frees on a thread other than the block's owner: claimed at once, settled in batches.
//!
//! A foreign free claims the block's slot with one compare-and-swap and returns; the claim
//! is settled later, after one `membarrier` (see `live`'s docs), which settles every claim
//! taken before it: a system call of 0.1–15 µs (more with other threads running: 14 µs with
//! one spinning thread on the 2-core development VM) shared by up to [`BATCH`] frees. A
//! claim the owner's window still covers waits for the next batch. Until a claim settles,
//! its block counts as allocated; statistics, `empty_cache`, an allocation out of memory,
//! and [`BATCH`] claims or [`BATCH_BYTES`] bytes pending settle them.
//!
//! Where claims cannot be batched (no `membarrier`: owners fence fully and settling costs a
//! fence) or need none (the block has no owner), they settle at once.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_queue::SegQueue;

use super::device::{owners, AbiDevice};
use super::status::{bump, Counter};
use super::words::{self, Parts};
use crate::live::{claimers_fence, Claim, Settled};

/// Claims pending before the freeing thread settles them all.
pub(crate) const BATCH: usize = 256;
/// ... or bytes pending.
pub(crate) const BATCH_BYTES: u64 = 256 << 20;

struct Pending {
    dev: &'static AbiDevice,
    claim: Claim,
}

static PENDING: SegQueue<Pending> = SegQueue::new();
static COUNT: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// Claims not settled yet.
pub(crate) fn pending() -> usize {
    COUNT.load(Ordering::Relaxed)
}

fn bytes_of(claim: &Claim) -> u64 {
    claim.words.size & !(crate::ALIGN - 1)
}

/// Free the block of a won, non-boxed claim: the slot is freed and the block goes back to
/// the pool from this thread.
pub(crate) fn finish(dev: &AbiDevice, claim: &Claim) {
    debug_assert!(!claim.words.ext);
    let (len, token) = words::unpack(claim.words.info);
    let stream = dev.entry.streams.by_token(token).map(|r| r.id);
    dev.table.release(claim);
    match stream {
        Some(stream) => {
            let parts = Parts {
                addr: dev.table.address(claim.index()),
                len,
                size_class: claim.words.size,
                stream,
                pool: dev.pool,
            };
            // SAFETY: the slot held these parts since the block's publication, and the won
            // claim made this thread the one that gives it back (invariant 4).
            drop(unsafe { words::rebuild(parts) });
        }
        // A token no stream has: the slot's words are not what the ABI wrote (a bug).
        // The block is left out of the pool rather than freed on a guessed stream.
        None => bump(Counter::Internal),
    }
}

/// Take over a claim for a free: settle it at once where that costs nothing, else queue it
/// and settle the queue when it is long enough.
pub(crate) fn defer(dev: &'static AbiDevice, claim: Claim) {
    bump(Counter::ForeignFrees);
    let owners = owners();
    if !owners.asymmetric() || claim.words.ext || settles_alone(&claim) {
        match dev.table.settle_now(&claim, owners) {
            Some(Settled::Won) => finish(dev, &claim),
            Some(_) => bump(Counter::LateDoubleFrees),
            // No fence to be had: the claim was undone; the block stays live.
            None => bump(Counter::FailedCalls),
        }
        return;
    }
    let bytes = bytes_of(&claim);
    PENDING.push(Pending { dev, claim });
    let n = COUNT.fetch_add(1, Ordering::AcqRel) + 1;
    let b = BYTES.fetch_add(bytes, Ordering::AcqRel) + bytes;
    if n >= BATCH || b >= BATCH_BYTES {
        settle(false);
    }
}

/// A claim on a block without an owner: no owner window can cover it.
fn settles_alone(claim: &Claim) -> bool {
    claim.owner() == 0
}

/// Settle the pending claims: one fence, then each claim; claims an owner's window still
/// covers are queued again. `all`: repeat until none is left (waiting for owners' windows
/// to close; they are a few instructions long).
pub(crate) fn settle(all: bool) {
    let owners = owners();
    let mut rounds = 0u32;
    loop {
        let mut batch = Vec::new();
        let mut want = COUNT.load(Ordering::Acquire);
        while want > 0 {
            match PENDING.pop() {
                Some(p) => batch.push(p),
                None => break,
            }
            want -= 1;
        }
        if batch.is_empty() {
            return;
        }
        if !claimers_fence(owners) {
            // Try again with the next batch; the blocks stay claimed meanwhile.
            batch.into_iter().for_each(|p| PENDING.push(p));
            return;
        }
        let mut waiting = 0usize;
        for p in batch {
            match p.dev.table.settle(&p.claim, owners) {
                Settled::Wait => {
                    waiting += 1;
                    PENDING.push(p);
                    continue;
                }
                Settled::Won => finish(p.dev, &p.claim),
                Settled::Lost => bump(Counter::LateDoubleFrees),
            }
            COUNT.fetch_sub(1, Ordering::AcqRel);
            BYTES.fetch_sub(bytes_of(&p.claim), Ordering::AcqRel);
        }
        if !all || waiting == 0 {
            return;
        }
        rounds += 1;
        crate::sync::yield_now();
        if rounds > 10_000 {
            return;
        }
    }
}
