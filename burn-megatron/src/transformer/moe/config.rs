//! [`MoeConfig`]: one configuration for the whole layer, with Megatron's option names in the
//! field docs.

use burn::config::Config;
use burn::tensor::Tensor;
use burn_megatron_dist::ProcessGroup;

use super::capacity::ExpertCapacity;
use super::dispatcher::{BlockPadding, TokenDispatcher, TokenDispatcherType};
use super::experts::GroupedExpertsConfig;
use super::layer::MoeLayer;
use super::router::{
    AuxLossTerm, LoadBalancingType, Router, RouterDtype, RouterScoreFunction, RouterSettings,
};
use super::settings::{
    MoeSettings, check_expert_sizes, check_expert_widths, check_sinkhorn_choice,
};
use crate::error::ConfigError;
use crate::init::{InitDistribution, init_full, param_seed};
use crate::ops::CounterNormalOps;
use crate::transformer::Activation;

/// Configuration of an [`MoeLayer`].
#[derive(Config, Debug)]
pub struct MoeConfig {
    /// Width of the tokens.
    pub hidden_size: usize,
    /// Routed experts over all expert-parallel ranks (`--num-experts`).
    pub num_experts: usize,
    /// Hidden width of each routed expert (`--moe-ffn-hidden-size`).
    pub ffn_hidden_size: usize,
    /// Experts per token, from 1 to `num_experts` (`--moe-router-topk`).
    #[config(default = 2)]
    pub top_k: usize,
    /// Softmax or sigmoid scores (`--moe-router-score-function`).
    #[config(default = "RouterScoreFunction::Softmax")]
    pub score_function: RouterScoreFunction,
    /// Softmax scores: the top-k of the softmax over all experts, its values the weights,
    /// instead of a softmax over the top-k logits (`--moe-router-pre-softmax`; required for
    /// softmax with `top_k` 1; sigmoid scores ignore it).
    #[config(default = false)]
    pub pre_softmax: bool,
    /// Whether each token's top-k weights are divided by their sum (Hugging Face's
    /// `norm_topk_prob`): Megatron's weights already sum to 1 except with pre-softmax (and
    /// sigmoid top-1), where this makes them.
    #[config(default = false)]
    pub normalize_top_k: bool,
    /// Group-limited routing (`--moe-router-num-groups`): the experts split into this many
    /// groups of consecutive experts; with `group_top_k`.
    #[config(default = "None")]
    pub num_groups: Option<usize>,
    /// Groups a token may take its experts from (`--moe-router-group-topk`): those whose
    /// top `top_k / group_top_k` scores sum highest (DeepSeek-V3: 8 groups, 4 a token).
    #[config(default = "None")]
    pub group_top_k: Option<usize>,
    /// Factor of the top-k weights (`--moe-router-topk-scaling-factor`; DeepSeek-V3: 2.5),
    /// applied last; `None` for 1.
    #[config(default = "None")]
    pub top_k_scaling_factor: Option<f64>,
    /// The load-balancing loss, or Sinkhorn balancing, or none
    /// (`--moe-router-load-balancing-type`; the first of a list).
    #[config(default = "LoadBalancingType::AuxLoss")]
    pub load_balancing_type: LoadBalancingType,
    /// Coefficient of the load-balancing loss (`--moe-aux-loss-coeff`; the first of a list).
    #[config(default = 0.0)]
    pub aux_loss_coeff: f64,
    /// The losses a list of types adds to the first, with their coefficients.
    #[config(default = "Vec::new()")]
    pub more_aux_losses: Vec<AuxLossTerm>,
    /// Coefficient of the z-loss (`--moe-z-loss-coeff`).
    #[config(default = 0.0)]
    pub z_loss_coeff: f64,
    /// The experts' activation: SwiGLU or GeLU (Megatron's `--swiglu`).
    #[config(default = "Activation::SwiGlu")]
    pub activation: Activation,
    /// Hidden width of the shared expert, applied to every token, or `None` for no shared
    /// expert (`--moe-shared-expert-intermediate-size`: the width of all shared experts
    /// together).
    #[config(default = "None")]
    pub shared_expert_ffn_hidden_size: Option<usize>,
    /// Standard deviation of the normal initialisation of every weight.
    #[config(default = 0.02)]
    pub init_std: f64,
    /// DeepSeek-V3's auxiliary-loss-free expert bias (`--moe-router-enable-expert-bias`):
    /// the router chooses by the scores plus a per-expert bias that the training loop
    /// updates from the load ([`expert_bias_update`](super::expert_bias_update)).
    #[config(default = false)]
    pub expert_bias: bool,
    /// Each expert's capacity and what an over-full expert drops
    /// (`--moe-expert-capacity-factor`, `--moe-token-drop-policy`,
    /// `--moe-pad-expert-input-to-capacity`); `None`: dropless.
    #[config(default = "None")]
    pub capacity: Option<ExpertCapacity>,
    /// How tokens travel to the experts and back (`--moe-token-dispatcher-type`): an
    /// all-to-all (the default here) or an all-gather and a reduce-scatter. The same results
    /// either way.
    #[config(default = "TokenDispatcherType::AllToAll")]
    pub token_dispatcher: TokenDispatcherType,
    /// Whether the dispatcher pads the experts' blocks to one size
    /// ([`BlockPadding`]): where the backend runs them faster (the default), or always.
    #[config(default = "BlockPadding::Backend")]
    pub block_padding: BlockPadding,
    /// The dtype the router computes in (`--moe-router-dtype`); `None`: the model's.
    #[config(default = "None")]
    pub router_dtype: Option<RouterDtype>,
    /// Route by pseudo-random logits for an even load (`--moe-router-force-load-balancing`,
    /// for benchmarks; see [`RouterSettings::force_load_balancing`]).
    #[config(default = false)]
    pub force_load_balancing: bool,
    /// Switch Transformer's jitter of the router's input in training
    /// (`--moe-input-jitter-eps`; see [`RouterSettings::input_jitter_eps`]).
    #[config(default = "None")]
    pub input_jitter_eps: Option<f64>,
}

impl MoeConfig {
    /// This rank's layer: the router and shared expert whole, and experts
    /// `[ep_rank · num_experts / ep, (ep_rank + 1) · num_experts / ep)`. Parameter values
    /// depend on `seed` only, not on the expert-parallel size.
    pub fn init<B: CounterNormalOps>(
        &self,
        ep: &ProcessGroup,
        seed: u64,
        device: &B::Device,
    ) -> Result<MoeLayer<B>, ConfigError> {
        self.init_with_expert_tp(ep, None, seed, device)
    }

    /// [`init`](Self::init) with expert tensor parallelism over `expert_tp` (Megatron's
    /// `--expert-tensor-parallel-size` equal to the TP size): each rank of it holds its slice
    /// of every expert's hidden width, routed and shared, and the layer sums the experts'
    /// partial outputs over it ([`MoeLayer::try_forward_partial_over`]). Every rank of
    /// `expert_tp` must route the same tokens. `None` (or a group of one): the experts whole
    /// on every rank.
    pub fn init_with_expert_tp<B: CounterNormalOps>(
        &self,
        ep: &ProcessGroup,
        expert_tp: Option<&ProcessGroup>,
        seed: u64,
        device: &B::Device,
    ) -> Result<MoeLayer<B>, ConfigError> {
        self.validate(ep.size())?;
        let expert_tp = expert_tp.filter(|tp| tp.size() > 1);
        let (tp_rank, tp_size) = expert_tp.map_or((0, 1), |tp| (tp.rank(), tp.size()));
        check_expert_widths(
            self.ffn_hidden_size,
            self.shared_expert_ffn_hidden_size,
            tp_size,
        )?;
        let shard = |width: usize| {
            let n = width / tp_size;
            tp_rank * n..(tp_rank + 1) * n
        };
        let dispatcher = TokenDispatcher::new(ep, self.num_experts, self.token_dispatcher)
            .with_block_padding(self.block_padding);
        let router = Router::new(
            init_full(
                [self.hidden_size, self.num_experts],
                InitDistribution::Normal { std: self.init_std },
                param_seed(seed, "router.weight"),
                device,
            ),
            self.router_settings(),
        );
        let router = match self.expert_bias {
            true => router.with_expert_bias(Tensor::zeros([self.num_experts], device)),
            false => router,
        };
        let experts =
            GroupedExpertsConfig::new(self.hidden_size, self.ffn_hidden_size, self.num_experts)
                .with_activation(self.activation)
                .with_init_std(self.init_std)
                .init_sharded(
                    dispatcher.local_experts(),
                    shard(self.ffn_hidden_size),
                    seed,
                    "experts",
                    device,
                );
        let shared_expert = self.shared_expert_ffn_hidden_size.map(|width| {
            GroupedExpertsConfig::new(self.hidden_size, width, 1)
                .with_activation(self.activation)
                .with_init_std(self.init_std)
                .init_sharded(0..1, shard(width), seed, "shared_expert", device)
        });
        Ok(MoeLayer::new(router, experts, shared_expert, dispatcher)
            .with_capacity(self.capacity)
            .with_expert_tp(expert_tp.cloned()))
    }

    /// The router's part of the configuration.
    pub fn router_settings(&self) -> RouterSettings {
        RouterSettings {
            score_function: self.score_function,
            top_k: self.top_k,
            pre_softmax: self.pre_softmax,
            normalize_top_k: self.normalize_top_k,
            num_groups: self.num_groups,
            group_top_k: self.group_top_k,
            scaling_factor: self.top_k_scaling_factor,
            load_balancing: self.load_balancing_type,
            aux_loss_coeff: self.aux_loss_coeff,
            more_aux_losses: self.more_aux_losses.clone(),
            z_loss_coeff: self.z_loss_coeff,
            dtype: self.router_dtype,
            force_load_balancing: self.force_load_balancing,
            input_jitter_eps: self.input_jitter_eps,
        }
    }

    /// Checks the sizes against each other and against an expert-parallel size `ep`, and the
    /// routing options ([`RouterSettings::validate`]).
    pub fn validate(&self, ep: usize) -> Result<(), ConfigError> {
        if self.hidden_size == 0 {
            return Err(ConfigError::Invalid(
                "MoE hidden_size must be at least 1".into(),
            ));
        }
        check_expert_sizes(
            self.num_experts,
            self.ffn_hidden_size,
            self.top_k,
            self.shared_expert_ffn_hidden_size,
            ep,
        )?;
        self.router_settings().validate(self.num_experts)?;
        check_sinkhorn_choice(
            self.load_balancing_type,
            self.expert_bias,
            self.capacity.is_some(),
        )?;
        self.capacity.map_or(Ok(()), |c| c.validate())
    }
}

impl MoeSettings {
    /// The routing options of every MoE layer these settings build.
    pub fn router_settings(&self) -> RouterSettings {
        self.layer_config(1, 1, Activation::SwiGlu, 0.02)
            .router_settings()
    }

    /// The layer configuration for a model of width `hidden_size` whose dense MLPs are
    /// `ffn_hidden_size` wide.
    pub fn layer_config(
        &self,
        hidden_size: usize,
        ffn_hidden_size: usize,
        activation: Activation,
        init_std: f64,
    ) -> MoeConfig {
        MoeConfig::new(
            hidden_size,
            self.num_experts,
            self.ffn_hidden_size.unwrap_or(ffn_hidden_size),
        )
        .with_top_k(self.top_k)
        .with_score_function(self.score_function)
        .with_pre_softmax(self.pre_softmax)
        .with_normalize_top_k(self.normalize_top_k)
        .with_num_groups(self.num_groups)
        .with_group_top_k(self.group_top_k)
        .with_top_k_scaling_factor(self.top_k_scaling_factor)
        .with_load_balancing_type(self.load_balancing_type)
        .with_aux_loss_coeff(self.aux_loss_coeff)
        .with_more_aux_losses(self.more_aux_losses.clone())
        .with_z_loss_coeff(self.z_loss_coeff)
        .with_activation(activation)
        .with_shared_expert_ffn_hidden_size(self.shared_expert_ffn_hidden_size)
        .with_init_std(init_std)
        .with_expert_bias(self.expert_bias)
        .with_capacity(self.capacity)
        .with_token_dispatcher(self.token_dispatcher)
        .with_router_dtype(self.router_dtype)
        .with_force_load_balancing(self.force_load_balancing)
        .with_input_jitter_eps(self.input_jitter_eps)
    }
}
