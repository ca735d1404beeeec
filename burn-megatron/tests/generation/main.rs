//! Text generation with the KV cache (`burn_megatron::inference`) against the full forward
//! pass, at TP 1 and TP 2, on CPU thread ranks.

mod errors;
mod kv_cache;
mod pipeline;
mod sampling;

use burn::backend::NdArray;
use burn_megatron::inference::{Generated, GenerationConfig};
use burn_megatron::models::GptModel;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::ParallelSizes;
pub use burn_megatron_testing::{assert_close, run, tolerance};

/// Generation runs without autodiff.
pub type B = NdArray<f32>;

/// The tiny GPT (learned positions, tied embeddings) with room for 12 tokens, initialised
/// with std 0.5: logits that depend on the context enough for greedy tokens to vary.
pub fn gpt() -> TransformerConfig {
    let mut config = burn_megatron_testing::models::tiny_gpt().with_init_std(0.5);
    config.max_sequence_length = 12;
    config
}

/// The tiny Llama (RoPE, GQA: 4 query heads in 2 groups, one group a rank at TP 2) with room
/// for 12 tokens, initialised with std 0.5.
pub fn llama() -> TransformerConfig {
    let mut config = burn_megatron_testing::models::tiny_llama().with_init_std(0.5);
    config.max_sequence_length = 12;
    config
}

/// Prompts of different lengths (1, 4 and 7 tokens) in the vocabulary of 50.
pub fn prompts() -> Vec<Vec<i64>> {
    vec![vec![3, 17, 42, 8], vec![25], vec![1, 2, 3, 5, 8, 13, 21]]
}

/// Runs `generate` (given the model and the prompts) on every rank of TP = `tp` and returns
/// each rank's result.
pub fn on_ranks<T: Send>(
    config: &TransformerConfig,
    tp: usize,
    f: impl Fn(&GptModel<B>) -> burn_megatron::Result<T> + Sync,
) -> Vec<T> {
    run(tp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        let model = config.init_gpt::<B>(state.tp(), &Default::default())?;
        Ok(f(&model)?)
    })
}

/// The generated tokens only.
pub fn tokens(generated: &[Generated]) -> Vec<Vec<i64>> {
    generated.iter().map(|g| g.tokens.clone()).collect()
}

/// Greedy generation of up to 9 new tokens (the 7-token prompt stops at the 12-token limit).
pub fn greedy() -> GenerationConfig {
    GenerationConfig::greedy(9)
}
