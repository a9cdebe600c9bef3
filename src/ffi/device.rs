//! The ABI's state of one device: its registry entry, its live-block table, and the pool's
//! state pointer that rebuilt blocks carry. Made on the device's first allocation through
//! the ABI and kept for the life of the process, like the entry.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::live::{Owners, Table, MAX_OWNERS};
use crate::pool::PoolInner;
use crate::registry::{self, Entry, MAX_DEVICES};
use crate::Result;

/// One device, as the ABI sees it.
pub(crate) struct AbiDevice {
    pub(crate) entry: &'static Entry,
    pub(crate) table: Table,
    /// What every block of the pool points to (a block is rebuilt with it).
    pub(crate) pool: NonNull<PoolInner>,
}

// SAFETY: `pool` names the pool's state, which is `Sync` and lives as long as the entry
// (for ever); everything else is `Sync`.
unsafe impl Sync for AbiDevice {}
// SAFETY: as above.
unsafe impl Send for AbiDevice {}

static DEVICES: [AtomicPtr<AbiDevice>; MAX_DEVICES] = [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_DEVICES];
static CREATE: Mutex<()> = Mutex::new(());

/// Device `ordinal`'s state if the ABI has used it.
#[inline(always)]
pub(crate) fn existing(ordinal: usize) -> Option<&'static AbiDevice> {
    // SAFETY: a published device is never dropped or replaced.
    DEVICES.get(ordinal).and_then(|p| unsafe { p.load(Ordering::Acquire).as_ref() })
}

/// Every device the ABI has used.
pub(crate) fn all() -> impl Iterator<Item = &'static AbiDevice> {
    // SAFETY: as in `existing`.
    DEVICES.iter().filter_map(|p| unsafe { p.load(Ordering::Acquire).as_ref() })
}

/// The device whose pool's range holds `addr`.
pub(crate) fn holding(addr: u64) -> Option<&'static AbiDevice> {
    all().find(|d| {
        let (base, bytes) = d.entry.pool.address_range();
        addr.wrapping_sub(base) < bytes
    })
}

/// Device `ordinal`'s state, made (with its pool) on first use.
pub(crate) fn get(ordinal: usize) -> Result<&'static AbiDevice> {
    match existing(ordinal) {
        Some(d) => Ok(d),
        None => make(ordinal),
    }
}

#[cold]
fn make(ordinal: usize) -> Result<&'static AbiDevice> {
    let entry = registry::entry(ordinal)?;
    let _one = CREATE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = existing(ordinal) {
        return Ok(d);
    }
    let (base, bytes) = entry.pool.address_range();
    let table = Table::new(base, bytes)?;
    // An empty block carries its pool's state pointer and holds no memory.
    let probe = entry.pool.alloc(0, &registry::stream_rec(entry, 0)?.stream)?;
    let pool = probe.pool;
    drop(probe);
    let p = Box::into_raw(Box::new(AbiDevice { entry, table, pool }));
    // Release: whoever loads the pointer sees the device whole.
    DEVICES[ordinal].store(p, Ordering::Release);
    // SAFETY: just published, never dropped.
    Ok(unsafe { &*p })
}

/// The owner records of every thread that allocates through the ABI, for all devices.
/// `membarrier` is tried once here: where it works, owners fence with a compiler fence only.
pub(crate) fn owners() -> &'static Owners {
    static OWNERS: OnceLock<Owners> = OnceLock::new();
    OWNERS.get_or_init(|| Owners::new(MAX_OWNERS, crate::sync::heavy_fence()))
}
