//! GPT- and Llama-style decoder models.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Int, Tensor, backend::Backend};
use burn_megatron_dist::mapping::reduce_from_tensor_parallel_region;
use burn_megatron_dist::{DeviceTransport, DistResult, ProcessGroup};

use super::stage::Stage;
use crate::backend::ModelBackend;
use crate::context_parallel::CpContext;
use crate::error::PipelineError;
use crate::error::{ConfigError, InputError, Result};
use crate::init::{InitDistribution, init_full, param_seed};
use crate::ops::BackwardHook;
use crate::ops::fp8::{Fp8Linear, reduce_delayed_states};
use crate::tensor_parallel::{
    DeclarePlacements, DropoutSite, ParamPlacement, Placements, SequenceParallelGrads, TpContext,
    VocabParallelEmbedding, VocabParallelOutput, VocabPartition, masked_mean, parallel_lm_logits,
    vocab_parallel_cross_entropy,
};
use crate::transformer::moe::MoeLosses;
use crate::transformer::{
    LayerContext, PositionEmbedding, Recompute, TransformerBlock, TransformerConfig,
    TransformerLayer, hidden_dropout,
};

/// A decoder-only language model: token (and learned position) embeddings, a
/// [`TransformerBlock`] (layers and final norm) and an output layer (tied to the token
/// embeddings or not), each split over the tensor-parallel group as Megatron splits them.
///
/// A model may be one pipeline stage of a larger model ([`TransformerConfig::init_gpt_stage`],
/// Megatron's `pre_process`/`post_process`): the first stage holds the embeddings, the last the
/// final norm, the output layer and the loss, every stage its own layers. Schedules in
/// [`pipeline_parallel`](crate::pipeline_parallel) drive the stages through the pieces
/// ([`embed`](Self::embed), [`layers`](Self::layers), [`head`](Self::head),
/// [`loss`](Self::loss)); [`try_forward`](Self::try_forward) runs a whole model.
#[derive(Module, Debug)]
pub struct GptModel<B: Backend> {
    /// Token embeddings, split by vocabulary; first stage only.
    pub embedding: Option<VocabParallelEmbedding<B>>,
    /// `[max_sequence_length, hidden]`, replicated; learned positions only, first stage only.
    pub position_embedding: Option<Param<Tensor<B, 2>>>,
    /// This stage's transformer layers, and the final norm on the last stage.
    pub block: TransformerBlock<B>,
    /// Output layer, split by vocabulary; last stage only. With tied embeddings it is `None`
    /// on a whole model (the output reuses `embedding`), and on the last of several stages the
    /// copy of the embedding table whose gradient the schedule all-reduces with the first
    /// stage's over the embedding group.
    pub output: Option<VocabParallelOutput<B>>,
    #[module(skip)]
    context: ModelContext,
}

#[derive(Debug, Clone)]
struct ModelContext {
    vocab: VocabPartition,
    max_sequence_length: usize,
    layer: LayerContext,
    /// Forward passes so far: picks fresh dropout masks for each.
    calls: Arc<AtomicU64>,
    recompute: Recompute,
    notes: Vec<String>,
    stage: Stage,
    hidden_size: usize,
    tie_embeddings: bool,
    /// Run at each layer's input in the backward pass ([`GptModel::set_backward_hook`]).
    backward_hook: Option<Arc<dyn BackwardHook>>,
    /// The context-parallel group, when CP > 1 ([`GptModel::with_context_parallel`]).
    cp: Option<CpContext>,
}

impl TransformerConfig {
    /// This rank's part of the model over the tensor-parallel group `tp`. Parameter values
    /// depend on the seed only, so every layout holds slices of the same model.
    pub fn init_gpt<B: ModelBackend>(
        &self,
        tp: &ProcessGroup,
        device: &B::Device,
    ) -> core::result::Result<GptModel<B>, ConfigError> {
        self.init_gpt_stage(tp, &Stage::whole(self.num_layers), device)
    }

    /// This rank's part of pipeline stage `stage` (see
    /// [`StageSplit`](crate::pipeline_parallel::StageSplit)) over the tensor-parallel group
    /// `tp`: exactly those layers, embeddings and output layer of the whole model. With tied
    /// embeddings the last stage (of several) holds a copy of the embedding table as its output
    /// layer, as Megatron does.
    pub fn init_gpt_stage<B: ModelBackend>(
        &self,
        tp: &ProcessGroup,
        stage: &Stage,
        device: &B::Device,
    ) -> core::result::Result<GptModel<B>, ConfigError> {
        let ep = tp
            .new_group("expert_parallel_self", &[tp.global_rank()])
            .map_err(|e| ConfigError::Invalid(format!("a single-rank expert group: {e}")))?;
        self.init_gpt_stage_with_ep(tp, &ep, stage, device)
    }

    /// [`init_gpt_stage`](Self::init_gpt_stage) with the MoE layers' routed experts split
    /// over the expert-parallel group `ep` (`state.ep()` of a
    /// [`ParallelState`](burn_megatron_dist::ParallelState)): `num_experts / ep` a rank.
    /// Parameter values do not depend on `ep` either.
    pub fn init_gpt_stage_with_ep<B: ModelBackend>(
        &self,
        tp: &ProcessGroup,
        ep: &ProcessGroup,
        stage: &Stage,
        device: &B::Device,
    ) -> core::result::Result<GptModel<B>, ConfigError> {
        if stage.layers.end > self.num_layers || stage.index >= stage.num_stages {
            return Err(ConfigError::Invalid(format!(
                "stage {} of {} with layers {:?} does not fit a model of {} layers",
                stage.index, stage.num_stages, stage.layers, self.num_layers
            )));
        }
        let validated = self.validate(tp.size(), tp.rank())?;
        let vocab = validated.vocab;
        let hidden = self.hidden_size;
        let seed = |name: &str| param_seed(self.seed, name);
        let (first, last) = (stage.is_first(), stage.is_last());
        let embedding = first.then(|| {
            VocabParallelEmbedding::new(
                vocab.clone(),
                hidden,
                self.init_std,
                self.sequence_parallel,
                tp,
                seed("embedding"),
                device,
            )
        });
        let position_embedding = (first && self.position_embedding == PositionEmbedding::Learned)
            .then(|| {
                let table = init_full(
                    [self.max_sequence_length, hidden],
                    InitDistribution::Normal { std: self.init_std },
                    seed("position_embedding"),
                    device,
                );
                Param::from_tensor(table)
            });
        let output_seed = match (self.tie_embeddings, first) {
            (false, _) => Some(seed("output")),
            (true, false) => Some(seed("embedding")),
            (true, true) => None,
        };
        let output = output_seed
            .filter(|_| last)
            .map(|seed| VocabParallelOutput::new(&vocab, hidden, self.init_std, seed, device));
        Ok(GptModel {
            embedding,
            position_embedding,
            block: TransformerBlock::new_stage_with_ep(
                self,
                stage.layers.clone(),
                last,
                tp,
                ep,
                device,
            )?,
            output,
            context: ModelContext {
                vocab,
                max_sequence_length: self.max_sequence_length,
                layer: LayerContext {
                    index: usize::MAX,
                    seed: self.seed,
                    hidden_dropout: self.hidden_dropout,
                    tp: TpContext::new(tp, self.sequence_parallel),
                    cp: None,
                },
                calls: Arc::new(AtomicU64::new(0)),
                recompute: self.recompute,
                notes: validated.notes,
                stage: stage.clone(),
                hidden_size: hidden,
                tie_embeddings: self.tie_embeddings,
                backward_hook: None,
                cp: None,
            },
        })
    }
}

/// The embeddings and output layer as their layers declare them; the learned position table
/// is replicated.
impl<B: Backend> DeclarePlacements for GptModel<B> {
    fn declare_placements(&self, out: &mut Placements) {
        self.embedding.declare_placements(out);
        if let Some(table) = &self.position_embedding {
            out.declare(table, ParamPlacement::replicated());
        }
        self.block.declare_placements(out);
        self.output.declare_placements(out);
    }

    /// The last stage's copy of a tied embedding table (`output.weight`).
    fn shared_copies(&self) -> Vec<String> {
        if self.context.tie_embeddings && !self.context.stage.is_first() && self.output.is_some() {
            vec!["output.weight".to_string()]
        } else {
            Vec::new()
        }
    }
}

impl<B: Backend> GptModel<B> {
    /// The same model (the same parameters, ids, dropout count and backward hook), summing
    /// the gradients sequence parallelism leaves partial (norm weights, row-parallel biases)
    /// where `grads` says. A model is built with [`SequenceParallelGrads::SumInBackward`]:
    /// `loss.backward()` gives whole gradients. With [`SequenceParallelGrads::Deferred`] they
    /// stay partial until
    /// [`sum_sequence_parallel_grads`](crate::tensor_parallel::sum_sequence_parallel_grads)
    /// sums them all in one all-reduce, as the schedules of
    /// [`pipeline_parallel`](crate::pipeline_parallel) do with whatever model they are given.
    /// Gradients keep their keys: the parameter ids are those of `self`.
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        self.map_tp_context(&|tp| tp.with_sequence_parallel_grads(grads))
    }

    /// The same model (same parameters and ids) with every tensor-parallel context (the
    /// model's, the output layer's, each layer's) mapped by `f`.
    fn map_tp_context(self, f: &dyn Fn(TpContext) -> TpContext) -> Self {
        let mut context = self.context;
        context.layer.tp = f(context.layer.tp);
        Self {
            embedding: self.embedding.map(|embedding| embedding.map_tp_context(f)),
            position_embedding: self.position_embedding,
            block: self.block.map_tp_context(f),
            output: self.output,
            context,
        }
    }
}

impl<B: Backend> GptModel<B> {
    /// The same model (the same parameters, ids, dropout count and backward hook) run by
    /// context parallelism over `cp.group` (Megatron's `--context-parallel-size`): each rank
    /// takes its two chunks of every sequence ([`LoadBalancedSplit`]), tokens and targets,
    /// and every layer works on them; attention crosses the group by `cp.comm`
    /// ([`context_parallel_attention`]), RoPE and the learned positions take the tokens'
    /// global positions, and [`loss`](Self::loss) is the mean over the whole sequences of the
    /// group. The gradients of one rank's backward pass are its tokens' share: the model's
    /// gradient is their sum over the CP group (reduced over DP × CP in training, see
    /// [`DistributedAdamW`](crate::optimizer::DistributedAdamW)). A group of one rank gives
    /// the model back unchanged. Attention dropout has no context-parallel form: a
    /// [`ConfigError`].
    ///
    /// [`LoadBalancedSplit`]: crate::context_parallel::LoadBalancedSplit
    /// [`context_parallel_attention`]: crate::context_parallel::context_parallel_attention
    pub fn with_context_parallel(self, cp: CpContext) -> core::result::Result<Self, ConfigError> {
        let cp = Some(cp).filter(|cp| cp.size() > 1);
        let mut context = self.context;
        context.layer.cp = cp.clone();
        context.cp = cp.clone();
        Ok(Self {
            block: self.block.with_context_parallel(cp)?,
            context,
            ..self
        })
    }

    /// The context-parallel group the model runs over, when CP > 1.
    pub fn context_parallel(&self) -> Option<&CpContext> {
        self.context.cp.as_ref()
    }
}

impl<B: ModelBackend> GptModel<B> {
    /// `[batch, seq]` tokens → `[batch, seq, padded_vocab / tp]`: this rank's slice of the
    /// logits. Under sequence parallelism `seq` must be divisible by the TP size; every token
    /// id must be in `0..vocab_size` (an [`InputError`] otherwise). Under context parallelism
    /// ([`with_context_parallel`](Self::with_context_parallel)) `seq` is this rank's two
    /// chunks of the sequence, in split order, and the logits are those of its tokens.
    ///
    /// # Shapes
    /// - tokens: `[batch, seq]`
    /// - output: `[batch, seq, padded_vocab / tp]`
    ///
    /// Runs a whole model (a pipeline stage is a [`PipelineError::MissingPiece`]). A model
    /// built with [`Recompute::Full`] (or a variant) that tracks gradients is a
    /// [`PipelineError::RecomputeNeedsSchedule`]: train it with a schedule of
    /// [`pipeline_parallel`](crate::pipeline_parallel), which reruns the layers in the
    /// backward pass.
    ///
    /// The auxiliary losses of MoE layers are dropped (for evaluation);
    /// [`try_forward_with_losses`](Self::try_forward_with_losses) returns them.
    pub fn try_forward(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>> {
        Ok(self.try_forward_with_losses(tokens)?.0)
    }

    /// [`try_forward`](Self::try_forward) and the MoE layers' auxiliary losses: add
    /// [`MoeLosses::total`] (or use [`MoeLosses::add_to`]) to the loss before the backward
    /// pass. Empty for a dense model.
    pub fn try_forward_with_losses(
        &self,
        tokens: Tensor<B, 2, Int>,
    ) -> Result<(Tensor<B, 3>, MoeLosses<B>)> {
        if self.context.recompute.reruns_layers() && self.tracks_gradients() {
            return Err(PipelineError::RecomputeNeedsSchedule.into());
        }
        let call = self.next_call();
        let x = self.embed(tokens, call)?;
        let mut x = x;
        let mut losses = MoeLosses::default();
        for (i, layer) in self.block.layers.iter().enumerate() {
            x = layer.try_forward_with_losses(self.mark_layer_input(x, i), call, &mut losses)?;
        }
        Ok((self.mark_output(self.head(x)?), losses))
    }

    /// `x`, this stage's output (the logits on the last stage, else the last layer's output),
    /// marked for the [backward hook](Self::set_backward_hook) with point `layers().len()`:
    /// its backward runs before any of the stage's own, so the hook learns there that a
    /// backward pass begins, before the weight gradients the layers offer it.
    pub fn mark_output(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.mark_layer_input(x, self.block.layers.len())
    }

    /// `x`, the input of this stage's layer `i`, marked for the
    /// [backward hook](Self::set_backward_hook) when one is installed.
    pub fn mark_layer_input(&self, x: Tensor<B, 3>, i: usize) -> Tensor<B, 3> {
        match &self.context.backward_hook {
            Some(hook) => B::backward_hook(x, hook, i),
            None => x,
        }
    }

    /// Installs `hook` (or removes it, with `None`) at every layer's input: in the backward
    /// pass of [`try_forward`](Self::try_forward) and of the schedules of
    /// [`pipeline_parallel`](crate::pipeline_parallel) (not under full recomputation), it
    /// runs with the layer's index in [`layers`](Self::layers) once that layer's gradients
    /// are all computed, last layer first. The distributed optimizer's
    /// [`overlap hook`](crate::optimizer::DistributedAdamW::overlap_hook) starts the
    /// data-parallel gradient reduction there.
    ///
    /// The model's dense layers offer the hook their weight gradients too
    /// ([`BackwardHook::take_weight_gradient`]).
    pub fn set_backward_hook(&mut self, hook: Option<Arc<dyn BackwardHook>>) {
        let model = std::mem::replace(self, self.clone());
        *self = model.map_tp_context(&|tp| tp.with_backward_hook(hook.clone()));
        self.context.backward_hook = hook;
    }

    /// [`try_forward`](Self::try_forward), panicking with its error: Burn's convention of an
    /// infallible `forward(input) -> output`, for code written against it. Prefer
    /// `try_forward`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.try_forward(tokens).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Per-token cross-entropy of `logits` (from [`try_forward`](Self::try_forward)) against
    /// `targets` (`[batch, seq]`), without gathering the vocabulary; `[batch, seq]`. A target
    /// at or above the vocabulary size is an [`InputError`].
    pub fn token_losses(
        &self,
        logits: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 2>> {
        vocab_parallel_cross_entropy(logits, targets, &self.context.vocab, self.tp())
    }

    /// The mean cross-entropy over the targets that are not negative (a negative target,
    /// such as -100, is ignored).
    ///
    /// Under context parallelism `logits` and `targets` are this rank's tokens, and the loss
    /// is the mean over every rank's tokens of the CP group, token-count weighted (the sums
    /// and the counts are added over the group, not the ranks' means averaged): the loss of
    /// the whole sequences, the same on every rank. Its backward gives each rank its own
    /// tokens' share of the gradient (the sum over the group is an all-reduce forward,
    /// identity backward): sum the gradients over CP.
    pub fn loss(&self, logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Result<Tensor<B, 1>> {
        let keep = targets.clone().greater_equal_elem(0);
        let losses = self.token_losses(logits, targets)?;
        let Some(cp) = &self.context.cp else {
            return Ok(masked_mean(losses, keep));
        };
        let mask = keep.float().cast(losses.dtype());
        let count = reduce_from_tensor_parallel_region(mask.clone().sum().detach(), &cp.group)?;
        let local = (losses * mask).sum() / count.clamp_min(1.0);
        Ok(reduce_from_tensor_parallel_region(local, &cp.group)?)
    }

    /// The vocabulary as split over TP.
    pub fn vocab(&self) -> &VocabPartition {
        &self.context.vocab
    }

    /// The most tokens a sequence may hold (the learned position table's rows; RoPE models
    /// keep the configured limit too).
    pub fn max_sequence_length(&self) -> usize {
        self.context.max_sequence_length
    }

    /// Whether the model was built with sequence parallelism.
    pub fn sequence_parallel(&self) -> bool {
        self.context.layer.tp.sequence_parallel
    }

    /// Notes from building the model, such as vocabulary padding.
    pub fn notes(&self) -> &[String] {
        &self.context.notes
    }

    /// The activation recomputation the model was built with.
    pub fn recompute(&self) -> Recompute {
        self.context.recompute
    }

    /// The pipeline stage the model is (the whole model is stage 0 of 1).
    pub fn stage(&self) -> &Stage {
        &self.context.stage
    }

    /// This stage's transformer layers; `layers()[i]` is global layer `stage().layers.start +
    /// i`. Run layer `l` for a forward pass with `l.try_forward(x, call)`.
    pub fn layers(&self) -> &[TransformerLayer<B>] {
        &self.block.layers
    }

    /// The number of a new forward pass, which picks its dropout masks: every piece of one
    /// microbatch's pass (and its recomputation) must use the same number, and every stage
    /// numbers its passes alike (the n-th microbatch it sees gets the n-th number).
    pub fn next_call(&self) -> u64 {
        self.context.calls.fetch_add(1, Ordering::Relaxed)
    }

    /// Sets the number [`next_call`](Self::next_call) returns next: a run resumed from a
    /// checkpoint continues the count of forward passes, so its dropout masks are those of the
    /// uninterrupted run.
    pub fn set_next_call(&self, call: u64) {
        self.context.calls.store(call, Ordering::Relaxed)
    }

    /// The shape of the residual stream between stages for `[batch, seq]` tokens:
    /// `[batch, seq, hidden]`, or `[batch, seq / tp, hidden]` under sequence parallelism.
    pub fn activation_shape(&self, batch: usize, seq: usize) -> [usize; 3] {
        let c = &self.context;
        let seq = if c.layer.tp.sequence_parallel {
            seq / c.layer.tp.group.size()
        } else {
            seq
        };
        [batch, seq, c.hidden_size]
    }

    /// Whether the output layer is tied to the token embeddings.
    pub fn ties_embeddings(&self) -> bool {
        self.context.tie_embeddings
    }

    /// The path in the whole model of this stage's parameter at `path`: layers renumbered
    /// ([`Stage::global_path`]), and a later stage's copy of a tied embedding table
    /// (`output.weight`) named as the table it copies, `embedding.weight`.
    pub fn global_path(&self, path: &str) -> String {
        let stage = self.stage();
        if self.ties_embeddings() && !stage.is_first() && path == "output.weight" {
            return "embedding.weight".to_string();
        }
        stage.global_path(path)
    }

    /// This chunk's FP8 linear layers, each with its path in the whole model
    /// (`block.layers.5.attention.qkv`): where checkpoints keep delayed scaling's state.
    pub fn fp8_layers(&self) -> Vec<(String, &Fp8Linear)> {
        let mut layers = Vec::new();
        for (i, layer) in self.block.layers.iter().enumerate() {
            let attention = &layer.attention;
            let mlp = layer.mlp.as_ref();
            let linears = [
                ("attention.qkv", attention.qkv.fp8()),
                ("attention.output", attention.output.fp8()),
                ("mlp.fc1", mlp.and_then(|m| m.fc1.fp8())),
                ("mlp.gate", mlp.and_then(|m| m.gate.as_ref()?.fp8())),
                ("mlp.fc2", mlp.and_then(|m| m.fc2.fp8())),
            ];
            for (name, fp8) in linears {
                if let Some(fp8) = fp8 {
                    layers.push((self.global_path(&format!("block.layers.{i}.{name}")), fp8));
                }
            }
        }
        layers
    }

    /// The tensor-parallel group the model is split over.
    pub fn tp(&self) -> &ProcessGroup {
        &self.context.layer.tp.group
    }

    /// The model after DeepSeek-V3's expert-bias update of a step: each MoE layer of this
    /// stage whose router has an expert bias moves it by
    /// [`expert_bias_update`](crate::transformer::moe::expert_bias_update) of its counts in
    /// `tokens_per_expert` (global layer index and the step's tokens per expert over every
    /// DP × CP rank, `[num_experts]` on the device). Layers not listed are left as they are.
    pub fn with_updated_expert_bias(
        mut self,
        tokens_per_expert: &[(usize, Tensor<B, 1>)],
        rate: f64,
    ) -> Self {
        let first = self.stage().layers.start;
        for (i, layer) in self.block.layers.iter_mut().enumerate() {
            let counts = tokens_per_expert.iter().find(|(l, _)| *l == first + i);
            if let (Some(moe), Some((_, counts))) = (layer.moe.as_mut(), counts) {
                moe.update_expert_bias(counts.clone(), rate);
            }
        }
        self
    }

    /// Makes FP8 delayed scaling's amax histories the same on every rank of `group` (the
    /// data-parallel group), unless the layers' settings say `tp_only_amax_reduction`
    /// ([`reduce_delayed_states`] over the model's FP8 layers, on backend `I`, the inner one
    /// under `Autodiff`). A training loop calls it once per optimizer step, so that the ranks
    /// cast the next step with the same scales and a checkpoint's states are every rank's.
    pub fn reduce_fp8_histories<I: Backend + DeviceTransport>(
        &self,
        group: &ProcessGroup,
    ) -> DistResult<()> {
        let layers = self.fp8_layers();
        reduce_delayed_states::<I>(layers.iter().map(|(_, fp8)| *fp8), group)
    }

    /// The same model counting `global_aux_loss`'s load over `group` in every MoE layer
    /// ([`Router::with_global_load_group`](crate::transformer::moe::Router::with_global_load_group)):
    /// the DP × CP ranks of this stage and tensor-parallel rank (`ParallelState::dp_cp`).
    pub fn with_global_load_group(mut self, group: Option<ProcessGroup>) -> Self {
        for layer in &mut self.block.layers {
            if let Some(moe) = layer.moe.as_mut() {
                moe.router = moe.router.clone().with_global_load_group(group.clone());
            }
        }
        self
    }

    /// Starts every MoE layer's `global_aux_loss` load afresh: a training loop calls it
    /// before each optimizer step's first micro-batch (a no-op for other load-balancing
    /// types).
    pub fn reset_global_load(&self) {
        for layer in &self.block.layers {
            if let Some(moe) = &layer.moe {
                moe.router.reset_global_load();
            }
        }
    }

    /// The expert-parallel group this stage's MoE layers split their experts over; `None`
    /// when the stage has no MoE layer.
    pub fn expert_parallel_group(&self) -> Option<&ProcessGroup> {
        self.block
            .layers
            .iter()
            .find_map(|layer| layer.moe.as_ref())
            .map(|moe| moe.dispatcher().ep())
    }

    /// Whether a forward pass would record a graph for the parameters' gradients.
    fn tracks_gradients(&self) -> bool {
        let device = self.devices().into_iter().next().unwrap_or_default();
        if !B::ad_enabled(&device) {
            return false;
        }
        struct AnyTracked(bool);
        impl<B: Backend> ModuleVisitor<B> for AnyTracked {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0 |= param.val().is_require_grad();
            }
        }
        let mut visitor = AnyTracked(false);
        self.visit(&mut visitor);
        visitor.0
    }

    fn missing(&self, piece: &'static str) -> PipelineError {
        PipelineError::MissingPiece {
            stage: self.context.stage.index,
            stages: self.context.stage.num_stages,
            piece,
        }
    }

    /// Token and position embeddings with dropout for forward pass `call` (see
    /// [`next_call`](Self::next_call)): the residual stream's start, `[batch, seq, hidden]`
    /// (`seq / tp` under sequence parallelism). First stage only. Under context parallelism
    /// `tokens` are this rank's two chunks (`seq` even, `seq · cp` at most the maximum
    /// sequence length) and the learned positions are those of their global positions.
    pub fn embed(&self, tokens: Tensor<B, 2, Int>, call: u64) -> Result<Tensor<B, 3>> {
        let embedding = self
            .embedding
            .as_ref()
            .ok_or_else(|| self.missing("embedding"))?;
        let c = &self.context;
        let [_, seq] = tokens.dims();
        let tp = &c.layer.tp.group;
        let cp = c.cp.as_ref().map_or(1, CpContext::size);
        if seq * cp > c.max_sequence_length {
            return Err(InputError::SequenceTooLong {
                len: seq * cp,
                max: c.max_sequence_length,
            }
            .into());
        }
        let positions = c.cp.as_ref().map(|cp| cp.positions(seq)).transpose()?;
        if c.layer.tp.sequence_parallel && !seq.is_multiple_of(tp.size()) {
            return Err(InputError::SequenceNotDivisible {
                len: seq,
                tp: tp.size(),
            }
            .into());
        }
        let mut x = embedding.try_forward(tokens)?;
        if let Some(table) = &self.position_embedding {
            let positions = match &positions {
                Some(positions) => {
                    let ids: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
                    let ids = Tensor::<B, 1, Int>::from_data(
                        burn::tensor::TensorData::new(ids, [seq]),
                        &table.device(),
                    );
                    table.val().select(0, ids)
                }
                None => table.val().narrow(0, 0, seq),
            }
            .unsqueeze::<3>();
            let positions = c.layer.tp.split_sequence(positions)?;
            x = x + positions;
        }
        Ok(hidden_dropout(
            x,
            None,
            &c.layer,
            DropoutSite::new(c.layer.seed, call, "embedding"),
        ))
    }

    /// The final norm and the output layer: the last layer's output `[batch, seq, hidden]`
    /// (`seq / tp` under sequence parallelism) to this rank's slice of the logits, `[batch,
    /// seq, padded_vocab / tp]`. Last stage only.
    pub fn head(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>> {
        let norm = self
            .block
            .final_norm
            .as_ref()
            .ok_or_else(|| self.missing("final norm"))?;
        let table = match (&self.output, &self.embedding) {
            (Some(output), _) => output.weight.val(),
            (None, Some(embedding)) => embedding.weight.val(),
            (None, None) => return Err(self.missing("output layer").into()),
        };
        Ok(parallel_lm_logits(
            norm.try_forward(x)?,
            table,
            &self.context.layer.tp,
        )?)
    }
}
