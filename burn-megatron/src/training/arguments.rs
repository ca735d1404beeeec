//! `pretrain_gpt`'s options: Megatron's argument names on the command line, the same names
//! in a TOML file (`--config run.toml`, keys in kebab-case: `num-layers = 8`), the command
//! line winning over the file and the file over [`PretrainConfig`]'s defaults.

use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;

use super::config::PretrainConfig;
use crate::error::{ConfigError, Result};
use crate::ops::fp8::{AmaxComputeAlgo, Fp8Backward, Fp8Config, Fp8Format, Fp8Recipe};
use crate::optimizer::LrDecayStyle;
use crate::transformer::moe::{
    AuxLossTerm, LoadBalancingType, MoeLayerFreq, RouterDtype, RouterScoreFunction,
    TokenDispatcherType, TokenDropPolicy, check_load_balancing_list,
};
use crate::transformer::{Normalization, PositionEmbedding, Recompute};

/// Pretrain a GPT with tensor and pipeline parallelism (Megatron-LM's `pretrain_gpt.py`).
///
/// With no options it trains a tiny GPT on a generated corpus on 4 CPU thread ranks
/// (TP = 2 × PP = 2) for a minute or two and saves a checkpoint under target/pretrain_gpt.
/// Every option can also be given in a TOML file (`--config`), with the same names without
/// the leading dashes; the command line wins over the file.
#[derive(Parser, Deserialize, Debug, Clone, Default, PartialEq)]
#[command(name = "pretrain_gpt", version, about, long_about)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct PretrainArgs {
    /// A TOML file of options (keys as the long options without dashes, e.g.
    /// `global-batch-size = 32`, `data-path = ["0.3", "a_text_document"]`).
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// Transformer layers; divisible by the pipeline-parallel size. [default: 2]
    #[arg(long, help_heading = "Model")]
    pub num_layers: Option<usize>,
    /// Width of the residual stream. [default: 64]
    #[arg(long, help_heading = "Model")]
    pub hidden_size: Option<usize>,
    /// Attention heads; divisible by the tensor-parallel size. [default: 4]
    #[arg(long, help_heading = "Model")]
    pub num_attention_heads: Option<usize>,
    /// Hidden width of the MLP. [default: 4 × hidden size]
    #[arg(long, help_heading = "Model")]
    pub ffn_hidden_size: Option<usize>,
    /// Tokens per sample, and the model's longest sequence. [default: 64]
    #[arg(long, help_heading = "Model")]
    pub seq_length: Option<usize>,
    /// Vocabulary size; every token id of the data must be below it. [default: 257, the
    /// byte tokenizer's]
    #[arg(long, help_heading = "Model")]
    pub vocab_size: Option<usize>,
    /// Pad the vocabulary to a multiple of this × TP. [default: 8]
    #[arg(long, help_heading = "Model")]
    pub make_vocab_size_divisible_by: Option<usize>,
    /// Standard deviation of the normal initialisation. [default: 0.02]
    #[arg(long, help_heading = "Model")]
    pub init_method_std: Option<f64>,
    /// Dropout on the embeddings and each block's output. [default: 0]
    #[arg(long, help_heading = "Model")]
    pub hidden_dropout: Option<f64>,
    /// Dropout on the attention probabilities. [default: 0]
    #[arg(long, help_heading = "Model")]
    pub attention_dropout: Option<f64>,
    /// SwiGLU MLP (Llama): `silu(gate(x)) · up(x)`, three GEMMs. [default: GeLU]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Model")]
    pub swiglu: Option<bool>,
    /// The normalisation: LayerNorm or RMSNorm. [default: LayerNorm]
    #[arg(long, help_heading = "Model")]
    pub normalization: Option<String>,
    /// Epsilon of the normalisation. [default: 1e-5]
    #[arg(long, help_heading = "Model")]
    pub norm_epsilon: Option<f64>,
    /// Width of each attention head (Qwen3: 128 at hidden 2048 with 32 heads). [default:
    /// hidden size / heads]
    #[arg(long, help_heading = "Model")]
    pub kv_channels: Option<usize>,
    /// QK-norm: each query and key head normalised (the model's normalisation, weights of
    /// head_dim shared by the heads) before RoPE, as in Qwen3. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Model")]
    pub qk_layernorm: Option<bool>,
    /// Position embeddings: learned_absolute or rope. [default: learned_absolute]
    #[arg(long, help_heading = "Model")]
    pub position_embedding_type: Option<String>,
    /// The base of the rotary embeddings' frequencies (500000 for Llama 3). [default: 10000]
    #[arg(long, help_heading = "Model")]
    pub rotary_base: Option<f64>,
    /// Grouped-query attention: key/value heads shared by groups of query heads
    /// (--num-query-groups of them). [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Model")]
    pub group_query_attention: Option<bool>,
    /// Key/value heads under --group-query-attention; divides the heads, and TP divides it.
    /// [default: 1]
    #[arg(long, help_heading = "Model")]
    pub num_query_groups: Option<usize>,
    /// An output layer of its own instead of the token embedding table (Llama). [default:
    /// false, tied]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Model")]
    pub untie_embeddings_and_output_weights: Option<bool>,
    /// Linear layers without biases (Llama). [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Model")]
    pub disable_bias_linear: Option<bool>,
    /// Activation recomputation: selective (the attention core) or full (each layer rerun
    /// from its input in the backward pass). [default: none]
    #[arg(long, help_heading = "Model")]
    pub recompute_granularity: Option<String>,
    /// How full recomputation picks layers: uniform (each model chunk's layers in groups of
    /// --recompute-num-layers, each rerun from its input) or block (the first
    /// --recompute-num-layers layers of each chunk rerun, the rest stored). [default: uniform]
    #[arg(long, help_heading = "Model")]
    pub recompute_method: Option<String>,
    /// Full recomputation: layers a group holds (uniform) or layers rerun at the start of each
    /// model chunk (block). [default: 1]
    #[arg(long, help_heading = "Model")]
    pub recompute_num_layers: Option<usize>,
    /// Selective recomputation (Megatron's older name for --recompute-granularity
    /// selective). [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Model")]
    pub recompute_activations: Option<bool>,

    /// Tensor-parallel size (ranks that split each layer). [default: 2]
    #[arg(long, help_heading = "Parallelism")]
    pub tensor_model_parallel_size: Option<usize>,
    /// Pipeline-parallel size (stages the layers are split into, run with 1F1B). [default: 2]
    #[arg(long, help_heading = "Parallelism")]
    pub pipeline_model_parallel_size: Option<usize>,
    /// Layers per virtual pipeline stage: each rank holds several model chunks and runs the
    /// interleaved 1F1B schedule, whose bubble shrinks by the number of chunks. Must divide the
    /// layers of each pipeline rank; the microbatches per step must be a multiple of the
    /// pipeline-parallel size. [default: one chunk per rank, 1F1B]
    #[arg(long, help_heading = "Parallelism")]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// Model chunks per pipeline rank for the interleaved schedule, in place of
    /// --num-layers-per-virtual-pipeline-stage (needed with uneven first/last stages); each
    /// rank's layers are split over its chunks as evenly as they go. [default: 1]
    #[arg(long, help_heading = "Parallelism")]
    pub num_virtual_stages_per_pipeline_rank: Option<usize>,
    /// Layers of the first pipeline rank; the ranks without a count share the rest evenly.
    /// [default: an even split]
    #[arg(long, help_heading = "Parallelism")]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers of the last pipeline rank, which also runs the output layer and the loss:
    /// fewer there balance the pipeline when the vocabulary is large. [default: an even split]
    #[arg(long, help_heading = "Parallelism")]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// Split activations outside the tensor-parallel regions along the sequence over TP
    /// (the sequence length must be divisible by TP). [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Parallelism")]
    pub sequence_parallel: Option<bool>,
    /// With --sequence-parallel: run QKV and the MLP's first projections with their input's
    /// all-gather as one operation whose backward reduce-scatters the input's gradient while
    /// it computes the weights' gradients. Same results. Not with FP8 yet. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Parallelism")]
    pub tp_comm_overlap: Option<bool>,
    /// Data-parallel size (model replicas, each reading its own microbatches). [default: 1]
    #[arg(long, help_heading = "Parallelism")]
    pub data_parallel_size: Option<usize>,
    /// Context-parallel size: ranks that split every sequence (each holds 2 of 2 × CP
    /// chunks, load-balanced for the causal mask) through the whole model; the sequence
    /// length must be divisible by 2 × CP (× TP with --sequence-parallel). [default: 1]
    #[arg(long, help_heading = "Parallelism")]
    pub context_parallel_size: Option<usize>,
    /// How context-parallel attention communicates: p2p (K/V ring), all_gather (K/V
    /// gathered) or a2a (all-to-all, heads for sequence; CP must divide the heads of a TP
    /// rank). [default: p2p]
    #[arg(long, help_heading = "Parallelism")]
    pub cp_comm_type: Option<String>,
    /// Shard the optimizer state over DP (ZeRO-1). [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Parallelism")]
    pub use_distributed_optimizer: Option<bool>,
    /// Reduce gradients from inside the backward pass, overlapping it. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Parallelism")]
    pub overlap_grad_reduce: Option<bool>,
    /// All-gather the distributed optimizer's updated parameters in buckets, in the next
    /// forward pass's order, each parameter a view of its bucket where it lies in one; needs
    /// --use-distributed-optimizer. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Parallelism")]
    pub overlap_param_gather: Option<bool>,
    /// With --overlap-grad-reduce, let the weight-gradient GEMMs write into the f32 gradient
    /// buffer no more (Megatron's gradient-accumulation fusion, on by default): each weight
    /// gradient is then written in the model's dtype and added by a second kernel.
    /// [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Parallelism")]
    pub no_gradient_accumulation_fusion: Option<bool>,
    /// Match each GPU collective across ranks on the host first: a mismatch is an error
    /// naming each rank's call, for a host round trip per call. Turn off for speed on GPUs
    /// (a mismatch then ends in the watchdog's timeout); --overlap-grad-reduce overlaps the
    /// backward pass only with checks off. [default: true]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Parallelism")]
    pub collective_checks: Option<bool>,

    /// Samples per microbatch. [default: 4]
    #[arg(long, help_heading = "Batch")]
    pub micro_batch_size: Option<usize>,
    /// Samples per optimizer step; a multiple of micro batch × DP, the quotient being the
    /// microbatches (gradient accumulation) per step. [default: 16]
    #[arg(long, help_heading = "Batch")]
    pub global_batch_size: Option<usize>,

    /// Peak learning rate, reached at the end of the warm-up. [default: 3e-3]
    #[arg(long, help_heading = "Optimizer")]
    pub lr: Option<f64>,
    /// Learning rate at the end of the decay. [default: 3e-4]
    #[arg(long, help_heading = "Optimizer")]
    pub min_lr: Option<f64>,
    /// Iterations of linear warm-up from 0. [default: 10]
    #[arg(long, help_heading = "Optimizer")]
    pub lr_warmup_iters: Option<usize>,
    /// The iteration at which the decay reaches --min-lr. [default: --train-iters]
    #[arg(long, help_heading = "Optimizer")]
    pub lr_decay_iters: Option<usize>,
    /// The decay after the warm-up: constant, linear or cosine. [default: cosine]
    #[arg(long, help_heading = "Optimizer")]
    pub lr_decay_style: Option<String>,
    /// AdamW's decoupled weight decay; biases and norms are exempt. [default: 0.01]
    #[arg(long, help_heading = "Optimizer")]
    pub weight_decay: Option<f64>,
    /// AdamW's β₁. [default: 0.9]
    #[arg(long, help_heading = "Optimizer")]
    pub adam_beta1: Option<f32>,
    /// AdamW's β₂. [default: 0.95]
    #[arg(long, help_heading = "Optimizer")]
    pub adam_beta2: Option<f32>,
    /// AdamW's ε. [default: 1e-8]
    #[arg(long, help_heading = "Optimizer")]
    pub adam_eps: Option<f32>,
    /// Largest global gradient norm (over every TP and PP rank); larger gradients are
    /// scaled down to it. [default: 1.0]
    #[arg(long, help_heading = "Optimizer")]
    pub clip_grad: Option<f64>,
    /// Stop at the first NaN or infinity, with an error naming the iteration and the rank,
    /// before anything of that iteration is saved. Checked: the loss and the gradient norm
    /// of every iteration, from the values the log reads anyway (no extra device sync; with
    /// --fp16 the gradient norm is the loss scaler's to skip, so only the loss); every
    /// parameter, once right before each checkpoint save and at the end of the run (one read
    /// each). With --learner the loss and gradient norm are flagged on the device each step
    /// and the flag is read before each save and at the end of the run. `false` turns every
    /// check off. [default: true]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Optimizer")]
    pub check_for_nan_in_loss_and_grad: Option<bool>,

    /// Optimizer steps in all, counting a loaded checkpoint's. [default: 100]
    #[arg(long, help_heading = "Training")]
    pub train_iters: Option<usize>,
    /// Iterations between log lines. [default: 1]
    #[arg(long, help_heading = "Training")]
    pub log_interval: Option<usize>,
    /// Iterations between evaluations on the validation split; 0 for none. [default: 25]
    #[arg(long, help_heading = "Training")]
    pub eval_interval: Option<usize>,
    /// Global batches per evaluation. [default: 2]
    #[arg(long, help_heading = "Training")]
    pub eval_iters: Option<usize>,
    /// Seed of the initialisation, dropout and data shuffles. [default: 1234]
    #[arg(long, help_heading = "Training")]
    pub seed: Option<u64>,
    /// Peak dense TFLOP/s of one device, for the logged MFU (an H100's bf16 peak by
    /// default; 494.7 for its TF32 one). [default: 989.4]
    #[arg(long, help_heading = "Training")]
    pub peak_tflops: Option<f64>,
    /// Record where each GPU's time goes, per kernel (our CUDA backend's built-in profile; set
    /// BM_PROFILE=1 in the environment too), over iterations --profile-step-start + 1 to
    /// --profile-step-end on the ranks --profile-ranks, each printing its table at the end of
    /// the window. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Training")]
    pub profile: Option<bool>,
    /// The iteration after which the profile starts. [default: 10]
    #[arg(long, help_heading = "Training")]
    pub profile_step_start: Option<u64>,
    /// The iteration at which the profile ends. [default: 12]
    #[arg(long, help_heading = "Training")]
    pub profile_step_end: Option<u64>,
    /// The global ranks profiled. [default: 0]
    #[arg(long, num_args = 1.., help_heading = "Training")]
    pub profile_ranks: Option<Vec<usize>>,

    /// Directory to save sharded checkpoints in. [default: target/pretrain_gpt]
    #[arg(long, value_name = "DIR", help_heading = "Checkpoints")]
    pub save: Option<PathBuf>,
    /// Iterations between checkpoints (one is also saved at the end). [default: only at the
    /// end]
    #[arg(long, help_heading = "Checkpoints")]
    pub save_interval: Option<usize>,
    /// Directory to resume from: its latest checkpoint restores the model, the optimizer,
    /// the iteration and the data position. An empty or missing directory starts afresh, so
    /// `--save d --load d` resumes a killed run with the same command.
    #[arg(long, value_name = "DIR", help_heading = "Checkpoints")]
    pub load: Option<PathBuf>,
    /// Print the memory planner's table (each rank's peak memory and an estimated step time
    /// for every layout of the world: TP × PP × DP = --tensor-model-parallel-size ×
    /// --pipeline-model-parallel-size × --data-parallel-size) and the fastest layout that
    /// fits, then exit without training. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Training")]
    pub plan: Option<bool>,
    /// One GPU's memory in GiB, for --plan. [default: 80]
    #[arg(long, help_heading = "Training")]
    pub gpu_memory_gib: Option<f64>,
    /// Save no checkpoint at all, not even the default run's final one (long runs on small
    /// disks, benchmarks). [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Checkpoints")]
    pub no_save: Option<bool>,
    /// Write checkpoints in the background: the step waits only for the host copies.
    /// [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Checkpoints")]
    pub async_save: Option<bool>,
    /// Train through burn-train's Learner (its dashboard and metric files, our metrics), with
    /// the distributed optimizer's step; checkpoints resume from --save. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Training")]
    pub learner: Option<bool>,
    /// bf16 parameters and activations, with fp32 master weights, gradients and AdamW state
    /// (Megatron's --bf16); needs the CUDA build. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Training")]
    pub bf16: Option<bool>,
    /// fp16 parameters and activations, fp32 master weights, gradients and AdamW state, and
    /// the dynamic loss scaler (Megatron's --fp16); needs the CUDA build. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Training")]
    pub fp16: Option<bool>,
    /// The loss scale of the first --fp16 step. [default: 4294967296]
    #[arg(long, help_heading = "Training")]
    pub initial_loss_scale: Option<f64>,
    /// Clean steps before the loss scale doubles. [default: 1000]
    #[arg(long, help_heading = "Training")]
    pub loss_scale_window: Option<usize>,
    /// Overflowing steps before the loss scale halves. [default: 2]
    #[arg(long, help_heading = "Training")]
    pub hysteresis: Option<usize>,

    /// FP8 GEMMs in every transformer layer (QKV, attention output, the MLP's): hybrid (E4M3
    /// activations and weights, E5M2 gradients) or e4m3 (E4M3 everywhere). The embedding,
    /// output layer, norms and loss stay in the run's dtype. Megatron needs --bf16 or --fp16
    /// with it; here it also runs in fp32, so that the CPU build runs it (emulated in f32).
    /// [default: off]
    #[arg(long, help_heading = "FP8")]
    pub fp8_format: Option<String>,
    /// How FP8 scales are chosen: tensorwise (each tensor's current amax), delayed (a
    /// history of earlier amaxes) or blockwise (DeepSeek-V3's: each 1 × 128 block of an
    /// activation or gradient and each 128 × 128 block of a weight its own; dimensions
    /// multiples of 128). [default: tensorwise]
    #[arg(long, help_heading = "FP8")]
    pub fp8_recipe: Option<String>,
    /// FP8 scales are divided by 2^margin. [default: 0]
    #[arg(long, allow_hyphen_values = true, help_heading = "FP8")]
    pub fp8_margin: Option<i32>,
    /// Amaxes remembered per tensor by --fp8-recipe delayed (Transformer Engine's default;
    /// Megatron's is 1). [default: 1024]
    #[arg(long, help_heading = "FP8")]
    pub fp8_amax_history_len: Option<usize>,
    /// How --fp8-recipe delayed reads its history: max or most_recent (Transformer Engine's
    /// default is max, Megatron's most_recent). [default: max]
    #[arg(long, help_heading = "FP8")]
    pub fp8_amax_compute_algo: Option<String>,
    /// Keeps the first and last transformer layers (--num-layers-at-start-in-bf16 and
    /// --num-layers-at-end-in-bf16 of them) out of FP8, in the run's dtype. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "FP8")]
    pub first_last_layers_bf16: Option<bool>,
    /// Layers at the start kept out of FP8 by --first-last-layers-bf16. [default: 1]
    #[arg(long, help_heading = "FP8")]
    pub num_layers_at_start_in_bf16: Option<usize>,
    /// Layers at the end kept out of FP8 by --first-last-layers-bf16. [default: 1]
    #[arg(long, help_heading = "FP8")]
    pub num_layers_at_end_in_bf16: Option<usize>,
    /// Runs backward GEMMs of the FP8 layers in the run's dtype on unquantised operands:
    /// dgrad (the input gradient's), wgrad (the weight gradient's) or both (Transformer
    /// Engine's override_linear_precision; not a Megatron option). To find which GEMM a run's
    /// loss is sensitive to. [default: none]
    #[arg(long, help_heading = "FP8")]
    pub fp8_backward_bf16: Option<String>,
    /// With --fp8-recipe delayed, reduces the amax histories over TP (and CP) only, not over
    /// DP once a step. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "FP8")]
    pub tp_only_amax_red: Option<bool>,

    /// Indexed datasets (prefixes of .bin/.idx files made by preprocess_data or Megatron),
    /// alone or as `weight prefix` pairs for a blend. [default: a generated corpus]
    #[arg(long, num_args = 1.., value_name = "WEIGHT PREFIX", help_heading = "Data")]
    pub data_path: Option<Vec<String>>,
    /// Train, validation and test weights of each dataset's documents. [default: 969,30,1]
    #[arg(long, help_heading = "Data")]
    pub split: Option<String>,

    /// Routed experts of each MoE layer: the MLP of every layer (or every
    /// --moe-layer-freq-th) becomes a dropless mixture of experts. [default: none, dense]
    #[arg(long, help_heading = "Mixture of experts")]
    pub num_experts: Option<usize>,
    /// Expert-parallel size: ranks of DP × CP that split each MoE layer's experts (it must
    /// divide DP × CP and --num-experts; expert gradients are averaged over the other
    /// DP × CP / EP ranks). [default: 1]
    #[arg(long, help_heading = "Mixture of experts")]
    pub expert_model_parallel_size: Option<usize>,
    /// Expert tensor parallelism: 1 keeps every expert whole on each TP rank; the
    /// tensor-parallel size splits each expert's hidden width (routed and shared) over TP, as
    /// TP splits the dense MLP. Other sizes are not supported. [default: --tensor-model-parallel-size]
    #[arg(long, help_heading = "Mixture of experts")]
    pub expert_tensor_parallel_size: Option<usize>,
    /// Hidden width of each routed expert. [default: --ffn-hidden-size]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_ffn_hidden_size: Option<usize>,
    /// Experts per token. [default: 2]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_router_topk: Option<usize>,
    /// Router scores: softmax or sigmoid. [default: softmax]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_router_score_function: Option<String>,
    /// Divide each token's top-k weights by their sum. [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Mixture of experts")]
    pub moe_router_topk_normalize: Option<bool>,
    /// Softmax over all experts before the top-k, its values the weights, instead of a
    /// softmax over the top-k logits (needed for softmax top-1; sigmoid ignores it).
    /// [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true", help_heading = "Mixture of experts")]
    pub moe_router_pre_softmax: Option<bool>,
    /// Group-limited routing (DeepSeek-V2/V3): the experts split into this many groups; with
    /// --moe-router-group-topk. [default: none]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_router_num_groups: Option<usize>,
    /// Groups each token may take its experts from: those whose top topk/group-topk scores
    /// sum highest. [default: none]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_router_group_topk: Option<usize>,
    /// Factor of the top-k routing weights (DeepSeek-V3: 2.5). [default: none, 1]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_router_topk_scaling_factor: Option<f64>,
    /// The load-balancing loss: aux_loss (Switch, over the micro-batch), seq_aux_loss
    /// (DeepSeek, per sequence), global_aux_loss (Switch, the load over the global batch so
    /// far), sinkhorn or none; or a list of losses, added up, each with its coefficient in
    /// --moe-aux-loss-coeff's list. [default: aux_loss]
    #[arg(long, num_args = 1.., help_heading = "Mixture of experts")]
    #[serde(default, deserialize_with = "one_or_many")]
    pub moe_router_load_balancing_type: Option<Vec<String>>,
    /// Coefficient of the load-balancing (auxiliary) loss; one a type where
    /// --moe-router-load-balancing-type lists several. [default: 0]
    #[arg(long, num_args = 1.., help_heading = "Mixture of experts")]
    #[serde(default, deserialize_with = "one_or_many")]
    pub moe_aux_loss_coeff: Option<Vec<f64>>,
    /// Switch Transformer's input jitter: in training, each router's input multiplied by
    /// factors uniform in (1 - eps, 1 + eps), drawn from each element's place in the global
    /// batch (as dropout's masks are), so every layout draws the same. [default: none]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_input_jitter_eps: Option<f64>,
    /// Coefficient of the router's z-loss. [default: 0]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_z_loss_coeff: Option<f64>,
    /// Width of the shared expert applied to every token (DeepSeek). [default: none]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// Which layers are MoE layers: an integer k (every k-th from layer 0) or a list such as
    /// `([0]*1+[1]*3)` with a 1 a MoE layer. [default: 1, every layer]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_layer_freq: Option<String>,
    /// DeepSeek-V3's auxiliary-loss-free load balancing: a per-expert bias added to the
    /// router's scores for the choice only, moved after each step toward a balanced load.
    /// [default: false]
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "true",
        help_heading = "Mixture of experts"
    )]
    pub moe_router_enable_expert_bias: Option<bool>,
    /// How far the expert bias moves per step. [default: 1e-3]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_router_bias_update_rate: Option<f64>,
    /// Capacity factor: each expert takes at most ceil(tokens × topk / experts × factor) of a
    /// rank's token assignments, the others are dropped (the token's residual passes).
    /// [default: none, dropless]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_expert_capacity_factor: Option<f64>,
    /// Which assignments an over-full expert drops: probs (lowest router weight) or position
    /// (latest token); needs --moe-expert-capacity-factor. [default: probs]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_token_drop_policy: Option<String>,
    /// Pad each expert's input with zero rows to its capacity; needs
    /// --moe-expert-capacity-factor. [default: false]
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "true",
        help_heading = "Mixture of experts"
    )]
    pub moe_pad_expert_input_to_capacity: Option<bool>,
    /// How tokens travel to their experts and back: alltoall (each rank sends each rank the
    /// tokens of its experts) or allgather (every EP rank gathers the group's tokens, the
    /// outputs return by reduce-scatter; for small EP). The same results either way.
    /// Megatron's default is allgather; here alltoall, the dispatcher of every earlier run
    /// and preset and the only one run on a GPU. [default: alltoall]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_token_dispatcher_type: Option<String>,
    /// The dtype the router computes in (its logits, scores, top-k, weights and losses),
    /// whatever the model's: fp32 or fp64. [default: the model's]
    #[arg(long, help_heading = "Mixture of experts")]
    pub moe_router_dtype: Option<String>,
    /// Route by pseudo-random logits (a hash of each logit), so that the experts' load is even
    /// whatever the router has learned: Megatron's switch for benchmarking the experts and the
    /// exchange without the routing's imbalance. The router still trains (its gradient passes
    /// straight through), and the z-loss comes from the real logits. [default: false]
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "true",
        help_heading = "Mixture of experts"
    )]
    pub moe_router_force_load_balancing: Option<bool>,
    /// Megatron's switch for one grouped GEMM over a rank's experts: always on here (on CUDA
    /// one grouped product, or per-expert GEMMs on side streams; elsewhere a loop), accepted
    /// so that Megatron's scripts run. It cannot be turned off. [default: true]
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "true",
        help_heading = "Mixture of experts"
    )]
    pub moe_grouped_gemm: Option<bool>,
    /// Megatron's switch for fused permutation: always on here (the tokens are sorted by
    /// expert and restored by row-gather kernels), accepted so that Megatron's scripts run.
    /// It cannot be turned off. [default: true]
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "true",
        help_heading = "Mixture of experts"
    )]
    pub moe_permute_fusion: Option<bool>,
    /// Megatron's switch for running the shared expert while the tokens travel: always on
    /// here (the shared expert is queued before the dispatch waits for the counts), accepted
    /// so that Megatron's scripts run. It cannot be turned off. [default: true]
    #[arg(
        long,
        num_args = 0..=1,
        default_missing_value = "true",
        help_heading = "Mixture of experts"
    )]
    pub moe_shared_expert_overlap: Option<bool>,
}

impl PretrainArgs {
    /// The options of the file named by `--config` (if any) under those of `self`.
    pub fn with_file(self) -> Result<Self> {
        let Some(path) = &self.config else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::Invalid(format!("--config {}: cannot read it: {e}", path.display()))
        })?;
        let file = Self::from_toml(&text)
            .map_err(|e| ConfigError::Invalid(format!("--config {}: {e}", path.display())))?;
        Ok(self.over(file))
    }

    /// Options from TOML text; an unknown key or a wrong type is an error naming it.
    pub fn from_toml(text: &str) -> core::result::Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())
    }

    /// The run: `--config`'s file read, then every option given here or in the file replacing
    /// [`PretrainConfig`]'s default. Not yet checked against a world size: see
    /// [`PretrainConfig::check`].
    pub fn into_config(self) -> Result<PretrainConfig> {
        let a = self.with_file()?;
        let mut c = PretrainConfig::new();
        macro_rules! set {
            ($($arg:ident => $field:ident),* $(,)?) => {
                $(if let Some(v) = a.$arg.clone() { c.$field = v; })*
            };
        }
        macro_rules! set_some {
            ($($arg:ident),* $(,)?) => { $(if let Some(v) = a.$arg.clone() { c.$arg = Some(v); })* };
        }
        set!(
            num_layers => num_layers,
            hidden_size => hidden_size,
            num_attention_heads => num_attention_heads,
            seq_length => seq_length,
            vocab_size => vocab_size,
            make_vocab_size_divisible_by => make_vocab_size_divisible_by,
            init_method_std => init_std,
            hidden_dropout => hidden_dropout,
            attention_dropout => attention_dropout,
            swiglu => swiglu,
            norm_epsilon => norm_epsilon,
            qk_layernorm => qk_layernorm,
            untie_embeddings_and_output_weights => untie_embeddings_and_output_weights,
            no_save => no_save,
            plan => plan,
            gpu_memory_gib => gpu_memory_gib,
            tensor_model_parallel_size => tensor_model_parallel_size,
            pipeline_model_parallel_size => pipeline_model_parallel_size,
            sequence_parallel => sequence_parallel,
            tp_comm_overlap => tp_comm_overlap,
            data_parallel_size => data_parallel_size,
            context_parallel_size => context_parallel_size,
            cp_comm_type => cp_comm_type,
            use_distributed_optimizer => use_distributed_optimizer,
            overlap_grad_reduce => overlap_grad_reduce,
            overlap_param_gather => overlap_param_gather,
            collective_checks => collective_checks,
            micro_batch_size => micro_batch_size,
            global_batch_size => global_batch_size,
            lr => lr,
            min_lr => min_lr,
            lr_warmup_iters => lr_warmup_iters,
            weight_decay => weight_decay,
            adam_beta1 => adam_beta1,
            adam_beta2 => adam_beta2,
            adam_eps => adam_eps,
            clip_grad => clip_grad,
            check_for_nan_in_loss_and_grad => check_for_nan_in_loss_and_grad,
            train_iters => train_iters,
            log_interval => log_interval,
            eval_interval => eval_interval,
            eval_iters => eval_iters,
            seed => seed,
            peak_tflops => peak_tflops,
            profile => profile,
            profile_step_start => profile_step_start,
            profile_step_end => profile_step_end,
            profile_ranks => profile_ranks,
            async_save => async_save,
            learner => learner,
            bf16 => bf16,
            fp16 => fp16,
            initial_loss_scale => initial_loss_scale,
            loss_scale_window => loss_scale_window,
            hysteresis => hysteresis,
            data_path => data_path,
            split => split,
        );
        set_some!(
            ffn_hidden_size,
            kv_channels,
            num_layers_per_virtual_pipeline_stage,
            num_virtual_stages_per_pipeline_rank,
            decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers,
            lr_decay_iters,
            save,
            save_interval,
            load
        );
        if let Some(style) = &a.lr_decay_style {
            c.lr_decay_style = parse_decay_style(style)?;
        }
        if let Some(name) = &a.normalization {
            c.normalization = parse_normalization(name)?;
        }
        c.position_embedding =
            position_embedding(a.position_embedding_type.as_deref(), a.rotary_base)?;
        match (a.group_query_attention.unwrap_or(false), a.num_query_groups) {
            (true, groups) => c.num_query_groups = Some(groups.unwrap_or(1)),
            (false, Some(groups)) => {
                return Err(ConfigError::Invalid(format!(
                    "--num-query-groups {groups} takes effect with --group-query-attention: add it"
                ))
                .into());
            }
            (false, None) => {}
        }
        set!(
            expert_model_parallel_size => expert_model_parallel_size,
            moe_router_topk => moe_router_topk,
            moe_router_topk_normalize => moe_router_topk_normalize,
            moe_router_pre_softmax => moe_router_pre_softmax,
            moe_z_loss_coeff => moe_z_loss_coeff,
            moe_router_enable_expert_bias => moe_router_enable_expert_bias,
            moe_router_bias_update_rate => moe_router_bias_update_rate,
            moe_pad_expert_input_to_capacity => moe_pad_expert_input_to_capacity,
            moe_router_force_load_balancing => moe_router_force_load_balancing,
        );
        set_some!(
            num_experts,
            expert_tensor_parallel_size,
            moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size,
            moe_router_num_groups,
            moe_router_group_topk,
            moe_router_topk_scaling_factor
        );
        if let Some((first, coeff, more)) = load_balancing_list(
            a.moe_router_load_balancing_type.as_deref(),
            a.moe_aux_loss_coeff.as_deref(),
        )? {
            c.moe_router_load_balancing_type = first;
            c.moe_aux_loss_coeff = coeff;
            c.moe_more_aux_losses = more;
        }
        c.moe_input_jitter_eps = a.moe_input_jitter_eps;
        c.moe_expert_capacity_factor = a.moe_expert_capacity_factor;
        if let Some(name) = &a.moe_token_drop_policy {
            c.moe_token_drop_policy = Some(TokenDropPolicy::parse(name)?);
        }
        if let Some(name) = &a.moe_token_dispatcher_type {
            c.moe_token_dispatcher_type = TokenDispatcherType::parse(name)?;
        }
        if let Some(name) = &a.moe_router_dtype {
            c.moe_router_dtype = Some(RouterDtype::parse(name)?);
        }
        check_always_on(&a)?;
        if let Some(name) = &a.moe_router_score_function {
            c.moe_router_score_function = parse_score_function(name)?;
        }
        if let Some(freq) = &a.moe_layer_freq {
            match MoeLayerFreq::parse(freq)? {
                MoeLayerFreq::Every(k) => c.moe_layer_freq = k,
                MoeLayerFreq::Pattern(flags) => c.moe_layer_pattern = Some(flags),
            }
        }
        if a.disable_bias_linear.unwrap_or(false) {
            c.add_bias_linear = false;
        }
        c.recompute = recompute(
            a.recompute_granularity.as_deref(),
            a.recompute_activations.unwrap_or(false),
            a.recompute_method.as_deref(),
            a.recompute_num_layers,
        )?;
        c.fp8 = fp8(&a)?;
        if let Some(off) = a.no_gradient_accumulation_fusion {
            c.gradient_accumulation_fusion = !off;
        }
        Ok(c)
    }

    /// `self`'s options, and `file`'s where `self` has none.
    fn over(self, file: Self) -> Self {
        macro_rules! merge {
            ($($f:ident),* $(,)?) => { Self { config: self.config, $($f: self.$f.or(file.$f),)* } };
        }
        merge!(
            num_layers,
            hidden_size,
            num_attention_heads,
            ffn_hidden_size,
            seq_length,
            vocab_size,
            make_vocab_size_divisible_by,
            init_method_std,
            hidden_dropout,
            attention_dropout,
            swiglu,
            normalization,
            norm_epsilon,
            kv_channels,
            qk_layernorm,
            position_embedding_type,
            rotary_base,
            group_query_attention,
            num_query_groups,
            untie_embeddings_and_output_weights,
            disable_bias_linear,
            recompute_granularity,
            recompute_method,
            recompute_num_layers,
            recompute_activations,
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            num_layers_per_virtual_pipeline_stage,
            num_virtual_stages_per_pipeline_rank,
            decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers,
            sequence_parallel,
            tp_comm_overlap,
            data_parallel_size,
            context_parallel_size,
            cp_comm_type,
            use_distributed_optimizer,
            overlap_grad_reduce,
            overlap_param_gather,
            no_gradient_accumulation_fusion,
            collective_checks,
            micro_batch_size,
            global_batch_size,
            lr,
            min_lr,
            lr_warmup_iters,
            lr_decay_iters,
            lr_decay_style,
            weight_decay,
            adam_beta1,
            adam_beta2,
            adam_eps,
            clip_grad,
            check_for_nan_in_loss_and_grad,
            train_iters,
            log_interval,
            eval_interval,
            eval_iters,
            seed,
            peak_tflops,
            profile,
            profile_step_start,
            profile_step_end,
            profile_ranks,
            save,
            save_interval,
            load,
            no_save,
            plan,
            gpu_memory_gib,
            async_save,
            learner,
            bf16,
            fp16,
            initial_loss_scale,
            loss_scale_window,
            hysteresis,
            fp8_format,
            fp8_recipe,
            fp8_margin,
            fp8_amax_history_len,
            fp8_amax_compute_algo,
            first_last_layers_bf16,
            num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16,
            fp8_backward_bf16,
            tp_only_amax_red,
            data_path,
            split,
            num_experts,
            expert_model_parallel_size,
            expert_tensor_parallel_size,
            moe_ffn_hidden_size,
            moe_router_topk,
            moe_router_score_function,
            moe_router_topk_normalize,
            moe_router_pre_softmax,
            moe_router_num_groups,
            moe_router_group_topk,
            moe_router_topk_scaling_factor,
            moe_router_load_balancing_type,
            moe_aux_loss_coeff,
            moe_input_jitter_eps,
            moe_z_loss_coeff,
            moe_shared_expert_intermediate_size,
            moe_layer_freq,
            moe_router_enable_expert_bias,
            moe_router_bias_update_rate,
            moe_expert_capacity_factor,
            moe_token_drop_policy,
            moe_pad_expert_input_to_capacity,
            moe_token_dispatcher_type,
            moe_router_dtype,
            moe_router_force_load_balancing,
            moe_grouped_gemm,
            moe_permute_fusion,
            moe_shared_expert_overlap,
        )
    }
}

/// Megatron's MoE performance switches that describe what always happens here
/// (`--moe-grouped-gemm`, `--moe-permute-fusion`, `--moe-shared-expert-overlap`): accepted
/// with `--num-experts`; turning one off is an error, not ignored.
fn check_always_on(a: &PretrainArgs) -> Result<()> {
    let switches = [
        ("--moe-grouped-gemm", a.moe_grouped_gemm),
        ("--moe-permute-fusion", a.moe_permute_fusion),
        ("--moe-shared-expert-overlap", a.moe_shared_expert_overlap),
    ];
    for (name, value) in switches {
        let why = match value {
            None => continue,
            Some(false) => {
                format!("{name} false: this is always on here (see --help); leave the option out")
            }
            Some(true) if a.num_experts.is_none() => {
                format!("{name} needs --num-experts (the routed experts of each MoE layer)")
            }
            Some(true) => continue,
        };
        return Err(ConfigError::Invalid(why).into());
    }
    Ok(())
}

/// Megatron's `--moe-router-score-function` names.
pub fn parse_score_function(name: &str) -> Result<RouterScoreFunction> {
    match name.to_ascii_lowercase().as_str() {
        "softmax" => Ok(RouterScoreFunction::Softmax),
        "sigmoid" => Ok(RouterScoreFunction::Sigmoid),
        other => Err(ConfigError::Invalid(format!(
            "--moe-router-score-function {other:?}: use softmax or sigmoid"
        ))
        .into()),
    }
}

/// `--moe-router-load-balancing-type` and `--moe-aux-loss-coeff`, each one value or a list
/// (Megatron's): the first type, its coefficient, and the terms the rest add; `None` where
/// neither is given. A list of types takes a list of as many coefficients; one type
/// takes one. Types left out are `aux_loss`, a coefficient left out 0.
pub fn load_balancing_list(
    types: Option<&[String]>,
    coeffs: Option<&[f64]>,
) -> Result<Option<(LoadBalancingType, f64, Vec<AuxLossTerm>)>> {
    if types.is_some_and(<[String]>::is_empty) || coeffs.is_some_and(<[f64]>::is_empty) {
        return Err(ConfigError::Invalid(
            "--moe-router-load-balancing-type and --moe-aux-loss-coeff need at least one value"
                .into(),
        )
        .into());
    }
    let types = match types {
        Some(names) => names
            .iter()
            .map(|n| parse_load_balancing_type(n))
            .collect::<Result<Vec<_>>>()?,
        None if coeffs.is_none() => return Ok(None),
        None => vec![LoadBalancingType::AuxLoss],
    };
    let coeffs = match coeffs {
        Some(values) => values.to_vec(),
        None if types.len() == 1 => vec![0.0],
        None => {
            return Err(ConfigError::Invalid(format!(
                "--moe-router-load-balancing-type lists {} types: give as many \
                 --moe-aux-loss-coeff values, one a type in the same order",
                types.len()
            ))
            .into());
        }
    };
    if coeffs.len() != types.len() {
        let join = |words: Vec<String>| words.join(" ");
        return Err(ConfigError::Invalid(format!(
            "--moe-aux-loss-coeff {} for --moe-router-load-balancing-type {}: give one \
             coefficient a type, in the same order",
            join(coeffs.iter().map(f64::to_string).collect()),
            join(types.iter().map(|t| t.name().to_string()).collect()),
        ))
        .into());
    }
    let more = types[1..]
        .iter()
        .zip(&coeffs[1..])
        .map(|(&kind, &coeff)| AuxLossTerm::new(kind, coeff))
        .collect::<Vec<_>>();
    check_load_balancing_list(types[0], coeffs[0], &more)?;
    Ok(Some((types[0], coeffs[0], more)))
}

/// A TOML value that is one value or a list of them, as a list (the options that take
/// `num_args = 1..` on the command line).
fn one_or_many<'de, D, T>(deserializer: D) -> core::result::Result<Option<Vec<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany<T> {
        One(T),
        Many(Vec<T>),
    }
    Ok(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(value) => Some(vec![value]),
        OneOrMany::Many(values) => Some(values),
    })
}

/// Megatron's `--moe-router-load-balancing-type` names.
pub fn parse_load_balancing_type(name: &str) -> Result<LoadBalancingType> {
    match name.to_ascii_lowercase().as_str() {
        "aux_loss" => Ok(LoadBalancingType::AuxLoss),
        "seq_aux_loss" => Ok(LoadBalancingType::SeqAuxLoss),
        "global_aux_loss" => Ok(LoadBalancingType::GlobalAuxLoss),
        "sinkhorn" => Ok(LoadBalancingType::Sinkhorn),
        "none" => Ok(LoadBalancingType::None),
        other => Err(ConfigError::Invalid(format!(
            "--moe-router-load-balancing-type {other:?}: use aux_loss, seq_aux_loss, \
             global_aux_loss, sinkhorn or none"
        ))
        .into()),
    }
}

/// Megatron's `--normalization` names (case-insensitive).
pub fn parse_normalization(name: &str) -> Result<Normalization> {
    match name.to_ascii_lowercase().as_str() {
        "layernorm" => Ok(Normalization::LayerNorm),
        "rmsnorm" => Ok(Normalization::RmsNorm),
        _ => Err(ConfigError::Invalid(format!(
            "--normalization {name:?}: use LayerNorm or RMSNorm"
        ))
        .into()),
    }
}

/// Megatron's `--position-embedding-type` (and `--rotary-base`, which only rope takes).
fn position_embedding(kind: Option<&str>, base: Option<f64>) -> Result<PositionEmbedding> {
    let invalid = |m: String| Err(ConfigError::Invalid(m).into());
    match kind.unwrap_or("learned_absolute") {
        "rope" => {
            let base = base.unwrap_or(10_000.0);
            if !(base.is_finite() && base > 1.0) {
                return invalid(format!(
                    "--rotary-base ({base}) must be a finite number above 1"
                ));
            }
            Ok(PositionEmbedding::Rope { base })
        }
        "learned_absolute" if base.is_some() => {
            invalid("--rotary-base takes effect with --position-embedding-type rope".into())
        }
        "learned_absolute" => Ok(PositionEmbedding::Learned),
        other => invalid(format!(
            "--position-embedding-type {other:?}: use learned_absolute or rope"
        )),
    }
}

/// Megatron's recomputation options: `--recompute-granularity selective|full` (or the older
/// `--recompute-activations`), with `--recompute-method` and `--recompute-num-layers` for
/// full recomputation: `uniform` reruns each chunk's layers in groups of N (1 by default),
/// `block` reruns the first N layers of each chunk and stores the rest.
fn recompute(
    granularity: Option<&str>,
    activations: bool,
    method: Option<&str>,
    num_layers: Option<usize>,
) -> Result<Recompute> {
    let invalid = |m: String| Err(ConfigError::Invalid(m).into());
    let granularity = match (granularity, activations) {
        (Some(g), true) if g != "selective" => {
            return invalid(format!(
                "--recompute-activations is --recompute-granularity selective, not {g:?}"
            ));
        }
        (_, true) => Some("selective"),
        (g, false) => g,
    };
    let full_only = |name: &str| {
        ConfigError::Invalid(format!(
            "{name} applies to --recompute-granularity full only"
        ))
    };
    match granularity {
        None | Some("selective") => {
            if method.is_some() {
                return Err(full_only("--recompute-method").into());
            }
            if num_layers.is_some() {
                return Err(full_only("--recompute-num-layers").into());
            }
            Ok(match granularity {
                None => Recompute::None,
                _ => Recompute::Selective,
            })
        }
        Some("full") => {
            let layers = num_layers.unwrap_or(1);
            match (method.unwrap_or("uniform"), layers) {
                ("uniform", 1) => Ok(Recompute::Full),
                ("uniform", layers) => Ok(Recompute::FullUniform { layers }),
                ("block", layers) => Ok(Recompute::FullBlock { layers }),
                (other, _) => invalid(format!(
                    "--recompute-method {other:?}: use uniform or block"
                )),
            }
        }
        Some(other) => invalid(format!(
            "--recompute-granularity {other:?}: use selective or full"
        )),
    }
}

/// Megatron's FP8 options: `--fp8-format` turns FP8 on, and the others are refused without
/// it; `--fp8-amax-history-len` and `--fp8-amax-compute-algo` belong to `--fp8-recipe
/// delayed`, and are refused with tensorwise scaling, where they would do nothing.
fn fp8(a: &PretrainArgs) -> Result<Option<Fp8Config>> {
    let invalid = |m: String| Err(ConfigError::Invalid(m).into());
    let Some(format) = &a.fp8_format else {
        for (name, given) in [
            ("--fp8-recipe", a.fp8_recipe.is_some()),
            ("--fp8-margin", a.fp8_margin.is_some()),
            ("--fp8-amax-history-len", a.fp8_amax_history_len.is_some()),
            ("--fp8-amax-compute-algo", a.fp8_amax_compute_algo.is_some()),
            (
                "--first-last-layers-bf16",
                a.first_last_layers_bf16.is_some(),
            ),
            (
                "--num-layers-at-start-in-bf16",
                a.num_layers_at_start_in_bf16.is_some(),
            ),
            (
                "--num-layers-at-end-in-bf16",
                a.num_layers_at_end_in_bf16.is_some(),
            ),
            ("--fp8-backward-bf16", a.fp8_backward_bf16.is_some()),
            ("--tp-only-amax-red", a.tp_only_amax_red.is_some()),
        ] {
            if given {
                return invalid(format!(
                    "{name} takes effect with --fp8-format (hybrid or e4m3): add it"
                ));
            }
        }
        return Ok(None);
    };
    let mut config = Fp8Config::new().with_format(Fp8Format::parse(format)?);
    if let Some(recipe) = &a.fp8_recipe {
        config.recipe = Fp8Recipe::parse(recipe)?;
    }
    if let Some(margin) = a.fp8_margin {
        config.margin = margin;
    }
    let history_options = a.fp8_amax_history_len.is_some() || a.fp8_amax_compute_algo.is_some();
    if config.recipe != Fp8Recipe::Delayed && history_options {
        return invalid(format!(
            "--fp8-amax-history-len and --fp8-amax-compute-algo apply to --fp8-recipe delayed \
             only ({} scaling uses the current amaxes): add --fp8-recipe delayed or leave them \
             out",
            a.fp8_recipe.as_deref().unwrap_or("tensorwise")
        ));
    }
    if let Some(len) = a.fp8_amax_history_len {
        config.amax_history_len = len;
    }
    if let Some(algo) = &a.fp8_amax_compute_algo {
        config.amax_compute_algo = AmaxComputeAlgo::parse(algo)?;
    }
    config.first_last_layers_bf16 = a.first_last_layers_bf16.unwrap_or(false);
    let counts = [
        (
            "--num-layers-at-start-in-bf16",
            a.num_layers_at_start_in_bf16,
        ),
        ("--num-layers-at-end-in-bf16", a.num_layers_at_end_in_bf16),
    ];
    for (name, count) in counts {
        if count.is_some() && !config.first_last_layers_bf16 {
            return invalid(format!(
                "{name} takes effect with --first-last-layers-bf16: add it or leave {name} out"
            ));
        }
    }
    if let Some(n) = a.num_layers_at_start_in_bf16 {
        config.num_layers_at_start_in_bf16 = n;
    }
    if let Some(n) = a.num_layers_at_end_in_bf16 {
        config.num_layers_at_end_in_bf16 = n;
    }
    if let Some(gemms) = &a.fp8_backward_bf16 {
        config.backward = Fp8Backward::parse(gemms)?;
    }
    config.tp_only_amax_reduction = a.tp_only_amax_red.unwrap_or(false);
    config.validate()?;
    Ok(Some(config))
}

/// Megatron's `--lr-decay-style` names.
pub fn parse_decay_style(name: &str) -> Result<LrDecayStyle> {
    match name.to_ascii_lowercase().as_str() {
        "constant" => Ok(LrDecayStyle::Constant),
        "linear" => Ok(LrDecayStyle::Linear),
        "cosine" => Ok(LrDecayStyle::Cosine),
        _ => Err(ConfigError::Invalid(format!(
            "--lr-decay-style {name:?}: use constant, linear or cosine (WSD is not an option of \
             pretrain_gpt yet)"
        ))
        .into()),
    }
}
