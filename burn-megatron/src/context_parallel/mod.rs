//! Context parallelism (CP): the sequence split over the CP group, and causal attention across
//! the split (issue 35; Megatron-Core's `--context-parallel-size`, `--cp-comm-type`).
//!
//! Every layer but attention works on its own tokens; attention needs every earlier token's
//! keys and values. So:
//!
//! - [`LoadBalancedSplit`]: the sequence in `2 · cp` chunks, rank `i` holding chunks `i` and
//!   `2 · cp - 1 - i` (equal causal work on every rank), the helpers that cut a rank's part out
//!   of a tensor and put the parts back in order, and the global position ids of a rank's
//!   tokens (for RoPE).
//! - [`ring_attention`] (`p2p`): K/V blocks passed around a ring in `cp - 1` steps, each
//!   step's partial attention merged by log-sum-exp.
//! - [`all_gather_attention`] (`all_gather`): K/V all-gathered, one attention against the
//!   whole sequence.
//! - [`all_to_all_attention`] (`a2a`, DeepSpeed-Ulysses): the sequence split traded for a head
//!   split by all-to-all, and back.
//! - [`context_parallel_attention`] dispatches on [`CpCommType`] to these compositions, the
//!   reference on every backend.
//! - [`ring_flash_attention`], [`all_gather_flash_attention`] and
//!   [`all_to_all_flash_attention`]: `p2p`, `all_gather` and `a2a` on the fused flash
//!   attention (the ring, and the gathered blocks taken in the ring's order, as one operation
//!   with its own backward node, [`crate::ops::ring_flash_attention`]);
//!   [`context_parallel_flash_attention`] dispatches to them, and is what the model runs.
//! - [`CpContext`]: the group and communication a model's layers run over
//!   ([`GptModel::with_context_parallel`](crate::models::GptModel::with_context_parallel)).
//! - [`block_attention`](block_attention::block_attention) and
//!   [`merge`](block_attention::merge): the partial attention with its log-sum-exp, and the
//!   online-softmax merge, both Burn compositions.
//!
//! Every variant takes grouped-query attention (fewer K/V heads than query heads, any number
//! of K/V heads, whatever CP is; `a2a` repeats the K/V heads when CP does not divide them)
//! and runs under `Autodiff<B>` on every [`DistBackend`](burn_megatron_dist::DistBackend):
//! the compositions' backward is Burn's autodiff through them and through differentiable
//! communication (the all-gather's gradient is reduce-scattered; the ring exchange's gradient
//! goes back round the ring).
//!
//! The fused ring starts each step's K/V exchange before the step's attention and sends a copy,
//! so that the two overlap on our CUDA backend (the compositions run one after the other). Not
//! here yet: attention dropout (see the book's "Context parallelism" page).

pub mod all_gather;
pub mod all_to_all;
pub mod block_attention;
pub mod comm_type;
pub mod context;
pub mod ring;
pub mod split;

pub use all_gather::{all_gather_attention, all_gather_flash_attention};
pub use all_to_all::{all_to_all_attention, all_to_all_flash_attention};
pub use comm_type::{CpCommType, context_parallel_attention, context_parallel_flash_attention};
pub use context::CpContext;
pub use ring::{ring_attention, ring_flash_attention, ring_plan};
pub use split::LoadBalancedSplit;
