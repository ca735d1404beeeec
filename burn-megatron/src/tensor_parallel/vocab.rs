//! Splitting a vocabulary across tensor-parallel ranks.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use burn_megatron_dist::Placement;

use super::placement::ParamPlacement;
use crate::error::ConfigError;

/// A vocabulary padded so that it splits evenly over TP ranks, and this rank's range of it.
///
/// Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by × tp`. The
/// padded entries never score: the cross-entropy leaves them out, so losses and gradients do
/// not depend on the padding, and hence not on the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VocabPartition {
    /// Real vocabulary size.
    pub vocab_size: usize,
    /// Padded vocabulary size (a multiple of `divisible_by × tp`).
    pub padded_size: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// This rank's index in the TP group.
    pub rank: usize,
}

impl VocabPartition {
    /// The partition of `vocab_size` tokens padded to a multiple of `divisible_by × tp`.
    pub fn new(
        vocab_size: usize,
        divisible_by: usize,
        tp: usize,
        rank: usize,
    ) -> Result<Self, ConfigError> {
        if vocab_size == 0 || divisible_by == 0 || tp == 0 {
            return Err(ConfigError::Invalid(format!(
                "vocabulary size ({vocab_size}), its divisor ({divisible_by}) and TP ({tp}) must be positive"
            )));
        }
        let multiple = divisible_by * tp;
        Ok(Self {
            vocab_size,
            padded_size: vocab_size.div_ceil(multiple) * multiple,
            tp,
            rank,
        })
    }

    /// The placement of a `[padded_size, ..]` table split by rows: sharded along dimension 0,
    /// its last `padded_size - vocab_size` rows padding.
    pub fn placement(&self) -> ParamPlacement {
        ParamPlacement {
            placement: Placement::Shard(0),
            rank: self.rank,
            parts: self.tp,
            padding: self.padded_size - self.vocab_size,
            expert: None,
            frozen: false,
        }
    }

    /// Entries per rank.
    pub fn local_size(&self) -> usize {
        self.padded_size / self.tp
    }

    /// The token ids this rank holds.
    pub fn range(&self) -> Range<usize> {
        let n = self.local_size();
        self.rank * n..(self.rank + 1) * n
    }

    /// Token ids as indices into this rank's slice, with ids outside the slice mapped to the
    /// slice's length (one past its last row): the ids
    /// [`embedding_or_zero`](crate::ops::embedding::embedding_or_zero) gives zero rows.
    pub fn localize<B: Backend, const D: usize>(
        &self,
        ids: Tensor<B, D, Int>,
    ) -> Tensor<B, D, Int> {
        let range = self.range();
        let outside = ids
            .clone()
            .lower_elem(range.start as i64)
            .bool_or(ids.clone().greater_equal_elem(range.end as i64));
        ids.sub_scalar(range.start as i64)
            .mask_fill(outside, range.len() as i64)
    }

    /// A note for the user when padding was added, `None` otherwise.
    pub fn padding_note(&self) -> Option<String> {
        (self.padded_size != self.vocab_size).then(|| {
            format!(
                "vocabulary of {} tokens padded to {} ({} dummy tokens) to split evenly over TP = {}",
                self.vocab_size,
                self.padded_size,
                self.padded_size - self.vocab_size,
                self.tp
            )
        })
    }
}
