//! Megatron's rank layout on 8 CPU thread ranks at TP 2 × PP 2 (DP is what is left: 2): each
//! rank prints the global ranks of its groups, then the ranks of each tensor-parallel group
//! sum a number with an all-reduce.
//!
//!     cargo run --example ranks_and_groups

// ANCHOR: groups
use burn::backend::NdArray;
use burn::tensor::Tensor;
use burn_megatron_dist::{DistError, LaunchConfig, ParallelSizes, ReduceOp, launch};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 8 ranks, each a thread running this closure with its own `ctx`.
    let sums = launch(LaunchConfig::new(8), |ctx| {
        // TP 2 × PP 2; DP = 8 / (2 · 2) = 2.
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2).with_pp(2))?;
        println!(
            "rank {}: TP group {:?}, DP group {:?}, PP group {:?}",
            ctx.rank(),
            state.tp().ranks(),
            state.dp().ranks(),
            state.pp().ranks()
        );
        // Every rank contributes its own rank number; the TP group adds them up.
        let x = Tensor::<NdArray, 1>::from_floats([ctx.rank() as f32], &Default::default());
        let sum = state.tp().all_reduce(x, ReduceOp::Sum)?;
        Ok::<_, DistError>(sum.into_scalar())
    })?;
    // TP groups {0, 1}, {2, 3}, {4, 5}, {6, 7}: sums 1, 5, 9, 13, the same on both members.
    assert_eq!(sums, [1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 13.0, 13.0]);
    println!("TP all-reduce on each rank: {sums:?}");
    Ok(())
}
// ANCHOR_END: groups
