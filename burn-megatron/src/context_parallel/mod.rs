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
//! - [`context_parallel_attention`] dispatches on [`CpCommType`].
//! - [`block_attention`](block_attention::block_attention) and
//!   [`merge`](block_attention::merge): the partial attention with its log-sum-exp, and the
//!   online-softmax merge, both Burn compositions.
//!
//! Both variants take grouped-query attention (fewer K/V heads than query heads, any number
//! of K/V heads, whatever CP is) and run under `Autodiff<B>` on every
//! [`DistBackend`](burn_megatron_dist::DistBackend): their backward is Burn's autodiff through the
//! compositions and through differentiable communication (the all-gather's gradient is
//! reduce-scattered; the ring exchange's gradient goes back round the ring).
//!
//! Not here yet: the Ulysses all-to-all (`a2a`); a ring whose attention is the fused flash
//! kernel with its own backward node (the fused op's log-sum-exp is not tracked under
//! `Autodiff`, so the compositions here materialise each block pair's scores and keep them
//! for the backward); overlap of the ring's exchange with the attention; and the model,
//! loss and data loader on the split (see the book's "Context parallelism" page).

pub mod all_gather;
pub mod all_to_all;
pub mod block_attention;
pub mod comm_type;
pub mod context;
pub mod ring;
pub mod split;

pub use all_gather::all_gather_attention;
pub use all_to_all::{all_to_all_attention, all_to_all_flash_attention};
pub use comm_type::{CpCommType, context_parallel_attention, context_parallel_flash_attention};
pub use context::CpContext;
pub use ring::{ring_attention, ring_flash_attention, ring_plan};
pub use split::LoadBalancedSplit;
