//! One pre-norm transformer layer.

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::mapping::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
};
use burn_megatron_dist::{DistError, DistResult, ProcessGroup};

use super::attention::ParallelAttention;
use super::config::TransformerConfig;
use super::mlp::ParallelMlp;
use super::moe::{JitterSite, MoeLayer, MoeLosses};
use super::norm::Norm;
use crate::backend::ModelBackend;
use crate::context_parallel::CpContext;
use crate::error::ConfigError;
use crate::init::param_seed;
use crate::tensor_parallel::{DeclarePlacements, Placements, SequenceParallelGrads, TpContext};
use crate::tensor_parallel::{DropoutSite, ParamPlacement, SEQ_DIM, dropout};

/// `x + dropout(attention(norm(x)))`, then `x + dropout(mlp(norm(x)))`, the MLP being a
/// mixture of experts ([`MoeLayer`]) in the layers the configuration's
/// [`moe`](TransformerConfig::moe) picks.
///
/// The residual stream is `[batch, seq, hidden]`, replicated over the TP group, or
/// `[batch, seq / tp, hidden]` (this rank's part of the sequence) under sequence parallelism.
#[derive(Module, Debug)]
pub struct TransformerLayer<B: Backend> {
    /// Norm before attention.
    pub input_norm: Norm<B>,
    /// Self-attention.
    pub attention: ParallelAttention<B>,
    /// Norm before the MLP.
    pub post_attention_norm: Norm<B>,
    /// The dense MLP; `None` in an MoE layer.
    pub mlp: Option<ParallelMlp<B>>,
    /// The mixture of experts in place of the MLP; `None` in a dense layer.
    pub moe: Option<MoeLayer<B>>,
    #[module(skip)]
    context: LayerContext,
}

/// What a layer needs to place its dropout masks.
#[derive(Debug, Clone)]
pub(crate) struct LayerContext {
    pub index: usize,
    pub seed: u64,
    pub hidden_dropout: f64,
    pub tp: TpContext,
    /// The context-parallel group, when CP > 1: the rank's tokens are two chunks of the
    /// sequence, which places the dropout masks.
    pub cp: Option<CpContext>,
}

impl<B: Backend> DeclarePlacements for TransformerLayer<B> {
    fn declare_placements(&self, out: &mut Placements) {
        self.input_norm.declare_placements(out);
        self.attention.declare_placements(out);
        self.post_attention_norm.declare_placements(out);
        self.mlp.declare_placements(out);
        self.moe.declare_placements(out);
    }
}

/// The router replicated, the routed experts split over EP ([`ParamPlacement::expert`]);
/// under expert tensor parallelism the routed and shared experts' hidden width is split over
/// its group too (`fc1` and `gate` along dimension 2, `fc2` along dimension 1), otherwise the
/// shared expert is replicated.
impl<B: Backend> DeclarePlacements for MoeLayer<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare(&self.router.weight, ParamPlacement::replicated());
        if let Some(bias) = &self.router.expert_bias {
            out.declare(bias, ParamPlacement::frozen_buffer());
        }
        let ep = self.dispatcher().ep();
        let (up, down) = match self.expert_tp() {
            Some(tp) => (
                ParamPlacement::expert_sharded(2, tp, ep),
                ParamPlacement::expert_sharded(1, tp, ep),
            ),
            None => (ParamPlacement::expert(ep), ParamPlacement::expert(ep)),
        };
        let experts = &self.experts;
        out.declare(&experts.fc1, up);
        out.declare(&experts.fc2, down);
        if let Some(gate) = &experts.gate {
            out.declare(gate, up);
        }
        if let Some(shared) = &self.shared_expert {
            match self.expert_tp() {
                Some(tp) => {
                    out.declare(&shared.fc1, ParamPlacement::sharded(2, tp));
                    out.declare(&shared.fc2, ParamPlacement::sharded(1, tp));
                    if let Some(gate) = &shared.gate {
                        out.declare(gate, ParamPlacement::sharded(2, tp));
                    }
                }
                None => out.declare_replicated(shared),
            }
        }
    }
}

impl<B: Backend> TransformerLayer<B> {
    /// The same layer (same parameters and ids), summing the gradients sequence parallelism
    /// leaves partial (its norms', its row-parallel biases') where `grads` says: in the
    /// backward pass, or after it
    /// ([`sum_sequence_parallel_grads`](crate::tensor_parallel::sum_sequence_parallel_grads)).
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        self.map_tp_context(&|tp| tp.with_sequence_parallel_grads(grads))
    }

    /// The same layer (same parameters and ids) with its tensor-parallel contexts (its own
    /// and its norms', attention's and MLP's) mapped by `f`. An MoE layer has none; its
    /// experts take the backward hook of the layer's new context
    /// ([`MoeLayer::with_backward_hook`]).
    pub fn map_tp_context(self, f: &dyn Fn(TpContext) -> TpContext) -> Self {
        let tp = f(self.context.tp);
        Self {
            input_norm: self.input_norm.map_tp_context(f),
            attention: self.attention.map_tp_context(f),
            post_attention_norm: self.post_attention_norm.map_tp_context(f),
            mlp: self.mlp.map(|mlp| mlp.map_tp_context(f)),
            moe: self
                .moe
                .map(|moe| moe.with_backward_hook(tp.backward_hook.clone())),
            context: LayerContext { tp, ..self.context },
        }
    }
}

impl<B: Backend> TransformerLayer<B> {
    /// The same layer (same parameters and ids) over the context-parallel group of `cp`: see
    /// [`ParallelAttention::with_context_parallel`], whose errors it returns; FP8 layers
    /// reduce their activations' amaxes over the group.
    pub fn with_context_parallel(self, cp: Option<CpContext>) -> Result<Self, ConfigError> {
        let cp = cp.filter(|cp| cp.size() > 1);
        let group = cp.as_ref().map(|cp| &cp.group);
        Ok(Self {
            attention: self.attention.with_context_parallel(cp.clone())?,
            mlp: self.mlp.map(|mlp| mlp.with_sequence_group(group)),
            context: LayerContext { cp, ..self.context },
            ..self
        })
    }
}

impl<B: ModelBackend> TransformerLayer<B> {
    /// This rank's part of layer `index`. An MoE layer's experts are all on this rank; see
    /// [`new_with_ep`](Self::new_with_ep).
    pub fn new(
        config: &TransformerConfig,
        index: usize,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        let ep = single_rank_group(tp)?;
        Self::new_with_ep(config, index, tp, &ep, device)
    }

    /// This rank's part of layer `index`, an MoE layer's experts split over the
    /// expert-parallel group `ep` (its parameter values do not depend on `ep`).
    pub fn new_with_ep(
        config: &TransformerConfig,
        index: usize,
        tp: &ProcessGroup,
        ep: &ProcessGroup,
        device: &B::Device,
    ) -> Result<Self, ConfigError> {
        let moe_settings = config.moe.as_ref().filter(|moe| moe.is_moe_layer(index));
        let moe = match moe_settings {
            Some(settings) => Some(
                settings
                    .layer_config(
                        config.hidden_size,
                        config.ffn_hidden_size,
                        config.activation,
                        config.init_std,
                    )
                    .init_with_expert_tp(
                        ep,
                        settings.expert_tp_group(tp)?,
                        param_seed(config.seed, &format!("layers.{index}.moe")),
                        device,
                    )?,
            ),
            None => None,
        };
        let mlp = match moe {
            Some(_) => None,
            None => Some(ParallelMlp::new(config, index, tp, device)?),
        };
        let context = TpContext::new(tp, config.sequence_parallel);
        let norm = || {
            Norm::new(
                config.normalization,
                config.hidden_size,
                config.norm_epsilon,
                &context,
                device,
            )
        };
        Ok(Self {
            input_norm: norm(),
            attention: ParallelAttention::new(config, index, tp, device)?,
            post_attention_norm: norm(),
            mlp,
            moe,
            context: LayerContext {
                index,
                seed: config.seed,
                hidden_dropout: config.hidden_dropout,
                tp: context.clone(),
                cp: None,
            },
        })
    }

    /// Runs the layer for the model's `call`-th forward pass (which picks the dropout masks).
    /// An MoE layer's auxiliary losses are dropped: for evaluation and inference; training
    /// takes them with [`try_forward_with_losses`](Self::try_forward_with_losses).
    ///
    /// # Shapes
    /// - x and the output: `[batch, seq, hidden]` (`seq / tp` under sequence parallelism)
    pub fn try_forward(&self, x: Tensor<B, 3>, call: u64) -> DistResult<Tensor<B, 3>> {
        self.try_forward_with_losses(x, call, &mut MoeLosses::default())
    }

    /// [`try_forward`](Self::try_forward), adding an MoE layer's auxiliary losses and load to
    /// `losses`. Every rank of the expert-parallel group must run its MoE layers together.
    pub fn try_forward_with_losses(
        &self,
        x: Tensor<B, 3>,
        call: u64,
        losses: &mut MoeLosses<B>,
    ) -> DistResult<Tensor<B, 3>> {
        let c = &self.context;
        let site =
            |name: &str| DropoutSite::new(c.seed, call, &format!("layers.{}.{name}", c.index));
        let attention = self
            .attention
            .try_forward(self.input_norm.try_forward(x.clone())?, site("attention"))?;
        let x = hidden_dropout(attention, Some(x), c, site("attention_output"));
        let normed = self.post_attention_norm.try_forward(x.clone())?;
        let mlp = self.try_forward_mlp(normed, site("router_jitter"), losses)?;
        Ok(hidden_dropout(mlp, Some(x), c, site("mlp_output")))
    }

    /// The dense MLP or the mixture of experts on the normed residual stream, an MoE layer's
    /// losses and load added to `losses`; its router's input jitter (if any) drawn from
    /// `jitter`'s stream at the tokens' global coordinates.
    ///
    /// # Shapes
    /// - x and the output: `[batch, seq, hidden]` (`seq / tp` under sequence parallelism)
    pub fn try_forward_mlp(
        &self,
        x: Tensor<B, 3>,
        jitter: DropoutSite,
        losses: &mut MoeLosses<B>,
    ) -> DistResult<Tensor<B, 3>> {
        match (&self.mlp, &self.moe) {
            (_, Some(moe)) => {
                // Under sequence parallelism the MoE layer takes the whole sequence, gathered
                // over TP (its gradient complete on every rank: keep the shard), so that
                // every TP rank routes the same tokens and the router's gradient is whole, as
                // without SP. Experts whole on every TP rank give the whole output: split it
                // (its gradient gathered). Experts split over TP (expert tensor parallelism)
                // give partial sums: reduce-scatter them.
                let tp = &self.context.tp;
                let sp = tp.sequence_parallel && tp.group.size() > 1;
                let x = match sp {
                    true => gather_from_sequence_parallel_region(x, &tp.group, SEQ_DIM, false)?,
                    false => x,
                };
                // Under context parallelism the losses are this rank's share of the batch's
                // (summed over CP with the gradients).
                let cp = self.context.cp.as_ref().map(|cp| &cp.group);
                let training = B::ad_enabled(&x.device());
                let jitter = match moe.router.settings().input_jitter_eps {
                    Some(_) if training => Some(self.jitter_site(jitter, x.dims()[1])?),
                    _ => None,
                };
                let out = match sp {
                    true => moe.try_forward_partial_at(x, cp, jitter.as_ref())?,
                    false => moe.try_forward_over_at(x, cp, jitter.as_ref())?,
                };
                losses.push(self.context.index, &out);
                match (sp, moe.expert_tp()) {
                    (true, Some(etp)) => {
                        reduce_scatter_to_sequence_parallel_region(out.output, etp, SEQ_DIM)
                    }
                    (true, None) => {
                        scatter_to_sequence_parallel_region(out.output, &tp.group, SEQ_DIM)
                    }
                    (false, _) => Ok(out.output),
                }
            }
            (Some(mlp), None) => mlp.try_forward(x),
            (None, None) => unreachable!("`new` gives a layer an MLP or an MoE layer"),
        }
    }

    /// Where the MoE layer's `seq` tokens a sequence (the whole sequence under sequence
    /// parallelism, this rank's part under context parallelism) sit in the global sequence,
    /// for the router's input jitter drawn from `site`'s stream.
    fn jitter_site(&self, site: DropoutSite, seq: usize) -> DistResult<JitterSite> {
        let seed = site.seed();
        match &self.context.cp {
            Some(cp) => {
                let positions = cp.positions(seq).map_err(|e| DistError::Device {
                    rank: cp.group.global_rank(),
                    group: cp.group.name().to_string(),
                    what: "the router's input jitter's positions".to_string(),
                    message: e.to_string(),
                })?;
                Ok(JitterSite {
                    seed,
                    positions,
                    sequence_length: seq * cp.group.size(),
                })
            }
            None => Ok(JitterSite::whole_sequence(seed, seq)),
        }
    }

    /// Whether the layer's MLP is a mixture of experts.
    pub fn is_moe(&self) -> bool {
        self.moe.is_some()
    }
}

/// A group of this rank alone, for experts that are not split.
pub(crate) fn single_rank_group(tp: &ProcessGroup) -> Result<ProcessGroup, ConfigError> {
    tp.new_group("expert_parallel_self", &[tp.global_rank()])
        .map_err(|e| ConfigError::Invalid(format!("a single-rank expert group: {e}")))
}

/// `residual + dropout(x)` (or `dropout(x)`) on the residual stream, the mask placed in the
/// global `[batch, seq, hidden]` tensor.
///
/// Under context parallelism the rank's tokens are not one run of the sequence: each run of
/// consecutive global positions gets the mask of its place, so that the masks are those of
/// the whole sequence on one rank.
pub(crate) fn hidden_dropout<B: ModelBackend>(
    x: Tensor<B, 3>,
    residual: Option<Tensor<B, 3>>,
    c: &LayerContext,
    site: DropoutSite,
) -> Tensor<B, 3> {
    let [_, seq, _] = x.dims();
    let offset = if c.tp.sequence_parallel {
        seq * c.tp.group.rank()
    } else {
        0
    };
    let positions = match &c.cp {
        Some(cp) if c.hidden_dropout > 0.0 => {
            let local = if c.tp.sequence_parallel {
                seq * c.tp.group.size()
            } else {
                seq
            };
            cp.positions(local).ok()
        }
        _ => None,
    };
    let Some(positions) = positions else {
        return dropout(x, residual, c.hidden_dropout, site, [0, offset, 0]);
    };
    let positions = &positions[offset..offset + seq];
    let mut parts = Vec::new();
    let mut start = 0;
    while start < seq {
        let mut end = start + 1;
        while end < seq && positions[end] == positions[end - 1] + 1 {
            end += 1;
        }
        let part = |t: &Tensor<B, 3>| t.clone().narrow(1, start, end - start);
        parts.push(dropout(
            part(&x),
            residual.as_ref().map(part),
            c.hidden_dropout,
            site,
            [0, positions[start], 0],
        ));
        start = end;
    }
    Tensor::cat(parts, 1)
}
