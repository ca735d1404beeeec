//! AdamW over the flat buffers of a data-parallel replica, optionally with its state sharded
//! over the DP group: Megatron's `DistributedOptimizer` (ZeRO-1,
//! `megatron/core/optimizer/distrib_optimizer.py`) and, without sharding, its
//! `Float16OptimizerWithFloat16Params` behind `DistributedDataParallel`.
//!
//! One step, every rank of the world calling it after its backward pass:
//!
//! 1. this rank's gradients (accumulated over its microbatches) are copied into the flat fp32
//!    gradient buffer;
//! 2. they are averaged over DP ([`grad_reduction`](crate::distributed::grad_reduction)): all-reduced, or,
//!    with the distributed optimizer, reduce-scattered so that the rank holds only the shard
//!    `layout.shard(dp_rank)` it updates. Under context parallelism (CP > 1) the replicas
//!    are the DP × CP ranks (the CP ranks of a DP rank hold the same parameters, each
//!    gradient its tokens' share, see
//!    [`GptModel::with_context_parallel`](crate::models::GptModel::with_context_parallel)):
//!    the gradients are averaged over DP × CP and multiplied by CP (summed over CP, averaged
//!    over DP), and with the distributed optimizer the state is sharded over DP × CP, as in
//!    Megatron; "DP" below is then DP × CP;
//! 3. the global gradient norm: each rank sums the squares of the elements it holds and
//!    counts (TP-replicated parameters on TP rank 0 only, a tied embedding's last-stage copy
//!    not at all); with sharding the sums are added over DP (each shard once), and then over
//!    the model-parallel (TP × PP) group. The clip coefficient stays on the device;
//! 4. [`AdamWOps::flat_adamw`] updates the fp32 master weights and moments of the rank's
//!    range (the shard, or the whole buffer), one kernel on CubeCL backends;
//! 5. with sharding, the updated parameters (in the model's dtype) are all-gathered over DP;
//!    every parameter of the model becomes a slice of the full buffer. With
//!    [`DataParallelConfig::overlap_param_gather`] the gather is cut into buckets issued in
//!    the next forward pass's order, and each parameter is a slice of its bucket
//!    ([`param_gather`](crate::distributed::param_gather)).
//!
//! # Memory per parameter
//! With `d` DP ranks, parameters of `s` bytes and fp32 gradients, a rank holds `s` (the
//! model's parameters) + 4 (the gradient buffer) + `12 / d` (fp32 master, `exp_avg`,
//! `exp_avg_sq` of its shard) bytes per parameter: Megatron's table gives `6 + 12/d` for bf16
//! parameters. For f32 parameters it is `8 + 12/d`: the master shard is kept as its own copy
//! (Megatron's fp32 row, `8 + 8/d`, reuses the parameters as master weights). Without
//! sharding: `s + 4 + 12` (for f32 parameters `4 + 4 + 8`: the model's parameters are views
//! of the master weights). [`DistributedAdamW::memory`] adds up what a rank holds.
//!
//! The learning rate is the caller's: a schedule advances once per global step, whatever the
//! DP size (every rank steps once per global batch).
//!
//! # fp16 loss scaling
//! [`DistributedAdamW::step_scaled`] takes gradients of the loss times a
//! [`DynamicLossScaler`]'s scale (the schedule's
//! [`forward_backward_scaled`](crate::pipeline_parallel::forward_backward_scaled)). Its
//! overflow check needs no collective of its own: the global sum of squares of step 3 is
//! already reduced over every rank that holds a distinct part of the gradients (over DP with
//! sharding; without it every DP rank holds the same all-reduced buffer, into which a NaN or
//! ±∞ of any rank's gradients has propagated), and it is finite exactly when no gradient is
//! NaN or ±∞ and no square overflows (a scale that large should back off too). So one device
//! scalar, the norm's finiteness, is the flag on every rank of the world: the kernel skips
//! the update on it (as [`FlatAdamW`](crate::optimizer::FlatAdamW) does), the step count
//! does not advance, and the scaler backs off or grows on the device. Megatron reads the flag
//! on the host (`found_inf.item()`) every step; here nothing is read.
//!
//! # Routed experts
//! The experts of MoE layers have flat buffers of their own, averaged over the
//! expert-data-parallel group (the ranks holding the same experts) and sharded over it; their
//! squares join the one global norm, and they are updated with the dense parameters' clip
//! coefficient and overflow flag. A rank's experts can pass 32-bit indices together (32
//! experts of 3 × 2048 × 1408 in each of 16 layers: 4.43 billion elements), so they are cut into
//! parts of whole parameters, each with its own buffers, shards and state, each within
//! [`MAX_FLAT_NUMEL`] ([`flat_limit`](super::flat_limit)). With one part, the common case,
//! the step is what it was before the cut existed, bit for bit.

use std::collections::HashSet;
use std::sync::Arc;

use burn::config::Config;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor, TensorData};
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::{ParallelState, ProcessGroup, ReduceOp};

use super::flat_limit::{MAX_FLAT_NUMEL, check_indexable, split_at_limit};
use super::{DynamicLossScaler, FlatAdamWConfig, FoundInf, clip_coefficient};
use crate::ModelBackend;
use crate::distributed::grad_reduction::{
    DataParallelConfig, all_reduce_grads, check_dp, reduce_scatter_grads,
};
use crate::distributed::overlap::AfterBackward;
use crate::distributed::param_gather::all_gather_params;
use crate::distributed::{BufferLayout, GradReduceOverlap, ParamAndGradBuffer};
use crate::ops::BackwardHook;
use crate::ops::adamw::{AdamWOps, AdamWScalars, FlatAdamWBuffers};
use crate::tensor_parallel::{DeclarePlacements, Placements};

/// AdamW over a data-parallel replica's flat buffers (see the [module docs](self)).
#[derive(Config, Debug, Copy, PartialEq)]
pub struct DistributedAdamWConfig {
    /// AdamW's settings and the buffers' layout; `buffer.dp_size` is set from the DP group
    /// (DP × CP under context parallelism).
    #[config(default = "FlatAdamWConfig::new()")]
    pub adam: FlatAdamWConfig,
    /// Buckets and sharding.
    #[config(default = "DataParallelConfig::new()")]
    pub data_parallel: DataParallelConfig,
    /// Clip the global gradient norm to this (`--clip-grad`); `None`: no clipping.
    #[config(default = "None")]
    pub clip_grad: Option<f64>,
    /// The most elements of one part of the routed experts' flat buffers
    /// ([`MAX_FLAT_NUMEL`], see [`flat_limit`](super::flat_limit)); lowered only by tests, so
    /// that a tiny model's experts take several parts.
    #[doc(hidden)]
    #[config(default = "MAX_FLAT_NUMEL")]
    pub expert_part_numel: usize,
}

impl DistributedAdamWConfig {
    /// Checks AdamW's settings ([`FlatAdamWConfig::validate`]), the buckets and the clipping
    /// norm; [`init`](Self::init) calls it, and so does
    /// [`PretrainConfig::check`](crate::training::PretrainConfig::check) for every run,
    /// whichever optimizer it steps.
    pub fn validate(&self) -> core::result::Result<(), crate::error::ConfigError> {
        self.adam.validate()?;
        self.data_parallel.validate()?;
        if let Some(max_norm) = self.clip_grad {
            crate::optimizer::GradClipConfig::new()
                .with_max_norm(max_norm)
                .validate()?;
        }
        if !(1..=MAX_FLAT_NUMEL).contains(&self.expert_part_numel) {
            return Err(crate::error::ConfigError::Invalid(format!(
                "expert_part_numel ({}) must be in 1..={MAX_FLAT_NUMEL}",
                self.expert_part_numel
            )));
        }
        Ok(())
    }

    /// The optimizer of this rank's `model` (one model chunk) in the layout `state`: buffers
    /// laid out from its parameters and cut into `state.dp()`-size shards (`state.dp_cp()`
    /// under context parallelism: see the [module docs](self)), the master weights
    /// of the rank's range copied from the parameters, the moments zero. `shared_copies` are
    /// paths of parameters counted in the norm on another rank (a tied embedding's last-stage
    /// copy, [`shared_copies`](crate::optimizer::shared_copies)). Every DP rank must start from
    /// the same parameters (our initialisation depends only on the seed and the TP layout).
    pub fn init<B, M>(
        &self,
        model: &M,
        state: &ParallelState,
        shared_copies: &[String],
    ) -> crate::Result<DistributedAdamW<B>>
    where
        B: AutodiffBackend + ModelBackend,
        B::InnerBackend: ModelBackend,
        M: AutodiffModule<B> + DeclarePlacements,
    {
        // The ranks holding replicas of the dense parameters: DP, times CP under context
        // parallelism.
        let replicas = match state.cp().size() {
            1 => state.dp(),
            _ => state.dp_cp(),
        };
        let mut adam = self.adam;
        adam.buffer.dp_size = replicas.size();
        Self { adam, ..*self }.validate()?;
        super::shared_leaves::refuse_shared_leaves::<B, M>(model, state.world())?;
        let has_experts = crate::tensor_parallel::try_param_infos(model)?
            .iter()
            .any(|info| info.placement.is_expert());
        let mut buffer = ParamAndGradBuffer::from_module_where(model, adam.buffer, |info| {
            !info.placement.is_expert() && !info.placement.frozen
        })?;
        let layout = buffer.layout().clone();
        check_dp(&layout, replicas)?;
        let dp_rank = replicas.rank();
        let range = if self.data_parallel.use_distributed_optimizer {
            layout.shard(dp_rank)
        } else {
            0..layout.numel()
        };
        check_indexable(
            range.len(),
            "the dense parameters' optimizer shard of this rank",
            "--data-parallel-size with --use-distributed-optimizer, or --pipeline-model-parallel-size",
        )?;
        let full = buffer.take_main_params();
        check_same_parameters(&full, replicas)?;
        let device = full.device();
        let master = if range.len() == layout.numel() {
            full
        } else {
            // A copy, so that the shard does not keep the whole buffer alive.
            Tensor::zeros([range.len()], (&device, DType::F32)).add(full.slice(range.clone()))
        };
        let align = adam.buffer.param_alignment;
        let blocks = range.start / align..range.end / align;
        let policy = adam.decay_policy;
        let decay = layout.block_flags(|slot| policy.decays(slot.kind))[blocks.clone()].to_vec();
        let tp_rank = state.tp().rank();
        let counted = layout.block_flags(|slot| {
            (slot.placement.dim().is_some() || tp_rank == 0) && !shared_copies.contains(&slot.path)
        })[blocks]
            .to_vec();
        let f32_tensor = |values: Vec<f32>| {
            let len = values.len();
            Tensor::from_data(TensorData::new(values, [len]), (&device, DType::F32))
        };
        let zeros = || Tensor::zeros([range.len()], (&device, DType::F32));
        let experts = match has_experts {
            true => Some(Experts::init(
                model,
                state,
                adam,
                self.data_parallel.use_distributed_optimizer,
                shared_copies,
                self.expert_part_numel,
            )?),
            false => None,
        };
        Ok(DistributedAdamW {
            experts,
            config: DistributedAdamWConfig { adam, ..*self },
            dp: replicas.clone(),
            cp: state.cp().size(),
            model_parallel: state.model_parallel().clone(),
            range_start: range.start,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            master,
            decay: f32_tensor(decay),
            counted: f32_tensor(counted),
            step: f32_tensor(vec![0.0]),
            one: f32_tensor(vec![1.0]),
            zero: f32_tensor(vec![0.0]),
            layout,
            buffer,
            shared_copies: shared_copies.to_vec(),
            partial: Placements::of(model).partial_gradients().to_vec(),
            overlap: None,
            param_gathers: 0,
        })
    }
}

/// A flat f32 buffer of the inner backend.
type InnerFlat<B> = Tensor<<B as AutodiffBackend>::InnerBackend, 1>;

/// What the experts' update shares with the dense one.
struct ExpertStep<B: AutodiffBackend> {
    /// `[1]`: the clip coefficient times the loss scale's inverse.
    grad_factor: InnerFlat<B>,
    /// `[1]`: the overflow flag of a loss-scaled step.
    flag: Option<InnerFlat<B>>,
    sharded: bool,
    /// The parameter gather in buckets ([`DataParallelConfig::overlap_param_gather`]).
    bucketed: Option<usize>,
    model_dtype: DType,
}

/// The AdamW state of one flat range (the dense parameters' or the routed experts'), borrowed
/// for a step: both parts update theirs through [`FlatAdamW::step`].
struct FlatAdamW<'a, B: ModelBackend> {
    master: &'a mut Tensor<B, 1>,
    exp_avg: &'a mut Tensor<B, 1>,
    exp_avg_sq: &'a mut Tensor<B, 1>,
    step: &'a mut Tensor<B, 1>,
    decay: &'a Tensor<B, 1>,
}

impl<B: ModelBackend> FlatAdamW<'_, B> {
    /// One AdamW step of the range ([`AdamWOps::flat_adamw`]): the moments and master weights
    /// replaced by their updates, the step count advanced unless `flag` (a loss-scaled step's
    /// overflow, `[1]`) is set. Returns the updated values in `model_dtype` (the master weights
    /// themselves for f32 models), this rank's range of the parameters.
    fn step(
        self,
        grads: Tensor<B, 1>,
        hyper: &AdamWScalars,
        grad_factor: Tensor<B, 1>,
        flag: Option<Tensor<B, 1>>,
        model_dtype: DType,
    ) -> Tensor<B, 1> {
        let take = |t: &mut Tensor<B, 1>| {
            let device = t.device();
            std::mem::replace(t, Tensor::empty([0], (&device, DType::F32)))
        };
        let found_inf = flag.clone().unwrap_or_else(|| self.step.zeros_like());
        let out = <B as AdamWOps>::flat_adamw(
            FlatAdamWBuffers {
                master: take(self.master),
                grad: grads,
                exp_avg: take(self.exp_avg),
                exp_avg_sq: take(self.exp_avg_sq),
                decay: self.decay.clone(),
                step: self.step.clone(),
                grad_factor,
                found_inf,
            },
            hyper,
            (model_dtype != DType::F32).then_some(model_dtype),
        );
        *self.exp_avg = out.exp_avg;
        *self.exp_avg_sq = out.exp_avg_sq;
        *self.master = out.master.clone();
        *self.step = match flag {
            Some(flag) => self.step.clone() + flag.neg().add_scalar(1.0),
            None => self.step.clone().add_scalar(1.0),
        };
        out.model.unwrap_or(out.master)
    }
}

/// One part of the routed experts of a [`DistributedAdamW`] in a checkpoint: its layout, the
/// range of it this rank holds, and the state of that range. A checkpoint keys the state by
/// parameter, so what it holds does not depend on how the experts were cut into parts.
#[derive(Debug, Clone)]
pub struct ExpertOptimizerState<'a, B: burn::tensor::backend::Backend> {
    /// The part's flat-buffer layout.
    pub layout: &'a BufferLayout,
    /// The range of it this rank holds.
    pub range: std::ops::Range<usize>,
    /// The state of that range.
    pub state: DistributedAdamWState<B>,
}

/// The routed experts of a [`DistributedAdamW`]: their own flat buffers, averaged over the
/// expert-data-parallel group (the ranks that hold the same experts) instead of DP, and
/// sharded over it with the distributed optimizer (Megatron's expert buffers and
/// `expert_data_parallel_group`). A rank's experts can pass 32-bit indices together, so they
/// are cut into parts of whole parameters that each stay below the limit
/// ([`flat_limit`](super::flat_limit)); a step reduces every part, adds their squares into the
/// one global norm, and updates each with the same clip coefficient and overflow flag.
#[derive(Debug, Clone)]
struct Experts<B: AutodiffBackend> {
    expert_dp: ProcessGroup,
    ep: ProcessGroup,
    /// Expert gradients are averaged over expert-DP; times this (`expert_dp / dp = 1 / ep`)
    /// they are the DP average of the loss's gradient, as the dense ones.
    grad_scale: f64,
    /// In buffer order; a single part unless the experts pass
    /// [`DistributedAdamWConfig::expert_part_numel`] together.
    parts: Vec<ExpertPart<B>>,
}

/// One part of the experts: a group of whole parameters with its own flat buffers, shards and
/// the AdamW state of this rank's range of them.
#[derive(Debug, Clone)]
struct ExpertPart<B: AutodiffBackend> {
    layout: BufferLayout,
    buffer: ParamAndGradBuffer<B::InnerBackend>,
    range_start: usize,
    master: Tensor<B::InnerBackend, 1>,
    exp_avg: Tensor<B::InnerBackend, 1>,
    exp_avg_sq: Tensor<B::InnerBackend, 1>,
    decay: Tensor<B::InnerBackend, 1>,
    counted: Tensor<B::InnerBackend, 1>,
    step: Tensor<B::InnerBackend, 1>,
}

impl<B> Experts<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
{
    /// The experts of `model`, cut into parts of at most `limit` elements.
    fn init<M>(
        model: &M,
        state: &ParallelState,
        adam: FlatAdamWConfig,
        sharded: bool,
        shared_copies: &[String],
        limit: usize,
    ) -> crate::Result<Self>
    where
        B: ModelBackend,
        M: AutodiffModule<B> + DeclarePlacements,
    {
        let expert_dp = state.expert_dp().clone();
        let mut config = adam.buffer;
        config.dp_size = expert_dp.size();
        let infos = crate::tensor_parallel::try_param_infos(model)?;
        let all = BufferLayout::new_where(&infos, config, |info| info.placement.is_expert())?;
        let parts = split_at_limit(&all, limit, "--expert-model-parallel-size")?
            .into_iter()
            .map(|ids| {
                let ids: HashSet<ParamId> = ids.into_iter().collect();
                let context = PartContext {
                    state,
                    adam,
                    config,
                    sharded,
                    shared_copies,
                };
                ExpertPart::init(model, &context, &ids)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Self {
            grad_scale: expert_dp.size() as f64 / state.dp().size() as f64,
            expert_dp,
            ep: state.ep().clone(),
            parts,
        })
    }

    /// Each part's gradients averaged over DP (this rank's shard with the distributed
    /// optimizer), and their sum of squares over every expert of the model: each part's
    /// added, then over the expert-DP shards, then over EP (each rank of an EP group holds
    /// other experts).
    fn reduce<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: &GradientsParams,
        bucket: usize,
        sharded: bool,
        align: usize,
    ) -> crate::Result<(Vec<InnerFlat<B>>, InnerFlat<B>)> {
        let mut reduced = Vec::with_capacity(self.parts.len());
        let mut squares: Option<InnerFlat<B>> = None;
        let reduction = PartReduction {
            expert_dp: &self.expert_dp,
            grad_scale: self.grad_scale,
            bucket,
            sharded,
            align,
        };
        for part in &mut self.parts {
            let (part_grads, part_squares) = part.reduce(model, grads, &reduction)?;
            squares = Some(match squares {
                Some(sum) => sum + part_squares,
                None => part_squares,
            });
            reduced.push(part_grads);
        }
        let Some(mut sum_of_squares) = squares else {
            return Err(crate::ConfigError::Invalid(
                "the routed experts' optimizer holds no part".into(),
            )
            .into());
        };
        if sharded {
            sum_of_squares = self.expert_dp.all_reduce(sum_of_squares, ReduceOp::Sum)?;
        }
        let sum_of_squares = self.ep.all_reduce(sum_of_squares, ReduceOp::Sum)?;
        Ok((reduced, sum_of_squares))
    }

    /// The AdamW update of every part's range (`grads` from [`reduce`](Self::reduce)), and
    /// the model with the new expert weights.
    fn update<M: AutodiffModule<B>>(
        &mut self,
        mut model: M,
        grads: Vec<InnerFlat<B>>,
        hyper: &AdamWScalars,
        step: ExpertStep<B>,
    ) -> crate::Result<M> {
        let ExpertStep {
            grad_factor,
            flag,
            sharded,
            bucketed,
            model_dtype,
        } = step;
        if grads.len() != self.parts.len() {
            return Err(crate::ConfigError::Invalid(format!(
                "{} gradients for the experts' {} parts",
                grads.len(),
                self.parts.len()
            ))
            .into());
        }
        for (part, grads) in self.parts.iter_mut().zip(grads) {
            let flat = FlatAdamW {
                master: &mut part.master,
                exp_avg: &mut part.exp_avg,
                exp_avg_sq: &mut part.exp_avg_sq,
                step: &mut part.step,
                decay: &part.decay,
            };
            let updated = flat.step(grads, hyper, grad_factor.clone(), flag.clone(), model_dtype);
            model = write_gathered(
                &part.buffer,
                model,
                updated,
                &self.expert_dp,
                sharded,
                bucketed,
            )?
            .0;
        }
        Ok(model)
    }
}

/// How a step reduces every part of the experts.
struct PartReduction<'a> {
    expert_dp: &'a ProcessGroup,
    /// See [`Experts::grad_scale`].
    grad_scale: f64,
    /// The reduction's bucket size ([`DataParallelConfig::bucket_numel`]).
    bucket: usize,
    sharded: bool,
    /// [`BufferConfig::param_alignment`](crate::distributed::BufferConfig::param_alignment).
    align: usize,
}

/// What every part of the experts is built with.
struct PartContext<'a> {
    state: &'a ParallelState,
    adam: FlatAdamWConfig,
    /// The buffers' layout settings, `dp_size` the expert-DP size.
    config: crate::distributed::BufferConfig,
    sharded: bool,
    shared_copies: &'a [String],
}

impl<B> ExpertPart<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
{
    /// The part of `model`'s experts `ids`: its buffers, its master weights copied from the
    /// parameters (this rank's shard of them with the distributed optimizer), moments zero.
    fn init<M>(model: &M, context: &PartContext, ids: &HashSet<ParamId>) -> crate::Result<Self>
    where
        B: ModelBackend,
        M: AutodiffModule<B> + DeclarePlacements,
    {
        let PartContext {
            state,
            adam,
            config,
            sharded,
            shared_copies,
        } = *context;
        let expert_dp = state.expert_dp();
        let mut buffer = ParamAndGradBuffer::from_module_where(model, config, |info| {
            info.placement.is_expert() && ids.contains(&info.id)
        })?;
        let layout = buffer.layout().clone();
        let range = if sharded {
            layout.shard(expert_dp.rank())
        } else {
            0..layout.numel()
        };
        let full = buffer.take_main_params();
        check_same_parameters(&full, expert_dp)?;
        let device = full.device();
        let master = if range.len() == layout.numel() {
            full
        } else {
            Tensor::zeros([range.len()], (&device, DType::F32)).add(full.slice(range.clone()))
        };
        let align = config.param_alignment;
        let blocks = range.start / align..range.end / align;
        let policy = adam.decay_policy;
        let decay = layout.block_flags(|slot| policy.decays(slot.kind))[blocks.clone()].to_vec();
        // Replicated over TP (no expert tensor parallelism): counted on TP rank 0.
        let tp_rank = state.tp().rank();
        let counted = layout
            .block_flags(|_| tp_rank == 0)
            .into_iter()
            .zip(layout.block_flags(|slot| !shared_copies.contains(&slot.path)))
            .map(|(a, b)| a * b)
            .collect::<Vec<_>>()[blocks]
            .to_vec();
        let f32_tensor = |values: Vec<f32>| {
            let len = values.len();
            Tensor::from_data(TensorData::new(values, [len]), (&device, DType::F32))
        };
        let zeros = || Tensor::zeros([range.len()], (&device, DType::F32));
        Ok(Self {
            layout,
            buffer,
            range_start: range.start,
            master,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            decay: f32_tensor(decay),
            counted: f32_tensor(counted),
            step: f32_tensor(vec![0.0]),
        })
    }

    /// This part's gradients averaged over DP (this rank's shard with the distributed
    /// optimizer), and the sum of the squares of those counted in the norm on this rank.
    fn reduce<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: &GradientsParams,
        how: &PartReduction,
    ) -> crate::Result<(InnerFlat<B>, InnerFlat<B>)> {
        self.buffer.gather_grads(model, grads)?;
        let full = self.buffer.grads();
        self.buffer.release_grads();
        let reduced = if how.sharded {
            reduce_scatter_grads(full, &self.layout, how.expert_dp, how.bucket)?
        } else {
            all_reduce_grads(full, &self.layout, how.expert_dp, how.bucket)?
        };
        let reduced = reduced.mul_scalar(how.grad_scale);
        let blocks = self.decay.dims()[0];
        let sum_of_squares = (reduced
            .clone()
            .reshape([blocks, how.align])
            .square()
            .sum_dim(1)
            * self.counted.clone().reshape([blocks, 1]))
        .sum();
        Ok((reduced, sum_of_squares))
    }

    /// The range of the part's buffers this rank holds.
    fn range(&self) -> std::ops::Range<usize> {
        self.range_start..self.range_start + self.master.dims()[0]
    }
}

/// `model` with the parameters of `buffer` replaced by the updated values: `updated` itself
/// (this rank updated the whole buffer) or, when `sharded`, every rank's shard of them
/// all-gathered over `dp`, in one gather or, with `bucketed` (the bucket size), in buckets in
/// the next forward pass's order
/// ([`all_gather_params`](crate::distributed::all_gather_params)). Also returns the number
/// of all-gathers issued.
fn write_gathered<B, M>(
    buffer: &ParamAndGradBuffer<B::InnerBackend>,
    model: M,
    updated: InnerFlat<B>,
    dp: &ProcessGroup,
    sharded: bool,
    bucketed: Option<usize>,
) -> crate::Result<(M, usize)>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
    M: AutodiffModule<B>,
{
    if !sharded || dp.size() == 1 {
        return Ok((buffer.write_params(model, updated), 0));
    }
    match bucketed {
        Some(bucket_numel) => {
            let gathered = all_gather_params(updated, buffer.layout(), dp, bucket_numel)?;
            let gathers = gathered.buckets();
            Ok((
                buffer.write_params_with(model, |slot| gathered.param(slot)),
                gathers,
            ))
        }
        None => {
            let params = dp.all_gather(updated, 0)?;
            Ok((buffer.write_params(model, params), 1))
        }
    }
}

/// Refuses replicas that start from different parameters, which would train silently
/// wrong: the ranks' sums of `params` and of their squares must agree bit for bit over `dp`.
/// The sums are taken in a fixed order ([`fixed_order_sum`]): Burn's `sum` may add with
/// atomics on a GPU, whose order, and so last bits, differ between equal replicas (found on
/// two H100s). One small all-reduce pair and one host read, at initialisation only.
fn check_same_parameters<B: ModelBackend>(
    params: &Tensor<B, 1>,
    dp: &ProcessGroup,
) -> crate::Result<()> {
    if dp.size() == 1 {
        return Ok(());
    }
    let sums = Tensor::cat(
        vec![
            fixed_order_sum(params.clone()),
            fixed_order_sum(params.clone() * params.clone()),
        ],
        0,
    );
    let highest = dp.all_reduce(sums.clone(), ReduceOp::Max)?;
    let lowest = dp.all_reduce(sums, ReduceOp::Min)?;
    let spread = (highest - lowest).abs().max();
    let spread: f64 = crate::error::read_scalar(spread, || {
        "the spread of the data-parallel replicas' parameter sums".to_string()
    })
    .map_err(|e| e.on_rank(dp.global_rank()))?
    .elem();
    if spread == 0.0 {
        return Ok(());
    }
    Err(crate::ConfigError::Invalid(format!(
        "data-parallel rank {} of {} starts from other parameters than its replicas (their sums \
         differ by {spread:e}): build every rank's model from the same seed or checkpoint. Burn \
         initialises parameters lazily and each clone of an uninitialised module on its own, \
         so materialise a module (e.g. `m.clone().load_record(m.into_record())`) before \
         copying it for several ranks, and give each thread rank its own copy with \
         `m.clone().fork(&device)`",
        dp.rank(),
        dp.size()
    ))
    .into())
}

/// `[Σ x]` added in an order fixed by the length alone, so that equal tensors give equal bits
/// on every rank: [`BiasOps::bias_gradient`]'s deterministic column sums over 1 024
/// columns, then over those columns, plus the tail that does not fill a row.
fn fixed_order_sum<B: ModelBackend>(x: Tensor<B, 1>) -> Tensor<B, 1> {
    const COLUMNS: usize = 1024;
    let n = x.dims()[0];
    let whole = n / COLUMNS * COLUMNS;
    let column_sum =
        |t: Tensor<B, 1>, rows: usize, columns: usize| B::bias_gradient(t.reshape([rows, columns]));
    let mut parts = Vec::new();
    if whole > 0 {
        let columns = column_sum(x.clone().narrow(0, 0, whole), whole / COLUMNS, COLUMNS);
        parts.push(column_sum(columns, COLUMNS, 1));
    }
    if n > whole {
        parts.push(column_sum(
            x.clone().narrow(0, whole, n - whole),
            n - whole,
            1,
        ));
    }
    match parts.len() {
        0 => x.sum(),
        // At most two values: their sum is the same in either order.
        _ => Tensor::cat(parts, 0).sum(),
    }
}

/// Bytes one rank holds for training, by role (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OptimizerMemory {
    /// The model's parameters (its dtype), counted from the module.
    pub params: usize,
    /// The flat fp32 gradient buffer (allocated for the optimizer step only, so not held
    /// during the forward and backward passes).
    pub grads: usize,
    /// The fp32 master weights of the rank's range.
    pub main_params: usize,
    /// The first moments of the rank's range.
    pub exp_avg: usize,
    /// The second moments of the rank's range.
    pub exp_avg_sq: usize,
}

impl OptimizerMemory {
    /// The sum of every role.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.main_params + self.exp_avg + self.exp_avg_sq
    }

    /// The optimizer's state: master weights and moments.
    pub fn optimizer_state(&self) -> usize {
        self.main_params + self.exp_avg + self.exp_avg_sq
    }
}

/// A rank's optimizer state over its [`range`](DistributedAdamW::range) of the flat buffers,
/// each `[range.len()]` f32: what a checkpoint stores
/// ([`distributed_adamw_state`](crate::checkpointing::distributed_adamw_state)).
#[derive(Debug, Clone)]
pub struct DistributedAdamWState<B: burn::tensor::backend::Backend> {
    /// The fp32 master weights.
    pub main_params: Tensor<B, 1>,
    /// The first moments.
    pub exp_avg: Tensor<B, 1>,
    /// The second moments.
    pub exp_avg_sq: Tensor<B, 1>,
    /// Steps taken.
    pub step: u64,
}

/// What a step returns.
#[derive(Debug, Clone)]
pub struct DistributedStep<M, B: burn::tensor::backend::Backend> {
    /// The updated model.
    pub model: M,
    /// The global gradient norm before clipping (the loss scale divided out), `[1]` f32 on
    /// the device.
    pub grad_norm: Tensor<B, 1>,
    /// With [`DistributedAdamW::step_scaled`], the overflow flag: set, the step was skipped on
    /// every rank. Read it ([`FoundInf::read`]) only when the host needs it.
    pub found_inf: Option<FoundInf<B>>,
}

/// AdamW over a data-parallel replica's flat buffers, with its state for the whole buffer or,
/// with the distributed optimizer, for the rank's shard only (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct DistributedAdamW<B: AutodiffBackend> {
    config: DistributedAdamWConfig,
    /// The ranks holding replicas of the dense parameters: the DP group, or under context
    /// parallelism the DP × CP group.
    dp: ProcessGroup,
    /// The context-parallel size: the gradients averaged over `dp` are multiplied by it (each
    /// CP rank's gradient is its tokens' share: summed over CP, averaged over DP).
    cp: usize,
    model_parallel: ProcessGroup,
    layout: BufferLayout,
    /// The gradient buffer (`[numel]` f32); its master weights are moved to `master`.
    buffer: ParamAndGradBuffer<B::InnerBackend>,
    /// First element of the rank's range in the buffers.
    range_start: usize,
    /// `[range]` f32 master weights.
    master: Tensor<B::InnerBackend, 1>,
    /// `[range]` f32 first moments.
    exp_avg: Tensor<B::InnerBackend, 1>,
    /// `[range]` f32 second moments.
    exp_avg_sq: Tensor<B::InnerBackend, 1>,
    /// `[range / param_alignment]` f32 weight-decay flags.
    decay: Tensor<B::InnerBackend, 1>,
    /// `[range / param_alignment]` f32: 1 where the block counts in the global norm.
    counted: Tensor<B::InnerBackend, 1>,
    /// `[1]` f32 steps taken (skipped ones not counted).
    step: Tensor<B::InnerBackend, 1>,
    one: Tensor<B::InnerBackend, 1>,
    zero: Tensor<B::InnerBackend, 1>,
    /// The reduction started inside the backward pass, once
    /// [`overlap_hook`](Self::overlap_hook) made it.
    overlap: Option<Arc<GradReduceOverlap<B>>>,
    /// Paths of copies of parameters held on another rank (see
    /// [`DistributedAdamWConfig::init`]).
    shared_copies: Vec<String>,
    /// Parameters whose gradients the schedule sums over TP after the backward pass
    /// ([`Placements::partial_gradients`]: the schedules defer these sums whatever the
    /// model's layers say).
    partial: Vec<ParamId>,
    /// The routed experts' buffers and state, if the model has MoE layers: reduced over the
    /// expert-data-parallel group (the dense buffer leaves them out), in one or more parts.
    experts: Option<Experts<B>>,
    /// All-gathers of the dense parameters in the last step (see
    /// [`param_gathers`](Self::param_gathers)).
    param_gathers: usize,
}

impl<B> DistributedAdamW<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
{
    /// The settings (`adam.buffer.dp_size` is the DP size, DP × CP under context
    /// parallelism).
    pub fn config(&self) -> &DistributedAdamWConfig {
        &self.config
    }

    /// This rank's number in the world (for errors).
    pub fn global_rank(&self) -> usize {
        self.dp.global_rank()
    }

    /// The flat buffers' layout.
    pub fn layout(&self) -> &BufferLayout {
        &self.layout
    }

    /// The range of the buffers whose master weights and moments this rank holds.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.range_start..self.range_start + self.master.dims()[0]
    }

    /// The fp32 master weights of [`range`](Self::range).
    pub fn main_params(&self) -> Tensor<B::InnerBackend, 1> {
        self.master.clone()
    }

    /// Steps taken, `[1]` f32 on the device (skipped steps not counted).
    pub fn step_count(&self) -> Tensor<B::InnerBackend, 1> {
        self.step.clone()
    }

    /// The state of the rank's range (reads the step count to the host: a device error is a
    /// [`DeviceError`](crate::error::DeviceError)).
    pub fn state(
        &self,
    ) -> core::result::Result<DistributedAdamWState<B::InnerBackend>, crate::error::DeviceError>
    {
        let step = read_step(&self.step, "the distributed optimizer's step count")?;
        Ok(DistributedAdamWState {
            main_params: self.master.clone(),
            exp_avg: self.exp_avg.clone(),
            exp_avg_sq: self.exp_avg_sq.clone(),
            step,
        })
    }

    /// Continues from `state` (a checkpoint's, for this rank's range): each tensor must be
    /// `[range.len()]`. The model's parameters must hold the same values (load both from one
    /// checkpoint): the next step starts from the master weights.
    pub fn load_state(
        &mut self,
        state: DistributedAdamWState<B::InnerBackend>,
    ) -> core::result::Result<(), crate::error::ConfigError> {
        let len = self.range().len();
        for (name, t) in [
            ("main_params", &state.main_params),
            ("exp_avg", &state.exp_avg),
            ("exp_avg_sq", &state.exp_avg_sq),
        ] {
            if t.dims()[0] != len {
                return Err(crate::error::ConfigError::Invalid(format!(
                    "the loaded {name} has {} elements, this rank's range {:?} has {len}",
                    t.dims()[0],
                    self.range()
                )));
            }
        }
        let device = self.master.device();
        let f32_on_device = |t: Tensor<B::InnerBackend, 1>| t.cast(DType::F32).to_device(&device);
        self.master = f32_on_device(state.main_params);
        self.exp_avg = f32_on_device(state.exp_avg);
        self.exp_avg_sq = f32_on_device(state.exp_avg_sq);
        self.step = Tensor::from_data(
            TensorData::new(vec![state.step as f32], [1]),
            (&device, DType::F32),
        );
        Ok(())
    }

    /// The parts of the routed experts, in buffer order (none without MoE layers; one unless
    /// a rank's experts pass 32-bit indices together, see [`flat_limit`](super::flat_limit)):
    /// each part's layout, the range of it this rank holds, and the state of that range (reads
    /// each part's step count to the host: a device error is a
    /// [`DeviceError`](crate::error::DeviceError)).
    #[allow(clippy::type_complexity)]
    pub fn expert_states(
        &self,
    ) -> core::result::Result<
        Vec<ExpertOptimizerState<'_, B::InnerBackend>>,
        crate::error::DeviceError,
    > {
        let Some(experts) = self.experts.as_ref() else {
            return Ok(Vec::new());
        };
        experts
            .parts
            .iter()
            .map(|part| {
                let step = read_step(&part.step, "the distributed optimizer's expert step count")?;
                Ok(ExpertOptimizerState {
                    layout: &part.layout,
                    range: part.range(),
                    state: DistributedAdamWState {
                        main_params: part.master.clone(),
                        exp_avg: part.exp_avg.clone(),
                        exp_avg_sq: part.exp_avg_sq.clone(),
                        step,
                    },
                })
            })
            .collect()
    }

    /// [`load_state`](Self::load_state) for part `part` of the routed experts (its index in
    /// [`expert_states`](Self::expert_states)).
    pub fn load_expert_state(
        &mut self,
        part: usize,
        state: DistributedAdamWState<B::InnerBackend>,
    ) -> core::result::Result<(), crate::error::ConfigError> {
        let parts = self.experts.as_ref().map_or(0, |e| e.parts.len());
        let Some(experts) = self.experts.as_mut().and_then(|e| e.parts.get_mut(part)) else {
            return Err(crate::error::ConfigError::Invalid(format!(
                "the experts' part {part} does not exist: this optimizer has {parts}"
            )));
        };
        let len = experts.master.dims()[0];
        for (name, t) in [
            ("main_params", &state.main_params),
            ("exp_avg", &state.exp_avg),
            ("exp_avg_sq", &state.exp_avg_sq),
        ] {
            if t.dims()[0] != len {
                return Err(crate::error::ConfigError::Invalid(format!(
                    "the loaded experts' {name} (part {part}) has {} elements, this rank's \
                     range has {len}",
                    t.dims()[0]
                )));
            }
        }
        let device = experts.master.device();
        let f32_on_device = |t: Tensor<B::InnerBackend, 1>| t.cast(DType::F32).to_device(&device);
        experts.master = f32_on_device(state.main_params);
        experts.exp_avg = f32_on_device(state.exp_avg);
        experts.exp_avg_sq = f32_on_device(state.exp_avg_sq);
        experts.step = Tensor::from_data(
            TensorData::new(vec![state.step as f32], [1]),
            (&device, DType::F32),
        );
        Ok(())
    }

    /// The hook that starts this optimizer's data-parallel gradient reduction inside the
    /// backward pass, bucket by bucket as the layers' gradients become final (Megatron's
    /// `--overlap-grad-reduce`, see [`overlap`](crate::distributed::overlap)). Install it in the model
    /// (`GptModel::set_backward_hook`) whose backward pass comes next; `model` is that model.
    /// From then on [`step`](Self::step) takes the gradients the hook reduced and those of
    /// `grads` it did not take, and keeps the hook pointed at the parameters it returns. The
    /// losses, norms and parameters are the same as without the hook, bit for bit. With
    /// gradient accumulation, `microbatches` backward passes make a step: the hook sums them
    /// in f32 and only the last one communicates. Calling it again returns the same hook.
    pub fn overlap_hook<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        microbatches: usize,
    ) -> Arc<dyn BackwardHook>
    where
        B: AutodiffBackend<Gradients = Gradients>,
    {
        let overlap = self.overlap.get_or_insert_with(|| {
            Arc::new(GradReduceOverlap::new(
                &self.layout,
                &self.dp,
                self.config.data_parallel.bucket_numel,
                self.config.data_parallel.use_distributed_optimizer,
                self.config.data_parallel.gradient_accumulation_fusion,
                microbatches,
                AfterBackward {
                    shared_copies: &self.shared_copies,
                    partial: &self.partial,
                },
                &self.master.device(),
            ))
        });
        overlap.arm(model);
        overlap.clone()
    }

    /// Whether the reduction overlaps the backward pass: an [`overlap_hook`](Self::overlap_hook)
    /// exists and the DP group's collectives run on the device (NCCL with collective checks
    /// off). Elsewhere the hook copies the gradients during the backward pass and the
    /// collectives run after it.
    pub fn overlaps_backward(&self) -> bool {
        self.overlap.as_ref().is_some_and(|o| o.overlaps())
    }

    /// Parameter elements whose gradients the overlap hook took inside the last step's
    /// backward pass (0 without a hook).
    pub fn hooked_numel(&self) -> usize {
        self.overlap.as_ref().map_or(0, |o| o.hooked_numel())
    }

    /// Parameter elements whose gradients the weight-gradient GEMMs added straight into the
    /// hook's f32 buffer in the last step's first backward pass (0 without the hook).
    pub fn fused_numel(&self) -> usize {
        self.overlap.as_ref().map_or(0, |o| o.fused_numel())
    }

    /// All-gathers the last step issued for the dense parameters: with the distributed
    /// optimizer over more than one DP rank, 1, or with
    /// [`DataParallelConfig::overlap_param_gather`] one per bucket
    /// ([`param_gather_columns`](crate::distributed::param_gather_columns)); else 0.
    pub fn param_gathers(&self) -> usize {
        self.param_gathers
    }

    /// One step at learning rate `lr` with this rank's gradients `grads` of `model` (the
    /// gradient of the mean loss of its microbatches): reduce over DP, clip, update, gather.
    /// Every rank of the world must call it. Returns the updated model and the global norm.
    pub fn step<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: &GradientsParams,
    ) -> crate::Result<DistributedStep<M, B::InnerBackend>> {
        self.step_inner(lr, model, grads, None)
    }

    /// [`step`](Self::step) for gradients of the loss times `scaler`'s scale
    /// ([`forward_backward_scaled`](crate::pipeline_parallel::forward_backward_scaled)), with
    /// Megatron's overflow handling, all on the device (see the [module docs](self)): the
    /// scale is divided out of the norm and, in the kernel, out of the gradients; if the
    /// global norm is not finite (a NaN or ±∞ in any rank's gradients, or squares that
    /// overflow: the scale is too large) every rank skips the step, leaving its parameters,
    /// master weights, moments and step count as they were; then the scaler is
    /// [updated](DynamicLossScaler::update) (backed off on an overflow, grown after its
    /// window). The returned [`DistributedStep::found_inf`] holds the flag; the norm is not
    /// finite on a skipped step.
    pub fn step_scaled<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: &GradientsParams,
        scaler: &mut DynamicLossScaler<B::InnerBackend>,
    ) -> crate::Result<DistributedStep<M, B::InnerBackend>> {
        let out = self.step_inner(lr, model, grads, Some(scaler.scale()))?;
        if let Some(found) = &out.found_inf {
            scaler.update(found);
        }
        Ok(out)
    }

    fn step_inner<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads_in: &GradientsParams,
        loss_scale: Option<Tensor<B::InnerBackend, 1>>,
    ) -> crate::Result<DistributedStep<M, B::InnerBackend>> {
        let bucket = self.config.data_parallel.bucket_numel;
        let sharded = self.config.data_parallel.use_distributed_optimizer;
        let grads = match &self.overlap {
            Some(overlap) => overlap.finish(&model, grads_in)?,
            None => {
                check_indexable(
                    self.layout.numel(),
                    "the dense parameters' flat gradient buffer of this rank",
                    "--overlap-grad-reduce (it reduces bucket by bucket), or --pipeline-model-parallel-size",
                )?;
                self.buffer.gather_grads(&model, grads_in)?;
                let full = self.buffer.grads();
                self.buffer.release_grads();
                if sharded {
                    reduce_scatter_grads(full, &self.layout, &self.dp, bucket)?
                } else {
                    all_reduce_grads(full, &self.layout, &self.dp, bucket)?
                }
            }
        };
        // Averaged over DP × CP: times CP, the CP ranks' shares summed and DP averaged.
        let grads = match self.cp {
            1 => grads,
            cp => grads.mul_scalar(cp as f64),
        };

        let align = self.config.adam.buffer.param_alignment;
        let blocks = self.decay.dims()[0];
        let mut sum_of_squares = (grads.clone().reshape([blocks, align]).square().sum_dim(1)
            * self.counted.clone().reshape([blocks, 1]))
        .sum();
        if sharded {
            sum_of_squares = self.dp.all_reduce(sum_of_squares, ReduceOp::Sum)?;
        }
        let expert_grads = match self.experts.as_mut() {
            Some(experts) => {
                let (grads, squares) = experts.reduce(&model, grads_in, bucket, sharded, align)?;
                sum_of_squares = sum_of_squares + squares;
                Some(grads)
            }
            None => None,
        };
        let norm = self
            .model_parallel
            .all_reduce(sum_of_squares, ReduceOp::Sum)?
            .sqrt();
        // With a power-of-two scale, dividing it out of the norm is exact.
        let (grad_norm, unscale, found_inf) = match loss_scale {
            Some(scale) => {
                let unscale = scale.recip();
                let grad_norm = norm * unscale.clone();
                let overflow = grad_norm.clone().is_finite().bool_not();
                let flag = self.zero.clone().mask_fill(overflow, 1.0);
                (grad_norm, Some(unscale), Some(FoundInf::new(flag)))
            }
            None => (norm, None, None),
        };
        let clip = self
            .config
            .clip_grad
            .map(|max_norm| clip_coefficient(grad_norm.clone(), max_norm));
        let grad_factor = match (clip, unscale) {
            (Some(clip), Some(unscale)) => clip * unscale,
            (Some(factor), None) | (None, Some(factor)) => factor,
            (None, None) => self.one.clone(),
        };
        let flag = found_inf.as_ref().map(FoundInf::flag);
        let (grad_factor_experts, flag_experts) = (grad_factor.clone(), flag.clone());

        let a = &self.config.adam;
        let hyper = AdamWScalars::new(lr, a.beta_1, a.beta_2, a.epsilon, a.weight_decay, align);
        let model_dtype = self.buffer.model_dtype();
        let flat = FlatAdamW {
            master: &mut self.master,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
            step: &mut self.step,
            decay: &self.decay,
        };
        let updated = flat.step(grads, &hyper, grad_factor, flag, model_dtype);
        let bucketed = self
            .config
            .data_parallel
            .overlap_param_gather
            .then_some(bucket);
        let (mut model, gathers) =
            write_gathered(&self.buffer, model, updated, &self.dp, sharded, bucketed)?;
        self.param_gathers = gathers;
        if let (Some(experts), Some(expert_grads)) = (self.experts.as_mut(), expert_grads) {
            let step = ExpertStep {
                grad_factor: grad_factor_experts,
                flag: flag_experts,
                sharded,
                bucketed,
                model_dtype,
            };
            model = experts.update(model, expert_grads, &hyper, step)?;
        }
        if let Some(overlap) = &self.overlap {
            overlap.arm(&model);
        }
        Ok(DistributedStep {
            model,
            grad_norm,
            found_inf,
        })
    }

    /// The bytes this rank holds for `model` (its parameters) and the optimizer (gradient
    /// buffers, master weights, moments: the dense parameters' and every part of the routed
    /// experts'), from the tensors' shapes and dtypes. With f32 parameters and no sharding
    /// the parameters are views of the master weights and are not counted twice.
    pub fn memory<M: Module<B>>(&self, model: &M) -> OptimizerMemory {
        struct Bytes(usize);
        impl<B: AutodiffBackend> ModuleVisitor<B> for Bytes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let value = param.val();
                self.0 += value.shape().num_elements() * value.dtype().size();
            }
        }
        let mut params = Bytes(0);
        model.visit(&mut params);
        let bytes = |t: &Tensor<B::InnerBackend, 1>| t.dims()[0] * t.dtype().size();
        let views = !self.config.data_parallel.use_distributed_optimizer
            && self.buffer.model_dtype() == DType::F32;
        let mut memory = OptimizerMemory {
            params: params.0,
            grads: 4 * self.layout.numel(),
            main_params: if views { 0 } else { bytes(&self.master) },
            exp_avg: bytes(&self.exp_avg),
            exp_avg_sq: bytes(&self.exp_avg_sq),
        };
        for part in self.experts.iter().flat_map(|e| &e.parts) {
            memory.grads += 4 * part.layout.numel();
            memory.main_params += if views { 0 } else { bytes(&part.master) };
            memory.exp_avg += bytes(&part.exp_avg);
            memory.exp_avg_sq += bytes(&part.exp_avg_sq);
        }
        memory
    }
}

/// A `[1]` f32 step count on the host, as an integer; a device error names `what`.
fn read_step<B: burn::tensor::backend::Backend>(
    step: &Tensor<B, 1>,
    what: &str,
) -> core::result::Result<u64, crate::error::DeviceError> {
    let step: f32 =
        crate::error::read_scalar(step.clone().cast(DType::F32), || what.to_string())?.elem();
    Ok(step as u64)
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Tensor, TensorData};

    use super::fixed_order_sum;

    /// The fixed-order sum is the sum, at lengths below, at and around one row of columns.
    #[test]
    fn fixed_order_sum_is_the_sum() {
        for n in [0usize, 1, 1023, 1024, 1025, 5000] {
            // Small integers: every order of adding them is exact in f32.
            let values: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32) - 50.0).collect();
            let want: f32 = values.iter().sum();
            let x = Tensor::<NdArray<f32>, 1>::from_data(
                TensorData::new(values, [n]),
                &Default::default(),
            );
            let got: f32 = fixed_order_sum(x).into_scalar();
            assert_eq!(got, want, "length {n}");
        }
    }
}
