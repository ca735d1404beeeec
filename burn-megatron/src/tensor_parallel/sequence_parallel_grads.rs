//! The gradients sequence parallelism leaves partial, summed over the TP group after the
//! backward pass: Megatron's all-reduce of the "sequence-parallel parameters" in
//! `finalize_model_grads`.
//!
//! Under sequence parallelism each TP rank applies the replicated norm weights and
//! row-parallel biases to its own part of the sequence, so its gradient of them is partial.
//! Where it is summed is a value of the layers' [`TpContext`](super::TpContext), a
//! [`SequenceParallelGrads`](super::SequenceParallelGrads), set when the model is built and
//! changed with `with_sequence_parallel_grads` (on [`GptModel`](crate::models::GptModel) and
//! each layer), which keeps the parameter ids:
//!
//! - [`SumInBackward`](super::SequenceParallelGrads::SumInBackward), how a model is built:
//!   each parameter enters through *f*, whose backward sums its gradient. A small all-reduce
//!   per parameter inside the backward pass, six a layer for a GPT, about half of a step's
//!   collectives; a loop of one's own with `loss.backward()` gets whole gradients without
//!   another call.
//! - [`Deferred`](super::SequenceParallelGrads::Deferred): no *f*; the backward pass leaves
//!   the gradients partial, and [`sum_sequence_parallel_grads`] sums them all in one
//!   all-reduce afterwards. The training schedules run their passes on deferring copies of
//!   the chunks they are given (same parameter ids) and call it after their backward passes.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup, ReduceOp};

use super::placement::{DeclarePlacements, Placements};

/// Sums over `tp` the gradients in `grads[i]` of the parameters whose gradients `chunks[i]`
/// leaves partial ([`Placements::deferred_gradients`]: those its layers declare with
/// [`Placements::declare_partial_gradient`] as
/// [`Deferred`](super::SequenceParallelGrads::Deferred)), in one all-reduce of their
/// concatenation in f32; each sum is registered back in its gradient's dtype. A declared
/// parameter without a gradient counts as zero, so every TP rank contributes the same
/// elements in the same order. `grads[i]` must come from passes of `chunks[i]` (or of a copy
/// with the same parameter ids and the same
/// [`SequenceParallelGrads`](super::SequenceParallelGrads)). On chunks that sum in the
/// backward pass ([`SumInBackward`](super::SequenceParallelGrads::SumInBackward)) it does
/// nothing: *f* has summed their gradients already.
///
/// A loop of one's own that wants the deferred sum:
///
/// ```ignore
/// let model = model.with_sequence_parallel_grads(SequenceParallelGrads::Deferred);
/// let loss = model.loss(model.try_forward(tokens)?, targets)?;
/// let mut grads = GradientsParams::from_grads(loss.backward(), &model);
/// sum_sequence_parallel_grads(std::slice::from_ref(&model), std::slice::from_mut(&mut grads), model.tp())?;
/// ```
pub fn sum_sequence_parallel_grads<B, M>(
    chunks: &[M],
    grads: &mut [GradientsParams],
    tp: &ProcessGroup,
) -> DistResult<()>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B> + DeclarePlacements,
{
    if tp.size() == 1 {
        return Ok(());
    }
    // (chunk, parameter id, the parameter's value as a 1D tensor: shape, dtype, device).
    let mut partial = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let placements = Placements::of(chunk);
        let ids = placements.deferred_gradients();
        if ids.is_empty() {
            continue;
        }
        let mut values = Values::<B::InnerBackend> {
            ids,
            found: Vec::new(),
        };
        chunk.visit(&mut values);
        // In declaration order, the same on every TP rank.
        for id in ids {
            if let Some((_, value)) = values.found.iter().find(|(found, _)| found == id) {
                partial.push((i, *id, value.clone()));
            }
        }
    }
    if partial.is_empty() {
        return Ok(());
    }
    let mut dtypes = Vec::with_capacity(partial.len());
    let mut parts = Vec::with_capacity(partial.len());
    for (i, id, value) in &partial {
        let grad = grads[*i]
            .remove::<B::InnerBackend, 1>(*id)
            .unwrap_or_else(|| value.zeros_like());
        dtypes.push(grad.dtype());
        parts.push(grad);
    }
    let lens: Vec<usize> = parts.iter().map(|p| p.dims()[0]).collect();
    // Summed in f32. Gradients of one dtype (the usual case) are joined first and cast once
    // each way: two launches, where a cast per tensor is hundreds of tiny ones.
    let one_dtype = dtypes.windows(2).all(|w| w[0] == w[1]);
    let joined = match one_dtype {
        true => Tensor::cat(parts, 0).cast(DType::F32),
        false => Tensor::cat(parts.into_iter().map(|p| p.cast(DType::F32)).collect(), 0),
    };
    let mut sum = tp.all_reduce(joined, ReduceOp::Sum)?;
    if one_dtype {
        sum = sum.cast(dtypes[0]);
    }
    let mut start = 0;
    for ((i, id, _), (len, dtype)) in partial.into_iter().zip(lens.into_iter().zip(dtypes)) {
        let grad = sum.clone().narrow(0, start, len).cast(dtype);
        grads[i].register::<B::InnerBackend, 1>(id, grad);
        start += len;
    }
    Ok(())
}

/// Collects the values (inner backend) of the 1D parameters `ids`.
struct Values<'a, B: burn::tensor::backend::Backend> {
    ids: &'a [ParamId],
    found: Vec<(ParamId, Tensor<B, 1>)>,
}

impl<BA: AutodiffBackend> ModuleVisitor<BA> for Values<'_, BA::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<BA, D>>) {
        if self.ids.contains(&param.id) {
            let value = param.val().inner();
            let numel = value.shape().num_elements();
            self.found.push((param.id, value.reshape([numel])));
        }
    }
}
