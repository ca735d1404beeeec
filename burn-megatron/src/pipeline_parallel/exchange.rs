//! Running a plan's exchange steps over the pipeline group.

use std::collections::HashMap;

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::p2p::{P2pOp, batch_isend_irecv};
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use super::plan::{Compute, Direction, Payload, Transfer};

/// Tensors waiting to leave this rank, and tensors that have arrived, by what they are.
pub(crate) struct Mailbox<E: burn::tensor::backend::Backend> {
    pub outgoing: HashMap<(Payload, Compute), Tensor<E, 3>>,
    pub arrived: HashMap<(Payload, Compute), Tensor<E, 3>>,
}

impl<E: DistBackend> Mailbox<E> {
    pub fn new() -> Self {
        Self {
            outgoing: HashMap::new(),
            arrived: HashMap::new(),
        }
    }

    /// Runs one exchange as a single batched call: the sends of tensors this rank produced
    /// and the receives of tensors of `shape(transfer)` (known in advance, no shape messages).
    pub fn exchange(
        &mut self,
        pp: &ProcessGroup,
        transfers: &[Transfer],
        shape: impl Fn(&Transfer) -> [usize; 3],
        dtype: DType,
        device: &E::Device,
    ) -> DistResult<()> {
        let mut ops = Vec::with_capacity(transfers.len());
        let mut receiving = Vec::new();
        for t in transfers {
            let key = (t.payload, compute(t));
            match t.direction {
                Direction::Send => {
                    let tensor = self.outgoing.remove(&key).ok_or_else(|| {
                        burn_megatron_dist::DistError::InvalidArgument(format!(
                            "plan sends the {:?} of microbatch {} (chunk {}) before computing it",
                            t.payload, t.microbatch, t.chunk
                        ))
                    })?;
                    ops.push(P2pOp::Send {
                        tensor,
                        peer: t.peer,
                    });
                }
                Direction::Recv => {
                    ops.push(P2pOp::Recv {
                        peer: t.peer,
                        shape: shape(t),
                        dtype,
                    });
                    receiving.push(key);
                }
            }
        }
        let received = batch_isend_irecv::<E, 3>(pp, ops, device)?;
        self.arrived.extend(receiving.into_iter().zip(received));
        Ok(())
    }
}

fn compute(t: &Transfer) -> Compute {
    Compute {
        microbatch: t.microbatch,
        chunk: t.chunk,
    }
}
