//! Stop after iteration 3, resume with the same command (`--save d --load d`): the model,
//! the AdamW state, the data position, the learning-rate schedule and the dropout masks
//! continue, so the losses equal the uninterrupted run's. Also resumed in another layout,
//! with the distributed optimizer at another DP size, with checkpoints written in the
//! background (`--async-save`), and with FP8 delayed scaling's histories.

use crate::{assert_close, scratch, tiny_run, tolerance, train};
use burn_megatron::ops::fp8::{Fp8Config, Fp8Recipe};
use burn_megatron::training::PretrainConfig;

/// `iters` of the 6 steps of a run with dropout, evaluations after 2, 4 and 6.
fn run(tp: usize, pp: usize, iters: usize) -> PretrainConfig {
    tiny_run(tp, pp)
        .with_train_iters(iters)
        .with_lr_decay_iters(Some(6))
        .with_hidden_dropout(0.1)
        .with_attention_dropout(0.1)
}

fn resume(from: (usize, usize), to: (usize, usize)) {
    let what = format!("saved at (TP, PP) = {from:?}, resumed at {to:?}");
    let name = format!("resume-{}{}-{}{}", from.0, from.1, to.0, to.1);
    let (from, to) = (
        move |iters| run(from.0, from.1, iters),
        move |iters| run(to.0, to.1, iters),
    );
    resume_runs(&what, &name, from, to);
}

/// Saves `from(3)` after 3 iterations, resumes with `to(6)`'s command: equal to `to(6)`
/// uninterrupted.
fn resume_runs(
    what: &str,
    name: &str,
    from: impl Fn(usize) -> PretrainConfig,
    to: impl Fn(usize) -> PretrainConfig,
) {
    let dir = scratch(name);
    let uninterrupted = train(&to(6));

    let stopped = train(
        &from(3)
            .with_save(Some(dir.clone()))
            .with_save_interval(Some(3)),
    );
    assert_eq!(stopped.checkpoints, [dir.join("iter_0000003")], "{what}");
    assert!(stopped.resumed_from.is_none());

    let same_command = to(6)
        .with_save(Some(dir.clone()))
        .with_save_interval(Some(3))
        .with_load(Some(dir.clone()));
    let resumed = train(&same_command);
    assert_eq!(
        resumed.resumed_from.as_deref(),
        Some(dir.join("iter_0000003").as_path()),
        "{what}"
    );
    let iterations: Vec<u64> = resumed.iterations.iter().map(|r| r.iteration).collect();
    assert_eq!(iterations, [4, 5, 6], "{what}");
    assert_eq!(resumed.iterations[0].consumed_samples, 32, "{what}");
    assert_close(
        &format!("{what}: losses before the stop"),
        &stopped.losses(),
        &uninterrupted.losses()[..3],
        tolerance::F32_TRAINING,
    );
    assert_close(
        &format!("{what}: losses after the resume"),
        &resumed.losses(),
        &uninterrupted.losses()[3..],
        tolerance::F32_TRAINING,
    );
    let evals = |s: &burn_megatron::training::PretrainSummary| -> Vec<f64> {
        s.evaluations.iter().map(|e| e.loss).collect()
    };
    assert_close(
        &format!("{what}: validation losses after the resume"),
        &evals(&resumed),
        &evals(&uninterrupted)[1..],
        tolerance::F32_TRAINING,
    );
    let lrs: Vec<f64> = resumed.iterations.iter().map(|r| r.lr).collect();
    let want: Vec<f64> = uninterrupted.iterations[3..].iter().map(|r| r.lr).collect();
    assert_eq!(lrs, want, "{what}: learning rates");

    // A fresh run over the same iterations differs: the comparison above is sharp.
    let fresh = train(&to(3));
    assert!(
        (fresh.losses()[0] - resumed.losses()[0]).abs() > 1e-2,
        "{what}: the resumed run starts where a fresh one does"
    );

    // Run again with the same command: nothing left to do, no step, no new checkpoint.
    let again = train(&same_command);
    assert!(again.iterations.is_empty(), "{what}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn resumed_run_equals_uninterrupted() {
    resume((2, 2), (2, 2));
}

#[test]
fn resumed_in_another_layout_equals_uninterrupted() {
    resume((2, 2), (1, 1));
}

/// The distributed optimizer's state saved by 2 DP ranks resumes at DP = 4 (no dropout: the
/// masks' numbering depends on the microbatches a rank runs).
#[test]
fn distributed_optimizer_resumed_at_another_dp_size_equals_uninterrupted() {
    let zero = |dp: usize| {
        move |iters| {
            run(1, 1, iters)
                .with_hidden_dropout(0.0)
                .with_attention_dropout(0.0)
                .with_data_parallel_size(dp)
                .with_use_distributed_optimizer(true)
        }
    };
    let what = "saved with ZeRO-1 at DP = 2, resumed at DP = 4";
    resume_runs(what, "resume-zero-dp2-dp4", zero(2), zero(4));
}

/// Checkpoints written in the background are published by the next save or at the end of the
/// run, and resume as the synchronous ones do.
#[test]
fn async_saved_run_resumes_equal_to_uninterrupted() {
    let in_background = |iters| run(2, 2, iters).with_async_save(true);
    let what = "saved in the background at (TP, PP) = (2, 2)";
    resume_runs(what, "resume-async", in_background, in_background);
}

/// A checkpoint of Burn's AdamW (DP = 1) resumes with the distributed optimizer at DP = 2: the
/// moments are stored per parameter, and the master weights come from the loaded parameters.
#[test]
fn burn_adamw_checkpoint_resumes_with_the_distributed_optimizer() {
    let plain = |iters| {
        run(1, 1, iters)
            .with_hidden_dropout(0.0)
            .with_attention_dropout(0.0)
    };
    let zero = move |iters| {
        plain(iters)
            .with_data_parallel_size(2)
            .with_use_distributed_optimizer(true)
    };
    let what = "saved by Burn's AdamW at DP = 1, resumed with ZeRO-1 at DP = 2";
    resume_runs(what, "resume-adamw-zero", plain, zero);
}

/// Checkpoints of the interleaved schedule (two chunks a rank) resume in another layout and
/// from another one, with Burn's AdamW and with the distributed optimizer (its state saved
/// and loaded across both chunks).
#[test]
fn interleaved_runs_resume_equal_to_uninterrupted() {
    let interleaved = |iters| run(1, 2, iters).with_num_layers_per_virtual_pipeline_stage(Some(1));
    let plain = |iters| run(2, 2, iters);
    let what = "saved interleaved at (TP, PP) = (1, 2), resumed at (2, 2)";
    resume_runs(what, "resume-interleaved-22", interleaved, plain);
    let what = "saved at (TP, PP) = (2, 2), resumed interleaved at (1, 2)";
    resume_runs(what, "resume-22-interleaved", plain, interleaved);
    let zero = |iters| {
        run(1, 2, iters)
            .with_num_layers_per_virtual_pipeline_stage(Some(1))
            .with_hidden_dropout(0.0)
            .with_attention_dropout(0.0)
            .with_data_parallel_size(2)
            .with_use_distributed_optimizer(true)
    };
    let what = "saved and resumed interleaved with ZeRO-1 at PP = 2 × DP = 2";
    resume_runs(what, "resume-interleaved-zero", zero, zero);
}

/// A checkpoint of uneven stages (3 + 1 layers at PP = 2) resumes in the even layout, and an
/// even one in uneven interleaved stages: checkpoints name layers by their global index.
#[test]
fn uneven_stages_resume_equal_to_uninterrupted() {
    let uneven = |iters| run(1, 2, iters).with_decoder_last_pipeline_num_layers(Some(1));
    let even = |iters| run(2, 2, iters);
    let what = "saved at PP = 2 with 3 + 1 layers, resumed at (TP, PP) = (2, 2)";
    resume_runs(what, "resume-uneven-22", uneven, even);
    let interleaved = |iters| {
        run(1, 2, iters)
            .with_decoder_first_pipeline_num_layers(Some(1))
            .with_num_virtual_stages_per_pipeline_rank(Some(2))
    };
    let what = "saved at (TP, PP) = (2, 2), resumed interleaved with 1 + 3 layers";
    resume_runs(what, "resume-22-uneven-interleaved", even, interleaved);
}

/// A GPT in FP8 (emulated) under delayed scaling: hidden 32, so that every FP8 GEMM's
/// dimensions are multiples of 16 at TP 2.
fn fp8_delayed(tp: usize, pp: usize, iters: usize) -> PretrainConfig {
    let fp8 = Fp8Config::new()
        .with_recipe(Fp8Recipe::Delayed)
        .with_amax_history_len(4);
    run(tp, pp, iters).with_hidden_size(32).with_fp8(Some(fp8))
}

/// `pretrain_gpt` in FP8 under delayed scaling saves and resumes (in the same layout and in
/// another), with the uninterrupted run's losses. At this size the scales barely move the
/// losses (a resume with fresh histories is 2e-5 off): `checkpoints/fp8_states.rs` checks
/// the saved and loaded states themselves, bit for bit.
#[test]
fn fp8_delayed_scaling_resumes_equal_to_uninterrupted() {
    for (tp, pp) in [(2, 2), (1, 1)] {
        let what =
            format!("FP8 delayed scaling saved at (TP, PP) = (2, 2), resumed at ({tp}, {pp})");
        let name = format!("resume-fp8-22-{tp}{pp}");
        resume_runs(
            &what,
            &name,
            |i| fp8_delayed(2, 2, i),
            move |i| fp8_delayed(tp, pp, i),
        );
    }
}
