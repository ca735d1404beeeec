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
//! Not supported, and refused with a panic that says so: burn-train's per-epoch file
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

use super::output::LanguageModelOutput;
use super::quiet::{QuietLogger, QuietRenderer};
use super::{MegatronOptimizer, ParallelGpt, StepShape};
use crate::backend::{BackendInfo, ModelBackend};
use crate::checkpointing::{
    Checkpoint, Checkpointer, TrainingState, distributed_adamw_state, latest_checkpoint,
    load_distributed_adamw,
};
use crate::error::Result;
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
}

impl<B: AutodiffBackend, M> MegatronStrategy<B, M> {
    /// The loop of this rank of `state`, stepping `optim` (a clone of the handle given to
    /// the `Learner`).
    pub fn new(state: &ParallelState, optim: &MegatronOptimizer<B>) -> Self {
        Self {
            state: state.clone(),
            optim: optim.clone(),
            checkpoints: None,
        }
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
            let optimizer = optim.with(|o| distributed_adamw_state(&model.model, o))?;
            let training = TrainingState {
                iteration,
                consumed_samples: iteration * global_batch,
                rng_seed: model.config().seed,
                lr_scheduler: Some(serde_json::json!({ "next_step": iteration })),
                loss_scaler: optim.loss_scaler_state(),
            };
            checkpointer.save(
                model.state(),
                model.config(),
                core::slice::from_ref(&model.model),
                Some(&[optimizer]),
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
            optim.with(|o| load_distributed_adamw(&checkpoint, &chunk, o))?;
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

fn or_panic<T>(state: &ParallelState, what: &str, result: Result<T>) -> T {
    result.unwrap_or_else(|e| panic!("rank {}: {what} failed: {e}", state.world().rank()))
}

impl<LC, B> SupervisedLearningStrategy<LC> for MegatronStrategy<B, LC::TrainingModel>
where
    LC: LearningComponentsTypes<Backend = B, Optimizer = MegatronOptimizer<B>>,
    B: AutodiffBackend,
    B::InnerBackend: DistBackend + ModelBackend,
    LC::TrainingModel: TrainStep<Output = LanguageModelOutput<B::InnerBackend>>,
    LC::InferenceModel: InferenceStep<Output = LanguageModelOutput<B::InnerBackend>>,
{
    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        train: TrainLoader<LC>,
        valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let state = &self.state;
        assert!(
            components.checkpointer.is_none() && starting_epoch == 1,
            "MegatronStrategy keeps sharded state that burn-train's per-epoch checkpointer \
             cannot hold: use MegatronStrategy::with_checkpoints instead of \
             with_file_checkpointer/checkpoint"
        );
        assert!(
            components.grad_accumulation.is_none(),
            "MegatronStrategy: the model's step accumulates its microbatches (the global \
             batch is micro batch × microbatches × DP); leave grads_accumulation unset"
        );
        own_autodiff_leaves(&mut learner);
        let logging = self.is_logging_rank();
        let mut processor = components.event_processor;
        let steps_per_epoch = train.num_items().max(1);
        let num_epochs = components.num_epochs;

        let mut iteration = 0;
        if let Some(checkpoints) = &self.checkpoints {
            let resumed = or_panic(
                state,
                "resuming from the checkpoint",
                (checkpoints.resume)(learner.model(), &self.optim),
            );
            if let Some((model, training)) = resumed {
                learner.load_model(model.into_record());
                iteration = training.iteration as usize;
                for _ in 0..iteration {
                    learner.lr_step();
                }
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
                item.loss = or_panic(
                    state,
                    "averaging the loss over data-parallel ranks",
                    state
                        .dp()
                        .all_reduce(item.loss, ReduceOp::Avg)
                        .map_err(Into::into),
                );
                item.grad_norm = self.optim.last_grad_norm();
                item.loss_scale = self.optim.last_loss_scale();
                item.max_memory_mib = or_panic(
                    state,
                    "gathering the ranks' memory",
                    largest_memory::<B>(state, &learner.model()),
                );
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
                if let Some(checkpoints) = &self.checkpoints
                    && (iteration.is_multiple_of(checkpoints.interval) || last)
                {
                    or_panic(
                        state,
                        "saving the checkpoint",
                        (checkpoints.save)(&learner.model(), &self.optim, iteration as u64),
                    );
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
                item.loss = or_panic(
                    state,
                    "averaging the validation loss over data-parallel ranks",
                    state
                        .dp()
                        .all_reduce(loss, ReduceOp::Avg)
                        .map_err(Into::into),
                );
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
        (learner.model(), processor)
    }
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
