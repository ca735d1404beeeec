//! GPipe: all forward passes, then all backward passes.

use crate::pipeline_parallel::plan::Compute;

/// `F0 F1 … F(m−1) B0 B1 … B(m−1)` on every rank.
pub(super) fn order(microbatches: usize) -> Vec<(bool, Compute)> {
    (0..microbatches)
        .map(|m| super::pass(true, m))
        .chain((0..microbatches).map(|m| super::pass(false, m)))
        .collect()
}
