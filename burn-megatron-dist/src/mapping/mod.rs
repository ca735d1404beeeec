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
//! | [`all_to_all_v`] | all-to-all of blocks of rows of different sizes | the same, sizes swapped |
//! | [`ring_exchange`] | send to the next rank, receive from the previous | send to the previous, receive from the next |
//!
//! Megatron keeps activations as `[seq, batch, hidden]`; Burn models usually use
//! `[batch, seq, hidden]`, so the sequence functions take the sequence dimension. On a group of
//! one rank every function returns its input.
//!
//! Each communication runs through [`ProcessGroup`] (and so through a backend's
//! [`DeviceTransport`]); [`DistBackend`] records its backward half in the autodiff graph.

mod dist_backend;

use std::sync::Arc;

use burn::tensor::Tensor;

pub use dist_backend::DistBackend;

use crate::error::{DistError, DistResult};
use crate::op::{P2pOp, ReduceOp};
use crate::p2p::batch_isend_irecv;
use crate::process_group::DeviceTransport;
use crate::process_group::ProcessGroup;
use crate::shard::shard_range;

/// One communication applied to a tensor: a mapping's forward or backward half.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Send `send[q]` rows (dimension 0, in rank order) to each group rank `q`, receive
    /// `recv[r]` rows from each rank `r` and concatenate them in rank order.
    AllToAllV {
        /// Rows sent to each group rank.
        send: Arc<[usize]>,
        /// Rows received from each group rank.
        recv: Arc<[usize]>,
    },
    /// Send to the next rank of the ring (group rank `rank + 1 mod size`), receive from the
    /// previous one (`rank - 1 mod size`): the step of ring attention's K/V rotation.
    RingToNext,
    /// Send to the previous rank of the ring, receive from the next one: the inverse of
    /// [`RingToNext`](Comm::RingToNext), which its gradient goes through.
    RingToPrevious,
}

/// A differentiable communication.
#[derive(Debug, Clone, PartialEq, Eq)]
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
            Comm::AllToAllV { send, recv } => exchange_rows(group, x, &send, &recv),
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

/// The blocks of `x` (`send[q]` rows for rank `q`) to their ranks, in one batch of sends and
/// receives; this rank's own block is kept, not sent. A block of no rows is neither sent
/// nor received.
fn exchange_rows<B: DeviceTransport, const D: usize>(
    group: &ProcessGroup,
    x: Tensor<B, D>,
    send: &[usize],
    recv: &[usize],
) -> DistResult<Tensor<B, D>> {
    let rank = group.rank();
    let (dims, dtype, device) = (x.dims(), x.dtype(), x.device());
    let mut ops = Vec::new();
    let mut own = None;
    let mut start = 0;
    for (q, &rows) in send.iter().enumerate() {
        if rows > 0 {
            let block = x.clone().narrow(0, start, rows);
            match q == rank {
                true => own = Some(block),
                false => ops.push(P2pOp::Send {
                    tensor: block,
                    peer: q,
                }),
            }
        }
        start += rows;
    }
    for (r, &rows) in recv.iter().enumerate() {
        if rows > 0 && r != rank {
            let mut shape = dims;
            shape[0] = rows;
            ops.push(P2pOp::Recv {
                peer: r,
                shape,
                dtype,
            });
        }
    }
    let mut received = batch_isend_irecv(group, ops, &device)?.into_iter();
    let blocks: Vec<Tensor<B, D>> = recv
        .iter()
        .enumerate()
        .filter(|&(_, &rows)| rows > 0)
        .map(|(r, _)| match r == rank {
            true => own
                .take()
                .expect("this rank's own block, checked equal in size"),
            false => received.next().expect("one receive a block"),
        })
        .collect();
    Ok(match blocks.is_empty() {
        true => {
            let mut empty = dims;
            empty[0] = 0;
            Tensor::zeros(empty, (&device, dtype))
        }
        false => Tensor::cat(blocks, 0),
    })
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

/// [`all_to_all`] with blocks of different sizes: `x` holds, along dimension 0 and in rank
/// order, `send_rows[q]` rows for each group rank `q`; the result holds the `recv_rows[r]`
/// rows each rank `r` sent this rank, in rank order. The gradient goes back the same way
/// with the sizes swapped. Each rank's `send_rows[q]` must be rank `q`'s `recv_rows[rank]`
/// (the caller knows both, e.g. from all-gathered counts): this is checked for this rank's
/// own block and the length of `x`, and a receive of the wrong size fails with the group's
/// collective checks on. The MoE token dispatcher sends each rank only the tokens of its
/// experts with it, where [`all_to_all`] would pad every block to the largest.
pub fn all_to_all_v<B: DistBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> DistResult<Tensor<B, D>> {
    let (size, rank) = (group.size(), group.rank());
    let rows = x.dims()[0];
    if send_rows.len() != size
        || recv_rows.len() != size
        || send_rows.iter().sum::<usize>() != rows
        || send_rows[rank] != recv_rows[rank]
    {
        return Err(DistError::InvalidArgument(format!(
            "all_to_all_v on group '{}' (rank {rank} of {size}): send rows {send_rows:?} and \
             receive rows {recv_rows:?} must have one entry a rank, the send rows must add up \
             to the input's {rows} rows and this rank's own block must be the same both ways",
            group.name()
        )));
    }
    let (send, recv): (Arc<[usize]>, Arc<[usize]>) = (send_rows.into(), recv_rows.into());
    map(
        x,
        group,
        Comm::AllToAllV {
            send: send.clone(),
            recv: recv.clone(),
        },
        Comm::AllToAllV {
            send: recv,
            recv: send,
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
