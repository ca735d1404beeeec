//! A count of the times the host waited for the device: every read back to the host, every
//! sync, and every launch whose cube count had to be read first.
//!
//! A training step should add none (issue 13): the loss is read at the log interval only, and
//! checks such as out-of-range ids or a loss scaler's overflow stay on the device. Tests and
//! benchmarks read [`host_syncs`] before and after the work they want to hold to that.

use std::sync::atomic::{AtomicU64, Ordering};

static HOST_SYNCS: AtomicU64 = AtomicU64::new(0);

/// How many times any thread of this process has waited for one of our CUDA devices so far.
pub fn host_syncs() -> u64 {
    HOST_SYNCS.load(Ordering::Relaxed)
}

pub(super) fn record() {
    HOST_SYNCS.fetch_add(1, Ordering::Relaxed);
}
