//! The streams of one device, by the key the registry gives a raw handle, each with a small
//! token the C ABI's live-block table stores in place of the stream.
//!
//! Keys: on the simulator the handle itself (NULL is the device's default stream; any other
//! value names a stream made the first time it is seen). On CUDA never the handle's value,
//! which the driver reuses once a stream is destroyed: the driver's own stream id
//! (`cuStreamGetId`, unique for the life of the context), fixed keys for the legacy default
//! stream (NULL and `CU_STREAM_LEGACY`), and the calling thread for the per-thread default
//! stream (`CU_STREAM_PER_THREAD`), which names a different stream on each thread.
//!
//! Lookups are lock-free (an arc-swap'd snapshot); a stream seen for the first time is added
//! under a mutex (one-time set-up per stream), and never removed: blocks may be cached
//! against it for the life of the pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::device::{Stream, StreamId};
use crate::error::{Error, Result};

/// One stream the registry knows.
#[derive(Debug)]
pub struct StreamRec {
    /// The pool's handle for it.
    pub stream: Stream,
    /// The caller's raw handle (as passed the first time).
    pub raw: u64,
    /// Its token: 1, 2, ... in the order streams were first seen on this device.
    pub token: u32,
    /// `stream.id()`.
    pub id: StreamId,
}

#[derive(Default)]
struct Snapshot {
    by_key: HashMap<u64, Arc<StreamRec>>,
    /// Token `t` at index `t - 1`.
    by_token: Vec<Arc<StreamRec>>,
}

/// The streams of one device.
pub struct Streams {
    snap: ArcSwap<Snapshot>,
    add: Mutex<()>,
    max: usize,
}

impl Streams {
    pub(crate) fn new(max: usize) -> Streams {
        Streams { snap: ArcSwap::from_pointee(Snapshot::default()), add: Mutex::new(()), max }
    }

    /// The stream of `key`, if seen before.
    pub(crate) fn get(&self, key: u64) -> Option<Arc<StreamRec>> {
        self.snap.load().by_key.get(&key).cloned()
    }

    /// The stream last seen with raw handle `raw` and not destroyed: for a handle that
    /// cannot be keyed now (a capturing stream's id cannot be asked).
    pub(crate) fn by_raw(&self, raw: u64) -> Option<Arc<StreamRec>> {
        self.snap.load().by_token.iter().rev().find(|r| r.raw == raw && !r.stream.is_destroyed()).cloned()
    }

    /// The stream the pool knows as `id` (the newest, should a destroyed one share it).
    pub(crate) fn by_id(&self, id: StreamId) -> Option<Arc<StreamRec>> {
        self.snap.load().by_token.iter().rev().find(|r| r.id == id).cloned()
    }

    /// The stream of `token`.
    pub(crate) fn by_token(&self, token: u32) -> Option<Arc<StreamRec>> {
        let i = (token as usize).checked_sub(1)?;
        self.snap.load().by_token.get(i).cloned()
    }

    /// The stream of `key`, made with `make` the first time (`make` gets the raw handle's
    /// stream: the pool's handle). Refused past the device's stream limit.
    pub(crate) fn get_or_make(
        &self,
        key: u64,
        raw: u64,
        make: impl FnOnce() -> Result<Stream>,
    ) -> Result<Arc<StreamRec>> {
        if let Some(rec) = self.get(key) {
            return Ok(rec);
        }
        let _one = self.add.lock().unwrap_or_else(|p| p.into_inner());
        let snap = self.snap.load_full();
        if let Some(rec) = snap.by_key.get(&key) {
            return Ok(Arc::clone(rec));
        }
        if snap.by_token.len() >= self.max {
            return Err(Error::InvalidArgument(format!(
                "stream {raw:#x}: this device already has {} streams, the most VRAMPOOL_MAX_STREAMS allows",
                self.max
            )));
        }
        let stream = make()?;
        let rec = Arc::new(StreamRec { id: stream.id(), stream, raw, token: snap.by_token.len() as u32 + 1 });
        let mut next = Snapshot { by_key: snap.by_key.clone(), by_token: snap.by_token.clone() };
        next.by_key.insert(key, Arc::clone(&rec));
        next.by_token.push(Arc::clone(&rec));
        self.snap.store(Arc::new(next));
        Ok(rec)
    }
}

impl Streams {
    /// Take `key`'s stream out of the lookups and return it, so that the handle's value, if
    /// the driver or the caller uses it again, names a new stream; its token stays, for the
    /// blocks still live on it.
    pub(crate) fn forget(&self, key: u64) -> Option<Arc<StreamRec>> {
        let _one = self.add.lock().unwrap_or_else(|p| p.into_inner());
        let snap = self.snap.load_full();
        let rec = Arc::clone(snap.by_key.get(&key)?);
        let mut next = Snapshot { by_key: snap.by_key.clone(), by_token: snap.by_token.clone() };
        next.by_key.remove(&key);
        self.snap.store(Arc::new(next));
        Some(rec)
    }
}

// The keys of CUDA handles (unused without the `cuda` feature but by the tests).
/// CUDA's special stream handles.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CU_STREAM_LEGACY: u64 = 0x1;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CU_STREAM_PER_THREAD: u64 = 0x2;

/// Key kinds on CUDA, in the top two bits (driver stream ids are below 2^62). NULL and
/// `CU_STREAM_LEGACY` name the same stream but get two keys, so that each record keeps the
/// handle its blocks are freed with; the pool then treats them as two streams, which only
/// costs events where none were needed.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const KEY_LEGACY: u64 = 2 << 62;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const KEY_PER_THREAD: u64 = 3 << 62;

/// The key of CUDA handle `raw` as seen from the calling thread. `id` asks the driver for a
/// stream's id (only called for handles that are not special).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn cuda_key(raw: u64, id: impl FnOnce(u64) -> Result<u64>) -> Result<u64> {
    match raw {
        0 | CU_STREAM_LEGACY => Ok(KEY_LEGACY | raw),
        CU_STREAM_PER_THREAD => Ok(KEY_PER_THREAD | thread_serial()),
        _ => {
            let id = id(raw)?;
            if id >> 62 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "stream {raw:#x}: the driver gave it id {id:#x}, out of range"
                )));
            }
            Ok(id)
        }
    }
}

/// A number for the calling thread, unique for the life of the process.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn thread_serial() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    std::thread_local! {
        static SERIAL: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    SERIAL.try_with(|s| *s).unwrap_or_else(|_| NEXT.fetch_add(1, Ordering::Relaxed))
}

/// `cuStreamGetId` (CUDA 12.0): the driver's id of stream `raw`.
#[cfg(feature = "cuda")]
pub(crate) fn cu_stream_id(raw: u64) -> Result<u64> {
    use cudarc::driver::sys;
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: the registry checked at start-up that the driver has this symbol; the driver
    // validates the handle (the caller promised a live stream of the device's context) and
    // writes one integer.
    let rc = unsafe { sys::cuStreamGetId(raw as usize as sys::CUstream, &mut id) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Device {
            call: "cuStreamGetId",
            code: rc as i64,
            message: Box::new(format!("stream {raw:#x} is not a live stream ({rc:?})")),
        });
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Device, SimDevice};

    #[test]
    fn a_key_gets_one_stream_and_tokens_count_up() {
        let dev = SimDevice::new(64 << 20);
        let s = Streams::new(8);
        let a = s.get_or_make(7, 7, || dev.create_stream()).unwrap();
        let b = s.get_or_make(9, 9, || dev.create_stream()).unwrap();
        let a2 = s.get_or_make(7, 7, || panic!("made twice")).unwrap();
        assert_eq!((a.token, b.token), (1, 2));
        assert!(Arc::ptr_eq(&a, &a2));
        assert_eq!(s.by_token(2).unwrap().id, b.id);
        assert!(s.by_token(0).is_none() && s.by_token(3).is_none());
    }

    #[test]
    fn past_the_limit_a_new_stream_is_refused() {
        let dev = SimDevice::new(64 << 20);
        let s = Streams::new(1);
        s.get_or_make(1, 1, || dev.create_stream()).unwrap();
        let e = s.get_or_make(2, 2, || dev.create_stream()).unwrap_err();
        assert!(e.to_string().contains("VRAMPOOL_MAX_STREAMS"), "{e}");
    }

    #[test]
    fn cuda_keys_follow_stream_identity_not_handle_values() {
        assert_ne!(cuda_key(0, |_| unreachable!()).unwrap(), cuda_key(CU_STREAM_LEGACY, |_| unreachable!()).unwrap());
        assert_eq!(cuda_key(0xdead0, |_| Ok(5)).unwrap(), 5);
        // The same handle value, reused by the driver for a new stream, is a new key.
        assert_ne!(cuda_key(0xdead0, |_| Ok(5)).unwrap(), cuda_key(0xdead0, |_| Ok(6)).unwrap());
        let here = cuda_key(CU_STREAM_PER_THREAD, |_| unreachable!()).unwrap();
        let there = std::thread::spawn(|| cuda_key(CU_STREAM_PER_THREAD, |_| unreachable!()).unwrap()).join().unwrap();
        assert_ne!(here, there);
        assert_eq!(here, cuda_key(CU_STREAM_PER_THREAD, |_| unreachable!()).unwrap());
        assert!(cuda_key(0xbeef0, |_| Ok(1 << 62)).is_err());
    }
}
