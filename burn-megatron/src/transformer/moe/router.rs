//! The router: which experts each token goes to, with which weight, and the losses that keep
//! the experts' load balanced (Megatron's `TopKRouter` and `moe_utils` loss functions).

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, backend::Backend};
use burn_megatron_dist::{DistBackend, DistError, DistResult, ProcessGroup};

use crate::backend::ModelBackend;
use crate::error::{DeviceError, read_data};
use crate::ops::norm::statistics_dtype;
use crate::ops::{linear, sigmoid};

/// How the router turns its logits into scores (Megatron's `--moe-router-score-function`).
#[derive(Config, Debug, Copy, PartialEq)]
pub enum RouterScoreFunction {
    /// `softmax` over the experts (Mixtral, Qwen3-MoE, Switch).
    Softmax,
    /// `sigmoid` of each logit on its own (DeepSeek-V3); the load-balancing loss normalises
    /// each token's scores to sum to one first.
    Sigmoid,
}

/// The router's settings, fixed at init.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterSettings {
    /// Scores from logits.
    pub score_function: RouterScoreFunction,
    /// Experts per token, at least 1.
    pub top_k: usize,
    /// Whether each token's `top_k` weights are divided by their sum.
    pub normalize_top_k: bool,
    /// Coefficient of the load-balancing loss.
    pub aux_loss_coeff: f64,
    /// Coefficient of the z-loss.
    pub z_loss_coeff: f64,
}

/// A linear layer from the hidden state to one logit per expert, then top-k.
///
/// The weight is replicated on every rank (expert parallelism splits the experts, not the
/// router); its gradient is the rank's own tokens' contribution, summed over data parallelism
/// like any dense parameter's.
#[derive(Module, Debug)]
pub struct Router<B: Backend> {
    /// `[hidden_size, num_experts]`, drawn from `N(0, init_std²)`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[num_experts]`, zeros at init: DeepSeek-V3's auxiliary-loss-free expert bias, added to
    /// the scores to choose the top-k experts only (the weights stay the unbiased scores),
    /// and updated from the load ([`expert_bias_update`]) rather than trained: no gradient.
    pub expert_bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    settings: RouterSettings,
}

/// Where the router sends a batch of tokens.
#[derive(Debug, Clone)]
pub struct Routing<B: Backend> {
    /// `[tokens, top_k]`: the weight of each token's chosen experts, differentiable with
    /// respect to the router's weight and the input.
    pub weights: Tensor<B, 2>,
    /// `[tokens, top_k]`: each token's chosen experts, best first, on the device (the
    /// dispatcher sorts the tokens by expert there; only the counts come to the host).
    pub experts: Tensor<B, 2, Int>,
    /// `[num_experts]`: how many of the batch's `tokens · top_k` assignments each expert got,
    /// on the device.
    pub tokens_per_expert: Tensor<B, 1, Int>,
    /// `[1]`: the Switch-style load-balancing loss, coefficient included (0 when the
    /// coefficient is 0).
    pub load_balancing_loss: Tensor<B, 1>,
    /// `[1]`: the z-loss, coefficient included (0 when the coefficient is 0).
    pub z_loss: Tensor<B, 1>,
}

impl<B: Backend> Routing<B> {
    /// [`experts`](Self::experts) read to the host, token-major (`t · top_k + j` is token
    /// `t`'s `j`-th choice): for tests and inspection, the layer never reads them.
    pub fn read_experts(&self) -> Result<Vec<usize>, DeviceError> {
        read_indices(self.experts.clone(), || "the router's chosen experts")
    }

    /// [`tokens_per_expert`](Self::tokens_per_expert) read to the host.
    pub fn read_tokens_per_expert(&self) -> Result<Vec<usize>, DeviceError> {
        read_indices(
            self.tokens_per_expert.clone(),
            || "the router's tokens per expert",
        )
    }
}

/// Non-negative integers read to the host.
fn read_indices<B: Backend, const D: usize>(
    tensor: Tensor<B, D, Int>,
    what: fn() -> &'static str,
) -> Result<Vec<usize>, DeviceError> {
    let data = read_data(tensor, || what().to_string())?.convert::<i64>();
    let values = data.to_vec::<i64>().map_err(|e| DeviceError {
        rank: None,
        what: what().to_string(),
        message: format!("{e:?}"),
    })?;
    Ok(values.into_iter().map(|v| v as usize).collect())
}

impl<B: Backend> Router<B> {
    /// A router with the given weight (`[hidden_size, num_experts]`).
    pub fn new(weight: Tensor<B, 2>, settings: RouterSettings) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            expert_bias: None,
            settings,
        }
    }

    /// The same router choosing its experts by the scores plus `bias` (`[num_experts]`).
    pub fn with_expert_bias(self, bias: Tensor<B, 1>) -> Self {
        Self {
            expert_bias: Some(Param::from_tensor(bias).set_require_grad(false)),
            ..self
        }
    }

    /// The router's settings.
    pub fn settings(&self) -> RouterSettings {
        self.settings
    }

    /// Number of experts.
    pub fn num_experts(&self) -> usize {
        self.weight.dims()[1]
    }
}

impl<B: ModelBackend> Router<B> {
    /// Routes `tokens`: scores, the top-k experts of each token (ties go to the lower
    /// expert index) and their weights, and the losses. Nothing is read to the host.
    ///
    /// # Shapes
    /// - tokens: `[tokens, hidden_size]`
    /// - weights in the result: `[tokens, top_k]`; losses: `[1]`
    pub fn route(&self, tokens: Tensor<B, 2>) -> Routing<B> {
        self.route_over(tokens, None)
            .unwrap_or_else(|_| unreachable!("routing without a group communicates nothing"))
    }

    /// [`route`](Self::route) for tokens that are this rank's part of a batch spread over
    /// `sequence` (the context-parallel group): the losses are this rank's share of the
    /// batch's, `n / N` of them with `n` its tokens and `N` the group's, the load-balancing
    /// loss from the load over the whole group (its token counts all-gathered, a host-side
    /// exchange, the router's only read to the host). Summed over the group, they are the
    /// losses of the batch on one rank. Every rank of `sequence` must call it.
    ///
    /// # Shapes
    /// - tokens: `[tokens, hidden_size]`
    /// - weights in the result: `[tokens, top_k]`; losses: `[1]`
    pub fn route_over(
        &self,
        tokens: Tensor<B, 2>,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<Routing<B>> {
        let s = self.settings;
        let num_experts = self.num_experts();
        let [num_tokens, _] = tokens.dims();
        let device = tokens.device();
        let logits = linear(tokens, self.weight.val(), None);
        let scores = match s.score_function {
            RouterScoreFunction::Softmax => softmax(logits.clone(), 1),
            RouterScoreFunction::Sigmoid => sigmoid(logits.clone()),
        };
        let for_choice = match &self.expert_bias {
            Some(bias) => scores.clone().detach() + bias.val().detach().unsqueeze::<2>(),
            None => scores.clone().detach(),
        };
        let chosen = top_k_indices(for_choice, s.top_k);
        let tokens_per_expert = assignment_map(chosen.clone(), num_experts)
            .sum_dim(0)
            .reshape([num_experts]);
        let mut weights = scores.clone().gather(1, chosen.clone());
        if s.normalize_top_k {
            weights = weights.clone() / weights.sum_dim(1);
        }
        let (counts, total) = match sequence.filter(|g| g.size() > 1) {
            Some(group) => {
                let (counts, total) =
                    group_load::<B>(group, tokens_per_expert.clone(), num_tokens, &device)?;
                let counts: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
                let counts = TensorData::new(counts, [1, num_experts]);
                (
                    Tensor::<B, 2>::from_data(counts, (&device, DType::F32)),
                    total,
                )
            }
            None => (
                tokens_per_expert
                    .clone()
                    .cast(FloatDType::F32)
                    .reshape([1, num_experts]),
                num_tokens,
            ),
        };
        let load_balancing_loss = if s.aux_loss_coeff == 0.0 {
            Tensor::zeros([1], &device)
        } else {
            let probs = match s.score_function {
                RouterScoreFunction::Softmax => scores,
                RouterScoreFunction::Sigmoid => scores.clone() / scores.sum_dim(1),
            };
            load_balancing_share(probs, counts, total, s.top_k, s.aux_loss_coeff)
        };
        let z_loss = if s.z_loss_coeff == 0.0 {
            Tensor::zeros([1], &device)
        } else {
            z_loss(logits, s.z_loss_coeff).mul_scalar(num_tokens as f64 / total as f64)
        };
        Ok(Routing {
            weights,
            experts: chosen,
            tokens_per_expert,
            load_balancing_loss,
            z_loss,
        })
    }
}

/// DeepSeek-V3's update of the expert bias from one step's load (Megatron's
/// `get_updated_expert_bias`): `rate · sign(mean − count_e)` for each expert, so that the
/// bias rises for experts below the mean load and falls for those above it (0 at the mean).
/// `tokens_per_expert` are the step's counts over every data-parallel rank.
pub fn expert_bias_update(tokens_per_expert: &[f64], rate: f64) -> Vec<f32> {
    let n = tokens_per_expert.len().max(1) as f64;
    let mean = tokens_per_expert.iter().sum::<f64>() / n;
    tokens_per_expert
        .iter()
        .map(|&c| (rate * (mean - c).signum() * f64::from(u8::from(mean != c))) as f32)
        .collect()
}

/// The Switch Transformer's load-balancing loss as Megatron computes it:
/// `coeff · E · Σ_e f_e · P_e`, with `f_e` the fraction of the `T · k` assignments that went
/// to expert `e` (a constant) and `P_e` the mean probability of `e` over the `T` tokens. It is
/// `coeff` when the load is uniform and rises as it concentrates.
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
    let counts: Vec<f64> = tokens_per_expert.iter().map(|&c| c as f64).collect();
    let counts = TensorData::new(counts, [1, num_experts]);
    let counts = Tensor::<B, 2>::from_data(counts, (device, DType::F32));
    load_balancing_share(probs, counts, num_tokens, top_k, coeff)
}

/// A rank's share of the load-balancing loss of a batch of `total` tokens spread over
/// several ranks: `coeff · E / (N² k) · Σ_e (Σ_t p_te) · c_e`, with the batch's counts
/// `c_e` (`[1, num_experts]`, F32) and this rank's probabilities `p_te`; with `N` this rank's
/// tokens and `c` its counts it is [`load_balancing_loss`].
///
/// Computed in F32 (F64 for F64 `probs`) and returned in `probs`' dtype: in F16,
/// `Σ_t p_te · c_e` overflows past a few hundred tokens (and the scale underflows), which made
/// the loss NaN.
fn load_balancing_share<B: Backend>(
    probs: Tensor<B, 2>,
    counts: Tensor<B, 2>,
    total: usize,
    top_k: usize,
    coeff: f64,
) -> Tensor<B, 1> {
    let [_, num_experts] = probs.dims();
    let dtype = probs.dtype();
    let stat = statistics_dtype(dtype);
    let scale = coeff * num_experts as f64 / (total as f64 * (total * top_k) as f64);
    let per_expert = probs.cast(stat).sum_dim(0);
    (per_expert * counts.cast(stat))
        .sum()
        .mul_scalar(scale)
        .cast(dtype)
}

/// The counts per expert and the tokens of every rank of `group` added up: one all-gather of
/// `[experts + 1]` values, read to the host.
fn group_load<B: DistBackend>(
    group: &ProcessGroup,
    tokens_per_expert: Tensor<B, 1, Int>,
    num_tokens: usize,
    device: &B::Device,
) -> DistResult<(Vec<usize>, usize)> {
    let error = |message: String| DistError::Device {
        rank: group.global_rank(),
        group: group.name().to_string(),
        what: "the router's token counts all-gathered over the context-parallel group".to_string(),
        message,
    };
    let own = Tensor::<B, 1>::from_data(
        TensorData::new(vec![num_tokens as f32], [1]),
        (device, DType::F32),
    );
    // Straight to F32: through the default float dtype (BF16), counts above 256 would round.
    let local = Tensor::cat(vec![tokens_per_expert.cast(FloatDType::F32), own], 0);
    let len = local.dims()[0];
    let all = group.all_gather(local, 0)?;
    let all = all.try_into_data().map_err(|e| error(e.to_string()))?;
    let all = all
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| error(format!("{e:?}")))?;
    let mut sum = vec![0usize; len];
    for chunk in all.chunks(len) {
        for (s, &v) in sum.iter_mut().zip(chunk) {
            *s += v as usize;
        }
    }
    let total = sum.pop().unwrap_or(num_tokens);
    Ok((sum, total))
}

/// The indices of the `k` largest values of each row, largest first, ties to the lower index:
/// `k` arg-max reductions, each masking the one before, so that it runs on the device on
/// every backend (Burn's `topk_with_indices` sorts, which CubeCL does on the host). Each
/// index is clamped to `[0, num_experts)`: CubeCL's arg-max returns `u32::MAX` (`-1` as i32)
/// for a row without a largest value (NaN scores), and the indices address buffers.
///
/// # Shapes
/// - scores: `[tokens, num_experts]`
/// - output: `[tokens, k]`
fn top_k_indices<B: Backend>(mut scores: Tensor<B, 2>, k: usize) -> Tensor<B, 2, Int> {
    let [tokens, experts] = scores.dims();
    let columns = Tensor::<B, 1, Int>::arange(0..experts as i64, &scores.device())
        .reshape([1, experts])
        .expand([tokens, experts]);
    let mut chosen = Vec::with_capacity(k);
    for j in 0..k {
        let best = scores.clone().argmax(1).clamp(0, experts as i64 - 1);
        if j + 1 < k {
            let taken = columns
                .clone()
                .equal(best.clone().expand([tokens, experts]));
            scores = scores.mask_fill(taken, f32::NEG_INFINITY);
        }
        chosen.push(best);
    }
    Tensor::cat(chosen, 1)
}

/// Megatron's routing map: `[assignments, num_experts]`, 1 where assignment `a` (token-major,
/// `t · top_k + j`) goes to expert `e`, else 0.
///
/// # Shapes
/// - experts: `[tokens, top_k]`
/// - output: `[tokens · top_k, num_experts]`
pub(crate) fn assignment_map<B: Backend>(
    experts: Tensor<B, 2, Int>,
    num_experts: usize,
) -> Tensor<B, 2, Int> {
    let [tokens, top_k] = experts.dims();
    let shape = [tokens * top_k, num_experts];
    let columns = Tensor::<B, 1, Int>::arange(0..num_experts as i64, &experts.device())
        .reshape([1, num_experts])
        .expand(shape);
    experts
        .reshape([tokens * top_k, 1])
        .expand(shape)
        .equal(columns)
        .int()
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
