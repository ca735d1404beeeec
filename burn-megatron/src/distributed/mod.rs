//! Data-parallel training's memory layout: Megatron-Core's `distributed/` package.
//!
//! - [`param_and_grad_buffer`]: every parameter of a model chunk at an offset of one flat
//!   buffer, in reverse forward order, with fp32 master weights and an fp32 gradient buffer
//!   (Megatron's `_ParamAndGradBuffer`). The fused AdamW
//!   ([`FlatAdamW`](crate::optimizer::FlatAdamW)) steps these buffers in one kernel; data-parallel
//!   buckets ([`BufferLayout::buckets`]) and the distributed optimizer's shards
//!   ([`BufferLayout::shard`]) are ranges of them.
//!
//! Gradient reduction over DP and the distributed optimizer are not written yet.

pub mod param_and_grad_buffer;

pub use param_and_grad_buffer::{BufferConfig, BufferLayout, ParamAndGradBuffer, ParamSlot};
