//! The data of one microbatch.

use burn::tensor::{Int, Tensor, backend::Backend};

/// One microbatch of a step: `[micro_batch, seq]` token ids and their targets (a negative
/// target, such as -100, is ignored by the loss). Every pipeline rank is given every
/// microbatch; the first stage reads the tokens, the last the targets, the others the shape.
#[derive(Debug, Clone)]
pub struct Microbatch<B: Backend> {
    /// `[micro_batch, seq]` input token ids.
    pub tokens: Tensor<B, 2, Int>,
    /// `[micro_batch, seq]` target ids.
    pub targets: Tensor<B, 2, Int>,
}

impl<B: Backend> Microbatch<B> {
    /// A microbatch of `tokens` and `targets`.
    pub fn new(tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Self {
        Self { tokens, targets }
    }
}
