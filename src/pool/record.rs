//! [`PoolConfig::record_trace`](super::PoolConfig::record_trace): the pool writes every
//! allocation and free it serves as a trace, in the format [`crate::replay`] plays (CSV,
//! `op,id,size,stream`), so that a server's own workload can be replayed offline: through
//! vrampool's configurations, the best-fit baseline and, on a GPU, `cuMemAllocAsync`
//! (`examples/replay.rs`, `examples/compare/`). What RMM's logging adaptor and PyTorch's
//! memory history give their users, in the form this project's tools read.
//!
//! # What it owns, and its invariants
//!
//! One file and, under one mutex, the books that make its lines: the live blocks by
//! address with the id each was given, the next id, and the number given to each stream in
//! the order streams first appear.
//!
//! * **Order.** An allocation's line is written before the block is handed out, and a free's
//!   line before its memory goes back to the pool. Every line is written under the mutex, so
//!   the file's order is one in which each free follows its allocation and each address is
//!   allocated again only after its last free: a trace that replays.
//! * **Ids** are numbered from 0 in allocation order and never reused, as PyTorch's traces
//!   are. A free of an address with no live id (it cannot happen while the invariants hold)
//!   writes nothing.
//! * **Sizes** are the bytes asked for, on the free's line too; zero-byte requests (empty
//!   blocks) are not written.
//! * **Streams** are numbered from 0 in the order they first allocate; a free is written on
//!   its block's stream, the stream it is ordered on.
//! * **Pauses** ([`Pool::pause_trace`](super::Pool::pause_trace)) leave out the blocks
//!   allocated meanwhile, whole: their frees are not written either, and the frees of
//!   blocks written before are. The file stays a trace that replays.
//!
//! # Why a mutex, and off the hit path
//!
//! The file's order must be a real order of the events, across threads: a lock gives it for
//! free, where per-thread buffers would need a global sequence number and a merge. As with
//! `track_sites`, a recording pool caches no size class, so every allocation and free takes
//! the slow paths where the line is written, and a pool that does not record carries
//! nothing for it on the hit path: one `Option` test on the slow paths. Recording is a
//! measuring tool: the workload it records runs at the speed of those paths.
//!
//! # Failures
//!
//! Nothing here fails an allocation or a free. The file is made when the pool is (a path
//! that cannot be created fails [`Pool::new`](super::Pool::new)); a write that fails later
//! stops the recording, and the error is kept for [`Pool::flush_trace`](super::Pool::flush_trace)
//! to report. Lines are buffered: they reach the file as the buffer fills, at
//! [`Pool::flush_trace`](super::Pool::flush_trace), and when the pool is dropped.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::device::StreamId;
use crate::error::{Error, Result};

/// The header line of a trace (see [`crate::replay`]).
const HEADER: &str = "op,id,size,stream";

/// A pool's trace being written. See the module docs.
pub(crate) struct Recorder {
    path: PathBuf,
    books: Mutex<Books>,
}

struct Books {
    /// None once a write failed (the error is in `failed`).
    out: Option<BufWriter<File>>,
    failed: Option<String>,
    /// Live blocks: address → (id, bytes asked for).
    live: HashMap<u64, (u64, u64)>,
    next_id: u64,
    streams: HashMap<StreamId, u32>,
    /// Lines written so far, the header not counted.
    events: u64,
    /// While true, allocations are not written (their frees then are not either); frees of
    /// blocks written before still are, so the file stays a trace that replays.
    paused: bool,
}

impl Recorder {
    /// Start a trace at `path` (created, or truncated), its header written.
    pub(crate) fn create(path: &Path) -> Result<Recorder> {
        let fail = |e: std::io::Error| Error::InvalidArgument(format!("trace file {}: {e}", path.display()));
        let mut out = BufWriter::with_capacity(1 << 16, File::create(path).map_err(fail)?);
        writeln!(out, "{HEADER}").map_err(fail)?;
        let books = Books {
            out: Some(out),
            failed: None,
            live: HashMap::new(),
            next_id: 0,
            streams: HashMap::new(),
            events: 0,
            paused: false,
        };
        Ok(Recorder { path: path.to_path_buf(), books: Mutex::new(books) })
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        // A panic elsewhere while the lock was held leaves whole books (each update is one
        // insert or remove and one line): go on with them.
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The block at `addr` of `bytes` asked for, on `stream`, is about to be handed out.
    pub(crate) fn alloc(&self, addr: u64, bytes: u64, stream: StreamId) {
        if bytes == 0 {
            return;
        }
        let mut b = self.books();
        if b.paused {
            return;
        }
        let id = b.next_id;
        b.next_id += 1;
        b.live.insert(addr, (id, bytes));
        let s = b.stream_number(stream);
        b.line(format_args!("a,{id},{bytes},{s}"));
    }

    /// The block at `addr`, of `stream`, is being freed (its memory not yet back).
    pub(crate) fn free(&self, addr: u64, stream: StreamId) {
        let mut b = self.books();
        let Some((id, bytes)) = b.live.remove(&addr) else { return };
        let s = b.stream_number(stream);
        b.line(format_args!("f,{id},{bytes},{s}"));
    }

    /// Stop writing allocations (`true`) or start again (`false`): what a program records
    /// can then be its workload alone, not its start-up or its own checks. A block
    /// allocated while paused is left out whole (its free too); a block written before is
    /// freed in the file whenever it is freed.
    pub(crate) fn pause(&self, paused: bool) {
        self.books().paused = paused;
    }

    /// Write what is buffered to the file: the lines written so far, or the error that
    /// stopped the recording.
    pub(crate) fn flush(&self) -> Result<u64> {
        let mut b = self.books();
        b.flush();
        match &b.failed {
            Some(why) => Err(Error::InvalidArgument(format!("trace file {}: {why}", self.path.display()))),
            None => Ok(b.events),
        }
    }

    /// As [`Recorder::flush`], but only if no thread is writing a line now: for the end of
    /// the process, where a thread stopped mid-line must not stop the exit.
    pub(crate) fn flush_if_idle(&self) {
        let mut b = match self.books.try_lock() {
            Ok(b) => b,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        b.flush();
    }
}

impl Books {
    /// The trace's number for `stream`: given in the order streams first appear.
    fn stream_number(&mut self, stream: StreamId) -> u32 {
        let next = self.streams.len() as u32;
        *self.streams.entry(stream).or_insert(next)
    }

    /// Write the buffered lines to the file (a failure stops the recording).
    fn flush(&mut self) {
        if let Some(Err(e)) = self.out.as_mut().map(|out| out.flush()) {
            self.stop(e);
        }
    }

    fn line(&mut self, line: std::fmt::Arguments<'_>) {
        let Some(out) = self.out.as_mut() else { return };
        match writeln!(out, "{line}") {
            Ok(()) => self.events += 1,
            Err(e) => self.stop(e),
        }
    }

    /// A write failed: keep the error, write no more (a partial line may be in the file; the
    /// lines before it are whole).
    fn stop(&mut self, e: std::io::Error) {
        self.failed = Some(format!("writing stopped after {} events: {e}", self.events));
        self.out = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("vrampool-record-{}-{name}.csv", std::process::id()))
    }

    #[test]
    fn lines_follow_the_events_with_fresh_ids_and_dense_streams() {
        let path = temp("lines");
        let r = Recorder::create(&path).unwrap();
        r.alloc(0x1000, 100, 77);
        r.alloc(0x2000, 0, 77);
        r.alloc(0x3000, 300, 5);
        r.free(0x1000, 77);
        r.alloc(0x1000, 50, 5);
        r.free(0x9999, 5);
        r.free(0x1000, 5);
        assert_eq!(r.flush().unwrap(), 5);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(text, "op,id,size,stream\na,0,100,0\na,1,300,1\nf,0,100,0\na,2,50,1\nf,2,50,1\n");
    }

    #[test]
    fn a_pause_leaves_out_whole_blocks_and_keeps_the_frees_of_those_written() {
        let path = temp("pause");
        let r = Recorder::create(&path).unwrap();
        r.alloc(0x1000, 100, 7);
        r.pause(true);
        r.alloc(0x2000, 200, 7); // left out, and so is its free
        r.free(0x1000, 7); // written before the pause: its free is written
        r.pause(false);
        r.free(0x2000, 7);
        r.alloc(0x3000, 300, 7);
        assert_eq!(r.flush().unwrap(), 3);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(text, "op,id,size,stream\na,0,100,0\nf,0,100,0\na,1,300,0\n");
    }

    #[test]
    fn a_path_that_cannot_be_made_is_an_error_not_a_panic() {
        let e = Recorder::create(Path::new("/nonexistent-dir/for/sure/trace.csv")).err().unwrap();
        assert!(e.to_string().contains("nonexistent-dir"), "{e}");
    }

    #[test]
    fn a_failed_write_stops_the_recording_and_is_reported() {
        // /dev/full accepts the open and fails every write with ENOSPC.
        let Ok(r) = Recorder::create(Path::new("/dev/full")) else { return };
        for i in 0..10_000u64 {
            r.alloc(i << 8, 256, 1);
        }
        let e = r.flush().unwrap_err().to_string();
        assert!(e.contains("writing stopped"), "{e}");
        r.alloc(1 << 40, 256, 1);
        assert!(r.flush().is_err(), "still reported after more events");
    }
}
