//! The all-to-all dispatcher (`--moe-token-dispatcher-type alltoall`, Megatron's
//! `MoEAlltoAllTokenDispatcher`): every rank sends each rank the rows of that rank's experts,
//! in one differentiable all-to-all of blocks of different sizes ([`all_to_all_v`]), every
//! block's size known to both ends from the all-gathered counts. A block has at least one row
//! (a zero row when it carries no token), so that no buffer is ever empty. The receiver orders
//! the rows by expert; the way back is the same in reverse.
//!
//! Collectives, whatever the routing: forward one all-to-all each way (after the plan's
//! all-gather of the counts), backward the same two with the sizes swapped.

use burn::tensor::{IndexingUpdateOp, Int, Tensor, backend::Backend};
use burn_megatron_dist::mapping::all_to_all_v;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use super::{DispatchPlan, Sorted, TokenDispatcher, int_tensor};
use crate::ops::EmbeddingOps;
use crate::ops::embedding::gather_rows_or_zero;

/// The all-to-all dispatcher's part of a [`DispatchPlan`].
#[derive(Debug, Clone)]
pub struct AllToAllPlan<B: Backend> {
    /// Rows this rank sends each rank in the all-to-all (at least 1 a rank).
    pub send_splits: Vec<usize>,
    /// Rows this rank receives from each rank (at least 1 a rank).
    pub recv_splits: Vec<usize>,
    /// `[Σ send_splits]`, device: the input row (or `num_tokens`, past the input: a zero
    /// row) of each send row.
    send_rows: Tensor<B, 1, Int>,
    /// `[received + 1]`: the received row (or `Σ recv_splits`, past the received buffer: a
    /// zero row) of each expert-major row, the last being a zero row.
    expert_rows: Vec<usize>,
    /// `[Σ recv_splits]`: the expert-major row whose output goes back in each row of the
    /// return buffer, or `received + 1` (past the experts' output: a zero row) for a block's
    /// filler row.
    return_rows: Vec<usize>,
    /// `[num_tokens · top_k]`, device: for each assignment (token-major), its row in the
    /// send buffer and in the buffer that comes back; `Σ send_splits` (past the buffer that
    /// comes back: a zero row) for a dropped one.
    combine_rows: Tensor<B, 1, Int>,
}

/// The blocks and row indices of the exchange, from the counts and this rank's sorted
/// assignments.
pub(super) fn plan<B: DistBackend>(
    dispatcher: &TokenDispatcher,
    sorted: Sorted<B>,
) -> AllToAllPlan<B> {
    let (ep, rank) = (dispatcher.ep.size(), dispatcher.ep.rank());
    let e_local = dispatcher.num_local_experts();
    let e_all = dispatcher.num_experts;
    let Sorted {
        num_tokens,
        top_k,
        counts_of,
        experts,
        place,
        kept,
        ..
    } = sorted;
    let device = experts.device();
    let counts = &counts_of[rank];
    // Rows rank s sends rank q: its assignments to q's experts, at least one row.
    let block = |s: usize, q: usize| -> usize {
        counts_of[s][q * e_local..(q + 1) * e_local]
            .iter()
            .sum::<usize>()
            .max(1)
    };
    let send_splits: Vec<usize> = (0..ep).map(|q| block(rank, q)).collect();
    let recv_splits: Vec<usize> = (0..ep).map(|r| block(r, rank)).collect();
    let starts = |splits: &[usize]| -> Vec<usize> {
        splits
            .iter()
            .scan(0, |start, &rows| {
                *start += rows;
                Some(*start - rows)
            })
            .collect()
    };
    let (send_start, recv_start) = (starts(&send_splits), starts(&recv_splits));
    let (sent, arriving) = (
        send_splits.iter().sum::<usize>(),
        recv_splits.iter().sum::<usize>(),
    );

    // The send side, on the device. Assignment a to expert e, the i-th of this rank's
    // assignments to e that it keeps, goes in row `first[e] + i` of the send buffer: its
    // destination's block, after the rows of that rank's experts before e. A dropped one
    // goes to row `sent`, past the buffer: cut off before sending, the zero row coming
    // back.
    let first: Vec<usize> = (0..e_all)
        .map(|e| {
            let q = e / e_local;
            send_start[q] + counts[q * e_local..e].iter().sum::<usize>()
        })
        .collect();
    let assignments = num_tokens * top_k;
    let mut combine_rows = place + int_tensor(&first, &device).select(0, experts);
    if let Some(kept) = kept {
        combine_rows = combine_rows.mask_fill(kept.bool_not(), sent as i64);
    }
    let token_of = Tensor::<B, 1, Int>::arange(0..assignments as i64, &device)
        .div_scalar(top_k as i64)
        .sub_scalar(num_tokens as i64);
    let send_rows = Tensor::<B, 1, Int>::full([sent + 1], num_tokens as i64, &device)
        .scatter(0, combine_rows.clone(), token_of, IndexingUpdateOp::Add)
        .narrow(0, 0, sent);

    // The receive side: block r holds rank r's tokens for this rank's experts, by local
    // expert; the experts want them by expert, then by source rank.
    let mine = |r: usize, j: usize| counts_of[r][rank * e_local + j];
    let received: usize = (0..e_local)
        .map(|j| (0..ep).map(|r| mine(r, j)).sum::<usize>())
        .sum();
    let mut expert_rows = Vec::with_capacity(received + 1);
    let mut return_rows = vec![received + 1; arriving];
    for j in 0..e_local {
        for (r, &block_start) in recv_start.iter().enumerate() {
            let start = block_start + (0..j).map(|j2| mine(r, j2)).sum::<usize>();
            let rows = start..start + mine(r, j);
            for (row, back) in rows.clone().zip(&mut return_rows[rows]) {
                *back = expert_rows.len();
                expert_rows.push(row);
            }
        }
    }
    expert_rows.push(arriving);
    AllToAllPlan {
        send_splits,
        recv_splits,
        send_rows,
        expert_rows,
        return_rows,
        combine_rows,
    }
}

/// [`TokenDispatcher::dispatch`] by all-to-all.
pub(super) fn dispatch<B: DistBackend + EmbeddingOps>(
    ep: &ProcessGroup,
    plan: &AllToAllPlan<B>,
    tokens: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    let device = tokens.device();
    let send = gather_rows_or_zero(tokens, plan.send_rows.clone());
    let received = all_to_all_v(send, ep, &plan.send_splits, &plan.recv_splits)?;
    Ok(gather_rows_or_zero(
        received,
        int_tensor(&plan.expert_rows, &device),
    ))
}

/// [`TokenDispatcher::combine`] by all-to-all.
pub(super) fn combine<B: DistBackend + EmbeddingOps>(
    ep: &ProcessGroup,
    plan: &DispatchPlan<B>,
    rows: &AllToAllPlan<B>,
    expert_output: Tensor<B, 2>,
    weights: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    let device = expert_output.device();
    let hidden = expert_output.dims()[1];
    let back = gather_rows_or_zero(expert_output, int_tensor(&rows.return_rows, &device));
    let back = all_to_all_v(back, ep, &rows.recv_splits, &rows.send_splits)?;
    let per_assignment = gather_rows_or_zero(back, rows.combine_rows.clone()).reshape([
        plan.num_tokens,
        plan.top_k,
        hidden,
    ]);
    let weighted = per_assignment * weights.unsqueeze_dim::<3>(2);
    Ok(weighted.sum_dim(1).reshape([plan.num_tokens, hidden]))
}
