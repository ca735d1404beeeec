//! The token dispatcher: tokens sorted by expert, sent to the ranks that hold their experts,
//! and the experts' outputs brought back in the original order (Megatron's
//! `MoEAlltoAllTokenDispatcher`), dropless or with a capacity per expert
//! ([`super::capacity`]).
//!
//! Sizes vary from batch to batch and from rank to rank. So the exchange goes in two steps:
//!
//! 1. the ranks all-gather how many tokens each of them routes to each expert, and their
//!    total (a `[ep · (num_experts + 1)]` exchange read to the host, the only synchronisation
//!    with it: the tokens are sorted by expert on the device, as in Megatron's all-to-all
//!    dispatcher);
//! 2. every rank sends each rank the rows of that rank's experts, in one differentiable
//!    all-to-all of blocks of different sizes ([`all_to_all_v`]), every block's size known to
//!    both ends from the counts. A block has at least one row (a zero row when it carries no
//!    token), so that no buffer is ever empty.
//!
//! Every rank runs the same collectives in the same order whatever its tokens (one
//! all-gather forward, one all-to-all each way forward and backward), so a rank or an expert
//! that gets no tokens cannot leave another waiting. Indices past a buffer's end read a zero
//! row ([`gather_rows_or_zero`]).
//!
//! With a capacity, each rank's blocks hold the assignments its experts keep (or, padded, the
//! capacity's rows): the sizes follow from the same all-gathered counts, so a capacity adds no
//! exchange (the probs policy adds each assignment's expert and weight to the host read).

use std::ops::Range;

use burn::tensor::{
    Bool, DType, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData, backend::Backend,
};
use burn_megatron_dist::mapping::all_to_all_v;
use burn_megatron_dist::{DistBackend, DistError, DistResult, ProcessGroup};

use super::capacity::{ExpertCapacity, TokenDropPolicy, keep_by_weight};
use super::router::assignment_map;
use crate::ops::EmbeddingOps;
use crate::ops::embedding::gather_rows_or_zero;

/// Splits `num_experts` experts over the expert-parallel group and moves tokens to them.
#[derive(Debug, Clone)]
pub struct TokenDispatcher {
    ep: ProcessGroup,
    num_experts: usize,
}

/// The plan of one dispatch: row indices for every gather of the exchange, those that depend
/// on each token's experts computed on the device, the rest on the host from the counts.
///
/// Built by [`TokenDispatcher::plan`] from the routing; the same plan serves
/// [`dispatch`](TokenDispatcher::dispatch) and [`combine`](TokenDispatcher::combine).
#[derive(Debug, Clone)]
pub struct DispatchPlan<B: Backend> {
    /// Tokens of this rank.
    pub num_tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Rows this rank sends each rank in the all-to-all (at least 1 a rank).
    pub send_splits: Vec<usize>,
    /// Rows this rank receives from each rank (at least 1 a rank).
    pub recv_splits: Vec<usize>,
    /// How many of this rank's assignments each expert (of all `num_experts`) got and kept
    /// (all of them without a capacity).
    pub tokens_per_expert: Vec<usize>,
    /// Each expert's capacity on this rank, if the layer has one.
    pub capacity: Option<usize>,
    /// This rank's assignments dropped by over-full experts.
    pub dropped: usize,
    /// Tokens each local expert receives, over all ranks (the expert-major blocks).
    pub local_counts: Vec<usize>,
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

impl<B: Backend> DispatchPlan<B> {
    /// Tokens this rank's experts receive, over all ranks.
    pub fn received(&self) -> usize {
        self.local_counts.iter().sum()
    }
}

impl TokenDispatcher {
    /// A dispatcher for `num_experts` experts over `ep`, which must divide them (checked by
    /// [`MoeConfig::init`](super::MoeConfig::init)).
    pub fn new(ep: &ProcessGroup, num_experts: usize) -> Self {
        Self {
            ep: ep.clone(),
            num_experts,
        }
    }

    /// The expert-parallel group.
    pub fn ep(&self) -> &ProcessGroup {
        &self.ep
    }

    /// Experts per rank.
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.ep.size()
    }

    /// The global indices of this rank's experts.
    pub fn local_experts(&self) -> Range<usize> {
        let n = self.num_local_experts();
        self.ep.rank() * n..(self.ep.rank() + 1) * n
    }

    /// Plans the dropless exchange of `experts` (`[num_tokens, top_k]`, [`Routing::experts`])
    /// whose counts per expert are `tokens_per_expert` (`[num_experts]`), all-gathering every
    /// rank's counts and its `num_tokens · top_k`: the one read to the host
    /// (`ep · (num_experts + 1)` integers). Every rank of the group must call it. Counts that
    /// do not add up to their rank's total fail every rank's plan alike
    /// ([`DistError::InvalidArgument`]): row indices built from them would point past the
    /// buffers.
    ///
    /// The assignments are sorted by expert (so by destination, then by its local expert) on
    /// the device, stably, so that tokens keep their order within an expert: a counting sort,
    /// an assignment's place being the tokens before it with the same expert (a cumulative
    /// sum of the routing map, [`exclusive_cumsum_rows`]) after those of the experts before
    /// its own (from the counts).
    ///
    /// [`Routing::experts`]: super::Routing::experts
    pub fn plan<B: DistBackend>(
        &self,
        experts: Tensor<B, 2, Int>,
        tokens_per_expert: Tensor<B, 1, Int>,
    ) -> DistResult<DispatchPlan<B>> {
        self.plan_dropping(experts, tokens_per_expert, None)
    }

    /// [`plan`](Self::plan) with each expert limited to `capacity` (see [`super::capacity`]):
    /// every rank's capacity comes from its own number of assignments (all-gathered with the
    /// counts), the assignments kept from its counts (`min(count, capacity)` an expert), so
    /// that every rank knows every block's size without another exchange. Which assignments an
    /// over-full expert keeps is found on the device for the position policy (an assignment's
    /// place among its expert's, below the capacity); for the probs policy each assignment's
    /// expert and `weights` (`[num_tokens, top_k]`, ranked in F32) come to the host in the
    /// same read as the counts. Dropped assignments are sent nowhere and read back as a zero
    /// row.
    pub fn plan_with_capacity<B: DistBackend>(
        &self,
        experts: Tensor<B, 2, Int>,
        tokens_per_expert: Tensor<B, 1, Int>,
        weights: Tensor<B, 2>,
        capacity: &ExpertCapacity,
    ) -> DistResult<DispatchPlan<B>> {
        self.plan_dropping(experts, tokens_per_expert, Some((capacity, weights)))
    }

    fn plan_dropping<B: DistBackend>(
        &self,
        experts: Tensor<B, 2, Int>,
        tokens_per_expert: Tensor<B, 1, Int>,
        drop: Option<(&ExpertCapacity, Tensor<B, 2>)>,
    ) -> DistResult<DispatchPlan<B>> {
        let (ep, rank) = (self.ep.size(), self.ep.rank());
        let (e_all, e_local) = (self.num_experts, self.num_local_experts());
        let [num_tokens, top_k] = experts.dims();
        let device = experts.device();
        // routed_of[r][e]: assignments rank r routes to expert e. Cast to F32 directly, not
        // through the default float dtype: BF16 holds integers exactly only up to 256, and a
        // rounded count puts assignments in the wrong rows of the buffers (on a GPU, reads and
        // writes past their ends). F32 is exact up to 2^24 assignments a rank.
        let assignments = num_tokens * top_k;
        let total = TensorData::new(vec![assignments as f32], [1]);
        let local = Tensor::cat(
            vec![
                tokens_per_expert.cast(FloatDType::F32),
                Tensor::from_data(total, (&device, DType::F32)),
            ],
            0,
        );
        let all = match ep {
            1 => local,
            _ => self.ep.all_gather(local, 0)?,
        };
        let capacity = drop.as_ref().map(|(c, _)| **c);
        let by_weight = capacity.is_some_and(|c| c.drop_policy == TokenDropPolicy::Probs);
        let read = match (&drop, by_weight) {
            (Some((_, weights)), true) => Tensor::cat(
                vec![
                    all,
                    experts.clone().reshape([assignments]).cast(FloatDType::F32),
                    weights
                        .clone()
                        .detach()
                        .reshape([assignments])
                        .cast(FloatDType::F32),
                ],
                0,
            ),
            _ => all,
        };
        let error = |message: String| DistError::Device {
            rank: self.ep.global_rank(),
            group: self.ep.name().to_string(),
            what: "the expert token counts all-gathered over EP".to_string(),
            message,
        };
        let read = read.try_into_data().map_err(|e| error(e.to_string()))?;
        let read = read
            .convert::<f32>()
            .to_vec::<f32>()
            .map_err(|e| error(format!("{e:?}")))?;
        let (all, local_read) = read.split_at(ep * (e_all + 1));
        check_counts(all, ep, e_all).map_err(|detail| {
            DistError::InvalidArgument(format!(
                "rank {}: the expert token counts all-gathered over EP on group '{}': {detail}",
                self.ep.global_rank(),
                self.ep.name()
            ))
        })?;
        let routed_of: Vec<Vec<usize>> = all
            .chunks(e_all + 1)
            .map(|c| c[..e_all].iter().map(|&v| v as usize).collect())
            .collect();
        let totals: Vec<usize> = all.chunks(e_all + 1).map(|c| c[e_all] as usize).collect();
        // Each rank's capacity, the assignments it keeps and the rows of its blocks (the kept
        // ones, or the capacity's with padding), the same on every rank.
        let capacity_of: Vec<Option<usize>> = totals
            .iter()
            .map(|&t| capacity.map(|c| c.capacity(t, e_all)))
            .collect();
        let kept_of: Vec<Vec<usize>> = routed_of
            .iter()
            .zip(&capacity_of)
            .map(|(routed, cap)| {
                routed
                    .iter()
                    .map(|&n| cap.map_or(n, |c| n.min(c)))
                    .collect()
            })
            .collect();
        let counts_of: Vec<Vec<usize>> = kept_of
            .iter()
            .enumerate()
            .map(|(r, kept)| {
                let padded = capacity
                    .zip(capacity_of[r])
                    .and_then(|(c, cap)| c.padded_rows(cap, totals[r] / top_k.max(1)));
                match padded {
                    Some(rows) => vec![rows; e_all],
                    None => kept.clone(),
                }
            })
            .collect();
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
        let dropped: usize =
            routed_of[rank].iter().sum::<usize>() - kept_of[rank].iter().sum::<usize>();
        let map = assignment_map(experts.clone(), e_all);
        let (index, kept) = match (capacity, capacity_of[rank]) {
            (Some(c), Some(cap)) if dropped > 0 => match c.drop_policy {
                TokenDropPolicy::Position => {
                    let index = rank_in_expert(map);
                    let kept = index.clone().lower_elem(cap as i64);
                    (index, Some(kept))
                }
                TokenDropPolicy::Probs => {
                    let (chosen, weights) = local_read.split_at(assignments);
                    let chosen: Vec<usize> = chosen.iter().map(|&e| e as usize).collect();
                    let keep = keep_by_weight(&chosen, weights, e_all, cap);
                    let kept = Tensor::<B, 1, Bool>::from_data(
                        TensorData::new(keep, [assignments]),
                        &device,
                    );
                    let map = map * kept.clone().int().reshape([assignments, 1]);
                    (rank_in_expert(map), Some(kept))
                }
            },
            _ => (rank_in_expert(map), None),
        };
        let flat = experts.reshape([assignments]);
        let mut combine_rows = index + int_tensor(&first, &device).select(0, flat);
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
        let local_counts: Vec<usize> = (0..e_local)
            .map(|j| (0..ep).map(|r| mine(r, j)).sum())
            .collect();
        let received: usize = local_counts.iter().sum();
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
        Ok(DispatchPlan {
            num_tokens,
            top_k,
            send_splits,
            recv_splits,
            tokens_per_expert: kept_of[rank].clone(),
            capacity: capacity_of[rank],
            dropped,
            local_counts,
            send_rows,
            expert_rows,
            return_rows,
            combine_rows,
        })
    }

    /// The tokens for this rank's experts, in expert-major blocks (`plan.local_counts`), and a
    /// last row of zeros.
    ///
    /// # Shapes
    /// - tokens: `[num_tokens, hidden]`
    /// - output: `[plan.received() + 1, hidden]`
    pub fn dispatch<B: DistBackend + EmbeddingOps>(
        &self,
        plan: &DispatchPlan<B>,
        tokens: Tensor<B, 2>,
    ) -> DistResult<Tensor<B, 2>> {
        let device = tokens.device();
        let send = gather_rows_or_zero(tokens, plan.send_rows.clone());
        let received = all_to_all_v(send, &self.ep, &plan.send_splits, &plan.recv_splits)?;
        Ok(gather_rows_or_zero(
            received,
            int_tensor(&plan.expert_rows, &device),
        ))
    }

    /// The experts' outputs brought back to the ranks their tokens came from, restored to the
    /// tokens' order, weighted by the router and summed over each token's experts.
    ///
    /// # Shapes
    /// - expert_output: `[plan.received() + 1, hidden]`, expert-major as
    ///   [`dispatch`](Self::dispatch) gave the tokens; the last row is never read
    /// - weights: `[num_tokens, top_k]`
    /// - output: `[num_tokens, hidden]`
    pub fn combine<B: DistBackend + EmbeddingOps>(
        &self,
        plan: &DispatchPlan<B>,
        expert_output: Tensor<B, 2>,
        weights: Tensor<B, 2>,
    ) -> DistResult<Tensor<B, 2>> {
        let device = expert_output.device();
        let hidden = expert_output.dims()[1];
        let back = gather_rows_or_zero(expert_output, int_tensor(&plan.return_rows, &device));
        let back = all_to_all_v(back, &self.ep, &plan.recv_splits, &plan.send_splits)?;
        let per_assignment = gather_rows_or_zero(back, plan.combine_rows.clone()).reshape([
            plan.num_tokens,
            plan.top_k,
            hidden,
        ]);
        let weighted = per_assignment * weights.unsqueeze_dim::<3>(2);
        Ok(weighted.sum_dim(1).reshape([plan.num_tokens, hidden]))
    }
}

/// Checks the all-gathered counts (`[ep · (num_experts + 1)]`: each rank's counts per
/// expert, then its number of assignments) before they size the exchange: whole non-negative
/// numbers, each rank's counts adding up to its total. Every rank checks every rank's, so all
/// of them fail together.
fn check_counts(all: &[f32], ep: usize, num_experts: usize) -> Result<(), String> {
    if all.len() != ep * (num_experts + 1) {
        return Err(format!(
            "{} values, not {ep} ranks × ({num_experts} experts + 1)",
            all.len()
        ));
    }
    if let Some(v) = all.iter().find(|v| !(v.fract() == 0.0 && **v >= 0.0)) {
        return Err(format!("a count of {v}, not a whole number of tokens"));
    }
    for (rank, chunk) in all.chunks(num_experts + 1).enumerate() {
        let sum: f64 = chunk[..num_experts].iter().map(|&v| f64::from(v)).sum();
        let total = chunk[num_experts];
        if sum != f64::from(total) {
            return Err(format!(
                "EP rank {rank}'s counts per expert add up to {sum}, not to its {total} token \
                 assignments (tokens × top-k): they disagree with its routing"
            ));
        }
    }
    Ok(())
}

/// Each assignment's place among those of its expert before it: `[assignments]`, from the
/// routing map (`[assignments, num_experts]`, 0 or 1).
fn rank_in_expert<B: Backend>(map: Tensor<B, 2, Int>) -> Tensor<B, 1, Int> {
    let [assignments, _] = map.dims();
    (exclusive_cumsum_rows(map.clone()) * map)
        .sum_dim(1)
        .reshape([assignments])
}

/// The sum of the rows before each row (`out[i] = Σ_{i' < i} x[i']`), in blocks of `√n` rows:
/// a cumulative sum within each block, then one over the blocks' totals. CubeCL's `cumsum`
/// has each output element add up every element before it (`n²/2` reads along `n`); in
/// blocks each element reads at most `√n` (`n^1.5` in all), so that a GPU's sort by expert of
/// `tokens · top_k` assignments stays affordable. Exact: integers.
///
/// # Shapes
/// - x: `[n, columns]`, `n ≥ 1`
/// - output: `[n, columns]`
pub fn exclusive_cumsum_rows<B: Backend>(x: Tensor<B, 2, Int>) -> Tensor<B, 2, Int> {
    let [n, columns] = x.dims();
    let device = x.device();
    let block = ((n as f64).sqrt().ceil() as usize).max(1);
    let blocks = n.div_ceil(block);
    let padded = match blocks * block - n {
        0 => x,
        extra => Tensor::cat(vec![x, Tensor::zeros([extra, columns], &device)], 0),
    };
    let x = padded.reshape([blocks, block, columns]);
    let inclusive = x.clone().cumsum(1);
    let totals = inclusive.clone().narrow(1, block - 1, 1);
    let offsets = totals.clone().cumsum(0) - totals;
    (inclusive - x + offsets)
        .reshape([blocks * block, columns])
        .narrow(0, 0, n)
}

/// `values` as a 1-D integer tensor on `device`.
fn int_tensor<B: Backend>(values: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let values: Vec<i64> = values.iter().map(|&v| v as i64).collect();
    let len = values.len();
    Tensor::from_data(TensorData::new(values, [len]), device)
}
