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
//! Collectives, whatever the routing: forward the counts' all-gather, the routing's, the
//! tokens', the weights' and one reduce-scatter; backward one all-gather and two
//! reduce-scatters. Every rank holds `ep` times the largest rank's tokens, and the combine
//! `ep · top_k` times (one row a copy): for small EP groups.

use burn::tensor::{DType, FloatDType, IndexingUpdateOp, Int, Tensor, backend::Backend};
use burn_megatron_dist::mapping::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use burn_megatron_dist::{DistBackend, DistError, DistResult, ProcessGroup};

use super::{DispatchPlan, Sorted, TokenDispatcher, int_tensor};
use crate::ops::EmbeddingOps;
use crate::ops::embedding::gather_rows_or_zero;

/// Integers F32 holds exactly: `0..2²⁴`.
const F32_EXACT: usize = 1 << 24;

/// The all-gather dispatcher's part of a [`DispatchPlan`].
#[derive(Debug, Clone)]
pub struct AllGatherPlan<B: Backend> {
    /// Rows each rank contributes to the all-gathers: the group's largest number of tokens
    /// (a rank with fewer pads with zero rows).
    pub rows_per_rank: usize,
    /// `[received + 1]`, device: the gathered token (row of the `[ep · rows_per_rank,
    /// hidden]` all-gather) of each expert-major row; `ep · rows_per_rank` (past the gathered
    /// tokens: a zero row) for a padding row and for the last row.
    expert_rows: Tensor<B, 1, Int>,
    /// `[ep · rows_per_rank · top_k]`, device: for each of the group's assignments (by rank,
    /// then token-major), its expert-major row if its expert is this rank's and it is kept,
    /// else `received + 1` (past the experts' output: a zero row).
    combine_rows: Tensor<B, 1, Int>,
}

/// The rows of the exchange: each of this rank's kept assignments' row in its expert's rank's
/// buffer, all-gathered over the group.
pub(super) fn plan<B: DistBackend>(
    dispatcher: &TokenDispatcher,
    sorted: Sorted<B>,
    local_counts: &[usize],
) -> DistResult<AllGatherPlan<B>> {
    let group = &dispatcher.ep;
    let (ep, rank) = (group.size(), group.rank());
    let (e_all, e_local) = (dispatcher.num_experts, dispatcher.num_local_experts());
    let Sorted {
        num_tokens,
        top_k,
        counts_of,
        tokens_of,
        experts,
        place,
        kept,
    } = sorted;
    let device = experts.device();
    // Rows of expert e's blocks, from every rank, in its rank's buffer.
    let rows_of_expert = |e: usize| (0..ep).map(|r| counts_of[r][e]).sum::<usize>();
    let received_of: Vec<usize> = (0..ep)
        .map(|q| (q * e_local..(q + 1) * e_local).map(rows_of_expert).sum())
        .collect();
    if let Some(q) = received_of.iter().position(|&n| n + 1 >= F32_EXACT) {
        return Err(DistError::InvalidArgument(format!(
            "rank {}: the all-gather MoE dispatcher on group '{}' sends its row indices as \
             F32, exact below 2^24 = {F32_EXACT}, but EP rank {q}'s experts would receive {} \
             rows: use --moe-token-dispatcher-type alltoall, or fewer tokens a micro-batch",
            group.global_rank(),
            group.name(),
            received_of[q]
        )));
    }
    let rows_per_rank = tokens_of.iter().copied().max().unwrap_or(num_tokens);
    // Where this rank's block for expert e starts in the buffer of e's rank: after the blocks
    // of that rank's experts before e, then after the blocks of the ranks before this one.
    let offset: Vec<usize> = (0..e_all)
        .map(|e| {
            let first = e / e_local * e_local;
            (first..e).map(rows_of_expert).sum::<usize>()
                + (0..rank).map(|r| counts_of[r][e]).sum::<usize>()
        })
        .collect();
    let row = place + int_tensor(&offset, &device).select(0, experts.clone());
    let mut owner = experts.div_scalar(e_local as i64);
    if let Some(kept) = kept {
        owner = owner.mask_fill(kept.bool_not(), ep as i64);
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
    let received: usize = local_counts.iter().sum();
    let owner = routing.clone().narrow(1, 0, 1).reshape([gathered]);
    let combine_rows = routing
        .narrow(1, 1, 1)
        .reshape([gathered])
        .int()
        .mask_fill(owner.not_equal_elem(rank as f32), (received + 1) as i64);
    // Each expert-major row reads the gathered token of the copy that lands there; copies not
    // for this rank land in row `received + 1`, cut off.
    let tokens = (ep * rows_per_rank) as i64;
    let token_of = Tensor::<B, 1, Int>::arange(0..gathered as i64, &device)
        .div_scalar(top_k as i64)
        .sub_scalar(tokens);
    let expert_rows = Tensor::<B, 1, Int>::full([received + 2], tokens, &device)
        .scatter(0, combine_rows.clone(), token_of, IndexingUpdateOp::Add)
        .narrow(0, 0, received + 1);
    Ok(AllGatherPlan {
        rows_per_rank,
        expert_rows,
        combine_rows,
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
pub(super) fn dispatch<B: DistBackend + EmbeddingOps>(
    ep: &ProcessGroup,
    plan: &AllGatherPlan<B>,
    tokens: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    let padded = pad_rows(tokens, plan.rows_per_rank);
    let gathered = gather_from_sequence_parallel_region(padded, ep, 0, true)?;
    Ok(gather_rows_or_zero(gathered, plan.expert_rows.clone()))
}

/// [`TokenDispatcher::combine`] by reduce-scatter.
pub(super) fn combine<B: DistBackend + EmbeddingOps>(
    ep: &ProcessGroup,
    plan: &DispatchPlan<B>,
    rows: &AllGatherPlan<B>,
    expert_output: Tensor<B, 2>,
    weights: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    let hidden = expert_output.dims()[1];
    let tokens = ep.size() * rows.rows_per_rank;
    let weights = pad_rows(weights, rows.rows_per_rank);
    let weights = gather_from_sequence_parallel_region(weights, ep, 0, true)?;
    let per_assignment = gather_rows_or_zero(expert_output, rows.combine_rows.clone())
        .reshape([tokens, plan.top_k, hidden]);
    let partial = (per_assignment * weights.unsqueeze_dim::<3>(2))
        .sum_dim(1)
        .reshape([tokens, hidden]);
    let mine = reduce_scatter_to_sequence_parallel_region(partial, ep, 0)?;
    Ok(mine.narrow(0, 0, plan.num_tokens))
}
