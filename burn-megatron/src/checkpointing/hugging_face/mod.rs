//! Hugging Face interop: transformers' GPT-2, Llama, Mixtral and Qwen3-MoE checkpoints
//! (`config.json` + `model.safetensors`) imported into our models at any TP/PP/EP layout, and
//! exported back.
//!
//! - [`HfConfig`]: `config.json` ↔ [`TransformerConfig`](crate::transformer::TransformerConfig);
//!   options we do not implement (`rope_scaling`, attention biases in Llama, Mixtral's
//!   `sliding_window` or `router_jitter_noise`, …) are errors naming the key; OLMoE and
//!   Qwen2-MoE are refused naming what our model lacks (QK-norm over all heads together, a
//!   gated shared expert).
//! - [`HfCheckpoint::load_model`]: each rank converts the transformers tensors its chunk needs
//!   (memory-mapped, any float dtype) to our layout and keeps its slice (of the routed
//!   experts, it reads only its own).
//! - [`export_model`]: the model gathered over TP, written with transformers' names and
//!   layouts, the vocabulary unpadded.
//!
//! The name and layout mapping (QKV column order, transposed `nn.Linear` weights, RoPE
//! convention, vocabulary padding, Mixtral's and Qwen3-MoE's experts) is described in
//! `layout.rs`.

mod config;
mod export;
mod files;
mod import;
mod layout;

pub use config::{HfConfig, HfFamily};
pub use export::{export_model, export_tensors};
pub use files::{HF_INDEX_FILE, HF_WEIGHTS_FILE};
pub use import::HfCheckpoint;
pub(crate) use import::copy_tokenizer_files;
