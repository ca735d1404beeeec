//! Pipeline parallelism: plans, and schedules against the single-device model, on CPU thread
//! ranks.

mod equivalence;
mod plans;
mod robustness;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::pipeline_parallel::Microbatch;
use burn_megatron::transformer::TransformerConfig;
pub use burn_megatron_testing::{assert_close, compare::data_values, run, tolerance};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// A tiny GPT of 4 layers with tied embeddings (the vocabulary of 50 is padded for TP).
pub fn tiny_gpt() -> TransformerConfig {
    TransformerConfig::new(16, 4, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// Microbatch `i` of a step: `[2, 8]` tokens and next-token-like targets (the first position
/// of each row ignored).
pub fn microbatches(count: usize, vocab: usize) -> Vec<Microbatch<AD>> {
    (0..count)
        .map(|i| {
            let ids = |seed: u64| -> Vec<i64> {
                (0..16u64)
                    .map(|j| ((j * 2_654_435_761 + seed * 40_503 + 7) % vocab as u64) as i64)
                    .collect()
            };
            let mut targets = ids(i as u64 + 100);
            targets[0] = -100;
            targets[8] = -100;
            let tensor = |v: Vec<i64>| {
                Tensor::<AD, 2, Int>::from_data(TensorData::new(v, [2, 8]), &Default::default())
            };
            Microbatch::new(tensor(ids(i as u64)), tensor(targets))
        })
        .collect()
}

/// A tiny Llama of 4 layers: RMSNorm, SwiGLU, RoPE, grouped queries, untied output.
pub fn tiny_llama() -> TransformerConfig {
    use burn_megatron::transformer::{Activation, Normalization, PositionEmbedding};
    TransformerConfig::new(16, 4, 4, 24, 50, 8)
        .with_num_query_groups(Some(2))
        .with_normalization(Normalization::RmsNorm)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 })
        .with_add_bias_linear(false)
        .with_tie_embeddings(false)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}
