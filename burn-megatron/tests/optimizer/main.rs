//! The optimizer's pieces: learning-rate schedules against their formulas, the weight-decay
//! groups, global-norm clipping against the single-device model in TP and PP layouts, and
//! the dynamic loss scaler's skip, back-off and growth (with Burn's optimizers and with the
//! distributed optimizer); data parallelism against one device.

mod clip;
mod data_parallel;
mod distributed_loss_scaling;
mod flat_adamw;
mod loss_scaler;
mod lr_schedule;
mod param_groups;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::pipeline_parallel::Microbatch;
use burn_megatron::transformer::{Activation, Normalization, PositionEmbedding, TransformerConfig};
pub use burn_megatron_testing::{assert_close, compare::data_values, run, tolerance, values};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// A tiny GPT of 4 layers: LayerNorm, GeLU, learned positions, biases, tied embeddings (the
/// vocabulary of 50 is padded for TP).
pub fn tiny_gpt() -> TransformerConfig {
    TransformerConfig::new(16, 4, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// A tiny Llama of 2 layers: RMSNorm, SwiGLU, RoPE, grouped queries (8 heads in 4 groups), no biases, untied output.
pub fn tiny_llama() -> TransformerConfig {
    TransformerConfig::new(16, 2, 8, 24, 50, 8)
        .with_num_query_groups(Some(4))
        .with_normalization(Normalization::RmsNorm)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 })
        .with_add_bias_linear(false)
        .with_tie_embeddings(false)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// `count` microbatches of `[2, 8]` tokens and next-token-like targets (the first position
/// of each row ignored), the same on every rank; `seed` varies them between steps.
pub fn microbatches(count: usize, vocab: usize, seed: u64) -> Vec<Microbatch<AD>> {
    (0..count as u64)
        .map(|i| {
            let ids = |s: u64| -> Vec<i64> {
                (0..16u64)
                    .map(|j| ((j * 2_654_435_761 + s * 40_503 + 7) % vocab as u64) as i64)
                    .collect()
            };
            let mut targets = ids(i + seed * 31 + 100);
            targets[0] = -100;
            targets[8] = -100;
            let tensor = |v: Vec<i64>| {
                Tensor::<AD, 2, Int>::from_data(TensorData::new(v, [2, 8]), &Default::default())
            };
            Microbatch::new(tensor(ids(i + seed * 31)), tensor(targets))
        })
        .collect()
}
