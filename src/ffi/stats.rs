//! `vrampool_stats_json`: a device's [`Stats`] and the ABI's counters as one JSON object.

use std::ffi::{c_char, c_int};

use super::status::{vrampool_status, AbiCounters, AbiError, Counter};
use crate::{registry, Stats};

/// What the statistics JSON holds: every field of [`Stats`] and of [`AbiCounters`], by
/// name, in one flat object.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Report {
    /// The pool's figures.
    #[serde(flatten)]
    pub stats: Stats,
    /// The ABI's counters (process-wide).
    #[serde(flatten)]
    pub abi: AbiCounters,
    /// CUDA graph pools of this device open or not yet given back (`vrampool_begin_allocate_to_pool`).
    pub graph_pools: u64,
    /// Their live blocks.
    pub graph_pool_blocks: u64,
    /// Bytes they hold mapped (not in `reserved_bytes`, which is the device's main pool's).
    pub graph_pool_reserved_bytes: u64,
    /// The most the device's pool may map now (`VRAMPOOL_MAX_RESERVED`, or as
    /// `vrampool_set_memory_fraction` last set it).
    pub max_reserved_bytes: u64,
    /// The device's memory: with `max_reserved_bytes`, the fraction PyTorch's
    /// `get_per_process_memory_fraction` reads.
    pub device_memory_bytes: u64,
}

impl Report {
    /// Device `device`'s report now (its pool made if it was not), after settling pending
    /// frees.
    pub fn now(device: usize) -> crate::Result<Report> {
        let entry = registry::entry(device)?;
        super::foreign::settle(true);
        let graphs = super::graph::pools(device);
        Ok(Report {
            stats: entry.pool.stats(),
            abi: AbiCounters::now(),
            graph_pools: graphs.len() as u64,
            graph_pool_blocks: graphs.iter().map(|&(blocks, _)| blocks as u64).sum(),
            graph_pool_reserved_bytes: graphs.iter().map(|&(_, bytes)| bytes).sum(),
            max_reserved_bytes: entry.pool.max_reserved(),
            device_memory_bytes: entry.pool.device().total_memory(),
        })
    }

    /// The report as the ABI writes it.
    pub fn to_json(&self) -> String {
        // Plain integers by field name: serialising cannot fail.
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// `snprintf` into `buf` of `len` bytes; the JSON's whole length.
pub(super) fn json(device: c_int, buf: *mut c_char, len: usize) -> Result<usize, AbiError> {
    let call = "vrampool_stats_json";
    let invalid =
        |msg: String| AbiError::new(vrampool_status::VRAMPOOL_ERROR_INVALID_ARGUMENT, Counter::FailedCalls, msg);
    if buf.is_null() && len != 0 {
        return Err(invalid(format!("{call}: a null buffer of {len} bytes")));
    }
    let report = super::ordinal(device)
        .and_then(Report::now)
        .map_err(|e| AbiError::from_error(call, Counter::FailedCalls, &e))?;
    let text = report.to_json();
    if len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: the caller gave `len` writable bytes at `buf` (non-null as `len > 0`);
        // `n + 1 <= len` bytes are written.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    Ok(text.len())
}
