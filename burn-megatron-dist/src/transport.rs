//! What carries a group's host-side traffic between ranks: threads of one process
//! ([`ThreadWorld`](crate::threads::ThreadWorld)) or processes over TCP
//! ([`tcp`](crate::tcp)).
//!
//! The host side is the whole collective for CPU tensors. For GPU tensors it is the control
//! plane: NCCL ids, shape checks, send/recv headers and the news of a failed or exited rank,
//! while NCCL moves the data.

use std::fmt;
use std::time::Duration;

use burn::tensor::{DType, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::DistResult;
use crate::op::CollectiveOp;

/// One rank's part of a collective.
#[derive(Debug, Clone)]
pub(crate) struct Contribution {
    pub op: CollectiveOp,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// `None` where the operation needs no data from this rank (barrier, non-root broadcast,
    /// a shape check ahead of an NCCL call).
    pub data: Option<TensorData>,
}

/// What identifies a group and this rank's place in it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct GroupInfo {
    pub name: String,
    /// Unique across the world: the name and the members.
    pub key: String,
    /// Global ranks, in group-rank order.
    pub members: Vec<usize>,
    /// This rank's index in `members`.
    pub group_rank: usize,
    /// This rank's global rank.
    pub global_rank: usize,
}

/// Which ranks have failed or finished.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WorldStatus {
    /// The first rank that failed, with its error.
    pub failure: Option<(usize, String)>,
    /// Per global rank: whether it has finished its work.
    pub exited: Vec<bool>,
}

/// The rendezvous of all ranks of one world.
///
/// Every blocking call fails instead of hanging: on a failed peer, on a peer that finished
/// without joining, or after the timeout, with an error naming the group, the operation and
/// the ranks.
pub(crate) trait Transport: Send + Sync + fmt::Debug {
    /// Number of ranks in the world.
    fn size(&self) -> usize;
    /// How long a call waits for its peers.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn timeout(&self) -> Duration;
    /// Records that `rank` failed; every rank waiting now or later is released with an error.
    fn fail(&self, rank: usize, reason: String);
    /// Records that `rank` finished; operations still waiting for it fail at once.
    fn exit(&self, rank: usize);
    /// Failures and exits so far.
    fn status(&self) -> DistResult<WorldStatus>;
    /// Deposits this rank's part of collective `seq` of the group (never blocks).
    fn deposit(&self, group: &GroupInfo, seq: u64, part: Contribution) -> DistResult<()>;
    /// Waits for every rank's part of collective `seq`, returned in group-rank order.
    fn collect(&self, group: &GroupInfo, seq: u64, op: &str) -> DistResult<Vec<Contribution>>;
    /// Queues a message for group rank `dst` (never blocks): the tensor, or only its header
    /// when NCCL carries the data.
    fn send(&self, group: &GroupInfo, dst: usize, message: Contribution) -> DistResult<()>;
    /// Waits for the next message from group rank `src`; `seq` numbers it in errors.
    fn recv(&self, group: &GroupInfo, src: usize, seq: u64) -> DistResult<Contribution>;
}
