//! What a run reports as it goes: one value per iteration, evaluation and checkpoint, given
//! to a [`TrainingObserver`] on the logging rank (global rank 0). Every value is already
//! agreed by all ranks (the loss is shared from the last pipeline stage), so the logging
//! rank need not hold the loss itself.

use std::path::Path;

/// The run as it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStart {
    /// The first iteration to run (0, or the loaded checkpoint's iteration).
    pub first_iteration: u64,
    /// The iteration the run ends at.
    pub train_iters: u64,
    /// Ranks: TP × PP × CP × DP.
    pub world_size: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Model chunks per pipeline rank (virtual stages, interleaved 1F1B); 1 for 1F1B.
    pub virtual_pipeline_size: usize,
    /// Microbatches per step.
    pub num_microbatches: usize,
    /// Parameters of the whole model, each counted once (padding left out); summed in f32,
    /// so exact to about 7 digits.
    pub parameters: f64,
    /// The loaded checkpoint, if the run resumes.
    pub resumed_from: Option<std::path::PathBuf>,
    /// Where the data comes from.
    pub data: String,
    /// Seconds from the call to the first step: building the model stage, the optimizer and
    /// loading a checkpoint.
    pub startup_seconds: f64,
}

/// One optimizer step, as Megatron's `training_log` prints it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IterationReport {
    /// The iteration just finished (1 for the first step).
    pub iteration: u64,
    /// The mean loss over the step's microbatches (next-token cross-entropy, nats).
    pub loss: f64,
    /// The mean of [`loss`](Self::loss) over the iterations since the last logged one (every
    /// `--log-interval`), this one included: Megatron's `lm loss`. One global batch's loss
    /// wanders by a few per cent from batch to batch; the interval's mean much less, so two
    /// runs' curves are compared on it.
    pub lm_loss: f64,
    /// The learning rate the step used.
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Samples consumed so far, this step's included.
    pub consumed_samples: u64,
    /// Tokens this step trained on (global batch × sequence length).
    pub tokens: u64,
    /// Wall time of the step, in seconds.
    pub seconds: f64,
    /// Model FLOPs per second of this step over all ranks (Megatron's count, see
    /// [`TransformerConfig::training_flops`](crate::transformer::TransformerConfig::training_flops)).
    pub flops_per_second: f64,
    /// Ranks (devices) the step ran on.
    pub devices: usize,
    /// Model FLOPs utilisation of this step: FLOP/s per device over the configured peak
    /// (`--peak-tflops`), as a fraction.
    pub mfu: f64,
    /// Device memory in use at the end of the step, the largest over all ranks, in bytes;
    /// on logged iterations of backends that track it (GPUs), `None` otherwise.
    pub max_memory_bytes: Option<f64>,
    /// The most device memory in use between the schedule's passes during the step (the
    /// activations of the microbatches in flight included), the largest over all ranks, in
    /// bytes; as `max_memory_bytes`, on logged iterations of backends that track it. The
    /// planner's peak is comparable with it.
    pub peak_memory_bytes: Option<f64>,
    /// With `--fp16`: the loss scale this step's backward pass used.
    pub loss_scale: Option<f64>,
    /// With `--num-experts`, on logged iterations: the MoE losses and the experts' load.
    pub moe: Option<super::MoeReport>,
}

impl IterationReport {
    /// Model FLOP/s per device.
    pub fn flops_per_device(&self) -> f64 {
        self.flops_per_second / self.devices.max(1) as f64
    }

    /// Tokens per second of this step.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }
}

/// One evaluation on the validation split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalReport {
    /// The iteration after which it ran.
    pub iteration: u64,
    /// The mean loss over `--eval-iters` global batches.
    pub loss: f64,
}

impl EvalReport {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Receives a run's reports on the logging rank. Every method has an empty default.
pub trait TrainingObserver: Sync {
    /// What start-up is doing now (building the model, the optimizer, loading), so that a
    /// long start-up says what it waits for.
    fn on_setup(&self, _step: &str) {}
    /// Before the first step.
    fn on_start(&self, _start: &RunStart) {}
    /// After every `--log-interval`-th step.
    fn on_iteration(&self, _report: &IterationReport) {}
    /// After an evaluation.
    fn on_evaluation(&self, _report: &EvalReport) {}
    /// After a checkpoint was written (every rank finished and it was published).
    fn on_checkpoint(&self, _iteration: u64, _dir: &Path) {}
    /// After the last step.
    fn on_finish(&self) {}
    /// `--profile`: where GPU time went on global rank `rank` over the profiled steps (a
    /// table per kernel). Called on every profiled rank, not only the logging one.
    fn on_profile(&self, _rank: usize, _steps: std::ops::RangeInclusive<u64>, _table: &str) {}
}

/// An observer that ignores everything (tests that look only at the returned summary).
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl TrainingObserver for Silent {}
