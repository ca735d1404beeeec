//! Saved at one (TP, PP) layout, loaded at others: loss and gradients equal the saved model's
//! on one device (f32, 1e-5 relative).

use std::path::Path;

use burn_megatron::checkpointing::{Checkpoint, Checkpointer, TrainingState};
use burn_megatron::transformer::TransformerConfig;

use crate::{
    Outcome, assert_same_step, build, merge, microbatches, run, scratch, step, tiny_gpt, tiny_llama,
};

/// The single-device step of `config` (the saved model).
fn reference(
    config: &TransformerConfig,
) -> (
    f64,
    std::collections::BTreeMap<String, burn::tensor::TensorData>,
) {
    merge(run(1, |ctx| {
        let (state, chunks) = build(&ctx, config, 1, 1)?;
        Ok(step(&state, &chunks, &microbatches(0, 4, config.vocab_size))?.0)
    }))
}

fn save(config: &TransformerConfig, (tp, pp, dp): (usize, usize, usize), root: &Path) {
    run(tp * pp * dp, |ctx| {
        let (state, chunks) = build(&ctx, config, tp, pp)?;
        let training = TrainingState {
            iteration: 7,
            ..Default::default()
        };
        Checkpointer::new(root).save(&state, config, &chunks, None, &training)?;
        Ok(())
    });
}

/// Builds `config` with another seed at TP × PP × DP, loads the latest checkpoint and runs a step.
fn load_and_step(
    config: &TransformerConfig,
    (tp, pp, dp): (usize, usize, usize),
    root: &Path,
) -> Vec<Outcome> {
    let other = config.clone().with_seed(config.seed + 1);
    run(tp * pp * dp, |ctx| {
        let (state, chunks) = build(&ctx, &other, tp, pp)?;
        let checkpoint = Checkpoint::open_latest(root)?;
        checkpoint.check_config(&other)?;
        assert_eq!(checkpoint.training_state().iteration, 7);
        let chunks = chunks
            .into_iter()
            .map(|c| checkpoint.load_model(c))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(step(&state, &chunks, &microbatches(0, 4, config.vocab_size))?.0)
    })
}

fn check(config: TransformerConfig, name: &str, saved: (usize, usize), loads: &[(usize, usize)]) {
    let saved = (saved.0, saved.1, 1);
    let loads: Vec<_> = loads.iter().map(|&(tp, pp)| (tp, pp, 1)).collect();
    check_dp(config, name, saved, &loads);
}

/// Saves `config` at `saved` = (TP, PP, DP), loads it at each of `loads`.
fn check_dp(
    config: TransformerConfig,
    name: &str,
    saved: (usize, usize, usize),
    loads: &[(usize, usize, usize)],
) {
    let root = scratch(&format!("reshard-{name}-{saved:?}"));
    save(&config, saved, &root);
    let want = reference(&config);
    // Loading into a differently seeded model must change its step: else the test proves
    // nothing.
    let other = reference(&config.clone().with_seed(config.seed + 1));
    assert!(
        (other.0 - want.0).abs() > 1e-4,
        "the seeds give the same loss"
    );
    for &layout in loads {
        let got = merge(load_and_step(&config, layout, &root));
        assert_same_step(
            &format!("{name} saved at (TP, PP, DP) = {saved:?}, loaded at {layout:?}"),
            &got,
            &want,
        );
    }
    std::fs::remove_dir_all(root).unwrap();
}
#[test]
fn gpt_saved_at_tp2_pp2_loads_in_any_layout() {
    check(
        tiny_gpt(),
        "gpt",
        (2, 2),
        &[(1, 1), (4, 1), (1, 4), (2, 1), (2, 2), (1, 2), (4, 2)],
    );
}

#[test]
fn gpt_saved_at_tp4_loads_at_tp1_and_pp2() {
    check(tiny_gpt(), "gpt", (4, 1), &[(1, 1), (2, 2)]);
}

#[test]
fn llama_saved_at_tp2_pp2_loads_in_any_layout() {
    check(tiny_llama(), "llama", (2, 2), &[(1, 1), (2, 1), (1, 4)]);
}

/// Data-parallel replicas: only DP rank 0 writes; every replica loads.
#[test]
fn gpt_saved_with_dp2_loads_with_and_without_dp() {
    check_dp(
        tiny_gpt(),
        "gpt-dp",
        (2, 1, 2),
        &[(1, 1, 1), (1, 4, 2), (2, 2, 2)],
    );
}
