//! Tier T3: the address space of a pool, the arenas over it, and the page map that says which
//! physical pages are mapped under it.
//!
//! * [`hbitmap`]: a lock-free hierarchical bitmap with lazily made nodes, one per buddy order.
//! * [`buddy`]: the [`Arena`]: lowest-first placement, exact sizes, coalescing frees.
//! * [`stream`]: [`StreamArena`]: one stream's small blocks, a buddy over the 2 MiB chunks
//!   the stream holds.
//! * [`extent`]: [`Extents`]: first-fit runs of 64 KiB granules.
//! * [`space`]: [`Space`]: extents over the whole range for large blocks and chunks, with
//!   the fence of every free granule and the owner of every chunk.
//! * [`pages`]: the [`PageMap`]: per-page state and block counts, mapping on demand.
//! * [`alone`]: T3 on its own, for the benches.
//! * [`tally`]: a byte count striped over cache lines by thread (the extents' free bytes).
//! * [`words`]: the lazily made array of atomic words the page map, the extents and the
//!   space share.
//!
//! The arenas and the page map know nothing of each other: the pool places a block (a large
//! one or a chunk) in the space, then acquires its pages (mapping those that are not), and
//! does the reverse on free. Keeping them apart keeps each protocol small enough to
//! model-check with loom.

pub mod alone;
pub mod buddy;
pub mod extent;
pub mod hbitmap;
pub mod pages;
pub mod space;
pub mod stream;
pub mod tally;
pub mod words;

#[cfg(test)]
mod tests;

pub use buddy::{Arena, MIN_BLOCK, MIN_ORDER};
pub use extent::Extents;
pub use hbitmap::{HBitmap, SetOutcome};
pub use pages::{Acquire, PageMap, MAX_RUN};
pub use space::{fence_parts, fence_word, Space, CHUNK, GRANULE};
pub use stream::StreamArena;
