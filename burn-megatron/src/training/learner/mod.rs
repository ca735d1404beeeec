//! Training through Burn's `Learner` (burn-train 0.21): the pieces that make a parallel job
//! a burn-train run, one `SupervisedTraining` per rank.
//!
//! - [`ParallelGpt`]: this rank's GPT chunk as a burn-train model; its `TrainStep` is one
//!   pipeline-schedule step over the rank's microbatches, its `InferenceStep` the forward
//!   passes.
//! - [`LanguageModelOutput`]: what a step reports (loss, tokens, FLOPs, gradient norm), not
//!   the logits; [`LanguageModelMetric`]: tokens/s, TFLOP/s per device, MFU, gradient norm
//!   and perplexity for burn-train's dashboard.
//! - [`MegatronOptimizer`]: [`DistributedAdamW`](crate::optimizer::DistributedAdamW) as a
//!   Burn optimizer (DP reduction, ZeRO-1, global-norm clipping, fp32 master weights).
//! - [`MegatronStrategy`]: the loop, plugged in with [`MegatronTraining::with_megatron`];
//!   step-interval sharded checkpoints and resume, the NaN check, and failures as errors
//!   ([`FitFailure`]: Burn's traits cannot return one, so the loop is a panic boundary).
//! - [`pretrain_with_learner`]: `pretrain_gpt --learner`, a [`PretrainConfig`](crate::training::PretrainConfig)
//!   run through burn-train.
//! - [`LogRenderer`]: metric values as log lines, where burn-train's dashboard has no terminal.
//! - [`MetricRecorder`]: metric values kept readable after the run (tests, examples).
//! - [`GptStepLoader`]: Megatron's per-rank microbatches as a Burn data loader;
//!   [`DataParallelShard`]: any Burn loader cut among DP ranks.
//!
//! Any Burn model whose step reports a [`LanguageModelOutput`] trains the same way with data
//! parallelism and the distributed optimizer (book: "Pretraining", the Learner section).

mod failure;
mod loader;
mod log_renderer;
mod metrics;
mod optimizer;
mod output;
mod parallel_gpt;
mod pretrain;
mod quiet;
mod recorder;
mod strategy;

pub use failure::FitFailure;
pub use loader::{DataParallelShard, GptStepLoader, StepShape};
pub use log_renderer::LogRenderer;
pub use metrics::{H100_BF16_PEAK_FLOPS, LanguageModelMetric};
pub use optimizer::{LossScale, MegatronOptimizer};
pub use output::{LanguageModelOutput, LanguageModelStats};
pub use parallel_gpt::ParallelGpt;
pub use pretrain::{LearnerReporting, pretrain_with_learner};
pub use quiet::{QuietLogger, QuietRenderer};
pub use recorder::MetricRecorder;
pub use strategy::{MegatronStrategy, MegatronTraining};
