//! The pretraining loop of one rank (Megatron's `pretrain` → `train` → `train_step`): build
//! this rank's pipeline stage, resume from a checkpoint if there is one, then per iteration
//! read the global batch, run the pipeline schedule's forward and backward passes, clip the
//! global gradient norm, step AdamW in its two weight-decay groups at the schedule's learning
//! rate, and evaluate and save at their intervals. With `--check-for-nan-in-loss-and-grad`
//! (on by default) a non-finite loss or gradient norm (the values read for the log) or, right
//! before a save and at the end, a non-finite parameter stops the run with
//! [`TrainingError::NonFinite`](crate::error::TrainingError::NonFinite) before anything of
//! that iteration is written.
//!
//! With data parallelism (DP > 1), `--use-distributed-optimizer`, `--bf16` or `--fp16`, the step is
//! [`DistributedAdamW`]'s instead: each DP rank reads its own microbatches of the global batch,
//! and after the schedule's backward passes the gradients are averaged over DP in the flat
//! buffer, clipped by the global norm and stepped (the optimizer state sharded over DP with
//! the distributed optimizer). The learning-rate schedule advances once per global step.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use burn::lr_scheduler::LrScheduler;
use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{DistBackend, ParallelSizes, ParallelState, RankContext, ReduceOp};

use super::config::{PretrainConfig, RunLayout};
use super::data::{PretrainData, read_microbatches};
use super::moe_log::{MoeReport, global_expert_load, moe_report};
use super::nan_check::{check_finite_chunks, check_step_values, read_f32};
use super::observer::{EvalReport, IterationReport, RunStart, TrainingObserver};
use super::step::{MIB, largest_over_ranks, loss_on_every_stage};
use crate::backend::ModelBackend;
use crate::checkpointing::{
    AsyncCheckpointer, Checkpoint, Checkpointer, OptimizerState, TrainingState, adamw_record,
    adamw_state, distributed_adamw_state, latest_checkpoint, load_distributed_adamw,
};
use crate::context_parallel::CpContext;
use crate::error::Result;
use crate::models::GptModel;
use crate::ops::fp8::Fp8Recipe;
use crate::optimizer::DistributedAdamW;
use crate::optimizer::{
    GradClipConfig, ParamGroups, WeightDecayPolicy, clip_grad_norm, merge_chunk_grads,
    shared_copies,
};
use crate::pipeline_parallel::{forward_backward, forward_backward_scaled, forward_only};
use crate::tensor_parallel::param_infos;

/// What one rank's run did. Every rank holds the same values.
#[derive(Debug, Clone, PartialEq)]
pub struct PretrainSummary {
    /// Every step this run took, in order.
    pub iterations: Vec<IterationReport>,
    /// Every evaluation.
    pub evaluations: Vec<EvalReport>,
    /// Every checkpoint written.
    pub checkpoints: Vec<PathBuf>,
    /// The checkpoint the run resumed from.
    pub resumed_from: Option<PathBuf>,
    /// With `overlap_grad_reduce`: the parameter elements of this rank whose gradients were
    /// taken for reduction inside the last step's backward pass (0 otherwise).
    pub reduced_in_backward: usize,
}

impl PretrainSummary {
    /// The step losses, in order.
    pub fn losses(&self) -> Vec<f64> {
        self.iterations.iter().map(|r| r.loss).collect()
    }
}

type Adam<B> = OptimizerAdaptor<AdamW, Vec<GptModel<B>>, B>;

/// This rank's model chunks (one pipeline stage, or several virtual stages under the
/// interleaved schedule) and their optimizer, which steps the chunks as one module: AdamW
/// twice, with and without weight decay, over the two [`ParamGroups`].
struct RankModel<B: AutodiffBackend + ModelBackend> {
    chunks: Vec<GptModel<B>>,
    groups: ParamGroups,
    decay: Adam<B>,
    no_decay: Adam<B>,
    /// With DP > 1, the distributed optimizer, bf16 or fp16: the flat-buffer AdamW that reduces over DP
    /// (`decay` and `no_decay` then stay unused).
    distributed: Option<DistributedAdamW<B>>,
}

impl<B> RankModel<B>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend + ModelBackend,
{
    /// The optimizer state by chunk (`out[i]` for `chunks[i]`), as checkpoints take it.
    fn optimizer_state(&self) -> Result<Vec<OptimizerState>> {
        if let Some(optim) = &self.distributed {
            return distributed_adamw_state(&self.chunks, optim);
        }
        let rank = self.chunks.first().map_or(0, |c| c.tp().global_rank());
        let mut state = adamw_state(&self.chunks, &self.decay).map_err(|e| e.on_rank(rank))?;
        state.params.extend(
            adamw_state(&self.chunks, &self.no_decay)
                .map_err(|e| e.on_rank(rank))?
                .params,
        );
        Ok(state.split_by_chunk(&self.chunks))
    }

    /// Loads the model and the optimizer state of `checkpoint` (saved at any layout, by
    /// either optimizer); each AdamW gets its group's parameters, the distributed optimizer
    /// its range.
    fn load(mut self, checkpoint: &Checkpoint) -> Result<Self> {
        let chunks = self
            .chunks
            .into_iter()
            .map(|chunk| checkpoint.load_model(chunk))
            .collect::<Result<Vec<_>>>()?;
        if let Some(optim) = self.distributed.as_mut() {
            load_distributed_adamw(checkpoint, &chunks, optim)?;
            return Ok(Self { chunks, ..self });
        }
        let saved = chunks
            .iter()
            .map(|chunk| checkpoint.load_optimizer_state(chunk))
            .collect::<Result<Vec<_>>>()?;
        let saved = OptimizerState::merge(saved).unwrap_or_default();
        let exempt: HashSet<ParamId> = self.groups.no_decay.iter().map(|p| p.id).collect();
        let (no_decay, decay): (Vec<_>, Vec<_>) = adamw_record(&chunks, &saved)
            .into_iter()
            .partition(|(id, _)| exempt.contains(id));
        Ok(Self {
            chunks,
            distributed: self.distributed,
            groups: self.groups,
            decay: self.decay.load_record(decay.into_iter().collect()),
            no_decay: self.no_decay.load_record(no_decay.into_iter().collect()),
        })
    }
}

/// Runs `config` as this rank of the launch `ctx` on `device`: every rank of the world must
/// call it with the same configuration and data. The logging rank (global rank 0) reports to
/// `observer`. Returns the run's losses, evaluations and checkpoints.
///
/// The world must be TP × PP × CP × DP ranks (CP > 1: every sequence split over the CP
/// group, see [`GptModel::with_context_parallel`]). Each rank builds only its pipeline stage, a
/// TP slice of it; with `config.load` set and a checkpoint there, the model, the AdamW moments
/// and step counts, the iteration, the consumed samples and the learning-rate schedule are
/// restored, so the next losses equal the uninterrupted run's.
pub fn pretrain<B>(
    ctx: &RankContext,
    config: &PretrainConfig,
    data: &PretrainData,
    device: &B::Device,
    observer: &dyn TrainingObserver,
) -> Result<PretrainSummary>
where
    B: AutodiffBackend<Gradients = burn_autodiff::grads::Gradients> + ModelBackend,
    B::InnerBackend: DistBackend + ModelBackend,
{
    let started = Instant::now();
    let layout = config.check(ctx.world_size())?;
    let RunLayout {
        tp,
        pp,
        cp,
        cp_comm,
        virtual_pipeline_size,
        dp,
        num_microbatches,
        model: model_config,
        ..
    } = &layout;
    let schedule_kind = layout.schedule();
    // DP takes what is left of the world: TP × PP × CP × DP ranks were checked above.
    let sizes = ParallelSizes::default()
        .with_tp(*tp)
        .with_pp(*pp)
        .with_cp(*cp)
        .with_ep(layout.ep);
    let state = ctx
        .parallel_state(sizes)?
        .with_virtual_pipeline_size(*virtual_pipeline_size)?;
    let world_rank = state.world().rank();
    let logging = world_rank == 0;
    let setup = |step: String| {
        if logging {
            observer.on_setup(&format!(
                "{step} ({:.1} s)",
                started.elapsed().as_secs_f64()
            ));
        }
    };
    if state.world().size() > 1 {
        setup("connecting the ranks (each group's communicator, the pipeline's links)".into());
        state.connect::<B>(device, model_config.moe.is_some())?;
    }
    let split = &layout.split;
    let stages: Vec<_> = (0..*virtual_pipeline_size)
        .map(|c| split.stage(state.virtual_stage(c)))
        .collect();
    setup(format!(
        "building each rank's model {} (layers {} of {} on the first{}, TP = {tp}), {} \
         values drawn where they live (a GPU draws its own; the CPU on {} cores)",
        if stages.len() == 1 { "stage" } else { "chunks" },
        stages
            .iter()
            .map(|s| format!("{:?}", s.layers))
            .collect::<Vec<_>>()
            .join(" and "),
        model_config.num_layers,
        match pp {
            1 => String::new(),
            _ => format!(
                "; {} layers a pipeline rank",
                (0..*pp)
                    .map(|r| split.rank_layers(r, *pp).to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
        if stages.len() == 1 { "its" } else { "their" },
        std::thread::available_parallelism().map_or(1, |n| n.get())
    ));
    let chunks = stages
        .iter()
        .map(|stage| {
            model_config
                .init_gpt_stage_with_ep::<B>(state.tp(), state.ep(), stage, device)?
                .with_context_parallel(CpContext::new(state.cp(), *cp_comm))
                .map(|model| model.with_global_load_group(Some(state.dp_cp().clone())))
        })
        .collect::<core::result::Result<Vec<_>, _>>()?;
    let adamw = AdamWConfig::new()
        .with_beta_1(config.adam_beta1)
        .with_beta_2(config.adam_beta2)
        .with_epsilon(config.adam_eps);
    let mut rank = RankModel {
        groups: WeightDecayPolicy::default().groups(&chunks),
        chunks,
        decay: adamw
            .clone()
            .with_weight_decay(config.weight_decay as f32)
            .init(),
        no_decay: adamw.with_weight_decay(0.0).init(),
        distributed: None,
    };
    // Context parallelism needs the gradients summed over CP: the flat-buffer AdamW does it.
    // Expert parallelism needs the flat-buffer AdamW: it reduces the experts over expert-DP.
    if *dp > 1
        || *cp > 1
        || layout.ep > 1
        || config.use_distributed_optimizer
        || config.bf16
        || config.fp16
    {
        setup("building the flat-buffer AdamW (fp32 master weights and moments)".into());
        let optim =
            config
                .distributed_adamw()
                .init(&rank.chunks, &state, &shared_copies(&rank.chunks))?;
        rank.distributed = Some(optim);
    }

    // fp16: the loss is scaled before backward, the optimizer divides it out and skips a
    // step whose gradients overflowed, all on the device.
    let mut scaler = match config.fp16 {
        true => Some(config.loss_scaler().init::<B::InnerBackend>(device)?),
        false => None,
    };
    let fp8_delayed = (model_config.fp8.as_ref())
        .is_some_and(|f| f.recipe == Fp8Recipe::Delayed && !f.tp_only_amax_reduction);
    let mut iteration = 0u64;
    let mut consumed = 0u64;
    // The losses since the last logged iteration, for its `lm loss`.
    let mut interval_losses = Vec::new();
    let mut resumed_from = None;
    if let Some(root) = &config.load
        && latest_checkpoint(root)?.is_some()
    {
        setup(format!(
            "loading the latest checkpoint of {}",
            root.display()
        ));
        let checkpoint = Checkpoint::open_latest(root)?;
        checkpoint.check_config(model_config)?;
        rank = rank.load(&checkpoint)?;
        if let (Some(scaler), Some(saved)) =
            (scaler.as_mut(), &checkpoint.training_state().loss_scaler)
        {
            scaler.load_state(saved)?;
        }
        iteration = checkpoint.training_state().iteration;
        consumed = checkpoint.training_state().consumed_samples;
        resumed_from = Some(checkpoint.dir().to_path_buf());
    }
    // One chunk per rank here: the check refuses the hook with virtual stages.
    if config.overlap_grad_reduce
        && let Some(optim) = rank.distributed.as_mut()
        && let [chunk] = rank.chunks.as_mut_slice()
    {
        let hook = optim.overlap_hook(&*chunk, *num_microbatches);
        chunk.set_backward_hook(Some(hook));
    }
    // Dropout masks are keyed by the forward pass's number: continue the count (each chunk
    // runs once per microbatch).
    for chunk in &rank.chunks {
        chunk.set_next_call(iteration * *num_microbatches as u64);
    }
    let mut schedule = config.lr_schedule()?.resumed_at(iteration as usize);
    let clip = GradClipConfig::new().with_max_norm(config.clip_grad);
    let tokens_per_step = (config.global_batch_size * config.seq_length) as u64;
    let flops_per_step =
        model_config.training_flops(config.global_batch_size, config.seq_length)?;

    let parameters = count_parameters(&state, &rank.chunks, device)?;
    if logging {
        observer.on_start(&RunStart {
            first_iteration: iteration,
            train_iters: config.train_iters as u64,
            world_size: state.world().size(),
            tp: *tp,
            pp: *pp,
            cp: *cp,
            virtual_pipeline_size: *virtual_pipeline_size,
            num_microbatches: *num_microbatches,
            parameters,
            resumed_from: resumed_from.clone(),
            data: data.description.clone(),
            startup_seconds: started.elapsed().as_secs_f64(),
        });
    }

    let mut summary = PretrainSummary {
        iterations: Vec::new(),
        evaluations: Vec::new(),
        checkpoints: Vec::new(),
        resumed_from,
        reduced_in_backward: 0,
    };
    let checkpointer = config
        .save
        .as_ref()
        .map(|root| Checkpointer::new(root).with_keep_last(config.keep_last_checkpoints));
    let mut in_background = match (&checkpointer, config.async_save) {
        (Some(c), true) => Some(AsyncCheckpointer::<B>::new(c.clone())),
        _ => None,
    };
    if let Some(saver) = &in_background {
        saver.prepare(&state, &rank.chunks);
    }
    let mut parameters_checked_at = None;
    let profiled = config.profile && config.profile_ranks.contains(&world_rank);
    let mut profiling = false;
    while iteration < config.train_iters as u64 {
        if profiled && iteration == config.profile_step_start {
            profiling = B::profile_start(device);
        }
        let started = Instant::now();
        let lr = LrScheduler::step(&mut schedule);
        let microbatches = read_microbatches::<B, _>(
            &data.train,
            &state,
            consumed as usize,
            *num_microbatches,
            config.micro_batch_size,
            config.vocab_size,
            device,
        )?;
        let loss_scale = scaler.as_ref().map(|s| s.scale());
        // global_aux_loss counts each optimizer step's load afresh.
        rank.chunks.iter().for_each(GptModel::reset_global_load);
        let out = match &loss_scale {
            Some(scale) => forward_backward_scaled(
                schedule_kind,
                &state,
                &rank.chunks,
                &microbatches,
                scale.clone(),
            )?,
            None => forward_backward(schedule_kind, &state, &rank.chunks, &microbatches)?,
        };
        // FP8 delayed scaling: every DP rank casts the next step with the same scales.
        if fp8_delayed {
            for chunk in &rank.chunks {
                chunk.reduce_fp8_histories::<B::InnerBackend>(state.dp())?;
            }
        }
        B::profile_phase(device, "optimizer");
        let mut grads = out.grads;
        let moe_stats = out.moe;
        let bias_rate = model_config
            .moe
            .as_ref()
            .filter(|moe| moe.expert_bias)
            .map(|moe| moe.bias_update_rate);
        let bias_stats = moe_stats.clone().filter(|_| bias_rate.is_some());
        let loss = shared_loss(&state, out.loss, device)?;
        let norm = if let Some(optim) = rank.distributed.as_mut() {
            let grads = merge_chunk_grads(&rank.chunks, grads);
            let step = match scaler.as_mut() {
                Some(scaler) => optim.step_scaled(lr, rank.chunks, &grads, scaler)?,
                None => optim.step(lr, rank.chunks, &grads)?,
            };
            rank.chunks = step.model;
            step.grad_norm
        } else {
            let norm = clip_grad_norm(&rank.chunks, &mut grads, &state, &clip)?;
            let grads = merge_chunk_grads(&rank.chunks, grads);
            let (decay, no_decay) = rank.groups.split(&rank.chunks, grads);
            let chunks = rank.decay.step(lr, rank.chunks, decay);
            rank.chunks = rank.no_decay.step(lr, chunks, no_decay);
            norm
        };
        // DeepSeek-V3's expert bias follows the step's load over every DP × CP rank.
        if let (Some(rate), Some(stats)) = (bias_rate, &bias_stats) {
            let load = global_expert_load::<B>(&state, stats, device)?;
            rank.chunks = std::mem::take(&mut rank.chunks)
                .into_iter()
                .map(|chunk| chunk.with_updated_expert_bias(&load, rate))
                .collect();
        }
        let logged = (iteration + 1).is_multiple_of(config.log_interval as u64)
            || iteration + 1 == config.train_iters as u64;
        let memory = match B::memory_in_use(device) {
            Some(bytes) if logged => Some(largest_over_ranks(&state, bytes, device)?),
            _ => None,
        };
        let peak = match out.peak_memory_bytes {
            Some(bytes) if logged => Some(largest_over_ranks(&state, bytes, device)?),
            _ => None,
        };
        let moe = match model_config.moe.is_some() && logged {
            true => {
                let values = moe_report(&state, moe_stats, device)?;
                let values = read_f32(values, world_rank, "the MoE losses and load")?;
                let drops = (model_config.moe.as_ref()).is_some_and(|moe| moe.capacity.is_some());
                Some(MoeReport::from_values(&values, drops))
            }
            false => None,
        };
        let optional = [loss_scale, memory, peak];
        let mut values = read_scalars(
            [loss, norm]
                .into_iter()
                .chain(optional.iter().flatten().cloned())
                .collect(),
            world_rank,
            "the step's loss and gradient norm",
        )?
        .into_iter();
        // Collectives over NCCL return once enqueued: if the watchdog aborted one of this step
        // (a peer died), the values just read are wrong and nothing has said so. End with the
        // watchdog's error (naming the dead rank) before logging or saving them.
        state.failure()?;
        let [loss, grad_norm] = [(); 2].map(|_| values.next().unwrap_or(f64::NAN));
        let [loss_scale, max_memory_bytes, peak_memory_bytes] =
            optional.map(|t| t.map(|_| values.next().unwrap_or(f64::NAN)));
        let max_memory_bytes = max_memory_bytes.map(|mib| mib * MIB);
        let peak_memory_bytes = peak_memory_bytes.map(|mib| mib * MIB);
        iteration += 1;
        interval_losses.push(loss);
        let lm_loss = interval_losses.iter().sum::<f64>() / interval_losses.len() as f64;
        if logged {
            interval_losses.clear();
        }
        consumed += config.global_batch_size as u64;
        let seconds = started.elapsed().as_secs_f64();
        let flops_per_second = flops_per_step / seconds.max(f64::MIN_POSITIVE);
        let devices = state.world().size();
        let report = IterationReport {
            iteration,
            loss,
            lm_loss,
            lr,
            grad_norm,
            consumed_samples: consumed,
            tokens: tokens_per_step,
            seconds,
            flops_per_second,
            devices,
            mfu: flops_per_second / devices as f64 / (config.peak_tflops * 1e12),
            max_memory_bytes,
            peak_memory_bytes,
            loss_scale,
            moe,
        };
        summary.iterations.push(report);
        if logging
            && (iteration.is_multiple_of(config.log_interval as u64)
                || iteration == config.train_iters as u64)
        {
            observer.on_iteration(&report);
        }
        if config.check_for_nan_in_loss_and_grad {
            // The values just read for the log: no extra sync. Under fp16's loss scaler a
            // non-finite gradient norm is an overflow, skipped by the optimizer, not an error.
            let norm = scaler.is_none().then_some(grad_norm);
            check_step_values(iteration, world_rank, loss, norm)?;
        }
        // After the step's time was taken: reading the profile waits for the GPU.
        if profiling && iteration == config.profile_step_end {
            profiling = false;
            let steps = config.profile_step_end - config.profile_step_start;
            if let Some(table) = B::profile_report(device, 25, steps as usize) {
                let window = config.profile_step_start + 1..=config.profile_step_end;
                observer.on_profile(world_rank, window, &table);
            }
        }

        let last = iteration == config.train_iters as u64;
        let interval = config.eval_interval as u64;
        if let Some(valid) = &data.valid
            && interval > 0
            && (iteration.is_multiple_of(interval) || last)
        {
            let index = iteration.div_ceil(interval) as usize - 1;
            let loss = evaluate(&state, config, &layout, &rank.chunks, valid, index, device)?;
            let report = EvalReport { iteration, loss };
            summary.evaluations.push(report);
            if logging {
                observer.on_evaluation(&report);
            }
        }

        if let Some(checkpointer) = &checkpointer
            && (last
                || config
                    .save_interval
                    .is_some_and(|k| iteration.is_multiple_of(k as u64)))
        {
            if config.check_for_nan_in_loss_and_grad {
                // No checkpoint may hold a NaN: every rank's parameters, before any writes.
                check_finite_chunks(&state, &rank.chunks, device, iteration)?;
                parameters_checked_at = Some(iteration);
            }
            let training = TrainingState {
                iteration,
                consumed_samples: consumed,
                rng_seed: config.seed,
                lr_scheduler: Some(serde_json::json!({ "next_step": schedule.next_step() })),
                loss_scaler: scaler
                    .as_ref()
                    .map(|s| s.state().map_err(|e| e.on_rank(world_rank)))
                    .transpose()?,
            };
            let chunks = rank.chunks.as_slice();
            let optimizer = rank.optimizer_state()?;
            let published = match in_background.as_mut() {
                Some(saver) => {
                    let previous = saver.in_flight();
                    let dir = saver.save(
                        &state,
                        model_config,
                        chunks,
                        Some(optimizer.as_slice()),
                        &training,
                    )?;
                    previous.zip(dir)
                }
                None => {
                    let dir = checkpointer.save(
                        &state,
                        model_config,
                        chunks,
                        Some(optimizer.as_slice()),
                        &training,
                    )?;
                    Some((iteration, dir))
                }
            };
            if let Some((saved_at, dir)) = published {
                if logging {
                    observer.on_checkpoint(saved_at, &dir);
                }
                summary.checkpoints.push(dir);
            }
        }
    }
    if config.check_for_nan_in_loss_and_grad && parameters_checked_at != Some(iteration) {
        // The end of the run: the last step's update, unless a save just checked it.
        check_finite_chunks(&state, &rank.chunks, device, iteration)?;
    }
    if let Some(saver) = in_background.as_mut() {
        let previous = saver.in_flight();
        if let Some((saved_at, dir)) = previous.zip(saver.finish(&state)?) {
            if logging {
                observer.on_checkpoint(saved_at, &dir);
            }
            summary.checkpoints.push(dir);
        }
    }
    if logging {
        observer.on_finish();
    }
    summary.reduced_in_backward = rank.distributed.as_ref().map_or(0, |o| o.hooked_numel());
    Ok(summary)
}

/// The step's loss on every rank: the last stage holds it, the others add zero over the
/// pipeline group (Megatron logs from the last stage; here every rank may log), and the DP
/// ranks' losses (each the mean over its microbatches) are averaged.
fn shared_loss<B: DistBackend>(
    state: &ParallelState,
    loss: Option<Tensor<B, 1>>,
    device: &B::Device,
) -> Result<Tensor<B, 1>> {
    let loss = loss_on_every_stage(state, loss, device)?;
    Ok(state.dp().all_reduce(loss, ReduceOp::Avg)?)
}

/// `[1]` tensors read in one host transfer, as f32 (NaN for a value missing from what was
/// read). A device error, such as a deferred one the read is the first to see, is a
/// [`DeviceError`](crate::error::DeviceError) naming `what` and `rank`.
fn read_scalars<B: burn::tensor::backend::Backend>(
    tensors: Vec<Tensor<B, 1>>,
    rank: usize,
    what: &str,
) -> Result<Vec<f64>> {
    let n = tensors.len();
    let values = read_f32(
        Tensor::cat(tensors.into_iter().map(|t| t.cast(DType::F32)).collect(), 0),
        rank,
        what,
    )?;
    Ok((0..n)
        .map(|i| values.get(i).map_or(f64::NAN, |&v| v as f64))
        .collect())
}

/// Evaluation `index` (0 for the first): `eval_iters` global batches of the validation split,
/// from sample `index · eval_iters · global_batch`, through the schedule's forward passes
/// only. The training model's forward-pass count is left as it was, so evaluating does not
/// change the dropout masks of training.
fn evaluate<B>(
    state: &ParallelState,
    config: &PretrainConfig,
    layout: &RunLayout,
    chunks: &[GptModel<B>],
    valid: &impl crate::data::SampleDataset,
    index: usize,
    device: &B::Device,
) -> Result<f64>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend + ModelBackend,
{
    let calls: Vec<u64> = chunks.iter().map(GptModel::next_call).collect();
    let model: Vec<_> = chunks.iter().map(|c| c.valid()).collect();
    let mut total = 0.0;
    for j in 0..config.eval_iters {
        let first = (index * config.eval_iters + j) * config.global_batch_size;
        let microbatches = read_microbatches::<B::InnerBackend, _>(
            valid,
            state,
            first,
            layout.num_microbatches,
            config.micro_batch_size,
            config.vocab_size,
            device,
        )?;
        let loss = forward_only(layout.schedule(), state, &model, &microbatches)?;
        let rank = state.world().rank();
        let loss = read_scalars(
            vec![shared_loss(state, loss, device)?],
            rank,
            "the evaluation loss",
        )?[0];
        total += loss;
    }
    for (chunk, call) in chunks.iter().zip(calls) {
        chunk.set_next_call(call);
    }
    Ok(total / config.eval_iters as f64)
}

/// Parameters of the whole model, each counted once (DP rank 0's TP rank 0 counts the full shape of
/// what its group splits; the last stage's copy of a tied table is not counted), summed over
/// the world in f32: exact to about 7 digits, enough for a log.
fn count_parameters<B>(
    state: &ParallelState,
    chunks: &[GptModel<B>],
    device: &B::Device,
) -> Result<f64>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend,
{
    let local: usize = if state.tp().rank() == 0 && state.dp().rank() == 0 && state.coords().cp == 0
    {
        let count = |chunk: &GptModel<B>| -> usize {
            let copies = shared_copies(chunk);
            param_infos(chunk)
                .iter()
                .filter(|p| !copies.contains(&p.path))
                .map(|p| p.global_shape().iter().product::<usize>())
                .sum()
        };
        chunks.iter().map(count).sum()
    } else {
        0
    };
    let local = Tensor::<B::InnerBackend, 1>::from_data(
        burn::tensor::TensorData::new(vec![local as f32], [1]),
        (device, DType::F32),
    );
    let total = read_scalars(
        vec![state.world().all_reduce(local, ReduceOp::Sum)?],
        state.world().rank(),
        "the parameter count",
    )?[0];
    Ok(total)
}
