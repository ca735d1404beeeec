//! burn-megatron's errors, and the policy they follow (book: "Errors").
//!
//! - A fallible function returns `Result` with the narrowest error type that describes its
//!   failures: [`ConfigError`] for building a model or layer, [`InputError`] for data given to
//!   a forward pass, [`DistError`] for communication (layers whose only failure is a
//!   collective return [`DistResult`](burn_megatron_dist::DistResult)), [`DataError`] for
//!   reading, writing and sampling datasets, [`DeviceError`] for a value the host could not
//!   read from the device (a deferred device error: Burn's `into_data` would panic there).
//! - [`Error`] holds any of them, and `?` converts each into it: the model's entry points
//!   (`try_forward`, `loss`, the schedules in `pipeline_parallel`) return [`Result`].
//! - A panicking `forward` exists only where Burn's convention of an infallible
//!   `forward(input) -> output` is expected of a module; its doc says so and points at
//!   `try_forward`.

mod checkpoint;
mod config;
mod device;
mod input;
mod pipeline;
mod training;

pub use burn_megatron_dist::DistError;
pub use checkpoint::CheckpointError;
pub use config::ConfigError;
pub use device::DeviceError;
pub(crate) use device::{read_data, read_params, read_scalar, unshared};
pub use input::{IdKind, InputError, check_ids_on_host};
pub use pipeline::PipelineError;
pub use training::{NonFiniteValue, TrainingError};

pub use crate::data::DataError;

/// Any error of burn-megatron's models and layers.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The configuration cannot be built.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The input of a forward pass is invalid.
    #[error(transparent)]
    Input(#[from] InputError),
    /// A collective failed.
    #[error(transparent)]
    Dist(#[from] DistError),
    /// A pipeline cannot be split, planned or run, or one of its stages failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A dataset cannot be read, written, sampled or tokenized.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A checkpoint cannot be saved or loaded.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A training run stopped: a non-finite loss, gradient norm or parameter, or a failure
    /// inside Burn's `Learner`.
    #[error(transparent)]
    Training(#[from] TrainingError),
    /// A value could not be read from the device (a checkpoint's parameter, the step's loss,
    /// generated tokens, …): the device reported an error, often a deferred one.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A launch of ranks failed: the first failing rank and its message.
    #[error(transparent)]
    Launch(#[from] burn_megatron_dist::LaunchError),
}

/// `Result` with burn-megatron's [`Error`].
pub type Result<T> = core::result::Result<T, Error>;
