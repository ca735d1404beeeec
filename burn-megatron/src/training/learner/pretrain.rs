//! `pretrain_gpt --learner`: the run of a [`PretrainConfig`] through burn-train, one
//! `SupervisedTraining` per rank, with burn-train's dashboard and our metrics.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::DataLoader;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{LearningRateMetric, LossMetric};
use burn::train::{Learner, SupervisedTraining};
use burn_megatron_dist::{DistBackend, ParallelSizes, RankContext};

use super::failure::catch;
use super::{
    GptStepLoader, LanguageModelMetric, LogRenderer, MegatronOptimizer, MegatronStrategy,
    MegatronTraining, MetricRecorder, ParallelGpt, QuietRenderer, StepShape,
};
use crate::backend::{BackendInfo, ModelBackend};
use crate::checkpointing::Checkpointer;
use crate::error::{ConfigError, Result};
use crate::optimizer::shared_copies;
use crate::training::{PretrainConfig, PretrainData};

/// Where a Learner run reports.
#[derive(Clone, Default)]
pub struct LearnerReporting {
    /// burn-train's directory (its metric files and experiment log, rank 0).
    pub directory: PathBuf,
    /// Also record every metric value here.
    pub recorder: Option<MetricRecorder>,
    /// No dashboard or console output (tests).
    pub quiet: bool,
    /// Peak FLOP/s of one device, the MFU denominator (`--peak-tflops` when `None`).
    pub peak_flops_per_device: Option<f64>,
}

/// Runs `config` as this rank of `ctx` through burn-train's `Learner` (its dashboard on a
/// terminal, a [`LogRenderer`] otherwise): the rank's
/// [`ParallelGpt`] chunk, the distributed optimizer (`--use-distributed-optimizer` shards
/// its state), Megatron's learning-rate schedule, the training split read as `pretrain`
/// reads it, and at the end the validation split's batches of `pretrain`'s last evaluation.
/// With `--save`, checkpoints every `--save-interval` steps and after the last; with `--load`
/// (the same directory as `--save`), the run resumes from its latest checkpoint.
///
/// Every rank of the world must call it with the same configuration and data. The losses
/// equal `pretrain`'s with the distributed optimizer (tests/pretrain/learner.rs).
///
/// Failures are this function's errors, never panics: Burn's `Learner` API cannot return
/// errors from a step, a data loader or an optimizer, so the strategy's loop and the whole
/// burn-train run are panic boundaries ([`std::panic::catch_unwind`]). Our steps, loader and
/// optimizer unwind with their typed error (a bad token id, a failed collective, a device
/// error), which comes back as it was; a panic of anyone else's comes back as
/// [`TrainingError::Learner`](crate::error::TrainingError::Learner) with its message. With
/// `--check-for-nan-in-loss-and-grad` a non-finite loss, gradient norm or parameter is a
/// [`TrainingError::NonFinite`](crate::error::TrainingError::NonFinite) before any
/// checkpoint of that iteration is written.
pub fn pretrain_with_learner<B>(
    ctx: &RankContext,
    config: &PretrainConfig,
    data: &PretrainData,
    device: &B::Device,
    reporting: &LearnerReporting,
) -> Result<()>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend + ModelBackend,
{
    let layout = config.check(ctx.world_size())?;
    if config.load.is_some() && config.load != config.save {
        return Err(ConfigError::Invalid(
            "with --learner a run resumes from its --save directory: give --load the same \
             directory as --save, or leave --load out"
                .into(),
        )
        .into());
    }
    let sizes = ParallelSizes::default()
        .with_tp(layout.tp)
        .with_pp(layout.pp)
        .with_ep(layout.ep);
    let state = ctx.parallel_state(sizes)?;
    let model_config = config.model();
    let model = ParallelGpt::<B>::init(&model_config, &state, device)?;
    let optim =
        config
            .distributed_adamw()
            .init(&model.model, &state, &shared_copies(&model.model))?;
    let mut optim = MegatronOptimizer::new(optim);
    let mut model = model;
    if config.fp16 {
        let scaler = config.loss_scaler().init::<B::InnerBackend>(device)?;
        optim = optim.with_loss_scaler(scaler);
        model = model.with_loss_scale(optim.loss_scale());
    }

    let shape = StepShape {
        micro_batch_size: config.micro_batch_size,
        global_batch_size: config.global_batch_size,
        vocab_size: config.vocab_size,
    };
    let train = GptStepLoader::<B, _>::new(
        Arc::new(data.train.clone()),
        &state,
        shape,
        config.train_iters,
        device,
    )?;
    let last_evaluation = match config.eval_interval {
        0 => 0,
        interval => config.train_iters.div_ceil(interval) - 1,
    };
    let eval_steps = if config.eval_interval == 0 {
        0
    } else {
        config.eval_iters
    };
    let first_eval = last_evaluation * eval_steps;
    let valid: Arc<dyn DataLoader<B::InnerBackend, _>> = match &data.valid {
        Some(valid) => GptStepLoader::<B::InnerBackend, _>::new(
            Arc::new(valid.clone()),
            &state,
            shape,
            first_eval + eval_steps,
            device,
        )?
        .slice(first_eval, first_eval + eval_steps),
        None => GptStepLoader::<B::InnerBackend, _>::new(
            Arc::new(data.train.clone()),
            &state,
            shape,
            0,
            device,
        )?
        .slice(0, 0),
    };

    let mut strategy =
        MegatronStrategy::new(&state, &optim).with_nan_check(config.check_for_nan_in_loss_and_grad);
    if let Some(root) = &config.save {
        let checkpointer = Checkpointer::new(root).with_keep_last(config.keep_last_checkpoints);
        let interval = config.save_interval.unwrap_or(config.train_iters);
        strategy = strategy.with_checkpoints(checkpointer, interval, shape, config.load.is_some());
    }
    let peak = reporting
        .peak_flops_per_device
        .unwrap_or(config.peak_tflops * 1e12);
    let mut training = SupervisedTraining::new(&reporting.directory, Arc::new(train), valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_valid_numeric(LanguageModelMetric::perplexity())
        .metric_train_numeric(LearningRateMetric::new())
        .metric_train_numeric(LanguageModelMetric::grad_norm())
        .metric_train_numeric(LanguageModelMetric::tokens_per_second())
        .metric_train_numeric(LanguageModelMetric::tflops_per_device())
        .metric_train_numeric(LanguageModelMetric::mfu(peak))
        .num_epochs(1);
    if config.fp16 {
        training = training.metric_train_numeric(LanguageModelMetric::loss_scale());
    }
    if let Some(moe) = &model_config.moe {
        training = training
            .metric_train_numeric(LanguageModelMetric::load_balancing_loss())
            .metric_train_numeric(LanguageModelMetric::z_loss())
            .metric_train_numeric(LanguageModelMetric::expert_load_min())
            .metric_train_numeric(LanguageModelMetric::expert_load_max());
        if moe.capacity.is_some() {
            training = training.metric_train_numeric(LanguageModelMetric::dropped_assignments());
        }
        if moe.expert_bias {
            strategy = strategy.with_expert_bias(moe.bias_update_rate);
        }
    }
    if <B::InnerBackend as BackendInfo>::memory_in_use(device).is_some() {
        training = training.metric_train_numeric(LanguageModelMetric::memory());
    }
    if let Some(recorder) = &reporting.recorder {
        training = training.with_metric_logger(recorder.clone());
    }
    if reporting.quiet {
        training = training
            .renderer(QuietRenderer)
            .with_application_logger(None);
    } else if !std::io::stdout().is_terminal() {
        training = training.renderer(LogRenderer::new(config.log_interval));
    }
    let failure = strategy.failure();
    let learner = Learner::new(model, optim, config.lr_schedule()?);
    // The panic boundary around burn-train: a panic outside the strategy's own boundary
    // (burn-train's event processing, its renderer) is an error too.
    catch(state.world().rank(), "the Learner run", || {
        training.with_megatron(strategy).launch(learner);
        Ok(())
    })?;
    match failure.take() {
        Some(error) => Err(error),
        None => Ok(()),
    }
}
