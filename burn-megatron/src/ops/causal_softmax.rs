//! The attention's scaled, causally masked softmax and its backward as Burn compositions:
//! the reference the fused kernels (`burn_megatron_kernels::fused::causal_softmax`, Megatron's
//! `ScaledUpperTriangMaskedSoftmax`) are tested and benchmarked against.
//!
//! `softmax(scale · scores)` over the keys, query `i` seeing keys `0..=i`, for scores
//! `[batch, heads, seq, seq]`; the backward is `scale · P ∘ (dP - Σ_row dP ∘ P)`, the gradient
//! of the unscaled scores. The model's attention core does not use them yet: a whole GPT step
//! on CUDA disagreed with them wired in (book: "Fused kernels").

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Tensor};

/// The causal softmax as a Burn composition (f32 statistics for narrow dtypes).
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

/// The causal softmax's backward as a Burn composition.
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
