//! Data-parallel training: Megatron-Core's `distributed/` package.
//!
//! - [`param_and_grad_buffer`]: every parameter of a model chunk at an offset of one flat
//!   buffer, in reverse forward order, with fp32 master weights and an fp32 gradient buffer
//!   (Megatron's `_ParamAndGradBuffer`). The fused AdamW
//!   ([`FlatAdamW`](crate::optimizer::FlatAdamW)) steps these buffers in one kernel; data-parallel
//!   buckets ([`BufferLayout::buckets`]) and the distributed optimizer's shards
//!   ([`BufferLayout::shard`]) are ranges of them.
//! - [`grad_reduction`]: the gradients averaged over the DP group after the backward pass,
//!   bucket by bucket: all-reduced, or reduce-scattered for the distributed optimizer.
//!
//! The distributed optimizer that steps on these buffers (ZeRO-1) is
//! [`DistributedAdamW`](crate::optimizer::DistributedAdamW), in [`crate::optimizer`].
//! - [`overlap`]: the same reduction started inside the backward pass, bucket by bucket as
//!   the layers' gradients become final ([`DistributedAdamW::overlap_hook`](crate::optimizer::DistributedAdamW::overlap_hook)).
//! - [`param_gather`]: the distributed optimizer's parameter all-gather in buckets, in the
//!   order the next forward pass needs them (`--overlap-param-gather`).

pub mod grad_reduction;
pub mod overlap;
pub mod param_and_grad_buffer;
pub mod param_gather;

pub use grad_reduction::{
    DataParallelConfig, all_reduce_grads, reduce_scatter_grads, shard_columns,
};
pub use overlap::GradReduceOverlap;
pub use param_and_grad_buffer::{BufferConfig, BufferLayout, ParamAndGradBuffer, ParamSlot};
pub use param_gather::{GatheredParams, all_gather_params, param_gather_columns};
