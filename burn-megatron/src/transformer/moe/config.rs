//! [`MoeConfig`]: one configuration for the whole layer, with Megatron's option names in the
//! field docs.

use burn::config::Config;
use burn_megatron_dist::ProcessGroup;

use super::dispatcher::TokenDispatcher;
use super::experts::GroupedExpertsConfig;
use super::layer::MoeLayer;
use super::router::{Router, RouterScoreFunction, RouterSettings};
use crate::error::ConfigError;
use crate::init::{InitDistribution, init_full, param_seed};
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
    /// Whether each token's top-k weights are divided by their sum (Hugging Face's
    /// `norm_topk_prob`; Megatron does it for sigmoid scores with `top_k > 1`).
    #[config(default = false)]
    pub normalize_top_k: bool,
    /// Coefficient of the load-balancing loss (`--moe-aux-loss-coeff`).
    #[config(default = 0.0)]
    pub aux_loss_coeff: f64,
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
}

impl MoeConfig {
    /// This rank's layer: the router and shared expert whole, and experts
    /// `[ep_rank · num_experts / ep, (ep_rank + 1) · num_experts / ep)`. Parameter values
    /// depend on `seed` only, not on the expert-parallel size.
    pub fn init<B: burn::tensor::backend::Backend>(
        &self,
        ep: &ProcessGroup,
        seed: u64,
        device: &B::Device,
    ) -> Result<MoeLayer<B>, ConfigError> {
        self.validate(ep.size())?;
        let dispatcher = TokenDispatcher::new(ep, self.num_experts);
        let router = Router::new(
            init_full(
                [self.hidden_size, self.num_experts],
                InitDistribution::Normal { std: self.init_std },
                param_seed(seed, "router.weight"),
                device,
            ),
            RouterSettings {
                score_function: self.score_function,
                top_k: self.top_k,
                normalize_top_k: self.normalize_top_k,
                aux_loss_coeff: self.aux_loss_coeff,
                z_loss_coeff: self.z_loss_coeff,
            },
        );
        let experts =
            GroupedExpertsConfig::new(self.hidden_size, self.ffn_hidden_size, self.num_experts)
                .with_activation(self.activation)
                .with_init_std(self.init_std)
                .init(dispatcher.local_experts(), seed, "experts", device);
        let shared_expert = self.shared_expert_ffn_hidden_size.map(|width| {
            GroupedExpertsConfig::new(self.hidden_size, width, 1)
                .with_activation(self.activation)
                .with_init_std(self.init_std)
                .init(0..1, seed, "shared_expert", device)
        });
        Ok(MoeLayer::new(router, experts, shared_expert, dispatcher))
    }

    /// Checks the sizes against each other and against an expert-parallel size `ep`.
    pub fn validate(&self, ep: usize) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if self.num_experts == 0 || self.hidden_size == 0 || self.ffn_hidden_size == 0 {
            return invalid(format!(
                "MoE sizes must be at least 1: num_experts {}, hidden_size {}, \
                 ffn_hidden_size {}",
                self.num_experts, self.hidden_size, self.ffn_hidden_size
            ));
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return invalid(format!(
                "MoE top_k ({}) must be between 1 and num_experts ({})",
                self.top_k, self.num_experts
            ));
        }
        if self.shared_expert_ffn_hidden_size == Some(0) {
            return invalid("the shared expert's ffn_hidden_size must be at least 1".into());
        }
        if !self.num_experts.is_multiple_of(ep) {
            let valid: Vec<String> = (1..=self.num_experts)
                .filter(|d| self.num_experts.is_multiple_of(*d))
                .map(|d| d.to_string())
                .collect();
            return invalid(format!(
                "num_experts ({}) must be divisible by the expert-parallel size ({ep}): valid \
                 EP sizes are {}",
                self.num_experts,
                valid.join(", ")
            ));
        }
        Ok(())
    }
}

/// Mixture of experts in a [`TransformerConfig`](crate::transformer::TransformerConfig):
/// which layers have one in place of their MLP, and the layer's settings (Megatron's
/// `--num-experts` and `--moe-*` options). The hidden size, activation, initialisation and
/// seed come from the transformer's configuration.
#[derive(Config, Debug)]
pub struct MoeSettings {
    /// Routed experts over all expert-parallel ranks (`--num-experts`).
    pub num_experts: usize,
    /// Hidden width of each routed expert (`--moe-ffn-hidden-size`); `None`: the dense MLP's
    /// `ffn_hidden_size`.
    #[config(default = "None")]
    pub ffn_hidden_size: Option<usize>,
    /// Experts per token (`--moe-router-topk`).
    #[config(default = 2)]
    pub top_k: usize,
    /// Softmax or sigmoid scores (`--moe-router-score-function`).
    #[config(default = "RouterScoreFunction::Softmax")]
    pub score_function: RouterScoreFunction,
    /// Whether each token's top-k weights are divided by their sum
    /// (`--moe-router-topk-normalize`, Hugging Face's `norm_topk_prob`).
    #[config(default = false)]
    pub normalize_top_k: bool,
    /// Coefficient of the load-balancing loss (`--moe-aux-loss-coeff`).
    #[config(default = 0.0)]
    pub aux_loss_coeff: f64,
    /// Coefficient of the z-loss (`--moe-z-loss-coeff`).
    #[config(default = 0.0)]
    pub z_loss_coeff: f64,
    /// Width of the shared expert (`--moe-shared-expert-intermediate-size`), or `None`.
    #[config(default = "None")]
    pub shared_expert_ffn_hidden_size: Option<usize>,
    /// Every `layer_freq`-th layer, from layer 0, is an MoE layer (`--moe-layer-freq k`).
    #[config(default = 1)]
    pub layer_freq: usize,
    /// One flag a layer, overriding `layer_freq` (`--moe-layer-freq "([0]*1+[1]*3)"`).
    #[config(default = "None")]
    pub layer_pattern: Option<Vec<bool>>,
}

impl MoeSettings {
    /// Whether global layer `layer` has an MoE layer in place of its MLP (Megatron's
    /// `moe_layer_pattern`: `layer % layer_freq == 0`, or the pattern's flag).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.layer_pattern {
            Some(pattern) => pattern.get(layer).copied().unwrap_or(false),
            None => self.layer_freq > 0 && layer.is_multiple_of(self.layer_freq),
        }
    }

    /// The MoE layers among `num_layers`.
    pub fn moe_layers(&self, num_layers: usize) -> Vec<usize> {
        (0..num_layers).filter(|&l| self.is_moe_layer(l)).collect()
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
        .with_normalize_top_k(self.normalize_top_k)
        .with_aux_loss_coeff(self.aux_loss_coeff)
        .with_z_loss_coeff(self.z_loss_coeff)
        .with_activation(activation)
        .with_shared_expert_ffn_hidden_size(self.shared_expert_ffn_hidden_size)
        .with_init_std(init_std)
    }

    /// Checks the settings for a model of `num_layers` layers at expert-parallel size `ep`
    /// (1 to check without a layout): the layer sizes ([`MoeConfig::validate`]), the layer
    /// frequency or pattern, and the coefficients (finite, not negative).
    pub fn validate(
        &self,
        hidden_size: usize,
        ffn_hidden_size: usize,
        num_layers: usize,
        ep: usize,
    ) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        self.layer_config(hidden_size, ffn_hidden_size, Activation::SwiGlu, 0.02)
            .validate(ep)?;
        match &self.layer_pattern {
            Some(pattern) if pattern.len() != num_layers => {
                return invalid(format!(
                    "--moe-layer-freq gives {} layers, the model has {num_layers}",
                    pattern.len()
                ));
            }
            Some(pattern) if !pattern.contains(&true) => {
                return invalid("--moe-layer-freq's pattern has no MoE layer".into());
            }
            None if self.layer_freq == 0 => {
                return invalid("--moe-layer-freq must be at least 1".into());
            }
            _ => {}
        }
        for (name, value) in [
            ("--moe-aux-loss-coeff", self.aux_loss_coeff),
            ("--moe-z-loss-coeff", self.z_loss_coeff),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return invalid(format!(
                    "{name} is {value}: it must be finite and not negative"
                ));
            }
        }
        Ok(())
    }
}

/// What `--moe-layer-freq` gives: every k-th layer, or a flag a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MoeLayerFreq {
    /// Every k-th layer from layer 0.
    Every(usize),
    /// One flag a layer.
    Pattern(Vec<bool>),
}

impl MoeLayerFreq {
    /// Parses Megatron's forms: an integer `k`, or a Python list expression of repeated
    /// lists such as `([0]*1+[1]*3)` or `[1,0,1,0]` (`1` for an MoE layer).
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let bad = || {
            ConfigError::Invalid(format!(
                "--moe-layer-freq {text:?}: give an integer k (every k-th layer) or a list \
                 such as \"([0]*1+[1]*3)\" or \"[1,0,1,0]\""
            ))
        };
        let text = text.trim();
        if let Ok(k) = text.parse::<usize>() {
            return Ok(Self::Every(k));
        }
        let inner = text
            .strip_prefix('(')
            .and_then(|t| t.strip_suffix(')'))
            .unwrap_or(text);
        let mut pattern = Vec::new();
        for term in inner.split('+') {
            let term = term.trim();
            let (list, times) = match term.split_once('*') {
                Some((list, times)) => (list.trim(), times.trim().parse().map_err(|_| bad())?),
                None => (term, 1usize),
            };
            let list = list
                .strip_prefix('[')
                .and_then(|l| l.strip_suffix(']'))
                .ok_or_else(bad)?;
            let flags = list
                .split(',')
                .map(|v| match v.trim() {
                    "0" => Ok(false),
                    "1" => Ok(true),
                    _ => Err(bad()),
                })
                .collect::<Result<Vec<_>, _>>()?;
            for _ in 0..times {
                pattern.extend_from_slice(&flags);
            }
        }
        Ok(Self::Pattern(pattern))
    }
}
