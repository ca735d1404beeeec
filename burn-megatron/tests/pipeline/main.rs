//! Pipeline parallelism: plans, and schedules against the single-device model, on CPU thread
//! ranks.

mod equivalence;
mod plans;
mod robustness;

use burn::backend::{Autodiff, NdArray};
use burn_megatron::pipeline_parallel::Microbatch;
use burn_megatron_testing::models::microbatch;
pub use burn_megatron_testing::models::{tiny_gpt, tiny_llama};
pub use burn_megatron_testing::{assert_close, compare::data_values, run, tolerance};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// The `count` microbatches of a step (microbatch `i` drawn with seed `i`): `[2, 8]` tokens and
/// next-token-like targets (the first position of each row ignored).
pub fn microbatches(count: usize, vocab: usize) -> Vec<Microbatch<AD>> {
    (0..count as u64).map(|i| microbatch(vocab, i)).collect()
}
