//! Pretraining: the job that pulls the models, schedules, optimizer, data and checkpoints
//! together (Megatron-LM's `pretrain_gpt.py` and `megatron/training/`).
//!
//! - [`PretrainConfig`]: the run, with Megatron's argument names; [`PretrainArgs`] reads them
//!   from the command line and a TOML file.
//! - [`PretrainData`]: the training and validation splits of the `--data-path` blend or of
//!   the generated default corpus; [`read_microbatches`] reads a DP rank's microbatches of a
//!   global batch on TP rank 0 and broadcasts them.
//! - [`pretrain`]: one rank's loop (1F1B over the pipeline group, global-norm clipping,
//!   AdamW in two weight-decay groups, Megatron's LR schedule, evaluation, sharded
//!   checkpoints and resume); [`pretrain_on_threads`] runs every rank as a thread.
//! - [`TrainingObserver`]: what the logging rank reports; [`ConsoleProgress`] prints it.
//! - `--check-for-nan-in-loss-and-grad`: a non-finite loss, gradient norm or parameter stops
//!   the run with [`TrainingError::NonFinite`](crate::error::TrainingError::NonFinite) before
//!   anything of its iteration is saved; [`check_finite_parameters`] is the parameters' check.
//!
//! - [`learner`]: the same training through burn-train's `Learner` (one
//!   `SupervisedTraining` per rank, [`learner::MegatronStrategy`]).
//!
//! The world is TP × PP × DP ranks; with DP > 1 or `--use-distributed-optimizer` the step is
//! [`DistributedAdamW`](crate::optimizer::DistributedAdamW)'s (gradients averaged over DP
//! after backward, the optimizer state optionally sharded).

mod arguments;
mod config;
mod data;
mod launch;
pub mod learner;
pub(crate) mod moe_log;
pub(crate) mod nan_check;
mod observer;
pub mod planner;
mod pretrain;
mod progress;
pub(crate) mod step;

pub use arguments::{PretrainArgs, parse_decay_style};
pub use config::{PretrainConfig, RunLayout};
pub use data::{PretrainData, read_microbatches};
pub use launch::{CpuTraining, pretrain_on_threads};
pub use moe_log::MoeReport;
pub use nan_check::check_finite_parameters;
pub use observer::{EvalReport, IterationReport, RunStart, Silent, TrainingObserver};
pub use pretrain::{PretrainSummary, pretrain};
pub use progress::ConsoleProgress;
pub use step::SCHEDULE;
