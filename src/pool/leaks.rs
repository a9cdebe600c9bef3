//! Leak reports, the classic pools' reference-count check at destruction: what is still out
//! when the pool should be empty.
//!
//! [`Pool::leaks`] lists the live memory now, from the same walk as [`Pool::snapshot`]:
//! with [`PoolConfig::track_sites`] one entry per block, with its stream and the line that
//! allocated it; without, one entry per stretch of live memory (adjacent blocks show as
//! one), with the stream that holds its chunk where there is one (small blocks). When the
//! last [`Pool`] handle drops with blocks still out, the pool says so with a `tracing`
//! warning, the leaks listed (the first [`WARN_LEAKS`]); the pool's books then live on so
//! that the late frees still find them.
//!
//! [`PoolConfig::track_sites`]: super::PoolConfig::track_sites

use serde::Serialize;

use super::snapshot::BlockState;
use super::{Pool, PoolInner};
use crate::device::StreamId;

/// Most leaks the drop's warning lists one by one.
pub const WARN_LEAKS: usize = 32;

/// A block (or, without `track_sites`, a stretch of adjacent blocks) still out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Leak {
    /// Device address.
    pub addr: u64,
    /// Bytes it holds.
    pub bytes: u64,
    /// With `track_sites`: bytes asked for.
    pub requested: Option<u64>,
    /// Its stream: always with `track_sites`; without, that of the chunk a small block lies
    /// in (none for large blocks).
    pub stream: Option<StreamId>,
    /// With `track_sites`: where it was allocated (`file:line:column`).
    pub site: Option<String>,
}

impl std::fmt::Display for Leak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} B at {:#x}", self.bytes, self.addr)?;
        if let Some(r) = self.requested {
            write!(f, " ({r} B asked for)")?;
        }
        match self.stream {
            Some(s) => write!(f, " on stream {s}")?,
            None => write!(f, " (stream not known: set PoolConfig::track_sites)")?,
        }
        if let Some(site) = &self.site {
            write!(f, ", allocated at {site}")?;
        }
        Ok(())
    }
}

impl Pool {
    /// The blocks still out, for a check where none should be (before the last handle
    /// drops, at the end of a test). With [`PoolConfig::track_sites`](super::PoolConfig::track_sites)
    /// one entry per block, with its stream and the line that allocated it; without, one per
    /// stretch of live memory (adjacent blocks show as one), with the stream holding its
    /// chunk where there is one (small blocks). Cached memory is no leak. Empty when every
    /// block is back; exact when the pool is quiet. When the last handle drops with blocks
    /// out, the pool logs them as a `tracing` warning.
    pub fn leaks(&self) -> Vec<Leak> {
        self.inner.leaks()
    }
}

impl PoolInner {
    pub(crate) fn leaks(&self) -> Vec<Leak> {
        if let Some(sites) = &self.sites {
            return sites
                .all()
                .into_iter()
                .map(|(addr, s)| Leak {
                    addr,
                    bytes: s.size,
                    requested: Some(s.bytes),
                    stream: Some(s.stream),
                    site: Some(s.at.to_string()),
                })
                .collect();
        }
        self.snapshot()
            .extents()
            .filter(|e| e.state == BlockState::Live)
            .map(|e| Leak { addr: e.addr, bytes: e.bytes, requested: None, stream: e.stream, site: None })
            .collect()
    }

    /// The last handle is going with `live` blocks still out: say so.
    pub(crate) fn warn_leaks(&self, live: u64) {
        let leaks = self.leaks();
        let bytes: u64 = leaks.iter().map(|l| l.bytes).sum();
        tracing::warn!(
            live_blocks = live,
            bytes,
            "vrampool: the last Pool handle dropped with {live} blocks still out"
        );
        for l in leaks.iter().take(WARN_LEAKS) {
            tracing::warn!(addr = l.addr, bytes = l.bytes, stream = l.stream, site = l.site, "vrampool: leaked {l}");
        }
        if leaks.len() > WARN_LEAKS {
            tracing::warn!("vrampool: ... and {} more", leaks.len() - WARN_LEAKS);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{Pool, PoolConfig, SimDevice};

    #[test]
    fn no_leaks_once_every_block_is_back() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let s = dev.new_stream().unwrap();
        let blocks: Vec<_> = (0..100).map(|i| pool.alloc(1000 + 977 * i, &s).unwrap()).collect();
        assert!(!pool.leaks().is_empty());
        drop(blocks);
        assert_eq!(pool.leaks(), vec![], "cached blocks are no leaks");
    }

    #[test]
    fn a_leak_is_reported_with_its_size_stream_and_site() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig { track_sites: true, ..PoolConfig::default() }).unwrap();
        let s = dev.new_stream().unwrap();
        let keep = pool.alloc(300, &s).unwrap();
        let line = line!() - 1;
        let big = pool.alloc(9 << 20, &s).unwrap();
        drop(big);
        let leaks = pool.leaks();
        assert_eq!(leaks.len(), 1, "{leaks:?}");
        let l = &leaks[0];
        assert_eq!((l.addr, l.bytes, l.requested, l.stream), (keep.device_ptr(), 512, Some(300), Some(s.id())));
        assert!(l.site.as_deref().unwrap().contains(&format!("leaks.rs:{line}:")), "{l}");
        assert!(l.to_string().contains("on stream"), "{l}");
        // The last handle goes with the block out: the books stay, and the late free finds them.
        drop(pool);
        drop(keep);
        dev.synchronize(&s).unwrap();
    }

    #[test]
    fn without_sites_a_leak_still_has_its_bytes_and_small_blocks_their_stream() {
        let dev = SimDevice::new(1 << 30);
        let pool = Pool::new(dev.clone(), PoolConfig::default()).unwrap();
        let s = dev.new_stream().unwrap();
        let small = pool.alloc(4096, &s).unwrap();
        let leaks = pool.leaks();
        assert_eq!(leaks.len(), 1, "{leaks:?}");
        assert_eq!((leaks[0].addr, leaks[0].bytes, leaks[0].stream), (small.device_ptr(), 4096, Some(s.id())));
    }
}
