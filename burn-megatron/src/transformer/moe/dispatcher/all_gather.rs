//! The all-gather dispatcher (`--moe-token-dispatcher-type allgather`, Megatron's
//! `MoEAllGatherTokenDispatcher`): every rank of the expert-parallel group sees all of the
//! group's tokens, runs its experts on those routed to them, and a reduce-scatter brings each
//! token's output, summed over the ranks of its experts, back to the token's rank.
//!
//! 1. **Plan.** From the all-gathered counts every rank knows where each rank's block for
//!    each expert sits in the expert-major buffer of the expert's rank (by local expert, then
//!    by source rank, as the all-to-all dispatcher lays it out). Each rank writes, for each of
//!    its kept assignments, that rank and row (for a dropped one, no rank), and the group
//!    all-gathers them: the routing, `[owner, row]` a copy, in F32 (exact below 2²⁴, checked).
//!    Each rank decides its own drops before, as with the all-to-all dispatcher.
//! 2. **Dispatch.** The tokens, each rank's padded with zero rows to the group's largest
//!    count, are all-gathered ([`gather_from_sequence_parallel_region`], whose gradient is a
//!    reduce-scatter: a token's gradient is summed over the ranks whose experts read it), and
//!    each rank picks its experts' rows.
//! 3. **Combine.** The router weights are all-gathered the same way. Each rank weights its
//!    experts' outputs and sums them over each of the group's tokens' experts (the other
//!    ranks' experts give zero rows), `[ep · rows, hidden]`; a reduce-scatter
//!    ([`reduce_scatter_to_sequence_parallel_region`], gradient an all-gather) sums that over
//!    the ranks and leaves each rank its own tokens.
//!
//! The row moves are gathers whose gradient is a gather through the inverse index
//! ([`permute_rows`], [`unpermute_rows`] with the weights): each expert-major row's gathered
//! copy, from the inverse of the copies' rows ([`PermuteOps::invert_rows`]), with the padding
//! rows (host-known) zero. Where a rank pads its experts' blocks to one size
//! ([`BlockPadding`](super::BlockPadding)), every rank knows it from the counts and writes
//! its copies' rows in the padded blocks: the padding costs no gather of its own.
//!
//! Collectives, whatever the routing: forward the counts' all-gather, the routing's, the
//! tokens', the weights' and one reduce-scatter; backward one all-gather and two
//! reduce-scatters. Every rank holds `ep` times the largest rank's tokens, and the combine
//! `ep · top_k` times (one row a copy): for small EP groups.

use burn::tensor::{Bool, DType, FloatDType, Tensor, TensorData, backend::Backend};
use burn_megatron_dist::mapping::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use burn_megatron_dist::{DistBackend, DistError, DistResult, ProcessGroup};

use super::{DispatchPlan, Sorted, TokenDispatcher};
use crate::ops::{PermuteOps, RowIndex, permute_rows, unpermute_rows};

/// Integers F32 holds exactly: `0..2²⁴`.
const F32_EXACT: usize = 1 << 24;

/// The all-gather dispatcher's part of a [`DispatchPlan`].
#[derive(Debug, Clone)]
pub struct AllGatherPlan<B: Backend> {
    /// Rows each rank contributes to the all-gathers: the group's largest number of tokens
    /// (a rank with fewer pads with zero rows).
    pub rows_per_rank: usize,
    /// `[Σ blocks]` ([`DispatchPlan::expert_blocks`]): the gathered token (row of the
    /// `[ep · rows_per_rank, hidden]` all-gather) of each expert-major row; zero for a
    /// padding row and the zero row.
    to_experts: RowIndex<B>,
    /// `[Σ blocks]`: the gathered copy (`token · top_k + j`) of each expert-major row,
    /// zero where [`to_experts`](Self::to_experts) is.
    expert_assignments: RowIndex<B>,
    /// `[ep · rows_per_rank · top_k]`: for each of the group's copies (by rank, then
    /// token-major), its expert-major row if its expert is this rank's and it is kept, else
    /// zero. Each gathered token's `top_k` rows are the inverse of `to_experts`.
    from_experts: RowIndex<B>,
}

/// The rows of the exchange: each of this rank's kept assignments' row in its expert's rank's
/// buffer, all-gathered over the group.
///
/// `padded_rows[q]`: the rows of every block of EP rank `q`'s experts where that rank pads
/// them to one size ([`DispatchPlan::padded_rows`] of each rank, which every rank knows from
/// the counts), `None` where its blocks are the counts.
pub(super) fn plan<B: DistBackend + PermuteOps>(
    dispatcher: &TokenDispatcher,
    sorted: Sorted<B>,
    padded_rows: &[Option<usize>],
) -> DistResult<AllGatherPlan<B>> {
    let group = &dispatcher.ep;
    let (ep, rank) = (group.size(), group.rank());
    let (e_all, e_local) = (dispatcher.num_experts, dispatcher.num_local_experts());
    let (counts_of, kept_of) = (&sorted.counts_of, &sorted.kept_of);
    let (num_tokens, top_k) = (sorted.num_tokens, sorted.top_k);
    let device = sorted.experts.device();
    // Rows of expert e's blocks, from every rank, in its rank's buffer, and the rows of its
    // block there (padded, or those rows and, for a rank's last expert, the zero row).
    let rows_of_expert = |e: usize| (0..ep).map(|r| counts_of[r][e]).sum::<usize>();
    let block_of_expert = |e: usize| match padded_rows[e / e_local] {
        Some(rows) => rows,
        None => rows_of_expert(e) + usize::from(e % e_local == e_local - 1),
    };
    let buffer_of: Vec<usize> = (0..ep)
        .map(|q| (q * e_local..(q + 1) * e_local).map(block_of_expert).sum())
        .collect();
    if let Some(q) = buffer_of.iter().position(|&n| n >= F32_EXACT) {
        return Err(DistError::InvalidArgument(format!(
            "rank {}: the all-gather MoE dispatcher on group '{}' sends its row indices as \
             F32, exact below 2^24 = {F32_EXACT}, but EP rank {q}'s experts would receive {} \
             rows: use --moe-token-dispatcher-type alltoall, or fewer tokens a micro-batch",
            group.global_rank(),
            group.name(),
            buffer_of[q]
        )));
    }
    let rows_per_rank = sorted.tokens_of.iter().copied().max().unwrap_or(num_tokens);
    // Where this rank's rows for expert e start in the buffer of e's rank: after the blocks
    // of that rank's experts before e, then after the rows of the ranks before this one.
    let offset: Vec<usize> = (0..e_all)
        .map(|e| {
            let first = e / e_local * e_local;
            (first..e).map(block_of_expert).sum::<usize>()
                + (0..rank).map(|r| counts_of[r][e]).sum::<usize>()
        })
        .collect();
    let row = sorted.rows(&offset);
    let mut owner = sorted
        .experts
        .clone()
        .reshape([num_tokens * top_k])
        .div_scalar(e_local as i64);
    if let Some(dropped) = &sorted.dropped {
        owner = owner.mask_fill(dropped.clone(), ep as i64);
    }
    // Cast to F32 directly, not through the default float dtype (BF16 rounds rows past 256).
    let mut routing: Tensor<B, 2> = Tensor::stack::<2>(vec![owner, row], 1).cast(FloatDType::F32);
    if rows_per_rank > num_tokens {
        let missing = (rows_per_rank - num_tokens) * top_k;
        routing = Tensor::cat(
            vec![
                routing,
                Tensor::full([missing, 2], ep as f32, (&device, DType::F32)),
            ],
            0,
        );
    }
    let routing = group.all_gather(routing, 0)?;
    let gathered = ep * rows_per_rank * top_k;
    let buffer = buffer_of[rank];
    let not_mine = routing
        .clone()
        .narrow(1, 0, 1)
        .reshape([gathered])
        .not_equal_elem(rank as f32);
    let rows = routing.narrow(1, 1, 1).reshape([gathered]).int();
    // Copies not for this rank point past the experts' rows for the inverse (which skips
    // them), and read a zero row in the gathers.
    let assignment = B::invert_rows(
        rows.clone().mask_fill(not_mine.clone(), buffer as i64),
        buffer,
    );
    let from_experts = RowIndex::new(rows.mask_fill(not_mine.clone(), 0)).with_zero_rows(not_mine);
    // Which expert-major rows carry a copy: by local expert, then by source rank, the kept
    // ones first in each rank's rows (the rest is capacity padding), then the block's padding
    // (or the last expert's zero row).
    let mut carries = Vec::with_capacity(buffer);
    for j in 0..e_local {
        let e = rank * e_local + j;
        let start = carries.len();
        for r in 0..ep {
            carries.extend((0..counts_of[r][e]).map(|i| i < kept_of[r][e]));
        }
        carries.resize(start + block_of_expert(e), false);
    }
    debug_assert_eq!(carries.len(), buffer);
    let empty: Vec<bool> = carries.iter().map(|c| !c).collect();
    let empty = Tensor::<B, 1, Bool>::from_data(TensorData::new(empty, [buffer]), &device);
    Ok(AllGatherPlan {
        rows_per_rank,
        to_experts: RowIndex::new(assignment.clone().div_scalar(top_k as i64))
            .with_zero_rows(empty.clone()),
        expert_assignments: RowIndex::new(assignment).with_zero_rows(empty),
        from_experts,
    })
}

/// `x` (`[n, columns]`) with zero rows appended up to `rows`.
fn pad_rows<B: Backend>(x: Tensor<B, 2>, rows: usize) -> Tensor<B, 2> {
    let [n, columns] = x.dims();
    match rows > n {
        true => {
            let zeros = Tensor::zeros([rows - n, columns], (&x.device(), x.dtype()));
            Tensor::cat(vec![x, zeros], 0)
        }
        false => x,
    }
}

/// [`TokenDispatcher::dispatch`] by all-gather.
pub(super) fn dispatch<B: DistBackend + PermuteOps>(
    ep: &ProcessGroup,
    plan: &AllGatherPlan<B>,
    tokens: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    let padded = pad_rows(tokens, plan.rows_per_rank);
    let gathered = gather_from_sequence_parallel_region(padded, ep, 0, true)?;
    Ok(permute_rows(gathered, &plan.to_experts, &plan.from_experts))
}

/// [`TokenDispatcher::combine`] by reduce-scatter.
pub(super) fn combine<B: DistBackend + PermuteOps>(
    ep: &ProcessGroup,
    plan: &DispatchPlan<B>,
    rows: &AllGatherPlan<B>,
    expert_output: Tensor<B, 2>,
    weights: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    let weights = pad_rows(weights, rows.rows_per_rank);
    let weights = gather_from_sequence_parallel_region(weights, ep, 0, true)?;
    let partial = unpermute_rows(
        expert_output,
        &rows.from_experts,
        &rows.expert_assignments,
        weights,
    );
    let mine = reduce_scatter_to_sequence_parallel_region(partial, ep, 0)?;
    Ok(mine.narrow(0, 0, plan.num_tokens))
}
