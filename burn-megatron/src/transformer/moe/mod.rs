//! Mixture of experts with expert parallelism (issue 34): an MoE layer, dropless or with a
//! capacity per expert, in the GPT model and `pretrain_gpt`, CPU-tested against one device.
//!
//! - [`router`]: linear scores, softmax or sigmoid, top-k (pre-softmax or not, group-limited or
//!   not), normalisation and scaling of the weights, DeepSeek-V3's expert bias;
//!   [`mod@sinkhorn`]: the choice balanced by Sinkhorn's normalisation instead of a loss.
//! - [`dispatcher`]: tokens sorted by expert and moved over the expert-parallel group, then
//!   brought back in order: by an all-to-all of blocks of different sizes, or by an
//!   all-gather of the group's tokens and a reduce-scatter of the outputs
//!   ([`TokenDispatcherType`], Megatron's `--moe-token-dispatcher-type`).
//! - [`capacity`]: [`ExpertCapacity`], Megatron's capacity factor, drop policy and padding.
//! - [`experts`]: a rank's experts, weights stacked `[local_experts, ..]`, each run once on
//!   its contiguous block of tokens; SwiGLU or GeLU.
//! - [`layer`]: [`MoeLayer`], router → dispatch → experts → combine, plus the shared expert,
//!   returning [`MoeOutput`] (output and losses); [`config`]: [`MoeConfig`].
//! - [`aux_losses`]: the Switch-style and sequence-level load-balancing losses and the z-loss;
//!   [`losses`]: [`MoeLosses`], the auxiliary losses of a forward pass's MoE layers, which the
//!   pipeline schedules add to each stage's backward root.
//! - [`settings`]: [`MoeSettings`], the MoE part of a `TransformerConfig` (which layers, which
//!   settings), and `--moe-layer-freq`'s forms.
//!
//! Not yet: expert tensor parallelism of a size other than 1 or the TP size, Megatron's
//! `flex` dispatcher (DeepEP); the token counts
//! that size the exchange (`ep · (num_experts + 1)` numbers) are read to the host in every
//! MoE layer's forward pass.

pub mod aux_losses;
pub mod capacity;
pub mod config;
pub mod dispatcher;
pub mod experts;
pub mod jitter;
pub mod layer;
pub mod losses;
pub mod router;
pub mod settings;
pub mod sinkhorn;

pub use aux_losses::{load_balancing_loss, sequence_load_balancing_loss, z_loss};
pub use capacity::{ExpertCapacity, TokenDropPolicy};
pub use config::MoeConfig;
pub use dispatcher::{
    AllGatherPlan, AllToAllPlan, BlockPadding, DispatchPlan, Exchange, PendingPlan,
    TokenDispatcher, TokenDispatcherType,
};
pub use experts::{GroupedExperts, GroupedExpertsConfig};
pub use jitter::JitterSite;
pub use layer::{MoeLayer, MoeOutput};
pub use losses::MoeLosses;
pub use router::{
    AuxLossTerm, LoadBalancingType, Router, RouterDtype, RouterScoreFunction, RouterSettings,
    Routing, balancing_logits, check_load_balancing_list, expert_bias_update,
};
pub use settings::{MoeLayerFreq, MoeSettings};
pub use sinkhorn::{SINKHORN_MAX_ITERATIONS, SINKHORN_TOLERANCE, sinkhorn};
