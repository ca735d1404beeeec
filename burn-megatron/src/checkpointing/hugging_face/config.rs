//! transformers' `config.json` for GPT-2, Llama, Mixtral and Qwen3-MoE, to and from our
//! [`TransformerConfig`].

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::checkpointing::CheckpointError;
use crate::error::Result;
use crate::transformer::moe::{MoeSettings, RouterScoreFunction};
use crate::transformer::{Activation, Normalization, PositionEmbedding, TransformerConfig};

/// The model families whose transformers checkpoints we read and write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfFamily {
    /// `GPT2LMHeadModel` (`model_type: "gpt2"`): LayerNorm, GeLU, learned positions, biases,
    /// output tied to the token embeddings, Conv1D weights stored `[in, out]`.
    Gpt2,
    /// `LlamaForCausalLM` (`model_type: "llama"`): RMSNorm, SwiGLU, rotary positions
    /// (rotate-half), grouped queries, no biases, `nn.Linear` weights stored `[out, in]`.
    Llama,
    /// `MixtralForCausalLM` (`model_type: "mixtral"`): a Llama whose every MLP is a
    /// mixture of SwiGLU experts, routed by softmax over all experts, top-k, the k weights
    /// renormalised to sum to one.
    Mixtral,
    /// `Qwen3MoeForCausalLM` (`model_type: "qwen3_moe"`): a Mixtral-like model whose
    /// attention normalises each query and key head by RMSNorm before RoPE (QK-norm), routed
    /// by softmax over all experts, top-k, the k weights renormalised only with
    /// `norm_topk_prob`; dense MLPs in the layers `mlp_only_layers` and
    /// `decoder_sparse_step` leave out.
    Qwen3Moe,
}

impl HfFamily {
    /// The family of an exported model of `config`, or why transformers has no class for it.
    pub fn of(config: &TransformerConfig) -> core::result::Result<Self, String> {
        let c = config;
        match (c.normalization, c.activation, c.position_embedding) {
            (
                Normalization::LayerNorm,
                Activation::Gelu | Activation::GeluTanh,
                PositionEmbedding::Learned,
            ) => {
                if !c.add_bias_linear {
                    Err("a GPT-2 has biases in its linear layers (add_bias_linear = false)".into())
                } else if !c.tie_embeddings {
                    Err(
                        "a GPT-2 ties its output layer to the embeddings (tie_embeddings = false)"
                            .into(),
                    )
                } else if c.query_groups() != c.num_attention_heads {
                    Err("a GPT-2 has no grouped queries (num_query_groups is set)".into())
                } else {
                    Ok(Self::Gpt2)
                }
            }
            (Normalization::RmsNorm, Activation::SwiGlu, PositionEmbedding::Rope { .. }) => {
                if c.add_bias_linear {
                    Err("a Llama has no biases (add_bias_linear = true)".into())
                } else if c.qk_layernorm {
                    match &c.moe {
                        Some(moe) => qwen3_moe(moe).map(|()| Self::Qwen3Moe),
                        None => Err("QK-norm without MoE is a Qwen3, whose export is not \
                                     written yet (qk_layernorm = true, no MoE)"
                            .into()),
                    }
                } else if let Some(moe) = &c.moe {
                    mixtral_moe(moe, c.num_layers).map(|()| Self::Mixtral)
                } else {
                    Ok(Self::Llama)
                }
            }
            _ => Err(format!(
                "no transformers model has {:?} with {:?} and {:?} (GPT-2: LayerNorm, GeLU, \
                 learned positions; Llama: RMSNorm, SwiGLU, RoPE)",
                c.normalization, c.activation, c.position_embedding
            )),
        }
    }
}

/// Whether the MoE settings are Mixtral's: an MoE layer in every layer, no shared expert, no
/// expert bias, and Mixtral's weights, the softmax over the k chosen logits (Megatron's
/// default routing, or pre-softmax with the k weights renormalised, which equals it), without
/// group-limited routing or a scaling factor. The coefficients of the losses and the capacity
/// are training settings, not part of the model: a Mixtral is dropless.
fn mixtral_moe(moe: &MoeSettings, num_layers: usize) -> core::result::Result<(), String> {
    let problem = if moe.moe_layers(num_layers).len() != num_layers {
        "an MoE layer in every layer (--moe-layer-freq leaves dense layers)"
    } else if moe.pre_softmax && !moe.normalize_top_k {
        "the top-k weights renormalised (pre_softmax without normalize_top_k)"
    } else {
        return softmax_top_k(moe).map_err(|problem| format!("a Mixtral has {problem}"));
    };
    Err(format!("a Mixtral has {problem}"))
}

/// Whether the MoE settings are Qwen3-MoE's: Mixtral's routing, except that the top-k
/// weights may stay unnormalised (`norm_topk_prob: false`: pre-softmax without
/// `normalize_top_k`), and any layers may be dense (`mlp_only_layers`).
fn qwen3_moe(moe: &MoeSettings) -> core::result::Result<(), String> {
    softmax_top_k(moe).map_err(|problem| format!("a Qwen3-MoE has {problem}"))
}

/// What Mixtral's and Qwen3-MoE's routing share, the problem where `moe` differs: softmax
/// scores, plain top-k (no groups, no scaling), no shared expert, no expert bias.
fn softmax_top_k(moe: &MoeSettings) -> core::result::Result<(), &'static str> {
    let problem = if moe.score_function != RouterScoreFunction::Softmax {
        "softmax router scores (the score function is sigmoid)"
    } else if moe.num_groups.is_some() || moe.group_top_k.is_some() {
        "no group-limited routing (num_groups, group_top_k)"
    } else if moe.top_k_scaling_factor.is_some_and(|f| f != 1.0) {
        "no top-k scaling factor"
    } else if moe.shared_expert_ffn_hidden_size.is_some() {
        "no shared expert"
    } else if moe.expert_bias {
        "no expert bias"
    } else {
        return Ok(());
    };
    Err(problem)
}

/// transformers' defaults for keys a Llama or Mixtral `config.json` leaves out.
#[derive(Debug, Clone, Copy)]
struct RotaryDefaults {
    rope_theta: f64,
    rms_norm_eps: f64,
    max_position_embeddings: usize,
}

const LLAMA_DEFAULTS: RotaryDefaults = RotaryDefaults {
    rope_theta: 10_000.0,
    rms_norm_eps: 1e-6,
    max_position_embeddings: 2048,
};

const MIXTRAL_DEFAULTS: RotaryDefaults = RotaryDefaults {
    rope_theta: 1e6,
    rms_norm_eps: 1e-5,
    max_position_embeddings: 4096 * 32,
};

const QWEN3_MOE_DEFAULTS: RotaryDefaults = RotaryDefaults {
    rope_theta: 10_000.0,
    rms_norm_eps: 1e-6,
    max_position_embeddings: 32_768,
};

/// A transformers `config.json` read as one of our configurations.
#[derive(Debug, Clone)]
pub struct HfConfig {
    /// Which model it is.
    pub family: HfFamily,
    /// Our configuration of the same model (the vocabulary unpadded; padding is ours to add:
    /// `make_vocab_size_divisible_by` keeps its default, dropout as the file says).
    pub config: TransformerConfig,
}

/// Checks `moe` against the dense shape of `config` at EP 1; an error names the file's `keys`
/// that set it.
fn checked_moe(k: &Keys, moe: &MoeSettings, config: &TransformerConfig, keys: &str) -> Result<()> {
    moe.validate(
        config.hidden_size,
        config.ffn_hidden_size,
        config.num_layers,
        1,
    )
    .map_err(|e| invalid(k.file, format!("{keys}: {e}")))
}

fn invalid(file: &Path, problem: impl Into<String>) -> crate::error::Error {
    CheckpointError::file(file, problem).into()
}

/// Typed reads of a `config.json` object, each error naming the file and the key.
struct Keys<'a> {
    file: &'a Path,
    map: &'a Map<String, Value>,
}

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| invalid(self.file, format!("key {key} is missing")))
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64().map(|n| n as usize).ok_or_else(|| {
                    invalid(
                        self.file,
                        format!("key {key} must be a whole number, got {v}"),
                    )
                })
            })
            .transpose()
    }
    /// The routed experts' count: `num_local_experts` (Mixtral, and every MoE config
    /// transformers 5 writes, through its `attribute_map`) or `num_experts` (Qwen3-MoE as
    /// transformers 4 writes it), else the family's `default`.
    fn num_experts(&self, default: usize) -> Result<usize> {
        match self.opt_usize("num_local_experts")? {
            Some(n) => Ok(n),
            None => Ok(self.opt_usize("num_experts")?.unwrap_or(default)),
        }
    }
    /// The router's load-balancing loss coefficient: transformers adds the loss only with
    /// `output_router_logits`.
    fn aux_loss_coeff(&self) -> Result<f64> {
        match self.bool_or("output_router_logits", false)? {
            true => self.f64_or("router_aux_loss_coef", 0.001),
            false => Ok(0.0),
        }
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| invalid(self.file, format!("key {key} must be a number, got {v}"))),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                invalid(
                    self.file,
                    format!("key {key} must be true or false, got {v}"),
                )
            }),
        }
    }
    /// A list of whole numbers, empty when absent.
    fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        let Some(v) = self.get(key) else {
            return Ok(Vec::new());
        };
        let bad = || {
            invalid(
                self.file,
                format!("key {key} must be a list of whole numbers, got {v}"),
            )
        };
        v.as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|n| n.as_u64().map(|n| n as usize).ok_or_else(bad))
            .collect()
    }
    fn str_or<'b>(&'b self, key: &str, default: &'b str) -> Result<&'b str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| invalid(self.file, format!("key {key} must be a string, got {v}"))),
        }
    }
    /// An error when `key` is set to anything but `expected` (or absent / null).
    fn unsupported_unless(&self, key: &str, expected: Value) -> Result<()> {
        match self.get(key) {
            Some(v) if *v != expected => Err(invalid(
                self.file,
                format!("unsupported option {key} = {v} (supported: {expected} or absent)"),
            )),
            _ => Ok(()),
        }
    }
}

impl HfConfig {
    /// Reads `config.json` in `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let file = dir.join("config.json");
        let text =
            std::fs::read_to_string(&file).map_err(|e| CheckpointError::io(&file, "read it", e))?;
        Self::parse(&text, &file)
    }

    /// Parses the text of a `config.json` (`file` names it in errors).
    pub fn parse(text: &str, file: &Path) -> Result<Self> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| invalid(file, format!("not JSON: {e}")))?;
        let map = value
            .as_object()
            .ok_or_else(|| invalid(file, "not a JSON object"))?;
        let keys = Keys { file, map };
        let unsupported_moe = |name: &str, why: &str| {
            Err(invalid(
                file,
                format!("unsupported model_type {name:?}: {why}, which our model lacks"),
            ))
        };
        match keys.str_or("model_type", "")? {
            "gpt2" => Self::gpt2(&keys),
            "llama" => Self::llama(&keys),
            "mixtral" => Self::mixtral(&keys),
            "qwen3_moe" => Self::qwen3_moe(&keys),
            name @ "olmoe" => unsupported_moe(
                name,
                "OLMoE's attention normalises the queries and keys by RMSNorm over all heads \
                 together (q_norm, k_norm of hidden_size), not each head",
            ),
            name @ "qwen2_moe" => unsupported_moe(
                name,
                "Qwen2-MoE has a shared expert scaled by a sigmoid gate (shared_expert_gate) \
                 and query/key/value biases",
            ),
            other => Err(invalid(
                file,
                format!(
                    "unsupported model_type {other:?} (supported: \"gpt2\", \"llama\", \
                     \"mixtral\", \"qwen3_moe\")"
                ),
            )),
        }
    }

    fn gpt2(k: &Keys) -> Result<Self> {
        k.unsupported_unless("scale_attn_weights", json!(true))?;
        k.unsupported_unless("scale_attn_by_inverse_layer_idx", json!(false))?;
        k.unsupported_unless("reorder_and_upcast_attn", json!(false))?;
        k.unsupported_unless("add_cross_attention", json!(false))?;
        k.unsupported_unless("tie_word_embeddings", json!(true))?;
        let activation = match k.str_or("activation_function", "gelu_new")? {
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            other => {
                return Err(invalid(
                    k.file,
                    format!(
                        "unsupported option activation_function = {other:?} (supported: \
                         \"gelu_new\", \"gelu_pytorch_tanh\", \"gelu\")"
                    ),
                ));
            }
        };
        let hidden = k.usize("n_embd")?;
        let ffn = k.opt_usize("n_inner")?.unwrap_or(4 * hidden);
        let config = TransformerConfig::new(
            hidden,
            k.usize("n_layer")?,
            k.usize("n_head")?,
            ffn,
            k.usize("vocab_size")?,
            k.usize("n_positions")?,
        )
        .with_normalization(Normalization::LayerNorm)
        .with_norm_epsilon(k.f64_or("layer_norm_epsilon", 1e-5)?)
        .with_activation(activation)
        .with_position_embedding(PositionEmbedding::Learned)
        .with_add_bias_linear(true)
        .with_tie_embeddings(true)
        .with_hidden_dropout(k.f64_or("resid_pdrop", 0.1)?)
        .with_attention_dropout(k.f64_or("attn_pdrop", 0.1)?)
        .with_init_std(k.f64_or("initializer_range", 0.02)?);
        Ok(Self {
            family: HfFamily::Gpt2,
            config,
        })
    }

    fn llama(k: &Keys) -> Result<Self> {
        Ok(Self {
            family: HfFamily::Llama,
            config: Self::rotary_decoder(k, LLAMA_DEFAULTS)?,
        })
    }

    fn mixtral(k: &Keys) -> Result<Self> {
        let config = Self::rotary_decoder(k, MIXTRAL_DEFAULTS)?;
        // A window as long as the longest sequence masks nothing.
        if let Some(window) = k.opt_usize("sliding_window")?
            && window < config.max_sequence_length
        {
            return Err(invalid(
                k.file,
                format!(
                    "unsupported option sliding_window = {window}: our attention sees the whole \
                     causal context (a window of at least max_position_embeddings = {} is \
                     accepted, it masks nothing)",
                    config.max_sequence_length
                ),
            ));
        }
        if k.f64_or("router_jitter_noise", 0.0)? != 0.0 {
            return Err(invalid(
                k.file,
                format!(
                    "unsupported option router_jitter_noise = {}: our router has no input \
                     jitter (supported: 0 or absent)",
                    k.f64_or("router_jitter_noise", 0.0)?
                ),
            ));
        }
        let num_experts = k.num_experts(8)?;
        let aux_loss_coeff = k.aux_loss_coeff()?;
        // Mixtral's routing as written: softmax over all experts, top-k, renormalised (which
        // also holds for top-1, where Megatron's default softmax over one logit is refused).
        let moe = MoeSettings::new(num_experts)
            .with_top_k(k.opt_usize("num_experts_per_tok")?.unwrap_or(2))
            .with_score_function(RouterScoreFunction::Softmax)
            .with_pre_softmax(true)
            .with_normalize_top_k(true)
            .with_aux_loss_coeff(aux_loss_coeff);
        checked_moe(k, &moe, &config, "num_local_experts / num_experts_per_tok")?;
        Ok(Self {
            family: HfFamily::Mixtral,
            config: config.with_moe(Some(moe)),
        })
    }

    fn qwen3_moe(k: &Keys) -> Result<Self> {
        let config = Self::rotary_decoder(k, QWEN3_MOE_DEFAULTS)?.with_qk_layernorm(true);
        if k.bool_or("use_sliding_window", false)? {
            return Err(invalid(
                k.file,
                "unsupported option use_sliding_window = true: our attention sees the whole \
                 causal context",
            ));
        }
        let layers = config.num_layers;
        // 128 is transformers' default.
        let num_experts = k.num_experts(128)?;
        let step = k.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        let dense = k.usize_list("mlp_only_layers")?;
        if num_experts == 0 || step == 0 {
            return Err(invalid(
                k.file,
                format!(
                    "num_experts = {num_experts}, decoder_sparse_step = {step}: a Qwen3-MoE \
                     without experts is a dense Qwen3, which we do not import"
                ),
            ));
        }
        // transformers' rule: layer i is sparse unless listed, when (i + 1) % step == 0.
        let pattern: Vec<bool> = (0..layers)
            .map(|i| !dense.contains(&i) && (i + 1).is_multiple_of(step))
            .collect();
        if !pattern.contains(&true) {
            return Err(invalid(
                k.file,
                "decoder_sparse_step / mlp_only_layers leave no MoE layer: a dense Qwen3, \
                 which we do not import",
            ));
        }
        let aux_loss_coeff = k.aux_loss_coeff()?;
        // Softmax over all experts, top-k, renormalised only with norm_topk_prob: Megatron's
        // pre-softmax router with or without --moe-router-topk-normalize, exactly.
        let moe = MoeSettings::new(num_experts)
            .with_ffn_hidden_size(Some(k.opt_usize("moe_intermediate_size")?.unwrap_or(768)))
            .with_top_k(k.opt_usize("num_experts_per_tok")?.unwrap_or(8))
            .with_score_function(RouterScoreFunction::Softmax)
            .with_pre_softmax(true)
            .with_normalize_top_k(k.bool_or("norm_topk_prob", false)?)
            .with_aux_loss_coeff(aux_loss_coeff)
            .with_layer_pattern((pattern.contains(&false)).then_some(pattern));
        checked_moe(
            k,
            &moe,
            &config,
            "num_experts / num_experts_per_tok / moe_intermediate_size",
        )?;
        Ok(Self {
            family: HfFamily::Qwen3Moe,
            config: config.with_moe(Some(moe)),
        })
    }

    /// The Llama-shaped part of a Llama or Mixtral config (attention, norms, RoPE; the MLP
    /// width from `intermediate_size`), with the family's defaults for absent keys.
    fn rotary_decoder(k: &Keys, defaults: RotaryDefaults) -> Result<TransformerConfig> {
        // transformers writes plain RoPE as no `rope_scaling` (older versions) or as a
        // `rope_type` of "default", with `rope_theta` inside `rope_parameters` (newer ones).
        let mut rope_theta = k.f64_or("rope_theta", defaults.rope_theta)?;
        for key in ["rope_scaling", "rope_parameters"] {
            let Some(rope) = k.get(key) else { continue };
            let kind = rope.get("rope_type").or_else(|| rope.get("type"));
            if kind.and_then(Value::as_str) != Some("default") {
                return Err(invalid(
                    k.file,
                    format!("unsupported option {key} = {rope} (plain RoPE only)"),
                ));
            }
            if let Some(theta) = rope.get("rope_theta").and_then(Value::as_f64) {
                rope_theta = theta;
            }
        }
        k.unsupported_unless("attention_bias", json!(false))?;
        k.unsupported_unless("mlp_bias", json!(false))?;
        k.unsupported_unless("hidden_act", json!("silu"))?;
        k.unsupported_unless("pretraining_tp", json!(1))?;
        let hidden = k.usize("hidden_size")?;
        let heads = k.usize("num_attention_heads")?;
        // Heads wider than hidden_size / heads (Qwen3) are our kv_channels.
        let kv_channels = k
            .opt_usize("head_dim")?
            .filter(|&head_dim| heads * head_dim != hidden);
        Ok(TransformerConfig::new(
            hidden,
            k.usize("num_hidden_layers")?,
            heads,
            k.usize("intermediate_size")?,
            k.usize("vocab_size")?,
            k.opt_usize("max_position_embeddings")?
                .unwrap_or(defaults.max_position_embeddings),
        )
        .with_kv_channels(kv_channels)
        .with_num_query_groups(Some(k.opt_usize("num_key_value_heads")?.unwrap_or(heads)))
        .with_normalization(Normalization::RmsNorm)
        .with_norm_epsilon(k.f64_or("rms_norm_eps", defaults.rms_norm_eps)?)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: rope_theta })
        .with_add_bias_linear(false)
        .with_tie_embeddings(k.bool_or("tie_word_embeddings", false)?)
        .with_scaled_output_init(false)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(k.f64_or("attention_dropout", 0.0)?)
        .with_init_std(k.f64_or("initializer_range", 0.02)?))
    }

    /// The `config.json` transformers reads for a model of `config`: an error when no
    /// transformers class has its architecture.
    pub fn to_json(config: &TransformerConfig) -> core::result::Result<Value, String> {
        let c = config;
        Ok(match HfFamily::of(c)? {
            HfFamily::Gpt2 => json!({
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_embd": c.hidden_size,
                "n_layer": c.num_layers,
                "n_head": c.num_attention_heads,
                "n_inner": c.ffn_hidden_size,
                "n_positions": c.max_sequence_length,
                "n_ctx": c.max_sequence_length,
                "vocab_size": c.vocab_size,
                "layer_norm_epsilon": c.norm_epsilon,
                "activation_function": match c.activation {
                    Activation::Gelu => "gelu",
                    _ => "gelu_new",
                },
                "resid_pdrop": c.hidden_dropout,
                "embd_pdrop": c.hidden_dropout,
                "attn_pdrop": c.attention_dropout,
                "initializer_range": c.init_std,
                "scale_attn_weights": true,
                "tie_word_embeddings": true,
                "torch_dtype": "float32",
            }),
            HfFamily::Llama => {
                let mut config = llama_shape(c);
                extend(
                    &mut config,
                    json!({
                        "model_type": "llama",
                        "architectures": ["LlamaForCausalLM"],
                        "intermediate_size": c.ffn_hidden_size,
                        "attention_bias": false,
                        "mlp_bias": false,
                    }),
                );
                config
            }
            HfFamily::Mixtral => {
                let moe = c
                    .moe
                    .as_ref()
                    .expect("HfFamily::of checks a Mixtral has MoE");
                let mut config = llama_shape(c);
                extend(
                    &mut config,
                    json!({
                        "model_type": "mixtral",
                        "architectures": ["MixtralForCausalLM"],
                        "intermediate_size": moe.ffn_hidden_size.unwrap_or(c.ffn_hidden_size),
                        "sliding_window": null,
                        "num_local_experts": moe.num_experts,
                        "num_experts_per_tok": moe.top_k,
                        "output_router_logits": moe.aux_loss_coeff > 0.0,
                        "router_aux_loss_coef": moe.aux_loss_coeff,
                        "router_jitter_noise": 0.0,
                    }),
                );
                config
            }
            HfFamily::Qwen3Moe => {
                let moe = c
                    .moe
                    .as_ref()
                    .expect("HfFamily::of checks a Qwen3-MoE has MoE");
                let dense: Vec<usize> = (0..c.num_layers)
                    .filter(|&l| !moe.is_moe_layer(l))
                    .collect();
                let mut config = llama_shape(c);
                extend(
                    &mut config,
                    json!({
                        "model_type": "qwen3_moe",
                        "architectures": ["Qwen3MoeForCausalLM"],
                        "intermediate_size": c.ffn_hidden_size,
                        "moe_intermediate_size": moe.ffn_hidden_size.unwrap_or(c.ffn_hidden_size),
                        "num_experts": moe.num_experts,
                        "num_experts_per_tok": moe.top_k,
                        // Megatron's default (softmax over the k chosen logits) sums to one.
                        "norm_topk_prob": moe.normalize_top_k || !moe.pre_softmax,
                        "decoder_sparse_step": 1,
                        "mlp_only_layers": dense,
                        "attention_bias": false,
                        "use_sliding_window": false,
                        "sliding_window": null,
                        "output_router_logits": moe.aux_loss_coeff > 0.0,
                        "router_aux_loss_coef": moe.aux_loss_coeff,
                    }),
                );
                config
            }
        })
    }
}

/// The `config.json` keys Llama, Mixtral and Qwen3-MoE share (a Mixtral is a Llama whose
/// MLPs are experts).
fn llama_shape(c: &TransformerConfig) -> Value {
    let PositionEmbedding::Rope { base } = c.position_embedding else {
        unreachable!("HfFamily::of checks a Llama, Mixtral or Qwen3-MoE has RoPE")
    };
    json!({
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.query_groups(),
        "head_dim": c.head_dim(),
        "rms_norm_eps": c.norm_epsilon,
        "rope_theta": base,
        "rope_scaling": null,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_sequence_length,
        "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": c.attention_dropout,
        "initializer_range": c.init_std,
        "torch_dtype": "float32",
    })
}

/// `config` with the keys of `more` added.
fn extend(config: &mut Value, more: Value) {
    if let (Value::Object(config), Value::Object(more)) = (config, more) {
        config.extend(more);
    }
}
