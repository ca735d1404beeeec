//! The model's operations, one file (or folder) each: the op's backend trait, its plain Burn
//! composition (the default, on NdArray, and the reference the kernels are tested against),
//! its `Autodiff<B>` node, and its wiring to the CubeCL kernels of `burn_megatron_kernels::fused`
//! or a vendor library (cuBLASLt, cuDNN). [`ModelBackend`](crate::ModelBackend) gathers the
//! traits.
//!
//! - [`mod@linear`]: the dense layers' GEMMs, transposes folded in, cuBLASLt on our CUDA backend.
//! - [`mod@fp8`]: FP8 casts and GEMMs (emulated in float tensors by the compositions), the
//!   scaling recipes, and the FP8 linear layer as one autodiff operation.
//! - [`mod@gathered_linear`]: a column-parallel projection of a sequence-parallel input whose
//!   backward reduce-scatters the input's gradient while it computes the weights' gradients
//!   (`--tp-comm-overlap`).
//! - [`mod@grouped_linear`]: the experts' GEMMs, one grouped product for all of a rank's
//!   experts (one cuBLAS grouped GEMM on our CUDA backend), one node under autodiff.
//! - [`mod@reduce_scattered_linear`]: a row-parallel projection and its sequence-parallel
//!   reduce-scatter, whose backward computes this rank's input gradient while the output
//!   gradient's all-gather runs (`--tp-comm-overlap`).
//! - [`mod@bias`]: a bias added to every token, its gradient as deterministic column sums.
//! - [`mod@gelu`]: GeLU (erf or tanh form) after an optional bias add, Megatron's bias-GeLU.
//! - [`mod@swiglu`]: `silu(gate + b_g) · (up + b_u)` (bias-SwiGLU), with a sigmoid that keeps
//!   f64.
//! - [`mod@norm`]: LayerNorm and RMSNorm, f32 statistics, one backward for input, scale and
//!   shift.
//! - [`mod@counter_normal`]: parameters' initial values from their global coordinates, drawn
//!   on the device where a kernel exists.
//! - [`mod@dropout`]: dropout with masks drawn from global coordinates (on the device where a
//!   kernel exists), fused with the residual add after it.
//! - [`mod@rope`]: rotary position embeddings on the packed QKV, f32 angles, one kernel each
//!   way.
//! - [`mod@causal_softmax`]: the attention's scaled, causally (or padding-) masked softmax.
//! - [`mod@decode_attention`]: one decode step's attention (RoPE, the KV cache's write, the
//!   masked attention over the cache), one kernel a layer on CubeCL backends.
//! - [`mod@flash_attention`]: attention as one operation (output and log-sum-exp forward,
//!   probabilities recomputed backward), grouped-query attention without copying K/V.
//! - [`mod@ring_flash_attention`]: context parallelism's ring of K/V blocks on the flash
//!   attention, one node whose backward recomputes each block from the merged output and
//!   log-sum-exp and passes the K/V gradients back around the ring.
//! - [`mod@packed_flash_attention`]: flash attention on the fused QKV projection's output
//!   `[batch, seq, groups, heads_per_group + 2, head_dim]`: no split copies forward, one
//!   gradient buffer backward.
//! - [`mod@recompute`]: the attention core stored as its inputs only (selective recomputation).
//! - [`mod@embedding`]: the token-embedding lookup, whose weight gradient is one deterministic
//!   scatter-add kernel.
//! - [`mod@permute`]: the MoE dispatcher's row gathers (Megatron's permute, and unpermute
//!   with the router's weights), whose gradient is a gather through the inverse index; the
//!   inverse of an index on the device.
//! - [`mod@top_k`]: the router's top-k columns of each row, one kernel on CubeCL backends.
//! - [`mod@cross_entropy`]: the vocabulary-parallel cross-entropy, statistics forward and
//!   `softmax - one_hot` backward, each one pass over the logits.
//! - [`mod@ids`]: token and target ids checked against the vocabulary (on the device on our
//!   CUDA backend).
//! - [`mod@backward_hook`]: code run inside the backward pass where a tensor was marked.
//! - [`mod@write_slot`]: a gradient cast and copied into its slot of a flat fp32 buffer.
//! - [`mod@adamw`]: one AdamW step over flat fp32 buffers.
//! - [`mod@host_transfer`]: host buffers and uploads of whole tensors, for checkpoints
//!   (page-locked and without CubeCL's extra copy on our CUDA backend).
//!
//! `autodiff` holds the backward shell the ops share, `primitive` the moves between tensors
//! and primitives.

pub mod adamw;
mod autodiff;
pub mod backward_hook;
pub mod bias;
pub mod causal_softmax;
pub mod counter_normal;
pub mod cross_entropy;
pub mod decode_attention;
pub mod dropout;
pub mod embedding;
pub mod flash_attention;
pub mod fp8;
pub mod gathered_linear;
pub mod gelu;
pub mod grouped_linear;
pub mod host_transfer;
pub mod ids;
pub mod linear;
pub mod norm;
pub mod packed_flash_attention;
pub mod permute;
mod primitive;
pub mod recompute;
pub mod reduce_scattered_linear;
pub mod ring_flash_attention;
pub mod rope;
pub mod swiglu;
pub mod top_k;
pub mod write_slot;

pub use adamw::AdamWOps;
pub use backward_hook::{BackwardHook, BackwardHookOps, WeightGradient, node_id};
pub use bias::{BiasOps, bias_add};
pub use causal_softmax::SoftmaxOps;
pub use counter_normal::CounterNormalOps;
pub use cross_entropy::CrossEntropyOps;
pub use decode_attention::{DecodeAttentionOps, DecodeIndices};
pub use dropout::{DropoutMask, DropoutOps};
pub use embedding::EmbeddingOps;
pub use flash_attention::FlashAttentionOps;
pub use fp8::{Fp8LinearOps, Fp8Ops};
pub use gathered_linear::{GatheredLinearOps, GatheredProjection};
pub use gelu::{GeluForm, GeluOps, bias_gelu, gelu};
pub use grouped_linear::{GroupedLinearOps, grouped_linear, hooked_grouped_linear};
pub use host_transfer::HostTransferOps;
pub use ids::IdCheckOps;
pub use linear::{LinearOps, hooked_linear, linear, linear_output_major};
pub use norm::{NormKind, NormOps, norm};
pub use packed_flash_attention::PackedFlashAttentionOps;
pub use permute::{PermuteOps, RowIndex, permute_rows, unpermute_rows};
pub use recompute::{RecomputeOps, RecomputedAttention};
pub use reduce_scattered_linear::ReduceScatteredLinearOps;
pub use ring_flash_attention::RingFlashAttentionOps;
pub use rope::RopeOps;
pub use swiglu::{SwiGluOps, bias_swiglu, sigmoid, swiglu};
pub use top_k::{TopKOps, top_k_indices};
pub use write_slot::WriteSlotOps;
