//! Attention of a block of queries against a block of keys and values, by global position,
//! returning the log-sum-exp of each query row; and the merge of two such partial results
//! (online softmax).
//!
//! Context parallelism computes a query's attention in pieces, one piece per key/value block
//! it sees, and combines them: with `lse_j = log Σ_{keys of block j} exp(s)` and `o_j` the
//! block's softmax-weighted values, the attention over all blocks is
//! `o = Σ_j exp(lse_j - lse) o_j` with `lse = log Σ_j exp(lse_j)`.
//!
//! This is a plain Burn composition, differentiable through `Autodiff<B>` including its
//! log-sum-exp (the merge's weights depend on it). The model's flash attention
//! ([`crate::ops::flash_attention`]) returns the log-sum-exp too, but under `Autodiff` that
//! log-sum-exp is not tracked, and its mask is causal on aligned blocks only; a ring built on it
//! needs its own backward node (see the [module docs](super)). Here the `[batch, heads,
//! seq_q, seq_k]` scores of a block pair are materialised, in f32 (f64 for f64 inputs).

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Tensor, TensorData};

use crate::ops::flash_attention::repeat_heads;

/// A partial attention result: `[batch, heads, seq_q, head_dim]` output and its `[batch, heads,
/// seq_q]` log-sum-exp of the scaled scores, both in the working dtype (f32, or f64).
#[derive(Debug, Clone)]
pub struct PartialAttention<B: Backend> {
    /// The attention output over the keys seen so far.
    pub out: Tensor<B, 4>,
    /// `log Σ exp(scale · q kᵀ)` over the keys seen so far, per query row.
    pub lse: Tensor<B, 3>,
}

/// The dtype attention is computed in: f32 for the narrow float dtypes, f64 for f64.
pub fn working_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `softmax(scale · q kᵀ + mask) v` and its log-sum-exp, where query `i` (global position
/// `q_positions[i]`) sees key `j` (global position `k_positions[j]`) iff `k_positions[j] <=
/// q_positions[i]`.
///
/// # Shapes
/// - `q`: `[batch, heads, seq_q, head_dim]`, `k`, `v`: `[batch, kv_heads, seq_k, head_dim]`,
///   `heads` a multiple of `kv_heads` (query head `h` reads key/value head
///   `h / (heads / kv_heads)`);
/// - `q_positions`: `seq_q` values, `k_positions`: `seq_k` values;
/// - returns `out`: `[batch, heads, seq_q, head_dim]`, `lse`: `[batch, heads, seq_q]`, in the
///   [`working_dtype`] of q's.
///
/// Panics if a query sees no key (its softmax would be undefined): callers skip blocks that lie
/// entirely in a query block's future.
pub fn block_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    q_positions: &[usize],
    k_positions: &[usize],
    scale: f64,
) -> PartialAttention<B> {
    let [batch, heads, seq_q, _] = q.dims();
    let seq_k = k.dims()[2];
    assert_eq!(q_positions.len(), seq_q, "one position per query");
    assert_eq!(k_positions.len(), seq_k, "one position per key");
    let wide = working_dtype(q.dtype());
    let [q, k, v] = [q, k, v].map(|t| t.cast(wide));
    let [k, v] = [k, v].map(|t| repeat_heads(t, heads));
    let mut scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    if let Some(future) = future_mask::<B>(q_positions, k_positions, &scores.device()) {
        scores = scores.mask_fill(future.unsqueeze::<4>(), f64::NEG_INFINITY);
    }
    // The row maximum only keeps `exp` in range: the result does not depend on it, so it is
    // detached and its (exactly cancelling) gradient paths are never built.
    let max = scores.clone().max_dim(3).detach();
    let exp = (scores - max.clone()).exp();
    let sum = exp.clone().sum_dim(3);
    let out = (exp / sum.clone()).matmul(v);
    let lse = (max + sum.log()).reshape([batch, heads, seq_q]);
    PartialAttention { out, lse }
}

/// The attention over the union of the keys of `a` and `b` (disjoint key sets, same queries):
/// `lse = log(exp(lse_a) + exp(lse_b))`, `out = exp(lse_a - lse) out_a + exp(lse_b - lse)
/// out_b`. Differentiable in all four inputs.
pub fn merge<B: Backend>(a: PartialAttention<B>, b: PartialAttention<B>) -> PartialAttention<B> {
    // Subtracting the larger log-sum-exp keeps both exponentials at most 1; like the row
    // maximum above, it cancels from the result and is detached.
    let max = a.lse.clone().max_pair(b.lse.clone()).detach();
    let weight_a = (a.lse - max.clone()).exp();
    let weight_b = (b.lse - max.clone()).exp();
    let sum = weight_a.clone() + weight_b.clone();
    let lse = max + sum.clone().log();
    let [weight_a, weight_b] = [weight_a, weight_b].map(|w| (w / sum.clone()).unsqueeze_dim(3));
    PartialAttention {
        out: a.out * weight_a + b.out * weight_b,
        lse,
    }
}

/// `[seq_q, seq_k]`, true where key `j` lies in query `i`'s future; `None` when no key does.
fn future_mask<B: Backend>(
    q_positions: &[usize],
    k_positions: &[usize],
    device: &B::Device,
) -> Option<Tensor<B, 2, Bool>> {
    let mut any = false;
    let mut mask = Vec::with_capacity(q_positions.len() * k_positions.len());
    for (i, &qp) in q_positions.iter().enumerate() {
        let mut sees_one = false;
        for &kp in k_positions {
            let future = kp > qp;
            any |= future;
            sees_one |= !future;
            mask.push(future);
        }
        assert!(
            sees_one,
            "query {i} (position {qp}) sees no key of the block: skip blocks in its future"
        );
    }
    any.then(|| {
        Tensor::from_data(
            TensorData::new(mask, [q_positions.len(), k_positions.len()]),
            device,
        )
    })
}
