//! Model fixtures shared by burn-megatron's test crates (feature `models`): the tiny GPT and
//! Llama configurations, Llama's architecture choices on any configuration, and deterministic
//! token ids and microbatches.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::data::Microbatch;
use burn_megatron::transformer::{Activation, Normalization, PositionEmbedding, TransformerConfig};

/// A tiny GPT of 4 layers: LayerNorm, GeLU, learned positions, biases, tied embeddings; the
/// vocabulary of 50 is padded differently for TP = 1, 2, 4 (52, 56, 64 rows).
pub fn tiny_gpt() -> TransformerConfig {
    TransformerConfig::new(16, 4, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// A tiny Llama of 4 layers: RMSNorm, SwiGLU, RoPE, grouped queries (4 heads in 2 groups), no
/// biases, untied output; the vocabulary of 50 is padded for TP.
pub fn tiny_llama() -> TransformerConfig {
    llama(TransformerConfig::new(16, 4, 4, 24, 50, 8).with_num_query_groups(Some(2)))
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// `config` with Llama's architecture: RMSNorm, SwiGLU, RoPE (base 10 000), no biases in the
/// linear layers, an output layer untied from the embedding.
pub fn llama(config: TransformerConfig) -> TransformerConfig {
    config
        .with_normalization(Normalization::RmsNorm)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 })
        .with_add_bias_linear(false)
        .with_tie_embeddings(false)
}

/// `n` deterministic token ids in `[0, vocab)`: `(i · 2 654 435 761 + seed · 40 503 + 7) mod
/// vocab`.
pub fn token_ids(n: usize, vocab: usize, seed: u64) -> Vec<i64> {
    (0..n as u64)
        .map(|i| ((i * 2_654_435_761 + seed * 40_503 + 7) % vocab as u64) as i64)
        .collect()
}

/// A microbatch of `[2, 8]` tokens drawn with `seed` and next-token-like targets drawn with
/// `seed + 100` (the first position of each row ignored), on the default device.
pub fn microbatch<B: Backend>(vocab: usize, seed: u64) -> Microbatch<B> {
    let mut targets = token_ids(16, vocab, seed + 100);
    targets[0] = -100;
    targets[8] = -100;
    let tensor = |v: Vec<i64>| {
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [2, 8]), &Default::default())
    };
    Microbatch::new(tensor(token_ids(16, vocab, seed)), tensor(targets))
}
