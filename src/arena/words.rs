//! A lazily made array of atomic words, for the page map and the extent bitmap.
//!
//! The words live in chunks of [`CHUNK`] made the first time a word in them is wanted and
//! published with a CAS into a directory of `AtomicPtr`s (a loser frees its own chunk); chunks
//! are freed only when the array drops. So metadata is one pointer per [`CHUNK`] words of the
//! range plus the chunks in use: it grows with the part of the range in use, not the range.
//! A chunk never made reads as all zero words.

use crate::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

/// Words per chunk.
pub const CHUNK: usize = 512;

struct Chunk {
    words: Box<[AtomicU64]>,
}

/// `len` atomic words, all zero at first, made a chunk at a time.
pub struct LazyWords {
    len: usize,
    dir: Box<[AtomicPtr<Chunk>]>,
}

// SAFETY: all shared state is atomic; chunk pointers are owned by the array and freed only in
// `Drop`, which needs exclusive access.
unsafe impl Send for LazyWords {}
// SAFETY: as above; `&LazyWords` reads chunks only through atomics and never frees them.
unsafe impl Sync for LazyWords {}

impl LazyWords {
    /// `len` words, none made yet.
    pub fn new(len: usize) -> LazyWords {
        LazyWords { len, dir: (0..len.div_ceil(CHUNK)).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect() }
    }

    /// How many words.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The words of chunk `c` (words `c * CHUNK ..`), if it has been made.
    #[inline]
    pub fn chunk(&self, c: usize) -> Option<&[AtomicU64]> {
        let p = self.dir.get(c)?.load(Ordering::Acquire);
        // SAFETY: a non-null slot holds a chunk published by `get` from `Box::into_raw` with
        // a release CAS, freed only in `Drop`, which cannot run while `&self` lives.
        unsafe { p.as_ref() }.map(|c| &c.words[..])
    }

    /// Word `i`, making its chunk when `make`; `None` past the end, or absent and not made.
    #[inline]
    pub fn get(&self, i: usize, make: bool) -> Option<&AtomicU64> {
        self.chunk_of(i / CHUNK, make)?.get(i % CHUNK)
    }

    /// The words of chunk `c`, making it when `make`; `None` past the end, or absent and not
    /// made.
    #[inline]
    fn chunk_of(&self, c: usize, make: bool) -> Option<&[AtomicU64]> {
        match self.chunk(c) {
            Some(words) => Some(words),
            None if make => self.make(c),
            None => None,
        }
    }

    /// Visit words `from..to` (cut at the end) a chunk at a time, lowest first: `f(first,
    /// words)` with the words of one chunk in the range, `first` the index of the first, or
    /// `None` for a chunk absent (all zero) and not made (made when `make`). Stops when `f`
    /// returns false. For loops over many words: one directory look a chunk, not one a word.
    pub fn slices(&self, from: usize, to: usize, make: bool, mut f: impl FnMut(usize, Option<&[AtomicU64]>) -> bool) {
        let to = to.min(self.len);
        let mut i = from;
        while i < to {
            let c = i / CHUNK;
            let stop = ((c + 1) * CHUNK).min(to);
            let words = self.chunk_of(c, make).map(|w| &w[i - c * CHUNK..stop - c * CHUNK]);
            if !f(i, words) {
                return;
            }
            i = stop;
        }
    }

    /// Make chunk `c` (or find the one another thread made first); `None` past the end.
    #[cold]
    #[inline(never)]
    fn make(&self, c: usize) -> Option<&[AtomicU64]> {
        let slot = self.dir.get(c)?;
        let len = CHUNK.min(self.len - c * CHUNK);
        let fresh = Box::into_raw(Box::new(Chunk { words: (0..len).map(|_| AtomicU64::new(0)).collect() }));
        let chunk = match slot.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: published just now; lives until `Drop` (see `chunk`).
            Ok(_) => unsafe { &*fresh },
            Err(theirs) => {
                // SAFETY: `fresh` was never shared: the CAS that would publish it failed.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: non-null (the CAS failed against it), published as in `chunk`.
                unsafe { &*theirs }
            }
        };
        Some(&chunk.words[..])
    }

    /// How many chunk slots the directory has.
    pub fn chunks(&self) -> usize {
        self.dir.len()
    }

    /// How many chunks have been made.
    pub fn chunks_made(&self) -> usize {
        (0..self.dir.len()).filter(|&c| self.chunk(c).is_some()).count()
    }
}

impl Drop for LazyWords {
    fn drop(&mut self) {
        for slot in self.dir.iter() {
            let p = slot.swap(std::ptr::null_mut(), Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: `p` came from `Box::into_raw` in `get`, published once; we own the
                // array exclusively now and the swap leaves null, so it is freed once.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn words_are_made_a_chunk_at_a_time_and_start_at_zero() {
        let w = LazyWords::new(3 * CHUNK + 7);
        assert_eq!((w.len(), w.chunks(), w.chunks_made()), (3 * CHUNK + 7, 4, 0));
        assert!(w.get(CHUNK + 3, false).is_none(), "not made unless asked");
        w.get(CHUNK + 3, true).unwrap().store(5, Ordering::Relaxed);
        assert_eq!(w.chunks_made(), 1);
        assert_eq!(w.chunk(1).unwrap()[3].load(Ordering::Relaxed), 5);
        assert_eq!(w.get(3 * CHUNK + 6, true).unwrap().load(Ordering::Relaxed), 0);
        assert_eq!(w.chunk(3).unwrap().len(), 7, "the last chunk is only as long as needed");
        assert!(w.get(3 * CHUNK + 7, true).is_none(), "past the end");
    }

    #[test]
    fn slices_go_a_chunk_at_a_time_and_make_chunks_only_when_asked() {
        let w = LazyWords::new(3 * CHUNK);
        w.get(CHUNK + 1, true).unwrap().store(9, Ordering::Relaxed);
        let mut seen = vec![];
        w.slices(CHUNK - 2, 3 * CHUNK + 50, false, |i, words| {
            seen.push((i, words.map(|ws| (ws.len(), ws[1.min(ws.len() - 1)].load(Ordering::Relaxed)))));
            true
        });
        assert_eq!(seen, vec![(CHUNK - 2, None), (CHUNK, Some((CHUNK, 9))), (2 * CHUNK, None)]);
        assert_eq!(w.chunks_made(), 1, "reading makes nothing");
        let mut calls = 0;
        w.slices(0, 3 * CHUNK, true, |_, words| {
            calls += 1;
            words.is_some() && calls < 2
        });
        assert_eq!((calls, w.chunks_made()), (2, 2), "made when asked, and stopped when told");
    }
}
