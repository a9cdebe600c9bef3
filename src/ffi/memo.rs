//! The calling thread's memo of its last (device, stream handle), its cache for them, and
//! its owner record.
//!
//! The memo is plain cells in a thread-local without a destructor, so the hot paths find
//! everything with a few loads and compares: each path has its own key (`alloc_device`,
//! `free_device`) that equals the caller's device ordinal only where that path may be taken
//! (a cache to allocate from; an owner record to free with), so one
//! compare tests them all; the allocation path also compares the registry's gate
//! (`registry::gate`) with the one read when the handle was keyed, so a stream declared
//! destroyed (or a capture declared, on CUDA) sends every thread's next allocation on that
//! path to key its handle again. The memo only ever names a device and a stream record, which
//! live for ever, a cache held by [`CACHES`] (whose destructor clears the memo first), and
//! the thread's own owner record, given back only by [`OwnerGuard`]'s destructor (thread
//! exit), which clears the memo's owner first.
//!
//! Besides the stream it names, the memo keeps the last few it named on its device, so that
//! a thread alternating between streams names one again without the registry. Each keeps
//! the gate it was keyed under, and [`CACHES`] empties the list whenever it drops a cache
//! (and at thread exit): a kept stream's cache is always held.

use std::cell::{Cell, RefCell};
use std::ptr;

use super::device::{self, AbiDevice};
use crate::cache::thread::CacheShared;
use crate::device::StreamId;
use crate::live::{Owner, TableView};
use crate::pool::PoolInner;
use crate::registry::StreamRec;
use crate::{DeviceKind, StreamCache};

/// A device key no caller's `int` device equals.
const NOT_NAMED: i64 = i64::MIN;

pub(crate) struct Memo {
    /// The device ordinal the memo names ([`NOT_NAMED`] for none).
    pub(crate) device: Cell<i64>,
    /// `device` where the allocation hot path may be taken, else [`NOT_NAMED`].
    pub(crate) alloc_device: Cell<i64>,
    /// `device` where the free hot path may be taken (the thread has an owner record),
    /// else [`NOT_NAMED`].
    pub(crate) free_device: Cell<i64>,
    pub(crate) raw: Cell<u64>,
    /// The registry's key for `raw` (checked again on CUDA, where handles are reused).
    pub(crate) key: Cell<u64>,
    /// The registry's memo gate ([`crate::registry::gate`]) read before `raw` was keyed: the
    /// allocation hot path is taken only while the gate still reads it.
    pub(crate) gate: Cell<u64>,
    pub(crate) dev: Cell<*const AbiDevice>,
    /// `dev`'s table and pool, copied here so the hot paths reach a slot and rebuild a
    /// block without loading the device first.
    pub(crate) table: Cell<TableView<'static>>,
    pub(crate) pool: Cell<*const PoolInner>,
    pub(crate) rec: Cell<*const StreamRec>,
    /// `rec`'s stream id.
    pub(crate) stream_id: Cell<StreamId>,
    /// `rec`'s token.
    pub(crate) token: Cell<u32>,
    /// `rec`'s token, placed as in an info word.
    pub(crate) token_bits: Cell<u64>,
    /// This thread's cache for (`dev`'s pool, `rec`'s stream), held by [`CACHES`]; null
    /// where the thread may have none (inside a host function, exiting).
    pub(crate) cache: Cell<*const StreamCache>,
    /// `cache`'s shared part, which the free hot path pushes to directly (null with it).
    pub(crate) shared: Cell<*const CacheShared>,
    /// This thread's owner index (0: none).
    pub(crate) owner: Cell<usize>,
    pub(crate) owner_rec: Cell<*const Owner>,
    /// Whether an owner record was tried for yet.
    owner_tried: Cell<bool>,
    /// Streams the memo named before, newest first (see [`Recent`]).
    recent: [Cell<Option<Recent>>; RECENT],
}

/// How many streams the memo keeps besides the one it names.
const RECENT: usize = 3;

/// A stream the memo named before on its device, kept so that a thread alternating between a
/// few streams (a compute and a copy stream) finds its cache again without the registry and
/// its thread's cache list: valid while the registry's gate reads `gate` (no stream declared
/// destroyed, no capture declared since) and while [`CACHES`] holds `cache`, which it does
/// until it drops a cache, when it empties the memo's list first (`cache_for`).
#[derive(Clone, Copy)]
struct Recent {
    device: i64,
    raw: u64,
    key: u64,
    gate: u64,
    rec: *const StreamRec,
    cache: *const StreamCache,
    shared: *const CacheShared,
}

impl Memo {
    const fn new() -> Memo {
        Memo {
            device: Cell::new(NOT_NAMED),
            alloc_device: Cell::new(NOT_NAMED),
            free_device: Cell::new(NOT_NAMED),
            raw: Cell::new(0),
            key: Cell::new(0),
            gate: Cell::new(0),
            dev: Cell::new(ptr::null()),
            table: Cell::new(TableView::EMPTY),
            pool: Cell::new(ptr::null()),
            rec: Cell::new(ptr::null()),
            stream_id: Cell::new(0),
            token: Cell::new(0),
            token_bits: Cell::new(0),
            cache: Cell::new(ptr::null()),
            shared: Cell::new(ptr::null()),
            owner: Cell::new(0),
            owner_rec: Cell::new(ptr::null()),
            owner_tried: Cell::new(false),
            recent: [const { Cell::new(None) }; RECENT],
        }
    }

    /// The table's view, read in place (a copy of its three words would go through the
    /// stack on the hot paths).
    #[inline(always)]
    pub(crate) fn table(&self) -> &TableView<'static> {
        // SAFETY: only `remember` sets the view, never while a caller holds this reference
        // (the hot paths make no call that reaches it); the cell is the thread's own.
        unsafe { &*self.table.as_ptr() }
    }

    /// Whether the memo names (`device`, `raw`).
    #[inline(always)]
    pub(crate) fn names(&self, device: i64, raw: u64) -> bool {
        self.device.get() == device && self.raw.get() == raw
    }

    /// Remember (`device`, `raw`) → (`dev`, `rec`, `key`) and this thread's cache for them;
    /// `gate` is the registry's memo gate read before `raw` was keyed.
    pub(crate) fn remember(
        &self,
        (device, raw, key, gate): (i64, u64, u64, u64),
        dev: &'static AbiDevice,
        rec: &StreamRec,
    ) {
        // Before the cache list is looked at: if it drops a cache, it empties the list of
        // recent streams, this one included.
        self.stash();
        let cache = cache_for(device, key, dev, rec);
        // SAFETY: a non-null cache is held by `CACHES`, as the memo's docs say.
        let shared = if cache.is_null() { ptr::null() } else { unsafe { (*cache).shared() } };
        self.device.set(device);
        self.dev.set(dev);
        self.table.set(dev.table.view());
        self.pool.set(dev.pool.as_ptr());
        self.name(Recent { device, raw, key, gate, rec, cache, shared });
        self.free_device.set(if self.owner.get() != 0 { device } else { NOT_NAMED });
    }

    /// Name stream `r` of the memo's device (its handle, record, cache), and open the hot
    /// path for it where it may be ([`Memo::rearm`]).
    fn name(&self, r: Recent) {
        // SAFETY: the registry keeps every stream record (and its token) for ever.
        let rec = unsafe { &*r.rec };
        self.raw.set(r.raw);
        self.key.set(r.key);
        self.rec.set(r.rec);
        self.stream_id.set(rec.id);
        self.token.set(rec.token);
        self.token_bits.set(super::words::token_bits(rec.token));
        self.cache.set(r.cache);
        self.shared.set(r.shared);
        self.rearm(r.device, r.gate);
    }

    /// Open the allocation hot path for the remembered stream while the registry's gate
    /// reads `gate` (read before the handle was keyed, and the key found to be the memo's).
    /// Not on CUDA while a capture is declared underway: a handle must then be checked for
    /// capture before it is keyed, which the hot path does not do. (The simulator's cache
    /// hit never asked about capture.)
    pub(crate) fn rearm(&self, device: i64, gate: u64) {
        self.gate.set(gate);
        let open = !self.cache.get().is_null() && {
            // SAFETY: a memo with a cache names a device entry (`remember` sets both), and
            // entries live for ever.
            let dev = unsafe { &*self.dev.get() };
            dev.entry.kind == DeviceKind::Simulated || crate::registry::gate_open(gate)
        };
        self.alloc_device.set(if open { device } else { NOT_NAMED });
    }

    /// Keep the stream the memo names among the recent ones (newest first), if it has a
    /// cache.
    fn stash(&self) {
        if self.device.get() == NOT_NAMED || self.cache.get().is_null() {
            return;
        }
        let now = Recent {
            device: self.device.get(),
            raw: self.raw.get(),
            key: self.key.get(),
            gate: self.gate.get(),
            rec: self.rec.get(),
            cache: self.cache.get(),
            shared: self.shared.get(),
        };
        let mut carry = Some(now);
        for slot in &self.recent {
            let old = slot.replace(carry);
            // The same stream further down is an older copy: it goes.
            carry = old.filter(|o| (o.device, o.raw) != (now.device, now.raw));
            if carry.is_none() {
                break;
            }
        }
    }

    /// Name (`device`, `raw`) again from the recent streams, if the memo names `device` now
    /// and the registry's gate has not moved since the stream was keyed (`malloc_hit` checks
    /// the gate too): the memo's stream takes its place among them. False (nothing changed)
    /// otherwise.
    pub(crate) fn recall(&self, device: i64, raw: u64) -> bool {
        if self.device.get() != device {
            return false;
        }
        let gate = crate::registry::gate();
        let found =
            self.recent.iter().position(|c| c.get().is_some_and(|r| (r.device, r.raw, r.gate) == (device, raw, gate)));
        let Some(r) = found.and_then(|i| self.recent[i].take()) else { return false };
        self.stash();
        self.name(r);
        true
    }

    /// Forget the recent streams (their caches may be dropped).
    fn clear_recent(&self) {
        for slot in &self.recent {
            slot.set(None);
        }
    }

    /// Take an owner record for this thread, the first time (later calls do nothing). None
    /// is taken where claimers cannot use `membarrier`: the owner's free would need a full
    /// fence, as dear as the compare-and-swap of a claim, so every free claims instead.
    pub(crate) fn ensure_owner(&self) {
        if self.owner_tried.replace(true) {
            return;
        }
        let owners = device::owners();
        if !owners.asymmetric() {
            return;
        }
        let Some(id) = owners.acquire() else { return };
        // The guard gives the record back at thread exit; without one (the thread is
        // already exiting) the record goes back at once.
        if GUARD.try_with(|g| g.id.set(id)).is_err() {
            owners.release(id);
            return;
        }
        self.owner_rec.set(owners.get(id));
        self.owner.set(id);
    }

    /// Stop naming a stream (its handle now names another): the next allocation takes the
    /// slow path, which remembers afresh. The owner record and the free path stay.
    pub(crate) fn forget(&self) {
        self.clear_recent();
        self.device.set(NOT_NAMED);
        self.alloc_device.set(NOT_NAMED);
        self.cache.set(ptr::null());
        self.shared.set(ptr::null());
    }

    /// Forget the owner record: no owner window may open after this.
    fn drop_owner(&self) {
        self.owner.set(0);
        self.owner_rec.set(ptr::null());
        self.free_device.set(NOT_NAMED);
    }
}

crate::sync::thread_local! {
    pub(crate) static MEMO: Memo = const { Memo::new() };
}

/// Gives the thread's owner record back when the thread exits.
struct OwnerGuard {
    id: Cell<usize>,
}

impl Drop for OwnerGuard {
    fn drop(&mut self) {
        let id = self.id.get();
        if id == 0 {
            return;
        }
        // Frees from later thread-local destructors claim instead.
        let _ = MEMO.try_with(Memo::drop_owner);
        device::owners().release(id);
    }
}

crate::sync::thread_local! {
    static GUARD: OwnerGuard = const { OwnerGuard { id: Cell::new(0) } };
}

/// This thread's caches, by (device, stream key): boxed so the memo may point into them
/// while the list grows, dropped (and the memo's pointer cleared first) at thread exit.
struct Caches {
    #[allow(clippy::vec_box)]
    list: RefCell<Vec<Box<(i64, u64, StreamCache)>>>,
}

impl Drop for Caches {
    fn drop(&mut self) {
        let _ = MEMO.try_with(|m| {
            m.clear_recent();
            m.cache.set(ptr::null());
            m.shared.set(ptr::null());
            m.alloc_device.set(NOT_NAMED);
        });
    }
}

crate::sync::thread_local! {
    static CACHES: Caches = const { Caches { list: RefCell::new(Vec::new()) } };
}

/// The calling thread's cache for (`dev`'s pool, `rec`'s stream), made the first time; null
/// if the thread may have none now.
fn cache_for(device: i64, key: u64, dev: &AbiDevice, rec: &StreamRec) -> *const StreamCache {
    CACHES
        .try_with(|c| {
            let mut list = c.list.borrow_mut();
            // A key names a new stream once the old one was declared destroyed (on the
            // simulator the key is the handle's value): its cache goes with it. So do the
            // caches of every stream declared destroyed since, whatever its key: a thread
            // that served many short-lived streams kept one for each (see
            // `pool::local`'s `drop_destroyed`, which then flushes them).
            //
            // Not while this thread runs an out-of-memory handler: the allocation the handler
            // serves is inside one of these caches. The entries wait for the next call, and
            // the search matches the stream too, so a stale one is never taken.
            if !crate::pool::in_oom_handler() {
                let before = list.len();
                list.retain(|e| {
                    let s = e.2.stream();
                    !(s.is_destroyed() || (e.0 == device && e.1 == key && s.id() != rec.id))
                });
                if list.len() != before {
                    // The memo's recent streams may point into a dropped cache.
                    let _ = MEMO.try_with(Memo::clear_recent);
                }
            }
            if let Some(e) = list.iter().find(|e| e.0 == device && e.1 == key && e.2.stream().id() == rec.id) {
                return &e.2 as *const StreamCache;
            }
            match dev.entry.pool.stream_cache(&rec.stream) {
                Ok(cache) => {
                    list.push(Box::new((device, key, cache)));
                    list.last().map_or(ptr::null(), |e| &e.2 as *const StreamCache)
                }
                Err(_) => ptr::null(),
            }
        })
        .unwrap_or(ptr::null())
}
