//! Activation memory under 1F1B, a failing stage, and a long run with random communication
//! delays.

use std::time::Duration;

use burn::optim::{AdamWConfig, Optimizer};
use burn_megatron::pipeline_parallel::{Schedule, StageSplit, forward_backward, forward_only};
use burn_megatron::transformer::Recompute;
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};

use crate::{AD, microbatches, run, tiny_gpt};

/// The executor counts the microbatches whose activations a rank holds: under 1F1B at most
/// `pp − rank`, under GPipe all of them.
#[test]
fn under_1f1b_a_rank_keeps_at_most_pp_minus_rank_activations() {
    let config = tiny_gpt();
    let pp = 4;
    let live = run(pp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_pp(pp))?;
        let stage = StageSplit::even(config.num_layers, pp)?.stage(state.pp_rank());
        let model = config.init_gpt_stage::<AD>(state.tp(), &stage, &Default::default())?;
        let chunks = [model];
        let data = microbatches(8, config.vocab_size);
        let f1b1 = forward_backward(Schedule::OneFOneB, &state, &chunks, &data)?;
        let gpipe = forward_backward(Schedule::GPipe, &state, &chunks, &data)?;
        Ok((f1b1.max_live_activations, gpipe.max_live_activations))
    });
    for (rank, (f1b1, gpipe)) in live.into_iter().enumerate() {
        assert_eq!(f1b1, pp - rank, "1F1B, rank {rank}");
        assert_eq!(gpipe, 8, "GPipe, rank {rank}");
    }
}

/// A target outside the vocabulary on microbatch 3 makes the last stage fail in the middle of
/// the schedule: every rank returns an error, and every error names that stage.
#[test]
fn a_stage_that_fails_mid_schedule_fails_every_rank_naming_it() {
    let config = tiny_gpt();
    let err = launch(
        LaunchConfig::new(4).with_timeout(Duration::from_secs(30)),
        |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default().with_pp(2).with_tp(2))?;
            let stage = StageSplit::even(config.num_layers, 2)?.stage(state.pp_rank());
            let model = config.init_gpt_stage::<AD>(state.tp(), &stage, &Default::default())?;
            let mut data = microbatches(6, config.vocab_size);
            data[3].targets = data[3].targets.clone().add_scalar(1000);
            forward_backward(Schedule::OneFOneB, &state, &[model], &data)?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        },
    )
    .unwrap_err();
    assert_eq!(err.failures.len(), 4, "{:#?}", err.failures);
    for (rank, message) in &err.failures {
        assert!(
            message.contains("pipeline stage 1 (global rank")
                && message.contains("failed in the forward pass of microbatch 3")
                && message.contains("outside the vocabulary"),
            "rank {rank}: {message}"
        );
        assert!(!message.contains("panicked"), "rank {rank}: {message}");
    }
}

/// 100 AdamW steps of PP = 2 × TP = 2 (sequence parallelism, full recomputation: many
/// backward passes side by side on the thread ranks) with random delays below 300 µs before
/// every send, receive and collective, cycling through the schedules, then an evaluation
/// step: no hang, and every TP rank of the last stage reports the same losses.
#[test]
fn a_hundred_steps_with_random_delays_finish() {
    let config = tiny_gpt()
        .with_sequence_parallel(true)
        .with_recompute(Recompute::Full);
    let launch_config = LaunchConfig::new(4)
        .with_timeout(Duration::from_secs(60))
        .with_injected_delays(Duration::from_micros(300));
    let losses = launch(launch_config, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_pp(2).with_tp(2))?;
        let stage = StageSplit::even(config.num_layers, 2)?.stage(state.pp_rank());
        let mut model = config.init_gpt_stage::<AD>(state.tp(), &stage, &Default::default())?;
        let mut optim = AdamWConfig::new().init();
        let schedules = [Schedule::OneFOneB, Schedule::GPipe, Schedule::NoPipelining];
        let mut losses = Vec::new();
        for step in 0..100 {
            let data = microbatches(4, config.vocab_size);
            let chunks = [model];
            let mut out = forward_backward(schedules[step % 3], &state, &chunks, &data)?;
            let [chunk] = chunks;
            if let Some(loss) = out.loss {
                losses.push(loss.into_scalar());
            }
            model = optim.step(1e-3, chunk, out.grads.remove(0));
        }
        let eval = forward_only(
            Schedule::OneFOneB,
            &state,
            &[burn::module::AutodiffModule::valid(&model)],
            &crate::microbatches(4, config.vocab_size)
                .into_iter()
                .map(|m| {
                    burn_megatron::pipeline_parallel::Microbatch::new(
                        m.tokens.inner(),
                        m.targets.inner(),
                    )
                })
                .collect::<Vec<_>>(),
        )?;
        if let Some(loss) = eval {
            losses.push(loss.into_scalar());
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(losses)
    })
    .unwrap_or_else(|e| panic!("{e}\n{:#?}", e.failures));
    assert!(losses[0].is_empty() && losses[1].is_empty());
    assert_eq!(losses[2].len(), 101);
    assert_eq!(losses[2], losses[3], "TP ranks of the last stage disagree");
    assert!(
        losses[2][99] < losses[2][0],
        "training on a fixed batch lowers the loss: {:?}",
        losses[2]
    );
}

/// A plain forward pass on a `Recompute::Full` model that tracks gradients would silently
/// store everything: it is an error pointing at the schedules; inference on `valid()` works.
#[test]
fn full_recomputation_outside_a_schedule_is_an_error() {
    let config = tiny_gpt().with_recompute(Recompute::Full);
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let data = microbatches(1, config.vocab_size).remove(0);
        let err = model.try_forward(data.tokens.clone()).unwrap_err();
        assert!(
            matches!(
                err,
                burn_megatron::Error::Pipeline(
                    burn_megatron::pipeline_parallel::PipelineError::RecomputeNeedsSchedule
                )
            ),
            "{err}"
        );
        assert!(err.to_string().contains("pipeline_parallel"), "{err}");
        burn::module::AutodiffModule::valid(&model).try_forward(data.tokens.inner())?;
        Ok(())
    });
}
