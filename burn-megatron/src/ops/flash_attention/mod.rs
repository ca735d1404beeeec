//! Attention as one operation, `softmax(scale · q kᵀ + mask) v`, whose backward recomputes
//! the probabilities instead of storing them (flash attention).
//!
//! `q: [batch, heads, seq_q, head_dim]`, `k, v: [batch, kv_heads, seq_k, head_dim]`, with
//! `heads` a multiple of `kv_heads`: query head `h` reads key/value head
//! `h / (heads / kv_heads)` (grouped-query and multi-query attention), and K/V are passed
//! un-repeated. Causal attention lets query `i` see keys `0..=i` and needs `seq_q == seq_k`.
//!
//! [`FlashAttentionOps::flash_attention`] returns the output and each query row's log-sum-exp
//! (`lse`); `Autodiff<B>` records one node that stores `q`, `k`, `v`, the output and `lse`
//! (memory linear in the sequence) and whose backward is
//! [`FlashAttentionOps::flash_attention_backward`]. CubeCL backends run a vendor library where
//! the runtime has one (cuDNN on our CUDA backend) and the kernels of
//! `burn_megatron_kernels::fused::flash_attention` otherwise (`kernels.rs`); every other backend
//! runs the Burn compositions here, which materialise the `[batch, heads, seq_q, seq_k]` scores
//! in f32 (f64 for f64 inputs).

#[cfg(feature = "fused")]
pub mod kernels;

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, Tensor};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::primitive::{raw, wrap};

/// Attention whose backward recomputes the probabilities.
pub trait FlashAttentionOps: Backend {
    /// `softmax(scale · q kᵀ + mask) v` for `q: [batch, heads, seq_q, head_dim]` and `k, v:
    /// [batch, kv_heads, seq_k, head_dim]` (`heads` a multiple of `kv_heads`; query `i` sees
    /// keys `0..=i` when `causal`). Returns the output (q's dtype) and each query row's
    /// log-sum-exp `[batch, heads, seq_q]` (f32; f64 for f64 inputs). `Autodiff<B>` records
    /// one node storing the inputs, the output and `lse` (its `lse` is not tracked), whose
    /// backward is [`flash_attention_backward`](Self::flash_attention_backward).
    fn flash_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        forward_composition(q, k, v, scale, causal)
    }

    /// The gradients `[dq, dk, dv]` of [`flash_attention`](Self::flash_attention)'s output
    /// given its gradient `grad` (`[batch, heads, seq_q, head_dim]`), from the inputs, the
    /// output and `lse`; `dk` and `dv` are summed over the query heads of each key/value head.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        out: Tensor<Self, 4>,
        lse: Tensor<Self, 3>,
        grad: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> [Tensor<Self, 4>; 3] {
        backward_composition(q, k, v, out, lse, grad, scale, causal)
    }
}

/// `softmax(scale · q kᵀ + mask) v` for `q: [batch, heads, seq_q, head_dim]` and `k, v:
/// [batch, kv_heads, seq_k, head_dim]` (`heads` a multiple of `kv_heads`): the output
/// `[batch, heads, seq_q, head_dim]` in q's dtype. With `causal`, query `i` sees keys
/// `0..=i`.
///
/// Differentiable under `Autodiff<B>` with a backward that stores no `[seq_q, seq_k]`
/// tensor (see the [module](self)). Panics, saying what is wrong, on shapes that do not fit.
pub fn attention<B: FlashAttentionOps>(
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
/// repeated for the query heads of its group (a broadcast view; under `Autodiff` the gradient
/// is summed back over each group).
pub(crate) fn repeat_heads<B: Backend>(t: Tensor<B, 4>, heads: usize) -> Tensor<B, 4> {
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

/// [`FlashAttentionOps::flash_attention`] as a Burn composition: the output (q's dtype) and the
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

/// [`FlashAttentionOps::flash_attention_backward`] as a Burn composition: with
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

/// The forward on the inner backend, one node storing `q`, `k`, `v`, the output and `lse`.
/// The returned `lse` is not tracked.
impl<B: FlashAttentionOps, C: CheckpointStrategy> FlashAttentionOps for Autodiff<B, C> {
    fn flash_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        let [q, k, v] = [q, k, v].map(raw);
        let (out, lse) = B::flash_attention(inner(&q), inner(&k), inner(&v), scale, causal);
        let out = raw(out);
        let state = FlashAttentionState {
            q: q.primitive.clone(),
            k: k.primitive.clone(),
            v: v.primitive.clone(),
            out: out.clone(),
            lse: raw(lse.clone()),
            scale,
            causal,
        };
        let out = record::<B, C, _>(FlashAttentionBackward, &[&q, &k, &v], state, out);
        (wrap(out), Tensor::from_inner(lse))
    }
}

/// What the backward keeps from the forward.
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

/// The backward of flash attention, [`FlashAttentionOps::flash_attention_backward`]. Its
/// parents are `[q, k, v]`.
#[derive(Debug)]
struct FlashAttentionBackward;

impl<B: FlashAttentionOps> BackwardStep<B> for FlashAttentionBackward {
    type State = FlashAttentionState<B>;

    fn backward(
        self,
        grad: FloatTensor<B>,
        s: <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let gradients = B::flash_attention_backward(
            wrap(s.q),
            wrap(s.k),
            wrap(s.v),
            wrap(s.out),
            wrap(s.lse),
            wrap(grad),
            s.scale,
            s.causal,
        );
        for (index, gradient) in gradients.into_iter().enumerate() {
            register(grads, parent(parents, index), || gradient);
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::activation::softmax;
    use burn::tensor::{Bool, Int, Tensor, TensorData};
    use burn_megatron_testing::{assert_close, assert_near_zero, tolerance, values};

    use crate::init::{InitDistribution, init_full};

    type AD = Autodiff<NdArray>;

    /// `(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal)`: multi-head, GQA and MQA,
    /// a single position, more keys than queries and the reverse.
    const CASES: [(usize, usize, usize, usize, usize, usize, bool); 6] = [
        (2, 4, 4, 5, 5, 8, true),
        (1, 4, 2, 7, 7, 6, true),
        (2, 4, 1, 3, 9, 5, false),
        (1, 2, 2, 1, 1, 4, true),
        (1, 4, 2, 6, 4, 8, false),
        (1, 3, 1, 4, 4, 7, false),
    ];

    fn normal<B: crate::ops::CounterNormalOps>(
        shape: [usize; 4],
        std: f64,
        seed: u64,
    ) -> Tensor<B, 4> {
        init_full::<B, 4>(
            shape,
            InitDistribution::Normal { std },
            seed,
            &Default::default(),
        )
    }

    /// Plain Burn, differentiated by Burn: `softmax(scale · q kᵀ + mask) v`, each query head
    /// reading its key/value head through `select`.
    fn reference<B: burn::tensor::backend::Backend>(
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<B, 4>, Tensor<B, 3>) {
        let [_, heads, seq_q, _] = q.dims();
        let [_, kv_heads, seq_k, _] = k.dims();
        let device = q.device();
        let of_head: Vec<i64> = (0..heads)
            .map(|h| (h / (heads / kv_heads)) as i64)
            .collect();
        let of_head = Tensor::<B, 1, Int>::from_data(TensorData::new(of_head, [heads]), &device);
        let (k, v) = (k.select(1, of_head.clone()), v.select(1, of_head));
        let mut scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
        if causal {
            let future = Tensor::<B, 2, Bool>::tril_mask([seq_q, seq_k], 0, &device);
            scores = scores.mask_fill(future.unsqueeze::<4>(), f64::NEG_INFINITY);
        }
        let lse = scores.clone().exp().sum_dim(3).log().squeeze_dim::<3>(3);
        (softmax(scores, 3).matmul(v), lse)
    }

    /// The op (through `ModelBackend` on `Autodiff<NdArray>`: the composition forward and the
    /// node's backward) against Burn's autodiff of the plain formula: output, `lse` and the
    /// gradients of q, k and v (K/V gradients summed over each group's query heads).
    #[test]
    fn the_op_and_its_node_match_burns_autodiff_of_the_formula() {
        for (i, &(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal)) in
            CASES.iter().enumerate()
        {
            let scale = 1.0 / (head_dim as f64).sqrt();
            let seed = 10 * i as u64;
            let q_shape = [batch, heads, seq_q, head_dim];
            let kv_shape = [batch, kv_heads, seq_k, head_dim];
            let upstream = normal::<AD>(q_shape, 1.0, seed + 3).detach();
            let run = |ours: bool| {
                let q = normal::<AD>(q_shape, 1.5, seed).require_grad();
                let k = normal::<AD>(kv_shape, 1.5, seed + 1).require_grad();
                let v = normal::<AD>(kv_shape, 1.0, seed + 2).require_grad();
                let out = if ours {
                    super::attention(q.clone(), k.clone(), v.clone(), scale, causal)
                } else {
                    reference(q.clone(), k.clone(), v.clone(), scale, causal).0
                };
                let grads = (out.clone() * upstream.clone()).sum().backward();
                [
                    values(out),
                    values(q.grad(&grads).expect("q has a gradient")),
                    values(k.grad(&grads).expect("k has a gradient")),
                    values(v.grad(&grads).expect("v has a gradient")),
                ]
            };
            let (ours, want) = (run(true), run(false));
            for (name, (a, b)) in ["output", "dq", "dk", "dv"]
                .iter()
                .zip(ours.iter().zip(&want))
            {
                let numel = match *name {
                    "output" | "dq" => q_shape.iter().product::<usize>(),
                    _ => kv_shape.iter().product(),
                };
                assert_eq!((a.len(), b.len()), (numel, numel), "case {i} {name}: sizes");
                if (*name == "dq" || *name == "dk") && seq_k == 1 {
                    // One key: the probabilities are constant, the score gradients zero
                    // (a NaN on either side fails).
                    assert_near_zero(&format!("case {i} {name} (ours)"), a, 1e-6);
                    assert_near_zero(&format!("case {i} {name} (Burn)"), b, 1e-6);
                    continue;
                }
                assert_close(&format!("case {i} {name}"), a, b, tolerance::F32);
            }

            let q = normal::<NdArray>(q_shape, 1.5, seed);
            let k = normal::<NdArray>(kv_shape, 1.5, seed + 1);
            let v = normal::<NdArray>(kv_shape, 1.0, seed + 2);
            let (out, lse) =
                super::forward_composition(q.clone(), k.clone(), v.clone(), scale, causal);
            let (want_out, want_lse) = reference(q, k, v, scale, causal);
            assert_eq!(lse.dims(), [batch, heads, seq_q]);
            assert_close(
                &format!("case {i} lse"),
                &values(lse),
                &values(want_lse),
                tolerance::F32,
            );
            assert_close(
                &format!("case {i} output (inner backend)"),
                &values(out),
                &values(want_out),
                tolerance::F32,
            );
        }
    }

    /// The composition's `lse` is returned untracked, and calls with tracked and untracked
    /// inputs agree.
    #[test]
    fn untracked_inputs_give_the_same_output() {
        let (q_shape, kv_shape) = ([1, 2, 5, 4], [1, 1, 5, 4]);
        let q = normal::<AD>(q_shape, 1.0, 1);
        let k = normal::<AD>(kv_shape, 1.0, 2);
        let v = normal::<AD>(kv_shape, 1.0, 3);
        let plain = super::attention(q.clone(), k.clone(), v.clone(), 0.5, true);
        let tracked = super::attention(q.require_grad(), k, v, 0.5, true);
        assert_close(
            "tracked vs untracked",
            &values(tracked),
            &values(plain),
            tolerance::F32_SAME_ORDER,
        );
    }

    #[test]
    #[should_panic(expected = "causal attention needs as many queries as keys (seq_q 3, seq_k 4)")]
    fn causal_attention_with_unequal_lengths_is_refused() {
        let q = normal::<NdArray>([1, 2, 3, 4], 1.0, 1);
        let k = normal::<NdArray>([1, 2, 4, 4], 1.0, 2);
        super::attention(q, k.clone(), k, 0.5, true);
    }

    #[test]
    #[should_panic(expected = "the query heads (3) must be a multiple of the key/value heads (2)")]
    fn heads_not_a_multiple_of_kv_heads_are_refused() {
        let q = normal::<NdArray>([1, 3, 4, 4], 1.0, 1);
        let k = normal::<NdArray>([1, 2, 4, 4], 1.0, 2);
        super::attention(q, k.clone(), k, 0.5, false);
    }
}
