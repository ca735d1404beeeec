//! Cross-entropy over logits split by vocabulary, without gathering them.

use burn::tensor::{Int, Tensor};
use burn_megatron_dist::mapping::reduce_from_tensor_parallel_region;
use burn_megatron_dist::{DistBackend, ProcessGroup, ReduceOp};

use super::vocab::VocabPartition;
use crate::backend::ModelBackend;
use crate::error::{IdKind, Result};

/// Per-token cross-entropy of logits split by vocabulary across the TP group.
///
/// `logits`: `[batch, seq, padded_vocab / tp]`, this rank's slice; `targets`: `[batch, seq]`.
/// Returns `[batch, seq]` losses, equal on every rank. As in Megatron, only three
/// `[batch, seq]` reductions cross ranks: the maximum (for stability), the sum of
/// exponentials and the target's logit. Padded vocabulary entries are left out, so the loss
/// does not depend on the padding. A negative target (such as an ignore index of -100) gives
/// a meaningless loss there: mask it with [`masked_mean`]. A target at or above the real
/// vocabulary size is an [`InputError::IdOutOfRange`](crate::InputError::IdOutOfRange) (see
/// [`ModelBackend::check_ids`]).
///
/// The gradient is `softmax - one_hot` on each rank's slice: the reductions use the *g*
/// operator, whose backward is the identity, because every rank computes the same loss.
pub fn vocab_parallel_cross_entropy<B: ModelBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    vocab: &VocabPartition,
    tp: &ProcessGroup,
) -> Result<Tensor<B, 2>> {
    B::check_ids(targets.clone(), IdKind::Target, vocab.vocab_size)?;
    let device = logits.device();
    let [batch, seq, local] = logits.dims();
    let range = vocab.range();
    // Padded entries of this rank's slice get -inf: they add nothing to the sum of exponentials.
    let real = vocab.vocab_size.clamp(range.start, range.end) - range.start;
    let logits = if real < local {
        let padding = Tensor::<B, 1, Int>::arange(0..local as i64, &device)
            .greater_equal_elem(real as i64)
            .reshape([1, 1, local])
            .expand([batch, seq, local]);
        logits.mask_fill(padding, f32::NEG_INFINITY)
    } else {
        logits
    };

    let local_max = logits.clone().detach().max_dim(2);
    let max = tp.all_reduce(local_max, ReduceOp::Max)?.detach();
    let shifted = logits - max;

    let sum_exp = shifted.clone().exp().sum_dim(2);
    let sum_exp = reduce_from_tensor_parallel_region(sum_exp, tp)?;

    let (local_targets, in_range) = vocab.localize(targets);
    let local_targets = local_targets.unsqueeze_dim::<3>(2);
    // Masked with a fill, not a product: a clamped index may point at a -inf padded entry.
    let target_logit = shifted
        .gather(2, local_targets)
        .mask_fill(in_range.bool_not().unsqueeze_dim::<3>(2), 0.0);
    let target_logit = reduce_from_tensor_parallel_region(target_logit, tp)?;

    Ok((sum_exp.log() - target_logit).squeeze_dim(2))
}

/// The mean of `losses` over the positions where `mask` is true; 0 when none is.
pub fn masked_mean<B: DistBackend>(
    losses: Tensor<B, 2>,
    mask: Tensor<B, 2, burn::tensor::Bool>,
) -> Tensor<B, 1> {
    let mask = mask.float();
    let count = mask.clone().sum().clamp_min(1.0);
    (losses * mask).sum() / count
}
