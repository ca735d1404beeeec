//! Tensor-parallel GPT and Llama models against the single-device model, on CPU thread ranks.

mod bad_input;
mod communication;
mod config_errors;
mod cross_entropy;
mod equivalence;
mod training;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_testing::models::{llama, token_ids};
pub use burn_megatron_testing::{assert_close, compare::data_values, run, tolerance};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// A small GPT: LayerNorm, GeLU, learned positions, biases, tied embeddings. The vocabulary
/// (50) is padded differently for every TP size.
pub fn small_gpt() -> TransformerConfig {
    TransformerConfig::new(16, 2, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// A small Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention (8 heads in 4 groups), no
/// biases, untied output layer.
pub fn small_llama() -> TransformerConfig {
    llama(TransformerConfig::new(32, 2, 8, 24, 50, 8).with_num_query_groups(Some(4)))
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// Deterministic token ids in `[0, vocab)`, shaped `[batch, seq]`.
pub fn tokens(batch: usize, seq: usize, vocab: usize, seed: u64) -> Tensor<AD, 2, Int> {
    let ids = token_ids(batch * seq, vocab, seed);
    Tensor::from_data(TensorData::new(ids, [batch, seq]), &Default::default())
}
