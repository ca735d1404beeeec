//! The vocabulary-parallel cross-entropy as one operation with a written-out backward.
//!
//! Each rank reduces its `[rows, local]` slice of the logits to three `[rows]` statistics
//! ([`CrossEntropyOps::cross_entropy_statistics`]: the largest logit, `Σ exp(x - max)` and the
//! target's logit), the TP group reduces those (three `[rows]` collectives, as Megatron), and
//! the loss is `ln Σ + max - target_logit`. The backward
//! ([`CrossEntropyOps::cross_entropy_gradient`]) writes `(softmax - one_hot) · dloss` for the slice
//! from the logits and the two global statistics, with no collective: every rank computes the
//! same loss. Nothing `[rows, vocab]`-sized is stored besides the logits themselves, and on
//! CubeCL backends each of the two passes is one fused kernel.
//!
//! Statistics and losses are f32 (f64 for f64 logits), whatever the logits' dtype.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::{DeviceTransport, DistResult, ProcessGroup, ReduceOp};

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::primitive::{raw, wrap};

/// Stands for "no logit" in a row maximum: finite, so that `exp(a - b)` of two of them is 1
/// (times a zero sum) rather than NaN.
pub const NO_LOGIT: f64 = -1.0e30;

/// The vocabulary-parallel cross-entropy.
pub trait CrossEntropyOps: DeviceTransport {
    /// Per-token losses `[rows]` of this rank's logits slice `[rows, local]` against `targets`
    /// (`[rows]`), reduced over `tp` (see the [module docs](self)). `Autodiff<B>` records one
    /// node whose backward is [`cross_entropy_gradient`](Self::cross_entropy_gradient).
    fn cross_entropy(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        slice: VocabSlice,
        tp: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 1>> {
        Ok(forward(logits, targets, slice, tp)?.losses)
    }

    /// This rank's `[max, Σ exp(x - max), target logit]` per row of `logits` (`[rows, local]`),
    /// f32 (f64 for f64 logits); padding columns are left out, and a target outside the slice
    /// has logit 0. CubeCL backends run one fused kernel.
    fn cross_entropy_statistics(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        slice: VocabSlice,
    ) -> [Tensor<Self, 1>; 3] {
        statistics_composition(logits, targets, slice)
    }

    /// `(exp(x - max) / sum_exp - one_hot(target)) · grad_loss` per row of `logits`
    /// (`[rows, local]`), zero in padding columns, in the logits' dtype; `max` and `sum_exp`
    /// are the TP-reduced statistics. CubeCL backends run one fused kernel.
    fn cross_entropy_gradient(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        max: Tensor<Self, 1>,
        sum_exp: Tensor<Self, 1>,
        grad_loss: Tensor<Self, 1>,
        slice: VocabSlice,
    ) -> Tensor<Self, 2> {
        gradient_composition(logits, targets, max, sum_exp, grad_loss, slice)
    }
}

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
pub fn vocab_parallel_cross_entropy_rows<B: CrossEntropyOps>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    slice: VocabSlice,
    tp: &ProcessGroup,
) -> DistResult<Tensor<B, 1>> {
    B::cross_entropy(logits, targets, slice, tp)
}

/// The forward pass on any backend: the losses and the global statistics the backward needs.
struct CrossEntropyForward<B: Backend> {
    losses: Tensor<B, 1>,
    max: Tensor<B, 1>,
    sum_exp: Tensor<B, 1>,
}

fn forward<B: CrossEntropyOps>(
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

/// [`CrossEntropyOps::cross_entropy_statistics`] as a Burn composition.
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

/// [`CrossEntropyOps::cross_entropy_gradient`] as a Burn composition.
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

/// The forward on the inner backend, and one node whose backward calls
/// [`CrossEntropyOps::cross_entropy_gradient`].
impl<B: CrossEntropyOps, C: CheckpointStrategy> CrossEntropyOps for Autodiff<B, C> {
    fn cross_entropy(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        slice: VocabSlice,
        tp: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 1>> {
        let logits = raw(logits);
        let targets: Tensor<B, 1, Int> = Tensor::from_primitive(targets.into_primitive());
        let outcome = forward::<B>(inner(&logits), targets.clone(), slice, tp)?;
        let state = CrossEntropyState::<B> {
            logits: logits.primitive.clone(),
            targets: targets.into_primitive(),
            max: raw(outcome.max),
            sum_exp: raw(outcome.sum_exp),
            slice,
        };
        Ok(wrap(record::<B, C, _>(
            CrossEntropyBackward,
            &[&logits],
            state,
            raw(outcome.losses),
        )))
    }
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

impl<B: CrossEntropyOps> BackwardStep<B> for CrossEntropyBackward {
    type State = CrossEntropyState<B>;

    fn backward(
        self,
        grad_loss: FloatTensor<B>,
        s: CrossEntropyState<B>,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 0), || {
            B::cross_entropy_gradient(
                wrap(s.logits),
                Tensor::from_primitive(s.targets),
                wrap(s.max),
                wrap(s.sum_exp),
                wrap(grad_loss),
                s.slice,
            )
        });
    }
}

/// CubeCL backends: one kernel for the statistics, one for the gradient.
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Int, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::cross_entropy as kernels;

    use super::{CrossEntropyOps, VocabSlice, gradient_composition, statistics_composition};
    use crate::ops::primitive::{raw, wrap};

    fn kernel_slice(slice: VocabSlice) -> kernels::VocabSlice {
        kernels::VocabSlice {
            start: slice.start,
            real: slice.real,
        }
    }

    impl<R, F, I, BT> CrossEntropyOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        /// One kernel (f64 logits: the composition).
        fn cross_entropy_statistics(
            logits: Tensor<Self, 2>,
            targets: Tensor<Self, 1, Int>,
            slice: VocabSlice,
        ) -> [Tensor<Self, 1>; 3] {
            if logits.dtype() == DType::F64 {
                return statistics_composition(logits, targets, slice);
            }
            let stats =
                kernels::row_statistics(raw(logits), targets.into_primitive(), kernel_slice(slice));
            [stats.max, stats.sum_exp, stats.target_logit].map(wrap)
        }

        /// One kernel (f64 logits: the composition).
        fn cross_entropy_gradient(
            logits: Tensor<Self, 2>,
            targets: Tensor<Self, 1, Int>,
            max: Tensor<Self, 1>,
            sum_exp: Tensor<Self, 1>,
            grad_loss: Tensor<Self, 1>,
            slice: VocabSlice,
        ) -> Tensor<Self, 2> {
            if logits.dtype() == DType::F64 {
                return gradient_composition(logits, targets, max, sum_exp, grad_loss, slice);
            }
            let [max, sum_exp, grad_loss] =
                [max, sum_exp, grad_loss].map(|t| raw(t.cast(DType::F32)));
            wrap(kernels::gradient(
                raw(logits),
                targets.into_primitive(),
                max,
                sum_exp,
                grad_loss,
                kernel_slice(slice),
            ))
        }
    }
}
