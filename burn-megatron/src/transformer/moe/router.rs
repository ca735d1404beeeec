//! The router: which experts each token goes to, with which weight, and the losses that keep
//! the experts' load balanced (Megatron's `TopKRouter` and `topk_routing_with_score_function`;
//! the loss functions are in [`losses`](super::losses)).
//!
//! Megatron's order, which this file follows:
//!
//! 1. logits `x W`; scores: softmax over all experts or the sigmoid of each logit;
//! 2. the choice: the top-k of the logits (softmax, the default), of the softmax scores
//!    (`--moe-router-pre-softmax`) or of the sigmoid scores, plus the expert bias if any;
//!    with group-limited routing (`--moe-router-num-groups`, `--moe-router-group-topk`) only
//!    among the experts of each token's best groups;
//! 3. the weights: a softmax over the k chosen logits (so they sum to 1), the chosen softmax
//!    scores as they are (pre-softmax), or the chosen sigmoid scores divided by their sum
//!    (`k > 1`); then multiplied by `--moe-router-topk-scaling-factor`.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, backend::Backend};
use burn_megatron_dist::{DistBackend, DistError, DistResult, ProcessGroup, ReduceOp};

use super::aux_losses::{load_balancing_share, z_loss};
use super::jitter::JitterSite;
use super::sinkhorn::sinkhorn;
use crate::backend::ModelBackend;
use crate::error::{ConfigError, DeviceError, read_data};
use crate::ops::{TopKOps, linear, sigmoid, top_k_indices};

/// How the router turns its logits into scores (Megatron's `--moe-router-score-function`).
#[derive(Config, Debug, Copy, PartialEq)]
pub enum RouterScoreFunction {
    /// `softmax` over the experts (Mixtral, Qwen3-MoE, Switch).
    Softmax,
    /// `sigmoid` of each logit on its own (DeepSeek-V3); the load-balancing loss normalises
    /// each token's scores to sum to one first.
    Sigmoid,
}

/// How the router balances the experts' load (Megatron's `--moe-router-load-balancing-type`):
/// by a loss, or by Sinkhorn's normalisation of its choice.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum LoadBalancingType {
    /// `aux_loss`: Switch Transformer's, over all of the rank's tokens (Megatron's default).
    AuxLoss,
    /// `seq_aux_loss`: DeepSeek-V2/V3's sequence-wise loss, Switch's loss of each sequence on
    /// its own, averaged over the sequences.
    SeqAuxLoss,
    /// `global_aux_loss`: Switch's loss with the load counted over the whole global batch so
    /// far: each micro-batch's counts summed over every DP × CP rank (the router's
    /// [`with_global_load_group`](Router::with_global_load_group)) and averaged over the
    /// optimizer step's micro-batches up to this one (Megatron's `global_tokens_per_expert /
    /// ga_steps`), the probabilities this micro-batch's. The running load starts afresh each
    /// optimizer step ([`Router::reset_global_load`]).
    GlobalAuxLoss,
    /// `none`: no load-balancing loss, whatever `--moe-aux-loss-coeff` says.
    None,
    /// `sinkhorn`: in training, the top-k of the logits balanced by
    /// [`sinkhorn`] (no loss: `--moe-aux-loss-coeff` must be 0); in
    /// evaluation, the top-k of the weights. The weights are the sigmoid of the chosen logit
    /// (top-1) or the softmax over all experts at the chosen ones (top-k), as in Megatron.
    Sinkhorn,
}

impl LoadBalancingType {
    /// Megatron's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::AuxLoss => "aux_loss",
            Self::SeqAuxLoss => "seq_aux_loss",
            Self::GlobalAuxLoss => "global_aux_loss",
            Self::None => "none",
            Self::Sinkhorn => "sinkhorn",
        }
    }

    /// Whether the type is a loss (`aux_loss`, `seq_aux_loss`, `global_aux_loss`): the types
    /// a list may combine.
    pub fn is_loss(self) -> bool {
        matches!(self, Self::AuxLoss | Self::SeqAuxLoss | Self::GlobalAuxLoss)
    }
}

/// A load-balancing loss added to the first one, with its own coefficient: Megatron's lists,
/// `--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2 1e-4`
/// (the first type and coefficient are the settings' own, the rest are these terms).
#[derive(Config, Debug, Copy, PartialEq)]
pub struct AuxLossTerm {
    /// `aux_loss`, `seq_aux_loss` or `global_aux_loss`, each at most once in a list.
    pub load_balancing_type: LoadBalancingType,
    /// The loss's coefficient.
    pub coeff: f64,
}

/// The types and coefficients of a list of load-balancing losses (the first type and
/// coefficient, then `more`) checked: a list of two or more holds losses only, each once, and
/// every coefficient is finite and not negative. Names the options in the message.
pub fn check_load_balancing_list(
    first: LoadBalancingType,
    first_coeff: f64,
    more: &[AuxLossTerm],
) -> Result<(), ConfigError> {
    let invalid = |message: String| Err(ConfigError::Invalid(message));
    let all: Vec<(LoadBalancingType, f64)> = std::iter::once((first, first_coeff))
        .chain(more.iter().map(|t| (t.load_balancing_type, t.coeff)))
        .collect();
    for (i, (kind, coeff)) in all.iter().enumerate() {
        if !(coeff.is_finite() && *coeff >= 0.0) {
            return invalid(format!(
                "--moe-aux-loss-coeff is {coeff} for {}: it must be finite and not negative",
                kind.name()
            ));
        }
        if all.len() > 1 && !kind.is_loss() {
            return invalid(format!(
                "--moe-router-load-balancing-type lists {}: a list combines losses only \
                 (aux_loss, seq_aux_loss, global_aux_loss); give sinkhorn or none alone",
                kind.name()
            ));
        }
        if all[..i].iter().any(|(k, _)| k == kind) {
            return invalid(format!(
                "--moe-router-load-balancing-type lists {} twice: each loss at most once",
                kind.name()
            ));
        }
    }
    Ok(())
}

/// The dtype the router computes in (Megatron's `--moe-router-dtype`), whatever the model's:
/// its logits, scores, choice, weights and losses, for stability in a bf16 model. The weights
/// return to the model's dtype for the combine.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum RouterDtype {
    /// `fp32`.
    Fp32,
    /// `fp64`.
    Fp64,
}

impl RouterDtype {
    /// Megatron's names, `fp32` or `fp64`.
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        match name.to_ascii_lowercase().as_str() {
            "fp32" => Ok(Self::Fp32),
            "fp64" => Ok(Self::Fp64),
            _ => Err(ConfigError::Invalid(format!(
                "--moe-router-dtype {name:?}: use fp32 or fp64 (or leave it out for the \
                 model's dtype)"
            ))),
        }
    }

    /// The Burn dtype.
    pub fn float(self) -> FloatDType {
        match self {
            Self::Fp32 => FloatDType::F32,
            Self::Fp64 => FloatDType::F64,
        }
    }
}

/// The router's settings, fixed at init. The default is Megatron's: softmax, top-2, no
/// groups, no scaling, the Switch-style loss with coefficients 0, no jitter.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterSettings {
    /// Scores from logits.
    pub score_function: RouterScoreFunction,
    /// Experts per token, at least 1.
    pub top_k: usize,
    /// Softmax scores: the top-k of the softmax over all experts, its values the weights
    /// (`--moe-router-pre-softmax`), instead of a softmax over the top-k logits. Sigmoid
    /// scores ignore it, as in Megatron.
    pub pre_softmax: bool,
    /// Whether each token's `top_k` weights are divided by their sum (Hugging Face's
    /// `norm_topk_prob`): a no-op where Megatron's weights already sum to 1 (softmax without
    /// pre-softmax, sigmoid with `top_k > 1`).
    pub normalize_top_k: bool,
    /// Groups the experts are split into for group-limited routing
    /// (`--moe-router-num-groups`), `None` for none.
    pub num_groups: Option<usize>,
    /// Groups each token may choose from (`--moe-router-group-topk`): the groups whose top
    /// `top_k / group_top_k` scores sum highest.
    pub group_top_k: Option<usize>,
    /// Factor of the top-k weights (`--moe-router-topk-scaling-factor`), `None` for 1.
    pub scaling_factor: Option<f64>,
    /// Which load-balancing loss (the first of a list).
    pub load_balancing: LoadBalancingType,
    /// Coefficient of the load-balancing loss.
    pub aux_loss_coeff: f64,
    /// The losses a list adds to the first, each with its coefficient (empty: one type).
    /// The router's `load_balancing_loss` is the sum of all of them.
    pub more_aux_losses: Vec<AuxLossTerm>,
    /// Coefficient of the z-loss.
    pub z_loss_coeff: f64,
    /// The dtype the router computes in; `None`: the model's.
    pub dtype: Option<RouterDtype>,
    /// Route by [`balancing_logits`] instead of the logits (Megatron's
    /// `--moe-router-force-load-balancing`, for benchmarks): an even load whatever the
    /// router has learned. The z-loss still comes from the logits. A 16-bit model's router
    /// then computes in f32 (unless `dtype` says otherwise), so that the values do not tie.
    pub force_load_balancing: bool,
    /// Switch Transformer's input jitter (`--moe-input-jitter-eps`): in training, the
    /// router's input (not the experts') multiplied by factors uniform in `(1 − ε, 1 + ε)`,
    /// drawn from the tokens' global coordinates ([`JitterSite`]), constants to the gradient;
    /// `None` for none.
    pub input_jitter_eps: Option<f64>,
}

impl Default for RouterSettings {
    fn default() -> Self {
        Self {
            score_function: RouterScoreFunction::Softmax,
            top_k: 2,
            pre_softmax: false,
            normalize_top_k: false,
            num_groups: None,
            group_top_k: None,
            scaling_factor: None,
            load_balancing: LoadBalancingType::AuxLoss,
            aux_loss_coeff: 0.0,
            more_aux_losses: Vec::new(),
            z_loss_coeff: 0.0,
            dtype: None,
            force_load_balancing: false,
            input_jitter_eps: None,
        }
    }
}

impl RouterSettings {
    /// Checks the routing options against each other and `num_experts` (Megatron's checks of
    /// `TransformerConfig`): softmax top-1 needs pre-softmax (a softmax over one logit is 1,
    /// and the router would learn nothing from the output); group-limited routing needs both
    /// group options, groups that split the experts evenly, `1 ≤ group_top_k ≤ num_groups`
    /// and `group_top_k ≤ top_k ≤ group_top_k · experts per group`; the scaling factor
    /// finite and above 0. `top_k` itself is checked with the sizes
    /// ([`check_expert_sizes`](super::settings::check_expert_sizes)).
    pub fn validate(&self, num_experts: usize) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        let top_k = self.top_k;
        check_load_balancing_list(
            self.load_balancing,
            self.aux_loss_coeff,
            &self.more_aux_losses,
        )?;
        if let Some(eps) = self.input_jitter_eps
            && !(eps.is_finite() && (0.0..1.0).contains(&eps))
        {
            return invalid(format!(
                "--moe-input-jitter-eps is {eps}: it must be at least 0 and below 1 (the \
                 router's input is multiplied by factors in [1 - eps, 1 + eps))"
            ));
        }
        if self.load_balancing == LoadBalancingType::Sinkhorn {
            return self.validate_sinkhorn();
        }
        if top_k == 1 && self.score_function == RouterScoreFunction::Softmax && !self.pre_softmax {
            return invalid(
                "MoE top_k 1 with softmax scores needs pre_softmax (--moe-router-pre-softmax): \
                 a softmax over the one chosen logit is always 1, so the router would get no \
                 gradient from the output"
                    .into(),
            );
        }
        match (self.num_groups, self.group_top_k) {
            (None, None) => {}
            (Some(groups), None) => {
                return invalid(format!(
                    "num_groups ({groups}, --moe-router-num-groups) takes effect with \
                     group_top_k (--moe-router-group-topk): set both or neither"
                ));
            }
            (None, Some(group_top_k)) => {
                return invalid(format!(
                    "group_top_k ({group_top_k}, --moe-router-group-topk) needs num_groups \
                     (--moe-router-num-groups): the groups the experts are split into"
                ));
            }
            (Some(groups), Some(group_top_k)) => {
                if groups == 0 || !num_experts.is_multiple_of(groups) {
                    let valid: Vec<String> = (1..=num_experts)
                        .filter(|d| num_experts.is_multiple_of(*d))
                        .map(|d| d.to_string())
                        .collect();
                    return invalid(format!(
                        "num_groups ({groups}, --moe-router-num-groups) must divide num_experts \
                         ({num_experts}): valid group counts are {}",
                        valid.join(", ")
                    ));
                }
                if group_top_k == 0 || group_top_k > groups {
                    return invalid(format!(
                        "group_top_k ({group_top_k}, --moe-router-group-topk) must be between 1 \
                         and num_groups ({groups})"
                    ));
                }
                let eligible = group_top_k * (num_experts / groups);
                if top_k > eligible {
                    return invalid(format!(
                        "top_k ({top_k}) is more than the {eligible} experts of the \
                         {group_top_k} groups a token may choose ({} experts a group): raise \
                         --moe-router-group-topk or lower --moe-router-topk",
                        num_experts / groups
                    ));
                }
                if group_top_k > top_k {
                    return invalid(format!(
                        "group_top_k ({group_top_k}, --moe-router-group-topk) must not exceed \
                         top_k ({top_k}): a group's score sums its top top_k / group_top_k \
                         experts' scores"
                    ));
                }
            }
        }
        if let Some(factor) = self.scaling_factor
            && !(factor.is_finite() && factor > 0.0)
        {
            return invalid(format!(
                "the top-k scaling factor (--moe-router-topk-scaling-factor) is {factor}: it \
                 must be finite and above 0"
            ));
        }
        Ok(())
    }

    /// The dtype the router computes in for a model of `model_dtype`, `None` for the model's:
    /// [`dtype`](Self::dtype) if set; else f32 for a 16-bit model under
    /// [`force_load_balancing`](Self::force_load_balancing), whose hashed values in
    /// `[0, 1)` would take a few dozen 16-bit values after a sigmoid and tie (ties go to the
    /// lower expert: loads from 0.09 to 3.56 times the mean on an H200 in bf16).
    pub fn compute_dtype(&self, model_dtype: DType) -> Option<FloatDType> {
        let sixteen_bits = matches!(model_dtype, DType::BF16 | DType::F16);
        match self.dtype {
            Some(dtype) => Some(dtype.float()),
            None if self.force_load_balancing && sixteen_bits => Some(FloatDType::F32),
            None => None,
        }
    }

    /// The load-balancing losses the router adds, each with its coefficient: the first type
    /// and the list's others, those with a coefficient of 0 (and `none`, `sinkhorn`) left out.
    pub fn loss_terms(&self) -> Vec<(LoadBalancingType, f64)> {
        std::iter::once((self.load_balancing, self.aux_loss_coeff))
            .chain(
                self.more_aux_losses
                    .iter()
                    .map(|t| (t.load_balancing_type, t.coeff)),
            )
            .filter(|(kind, coeff)| kind.is_loss() && *coeff != 0.0)
            .collect()
    }

    /// Sinkhorn balancing has its own weights and no loss: Megatron refuses an auxiliary
    /// loss with it and ignores the options that shape the other routings' choice and weights.
    /// Here those options are refused, so that none is silently ignored.
    fn validate_sinkhorn(&self) -> Result<(), ConfigError> {
        let ignored = [
            (self.aux_loss_coeff != 0.0, "--moe-aux-loss-coeff above 0"),
            (
                self.score_function == RouterScoreFunction::Sigmoid,
                "--moe-router-score-function sigmoid",
            ),
            (self.pre_softmax, "--moe-router-pre-softmax"),
            (self.normalize_top_k, "--moe-router-topk-normalize"),
            (
                self.num_groups.is_some() || self.group_top_k.is_some(),
                "--moe-router-num-groups and --moe-router-group-topk",
            ),
            (
                self.scaling_factor.is_some(),
                "--moe-router-topk-scaling-factor",
            ),
        ];
        match ignored.iter().find(|(set, _)| *set) {
            Some((_, option)) => Err(ConfigError::Invalid(format!(
                "--moe-router-load-balancing-type sinkhorn does not take {option}: Sinkhorn \
                 balancing adds no loss, and its weights are the sigmoid of the chosen logit \
                 (top-1) or the softmax over all experts (top-k)"
            ))),
            None => Ok(()),
        }
    }
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
    /// `global_aux_loss`'s group and running load (shared by the router's clones).
    #[module(skip)]
    global_load: GlobalLoad,
    /// The calls that drew input jitter without a [`JitterSite`]: their seeds.
    #[module(skip)]
    jitter_calls: Arc<AtomicU64>,
}

/// `global_aux_loss`'s load: the group its counts are summed over (DP × CP) and their running
/// sum over the optimizer step's micro-batches. Kept behind a lock because the forward pass
/// has the module only by reference; a clone of the router (its `valid()` copy, a pipeline
/// schedule's) shares it.
#[derive(Clone, Default)]
struct GlobalLoad {
    group: Option<ProcessGroup>,
    sum: Arc<Mutex<Option<LoadSum>>>,
}

/// The sum of the step's counts so far (a `[num_experts]` F32 tensor of the routing backend,
/// boxed: the state is not generic over where the router runs) and how many micro-batches.
type LoadSum = (Box<dyn Any + Send>, usize);

impl fmt::Debug for GlobalLoad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GlobalLoad")
            .field("group", &self.group.as_ref().map(|g| g.ranks().to_vec()))
            .finish_non_exhaustive()
    }
}

impl GlobalLoad {
    /// `counts` added to the running sum; the mean of the step's counts so far.
    fn add<B: Backend>(&self, counts: Tensor<B, 1>) -> Tensor<B, 1> {
        let mut sum = self.sum.lock().unwrap_or_else(PoisonError::into_inner);
        let before = sum
            .take()
            .and_then(|(t, n)| t.downcast::<Tensor<B, 1>>().ok().map(|t| (*t, n)));
        let (total, steps) = match before {
            Some((total, n)) => (total + counts, n + 1),
            None => (counts, 1),
        };
        *sum = Some((Box::new(total.clone()), steps));
        total.div_scalar(steps as f64)
    }
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
    /// `[tokens, num_experts]`: 1 where a token chose an expert, else 0 (Megatron's
    /// `routing_map`), on the device: the dispatcher sorts the tokens by expert from it.
    pub routing_map: Tensor<B, 2, Int>,
    /// `[1]`: the load-balancing loss, coefficient included (0 when the coefficient is 0);
    /// the sum of a list's losses.
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
            global_load: GlobalLoad::default(),
            jitter_calls: Arc::default(),
        }
    }

    /// The same router counting `global_aux_loss`'s load over `group`, every DP × CP rank of
    /// its pipeline stage and tensor-parallel rank (`ParallelState::dp_cp`); without one, over
    /// the context-parallel group a forward pass names. It must contain that group.
    pub fn with_global_load_group(self, group: Option<ProcessGroup>) -> Self {
        Self {
            global_load: GlobalLoad {
                group,
                ..self.global_load
            },
            ..self
        }
    }

    /// Starts `global_aux_loss`'s running load afresh: before each optimizer step's first
    /// micro-batch (the training loops call it through
    /// [`GptModel::reset_global_load`](crate::models::GptModel::reset_global_load)).
    pub fn reset_global_load(&self) {
        *self
            .global_load
            .sum
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The same router choosing its experts by the scores plus `bias` (`[num_experts]`).
    pub fn with_expert_bias(self, bias: Tensor<B, 1>) -> Self {
        Self {
            expert_bias: Some(Param::from_tensor(bias).set_require_grad(false)),
            ..self
        }
    }

    /// The router's settings.
    pub fn settings(&self) -> &RouterSettings {
        &self.settings
    }

    /// Number of experts.
    pub fn num_experts(&self) -> usize {
        self.weight.dims()[1]
    }
}

impl<B: ModelBackend> Router<B> {
    /// Routes `tokens`: scores, the top-k experts of each token (ties go to the lower
    /// expert index) and their weights, and the losses. Nothing is read to the host. The
    /// tokens are one sequence for the sequence-level loss.
    ///
    /// # Shapes
    /// - tokens: `[tokens, hidden_size]`
    /// - weights in the result: `[tokens, top_k]`; losses: `[1]`
    pub fn route(&self, tokens: Tensor<B, 2>) -> Routing<B> {
        self.route_over(tokens, None)
            .unwrap_or_else(|_| unreachable!("routing without a group communicates nothing"))
    }

    /// [`route`](Self::route) for tokens that are this rank's part of a batch spread over
    /// `sequence` (the context-parallel group), the tokens one sequence:
    /// [`route_sequences_over`](Self::route_sequences_over) with one sequence.
    pub fn route_over(
        &self,
        tokens: Tensor<B, 2>,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<Routing<B>> {
        self.route_sequences_over(tokens, 1, sequence)
    }

    /// [`route`](Self::route) for `batch` sequences of equal length, laid out batch-major
    /// (`[batch, seq, hidden]` flattened), that are this rank's part of a batch spread over
    /// `sequence` (the context-parallel group). The losses are this rank's share of the
    /// batch's: the z-loss `n / N` of it with `n` its tokens and `N` the group's, the
    /// load-balancing loss from the load over the whole group (its token counts, per sequence
    /// for `seq_aux_loss`, all-gathered: a host-side exchange, the router's only read to the
    /// host). Summed over the group, they are the losses of the batch on one rank. Every rank
    /// of `sequence` must call it.
    ///
    /// # Shapes
    /// - tokens: `[batch · seq, hidden_size]`
    /// - weights in the result: `[batch · seq, top_k]`; losses: `[1]`
    ///
    /// # Panics
    /// If `batch` is 0 or does not divide the tokens.
    pub fn route_sequences_over(
        &self,
        tokens: Tensor<B, 2>,
        batch: usize,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<Routing<B>> {
        self.route_at(tokens, batch, sequence, None)
    }

    /// [`route_sequences_over`](Self::route_sequences_over) with the input jitter drawn at
    /// `jitter`, the tokens' place in the global batch. Without one, a router with
    /// [`input_jitter_eps`](RouterSettings::input_jitter_eps) draws at the tokens' local
    /// coordinates from a seed that counts its calls (so each call draws afresh, but layouts
    /// and recomputation do not see the same draws).
    pub fn route_at(
        &self,
        tokens: Tensor<B, 2>,
        batch: usize,
        sequence: Option<&ProcessGroup>,
        jitter: Option<&JitterSite>,
    ) -> DistResult<Routing<B>> {
        let s = &self.settings;
        let num_experts = self.num_experts();
        let [num_tokens, _] = tokens.dims();
        assert!(
            batch > 0 && num_tokens.is_multiple_of(batch),
            "{num_tokens} tokens are not {batch} sequences of equal length"
        );
        let device = tokens.device();
        let model_dtype = tokens.dtype();
        let compute = s.compute_dtype(model_dtype);
        let (tokens, weight) = match compute {
            Some(dtype) => (tokens.cast(dtype), self.weight.val().cast(dtype)),
            None => (tokens, self.weight.val()),
        };
        let tokens = match s.input_jitter_eps {
            Some(eps) if eps > 0.0 && B::ad_enabled(&device) => {
                let hidden = tokens.dims()[1];
                let site = match jitter {
                    Some(site) => site.clone(),
                    None => JitterSite::whole_sequence(
                        self.jitter_calls.fetch_add(1, Ordering::Relaxed),
                        num_tokens / batch,
                    ),
                };
                let factors = site.factors::<B>(eps, batch, hidden, &device);
                tokens.clone() * factors.cast(tokens.dtype())
            }
            _ => tokens,
        };
        let logits = linear(tokens, weight, None);
        let z_loss = if s.z_loss_coeff == 0.0 {
            Tensor::zeros([1], &device)
        } else {
            // This rank's `n / N` share: context parallelism splits every sequence evenly.
            let ranks = sequence.map_or(1, ProcessGroup::size);
            z_loss(logits.clone(), s.z_loss_coeff).div_scalar(ranks as f64)
        };
        let logits = match s.force_load_balancing {
            // Their values, the logits' gradient (a straight-through estimator, as Megatron's).
            true => logits.clone() - logits.clone().detach() + balancing_logits(logits.clone()),
            false => logits,
        };
        if s.load_balancing == LoadBalancingType::Sinkhorn {
            return self.route_sinkhorn(logits, model_dtype, z_loss, sequence);
        }
        let scores = match s.score_function {
            RouterScoreFunction::Softmax => softmax(logits.clone(), 1),
            RouterScoreFunction::Sigmoid => sigmoid(logits.clone()),
        };
        let softmax_after_top_k =
            s.score_function == RouterScoreFunction::Softmax && !s.pre_softmax;
        let for_choice = match &self.expert_bias {
            // In the scores' dtype: Burn reads both operands in the left one's.
            Some(bias) => {
                let bias = bias.val().detach().cast(scores.dtype());
                scores.clone().detach() + bias.unsqueeze::<2>()
            }
            None if softmax_after_top_k => logits.clone().detach(),
            None => scores.clone().detach(),
        };
        let for_choice = match (s.num_groups, s.group_top_k) {
            (Some(groups), Some(group_top_k)) => {
                group_limited_scores(for_choice, s.top_k, groups, group_top_k)
            }
            _ => for_choice,
        };
        let losses = s.loss_terms();
        let probs = (!losses.is_empty()).then(|| match s.score_function {
            RouterScoreFunction::Softmax => scores.clone(),
            RouterScoreFunction::Sigmoid => scores.clone() / scores.clone().sum_dim(1),
        });
        // Megatron counts the load of the loss by a plain top-k of these probabilities: the
        // choice itself, unless the expert bias or the groups changed it. Then both top-k run
        // as one, over the two score tables stacked.
        let separate = self.expert_bias.is_some() || s.group_top_k.is_some();
        let (chosen, routing_map, loss_map) = match &probs {
            Some(probs) if separate => {
                let stacked = Tensor::cat(vec![for_choice, probs.clone().detach()], 0);
                let both = top_k_indices(stacked, s.top_k);
                let maps = routing_map(both.clone(), num_experts);
                (
                    both.narrow(0, 0, num_tokens),
                    maps.clone().narrow(0, 0, num_tokens),
                    Some(maps.narrow(0, num_tokens, num_tokens)),
                )
            }
            _ => {
                let chosen = top_k_indices(for_choice, s.top_k);
                let map = routing_map(chosen.clone(), num_experts);
                (chosen, map.clone(), probs.as_ref().map(|_| map))
            }
        };
        let tokens_per_expert = routing_map.clone().sum_dim(0).reshape([num_experts]);
        let mut weights = if softmax_after_top_k {
            softmax(logits.clone().gather(1, chosen.clone()), 1)
        } else {
            scores.clone().gather(1, chosen.clone())
        };
        let sigmoid_sum = s.score_function == RouterScoreFunction::Sigmoid && s.top_k > 1;
        if sigmoid_sum {
            weights = weights.clone() / weights.sum_dim(1).add_scalar(1e-20);
        }
        if s.normalize_top_k && !(softmax_after_top_k || sigmoid_sum) {
            weights = weights.clone() / weights.sum_dim(1);
        }
        if let Some(factor) = s.scaling_factor {
            weights = weights.mul_scalar(factor);
        }
        // Back to the model's dtype for the combine (Burn does not promote dtypes).
        let weights = match compute {
            Some(_) => weights.cast(model_dtype),
            None => weights,
        };
        // The sum of the list's losses, in the first's dtype.
        let mut load_balancing_loss: Option<Tensor<B, 1>> = None;
        if let (Some(probs), Some(map)) = (probs, loss_map) {
            for (kind, coeff) in losses {
                let (probs, map) = (probs.clone(), map.clone());
                let loss = match kind {
                    LoadBalancingType::GlobalAuxLoss => {
                        self.global_load_balancing_loss(probs, map, coeff, sequence)?
                    }
                    LoadBalancingType::SeqAuxLoss => {
                        self.load_balancing_loss(probs, map, coeff, batch, sequence)?
                    }
                    _ => self.load_balancing_loss(probs, map, coeff, 1, sequence)?,
                };
                load_balancing_loss = Some(match load_balancing_loss {
                    Some(sum) => sum + loss,
                    None => loss,
                });
            }
        }
        let load_balancing_loss =
            load_balancing_loss.unwrap_or_else(|| Tensor::zeros([1], &device));
        Ok(Routing {
            weights,
            experts: chosen,
            tokens_per_expert,
            routing_map,
            load_balancing_loss,
            z_loss,
        })
    }

    /// [`LoadBalancingType::Sinkhorn`]'s routing of `logits` (`[tokens, num_experts]`, in the
    /// router's dtype): the choice from [`sinkhorn`] in training (where the device tracks
    /// gradients), from the weights in evaluation; no load-balancing loss.
    fn route_sinkhorn(
        &self,
        logits: Tensor<B, 2>,
        model_dtype: DType,
        z_loss: Tensor<B, 1>,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<Routing<B>> {
        let s = &self.settings;
        let device = logits.device();
        let probs = match s.top_k {
            1 => sigmoid(logits.clone()),
            _ => softmax(logits.clone(), 1),
        };
        let for_choice = match B::ad_enabled(&device) {
            true => sinkhorn(logits.clone(), sequence)?,
            false => probs.clone().detach(),
        };
        let chosen = top_k_indices(for_choice, s.top_k);
        let routing_map = routing_map(chosen.clone(), self.num_experts());
        let tokens_per_expert = routing_map.clone().sum_dim(0).reshape([self.num_experts()]);
        let weights = probs.gather(1, chosen.clone());
        let weights = match weights.dtype() == model_dtype {
            true => weights,
            false => weights.cast(model_dtype),
        };
        Ok(Routing {
            weights,
            experts: chosen,
            tokens_per_expert,
            routing_map,
            load_balancing_loss: Tensor::zeros([1], &device),
            z_loss,
        })
    }

    /// This rank's share of the load-balancing loss of `batch` sequences (1: the Switch loss
    /// over all the tokens), from the probabilities `probs` (`[tokens, num_experts]`, each row
    /// summing to 1) and the loss's routing map `map` (`[tokens, num_experts]`), the counts
    /// summed over `sequence`, times `coeff`.
    fn load_balancing_loss(
        &self,
        probs: Tensor<B, 2>,
        map: Tensor<B, 2, Int>,
        coeff: f64,
        batch: usize,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<Tensor<B, 1>> {
        let s = &self.settings;
        let [num_tokens, num_experts] = probs.dims();
        let device = probs.device();
        let counts = map
            .reshape([batch, num_tokens / batch, num_experts])
            .sum_dim(1)
            .reshape([batch * num_experts]);
        let (counts, total) = match sequence.filter(|g| g.size() > 1) {
            Some(group) => {
                let (counts, total) = group_load::<B>(group, counts, num_tokens, &device)?;
                let counts: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
                let counts = TensorData::new(counts, [batch, num_experts]);
                let counts = Tensor::<B, 2>::from_data(counts, (&device, DType::F32));
                (counts, total)
            }
            None => (
                counts.cast(FloatDType::F32).reshape([batch, num_experts]),
                num_tokens,
            ),
        };
        Ok(load_balancing_share(
            probs,
            counts,
            total / batch,
            s.top_k,
            coeff,
        ))
    }

    /// This rank's part of `global_aux_loss` from its probabilities `probs` (`[tokens,
    /// num_experts]`) and the loss's routing map `map`: the counts summed over the global
    /// load group (on the device, no host read) and, in training, averaged with the step's
    /// earlier micro-batches; the Switch loss over the group's `N` tokens, this rank's share
    /// of it, times the DP ranks in the group. The shares of the CP ranks add up (as their
    /// gradients do), and the DP ranks' gradients are averaged: so DP = d runs as one DP rank
    /// whose micro-batches hold the d ranks' ones. In evaluation the counts are this
    /// micro-batch's alone, and nothing is kept.
    fn global_load_balancing_loss(
        &self,
        probs: Tensor<B, 2>,
        map: Tensor<B, 2, Int>,
        coeff: f64,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<Tensor<B, 1>> {
        let s = &self.settings;
        let [num_tokens, num_experts] = probs.dims();
        let device = probs.device();
        let counts = map
            .sum_dim(0)
            .reshape([num_experts])
            .float()
            .cast(FloatDType::F32);
        let group = self.global_load.group.as_ref().or(sequence);
        let (counts, ranks) = match group.filter(|g| g.size() > 1) {
            Some(group) => (group.all_reduce(counts, ReduceOp::Sum)?, group.size()),
            None => (counts, 1),
        };
        let data_parallel = ranks / sequence.map_or(1, ProcessGroup::size);
        let load = match B::ad_enabled(&device) {
            true => self.global_load.add(counts),
            false => counts,
        };
        let share = load_balancing_share(
            probs,
            load.reshape([1, num_experts]),
            num_tokens * ranks,
            s.top_k,
            coeff,
        );
        Ok(share.mul_scalar(data_parallel as f64))
    }
}

/// Values in `[0, 1)` that stand in for the router's logits under
/// [`RouterSettings::force_load_balancing`]: a hash of each logit and its expert's index
/// (`frac(sin(12.9898 l + 78.233 e) · 43758.5453)`, in f32), so that each token's top-k is
/// spread evenly over the experts whatever the router has learned. Megatron draws normal
/// values from a generator seeded by the rank; a function of the logits instead is the same
/// on every rank that routes the same tokens (the TP ranks), so every layout routes as one
/// device does. Returned in the logits' dtype, without gradient.
///
/// # Shapes
/// - logits, output: `[tokens, num_experts]`
pub fn balancing_logits<B: Backend>(logits: Tensor<B, 2>) -> Tensor<B, 2> {
    let dtype = logits.dtype();
    let [tokens, experts] = logits.dims();
    let expert = Tensor::<B, 1, Int>::arange(0..experts as i64, &logits.device())
        .float()
        .cast(FloatDType::F32)
        .reshape([1, experts])
        .expand([tokens, experts]);
    let phase =
        logits.detach().cast(FloatDType::F32).mul_scalar(12.9898) + expert.mul_scalar(78.233);
    let hashed = phase.sin().mul_scalar(43_758.545_3);
    (hashed.clone() - hashed.floor()).cast(dtype)
}

/// DeepSeek-V3's update of the expert bias from one step's load (Megatron's
/// `get_updated_expert_bias`): `rate · sign(mean − count_e)` for each expert, so that the
/// bias rises for experts below the mean load and falls for those above it (0 at the mean).
/// `tokens_per_expert` (`[num_experts]`, f32) are the step's counts over every data-parallel
/// rank; computed on the device, nothing read to the host.
pub fn expert_bias_update<B: Backend>(tokens_per_expert: Tensor<B, 1>, rate: f64) -> Tensor<B, 1> {
    let counts = tokens_per_expert.cast(FloatDType::F32);
    (counts.clone().mean() - counts).sign().mul_scalar(rate)
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

/// Megatron's group-limited top-k (DeepSeek-V2's device-limited and DeepSeek-V3's
/// node-limited routing), the masking part: the experts split into `num_groups` groups of
/// consecutive experts; each group scored by the sum of its `top_k / group_top_k` best
/// scores; the scores of experts outside each token's `group_top_k` best groups set to −∞,
/// so that a top-k of the result chooses among the rest only.
///
/// # Shapes
/// - scores: `[tokens, num_experts]`
/// - output: `[tokens, num_experts]`
fn group_limited_scores<B: TopKOps>(
    scores: Tensor<B, 2>,
    top_k: usize,
    num_groups: usize,
    group_top_k: usize,
) -> Tensor<B, 2> {
    let [tokens, experts] = scores.dims();
    let per_group = experts / num_groups;
    let device = scores.device();
    let grouped = scores.clone().reshape([tokens * num_groups, per_group]);
    let best = top_k_indices(grouped.clone(), top_k / group_top_k);
    let group_scores = grouped
        .gather(1, best)
        .sum_dim(1)
        .reshape([tokens, num_groups]);
    let groups = top_k_indices(group_scores, group_top_k);
    let columns = Tensor::<B, 1, Int>::arange(0..num_groups as i64, &device)
        .reshape([1, 1, num_groups])
        .expand([tokens, group_top_k, num_groups]);
    let eligible = groups
        .reshape([tokens, group_top_k, 1])
        .expand([tokens, group_top_k, num_groups])
        .equal(columns)
        .int()
        .sum_dim(1)
        .reshape([tokens, num_groups, 1])
        .expand([tokens, num_groups, per_group])
        .reshape([tokens, experts])
        .greater_elem(0);
    scores.mask_fill(eligible.bool_not(), f32::NEG_INFINITY)
}

/// Megatron's routing map: `[tokens, num_experts]`, 1 where token `t` chose expert `e`, else
/// 0. An index of `num_experts` or more (an assignment dropped) marks nothing.
///
/// # Shapes
/// - experts: `[tokens, top_k]`, each token's experts distinct
/// - output: `[tokens, num_experts]`
pub(crate) fn routing_map<B: Backend>(
    experts: Tensor<B, 2, Int>,
    num_experts: usize,
) -> Tensor<B, 2, Int> {
    let [tokens, top_k] = experts.dims();
    let shape = [tokens, top_k, num_experts];
    let columns = Tensor::<B, 1, Int>::arange(0..num_experts as i64, &experts.device())
        .reshape([1, 1, num_experts])
        .expand(shape);
    experts
        .reshape([tokens, top_k, 1])
        .expand(shape)
        .equal(columns)
        .int()
        .sum_dim(1)
        .reshape([tokens, num_experts])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The router computes in its set dtype, else in f32 for a 16-bit model under forced
    /// balancing, else in the model's.
    #[test]
    fn compute_dtype_follows_the_rule() {
        let forced = RouterSettings {
            force_load_balancing: true,
            ..Default::default()
        };
        let plain = RouterSettings::default();
        assert_eq!(forced.compute_dtype(DType::BF16), Some(FloatDType::F32));
        assert_eq!(forced.compute_dtype(DType::F16), Some(FloatDType::F32));
        assert_eq!(forced.compute_dtype(DType::F32), None);
        assert_eq!(forced.compute_dtype(DType::F64), None);
        assert_eq!(plain.compute_dtype(DType::BF16), None);
        let in_fp64 = RouterSettings {
            dtype: Some(RouterDtype::Fp64),
            ..forced
        };
        assert_eq!(in_fp64.compute_dtype(DType::BF16), Some(FloatDType::F64));
    }
}
