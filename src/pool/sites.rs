//! [`PoolConfig::track_sites`](super::PoolConfig::track_sites): every live block by address,
//! with its size, its stream and the line of the caller's code that allocated it, for
//! [`Pool::snapshot`](super::Pool::snapshot) and [`Pool::leaks`](super::Pool::leaks).
//!
//! **Off the hit path.** A pool that tracks sites keeps no size class in its caches, so
//! every allocation and every free takes the pool's slow paths (the arena, through the
//! ladder), and only those record: a pool that does not track sites has nothing added
//! anywhere but one `Option` test on those slow paths. The site is the caller's
//! [`Location`], passed down by `#[track_caller]` from `Pool::alloc` and `StreamCache::alloc`
//! (a constant in the caller's code, read only where the record is made).
//!
//! **Lock-free**: a [`crossbeam_skiplist::SkipMap`] keyed by address (epoch-reclaimed, like
//! the depots). A block's entry is inserted by the thread that allocated it before the block
//! is handed out and removed by the thread that frees it before the memory goes back, so at
//! any moment an address has at most one entry, and a walk (exact when the pool is quiet)
//! sees every live block. Not built under loom: the models do not track sites.

use std::panic::Location;

use crate::device::StreamId;

/// One live block, as recorded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Site {
    /// Bytes asked for.
    pub(crate) bytes: u64,
    /// Bytes the block holds.
    pub(crate) size: u64,
    pub(crate) stream: StreamId,
    pub(crate) at: &'static Location<'static>,
}

/// The live blocks of a pool that tracks sites.
#[cfg(not(loom))]
pub(crate) struct Sites(crossbeam_skiplist::SkipMap<u64, Site>);

/// Under loom there is no such table (see the module docs): the type has no value.
#[cfg(loom)]
pub(crate) struct Sites(std::convert::Infallible);

#[cfg(not(loom))]
impl Sites {
    /// A table, if `track` asks for one.
    pub(crate) fn new(track: bool) -> Option<Sites> {
        track.then(|| Sites(crossbeam_skiplist::SkipMap::new()))
    }

    /// The block at `addr` was just handed out.
    pub(crate) fn insert(&self, addr: u64, site: Site) {
        self.0.insert(addr, site);
    }

    /// The block at `addr` is being freed.
    pub(crate) fn remove(&self, addr: u64) {
        self.0.remove(&addr);
    }

    /// Every live block, lowest address first.
    pub(crate) fn all(&self) -> Vec<(u64, Site)> {
        self.0.iter().map(|e| (*e.key(), *e.value())).collect()
    }

    /// The live blocks that start in `[lo, hi)`, lowest first.
    pub(crate) fn within(&self, lo: u64, hi: u64) -> Vec<(u64, Site)> {
        self.0.range(lo..hi).map(|e| (*e.key(), *e.value())).collect()
    }
}

#[cfg(loom)]
impl Sites {
    pub(crate) fn new(_track: bool) -> Option<Sites> {
        None
    }
    pub(crate) fn insert(&self, _addr: u64, _site: Site) {
        match self.0 {}
    }
    pub(crate) fn remove(&self, _addr: u64) {
        match self.0 {}
    }
    pub(crate) fn all(&self) -> Vec<(u64, Site)> {
        match self.0 {}
    }
    pub(crate) fn within(&self, _lo: u64, _hi: u64) -> Vec<(u64, Site)> {
        match self.0 {}
    }
}
