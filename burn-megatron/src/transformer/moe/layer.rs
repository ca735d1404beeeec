//! The mixture-of-experts layer: router, dispatch, experts, combine, and the shared expert.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::mapping::{
    copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
};
use burn_megatron_dist::{DistResult, ProcessGroup};

use super::capacity::ExpertCapacity;
use super::dispatcher::{BlockPadding, TokenDispatcher};
use super::experts::GroupedExperts;
use super::jitter::JitterSite;
use super::router::{Router, expert_bias_update};
use crate::backend::ModelBackend;
use crate::ops::BackwardHook;

/// A mixture of experts in place of a transformer layer's MLP (Megatron's `MoELayer`):
/// dropless, every token reaching each of its `top_k` experts, or with a capacity per expert
/// beyond which a rank's assignments drop ([`ExpertCapacity`]).
///
/// The router and the shared expert are replicated on every rank; the routed experts are
/// split over the expert-parallel group, `num_experts / ep` each, and tokens travel to them
/// by all-to-all or by all-gather ([`TokenDispatcher`]). Each rank routes its own tokens: its
/// losses are its batch's, and the gradients of the replicated parameters are its batch's
/// contribution (sum them over data parallelism, as for any dense parameter); an expert's
/// gradient covers the tokens of every rank that routed to it.
///
/// Under expert tensor parallelism ([`with_expert_tp`](Self::with_expert_tp)) every expert,
/// routed and shared, holds this rank's slice of its hidden width, and the ranks of that group
/// route the same tokens; their partial outputs are summed over it.
#[derive(Module, Debug)]
pub struct MoeLayer<B: Backend> {
    /// Scores and top-k.
    pub router: Router<B>,
    /// This rank's routed experts.
    pub experts: GroupedExperts<B>,
    /// DeepSeek's shared expert(s), applied to every token (one MLP of the shared experts'
    /// total width), if any.
    pub shared_expert: Option<GroupedExperts<B>>,
    #[module(skip)]
    dispatcher: TokenDispatcher,
    #[module(skip)]
    capacity: Option<ExpertCapacity>,
    /// The group over which every expert's hidden width is split (expert tensor
    /// parallelism), `None` when the experts are whole on every rank.
    #[module(skip)]
    expert_tp: Option<ProcessGroup>,
}

/// What an MoE layer returns: its output, and the losses to add to the model's loss.
#[derive(Debug, Clone)]
pub struct MoeOutput<B: Backend> {
    /// `[batch, seq, hidden_size]`.
    pub output: Tensor<B, 3>,
    /// `[1]`: the load-balancing loss, coefficient included.
    pub load_balancing_loss: Tensor<B, 1>,
    /// `[1]`: the z-loss, coefficient included.
    pub z_loss: Tensor<B, 1>,
    /// How many of this rank's token assignments each expert got and kept (for logging the
    /// load; with a capacity, the assignments kept).
    pub tokens_per_expert: Vec<usize>,
    /// This rank's assignments that over-full experts dropped (0 when dropless).
    pub dropped: usize,
}

impl<B: Backend> MoeOutput<B> {
    /// `[1]`: the auxiliary losses together, the term to add to the model's loss, in the
    /// router's dtype: cast it to the loss's dtype before adding (Burn 0.21 does not promote
    /// dtypes; [`MoeLosses::add_to`](super::MoeLosses::add_to) casts).
    pub fn aux_loss(&self) -> Tensor<B, 1> {
        let dtype = self.load_balancing_loss.dtype();
        self.load_balancing_loss.clone() + self.z_loss.clone().cast(dtype)
    }
}

impl<B: Backend> MoeLayer<B> {
    /// A layer from its parts.
    pub fn new(
        router: Router<B>,
        experts: GroupedExperts<B>,
        shared_expert: Option<GroupedExperts<B>>,
        dispatcher: TokenDispatcher,
    ) -> Self {
        Self {
            router,
            experts,
            shared_expert,
            dispatcher,
            capacity: None,
            expert_tp: None,
        }
    }

    /// The same layer whose experts (routed and shared) hold this rank's slice of their
    /// hidden width over `expert_tp`, a group whose ranks all route the same tokens; `None`
    /// (or a group of one) for whole experts. The parameters must have been built for it
    /// ([`MoeConfig::init_with_expert_tp`](super::MoeConfig::init_with_expert_tp)).
    pub fn with_expert_tp(self, expert_tp: Option<ProcessGroup>) -> Self {
        let expert_tp = expert_tp.filter(|tp| tp.size() > 1);
        Self { expert_tp, ..self }
    }

    /// The expert-tensor-parallel group, if the experts are split over one.
    pub fn expert_tp(&self) -> Option<&ProcessGroup> {
        self.expert_tp.as_ref()
    }

    /// The same layer with each expert's capacity (`None`: dropless).
    pub fn with_capacity(self, capacity: Option<ExpertCapacity>) -> Self {
        Self { capacity, ..self }
    }

    /// The same layer (same parameters and ids) whose routed and shared experts offer their
    /// weights' gradients to `hook` in the backward pass
    /// ([`BackwardHook::take_weight_gradient`]), or to none.
    pub fn with_backward_hook(self, hook: Option<Arc<dyn BackwardHook>>) -> Self {
        Self {
            experts: self.experts.with_backward_hook(hook.clone()),
            shared_expert: self
                .shared_expert
                .map(|shared| shared.with_backward_hook(hook)),
            ..self
        }
    }

    /// Each expert's capacity, if any.
    pub fn capacity(&self) -> Option<ExpertCapacity> {
        self.capacity
    }

    /// The dispatcher (and through it the expert-parallel group).
    pub fn dispatcher(&self) -> &TokenDispatcher {
        &self.dispatcher
    }

    /// The same layer whose dispatcher pads the experts' blocks as `padding` says.
    pub fn with_block_padding(self, padding: BlockPadding) -> Self {
        Self {
            dispatcher: self.dispatcher.with_block_padding(padding),
            ..self
        }
    }

    /// Moves the router's expert bias, if it has one, by [`expert_bias_update`] of
    /// `tokens_per_expert` (`[num_experts]`: one step's counts over every data-parallel rank,
    /// the same on every rank, so that the bias stays the same everywhere), on the device.
    pub fn update_expert_bias(&mut self, tokens_per_expert: Tensor<B, 1>, rate: f64) {
        let Some(bias) = self.router.expert_bias.take() else {
            return;
        };
        let delta = expert_bias_update(tokens_per_expert, rate);
        self.router.expert_bias = Some(bias.map(|b| {
            let delta = delta.cast(b.dtype());
            (b.detach() + delta).set_require_grad(false)
        }));
    }
}

impl<B: ModelBackend> MoeLayer<B> {
    /// Routes every token to its experts and back, adding the shared expert's output.
    ///
    /// Every rank of the expert-parallel group must call it, each with its own tokens (the
    /// batch sizes may differ).
    ///
    /// # Shapes
    /// - input: `[batch, seq, hidden_size]`
    /// - output: `[batch, seq, hidden_size]`; losses `[1]`
    ///
    /// # Panics
    /// If a collective fails; [`try_forward`](Self::try_forward) returns the error instead.
    pub fn forward(&self, input: Tensor<B, 3>) -> MoeOutput<B> {
        self.try_forward(input).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning communication errors.
    pub fn try_forward(&self, input: Tensor<B, 3>) -> DistResult<MoeOutput<B>> {
        self.try_forward_over(input, None)
    }

    /// [`try_forward`](Self::try_forward) for this rank's part of a batch spread over
    /// `sequence` (the context-parallel group): the losses are this rank's share of the
    /// batch's ([`Router::route_over`]), so that summed over the group they are the batch's.
    pub fn try_forward_over(
        &self,
        input: Tensor<B, 3>,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<MoeOutput<B>> {
        self.try_forward_over_at(input, sequence, None)
    }

    /// [`try_forward_over`](Self::try_forward_over) with the router's input jitter drawn at
    /// `jitter`, the tokens' place in the global batch ([`Router::route_at`]).
    pub fn try_forward_over_at(
        &self,
        input: Tensor<B, 3>,
        sequence: Option<&ProcessGroup>,
        jitter: Option<&JitterSite>,
    ) -> DistResult<MoeOutput<B>> {
        let mut out = self.try_forward_partial_at(input, sequence, jitter)?;
        if let Some(tp) = &self.expert_tp {
            out.output = reduce_from_tensor_parallel_region(out.output, tp)?;
        }
        Ok(out)
    }

    /// [`try_forward_over`](Self::try_forward_over) whose output, under expert tensor
    /// parallelism ([`expert_tp`](Self::expert_tp)), is this rank's partial sum: the sum over
    /// the group is the layer's output, and each rank's output gradient must be the whole
    /// one. So a caller can reduce it as it needs (under sequence parallelism, a
    /// reduce-scatter in place of an all-reduce and a split). Without expert tensor
    /// parallelism it is the output.
    pub fn try_forward_partial_over(
        &self,
        input: Tensor<B, 3>,
        sequence: Option<&ProcessGroup>,
    ) -> DistResult<MoeOutput<B>> {
        self.try_forward_partial_at(input, sequence, None)
    }

    /// [`try_forward_partial_over`](Self::try_forward_partial_over) with the router's input
    /// jitter drawn at `jitter` ([`Router::route_at`]).
    pub fn try_forward_partial_at(
        &self,
        input: Tensor<B, 3>,
        sequence: Option<&ProcessGroup>,
        jitter: Option<&JitterSite>,
    ) -> DistResult<MoeOutput<B>> {
        let [batch, seq, hidden] = input.dims();
        let tokens = input.reshape([batch * seq, hidden]);
        let routing = self
            .router
            .route_at(tokens.clone(), batch, sequence, jitter)?;
        // The shared expert is queued between the counts' read and the wait for it, so that
        // the GPU runs it while the host plans the exchange (Megatron's shared-expert
        // overlap); it is added last, as without the overlap.
        let pending = self
            .dispatcher
            .start_plan_routing(&routing, self.capacity.as_ref())?;
        // Under expert tensor parallelism each rank's experts give a partial output, so the
        // gradients they send back (to the tokens, to the routing weights) are partial:
        // entering the region sums them over the group, where they join the router's own,
        // which every rank computes whole.
        let (tokens, weights) = match &self.expert_tp {
            Some(tp) => (
                copy_to_tensor_parallel_region(tokens, tp)?,
                copy_to_tensor_parallel_region(routing.weights, tp)?,
            ),
            None => (tokens, routing.weights),
        };
        let shared = (self.shared_expert.as_ref()).map(|s| s.forward_shared(tokens.clone()));
        let plan = self.dispatcher.finish_plan(pending)?;
        let expert_input = self.dispatcher.dispatch(&plan, tokens)?;
        let expert_output = self
            .experts
            .forward_blocks(expert_input, &plan.expert_blocks());
        let mut output = self.dispatcher.combine(&plan, expert_output, weights)?;
        if let Some(shared) = shared {
            output = output + shared;
        }
        Ok(MoeOutput {
            output: output.reshape([batch, seq, hidden]),
            load_balancing_loss: routing.load_balancing_loss,
            z_loss: routing.z_loss,
            tokens_per_expert: plan.tokens_per_expert,
            dropped: plan.dropped,
        })
    }
}
