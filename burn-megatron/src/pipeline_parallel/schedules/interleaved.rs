//! Interleaved 1F1B with virtual stages: Megatron's
//! `forward_backward_pipelining_with_interleaving`.

use crate::pipeline_parallel::plan::Compute;

/// Megatron's warm-up forwards (passes of one chunk) of pipeline rank `rank` with `v` chunks
/// and `microbatches` microbatches: `min(2 · (pp − rank − 1) + (v − 1) · pp, v · microbatches)`
/// (`microbatch_group_size_per_vp_stage` = pp, Megatron's default).
pub fn megatron_warmup(pp: usize, rank: usize, v: usize, microbatches: usize) -> usize {
    (2 * (pp - rank - 1) + (v - 1) * pp).min(v * microbatches)
}

/// The `k`-th forward (or backward) pass of a rank: passes go in groups of `pp` microbatches
/// through chunk 0, then the same group through chunk 1, and so on; backward passes take the
/// chunks in reverse. Megatron's `get_model_chunk_id` and `get_microbatch_id_in_model_chunk`.
fn virtual_pass(k: usize, pp: usize, v: usize, forward: bool) -> Compute {
    let group = k / (pp * v);
    let in_group = k % (pp * v);
    let chunk = in_group / pp;
    Compute {
        microbatch: group * pp + in_group % pp,
        chunk: if forward { chunk } else { v - 1 - chunk },
    }
}

/// Warm-up forwards, then forward and backward in turn (in pairs whose receives are posted
/// together), then the remaining backwards; every pass is of one chunk. Forward-only runs
/// every forward in the same order.
pub(super) fn order(
    pp: usize,
    rank: usize,
    v: usize,
    microbatches: usize,
    forward_only: bool,
) -> Vec<Vec<(bool, Compute)>> {
    let total = v * microbatches;
    let warmup = if forward_only {
        total
    } else {
        megatron_warmup(pp, rank, v, microbatches)
    };
    let f = |k| (true, virtual_pass(k, pp, v, true));
    let b = |k| (false, virtual_pass(k, pp, v, false));
    let mut order: Vec<_> = (0..warmup).map(|k| vec![f(k)]).collect();
    for i in 0..total - warmup {
        order.push(vec![f(warmup + i), b(i)]);
    }
    if !forward_only {
        order.extend((total - warmup..total).map(|k| vec![b(k)]));
    }
    order
}
