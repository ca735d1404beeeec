//! Point-to-point exchange between neighbouring pipeline stages: Megatron's
//! `p2p_communication.py`, and torch's `batch_isend_irecv`.
//!
//! A pipeline schedule often sends one tensor to a neighbour and receives another in the same
//! breath (Megatron's `send_forward_recv_backward`). Over NCCL a send completes only once its
//! receive is posted, so two stages that each send a large tensor to the other before
//! receiving would wait for ever. [`batch_isend_irecv`] posts every send and receive of one
//! exchange as one grouped call, which NCCL (`ncclGroupStart`, `ncclSend`/`ncclRecv` for each
//! op, `ncclGroupEnd`) completes as a whole: no order among the ops of a batch can deadlock.
//!
//! Shapes are known in advance (a stage's activation is `[micro_batch, seq, hidden]`, or
//! `seq / tp` under sequence parallelism), so a receive names the shape and dtype it expects and
//! the steady state sends no shape messages. On the host transports (thread and TCP ranks)
//! sends are buffered: the batch sends first, then waits for its receives, and a receive whose
//! message has another shape is a [`DistError::Mismatch`] naming both.
//!
//! On our CUDA backend (`MegatronCuda`, and `Autodiff` over it) the whole batch is one NCCL
//! group (`ncclGroupStart`, an `ncclSend`/`ncclRecv` per op, `ncclGroupEnd`) on the pipeline
//! group's side stream, through [`DeviceTransport::batch_p2p_on_device`]: an in-band foreign
//! operation, like the all-to-all, so the sends wait for the kernels that produced them, the
//! compute stream waits for the receives before it reads them, and the host never
//! synchronises. The watchdog follows the batch as one call. With collective checks on,
//! each send posts its header (shape, dtype) to its peer through the host first and each
//! receive checks it: a wrong shape is the same [`DistError::Mismatch`] as on the host path.
//! With checks off no header travels, so a batched send must be met by a batched receive.

use burn::tensor::Tensor;

use crate::error::{DistError, DistResult};
pub use crate::op::P2pOp;
use crate::process_group::ProcessGroup;
use crate::process_group::{DeviceTransport, OnDevice};

/// Runs every op of `ops` as one exchange over `group` and returns the received tensors, in
/// the order of the [`P2pOp::Recv`] ops. Messages between two ranks are matched in order: the
/// n-th send from `a` to `b` meets the n-th receive on `b` from `a`.
///
/// Megatron's `_batched_p2p_ops` (`torch.distributed.batch_isend_irecv`). Every receive fails
/// within the group's timeout, naming the peer, if its message never comes.
pub fn batch_isend_irecv<B: DeviceTransport, const D: usize>(
    group: &ProcessGroup,
    ops: Vec<P2pOp<B, D>>,
    device: &B::Device,
) -> DistResult<Vec<Tensor<B, D>>> {
    if ops.is_empty() {
        return Ok(Vec::new());
    }
    let ops = match B::batch_p2p_on_device(group, ops, device) {
        OnDevice::Done(done) => return done,
        OnDevice::Host(ops) => ops,
    };
    let mut receives = Vec::new();
    for op in ops {
        match op {
            P2pOp::Send { tensor, peer } => group.send(tensor, peer)?,
            P2pOp::Recv { peer, shape, dtype } => receives.push((peer, shape, dtype)),
        }
    }
    receives
        .into_iter()
        .map(|(peer, shape, dtype)| {
            let tensor = group.recv::<B, D>(peer, device)?;
            if tensor.dims() != shape || tensor.dtype() != dtype {
                return Err(DistError::Mismatch {
                    rank: group.global_rank(),
                    group: group.name().to_string(),
                    op: format!("recv(src={peer})"),
                    seq: 0,
                    detail: format!(
                        "expected {shape:?} {dtype:?}, rank {} sent {:?} {:?}",
                        group.ranks()[peer],
                        tensor.dims(),
                        tensor.dtype()
                    ),
                });
            }
            Ok(tensor)
        })
        .collect()
}
