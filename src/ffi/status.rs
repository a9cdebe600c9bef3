//! Status codes, the calling thread's last error (as `dlerror`), and the ABI's counters.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, CString};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

/// What a call returns (as an `int`), and the code of a thread's last error.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum vrampool_status {
    /// Success.
    VRAMPOOL_OK = 0,
    /// An argument that makes no sense: a negative size, a bad device ordinal or stream, a
    /// null buffer with a non-zero length.
    VRAMPOOL_ERROR_INVALID_ARGUMENT = 1,
    /// A free or `record_stream` of a pointer that is no live block's start (foreign,
    /// interior), or with the wrong size or stream.
    VRAMPOOL_ERROR_INVALID_FREE = 2,
    /// A free of a block already freed.
    VRAMPOOL_ERROR_DOUBLE_FREE = 3,
    /// Out of device memory after every step of the pool's ladder.
    VRAMPOOL_ERROR_OUT_OF_MEMORY = 4,
    /// A request larger than the pool can ever serve.
    VRAMPOOL_ERROR_TOO_LARGE = 5,
    /// No usable device (no driver, no GPU, no such ordinal).
    VRAMPOOL_ERROR_NO_DEVICE = 6,
    /// A driver call failed.
    VRAMPOOL_ERROR_DEVICE = 7,
    /// Not allowed here (for example from inside a host function running on a stream).
    VRAMPOOL_ERROR_NOT_PERMITTED = 8,
    /// The stream is being captured into a CUDA graph.
    VRAMPOOL_ERROR_STREAM_CAPTURING = 9,
    /// The stream was destroyed.
    VRAMPOOL_ERROR_STREAM_DESTROYED = 10,
    /// A `VRAMPOOL_*` environment variable has a bad value.
    VRAMPOOL_ERROR_CONFIG = 11,
    /// A bug in vrampool (a caught panic, a broken invariant); the pool was not changed.
    VRAMPOOL_ERROR_INTERNAL = 12,
}

pub use vrampool_status::*;

/// A failed call: its status and message, and which counter it adds to.
#[derive(Debug)]
pub(crate) struct AbiError {
    pub(crate) status: vrampool_status,
    pub(crate) counter: Counter,
    pub(crate) message: String,
}

impl AbiError {
    pub(crate) fn new(status: vrampool_status, counter: Counter, message: impl fmt::Display) -> AbiError {
        AbiError { status, counter, message: message.to_string() }
    }

    /// An error of the pool or the registry, in `call`.
    pub(crate) fn from_error(call: &str, counter: Counter, e: &Error) -> AbiError {
        let status = match e {
            Error::OutOfMemory(_) => VRAMPOOL_ERROR_OUT_OF_MEMORY,
            Error::TooLarge { .. } => VRAMPOOL_ERROR_TOO_LARGE,
            Error::InvalidArgument(m) if m.starts_with("configuration:") => VRAMPOOL_ERROR_CONFIG,
            Error::InvalidArgument(_) => VRAMPOOL_ERROR_INVALID_ARGUMENT,
            Error::NotPermitted(_) => VRAMPOOL_ERROR_NOT_PERMITTED,
            Error::StreamCapturing => VRAMPOOL_ERROR_STREAM_CAPTURING,
            Error::StreamDestroyed => VRAMPOOL_ERROR_STREAM_DESTROYED,
            Error::NoDevice(_) => VRAMPOOL_ERROR_NO_DEVICE,
            Error::Device { .. } => VRAMPOOL_ERROR_DEVICE,
            _ => VRAMPOOL_ERROR_INTERNAL,
        };
        AbiError::new(status, counter, format!("{call}: {e}"))
    }

    /// Count the error and make it the calling thread's last one; its status as an `int`.
    #[cold]
    pub(crate) fn report(self) -> c_int {
        bump(self.counter);
        bump(Counter::Errors);
        set_last(self.status, self.message);
        self.status as c_int
    }
}

struct Last {
    code: Cell<c_int>,
    message: RefCell<Option<CString>>,
    /// The message last handed out by `vrampool_last_error`, kept alive until the thread's
    /// next error or next `vrampool_last_error`.
    handed: RefCell<Option<CString>>,
}

crate::sync::thread_local! {
    static LAST: Last = const { Last { code: Cell::new(0), message: RefCell::new(None), handed: RefCell::new(None) } };
}

fn set_last(status: vrampool_status, message: String) {
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    let _ = LAST.try_with(|l| {
        l.code.set(status as c_int);
        *l.message.borrow_mut() = Some(message);
        // The previous message was handed out before this (later) call: it may go.
        l.handed.borrow_mut().take();
    });
}

/// `vrampool_last_error`: this thread's last error message, then cleared; null if none.
pub(crate) fn take_last() -> *const c_char {
    LAST.try_with(|l| {
        l.code.set(0);
        let msg = l.message.borrow_mut().take();
        let mut handed = l.handed.borrow_mut();
        *handed = msg;
        handed.as_ref().map_or(std::ptr::null(), |m| m.as_ptr())
    })
    .unwrap_or(std::ptr::null())
}

/// `vrampool_last_error_code`: the status of this thread's unread last error, 0 if none.
pub(crate) fn last_code() -> c_int {
    LAST.try_with(|l| l.code.get()).unwrap_or(0)
}

/// The ABI's own counters, process-wide (they count refused calls, which may name no
/// device), shown in `vrampool_stats_json` beside the pool's `Stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    /// Every refused call.
    Errors,
    /// Mallocs refused for their arguments (negative size, bad device or stream).
    InvalidMallocs,
    /// Mallocs the pool could not serve (out of memory, too large, a device error).
    FailedMallocs,
    /// Frees of a pointer that is no block's start: foreign, interior, or of a device with
    /// no pool.
    InvalidFrees,
    /// Frees of a block already freed.
    DoubleFrees,
    /// Frees with another size than the block was allocated with.
    WrongSizeFrees,
    /// Frees with another stream handle than the block was allocated with.
    WrongStreamFrees,
    /// Frees on another thread that raced the owner's own free of the same block, found
    /// when settled (after the call returned; counted, and the pool untouched).
    LateDoubleFrees,
    /// Frees on a thread other than the allocating one (settled in batches).
    ForeignFrees,
    /// `record_stream` calls refused.
    FailedRecordStreams,
    /// Other refused calls (statistics, `empty_cache`).
    FailedCalls,
    /// Bugs: panics caught at the ABI, words in a slot the ABI did not write (please
    /// report them).
    Internal,
}

const COUNTERS: usize = 12;
static COUNTS: [AtomicU64; COUNTERS] = [const { AtomicU64::new(0) }; COUNTERS];

pub(crate) fn bump(c: Counter) {
    COUNTS[c as usize].fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn count(c: Counter) -> u64 {
    COUNTS[c as usize].load(Ordering::Relaxed)
}

/// The counters as the statistics JSON shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AbiCounters {
    /// Every refused call.
    pub abi_errors: u64,
    /// Mallocs refused for their arguments.
    pub abi_invalid_mallocs: u64,
    /// Mallocs the pool could not serve.
    pub abi_failed_mallocs: u64,
    /// Frees of a pointer that is no live block's start.
    pub abi_invalid_frees: u64,
    /// Frees of a block already freed.
    pub abi_double_frees: u64,
    /// Frees with the wrong size.
    pub abi_wrong_size_frees: u64,
    /// Frees with the wrong stream.
    pub abi_wrong_stream_frees: u64,
    /// Racing double frees found after the call returned.
    pub abi_late_double_frees: u64,
    /// Frees on a thread other than the allocating one.
    pub abi_foreign_frees: u64,
    /// Foreign frees not settled yet (their blocks still count as allocated).
    pub abi_pending_frees: u64,
    /// `record_stream` calls refused.
    pub abi_failed_record_streams: u64,
    /// Other refused calls.
    pub abi_failed_calls: u64,
    /// Bugs: panics caught at the ABI, broken invariants (the pool was not changed).
    pub abi_internal_errors: u64,
}

impl AbiCounters {
    /// The counters now.
    pub fn now() -> AbiCounters {
        use Counter::*;
        AbiCounters {
            abi_errors: count(Errors),
            abi_invalid_mallocs: count(InvalidMallocs),
            abi_failed_mallocs: count(FailedMallocs),
            abi_invalid_frees: count(InvalidFrees),
            abi_double_frees: count(DoubleFrees),
            abi_wrong_size_frees: count(WrongSizeFrees),
            abi_wrong_stream_frees: count(WrongStreamFrees),
            abi_late_double_frees: count(LateDoubleFrees),
            abi_foreign_frees: count(ForeignFrees),
            abi_pending_frees: super::foreign::pending() as u64,
            abi_failed_record_streams: count(FailedRecordStreams),
            abi_failed_calls: count(FailedCalls),
            abi_internal_errors: count(Internal),
        }
    }
}
