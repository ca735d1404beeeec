//! The memory planner: for a model, a sequence length, a batch and a GPU's memory, each rank's
//! peak memory in every layout of a world (TP × CP × PP × DP, sequence parallelism, the
//! distributed optimizer, activation recomputation), and an estimate of each layout's step
//! time, so that `pretrain_gpt --plan` can suggest the fastest layout that fits.
//!
//! Context parallelism is planned as the `p2p` ring runs it: a CP rank holds the whole model
//! and `seq / cp` tokens of each sequence, whose activations and logits it keeps; the
//! gradients are reduced, and the distributed optimizer's state sharded, over DP × CP; the
//! ring's K/V exchanges are counted as communication. The plan offers CP only where every
//! rank keeps at least [`MIN_CP_TOKENS`] tokens of a sequence: shorter blocks do not pay for
//! the exchanges.
//!
//! The memory is what this implementation holds, counted from its tensors (not Megatron's):
//!
//! - parameters in the model's dtype, and their gradients in the same dtype from the first
//!   backward pass to the optimizer step;
//! - the optimizer: Burn's AdamW (f32 runs on one data-parallel rank) keeps two moments per
//!   parameter; the flat-buffer AdamW keeps fp32 master weights (none for an f32 model it can
//!   view), two fp32 moments, each divided by DP under the distributed optimizer (ZeRO-1);
//! - the flat-buffer AdamW's step, part by part as it runs ([`optimizer_step_bytes`]): each
//!   part's fp32 gradient buffer while it is reduced, the reductions of every part until the
//!   update, the parameters it writes (the activations are gone by then);
//! - activations, per layer and microbatch ([`layer_activation_bytes`]): what each operation
//!   stores for its backward pass (flash attention stores no `[seq, seq]` tensor; dropout
//!   masks are redrawn, never stored); under full recomputation only each layer's input, and
//!   one layer's activations while it is recomputed;
//! - the pipeline: the most microbatches whose activations a stage keeps at once under the
//!   schedule the run uses ([`Plan::max_in_flight`](crate::pipeline_parallel::Plan::max_in_flight)): `pp - stage` under 1F1B, more (each
//!   a chunk's share of the layers) under the interleaved schedule;
//! - the output layer's logits `[tokens, vocab / tp]` and their gradient, on the last stage.
//!
//! MoE layers are planned at the run's expert-parallel size: each rank's routed experts
//! (parameters and gradients in the model's dtype, their f32 buffer during the optimizer step,
//! the optimizer state sharded over expert DP), its router and shared expert. Their
//! activations are planned as the dense MLP's, which [`render`] says above the table.
//!
//! The optimizer cuts a rank's flat buffers (the dense parameters', the experts') into parts
//! below 32-bit indices, whole parameters each: the planner lists a rank's parameters in the
//! model's order ([`stage_param_numels`]) and cuts them with the optimizer's own rule
//! ([`flat_part_numels`]); a layout whose largest dense or expert parameter alone would pass
//! the limit is left out, as the optimizer refuses it.
//!
//! Megatron's closed forms ([`megatron_layer_activation_bytes`]) are there to compare with.
//! The step time is an estimate: the model's FLOPs at an assumed efficiency, plus the
//! pipeline's bubble, recomputation's extra forward pass and the communication that is not
//! hidden (see [`LayoutEstimate::step_seconds`]); rank layouts by it, but measure.

use std::collections::HashSet;

use burn::module::ParamId;

use crate::distributed::BufferLayout;
use crate::error::ConfigError;
use crate::models::StageSplit;
use crate::optimizer::flat_limit::split_at_limit;
use crate::optimizer::{FlatAdamWConfig, MAX_FLAT_NUMEL, check_indexable};
use crate::pipeline_parallel::Schedule;
use crate::tensor_parallel::{ParamInfo, ParamPlacement, VocabPartition};
use crate::transformer::{
    Activation, Normalization, PositionEmbedding, Recompute, TransformerConfig,
};

/// One layout to plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlannedLayout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size: each sequence split over `cp` ranks, which hold the whole model
    /// and `seq / cp` of its tokens (the `p2p` ring's memory and exchanges).
    pub cp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Model chunks (virtual pipeline stages) per pipeline rank: 1 for 1F1B, more for the
    /// interleaved schedule.
    pub virtual_stages: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// Sequence parallelism (with TP > 1).
    pub sequence_parallel: bool,
    /// The distributed optimizer (ZeRO-1).
    pub distributed_optimizer: bool,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Layers of the last pipeline rank (`--decoder-last-pipeline-num-layers`), the others
    /// sharing the rest evenly; `None`: an even split.
    pub last_stage_layers: Option<usize>,
}

impl PlannedLayout {
    /// The layers of each virtual stage.
    pub fn split(&self, num_layers: usize) -> Result<StageSplit, ConfigError> {
        StageSplit::pipeline(
            num_layers,
            self.pp,
            self.virtual_stages,
            None,
            self.last_stage_layers,
        )
        .map_err(|e| ConfigError::Invalid(e.to_string()))
    }
}

/// The run a layout is planned for.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The model.
    pub model: TransformerConfig,
    /// Tokens per sample.
    pub seq: usize,
    /// Samples per microbatch.
    pub micro_batch: usize,
    /// Samples per optimizer step.
    pub global_batch: usize,
    /// Bytes of one parameter and activation element: 2 for bf16 and fp16, 4 for f32.
    pub dtype_bytes: usize,
    /// Whether the gradients are taken into f32 reduction units during the backward pass
    /// (`--overlap-grad-reduce`, with the flat-buffer AdamW): the units, 4 bytes a parameter,
    /// then live through every microbatch, where otherwise the gradients are held in the
    /// model's dtype and the f32 buffer exists during the optimizer step only.
    pub overlap_grad_reduce: bool,
    /// Expert-parallel size (`--expert-model-parallel-size`): the routed experts of an MoE
    /// layer are split over EP ranks within DP × CP; 1 for a dense model.
    pub expert_parallel: usize,
    /// The GPU's memory, in bytes.
    pub gpu_memory: u64,
    /// The GPU's peak dense TFLOP/s in the model's dtype.
    pub peak_tflops: f64,
}

/// One rank's memory in a layout, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankMemory {
    /// Parameters.
    pub params: u64,
    /// Parameter gradients: in the model's dtype, or the f32 reduction units
    /// ([`PlanInput::overlap_grad_reduce`]).
    pub grads: u64,
    /// Optimizer state (master weights and moments).
    pub optimizer: u64,
    /// What the flat-buffer AdamW's step holds at its peak beyond the parameters, gradients
    /// and optimizer state, its flat buffers cut into parts as the optimizer cuts them
    /// ([`optimizer_step_bytes`]): one part's f32 gradient buffer at a time, every part's
    /// reduced gradients, the parameters it writes.
    pub step_buffer: u64,
    /// Activations at the peak of the forward and backward passes.
    pub activations: u64,
    /// The output layer's logits and their gradient (last stage).
    pub logits: u64,
}

impl RankMemory {
    /// The peak: the larger of the forward and backward passes' (activations held) and the
    /// optimizer step's (activations freed, [`step_buffer`](Self::step_buffer) allocated).
    pub fn peak(&self) -> u64 {
        let resident = self.params + self.grads + self.optimizer;
        resident + (self.activations + self.logits).max(self.step_buffer)
    }
}

/// A layout's memory and estimated speed.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutEstimate {
    /// The layout.
    pub layout: PlannedLayout,
    /// The rank with the largest peak (each pipeline stage's first rank is considered).
    pub memory: RankMemory,
    /// Its pipeline stage.
    pub stage: usize,
    /// Microbatches per step.
    pub microbatches: usize,
    /// Estimated seconds per step (see [`step_seconds`](Self::step_seconds)).
    pub step_seconds: f64,
    /// Whether the peak fits the GPU with [`POOL_ALLOWANCE`] of it kept free.
    pub fits: bool,
}

/// The share of a GPU's memory a layout must leave beyond its predicted peak of live tensors
/// to be said to fit. The memory pool holds pages that are only partly used (on 4 H100s GPT-3
/// 6.7B ran out of memory with 45 GiB live in 59 GiB of pages, where the planner's peak was
/// 70.4 GiB of 79.6), and the CUDA context and NCCL's buffers live beside the pool.
pub const POOL_ALLOWANCE: f64 = 0.20;

/// Model FLOPs per second a GPU sustains in this estimate: the fraction of its peak our
/// single-GPU step reaches at 1.3B (about 55 %, book "Benchmarks").
const COMPUTE_EFFICIENCY: f64 = 0.55;
/// Bytes per second a collective moves between GPUs of one host (NVLink, bus bandwidth).
const LINK_BYTES_PER_SECOND: f64 = 300e9;
/// The share of tensor-parallel communication not hidden behind compute.
const TP_EXPOSED: f64 = 1.0;
/// The share of the data-parallel gradient reduction not hidden (it overlaps the backward
/// pass with `--overlap-grad-reduce`; counted whole here).
const DP_EXPOSED: f64 = 1.0;
/// The share of the context-parallel ring's exchanges not hidden (they run under the
/// attention of the block held; counted whole here, like the others).
const CP_EXPOSED: f64 = 1.0;
/// The fewest tokens of a sequence a CP rank keeps in the layouts [`plan`] offers.
pub const MIN_CP_TOKENS: usize = 4096;

/// The stored activations of one transformer layer for one microbatch on one TP rank, in
/// bytes, as this implementation keeps them (see the [module docs](self)).
pub fn layer_activation_bytes(
    model: &TransformerConfig,
    seq: usize,
    micro_batch: usize,
    tp: usize,
    sequence_parallel: bool,
    dtype_bytes: usize,
) -> u64 {
    let (h, f) = (model.hidden_size as u64, model.ffn_hidden_size as u64);
    let kv = (model.query_groups() * model.head_dim()) as u64;
    let q = model.query_width() as u64;
    let heads = model.num_attention_heads as u64;
    let (t, d) = (tp as u64, dtype_bytes as u64);
    let tokens = (seq * micro_batch) as u64;
    // Activations outside the tensor-parallel regions are split along the sequence under SP.
    let outside = if sequence_parallel && tp > 1 { t } else { 1 };
    let norm = |width: u64| d * tokens * width / outside + 2 * 4 * tokens / outside;
    // A column-parallel layer keeps its whole (gathered) input.
    let column_input = d * tokens * h;
    let attention = d * tokens * (q + 2 * kv) / t + d * tokens * q / t + 4 * tokens * heads / t;
    let unfused_scores = if model.flash_attention && model.attention_dropout == 0.0 {
        0
    } else {
        // Probabilities, and the dropout output where dropout runs.
        let per_head = (seq * seq * micro_batch) as u64 * heads / t;
        d * per_head * if model.attention_dropout > 0.0 { 2 } else { 1 }
    };
    let mlp = match model.activation {
        Activation::SwiGlu => 3 * d * tokens * f / t,
        Activation::Gelu | Activation::GeluTanh => 2 * d * tokens * f / t,
    };
    norm(h) + column_input + attention + unfused_scores + norm(h) + column_input + mlp
}

/// Megatron's activation memory of one layer (the paper "Reducing Activation Recomputation
/// in Large Transformer Models", 16-bit activations, dropout masks of one byte): `s·b·h·(34 +
/// 5·a·s/h)` bytes without tensor parallelism; with TP `t` and sequence parallelism, all of it
/// divided by `t`; with flash attention (or selective recomputation), the `5·a·s/h` term gone.
pub fn megatron_layer_activation_bytes(
    seq: usize,
    micro_batch: usize,
    hidden: usize,
    heads: usize,
    tp: usize,
    flash: bool,
) -> f64 {
    let (s, b, h, a, t) = (
        seq as f64,
        micro_batch as f64,
        hidden as f64,
        heads as f64,
        tp as f64,
    );
    let scores = if flash { 0.0 } else { 5.0 * a * s / h };
    s * b * h * (34.0 + scores) / t
}

/// The parameters a TP rank of a pipeline rank holds ([`stage_params`]): those replicated
/// over data parallelism, and this expert-parallel rank's routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StageParams {
    /// Parameters replicated over DP × CP (every dense weight, and the MoE layers' routers
    /// and shared experts).
    pub dense: u64,
    /// This EP rank's routed experts (`num_experts / ep` of each MoE layer), replicated over
    /// expert DP (DP × CP / EP), their width split over TP under expert tensor parallelism.
    pub experts: u64,
    /// The largest of those parameters (one stacked matrix of an MoE layer, `num_experts / ep
    /// × hidden × width`): the optimizer keeps each in one flat buffer.
    pub largest_expert: u64,
    /// The largest dense parameter (a TP slice of the embedding table or of a layer's matrix):
    /// the optimizer keeps each in one flat buffer.
    pub largest_dense: u64,
}

impl StageParams {
    /// Both kinds.
    pub fn total(&self) -> u64 {
        self.dense + self.experts
    }
}

/// The parameters a TP rank of pipeline rank `stage` (of `pp`) holds, its transformer layers
/// the global indices `layers`, at expert-parallel size `ep`: [`stage_param_numels`] added up.
/// An MoE layer holds, in place of the MLP, its router (`hidden × experts`, and the expert
/// bias), its shared expert and its `experts / ep` routed experts, the experts' width split
/// over TP unless `--expert-tensor-parallel-size` is 1.
pub fn stage_params(
    model: &TransformerConfig,
    tp: usize,
    ep: usize,
    pp: usize,
    stage: usize,
    layers: impl IntoIterator<Item = usize>,
) -> StageParams {
    let numels = stage_param_numels(model, tp, ep, pp, stage, layers);
    let largest = |n: &[u64]| n.iter().copied().max().unwrap_or(0);
    StageParams {
        dense: numels.dense.iter().chain(&numels.frozen).sum(),
        experts: numels.experts.iter().sum(),
        largest_expert: largest(&numels.experts),
        largest_dense: largest(&numels.dense).max(largest(&numels.frozen)),
    }
}

/// The parameters a TP rank of a pipeline rank holds, one by one: each one's element count, in
/// the order the model visits them (the reverse of the flat buffers' order, which decides where
/// the optimizer cuts them into parts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageParamNumels {
    /// The dense parameters the optimizer trains: its dense flat buffers.
    pub dense: Vec<u64>,
    /// This EP rank's routed experts: their own flat buffers.
    pub experts: Vec<u64>,
    /// Parameters the optimizer leaves out of its buffers (DeepSeek-V3's expert bias, updated
    /// from the load).
    pub frozen: Vec<u64>,
}

/// [`stage_params`] one parameter at a time (see [`StageParamNumels`]): the embedding tables
/// on the first stage; per layer its input norm, QKV (and bias), the attention output (and
/// bias), the QK-norms, the second norm, then the MLP's `fc1`, SwiGLU's `gate` and `fc2`
/// (each with its bias), or an MoE layer's router, expert bias, routed experts (`fc1`,
/// `gate`, `fc2`, stacked) and shared expert; the final norm and the output layer on the last.
pub fn stage_param_numels(
    model: &TransformerConfig,
    tp: usize,
    ep: usize,
    pp: usize,
    stage: usize,
    layers: impl IntoIterator<Item = usize>,
) -> StageParamNumels {
    let (h, f) = (model.hidden_size as u64, model.ffn_hidden_size as u64);
    let kv = (model.query_groups() * model.head_dim()) as u64;
    let q = model.query_width() as u64;
    let t = tp as u64;
    let swiglu = model.activation == Activation::SwiGlu;
    let mut out = StageParamNumels::default();
    let dense = &mut out.dense;
    // A norm's scale, and LayerNorm's shift.
    let norm = |dense: &mut Vec<u64>, width: u64| {
        dense.push(width);
        if model.normalization == Normalization::LayerNorm {
            dense.push(width);
        }
    };
    // A linear layer's weight, and its bias with `--add-bias-linear`.
    let linear = |dense: &mut Vec<u64>, weight: u64, bias: u64| {
        dense.push(weight);
        if model.add_bias_linear {
            dense.push(bias);
        }
    };
    let vocab = VocabPartition::new(model.vocab_size, model.make_vocab_size_divisible_by, tp, 0)
        .map(|v| v.padded_size as u64)
        .unwrap_or(model.vocab_size as u64);
    let table = vocab / t * h;
    let (first, last) = (stage == 0, stage + 1 == pp);
    if first {
        dense.push(table);
        if model.position_embedding == PositionEmbedding::Learned {
            dense.push(model.max_sequence_length as u64 * h);
        }
    }
    for layer in layers {
        norm(dense, h);
        linear(dense, h * (q + 2 * kv) / t, (q + 2 * kv) / t);
        linear(dense, q * h / t, h);
        if model.qk_layernorm {
            let head = model.head_dim() as u64;
            norm(dense, head);
            norm(dense, head);
        }
        norm(dense, h);
        match &model.moe {
            Some(moe) if moe.is_moe_layer(layer) => {
                let experts = moe.num_experts as u64;
                let width = moe.ffn_hidden_size.unwrap_or(model.ffn_hidden_size) as u64;
                dense.push(h * experts);
                if moe.expert_bias {
                    out.frozen.push(experts);
                }
                // Expert tensor parallelism splits every expert's width over TP.
                let expert_tp = match moe.expert_tensor_parallel_size {
                    Some(1) => 1,
                    _ => t,
                };
                let stacked = experts / ep as u64 * h * width / expert_tp;
                let matrices = if swiglu { 3 } else { 2 };
                out.experts.extend(std::iter::repeat_n(stacked, matrices));
                if let Some(shared) = moe.shared_expert_ffn_hidden_size {
                    let shared = h * shared as u64 / expert_tp;
                    dense.extend(std::iter::repeat_n(shared, matrices));
                }
            }
            _ => {
                linear(dense, h * f / t, f / t);
                if swiglu {
                    linear(dense, h * f / t, f / t);
                }
                linear(dense, f / t * h, h);
            }
        }
    }
    if last {
        norm(dense, h);
        // An untied output layer; a tied one's copy on a later stage than the embedding's.
        if !model.tie_embeddings || !first {
            dense.push(table);
        }
    }
    out
}

/// The parts the optimizer cuts one kind of a rank's parameters into (`numels`, in the
/// model's visiting order, as [`StageParamNumels`] lists them): its own cut
/// ([`flat_limit`](crate::optimizer::flat_limit)), whole parameters in the buffers' order
/// (the reverse), each part at most `limit` elements once each parameter is aligned and the
/// part padded to whole shards of `replicas` ranks, as the run lays them out. Each part's
/// element count, padding included, in buffer order; none for no parameters. A parameter
/// whose buffer alone passes `limit` is refused, naming `fix`. The optimizer's `limit` is
/// [`MAX_FLAT_NUMEL`]; tests lower it, as they lower the
/// optimizer's (`DistributedAdamWConfig::part_numel`).
pub fn flat_part_numels(
    numels: &[u64],
    replicas: usize,
    limit: usize,
    fix: &str,
) -> Result<Vec<u64>, ConfigError> {
    if numels.is_empty() {
        return Ok(Vec::new());
    }
    let infos: Vec<ParamInfo> = numels
        .iter()
        .enumerate()
        .map(|(i, &n)| ParamInfo {
            id: ParamId::new(),
            path: format!("parameter {i} of the stage"),
            placement: ParamPlacement::replicated(),
            shape: vec![usize::try_from(n).unwrap_or(usize::MAX)],
        })
        .collect();
    let config = FlatAdamWConfig::new().buffer.with_dp_size(replicas);
    let layout = BufferLayout::new(&infos, config)?;
    split_at_limit(&layout, limit, fix)?
        .into_iter()
        .map(|group| {
            let ids: HashSet<ParamId> = group.into_iter().collect();
            let part = BufferLayout::new_where(&infos, config, |info| ids.contains(&info.id))?;
            Ok(part.numel() as u64)
        })
        .collect()
}

/// One kind of a rank's parameters (the dense ones, or the routed experts) at the optimizer
/// step: the parts of its flat buffers and how the step reduces them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepParts {
    /// Each part's elements, padding included, in buffer order ([`flat_part_numels`]).
    pub parts: Vec<u64>,
    /// The ranks holding replicas: DP × CP for the dense parameters, expert DP for the experts.
    pub replicas: usize,
    /// The distributed optimizer: the gradients reduce-scattered, each rank updating its
    /// shard and all-gathering the parameters (with more than one replica).
    pub sharded: bool,
    /// The gradients summed into f32 reduction units during the backward pass
    /// (`--overlap-grad-reduce`; the dense parameters only): the units, every part's, are
    /// counted with the gradients, and live until the step has taken their reduction.
    pub hooked: bool,
}

/// The bytes the optimizer step (`DistributedAdamW::step`) holds at its peak beyond the
/// parameters, the gradients (in the model's dtype, or the hooked units) and the optimizer
/// state: the step followed part by part, the dense parts then the experts', counting the
/// tensors it allocates and frees. Parameters of `dtype_bytes` bytes. With `n` a part's
/// elements, `p` its replicas and `r` the elements it reduces to (`n / p` sharded, else `n`):
///
/// - reduced after the backward pass, each part in turn gathers its gradients into an f32
///   buffer (`4n`); sharded, it is reduce-scattered in buckets whose outputs (`4r`) are then
///   concatenated (`4r` more) while the buffer is alive; not sharded, it is all-reduced in
///   place, and the squares for the global norm take a temporary of its size (`4n`). Each
///   part's reduced gradients (`4r`) are kept for the update, the rest freed before the next
///   part: the parts' buffers do not coexist, their reductions do;
/// - hooked, every unit's collective output exists when the step begins (`4r` a part), and
///   finishing a part concatenates its outputs (`4r`) before its unit buffer is freed;
/// - the update of each part writes its parameters in the model's dtype (`dtype_bytes · r`;
///   an f32 model viewing its master weights gets new ones, `4r`), and sharded all-gathers
///   them (`dtype_bytes · n`) while the part's old parameters are alive; its reduced
///   gradients are freed after it.
///
/// Not counted: the inputs of collectives that our CUDA backend keeps until the compute stream
/// has waited for them (each bucket's contiguous copy, the shards sent to the all-gathers),
/// whose number depends on how far the host runs ahead of the GPU.
pub fn optimizer_step_bytes(kinds: &[StepParts], dtype_bytes: usize) -> u64 {
    let d = dtype_bytes as i128;
    // Bytes beyond the resident ones: the reductions kept, less the unit buffers freed.
    let mut held: i128 = 0;
    let mut peak: i128 = 0;
    let reduced = |kind: &StepParts, n: u64| {
        let n = n as i128;
        match kind.sharded && kind.replicas > 1 {
            true => n / kind.replicas as i128,
            false => n,
        }
    };
    for kind in kinds {
        let outputs: i128 = kind.parts.iter().map(|&n| 4 * reduced(kind, n)).sum();
        if kind.hooked {
            held += outputs;
        }
        for &n in &kind.parts {
            let (buffer, out) = (4 * n as i128, 4 * reduced(kind, n));
            if kind.hooked {
                peak = peak.max(held + out);
                held -= buffer;
            } else {
                let sharded = kind.sharded && kind.replicas > 1;
                let transient = if sharded { 2 * out } else { buffer };
                peak = peak.max(held + buffer + transient);
                held += out;
            }
        }
    }
    for kind in kinds {
        let sharded = kind.sharded && kind.replicas > 1;
        for &n in &kind.parts {
            let (r, out) = (reduced(kind, n), 4 * reduced(kind, n));
            let written = match d {
                4 if sharded => 0,
                _ => d * r,
            };
            peak = peak.max(held + written);
            if sharded {
                peak = peak.max(held - out + written + d * n as i128);
            }
            held -= out;
        }
    }
    peak.max(0) as u64
}

/// Every rank's memory and the step time of `layout` for `input`.
pub fn estimate(input: &PlanInput, layout: PlannedLayout) -> Result<LayoutEstimate, ConfigError> {
    let PlannedLayout {
        tp,
        cp,
        pp,
        virtual_stages: v,
        dp,
        sequence_parallel,
        distributed_optimizer,
        recompute,
        last_stage_layers: _,
    } = layout;
    let model = &input.model;
    if tp == 0 || cp == 0 || dp == 0 {
        return Err(ConfigError::Invalid(format!(
            "TP {tp} x CP {cp} x PP {pp} x DP {dp}: every size must be at least 1"
        )));
    }
    // The ring's split: two chunks a CP rank, each cut again over TP under SP.
    let chunks = 2 * cp * if sequence_parallel { tp } else { 1 };
    if cp > 1 && !input.seq.is_multiple_of(chunks) {
        return Err(ConfigError::Invalid(format!(
            "CP {cp}: a sequence of {} tokens does not cut into {chunks} equal chunks",
            input.seq
        )));
    }
    // What a CP rank holds of each sequence.
    let seq = input.seq / cp;
    let split = layout.split(model.num_layers)?;
    model.validate(tp, 0)?;
    let per_step = input.micro_batch * dp;
    if input.global_batch == 0 || !input.global_batch.is_multiple_of(per_step) {
        return Err(ConfigError::Invalid(format!(
            "the global batch ({}) is not a multiple of the micro-batch ({}) x DP ({dp})",
            input.global_batch, input.micro_batch
        )));
    }
    let microbatches = input.global_batch / per_step;
    let ep = input.expert_parallel;
    if ep == 0 || !(dp * cp).is_multiple_of(ep) {
        return Err(ConfigError::Invalid(format!(
            "EP {ep} does not divide DP {dp} x CP {cp}: the experts are split within the replicas"
        )));
    }
    let schedule = match v {
        1 => Schedule::OneFOneB,
        _ => Schedule::Interleaved,
    };
    let in_flight = schedule
        .plan(pp, v, microbatches)
        .map_err(|e| ConfigError::Invalid(e.to_string()))?
        .max_in_flight();
    let d = input.dtype_bytes as u64;
    let flat_adamw = dp * cp > 1 || distributed_optimizer || input.dtype_bytes < 4;
    let shards = if distributed_optimizer {
        (dp * cp) as u64
    } else {
        1
    };
    let layer_acts = layer_activation_bytes(
        model,
        seq,
        input.micro_batch,
        tp,
        sequence_parallel,
        input.dtype_bytes,
    );
    let tokens = (seq * input.micro_batch) as u64;
    let outside = if sequence_parallel && tp > 1 {
        tp as u64
    } else {
        1
    };
    let layer_input = d * tokens * model.hidden_size as u64 / outside;
    let vocab = VocabPartition::new(model.vocab_size, model.make_vocab_size_divisible_by, tp, 0)?;
    let mut worst: Option<(usize, RankMemory)> = None;
    for stage in 0..pp {
        let rank_layers: Vec<usize> = (0..v)
            .flat_map(|c| split.stage(c * pp + stage).layers)
            .collect();
        let numels = stage_param_numels(model, tp, ep, pp, stage, rank_layers.iter().copied());
        let StageParams {
            dense: params,
            experts,
            largest_expert,
            largest_dense,
        } = stage_params(model, tp, ep, pp, stage, rank_layers);
        // A layout the optimizer would refuse (see `check_indexable`) is left out: it cuts
        // its flat buffers into parts of whole parameters below 32-bit indices, so only a
        // parameter whose own buffer passes them.
        let indexable = |numel: u64, what: &str, fix: &str| {
            check_indexable(usize::try_from(numel).unwrap_or(usize::MAX), what, fix)
        };
        indexable(
            largest_expert,
            "the flat buffer of one expert parameter alone",
            "more EP",
        )?;
        indexable(
            largest_dense,
            "the flat buffer of one dense parameter alone",
            "more TP",
        )?;
        // The parts the optimizer cuts each kind into, and how its step reduces them.
        let step_parts = |numels: &[u64], replicas: usize, hooked: bool, fix: &str| {
            Ok::<_, ConfigError>(StepParts {
                parts: flat_part_numels(numels, replicas, MAX_FLAT_NUMEL, fix)?,
                replicas,
                sharded: distributed_optimizer,
                hooked,
            })
        };
        let step_kinds = [
            step_parts(&numels.dense, dp * cp, input.overlap_grad_reduce, "more TP")?,
            step_parts(&numels.experts, dp * cp / ep, false, "more EP")?,
        ];
        // The experts' state is sharded over expert DP (DP × CP / EP).
        let expert_shards = if distributed_optimizer {
            ((dp * cp) / ep) as u64
        } else {
            1
        };
        // The layers of this rank's largest chunk: a forward pass in flight holds their
        // activations.
        let layers = (0..v)
            .map(|c| split.counts()[c * pp + stage])
            .max()
            .unwrap_or(0) as u64;
        let optimizer = match flat_adamw {
            // Master weights (viewed by an f32 model without ZeRO) and two moments.
            true if d == 4 && !distributed_optimizer => 8 * params / shards + 8 * experts,
            true => 12 * params / shards + 12 * experts / expert_shards,
            false => 8 * (params + experts),
        };
        // A recomputed group stores its input; stored layers their activations.
        let segments = recompute.segments(layers as usize);
        let per_microbatch: u64 = segments
            .iter()
            .map(|(range, rerun)| match rerun {
                true => layer_input,
                false => range.len() as u64 * layer_acts,
            })
            .sum();
        // One group recomputed at a time in the backward pass.
        let recomputing = segments
            .iter()
            .filter(|(_, rerun)| *rerun)
            .map(|(range, _)| range.len() as u64 * layer_acts)
            .max()
            .unwrap_or(0);
        let in_flight = in_flight[stage] as u64;
        let logits = match stage + 1 == pp {
            // The logits in the model's dtype and their gradient, and the final norm's output
            // gathered for the output layer.
            true => {
                2 * d * tokens * vocab.local_size() as u64 + d * tokens * model.hidden_size as u64
            }
            false => 0,
        };
        let memory = RankMemory {
            params: d * (params + experts),
            // The experts' gradients stay in the model's dtype until the step, which gathers
            // them into their own f32 buffer, with or without the overlapped reduction.
            grads: if input.overlap_grad_reduce && flat_adamw {
                4 * params + d * experts
            } else {
                d * (params + experts)
            },
            optimizer,
            step_buffer: match flat_adamw {
                true => optimizer_step_bytes(&step_kinds, input.dtype_bytes),
                false => 0,
            },
            activations: in_flight * per_microbatch + recomputing,
            logits,
        };
        if worst.is_none_or(|(_, m)| memory.peak() > m.peak()) {
            worst = Some((stage, memory));
        }
    }
    let (stage, memory) = worst.expect("at least one stage");
    let step_seconds = step_seconds(input, layout, &split, microbatches);
    let fits = (memory.peak() as f64) <= (1.0 - POOL_ALLOWANCE) * input.gpu_memory as f64;
    Ok(LayoutEstimate {
        layout,
        memory,
        stage,
        microbatches,
        step_seconds,
        fits,
    })
}

/// The estimated step time: the model's FLOPs (and a forward pass more under full
/// recomputation) over every GPU at [`COMPUTE_EFFICIENCY`] of the peak, stretched by the
/// pipeline's imbalance (the busiest rank's layers and output layer against the average
/// rank's: every rank waits for it) and by its bubble `(pp - 1) / (v · m)` (1F1B's with one
/// chunk a rank, `v` chunks interleaved), plus the tensor-parallel collectives (4 all-gathers or
/// reduce-scatters of the layer's activations a layer and microbatch, forward and backward)
/// and the data-parallel gradient reduction (and, with the distributed optimizer, the
/// parameter all-gather) at [`LINK_BYTES_PER_SECOND`].
fn step_seconds(
    input: &PlanInput,
    layout: PlannedLayout,
    split: &StageSplit,
    microbatches: usize,
) -> f64 {
    let model = &input.model;
    let world = (layout.tp * layout.cp * layout.pp * layout.dp) as f64;
    let flops = model
        .training_flops(input.global_batch, input.seq)
        .unwrap_or(0.0);
    let imbalance = pipeline_imbalance(input, split, layout.pp);
    // A recomputed layer's forward pass runs twice: a third more than its forward + backward.
    let chunk_layers = model.num_layers / (layout.pp * layout.virtual_stages);
    let rerun: usize = layout
        .recompute
        .segments(chunk_layers)
        .iter()
        .filter(|(_, rerun)| *rerun)
        .map(|(range, _)| range.len())
        .sum();
    let recompute = 1.0 + rerun as f64 / chunk_layers.max(1) as f64 / 3.0;
    let compute =
        flops * recompute * imbalance / world / (input.peak_tflops * 1e12 * COMPUTE_EFFICIENCY);
    let bubble = (layout.pp - 1) as f64 / (layout.virtual_stages * microbatches) as f64;
    let d = input.dtype_bytes as f64;
    let t = layout.tp as f64;
    let c = layout.cp as f64;
    let tokens = (input.seq * input.micro_batch) as f64 / c;
    let layers = (model.num_layers / layout.pp) as f64;
    let tp_bytes = match layout.tp {
        1 => 0.0,
        _ => {
            let per_collective = d * tokens * model.hidden_size as f64 * (t - 1.0) / t;
            8.0 * per_collective * layers * microbatches as f64
        }
    };
    // The dense parameters, reduced over DP × CP (the experts' over expert DP are not counted).
    let params = (0..layout.pp)
        .map(|s| {
            let layers =
                (0..layout.virtual_stages).flat_map(|c| split.stage(c * layout.pp + s).layers);
            stage_params(
                model,
                layout.tp,
                input.expert_parallel,
                layout.pp,
                s,
                layers,
            )
            .dense
        })
        .max()
        .unwrap_or(0) as f64;
    // The gradients are reduced (and the distributed optimizer's parameters gathered) over
    // the replicas: DP × CP.
    let p = (layout.dp * layout.cp) as f64;
    let dp_bytes = match layout.dp * layout.cp {
        1 => 0.0,
        _ => {
            let grads = 4.0 * params * 2.0 * (p - 1.0) / p;
            let gather = if layout.distributed_optimizer {
                d * params * (p - 1.0) / p
            } else {
                0.0
            };
            grads + gather
        }
    };
    // The ring, a layer and microbatch: the rank's K/V block (its TP share) sent `cp - 1`
    // times forward and again in the backward pass, where the f32 K/V gradients travel `cp`
    // times.
    let cp_bytes = match layout.cp {
        1 => 0.0,
        _ => {
            let block = tokens * (2 * model.query_groups() * model.head_dim()) as f64 / t;
            (2.0 * (c - 1.0) * d + c * 4.0) * block * layers * microbatches as f64
        }
    };
    compute * (1.0 + bubble)
        + (TP_EXPOSED * tp_bytes + DP_EXPOSED * dp_bytes + CP_EXPOSED * cp_bytes)
            / LINK_BYTES_PER_SECOND
}

/// The busiest pipeline rank's model FLOPs over the average rank's (1 without a pipeline): a
/// rank's transformer layers, and the output layer on the last rank.
pub fn pipeline_imbalance(input: &PlanInput, split: &StageSplit, pp: usize) -> f64 {
    let model = &input.model;
    let total = model.training_flops(1, input.seq).unwrap_or(0.0);
    let output = VocabPartition::new(model.vocab_size, model.make_vocab_size_divisible_by, 1, 0)
        .map(|v| 6.0 * (input.seq * model.hidden_size * v.padded_size) as f64)
        .unwrap_or(0.0);
    let layer = (total - output) / model.num_layers.max(1) as f64;
    let busiest = (0..pp)
        .map(|r| {
            let last = if r + 1 == pp { output } else { 0.0 };
            split.rank_layers(r, pp) as f64 * layer + last
        })
        .fold(0.0, f64::max);
    match total > 0.0 {
        true => busiest * pp as f64 / total,
        false => 1.0,
    }
}

/// The last rank's layer count that balances the pipeline best (the others sharing the rest
/// evenly), or `None` where the even split is as good.
pub fn balanced_last_stage_layers(
    input: &PlanInput,
    pp: usize,
    virtual_stages: usize,
) -> Option<usize> {
    let layers = input.model.num_layers;
    let imbalance = |last: Option<usize>| {
        StageSplit::pipeline(layers, pp, virtual_stages, None, last)
            .map(|split| pipeline_imbalance(input, &split, pp))
            .unwrap_or(f64::INFINITY)
    };
    let even = imbalance(None);
    (0..=layers / pp)
        .map(|last| (last, imbalance(Some(last))))
        .filter(|(_, i)| *i < even - 1e-9)
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(last, _)| last)
}

/// Every layout of `world` GPUs that the model splits into: TP, CP (see [`MIN_CP_TOKENS`])
/// and PP dividing the world,
/// with PP > 1 also 2 and 4 chunks a rank (interleaved) where the layers and microbatches
/// allow, and the last rank's layer count that balances the output layer's work
/// ([`balanced_last_stage_layers`]), sequence parallelism with TP > 1, the distributed optimizer with DP × CP > 1, each with
/// no, selective (where the unfused attention runs) and full recomputation; fastest first.
pub fn plan(input: &PlanInput, world: usize) -> Vec<LayoutEstimate> {
    let mut out = Vec::new();
    let sizes = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let cps = sizes(world).filter(|&cp| cp == 1 || input.seq / cp >= MIN_CP_TOKENS);
    for (cp, tp) in cps.flat_map(|cp| sizes(world / cp).map(move |tp| (cp, tp))) {
        for pp in sizes(world / (cp * tp)) {
            let dp = world / (cp * tp * pp);
            let recomputes =
                match input.model.flash_attention && input.model.attention_dropout == 0.0 {
                    true => vec![Recompute::None, Recompute::Full],
                    false => vec![Recompute::None, Recompute::Selective, Recompute::Full],
                };
            let virtual_stages: &[usize] = if pp > 1 { &[1, 2, 4] } else { &[1] };
            for &virtual_stages in virtual_stages {
                if !input.model.num_layers.is_multiple_of(pp * virtual_stages) {
                    continue;
                }
                let mut splits = vec![None];
                if pp > 1 {
                    splits.extend(balanced_last_stage_layers(input, pp, virtual_stages).map(Some));
                }
                for &last_stage_layers in &splits {
                    for &recompute in &recomputes {
                        let layout = PlannedLayout {
                            tp,
                            cp,
                            pp,
                            virtual_stages,
                            dp,
                            sequence_parallel: tp > 1,
                            distributed_optimizer: dp * cp > 1,
                            recompute,
                            last_stage_layers,
                        };
                        if let Ok(estimate) = estimate(input, layout) {
                            out.push(estimate);
                        }
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| {
        (!a.fits)
            .cmp(&!b.fits)
            .then(a.step_seconds.total_cmp(&b.step_seconds))
    });
    out
}

/// The plan as a table, fastest first, layouts that do not fit last.
pub fn render(input: &PlanInput, estimates: &[LayoutEstimate]) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut out = format!(
        "memory plan: {} layers x {} wide, seq {}, micro-batch {}, global batch {}, {}-byte \
         parameters, {:.0} GiB GPUs (peak per rank, GiB)\n",
        input.model.num_layers,
        input.model.hidden_size,
        input.seq,
        input.micro_batch,
        input.global_batch,
        input.dtype_bytes,
        gib(input.gpu_memory)
    );
    if let Some(moe) = &input.model.moe {
        out.push_str(&format!(
            "experts: {} a layer at EP {}, their parameters, gradients and optimizer state \
             counted; NOT COUNTED: their activations (planned as the dense MLP's, top-{} \
             routing stores more), so the activation column is too low for this model\n",
            moe.num_experts, input.expert_parallel, moe.top_k
        ));
    }
    out.push_str(
        "  TP  CP  PP  VP  last  DP  SP  ZeRO  recompute   params   grads   optim  activ  \
         logits    PEAK  fits  est. step\n",
    );
    for e in estimates {
        let l = e.layout;
        let m = e.memory;
        out.push_str(&format!(
            "  {:>2}  {:>2}  {:>2}  {:>2}  {:>4}  {:>2}  {:>2}  {:>4}  {:<9} {:>8.1} {:>7.1} {:>7.1} {:>6.1} {:>7.1} {:>7.1}  {:>4}  {:>7.2} s\n",
            l.tp,
            l.cp,
            l.pp,
            l.virtual_stages,
            l.last_stage_layers
                .map_or_else(|| "-".to_string(), |n| n.to_string()),
            l.dp,
            if l.sequence_parallel { "y" } else { "-" },
            if l.distributed_optimizer { "y" } else { "-" },
            match l.recompute {
                Recompute::FullUniform { layers } => format!("uniform {layers}"),
                Recompute::FullBlock { layers } => format!("block {layers}"),
                other => format!("{other:?}").to_lowercase(),
            },
            gib(m.params),
            gib(m.grads),
            gib(m.optimizer),
            gib(m.activations),
            gib(m.logits),
            gib(m.peak()),
            if e.fits { "yes" } else { "no" },
            e.step_seconds,
        ));
    }
    if let Some(best) = estimates.iter().find(|e| e.fits) {
        let l = best.layout;
        out.push_str(&format!(
            "suggested: --tensor-model-parallel-size {}{} --pipeline-model-parallel-size {} \
             --data-parallel-size {}{}{}{}{}{}\n",
            l.tp,
            match l.cp {
                1 => String::new(),
                cp => format!(" --context-parallel-size {cp}"),
            },
            l.pp,
            l.dp,
            match (l.virtual_stages, l.last_stage_layers) {
                (1, _) => String::new(),
                (v, Some(_)) => format!(" --num-virtual-stages-per-pipeline-rank {v}"),
                (v, None) => format!(
                    " --num-layers-per-virtual-pipeline-stage {}",
                    input.model.num_layers / (l.pp * v)
                ),
            },
            l.last_stage_layers.map_or_else(String::new, |n| format!(
                " --decoder-last-pipeline-num-layers {n}"
            )),
            if l.sequence_parallel {
                " --sequence-parallel"
            } else {
                ""
            },
            if l.distributed_optimizer {
                " --use-distributed-optimizer"
            } else {
                ""
            },
            match l.recompute {
                Recompute::None => String::new(),
                Recompute::Selective => " --recompute-granularity selective".into(),
                Recompute::Full => " --recompute-granularity full".into(),
                Recompute::FullUniform { layers } => format!(
                    " --recompute-granularity full --recompute-method uniform \
                     --recompute-num-layers {layers}"
                ),
                Recompute::FullBlock { layers } => format!(
                    " --recompute-granularity full --recompute-method block \
                     --recompute-num-layers {layers}"
                ),
            },
        ));
    } else {
        out.push_str("no layout fits: lower the micro-batch or the sequence, or add GPUs\n");
    }
    out
}
