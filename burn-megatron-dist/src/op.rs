//! Descriptions of operations: collectives (matched across ranks and named in errors), and
//! the sends and receives of a batched exchange ([`P2pOp`]).

use std::fmt;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// How an all-reduce or reduce-scatter combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the group (sum, then divide by the group size).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        };
        f.write_str(name)
    }
}

/// One collective call, as every rank of the group must make it.
///
/// Ranks are matched by the order of their calls on a group (the n-th call on one rank meets
/// the n-th call on every other rank, as in NCCL); this description lets a mismatch be
/// reported instead of producing garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveOp {
    /// Every rank gets the reduction of all ranks' tensors.
    AllReduce(ReduceOp),
    /// Every rank gets the concatenation of all ranks' tensors along `dim`.
    AllGather {
        /// Concatenation dimension.
        dim: usize,
    },
    /// Every rank gets its shard (along `dim`) of the reduction.
    ReduceScatter {
        /// Sharded dimension.
        dim: usize,
        /// Reduction.
        op: ReduceOp,
    },
    /// Every rank gets the tensor of the root (a group-local rank).
    Broadcast {
        /// Group-local rank of the source.
        root: usize,
    },
    /// Each rank splits its tensor along `split_dim`, sends shard j to rank j, and
    /// concatenates what it receives along `concat_dim`, in rank order.
    AllToAll {
        /// Dimension split into one shard per rank.
        split_dim: usize,
        /// Dimension the received shards are concatenated along.
        concat_dim: usize,
    },
    /// Waits until every rank has arrived.
    Barrier,
    /// Sends a tensor to one group rank (point to point, not collective).
    Send {
        /// Group-local rank of the receiver.
        dst: usize,
    },
    /// Creates the group's NCCL communicator (group rank 0 hands out its id).
    CommInit,
}

impl fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CollectiveOp::AllReduce(op) => write!(f, "all_reduce({op})"),
            CollectiveOp::AllGather { dim } => write!(f, "all_gather(dim={dim})"),
            CollectiveOp::ReduceScatter { dim, op } => write!(f, "reduce_scatter({op}, dim={dim})"),
            CollectiveOp::Broadcast { root } => write!(f, "broadcast(root={root})"),
            CollectiveOp::AllToAll {
                split_dim,
                concat_dim,
            } => write!(f, "all_to_all(split={split_dim}, concat={concat_dim})"),
            CollectiveOp::Barrier => f.write_str("barrier"),
            CollectiveOp::Send { dst } => write!(f, "send(dst={dst})"),
            CollectiveOp::CommInit => f.write_str("nccl_comm_init"),
        }
    }
}

/// One operation of a batched exchange; peers are group-local ranks of the pipeline group.
#[derive(Debug, Clone)]
pub enum P2pOp<B: Backend, const D: usize> {
    /// Sends `tensor` to `peer`.
    Send {
        /// The tensor to send.
        tensor: Tensor<B, D>,
        /// Group rank of the receiver.
        peer: usize,
    },
    /// Receives a tensor of `shape` and `dtype` from `peer`.
    Recv {
        /// Group rank of the sender.
        peer: usize,
        /// The shape the sender sends (known in advance).
        shape: [usize; D],
        /// The dtype the sender sends.
        dtype: DType,
    },
}
