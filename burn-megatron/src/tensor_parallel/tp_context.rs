//! The tensor-parallel context a layer works in: its group, whether the activations outside
//! the tensor-parallel regions are split along the sequence, and where the gradients that
//! sequence parallelism leaves partial are summed. The layers cross into and out of the
//! regions through it, so which of Megatron's operators applies is decided in one place.

use std::sync::Arc;

use burn::tensor::Tensor;
use burn_megatron_dist::mapping::{
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
};
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use crate::ops::BackwardHook;

/// The sequence dimension of the model's `[batch, seq, hidden]` activations.
pub const SEQ_DIM: usize = 1;

/// Where the gradients of the replicated parameters applied to a rank's part of the sequence
/// (norm weights, row-parallel biases: partial on each rank under sequence parallelism) are
/// summed over the tensor-parallel group. Without sequence parallelism there is nothing to
/// sum and either value means the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SequenceParallelGrads {
    /// Inside the backward pass: each parameter enters through *f*, whose backward
    /// all-reduces its gradient, so `loss.backward()` gives whole gradients. A small
    /// all-reduce per parameter, six a layer for a GPT.
    #[default]
    SumInBackward,
    /// After it: the backward pass leaves these gradients partial, and
    /// [`sum_sequence_parallel_grads`](super::sum_sequence_parallel_grads) sums all of them in
    /// one all-reduce (Megatron's `finalize_model_grads`). The schedules of
    /// [`pipeline_parallel`](crate::pipeline_parallel) run their passes so.
    Deferred,
}

/// A tensor-parallel group, its sequence parallelism, where the gradients that sequence
/// parallelism leaves partial are summed, and the model's backward hook its dense layers
/// offer their weight gradients to.
#[derive(Debug, Clone)]
pub struct TpContext {
    /// The tensor-parallel group.
    pub group: ProcessGroup,
    /// Whether activations outside the tensor-parallel regions hold `seq / tp` of the
    /// sequence ([`SEQ_DIM`]).
    pub sequence_parallel: bool,
    /// Where the gradients of [`replicated`](Self::replicated) parameters are summed under
    /// sequence parallelism.
    pub sequence_parallel_grads: SequenceParallelGrads,
    /// The model's backward hook
    /// ([`GptModel::set_backward_hook`](crate::models::GptModel::set_backward_hook)): the
    /// dense layers' weight gradients are offered to it
    /// ([`hooked_linear`](crate::ops::hooked_linear)), so that a hook summing gradients in
    /// a flat f32 buffer has the weight-gradient GEMM accumulate there.
    pub backward_hook: Option<Arc<dyn BackwardHook>>,
}

/// Two contexts are equal when they hold the same group, settings and hook (the same one,
/// not an equal one).
impl PartialEq for TpContext {
    fn eq(&self, other: &Self) -> bool {
        let same_hook = match (&self.backward_hook, &other.backward_hook) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        self.group == other.group
            && self.sequence_parallel == other.sequence_parallel
            && self.sequence_parallel_grads == other.sequence_parallel_grads
            && same_hook
    }
}

impl TpContext {
    /// The context of `group`, with or without sequence parallelism; its partial gradients
    /// are summed in the backward pass ([`SequenceParallelGrads::SumInBackward`]), and no
    /// backward hook.
    pub fn new(group: &ProcessGroup, sequence_parallel: bool) -> Self {
        Self {
            group: group.clone(),
            sequence_parallel,
            sequence_parallel_grads: SequenceParallelGrads::default(),
            backward_hook: None,
        }
    }

    /// The same context, its dense layers offering their weight gradients to `hook` (or to
    /// none).
    pub fn with_backward_hook(self, hook: Option<Arc<dyn BackwardHook>>) -> Self {
        Self {
            backward_hook: hook,
            ..self
        }
    }

    /// The same context, its partial gradients summed where `grads` says.
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        Self {
            sequence_parallel_grads: grads,
            ..self
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
    /// through *f*, whose backward sums the gradient over the group, unless the context
    /// defers that sum to one all-reduce after the backward pass
    /// ([`SequenceParallelGrads::Deferred`], see
    /// [`sum_sequence_parallel_grads`](super::sum_sequence_parallel_grads)). Unchanged without
    /// sequence parallelism.
    pub fn replicated<B: DistBackend, const D: usize>(
        &self,
        param: Tensor<B, D>,
    ) -> DistResult<Tensor<B, D>> {
        match (self.sequence_parallel, self.sequence_parallel_grads) {
            (true, SequenceParallelGrads::SumInBackward) => {
                copy_to_tensor_parallel_region(param, &self.group)
            }
            (true, SequenceParallelGrads::Deferred) | (false, _) => Ok(param),
        }
    }
}
