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
//! 4. [`AdamWOps::flat_adamw`](crate::ops::adamw::AdamWOps::flat_adamw) updates the fp32
//!    master weights and moments of the rank's range (the shard, or the whole buffer), one
//!    kernel on CubeCL backends;
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
//! # Parts below 32-bit indices, and routed experts
//! GPU kernels index a tensor's elements with 32-bit integers
//! ([`flat_limit`](super::flat_limit)). Where a rank's dense parameters would pass
//! [`MAX_FLAT_NUMEL`] elements in one flat buffer (Llama-3 8B's 8.03 billion at DP 4, or 16 of
//! its layers on one GPU), they are cut into parts of whole parameters
//! ([`flat_parts`](super::flat_parts)), each with its own buffers, buckets, shards and state;
//! steps 1, 2, 4 and 5 run part by part, and step 3 adds every part's squares into the one
//! norm. The experts of MoE layers have flat buffers of their own, averaged over the
//! expert-data-parallel group (the ranks holding the same experts), sharded over it and cut
//! into parts the same way (32 experts of 3 × 2048 × 1408 in each of 16 layers: 4.43 billion
//! elements); their squares join the one global norm, and they are updated with the dense
//! parameters' clip coefficient and overflow flag; with an
//! [`overlap_hook`](DistributedAdamW::overlap_hook) each of their parts has its own hook too.
//! Only one parameter whose own buffer passes the limit is refused, naming it. With one part,
//! the common case, the step is what it was before the cut existed, bit for bit.

use std::sync::Arc;

use burn::config::Config;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::{ParallelState, ReduceOp};

use super::flat_limit::MAX_FLAT_NUMEL;
use super::flat_parts::{
    DistributedAdamWState, FlatPart, FlatParts, PartContext, PartKind, PartOptimizerState,
    PartReduction, PartStep,
};
use super::{DynamicLossScaler, FlatAdamWConfig, FoundInf, clip_coefficient};
use crate::ModelBackend;
use crate::distributed::GradReduceOverlap;
use crate::distributed::grad_reduction::DataParallelConfig;
use crate::distributed::overlap::{AfterBackward, PartsOverlap};
use crate::ops::BackwardHook;
use crate::ops::adamw::AdamWScalars;
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
    /// The most elements of one part of a flat buffer, the dense parameters' and the routed
    /// experts' ([`MAX_FLAT_NUMEL`], see [`flat_limit`](super::flat_limit)); lowered only by
    /// tests, so that a tiny model's buffers take several parts.
    #[doc(hidden)]
    #[config(default = "MAX_FLAT_NUMEL")]
    pub part_numel: usize,
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
        if !(1..=MAX_FLAT_NUMEL).contains(&self.part_numel) {
            return Err(crate::error::ConfigError::Invalid(format!(
                "part_numel ({}) must be in 1..={MAX_FLAT_NUMEL}",
                self.part_numel
            )));
        }
        Ok(())
    }

    /// The optimizer of this rank's `model` (one model chunk) in the layout `state`: buffers
    /// laid out from its parameters (cut into parts below 32-bit indices where they would
    /// pass them) and cut into `state.dp()`-size shards (`state.dp_cp()` under context
    /// parallelism: see the [module docs](self)), the master weights of the rank's range
    /// copied from the parameters, the moments zero. `shared_copies` are paths of parameters
    /// counted in the norm on another rank (a tied embedding's last-stage copy,
    /// [`shared_copies`](crate::optimizer::shared_copies)). Every DP rank must start from the
    /// same parameters (our initialisation depends only on the seed and the TP layout). A
    /// parameter whose own flat buffer would pass [`MAX_FLAT_NUMEL`] is refused, naming it
    /// and the option that makes it smaller.
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
        let context = PartContext {
            replicas,
            tp_rank: state.tp().rank(),
            adam,
            sharded: self.data_parallel.use_distributed_optimizer,
            shared_copies,
            part_numel: self.part_numel,
        };
        // Averaged over DP × CP: times CP, the CP ranks' shares summed and DP averaged.
        let cp = state.cp().size() as f64;
        let dense = FlatParts::init(model, PartKind::Dense, &context, cp, None)?;
        let experts = match has_experts {
            true => {
                let expert_dp = state.expert_dp();
                let mut adam = adam;
                adam.buffer.dp_size = expert_dp.size();
                let context = PartContext {
                    replicas: expert_dp,
                    adam,
                    ..context
                };
                // Averaged over expert DP; times `expert_dp / dp = 1 / ep` they are the DP
                // average of the loss's gradient, as the dense ones.
                let grad_scale = expert_dp.size() as f64 / state.dp().size() as f64;
                let ep = Some(state.ep().clone());
                Some(FlatParts::init(
                    model,
                    PartKind::Experts,
                    &context,
                    grad_scale,
                    ep,
                )?)
            }
            false => None,
        };
        let device = dense.parts()[0].master().device();
        let f32_scalar = |value: f32| {
            Tensor::from_data(TensorData::new(vec![value], [1]), (&device, DType::F32))
        };
        Ok(DistributedAdamW {
            config: DistributedAdamWConfig { adam, ..*self },
            model_parallel: state.model_parallel().clone(),
            one: f32_scalar(1.0),
            zero: f32_scalar(0.0),
            dense,
            experts,
            shared_copies: shared_copies.to_vec(),
            partial: Placements::of(model).partial_gradients().to_vec(),
            overlap: None,
            param_gathers: 0,
        })
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
    model_parallel: burn_megatron_dist::ProcessGroup,
    /// The dense parameters, averaged over DP (DP × CP under context parallelism), in one or
    /// more parts.
    dense: FlatParts<B>,
    /// The routed experts, if the model has MoE layers: reduced over the expert-data-parallel
    /// group (the dense buffers leave them out), in one or more parts.
    experts: Option<FlatParts<B>>,
    one: Tensor<B::InnerBackend, 1>,
    zero: Tensor<B::InnerBackend, 1>,
    /// The dense parameters' reduction started inside the backward pass (one hook a part),
    /// once [`overlap_hook`](Self::overlap_hook) made it.
    overlap: Option<Arc<PartsOverlap<B>>>,
    /// Paths of copies of parameters held on another rank (see
    /// [`DistributedAdamWConfig::init`]).
    shared_copies: Vec<String>,
    /// Parameters whose gradients the schedule sums over TP after the backward pass
    /// ([`Placements::partial_gradients`]: the schedules defer these sums whatever the
    /// model's layers say).
    partial: Vec<ParamId>,
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
        self.dense.replicas().global_rank()
    }

    /// Steps taken, `[1]` f32 on the device (skipped steps not counted): every part counts
    /// the same steps.
    pub fn step_count(&self) -> Tensor<B::InnerBackend, 1> {
        self.dense.parts()[0].step_count().clone()
    }

    /// The parts of the dense parameters' flat buffers, in buffer order (one unless they
    /// pass 32-bit indices together, see [`flat_limit`](super::flat_limit)): each part's
    /// layout, the range of it this rank holds (its shard with the distributed optimizer, else
    /// all of it), and the state of that range (reads each part's step count to the host: a
    /// device error is a [`DeviceError`](crate::error::DeviceError)).
    pub fn dense_states(
        &self,
    ) -> core::result::Result<Vec<PartOptimizerState<'_, B::InnerBackend>>, crate::error::DeviceError>
    {
        self.dense.states()
    }

    /// The parts of the routed experts, in buffer order (none without MoE layers), as
    /// [`dense_states`](Self::dense_states) gives the dense parameters'.
    pub fn expert_states(
        &self,
    ) -> core::result::Result<Vec<PartOptimizerState<'_, B::InnerBackend>>, crate::error::DeviceError>
    {
        self.experts
            .as_ref()
            .map_or(Ok(Vec::new()), FlatParts::states)
    }

    /// Continues part `part` of the dense parameters (its index in
    /// [`dense_states`](Self::dense_states)) from `state` (a checkpoint's, for this rank's
    /// range of the part): each tensor must be `[range.len()]`. The model's parameters must
    /// hold the same values (load both from one checkpoint): the next step starts from the
    /// master weights.
    pub fn load_dense_state(
        &mut self,
        part: usize,
        state: DistributedAdamWState<B::InnerBackend>,
    ) -> core::result::Result<(), crate::error::ConfigError> {
        self.dense.load_state(part, state)
    }

    /// [`load_dense_state`](Self::load_dense_state) for part `part` of the routed experts
    /// (its index in [`expert_states`](Self::expert_states)).
    pub fn load_expert_state(
        &mut self,
        part: usize,
        state: DistributedAdamWState<B::InnerBackend>,
    ) -> core::result::Result<(), crate::error::ConfigError> {
        match self.experts.as_mut() {
            Some(experts) => experts.load_state(part, state),
            None => Err(crate::error::ConfigError::Invalid(format!(
                "the routed experts' part {part} does not exist: this optimizer has none"
            ))),
        }
    }

    /// The hook that starts this optimizer's data-parallel gradient reduction inside the
    /// backward pass, bucket by bucket as the layers' gradients become final (Megatron's
    /// `--overlap-grad-reduce`, see [`overlap`](crate::distributed::overlap)), one
    /// [`GradReduceOverlap`] for each part of the dense parameters and each part of the routed
    /// experts (reduced over expert DP, their weight-gradient products accumulating in the
    /// part's f32 buffer as the dense layers' do). Install it in the model
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
        let data_parallel = self.config.data_parallel;
        let dense = &self.dense;
        let after = AfterBackward {
            shared_copies: &self.shared_copies,
            partial: &self.partial,
        };
        let experts = self.experts.as_ref();
        let overlap = self.overlap.get_or_insert_with(|| {
            let hooks = |parts: &FlatParts<B>| -> Vec<GradReduceOverlap<B>> {
                parts
                    .parts()
                    .iter()
                    .map(|part| {
                        GradReduceOverlap::new(
                            part.layout(),
                            parts.replicas(),
                            data_parallel.bucket_numel,
                            data_parallel.use_distributed_optimizer,
                            data_parallel.gradient_accumulation_fusion,
                            microbatches,
                            after,
                            &part.master().device(),
                        )
                    })
                    .collect()
            };
            Arc::new(PartsOverlap::new(
                hooks(dense),
                experts.map(hooks).unwrap_or_default(),
            ))
        });
        overlap.arm(model);
        overlap.clone()
    }

    /// Whether the reduction overlaps the backward pass: an [`overlap_hook`](Self::overlap_hook)
    /// exists and a group of more than one rank (DP, or expert DP) runs its collectives on the
    /// device (NCCL with collective checks off). Elsewhere the hook sums the gradients during
    /// the backward pass and the collectives, if any, run after it.
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
    /// optimizer over more than one DP rank, 1 a part, or with
    /// [`DataParallelConfig::overlap_param_gather`] one per bucket of each part
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
        let align = self.config.adam.buffer.param_alignment;
        let how = PartReduction {
            bucket,
            sharded,
            align,
        };
        let hooks = self.overlap.as_ref().map(|o| o.dense());
        let (grads, mut sum_of_squares) = self.dense.reduce(&model, grads_in, hooks, &how)?;
        let expert_grads = match self.experts.as_mut() {
            Some(experts) => {
                let hooks = self.overlap.as_ref().map(|o| o.experts());
                let (grads, squares) = experts.reduce(&model, grads_in, hooks, &how)?;
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

        let a = &self.config.adam;
        let hyper = AdamWScalars::new(lr, a.beta_1, a.beta_2, a.epsilon, a.weight_decay, align);
        let step = PartStep {
            grad_factor,
            flag: found_inf.as_ref().map(FoundInf::flag),
            sharded,
            bucketed: self
                .config
                .data_parallel
                .overlap_param_gather
                .then_some(bucket),
            model_dtype: self.dense.model_dtype(),
        };
        let (mut model, gathers) = self.dense.update(model, grads, &hyper, &step)?;
        self.param_gathers = gathers;
        if let (Some(experts), Some(expert_grads)) = (self.experts.as_mut(), expert_grads) {
            model = experts.update(model, expert_grads, &hyper, &step)?.0;
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
    /// buffers, master weights, moments: of every part of the dense parameters and of the
    /// routed experts), from the tensors' shapes and dtypes. With f32 parameters and no
    /// sharding the parameters are views of the master weights and are not counted twice.
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
            && self.dense.model_dtype() == DType::F32;
        let mut memory = OptimizerMemory {
            params: params.0,
            ..OptimizerMemory::default()
        };
        let experts = self.experts.iter().flat_map(FlatParts::parts);
        for part in self.dense.parts().iter().chain(experts) {
            let part: &FlatPart<B> = part;
            memory.grads += 4 * part.layout().numel();
            memory.main_params += if views { 0 } else { bytes(part.master()) };
            memory.exp_avg += bytes(part.exp_avg());
            memory.exp_avg_sq += bytes(part.exp_avg_sq());
        }
        memory
    }
}
