//! The lock-free first-fit extent allocator: large blocks placed end to end, lowest address
//! first, at granule (e.g. 64 KiB) granularity.
//!
//! # Why it exists
//!
//! The buddy arena rounds a block's *placement* to its power-of-two alignment, so blocks of
//! 1 MiB and more leave the tail of their last 2 MiB page unused: the next block starts at the
//! next aligned address, not where the previous one ended. Placing them first fit at 64 KiB
//! granularity lets each block start where a free run starts; on a real trace this takes
//! peak mapped ÷ peak live from 1.112 to 1.003 in a sequential model. The pool gives large
//! requests to an [`Extents`] over its own part of the address range and small ones to the
//! buddy arena.
//!
//! # What it owns
//!
//! The books of one address range `[base, base + len)` cut into granules of `granule` bytes
//! (a power of two): one bit per granule, 1 = allocated, in `AtomicU64` words. Never the
//! memory itself, nor its physical pages (the page map does those). The words live in chunks
//! of [`CHUNK`] words (32768 granules, 2 GiB at 64 KiB) made the first time a granule in them
//! is claimed and published with a CAS into a directory of `AtomicPtr`s (the loser frees its
//! own chunk); an absent chunk is all free, and chunks are freed only when the allocator
//! drops. Metadata thus grows with the part of the range in use: one pointer per chunk, plus
//! 4 KiB per chunk touched. Beside the bits: a `free_bytes` count, a scan `hint`, and the
//! `in_flight` and `changes` counters of the failure check, each on cache lines of its own
//! (every thread writes them; the fields above are read-only and read by every call).
//!
//! # Invariants
//!
//! * Once quiet, a granule's bit is set exactly when it lies in a live block, and every live
//!   block is a run of set bits no other live block shares.
//! * Bits past the last granule (in the last word) are never set and never read as free.
//! * `free_bytes` equals the free bytes the bits show once quiet. It is a [`Tally`] striped
//!   by thread (one shared counter was 40% of a large pair's time on two threads), so a read
//!   racing allocations and frees may be off by the blocks in flight, as any snapshot of a
//!   busy pool is.
//! * Every word below the hint's index is full, except in the window between a free (or a
//!   rollback) clearing bits and lowering the hint, a window bracketed by `in_flight`.
//!
//! # The design and why
//!
//! * **Allocation** rounds the request up to `k` granules and walks the words from the hint,
//!   tracking the current run of free bits across word boundaries (trailing and leading zeros
//!   find runs inside a word; an all-free word adds 64, an absent chunk a whole chunk). At the
//!   first run of `k` it claims the run word by word in address order, each with a CAS from a
//!   value where its bits are all clear. If a CAS finds a bit taken (another thread claimed
//!   it since the walk), it clears the words it already claimed (`fetch_and(!mask)`: only its
//!   own bits) and walks again. Claiming in address order keeps two racing claims from
//!   blocking each other for long: both roll back at most what they hold, and the thread
//!   that reaches the contested word first wins it.
//! * **First fit, lowest address first**, as the buddy arena: live memory stays packed at
//!   the bottom, so few pages are mapped and high pages fall wholly free to be unmapped.
//! * **The hint** (the lowest word that may hold a free bit, with a sequence number in its
//!   upper 32 bits) skips the full prefix. It may be low, never high: a rollback lowers it
//!   after clearing, and so does a free that cleared bits of a word that was full (the
//!   `fetch_and` shows the word as it was), always bumping the sequence. A free into a word
//!   that already had a free bit leaves the hint alone: no walk skipped that word since the
//!   free that first cleared a bit of it lowered the hint (a CAS on a line every thread
//!   shares, saved on most frees); a walk raises it only with a CAS from the
//!   exact value it read before walking, so a raise fails if any lowering came in between. (A
//!   bare `fetch_min` would not do: a free below an already-low hint leaves it unchanged, and a
//!   walk that started before the free could then raise it past the freed bits.)
//! * **Free** checks that every bit of the block is set (loads only), and only then clears its
//!   own masks with `fetch_and`; anything else (misaligned, out of range, a granule not
//!   allocated) is refused with nothing changed. Two frees of one block racing is the
//!   caller's bug: both may pass the check, but each bit is cleared once and `free_bytes` is
//!   corrected by the bits found already clear, and no other block's bits are touched.
//! * **Why no lock**: every step is a single-word RMW on a bitmap word or a counter; a stalled
//!   thread holds at most the granules of its own partial claim, and others walk past them.
//! * **The only wait, and only on the failure path**: a walk can miss free granules another
//!   thread holds for a moment and will roll back, or that lie below a stale hint. Claims of
//!   runs that span words are bracketed by `in_flight`; a claim inside one word is one CAS,
//!   which sets the whole run or nothing, so no walk can see it half done and it needs no
//!   bracket (two RMWs fewer on most large blocks and every chunk). A rollback bumps
//!   `changes` (after clearing and lowering the hint, before leaving `in_flight`). `alloc`
//!   answers `None` only after a confirming walk (from the hint it reads then, between
//!   `SeqCst` fences) found no run while nothing was in flight and `changes` did not move;
//!   otherwise it walks again, spinning with `spin_hint`. The confirming walk starts at the
//!   hint, not at word 0: below it every word is full but in a rollback's window (which
//!   `in_flight` brackets) or a free's (which may be missed), and a prefix held for good (a
//!   server's KV cache: tens of thousands of words) was walked at every failed placement.
//!   A free needs neither: it only makes room, and a walk that misses a free under way may
//!   answer `None`, the allocation then ordered before the free (two RMWs fewer on every
//!   free). Every write to the words and counters is an `AcqRel` RMW, with `SeqCst` fences
//!   around the walk, so a walk that saw a word in its held state also sees the `in_flight`
//!   increment made before it.
//!   A successful claim only sets bits, so it need not bump `changes`: the state at the end of
//!   such a walk then truly has no run of `k`.

use crossbeam_utils::CachePadded;

use super::tally::Tally;
use super::words::LazyWords;
use crate::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use crate::sync::spin_hint;
use crate::Error;
use walk::Next;

mod walk;

/// Bitmap words per chunk: 32768 granules (2 GiB at 64 KiB granules), 4 KiB of bits.
pub use super::words::CHUNK;
/// The most granules an allocator may cover (256 TiB at 64 KiB): word indices then fit the
/// hint's low 32 bits, and the directory (made eagerly) stays at most 1 MiB.
pub const MAX_GRANULES: u64 = 1 << 32;
/// The hint's word index; the upper 32 bits are its sequence number.
const HINT_INDEX: u64 = u32::MAX as u64;
const BITS: u64 = u64::BITS as u64;

/// The lock-free first-fit extent allocator over one address range. See the module docs.
pub struct Extents {
    base: u64,
    len: u64,
    /// log2 of the granule.
    shift: u32,
    granules: u64,
    /// Bitmap words: `granules.div_ceil(64)`.
    words: usize,
    bits: LazyWords,
    // What allocations and frees write, on cache lines apart from the read-only fields above
    // (read by every call on every thread), which one thread's write would take from all.
    free_bytes: Tally,
    /// `seq << 32 | word`: every word below `word` is full (see the module docs).
    hint: CachePadded<AtomicU64>,
    /// Multi-word claims in progress, and the count bumped by every rollback before it
    /// leaves `in_flight` (the failure check's pair, written only off the common path).
    flight: CachePadded<Flight>,
}

/// The failure check's counters (see the module docs).
struct Flight {
    /// Claims that may hold part of their run, and give-backs, in progress.
    in_flight: AtomicUsize,
    /// Bumped by every rollback, before it leaves `in_flight`.
    changes: AtomicUsize,
}

impl std::fmt::Debug for Extents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extents")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("granule", &self.granule())
            .field("free_bytes", &self.free_bytes())
            .finish_non_exhaustive()
    }
}

/// What one walk of [`Extents::alloc_with`] found.
enum Fit {
    /// A candidate run starting at this granule.
    At(u64),
    /// Nothing from where the walk started.
    None,
}

/// Marks a claim or a free from `enter` to drop, so a failing walk knows bits may change.
struct InFlight<'a> {
    ext: &'a Extents,
    /// Bits were cleared (a free or a rollback): bump `changes` on leaving.
    cleared: bool,
}

impl<'a> InFlight<'a> {
    fn enter(ext: &'a Extents) -> InFlight<'a> {
        ext.flight.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight { ext, cleared: false }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.cleared {
            // `changes` first: a failing walk that sees `in_flight` fall also sees the change.
            self.ext.flight.changes.fetch_add(1, Ordering::AcqRel);
        }
        self.ext.flight.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The words and masks covering granules `[start, end)`, lowest first.
fn segments(start: u64, end: u64) -> impl Iterator<Item = (usize, u64)> {
    let mut g = start;
    std::iter::from_fn(move || {
        if g >= end {
            return None;
        }
        let lo = g % BITS;
        let n = (BITS - lo).min(end - g);
        let mask = if n == BITS { u64::MAX } else { ((1u64 << n) - 1) << lo };
        let i = (g / BITS) as usize;
        g += n;
        Some((i, mask))
    })
}

/// Set `mask`'s bits of `w` if none of them is set (one CAS, retried only while other bits
/// change); false, with nothing changed, if one is.
fn set_if_clear(w: &AtomicU64, mask: u64) -> bool {
    let mut cur = w.load(Ordering::Acquire);
    loop {
        if cur & mask != 0 {
            return false;
        }
        match w.compare_exchange_weak(cur, cur | mask, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

impl Extents {
    /// An allocator over `[base, base + len)` in granules of `granule` bytes (a power of two),
    /// all free. `base` and `len` must be multiples of `granule`, `len` non-zero, the range
    /// must not wrap, and it may hold at most [`MAX_GRANULES`] granules.
    pub fn new(base: u64, len: u64, granule: u64) -> Result<Extents, Error> {
        if !granule.is_power_of_two() || len == 0 || len % granule != 0 || base % granule != 0 {
            return Err(Error::InvalidArgument(format!(
                "extents: granule {granule:#x} must be a power of two dividing base {base:#x} and len {len:#x}"
            )));
        }
        if base.checked_add(len).is_none() || len / granule > MAX_GRANULES {
            return Err(Error::InvalidArgument(format!("extents: len {len:#x} too large for granule {granule:#x}")));
        }
        let granules = len / granule;
        let words = granules.div_ceil(BITS) as usize;
        Ok(Extents {
            base,
            len,
            shift: granule.trailing_zeros(),
            granules,
            words,
            bits: LazyWords::new(words),
            free_bytes: Tally::new(len),
            hint: CachePadded::new(AtomicU64::new(0)),
            flight: CachePadded::new(Flight { in_flight: AtomicUsize::new(0), changes: AtomicUsize::new(0) }),
        })
    }

    /// The granule in bytes: every block's address and size are multiples of it.
    pub fn granule(&self) -> u64 {
        1 << self.shift
    }

    /// The granule after the one holding address `bad`: where the next candidate starts once
    /// `accept` has refused a block for the byte at `bad`.
    fn granule_past(&self, bad: u64) -> u64 {
        (bad.saturating_sub(self.base) >> self.shift) + 1
    }

    /// The first address of the range.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The size of the range in bytes.
    pub fn range(&self) -> u64 {
        self.len
    }

    /// Free bytes: `len` − Σ rounded sizes of live blocks, exact when quiet (a read racing
    /// changes may be off by the blocks in flight: see the module docs).
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes.get()
    }

    /// The word `i`, making its chunk when `make`; `None` past the end, or absent and not made.
    fn word(&self, i: usize, make: bool) -> Option<&AtomicU64> {
        self.bits.get(i, make)
    }

    /// Bits of word `i` past the last granule, which must read as taken.
    fn past_end(&self, i: usize) -> u64 {
        let tail = self.granules % BITS;
        if tail != 0 && i + 1 == self.words {
            !((1u64 << tail) - 1)
        } else {
            0
        }
    }

    /// Lower the hint to at most word `i`, bumping its sequence so no walk that started
    /// before can raise it past `i` again.
    fn lower_hint(&self, i: usize) {
        let mut cur = self.hint.load(Ordering::Acquire);
        loop {
            let idx = (cur & HINT_INDEX).min(i as u64);
            let new = (cur.wrapping_add(HINT_INDEX + 1) & !HINT_INDEX) | idx;
            match self.hint.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// Claim granules `[start, start + k)`, word by word in address order. False, with every
    /// bit this call set cleared again, if some granule was taken meanwhile. A run inside
    /// one word is one CAS, which sets all of it or none: no other walk can see it half
    /// claimed, so it takes no `in_flight` bracket (two RMWs on a line every thread shares,
    /// saved on most large blocks and every chunk).
    fn claim(&self, start: u64, k: u64) -> bool {
        let end = start + k;
        if start / BITS == (end - 1) / BITS {
            return segments(start, end).all(|(i, mask)| self.word(i, true).is_some_and(|w| set_if_clear(w, mask)));
        }
        let mut guard = InFlight::enter(self);
        let mut claimed_to = start;
        let mut ok = true;
        for (i, mask) in segments(start, end) {
            if !self.word(i, true).is_some_and(|w| set_if_clear(w, mask)) {
                ok = false;
                break;
            }
            claimed_to += u64::from(mask.count_ones());
        }
        if !ok && claimed_to > start {
            for (i, mask) in segments(start, claimed_to) {
                if let Some(w) = self.word(i, false) {
                    w.fetch_and(!mask, Ordering::AcqRel);
                }
            }
            self.lower_hint((start / BITS) as usize);
            guard.cleared = true;
        }
        ok
    }

    /// Allocate `bytes` rounded up to whole granules, at the lowest address where that many
    /// free granules run in a row. `None` for 0 bytes, more than the range, or when no run
    /// fits (checked as the module docs say, so never only because of a race).
    pub fn alloc(&self, bytes: u64) -> Option<u64> {
        self.alloc_with(bytes, 1, &mut |_, _| Ok(()))
    }

    /// [`Extents::alloc`] with two more conditions: the block starts at a multiple of
    /// `align` granules (a power of two) from the range's base, and `accept(addr, len)` takes
    /// it. `accept` judges state the allocator does not own (whose memory the granules were,
    /// whether their pages are mapped): it returns `Err(bad)` when the byte at `bad` (inside
    /// the block) rules the block out, and the search goes on past `bad`'s granule. It is
    /// asked while searching, to skip what it would refuse without claiming, and asked again
    /// once the block is claimed, which is the answer that counts: what it reads may change
    /// until the granules are this call's. A block refused after its claim is given back
    /// whole, exactly as it was. `None` when no free run satisfies both (confirmed as for
    /// `alloc`: a fenced walk from the hint with nothing in flight and nothing changed but
    /// this call's own give-backs).
    pub fn alloc_with(
        &self,
        bytes: u64,
        align: u64,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
    ) -> Option<u64> {
        self.alloc_from(bytes, align, None, accept)
    }

    /// [`Extents::alloc_with`] at `floor` (an address) or above: the lowest run there, as if
    /// the range began at `floor`. Below it nothing is walked, and the hint is neither read
    /// past nor raised (it speaks for the whole range). `None` when no run at or above
    /// `floor` fits, confirmed as for `alloc_with`.
    pub fn alloc_above(
        &self,
        bytes: u64,
        align: u64,
        floor: u64,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
    ) -> Option<u64> {
        let g = self.floor_granule(floor)?;
        self.alloc_from(bytes, align, Some(g), accept)
    }

    /// Whether a run of `bytes` (aligned as for [`Extents::alloc_with`]) is free at `floor`
    /// or above, whoever's memory it was: one walk, claiming nothing, a snapshot of a moment.
    pub fn has_room_above(&self, bytes: u64, align: u64, floor: u64) -> bool {
        let (Some(k), Some(g)) = (self.granules_for(bytes, align), self.floor_granule(floor)) else { return false };
        matches!(self.first_fit_with(k, align, Some(g), &mut |_| Ok(())), Fit::At(_))
    }

    /// The granules a request of `bytes` aligned to `align` granules takes, if one can be
    /// placed at all.
    fn granules_for(&self, bytes: u64, align: u64) -> Option<u64> {
        if bytes == 0 || bytes > self.len || !align.is_power_of_two() || align > self.granules {
            return None;
        }
        Some(bytes.div_ceil(self.granule()))
    }

    /// The granule of address `floor` (the first for one below the range), if in the range.
    fn floor_granule(&self, floor: u64) -> Option<u64> {
        Some(floor.saturating_sub(self.base) >> self.shift).filter(|&g| g < self.granules)
    }

    /// [`Extents::alloc_with`] from granule `floor` up (the whole range for `None`).
    fn alloc_from(
        &self,
        bytes: u64,
        align: u64,
        floor: Option<u64>,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
    ) -> Option<u64> {
        let k = self.granules_for(bytes, align)?;
        let len = k << self.shift;
        // Every walk starts at the floor or past it: a restart only ever moves up.
        let (mut confirming, mut restart) = (false, floor);
        // Give-backs of refused blocks made by this call: `changes` moves by these alone
        // when nobody else changed anything.
        let mut own = 0usize;
        let mut before = self.flight.changes.load(Ordering::Acquire);
        loop {
            if confirming {
                // Only a confirming walk needs its reads ordered after `before`'s.
                fence(Ordering::SeqCst);
            }
            let found = self.first_fit_with(k, align, restart, &mut |g| {
                accept(self.base + (g << self.shift), len).map_err(|bad| self.granule_past(bad))
            });
            match found {
                Fit::At(start) => match self.claim_accepted(start, k, accept) {
                    Ok(addr) => return Some(addr),
                    Err(None) => {
                        // Lost the run to another claim: someone made progress; walk again.
                        (confirming, restart) = (false, floor);
                        continue;
                    }
                    Err(Some(bad)) => {
                        own += 1;
                        restart = Some(self.granule_past(bad).max(start + 1));
                        continue;
                    }
                },
                Fit::None => {}
            }
            fence(Ordering::SeqCst);
            if confirming {
                // `in_flight` first: a claim or free in flight bumps `changes` before it
                // leaves, so once it is seen gone its change is seen too.
                let quiet = self.flight.in_flight.load(Ordering::Acquire) == 0;
                let now = self.flight.changes.load(Ordering::Acquire);
                if quiet && now == before.wrapping_add(own) {
                    return None;
                }
                spin_hint();
                (before, own) = (now, 0);
            }
            // Confirm a failure with a second walk, its reads ordered after `before`'s: the
            // first may have missed granules a rollback held, and the counters read after
            // this one tell. From the hint, not word 0 (module docs).
            (confirming, restart) = (true, floor);
        }
    }

    /// [`Extents::alloc_with`] (granule-aligned), choosing among every free run instead of
    /// taking the first: of each run, its first candidate `accept` takes and its far end
    /// (the block flush with the run's end, which leaves the rest of the run in one piece),
    /// the one `score(addr, run_len)` rates lowest, the lowest address among equals. The
    /// choice is then claimed and judged by `accept` again, as `alloc_with` does. If another
    /// thread took it meanwhile, if `accept` now refuses it, or if no run had a candidate,
    /// the answer is `alloc_with`'s: a score is a preference, never a reason to fail, and
    /// `None` is only ever the confirmed answer of that walk.
    ///
    /// One walk over every run: for the slow paths that can afford it (a pool near its
    /// limit), not for every large block.
    pub fn alloc_scored_with(
        &self,
        bytes: u64,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
        score: &mut dyn FnMut(u64, u64) -> u64,
    ) -> Option<u64> {
        if bytes == 0 || bytes > self.len {
            return None;
        }
        let k = bytes.div_ceil(self.granule());
        let len = k << self.shift;
        let from = (self.hint.load(Ordering::Acquire) & HINT_INDEX) as usize;
        let mut best: Option<(u64, u64)> = None;
        let mut consider = |c: u64, run: u64, best: &mut Option<(u64, u64)>| {
            let rating = score(self.base + (c << self.shift), run << self.shift);
            if best.is_none_or(|(b, at)| (rating, c) < (b, at)) {
                *best = Some((rating, c));
            }
        };
        self.walk(from as u64 * BITS, u64::MAX, k, &mut |s, l| {
            let end = s + l;
            let mut c = s;
            while c + k <= end {
                match accept(self.base + (c << self.shift), len) {
                    Ok(()) => {
                        consider(c, l, &mut best);
                        break;
                    }
                    Err(bad) => c = self.granule_past(bad).max(c + 1),
                }
            }
            // The untouched rest of the range has no far end worth taking.
            let far = end.wrapping_sub(k);
            if l > k && far > c && end < self.granules && accept(self.base + (far << self.shift), len).is_ok() {
                consider(far, l, &mut best);
            }
            Next::On
        });
        if let Some(Ok(addr)) = best.map(|(_, start)| self.claim_accepted(start, k, accept)) {
            return Some(addr);
        }
        self.alloc_with(bytes, 1, accept)
    }

    /// Claim the `bytes` (whole granules) at `addr`, a run the caller chose (say, from
    /// [`Extents::for_each_free`]), and ask `accept` as [`Extents::alloc_with`] does once it
    /// has claimed: the address, or None if a granule was taken meanwhile or `accept` refused
    /// (nothing claimed then).
    pub fn claim_at(&self, addr: u64, bytes: u64, accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>) -> Option<u64> {
        let k = bytes.div_ceil(self.granule());
        let start = addr.checked_sub(self.base)? >> self.shift;
        if bytes == 0 || addr & (self.granule() - 1) != 0 || start + k > self.granules {
            return None;
        }
        self.claim_accepted(start, k, accept).ok()
    }

    /// Claim granules `[start, start + k)` and ask `accept` again, which is the answer that
    /// counts (what it judges may have changed since the walk): the block's address, taken;
    /// `Err(None)` when another thread claimed a granule first; `Err(Some(bad))` when
    /// `accept` refused it now, the claim given back whole.
    fn claim_accepted(
        &self,
        start: u64,
        k: u64,
        accept: &mut dyn FnMut(u64, u64) -> Result<(), u64>,
    ) -> Result<u64, Option<u64>> {
        if !self.claim(start, k) {
            return Err(None);
        }
        let (addr, len) = (self.base + (start << self.shift), k << self.shift);
        if let Err(bad) = accept(addr, len) {
            self.unclaim(start, k);
            return Err(Some(bad));
        }
        self.free_bytes.sub(len);
        Ok(addr)
    }

    /// One walk for [`Extents::alloc_with`]: from the hint (or granule `restart`, if higher),
    /// the first `align`-aligned run of `k` free granules that `accept` (given a candidate's
    /// first granule) does not refuse; raises the hint past the full words it saw.
    fn first_fit_with(
        &self,
        k: u64,
        align: u64,
        restart: Option<u64>,
        accept: &mut dyn FnMut(u64) -> Result<(), u64>,
    ) -> Fit {
        let seen = self.hint.load(Ordering::Acquire);
        let from = ((seen & HINT_INDEX) * BITS).max(restart.unwrap_or(0));
        // A run this long holds an aligned candidate wherever it starts.
        let stop_at = k + align - 1;
        let mut fit = Fit::None;
        let first = self.walk(from, stop_at, k, &mut |s, l| {
            let end = s + l;
            let mut c = s.next_multiple_of(align);
            while c + k <= end {
                match accept(c) {
                    Ok(()) => {
                        fit = Fit::At(c);
                        return Next::Stop;
                    }
                    Err(next) => c = next.max(c + 1).next_multiple_of(align),
                }
            }
            // Past what `accept` refused: a run handed at `stop_at` may go on past `end`, and
            // a refusal may reach past the run's end (pages that serve no block now).
            if l >= stop_at || c > end {
                Next::From(c)
            } else {
                Next::On
            }
        });
        if restart.is_none() {
            let to = first.unwrap_or(self.words);
            if to as u64 > seen & HINT_INDEX {
                // Only from the value read before the walk: fails if a free lowered it meanwhile.
                let _ = self.hint.compare_exchange(
                    seen,
                    (seen & !HINT_INDEX) | to as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        }
        fit
    }

    /// Give back granules `[start, start + k)` that this thread claimed and did not hand
    /// out, as they were: clear its bits, lower the hint, and count the change for walks
    /// that may have missed them meanwhile.
    fn unclaim(&self, start: u64, k: u64) {
        let mut guard = InFlight::enter(self);
        for (i, mask) in segments(start, start + k) {
            if let Some(w) = self.word(i, false) {
                w.fetch_and(!mask, Ordering::AcqRel);
            }
        }
        self.lower_hint((start / BITS) as usize);
        guard.cleared = true;
    }

    /// Give back the block `[addr, addr + bytes rounded up to granules)`. False, with nothing
    /// changed, if `bytes` is 0, `addr` is misaligned or the block leaves the range, or any of
    /// its granules is not allocated (a double free). Two frees of one block racing is the
    /// caller's bug: the one that finds bits already cleared returns false (see module docs).
    pub fn free(&self, addr: u64, bytes: u64) -> bool {
        let Some(off) = addr.checked_sub(self.base) else { return false };
        if bytes == 0 || off % self.granule() != 0 {
            return false;
        }
        let start = off >> self.shift;
        let k = bytes.div_ceil(self.granule());
        if start >= self.granules || k > self.granules - start {
            return false;
        }
        let end = start + k;
        // Check every word before touching any: a refused free changes nothing.
        let all_set = segments(start, end)
            .all(|(i, mask)| self.word(i, false).is_some_and(|w| w.load(Ordering::Acquire) & mask == mask));
        if !all_set {
            return false;
        }
        // No `in_flight` or `changes` here: a free only makes room, so a walk that misses it
        // while it is under way may answer `None` (the allocation then comes before the free,
        // which is a valid order). Only a claim's rollback hides room that was there before.
        // Add before clearing: this thread's stripe never shows the granules free before
        // they are.
        self.free_bytes.add(k << self.shift);
        let mut already_clear = 0u64;
        let mut was_full = None;
        for (i, mask) in segments(start, end) {
            if let Some(w) = self.word(i, false) {
                let old = w.fetch_and(!mask, Ordering::AcqRel);
                already_clear += u64::from((mask & !old).count_ones());
                if was_full.is_none() && old | self.past_end(i) == u64::MAX {
                    was_full = Some(i);
                }
            }
        }
        if already_clear > 0 {
            // A racing double free cleared them: it counts them, we must not.
            self.free_bytes.sub(already_clear << self.shift);
        }
        // Only a word that was full can lie below the hint, or have been skipped by a walk
        // that will raise it: a word that already had a free bit did not, and the free that
        // first cleared a bit of it since it was last full lowered the hint itself.
        if let Some(i) = was_full {
            self.lower_hint(i);
        }
        already_clear == 0
    }
}

#[cfg(test)]
mod tests;
