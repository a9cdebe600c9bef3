//! The cache tiers above the arena: magazines, per-thread caches (T0) and per-stream depots
//! (T1).
pub mod budget;
pub mod depot;
pub mod magazine;
mod mags;
pub mod thread;
