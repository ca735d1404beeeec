//! [`MegatronStrategy`]: burn-train's training loop for one rank of a parallel job, plugged
//! in as `TrainingStrategy::Custom`.
//!
//! Every rank runs the same program (Megatron's SPMD model, one process per GPU or one
//! thread per CPU rank): it builds its `Learner` on its own model chunk and calls
//! `SupervisedTraining::launch`. The strategy then, per global step:
//! 1. advances the learning-rate schedule once (whatever the number of GPUs, unlike Burn's
//!    DDP, which steps it on every device);
//! 2. runs the model's `TrainStep` (for [`ParallelGpt`](super::ParallelGpt), the pipeline
//!    schedule over the rank's microbatches);
//! 3. steps the [`MegatronOptimizer`]: gradients reduced over data-parallel ranks, clipped by
//!    the global norm, AdamW on fp32 master weights (sharded with the distributed optimizer);
//! 4. averages the loss over data-parallel ranks on the device and hands the step, with its
//!    gradient norm, to burn-train's event processor on the logging rank (global rank 0)
//!    only: metrics, the renderer and the metric files are rank 0's.
//!
//! At the end of each epoch every rank runs the validation loader through the model's
//! `InferenceStep`, and the logging rank reports one validation item: the mean loss over
//! the validation batches and the DP ranks (Megatron's evaluation), so burn-train's
//! validation metrics (loss, perplexity) are the evaluation's. With [`with_checkpoints`](MegatronStrategy::with_checkpoints) the model
//! and the optimizer's sharded state are saved every `interval` steps into our sharded
//! checkpoints, and a run that finds one resumes from it (same data order, same losses).
//!
//! Failures are errors, not panics: burn-train's `fit` returns no `Result`, so the loop runs
//! inside a panic boundary ([`std::panic::catch_unwind`]); the typed errors of our steps,
//! loader and optimizer (which Burn's traits make unwind) and any other panic's message stop
//! the loop, burn-train ends the run as usual, and the error waits in
//! [`MegatronStrategy::failure`] ([`pretrain_with_learner`](super::pretrain_with_learner)
//! returns it). With `--check-for-nan-in-loss-and-grad` (on by default) a non-finite loss or
//! gradient norm, flagged on the device each step, or a non-finite parameter stops the run
//! before a checkpoint is saved ([`MegatronStrategy::with_nan_check`]).
//!
//! Not supported, and refused with an error that says so: burn-train's per-epoch file
//! checkpointer and `checkpoint(epoch)` (they cannot hold sharded state), and its gradient
//! accumulation (the schedule accumulates microbatches). burn-train's interrupter is not
//! honoured: stopping one rank alone would leave the others waiting in a collective.

use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::AutodiffBackend;
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearningComponentsTypes,
    SupervisedLearningStrategy, SupervisedTraining, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};
use burn_megatron_dist::{DistBackend, ParallelState, ReduceOp};

use super::failure::{FitFailure, catch};
use super::output::LanguageModelOutput;
use super::quiet::{QuietLogger, QuietRenderer};
use super::{MegatronOptimizer, ParallelGpt, StepShape};
use crate::backend::{BackendInfo, ModelBackend};
use crate::checkpointing::{
    Checkpoint, Checkpointer, TrainingState, distributed_adamw_state, latest_checkpoint,
    load_distributed_adamw,
};
use crate::error::{ConfigError, Result};
use crate::training::check_finite_parameters;
use crate::training::moe_log::global_expert_load;
use crate::training::nan_check::StepFlag;
use crate::training::step::largest_over_ranks;

/// Gives this rank's model autodiff leaves of its own.
///
/// Thread ranks often start from clones of one initial model, and a clone shares its
/// parameters' autodiff nodes. burn-autodiff then merges the ranks' graphs into one, and its
/// locks deadlock when one rank's backward pass cleans up while another rank records its
/// forward pass (seen about once in fifteen DP 2 runs). `fork` detaches every parameter into
/// a new leaf, keeping its value, `ParamId` and `require_grad`.
fn own_autodiff_leaves<LC: LearningComponentsTypes>(learner: &mut Learner<LC>) {
    let model = learner.model();
    if let Some(device) = model.devices().first().cloned() {
        learner.load_model(model.fork(&device).into_record());
    }
}

/// Saves the model and optimizer after the given iteration.
type SaveFn<B, M> = Box<dyn Fn(&M, &MegatronOptimizer<B>, u64) -> Result<PathBuf> + Send + Sync>;
type ResumeFn<B, M> =
    Box<dyn Fn(M, &MegatronOptimizer<B>) -> Result<Option<(M, TrainingState)>> + Send + Sync>;
/// After a step's optimizer update: the model changed from the step's output (DeepSeek-V3's
/// expert bias), or `None` to keep it.
type AfterStepFn<B, M> = Box<
    dyn Fn(M, &LanguageModelOutput<<B as AutodiffBackend>::InnerBackend>) -> Result<Option<M>>
        + Send
        + Sync,
>;

/// Step-interval checkpoints: how to save and resume the model `M`.
struct StepCheckpoints<B: AutodiffBackend, M> {
    interval: usize,
    save: SaveFn<B, M>,
    resume: ResumeFn<B, M>,
}

/// burn-train's training loop for one rank of a Megatron-style parallel job: each global
/// step, the LR schedule once, the model's `TrainStep`, the optimizer, and the loss averaged
/// over DP for the logging rank. `M` is the training model, `B` its backend.
pub struct MegatronStrategy<B: AutodiffBackend, M> {
    state: ParallelState,
    optim: MegatronOptimizer<B>,
    checkpoints: Option<StepCheckpoints<B, M>>,
    after_step: Option<AfterStepFn<B, M>>,
    check_for_nan: bool,
    failure: FitFailure,
}

impl<B: AutodiffBackend, M> MegatronStrategy<B, M> {
    /// The loop of this rank of `state`, stepping `optim` (a clone of the handle given to
    /// the `Learner`).
    pub fn new(state: &ParallelState, optim: &MegatronOptimizer<B>) -> Self {
        Self {
            state: state.clone(),
            optim: optim.clone(),
            checkpoints: None,
            after_step: None,
            check_for_nan: true,
            failure: FitFailure::default(),
        }
    }

    /// Whether a non-finite loss or gradient norm, or a non-finite parameter before a save
    /// and at the end, stops the run (`--check-for-nan-in-loss-and-grad`; on by default).
    /// The loss and norm are flagged on the device each step, with no host read; the flag is
    /// read before each checkpoint save and at the end of the run, and every parameter is
    /// checked there too (one all-reduce and one read each time).
    pub fn with_nan_check(mut self, check: bool) -> Self {
        self.check_for_nan = check;
        self
    }

    /// Where the error that ends the loop is left, since burn-train's `fit` cannot return one:
    /// take it after `launch` ([`FitFailure::take`]). A run whose loop failed returns the
    /// model as it was when it stopped.
    pub fn failure(&self) -> FitFailure {
        self.failure.clone()
    }

    /// Whether this rank reports to burn-train's event processor (global rank 0).
    pub fn is_logging_rank(&self) -> bool {
        self.state.world().rank() == 0
    }
}

impl<B> MegatronStrategy<B, ParallelGpt<B>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend + ModelBackend,
{
    /// Saves the model and the distributed optimizer's state with `checkpointer` every
    /// `interval` steps and after the last one, as `pretrain_gpt` does (the same format:
    /// either loads the other's checkpoints). With `resume`, before training the latest
    /// checkpoint under the checkpointer's root, if any, is loaded (saved at any TP/PP/DP
    /// layout) and training continues after its step: the learning-rate schedule is advanced
    /// past it, the loader's steps before it are skipped and the dropout masks continue.
    /// `shape` is the loader's batch shape.
    pub fn with_checkpoints(
        mut self,
        checkpointer: Checkpointer,
        interval: usize,
        shape: StepShape,
        resume: bool,
    ) -> Self {
        let dp = self.state.dp().size();
        let microbatches = (shape.global_batch_size / (shape.micro_batch_size * dp).max(1)) as u64;
        let root = checkpointer.root().to_path_buf();
        let global_batch = shape.global_batch_size as u64;
        let save: SaveFn<B, ParallelGpt<B>> = Box::new(move |model, optim, iteration| {
            let chunks = core::slice::from_ref(&model.model);
            let optimizer = optim.with(|o| distributed_adamw_state(chunks, o))?;
            let training = TrainingState {
                iteration,
                consumed_samples: iteration * global_batch,
                rng_seed: model.config().seed,
                lr_scheduler: Some(serde_json::json!({ "next_step": iteration })),
                loss_scaler: optim.loss_scaler_state()?,
            };
            checkpointer.save(
                model.state(),
                model.config(),
                chunks,
                Some(&optimizer),
                &training,
            )
        });
        let resume: ResumeFn<B, ParallelGpt<B>> = Box::new(move |model, optim| {
            if !resume || latest_checkpoint(&root)?.is_none() {
                return Ok(None);
            }
            let checkpoint = Checkpoint::open_latest(&root)?;
            checkpoint.check_config(model.config())?;
            let chunk = checkpoint.load_model(model.model.clone())?;
            optim
                .with(|o| load_distributed_adamw(&checkpoint, core::slice::from_ref(&chunk), o))?;
            let training = checkpoint.training_state().clone();
            if let Some(saved) = &training.loss_scaler {
                optim.load_loss_scaler_state(saved)?;
            }
            chunk.set_next_call(training.iteration * microbatches);
            Ok(Some((model.with_model(chunk), training)))
        });
        self.checkpoints = Some(StepCheckpoints {
            interval: interval.max(1),
            save,
            resume,
        });
        self
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing (`--moe-router-enable-expert-bias`):
    /// after each optimizer step the MoE layers' expert biases move by `rate` times the sign
    /// of their load's deviation over every DP × CP rank, as `pretrain_gpt`'s own loop moves
    /// them ([`GptModel::with_updated_expert_bias`](crate::models::GptModel::with_updated_expert_bias),
    /// on the device).
    pub fn with_expert_bias(mut self, rate: f64) -> Self {
        self.after_step = Some(Box::new(move |model: ParallelGpt<B>, item| {
            let Some(stats) = item.moe.as_ref().and_then(|moe| moe.stats.as_ref()) else {
                return Ok(None);
            };
            let device = stats.load_balancing_loss.device();
            let load = global_expert_load::<B>(model.state(), stats, &device)?;
            let chunk = model.model.clone().with_updated_expert_bias(&load, rate);
            Ok(Some(model.with_model(chunk)))
        }));
        self
    }
}

/// Device memory in use on this rank now, the largest over the world, in MiB (`[1]` f32 on
/// the device); `None` where the backend does not track memory.
fn largest_memory<B>(
    state: &ParallelState,
    model: &impl Module<B>,
) -> Result<Option<burn::tensor::Tensor<B::InnerBackend, 1>>>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend + ModelBackend,
{
    let Some(device) = model.devices().into_iter().next() else {
        return Ok(None);
    };
    <B::InnerBackend as BackendInfo>::memory_in_use(&device)
        .map(|bytes| largest_over_ranks::<B::InnerBackend>(state, bytes, &device))
        .transpose()
}

impl<B, M> MegatronStrategy<B, M>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B>,
{
    /// `--check-for-nan-in-loss-and-grad` before a save and at the end of the run: the first
    /// non-finite loss or gradient norm flagged on the device, then every parameter.
    fn check_finite(
        &self,
        flag: &StepFlag<B::InnerBackend>,
        model: &M,
        iteration: usize,
    ) -> Result<()> {
        if self.check_for_nan {
            flag.check(self.state.world().rank())?;
            check_finite_parameters(&self.state, model, iteration as u64)?;
        }
        Ok(())
    }
}

impl<LC, B> SupervisedLearningStrategy<LC> for MegatronStrategy<B, LC::TrainingModel>
where
    LC: LearningComponentsTypes<Backend = B, Optimizer = MegatronOptimizer<B>>,
    B: AutodiffBackend,
    B::InnerBackend: DistBackend + ModelBackend,
    LC::TrainingModel: TrainStep<Output = LanguageModelOutput<B::InnerBackend>>,
    LC::InferenceModel: InferenceStep<Output = LanguageModelOutput<B::InnerBackend>>,
{
    /// The loop (see [`MegatronStrategy`]). It runs inside a panic boundary: whatever
    /// fails, our typed errors from the steps, the loader and the optimizer, or another
    /// panic's message, stops the loop and is left in [`failure`](MegatronStrategy::failure);
    /// the model is returned as it was, and burn-train ends the run as usual.
    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        train: TrainLoader<LC>,
        valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let rank = self.state.world().rank();
        let mut processor = components.event_processor;
        let outcome = if components.checkpointer.is_some() || starting_epoch != 1 {
            Err(ConfigError::Invalid(
                "MegatronStrategy keeps sharded state that burn-train's per-epoch checkpointer \
                 cannot hold: use MegatronStrategy::with_checkpoints instead of \
                 with_file_checkpointer/checkpoint"
                    .into(),
            )
            .into())
        } else if components.grad_accumulation.is_some() {
            Err(ConfigError::Invalid(
                "MegatronStrategy: the model's step accumulates its microbatches (the global \
                 batch is micro batch × microbatches × DP); leave grads_accumulation unset"
                    .into(),
            )
            .into())
        } else {
            catch(rank, "the Learner's training loop", || {
                run(
                    self,
                    &mut learner,
                    &mut processor,
                    &train,
                    &valid,
                    components.num_epochs,
                )
            })
        };
        if let Err(error) = outcome {
            self.failure.set(error);
        }
        (learner.model(), processor)
    }
}

/// The epochs of [`fit`](SupervisedLearningStrategy::fit), as a `Result`.
fn run<LC, B>(
    strategy: &MegatronStrategy<B, LC::TrainingModel>,
    learner: &mut Learner<LC>,
    processor: &mut SupervisedTrainingEventProcessor<LC>,
    train: &TrainLoader<LC>,
    valid: &ValidLoader<LC>,
    num_epochs: usize,
) -> Result<()>
where
    LC: LearningComponentsTypes<Backend = B, Optimizer = MegatronOptimizer<B>>,
    B: AutodiffBackend,
    B::InnerBackend: DistBackend + ModelBackend,
    LC::TrainingModel: TrainStep<Output = LanguageModelOutput<B::InnerBackend>>,
    LC::InferenceModel: InferenceStep<Output = LanguageModelOutput<B::InnerBackend>>,
{
    let state = &strategy.state;
    own_autodiff_leaves(learner);
    let logging = strategy.is_logging_rank();
    let steps_per_epoch = train.num_items().max(1);
    let mut flag = StepFlag::<B::InnerBackend>::new();
    let mut checked_at = None;

    let mut iteration = 0;
    if let Some(checkpoints) = &strategy.checkpoints
        && let Some((model, training)) = (checkpoints.resume)(learner.model(), &strategy.optim)?
    {
        learner.load_model(model.into_record());
        iteration = training.iteration as usize;
        for _ in 0..iteration {
            learner.lr_step();
        }
    }

    let first_epoch = iteration / steps_per_epoch + 1;
    for epoch in first_epoch..=num_epochs {
        let epoch_progress = Progress::new(epoch, num_epochs);
        let skip = if epoch == first_epoch {
            iteration % steps_per_epoch
        } else {
            0
        };
        let loader = if skip > 0 {
            train.slice(skip, train.num_items())
        } else {
            train.clone()
        };
        let mut batches = loader.iter();
        while let Some(batch) = batches.next() {
            let progress =
                Progress::new(skip + batches.progress().items_processed, steps_per_epoch);
            iteration += 1;
            learner.lr_step();
            let out = learner.train_step(batch);
            learner.optimizer_step(out.grads);
            let mut item = out.item;
            if let Some(after_step) = &strategy.after_step
                && let Some(model) = after_step(learner.model(), &item)?
            {
                learner.load_model(model.into_record());
            }
            item.loss = state.dp().all_reduce(item.loss, ReduceOp::Avg)?;
            item.grad_norm = strategy.optim.last_grad_norm();
            item.loss_scale = strategy.optim.last_loss_scale();
            if strategy.check_for_nan {
                // Under fp16's loss scaler a non-finite norm is an overflow the
                // optimizer skipped, not an error.
                let norm = item
                    .grad_norm
                    .as_ref()
                    .filter(|_| item.loss_scale.is_none());
                flag.observe(iteration as u64, &item.loss, norm);
            }
            item.max_memory_mib = largest_memory::<B>(state, &learner.model())?;
            if logging {
                processor.process_train(LearnerEvent::ProcessedItem(TrainingItem::new(
                    item,
                    progress,
                    epoch_progress.clone(),
                    Some(iteration),
                    Some(learner.lr_current()),
                )));
            }
            let last =
                epoch == num_epochs && batches.progress().items_processed == loader.num_items();
            if let Some(checkpoints) = &strategy.checkpoints
                && (iteration.is_multiple_of(checkpoints.interval) || last)
            {
                let model = learner.model();
                // No checkpoint may hold a NaN: checked on every rank before any writes.
                strategy.check_finite(&flag, &model, iteration)?;
                checked_at = Some(iteration);
                (checkpoints.save)(&model, &strategy.optim, iteration as u64)?;
            }
        }
        processor.process_train(LearnerEvent::EndEpoch(epoch));

        let model = learner.model().valid();
        let mut evaluation: Option<(LanguageModelOutput<B::InnerBackend>, usize)> = None;
        for batch in valid.iter() {
            let item = model.step(batch);
            evaluation = Some(match evaluation {
                None => (item, 1),
                Some((sum, n)) => (
                    LanguageModelOutput {
                        loss: sum.loss + item.loss,
                        tokens: sum.tokens + item.tokens,
                        ..sum
                    },
                    n + 1,
                ),
            });
        }
        if let Some((mut item, batches)) = evaluation {
            // The mean over the validation batches, and over DP ranks.
            let loss = item.loss.div_scalar(batches as f64);
            item.loss = state.dp().all_reduce(loss, ReduceOp::Avg)?;
            if logging {
                processor.process_valid(LearnerEvent::ProcessedItem(TrainingItem::new(
                    item,
                    Progress::new(1, 1),
                    epoch_progress.clone(),
                    Some(iteration),
                    None,
                )));
            }
        }
        processor.process_valid(LearnerEvent::EndEpoch(epoch));
    }
    if checked_at != Some(iteration) {
        // The end of the run: the steps since the last save, and the last update.
        strategy.check_finite(&flag, &learner.model(), iteration)?;
    }
    Ok(())
}

/// `SupervisedTraining` set up for one rank of a parallel job.
pub trait MegatronTraining<B: AutodiffBackend, M>: Sized {
    /// Trains with `strategy`. On ranks other than the logging rank, burn-train's renderer,
    /// metric files and application log are turned off, so that one rank reports the run.
    fn with_megatron(self, strategy: MegatronStrategy<B, M>) -> Self;
}

impl<LC, B> MegatronTraining<B, LC::TrainingModel> for SupervisedTraining<LC>
where
    LC: LearningComponentsTypes<Backend = B>,
    B: AutodiffBackend,
    MegatronStrategy<B, LC::TrainingModel>: SupervisedLearningStrategy<LC> + 'static,
{
    fn with_megatron(self, strategy: MegatronStrategy<B, LC::TrainingModel>) -> Self {
        let logging = strategy.is_logging_rank();
        let training = self.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
        if logging {
            training
        } else {
            training
                .renderer(QuietRenderer)
                .with_application_logger(None)
                .with_metric_logger(QuietLogger)
        }
    }
}
