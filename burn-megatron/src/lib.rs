//! Megatron-style parallel modules, models and training for Burn.
//!
//! Layers are ordinary Burn modules (`#[derive(Module)]`, generic over the backend, working
//! under `Autodiff`) that hold their slice of the parameters and a
//! [`ProcessGroup`](burn_megatron_dist::ProcessGroup) to communicate over.
//!
//! From the bottom up (a module imports only those above it in this list, see
//! `tests/tests/module_layering.rs`):
//!
//! - [`error`]: every error type and the policy they follow; [`init`]: layout-independent
//!   initialisation; [`data`]: Megatron's indexed datasets (`.bin`/`.idx`), GPT sampling,
//!   blending, splits, tokenizers, the preprocessing behind `preprocess_data`, and the
//!   [`Microbatch`](data::Microbatch) the model takes.
//! - [`ops`]: the model's operations, one home each (backend trait, composition, autodiff
//!   node, kernel wiring); [`backend`]: [`ModelBackend`], which gathers them.
//! - [`tensor_parallel`]: column/row-parallel linear layers, vocabulary-parallel embedding,
//!   output layer and cross-entropy, layout-independent dropout, parameter placements and
//!   kinds, sequence parallelism's partial gradients. [`context_parallel`] beside it: the
//!   load-balanced sequence split over CP and causal attention across it (ring and
//!   all-gather).
//! - [`transformer`]: [`TransformerConfig`](transformer::TransformerConfig) and the layers.
//! - [`models`]: [`GptModel`](models::GptModel), GPT- and Llama-style, and the pipeline
//!   stage it is built for.
//! - [`pipeline_parallel`]: schedules (no pipelining, GPipe, 1F1B, interleaved), their plans
//!   and timelines, and the executor that runs them. [`inference`] beside it: text
//!   generation with a KV cache.
//! - [`distributed`]: flat parameter and gradient buffers (Megatron's `ParamAndGradBuffer`)
//!   and the data-parallel gradient reduction, overlapped with the backward pass.
//! - [`optimizer`]: learning-rate schedules, the weight-decay policy, global-norm gradient
//!   clipping, the dynamic loss scaler, AdamW over flat buffers and the distributed
//!   optimizer (ZeRO-1), and optimizer state by parameter.
//! - [`checkpointing`]: sharded, reshardable, crash-safe checkpoints; Hugging Face import and
//!   export.
//! - [`training`]: the pretraining loop (`pretrain_gpt`), its options, progress and resume,
//!   burn-train's Learner, and the memory planner.

pub mod backend;
pub mod checkpointing;
pub mod context_parallel;
pub mod data;
pub mod distributed;
pub mod error;
pub mod inference;
pub mod init;
pub mod models;
pub mod ops;
pub mod optimizer;
pub mod pipeline_parallel;
pub mod tensor_parallel;
pub mod training;
pub mod transformer;

pub use backend::ModelBackend;
pub use burn_megatron_dist as dist;
pub use error::{ConfigError, DataError, Error, IdKind, InputError, Result};
