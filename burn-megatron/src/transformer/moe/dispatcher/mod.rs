//! The token dispatchers: each token's copies (one an expert it is routed to) brought to the
//! ranks that hold their experts, sorted by expert, and the experts' outputs brought back,
//! weighted by the router and summed over each token's experts, dropless or with a capacity
//! per expert ([`super::capacity`]). Megatron's two main dispatchers, chosen by
//! `--moe-token-dispatcher-type` ([`TokenDispatcherType`]):
//!
//! - [`all_to_all`] (`alltoall`, Megatron's `MoEAlltoAllTokenDispatcher`): every rank sends
//!   each rank the copies of its tokens for that rank's experts, in one all-to-all of blocks
//!   of different sizes, and the outputs come back the same way;
//! - [`all_gather`] (`allgather`, Megatron's `MoEAllGatherTokenDispatcher`): every rank
//!   all-gathers the group's tokens and their routing, runs its experts on the copies routed
//!   to them, and a reduce-scatter sums each token's outputs over the ranks and brings them
//!   back to the token's rank. Every rank holds the whole group's tokens: for small EP groups.
//!
//! Both plan the same way (this file). Sizes vary from batch to batch and from rank to rank,
//! so:
//!
//! 1. the ranks all-gather how many tokens each of them routes to each expert, and their
//!    total (a `[ep · (num_experts + 1)]` exchange read to the host, the only synchronisation
//!    with it: the tokens are sorted by expert on the device, as in Megatron's all-to-all
//!    dispatcher);
//! 2. each rank finds, on the device, each of its assignments' place among its expert's
//!    (a counting sort: the router's routing map, `[tokens, num_experts]`, summed down the
//!    tokens in blocks, read at each assignment) and, with a capacity, which ones it keeps;
//!    from the places, each assignment's row in the buffer it travels in, and the inverse,
//!    each row's assignment ([`PermuteOps::invert_rows`]).
//!
//! From the counts every rank knows every block's size: each rank's experts receive the same
//! rows in the same order from either dispatcher (by local expert, then by source rank, then
//! in token order, each block padded alike), so their experts compute the same numbers.
//!
//! Every rank runs the same collectives in the same order whatever its tokens, forward and
//! backward, so a rank or an expert that gets no tokens cannot leave another waiting.
//!
//! Rows move by gathers whose gradient is a gather through the inverse index
//! ([`permute_rows`], and [`unpermute_rows`] with the router's weights, Megatron's permute
//! and unpermute): no scatter-add, forward or backward. A row that carries no token (a
//! block's filler row, capacity padding, the experts' last row) is zero both ways.
//!
//! With a capacity, each rank's blocks hold the assignments its experts keep (or, padded, the
//! capacity's rows): the sizes follow from the same all-gathered counts, so a capacity adds no
//! exchange (the probs policy adds each assignment's expert and weight to the host read).
//!
//! [`permute_rows`]: crate::ops::permute_rows
//! [`unpermute_rows`]: crate::ops::unpermute_rows

pub mod all_gather;
pub mod all_to_all;

use std::ops::Range;

use burn::config::Config;
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor, TensorData, backend::Backend};
use burn_megatron_dist::{DistBackend, DistError, DistResult, HostRead, ProcessGroup};

pub use all_gather::AllGatherPlan;
pub use all_to_all::AllToAllPlan;

use super::capacity::{ExpertCapacity, TokenDropPolicy, keep_by_weight};
use super::router::{Routing, routing_map};
use crate::error::ConfigError;
use crate::ops::grouped_linear::padded_block_rows;
use crate::ops::{GroupedLinearOps, PermuteOps};

/// How tokens travel to the experts and back (Megatron's `--moe-token-dispatcher-type`).
/// Both give the same outputs, losses and gradients (up to the order of the sums over a
/// token's experts) and drop the same assignments.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum TokenDispatcherType {
    /// `alltoall`: each rank sends each rank only its tokens' copies for that rank's experts
    /// ([`all_to_all`]). What a rank moves and holds grows with its own tokens.
    AllToAll,
    /// `allgather`: every rank all-gathers the group's tokens and routing, the outputs go back
    /// by a reduce-scatter ([`all_gather`]). Every rank holds `ep` times its tokens (and
    /// `ep · top_k` times their width for the combine): for small EP groups.
    AllGather,
}

impl TokenDispatcherType {
    /// Megatron's names, `alltoall` or `allgather`; Megatron's `flex` (DeepEP's fused
    /// kernels) is refused as not implemented.
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        match name.to_ascii_lowercase().as_str() {
            "alltoall" => Ok(Self::AllToAll),
            "allgather" => Ok(Self::AllGather),
            "flex" => Err(ConfigError::Invalid(
                "--moe-token-dispatcher-type flex (Megatron's DeepEP dispatcher) is not \
                 implemented here: use alltoall or allgather"
                    .into(),
            )),
            _ => Err(ConfigError::Invalid(format!(
                "--moe-token-dispatcher-type {name:?}: use alltoall (tokens sent to their \
                 experts' ranks) or allgather (every rank gathers the group's tokens)"
            ))),
        }
    }

    /// Megatron's name: `alltoall` or `allgather`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::AllToAll => "alltoall",
            Self::AllGather => "allgather",
        }
    }
}

/// Whether the dispatcher hands the experts blocks of one size, each expert's tokens followed
/// by zero rows, so that each of their products runs as one batched GEMM. The padding rides
/// in the dispatcher's own row moves: it costs no gather of its own.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum BlockPadding {
    /// Where the backend runs blocks of one size faster
    /// ([`GroupedLinearOps::padded_block_rows`]: our CUDA backend, for many local experts).
    Backend,
    /// Wherever a rank has two or more experts and some tokens, whatever the backend (for
    /// testing the padded layout on the CPU).
    Always,
}

impl BlockPadding {
    /// The rows of every padded block for these counts, or `None` for blocks of the counts.
    fn rows<B: GroupedLinearOps>(self, counts: &[usize]) -> Option<usize> {
        match self {
            Self::Backend => B::padded_block_rows(counts),
            Self::Always => padded_block_rows(counts, f64::INFINITY),
        }
    }
}

/// Splits `num_experts` experts over the expert-parallel group and moves tokens to them.
#[derive(Debug, Clone)]
pub struct TokenDispatcher {
    ep: ProcessGroup,
    num_experts: usize,
    kind: TokenDispatcherType,
    padding: BlockPadding,
}

/// The plan of one dispatch: what every rank routes and keeps, and the row indices of every
/// gather of the exchange, those that depend on each token's experts computed on the device,
/// the rest on the host from the counts.
///
/// Built by [`TokenDispatcher::plan`] from the routing; the same plan serves
/// [`dispatch`](TokenDispatcher::dispatch) and [`combine`](TokenDispatcher::combine).
#[derive(Debug, Clone)]
pub struct DispatchPlan<B: Backend> {
    /// Tokens of this rank.
    pub num_tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// How many of this rank's assignments each expert (of all `num_experts`) got and kept
    /// (all of them without a capacity).
    pub tokens_per_expert: Vec<usize>,
    /// Each expert's capacity on this rank, if the layer has one.
    pub capacity: Option<usize>,
    /// This rank's assignments dropped by over-full experts.
    pub dropped: usize,
    /// Rows each local expert receives, over all ranks (the expert-major blocks; with
    /// padding, the capacity's rows from each rank).
    pub local_counts: Vec<usize>,
    /// The rows of every local expert's block in the buffer [`dispatch`] gives, where the
    /// blocks are padded to one size ([`BlockPadding`]); `None` where they are the counts
    /// followed by one zero row.
    ///
    /// [`dispatch`]: TokenDispatcher::dispatch
    pub padded_rows: Option<usize>,
    /// The dispatcher's own part: how the rows travel.
    pub exchange: Exchange<B>,
}

/// A plan half made ([`TokenDispatcher::start_plan_routing`]): the counts on their way to
/// the host and the sort's sums queued; [`TokenDispatcher::finish_plan`] completes it.
pub struct PendingPlan<B: Backend> {
    /// `[num_tokens, top_k]`, device: each assignment's expert.
    experts: Tensor<B, 2, Int>,
    capacity: Option<ExpertCapacity>,
    /// The all-gathered counts (with the probs policy, this rank's experts and weights too).
    read: HostRead,
    /// The cumulative sums of the routing map, or the map.
    sums: SortSums<B>,
}

/// The sums that sort the assignments: queued with the counts' read, or (the probs drop
/// policy, which may sort a map of the assignments it keeps instead) the routing map, summed
/// only if the plan needs it.
enum SortSums<B: Backend> {
    Queued(BlockedCumsum<B>),
    Later(Tensor<B, 2, Int>),
}

impl<B: Backend> SortSums<B> {
    fn into_sums(self) -> BlockedCumsum<B> {
        match self {
            Self::Queued(sums) => sums,
            Self::Later(map) => BlockedCumsum::new(map),
        }
    }
}

impl<B: Backend> core::fmt::Debug for PendingPlan<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "PendingPlan({:?})", self.experts.dims())
    }
}

/// The part of a [`DispatchPlan`] that depends on the dispatcher.
#[derive(Debug, Clone)]
pub enum Exchange<B: Backend> {
    /// [`TokenDispatcherType::AllToAll`]'s blocks.
    AllToAll(AllToAllPlan<B>),
    /// [`TokenDispatcherType::AllGather`]'s rows.
    AllGather(AllGatherPlan<B>),
}

impl<B: Backend> DispatchPlan<B> {
    /// Rows this rank's experts receive, over all ranks.
    pub fn received(&self) -> usize {
        self.local_counts.iter().sum()
    }

    /// Rows of the buffer [`dispatch`](TokenDispatcher::dispatch) gives: every block padded
    /// ([`padded_rows`](Self::padded_rows)), or the rows received and one zero row.
    pub fn expert_rows(&self) -> usize {
        self.expert_blocks().iter().sum()
    }

    /// The rows of each local expert's block in that buffer: its tokens, then zero rows (the
    /// last block's last row is the zero row where the blocks are not padded).
    pub fn expert_blocks(&self) -> Vec<usize> {
        expert_blocks(&self.local_counts, self.padded_rows)
    }
}

/// [`DispatchPlan::expert_blocks`] of these counts.
fn expert_blocks(local_counts: &[usize], padded_rows: Option<usize>) -> Vec<usize> {
    match padded_rows {
        Some(rows) => vec![rows; local_counts.len()],
        None => {
            let mut blocks = local_counts.to_vec();
            *blocks.last_mut().expect("at least one local expert") += 1;
            blocks
        }
    }
}

/// What both dispatchers' plans start from: every rank's blocks, and this rank's assignments
/// sorted by expert on the device.
struct Sorted<B: Backend> {
    /// Tokens of this rank.
    num_tokens: usize,
    /// Experts per token.
    top_k: usize,
    /// `counts_of[r][e]`: rows of rank `r`'s block for expert `e` (the assignments kept, or
    /// the capacity's rows with padding), the same on every rank.
    counts_of: Vec<Vec<usize>>,
    /// `kept_of[r][e]`: the assignments of rank `r` that expert `e` keeps, the first rows of
    /// its block (the rest is padding).
    kept_of: Vec<Vec<usize>>,
    /// Tokens of each rank.
    tokens_of: Vec<usize>,
    /// `[num_tokens, top_k]`, device: each assignment's expert.
    experts: Tensor<B, 2, Int>,
    /// The cumulative sums over the tokens of the routing map of the assignments kept.
    sums: BlockedCumsum<B>,
    /// `[num_tokens · top_k]`, device: which assignments are dropped, if any are.
    dropped: Option<Tensor<B, 1, Bool>>,
}

impl<B: Backend> Sorted<B> {
    /// Each assignment's row `base[e] + i` (token-major, `[num_tokens · top_k]`), where `e`
    /// is its expert and `i` its place among this rank's kept assignments to `e` in token
    /// order; anything for a dropped one ([`assignment_rows`]).
    fn rows(&self, base: &[usize]) -> Tensor<B, 1, Int> {
        assignment_rows(&self.sums, &self.experts, base)
    }
}

/// Each assignment's row `base[e] + i` (token-major, `[tokens · top_k]`), where `e` is its
/// expert (`experts`, `[tokens, top_k]`) and `i` its place among the assignments to `e` of the
/// routing map that `sums` sums, in token order (an assignment the map leaves out gets
/// anything). Three kernels: the place is the map's inclusive sum at the assignment, minus
/// one, and the shift `base − 1` goes on the blocks' offsets.
fn assignment_rows<B: Backend>(
    sums: &BlockedCumsum<B>,
    experts: &Tensor<B, 2, Int>,
    base: &[usize],
) -> Tensor<B, 1, Int> {
    let [tokens, top_k] = experts.dims();
    let e = base.len();
    let shift: Vec<i64> = base.iter().map(|&b| b as i64 - 1).collect();
    let shift = Tensor::<B, 1, Int>::from_data(TensorData::new(shift, [e]), &experts.device());
    sums.inclusive_plus(shift.reshape([1, 1, e]))
        .gather(1, experts.clone())
        .reshape([tokens * top_k])
}

impl TokenDispatcher {
    /// A dispatcher of type `kind` for `num_experts` experts over `ep`, which must divide
    /// them (checked by [`MoeConfig::init`](super::MoeConfig::init)).
    pub fn new(ep: &ProcessGroup, num_experts: usize, kind: TokenDispatcherType) -> Self {
        Self {
            ep: ep.clone(),
            num_experts,
            kind,
            padding: BlockPadding::Backend,
        }
    }

    /// The same dispatcher padding the experts' blocks as `padding` says.
    pub fn with_block_padding(self, padding: BlockPadding) -> Self {
        Self { padding, ..self }
    }

    /// Whether the experts' blocks are padded to one size.
    pub fn block_padding(&self) -> BlockPadding {
        self.padding
    }

    /// The expert-parallel group.
    pub fn ep(&self) -> &ProcessGroup {
        &self.ep
    }

    /// How the tokens travel.
    pub fn kind(&self) -> TokenDispatcherType {
        self.kind
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
    /// sum of the routing map in blocks, as [`exclusive_cumsum_rows`]) after those of the experts before
    /// its own (from the counts). The all-gather dispatcher then all-gathers each
    /// assignment's row in its expert's rank's buffer (see [`all_gather`]).
    ///
    /// [`Routing::experts`]: super::Routing::experts
    pub fn plan<B: DistBackend + PermuteOps + GroupedLinearOps>(
        &self,
        experts: Tensor<B, 2, Int>,
        tokens_per_expert: Tensor<B, 1, Int>,
    ) -> DistResult<DispatchPlan<B>> {
        self.plan_dropping(experts, None, tokens_per_expert, None)
    }

    /// [`plan`](Self::plan) with each expert limited to `capacity` (see [`super::capacity`]):
    /// every rank's capacity comes from its own number of assignments (all-gathered with the
    /// counts), the assignments kept from its counts (`min(count, capacity)` an expert), so
    /// that every rank knows every block's size without another exchange. Which assignments an
    /// over-full expert keeps is found on the device for the position policy (an assignment's
    /// place among its expert's, below the capacity); for the probs policy each assignment's
    /// expert and `weights` (`[num_tokens, top_k]`, ranked in F32) come to the host in the
    /// same read as the counts. Each rank decides its own drops, whatever the dispatcher.
    /// Dropped assignments go to no expert and read back as a zero row.
    pub fn plan_with_capacity<B: DistBackend + PermuteOps + GroupedLinearOps>(
        &self,
        experts: Tensor<B, 2, Int>,
        tokens_per_expert: Tensor<B, 1, Int>,
        weights: Tensor<B, 2>,
        capacity: &ExpertCapacity,
    ) -> DistResult<DispatchPlan<B>> {
        self.plan_dropping(experts, None, tokens_per_expert, Some((capacity, weights)))
    }

    /// [`plan`](Self::plan), or with a capacity [`plan_with_capacity`](Self::plan_with_capacity),
    /// of a router's [`Routing`], whose routing map it reuses.
    pub fn plan_routing<B: DistBackend + PermuteOps + GroupedLinearOps>(
        &self,
        routing: &Routing<B>,
        capacity: Option<&ExpertCapacity>,
    ) -> DistResult<DispatchPlan<B>> {
        let pending = self.start_plan_routing(routing, capacity)?;
        self.finish_plan(pending)
    }

    /// The first half of [`plan_routing`](Self::plan_routing): queues the counts'
    /// all-gather, starts their read to the host ([`DeviceTransport::read_ahead`]) and queues
    /// the cumulative sums that sort the assignments, without waiting. Work queued before
    /// [`finish_plan`](Self::finish_plan) (the shared expert) then keeps the GPU busy while
    /// the host waits for the counts and plans (Megatron's shared-expert overlap).
    ///
    /// [`DeviceTransport::read_ahead`]: burn_megatron_dist::DeviceTransport::read_ahead
    pub fn start_plan_routing<B: DistBackend + PermuteOps>(
        &self,
        routing: &Routing<B>,
        capacity: Option<&ExpertCapacity>,
    ) -> DistResult<PendingPlan<B>> {
        self.start_plan(
            routing.experts.clone(),
            Some(routing.routing_map.clone()),
            routing.tokens_per_expert.clone(),
            capacity.map(|c| (c, routing.weights.clone())),
        )
    }

    fn plan_dropping<B: DistBackend + PermuteOps + GroupedLinearOps>(
        &self,
        experts: Tensor<B, 2, Int>,
        map: Option<Tensor<B, 2, Int>>,
        tokens_per_expert: Tensor<B, 1, Int>,
        drop: Option<(&ExpertCapacity, Tensor<B, 2>)>,
    ) -> DistResult<DispatchPlan<B>> {
        let pending = self.start_plan(experts, map, tokens_per_expert, drop)?;
        self.finish_plan(pending)
    }

    fn start_plan<B: DistBackend + PermuteOps>(
        &self,
        experts: Tensor<B, 2, Int>,
        map: Option<Tensor<B, 2, Int>>,
        tokens_per_expert: Tensor<B, 1, Int>,
        drop: Option<(&ExpertCapacity, Tensor<B, 2>)>,
    ) -> DistResult<PendingPlan<B>> {
        let e_all = self.num_experts;
        let [num_tokens, top_k] = experts.dims();
        let device = experts.device();
        // routed_of[r][e]: assignments rank r routes to expert e. Cast to F32 directly, not
        // through the default float dtype: BF16 holds integers exactly only up to 256, and a
        // rounded count puts assignments in the wrong rows of the buffers (on a GPU, reads and
        // writes past their ends). F32 is exact up to 2^24 assignments a rank.
        let assignments = num_tokens * top_k;
        let mut total = vec![0.0f32; e_all + 1];
        total[e_all] = assignments as f32;
        let local =
            Tensor::<B, 1>::from_data(TensorData::new(total, [e_all + 1]), (&device, DType::F32))
                .slice_assign(0..e_all, tokens_per_expert.cast(FloatDType::F32));
        let all = match self.ep.size() {
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
        let read = B::read_ahead(read);
        // The sort's sums need only the routing: queued now, they run while the host waits.
        let map = map.unwrap_or_else(|| routing_map(experts.clone(), e_all));
        let sums = match by_weight {
            true => SortSums::Later(map),
            false => SortSums::Queued(BlockedCumsum::new(map)),
        };
        Ok(PendingPlan {
            experts,
            capacity,
            read,
            sums,
        })
    }

    /// The second half of [`plan_routing`](Self::plan_routing): waits for the counts and
    /// builds the plan from them.
    pub fn finish_plan<B: DistBackend + PermuteOps + GroupedLinearOps>(
        &self,
        pending: PendingPlan<B>,
    ) -> DistResult<DispatchPlan<B>> {
        let PendingPlan {
            experts,
            capacity,
            read,
            sums,
        } = pending;
        let (ep, rank) = (self.ep.size(), self.ep.rank());
        let (e_all, e_local) = (self.num_experts, self.num_local_experts());
        let [num_tokens, top_k] = experts.dims();
        let device = experts.device();
        let assignments = num_tokens * top_k;
        let error = |message: String| DistError::Device {
            rank: self.ep.global_rank(),
            group: self.ep.name().to_string(),
            what: "the expert token counts all-gathered over EP".to_string(),
            message,
        };
        let read = read.wait().map_err(error)?;
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
        let tokens_of: Vec<usize> = totals.iter().map(|&t| t / top_k.max(1)).collect();
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
                    .and_then(|(c, cap)| c.padded_rows(cap, tokens_of[r]));
                match padded {
                    Some(rows) => vec![rows; e_all],
                    None => kept.clone(),
                }
            })
            .collect();
        // Rows each of this rank's experts receives: its block from every rank.
        // Rows each local expert of EP rank q receives: its block from every rank.
        let counts_of_rank = |q: usize| -> Vec<usize> {
            (0..e_local)
                .map(|j| (0..ep).map(|r| counts_of[r][q * e_local + j]).sum())
                .collect()
        };
        let local_counts = counts_of_rank(rank);
        let padded_rows = self.padding.rows::<B>(&local_counts);
        // Whether each rank pads its experts' blocks, known to every rank from the counts: the
        // all-gather writes into every rank's blocks (the all-to-all only into its own).
        let padded_of: Vec<Option<usize>> = match self.kind {
            TokenDispatcherType::AllToAll => Vec::new(),
            TokenDispatcherType::AllGather => (0..ep)
                .map(|q| match q == rank {
                    true => padded_rows,
                    false => self.padding.rows::<B>(&counts_of_rank(q)),
                })
                .collect(),
        };

        // The routing map of the assignments this rank keeps, and which ones drop, on the
        // device.
        let dropped: usize =
            routed_of[rank].iter().sum::<usize>() - kept_of[rank].iter().sum::<usize>();
        let (sums, dropped_mask) = match (capacity, capacity_of[rank]) {
            (Some(c), Some(cap)) if dropped > 0 => match c.drop_policy {
                TokenDropPolicy::Position => {
                    // An assignment's place among all its expert's: the first `cap` stay, so
                    // that the places of those kept are their places among the kept.
                    let sums = sums.into_sums();
                    let place = assignment_rows(&sums, &experts, &vec![0; e_all]);
                    (sums, Some(place.greater_equal_elem(cap as i64)))
                }
                TokenDropPolicy::Probs => {
                    let (chosen, weights) = local_read.split_at(assignments);
                    let chosen: Vec<usize> = chosen.iter().map(|&e| e as usize).collect();
                    let keep = keep_by_weight(&chosen, weights, e_all, cap);
                    let drop: Vec<bool> = keep.iter().map(|k| !k).collect();
                    let drop = Tensor::<B, 1, Bool>::from_data(
                        TensorData::new(drop, [assignments]),
                        &device,
                    );
                    let kept_experts = experts
                        .clone()
                        .mask_fill(drop.clone().reshape([num_tokens, top_k]), e_all as i64);
                    let sums = BlockedCumsum::new(routing_map(kept_experts, e_all));
                    (sums, Some(drop))
                }
            },
            _ => (sums.into_sums(), None),
        };
        let sorted = Sorted {
            num_tokens,
            top_k,
            counts_of,
            kept_of: kept_of.clone(),
            tokens_of,
            experts,
            sums,
            dropped: dropped_mask,
        };
        let exchange = match self.kind {
            TokenDispatcherType::AllToAll => {
                let blocks = expert_blocks(&local_counts, padded_rows);
                Exchange::AllToAll(all_to_all::plan(self, sorted, &blocks))
            }
            TokenDispatcherType::AllGather => {
                Exchange::AllGather(all_gather::plan(self, sorted, &padded_of)?)
            }
        };
        Ok(DispatchPlan {
            num_tokens,
            top_k,
            tokens_per_expert: kept_of[rank].clone(),
            capacity: capacity_of[rank],
            dropped,
            local_counts,
            padded_rows,
            exchange,
        })
    }

    /// The tokens for this rank's experts, in expert-major blocks
    /// ([`DispatchPlan::expert_blocks`]: each local expert's tokens, then zero rows).
    ///
    /// # Shapes
    /// - tokens: `[num_tokens, hidden]`
    /// - output: `[plan.expert_rows(), hidden]`
    pub fn dispatch<B: DistBackend + PermuteOps>(
        &self,
        plan: &DispatchPlan<B>,
        tokens: Tensor<B, 2>,
    ) -> DistResult<Tensor<B, 2>> {
        match &plan.exchange {
            Exchange::AllToAll(rows) => all_to_all::dispatch(&self.ep, rows, tokens),
            Exchange::AllGather(rows) => all_gather::dispatch(&self.ep, rows, tokens),
        }
    }

    /// The experts' outputs brought back to the ranks their tokens came from, restored to the
    /// tokens' order, weighted by the router and summed over each token's experts.
    ///
    /// # Shapes
    /// - expert_output: `[plan.expert_rows(), hidden]`, expert-major as
    ///   [`dispatch`](Self::dispatch) gave the tokens; its zero rows are never read
    /// - weights: `[num_tokens, top_k]`
    /// - output: `[num_tokens, hidden]`
    pub fn combine<B: DistBackend + PermuteOps>(
        &self,
        plan: &DispatchPlan<B>,
        expert_output: Tensor<B, 2>,
        weights: Tensor<B, 2>,
    ) -> DistResult<Tensor<B, 2>> {
        match &plan.exchange {
            Exchange::AllToAll(rows) => {
                all_to_all::combine(&self.ep, plan, rows, expert_output, weights)
            }
            Exchange::AllGather(rows) => {
                all_gather::combine(&self.ep, plan, rows, expert_output, weights)
            }
        }
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

/// Inclusive cumulative sums down the rows of an `[n, columns]` integer tensor, in blocks of
/// about `√n` rows: a cumulative sum within each block and one over the blocks' totals (the
/// blocks' offsets), kept apart so that a caller adds a shift to the small offsets. CubeCL's
/// `cumsum` has each output element add up every element before it (`n²/2` reads along `n`);
/// in blocks each element reads at most about `√n` (`n^1.5` in all), so that a GPU's sort by
/// expert stays affordable. Exact: integers. The block is a divisor of `n` between `√n` and
/// `2√n` where there is one (no padding), else `√n` rows and zero rows after the last.
struct BlockedCumsum<B: Backend> {
    /// `[blocks, block, columns]`: the sums within each block.
    inclusive: Tensor<B, 3, Int>,
    /// `[blocks, 1, columns]`: the sum of the blocks before each block.
    offsets: Tensor<B, 3, Int>,
    /// Rows of the summed tensor.
    rows: usize,
}

impl<B: Backend> BlockedCumsum<B> {
    /// The sums of `x` (`[n, columns]`, `n ≥ 1`): three kernels (four more with padding).
    fn new(x: Tensor<B, 2, Int>) -> Self {
        let [n, columns] = x.dims();
        let root = ((n as f64).sqrt().ceil() as usize).max(1);
        let block = (root..=2 * root)
            .find(|d| n.is_multiple_of(*d))
            .unwrap_or(root);
        let blocks = n.div_ceil(block);
        let padded = match blocks * block - n {
            0 => x,
            extra => Tensor::cat(
                vec![x.clone(), Tensor::zeros([extra, columns], &x.device())],
                0,
            ),
        };
        let inclusive = padded.reshape([blocks, block, columns]).cumsum(1);
        let totals = inclusive.clone().narrow(1, block - 1, 1);
        let offsets = totals.clone().cumsum(0) - totals;
        Self {
            inclusive,
            offsets,
            rows: n,
        }
    }

    /// `[n, columns]`: the inclusive sums plus `shift` (`[1, 1, columns]`), added to the
    /// blocks' offsets first (two kernels).
    fn inclusive_plus(&self, shift: Tensor<B, 3, Int>) -> Tensor<B, 2, Int> {
        let [blocks, block, columns] = self.inclusive.dims();
        (self.inclusive.clone() + (self.offsets.clone() + shift))
            .reshape([blocks * block, columns])
            .narrow(0, 0, self.rows)
    }
}

/// The sum of the rows before each row (`out[i] = Σ_{i' < i} x[i']`), in blocks of about `√n`
/// rows (see `BlockedCumsum`): the cumulative sum that sorts the assignments by expert.
///
/// # Shapes
/// - x: `[n, columns]`, `n ≥ 1`
/// - output: `[n, columns]`
pub fn exclusive_cumsum_rows<B: Backend>(x: Tensor<B, 2, Int>) -> Tensor<B, 2, Int> {
    let sums = BlockedCumsum::new(x.clone());
    let [blocks, block, columns] = sums.inclusive.dims();
    (sums.inclusive + sums.offsets)
        .reshape([blocks * block, columns])
        .narrow(0, 0, sums.rows)
        - x
}
