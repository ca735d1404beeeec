//! Errors of process groups, collectives and layouts.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::layout::LayoutError;

/// Result of a distributed operation.
pub type DistResult<T> = Result<T, DistError>;

/// What went wrong in a distributed operation.
///
/// Every variant names the group, the operation and the ranks involved, so that a user
/// reading the error on one rank knows who is stuck or wrong, and where.
///
/// Errors cross process boundaries (a rank in another process reports them), hence serde.
#[derive(Debug, Clone, thiserror::Error, Serialize, Deserialize)]
pub enum DistError {
    /// Some ranks of the group did not reach the operation in time.
    #[error(
        "rank {rank}: {op} #{seq} on group '{group}' timed out after {timeout:?}: \
         ranks {missing:?} did not arrive"
    )]
    Timeout {
        /// Global rank that reports the error.
        rank: usize,
        /// Group name.
        group: String,
        /// Operation, e.g. `all_reduce(sum)`.
        op: String,
        /// Sequence number of the operation within the group on this rank.
        seq: u64,
        /// Global ranks that had not arrived.
        missing: Vec<usize>,
        /// The configured timeout.
        timeout: Duration,
    },
    /// Another rank failed (returned an error or panicked); this rank was released.
    #[error(
        "rank {rank}: {op} on group '{group}' aborted because rank {failed_rank} failed: {reason}"
    )]
    PeerFailed {
        /// Global rank that reports the error.
        rank: usize,
        /// Group name.
        group: String,
        /// The operation this rank was in.
        op: String,
        /// Global rank that failed first.
        failed_rank: usize,
        /// That rank's error.
        reason: String,
    },
    /// Ranks the operation waits for have already finished their work.
    #[error(
        "rank {rank}: {op} #{seq} on group '{group}' cannot complete: ranks {exited:?} \
         finished without joining it"
    )]
    PeerExited {
        /// Global rank that reports the error.
        rank: usize,
        /// Group name.
        group: String,
        /// Operation.
        op: String,
        /// Sequence number of the operation.
        seq: u64,
        /// Global ranks that exited.
        exited: Vec<usize>,
    },
    /// A collective started on the GPU but did not end within the timeout: the watchdog
    /// aborted the group's NCCL communicator.
    #[error(
        "rank {rank}: {op} #{seq} on group '{group}' timed out on the GPU after {timeout:?} \
         (a peer never joined it); the NCCL communicator was aborted. This rank's last \
         collectives on the group:{recent}"
    )]
    WatchdogTimeout {
        /// Global rank that reports the error.
        rank: usize,
        /// Group name.
        group: String,
        /// Operation.
        op: String,
        /// Sequence number of the operation within the group on this rank.
        seq: u64,
        /// The configured timeout.
        timeout: Duration,
        /// This rank's last collectives on the group, one per line.
        recent: String,
    },
    /// NCCL itself reported an error while a collective was pending (its own allocations
    /// failing on a full GPU, a broken connection): the watchdog aborted the communicator.
    #[error(
        "rank {rank}: NCCL failed during {op} #{seq} on group '{group}': {error}; the \
         communicator was aborted (NCCL allocates its buffers on the GPU as connections open: \
         on a nearly full GPU this is often out of memory; NCCL_DEBUG=WARN tells more)"
    )]
    NcclAsync {
        /// Global rank that reports the error.
        rank: usize,
        /// Group name.
        group: String,
        /// The oldest pending operation.
        op: String,
        /// Its sequence number within the group on this rank.
        seq: u64,
        /// NCCL's error.
        error: String,
    },
    /// Ranks called different collectives, or passed incompatible tensors, at the same step.
    #[error("rank {rank}: {op} #{seq} on group '{group}' mismatched across ranks: {detail}")]
    Mismatch {
        /// Global rank that reports the error.
        rank: usize,
        /// Group name.
        group: String,
        /// Operation on this rank.
        op: String,
        /// Sequence number.
        seq: u64,
        /// What differs, rank by rank.
        detail: String,
    },
    /// The call itself is invalid (a dimension out of range, a rank outside the group, …).
    #[error("{0}")]
    InvalidArgument(String),
    /// Distributed tensors with incompatible placements or groups were combined.
    #[error("placement mismatch: {0}")]
    Placement(String),
    /// Ranks in different processes could not reach each other (the rendezvous at
    /// `MASTER_ADDR:MASTER_PORT`, or a missing launch variable).
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// NCCL failed, or its watchdog aborted a communicator.
    #[error("{0}")]
    Nccl(String),
    /// A tensor could not be read from the device: the device reported an error, often one
    /// deferred from an earlier operation (a collective the watchdog aborted, a bad index).
    #[error("rank {rank}: reading {what} on group '{group}' from the device failed: {message}")]
    Device {
        /// Global rank that reports the error.
        rank: usize,
        /// Group name.
        group: String,
        /// What was read (e.g. `the input of all_reduce(sum)`).
        what: String,
        /// The backend's error.
        message: String,
    },
    /// The parallel layout is invalid.
    #[error(transparent)]
    #[serde(skip)]
    Layout(#[from] LayoutError),
}
