//! Tensor-parallel GPT and Llama models against the single-device model, on CPU thread ranks.

mod config_errors;
mod cross_entropy;
mod equivalence;
mod training;

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::transformer::{Activation, Normalization, PositionEmbedding, TransformerConfig};
use burn_megatron_dist::{LaunchConfig, RankContext, launch};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// Runs `f` on `n` thread ranks and returns every rank's result.
pub fn run<T: Send>(
    n: usize,
    f: impl Fn(RankContext) -> Result<T, Box<dyn std::error::Error + Send + Sync>> + Sync,
) -> Vec<T> {
    let config = LaunchConfig::new(n).with_timeout(Duration::from_secs(60));
    launch(config, f).unwrap_or_else(|e| panic!("launch failed: {e}\n{:#?}", e.failures))
}

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
    TransformerConfig::new(32, 2, 8, 24, 50, 8)
        .with_num_query_groups(Some(4))
        .with_normalization(Normalization::RmsNorm)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 })
        .with_add_bias_linear(false)
        .with_tie_embeddings(false)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// Deterministic token ids in `[0, vocab)`, shaped `[batch, seq]`.
pub fn tokens(batch: usize, seq: usize, vocab: usize, seed: u64) -> Tensor<AD, 2, Int> {
    let ids: Vec<i64> = (0..batch * seq)
        .map(|i| ((i as u64 * 2_654_435_761 + seed * 40_503 + 7) % vocab as u64) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq]), &Default::default())
}

/// The tensor's values as f32.
pub fn values(data: TensorData) -> Vec<f32> {
    data.convert::<f32>().to_vec().unwrap()
}

/// `max |a - b| / max |b|`: the relative error of a whole tensor.
pub fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    let scale = b
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
