//! The attention's scaled, causally masked softmax as one operation with a written-out
//! backward (Megatron's `ScaledUpperTriangMaskedSoftmax`).
//!
//! `softmax(scale · scores)` over the keys, query `i` seeing keys `0..=i`, for scores
//! `[batch, heads, seq, seq]`. `Autodiff<B>` stores only the probabilities (the output) and
//! its backward is [`ModelBackend::causal_softmax_backward`]: `scale · P ∘ (dP - Σ_row dP ∘ P)`,
//! the gradient of the unscaled scores. CubeCL backends run each direction as one kernel.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// [`ModelBackend::causal_softmax`] as a Burn composition (f32 statistics for narrow dtypes).
pub fn forward_composition<B: Backend>(scores: Tensor<B, 4>, scale: f64) -> Tensor<B, 4> {
    let [_, _, seq, keys] = scores.dims();
    let dtype = scores.dtype();
    let wide = match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let future = Tensor::<B, 2, Bool>::tril_mask([seq, keys], 0, &scores.device());
    let scores = scores
        .cast(wide)
        .mul_scalar(scale)
        .mask_fill(future.unsqueeze::<4>(), f64::NEG_INFINITY);
    burn::tensor::activation::softmax(scores, 3).cast(dtype)
}

/// [`ModelBackend::causal_softmax_backward`] as a Burn composition.
pub fn backward_composition<B: Backend>(
    probs: Tensor<B, 4>,
    grad: Tensor<B, 4>,
    scale: f64,
) -> Tensor<B, 4> {
    let dtype = probs.dtype();
    let wide = match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let (probs, grad) = (probs.cast(wide), grad.cast(wide));
    let row = (grad.clone() * probs.clone()).sum_dim(3);
    (probs * (grad - row)).mul_scalar(scale).cast(dtype)
}

/// The `Autodiff<B>` operation: the forward on the inner backend, one node storing the
/// probabilities.
pub(crate) fn autodiff_causal_softmax<B: ModelBackend, C: CheckpointStrategy>(
    scores: Tensor<Autodiff<B, C>, 4>,
    scale: f64,
) -> Tensor<Autodiff<B, C>, 4> {
    let scores = scores.into_primitive().tensor();
    let probs = B::causal_softmax(wrap::<B, 4>(scores.primitive.clone()), scale)
        .into_primitive()
        .tensor();
    let output = match CausalSoftmaxBackward
        .prepare::<C>([scores.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((probs.clone(), scale), probs),
        OpsKind::UnTracked(prep) => prep.finish(probs),
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

#[derive(Debug)]
struct CausalSoftmaxBackward;

impl<B: ModelBackend> Backward<B, 1> for CausalSoftmaxBackward {
    type State = (FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        let Some(parent) = parent else { return };
        let (probs, scale) = ops.state;
        // A workaround, not understood yet: on our CUDA backend the incoming gradient read
        // as is gave wrong gradients upstream in a whole GPT step (on burn-cuda, fusion and
        // lavapipe it did not), while passing it through one element-wise kernel first gave
        // the right ones (book: "Fused kernels", open problem). The pass costs one read and
        // write of `[batch, heads, seq, seq]`.
        let grad = wrap::<B, 4>(grad).mul_scalar(1.0);
        let grad_scores = B::causal_softmax_backward(wrap::<B, 4>(probs), grad, scale);
        grads.register::<B>(parent.id, grad_scores.into_primitive().tensor());
    }
}
