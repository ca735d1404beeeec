//! Causal self-attention with its heads split across tensor-parallel ranks.

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::{DistError, DistResult, ProcessGroup};

use super::attention_core::AttentionCore;
use super::config::{PositionEmbedding, Recompute, TransformerConfig};
use super::norm::Norm;
use crate::backend::ModelBackend;
use crate::context_parallel::{CpContext, context_parallel_flash_attention};
use crate::error::ConfigError;
use crate::init::param_seed;
use crate::ops::RecomputedAttention;
use crate::ops::rope::packed_rope_at;
use crate::ops::{flash_attention, packed_flash_attention};
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, DeclarePlacements, DropoutSite, Placements,
    RowParallelLinear, RowParallelLinearConfig, SequenceParallelGrads, TpContext,
};

/// Megatron's `ParallelAttention`: a column-parallel QKV projection, attention over this
/// rank's heads, and a row-parallel output projection.
///
/// The attention runs as flash attention (no `[batch, heads, seq, seq]` tensor is stored,
/// K/V heads are not repeated) unless attention dropout is active (`attention_dropout > 0`
/// while training), which needs the probabilities: then the unfused [`AttentionCore`] runs,
/// with selective recomputation if configured. With RoPE, the query and key heads of the QKV
/// projection's output are rotated in place of the packed layout first
/// ([`RopeOps::packed_rope`](crate::ops::RopeOps::packed_rope)); flash attention then
/// takes that output as it is ([`crate::ops::packed_flash_attention`]: no split copies, one
/// gradient buffer).
///
/// Heads are split by query group, so a rank holds whole groups: its query heads with the
/// key/value head they share (GQA; plain multi-head attention is one head per group). The QKV
/// weight's columns are ordered group by group, `[q heads of the group, k, v] × head_dim`, so
/// that a contiguous column slice is a set of whole groups.
///
/// With QK-norm ([`TransformerConfig::qk_layernorm`], Megatron's `--qk-layernorm`, as in
/// Qwen3), each query head's and each key head's vector of `head_dim` is normalised (the
/// model's normalisation and epsilon, one weight of `[head_dim]` for the queries and one for
/// the keys, shared by the heads) after the QKV projection and before RoPE, also in the
/// KV-cached decoding and under context parallelism.
///
/// Under context parallelism ([`with_context_parallel`](Self::with_context_parallel)) the
/// rank's tokens are its two chunks of the sequence: RoPE rotates them at their global
/// positions and the attention is [`context_parallel_flash_attention`] over the CP group.
#[derive(Module, Debug)]
pub struct ParallelAttention<B: Backend> {
    /// `hidden → groups · (heads_per_group + 2) · head_dim`, split by groups.
    pub qkv: ColumnParallelLinear<B>,
    /// `heads · head_dim → hidden`, split by heads.
    pub output: RowParallelLinear<B>,
    /// The queries' per-head norm (QK-norm; `None` without it): scale `[head_dim]`,
    /// replicated over TP, its gradient summed over the TP group ([`Norm::per_head`]).
    pub q_norm: Option<Norm<B>>,
    /// The keys' per-head norm, as `q_norm`.
    pub k_norm: Option<Norm<B>>,
    #[module(skip)]
    shape: AttentionShape,
    /// The context-parallel group, when CP > 1.
    #[module(skip)]
    cp: Option<CpContext>,
}

/// The head layout on this rank.
#[derive(Debug, Clone, Copy)]
struct AttentionShape {
    heads: usize,
    local_groups: usize,
    heads_per_group: usize,
    head_dim: usize,
    first_head: usize,
    rope_base: Option<f64>,
    dropout: f64,
    recompute: Recompute,
    flash: bool,
}

impl<B: Backend> DeclarePlacements for ParallelAttention<B> {
    fn declare_placements(&self, out: &mut Placements) {
        self.qkv.declare_placements(out);
        self.output.declare_placements(out);
        for norm in self.q_norm.iter().chain(&self.k_norm) {
            norm.declare_placements(out);
        }
    }
}

impl<B: Backend> ParallelAttention<B> {
    /// The same attention (same parameters and ids), summing the output projection's partial
    /// bias gradient under sequence parallelism where `grads` says.
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        self.map_tp_context(&|tp| tp.with_sequence_parallel_grads(grads))
    }

    /// The same attention (same parameters and ids) with its layers' tensor-parallel
    /// contexts mapped by `f`.
    pub fn map_tp_context(self, f: &dyn Fn(TpContext) -> TpContext) -> Self {
        Self {
            qkv: self.qkv.map_tp_context(f),
            output: self.output.map_tp_context(f),
            q_norm: self.q_norm.map(|n| n.map_tp_context(f)),
            k_norm: self.k_norm.map(|n| n.map_tp_context(f)),
            ..self
        }
    }

    /// The same attention (same parameters and ids) over the context-parallel group of `cp`
    /// (`None`, or a group of one rank: the whole sequence on every rank); FP8 projections
    /// reduce their activations' amaxes over it. Attention dropout has no context-parallel
    /// form: a [`ConfigError`] if it is configured.
    pub fn with_context_parallel(self, cp: Option<CpContext>) -> Result<Self, ConfigError> {
        let cp = cp.filter(|cp| cp.size() > 1);
        if cp.is_some() && self.shape.dropout > 0.0 {
            return Err(ConfigError::Invalid(format!(
                "attention dropout ({}) is not supported with context parallelism: set \
                 --attention-dropout 0",
                self.shape.dropout
            )));
        }
        let group = cp.as_ref().map(|cp| &cp.group);
        Ok(Self {
            qkv: self.qkv.with_sequence_group(group),
            output: self.output.with_sequence_group(group),
            cp,
            ..self
        })
    }
}

impl<B: Backend> ParallelAttention<B> {
    /// This rank's head layout for an incremental (KV-cached) forward pass:
    /// `(local_groups, heads_per_group, head_dim, rope_base)`; the QKV projection's output
    /// reshapes to `[batch, seq, local_groups, heads_per_group + 2, head_dim]`.
    pub(crate) fn decode_layout(&self) -> (usize, usize, usize, Option<f64>) {
        let s = self.shape;
        (s.local_groups, s.heads_per_group, s.head_dim, s.rope_base)
    }
}

impl<B: ModelBackend> ParallelAttention<B> {
    /// This rank's part of layer `layer`'s attention.
    pub fn new(
        config: &TransformerConfig,
        layer: usize,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        let heads = config.num_attention_heads;
        let groups = config.query_groups();
        let head_dim = config.head_dim();
        let heads_per_group = heads / groups;
        let local_groups = groups / tp.size();
        let seed =
            |name: &str| param_seed(config.seed, &format!("layers.{layer}.attention.{name}"));
        let qkv = ColumnParallelLinearConfig::new(
            config.hidden_size,
            groups * (heads_per_group + 2) * head_dim,
        )
        .with_bias(config.add_bias_linear)
        .with_sequence_parallel(config.sequence_parallel)
        .with_comm_overlap(config.tp_comm_overlap)
        .with_init_std(config.init_std)
        .with_fp8(config.fp8_for_layer(layer))
        .init(tp, seed("qkv"), device)?;
        let output = RowParallelLinearConfig::new(heads * head_dim, config.hidden_size)
            .with_bias(config.add_bias_linear)
            .with_sequence_parallel(config.sequence_parallel)
            .with_comm_overlap(config.tp_comm_overlap)
            .with_init_std(output_init_std(config))
            .with_fp8(config.fp8_for_layer(layer))
            .init(tp, seed("output"), device)?;
        let context = TpContext::new(tp, config.sequence_parallel);
        let qk_norm = || {
            config.qk_layernorm.then(|| {
                Norm::per_head(
                    config.normalization,
                    head_dim,
                    config.norm_epsilon,
                    &context,
                    device,
                )
            })
        };
        Ok(Self {
            qkv,
            output,
            q_norm: qk_norm(),
            k_norm: qk_norm(),
            shape: AttentionShape {
                heads,
                local_groups,
                heads_per_group,
                head_dim,
                first_head: tp.rank() * local_groups * heads_per_group,
                rope_base: match config.position_embedding {
                    PositionEmbedding::Rope { base } => Some(base),
                    PositionEmbedding::Learned => None,
                },
                dropout: config.attention_dropout,
                recompute: config.recompute,
                flash: config.flash_attention,
            },
            cp: None,
        })
    }

    /// Self-attention of `x`, causal, with the residual stream's width in and out.
    ///
    /// # Shapes
    /// - x and the output: `[batch, seq, hidden]` (`seq / tp` under sequence parallelism;
    ///   under context parallelism `seq` is this rank's two chunks, `seq / cp` of the
    ///   sequence, in split order)
    pub fn try_forward(&self, x: Tensor<B, 3>, site: DropoutSite) -> DistResult<Tensor<B, 3>> {
        let s = self.shape;
        let qkv = self.qkv.try_forward(x)?;
        let [batch, seq, _] = qkv.dims();
        let local_heads = s.local_groups * s.heads_per_group;
        let qkv = qkv.reshape([
            batch,
            seq,
            s.local_groups,
            s.heads_per_group + 2,
            s.head_dim,
        ]);
        let qkv = self.qk_norm(qkv)?;
        let core = AttentionCore {
            scale: 1.0 / (s.head_dim as f64).sqrt(),
            dropout: s.dropout,
            training: B::ad_enabled(&qkv.device()),
            site,
            heads: s.heads,
            first_head: s.first_head,
        };
        if let Some(cp) = &self.cp {
            let context = self.context_parallel(qkv, core.scale, cp)?;
            let context = context.reshape([batch, seq, local_heads * s.head_dim]);
            return self.output.try_forward(context);
        }
        let flash = s.flash && !core.dropout_active();
        let qkv = match s.rope_base {
            Some(base) => B::packed_rope(qkv, base),
            None => qkv,
        };
        let context = if flash {
            // `[batch, seq, heads, head_dim]`: the heads merge below without a copy.
            packed_flash_attention::attention(qkv, core.scale, true)
        } else {
            self.split_attention(qkv, core, flash).swap_dims(1, 2)
        };
        let context = context.reshape([batch, seq, local_heads * s.head_dim]);
        self.output.try_forward(context)
    }

    /// The packed `qkv` (`[batch, seq, local_groups, heads_per_group + 2, head_dim]`) with its
    /// query and key heads normalised (QK-norm), or as it is without QK-norm.
    pub(crate) fn qk_norm(&self, qkv: Tensor<B, 5>) -> DistResult<Tensor<B, 5>> {
        let (Some(q_norm), Some(k_norm)) = (&self.q_norm, &self.k_norm) else {
            return Ok(qkv);
        };
        let per_group = self.shape.heads_per_group;
        let q = q_norm.try_forward(qkv.clone().narrow(3, 0, per_group))?;
        let k = k_norm.try_forward(qkv.clone().narrow(3, per_group, 1))?;
        Ok(Tensor::cat(vec![q, k, qkv.narrow(3, per_group + 1, 1)], 3))
    }

    /// The attention of the packed `qkv` (`[batch, seq, local_groups, heads_per_group + 2,
    /// head_dim]`, this rank's chunks) over the context-parallel group, RoPE at the tokens'
    /// global positions: `[batch, seq, local_heads, head_dim]`. The fused flash attention
    /// for `p2p` and `a2a` ([`context_parallel_flash_attention`]), on every backend.
    fn context_parallel(
        &self,
        qkv: Tensor<B, 5>,
        scale: f64,
        cp: &CpContext,
    ) -> DistResult<Tensor<B, 4>> {
        // The model checks the sequence before the layers run: an error here is a
        // collective's, or a shape only a direct caller of the layer can get wrong.
        let to_dist = |e: crate::Error| match e {
            crate::Error::Dist(e) => e,
            other => DistError::InvalidArgument(other.to_string()),
        };
        let qkv = match self.shape.rope_base {
            Some(base) => {
                let positions = cp.positions(qkv.dims()[1]).map_err(|e| to_dist(e.into()))?;
                packed_rope_at(qkv, &positions, base)
            }
            None => qkv,
        };
        let [q, k, v] = packed_flash_attention::split(qkv);
        let out = context_parallel_flash_attention(q, k, v, &cp.group, scale, cp.comm)
            .map_err(to_dist)?;
        Ok(out.swap_dims(1, 2))
    }

    /// The attention of the packed `qkv` (`[batch, seq, local_groups, heads_per_group + 2,
    /// head_dim]`) split into q, k and v, through [`flash_attention`] or the unfused core:
    /// `[batch, heads, seq, head_dim]`.
    fn split_attention(&self, qkv: Tensor<B, 5>, core: AttentionCore, flash: bool) -> Tensor<B, 4> {
        let s = self.shape;
        let [batch, seq, ..] = qkv.dims();
        let local_heads = s.local_groups * s.heads_per_group;
        let [q, k, v] = packed_flash_attention::split(qkv);
        if flash {
            return flash_attention::attention(q, k, v, core.scale, true);
        }
        // Dropout on the probabilities needs them materialised: the unfused core, with each
        // key/value head repeated for its group's query heads.
        let repeat = |t: Tensor<B, 4>| -> Tensor<B, 4> {
            t.unsqueeze_dim::<5>(2)
                .expand([batch, s.local_groups, s.heads_per_group, seq, s.head_dim])
                .reshape([batch, local_heads, seq, s.head_dim])
        };
        let (k, v) = (repeat(k), repeat(v));
        match s.recompute {
            Recompute::Selective => B::recomputed_attention_core(q, k, v, core),
            Recompute::None
            | Recompute::Full
            | Recompute::FullUniform { .. }
            | Recompute::FullBlock { .. } => core.forward(q, k, v),
        }
    }
}

/// The initialisation scale of the layers that write into the residual stream.
pub(crate) fn output_init_std(config: &TransformerConfig) -> f64 {
    if config.scaled_output_init {
        config.init_std / (2.0 * config.num_layers as f64).sqrt()
    } else {
        config.init_std
    }
}
