//! 1F1B without interleaving (PipeDream-Flush): Megatron's
//! `forward_backward_pipelining_without_interleaving`.

use crate::pipeline_parallel::plan::Compute;

/// Megatron's warm-up forwards of pipeline rank `rank`: `min(pp − rank − 1, microbatches)`.
pub fn megatron_warmup(pp: usize, rank: usize, microbatches: usize) -> usize {
    (pp - rank - 1).min(microbatches)
}

/// Warm-up forwards, then forward and backward in turn (steady state), then the remaining
/// backwards (cool-down). A rank holds at most `warm-up + 1 = pp − rank` microbatches.
pub(super) fn order(pp: usize, rank: usize, microbatches: usize) -> Vec<(bool, Compute)> {
    let warmup = megatron_warmup(pp, rank, microbatches);
    let steady = microbatches - warmup;
    let mut order: Vec<_> = (0..warmup).map(|m| super::pass(true, m)).collect();
    for i in 0..steady {
        order.push(super::pass(true, warmup + i));
        order.push(super::pass(false, i));
    }
    order.extend((steady..microbatches).map(|m| super::pass(false, m)));
    order
}
