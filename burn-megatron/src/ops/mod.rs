//! The model's elementwise operations whose backward is written out: exact where Burn's is
//! not, and the place where a fused kernel replaces the forward and the backward together.
//!
//! - [`mod@causal_softmax`]: the attention's scaled, causally masked softmax.
//! - [`mod@cross_entropy`]: the vocabulary-parallel cross-entropy, statistics forward and
//!   `softmax - one_hot` backward, each one pass over the logits.
//! - [`mod@dropout`]: dropout with masks drawn from global coordinates (on the device where a
//!   kernel exists), fused with the residual add after it.
//! - [`mod@embedding`]: the token-embedding lookup, whose weight gradient is one deterministic
//!   scatter-add kernel.
//! - [`mod@flash_attention`]: attention as one operation (output and log-sum-exp forward,
//!   probabilities recomputed backward), grouped-query attention without copying K/V.
//! - [`mod@packed_flash_attention`]: flash attention on the fused QKV projection's output
//!   `[batch, seq, groups, heads_per_group + 2, head_dim]`: no split copies forward, one
//!   gradient buffer backward.
//! - [`mod@gelu`]: GeLU (erf or tanh form) after an optional bias add, Megatron's bias-GeLU.
//! - [`mod@norm`]: LayerNorm and RMSNorm, f32 statistics, one backward for input, scale and
//!   shift.
//! - [`mod@rope`]: rotary position embeddings on the packed QKV, f32 angles, one kernel each
//!   way.
//! - [`mod@swiglu`]: `silu(gate + b_g) · (up + b_u)` (bias-SwiGLU), with a sigmoid that keeps
//!   f64.

pub mod causal_softmax;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod flash_attention;
pub mod gelu;
pub mod norm;
pub mod packed_flash_attention;
pub mod rope;
pub mod swiglu;

pub use dropout::DropoutMask;
pub use gelu::{GeluForm, bias_gelu, gelu};
pub use norm::{NormKind, norm};
pub use swiglu::{bias_swiglu, sigmoid, swiglu};
