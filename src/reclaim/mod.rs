//! Stream-ordered reclamation: where freed blocks wait until no stream can still use them.
//!
//! Each stream the pool has seen owns a [`StreamRetire`]:
//!
//! - **open**: blocks freed on the stream since its last batch closed, in a push-only,
//!   take-all [`Stack`]. They may be reused *on the same stream* at once — stream order
//!   already serialises the old use before the new one — and pushing never calls the
//!   device, so a free inside a host function or a thread-local destructor is safe: the open
//!   stack is also the deferred list that the next slow path drains.
//! - **pending**: closed batches in a [`Fifo`], each guarded by ONE event recorded on the
//!   stream when the batch closed (one `cuEventRecord` per batch, never one per free).
//!   Pollers test the oldest batch's event and stop at the first incomplete one.
//!
//! A batch whose event is `None` completes as soon as it is the oldest: it holds blocks freed
//! after their stream was destroyed (the stream's final batch, ahead of it, carries the event
//! that covers every piece of work the stream ever ran).
//!
//! Lock-free because frees come from every worker thread at once; the FIFO's nodes are
//! reclaimed with crossbeam-epoch since pollers read a batch's event while another thread may
//! be popping it. `E` is the event type, generic so that loom models can use a fake event.

pub mod fifo;
pub mod stack;

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
    /// Taken by the one thread that pops the batch; never touched by testers.
    spans: UnsafeCell<Vec<Span>>,
}

// SAFETY: `spans` is only accessed by the single thread whose pop succeeded (Fifo::pop_if's
// `take`), or through `&mut`; every other thread only reads `event` and `bytes`.
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

    /// Visit the spans (for checks on a quiet pool).
    pub fn for_each_span(&self, mut f: impl FnMut(Span)) {
        // SAFETY: reading only; used by checks when no thread pops (a quiet pool).
        self.spans.with(|v| unsafe { (*v).iter().for_each(|s| f(*s)) });
    }

    /// # Safety
    /// Only the thread that popped this batch may call this, once.
    unsafe fn take_spans(&self) -> Vec<Span> {
        // SAFETY: the caller popped the batch, so no one else touches `spans`.
        self.spans.with_mut(|v| unsafe { std::mem::take(&mut *v) })
    }
}

/// The retire state of one stream.
pub struct StreamRetire<E> {
    open: Stack<Span>,
    open_blocks: AtomicU64,
    open_bytes: AtomicU64,
    pending: Fifo<Batch<E>>,
    pending_bytes: AtomicU64,
}

impl<E: Send + Sync> Default for StreamRetire<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Send + Sync> StreamRetire<E> {
    /// Empty.
    pub fn new() -> Self {
        StreamRetire {
            open: Stack::new(),
            open_blocks: AtomicU64::new(0),
            open_bytes: AtomicU64::new(0),
            pending: Fifo::new(),
            pending_bytes: AtomicU64::new(0),
        }
    }

    /// A block freed on this stream joins the open batch. Returns the open batch's block
    /// count and bytes after the push (the caller decides whether to close it).
    pub fn free(&self, span: Span) -> (u64, u64) {
        // Counters first: a closer that takes the span must find them covering it, so they
        // never go below zero.
        let blocks = self.open_blocks.fetch_add(1, Ordering::AcqRel) + 1;
        let bytes = self.open_bytes.fetch_add(span.size, Ordering::AcqRel) + span.size;
        self.open.push(span);
        (blocks, bytes)
    }

    /// Take an open block that `fits`, for an allocation on this same stream.
    pub fn reuse(&self, fits: impl FnMut(&Span) -> bool) -> Option<Span> {
        if self.open.is_empty() {
            return None;
        }
        let mut chain = self.open.take_all();
        let found = chain.take_first(fits);
        self.open.push_chain(chain);
        if let Some(s) = found {
            self.open_blocks.fetch_sub(1, Ordering::AcqRel);
            self.open_bytes.fetch_sub(s.size, Ordering::AcqRel);
        }
        found
    }

    /// Close the open batch: take its blocks, get an event for them from `record` (which
    /// records it on the stream), and queue the batch. If `record` fails the blocks go back
    /// to the open batch and the error is returned. Returns the bytes closed.
    pub fn close<Er>(&self, record: impl FnOnce() -> Result<Option<E>, Er>, guard: &Guard) -> Result<u64, Er> {
        let chain = self.open.take_all();
        if chain.is_empty() {
            return Ok(0);
        }
        let event = match record() {
            Ok(e) => e,
            Err(e) => {
                self.open.push_chain(chain);
                return Err(e);
            }
        };
        let spans: Vec<Span> = chain.collect();
        Ok(self.queue(event, spans, true, guard))
    }

    /// Queue spans that are not in the open batch behind an event (or none).
    pub fn queue_batch(&self, event: Option<E>, spans: Vec<Span>, guard: &Guard) -> u64 {
        self.queue(event, spans, false, guard)
    }

    fn queue(&self, event: Option<E>, spans: Vec<Span>, from_open: bool, guard: &Guard) -> u64 {
        let batch = Batch::new(event, spans);
        let bytes = batch.bytes;
        if from_open {
            let n = batch.spans.with(|v| {
                // SAFETY: the batch is not shared yet.
                unsafe { (*v).len() as u64 }
            });
            self.open_blocks.fetch_sub(n, Ordering::AcqRel);
            self.open_bytes.fetch_sub(bytes, Ordering::AcqRel);
        }
        self.pending_bytes.fetch_add(bytes, Ordering::AcqRel);
        self.pending.push(batch, guard);
        bytes
    }

    /// Release every batch, oldest first, whose event `complete` says is done; stop at the
    /// first that is not. Each released span goes to `release`. Returns (batches, bytes).
    pub fn poll(
        &self,
        mut complete: impl FnMut(&E) -> bool,
        mut release: impl FnMut(Span),
        guard: &Guard,
    ) -> (u64, u64) {
        let (mut batches, mut bytes) = (0, 0);
        loop {
            let taken = self.pending.pop_if(
                |b| b.event.as_ref().is_none_or(&mut complete),
                |b| {
                    // SAFETY: `take` runs only in the thread whose pop succeeded, once.
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

    /// Bytes in the open batch (reusable on this stream).
    pub fn open_bytes(&self) -> u64 {
        self.open_bytes.load(Ordering::Acquire)
    }

    /// Blocks in the open batch.
    pub fn open_blocks(&self) -> u64 {
        self.open_blocks.load(Ordering::Acquire)
    }

    /// Bytes in pending batches.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes.load(Ordering::Acquire)
    }

    /// Visit every span held, open or pending (for checks on a quiet pool).
    pub fn for_each_span(&self, mut f: impl FnMut(Span), guard: &Guard) {
        let chain = self.open.take_all();
        let spans: Vec<Span> = chain.collect();
        for s in &spans {
            f(*s);
        }
        for s in spans {
            self.open.push(s);
        }
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
    fn a_closed_batch_is_released_only_once_its_event_completes() {
        let r: StreamRetire<AtomicBool> = StreamRetire::new();
        let g = epoch::pin();
        r.free(span(0));
        r.free(span(256));
        assert_eq!(r.open_bytes(), 512);
        assert_eq!(r.close(|| Ok::<_, ()>(Some(AtomicBool::new(false))), &g), Ok(512));
        assert_eq!((r.open_bytes(), r.pending_bytes()), (0, 512));
        let mut out = vec![];
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |s| out.push(s), &g), (0, 0));
        r.with_oldest_event(|e| e.store(true, Ordering::Release), &g);
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |s| out.push(s), &g), (1, 512));
        out.sort_by_key(|s| s.addr);
        assert_eq!(out, vec![span(0), span(256)]);
        assert_eq!(r.pending_bytes(), 0);
    }

    #[test]
    fn polling_stops_at_the_first_incomplete_batch() {
        let r: StreamRetire<AtomicBool> = StreamRetire::new();
        let g = epoch::pin();
        r.free(span(0));
        r.close(|| Ok::<_, ()>(Some(AtomicBool::new(false))), &g).unwrap();
        r.free(span(256));
        r.close(|| Ok::<_, ()>(Some(AtomicBool::new(true))), &g).unwrap();
        let mut n = 0;
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |_| n += 1, &g).0, 0, "a newer complete batch must wait");
        assert_eq!(n, 0);
    }

    #[test]
    fn a_failed_record_puts_the_blocks_back_in_the_open_batch() {
        let r: StreamRetire<AtomicBool> = StreamRetire::new();
        let g = epoch::pin();
        r.free(span(0));
        assert_eq!(r.close(|| Err("not permitted"), &g), Err("not permitted"));
        assert_eq!(r.open_bytes(), 256);
        assert_eq!(r.reuse(|s| s.size >= 256), Some(span(0)));
        assert_eq!(r.open_bytes(), 0);
    }

    #[test]
    fn a_batch_without_an_event_waits_only_for_older_batches() {
        let r: StreamRetire<AtomicBool> = StreamRetire::new();
        let g = epoch::pin();
        r.free(span(0));
        r.close(|| Ok::<_, ()>(Some(AtomicBool::new(false))), &g).unwrap();
        r.queue_batch(None, vec![span(512)], &g);
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |_| {}, &g).0, 0);
        r.with_oldest_event(|e| e.store(true, Ordering::Release), &g);
        assert_eq!(r.poll(|e| e.load(Ordering::Acquire), |_| {}, &g), (2, 512));
    }
}
