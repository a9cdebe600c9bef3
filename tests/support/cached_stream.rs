//! The stream a cached block belongs to, as the registry's pool on device 0 pictures it, for
//! the C ABI's stream tests (`#[path]`-included).

use vrampool::{registry, BlockState, StreamId};

/// The stream the pool's picture gives the cached block at `addr` (every cache read).
pub fn cached_stream(addr: u64) -> Option<StreamId> {
    let snap = registry::pool(0).unwrap().snapshot();
    assert!(snap.exact, "every cache was read");
    let e = snap.segments.iter().flat_map(|s| &s.extents).find(|e| e.addr <= addr && addr < e.addr + e.bytes);
    let e = e.unwrap_or_else(|| panic!("{addr:#x} is in no segment"));
    assert_eq!(e.state, BlockState::Cached, "{e:?}");
    e.stream
}
