//! A lock-free hierarchical bitmap over `0..n` whose nodes are made the first time a bit under
//! them is set.
//!
//! # What it owns
//!
//! A tree of nodes. A *leaf node* holds up to 64 leaf words (`AtomicU64`, 4096 bits); an
//! *inner node* holds up to 64 child pointers (`AtomicPtr<Node>`). Every node also holds a
//! `summary` word: bit `c` is a *hint* that child `c` (a leaf word, or a child node) may be
//! non-empty. The root is made with the bitmap; every other node is made by the first `set`
//! below it, published with a CAS into its parent's slot (the loser of a publishing race frees
//! its own node), and freed only when the bitmap drops. Metadata therefore grows with the
//! parts of the index space in use, not with `n`: a bitmap of 2^34 bits with one bit set holds
//! one node per level. Nodes at the end of the index space are made only as wide as they need
//! to be, which also keeps loom models of tiny bitmaps small.
//!
//! # Invariants
//!
//! * The leaf words are the truth: bit `i` is set iff `i` is in the set. Summaries are hints.
//! * Hint liveness: once every operation in progress has returned, every non-empty child has
//!   its hint set in its parent, up to the root. A hint may be set over an empty child (it is
//!   "stale"); searches clean stale hints as they meet them.
//!
//! # Why the hints stay correct without a lock
//!
//! A setter sets its leaf bit, then walks up the ancestors, bottom up: where the hint bit is
//! already set it stops (whoever set it carries the hint on up), else it sets it with
//! `fetch_or`. A searcher that finds a hint set over an empty child clears it with
//! `fetch_and`, then re-reads the child *with a read-modify-write* (`fetch_or(0)`), and if
//! the child is non-empty sets the hint again and walks up as a setter would. Every write to
//! a hint or a leaf word is an `AcqRel` read-modify-write. Take a setter S, which made the
//! child non-empty with an RMW and then read the hint, and a clearer C of that hint, which
//! cleared it and then re-read the child with an RMW. The two RMWs on the child are ordered
//! in the child's modification order:
//!
//! * C's re-read comes after S's write: it sees the child non-empty (or a later value,
//!   written by someone who owns the hint from then on) and sets the hint again.
//! * C's re-read comes before S's write: S's RMW reads from C's release RMW, so C's clearing
//!   of the hint (sequenced before its re-read) happens-before S's read of the hint, which
//!   then cannot see the hint still set: S sets it.
//!
//! Either way the hint is not lost, and the same argument holds level by level (a setter
//! that stops at a set hint relies on the one that set it, to which the argument applies in
//! turn). The re-read must be an RMW: with a plain load, C's load and S's load could each
//! miss the other's write (store buffering), and a set hint could be left over an empty
//! summary. Stopping at a set hint makes a set one RMW in the common case, where the path
//! is already hinted. No one ever waits for anyone: `set` is a bounded number of RMWs,
//! `try_clear` one, and a search retries only when another thread changed the bitmap under
//! it (lock-free, not wait-free).
//!
//! The search answer is a hint too: the lowest index that was set at some moment during the
//! search; callers claim it with [`HBitmap::try_clear`] and search again if they lose.

use crate::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

/// log2 of the fan-out of every node (64 children, 64 bits per word).
const FAN_SHIFT: u32 = 6;
/// Bits covered by one leaf node: 64 words of 64 bits.
const LEAF_SHIFT: u32 = 2 * FAN_SHIFT;
/// Levels of the deepest tree (root height 8, 2^60 bits).
const MAX_HEIGHT: usize = 9;

/// What a node holds below its summary.
enum Slots {
    /// Leaf words: the bits themselves.
    Leaf(Box<[AtomicU64]>),
    /// Child nodes, null until first used.
    Inner(Box<[AtomicPtr<Node>]>),
}

struct Node {
    /// Bit `c`: child `c` may be non-empty.
    summary: AtomicU64,
    slots: Slots,
}

impl Node {
    /// A node of `height` (0 = leaf node) whose first bit is `start`, in a bitmap of `n` bits:
    /// only as many slots as reach `n`.
    fn new(height: usize, start: usize, n: usize) -> Node {
        let child_shift = child_shift(height);
        let remaining = n.saturating_sub(start);
        let slots = remaining.div_ceil(1usize << child_shift).clamp(1, 64);
        let slots = if height == 0 {
            Slots::Leaf((0..slots).map(|_| AtomicU64::new(0)).collect())
        } else {
            Slots::Inner((0..slots).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect())
        };
        Node { summary: AtomicU64::new(0), slots }
    }
}

/// log2 of the bits one child of a node of `height` covers (a leaf word covers 64).
fn child_shift(height: usize) -> u32 {
    FAN_SHIFT + FAN_SHIFT * height as u32
}

/// What [`HBitmap::set`] saw in the leaf word before it set its bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetOutcome {
    /// The bit was already set (nothing changed).
    pub was_set: bool,
    /// The buddy bit (`i ^ 1`, in the same word) was set.
    pub buddy_was_set: bool,
}

/// A concurrent set of indices in `0..n`, with lazily made nodes. See the module docs.
pub struct HBitmap {
    n: usize,
    /// Height of the root: 0 when one leaf node covers `n`.
    height: usize,
    root: Node,
}

// SAFETY: every field shared between threads is an atomic; the raw child pointers point to
// nodes owned by this bitmap that are freed only in `Drop`, which needs exclusive access.
unsafe impl Send for HBitmap {}
// SAFETY: as above: `&HBitmap` only ever reads nodes through atomics and never frees them.
unsafe impl Sync for HBitmap {}

impl std::fmt::Debug for HBitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HBitmap").field("n", &self.n).field("height", &self.height).finish_non_exhaustive()
    }
}

impl HBitmap {
    /// An empty set over `0..n`. Only the root node is made now.
    pub fn new(n: usize) -> HBitmap {
        // A root of height 8 covers 2^60 bits; nothing this crate builds comes near that.
        let n = n.min(1 << 60);
        let mut height = 0;
        while height < MAX_HEIGHT - 1 && n.saturating_sub(1) >> (LEAF_SHIFT + FAN_SHIFT * height as u32) != 0 {
            height += 1;
        }
        HBitmap { n, height, root: Node::new(height, 0, n) }
    }

    /// The size of the index space.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True when the index space is empty (`n == 0`), not when no bit is set.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Follow a child pointer. `None` while the child has not been made.
    fn child(slot: &AtomicPtr<Node>) -> Option<&Node> {
        let p = slot.load(Ordering::Acquire);
        // SAFETY: a non-null slot was published by `child_or_make` from `Box::into_raw` with a
        // release CAS (our acquire load sees the node initialised) and is freed only by
        // `Drop`, which cannot run while `&self` (and so this borrow) lives.
        unsafe { p.as_ref() }
    }

    /// Follow a child pointer, making and publishing the child if it is missing.
    fn child_or_make(slot: &AtomicPtr<Node>, height: usize, start: usize, n: usize) -> &Node {
        if let Some(c) = Self::child(slot) {
            return c;
        }
        let fresh = Box::into_raw(Box::new(Node::new(height, start, n)));
        match slot.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: we just published `fresh`; it lives until the bitmap drops (see `child`).
            Ok(_) => unsafe { &*fresh },
            Err(theirs) => {
                // SAFETY: `fresh` came from `Box::into_raw` above and was never shared: the
                // CAS that would have published it failed.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: `theirs` is non-null (the CAS failed against it) and published as in
                // `child`.
                unsafe { &*theirs }
            }
        }
    }

    /// The leaf word holding bit `i`, and the path of (node, child index) from the root down
    /// to the leaf node, where the last entry is (leaf node, word index). Makes missing nodes
    /// when `make`; otherwise `None` where a node is missing.
    fn descend<'a>(
        &'a self,
        i: usize,
        make: bool,
        path: &mut [(&'a Node, usize); MAX_HEIGHT + 1],
    ) -> Option<(&'a AtomicU64, usize)> {
        let mut node = &self.root;
        let mut height = self.height;
        let mut depth = 0;
        loop {
            let shift = child_shift(height);
            let c = (i >> shift) & 63;
            path[depth] = (node, c);
            depth += 1;
            match &node.slots {
                Slots::Leaf(words) => return words.get(c).map(|w| (w, depth)),
                Slots::Inner(children) => {
                    let slot = children.get(c)?;
                    let start = (i >> shift) << shift;
                    node = if make { Self::child_or_make(slot, height - 1, start, self.n) } else { Self::child(slot)? };
                    height -= 1;
                }
            }
        }
    }

    /// Set the hint bits along `path`, bottom up, after making a child non-empty with an RMW:
    /// stop at the first hint already set (see the module docs for why that is enough).
    fn mark_up(path: &[(&Node, usize)]) {
        for (node, c) in path.iter().rev() {
            let bit = 1u64 << c;
            if node.summary.load(Ordering::Acquire) & bit != 0 {
                return;
            }
            node.summary.fetch_or(bit, Ordering::AcqRel);
        }
    }

    /// Add `i` to the set (then set the hints above it). Returns what the leaf word held
    /// before; `None` when `i` is out of range.
    pub fn set(&self, i: usize) -> Option<SetOutcome> {
        if i >= self.n {
            return None;
        }
        let mut path = [(&self.root, 0usize); MAX_HEIGHT + 1];
        let (word, depth) = self.descend(i, true, &mut path)?;
        let bit = 1u64 << (i & 63);
        let buddy = 1u64 << ((i ^ 1) & 63);
        let old = word.fetch_or(bit, Ordering::AcqRel);
        Self::mark_up(&path[..depth]);
        Some(SetOutcome { was_set: old & bit != 0, buddy_was_set: old & buddy != 0 })
    }

    /// Add the indices `word * 64 + b` for every bit `b` of `mask` (one leaf word's worth,
    /// in one RMW), then set the hints above them. False, with nothing changed, when `mask`
    /// is empty or reaches past the end.
    pub fn set_word(&self, word: usize, mask: u64) -> bool {
        let Some(first) = word.checked_mul(64) else { return false };
        if mask == 0 || first + (63 - mask.leading_zeros() as usize) >= self.n {
            return false;
        }
        let mut path = [(&self.root, 0usize); MAX_HEIGHT + 1];
        let Some((w, depth)) = self.descend(first, true, &mut path) else { return false };
        w.fetch_or(mask, Ordering::AcqRel);
        Self::mark_up(&path[..depth]);
        true
    }

    /// Remove `i`; true if this call removed it (it was set).
    pub fn try_clear(&self, i: usize) -> bool {
        if i >= self.n {
            return false;
        }
        let mut path = [(&self.root, 0usize); MAX_HEIGHT + 1];
        let Some((word, _)) = self.descend(i, false, &mut path) else { return false };
        let bit = 1u64 << (i & 63);
        word.fetch_and(!bit, Ordering::AcqRel) & bit != 0
    }

    /// Remove both `i & !1` and `i | 1`, only if both are set at once; true on success. This
    /// is the buddy-merge step: the pair always lives in one leaf word.
    pub fn try_clear_pair(&self, i: usize) -> bool {
        if (i | 1) >= self.n {
            return false;
        }
        let mut path = [(&self.root, 0usize); MAX_HEIGHT + 1];
        let Some((word, _)) = self.descend(i, false, &mut path) else { return false };
        let mask = 3u64 << (i & 62);
        let mut cur = word.load(Ordering::Acquire);
        loop {
            if cur & mask != mask {
                return false;
            }
            match word.compare_exchange_weak(cur, cur & !mask, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// True if `i` is set (a snapshot).
    pub fn contains(&self, i: usize) -> bool {
        if i >= self.n {
            return false;
        }
        let mut path = [(&self.root, 0usize); MAX_HEIGHT + 1];
        self.descend(i, false, &mut path).is_some_and(|(w, _)| w.load(Ordering::Acquire) & (1u64 << (i & 63)) != 0)
    }

    /// The lowest set index, following the hints and cleaning stale ones. A hint: the answer
    /// was set at some moment of the search; `None` means the search found nothing, which is
    /// exact when no other thread is changing the bitmap.
    pub fn find_first_set(&self) -> Option<usize> {
        let mut path = [(&self.root, 0usize); MAX_HEIGHT + 1];
        let mut depth = 0; // entries of `path` above `node`
        let mut node = &self.root;
        let mut height = self.height;
        let mut start = 0usize;
        loop {
            let s = node.summary.load(Ordering::Acquire);
            if s == 0 {
                // `node` looks empty: drop its hint in the parent, then look again, because a
                // setter may have filled it between our load and our `fetch_and`.
                if depth == 0 {
                    return None;
                }
                let (parent, c) = path[depth - 1];
                parent.summary.fetch_and(!(1u64 << c), Ordering::AcqRel);
                // An RMW, not a load: see the module docs.
                if node.summary.fetch_or(0, Ordering::AcqRel) != 0 {
                    Self::mark_up(&path[..depth]);
                    continue;
                }
                depth -= 1;
                node = parent;
                height += 1;
                start &= !((1usize << child_shift(height)).wrapping_mul(64).wrapping_sub(1));
                continue;
            }
            let c = s.trailing_zeros() as usize;
            let shift = child_shift(height);
            match &node.slots {
                Slots::Leaf(words) => {
                    let Some(word) = words.get(c) else {
                        // A hint past the end: never set by `set`; drop it.
                        node.summary.fetch_and(!(1u64 << c), Ordering::AcqRel);
                        continue;
                    };
                    let w = word.load(Ordering::Acquire);
                    if w != 0 {
                        return Some(start + (c << shift) + w.trailing_zeros() as usize);
                    }
                    node.summary.fetch_and(!(1u64 << c), Ordering::AcqRel);
                    // An RMW, not a load: see the module docs.
                    if word.fetch_or(0, Ordering::AcqRel) != 0 {
                        path[depth] = (node, c);
                        Self::mark_up(&path[..=depth]);
                    }
                }
                Slots::Inner(children) => match children.get(c).and_then(Self::child) {
                    Some(child) => {
                        path[depth] = (node, c);
                        depth += 1;
                        node = child;
                        height -= 1;
                        start += c << shift;
                    }
                    None => {
                        // A hint is set only after its child is published, so this is a hint
                        // past the end; drop it.
                        node.summary.fetch_and(!(1u64 << c), Ordering::AcqRel);
                    }
                },
            }
        }
    }

    /// Call `f` on every set index in increasing order, reading the leaf words of every node
    /// made so far (hints ignored). Stops early when `f` returns false; returns false then.
    /// A snapshot per word: exact when no other thread is changing the bitmap.
    pub fn walk(&self, f: &mut dyn FnMut(usize) -> bool) -> bool {
        Self::walk_node(&self.root, self.height, 0, f)
    }

    fn walk_node(node: &Node, height: usize, start: usize, f: &mut dyn FnMut(usize) -> bool) -> bool {
        let shift = child_shift(height);
        match &node.slots {
            Slots::Leaf(words) => {
                for (c, word) in words.iter().enumerate() {
                    let mut w = word.load(Ordering::Acquire);
                    while w != 0 {
                        if !f(start + (c << shift) + w.trailing_zeros() as usize) {
                            return false;
                        }
                        w &= w - 1;
                    }
                }
            }
            Slots::Inner(children) => {
                for (c, slot) in children.iter().enumerate() {
                    if let Some(child) = Self::child(slot) {
                        if !Self::walk_node(child, height - 1, start + (c << shift), f) {
                            return false;
                        }
                    }
                }
            }
        }
        true
    }

    /// True if any bit is set, by a walk of the leaf words (hints ignored).
    pub fn any_set(&self) -> bool {
        !self.walk(&mut |_| false)
    }

    /// Nodes made so far, the root included (for tests of lazy growth).
    pub fn nodes(&self) -> usize {
        fn count(node: &Node) -> usize {
            match &node.slots {
                Slots::Leaf(_) => 1,
                Slots::Inner(children) => 1 + children.iter().filter_map(HBitmap::child).map(count).sum::<usize>(),
            }
        }
        count(&self.root)
    }
}

impl Drop for HBitmap {
    fn drop(&mut self) {
        fn free(node: &mut Node) {
            if let Slots::Inner(children) = &mut node.slots {
                for slot in children.iter() {
                    let p = slot.swap(std::ptr::null_mut(), Ordering::Acquire);
                    if !p.is_null() {
                        // SAFETY: `p` came from `Box::into_raw` in `child_or_make`, was
                        // published once, and we are its only owner now (`&mut self`); the
                        // swap leaves null behind, so it is freed once.
                        let mut b = unsafe { Box::from_raw(p) };
                        free(&mut b);
                    }
                }
            }
        }
        free(&mut self.root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_then_find_returns_lowest() {
        let b = HBitmap::new(1 << 20);
        assert_eq!(b.find_first_set(), None);
        for i in [70_000, 5, 999_999, 4096, 64] {
            assert_eq!(b.set(i), Some(SetOutcome { was_set: false, buddy_was_set: false }));
        }
        let mut seen = vec![];
        while let Some(i) = b.find_first_set() {
            assert!(b.try_clear(i));
            seen.push(i);
        }
        assert_eq!(seen, vec![5, 64, 4096, 70_000, 999_999]);
        assert!(!b.any_set());
    }

    #[test]
    fn out_of_range_is_refused_not_a_panic() {
        let b = HBitmap::new(10);
        assert_eq!(b.set(10), None);
        assert_eq!(b.set(usize::MAX), None);
        assert!(!b.try_clear(10));
        assert!(!b.try_clear_pair(9));
        assert!(!b.contains(12));
        let empty = HBitmap::new(0);
        assert_eq!(empty.set(0), None);
        assert_eq!(empty.find_first_set(), None);
    }

    #[test]
    fn metadata_grows_with_use_not_with_n() {
        let b = HBitmap::new(1 << 34);
        assert_eq!(b.nodes(), 1);
        b.set((1 << 34) - 1);
        // one node per level below the root
        assert_eq!(b.nodes(), 1 + b.height);
        b.set((1 << 34) - 2);
        assert_eq!(b.nodes(), 1 + b.height);
        assert_eq!(b.find_first_set(), Some((1 << 34) - 2));
    }

    #[test]
    fn set_reports_buddy_and_pair_clear_needs_both() {
        let b = HBitmap::new(256);
        assert!(!b.set(130).unwrap().buddy_was_set);
        assert!(!b.try_clear_pair(131));
        let o = b.set(131).unwrap();
        assert!(o.buddy_was_set && !o.was_set);
        assert!(b.set(131).unwrap().was_set);
        assert!(b.try_clear_pair(130));
        assert!(!b.contains(130) && !b.contains(131));
        assert_eq!(b.find_first_set(), None);
    }

    #[test]
    fn stale_hints_are_cleaned_and_search_still_finds_later_bits() {
        let b = HBitmap::new(1 << 16);
        b.set(3);
        b.set(60_000);
        assert!(b.try_clear(3)); // leaves stale hints above 3
        assert_eq!(b.find_first_set(), Some(60_000));
        // The stale hint for word 0 is gone from the root's leaf node.
        assert_eq!(b.root.summary.load(Ordering::Acquire).trailing_zeros(), (60_000 >> 12) as u32);
    }

    #[test]
    fn a_word_of_bits_is_set_at_once_and_found_through_the_hints() {
        let b = HBitmap::new(10_000);
        assert!(b.set_word(100, 0b1010));
        assert!(b.contains(6401) && b.contains(6403) && !b.contains(6400));
        assert_eq!(b.find_first_set(), Some(6401));
        assert!(!b.set_word(100, 0), "an empty mask");
        assert!(!b.set_word(156, 1 << 16), "bit 10,000 is past the end");
        assert!(b.set_word(156, 1 << 15), "bit 9,999 is the last");
        assert!(!b.set_word(usize::MAX, 1));
        let mut got = vec![];
        b.walk(&mut |i| {
            got.push(i);
            true
        });
        assert_eq!(got, [6401, 6403, 9999]);
    }

    #[test]
    fn walk_visits_every_set_bit_in_order() {
        let b = HBitmap::new(100_000);
        let want = [0, 1, 63, 64, 4095, 4096, 99_999];
        for &i in &want {
            b.set(i);
        }
        let mut got = vec![];
        b.walk(&mut |i| {
            got.push(i);
            true
        });
        assert_eq!(got, want);
        assert!(b.any_set());
    }

    #[test]
    fn concurrent_setters_and_clearers_lose_no_bit() {
        let b = HBitmap::new(1 << 18);
        std::thread::scope(|s| {
            for t in 0..4usize {
                let b = &b;
                s.spawn(move || {
                    for r in 0..2000usize {
                        let i = (r * 7919 + t * 65_537) % (1 << 18);
                        b.set(i);
                        if let Some(j) = b.find_first_set() {
                            b.try_clear(j);
                        }
                        b.set(i);
                    }
                });
            }
        });
        let mut walked = 0;
        b.walk(&mut |_| {
            walked += 1;
            true
        });
        let mut found = 0;
        while let Some(i) = b.find_first_set() {
            assert!(b.try_clear(i));
            found += 1;
        }
        assert_eq!(walked, found, "every set bit is reachable through the hints");
    }
}

#[cfg(test)]
mod model {
    use super::HBitmap;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn hbitmap_matches_a_btreeset(n in 1usize..20_000, ops in prop::collection::vec((0u8..4, any::<usize>()), 1..300)) {
            let b = HBitmap::new(n);
            let mut m = BTreeSet::new();
            for (op, x) in ops {
                let i = x % n;
                match op {
                    0 | 1 => {
                        let o = b.set(i).unwrap();
                        prop_assert_eq!(o.was_set, !m.insert(i));
                        prop_assert_eq!(o.buddy_was_set, m.contains(&(i ^ 1)));
                    }
                    2 => prop_assert_eq!(b.try_clear(i), m.remove(&i)),
                    _ => {
                        let both = m.contains(&(i & !1)) && m.contains(&(i | 1));
                        prop_assert_eq!(b.try_clear_pair(i), both);
                        if both {
                            m.remove(&(i & !1));
                            m.remove(&(i | 1));
                        }
                    }
                }
                prop_assert_eq!(b.find_first_set(), m.first().copied());
            }
            let mut walked = vec![];
            b.walk(&mut |i| { walked.push(i); true });
            prop_assert_eq!(walked, m.into_iter().collect::<Vec<_>>());
        }
    }
}
