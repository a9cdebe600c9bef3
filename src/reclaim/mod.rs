//! Stream-ordered reclamation: how freed memory becomes safe for other streams.
//!
//! - [`fence`]: memory freed on a stream is stamped with a fence, the number of the next
//!   event to be recorded on that stream; it is reusable at once on the same stream and by
//!   another stream once that event is complete, or once the other stream waits on it on
//!   the device. Events are recorded only when another stream needs one, so one event
//!   covers every free on its stream before it.
//! - [`waited`]: what each stream has already been made to wait for on the device, so that
//!   memory those waits cover is ready for it with no further wait.
//! - [`Retire`]: blocks used on several streams (`record_stream`) wait, each behind one
//!   event per stream it was used on, in a queue of [`Batch`]es; pollers test the oldest
//!   batch's events and stop at the first incomplete one.
//!
//! Lock-free because frees come from every worker thread at once; the queues' nodes are
//! reclaimed with crossbeam-epoch since pollers read a batch's event while another thread
//! may be popping it. Event types are generic so that loom models can use fake events.

pub mod fence;
pub mod fifo;
pub mod stack;
pub mod waited;

pub use fifo::Fifo;
pub use stack::{Chain, Stack};

use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::epoch::Guard;
use crate::sync::UnsafeCell;

/// A piece of the arena: its address and its rounded size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Device address.
    pub addr: u64,
    /// Bytes held in the arena (the request rounded up to 256).
    pub size: u64,
}

/// Blocks waiting for one event.
pub struct Batch<E> {
    event: Option<E>,
    bytes: u64,
    /// Never written after the batch is made: the thread that pops it copies them, so that
    /// walks (checks, snapshots) may read them while another thread pops.
    spans: UnsafeCell<Vec<Span>>,
}

// SAFETY: `spans` is written only through `&mut` (never once shared); every thread only
// reads it, `event` and `bytes`.
unsafe impl<E: Sync> Sync for Batch<E> {}

impl<E> Batch<E> {
    /// A batch of `spans` guarded by `event` (None: complete once it is the oldest).
    pub fn new(event: Option<E>, spans: Vec<Span>) -> Self {
        let bytes = spans.iter().map(|s| s.size).sum();
        Batch { event, bytes, spans: UnsafeCell::new(spans) }
    }

    /// Bytes in the batch.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The batch's event.
    pub fn event(&self) -> Option<&E> {
        self.event.as_ref()
    }

    /// Visit the spans (for checks and snapshots).
    pub fn for_each_span(&self, mut f: impl FnMut(Span)) {
        // SAFETY: reading only, and nobody writes `spans` once the batch is shared.
        self.spans.with(|v| unsafe { (*v).iter().for_each(|s| f(*s)) });
    }

    /// # Safety
    /// Only the thread that popped this batch may call this, once (its spans go back once).
    unsafe fn take_spans(&self) -> Vec<Span> {
        // SAFETY: reading only, as in `for_each_span`; the batch's own copy is dropped with
        // it, once the epoch lets it go.
        self.spans.with(|v| unsafe { (*v).clone() })
    }
}

/// Blocks waiting for their batch's events, oldest batch first.
pub struct Retire<E> {
    pending: Fifo<Batch<E>>,
    pending_bytes: AtomicU64,
}

impl<E: Send + Sync> Default for Retire<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Send + Sync> Retire<E> {
    /// Empty.
    pub fn new() -> Self {
        Retire { pending: Fifo::new(), pending_bytes: AtomicU64::new(0) }
    }

    /// Queue `spans` behind `event` (None: released as soon as the batch is the oldest).
    /// Returns the bytes queued.
    pub fn queue_batch(&self, event: Option<E>, spans: Vec<Span>, guard: &Guard) -> u64 {
        let batch = Batch::new(event, spans);
        let bytes = batch.bytes;
        self.pending_bytes.fetch_add(bytes, Ordering::AcqRel);
        self.pending.push(batch, guard);
        bytes
    }

    /// Release every batch, oldest first, whose event `complete` says is done; stop at the
    /// first that is not. Each released span goes to `release`. Returns (batches, bytes).
    pub fn poll(&self, mut complete: impl FnMut(&E) -> bool, release: impl FnMut(Span), guard: &Guard) -> (u64, u64) {
        self.take_while(|b| b.event.as_ref().is_none_or(&mut complete), release, u64::MAX, guard)
    }

    /// Release batches, oldest first, while `take` passes the oldest and fewer than `until`
    /// bytes have gone. `take` may run on a batch that another thread then pops (it must
    /// leave the batch as it found it); each span goes to `release` once, in the thread that
    /// popped its batch. Returns (batches, bytes).
    pub fn take_while(
        &self,
        mut take: impl FnMut(&Batch<E>) -> bool,
        mut release: impl FnMut(Span),
        until: u64,
        guard: &Guard,
    ) -> (u64, u64) {
        let (mut batches, mut bytes) = (0, 0);
        while bytes < until {
            let taken = self.pending.pop_if(
                &mut take,
                |b| {
                    // SAFETY: `take_spans` runs only in the thread whose pop succeeded, once.
                    (unsafe { b.take_spans() }, b.bytes)
                },
                guard,
            );
            let Some((spans, b)) = taken else { break };
            self.pending_bytes.fetch_sub(b, Ordering::AcqRel);
            spans.into_iter().for_each(&mut release);
            batches += 1;
            bytes += b;
        }
        (batches, bytes)
    }

    /// Run `f` on the oldest pending batch's event, if there is one with an event.
    pub fn with_oldest_event<R>(&self, f: impl FnOnce(&E) -> R, guard: &Guard) -> Option<R> {
        self.pending.with_front(|b| b.event.as_ref().map(f), guard).flatten()
    }

    /// Whether any batch is pending.
    pub fn has_pending(&self, guard: &Guard) -> bool {
        !self.pending.is_empty(guard)
    }

    /// Bytes in pending batches.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes.load(Ordering::Acquire)
    }

    /// Visit every span held (for checks on a quiet pool).
    pub fn for_each_span(&self, mut f: impl FnMut(Span), guard: &Guard) {
        self.pending.for_each(|b| b.for_each_span(&mut f), guard);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::epoch;
    use std::sync::atomic::AtomicBool;

    fn span(addr: u64) -> Span {
        Span { addr, size: 256 }
    }

    #[test]
    fn a_batch_is_released_only_once_its_event_completes() {
        let r: Retire<AtomicBool> = Retire::new();
        let g = epoch::pin();
        assert_eq!(r.queue_batch(Some(AtomicBool::new(false)), vec![span(0), span(256)], &g), 512);
        let mut out = vec![];
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |s| out.push(s), &g), (0, 0));
        r.with_oldest_event(|e| e.store(true, Ordering::Release), &g);
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |s| out.push(s), &g), (1, 512));
        assert_eq!(out, vec![span(0), span(256)]);
        assert_eq!(r.pending_bytes(), 0);
    }

    #[test]
    fn polling_stops_at_the_first_incomplete_batch() {
        let r: Retire<AtomicBool> = Retire::new();
        let g = epoch::pin();
        r.queue_batch(Some(AtomicBool::new(false)), vec![span(0)], &g);
        r.queue_batch(Some(AtomicBool::new(true)), vec![span(256)], &g);
        let mut n = 0;
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |_| n += 1, &g).0, 0, "a newer complete batch must wait");
        assert_eq!(n, 0);
    }

    #[test]
    fn a_batch_without_an_event_waits_only_for_older_batches() {
        let r: Retire<AtomicBool> = Retire::new();
        let g = epoch::pin();
        r.queue_batch(Some(AtomicBool::new(false)), vec![span(0)], &g);
        r.queue_batch(None, vec![span(512)], &g);
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |_| {}, &g).0, 0);
        r.with_oldest_event(|e| e.store(true, Ordering::Release), &g);
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |_| {}, &g), (2, 512));
    }

    #[test]
    fn an_early_take_stops_once_it_has_the_bytes_it_wants_or_at_a_batch_it_refuses() {
        let r: Retire<AtomicBool> = Retire::new();
        let g = epoch::pin();
        for a in 0..4 {
            r.queue_batch(Some(AtomicBool::new(false)), vec![span(a * 256)], &g);
        }
        let mut out = vec![];
        assert_eq!(r.take_while(|_| true, |s| out.push(s.addr), 300, &g), (2, 512), "two batches reach 300 bytes");
        assert_eq!(out, vec![0, 256], "oldest first");
        assert_eq!(r.take_while(|b| b.bytes() > 256, |_| {}, u64::MAX, &g), (0, 0), "the oldest is refused");
        assert_eq!(r.pending_bytes(), 512);
    }
}
