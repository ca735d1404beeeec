//! burn-megatron's errors, and the policy they follow (book: "Errors").
//!
//! - A fallible function returns `Result` with the narrowest error type that describes its
//!   failures: [`ConfigError`] for building a model or layer, [`InputError`] for data given to
//!   a forward pass, [`DistError`] for communication (layers whose only failure is a
//!   collective return [`DistResult`](burn_megatron_dist::DistResult)), [`DataError`] for
//!   reading, writing and sampling datasets.
//! - [`Error`] holds any of them, and `?` converts each into it: the model's entry points
//!   (`try_forward`, `loss`, the schedules in `pipeline_parallel`) return [`Result`].
//! - A panicking `forward` exists only where Burn's convention of an infallible
//!   `forward(input) -> output` is expected of a module; its doc says so and points at
//!   `try_forward`.

pub use crate::data::DataError;
pub use burn_megatron_dist::DistError;

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
    Pipeline(#[from] crate::pipeline_parallel::PipelineError),
    /// A dataset cannot be read, written, sampled or tokenized.
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    /// A checkpoint cannot be saved or loaded.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpointing::CheckpointError),
    /// A launch of ranks failed: the first failing rank and its message.
    #[error(transparent)]
    Launch(#[from] burn_megatron_dist::LaunchError),
}

/// `Result` with burn-megatron's [`Error`].
pub type Result<T> = core::result::Result<T, Error>;

/// A configuration that cannot be built, with what would be valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A size must be divisible by the tensor-parallel size.
    #[error(
        "{what} ({size}) must be divisible by TP ({tp}): valid TP sizes are {}",
        list(valid)
    )]
    NotDivisibleByTp {
        /// What is split, e.g. "attention heads".
        what: String,
        /// Its size.
        size: usize,
        /// The tensor-parallel size.
        tp: usize,
        /// TP sizes that divide it.
        valid: Vec<usize>,
    },
    /// Any other invalid setting.
    #[error("{0}")]
    Invalid(String),
}

impl ConfigError {
    /// Checks that `size` splits evenly over `tp` ranks.
    pub fn check_divisible(what: &str, size: usize, tp: usize) -> core::result::Result<(), Self> {
        if tp == 0 || !size.is_multiple_of(tp) {
            return Err(ConfigError::NotDivisibleByTp {
                what: what.to_string(),
                size,
                tp,
                valid: (1..=size).filter(|&d| size.is_multiple_of(d)).collect(),
            });
        }
        Ok(())
    }
}

/// Input a forward pass cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// A token or target id outside the model's vocabulary.
    #[error("{kind} id {id} is outside the vocabulary of {vocab_size} tokens: {}", kind.rule(*vocab_size))]
    IdOutOfRange {
        /// Token (input) or target (label).
        kind: IdKind,
        /// The offending id.
        id: i64,
        /// The model's real vocabulary size (without padding).
        vocab_size: usize,
    },
    /// More tokens than the model has positions for.
    #[error("sequence of {len} tokens is longer than the model's maximum of {max}")]
    SequenceTooLong {
        /// Tokens per sequence given.
        len: usize,
        /// The model's `max_sequence_length`.
        max: usize,
    },
    /// Sequence parallelism needs a sequence that splits evenly over TP.
    #[error(
        "sequence parallelism splits the sequence over TP = {tp}: {len} tokens do not divide; \
         use a multiple of {tp}"
    )]
    SequenceNotDivisible {
        /// Tokens per sequence given.
        len: usize,
        /// The tensor-parallel size.
        tp: usize,
    },
    /// The gradients given lack a parameter's gradient.
    #[error("parameter {path} has no gradient: pass the gradients of this model's backward pass")]
    MissingGradient {
        /// The parameter's path in the module, e.g. `block.layers.0.mlp.fc1.weight`.
        path: String,
    },
    /// A gradient whose shape is not its parameter's.
    #[error(
        "the gradient of {path} has shape {got:?}, its parameter {expected:?}: pass the \
         gradients of this model's backward pass"
    )]
    GradientShape {
        /// The parameter's path in the module.
        path: String,
        /// The parameter's (local) shape.
        expected: Vec<usize>,
        /// The gradient's shape.
        got: Vec<usize>,
    },
    /// A module parameter that a flat buffer or optimizer does not hold.
    #[error(
        "parameter {path} is not in the flat buffer: pass the module the optimizer was built \
         from"
    )]
    UnknownParameter {
        /// The parameter's path in the module.
        path: String,
    },
}

/// What a checked id is: its valid range differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdKind {
    /// An input token: `0 <= id < vocab_size`.
    Token,
    /// A target label: `id < vocab_size`; a negative target (such as -100) marks a position
    /// the loss ignores.
    Target,
}

impl IdKind {
    /// Whether `id` is valid for a vocabulary of `vocab_size` tokens.
    pub fn accepts(self, id: i64, vocab_size: usize) -> bool {
        let below = id < vocab_size as i64;
        match self {
            IdKind::Token => below && id >= 0,
            IdKind::Target => below,
        }
    }

    fn rule(self, vocab_size: usize) -> String {
        match self {
            IdKind::Token => format!("token ids must be in 0..{vocab_size}"),
            IdKind::Target => format!(
                "target ids must be below {vocab_size} (a negative target, such as -100, \
                 marks a position to ignore)"
            ),
        }
    }
}

impl core::fmt::Display for IdKind {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            IdKind::Token => "token",
            IdKind::Target => "target",
        })
    }
}

fn list(values: &[usize]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
