//! Megatron-style parallel modules, models and training for Burn.
//!
//! Layers are ordinary Burn modules (`#[derive(Module)]`, generic over the backend, working
//! under `Autodiff`) that hold their slice of the parameters and a
//! [`ProcessGroup`](burn_megatron_dist::ProcessGroup) to communicate over.
//!
//! - [`tensor_parallel`]: column/row-parallel linear layers, vocabulary-parallel embedding,
//!   output layer and cross-entropy, layout-independent dropout, parameter placements.
//! - [`transformer`]: [`TransformerConfig`](transformer::TransformerConfig) and the layers.
//! - [`models`]: [`GptModel`](models::GptModel), GPT- and Llama-style.
//! - [`pipeline_parallel`]: stages, schedules (no pipelining, GPipe, 1F1B, interleaved) and
//!   their plans and timelines.
//! - [`optimizer`]: learning-rate schedules, the weight-decay policy, global-norm gradient
//!   clipping, the dynamic loss scaler, and AdamW fused over flat buffers.
//! - [`distributed`]: flat parameter and gradient buffers (Megatron's `ParamAndGradBuffer`).
//! - [`data`]: Megatron's indexed datasets (`.bin`/`.idx`), GPT sampling, blending, splits,
//!   tokenizers and the preprocessing behind `preprocess_data`.
//! - [`checkpointing`]: sharded, reshardable, crash-safe checkpoints.
//! - [`training`]: the pretraining loop (`pretrain_gpt`), its options, progress and resume.
//! - [`ops`]: the MLP activations (GeLU, SwiGLU) with exact, written-out backwards.

pub mod backend;
pub mod checkpointing;
pub mod data;
pub mod distributed;
pub mod error;
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
