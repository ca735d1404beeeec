//! The distributed optimizer's parameter all-gather in buckets, issued in the order the next
//! forward pass needs the parameters: Megatron's `--overlap-param-gather`
//! (`DataParallelConfig::overlap_param_gather`).
//!
//! After its AdamW update each DP rank holds its shard of the new parameters
//! ([`BufferLayout::shard`]); the other ranks' shards come by all-gather. Gathered as one
//! tensor, every parameter is a view of it, so the next forward pass's first kernel that reads
//! a parameter waits for the whole gather. Here the gather is cut as the gradient
//! reduce-scatter is ([`reduce_scatter_grads`](super::reduce_scatter_grads)): the buffer seen
//! as `[dp, numel / dp]`, rank `r` owning row `r`, a bucket is a range of columns of every
//! row, one all-gather each. A parameter becomes a view of its bucket's gathered tensor, or,
//! where it crosses a bucket's edge or a shard's, the concatenation of its pieces.
//!
//! The buffer holds the parameters in the reverse of the forward order (see
//! [`param_and_grad_buffer`](super::param_and_grad_buffer)): the forward pass starts with the
//! last elements of the last row. So the buckets are issued from the last columns to the
//! first. The first `1 / dp` of the forward's parameters (the last row) then arrive bucket by
//! bucket in the order the forward reads them; the rest of them are in once the last bucket
//! is, the same as with one gather.
//!
//! With device collectives (NCCL on a side stream), a kernel that reads a view waits only for
//! its bucket's gather. The concatenations of cut parameters, though, are kernels launched on
//! the compute stream when the step writes the parameters, before the next forward pass, and
//! each waits for the buckets it reads: where one reads the last bucket issued (a parameter
//! cut at the edge of the first columns, or one crossing two shards), the forward still starts
//! only after the whole gather. A parameter wider than a bucket's columns is always cut, so
//! with large parameters most of them are copies (memory beside the gathered buckets). Not
//! measured on GPUs yet.
//!
//! The values are the same bits as one gather's: the same elements moved in other pieces.

use std::ops::Range;

use burn::tensor::Tensor;
use burn_megatron_dist::{DistBackend, ProcessGroup, Work};

use super::grad_reduction::{check_dp, shard_columns};
use super::{BufferLayout, ParamSlot};

/// The column ranges of the `[dp, numel / dp]` view that the parameter gather's buckets
/// cover, in the order they are issued: the next forward pass's, from the last columns to the
/// first. They are the gradient reduce-scatter's ([`shard_columns`], about `bucket_numel / dp`
/// columns each), widened to a multiple of the layout's `param_alignment`: every piece of a
/// gathered bucket then starts at an aligned offset, so a parameter inside one piece is a view
/// (the backend makes views only at aligned offsets), as it is of the unbucketed gather.
pub fn param_gather_columns(layout: &BufferLayout, bucket_numel: usize) -> Vec<Range<usize>> {
    let dp = layout.config().dp_size;
    let align = layout.config().param_alignment;
    let shard = layout.numel() / dp;
    let width = bucket_numel.div_ceil(dp).max(1).next_multiple_of(align);
    let mut columns = shard_columns(shard, 1, width);
    columns.reverse();
    columns
}

/// The updated parameters of every DP rank, gathered bucket by bucket
/// ([`all_gather_params`]).
#[derive(Debug, Clone)]
pub struct GatheredParams<B: DistBackend> {
    /// Elements per row (shard) of the `[dp, shard]` view.
    shard: usize,
    /// In the order issued (the last columns first): a bucket's columns and its gathered
    /// `[dp × columns]` values (row `r`'s columns at `r × columns`).
    buckets: Vec<(Range<usize>, Tensor<B, 1>)>,
}

impl<B: DistBackend> GatheredParams<B> {
    /// The number of buckets (one all-gather each).
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// The values of `slot` (`[numel]`): a view of its bucket's gathered tensor, or the
    /// concatenation of its pieces where it crosses a bucket's or a row's edge.
    pub fn param(&self, slot: &ParamSlot) -> Tensor<B, 1> {
        let range = slot.range();
        let mut pieces = Vec::new();
        for row in range.start / self.shard..range.end.div_ceil(self.shard) {
            let row_start = row * self.shard;
            let lo = range.start.max(row_start) - row_start;
            let hi = range.end.min(row_start + self.shard) - row_start;
            for (columns, values) in self.buckets.iter().rev() {
                let (a, b) = (lo.max(columns.start), hi.min(columns.end));
                if a < b {
                    let at = row * columns.len();
                    let piece = at + a - columns.start..at + b - columns.start;
                    pieces.push(values.clone().slice(piece));
                }
            }
        }
        match pieces.len() {
            1 => pieces.remove(0),
            _ => Tensor::cat(pieces, 0),
        }
    }
}

/// Every rank's shard of the updated parameters (`shard`: this rank's, `[numel / dp]`, the
/// model's dtype), all-gathered over `dp` in the buckets of [`param_gather_columns`]. All the
/// gathers are started before any is waited for, from the last bucket to the first (the
/// order of the next forward pass). Every rank of `dp` must call it with the same layout,
/// whose `dp_size` must be `dp`'s size.
pub fn all_gather_params<B: DistBackend>(
    shard: Tensor<B, 1>,
    layout: &BufferLayout,
    dp: &ProcessGroup,
    bucket_numel: usize,
) -> crate::Result<GatheredParams<B>> {
    check_dp(layout, dp)?;
    let columns = param_gather_columns(layout, bucket_numel);
    let mut started: Vec<(Range<usize>, Work<Tensor<B, 1>>)> = Vec::with_capacity(columns.len());
    for range in columns {
        let piece = shard.clone().slice(range.clone());
        started.push((range, dp.all_gather_async(piece, 0)?));
    }
    let mut buckets = Vec::with_capacity(started.len());
    for (range, work) in started {
        buckets.push((range, work.wait()?));
    }
    Ok(GatheredParams {
        shard: layout.numel() / dp.size(),
        buckets,
    })
}
