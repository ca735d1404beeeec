//! The optimizer's pieces: learning-rate schedules against their formulas, the weight-decay
//! groups, global-norm clipping against the single-device model in TP and PP layouts, and
//! the dynamic loss scaler's skip, back-off and growth (with Burn's optimizers and with the
//! distributed optimizer); data parallelism against one device, with the optimizer's flat
//! buffers in one part and cut into several.

mod clip;
mod data_parallel;
mod dense_parts;
mod distributed_loss_scaling;
mod flat_adamw;
mod loss_scaler;
mod lr_schedule;
mod param_groups;

use burn::backend::{Autodiff, NdArray};
use burn_megatron::pipeline_parallel::Microbatch;
use burn_megatron::transformer::TransformerConfig;
pub use burn_megatron_testing::models::tiny_gpt;
use burn_megatron_testing::models::{llama, microbatch};
pub use burn_megatron_testing::{assert_close, compare::data_values, run, tolerance, values};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// A tiny Llama of 2 layers: RMSNorm, SwiGLU, RoPE, grouped queries (8 heads in 4 groups), no
/// biases, untied output. (Not the shared `tiny_llama`, whose 4 heads in 2 groups stop at
/// TP = 2: the clipping tests take this one to TP = 4.)
pub fn tiny_llama() -> TransformerConfig {
    llama(TransformerConfig::new(16, 2, 8, 24, 50, 8).with_num_query_groups(Some(4)))
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

/// `count` microbatches of `[2, 8]` tokens and next-token-like targets (the first position
/// of each row ignored), the same on every rank; `seed` varies them between steps (microbatch
/// `i` drawn with seed `i + 31 · seed`).
pub fn microbatches(count: usize, vocab: usize, seed: u64) -> Vec<Microbatch<AD>> {
    (0..count as u64)
        .map(|i| microbatch(vocab, i + seed * 31))
        .collect()
}
