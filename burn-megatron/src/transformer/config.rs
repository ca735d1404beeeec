//! The one configuration that drives a transformer model, in the spirit of Megatron-Core's
//! `TransformerConfig`.

use burn::config::Config;

use super::moe::settings::MoeSettings;
use crate::error::ConfigError;
use crate::ops::GeluForm;
use crate::ops::fp8::{Fp8Config, Fp8Recipe};
use crate::tensor_parallel::VocabPartition;

/// Normalisation layer.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum Normalization {
    /// LayerNorm with a scale and a shift (GPT).
    LayerNorm,
    /// RMSNorm with a scale (Llama).
    RmsNorm,
}

/// Activation of the MLP.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum Activation {
    /// `fc2(gelu(fc1(x)))` with the exact GeLU, `x · Φ(x)` ([`GeluForm::Erf`]; PyTorch's
    /// `gelu`, Megatron's default `activation_func`).
    Gelu,
    /// `fc2(gelu(fc1(x)))` with GeLU's tanh approximation ([`GeluForm::Tanh`]; GPT-2's
    /// `gelu_new`, Megatron's fused bias-GeLU). The GPT-2 presets use it.
    GeluTanh,
    /// `fc2(silu(gate(x)) * fc1(x))` (Llama).
    SwiGlu,
}

impl Activation {
    /// The GeLU form, for the GeLU activations.
    pub fn gelu_form(self) -> Option<GeluForm> {
        match self {
            Self::Gelu => Some(GeluForm::Erf),
            Self::GeluTanh => Some(GeluForm::Tanh),
            Self::SwiGlu => None,
        }
    }
}

/// How token positions enter the model.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum PositionEmbedding {
    /// A learned `[max_sequence_length, hidden_size]` table added to the token embeddings.
    Learned,
    /// Rotary embeddings applied to queries and keys.
    Rope {
        /// The frequency base (10 000 in the RoPE paper, 500 000 in Llama 3).
        base: f64,
    },
}

/// Which activations are recomputed in the backward pass instead of stored.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum Recompute {
    /// Store everything.
    None,
    /// Recompute the attention core (scores, softmax, dropout), whose `[batch, heads, seq,
    /// seq]` activations dominate memory at long sequences. Only the unfused attention (with
    /// attention dropout) has them: flash attention stores no such tensor and is unchanged.
    Selective,
    /// Recompute each transformer layer from its input (Megatron's `--recompute-granularity
    /// full --recompute-method uniform --recompute-num-layers 1`).
    Full,
    /// Recompute the layers of each model chunk in groups of `layers`, each group from its
    /// input: fewer stored inputs, a larger group's activations live while it reruns
    /// (`--recompute-method uniform --recompute-num-layers N`).
    FullUniform {
        /// Layers a group.
        layers: usize,
    },
    /// Recompute only the first `layers` layers of each model chunk, each from its input, and
    /// store the rest's activations: trades memory for less rerun compute
    /// (`--recompute-method block --recompute-num-layers N`).
    FullBlock {
        /// Layers recomputed at the start of each chunk.
        layers: usize,
    },
}

impl Recompute {
    /// Whether whole layers are rerun in the backward pass (`Full` and its variants): such a
    /// model trains only through the schedules of
    /// [`pipeline_parallel`](crate::pipeline_parallel).
    pub fn reruns_layers(self) -> bool {
        matches!(
            self,
            Recompute::Full | Recompute::FullUniform { .. } | Recompute::FullBlock { .. }
        )
    }

    /// A chunk of `num_layers` layers cut into consecutive ranges, each with whether it is
    /// recomputed from its input (`true`) or stored (`false`; at most one, the last).
    pub fn segments(self, num_layers: usize) -> Vec<(core::ops::Range<usize>, bool)> {
        let groups = |size: usize| {
            (0..num_layers)
                .step_by(size.max(1))
                .map(|start| (start..(start + size.max(1)).min(num_layers), true))
                .collect::<Vec<_>>()
        };
        match self {
            Recompute::None | Recompute::Selective => vec![(0..num_layers, false)],
            Recompute::Full => groups(1),
            Recompute::FullUniform { layers } => groups(layers),
            Recompute::FullBlock { layers } => {
                let rerun = layers.min(num_layers);
                let mut out: Vec<_> = (0..rerun).map(|i| (i..i + 1, true)).collect();
                if rerun < num_layers {
                    out.push((rerun..num_layers, false));
                }
                out
            }
        }
    }
}

/// Shape, layers, initialisation and parallelism of a GPT- or Llama-style transformer.
#[derive(Config, Debug)]
pub struct TransformerConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Number of transformer layers.
    pub num_layers: usize,
    /// Attention (query) heads.
    pub num_attention_heads: usize,
    /// Key/value heads shared by groups of query heads (GQA); equal to the heads for plain
    /// multi-head attention (the default), 1 for multi-query attention.
    pub num_query_groups: Option<usize>,
    /// Hidden width of the MLP.
    pub ffn_hidden_size: usize,
    /// Width of each attention head (Megatron's `--kv-channels`); `None`: `hidden_size /
    /// num_attention_heads`. Qwen3's heads are wider than that (128 at a hidden size of 2048
    /// with 32 heads): the QKV projection is then `hidden → (heads + 2 · groups) · kv_channels`
    /// and the output projection `heads · kv_channels → hidden`.
    #[config(default = "None")]
    pub kv_channels: Option<usize>,
    /// Real vocabulary size (padded for TP, see `make_vocab_size_divisible_by`).
    pub vocab_size: usize,
    /// Longest sequence the model takes.
    pub max_sequence_length: usize,
    /// Normalisation layer.
    #[config(default = "Normalization::LayerNorm")]
    pub normalization: Normalization,
    /// Epsilon of the normalisation.
    #[config(default = 1e-5)]
    pub norm_epsilon: f64,
    /// QK-norm (Megatron's `--qk-layernorm`; Qwen3): each query and key head's vector
    /// normalised by the model's normalisation over `head_dim`, with weights `[head_dim]`
    /// shared by the heads, after the QKV projection and before RoPE.
    #[config(default = false)]
    pub qk_layernorm: bool,
    /// Activation of the MLP.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Position embedding.
    #[config(default = "PositionEmbedding::Learned")]
    pub position_embedding: PositionEmbedding,
    /// Whether linear layers have biases.
    #[config(default = true)]
    pub add_bias_linear: bool,
    /// Dropout on the embeddings and on each block's output before the residual add.
    #[config(default = 0.0)]
    pub hidden_dropout: f64,
    /// Dropout on the attention probabilities. Above 0, training falls back to the unfused
    /// attention, which materialises the `[batch, heads, seq, seq]` probabilities (recomputed
    /// under [`Recompute::Selective`]); at 0, and in evaluation, flash attention runs
    /// (`ops::flash_attention`). [`TransformerConfig::validate`] adds a note saying so.
    #[config(default = 0.0)]
    pub attention_dropout: f64,
    /// Whether the output layer reuses the token embedding table.
    #[config(default = true)]
    pub tie_embeddings: bool,
    /// Standard deviation of the normal initialisation.
    #[config(default = 0.02)]
    pub init_std: f64,
    /// Whether the layers writing into the residual stream (attention output, MLP down
    /// projection) use `init_std / sqrt(2 · num_layers)`, as GPT-2 and Megatron do.
    #[config(default = true)]
    pub scaled_output_init: bool,
    /// The vocabulary is padded to a multiple of this times the TP size.
    #[config(default = 128)]
    pub make_vocab_size_divisible_by: usize,
    /// Sequence parallelism: outside the tensor-parallel regions, activations are split
    /// along the sequence over the TP group, cutting their memory by TP.
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Under sequence parallelism, the column-parallel projections (QKV, fc1 or SwiGLU's gate
    /// and up) run with their input's all-gather as one operation whose backward
    /// reduce-scatters the input's gradient while it computes the weights' gradients
    /// (Megatron's `--tp-comm-overlap`; [`crate::ops::gathered_linear`]). Same results; no
    /// effect without sequence parallelism or in FP8.
    #[config(default = false)]
    pub tp_comm_overlap: bool,
    /// Activation recomputation.
    #[config(default = "Recompute::None")]
    pub recompute: Recompute,
    /// Whether attention runs as flash attention where attention dropout allows it (the
    /// default). `false` runs the unfused attention always, e.g. to compare the two.
    #[config(default = true)]
    pub flash_attention: bool,
    /// Seed of the initialisation and of the dropout masks.
    #[config(default = 1234)]
    pub seed: u64,
    /// Mixture of experts in place of the MLP of every layer or some (`--num-experts`,
    /// `--moe-*`); `None`: dense MLPs only.
    #[config(default = "None")]
    pub moe: Option<MoeSettings>,
    /// FP8 GEMMs in every transformer layer's linear layers (QKV, attention output, the
    /// MLP's; `--fp8-format`, `--fp8-recipe`, ...); `None`: the model's dtype throughout. The
    /// embedding, the output layer, norms, softmax, the loss and the experts of MoE layers
    /// stay in the model's dtype.
    #[config(default = "None")]
    pub fp8: Option<Fp8Config>,
}

/// A configuration checked against a TP size, with notes for the user (e.g. vocab padding).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedConfig {
    /// The vocabulary as split over TP.
    pub vocab: VocabPartition,
    /// Things the user should know, such as padding added to the vocabulary.
    pub notes: Vec<String>,
}

impl TransformerConfig {
    fn gpt2(num_layers: usize, hidden_size: usize, heads: usize) -> Self {
        Self::gpt(num_layers, hidden_size, heads, 1024)
    }

    /// A GPT with GPT-2's vocabulary, FFN width, GeLU (tanh form, as GPT-2's) and dropout.
    fn gpt(num_layers: usize, hidden_size: usize, heads: usize, seq: usize) -> Self {
        Self::new(hidden_size, num_layers, heads, 4 * hidden_size, 50257, seq)
            .with_activation(Activation::GeluTanh)
            .with_hidden_dropout(0.1)
            .with_attention_dropout(0.1)
    }

    /// GPT-2 small: 12 layers, 768 wide, 12 heads (124M parameters).
    pub fn gpt2_124m() -> Self {
        Self::gpt2(12, 768, 12)
    }
    /// GPT-2 medium: 24 layers, 1024 wide, 16 heads (350M).
    pub fn gpt2_350m() -> Self {
        Self::gpt2(24, 1024, 16)
    }
    /// GPT-2 large: 36 layers, 1280 wide, 20 heads (774M).
    pub fn gpt2_774m() -> Self {
        Self::gpt2(36, 1280, 20)
    }
    /// GPT-2 XL: 48 layers, 1600 wide, 25 heads (1.5B). 25 heads allow TP of 1, 5 or 25 only.
    pub fn gpt2_1_5b() -> Self {
        Self::gpt2(48, 1600, 25)
    }

    /// Megatron's 1.3B GPT: 24 layers, 2048 wide, 16 heads, sequences of 2048, GPT-2's
    /// vocabulary (GPT-3 XL's size).
    pub fn gpt_1_3b() -> Self {
        Self::gpt(24, 2048, 16, 2048)
    }

    fn llama(layers: usize, hidden: usize, heads: usize, groups: usize, ffn: usize) -> Self {
        Self::new(hidden, layers, heads, ffn, 128_256, 8192)
            .with_num_query_groups(Some(groups))
            .with_normalization(Normalization::RmsNorm)
            .with_activation(Activation::SwiGlu)
            .with_position_embedding(PositionEmbedding::Rope { base: 500_000.0 })
            .with_add_bias_linear(false)
            .with_scaled_output_init(false)
    }

    /// Llama-3.2-1B's shape: 16 layers, 2048 wide, 32 heads in 8 query groups.
    pub fn llama_1b() -> Self {
        Self::llama(16, 2048, 32, 8, 8192)
    }
    /// Llama-3.2-3B's shape: 28 layers, 3072 wide, 24 heads in 8 query groups.
    pub fn llama_3b() -> Self {
        Self::llama(28, 3072, 24, 8, 8192)
    }
    /// Llama-3.1-8B's shape: 32 layers, 4096 wide, 32 heads in 8 query groups, untied output.
    pub fn llama_8b() -> Self {
        Self::llama(32, 4096, 32, 8, 14_336).with_tie_embeddings(false)
    }

    /// Key/value heads.
    pub fn query_groups(&self) -> usize {
        self.num_query_groups.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head: `kv_channels`, or `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.kv_channels
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The FP8 settings of global layer `layer`'s linear layers: [`fp8`](Self::fp8), unless
    /// `--first-last-layers-bf16` keeps the layer in the model's dtype
    /// ([`Fp8Config::covers_layer`]).
    pub fn fp8_for_layer(&self, layer: usize) -> Option<Fp8Config> {
        (self.fp8.clone()).filter(|fp8| fp8.covers_layer(layer, self.num_layers))
    }

    /// Width of all query heads together, `num_attention_heads · head_dim` (the hidden size
    /// unless `kv_channels` is set).
    pub fn query_width(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }

    /// Checks the configuration for a TP group of `tp` ranks (this one being `tp_rank`):
    /// every size, the divisibility by TP, the dropouts (in `[0, 1)`), the norm epsilon and
    /// the initialisation's standard deviation (positive, finite), the RoPE base (finite,
    /// above 1). A NaN fails every check. Building a model calls it, and so does
    /// [`PretrainConfig::check`](crate::training::PretrainConfig::check).
    pub fn validate(&self, tp: usize, tp_rank: usize) -> Result<ValidatedConfig, ConfigError> {
        for (name, value) in [
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.vocab_size),
            ("max_sequence_length", self.max_sequence_length),
            ("num_query_groups", self.query_groups()),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid(format!("{name} must be at least 1")));
            }
        }
        if let Recompute::FullUniform { layers: 0 } | Recompute::FullBlock { layers: 0 } =
            self.recompute
        {
            return Err(ConfigError::Invalid(
                "recomputation of 0 layers (--recompute-num-layers 0): give at least 1, or \
                 leave --recompute-granularity out"
                    .into(),
            ));
        }
        if self.kv_channels == Some(0) {
            return Err(ConfigError::Invalid(
                "kv_channels (--kv-channels) must be at least 1".into(),
            ));
        }
        if self.kv_channels.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(ConfigError::Invalid(format!(
                "hidden size ({}) must be divisible by the attention heads ({})",
                self.hidden_size, self.num_attention_heads
            )));
        }
        if !self.num_attention_heads.is_multiple_of(self.query_groups()) {
            return Err(ConfigError::Invalid(format!(
                "attention heads ({}) must be divisible by the query groups ({})",
                self.num_attention_heads,
                self.query_groups()
            )));
        }
        ConfigError::check_divisible("attention heads", self.num_attention_heads, tp)?;
        ConfigError::check_divisible("query groups", self.query_groups(), tp)?;
        ConfigError::check_divisible("FFN hidden size", self.ffn_hidden_size, tp)?;
        if self.sequence_parallel {
            ConfigError::check_divisible(
                "maximum sequence length (sequence parallelism splits it)",
                self.max_sequence_length,
                tp,
            )?;
        }
        if let PositionEmbedding::Rope { base } = self.position_embedding {
            if !self.head_dim().is_multiple_of(2) || base <= 1.0 {
                return Err(ConfigError::Invalid(format!(
                    "RoPE needs an even head dimension (got {}) and a base above 1 (got {base})",
                    self.head_dim()
                )));
            }
            if !base.is_finite() {
                return Err(ConfigError::Invalid(format!(
                    "the RoPE base (--rotary-base) is {base}: it must be a finite number above 1"
                )));
            }
        }
        for (name, p) in [
            ("hidden_dropout", self.hidden_dropout),
            ("attention_dropout", self.attention_dropout),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(ConfigError::Invalid(format!(
                    "{name} must be in [0, 1), got {p}"
                )));
            }
        }
        if self.norm_epsilon <= 0.0 {
            return Err(ConfigError::Invalid(format!(
                "norm_epsilon must be positive, got {}",
                self.norm_epsilon
            )));
        }
        if !self.norm_epsilon.is_finite() {
            return Err(ConfigError::Invalid(format!(
                "norm_epsilon (--norm-epsilon) is {}: it must be positive and finite",
                self.norm_epsilon
            )));
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "init_std (--init-method-std) is {}: the initialisation's standard deviation \
                 must be positive and finite",
                self.init_std
            )));
        }
        if let Some(fp8) = &self.fp8 {
            fp8.validate()?;
            fp8.validate_layers(self.num_layers)?;
            if fp8.recipe == Fp8Recipe::Delayed && self.recompute.reruns_layers() {
                return Err(ConfigError::Invalid(
                    "--fp8-recipe delayed with full recomputation is not supported yet: the \
                     rerun forward pass would cast with a scale its first run has already \
                     moved on; use --fp8-recipe tensorwise (stateless) or leave \
                     --recompute-granularity full out"
                        .into(),
                ));
            }
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.hidden_size, self.ffn_hidden_size, self.num_layers, 1)?;
            if moe.has_global_aux_loss() && self.recompute.reruns_layers() {
                return Err(ConfigError::Invalid(
                    "--moe-router-load-balancing-type global_aux_loss with full recomputation \
                     is not supported yet: the rerun forward pass would count its micro-batch's \
                     load a second time; use aux_loss or leave --recompute-granularity full out"
                        .into(),
                ));
            }
        }
        let vocab = VocabPartition::new(
            self.vocab_size,
            self.make_vocab_size_divisible_by,
            tp,
            tp_rank,
        )?;
        let mut notes: Vec<String> = vocab.padding_note().into_iter().collect();
        if self.attention_dropout > 0.0 {
            notes.push(format!(
                "attention_dropout = {}: training runs the unfused attention, which \
                 materialises the [batch, heads, seq, seq] probabilities; flash attention runs \
                 only with attention dropout 0 and in evaluation",
                self.attention_dropout
            ));
        }
        Ok(ValidatedConfig { vocab, notes })
    }
}
