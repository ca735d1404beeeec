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

fn save(config: &TransformerConfig, tp: usize, pp: usize, root: &Path) {
    run(tp * pp, |ctx| {
        let (state, chunks) = build(&ctx, config, tp, pp)?;
        let training = TrainingState {
            iteration: 7,
            ..Default::default()
        };
        Checkpointer::new(root).save(&state, config, &chunks, None, &training)?;
        Ok(())
    });
}

/// Builds `config` with another seed at TP × PP, loads the latest checkpoint and runs a step.
fn load_and_step(config: &TransformerConfig, tp: usize, pp: usize, root: &Path) -> Vec<Outcome> {
    let other = config.clone().with_seed(config.seed + 1);
    run(tp * pp, |ctx| {
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
    let root = scratch(&format!("reshard-{name}-{}x{}", saved.0, saved.1));
    save(&config, saved.0, saved.1, &root);
    let want = reference(&config);
    // Loading into a differently seeded model must change its step: else the test proves
    // nothing.
    let other = reference(&config.clone().with_seed(config.seed + 1));
    assert!(
        (other.0 - want.0).abs() > 1e-4,
        "the seeds give the same loss"
    );
    for &(tp, pp) in loads {
        let got = merge(load_and_step(&config, tp, pp, &root));
        assert_same_step(
            &format!(
                "{name} saved at TP={} PP={}, loaded at TP={tp} PP={pp}",
                saved.0, saved.1
            ),
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
