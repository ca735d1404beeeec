//! Text generation with a KV cache (issue 37's CPU foundation): prefill of the prompts, then
//! one token at a time, on a tensor-parallel group's ranks with the model's own layers.
//!
//! - [`KvCache`]: per layer, this rank's key/value heads (GQA: the groups, not the query
//!   heads; under TP, split by heads as the layers are), the left padding of a batch of
//!   prompts of different lengths, and the positions and causal mask of new tokens.
//! - [`forward_cached`]: the model's incremental forward pass against the cache, at the
//!   tokens' absolute positions (RoPE or learned positions).
//! - [`Sampling`]: greedy, or temperature, top-k and top-p with a seed.
//! - [`generate`]: the loop, with stop tokens and a maximum of new tokens;
//!   [`generate_pipelined`] the same over pipeline stages; [`generate_without_cache`] reruns
//!   the whole forward pass per token (the reference).
//!
//! Not here yet: sequence parallelism, a GPU decode path (the flash or
//! cuDNN kernels, no host syncs but the sampled token), a preallocated cache.

mod decode;
mod generate;
mod kv_cache;
mod sampling;

pub use decode::{embed_cached, forward_cached, layers_cached};
pub use generate::{
    FinishReason, Generated, GenerationConfig, generate, generate_pipelined, generate_without_cache,
};
pub use kv_cache::{KvCache, LayerKv};
pub use sampling::Sampling;
