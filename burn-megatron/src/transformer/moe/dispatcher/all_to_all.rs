//! The all-to-all dispatcher (`--moe-token-dispatcher-type alltoall`, Megatron's
//! `MoEAlltoAllTokenDispatcher`): every rank sends each rank the rows of that rank's experts,
//! in one differentiable all-to-all of blocks of different sizes ([`all_to_all_v`]), every
//! block's size known to both ends from the all-gathered counts. A block has at least one row
//! (a zero row when it carries no token), so that no buffer is ever empty. The receiver orders
//! the rows by expert; the way back is the same in reverse.
//!
//! Each of the four row moves (the tokens into the send buffer, the received rows into the
//! experts' blocks, and back twice, the last weighted and summed over each token's experts)
//! is one gather whose gradient is a gather through the inverse index ([`permute_rows`],
//! [`unpermute_rows`]): the plan builds each index and its inverse once. The send side's come
//! from the routing on the device (each assignment's send row, and the inverse,
//! [`PermuteOps::invert_rows`]); the receive side's from the counts on the host. The
//! experts' blocks may be padded to one size ([`BlockPadding`]): the receive side's gathers
//! leave the padding rows zero, at no cost of their own. On a group of one rank the send
//! buffer is laid out as the experts' blocks, and the exchange and the receive side's
//! gathers are skipped.
//!
//! Collectives, whatever the routing: forward one all-to-all each way (after the plan's
//! all-gather of the counts), backward the same two with the sizes swapped.
//!
//! [`BlockPadding`]: super::BlockPadding

use burn::tensor::{Bool, Tensor, TensorData, backend::Backend};
use burn_megatron_dist::mapping::all_to_all_v;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use super::{DispatchPlan, Sorted, TokenDispatcher};
use crate::ops::{PermuteOps, RowIndex, permute_rows, unpermute_rows};

/// The all-to-all dispatcher's part of a [`DispatchPlan`].
#[derive(Debug, Clone)]
pub struct AllToAllPlan<B: Backend> {
    /// Rows this rank sends each rank in the all-to-all (at least 1 a rank; on a group of
    /// one rank, the experts' blocks).
    pub send_splits: Vec<usize>,
    /// Rows this rank receives from each rank (at least 1 a rank; on a group of one rank,
    /// the experts' blocks).
    pub recv_splits: Vec<usize>,
    /// `[Σ send_splits]`: the token of each send row; zero for a block's filler row and a
    /// padding row.
    to_send: RowIndex<B>,
    /// `[Σ send_splits]`: the assignment (token-major, `t · top_k + j`) of each send row, zero
    /// where [`to_send`](Self::to_send) is.
    send_assignments: RowIndex<B>,
    /// `[num_tokens · top_k]`: each assignment's row in the send buffer and in the buffer that
    /// comes back; zero for a dropped one. Token `t`'s `top_k` rows are the inverse of
    /// `to_send`.
    from_send: RowIndex<B>,
    /// The received rows' moves into the experts' blocks and back; `None` on a group of one
    /// rank, whose send buffer is the experts' blocks.
    receive: Option<Receive<B>>,
}

/// The receive side of an [`AllToAllPlan`].
#[derive(Debug, Clone)]
struct Receive<B: Backend> {
    /// `[Σ blocks]`: the received row of each row of the experts' blocks; zero for a padding
    /// row.
    to_experts: RowIndex<B>,
    /// `[Σ recv_splits]`: the experts' row of each received row (and of each row of the
    /// return buffer); zero for a block's filler row. The inverse of `to_experts`.
    from_experts: RowIndex<B>,
}

/// The blocks and row indices of the exchange, from the counts and this rank's sorted
/// assignments; `blocks`: the rows of each local expert's block in the experts' buffer
/// ([`DispatchPlan::expert_blocks`]).
pub(super) fn plan<B: DistBackend + PermuteOps>(
    dispatcher: &TokenDispatcher,
    sorted: Sorted<B>,
    blocks: &[usize],
) -> AllToAllPlan<B> {
    let (ep, rank) = (dispatcher.ep.size(), dispatcher.ep.rank());
    let e_local = dispatcher.num_local_experts();
    let e_all = dispatcher.num_experts;
    let (counts_of, kept_of) = (&sorted.counts_of, &sorted.kept_of);
    let (num_tokens, top_k) = (sorted.num_tokens, sorted.top_k);
    let device = sorted.experts.device();
    let counts = &counts_of[rank];
    let starts = |splits: &[usize]| -> Vec<usize> {
        splits
            .iter()
            .scan(0, |start, &rows| {
                *start += rows;
                Some(*start - rows)
            })
            .collect()
    };
    let block_start = starts(blocks);
    // Rows rank s sends rank q: its assignments to q's experts, at least one row; on a group
    // of one rank, the experts' blocks.
    let block = |s: usize, q: usize| -> usize {
        counts_of[s][q * e_local..(q + 1) * e_local]
            .iter()
            .sum::<usize>()
            .max(1)
    };
    let (send_splits, recv_splits): (Vec<usize>, Vec<usize>) = match ep {
        1 => (vec![blocks.iter().sum()], vec![blocks.iter().sum()]),
        _ => (
            (0..ep).map(|q| block(rank, q)).collect(),
            (0..ep).map(|r| block(r, rank)).collect(),
        ),
    };
    let (send_start, recv_start) = (starts(&send_splits), starts(&recv_splits));
    let (sent, arriving) = (
        send_splits.iter().sum::<usize>(),
        recv_splits.iter().sum::<usize>(),
    );

    // The send side, on the device. Assignment a to expert e, the i-th of this rank's
    // assignments to e that it keeps, goes in row `first[e] + i` of the send buffer: its
    // destination's block, after the rows of that rank's experts before e. The rows past an
    // expert's kept ones (padding) and a block's filler row carry no token: zero.
    let first: Vec<usize> = match ep {
        1 => block_start.clone(),
        _ => (0..e_all)
            .map(|e| {
                let q = e / e_local;
                send_start[q] + counts[q * e_local..e].iter().sum::<usize>()
            })
            .collect(),
    };
    let mut carries = vec![false; sent];
    for e in 0..e_all {
        carries[first[e]..first[e] + kept_of[rank][e]].fill(true);
    }
    let empty: Vec<bool> = carries.iter().map(|c| !c).collect();
    let empty = empty
        .contains(&true)
        .then(|| Tensor::<B, 1, Bool>::from_data(TensorData::new(empty, [sent]), &device));
    let rows = sorted.rows(&first);
    // A dropped assignment points past the send buffer for the inverse (which skips it), and
    // reads a zero row in the gathers.
    let (targets, from_send) = match &sorted.dropped {
        None => (rows.clone(), RowIndex::new(rows)),
        Some(dropped) => (
            rows.clone().mask_fill(dropped.clone(), sent as i64),
            RowIndex::new(rows.mask_fill(dropped.clone(), 0)).with_zero_rows(dropped.clone()),
        ),
    };
    let assignment = B::invert_rows(targets, sent);
    let zero = |index: RowIndex<B>| match &empty {
        Some(empty) => index.with_zero_rows(empty.clone()),
        None => index,
    };
    let to_send = zero(RowIndex::new(assignment.clone().div_scalar(top_k as i64)));
    let send_assignments = zero(RowIndex::new(assignment));
    debug_assert_eq!(from_send.len(), num_tokens * top_k);

    // The receive side: block r holds rank r's tokens for this rank's experts, by local
    // expert; the experts want them by expert, then by source rank, each expert's block
    // starting at `block_start[j]` (its padding rows stay zero).
    let receive = (ep > 1).then(|| {
        let mine = |r: usize, j: usize| counts_of[r][rank * e_local + j];
        let mut expert_rows = vec![None; blocks.iter().sum()];
        let mut return_rows = vec![None; arriving];
        for (j, &start_j) in block_start.iter().enumerate() {
            let mut row_j = start_j;
            for (r, &block_start) in recv_start.iter().enumerate() {
                let start = block_start + (0..j).map(|j2| mine(r, j2)).sum::<usize>();
                let rows = start..start + mine(r, j);
                for (row, back) in rows.clone().zip(&mut return_rows[rows]) {
                    *back = Some(row_j);
                    expert_rows[row_j] = Some(row);
                    row_j += 1;
                }
            }
            debug_assert!(row_j - start_j <= blocks[j], "expert {j}'s block overflows");
        }
        Receive {
            to_experts: RowIndex::from_host(&expert_rows, &device),
            from_experts: RowIndex::from_host(&return_rows, &device),
        }
    });
    AllToAllPlan {
        send_splits,
        recv_splits,
        to_send,
        send_assignments,
        from_send,
        receive,
    }
}

/// [`TokenDispatcher::dispatch`] by all-to-all.
pub(super) fn dispatch<B: DistBackend + PermuteOps>(
    ep: &ProcessGroup,
    plan: &AllToAllPlan<B>,
    tokens: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    let send = permute_rows(tokens, &plan.to_send, &plan.from_send);
    let Some(receive) = &plan.receive else {
        return Ok(send);
    };
    let received = all_to_all_v(send, ep, &plan.send_splits, &plan.recv_splits)?;
    Ok(permute_rows(
        received,
        &receive.to_experts,
        &receive.from_experts,
    ))
}

/// [`TokenDispatcher::combine`] by all-to-all.
pub(super) fn combine<B: DistBackend + PermuteOps>(
    ep: &ProcessGroup,
    plan: &DispatchPlan<B>,
    rows: &AllToAllPlan<B>,
    expert_output: Tensor<B, 2>,
    weights: Tensor<B, 2>,
) -> DistResult<Tensor<B, 2>> {
    debug_assert_eq!(weights.dims(), [plan.num_tokens, plan.top_k]);
    let back = match &rows.receive {
        Some(receive) => {
            let back = permute_rows(expert_output, &receive.from_experts, &receive.to_experts);
            all_to_all_v(back, ep, &rows.recv_splits, &rows.send_splits)?
        }
        None => expert_output,
    };
    Ok(unpermute_rows(
        back,
        &rows.from_send,
        &rows.send_assignments,
        weights,
    ))
}
