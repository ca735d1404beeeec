//! The transformer: configuration, norms, attention, MLP, mixture of experts and layers.

mod attention;
mod attention_core;
mod block;
mod config;
mod flops;
mod layer;
mod mlp;
pub mod moe;
mod norm;

pub use attention::ParallelAttention;
pub use attention_core::AttentionCore;
pub use block::TransformerBlock;
pub use config::{
    Activation, Normalization, PositionEmbedding, Recompute, TransformerConfig, ValidatedConfig,
};
pub use layer::TransformerLayer;
pub(crate) use layer::{LayerContext, hidden_dropout};
pub use mlp::ParallelMlp;
pub use norm::Norm;
