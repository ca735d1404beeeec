//! Data-parallel gradient reduction over the flat fp32 gradient buffer: Megatron's
//! `DistributedDataParallel` with its `_ParamAndGradBucketGroup`s
//! (`megatron/core/distributed/`), run after the backward pass.
//!
//! Every DP rank computes the gradient of the mean loss of its own microbatches; the mean of
//! those over the DP group is the gradient of the global batch's mean loss, which is what one
//! device would compute on the whole batch. The reduction works bucket by bucket, each bucket a
//! range of the flat buffer of about [`DataParallelConfig::bucket_numel`] elements, so that no
//! collective needs a second copy of the whole buffer:
//!
//! - without the distributed optimizer every rank needs every averaged gradient: each bucket
//!   (a [`BufferLayout::buckets`] range, ending on a parameter boundary) is **all-reduced**
//!   ([`all_reduce_grads`]);
//! - with it (ZeRO-1) each rank needs only the gradients of the shard it updates
//!   ([`BufferLayout::shard`]): each bucket is **reduce-scattered** ([`reduce_scatter_grads`]),
//!   half the traffic of an all-reduce.
//!
//! Our shards are contiguous over the whole buffer (rank `r` owns `shard(r)`), where Megatron
//! cuts each bucket into `dp` pieces and a rank's shard is the union of its piece of every
//! bucket. So a reduce-scatter bucket here is the same column range `[a, b)` of every rank's
//! shard: the buffer seen as `[dp, numel / dp]`, a bucket is the `[dp, b - a]` block of
//! columns `a..b`, and reduce-scattering it along the first dimension gives rank `r` the sum
//! of columns `a..b` of its shard. The traffic equals one reduce-scatter of the whole buffer.
//!
//! # Gradient accumulation
//! The reduction runs once per global step, on the gradient the schedule accumulated over the
//! step's microbatches: only the last microbatch communicates, by construction.
//!
//! # Overlap with backward
//! These functions run after the backward pass. [`overlap`](super::overlap) starts the same
//! collectives on the same ranges from inside it, as each bucket's gradients become final
//! ([`DistributedAdamW::overlap_hook`](crate::optimizer::DistributedAdamW::overlap_hook)), with the same
//! result bit for bit.

use std::ops::Range;

use burn::config::Config;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_megatron_dist::{DistBackend, ProcessGroup, ReduceOp};

use super::BufferLayout;
use crate::error::ConfigError;

/// How gradients are reduced over the data-parallel group, and whether the optimizer state
/// is sharded over it (`--use-distributed-optimizer`).
#[derive(Config, Debug, Copy, PartialEq)]
pub struct DataParallelConfig {
    /// Elements per gradient bucket (Megatron's `bucket_size`, 40M by default): smaller
    /// buckets need smaller collective buffers, larger ones fewer launches.
    #[config(default = 40_000_000)]
    pub bucket_numel: usize,
    /// Shard the fp32 master weights and the AdamW moments over the DP group (ZeRO-1):
    /// gradients are reduce-scattered and the updated parameters all-gathered.
    #[config(default = false)]
    pub use_distributed_optimizer: bool,
    /// With the distributed optimizer, all-gather the updated parameters in buckets (the
    /// reduce-scatter's columns, [`param_gather_columns`](super::param_gather_columns)), issued
    /// in the order the next forward pass reads them (Megatron's `--overlap-param-gather`).
    /// With one gather of the whole buffer every parameter is a view of one tensor, and the
    /// forward's first kernel that reads a parameter waits for all of it; here a parameter
    /// inside one bucket is a view of that bucket only (one that crosses a bucket's or a
    /// shard's edge is a copy, made when the step writes it, which waits for its buckets).
    /// The same parameters, bit for bit.
    #[config(default = false)]
    pub overlap_param_gather: bool,
    /// With the reduction hooked into the backward pass
    /// ([`DistributedAdamW::overlap_hook`](crate::optimizer::DistributedAdamW::overlap_hook)),
    /// let the weight-gradient GEMMs of the dense layers and of the experts add straight
    /// into its f32 buffers
    /// (Megatron's gradient-accumulation fusion; `--no-gradient-accumulation-fusion` turns it
    /// off): no gradient in the model's dtype is written and added again. Without it each
    /// weight gradient passes through Burn's gradient container first.
    #[config(default = true)]
    pub gradient_accumulation_fusion: bool,
}

impl DataParallelConfig {
    /// Checks that buckets hold at least one element and that the parameter gather is
    /// overlapped only where there is one (with the distributed optimizer).
    pub fn validate(&self) -> core::result::Result<(), ConfigError> {
        if self.bucket_numel == 0 {
            return Err(ConfigError::Invalid(
                "the data-parallel bucket size (bucket_numel) must be at least 1 element".into(),
            ));
        }
        if self.overlap_param_gather && !self.use_distributed_optimizer {
            return Err(ConfigError::Invalid(
                "overlap_param_gather splits the distributed optimizer's parameter all-gather: \
                 set use_distributed_optimizer too (without it every rank updates every \
                 parameter and nothing is gathered)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// The DP-averaged gradients of the whole buffer (`grads`: `[numel]` f32, this rank's
/// gradients in `layout`), all-reduced bucket by bucket ([`BufferLayout::buckets`] of
/// `bucket_numel`). Every rank of `dp` must call it with the same layout.
pub fn all_reduce_grads<B: DistBackend>(
    grads: Tensor<B, 1>,
    layout: &BufferLayout,
    dp: &ProcessGroup,
    bucket_numel: usize,
) -> crate::Result<Tensor<B, 1>> {
    check_len(&grads, layout)?;
    if dp.size() == 1 {
        return Ok(grads);
    }
    let mut grads = grads;
    for bucket in layout.buckets(bucket_numel) {
        let reduced = dp.all_reduce(grads.clone().slice(bucket.clone()), ReduceOp::Avg)?;
        grads = grads.slice_assign(bucket, reduced);
    }
    Ok(grads)
}

/// This rank's shard (`layout.shard(dp.rank())`, `[numel / dp]`) of the DP-averaged
/// gradients `grads` (`[numel]` f32), reduce-scattered in buckets of the same columns of
/// every shard, about `bucket_numel` elements each (see the [module docs](self)). Every rank
/// of `dp` must call it with the same layout, whose `dp_size` must be `dp`'s size.
pub fn reduce_scatter_grads<B: DistBackend>(
    grads: Tensor<B, 1>,
    layout: &BufferLayout,
    dp: &ProcessGroup,
    bucket_numel: usize,
) -> crate::Result<Tensor<B, 1>> {
    check_len(&grads, layout)?;
    check_dp(layout, dp)?;
    let size = dp.size();
    if size == 1 {
        return Ok(grads);
    }
    let shard = layout.numel() / size;
    let columns = grads.reshape([size, shard]);
    let mut pieces = Vec::new();
    for range in shard_columns(shard, size, bucket_numel) {
        let block = columns.clone().slice([0..size, range]);
        pieces.push(dp.reduce_scatter(block, 0, ReduceOp::Avg)?);
    }
    Ok(Tensor::cat(pieces, 1).reshape([shard]))
}

/// Ranges of the `shard` columns of the `[dp, shard]` view, each about `bucket_numel / dp`
/// columns (at least one).
pub fn shard_columns(shard: usize, dp: usize, bucket_numel: usize) -> Vec<Range<usize>> {
    let width = bucket_numel.div_ceil(dp).max(1);
    (0..shard)
        .step_by(width)
        .map(|start| start..(start + width).min(shard))
        .collect()
}

/// Checks that `layout` was cut into `dp`'s size shards.
pub(crate) fn check_dp(layout: &BufferLayout, dp: &ProcessGroup) -> crate::Result<()> {
    if layout.config().dp_size != dp.size() {
        return Err(ConfigError::Invalid(format!(
            "the flat buffer was cut into {} shards but the data-parallel group has {} ranks: \
             set BufferConfig::dp_size to the DP size",
            layout.config().dp_size,
            dp.size()
        ))
        .into());
    }
    Ok(())
}

fn check_len<B: Backend>(grads: &Tensor<B, 1>, layout: &BufferLayout) -> crate::Result<()> {
    if grads.dims()[0] != layout.numel() {
        return Err(ConfigError::Invalid(format!(
            "a gradient buffer of {} elements for a layout of {}: pass the buffer of this layout",
            grads.dims()[0],
            layout.numel()
        ))
        .into());
    }
    Ok(())
}
