//! [`MoeSettings`]: the mixture-of-experts part of a
//! [`TransformerConfig`](crate::transformer::TransformerConfig), and `--moe-layer-freq`.
//! Kept apart from the layer's [`MoeConfig`](super::MoeConfig), which needs the
//! transformer's activation, so that the transformer's configuration can hold it.

use burn::config::Config;
use burn_megatron_dist::ProcessGroup;

use super::capacity::ExpertCapacity;
use super::dispatcher::TokenDispatcherType;
use super::router::{AuxLossTerm, LoadBalancingType, RouterDtype, RouterScoreFunction};
use crate::error::ConfigError;

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
    /// The top-k of the softmax over all experts instead of a softmax over the top-k logits
    /// (`--moe-router-pre-softmax`).
    #[config(default = false)]
    pub pre_softmax: bool,
    /// Whether each token's top-k weights are divided by their sum
    /// (`--moe-router-topk-normalize`, Hugging Face's `norm_topk_prob`).
    #[config(default = false)]
    pub normalize_top_k: bool,
    /// Groups of experts for group-limited routing (`--moe-router-num-groups`).
    #[config(default = "None")]
    pub num_groups: Option<usize>,
    /// Groups a token may choose its experts from (`--moe-router-group-topk`).
    #[config(default = "None")]
    pub group_top_k: Option<usize>,
    /// Factor of the top-k weights (`--moe-router-topk-scaling-factor`).
    #[config(default = "None")]
    pub top_k_scaling_factor: Option<f64>,
    /// Which load-balancing loss (`--moe-router-load-balancing-type`; the first of a list).
    #[config(default = "LoadBalancingType::AuxLoss")]
    pub load_balancing_type: LoadBalancingType,
    /// Coefficient of the load-balancing loss (`--moe-aux-loss-coeff`; the first of a list).
    #[config(default = 0.0)]
    pub aux_loss_coeff: f64,
    /// The losses a list of types adds to the first, with their coefficients
    /// (`--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2
    /// 1e-4`).
    #[config(default = "Vec::new()")]
    pub more_aux_losses: Vec<AuxLossTerm>,
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
    /// DeepSeek-V3's auxiliary-loss-free expert bias (`--moe-router-enable-expert-bias`).
    #[config(default = false)]
    pub expert_bias: bool,
    /// How far the bias moves after each step (`--moe-router-bias-update-rate`, Megatron's
    /// 1e-3).
    #[config(default = 1e-3)]
    pub bias_update_rate: f64,
    /// Each expert's capacity (`--moe-expert-capacity-factor`, `--moe-token-drop-policy`,
    /// `--moe-pad-expert-input-to-capacity`); `None`: dropless.
    #[config(default = "None")]
    pub capacity: Option<ExpertCapacity>,
    /// How tokens travel to the experts and back (`--moe-token-dispatcher-type`).
    #[config(default = "TokenDispatcherType::AllToAll")]
    pub token_dispatcher: TokenDispatcherType,
    /// Expert tensor parallelism (`--expert-tensor-parallel-size`): 1 keeps every expert
    /// whole on each TP rank; the TP size splits each expert's hidden width (routed and
    /// shared) over the TP group, as TP splits the dense MLP. `None`: the TP size, Megatron's
    /// default. Other sizes are not supported.
    #[config(default = "None")]
    pub expert_tensor_parallel_size: Option<usize>,
    /// The dtype the router computes in (`--moe-router-dtype fp32|fp64`); `None`: the
    /// model's.
    #[config(default = "None")]
    pub router_dtype: Option<RouterDtype>,
    /// Route by pseudo-random logits for an even load, whatever the router has learned
    /// (`--moe-router-force-load-balancing`, Megatron's switch for benchmarks).
    #[config(default = false)]
    pub force_load_balancing: bool,
    /// Switch Transformer's jitter of the router's input in training
    /// (`--moe-input-jitter-eps`); `None` for none.
    #[config(default = "None")]
    pub input_jitter_eps: Option<f64>,
}

impl MoeSettings {
    /// Whether any of the load-balancing types is `global_aux_loss`.
    pub fn has_global_aux_loss(&self) -> bool {
        let global = LoadBalancingType::GlobalAuxLoss;
        self.load_balancing_type == global
            || self
                .more_aux_losses
                .iter()
                .any(|t| t.load_balancing_type == global)
    }

    /// Whether global layer `layer` has an MoE layer in place of its MLP (Megatron's
    /// `moe_layer_pattern`: `layer % layer_freq == 0`, or the pattern's flag).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.layer_pattern {
            Some(pattern) => pattern.get(layer).copied().unwrap_or(false),
            None => self.layer_freq > 0 && layer.is_multiple_of(self.layer_freq),
        }
    }

    /// The group over which the experts' hidden width is split (see
    /// [`expert_tensor_parallel_size`](Self::expert_tensor_parallel_size)): `tp` when that
    /// is the TP size and TP > 1, `None` when it is 1. Another size is an error.
    pub fn expert_tp_group<'a>(
        &self,
        tp: &'a ProcessGroup,
    ) -> Result<Option<&'a ProcessGroup>, ConfigError> {
        check_expert_tp(self.expert_tensor_parallel_size, tp.size())?;
        Ok(match self.expert_tensor_parallel_size {
            Some(1) => None,
            _ => Some(tp).filter(|tp| tp.size() > 1),
        })
    }

    /// Checks `expert_tensor_parallel_size` against the TP size `tp` ([`check_expert_tp`])
    /// and that it divides the routed experts' width (`ffn_hidden_size`, the dense MLP's,
    /// unless given) and the shared expert's.
    pub fn validate_expert_tp(&self, ffn_hidden_size: usize, tp: usize) -> Result<(), ConfigError> {
        check_expert_tp(self.expert_tensor_parallel_size, tp)?;
        check_expert_widths(
            self.ffn_hidden_size.unwrap_or(ffn_hidden_size),
            self.shared_expert_ffn_hidden_size,
            self.expert_tensor_parallel_size.unwrap_or(tp),
        )
    }

    /// The MoE layers among `num_layers`.
    pub fn moe_layers(&self, num_layers: usize) -> Vec<usize> {
        (0..num_layers).filter(|&l| self.is_moe_layer(l)).collect()
    }

    /// Checks the settings for a model of `num_layers` layers at expert-parallel size `ep`
    /// (1 to check without a layout): the layer sizes
    /// ([`MoeConfig::validate`](super::MoeConfig::validate)), the routing options
    /// ([`RouterSettings::validate`](super::RouterSettings::validate)), the layer frequency or
    /// pattern, the coefficients (finite, not negative) and the capacity factor (finite, above
    /// 0).
    pub fn validate(
        &self,
        hidden_size: usize,
        ffn_hidden_size: usize,
        num_layers: usize,
        ep: usize,
    ) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if hidden_size == 0 {
            return invalid("MoE hidden_size must be at least 1".into());
        }
        check_expert_sizes(
            self.num_experts,
            self.ffn_hidden_size.unwrap_or(ffn_hidden_size),
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
            ("--moe-router-bias-update-rate", self.bias_update_rate),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return invalid(format!(
                    "{name} is {value}: it must be finite and not negative"
                ));
            }
        }
        self.capacity.map_or(Ok(()), |c| c.validate())
    }
}

/// Sinkhorn balancing makes the choice itself: Megatron's ignores the expert bias and the
/// capacity; here both are refused with it.
pub fn check_sinkhorn_choice(
    load_balancing: LoadBalancingType,
    expert_bias: bool,
    capacity: bool,
) -> Result<(), ConfigError> {
    let option = match (expert_bias, capacity) {
        _ if load_balancing != LoadBalancingType::Sinkhorn => return Ok(()),
        (true, _) => "--moe-router-enable-expert-bias",
        (_, true) => "--moe-expert-capacity-factor",
        _ => return Ok(()),
    };
    Err(ConfigError::Invalid(format!(
        "--moe-router-load-balancing-type sinkhorn does not take {option}: Sinkhorn balancing \
         makes the choice itself"
    )))
}

/// The sizes every MoE layer needs: at least one expert of a positive width, `top_k` in
/// `1..=num_experts`, a shared expert of a positive width if any, and `num_experts`
/// divisible by the expert-parallel size `ep` (the message lists the valid sizes).
pub fn check_expert_sizes(
    num_experts: usize,
    ffn_hidden_size: usize,
    top_k: usize,
    shared_expert_ffn_hidden_size: Option<usize>,
    ep: usize,
) -> Result<(), ConfigError> {
    let invalid = |message: String| Err(ConfigError::Invalid(message));
    if num_experts == 0 || ffn_hidden_size == 0 {
        return invalid(format!(
            "MoE sizes must be at least 1: num_experts {num_experts}, ffn_hidden_size \
             {ffn_hidden_size}"
        ));
    }
    if top_k == 0 || top_k > num_experts {
        return invalid(format!(
            "MoE top_k ({top_k}) must be between 1 and num_experts ({num_experts})"
        ));
    }
    if shared_expert_ffn_hidden_size == Some(0) {
        return invalid("the shared expert's ffn_hidden_size must be at least 1".into());
    }
    if ep == 0 || !num_experts.is_multiple_of(ep) {
        let valid: Vec<String> = (1..=num_experts)
            .filter(|d| num_experts.is_multiple_of(*d))
            .map(|d| d.to_string())
            .collect();
        return invalid(format!(
            "num_experts ({num_experts}) must be divisible by the expert-parallel size ({ep}): \
             valid EP sizes are {}",
            valid.join(", ")
        ));
    }
    Ok(())
}

/// Checks `--expert-tensor-parallel-size` (`None`: the TP size) against the TP size `tp`:
/// 1 or `tp`.
pub fn check_expert_tp(expert_tp: Option<usize>, tp: usize) -> Result<(), ConfigError> {
    match expert_tp {
        None | Some(1) => Ok(()),
        Some(size) if size == tp => Ok(()),
        Some(size) => Err(ConfigError::Invalid(format!(
            "--expert-tensor-parallel-size {size}: 1 (experts whole on every TP rank) or the \
             tensor-parallel size ({tp}, each expert's hidden width split over TP) are \
             supported"
        ))),
    }
}

/// Checks that the expert-tensor-parallel size `expert_tp` divides the routed experts' width
/// `ffn_hidden_size` and the shared expert's, if any.
pub fn check_expert_widths(
    ffn_hidden_size: usize,
    shared_expert_ffn_hidden_size: Option<usize>,
    expert_tp: usize,
) -> Result<(), ConfigError> {
    let widths = [
        ("--moe-ffn-hidden-size", Some(ffn_hidden_size)),
        (
            "--moe-shared-expert-intermediate-size",
            shared_expert_ffn_hidden_size,
        ),
    ];
    for (name, width) in widths {
        if let Some(width) = width.filter(|w| !w.is_multiple_of(expert_tp)) {
            return Err(ConfigError::Invalid(format!(
                "{name} ({width}) must be a multiple of the expert-tensor-parallel size \
                 ({expert_tp}; --expert-tensor-parallel-size, the tensor-parallel size unless \
                 given): each expert's hidden width is split over it; give \
                 --expert-tensor-parallel-size 1 to keep the experts whole"
            )));
        }
    }
    Ok(())
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
