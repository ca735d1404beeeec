//! The vocabulary-parallel cross-entropy as one operation with a written-out backward.
//!
//! Each rank reduces its `[rows, local]` slice of the logits to three `[rows]` statistics
//! ([`ModelBackend::cross_entropy_statistics`]: the largest logit, `Σ exp(x - max)` and the
//! target's logit), the TP group reduces those (three `[rows]` collectives, as Megatron), and
//! the loss is `ln Σ + max - target_logit`. The backward
//! ([`ModelBackend::cross_entropy_gradient`]) writes `(softmax - one_hot) · dloss` for the slice
//! from the logits and the two global statistics, with no collective: every rank computes the
//! same loss. Nothing `[rows, vocab]`-sized is stored besides the logits themselves, and on
//! CubeCL backends each of the two passes is one fused kernel.
//!
//! Statistics and losses are f32 (f64 for f64 logits), whatever the logits' dtype.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_megatron_dist::{DistResult, ProcessGroup, ReduceOp};

use crate::backend::{ModelBackend, wrap};

/// Stands for "no logit" in a row maximum: finite, so that `exp(a - b)` of two of them is 1
/// (times a zero sum) rather than NaN.
pub const NO_LOGIT: f64 = -1.0e30;

/// Where a rank's slice of the logits sits in the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabSlice {
    /// The vocabulary id of the slice's first column.
    pub start: usize,
    /// Columns of the slice that are real tokens; the rest is padding, left out.
    pub real: usize,
}

/// The dtype statistics and losses are computed in: f64 for f64 logits, else f32.
pub fn statistics_dtype(logits: DType) -> DType {
    match logits {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// The per-token losses `[rows]` of `logits` (`[rows, local]`, this rank's slice) against
/// `targets` (`[rows]`, vocabulary ids; a negative target gives a meaningless loss, to be
/// masked): equal on every rank of `tp`.
pub fn vocab_parallel_cross_entropy_rows<B: ModelBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    slice: VocabSlice,
    tp: &ProcessGroup,
) -> DistResult<Tensor<B, 1>> {
    B::cross_entropy(logits, targets, slice, tp)
}

/// The forward pass on any backend: the losses and the global statistics the backward needs.
pub(crate) struct CrossEntropyForward<B: Backend> {
    pub losses: Tensor<B, 1>,
    pub max: Tensor<B, 1>,
    pub sum_exp: Tensor<B, 1>,
}

pub(crate) fn forward<B: ModelBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    slice: VocabSlice,
    tp: &ProcessGroup,
) -> DistResult<CrossEntropyForward<B>> {
    let [local_max, local_sum, target_logit] = B::cross_entropy_statistics(logits, targets, slice);
    let max = tp.all_reduce(local_max.clone(), ReduceOp::Max)?;
    // The two sums in one all-reduce: `[sum_exp | target_logit]`.
    let rows = target_logit.dims()[0];
    let sums = Tensor::cat(
        vec![local_sum * (local_max - max.clone()).exp(), target_logit],
        0,
    );
    let sums = tp.all_reduce(sums, ReduceOp::Sum)?;
    let sum_exp = sums.clone().narrow(0, 0, rows);
    let target_logit = sums.narrow(0, rows, rows);
    Ok(CrossEntropyForward {
        losses: sum_exp.clone().log() + max.clone() - target_logit,
        max,
        sum_exp,
    })
}

/// [`ModelBackend::cross_entropy_statistics`] as a Burn composition.
pub fn statistics_composition<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    slice: VocabSlice,
) -> [Tensor<B, 1>; 3] {
    let [rows, _] = logits.dims();
    let device = logits.device();
    let dtype = statistics_dtype(logits.dtype());
    if slice.real == 0 || rows == 0 {
        let full = |value: f64| Tensor::<B, 1>::full([rows], value, (&device, dtype));
        return [full(NO_LOGIT), full(0.0), full(0.0)];
    }
    let x = logits.cast(dtype).narrow(1, 0, slice.real);
    let max = x.clone().max_dim(1);
    let sum_exp = (x.clone() - max.clone()).exp().sum_dim(1);
    let (local, in_slice) = localize(targets, slice);
    let picked = x
        .gather(1, local.clamp(0, slice.real as i64 - 1).unsqueeze_dim(1))
        .mask_fill(in_slice.bool_not().unsqueeze_dim(1), 0.0);
    [max, sum_exp, picked].map(|t| t.squeeze_dim(1))
}

/// [`ModelBackend::cross_entropy_gradient`] as a Burn composition.
pub fn gradient_composition<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    max: Tensor<B, 1>,
    sum_exp: Tensor<B, 1>,
    grad_loss: Tensor<B, 1>,
    slice: VocabSlice,
) -> Tensor<B, 2> {
    let [rows, local] = logits.dims();
    let (device, dtype) = (logits.device(), logits.dtype());
    let stat = max.dtype();
    if slice.real == 0 || rows == 0 {
        return Tensor::zeros([rows, local], (&device, dtype));
    }
    let x = logits.cast(stat).narrow(1, 0, slice.real);
    let probs = (x - max.unsqueeze_dim(1)).exp() / sum_exp.unsqueeze_dim(1);
    let (target, _) = localize(targets, slice);
    let columns = Tensor::<B, 1, Int>::arange(0..slice.real as i64, &device)
        .unsqueeze_dim::<2>(0)
        .expand([rows, slice.real]);
    let one_hot = columns
        .equal(target.unsqueeze_dim::<2>(1).expand([rows, slice.real]))
        .float()
        .cast(stat);
    let grad = (probs - one_hot) * grad_loss.cast(stat).unsqueeze_dim(1);
    let grad = match slice.real < local {
        true => Tensor::cat(
            vec![
                grad,
                Tensor::zeros([rows, local - slice.real], (&device, stat)),
            ],
            1,
        ),
        false => grad,
    };
    grad.cast(dtype)
}

/// Targets as columns of the slice, and whether they fall in its real columns.
fn localize<B: Backend>(
    targets: Tensor<B, 1, Int>,
    slice: VocabSlice,
) -> (Tensor<B, 1, Int>, Tensor<B, 1, burn::tensor::Bool>) {
    let local = targets.sub_scalar(slice.start as i64);
    let in_slice = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(slice.real as i64));
    (local, in_slice)
}

/// The `Autodiff<B>` operation: the forward on the inner backend, and one node whose
/// backward calls [`ModelBackend::cross_entropy_gradient`].
pub(crate) fn autodiff_cross_entropy<B: ModelBackend, C: CheckpointStrategy>(
    logits: Tensor<Autodiff<B, C>, 2>,
    targets: Tensor<Autodiff<B, C>, 1, Int>,
    slice: VocabSlice,
    tp: &ProcessGroup,
) -> DistResult<Tensor<Autodiff<B, C>, 1>> {
    let logits = logits.into_primitive().tensor();
    let targets: Tensor<B, 1, Int> = Tensor::from_primitive(targets.into_primitive());
    let outcome = forward::<B>(
        wrap::<B, 2>(logits.primitive.clone()),
        targets.clone(),
        slice,
        tp,
    )?;
    let losses = outcome.losses.into_primitive().tensor();
    let state = CrossEntropyState::<B> {
        logits: logits.primitive.clone(),
        targets: targets.into_primitive(),
        max: outcome.max.into_primitive().tensor(),
        sum_exp: outcome.sum_exp.into_primitive().tensor(),
        slice,
    };
    let losses = match CrossEntropyBackward
        .prepare::<C>([logits.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, losses),
        OpsKind::UnTracked(prep) => prep.finish(losses),
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(losses)))
}

#[derive(Debug)]
struct CrossEntropyBackward;

#[derive(Debug)]
struct CrossEntropyState<B: Backend> {
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    max: FloatTensor<B>,
    sum_exp: FloatTensor<B>,
    slice: VocabSlice,
}

impl<B: Backend> Clone for CrossEntropyState<B> {
    fn clone(&self) -> Self {
        Self {
            logits: self.logits.clone(),
            targets: self.targets.clone(),
            max: self.max.clone(),
            sum_exp: self.sum_exp.clone(),
            slice: self.slice,
        }
    }
}

impl<B: ModelBackend> Backward<B, 1> for CrossEntropyBackward {
    type State = CrossEntropyState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad_loss = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        let Some(parent) = parent else { return };
        let s = ops.state;
        let grad = B::cross_entropy_gradient(
            wrap::<B, 2>(s.logits),
            Tensor::from_primitive(s.targets),
            wrap::<B, 1>(s.max),
            wrap::<B, 1>(s.sum_exp),
            wrap::<B, 1>(grad_loss),
            s.slice,
        );
        grads.register::<B>(parent.id, grad.into_primitive().tensor());
    }
}
