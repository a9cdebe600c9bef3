//! For those who implement [`Device`]: making [`Stream`] and [`Event`] handles around an
//! implementation's own state, reaching that state again, and the stream's destroy protocol.
//!
//! An application never needs this module: it gets its streams and events from a device
//! (`SimDevice::new_stream`, [`Device::create_stream`], [`Device::create_event`], ...).
//! These calls live apart because, used on a live stream of another device, they break
//! what the pool relies on: a stream marked destroyed while work still runs on it, destroy
//! hooks (the pool's last fence on the stream) run twice or never.
//!
//! The protocol a `Device` follows:
//!
//! - `create_stream` and `wrap_stream` return [`new_stream`]`(raw, backend)`, with `backend`
//!   the implementation's handle (dropped with the stream's last clone: an owned stream is
//!   destroyed there).
//! - Every other method finds its state with [`stream_backend`] / [`event_backend`], and
//!   refuses a stream of another device (`Error::InvalidArgument`) or one that
//!   `is_destroyed()` (`Error::StreamDestroyed`).
//! - `destroy_stream` first calls [`run_destroy_hooks`] (the stream can still record work
//!   then), then [`mark_destroyed`], and destroys the stream only if that returned true.
//!
//! ```
//! use vrampool::device::implement;
//! # struct MyStream(u32);
//! let s = implement::new_stream(7, Box::new(MyStream(7)));
//! assert_eq!(implement::stream_backend::<MyStream>(&s).map(|m| m.0), Some(7));
//! implement::on_destroy(&s, Box::new(|s| println!("stream {} goes", s.id())));
//! implement::run_destroy_hooks(&s);
//! assert!(implement::mark_destroyed(&s) && s.is_destroyed());
//! assert!(!implement::mark_destroyed(&s), "only the first caller destroys");
//! ```

use std::any::Any;

#[cfg(doc)]
use super::Device;
use super::{Event, Stream};

/// A callback run just before a stream is destroyed, while it can still record work.
pub type DestroyHook = Box<dyn FnOnce(&Stream) + Send>;

/// A stream handle for a device implementation, with a fresh [`crate::StreamId`]. `raw` is
/// the handle's raw value ([`Stream::raw`]); `backend` is whatever the implementation needs
/// to reach its stream, dropped (and free to destroy the stream) with the last clone.
pub fn new_stream(raw: u64, backend: Box<dyn Any + Send + Sync>) -> Stream {
    Stream::from_backend(raw, backend)
}

/// An event handle for a device implementation: `backend` is its state, dropped with the
/// event.
pub fn new_event(backend: Box<dyn Any + Send + Sync>) -> Event {
    Event::from_backend(backend)
}

/// The implementation's state for `stream`, if it is of type `T`.
pub fn stream_backend<T: 'static>(stream: &Stream) -> Option<&T> {
    stream.backend::<T>()
}

/// The implementation's state for `event`, if it is of type `T`.
pub fn event_backend<T: 'static>(event: &Event) -> Option<&T> {
    event.backend::<T>()
}

/// Mark `stream` destroyed; true for the one caller that did so first (it destroys the
/// stream). Clones then fail with `Error::StreamDestroyed` in every device call.
pub fn mark_destroyed(stream: &Stream) -> bool {
    stream.mark_destroyed()
}

/// Ask for `hook` to run just before `stream` is destroyed through
/// [`Device::destroy_stream`] (on any clone). Hooks run once, in the order added.
pub fn on_destroy(stream: &Stream, hook: DestroyHook) {
    stream.on_destroy(hook)
}

/// Run `stream`'s destroy hooks: every implementation calls this at the start of
/// `destroy_stream`, before the stream stops accepting work.
pub fn run_destroy_hooks(stream: &Stream) {
    stream.run_destroy_hooks()
}
