//! A lock-free FIFO (Michael & Scott) whose front item can be inspected and popped only if
//! it passes a test: the retire queue of a stream.
//!
//! Batches of freed blocks wait here for their event. Pollers look at the *oldest* batch,
//! query its event, and pop it only if complete; they stop at the first incomplete one, so a
//! stream's reuse is never held up by a later batch and never runs ahead of an earlier one.
//!
//! Items stay inside their node for the node's whole life: a popped node becomes the new
//! sentinel and the item is dropped only when that node is reclaimed by crossbeam-epoch,
//! after every thread that might still be reading it (testing the front item races with
//! popping it) has unpinned. The one thread whose CAS pops a node gets `take` run on the
//! item; parts it must own exclusively (the block list) live in an `UnsafeCell` inside the
//! item, parts others may test concurrently (the event) are only ever read.

use crate::sync::atomic::Ordering;
use crate::sync::epoch::{self, Atomic, Guard, Owned, Shared};

struct Node<T> {
    item: Option<T>,
    next: Atomic<Node<T>>,
}

/// A lock-free FIFO with test-and-pop at the front.
pub struct Fifo<T> {
    head: Atomic<Node<T>>,
    tail: Atomic<Node<T>>,
}

impl<T: Send + Sync> Default for Fifo<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Send + Sync> Fifo<T> {
    /// An empty queue.
    pub fn new() -> Self {
        let q = Fifo { head: Atomic::null(), tail: Atomic::null() };
        let sentinel = Owned::new(Node { item: None, next: Atomic::null() });
        // SAFETY: the queue is not shared yet, so an unprotected guard is fine for installing
        // its first node.
        let guard = unsafe { epoch::unprotected() };
        let s = sentinel.into_shared(guard);
        q.head.store(s, Ordering::Relaxed);
        q.tail.store(s, Ordering::Relaxed);
        q
    }

    /// Append an item.
    pub fn push(&self, item: T, guard: &Guard) {
        let node = Owned::new(Node { item: Some(item), next: Atomic::null() }).into_shared(guard);
        loop {
            let tail = self.tail.load(Ordering::Acquire, guard);
            // SAFETY: the tail is never null and is protected by the guard.
            let t = unsafe { tail.deref() };
            let next = t.next.load(Ordering::Acquire, guard);
            if !next.is_null() {
                // Help a lagging tail along, then retry.
                let _ = self.tail.compare_exchange(tail, next, Ordering::Release, Ordering::Relaxed, guard);
                continue;
            }
            if t.next.compare_exchange(Shared::null(), node, Ordering::Release, Ordering::Relaxed, guard).is_ok() {
                let _ = self.tail.compare_exchange(tail, node, Ordering::Release, Ordering::Relaxed, guard);
                return;
            }
        }
    }

    /// If the oldest item passes `test`, pop it and return `take(item)`. `test` may run
    /// concurrently with other threads' tests of the same item; `take` runs in exactly one
    /// thread per item, the one that popped it.
    pub fn pop_if<R>(&self, mut test: impl FnMut(&T) -> bool, take: impl FnOnce(&T) -> R, guard: &Guard) -> Option<R> {
        loop {
            let head = self.head.load(Ordering::Acquire, guard);
            // SAFETY: the head is never null and is protected by the guard.
            let h = unsafe { head.deref() };
            let next = h.next.load(Ordering::Acquire, guard);
            // SAFETY: a non-null next is protected by the guard.
            let n = unsafe { next.as_ref() }?;
            let item = n.item.as_ref()?;
            if !test(item) {
                return None;
            }
            let tail = self.tail.load(Ordering::Acquire, guard);
            if tail == head {
                // Never let the tail point at a node about to be reclaimed.
                let _ = self.tail.compare_exchange(tail, next, Ordering::Release, Ordering::Relaxed, guard);
            }
            if self.head.compare_exchange(head, next, Ordering::AcqRel, Ordering::Acquire, guard).is_ok() {
                let out = take(item);
                // SAFETY: the old sentinel is unlinked: no new reader can reach it, and the
                // epoch defers its destruction until every current reader has unpinned.
                unsafe { guard.defer_destroy(head) };
                return Some(out);
            }
        }
    }

    /// Run `f` on the oldest item, if any (a snapshot).
    pub fn with_front<R>(&self, f: impl FnOnce(&T) -> R, guard: &Guard) -> Option<R> {
        let head = self.head.load(Ordering::Acquire, guard);
        // SAFETY: the head is never null and is protected by the guard.
        let next = unsafe { head.deref() }.next.load(Ordering::Acquire, guard);
        // SAFETY: a non-null next is protected by the guard.
        unsafe { next.as_ref() }.and_then(|n| n.item.as_ref()).map(f)
    }

    /// Whether the queue looks empty (a snapshot).
    pub fn is_empty(&self, guard: &Guard) -> bool {
        let head = self.head.load(Ordering::Acquire, guard);
        // SAFETY: the head is never null and is protected by the guard.
        unsafe { head.deref() }.next.load(Ordering::Acquire, guard).is_null()
    }

    /// Visit every item (a snapshot; for checks on a quiet pool).
    pub fn for_each(&self, mut f: impl FnMut(&T), guard: &Guard) {
        let head = self.head.load(Ordering::Acquire, guard);
        // SAFETY: the head is never null and is protected by the guard.
        let mut cur = unsafe { head.deref() }.next.load(Ordering::Acquire, guard);
        // SAFETY: each non-null node reached is protected by the guard.
        while let Some(n) = unsafe { cur.as_ref() } {
            if let Some(item) = n.item.as_ref() {
                f(item);
            }
            cur = n.next.load(Ordering::Acquire, guard);
        }
    }
}

impl<T> Drop for Fifo<T> {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no other thread can reach the queue, so its nodes can be freed
        // at once, each exactly once.
        unsafe {
            let guard = epoch::unprotected();
            let mut cur = self.head.load(Ordering::Relaxed, guard);
            while !cur.is_null() {
                let next = cur.deref().next.load(Ordering::Relaxed, guard);
                drop(cur.into_owned());
                cur = next;
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn items_come_out_oldest_first_and_only_when_they_pass() {
        let q = Fifo::new();
        let g = epoch::pin();
        for i in 0..5 {
            q.push(i, &g);
        }
        assert_eq!(q.pop_if(|&x| x == 0, |&x| x, &g), Some(0));
        assert_eq!(q.pop_if(|&x| x == 2, |&x| x, &g), None, "1 is older and fails the test");
        assert_eq!(q.with_front(|&x| x, &g), Some(1));
        let mut rest = vec![];
        while let Some(x) = q.pop_if(|_| true, |&x| x, &g) {
            rest.push(x);
        }
        assert_eq!(rest, vec![1, 2, 3, 4]);
        assert!(q.is_empty(&g));
    }

    #[test]
    fn concurrent_producers_and_consumers_deliver_each_item_once() {
        let q = Fifo::new();
        let taken = AtomicUsize::new(0);
        let sum = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..2 {
                let q = &q;
                s.spawn(move || {
                    for i in 0..20_000usize {
                        q.push(t * 1_000_000 + i, &epoch::pin());
                    }
                });
            }
            for _ in 0..2 {
                let (q, taken, sum) = (&q, &taken, &sum);
                s.spawn(move || {
                    while taken.load(Ordering::Relaxed) < 40_000 {
                        if let Some(x) = q.pop_if(|_| true, |&x| x, &epoch::pin()) {
                            taken.fetch_add(1, Ordering::Relaxed);
                            sum.fetch_add(x, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let want: usize = (0..20_000).sum::<usize>() * 2 + 20_000 * 1_000_000;
        assert_eq!(sum.into_inner(), want);
    }
}
