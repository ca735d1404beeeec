//! Collectives on thread ranks beyond the shared suite (burn-megatron-tests'
//! `collective_suite`, which runs the same bodies on threads, processes and NCCL).

use burn_megatron_dist::{ParallelSizes, ReduceOp};

use crate::{B, run, tensor, values};

/// The check against Megatron: world 8, TP=4, PP=2; each rank all-reduces its own
/// rank number over its TP group.
#[test]
fn tp_group_all_reduce_matches_megatron() {
    let results = run(8, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(4).with_pp(2))?;
        let x = tensor::<B, 1>(vec![ctx.rank() as f32], [1]);
        Ok(values(state.tp().all_reduce(x, ReduceOp::Sum)?)[0])
    });
    assert_eq!(results, vec![6.0, 6.0, 6.0, 6.0, 22.0, 22.0, 22.0, 22.0]);
}
