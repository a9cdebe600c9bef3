//! The magazines of one thread cache (T0), and the hot entries its hit paths read.
//!
//! A thread cache holds, per size class, two magazines (Bonwick's "loaded" and "previous").
//! An allocation pops from `loaded` (or swaps in `previous`); a free pushes. Only when both
//! are empty (or both full) does the cache trade a whole magazine with the stream's depot
//! (T1). So the hit path touches memory of this cache alone: no atomic read-modify-write, no
//! lock, no heap allocation, no driver call.
//!
//! **What it owns.** [`Mags`]: every class's two boxed [`Magazine`]s, and the hot entries,
//! arrays indexed by class that describe each class's loaded magazine (its count, capacity,
//! block size and slots), so that a hit reads a count and a pointer and follows nothing else.
//! The depot trades, the counters and the bound on cached bytes are the cache's
//! ([`CacheShared`](super::thread::CacheShared)), not this module's.
//!
//! **Invariants.** Between operations, each class's hot entry describes its loaded magazine,
//! and the entry's count is the magazine's (the magazine's own is stale while loaded); a
//! class with no magazines, and every entry past the classes, has count, capacity and size
//! 0, so every take and put of it misses; the padding counts after the entries are 0. A
//! slow path opens a class ([`Mags::open`]) before it touches the magazines and closes it
//! ([`Mags::close`]) after; [`Mags::check`] checks the agreement. There are [`HOT_ENTRIES`]
//! entries, more than any class index, so a hit path clamps a class instead of checking it,
//! and an out-of-range class simply misses.
//!
//! **Borrowing on the hit path.** When a class's loaded magazine is empty, the hit path
//! takes a block of the smallest larger class within the class's reach (up to two
//! doublings; see [`CacheShared::set_reach`](super::thread::CacheShared::set_reach)) whose
//! loaded magazine holds one, found with one read of the classes' counts, which sit side by
//! side (see [`Mags`]). On random sizes about half the allocations find their own class
//! empty (a borrowed block goes back to its own, larger class), and doing this on the hit
//! path, without a call or a loop, made the random window about 35% faster than the same
//! choice made in the slow path. So a class whose loaded magazine is empty borrows before it
//! swaps in its own previous magazine or takes one from the depot: those wait for the slow
//! path, which runs when nothing within reach holds a block.
//!
//! **Who may touch it.** Nothing here is synchronised: `Mags` is plain data with raw
//! pointers into its own magazines, reached only through the cache's handshake, by the one
//! party that holds it (the owner inside an operation, or a thief that won; see
//! [`super::thread`]). So its hit paths are plain loads and stores.

use crate::cache::magazine::{Magazine, MAG_CAP};
use crate::cache::thread::{Hit, Slot};
use crate::class::MAX_CLASSES;

/// One class's two magazines.
pub(super) struct ClassMags {
    /// While loaded, this magazine's own count is stale: [`Mags::lens`] has the count.
    pub(super) loaded: Box<Magazine>,
    pub(super) prev: Box<Magazine>,
    /// Blocks per magazine of this class.
    pub(super) cap: u8,
    /// Bytes per block of this class.
    pub(super) size: u32,
}

impl ClassMags {
    fn new(slot: Slot) -> ClassMags {
        ClassMags {
            loaded: Magazine::boxed(),
            prev: Magazine::boxed(),
            cap: slot.cap.min(MAG_CAP) as u8,
            // Classes end at MAX_CLASS_SIZE, which a u32 holds (asserted below).
            size: slot.size as u32,
        }
    }
}

const _: () = assert!(crate::class::MAX_CLASS_SIZE <= u32::MAX as u64 && MAG_CAP <= u8::MAX as usize);

/// Hot entries: one per possible class index below 256, so the hit paths index them with a
/// class clamped to 255 and need no bounds check; classes past the pool's (and past
/// [`MAX_CLASSES`]) keep empty entries (count and capacity 0), so a clamped out-of-range
/// class (an uncached block's included) simply misses.
const HOT_ENTRIES: usize = 256;
const _: () = assert!(MAX_CLASSES < HOT_ENTRIES);

/// The entry of `class` for the hit paths: clamped, not checked (see [`HOT_ENTRIES`]).
#[inline(always)]
pub(super) fn hot_index(class: usize) -> u8 {
    class.min(HOT_ENTRIES - 1) as u8
}

/// How many larger classes the hit path can look at: one read of 16 counts (two words).
pub const REACH_MAX: usize = 16;

/// Entries of [`Mags::lens`]: one per hot entry, and zeroed padding so that the
/// [`REACH_MAX`] counts after any entry stay inside the array.
const LENS: usize = HOT_ENTRIES + REACH_MAX;

/// The magazines of every class, and what the hit paths read of them.
///
/// Class `c`'s loaded magazine is described inline in the cache, in arrays indexed by the
/// class (`lens[c]`, `caps[c]`, `slots[c]`, `sizes[c]`): a hit reads a count and a slots
/// pointer, with no vector, `Option` or box to follow. The counts are bytes side by side,
/// so an allocation whose own magazine is empty sees which of the next [`REACH_MAX`]
/// classes hold a block in one read of two words, with no summary to keep up on every
/// take and put (a flag byte per class, stored on each, cost the hot pair about 1 ns).
///
/// Invariant (between operations): a class with no magazines (`classes[c]` None, or past
/// the classes) has count, capacity and size 0 and a dangling slots pointer; any other
/// names `classes[c]`'s loaded magazine, whose count is `lens[c]` (its own is stale). A
/// slow path that touches class `c`'s magazines [`Mags::open`]s it first (writing the count
/// back into the magazine) and [`Mags::close`]s it after (reloading the entry).
pub(super) struct Mags {
    /// Blocks in each class's loaded magazine.
    pub(super) lens: [u8; LENS],
    /// Blocks each class's loaded magazine may hold (0: no magazines; every push misses).
    caps: [u8; HOT_ENTRIES],
    /// Per class `c`, the larger classes an allocation of it may take a block from when its
    /// own loaded magazine is empty: bit `j` stands for class `c + 1 + j` (see
    /// [`CacheShared::set_reach`](super::thread::CacheShared::set_reach)).
    pub(super) reach: [u16; HOT_ENTRIES],
    /// Bytes per block of each class: the hit path may take a block of a larger class.
    sizes: [u32; HOT_ENTRIES],
    /// Each class's loaded magazine's slots ([`Magazine::slots_ptr`]).
    slots: [*mut u64; HOT_ENTRIES],
    pub(super) classes: Vec<Option<ClassMags>>,
}

impl Mags {
    pub(super) fn new(classes: usize) -> Mags {
        let mut v = Vec::with_capacity(classes);
        v.resize_with(classes.min(MAX_CLASSES), || None);
        Mags {
            lens: [0; LENS],
            caps: [0; HOT_ENTRIES],
            reach: [0; HOT_ENTRIES],
            sizes: [0; HOT_ENTRIES],
            slots: [std::ptr::NonNull::dangling().as_ptr(); HOT_ENTRIES],
            classes: v,
        }
    }

    /// The hit path's choice for an allocation of `class` (of `size` bytes): its own loaded
    /// magazine, else the smallest larger class within its reach whose loaded magazine holds
    /// a block; and a block from it. No loop over the classes: one read of their counts.
    #[inline(always)]
    pub(super) fn fit(&mut self, class: usize, size: u64) -> Option<Hit> {
        let c = hot_index(class) as usize;
        if self.lens[c] > 0 {
            // SAFETY: it holds a block (just seen).
            let addr = unsafe { self.take_unchecked(c) };
            // The caller's size, not the entry's: the same, and often a constant there.
            return Some(Hit { addr, class, size });
        }
        self.take_larger(c)
    }

    /// A block of the smallest class within class `c`'s reach whose loaded magazine holds
    /// one (`c` at most 255).
    #[inline(always)]
    pub(super) fn take_larger(&mut self, c: usize) -> Option<Hit> {
        let fits = self.held_after(c) & self.reach[c];
        if fits == 0 {
            return None;
        }
        // Counts past the pool's classes are always 0, so this stays an entry of a class.
        let from = hot_index(c + 1 + fits.trailing_zeros() as usize) as usize;
        // SAFETY: its count is not 0 (it is why `from` was chosen).
        let addr = unsafe { self.take_unchecked(from) };
        Some(Hit { addr, class: from, size: u64::from(self.sizes[from]) })
    }

    /// Which of the [`REACH_MAX`] classes after `c` hold a block in their loaded magazine,
    /// as bits: bit `j` is class `c + 1 + j`.
    #[inline(always)]
    fn held_after(&self, c: usize) -> u16 {
        const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
        /// Multiplying 8 bytes of 0 or 1 by this moves byte `i`'s bit to bit `56 + i` (no two
        /// products meet, so nothing carries into the top byte).
        const GATHER: u64 = 0x0102_0408_1020_4080;
        let word = |i: usize| {
            let b = &self.lens;
            u64::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3], b[i + 4], b[i + 5], b[i + 6], b[i + 7]])
        };
        // 1 in each byte whose count is not 0: the low seven bits plus 0x7f carry into bit 7
        // unless they are all 0, and never past it.
        let held = |x: u64| (((x & LOW7).wrapping_add(LOW7) | x) & !LOW7) >> 7;
        let (lo, hi) = (held(word(c + 1)), held(word(c + 9)));
        ((lo.wrapping_mul(GATHER) >> 56) | (hi.wrapping_mul(GATHER) >> 56 << 8)) as u16
    }

    /// The most recent block of class `c`'s loaded magazine.
    ///
    /// # Safety
    /// It holds one (`lens[c] > 0`).
    #[inline(always)]
    unsafe fn take_unchecked(&mut self, c: usize) -> u64 {
        let len = self.lens[c] - 1;
        self.lens[c] = len;
        // SAFETY: the entry names class `c`'s loaded magazine (the invariant), which held
        // `len + 1 <= MAG_CAP` blocks in its first slots.
        unsafe { *self.slots[c].add(len as usize) }
    }

    /// A block from class `c`'s loaded magazine, if it holds one.
    #[inline(always)]
    pub(super) fn take(&mut self, c: u8) -> Option<u64> {
        let c = c as usize;
        if self.lens[c] == 0 {
            return None;
        }
        // SAFETY: it holds a block (just seen).
        Some(unsafe { self.take_unchecked(c) })
    }

    /// Put a block in class `c`'s loaded magazine, if it has room.
    #[inline(always)]
    pub(super) fn put(&mut self, c: u8, addr: u64) -> bool {
        let c = c as usize;
        let len = self.lens[c];
        if len >= self.caps[c] {
            return false;
        }
        // SAFETY: the entry names class `c`'s loaded magazine (the invariant), whose
        // `caps[c] <= MAG_CAP` slots exist; `len < caps[c]`.
        unsafe { *self.slots[c].add(len as usize) = addr };
        self.lens[c] = len + 1;
        true
    }

    /// Class `c`'s magazines with the loaded one's count written back; None if it has none.
    pub(super) fn open(&mut self, c: usize) -> Option<&mut ClassMags> {
        let len = *self.lens.get(c)?;
        let cm = self.classes.get_mut(c)?.as_mut()?;
        cm.loaded.set_len(len as usize);
        Some(cm)
    }

    /// Reload class `c`'s hot entry from its magazines (after [`Mags::open`]).
    pub(super) fn close(&mut self, c: usize) {
        if c >= HOT_ENTRIES {
            return;
        }
        let (len, cap, size, slots) = match self.classes.get_mut(c).and_then(Option::as_mut) {
            Some(cm) => (cm.loaded.len() as u8, cm.cap, cm.size, cm.loaded.slots_ptr()),
            None => (0, 0, 0, std::ptr::NonNull::dangling().as_ptr()),
        };
        (self.lens[c], self.caps[c], self.sizes[c], self.slots[c]) = (len, cap, size, slots);
    }

    /// Whether the hot entries agree with the magazines (see [`Mags`]'s invariant).
    pub(super) fn check(&self) -> Result<(), String> {
        if let Some(b) = self.lens[HOT_ENTRIES..].iter().find(|&&b| b != 0) {
            return Err(format!("a padding count is {b}, not 0"));
        }
        for c in 0..HOT_ENTRIES {
            let got = (self.lens[c], self.caps[c], self.sizes[c]);
            let want = match self.classes.get(c).and_then(Option::as_ref) {
                Some(cm) if !std::ptr::eq(self.slots[c], cm.loaded.slots().as_ptr()) => {
                    return Err(format!("class {c}: its entry names another magazine than the loaded one"));
                }
                Some(cm) if got.0 > cm.cap => {
                    return Err(format!("class {c}: count {} over capacity {}", got.0, cm.cap));
                }
                Some(cm) => (got.0, cm.cap, cm.size),
                None => (0, 0, 0),
            };
            if got != want {
                return Err(format!("class {c}: entry (count, capacity, size) {got:?}, magazines say {want:?}"));
            }
        }
        Ok(())
    }

    /// Class `c`'s magazines, made if it has none (the class must exist); opened.
    pub(super) fn open_or_make(&mut self, slot: Slot) -> Option<&mut ClassMags> {
        let c = slot.class;
        if self.classes.get(c)?.is_none() {
            self.classes[c] = Some(ClassMags::new(slot));
            self.close(c);
        }
        self.open(c)
    }

    /// Every class open at once (for walks over all of them); [`Mags::close_all`] after.
    pub(super) fn open_all(&mut self) {
        for c in 0..self.classes.len() {
            self.open(c);
        }
    }

    pub(super) fn close_all(&mut self) {
        for c in 0..self.classes.len() {
            self.close(c);
        }
    }
}
