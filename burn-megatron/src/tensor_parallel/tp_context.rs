//! The tensor-parallel context a layer works in: its group, and whether the activations
//! outside the tensor-parallel regions are split along the sequence. The layers cross into
//! and out of the regions through it, so which of Megatron's operators applies is decided
//! in one place.

use burn::tensor::Tensor;
use burn_megatron_dist::mapping::{
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
};
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use super::sequence_parallel_grads::sequence_parallel_grads_deferred;

/// The sequence dimension of the model's `[batch, seq, hidden]` activations.
pub const SEQ_DIM: usize = 1;

/// A tensor-parallel group and its sequence parallelism.
#[derive(Debug, Clone, PartialEq)]
pub struct TpContext {
    /// The tensor-parallel group.
    pub group: ProcessGroup,
    /// Whether activations outside the tensor-parallel regions hold `seq / tp` of the
    /// sequence ([`SEQ_DIM`]).
    pub sequence_parallel: bool,
}

impl TpContext {
    /// The context of `group`, with or without sequence parallelism.
    pub fn new(group: &ProcessGroup, sequence_parallel: bool) -> Self {
        Self {
            group: group.clone(),
            sequence_parallel,
        }
    }

    /// An activation entering a tensor-parallel region (a column-parallel layer's input):
    /// the *f* operator (identity forward, all-reduce backward), or under sequence
    /// parallelism the all-gather of the sequence (reduce-scatter backward).
    pub fn enter<B: DistBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> DistResult<Tensor<B, D>> {
        match self.sequence_parallel {
            true => gather_from_sequence_parallel_region(x, &self.group, SEQ_DIM, true),
            false => copy_to_tensor_parallel_region(x, &self.group),
        }
    }

    /// Partial results leaving a tensor-parallel region (a row-parallel layer's product, the
    /// embedding's lookups): the *g* operator (all-reduce forward), or under sequence
    /// parallelism the reduce-scatter of the sequence (all-gather backward).
    pub fn leave<B: DistBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> DistResult<Tensor<B, D>> {
        match self.sequence_parallel {
            true => reduce_scatter_to_sequence_parallel_region(x, &self.group, SEQ_DIM),
            false => reduce_from_tensor_parallel_region(x, &self.group),
        }
    }

    /// A replicated activation (the position embeddings) cut to this rank's part of the
    /// sequence under sequence parallelism; unchanged otherwise.
    pub fn split_sequence<B: DistBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> DistResult<Tensor<B, D>> {
        match self.sequence_parallel {
            true => scatter_to_sequence_parallel_region(x, &self.group, SEQ_DIM),
            false => Ok(x),
        }
    }

    /// A replicated parameter (a norm's weight, a row-parallel bias) applied to this rank's
    /// part of the sequence. Under sequence parallelism its gradient is partial: it enters
    /// through *f*, whose backward sums the gradient over the group, unless a schedule
    /// defers that sum to one all-reduce after the backward pass (see
    /// [`sum_sequence_parallel_grads`](super::sum_sequence_parallel_grads)). Unchanged without
    /// sequence parallelism.
    pub fn replicated<B: DistBackend, const D: usize>(
        &self,
        param: Tensor<B, D>,
    ) -> DistResult<Tensor<B, D>> {
        match self.sequence_parallel && !sequence_parallel_grads_deferred() {
            true => copy_to_tensor_parallel_region(param, &self.group),
            false => Ok(param),
        }
    }
}
