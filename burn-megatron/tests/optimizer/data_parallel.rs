//! Data parallelism against one device: a tiny GPT trained for ten steps on a global batch of
//! four microbatches, with DP ∈ {1, 2, 4} (each rank taking its share of the microbatches),
//! with and without the distributed optimizer, and TP = 2 × DP = 2, gives the losses, global
//! gradient norms (clipping active) and parameters of the flat-buffer AdamW on one device.
//! The bytes each rank holds follow Megatron's memory table.

use burn_megatron::distributed::{
    BufferConfig, DataParallelConfig, DistributedAdamWConfig, shard_columns,
};
use burn_megatron::optimizer::{FlatAdamWConfig, StepScalars, clip_coefficient, global_grad_norm};
use burn_megatron::pipeline_parallel::forward_backward_no_pipelining;
use burn_megatron::tensor_parallel::param_infos;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{ParallelSizes, ReduceOp};

use super::flat_adamw::{Trajectory, assert_same, full_params};
use crate::{AD, assert_close, microbatches, run, tiny_gpt, tolerance, values};

const STEPS: usize = 10;
/// Microbatches of a global batch.
const GLOBAL: usize = 4;
/// Small enough that every step clips.
const MAX_NORM: f64 = 0.05;

fn adam() -> FlatAdamWConfig {
    FlatAdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-5)
        .with_weight_decay(0.1)
}

fn lr(step: usize) -> f64 {
    1e-2 * (1.0 + step as f64) / STEPS as f64
}

/// Losses, norms and final parameters.
struct Run {
    trajectory: Trajectory,
    norms: Vec<f64>,
}

/// One device, the whole global batch, the flat-buffer AdamW with the global-norm clip.
fn one_device(config: &TransformerConfig) -> Run {
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut optim = adam().init::<AD, _>(&model)?;
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let (loss, grads) =
                forward_backward_no_pipelining(&model, &microbatches(GLOBAL, 50, step as u64))?;
            losses.push(values(loss)[0]);
            let norm = global_grad_norm(
                std::slice::from_ref(&model),
                std::slice::from_ref(&grads),
                &state,
            )?;
            norms.push(values(norm.clone())[0]);
            let scalars = StepScalars {
                grad_factor: Some(clip_coefficient(norm, MAX_NORM)),
                found_inf: None,
            };
            model = optim.step_with(lr(step), model, &grads, scalars)?;
        }
        Ok(Run {
            trajectory: Trajectory {
                losses,
                params: full_params(&model, &state),
            },
            norms,
        })
    })
    .remove(0)
}

/// `tp × dp` ranks; DP rank `r` takes microbatches `r·4/dp .. (r+1)·4/dp` of each global
/// batch. The loss is the DP mean of the ranks' losses.
fn data_parallel(config: &TransformerConfig, tp: usize, dp: usize, zero: bool) -> Vec<Run> {
    run(tp * dp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        assert_eq!(state.dp().size(), dp);
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut optim = DistributedAdamWConfig::new()
            .with_adam(adam())
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(zero)
                    // Several buckets for this tiny model.
                    .with_bucket_numel(700),
            )
            .with_clip_grad(Some(MAX_NORM))
            .init::<AD, _>(&model, &state, &[])?;
        let per_rank = GLOBAL / dp;
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let mine: Vec<_> = microbatches(GLOBAL, 50, step as u64)
                .into_iter()
                .skip(state.dp().rank() * per_rank)
                .take(per_rank)
                .collect();
            let (loss, grads) = forward_backward_no_pipelining(&model, &mine)?;
            losses.push(values(state.dp().all_reduce(loss, ReduceOp::Avg)?)[0]);
            let out = optim.step(lr(step), model, &grads)?;
            model = out.model;
            norms.push(values(out.grad_norm)[0]);
        }
        Ok(Run {
            trajectory: Trajectory {
                losses,
                params: full_params(&model, &state),
            },
            norms,
        })
    })
}

fn check(label: &str, config: &TransformerConfig, got: &[Run], want: &Run, tolerance: f64) {
    for (rank, got) in got.iter().enumerate() {
        let label = format!("{label}, rank {rank}");
        assert_close(
            &format!("{label}: norms"),
            &got.norms,
            &want.norms,
            tolerance,
        );
        assert_same(&label, config, &got.trajectory, &want.trajectory, tolerance);
    }
}

/// Every step clips: the comparison covers the clip coefficient.
fn assert_clipping(want: &Run) {
    assert!(
        want.norms.iter().all(|&n| n > MAX_NORM),
        "norms {:?} should all exceed {MAX_NORM}",
        want.norms
    );
}

#[test]
fn data_parallel_steps_equal_one_device() {
    let config = tiny_gpt();
    let want = one_device(&config);
    assert_clipping(&want);
    for dp in [1, 2, 4] {
        for zero in [false, true] {
            let got = data_parallel(&config, 1, dp, zero);
            check(
                &format!("dp {dp}, distributed optimizer {zero}"),
                &config,
                &got,
                &want,
                tolerance::F32,
            );
        }
    }
}

#[test]
fn tp2_dp2_steps_equal_one_device() {
    let config = tiny_gpt();
    let want = one_device(&config);
    for zero in [false, true] {
        let got = data_parallel(&config, 2, 2, zero);
        check(
            &format!("tp 2 × dp 2, distributed optimizer {zero}"),
            &config,
            &got,
            &want,
            tolerance::F32,
        );
    }
}

/// Megatron's table: `param_bytes + 4 + 12 / d` bytes per parameter with the distributed
/// optimizer (fp32 gradients; fp32 master weights and two moments sharded), `6 + 12/d` for
/// bf16 parameters. For f32 parameters our master shard is its own copy: `8 + 12/d`.
fn bytes_per_param(param_bytes: f64, dp: usize) -> f64 {
    param_bytes + 4.0 + 12.0 / dp as f64
}

#[test]
fn each_rank_holds_megatrons_bytes_per_parameter() {
    assert_eq!(bytes_per_param(2.0, 8), 6.0 + 12.0 / 8.0, "bf16 row");
    let config = tiny_gpt();
    for dp in [1, 2, 4] {
        let held = run(dp, |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default())?;
            let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
            let optim = DistributedAdamWConfig::new()
                .with_adam(adam().with_buffer(BufferConfig::new().with_param_alignment(1)))
                .with_data_parallel(DataParallelConfig::new().with_use_distributed_optimizer(true))
                .init::<AD, _>(&model, &state, &[])?;
            let params: usize = param_infos(&model)
                .iter()
                .map(|p| p.shape.iter().product::<usize>())
                .sum();
            let memory = optim.memory(&model);
            let numel = optim.layout().numel();
            assert_eq!(memory.params, 4 * params);
            assert_eq!(memory.grads, 4 * numel);
            assert_eq!(memory.optimizer_state(), 3 * 4 * numel / dp);
            Ok((memory, params))
        });
        for (memory, params) in held {
            let per_param = memory.total() as f64 / params as f64;
            // Padding adds fewer than `dp` elements to the buffers.
            assert_close(
                &format!("bytes per parameter at dp {dp}"),
                &[per_param],
                &[bytes_per_param(4.0, dp)],
                1e-3,
            );
        }
    }
}

#[test]
fn reduce_scatter_buckets_cover_each_shard() {
    assert_eq!(shard_columns(10, 2, 8), vec![0..4, 4..8, 8..10]);
    assert_eq!(shard_columns(3, 4, 1), vec![0..1, 1..2, 2..3]);
}
