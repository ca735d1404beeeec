//! What stops a training run: a non-finite value (`--check-for-nan-in-loss-and-grad`) and a
//! failure inside Burn's `Learner` that Burn's API could only report as a panic. (A device
//! error found when the loop reads a value is a [`DeviceError`](super::DeviceError).)

/// The value found non-finite.
#[derive(Debug, Clone, PartialEq)]
pub enum NonFiniteValue {
    /// The step's loss (averaged over the data-parallel ranks), as the loop read it.
    Loss(f64),
    /// The step's global gradient norm before clipping, as the loop read it.
    GradNorm(f64),
    /// A parameter holds a NaN or an infinity (checked before a checkpoint is saved and at
    /// the end of the run). `path` is the first such parameter of the reporting rank, when
    /// that rank holds it (`None` on the other ranks, which only learn which rank it is).
    Parameter {
        /// The rank holding the parameter.
        on_rank: usize,
        /// Its path in the model, e.g. `block.layers.0.mlp.fc1.weight`.
        path: Option<String>,
    },
}

impl core::fmt::Display for NonFiniteValue {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Loss(v) => write!(f, "the loss is {v}"),
            Self::GradNorm(v) => write!(f, "the gradient norm is {v}"),
            Self::Parameter {
                on_rank,
                path: Some(path),
            } => write!(
                f,
                "parameter {path} of rank {on_rank} holds NaN or infinity"
            ),
            Self::Parameter {
                on_rank,
                path: None,
            } => write!(f, "a parameter of rank {on_rank} holds NaN or infinity"),
        }
    }
}

/// A training run that stopped.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrainingError {
    /// `--check-for-nan-in-loss-and-grad` found a NaN or an infinity. The run stops before
    /// anything of that iteration is saved: the last checkpoint holds finite weights.
    #[error(
        "iteration {iteration}: {value} (seen on rank {rank}); the run stops before saving \
         (--check-for-nan-in-loss-and-grad): lower --lr, check the data, or resume from the \
         last checkpoint"
    )]
    NonFinite {
        /// The iteration (1 for the first step) whose loss or gradient norm was non-finite,
        /// or after which a parameter was.
        iteration: u64,
        /// The rank that reports it (every rank reads the same loss and gradient norm; a
        /// parameter is named by the rank holding it).
        rank: usize,
        /// What was not finite.
        value: NonFiniteValue,
    },
    /// Burn's `Learner` reported a failure as a panic (its steps, loaders and optimizer
    /// cannot return errors) and the panic carried no error of ours: its message, caught at
    /// the boundary of the Learner run.
    #[error("rank {rank}: {what} failed: {message}")]
    Learner {
        /// The rank.
        rank: usize,
        /// What was running (e.g. "the Learner's training loop").
        what: String,
        /// The panic's message.
        message: String,
    },
}
