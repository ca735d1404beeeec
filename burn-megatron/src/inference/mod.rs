//! Text generation with a KV cache (issue 37): prefill of the prompts, then one token at a
//! time, on a tensor-parallel group's ranks with the model's own layers. A decode step reads
//! one thing back to the host: the `[batch]` picked token ids.
//!
//! - [`KvCache`]: per layer, this rank's key/value heads (GQA: the groups, not the query
//!   heads; under TP, split by heads as the layers are) in buffers of a fixed capacity
//!   written in place, the left padding of a batch of prompts of different lengths, the
//!   positions and causal mask of new tokens, and RoPE's table on the device.
//! - [`forward_cached`]: the model's incremental forward pass against the cache, at the
//!   tokens' absolute positions (RoPE or learned positions), attention by query group.
//! - [`Sampling`]: greedy, or temperature, top-k and top-p with a seed, picked on the device.
//! - [`generate`]: the loop, with stop tokens and a maximum of new tokens;
//!   [`generate_pipelined`] the same over pipeline stages; [`generate_without_cache`] reruns
//!   the whole forward pass per token (the reference).
//!
//! Not here yet: sequence parallelism; the decode attention is a Burn composition, not a
//! fused kernel.

mod decode;
mod device_step;
mod generate;
mod kv_cache;
mod sampling;

pub use decode::{embed_cached, forward_cached, layers_cached};
pub use generate::{
    FinishReason, Generated, GenerationConfig, generate, generate_pipelined, generate_without_cache,
};
pub use kv_cache::{KvCache, LayerKv};
pub use sampling::Sampling;
