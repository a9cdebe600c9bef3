//! The paths behind `vrampool_malloc`, `vrampool_free` and `vrampool_record_stream`: the
//! thread memo's hot paths, the slow paths that find (or make) a device, a stream and an
//! owner record, the owner's and other threads' frees through the live table, and the
//! errors of a refused call. Apart from the entry points (`ffi`), which say what each call
//! promises, because this is how those promises are kept: most of the ABI's code, shaped so
//! that the hot paths stay small leaves and everything else is out of line.
//!
//! **No lock on the allocation or free path.** A malloc finds its device, stream and owner
//! record in the thread's memo (a few loads and compares, one of them the registry's gate,
//! which moves when a stream is declared destroyed: a handle's value may then name a new
//! stream, and the memo keys it again), allocates from the pool's thread cache
//! and publishes the block in its slot with plain stores; the owning thread's free finds
//! the slot from the address and takes it back with plain loads and stores. A free on
//! another thread takes one compare-and-swap and is settled in a batch; only the first use
//! of a device or a stream takes a lock (one-time set-up).

use std::ffi::{c_int, c_void};
use std::ptr::NonNull;

use libc::ssize_t;

use super::device::{self, AbiDevice};
use super::memo::{self, MEMO};
use super::status::{bump, vrampool_status, AbiError, Counter};
use super::words::{self, Ext, Parts, MAX_PACKED_LEN};
use super::{foreign, graph, relaxed};
use crate::live::{Refusal, Settled, Words};
use crate::pool::class_and_size;
use crate::registry::{self, StreamRec};
use crate::{Block, DeviceKind, Error};

#[inline(always)]
pub(super) fn malloc(size: ssize_t, device: c_int, raw: u64) -> *mut c_void {
    // One compare for zero, negative and too long to pack (1 TiB and more).
    if (size as u64).wrapping_sub(1) >= MAX_PACKED_LEN {
        return malloc_edge(size, device, raw);
    }
    match MEMO.try_with(|m| malloc_hit(m, size as usize, device, raw)) {
        Ok(Some(p)) => p,
        _ => malloc_slow(size as usize, device, raw),
    }
}

#[cold]
#[inline(never)]
fn malloc_edge(size: ssize_t, device: c_int, raw: u64) -> *mut c_void {
    match size {
        0 => std::ptr::null_mut(),
        ..0 => refused_malloc(size, device),
        _ => malloc_slow(size as usize, device, raw),
    }
}

/// The memo's path: the device and stream of the thread's last allocation. `None` if the
/// memo names others (nothing was done).
#[inline(always)]
fn malloc_hit(m: &memo::Memo, size: usize, device: c_int, raw: u64) -> Option<*mut c_void> {
    if m.alloc_device.get() != device as i64 || m.raw.get() != raw || m.gate.get() != registry::gate() {
        return None;
    }
    // SAFETY: `alloc_device` names the device only with a cache (and its shared part),
    // which the thread's `CACHES` holds until it clears the memo.
    let (cache, shared) = unsafe { (&*m.cache.get(), &*m.shared.get()) };
    // The hit alone here, everything else out of line: the hot path stays a small leaf.
    match crate::pool::try_alloc_hit(shared, size) {
        Some((addr, size_class)) => {
            let info = size as u64 | m.token_bits.get();
            if !m.table().publish_at(addr, m.owner.get(), Words { info, size: size_class, ext: false }) {
                return Some(outside_table(m, addr, size as u64, size_class));
            }
            Some(addr as *mut c_void)
        }
        None => Some(malloc_miss(m, cache, size)),
    }
}

/// [`malloc_hit`] past the loaded magazines: the cache's whole path.
#[cold]
#[inline(never)]
fn malloc_miss(m: &memo::Memo, cache: &crate::StreamCache, size: usize) -> *mut c_void {
    let _relaxed = relaxed();
    let at = Named::of(m);
    match cache.alloc(size) {
        Ok(block) => publish(at.dev, block, at.rec.token, at.owner),
        Err(e) => malloc_failed(&at, m, size, e),
    }
}

/// What the memo named when an allocation called the pool: read once, before the call,
/// and used after it instead of the memo, which an out-of-memory handler inside the call
/// may have made name another stream (its own calls into this library remember theirs).
struct Named {
    dev: &'static AbiDevice,
    rec: &'static registry::StreamRec,
    device: i64,
    raw: u64,
    owner: usize,
}

impl Named {
    fn of(m: &memo::Memo) -> Named {
        // SAFETY: callers hold a memo that names a device and a stream record (they checked
        // `names` or took the memo's hot path), and both live for ever.
        let (dev, rec) = unsafe { (&*m.dev.get(), &*m.rec.get()) };
        Named { dev, rec, device: m.device.get(), raw: m.raw.get(), owner: m.owner.get() }
    }
}

/// The pool handed the memo's stream a block outside its table (a bug): it goes back, the
/// allocation fails with the error set.
#[cold]
#[inline(never)]
fn outside_table(m: &memo::Memo, addr: u64, len: u64, size_class: u64) -> *mut c_void {
    free_freed(m, addr, len, size_class);
    report_outside(addr)
}

/// Report a block the pool handed out at `addr`, outside the table's range (a bug, given
/// back by the caller): the allocation's NULL.
#[cold]
fn report_outside(addr: u64) -> *mut c_void {
    let msg = format!("vrampool_malloc: the pool handed out {addr:#x}, outside its range (a bug)");
    AbiError::new(vrampool_status::VRAMPOOL_ERROR_INTERNAL, Counter::Internal, msg).report();
    std::ptr::null_mut()
}

/// CUDA's memo path when the hot path is closed (the registry's gate moved since the memo
/// was taken, or a capture is declared underway): as [`malloc_hit`], once the handle's key
/// (one driver call) shows it still names the memo's stream, which opens the hot path again
/// where it may be; through the pool (its memo finds the same cache), so that
/// [`malloc_miss`] stays the one caller of `StreamCache::alloc`, which the compiler then
/// inlines into it. Not on the simulator, whose key is the handle's value whether or not
/// the stream was declared destroyed since: the slow path finds out.
fn malloc_hit_cuda(m: &memo::Memo, size: usize, device: c_int, raw: u64) -> Option<*mut c_void> {
    if !m.names(device as i64, raw) || m.cache.get().is_null() {
        return None;
    }
    let at = Named::of(m);
    if at.dev.entry.kind != DeviceKind::Cuda {
        return None;
    }
    let gate = registry::gate();
    if registry::stream_key(at.dev.entry, raw).ok() != Some(m.key.get()) {
        return None;
    }
    m.rearm(at.device, gate);
    Some(match at.dev.entry.pool.alloc(size, &at.rec.stream) {
        Ok(block) => publish(at.dev, block, at.rec.token, at.owner),
        Err(e) => malloc_failed(&at, m, size, e),
    })
}

/// Record `block`, just allocated on stream `token` by owner `owner`, in its device's table.
#[inline(always)]
fn publish(dev: &AbiDevice, block: Block, token: u32, owner: usize) -> *mut c_void {
    let (addr, len, size) = words::view(&block);
    match dev.table.index(addr) {
        Some(idx) if len <= MAX_PACKED_LEN => {
            std::mem::forget(block);
            dev.table.publish(idx, owner, Words { info: words::pack(len, token), size, ext: false });
            addr as *mut c_void
        }
        _ => publish_ext(dev, block, token, owner),
    }
}

#[cold]
#[inline(never)]
fn publish_ext(dev: &AbiDevice, block: Block, token: u32, owner: usize) -> *mut c_void {
    let (addr, _, size) = words::view(&block);
    match dev.table.index(addr) {
        Some(idx) => {
            dev.table.publish(idx, owner, Words { info: Ext::into_info(block, token), size, ext: true });
            addr as *mut c_void
        }
        None => {
            drop(block);
            report_outside(addr)
        }
    }
}

/// The pool refused an allocation on `at`'s stream: settle pending frees and try once more
/// if it was out of memory, else report.
#[cold]
#[inline(never)]
fn malloc_failed(at: &Named, m: &memo::Memo, size: usize, e: Error) -> *mut c_void {
    let retried = match e {
        // The stream was declared destroyed (`vrampool_stream_destroyed`) and its handle
        // value is in use again: the slow path finds the new stream.
        Error::StreamDestroyed => {
            m.forget();
            return malloc_slow(size, at.device as c_int, at.raw);
        }
        e => retry_out_of_memory(at.dev, size, &at.rec.stream, e),
    };
    match retried {
        Ok(block) => publish(at.dev, block, at.rec.token, at.owner),
        Err(e) => {
            AbiError::from_error("vrampool_malloc", Counter::FailedMallocs, &e).report();
            std::ptr::null_mut()
        }
    }
}

/// An allocation on `stream` failed with `e`: if it ran out of memory and something can be
/// given back — frees other threads handed over, released graph pools (as PyTorch frees
/// its released private pools before it retries) — give it back and try once more.
#[cold]
#[inline(never)]
fn retry_out_of_memory(dev: &AbiDevice, size: usize, stream: &crate::Stream, e: Error) -> Result<Block, Error> {
    if !matches!(e, Error::OutOfMemory(_)) || (foreign::pending() == 0 && !graph::finishable()) {
        return Err(e);
    }
    foreign::settle(true);
    // A pool that cannot be given back now stays for `vrampool_empty_cache`; the retry
    // reports the out-of-memory if it fails again.
    let _ = graph::finish_ready();
    dev.entry.pool.alloc(size, stream)
}

#[cold]
#[inline(never)]
fn refused_malloc(size: ssize_t, device: c_int) -> *mut c_void {
    let msg = format!("vrampool_malloc({size}, device {device}): a negative size");
    AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_ARGUMENT, Counter::InvalidMallocs, msg).report();
    std::ptr::null_mut()
}

/// Everything the memo's path does not do: find (or make) the device and the stream,
/// take an owner record, allocate (settling pending frees and trying again when out of
/// memory), publish.
#[cold]
#[inline(never)]
fn malloc_slow(size: usize, device: c_int, raw: u64) -> *mut c_void {
    let _relaxed = relaxed();
    // A stream this thread allocated on lately: its memo names it again.
    let recalled = |m: &memo::Memo| m.recall(device as i64, raw).then(|| malloc_hit(m, size, device, raw)).flatten();
    if let Ok(Some(p)) = MEMO.try_with(recalled) {
        return p;
    }
    if let Ok(Some(p)) = MEMO.try_with(|m| malloc_hit_cuda(m, size, device, raw)) {
        return p;
    }
    match malloc_checked(size, device, raw) {
        Ok(p) => p,
        Err(e) => {
            e.report();
            std::ptr::null_mut()
        }
    }
}

fn malloc_checked(size: usize, device: c_int, raw: u64) -> Result<*mut c_void, AbiError> {
    let call = "vrampool_malloc";
    let invalid = |e: &Error| AbiError::from_error(call, Counter::InvalidMallocs, e);
    let ordinal = usize::try_from(device).map_err(|_| invalid(&Error::InvalidArgument(format!("device {device}"))))?;
    let dev = device::get(ordinal).map_err(|e| invalid(&e))?;
    // Before the handle is keyed: a stream declared destroyed meanwhile moves the gate.
    let gate = registry::gate();
    let key = registry::stream_key(dev.entry, raw).map_err(|e| invalid(&e))?;
    let rec = registry::stream_rec_keyed(dev.entry, raw, key).map_err(|e| invalid(&e))?;
    let owner = MEMO
        .try_with(|m| {
            m.ensure_owner();
            m.remember((device as i64, raw, key, gate), dev, &rec);
            m.owner.get()
        })
        .unwrap_or(0);
    // The pool's own path (it finds the cache just remembered), for the reason given at
    // `malloc_hit_cuda`.
    let block = dev
        .entry
        .pool
        .alloc(size, &rec.stream)
        .or_else(|e| retry_out_of_memory(dev, size, &rec.stream, e))
        .map_err(|e| AbiError::from_error(call, Counter::FailedMallocs, &e))?;
    Ok(publish(dev, block, rec.token, owner))
}

#[inline(always)]
pub(super) fn free(addr: u64, size: ssize_t, device: c_int, raw: u64) {
    let done = MEMO.try_with(|m| {
        let len = size as u64;
        if m.free_device.get() != device as i64 || m.raw.get() != raw || len.wrapping_sub(1) >= MAX_PACKED_LEN {
            return false;
        }
        // SAFETY: `free_device` names the device only while the thread holds its owner
        // record.
        let mine = unsafe { &*m.owner_rec.get() };
        let table = m.table();
        let Some(idx) = table.index(addr) else { return false };
        let info = len | m.token_bits.get();
        match table.free_owned(idx, mine, m.owner.get(), info) {
            Some(size_class) => {
                cache_freed(m, addr, len, size_class);
                true
            }
            None => false,
        }
    });
    if done != Ok(true) {
        free_slow(addr, size, device, raw);
    }
}

/// A hot-path free's block, its slot just freed by its owner and its info word the memo's
/// stream's: the thread's cache for that stream takes it as the block's own drop would,
/// without making the block and finding the cache again.
#[inline(always)]
fn cache_freed(m: &memo::Memo, addr: u64, len: u64, size_class: u64) {
    let shared = m.shared.get();
    let (class, size) = class_and_size(size_class);
    // SAFETY: a non-null `shared` is held by the thread's `CACHES` (memo docs).
    if shared.is_null() || !unsafe { &*shared }.try_push_fast(class as usize, size, addr) {
        free_freed(m, addr, len, size_class);
    }
}

/// The rest of a hot-path free whose block the cache's hit path could not take (or a block
/// that cannot be published): the block made again and dropped (its whole path). Out of
/// line, so the hot path stays small.
#[cold]
#[inline(never)]
fn free_freed(m: &memo::Memo, addr: u64, len: u64, size_class: u64) {
    let _relaxed = relaxed();
    // SAFETY: the memo names a device, whose pool pointer is never null.
    let pool = unsafe { NonNull::new_unchecked(m.pool.get().cast_mut()) };
    let parts = Parts { addr, len, size_class, stream: m.stream_id.get(), pool };
    // SAFETY: these are the parts of a block the pool gave the memo's stream (whose id this
    // is) and nobody else holds: a slot's, whose info word matched that stream and whose
    // owner's free took it from live to free, or (`outside_table`) one just allocated.
    drop(unsafe { words::rebuild(parts) });
}

#[cold]
#[inline(never)]
fn free_slow(addr: u64, size: ssize_t, device: c_int, raw: u64) {
    let _relaxed = relaxed();
    if let Err(e) = free_checked(addr, size, device, raw) {
        e.report();
    }
}

/// What a free says of its block: the size and stream handle it was allocated with
/// (`vrampool_free`, checked against the block), or nothing (`vrampool_free_any`: whatever
/// they were).
#[derive(Clone, Copy)]
struct Expect {
    size: ssize_t,
    raw: u64,
}

/// What a free's check saw of the block, for the message of a refusal and the answer of
/// `vrampool_free_any`: (bytes asked for, the stream handle it was allocated with).
type Seen = std::cell::Cell<Option<(u64, Option<u64>)>>;

/// Whether a block of `len` bytes allocated on `alloc_raw` is what `expect` says.
fn matches(expect: Option<Expect>, len: u64, alloc_raw: Option<u64>) -> bool {
    expect.is_none_or(|e| e.size > 0 && len == e.size as u64 && alloc_raw == Some(e.raw))
}

/// Whether a slot's (unboxed) words are those of the allocation `expect` says.
fn words_match(dev: &AbiDevice, w: Words, expect: Option<Expect>, seen: &Seen) -> bool {
    let (len, token) = words::unpack(w.info);
    let alloc_raw = stream_raw(dev, token);
    seen.set(Some((len, alloc_raw)));
    matches(expect, len, alloc_raw)
}

fn ext_matches(dev: &AbiDevice, ext: &Ext, expect: Option<Expect>, seen: &Seen) -> bool {
    let (len, alloc_raw) = (ext.block.len() as u64, stream_raw(dev, ext.token));
    seen.set(Some((len, alloc_raw)));
    matches(expect, len, alloc_raw)
}

fn stream_raw(dev: &AbiDevice, token: u32) -> Option<u64> {
    dev.entry.streams.by_token(token).map(|r| r.raw)
}

fn free_checked(addr: u64, size: ssize_t, device: c_int, raw: u64) -> Result<(), AbiError> {
    let call = "vrampool_free";
    let dev = usize::try_from(device).ok().and_then(device::existing).ok_or_else(|| {
        let msg = format!("{call}({addr:#x}): device {device} has no pool: no block of it was allocated here");
        AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_FREE, Counter::InvalidFrees, msg)
    })?;
    free_in(call, Some(dev), addr, Some(Expect { size, raw })).map(drop)
}

/// `vrampool_free_any`: free the block at `addr` (not NULL) as allocated, found by its
/// address on whichever device or graph pool holds it; returns what it was. The owner's
/// free of a block of its memo's device takes the hot path, as `vrampool_free` does.
pub(super) fn free_any(addr: u64) -> Result<graph::Freed, AbiError> {
    match MEMO.try_with(|m| free_any_hit(m, addr)) {
        Ok(Some(was)) => Ok(was),
        _ => free_any_slow(addr),
    }
}

/// [`free_any`]'s hot path: the memo's device holds `addr`, and this thread's unboxed
/// block starts there.
#[inline(always)]
fn free_any_hit(m: &memo::Memo, addr: u64) -> Option<graph::Freed> {
    let device = m.free_device.get();
    if device < 0 {
        return None;
    }
    let table = m.table();
    let idx = table.index(addr)?;
    // SAFETY: `free_device` names a device only while the thread holds its owner record.
    let mine = unsafe { &*m.owner_rec.get() };
    let (info, size_class) = table.free_owned_any(idx, mine, m.owner.get())?;
    let (len, token) = words::unpack(info);
    let mut was = graph::Freed { len, raw: m.raw.get(), device: device as usize };
    if token == m.token.get() {
        cache_freed(m, addr, len, size_class);
    } else {
        // SAFETY: the memo names a device while `free_device` does; devices live for ever.
        let dev = unsafe { &*m.dev.get() };
        was.raw = stream_raw(dev, token).unwrap_or(0);
        give_back(dev, idx, Words { info, size: size_class, ext: false });
    }
    Some(was)
}

#[cold]
#[inline(never)]
fn free_any_slow(addr: u64) -> Result<graph::Freed, AbiError> {
    let _relaxed = relaxed();
    free_in("vrampool_free_any", device::holding(addr), addr, None)
}

/// Free the block at `addr` on `dev` (or, outside every device's table, in the graph pool
/// holding it), if it is what `expect` says; returns what it was.
fn free_in(
    call: &str,
    dev: Option<&'static AbiDevice>,
    addr: u64,
    expect: Option<Expect>,
) -> Result<graph::Freed, AbiError> {
    let (size, raw) = expect.map_or((-1, 0), |e| (e.size, e.raw));
    let Some((dev, idx)) = dev.and_then(|d| Some((d, d.table.index(addr)?))) else {
        return match graph::free(addr, expect.map(|e| (e.size as u64, e.raw))) {
            Some(Ok(was)) => Ok(was),
            Some(Err(graph::FreeRefusal::NotLive)) => {
                Err(refusal(call, addr, size, raw, Refusal::NotLive { ever: true }, None))
            }
            Some(Err(graph::FreeRefusal::Mismatch { len, raw: alloc_raw })) => {
                Err(mismatch(call, addr, size, raw, len, Some(alloc_raw)))
            }
            None => match dev {
                Some(dev) => Err(not_a_block(call, dev, addr)),
                None => {
                    let msg = format!("{call}({addr:#x}): not a pointer of any pool");
                    Err(AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_FREE, Counter::InvalidFrees, msg))
                }
            },
        };
    };
    let seen = Seen::new(None);
    let refused = |r: Refusal| refusal(call, addr, size, raw, r, seen.get());
    let freed = |seen: &Seen| {
        let (len, raw) = seen.get().map_or((0, None), |s| s);
        graph::Freed { len, raw: raw.unwrap_or(0), device: dev.entry.ordinal }
    };
    let (me, mine) = MEMO.try_with(|m| (m.owner.get(), m.owner_rec.get())).unwrap_or((0, std::ptr::null()));
    if me != 0 && dev.table.owner(idx) == Ok(me) {
        // SAFETY: non-null with an owner index: the thread's own record.
        let mine = unsafe { &*mine };
        let check = |w: Words| {
            if w.ext {
                // SAFETY: the owner holds the slot inside its window (invariant 3).
                ext_matches(dev, unsafe { Ext::peek(w.info) }, expect, &seen)
            } else {
                words_match(dev, w, expect, &seen)
            }
        };
        match dev.table.free_owned_with(idx, mine, me, check) {
            Ok(w) => {
                give_back(dev, idx, w);
                return Ok(freed(&seen));
            }
            // The block changed hands meanwhile: free it as any other thread would.
            Err(Refusal::Foreign) => {}
            Err(r) => return Err(refused(r)),
        }
    }
    let claim = dev.table.claim(idx, |w| words_match(dev, w, expect, &seen)).map_err(refused)?;
    if !claim.words.ext {
        foreign::defer(dev, claim);
        return Ok(freed(&seen));
    }
    // A boxed block: its record may be read only once the claim has settled.
    bump(Counter::ForeignFrees);
    match dev.table.settle_now(&claim, device::owners()) {
        Some(Settled::Won) => {
            // SAFETY: a won claim holds the slot (invariant 3).
            let ext = unsafe { Ext::peek(claim.words.info) };
            if !ext_matches(dev, ext, expect, &seen) {
                dev.table.undo(&claim);
                return Err(refused(Refusal::Mismatch));
            }
            dev.table.release(&claim);
            give_back(dev, idx, claim.words);
            Ok(freed(&seen))
        }
        Some(_) => Err(refused(Refusal::Claimed)),
        None => Err(AbiError::new(
            vrampool_status::VRAMPOOL_ERROR_INTERNAL,
            Counter::Internal,
            format!("{call}({addr:#x}): the cross-thread fence failed; the block stays allocated"),
        )),
    }
}

/// Give a block back to the pool, once its slot went from live to free by this thread.
fn give_back(dev: &AbiDevice, idx: usize, w: Words) {
    if w.ext {
        // SAFETY: the slot no longer names the record: this thread freed it.
        drop(unsafe { Ext::take(w.info) }.block);
        return;
    }
    let (len, token) = words::unpack(w.info);
    match dev.entry.streams.by_token(token) {
        Some(rec) => {
            let parts = Parts { addr: dev.table.address(idx), len, size_class: w.size, stream: rec.id, pool: dev.pool };
            // SAFETY: the slot held these parts since the publication, and this thread took
            // it from live to free (invariant 4).
            drop(unsafe { words::rebuild(parts) });
        }
        None => bump(Counter::Internal),
    }
}

fn not_a_block(call: &str, dev: &AbiDevice, addr: u64) -> AbiError {
    let (base, bytes) = dev.entry.pool.address_range();
    let msg = if addr.wrapping_sub(base) < bytes {
        format!("{call}({addr:#x}): an interior pointer (block addresses are multiples of 256)")
    } else {
        format!("{call}({addr:#x}): not a pointer of device {}'s pool", dev.entry.ordinal)
    };
    AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_FREE, Counter::InvalidFrees, msg)
}

fn mismatch(call: &str, addr: u64, size: ssize_t, raw: u64, len: u64, alloc_raw: Option<u64>) -> AbiError {
    use vrampool_status::VRAMPOOL_ERROR_INVALID_FREE as INVALID;
    if size < 0 || len != size as u64 {
        let msg = format!("{call}({addr:#x}, size {size}): the block was allocated with size {len}");
        AbiError::new(INVALID, Counter::WrongSizeFrees, msg)
    } else {
        let was = alloc_raw.map_or("an unknown stream".to_string(), |r| format!("stream {r:#x}"));
        let msg = format!("{call}({addr:#x}, stream {raw:#x}): the block was allocated on {was}");
        AbiError::new(INVALID, Counter::WrongStreamFrees, msg)
    }
}

/// The error for refusal `r`; `seen`: what the check saw of the block, if it ran.
fn refusal(call: &str, addr: u64, size: ssize_t, raw: u64, r: Refusal, seen: Option<(u64, Option<u64>)>) -> AbiError {
    use vrampool_status::*;
    match r {
        Refusal::NotLive { ever: false } => {
            let msg = format!("{call}({addr:#x}): no block starts there (a foreign or interior pointer)");
            AbiError::new(VRAMPOOL_ERROR_INVALID_FREE, Counter::InvalidFrees, msg)
        }
        Refusal::NotLive { ever: true } => {
            let msg = format!("{call}({addr:#x}): no live block starts there: a double free (or an interior pointer)");
            AbiError::new(VRAMPOOL_ERROR_DOUBLE_FREE, Counter::DoubleFrees, msg)
        }
        Refusal::Claimed => {
            let msg = format!("{call}({addr:#x}): a double free: the block was freed on another thread");
            AbiError::new(VRAMPOOL_ERROR_DOUBLE_FREE, Counter::DoubleFrees, msg)
        }
        Refusal::Mismatch | Refusal::Foreign => match seen {
            Some((len, alloc_raw)) => mismatch(call, addr, size, raw, len, alloc_raw),
            None => {
                let msg = format!("{call}({addr:#x}, size {size}, stream {raw:#x}): not the block's size or stream");
                AbiError::new(VRAMPOOL_ERROR_INVALID_FREE, Counter::WrongSizeFrees, msg)
            }
        },
    }
}

pub(super) fn record_stream(addr: u64, raw: u64) -> Result<(), AbiError> {
    use vrampool_status::*;
    let _relaxed = relaxed();
    let call = "vrampool_record_stream";
    let counter = Counter::FailedRecordStreams;
    if addr == 0 {
        return Err(AbiError::new(VRAMPOOL_ERROR_INVALID_ARGUMENT, counter, format!("{call}: a null pointer")));
    }
    let Some(dev) = device::holding(addr) else {
        return match graph::record_stream(addr) {
            // A graph pool's block: parked at its free until the pool finishes.
            Some(true) => Ok(()),
            Some(false) => Err(AbiError::new(
                VRAMPOOL_ERROR_INVALID_FREE,
                counter,
                format!("{call}({addr:#x}): no live block of its graph pool starts there"),
            )),
            None => Err(AbiError::new(
                VRAMPOOL_ERROR_INVALID_FREE,
                counter,
                format!("{call}({addr:#x}): not a pointer of any pool"),
            )),
        };
    };
    let as_record = |mut e: AbiError| {
        e.counter = counter;
        e.message = e.message.replacen("vrampool_free", call, 1);
        e
    };
    let idx = dev.table.index(addr).ok_or_else(|| as_record(not_a_block(call, dev, addr)))?;
    let rec: std::sync::Arc<StreamRec> = match registry::stream_rec(dev.entry, raw) {
        // A stream being captured cannot be keyed: the record its handle was last seen with.
        Err(Error::StreamCapturing) => dev.entry.streams.by_raw(raw),
        r => r.ok(),
    }
    .ok_or_else(|| AbiError::from_error(call, counter, &Error::StreamCapturing))?;
    let claim = dev.table.claim_busy(idx).map_err(|r| as_record(refusal(call, addr, 1, raw, r, None)))?;
    let me = MEMO.try_with(|m| m.owner.get()).unwrap_or(0);
    if me == 0 || claim.owner() != me {
        match dev.table.settle_now(&claim, device::owners()) {
            Some(Settled::Won) => {}
            Some(_) => {
                let msg = format!("{call}({addr:#x}): the block was freed meanwhile");
                return Err(AbiError::new(VRAMPOOL_ERROR_DOUBLE_FREE, counter, msg));
            }
            None => {
                let msg = format!("{call}({addr:#x}): the cross-thread fence failed");
                return Err(AbiError::new(VRAMPOOL_ERROR_INTERNAL, Counter::Internal, msg));
            }
        }
    }
    // The slot is held busy: nobody else reads or changes its words now.
    let words = if claim.words.ext {
        // SAFETY: a settled busy claim holds the slot (invariant 3); the block is not
        // `Sync`, but no other thread reaches it while the slot is held.
        let ext = unsafe { Ext::peek(claim.words.info) };
        ext.block.record_stream(&rec.stream);
        claim.words
    } else {
        let (len, token) = words::unpack(claim.words.info);
        let Some(stream) = dev.entry.streams.by_token(token).map(|r| r.id) else {
            dev.table.undo(&claim);
            return Err(AbiError::new(
                VRAMPOOL_ERROR_INTERNAL,
                Counter::Internal,
                format!("{call}: unknown stream token"),
            ));
        };
        if stream == rec.id {
            // Its own stream: nothing to record.
            dev.table.undo(&claim);
            return Ok(());
        }
        let parts = Parts { addr, len, size_class: claim.words.size, stream, pool: dev.pool };
        // SAFETY: the held slot's parts; the block is boxed and the slot rewritten to name
        // the box before anyone else can reach the slot, so it exists once.
        let block = unsafe { words::rebuild(parts) };
        block.record_stream(&rec.stream);
        let size = block.size_class.get();
        Words { info: Ext::into_info(block, token), size, ext: true }
    };
    dev.table.unbusy(&claim, words);
    Ok(())
}
