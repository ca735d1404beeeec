//! What the optimizer step needs around Burn's optimizers: Megatron-Core's `optimizer/`
//! package, in pieces that work with `optim.step(lr, model, grads)`.
//!
//! - [`lr_schedule`]: learning-rate schedules in global steps, Megatron's
//!   `OptimizerParamScheduler` (warm-up, then constant, linear, cosine or WSD decay); also a
//!   Burn `LrScheduler`.
//! - [`param_groups`]: the weight-decay policy (no decay on biases and norms by default), and
//!   the split of a step's gradients into the decayed and exempt groups.
//! - [`clip`]: global-norm gradient clipping over the model-parallel group, counting each
//!   parameter once (TP-replicated parameters, tied embeddings), without a host sync.
//! - [`loss_scaler`]: the dynamic loss scaler for fp16 (`DynamicGradScaler`), with its
//!   overflow flag, scale and skip decision on the device.
//!
//! - [`flat_adamw`]: [`FlatAdamW`], AdamW over the flat buffers of
//!   [`crate::distributed::ParamAndGradBuffer`] with fp32 master weights and moments, one fused
//!   kernel per step on CubeCL backends ([`crate::ops::adamw`]: the step's math, its plain
//!   Burn composition and the kernel's wiring), with the clip coefficient, the loss scale and the overflow skip read on the
//!   device.
//!
//! - [`flat_limit`]: the 32-bit limit of a flat tensor on GPUs, and the cut of a flat buffer's
//!   parameters into groups below it.
//! - [`flat_parts`]: a rank's dense parameters, or its routed experts, in flat buffers cut
//!   into parts below that limit, each with its own AdamW state: what
//!   [`DistributedAdamW`] steps.
//!
//! Data parallelism (gradient reduction over DP) and the distributed optimizer (ZeRO-1) are
//! in [`crate::distributed`].

pub mod clip;
pub mod distrib_optimizer;
pub mod flat_adamw;
pub mod flat_limit;
pub mod flat_parts;
mod grads;
pub mod loss_scaler;
pub mod lr_schedule;
pub mod param_groups;
mod shared_leaves;
pub mod state;

pub use clip::{
    CLIP_EPSILON, GradClipConfig, clip_coefficient, clip_grad_norm, clip_grads_by_norm,
    global_grad_norm, local_grad_sum_of_squares, shared_copies,
};
pub use distrib_optimizer::{
    DistributedAdamW, DistributedAdamWConfig, DistributedStep, OptimizerMemory,
};
pub use flat_adamw::{FLAT_ADAMW, FlatAdamW, FlatAdamWConfig, StepScalars};
pub use flat_limit::MAX_FLAT_NUMEL;
pub(crate) use flat_limit::check_indexable;
pub use flat_parts::{DistributedAdamWState, PartOptimizerState};
pub use grads::merge_chunk_grads;
pub use loss_scaler::{DynamicLossScaler, FoundInf, LossScalerConfig, LossScalerState};
pub use lr_schedule::{LrDecayStyle, LrSchedule, LrScheduleConfig, WsdDecayStyle};
pub use param_groups::{ParamGroups, ParamKind, WeightDecayPolicy};
