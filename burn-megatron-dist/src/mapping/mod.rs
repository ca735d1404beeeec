//! Megatron's communication operators, differentiable: each has a forward communication and
//! the communication its gradient goes through.
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`copy_to_tensor_parallel_region`] (the paper's *f*) | identity | all-reduce |
//! | [`reduce_from_tensor_parallel_region`] (the paper's *g*) | all-reduce | identity |
//! | [`scatter_to_tensor_parallel_region`] | keep own last-dim shard | all-gather last dim |
//! | [`gather_from_tensor_parallel_region`] | all-gather last dim | keep own shard |
//! | [`scatter_to_sequence_parallel_region`] | keep own sequence shard | all-gather sequence |
//! | [`gather_from_sequence_parallel_region`] | all-gather sequence | reduce-scatter (or keep own shard) |
//! | [`reduce_scatter_to_sequence_parallel_region`] | reduce-scatter sequence | all-gather sequence |
//! | [`all_to_all`] | all-to-all (split a, concat b) | all-to-all (split b, concat a) |
//! | [`ring_exchange`] | send to the next rank, receive from the previous | send to the previous, receive from the next |
//!
//! Megatron keeps activations as `[seq, batch, hidden]`; Burn models usually use
//! `[batch, seq, hidden]`, so the sequence functions take the sequence dimension. On a group of
//! one rank every function returns its input.
//!
//! Each communication runs through [`ProcessGroup`] (and so through a backend's
//! [`DeviceTransport`]); [`DistBackend`] records its backward half in the autodiff graph.

mod dist_backend;

use burn::tensor::Tensor;

pub use dist_backend::DistBackend;

use crate::error::DistResult;
use crate::op::{P2pOp, ReduceOp};
use crate::p2p::batch_isend_irecv;
use crate::process_group::DeviceTransport;
use crate::process_group::ProcessGroup;
use crate::shard::shard_range;

/// One communication applied to a tensor: a mapping's forward or backward half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Comm {
    /// Nothing.
    Identity,
    /// Sum over the group.
    AllReduce,
    /// Keep this rank's shard along `dim`; no communication.
    Split {
        /// Sharded dimension.
        dim: usize,
    },
    /// Concatenate the ranks' shards along `dim`.
    AllGather {
        /// Gathered dimension.
        dim: usize,
    },
    /// Sum over the group, keep this rank's shard along `dim`.
    ReduceScatter {
        /// Sharded dimension.
        dim: usize,
    },
    /// Split along `split_dim` across ranks, concatenate what arrives along `concat_dim`.
    AllToAll {
        /// Dimension split across ranks.
        split_dim: usize,
        /// Dimension received shards are concatenated along.
        concat_dim: usize,
    },
    /// Send to the next rank of the ring (group rank `rank + 1 mod size`), receive from the
    /// previous one (`rank - 1 mod size`): the step of ring attention's K/V rotation.
    RingToNext,
    /// Send to the previous rank of the ring, receive from the next one: the inverse of
    /// [`RingToNext`](Comm::RingToNext), which its gradient goes through.
    RingToPrevious,
}

/// A differentiable communication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// Applied to the input.
    pub forward: Comm,
    /// Applied to the output's gradient to give the input's gradient.
    pub backward: Comm,
}

impl Comm {
    /// Runs this communication on `x` over `group`.
    pub fn apply<B: DeviceTransport, const D: usize>(
        self,
        group: &ProcessGroup,
        x: Tensor<B, D>,
    ) -> DistResult<Tensor<B, D>> {
        match self {
            Comm::Identity => Ok(x),
            Comm::AllReduce => group.all_reduce(x, ReduceOp::Sum),
            Comm::Split { dim } => {
                let range = shard_range(x.dims()[dim], group.size(), group.rank())?;
                Ok(x.narrow(dim, range.start, range.len()))
            }
            Comm::AllGather { dim } => group.all_gather(x, dim),
            Comm::ReduceScatter { dim } => group.reduce_scatter(x, dim, ReduceOp::Sum),
            Comm::AllToAll {
                split_dim,
                concat_dim,
            } => group.all_to_all(x, split_dim, concat_dim),
            Comm::RingToNext => ring_shift(group, x, 1),
            Comm::RingToPrevious => ring_shift(group, x, group.size() - 1),
        }
    }
}

/// Sends `x` to group rank `rank + offset` and returns what rank `rank - offset` (mod the
/// size) sent, as one batched exchange ([`batch_isend_irecv`]), so that no order of the ring's
/// sends and receives can deadlock on a device transport. Every rank sends a tensor of one
/// shape and dtype.
fn ring_shift<B: DeviceTransport, const D: usize>(
    group: &ProcessGroup,
    x: Tensor<B, D>,
    offset: usize,
) -> DistResult<Tensor<B, D>> {
    let size = group.size();
    let (to, from) = (
        (group.rank() + offset) % size,
        (group.rank() + size - offset) % size,
    );
    if to == group.rank() {
        return Ok(x);
    }
    let (shape, dtype, device) = (x.dims(), x.dtype(), x.device());
    let ops = vec![
        P2pOp::Send {
            tensor: x,
            peer: to,
        },
        P2pOp::Recv {
            peer: from,
            shape,
            dtype,
        },
    ];
    let mut received = batch_isend_irecv(group, ops, &device)?;
    Ok(received.pop().expect("one receive was posted"))
}

fn map<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    forward: Comm,
    backward: Comm,
) -> DistResult<Tensor<B, D>> {
    if group.size() == 1 {
        return Ok(x);
    }
    B::apply_mapping(x, Mapping { forward, backward }, group)
}

/// The *f* of Megatron's paper, entering a tensor-parallel region: identity forward, gradient
/// summed over the group backward.
pub fn copy_to_tensor_parallel_region<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
) -> DistResult<Tensor<B, D>> {
    map(x, group, Comm::Identity, Comm::AllReduce)
}

/// The *g* of Megatron's paper, leaving a tensor-parallel region: partial results summed over
/// the group forward, gradient passed through backward.
pub fn reduce_from_tensor_parallel_region<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
) -> DistResult<Tensor<B, D>> {
    map(x, group, Comm::AllReduce, Comm::Identity)
}

/// Keeps this rank's shard of the last dimension; the gradient is all-gathered.
pub fn scatter_to_tensor_parallel_region<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
) -> DistResult<Tensor<B, D>> {
    let dim = D - 1;
    map(x, group, Comm::Split { dim }, Comm::AllGather { dim })
}

/// All-gathers the last dimension; the gradient keeps this rank's shard.
pub fn gather_from_tensor_parallel_region<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
) -> DistResult<Tensor<B, D>> {
    let dim = D - 1;
    map(x, group, Comm::AllGather { dim }, Comm::Split { dim })
}

/// Keeps this rank's shard of the sequence dimension; the gradient is all-gathered.
pub fn scatter_to_sequence_parallel_region<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    seq_dim: usize,
) -> DistResult<Tensor<B, D>> {
    map(
        x,
        group,
        Comm::Split { dim: seq_dim },
        Comm::AllGather { dim: seq_dim },
    )
}

/// All-gathers the sequence dimension before a tensor-parallel region.
///
/// With `tensor_parallel_output_grad` (the usual case: the region's ranks each produce a
/// partial gradient of the full sequence) the gradient is reduce-scattered; without it each
/// rank's gradient is already complete and it keeps its own shard.
pub fn gather_from_sequence_parallel_region<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    seq_dim: usize,
    tensor_parallel_output_grad: bool,
) -> DistResult<Tensor<B, D>> {
    let backward = if tensor_parallel_output_grad {
        Comm::ReduceScatter { dim: seq_dim }
    } else {
        Comm::Split { dim: seq_dim }
    };
    map(x, group, Comm::AllGather { dim: seq_dim }, backward)
}

/// Sums partial results and keeps this rank's sequence shard, leaving a tensor-parallel
/// region under sequence parallelism; the gradient is all-gathered.
pub fn reduce_scatter_to_sequence_parallel_region<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    seq_dim: usize,
) -> DistResult<Tensor<B, D>> {
    map(
        x,
        group,
        Comm::ReduceScatter { dim: seq_dim },
        Comm::AllGather { dim: seq_dim },
    )
}

/// All-to-all (split `split_dim`, concatenate `concat_dim`), as expert and context parallelism
/// use it; the gradient goes through the inverse all-to-all.
pub fn all_to_all<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    split_dim: usize,
    concat_dim: usize,
) -> DistResult<Tensor<B, D>> {
    map(
        x,
        group,
        Comm::AllToAll {
            split_dim,
            concat_dim,
        },
        Comm::AllToAll {
            split_dim: concat_dim,
            concat_dim: split_dim,
        },
    )
}

/// Passes `x` one step around the ring of `group` (to group rank `rank + 1`, wrapping) and
/// returns the tensor of the previous rank (`rank - 1`, wrapping); the gradient travels the
/// other way (to `rank - 1`, from `rank + 1`). Every rank passes a tensor of one shape and
/// dtype. Ring attention rotates the K/V blocks with it, so that under `Autodiff` their
/// gradients travel back around the ring. On a group of one rank it returns its input.
pub fn ring_exchange<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
) -> DistResult<Tensor<B, D>> {
    map(x, group, Comm::RingToNext, Comm::RingToPrevious)
}
