//! No pipelining: gradient accumulation, Megatron's `forward_backward_no_pipelining`.

use crate::pipeline_parallel::plan::Compute;

/// `F0 B0 F1 B1 …` on every rank: one microbatch in the pipeline at a time.
pub(super) fn order(microbatches: usize) -> Vec<(bool, Compute)> {
    (0..microbatches)
        .flat_map(|m| [super::pass(true, m), super::pass(false, m)])
        .collect()
}
