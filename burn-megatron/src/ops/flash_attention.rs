//! Attention as one operation, `softmax(scale · q kᵀ + mask) v`, whose backward recomputes
//! the probabilities instead of storing them (flash attention).
//!
//! `q: [batch, heads, seq_q, head_dim]`, `k, v: [batch, kv_heads, seq_k, head_dim]`, with
//! `heads` a multiple of `kv_heads`: query head `h` reads key/value head
//! `h / (heads / kv_heads)` (grouped-query and multi-query attention), and K/V are passed
//! un-repeated. Causal attention lets query `i` see keys `0..=i` and needs `seq_q == seq_k`.
//!
//! [`ModelBackend::flash_attention`] returns the output and each query row's log-sum-exp
//! (`lse`); `Autodiff<B>` records one node that stores `q`, `k`, `v`, the output and `lse`
//! (memory linear in the sequence) and whose backward is
//! [`ModelBackend::flash_attention_backward`]. CubeCL backends run the kernels of
//! `burn_megatron_kernels::fused::flash_attention`; every other backend runs the Burn
//! compositions here, which materialise the `[batch, heads, seq_q, seq_k]` scores in f32 (f64
//! for f64 inputs).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// `softmax(scale · q kᵀ + mask) v` for `q: [batch, heads, seq_q, head_dim]` and `k, v:
/// [batch, kv_heads, seq_k, head_dim]` (`heads` a multiple of `kv_heads`): the output
/// `[batch, heads, seq_q, head_dim]` in q's dtype. With `causal`, query `i` sees keys
/// `0..=i`.
///
/// Differentiable under `Autodiff<B>` with a backward that stores no `[seq_q, seq_k]`
/// tensor (see the [module](self)). Panics, saying what is wrong, on shapes that do not fit.
pub fn attention<B: ModelBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    causal: bool,
) -> Tensor<B, 4> {
    check_shapes(q.dims(), k.dims(), v.dims(), causal);
    B::flash_attention(q, k, v, scale, causal).0
}

/// Panics with a message naming the shapes unless `q`, `k` and `v` fit the attention.
pub fn check_shapes(q: [usize; 4], k: [usize; 4], v: [usize; 4], causal: bool) {
    assert_eq!(
        k, v,
        "attention: k and v must have one shape [batch, kv_heads, seq_k, head_dim] (got k \
         {k:?}, v {v:?})"
    );
    assert!(
        q[0] == k[0] && q[3] == k[3],
        "attention: q [batch, heads, seq_q, head_dim] = {q:?} and k, v [batch, kv_heads, \
         seq_k, head_dim] = {k:?} must agree in batch and head_dim"
    );
    assert!(
        k[1] > 0 && q[1].is_multiple_of(k[1]),
        "attention: the query heads ({}) must be a multiple of the key/value heads ({})",
        q[1],
        k[1]
    );
    if causal {
        assert_eq!(
            q[2], k[2],
            "causal attention needs as many queries as keys (seq_q {}, seq_k {})",
            q[2], k[2]
        );
    } else {
        assert!(
            k[2] > 0 || q[2] == 0,
            "attention needs at least one key (seq_q {}, seq_k 0)",
            q[2]
        );
    }
}

/// f32 for the narrow float dtypes, f64 for f64.
fn wide(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `[batch, kv_heads, seq, head_dim]` → `[batch, heads, seq, head_dim]`, each key/value head
/// repeated for the query heads of its group (a broadcast view).
fn repeat_heads<B: Backend>(t: Tensor<B, 4>, heads: usize) -> Tensor<B, 4> {
    let [batch, kv_heads, seq, head_dim] = t.dims();
    if kv_heads == heads {
        return t;
    }
    t.unsqueeze_dim::<5>(2)
        .expand([batch, kv_heads, heads / kv_heads, seq, head_dim])
        .reshape([batch, heads, seq, head_dim])
}

/// `[batch, heads, seq, head_dim]` → `[batch, kv_heads, seq, head_dim]`, summed over the
/// query heads of each group (the gradient of [`repeat_heads`]).
fn sum_groups<B: Backend>(t: Tensor<B, 4>, kv_heads: usize) -> Tensor<B, 4> {
    let [batch, heads, seq, head_dim] = t.dims();
    if kv_heads == heads {
        return t;
    }
    t.reshape([batch, kv_heads, heads / kv_heads, seq, head_dim])
        .sum_dim(2)
        .reshape([batch, kv_heads, seq, head_dim])
}

/// `scale · q kᵀ` in `dtype`, with `-inf` where a causal query must not look.
fn scores<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    scale: f64,
    causal: bool,
    dtype: DType,
) -> Tensor<B, 4> {
    let [_, heads, seq_q, _] = q.dims();
    let seq_k = k.dims()[2];
    let k = repeat_heads(k, heads).cast(dtype);
    let scores = q.cast(dtype).matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    if !causal {
        return scores;
    }
    let future = Tensor::<B, 2, Bool>::tril_mask([seq_q, seq_k], 0, &scores.device());
    scores.mask_fill(future.unsqueeze::<4>(), f64::NEG_INFINITY)
}

/// [`ModelBackend::flash_attention`] as a Burn composition: the output (q's dtype) and the
/// log-sum-exp `[batch, heads, seq_q]` (f32; f64 for f64 inputs).
pub fn forward_composition<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    causal: bool,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let (dtype, heads) = (q.dtype(), q.dims()[1]);
    let wide = wide(dtype);
    let scores = scores(q, k, scale, causal, wide);
    let max = scores.clone().max_dim(3);
    let exp = (scores - max.clone()).exp();
    let sum = exp.clone().sum_dim(3);
    let probs = exp / sum.clone();
    let out = probs.matmul(repeat_heads(v, heads).cast(wide)).cast(dtype);
    let lse = (max + sum.log()).squeeze_dim::<3>(3);
    (out, lse)
}

/// [`ModelBackend::flash_attention_backward`] as a Burn composition: with
/// `P = exp(scale · q kᵀ - lse)` and `delta = rowsum(dO ∘ O)`, `dS = P ∘ (dO vᵀ - delta)`,
/// `dq = scale · dS k`, `dk = scale · dSᵀ q`, `dv = Pᵀ dO`, the last two summed over each
/// key/value head's query heads; in q's dtype.
#[allow(clippy::too_many_arguments)]
pub fn backward_composition<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    out: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    grad: Tensor<B, 4>,
    scale: f64,
    causal: bool,
) -> [Tensor<B, 4>; 3] {
    let (dtype, heads, kv_heads) = (q.dtype(), q.dims()[1], k.dims()[1]);
    let wide = wide(dtype);
    let [q, out, grad] = [q, out, grad].map(|t| t.cast(wide));
    let probs = (scores(q.clone(), k.clone(), scale, causal, wide)
        - lse.cast(wide).unsqueeze_dim::<4>(3))
    .exp();
    let delta = (grad.clone() * out).sum_dim(3);
    let [k, v] = [k, v].map(|t| repeat_heads(t, heads).cast(wide));
    let grad_v = probs.clone().swap_dims(2, 3).matmul(grad.clone());
    let grad_scores = probs * (grad.matmul(v.swap_dims(2, 3)) - delta);
    let grad_q = grad_scores.clone().matmul(k).mul_scalar(scale);
    let grad_k = grad_scores.swap_dims(2, 3).matmul(q).mul_scalar(scale);
    [
        grad_q,
        sum_groups(grad_k, kv_heads),
        sum_groups(grad_v, kv_heads),
    ]
    .map(|t| t.cast(dtype))
}

/// The `Autodiff<B>` operation: the forward on the inner backend, one node storing `q`, `k`,
/// `v`, the output and `lse`. The returned `lse` is not tracked.
#[allow(clippy::type_complexity)]
pub(crate) fn autodiff_flash_attention<B: ModelBackend, C: CheckpointStrategy>(
    q: Tensor<Autodiff<B, C>, 4>,
    k: Tensor<Autodiff<B, C>, 4>,
    v: Tensor<Autodiff<B, C>, 4>,
    scale: f64,
    causal: bool,
) -> (Tensor<Autodiff<B, C>, 4>, Tensor<Autodiff<B, C>, 3>) {
    let [q, k, v] = [q, k, v].map(|t| t.into_primitive().tensor());
    let (out, lse) = B::flash_attention(
        wrap::<B, 4>(q.primitive.clone()),
        wrap::<B, 4>(k.primitive.clone()),
        wrap::<B, 4>(v.primitive.clone()),
        scale,
        causal,
    );
    let out = out.into_primitive().tensor();
    let output = match FlashAttentionBackward
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            FlashAttentionState {
                q: q.primitive,
                k: k.primitive,
                v: v.primitive,
                out: out.clone(),
                lse: lse.clone().into_primitive().tensor(),
                scale,
                causal,
            },
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (
        Tensor::from_primitive(TensorPrimitive::Float(output)),
        Tensor::from_inner(lse),
    )
}

/// What the backward of [`autodiff_flash_attention`] keeps from the forward.
#[derive(Debug, Clone)]
struct FlashAttentionState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    scale: f64,
    causal: bool,
}

#[derive(Debug)]
struct FlashAttentionBackward;

impl<B: ModelBackend> Backward<B, 3> for FlashAttentionBackward {
    type State = FlashAttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let gradients = B::flash_attention_backward(
            wrap::<B, 4>(s.q),
            wrap::<B, 4>(s.k),
            wrap::<B, 4>(s.v),
            wrap::<B, 4>(s.out),
            wrap::<B, 3>(s.lse),
            wrap::<B, 4>(grad),
            s.scale,
            s.causal,
        );
        for (parent, gradient) in ops.parents.into_iter().zip(gradients) {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, gradient.into_primitive().tensor());
            }
        }
    }
}
