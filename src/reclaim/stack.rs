//! A lock-free LIFO of owned items that is only ever pushed to and emptied whole.
//!
//! This is the "open batch" of a stream: frees push, and whoever closes the batch (or looks
//! for a block to reuse on the same stream) takes *every* node with one `swap`. Because no
//! one ever pops a single node, there is no ABA problem and no node is read after another
//! thread could have freed it: a node belongs to the stack until a `swap` hands the whole
//! chain to one thread. So it needs no epoch reclamation, only release/acquire on the head.

use crate::sync::atomic::{AtomicPtr, Ordering};
use std::ptr;

struct Node<T> {
    item: T,
    next: *mut Node<T>,
}

/// A Treiber stack with push, push-a-chain and take-all.
pub struct Stack<T> {
    head: AtomicPtr<Node<T>>,
}

// SAFETY: the stack owns its items and hands each to exactly one thread (through take_all),
// so sharing it between threads is sound when the items may be sent between threads.
unsafe impl<T: Send> Send for Stack<T> {}
// SAFETY: as above: no `&T` is ever given out while the item is in the stack.
unsafe impl<T: Send> Sync for Stack<T> {}

/// A chain of nodes taken off a [`Stack`], owned by one thread.
pub struct Chain<T> {
    head: *mut Node<T>,
}

// SAFETY: the chain is owned exclusively; moving it moves the items.
unsafe impl<T: Send> Send for Chain<T> {}

impl<T> Default for Stack<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Stack<T> {
    /// An empty stack.
    pub fn new() -> Self {
        Stack { head: AtomicPtr::new(ptr::null_mut()) }
    }

    /// Push one item.
    pub fn push(&self, item: T) {
        let node = Box::into_raw(Box::new(Node { item, next: ptr::null_mut() }));
        // SAFETY: `node` is ours alone until the CAS publishes it.
        unsafe { self.link(node, node) };
    }

    /// Put a whole chain back (in any order) with one CAS.
    pub fn push_chain(&self, chain: Chain<T>) {
        let first = chain.head;
        std::mem::forget(chain);
        if first.is_null() {
            return;
        }
        let mut last = first;
        // SAFETY: the chain's nodes are owned by us (taken off a stack or built by Chain::push).
        unsafe {
            while !(*last).next.is_null() {
                last = (*last).next;
            }
            self.link(first, last);
        }
    }

    /// # Safety
    /// `first..=last` is a chain of nodes owned by the caller, `last.next` free to overwrite.
    unsafe fn link(&self, first: *mut Node<T>, last: *mut Node<T>) {
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // SAFETY: `last` is still owned by us: not published until the CAS succeeds.
            unsafe { (*last).next = head };
            // Release: the nodes' contents are visible to whoever takes them.
            match self.head.compare_exchange_weak(head, first, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Take every item at once.
    pub fn take_all(&self) -> Chain<T> {
        // Acquire: pairs with the pushers' Release, so the items are fully visible.
        Chain { head: self.head.swap(ptr::null_mut(), Ordering::Acquire) }
    }

    /// Whether the stack looks empty (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Acquire).is_null()
    }
}

impl<T> Drop for Stack<T> {
    fn drop(&mut self) {
        drop(self.take_all());
    }
}

impl<T> Chain<T> {
    /// An empty chain.
    pub fn new() -> Self {
        Chain { head: ptr::null_mut() }
    }

    /// Add an item to the front.
    pub fn push(&mut self, item: T) {
        self.head = Box::into_raw(Box::new(Node { item, next: self.head }));
    }

    /// Take the front item.
    pub fn pop(&mut self) -> Option<T> {
        if self.head.is_null() {
            return None;
        }
        // SAFETY: non-null nodes of an owned chain came from Box::into_raw and are ours.
        let node = unsafe { Box::from_raw(self.head) };
        self.head = node.next;
        Some(node.item)
    }

    /// Remove and return the first item for which `pick` returns true; the rest stay in order.
    pub fn take_first(&mut self, mut pick: impl FnMut(&T) -> bool) -> Option<T> {
        let mut link: *mut *mut Node<T> = &mut self.head;
        // SAFETY: every node reached from an owned chain is owned by it; `link` always points
        // either at `self.head` or at the `next` field of a node we own.
        unsafe {
            while !(*link).is_null() {
                let node = *link;
                if pick(&(*node).item) {
                    *link = (*node).next;
                    return Some(Box::from_raw(node).item);
                }
                link = &mut (*node).next;
            }
        }
        None
    }

    /// Whether the chain is empty.
    pub fn is_empty(&self) -> bool {
        self.head.is_null()
    }
}

impl<T> Default for Chain<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Iterator for Chain<T> {
    type Item = T;
    fn next(&mut self) -> Option<T> {
        self.pop()
    }
}

impl<T> Drop for Chain<T> {
    fn drop(&mut self) {
        while self.pop().is_some() {}
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn take_all_returns_every_pushed_item_once() {
        let s = Stack::new();
        for i in 0..10 {
            s.push(i);
        }
        let mut got: Vec<_> = s.take_all().collect();
        got.sort();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert!(s.is_empty());
    }

    #[test]
    fn a_chain_pushed_back_is_whole_and_take_first_removes_one() {
        let s = Stack::new();
        for i in 0..5 {
            s.push(i);
        }
        let mut c = s.take_all();
        assert_eq!(c.take_first(|&x| x == 2), Some(2));
        assert_eq!(c.take_first(|&x| x == 2), None);
        s.push_chain(c);
        s.push(9);
        let mut got: Vec<_> = s.take_all().collect();
        got.sort();
        assert_eq!(got, vec![0, 1, 3, 4, 9]);
    }

    #[test]
    fn concurrent_pushes_and_takes_lose_nothing() {
        let s = Stack::new();
        let total = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for t in 0..4 {
                let s = &s;
                let total = &total;
                sc.spawn(move || {
                    for i in 0..10_000usize {
                        s.push(t * 100_000 + i);
                        if i % 7 == 0 {
                            let c = s.take_all();
                            total.fetch_add(c.count(), std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let rest = s.take_all().count();
        assert_eq!(total.into_inner() + rest, 40_000);
    }
}
