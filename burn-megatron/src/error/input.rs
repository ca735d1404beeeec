//! Input a forward pass cannot take, and the ids it checks.

use burn::tensor::TensorData;

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
    /// A prompt without tokens: generation needs at least one token to condition on.
    #[error("prompt {index} is empty: give every prompt at least one token (a BOS token, say)")]
    EmptyPrompt {
        /// The prompt's index in the batch.
        index: usize,
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
    /// Context parallelism's load-balanced split cuts the sequence into `2 · cp` equal chunks.
    #[error(
        "context parallelism cuts the sequence into 2 x CP = {chunks} chunks: {len} tokens do \
         not divide; use a multiple of {chunks}"
    )]
    SequenceNotDivisibleByChunks {
        /// Tokens per sequence given.
        len: usize,
        /// The number of chunks, `2 · cp`.
        chunks: usize,
    },
    /// The all-to-all of context parallelism (`a2a`) splits the query heads over CP.
    #[error(
        "context parallelism by all-to-all (--cp-comm-type a2a) splits the {heads} attention \
         heads (of this TP rank) over CP = {cp}: use a CP size that divides them, or \
         --cp-comm-type p2p or all_gather"
    )]
    HeadsNotDivisibleByCp {
        /// Query heads on this rank.
        heads: usize,
        /// The context-parallel size.
        cp: usize,
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

/// Checks ids read back to the host: the first invalid id, in row-major order, is the error
/// (what [`IdCheckOps::check_ids`](crate::ops::IdCheckOps::check_ids) does by default).
pub fn check_ids_on_host(
    ids: &TensorData,
    kind: IdKind,
    vocab_size: usize,
) -> Result<(), InputError> {
    let ids = ids
        .clone()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("converted ids hold i64");
    match ids.into_iter().find(|&id| !kind.accepts(id, vocab_size)) {
        Some(id) => Err(InputError::IdOutOfRange {
            kind,
            id,
            vocab_size,
        }),
        None => Ok(()),
    }
}
