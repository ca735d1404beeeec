//! Cross-entropy over logits split by vocabulary, without gathering them.

use burn::tensor::{Int, Tensor};
use burn_megatron_dist::{DistBackend, ProcessGroup};

use super::vocab::VocabPartition;
use crate::backend::ModelBackend;
use crate::error::{IdKind, Result};
use crate::ops::cross_entropy::VocabSlice;

/// Per-token cross-entropy of logits split by vocabulary across the TP group.
///
/// `logits`: `[batch, seq, padded_vocab / tp]`, this rank's slice; `targets`: `[batch, seq]`.
/// Returns `[batch, seq]` losses, equal on every rank. As in Megatron, only three
/// `[batch, seq]` reductions cross ranks: the maximum (for stability), the sum of
/// exponentials and the target's logit (the last two in one all-reduce). Padded vocabulary entries are left out, so the loss
/// does not depend on the padding. A negative target (such as an ignore index of -100) gives
/// a meaningless loss there: mask it with [`masked_mean`]. A target at or above the real
/// vocabulary size is an [`InputError::IdOutOfRange`](crate::InputError::IdOutOfRange) (see
/// [`IdCheckOps::check_ids`](crate::ops::IdCheckOps::check_ids)).
///
/// The losses are f32 (f64 for f64 logits) whatever the logits' dtype. The gradient is
/// `(softmax - one_hot) · dloss` on each rank's slice, computed without any collective
/// because every rank computes the same loss (see [`crate::ops::cross_entropy`]); on CubeCL
/// backends each direction is one fused kernel.
pub fn vocab_parallel_cross_entropy<B: ModelBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    vocab: &VocabPartition,
    tp: &ProcessGroup,
) -> Result<Tensor<B, 2>> {
    B::check_ids(targets.clone(), IdKind::Target, vocab.vocab_size)?;
    let [batch, seq, local] = logits.dims();
    let range = vocab.range();
    let slice = VocabSlice {
        start: range.start,
        real: vocab.vocab_size.clamp(range.start, range.end) - range.start,
    };
    let losses = B::cross_entropy(
        logits.reshape([batch * seq, local]),
        targets.reshape([batch * seq]),
        slice,
        tp,
    )?;
    Ok(losses.reshape([batch, seq]))
}

/// The mean of `losses` over the positions where `mask` is true; 0 when none is.
pub fn masked_mean<B: DistBackend>(
    losses: Tensor<B, 2>,
    mask: Tensor<B, 2, burn::tensor::Bool>,
) -> Tensor<B, 1> {
    let mask = mask.float().cast(losses.dtype());
    let count = mask.clone().sum().clamp_min(1.0);
    (losses * mask).sum() / count
}
