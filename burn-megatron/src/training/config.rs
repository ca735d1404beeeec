//! What a pretraining run is: the model's shape, the layout, the batch, the optimizer, the
//! schedule, evaluation, checkpoints and data, in Megatron's terms (`pretrain_gpt.py`'s
//! arguments), checked once before any rank starts.

use std::path::PathBuf;

use burn::config::Config;

use crate::context_parallel::CpCommType;
use crate::data::{ByteTokenizer, parse_data_path, parse_split};
use crate::distributed::DataParallelConfig;
use crate::error::ConfigError;
use crate::models::StageSplit;
use crate::ops::fp8::{Fp8Config, Fp8Recipe};
use crate::optimizer::DistributedAdamWConfig;
use crate::optimizer::{
    FlatAdamWConfig, LossScalerConfig, LrDecayStyle, LrSchedule, LrScheduleConfig,
};
use crate::pipeline_parallel::Schedule;
use crate::transformer::moe::{
    AuxLossTerm, ExpertCapacity, LoadBalancingType, MoeSettings, RouterDtype, RouterScoreFunction,
    TokenDispatcherType, TokenDropPolicy,
};
use crate::transformer::{
    Activation, Normalization, PositionEmbedding, Recompute, TransformerConfig,
};

/// A pretraining run. The defaults are the embedded run of `pretrain_gpt` with no arguments:
/// a tiny GPT on the generated default corpus at TP = 2 × PP = 2 (4 ranks), a minute or two
/// on two CPU cores.
#[derive(Config, Debug)]
pub struct PretrainConfig {
    /// Transformer layers (`--num-layers`); divisible by the pipeline-parallel size.
    #[config(default = 2)]
    pub num_layers: usize,
    /// Width of the residual stream (`--hidden-size`).
    #[config(default = 64)]
    pub hidden_size: usize,
    /// Attention heads (`--num-attention-heads`); divisible by the tensor-parallel size.
    #[config(default = 4)]
    pub num_attention_heads: usize,
    /// Hidden width of the MLP (`--ffn-hidden-size`); `None` for 4 × hidden size.
    pub ffn_hidden_size: Option<usize>,
    /// Tokens per sample (`--seq-length`), also the model's longest sequence.
    #[config(default = 64)]
    pub seq_length: usize,
    /// Real vocabulary size (`--vocab-size`): every token id of the data must be below it.
    /// The default is the byte tokenizer's (256 bytes and the end-of-document token).
    #[config(default = 257)]
    pub vocab_size: usize,
    /// The vocabulary is padded to a multiple of this times TP
    /// (`--make-vocab-size-divisible-by`).
    #[config(default = 8)]
    pub make_vocab_size_divisible_by: usize,
    /// Standard deviation of the normal initialisation (`--init-method-std`).
    #[config(default = 0.02)]
    pub init_std: f64,
    /// Dropout on the embeddings and each block's output (`--hidden-dropout`).
    #[config(default = 0.0)]
    pub hidden_dropout: f64,
    /// Dropout on the attention probabilities (`--attention-dropout`).
    #[config(default = 0.0)]
    pub attention_dropout: f64,
    /// The MLP's activation is SwiGLU (Llama), `silu(gate(x)) · up(x)`, instead of GeLU.
    #[config(default = false)]
    pub swiglu: bool,
    /// The normalisation layer: LayerNorm (GPT) or RMSNorm (Llama).
    #[config(default = "Normalization::LayerNorm")]
    pub normalization: Normalization,
    /// Width of each attention head (`--kv-channels`); `None`: hidden size / heads. See
    /// [`TransformerConfig::kv_channels`](crate::transformer::TransformerConfig::kv_channels).
    #[config(default = "None")]
    pub kv_channels: Option<usize>,
    /// QK-norm (`--qk-layernorm`): see
    /// [`TransformerConfig::qk_layernorm`](crate::transformer::TransformerConfig::qk_layernorm).
    #[config(default = false)]
    pub qk_layernorm: bool,
    /// Epsilon of the normalisation.
    #[config(default = 1e-5)]
    pub norm_epsilon: f64,
    /// How positions enter the model: a learned table, or rotary embeddings with their base.
    #[config(default = "PositionEmbedding::Learned")]
    pub position_embedding: PositionEmbedding,
    /// Key/value heads (grouped-query attention); `None` for one per query head.
    pub num_query_groups: Option<usize>,
    /// The output layer has its own weights instead of the token embedding table's.
    #[config(default = false)]
    pub untie_embeddings_and_output_weights: bool,
    /// Whether the linear layers have biases.
    #[config(default = true)]
    pub add_bias_linear: bool,
    /// Activation recomputation: none, the attention core (selective), or whole layers (full).
    #[config(default = "Recompute::None")]
    pub recompute: Recompute,
    /// Train without saving any checkpoint, not even the example's default one at the end.
    #[config(default = false)]
    pub no_save: bool,
    /// Print the memory planner's table for this model, batch and world instead of training.
    #[config(default = false)]
    pub plan: bool,
    /// One GPU's memory in GiB, for the planner.
    #[config(default = 80.0)]
    pub gpu_memory_gib: f64,
    /// Tensor-parallel size (`--tensor-model-parallel-size`).
    #[config(default = 2)]
    pub tensor_model_parallel_size: usize,
    /// Pipeline-parallel size (`--pipeline-model-parallel-size`).
    #[config(default = 2)]
    pub pipeline_model_parallel_size: usize,
    /// Layers per virtual pipeline stage (`--num-layers-per-virtual-pipeline-stage`): each
    /// rank then holds `num_layers / (pp · this)` model chunks and runs the interleaved 1F1B
    /// schedule, whose bubble is that many times smaller. `None`: one chunk per rank, 1F1B.
    #[config(default = "None")]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// Model chunks per pipeline rank (`--num-virtual-stages-per-pipeline-rank`), Megatron's
    /// way to ask for the interleaved schedule when the ranks hold different numbers of
    /// layers; each rank's layers are split over its chunks as evenly as they go.
    #[config(default = "None")]
    pub num_virtual_stages_per_pipeline_rank: Option<usize>,
    /// Layers of the first pipeline rank (`--decoder-first-pipeline-num-layers`); the ranks
    /// without a count share the rest evenly.
    #[config(default = "None")]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers of the last pipeline rank (`--decoder-last-pipeline-num-layers`): fewer than
    /// the others balance the pipeline when the output layer is heavy (see
    /// [`StageSplit::pipeline`]).
    #[config(default = "None")]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// Sequence parallelism over the TP group (`--sequence-parallel`); the sequence length
    /// must be divisible by TP.
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Tensor-parallel communication overlapped with the GEMMs (`--tp-comm-overlap`): see
    /// [`TransformerConfig::tp_comm_overlap`](crate::transformer::TransformerConfig::tp_comm_overlap).
    /// Needs sequence parallelism; not with FP8 yet.
    #[config(default = false)]
    pub tp_comm_overlap: bool,
    /// Data-parallel size: replicas of the TP × PP model, each reading its own microbatches of
    /// the global batch (Megatron derives it from the world size; here the world is TP × PP ×
    /// DP).
    #[config(default = 1)]
    pub data_parallel_size: usize,
    /// Context-parallel size (`--context-parallel-size`): ranks that split every sequence
    /// through the whole model, each holding two of `2 · cp` chunks (see
    /// [`GptModel::with_context_parallel`](crate::models::GptModel::with_context_parallel)).
    /// The world is TP × PP × CP × DP.
    #[config(default = 1)]
    pub context_parallel_size: usize,
    /// How context-parallel attention communicates (`--cp-comm-type`, Megatron's names):
    /// `p2p`, `all_gather` or `a2a` ([`CpCommType`]).
    #[config(default = "String::from(\"p2p\")")]
    pub cp_comm_type: String,
    /// Shard the fp32 master weights and AdamW moments over DP (ZeRO-1,
    /// `--use-distributed-optimizer`): gradients reduce-scattered, parameters all-gathered.
    #[config(default = false)]
    pub use_distributed_optimizer: bool,
    /// Reduce each bucket's gradients from inside the backward pass, as soon as its layers are
    /// done (`--overlap-grad-reduce`); with device collectives (NCCL) the reduction overlaps the
    /// rest of the backward. The same results as reducing after it. No effect without DP or the
    /// distributed optimizer.
    #[config(default = false)]
    pub overlap_grad_reduce: bool,
    /// All-gather the distributed optimizer's updated parameters in buckets, issued in the
    /// order the next forward pass reads them (`--overlap-param-gather`,
    /// [`DataParallelConfig::overlap_param_gather`]), each parameter a view of its bucket
    /// where it lies in one, so that a kernel reading it need not wait for the whole gather.
    /// The same results. Needs `use_distributed_optimizer`.
    #[config(default = false)]
    pub overlap_param_gather: bool,
    /// With `overlap_grad_reduce`, the weight-gradient GEMMs of the dense layers and of the
    /// experts add straight into the hook's f32 gradient buffers (Megatron's
    /// gradient-accumulation fusion,
    /// [`DataParallelConfig::gradient_accumulation_fusion`]); `false` is
    /// `--no-gradient-accumulation-fusion`.
    #[config(default = true)]
    pub gradient_accumulation_fusion: bool,
    /// Match every GPU collective across ranks on the host before it runs
    /// (`--collective-checks`): a mismatch is an error naming each rank's call, at the cost of
    /// a host round trip per call. Off, calls go straight to NCCL: a mismatch then ends in the
    /// watchdog's timeout naming the rank and operation, and `overlap_grad_reduce` overlaps
    /// the backward pass (with checks on, the reduction runs after it). No effect on CPU
    /// ranks.
    #[config(default = true)]
    pub collective_checks: bool,
    /// Samples per microbatch (`--micro-batch-size`).
    #[config(default = 4)]
    pub micro_batch_size: usize,
    /// Samples per optimizer step (`--global-batch-size`): a multiple of micro batch × DP;
    /// the quotient is the number of microbatches (gradient accumulation) per step.
    #[config(default = 16)]
    pub global_batch_size: usize,
    /// Peak learning rate (`--lr`).
    #[config(default = 3e-3)]
    pub lr: f64,
    /// Learning rate at the end of the decay (`--min-lr`).
    #[config(default = 3e-4)]
    pub min_lr: f64,
    /// Iterations of linear warm-up (`--lr-warmup-iters`).
    #[config(default = 10)]
    pub lr_warmup_iters: usize,
    /// The iteration at which the decay reaches `min_lr` (`--lr-decay-iters`); `None` for
    /// `train_iters`.
    pub lr_decay_iters: Option<usize>,
    /// The decay after the warm-up (`--lr-decay-style`: constant, linear, cosine).
    #[config(default = "LrDecayStyle::Cosine")]
    pub lr_decay_style: LrDecayStyle,
    /// AdamW's decoupled weight decay (`--weight-decay`); biases and norms are exempt.
    #[config(default = 0.01)]
    pub weight_decay: f64,
    /// AdamW's β₁ (`--adam-beta1`).
    #[config(default = 0.9)]
    pub adam_beta1: f32,
    /// AdamW's β₂ (`--adam-beta2`).
    #[config(default = 0.95)]
    pub adam_beta2: f32,
    /// AdamW's ε (`--adam-eps`).
    #[config(default = 1e-8)]
    pub adam_eps: f32,
    /// Largest global gradient norm; larger gradients are scaled down to it (`--clip-grad`).
    #[config(default = 1.0)]
    pub clip_grad: f64,
    /// Stop the run with [`TrainingError::NonFinite`](crate::error::TrainingError::NonFinite)
    /// at the first NaN or infinite loss or gradient norm, or parameter before a save
    /// (`--check-for-nan-in-loss-and-grad`, Megatron's name, on by default), so that no
    /// checkpoint ever holds one. What is checked, and when, is in the option's help
    /// ([`PretrainArgs`](crate::training::PretrainArgs)): the values the loop reads anyway,
    /// plus one read of every parameter before each save and at the end of the run.
    #[config(default = true)]
    pub check_for_nan_in_loss_and_grad: bool,
    /// Optimizer steps to train for in all (`--train-iters`), counting those of a loaded
    /// checkpoint.
    #[config(default = 100)]
    pub train_iters: usize,
    /// Iterations between progress reports (`--log-interval`).
    #[config(default = 1)]
    pub log_interval: usize,
    /// Iterations between evaluations on the validation split (`--eval-interval`); 0 for
    /// none.
    #[config(default = 25)]
    pub eval_interval: usize,
    /// Global batches per evaluation (`--eval-iters`).
    #[config(default = 2)]
    pub eval_iters: usize,
    /// Directory to save checkpoints in (`--save`); `None` saves nothing.
    pub save: Option<PathBuf>,
    /// Iterations between checkpoints (`--save-interval`); `None` saves only at the end.
    pub save_interval: Option<usize>,
    /// Directory to resume from (`--load`): its latest checkpoint restores the model, the
    /// optimizer, the iteration and the data position. An empty or missing directory starts
    /// from scratch, as Megatron does, so `--save d --load d` resumes a killed run.
    pub load: Option<PathBuf>,
    /// Checkpoints kept in `save` (older ones are removed).
    #[config(default = 3)]
    pub keep_last_checkpoints: usize,
    /// Write checkpoints in the background (`--async-save`): a save blocks the step only for
    /// the host copies; it is published at the next save or at the end of the run.
    #[config(default = false)]
    pub async_save: bool,
    /// Train through burn-train's `Learner` (`--learner`,
    /// [`pretrain_with_learner`](crate::training::learner::pretrain_with_learner)) instead of
    /// [`pretrain`](crate::training::pretrain)'s own loop.
    #[config(default = false)]
    pub learner: bool,
    /// bf16 parameters and activations with fp32 master weights, gradients and AdamW state
    /// (`--bf16`, Megatron's mixed precision): the step is the flat-buffer
    /// [`DistributedAdamW`](crate::optimizer::DistributedAdamW)'s. The launcher sets the
    /// device's default float dtype to bf16 before the model is built.
    #[config(default = false)]
    pub bf16: bool,
    /// fp16 parameters and activations with fp32 master weights, gradients and AdamW state,
    /// and Megatron's dynamic loss scaler (`--fp16`): the loss is scaled before backward, an
    /// overflow anywhere skips the step on every rank and backs the scale off, all decided
    /// on the device. The launcher sets the device's default float dtype to f16.
    #[config(default = false)]
    pub fp16: bool,
    /// The loss scale of the first step (`--initial-loss-scale`, Megatron's 2³²).
    #[config(default = 4294967296.0)]
    pub initial_loss_scale: f64,
    /// Clean steps before the scale doubles (`--loss-scale-window`).
    #[config(default = 1000)]
    pub loss_scale_window: usize,
    /// Overflowing steps before the scale halves (`--hysteresis`).
    #[config(default = 2)]
    pub hysteresis: usize,
    /// Datasets (`--data-path`): indexed-dataset prefixes, optionally as `weight prefix`
    /// pairs for a blend. Empty for the generated default corpus.
    #[config(default = "Vec::new()")]
    pub data_path: Vec<String>,
    /// Documents of the generated default corpus when `data_path` is empty.
    #[config(default = 4000)]
    pub default_corpus_documents: usize,
    /// Train, validation and test weights of each dataset's documents (`--split`).
    #[config(default = "String::from(\"969,30,1\")")]
    pub split: String,
    /// Seed of the initialisation, dropout and data shuffles (`--seed`).
    #[config(default = 1234)]
    pub seed: u64,
    /// Peak dense TFLOP/s of one device, the denominator of the logged MFU
    /// (`--peak-tflops`; 989.4 is an H100/H200 SXM's bf16 peak, 494.7 its TF32 one).
    #[config(default = 989.4)]
    pub peak_tflops: f64,
    /// Record where each GPU's time goes, per kernel, over iterations `profile_step_start +
    /// 1` to `profile_step_end` (`--profile`, Megatron's option; our CUDA backend's built-in
    /// profile, which needs `BM_PROFILE=1` in the environment), on the ranks
    /// `profile_ranks`; each prints its table when the window ends.
    #[config(default = false)]
    pub profile: bool,
    /// The iteration after which the profile starts (`--profile-step-start`).
    #[config(default = 10)]
    pub profile_step_start: u64,
    /// The iteration at which it ends (`--profile-step-end`).
    #[config(default = 12)]
    pub profile_step_end: u64,
    /// The global ranks profiled (`--profile-ranks`).
    #[config(default = "vec![0]")]
    pub profile_ranks: Vec<usize>,
    /// FP8 GEMMs in the transformer layers (`--fp8-format`, `--fp8-recipe`, `--fp8-margin`,
    /// `--fp8-amax-history-len`, `--fp8-amax-compute-algo`); `None`: the run's dtype
    /// throughout. Megatron requires `--bf16` or `--fp16` with FP8; here an fp32 run may use it
    /// too, so that the CPU build (no bf16) runs the FP8 path, emulated in f32.
    #[config(default = "None")]
    pub fp8: Option<Fp8Config>,
    /// Routed experts of each MoE layer (`--num-experts`); `None`: a dense model.
    #[config(default = "None")]
    pub num_experts: Option<usize>,
    /// Expert-parallel size (`--expert-model-parallel-size`): ranks of a DP group (Megatron
    /// carves EP out of DP × CP) that split each MoE layer's experts; the other factor,
    /// `DP × CP / EP`, is the expert-data-parallel size over which expert gradients are
    /// averaged.
    #[config(default = 1)]
    pub expert_model_parallel_size: usize,
    /// Expert tensor parallelism (`--expert-tensor-parallel-size`): 1 (every expert whole on
    /// each TP rank) or the TP size (each expert's hidden width split over TP); `None`: the
    /// TP size, Megatron's default.
    #[config(default = "None")]
    pub expert_tensor_parallel_size: Option<usize>,
    /// The dtype the MoE routers compute in (`--moe-router-dtype`); `None`: the model's.
    #[config(default = "None")]
    pub moe_router_dtype: Option<RouterDtype>,
    /// Route by pseudo-random logits for an even expert load
    /// (`--moe-router-force-load-balancing`, for benchmarks).
    #[config(default = false)]
    pub moe_router_force_load_balancing: bool,
    /// Hidden width of each routed expert (`--moe-ffn-hidden-size`); `None`: the MLP's.
    #[config(default = "None")]
    pub moe_ffn_hidden_size: Option<usize>,
    /// Experts per token (`--moe-router-topk`).
    #[config(default = 2)]
    pub moe_router_topk: usize,
    /// Softmax or sigmoid router scores (`--moe-router-score-function`).
    #[config(default = "RouterScoreFunction::Softmax")]
    pub moe_router_score_function: RouterScoreFunction,
    /// Each token's top-k weights divided by their sum (`--moe-router-topk-normalize`).
    #[config(default = false)]
    pub moe_router_topk_normalize: bool,
    /// Top-k of the softmax over all experts, not a softmax over the top-k logits
    /// (`--moe-router-pre-softmax`).
    #[config(default = false)]
    pub moe_router_pre_softmax: bool,
    /// Groups of experts for group-limited routing (`--moe-router-num-groups`).
    #[config(default = "None")]
    pub moe_router_num_groups: Option<usize>,
    /// Groups a token may choose its experts from (`--moe-router-group-topk`).
    #[config(default = "None")]
    pub moe_router_group_topk: Option<usize>,
    /// Factor of the top-k weights (`--moe-router-topk-scaling-factor`).
    #[config(default = "None")]
    pub moe_router_topk_scaling_factor: Option<f64>,
    /// The load-balancing loss, Sinkhorn balancing or none
    /// (`--moe-router-load-balancing-type`; the first of a list).
    #[config(default = "LoadBalancingType::AuxLoss")]
    pub moe_router_load_balancing_type: LoadBalancingType,
    /// Coefficient of the load-balancing loss (`--moe-aux-loss-coeff`; the first of a list).
    #[config(default = 0.0)]
    pub moe_aux_loss_coeff: f64,
    /// The losses the lists of `--moe-router-load-balancing-type` and `--moe-aux-loss-coeff`
    /// add to the first, with their coefficients.
    #[config(default = "Vec::new()")]
    pub moe_more_aux_losses: Vec<AuxLossTerm>,
    /// Switch Transformer's jitter of the routers' input in training
    /// (`--moe-input-jitter-eps`); `None` for none.
    #[config(default = "None")]
    pub moe_input_jitter_eps: Option<f64>,
    /// Coefficient of the z-loss (`--moe-z-loss-coeff`).
    #[config(default = 0.0)]
    pub moe_z_loss_coeff: f64,
    /// Width of the shared expert (`--moe-shared-expert-intermediate-size`); `None`: none.
    #[config(default = "None")]
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// Every k-th layer from layer 0 is an MoE layer (`--moe-layer-freq k`).
    #[config(default = 1)]
    pub moe_layer_freq: usize,
    /// One flag a layer instead (`--moe-layer-freq "([0]*1+[1]*3)"`).
    #[config(default = "None")]
    pub moe_layer_pattern: Option<Vec<bool>>,
    /// DeepSeek-V3's auxiliary-loss-free expert bias (`--moe-router-enable-expert-bias`):
    /// after each step every router's bias moves toward a balanced load.
    #[config(default = false)]
    pub moe_router_enable_expert_bias: bool,
    /// How far the expert bias moves per step (`--moe-router-bias-update-rate`).
    #[config(default = 1e-3)]
    pub moe_router_bias_update_rate: f64,
    /// Capacity factor of each expert (`--moe-expert-capacity-factor`); `None`: dropless.
    #[config(default = "None")]
    pub moe_expert_capacity_factor: Option<f64>,
    /// Which assignments an over-full expert drops (`--moe-token-drop-policy`); `None`: probs.
    /// Needs a capacity factor.
    #[config(default = "None")]
    pub moe_token_drop_policy: Option<TokenDropPolicy>,
    /// Each expert's input padded to its capacity (`--moe-pad-expert-input-to-capacity`).
    /// Needs a capacity factor.
    #[config(default = false)]
    pub moe_pad_expert_input_to_capacity: bool,
    /// How tokens travel to the experts and back (`--moe-token-dispatcher-type alltoall|
    /// allgather`): the same results either way. Megatron defaults to `allgather`; here the
    /// default is `alltoall`, the dispatcher that every earlier run, test, benchmark and GPU
    /// preset used and the only one run on a GPU so far, so that leaving the option out
    /// means what it meant before the all-gather dispatcher existed (the all-gather one moves
    /// and holds `ep` times the tokens: for small EP groups).
    #[config(default = "TokenDispatcherType::AllToAll")]
    pub moe_token_dispatcher_type: TokenDispatcherType,
}

/// The facts every rank derives from a checked [`PretrainConfig`].
#[derive(Debug, Clone)]
pub struct RunLayout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// How context-parallel attention communicates.
    pub cp_comm: CpCommType,
    /// Model chunks (virtual pipeline stages) per rank: 1 unless
    /// `--num-layers-per-virtual-pipeline-stage` or `--num-virtual-stages-per-pipeline-rank`
    /// is set.
    pub virtual_pipeline_size: usize,
    /// The layers of each virtual stage (`pp · virtual_pipeline_size` of them).
    pub split: StageSplit,
    /// Data-parallel size.
    pub dp: usize,
    /// Microbatches per optimizer step per data-parallel rank: `global / (micro × dp)`.
    pub num_microbatches: usize,
    /// Expert-parallel size (1 for a dense model).
    pub ep: usize,
    /// The model.
    pub model: TransformerConfig,
}

impl RunLayout {
    /// The schedule of every step: interleaved 1F1B with several model chunks per rank,
    /// else 1F1B, Megatron's default (with one pipeline stage, plain gradient accumulation).
    pub fn schedule(&self) -> Schedule {
        match self.virtual_pipeline_size {
            1 => Schedule::OneFOneB,
            _ => Schedule::Interleaved,
        }
    }
}

impl PretrainConfig {
    /// The model this run trains.
    pub fn model(&self) -> TransformerConfig {
        TransformerConfig::new(
            self.hidden_size,
            self.num_layers,
            self.num_attention_heads,
            self.ffn_hidden_size.unwrap_or(match self.swiglu {
                // Megatron's default for SwiGLU: the GeLU MLP's 4h, times 2/3 for the third
                // GEMM, rounded down to a multiple of 64.
                true => 4 * self.hidden_size * 2 / 3 / 64 * 64,
                false => 4 * self.hidden_size,
            }),
            self.vocab_size,
            self.seq_length,
        )
        .with_make_vocab_size_divisible_by(self.make_vocab_size_divisible_by)
        .with_init_std(self.init_std)
        .with_sequence_parallel(self.sequence_parallel)
        .with_tp_comm_overlap(self.tp_comm_overlap)
        .with_hidden_dropout(self.hidden_dropout)
        .with_attention_dropout(self.attention_dropout)
        .with_seed(self.seed)
        .with_activation(match self.swiglu {
            true => Activation::SwiGlu,
            false => Activation::Gelu,
        })
        .with_normalization(self.normalization)
        .with_norm_epsilon(self.norm_epsilon)
        .with_qk_layernorm(self.qk_layernorm)
        .with_kv_channels(self.kv_channels)
        .with_position_embedding(self.position_embedding)
        .with_num_query_groups(self.num_query_groups)
        .with_tie_embeddings(!self.untie_embeddings_and_output_weights)
        .with_add_bias_linear(self.add_bias_linear)
        .with_recompute(self.recompute)
        .with_fp8(self.fp8.clone())
        .with_moe(self.moe())
    }

    /// The model's mixture of experts, with `--num-experts`.
    pub fn moe(&self) -> Option<MoeSettings> {
        self.num_experts.map(|experts| {
            MoeSettings::new(experts)
                .with_ffn_hidden_size(self.moe_ffn_hidden_size)
                .with_top_k(self.moe_router_topk)
                .with_score_function(self.moe_router_score_function)
                .with_normalize_top_k(self.moe_router_topk_normalize)
                .with_pre_softmax(self.moe_router_pre_softmax)
                .with_num_groups(self.moe_router_num_groups)
                .with_group_top_k(self.moe_router_group_topk)
                .with_top_k_scaling_factor(self.moe_router_topk_scaling_factor)
                .with_load_balancing_type(self.moe_router_load_balancing_type)
                .with_aux_loss_coeff(self.moe_aux_loss_coeff)
                .with_more_aux_losses(self.moe_more_aux_losses.clone())
                .with_z_loss_coeff(self.moe_z_loss_coeff)
                .with_shared_expert_ffn_hidden_size(self.moe_shared_expert_intermediate_size)
                .with_layer_freq(self.moe_layer_freq)
                .with_layer_pattern(self.moe_layer_pattern.clone())
                .with_expert_bias(self.moe_router_enable_expert_bias)
                .with_bias_update_rate(self.moe_router_bias_update_rate)
                .with_capacity(self.moe_expert_capacity_factor.map(|factor| {
                    ExpertCapacity::new(factor)
                        .with_drop_policy(
                            self.moe_token_drop_policy.unwrap_or(TokenDropPolicy::Probs),
                        )
                        .with_pad_to_capacity(self.moe_pad_expert_input_to_capacity)
                }))
                .with_token_dispatcher(self.moe_token_dispatcher_type)
                .with_expert_tensor_parallel_size(self.expert_tensor_parallel_size)
                .with_router_dtype(self.moe_router_dtype)
                .with_force_load_balancing(self.moe_router_force_load_balancing)
                .with_input_jitter_eps(self.moe_input_jitter_eps)
        })
    }

    /// The expert-parallel settings: `--num-experts` for any `--moe-*` option, EP at least 1
    /// and dividing DP × CP (expert-DP = DP × CP / EP) and the experts, and the paths MoE
    /// does not run yet refused. Returns EP.
    fn check_moe(&self, dp: usize, cp: usize) -> crate::Result<usize> {
        let invalid = |m: String| -> crate::Result<usize> { Err(ConfigError::Invalid(m).into()) };
        let ep = self.expert_model_parallel_size;
        let Some(experts) = self.num_experts else {
            let defaults = Self::new();
            if ep != 1
                || self.expert_tensor_parallel_size.is_some()
                || self.moe_router_dtype.is_some()
                || self.moe_router_force_load_balancing
                || self.moe_ffn_hidden_size.is_some()
                || self.moe_shared_expert_intermediate_size.is_some()
                || self.moe_layer_pattern.is_some()
                || self.moe_layer_freq != defaults.moe_layer_freq
                || self.moe_router_topk != defaults.moe_router_topk
                || self.moe_aux_loss_coeff != 0.0
                || !self.moe_more_aux_losses.is_empty()
                || self.moe_input_jitter_eps.is_some()
                || self.moe_z_loss_coeff != 0.0
                || self.moe_router_enable_expert_bias
                || self.moe_expert_capacity_factor.is_some()
                || self.moe_token_drop_policy.is_some()
                || self.moe_pad_expert_input_to_capacity
                || self.moe_router_pre_softmax
                || self.moe_router_num_groups.is_some()
                || self.moe_router_group_topk.is_some()
                || self.moe_router_topk_scaling_factor.is_some()
                || self.moe_router_load_balancing_type != defaults.moe_router_load_balancing_type
                || self.moe_token_dispatcher_type != defaults.moe_token_dispatcher_type
            {
                return invalid(
                    "--expert-model-parallel-size and the --moe-* options need --num-experts \
                     (the routed experts of each MoE layer)"
                        .into(),
                );
            }
            return Ok(1);
        };
        if ep == 0 {
            return invalid("--expert-model-parallel-size must be at least 1".into());
        }
        if !(dp * cp).is_multiple_of(ep) {
            let valid: Vec<String> = (1..=dp * cp)
                .filter(|e| (dp * cp).is_multiple_of(*e) && experts.is_multiple_of(*e))
                .map(|e| e.to_string())
                .collect();
            let spanning_tp = match self.tensor_model_parallel_size {
                1 => String::new(),
                tp => format!(
                    " (Megatron's expert grid, where with --expert-tensor-parallel-size 1 EP may \
                     also span the {tp} TP ranks, is not implemented here)"
                ),
            };
            return invalid(format!(
                "--expert-model-parallel-size ({ep}) must divide DP × CP ({dp} × {cp}): expert \
                 parallelism splits the data-parallel ranks into EP × expert-DP; valid sizes \
                 here are {}{spanning_tp}",
                valid.join(", ")
            ));
        }
        if self.moe_expert_capacity_factor.is_none() {
            for (name, given) in [
                (
                    "--moe-token-drop-policy",
                    self.moe_token_drop_policy.is_some(),
                ),
                (
                    "--moe-pad-expert-input-to-capacity",
                    self.moe_pad_expert_input_to_capacity,
                ),
            ] {
                if given {
                    return invalid(format!(
                        "{name} takes effect with --moe-expert-capacity-factor (without it the \
                         layer is dropless): add a factor or leave {name} out"
                    ));
                }
            }
        }
        Ok(ep)
    }

    /// The learning-rate schedule, in iterations.
    pub fn lr_schedule(&self) -> crate::Result<LrSchedule> {
        Ok(LrScheduleConfig::new(self.lr)
            .with_min_lr(self.min_lr)
            .with_warmup_steps(self.lr_warmup_iters)
            .with_decay_steps(self.lr_decay_iters.unwrap_or(self.train_iters))
            .with_decay_style(self.lr_decay_style)
            .init()?)
    }

    /// The flat-buffer AdamW of a data-parallel run (`--use-distributed-optimizer` shards
    /// its state): Adam's betas and epsilon, the weight decay (none on biases and norms) and
    /// global-norm clipping at `--clip-grad`.
    pub fn distributed_adamw(&self) -> DistributedAdamWConfig {
        let adam = FlatAdamWConfig::new()
            .with_beta_1(self.adam_beta1 as f64)
            .with_beta_2(self.adam_beta2 as f64)
            .with_epsilon(self.adam_eps as f64)
            .with_weight_decay(self.weight_decay);
        DistributedAdamWConfig::new()
            .with_adam(adam)
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(self.use_distributed_optimizer)
                    .with_overlap_param_gather(self.overlap_param_gather)
                    .with_gradient_accumulation_fusion(self.gradient_accumulation_fusion),
            )
            .with_clip_grad(Some(self.clip_grad))
    }

    /// The dynamic loss scaler of an `--fp16` run.
    pub fn loss_scaler(&self) -> LossScalerConfig {
        LossScalerConfig::new()
            .with_initial_scale(self.initial_loss_scale)
            .with_growth_interval(self.loss_scale_window)
            .with_hysteresis(self.hysteresis)
    }

    /// What the memory planner plans for: this run's model, sequence, batch and precision on
    /// GPUs of `gpu_memory_gib` (context parallelism is among the layouts it plans).
    pub fn plan_input(&self) -> crate::training::planner::PlanInput {
        crate::training::planner::PlanInput {
            model: self.model(),
            seq: self.seq_length,
            micro_batch: self.micro_batch_size,
            global_batch: self.global_batch_size,
            dtype_bytes: if self.bf16 || self.fp16 { 2 } else { 4 },
            overlap_grad_reduce: self.overlap_grad_reduce,
            expert_parallel: self.expert_model_parallel_size,
            gpu_memory: (self.gpu_memory_gib * (1u64 << 30) as f64) as u64,
            peak_tflops: self.peak_tflops,
        }
    }

    /// Ranks the run needs: TP × PP × CP × DP.
    pub fn world_size(&self) -> usize {
        self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.data_parallel_size
    }

    /// `--cp-comm-type` parsed.
    pub fn cp_comm(&self) -> crate::Result<CpCommType> {
        Ok(self.cp_comm_type.parse::<CpCommType>()?)
    }

    /// `--fp8-recipe blockwise` casts blocks of 128 along both sides of every FP8 GEMM's
    /// operands: the widths of the transformer layers' linear layers on a TP rank and the
    /// tokens of a micro-batch on a CP rank must be multiples of 128 (checked here, before the
    /// model is built; the layer checks each operand again).
    fn check_blockwise(&self, tp: usize, cp: usize) -> crate::Result<()> {
        let model = self.model();
        let (heads, groups, head_dim) = (
            model.num_attention_heads,
            model.query_groups(),
            model.head_dim(),
        );
        let sides = [
            ("--hidden-size".to_string(), model.hidden_size),
            (
                "the attention heads' width per TP rank (heads × head size / TP)".to_string(),
                heads * head_dim / tp,
            ),
            (
                "the query, key and value projection's width per TP rank ((heads + 2 × query \
                 groups) × head size / TP)"
                    .to_string(),
                (heads + 2 * groups) * head_dim / tp,
            ),
            (
                "the MLP's width per TP rank (--ffn-hidden-size / TP)".to_string(),
                model.ffn_hidden_size / tp,
            ),
            (
                format!(
                    "the tokens of a micro-batch per CP rank (--micro-batch-size × --seq-length \
                     / CP{})",
                    if cp > 1 {
                        format!(" = {cp}")
                    } else {
                        String::new()
                    }
                ),
                self.micro_batch_size * self.seq_length / cp,
            ),
        ];
        for (what, n) in sides {
            if n == 0 || !n.is_multiple_of(128) {
                return Err(ConfigError::Invalid(format!(
                    "--fp8-recipe blockwise casts blocks of 128 along every side of the FP8 \
                     GEMMs: {what} is {n}, not a multiple of 128; choose sizes that are, or \
                     use --fp8-recipe tensorwise"
                ))
                .into());
            }
        }
        Ok(())
    }

    /// The settings context parallelism (`cp > 1`) constrains: the sequence cuts into
    /// `2 · cp` chunks (each split again over TP under sequence parallelism), no attention
    /// dropout, the heads of a TP rank split over CP for `a2a`, and pretrain_gpt's own loop.
    fn check_context_parallel(&self, tp: usize, cp: usize, comm: CpCommType) -> crate::Result<()> {
        let invalid = |m: String| -> crate::Result<()> { Err(ConfigError::Invalid(m).into()) };
        let (seq, sp) = (self.seq_length, self.sequence_parallel && tp > 1);
        let multiple = if sp { 2 * cp * tp } else { 2 * cp };
        if !seq.is_multiple_of(multiple) {
            return invalid(format!(
                "--seq-length ({seq}) must be divisible by 2 × --context-parallel-size{} = \
                 {multiple}: each CP rank holds 2 of 2 × CP equal chunks{}",
                if sp { " × TP" } else { "" },
                if sp {
                    ", split again over TP by --sequence-parallel"
                } else {
                    ""
                },
            ));
        }
        if self.attention_dropout > 0.0 {
            return invalid(format!(
                "--attention-dropout ({}) is not supported with --context-parallel-size {cp}: \
                 set --attention-dropout 0",
                self.attention_dropout
            ));
        }
        if comm == CpCommType::A2a && !(self.num_attention_heads / tp.max(1)).is_multiple_of(cp) {
            return invalid(format!(
                "--cp-comm-type a2a splits each TP rank's {} attention heads over \
                 --context-parallel-size {cp}: use a CP size that divides them, or \
                 --cp-comm-type p2p or all_gather",
                self.num_attention_heads / tp.max(1)
            ));
        }
        if self.learner {
            return invalid(
                "--learner does not run context parallelism: leave --learner out with \
                 --context-parallel-size above 1"
                    .into(),
            );
        }
        Ok(())
    }

    /// Checks every setting for a world of `world_size` ranks, before any rank starts, and
    /// returns the derived layout. Each error names the setting and what would be valid.
    pub fn check(&self, world_size: usize) -> crate::Result<RunLayout> {
        let invalid =
            |m: String| -> crate::Result<RunLayout> { Err(ConfigError::Invalid(m).into()) };
        let (tp, pp) = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
        );
        if self.bf16 && self.fp16 {
            return invalid("--bf16 and --fp16 exclude each other: pick one".into());
        }
        if self.fp16 {
            self.loss_scaler().validate()?;
        }
        if self.overlap_param_gather && !self.use_distributed_optimizer {
            return invalid(
                "--overlap-param-gather splits the distributed optimizer's parameter all-gather: \
                 add --use-distributed-optimizer"
                    .into(),
            );
        }
        if self.tp_comm_overlap && !self.sequence_parallel {
            return invalid(
                "--tp-comm-overlap overlaps sequence parallelism's all-gathers and \
                 reduce-scatters: add --sequence-parallel"
                    .into(),
            );
        }
        if self.tp_comm_overlap && self.fp8.is_some() {
            return invalid(
                "--tp-comm-overlap does not run the FP8 layers yet: drop --tp-comm-overlap or \
                 --fp8-format"
                    .into(),
            );
        }
        let cp = self.context_parallel_size;
        if tp == 0 || pp == 0 || cp == 0 {
            return invalid(format!(
                "--tensor-model-parallel-size ({tp}), --pipeline-model-parallel-size ({pp}) and \
                 --context-parallel-size ({cp}) must be at least 1"
            ));
        }
        if !world_size.is_multiple_of(tp * pp * cp) {
            return invalid(format!(
                "the world of {world_size} ranks is not a multiple of TP ({tp}) × PP ({pp}) × \
                 CP ({cp})"
            ));
        }
        let dp = world_size / (tp * pp * cp);
        if dp != self.data_parallel_size {
            return invalid(format!(
                "the world of {world_size} ranks is TP ({tp}) × PP ({pp}) × CP ({cp}) × DP \
                 ({dp}), but --data-parallel-size is {}: launch {} ranks or set it to {dp}",
                self.data_parallel_size,
                tp * pp * cp * self.data_parallel_size
            ));
        }
        let cp_comm = self.cp_comm()?;
        if cp > 1 {
            self.check_context_parallel(tp, cp, cp_comm)?;
        }
        if (self.fp8.as_ref()).is_some_and(|fp8| fp8.recipe == Fp8Recipe::Blockwise) {
            self.check_blockwise(tp, cp)?;
        }
        for (name, value) in [
            ("--micro-batch-size", self.micro_batch_size),
            ("--global-batch-size", self.global_batch_size),
            ("--seq-length", self.seq_length),
            ("--train-iters", self.train_iters),
            ("--log-interval", self.log_interval),
        ] {
            if value == 0 {
                return invalid(format!("{name} must be at least 1"));
            }
        }
        if !self
            .global_batch_size
            .is_multiple_of(self.micro_batch_size * dp)
        {
            return invalid(format!(
                "--global-batch-size ({}) must be divisible by --micro-batch-size ({}) × DP \
                 ({dp}): the quotient is the number of microbatches per step",
                self.global_batch_size, self.micro_batch_size
            ));
        }
        let first = self.decoder_first_pipeline_num_layers;
        let last = self.decoder_last_pipeline_num_layers;
        let uneven = first.is_some() || last.is_some();
        if self.num_layers == 0 || (!uneven && !self.num_layers.is_multiple_of(pp)) {
            return invalid(format!(
                "--num-layers ({}) must be a positive multiple of \
                 --pipeline-model-parallel-size ({pp}) (or give \
                 --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)",
                self.num_layers
            ));
        }
        let num_microbatches = self.global_batch_size / (self.micro_batch_size * dp);
        let virtual_pipeline_size = match (
            self.num_layers_per_virtual_pipeline_stage,
            self.num_virtual_stages_per_pipeline_rank,
        ) {
            (Some(_), Some(_)) => {
                return invalid(
                    "--num-layers-per-virtual-pipeline-stage and \
                     --num-virtual-stages-per-pipeline-rank both set the chunks a rank holds: \
                     give one"
                        .into(),
                );
            }
            (None, None) => 1,
            (Some(_), None) if uneven => {
                return invalid(
                    "with --decoder-first/last-pipeline-num-layers the ranks hold different \
                     numbers of layers: give the chunks a rank holds with \
                     --num-virtual-stages-per-pipeline-rank instead of \
                     --num-layers-per-virtual-pipeline-stage"
                        .into(),
                );
            }
            (Some(per_stage), None) => {
                let per_rank = self.num_layers / pp;
                if pp < 2 || per_stage == 0 || !per_rank.is_multiple_of(per_stage) {
                    return invalid(format!(
                        "--num-layers-per-virtual-pipeline-stage ({per_stage}) needs \
                         --pipeline-model-parallel-size of at least 2 (got {pp}) and must divide \
                         the layers of each pipeline rank ({} / {pp} = {per_rank})",
                        self.num_layers
                    ));
                }
                per_rank / per_stage
            }
            (None, Some(v)) => {
                if pp < 2 || v == 0 {
                    return invalid(format!(
                        "--num-virtual-stages-per-pipeline-rank ({v}) needs \
                         --pipeline-model-parallel-size of at least 2 (got {pp}) and at least \
                         one chunk"
                    ));
                }
                v
            }
        };
        let v = virtual_pipeline_size;
        if v > 1 && !num_microbatches.is_multiple_of(pp) {
            return invalid(format!(
                "the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs \
                 the microbatches per step ({num_microbatches} = --global-batch-size / \
                 (--micro-batch-size × DP)) to be a multiple of \
                 --pipeline-model-parallel-size ({pp})"
            ));
        }
        if v > 1 && self.learner {
            return invalid(
                "--learner runs 1F1B with one model chunk per rank: \
                 --num-layers-per-virtual-pipeline-stage is pretrain_gpt's own loop only \
                 (leave --learner out)"
                    .into(),
            );
        }
        if uneven && self.learner {
            return invalid(
                "--learner splits the layers evenly over the pipeline: \
                 --decoder-first/last-pipeline-num-layers are pretrain_gpt's own loop only \
                 (leave --learner out)"
                    .into(),
            );
        }
        if v > 1 && self.overlap_grad_reduce {
            return invalid(
                "--overlap-grad-reduce with --num-layers-per-virtual-pipeline-stage is not \
                 supported yet: the reduction hook follows one model chunk; drop one of them"
                    .into(),
            );
        }
        let split = StageSplit::pipeline(self.num_layers, pp, v, first, last)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if self.profile && self.profile_step_end <= self.profile_step_start {
            return invalid(format!(
                "--profile-step-end ({}) must be after --profile-step-start ({})",
                self.profile_step_end, self.profile_step_start
            ));
        }
        if self.eval_interval > 0 && self.eval_iters == 0 {
            return invalid("--eval-iters must be at least 1 when --eval-interval is set".into());
        }
        if self.save_interval == Some(0) {
            return invalid("--save-interval must be at least 1".into());
        }
        if self.no_save && (self.save.is_some() || self.save_interval.is_some()) {
            return invalid("--no-save excludes --save and --save-interval: pick one".into());
        }
        if self.save_interval.is_some() && self.save.is_none() {
            return invalid("--save-interval needs --save (the directory to save in)".into());
        }
        if self.data_path.is_empty() && self.vocab_size < ByteTokenizer::VOCAB_SIZE {
            return invalid(format!(
                "the default corpus is byte-tokenized: --vocab-size ({}) must be at least {}",
                self.vocab_size,
                ByteTokenizer::VOCAB_SIZE
            ));
        }
        if !self.data_path.is_empty() {
            parse_data_path(&self.data_path)?;
        }
        parse_split(&self.split)?;
        let decay_iters = self.lr_decay_iters.unwrap_or(self.train_iters);
        if self.lr_decay_style != LrDecayStyle::Constant && decay_iters <= self.lr_warmup_iters {
            return invalid(format!(
                "--lr-decay-iters ({decay_iters}{}) must exceed --lr-warmup-iters ({}): the decay \
                 counts from iteration 0, the warm-up included",
                if self.lr_decay_iters.is_none() {
                    ", from --train-iters"
                } else {
                    ""
                },
                self.lr_warmup_iters
            ));
        }
        // Every setting is checked here whatever the path (pretrain's loop with either
        // optimizer, the Learner, the planner): AdamW's betas, epsilon and weight decay, the
        // buckets and the clipping norm by the optimizer's own validation.
        self.distributed_adamw().validate()?;
        self.lr_schedule()?;
        for (name, value) in [
            ("--peak-tflops", self.peak_tflops),
            ("--gpu-memory-gib", self.gpu_memory_gib),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return invalid(format!("{name} is {value}: it must be positive and finite"));
            }
        }
        let model = self.model();
        let ep = self.check_moe(dp, cp)?;
        if let Some(moe) = &model.moe {
            moe.validate(
                model.hidden_size,
                model.ffn_hidden_size,
                model.num_layers,
                ep,
            )?;
            moe.validate_expert_tp(model.ffn_hidden_size, tp)?;
        }
        model.validate(tp, 0)?;
        Ok(RunLayout {
            tp,
            pp,
            cp,
            cp_comm,
            virtual_pipeline_size,
            split,
            dp,
            num_microbatches,
            ep,
            model,
        })
    }
}
