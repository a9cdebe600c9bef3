//! Tier T3: the global lock-free buddy arena over one address range, and the page map that
//! says which physical pages are mapped under it.
//!
//! * [`hbitmap`]: a lock-free hierarchical bitmap with lazily made nodes, one per buddy order.
//! * [`buddy`]: the [`Arena`]: lowest-first placement, exact sizes, coalescing frees.
//! * [`extent`]: [`Extents`]: first-fit runs of 64 KiB granules, for large blocks.
//! * [`space`]: [`Space`]: the buddy for small blocks, extents for large ones.
//! * [`pages`]: the [`PageMap`]: per-page state and live-block counts, mapping on demand.
//! * [`words`]: the lazily made array of atomic words the page map and the extents share.
//!
//! The arena and the page map know nothing of each other: the pool allocates an address range
//! from the arena, then acquires its pages (mapping those that are not), and does the reverse
//! on free. Keeping them apart keeps each protocol small enough to model-check with loom.

pub mod buddy;
pub mod extent;
pub mod hbitmap;
pub mod pages;
pub mod space;
pub mod words;

#[cfg(test)]
mod tests;

pub use buddy::{Arena, MIN_BLOCK, MIN_ORDER};
pub use extent::Extents;
pub use hbitmap::{HBitmap, SetOutcome};
pub use pages::{Acquire, PageMap};
pub use space::Space;
