//! The router's auxiliary losses (Megatron's `moe_utils` loss functions): the Switch-style
//! load-balancing loss, DeepSeek's sequence-level one and the z-loss. [`super::losses`] sums
//! what the layers of a forward pass add.

use burn::tensor::{DType, Tensor, TensorData, backend::Backend};

use crate::ops::norm::statistics_dtype;

/// The Switch Transformer's load-balancing loss as Megatron computes it
/// (`--moe-router-load-balancing-type aux_loss`): `coeff · E · Σ_e f_e · P_e`, with `f_e`
/// the fraction of the `T · k` assignments that went to expert `e` (a constant) and `P_e` the
/// mean probability of `e` over the `T` tokens. It is `coeff` when the load is uniform and
/// rises as it concentrates.
///
/// # Shapes
/// - probs: `[tokens, num_experts]`, each row summing to 1
/// - output: `[1]`
pub fn load_balancing_loss<B: Backend>(
    probs: Tensor<B, 2>,
    tokens_per_expert: &[usize],
    top_k: usize,
    coeff: f64,
    device: &B::Device,
) -> Tensor<B, 1> {
    let [num_tokens, num_experts] = probs.dims();
    let counts = counts_tensor::<B>(tokens_per_expert, 1, num_experts, device);
    load_balancing_share(probs, counts, num_tokens, top_k, coeff)
}

/// DeepSeek-V2/V3's sequence-wise balance loss as Megatron computes it
/// (`--moe-router-load-balancing-type seq_aux_loss`): the
/// [`load_balancing_loss`] of each sequence on its own, its `f_e` and `P_e` over the `S`
/// tokens of that sequence, averaged over the `B` sequences:
/// `coeff / B · Σ_b E · Σ_e f_be · P_be`. Each sequence is pushed toward a balanced load, not
/// only the batch. With one sequence it is [`load_balancing_loss`].
///
/// # Shapes
/// - probs: `[batch, seq, num_experts]`, each row summing to 1
/// - tokens_per_expert: `batch · num_experts` counts, sequence-major (how many of sequence
///   `b`'s `seq · top_k` assignments went to expert `e` at `b · num_experts + e`)
/// - output: `[1]`
pub fn sequence_load_balancing_loss<B: Backend>(
    probs: Tensor<B, 3>,
    tokens_per_expert: &[usize],
    top_k: usize,
    coeff: f64,
    device: &B::Device,
) -> Tensor<B, 1> {
    let [batch, seq, num_experts] = probs.dims();
    let counts = counts_tensor::<B>(tokens_per_expert, batch, num_experts, device);
    let probs = probs.reshape([batch * seq, num_experts]);
    load_balancing_share(probs, counts, seq, top_k, coeff)
}

/// `[batch, num_experts]` F32 counts from the host.
fn counts_tensor<B: Backend>(
    counts: &[usize],
    batch: usize,
    num_experts: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let counts: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
    let counts = TensorData::new(counts, [batch, num_experts]);
    Tensor::<B, 2>::from_data(counts, (device, DType::F32))
}

/// A rank's share of the load-balancing loss of `B` sequences of `S` tokens each (`B = 1`
/// for the Switch-style loss over the whole batch) whose tokens are spread over several
/// ranks: `coeff · E / (B S² k) · Σ_b Σ_e (Σ_t p_bte) · c_be`, with the counts `c_be` over
/// every rank (`[B, num_experts]`, F32) and this rank's probabilities `p_bte` (its
/// `[B · s, num_experts]` tokens, sequence-major, `s ≤ S` of each sequence). The loss is
/// linear in the probabilities, so the ranks' shares add up to the loss of one rank holding
/// every token.
///
/// Computed in F32 (F64 for F64 `probs`) and returned in `probs`' dtype: in F16,
/// `Σ_t p_te · c_e` overflows past a few hundred tokens (and the scale underflows), which made
/// the loss NaN.
pub(super) fn load_balancing_share<B: Backend>(
    probs: Tensor<B, 2>,
    counts: Tensor<B, 2>,
    sequence_length: usize,
    top_k: usize,
    coeff: f64,
) -> Tensor<B, 1> {
    let [tokens, num_experts] = probs.dims();
    let [batch, _] = counts.dims();
    let dtype = probs.dtype();
    let stat = statistics_dtype(dtype);
    let s = sequence_length as f64;
    let scale = coeff * num_experts as f64 / (batch as f64 * s * s * top_k as f64);
    let per_expert = probs
        .cast(stat)
        .reshape([batch, tokens / batch, num_experts])
        .sum_dim(1)
        .reshape([1, batch * num_experts]);
    // The scale goes on the counts (constants), and the sum is one reduction.
    let counts = counts
        .cast(stat)
        .mul_scalar(scale)
        .reshape([1, batch * num_experts]);
    (per_expert * counts).sum_dim(1).reshape([1]).cast(dtype)
}

/// The z-loss of ST-MoE: `coeff · mean_t (log Σ_e exp(logit_te))²`, which keeps the logits
/// small. The log-sum-exp subtracts each row's maximum (held constant) first.
///
/// # Shapes
/// - logits: `[tokens, num_experts]`
/// - output: `[1]`
pub fn z_loss<B: Backend>(logits: Tensor<B, 2>, coeff: f64) -> Tensor<B, 1> {
    let max = logits.clone().detach().max_dim(1);
    let log_sum_exp = (logits - max.clone()).exp().sum_dim(1).log() + max;
    log_sum_exp.powi_scalar(2).mean().mul_scalar(coeff)
}
