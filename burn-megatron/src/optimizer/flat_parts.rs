//! A rank's parameters of one kind in flat buffers cut into parts below 32-bit indices, with
//! the AdamW state of each part's range: what [`DistributedAdamW`](super::DistributedAdamW)
//! steps, once for the dense parameters and once for the routed experts.
//!
//! The dense parameters are averaged over DP (DP × CP under context parallelism), the routed
//! experts over expert DP. Each kind is laid out in a flat buffer
//! ([`BufferLayout`]) and, where that buffer would pass
//! [`MAX_FLAT_NUMEL`](super::MAX_FLAT_NUMEL) elements, cut into parts of whole parameters in
//! the buffer's order ([`flat_limit`](super::flat_limit)). Each part has its own gradient
//! buffer, buckets, DP shards, fp32 master weights, moments and step count. Every rank holds
//! Llama-3 8B's 8.03 billion dense parameters at DP 4 with the distributed optimizer: two
//! parts. Megatron cuts its buffers by dtype and by expert-ness, not by size (PyTorch indexes
//! with 64 bits).
//!
//! A step reduces the parts one after the other (each its own all-reduce or reduce-scatter
//! in buckets, or its own overlap hook's collectives), adds the squares of every part's
//! counted elements into one sum for the global norm, and updates each part with the same
//! clip coefficient and overflow flag, gathering its parameters over the replicas. With one
//! part, the common case, the tensors and collectives are those of the buffer before it could
//! be cut, bit for bit. With several, the norm's squares are added in another order.

use std::collections::HashSet;
use std::ops::Range;

use burn::module::{AutodiffModule, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, Tensor, TensorData};
use burn_megatron_dist::{ProcessGroup, ReduceOp};

use super::FlatAdamWConfig;
use super::flat_limit::split_at_limit;
use crate::ModelBackend;
use crate::distributed::grad_reduction::{all_reduce_grads, check_dp, reduce_scatter_grads};
use crate::distributed::param_gather::all_gather_params;
use crate::distributed::{BufferLayout, GradReduceOverlap, ParamAndGradBuffer};
use crate::error::{ConfigError, DeviceError};
use crate::ops::adamw::{AdamWOps, AdamWScalars, FlatAdamWBuffers};
use crate::tensor_parallel::{DeclarePlacements, ParamInfo, try_param_infos};

/// A rank's optimizer state over one range of a flat buffer (the range of a part it holds),
/// each `[range.len()]` f32: what a checkpoint stores
/// ([`distributed_adamw_state`](crate::checkpointing::distributed_adamw_state)).
#[derive(Debug, Clone)]
pub struct DistributedAdamWState<B: Backend> {
    /// The fp32 master weights.
    pub main_params: Tensor<B, 1>,
    /// The first moments.
    pub exp_avg: Tensor<B, 1>,
    /// The second moments.
    pub exp_avg_sq: Tensor<B, 1>,
    /// Steps taken.
    pub step: u64,
}

/// One part of a [`DistributedAdamW`](super::DistributedAdamW)'s flat buffers (of the dense
/// parameters or of the routed experts) in a checkpoint: its layout, the range of it this rank
/// holds, and the state of that range. A checkpoint keys the state by parameter, so what it
/// holds does not depend on how the buffers were cut into parts.
#[derive(Debug, Clone)]
pub struct PartOptimizerState<'a, B: Backend> {
    /// The part's flat-buffer layout.
    pub layout: &'a BufferLayout,
    /// The range of it this rank holds.
    pub range: Range<usize>,
    /// The state of that range.
    pub state: DistributedAdamWState<B>,
}

/// The two kinds of parameters with flat buffers of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartKind {
    /// Every parameter but the routed experts and the frozen ones.
    Dense,
    /// The routed experts.
    Experts,
}

impl PartKind {
    /// Whether the parameter `info` belongs to this kind.
    fn holds(self, info: &ParamInfo) -> bool {
        match self {
            PartKind::Dense => !info.placement.is_expert() && !info.placement.frozen,
            PartKind::Experts => info.placement.is_expert(),
        }
    }

    /// The kind in errors.
    fn name(self) -> &'static str {
        match self {
            PartKind::Dense => "dense parameters",
            PartKind::Experts => "routed experts",
        }
    }

    /// The option that makes one parameter of this kind smaller: TP cuts every large dense
    /// matrix (the replicated ones are norms and biases), EP the experts' stacked matrices.
    fn fix(self) -> &'static str {
        match self {
            PartKind::Dense => "--tensor-model-parallel-size",
            PartKind::Experts => "--expert-model-parallel-size",
        }
    }
}

/// A flat f32 buffer of the inner backend.
pub(crate) type InnerFlat<B> = Tensor<<B as AutodiffBackend>::InnerBackend, 1>;

/// What every part of a kind is built with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartContext<'a> {
    /// The ranks holding replicas of these parameters: the gradients are averaged over them,
    /// and with the distributed optimizer the state is sharded over them.
    pub(crate) replicas: &'a ProcessGroup,
    /// This rank's TP rank: a parameter replicated over TP is counted in the norm on TP
    /// rank 0 only.
    pub(crate) tp_rank: usize,
    /// AdamW's settings and the buffers' layout, `buffer.dp_size` the replicas' size.
    pub(crate) adam: FlatAdamWConfig,
    /// With the distributed optimizer: the state of one shard of each part.
    pub(crate) sharded: bool,
    /// Paths of copies of parameters counted in the norm on another rank.
    pub(crate) shared_copies: &'a [String],
    /// The most elements of one part.
    pub(crate) part_numel: usize,
}

/// How a step reduces the parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartReduction {
    /// The reduction's bucket size
    /// ([`DataParallelConfig::bucket_numel`](crate::distributed::DataParallelConfig::bucket_numel)).
    pub(crate) bucket: usize,
    pub(crate) sharded: bool,
    /// [`BufferConfig::param_alignment`](crate::distributed::BufferConfig::param_alignment).
    pub(crate) align: usize,
}

/// What the update of every part shares.
#[derive(Debug, Clone)]
pub(crate) struct PartStep<B: AutodiffBackend> {
    /// `[1]`: the clip coefficient times the loss scale's inverse.
    pub(crate) grad_factor: InnerFlat<B>,
    /// `[1]`: the overflow flag of a loss-scaled step.
    pub(crate) flag: Option<InnerFlat<B>>,
    pub(crate) sharded: bool,
    /// The parameter gather in buckets of this size
    /// ([`DataParallelConfig::overlap_param_gather`](crate::distributed::DataParallelConfig::overlap_param_gather)).
    pub(crate) bucketed: Option<usize>,
    pub(crate) model_dtype: DType,
}

/// A rank's parameters of one kind, in one or more parts (see the [module docs](self)).
#[derive(Debug, Clone)]
pub(crate) struct FlatParts<B: AutodiffBackend> {
    kind: PartKind,
    /// The ranks holding replicas of these parameters.
    replicas: ProcessGroup,
    /// The gradients averaged over `replicas` times this: CP for the dense parameters (each
    /// CP rank's gradient is its tokens' share: summed over CP, averaged over DP), and
    /// `expert_dp / dp` for the experts (the DP average of the loss's gradient).
    grad_scale: f64,
    /// A group over which the sum of squares is added once more: EP for the experts (each
    /// rank of an EP group holds other experts).
    norm_over: Option<ProcessGroup>,
    /// In buffer order; one unless the kind's buffer would pass
    /// [`PartContext::part_numel`].
    parts: Vec<FlatPart<B>>,
}

/// One part: a group of whole parameters with its own flat buffers, shards and the AdamW
/// state of this rank's range of them.
#[derive(Debug, Clone)]
pub(crate) struct FlatPart<B: AutodiffBackend> {
    /// The gradient buffer (`[numel]` f32) and the layout; its master weights are moved to
    /// `master`.
    buffer: ParamAndGradBuffer<B::InnerBackend>,
    /// First element of the rank's range in the buffers.
    range_start: usize,
    /// `[range]` f32 master weights.
    master: InnerFlat<B>,
    /// `[range]` f32 first moments.
    exp_avg: InnerFlat<B>,
    /// `[range]` f32 second moments.
    exp_avg_sq: InnerFlat<B>,
    /// `[range / param_alignment]` f32 weight-decay flags.
    decay: InnerFlat<B>,
    /// `[range / param_alignment]` f32: 1 where the block counts in the global norm.
    counted: InnerFlat<B>,
    /// `[1]` f32 steps taken (skipped ones not counted).
    step: InnerFlat<B>,
}

impl<B> FlatParts<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
{
    /// The parameters of `kind` of `model`, cut into parts of at most `context.part_numel`
    /// elements ([`split_at_limit`]: a parameter whose buffer alone would pass it is refused,
    /// naming it and [`PartKind::fix`]); their gradients are scaled by `grad_scale` and their
    /// norm's squares added over `norm_over` too.
    pub(crate) fn init<M>(
        model: &M,
        kind: PartKind,
        context: &PartContext,
        grad_scale: f64,
        norm_over: Option<ProcessGroup>,
    ) -> crate::Result<Self>
    where
        M: AutodiffModule<B> + DeclarePlacements,
    {
        let infos = try_param_infos(model)?;
        let all = BufferLayout::new_where(&infos, context.adam.buffer, |info| kind.holds(info))?;
        let groups = split_at_limit(&all, context.part_numel, kind.fix())?;
        if groups.is_empty() {
            return Err(ConfigError::Invalid(format!(
                "the {}' flat buffer needs a module with at least one float parameter",
                kind.name()
            ))
            .into());
        }
        let parts = groups
            .into_iter()
            .map(|ids| {
                let ids: HashSet<ParamId> = ids.into_iter().collect();
                FlatPart::init(model, context, |info| {
                    kind.holds(info) && ids.contains(&info.id)
                })
            })
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Self {
            kind,
            replicas: context.replicas.clone(),
            grad_scale,
            norm_over,
            parts,
        })
    }

    /// The parts, in buffer order.
    pub(crate) fn parts(&self) -> &[FlatPart<B>] {
        &self.parts
    }

    /// The ranks holding replicas of these parameters.
    pub(crate) fn replicas(&self) -> &ProcessGroup {
        &self.replicas
    }

    /// The dtype of the model's parameters.
    pub(crate) fn model_dtype(&self) -> DType {
        self.parts[0].buffer.model_dtype()
    }

    /// Each part's gradients averaged over the replicas and scaled (this rank's shard with
    /// the distributed optimizer), and the sum of the squares of every part's counted
    /// elements: added over the parts, then over the replicas' shards, then over
    /// `norm_over`. With `hooks` (one per part, the overlap hook's) each part's reduction is
    /// the one its hook started in the backward pass.
    pub(crate) fn reduce<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: &GradientsParams,
        hooks: Option<&[GradReduceOverlap<B>]>,
        how: &PartReduction,
    ) -> crate::Result<(Vec<InnerFlat<B>>, InnerFlat<B>)> {
        let mut reduced = Vec::with_capacity(self.parts.len());
        let mut squares: Option<InnerFlat<B>> = None;
        for (i, part) in self.parts.iter_mut().enumerate() {
            let hook = hooks.and_then(|hooks| hooks.get(i));
            let (part_grads, part_squares) =
                part.reduce(model, grads, hook, &self.replicas, self.grad_scale, how)?;
            squares = Some(match squares {
                Some(sum) => sum + part_squares,
                None => part_squares,
            });
            reduced.push(part_grads);
        }
        let Some(mut sum_of_squares) = squares else {
            return Err(ConfigError::Invalid(format!(
                "the {}' optimizer holds no part",
                self.kind.name()
            ))
            .into());
        };
        if how.sharded {
            sum_of_squares = self.replicas.all_reduce(sum_of_squares, ReduceOp::Sum)?;
        }
        if let Some(group) = &self.norm_over {
            sum_of_squares = group.all_reduce(sum_of_squares, ReduceOp::Sum)?;
        }
        Ok((reduced, sum_of_squares))
    }

    /// The AdamW update of every part's range (`grads` from [`reduce`](Self::reduce)), and
    /// the model with the new parameters; also the number of all-gathers issued.
    pub(crate) fn update<M: AutodiffModule<B>>(
        &mut self,
        mut model: M,
        grads: Vec<InnerFlat<B>>,
        hyper: &AdamWScalars,
        step: &PartStep<B>,
    ) -> crate::Result<(M, usize)> {
        if grads.len() != self.parts.len() {
            return Err(ConfigError::Invalid(format!(
                "{} gradients for the {}' {} parts",
                grads.len(),
                self.kind.name(),
                self.parts.len()
            ))
            .into());
        }
        let mut gathers = 0;
        for (part, grads) in self.parts.iter_mut().zip(grads) {
            let updated = part.adamw(grads, hyper, step);
            let (updated_model, issued) = write_gathered(
                &part.buffer,
                model,
                updated,
                &self.replicas,
                step.sharded,
                step.bucketed,
            )?;
            model = updated_model;
            gathers += issued;
        }
        Ok((model, gathers))
    }

    /// Each part's layout, the range of it this rank holds, and the state of that range
    /// (reads each part's step count to the host).
    pub(crate) fn states(
        &self,
    ) -> core::result::Result<Vec<PartOptimizerState<'_, B::InnerBackend>>, DeviceError> {
        self.parts
            .iter()
            .enumerate()
            .map(|(i, part)| {
                let what = format!(
                    "the distributed optimizer's step count of the {} (part {i})",
                    self.kind.name()
                );
                Ok(PartOptimizerState {
                    layout: part.layout(),
                    range: part.range(),
                    state: DistributedAdamWState {
                        main_params: part.master.clone(),
                        exp_avg: part.exp_avg.clone(),
                        exp_avg_sq: part.exp_avg_sq.clone(),
                        step: read_step(&part.step, &what)?,
                    },
                })
            })
            .collect()
    }

    /// Continues part `part` from `state` (a checkpoint's, for this rank's range of the part):
    /// each tensor must be `[range.len()]`.
    pub(crate) fn load_state(
        &mut self,
        part: usize,
        state: DistributedAdamWState<B::InnerBackend>,
    ) -> core::result::Result<(), ConfigError> {
        let (name, count) = (self.kind.name(), self.parts.len());
        let Some(target) = self.parts.get_mut(part) else {
            return Err(ConfigError::Invalid(format!(
                "the {name}' part {part} does not exist: this optimizer has {count}"
            )));
        };
        let range = target.range();
        for (tensor, t) in [
            ("main_params", &state.main_params),
            ("exp_avg", &state.exp_avg),
            ("exp_avg_sq", &state.exp_avg_sq),
        ] {
            if t.dims()[0] != range.len() {
                return Err(ConfigError::Invalid(format!(
                    "the loaded {tensor} of the {name} (part {part} of {count}) has {} \
                     elements, this rank's range {range:?} of the part has {}",
                    t.dims()[0],
                    range.len()
                )));
            }
        }
        let device = target.master.device();
        let f32_on_device = |t: InnerFlat<B>| t.cast(DType::F32).to_device(&device);
        target.master = f32_on_device(state.main_params);
        target.exp_avg = f32_on_device(state.exp_avg);
        target.exp_avg_sq = f32_on_device(state.exp_avg_sq);
        target.step = Tensor::from_data(
            TensorData::new(vec![state.step as f32], [1]),
            (&device, DType::F32),
        );
        Ok(())
    }
}

impl<B> FlatPart<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
{
    /// The part of `model` holding the parameters `keep` accepts: its buffers, its master
    /// weights copied from the parameters (this rank's shard of them with the distributed
    /// optimizer), moments zero. The replicas must start from the same values
    /// ([`check_same_parameters`]).
    fn init<M>(
        model: &M,
        context: &PartContext,
        keep: impl Fn(&ParamInfo) -> bool,
    ) -> crate::Result<Self>
    where
        M: AutodiffModule<B> + DeclarePlacements,
    {
        let PartContext {
            replicas,
            tp_rank,
            adam,
            sharded,
            shared_copies,
            part_numel: _,
        } = *context;
        let mut buffer = ParamAndGradBuffer::from_module_where(model, adam.buffer, keep)?;
        let layout = buffer.layout();
        check_dp(layout, replicas)?;
        let numel = layout.numel();
        let range = match sharded {
            true => layout.shard(replicas.rank()),
            false => 0..numel,
        };
        let align = adam.buffer.param_alignment;
        let blocks = range.start / align..range.end / align;
        let policy = adam.decay_policy;
        let decay = layout.block_flags(|slot| policy.decays(slot.kind))[blocks.clone()].to_vec();
        // A parameter sharded over TP counts on every TP rank (a routed expert under expert
        // tensor parallelism too), a replicated one on TP rank 0.
        let counted = layout.block_flags(|slot| {
            (slot.placement.dim().is_some() || tp_rank == 0) && !shared_copies.contains(&slot.path)
        })[blocks]
            .to_vec();
        let full = buffer.take_main_params();
        check_same_parameters(&full, replicas)?;
        let device = full.device();
        let master = if range.len() == numel {
            full
        } else {
            // A copy, so that the shard does not keep the whole buffer alive.
            Tensor::zeros([range.len()], (&device, DType::F32)).add(full.slice(range.clone()))
        };
        let f32_tensor = |values: Vec<f32>| {
            let len = values.len();
            Tensor::from_data(TensorData::new(values, [len]), (&device, DType::F32))
        };
        let zeros = || Tensor::zeros([range.len()], (&device, DType::F32));
        Ok(Self {
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

    /// The part's flat-buffer layout.
    pub(crate) fn layout(&self) -> &BufferLayout {
        self.buffer.layout()
    }

    /// The range of the part's buffers this rank holds.
    pub(crate) fn range(&self) -> Range<usize> {
        self.range_start..self.range_start + self.master.dims()[0]
    }

    /// The fp32 master weights of [`range`](Self::range).
    pub(crate) fn master(&self) -> &InnerFlat<B> {
        &self.master
    }

    /// The first moments of [`range`](Self::range).
    pub(crate) fn exp_avg(&self) -> &InnerFlat<B> {
        &self.exp_avg
    }

    /// The second moments of [`range`](Self::range).
    pub(crate) fn exp_avg_sq(&self) -> &InnerFlat<B> {
        &self.exp_avg_sq
    }

    /// Steps taken, `[1]` f32 (skipped steps not counted).
    pub(crate) fn step_count(&self) -> &InnerFlat<B> {
        &self.step
    }

    /// This part's gradients averaged over `replicas` and times `grad_scale` (this rank's
    /// shard with the distributed optimizer): reduced here after the backward pass, or the
    /// reduction `hook` started inside it. Also the sum of the squares of those counted in
    /// the norm on this rank.
    fn reduce<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: &GradientsParams,
        hook: Option<&GradReduceOverlap<B>>,
        replicas: &ProcessGroup,
        grad_scale: f64,
        how: &PartReduction,
    ) -> crate::Result<(InnerFlat<B>, InnerFlat<B>)> {
        let reduced = match hook {
            Some(hook) => hook.finish(model, grads)?,
            None => {
                self.buffer.gather_grads(model, grads)?;
                let full = self.buffer.grads();
                self.buffer.release_grads();
                let layout = self.buffer.layout();
                if how.sharded {
                    reduce_scatter_grads(full, layout, replicas, how.bucket)?
                } else {
                    all_reduce_grads(full, layout, replicas, how.bucket)?
                }
            }
        };
        let reduced = match grad_scale == 1.0 {
            true => reduced,
            false => reduced.mul_scalar(grad_scale),
        };
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

    /// One AdamW step of the range ([`AdamWOps::flat_adamw`]): the moments and master
    /// weights replaced by their updates, the step count advanced unless the step's overflow
    /// flag is set. Returns the updated values in the model's dtype (the master weights
    /// themselves for f32 models), this rank's range of the parameters.
    fn adamw(
        &mut self,
        grads: InnerFlat<B>,
        hyper: &AdamWScalars,
        step: &PartStep<B>,
    ) -> InnerFlat<B> {
        // Moved out, so that the kernel may update them in place.
        let take = |t: &mut InnerFlat<B>| {
            let device = t.device();
            std::mem::replace(t, Tensor::empty([0], (&device, DType::F32)))
        };
        let flag = step.flag.clone();
        let found_inf = flag.clone().unwrap_or_else(|| self.step.zeros_like());
        let model_dtype = step.model_dtype;
        let out = <B::InnerBackend as AdamWOps>::flat_adamw(
            FlatAdamWBuffers {
                master: take(&mut self.master),
                grad: grads,
                exp_avg: take(&mut self.exp_avg),
                exp_avg_sq: take(&mut self.exp_avg_sq),
                decay: self.decay.clone(),
                step: self.step.clone(),
                grad_factor: step.grad_factor.clone(),
                found_inf,
            },
            hyper,
            (model_dtype != DType::F32).then_some(model_dtype),
        );
        self.exp_avg = out.exp_avg;
        self.exp_avg_sq = out.exp_avg_sq;
        self.master = out.master.clone();
        self.step = match flag {
            Some(flag) => self.step.clone() + flag.neg().add_scalar(1.0),
            None => self.step.clone().add_scalar(1.0),
        };
        out.model.unwrap_or(out.master)
    }
}

/// `model` with the parameters of `buffer` replaced by the updated values: `updated` itself
/// (this rank updated the whole buffer) or, when `sharded`, every rank's shard of them
/// all-gathered over `replicas`, in one gather or, with `bucketed` (the bucket size), in
/// buckets in the next forward pass's order
/// ([`all_gather_params`](crate::distributed::all_gather_params)). Also returns the number
/// of all-gathers issued.
fn write_gathered<B, M>(
    buffer: &ParamAndGradBuffer<B::InnerBackend>,
    model: M,
    updated: InnerFlat<B>,
    replicas: &ProcessGroup,
    sharded: bool,
    bucketed: Option<usize>,
) -> crate::Result<(M, usize)>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
    M: AutodiffModule<B>,
{
    if !sharded || replicas.size() == 1 {
        return Ok((buffer.write_params(model, updated), 0));
    }
    match bucketed {
        Some(bucket_numel) => {
            let gathered = all_gather_params(updated, buffer.layout(), replicas, bucket_numel)?;
            let gathers = gathered.buckets();
            Ok((
                buffer.write_params_with(model, |slot| gathered.param(slot)),
                gathers,
            ))
        }
        None => {
            let params = replicas.all_gather(updated, 0)?;
            Ok((buffer.write_params(model, params), 1))
        }
    }
}

/// A `[1]` f32 step count on the host, as an integer; a device error names `what`.
fn read_step<B: Backend>(
    step: &Tensor<B, 1>,
    what: &str,
) -> core::result::Result<u64, DeviceError> {
    let step: f32 =
        crate::error::read_scalar(step.clone().cast(DType::F32), || what.to_string())?.elem();
    Ok(step as u64)
}

/// Refuses replicas that start from different parameters, which would train silently
/// wrong: the ranks' sums of `params` and of their squares must agree bit for bit over
/// `replicas`. The sums are taken in a fixed order ([`fixed_order_sum`]): Burn's `sum` may
/// add with atomics on a GPU, whose order, and so last bits, differ between equal replicas
/// (found on two H100s). One small all-reduce pair and one host read a part, at
/// initialisation only.
fn check_same_parameters<B: ModelBackend>(
    params: &Tensor<B, 1>,
    replicas: &ProcessGroup,
) -> crate::Result<()> {
    if replicas.size() == 1 {
        return Ok(());
    }
    let sums = Tensor::cat(
        vec![
            fixed_order_sum(params.clone()),
            fixed_order_sum(params.clone() * params.clone()),
        ],
        0,
    );
    let highest = replicas.all_reduce(sums.clone(), ReduceOp::Max)?;
    let lowest = replicas.all_reduce(sums, ReduceOp::Min)?;
    let spread = (highest - lowest).abs().max();
    let spread: f64 = crate::error::read_scalar(spread, || {
        "the spread of the data-parallel replicas' parameter sums".to_string()
    })
    .map_err(|e| e.on_rank(replicas.global_rank()))?
    .elem();
    if spread == 0.0 {
        return Ok(());
    }
    Err(ConfigError::Invalid(format!(
        "data-parallel rank {} of {} starts from other parameters than its replicas (their sums \
         differ by {spread:e}): build every rank's model from the same seed or checkpoint. Burn \
         initialises parameters lazily and each clone of an uninitialised module on its own, \
         so materialise a module (e.g. `m.clone().load_record(m.into_record())`) before \
         copying it for several ranks, and give each thread rank its own copy with \
         `m.clone().fork(&device)`",
        replicas.rank(),
        replicas.size()
    ))
    .into())
}

/// `[Σ x]` added in an order fixed by the length alone, so that equal tensors give equal bits
/// on every rank: [`BiasOps::bias_gradient`](crate::ops::BiasOps::bias_gradient)'s
/// deterministic column sums over 1 024 columns, then over those columns, plus the tail that
/// does not fill a row.
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
