//! Train, save, load in a new layout (model and AdamW state resharded), continue: the losses
//! equal uninterrupted training in the new layout.

use std::ops::Range;
use std::path::Path;

use burn::optim::{AdamWConfig, Optimizer};
use burn_megatron::checkpointing::{
    Checkpoint, Checkpointer, TrainingState, adamw_record, adamw_state,
};
use burn_megatron::transformer::TransformerConfig;

use crate::{assert_close, build, microbatches, run, scratch, step, tiny_gpt, tolerance};

const LR: f64 = 1e-2;

/// Trains `config` at TP × PP with AdamW over `steps` (the step index picks the data),
/// optionally starting from the latest checkpoint under `load` and saving under `save` at
/// the end. Returns the step losses.
fn train(
    config: &TransformerConfig,
    (tp, pp): (usize, usize),
    steps: Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<f64> {
    let per_rank = run(tp * pp, |ctx| {
        let (state, mut chunks) = build(&ctx, config, tp, pp)?;
        let mut optims: Vec<_> = chunks
            .iter()
            .map(|_| AdamWConfig::new().with_weight_decay(0.01).init())
            .collect();
        if let Some(root) = load {
            let checkpoint = Checkpoint::open_latest(root)?;
            checkpoint.check_config(config)?;
            assert_eq!(checkpoint.training_state().iteration, steps.start as u64);
            let mut loaded = Vec::new();
            for (chunk, optim) in chunks.into_iter().zip(optims.drain(..)) {
                let chunk = checkpoint.load_model(chunk)?;
                let saved = checkpoint.load_optimizer_state(&chunk)?;
                loaded.push((adamw_record(&chunk, &saved), chunk, optim));
            }
            chunks = Vec::new();
            for (record, chunk, optim) in loaded {
                optims.push(optim.load_record(record));
                chunks.push(chunk);
            }
        }
        let mut losses = Vec::new();
        for s in steps.clone() {
            let (outcome, grads) = step(&state, &chunks, &microbatches(s, 2, config.vocab_size))?;
            losses.push(outcome.loss);
            chunks = chunks
                .into_iter()
                .zip(grads)
                .zip(optims.iter_mut())
                .map(|((chunk, grads), optim)| optim.step(LR, chunk, grads))
                .collect();
        }
        if let Some(root) = save {
            let optimizer: Vec<_> = chunks
                .iter()
                .zip(&optims)
                .map(|(chunk, optim)| adamw_state(chunk, optim).unwrap())
                .collect();
            let training = TrainingState {
                iteration: steps.end as u64,
                consumed_samples: (steps.end * 4) as u64,
                rng_seed: config.seed,
                ..Default::default()
            };
            Checkpointer::new(root).save(&state, config, &chunks, Some(&optimizer), &training)?;
        }
        Ok(losses)
    });
    // The last stage's ranks report the losses.
    let losses: Vec<Vec<f64>> = per_rank
        .into_iter()
        .filter(|l| l.iter().all(Option::is_some))
        .map(|l| l.into_iter().map(Option::unwrap).collect())
        .collect();
    for l in &losses[1..] {
        assert_eq!(l, &losses[0], "ranks disagree on the losses");
    }
    losses[0].clone()
}

fn resume(from: (usize, usize), to: (usize, usize)) {
    let config = tiny_gpt();
    let root = scratch(&format!("resume-{from:?}-{to:?}"));
    let (n, k) = (3, 3);
    let uninterrupted = train(&config, to, 0..n + k, None, None);
    let first = train(&config, from, 0..n, None, Some(&root));
    // A model built from another seed: every value must come from the checkpoint.
    let reseeded = config.clone().with_seed(config.seed + 1);
    let resumed = train(&reseeded, to, n..n + k, Some(&root), None);
    let what = format!("saved at (TP, PP) = {from:?}, resumed at {to:?}");
    assert_close(
        &format!("{what}: losses before the save"),
        &first,
        &uninterrupted[..n],
        tolerance::F32,
    );
    assert_close(
        &format!("{what}: losses after the resume"),
        &resumed,
        &uninterrupted[n..],
        tolerance::F32_TRAINING,
    );
    // Without the optimizer state the resumed losses would differ: the comparison is sharp.
    assert!(
        (resumed[0] - uninterrupted[n - 1]).abs() > 1e-6,
        "{what}: training made no progress"
    );
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn adamw_resumed_at_tp1_equals_uninterrupted() {
    resume((2, 2), (1, 1));
}

#[test]
fn adamw_resumed_at_tp4_and_pp4_equals_uninterrupted() {
    resume((2, 2), (4, 1));
    resume((2, 1), (1, 4));
}
