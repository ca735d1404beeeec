//! `FlatAdamW` (flat buffers, fp32 master weights, one fused update) through the
//! `Checkpointer`: its state is saved by parameter path, loaded into a fresh optimizer on a
//! fresh model, and training continues with the losses of uninterrupted training.

use std::ops::Range;
use std::path::Path;

use burn_megatron::checkpointing::{Checkpoint, Checkpointer, TrainingState};
use burn_megatron::optimizer::FlatAdamWConfig;
use burn_megatron::pipeline_parallel::forward_backward_no_pipelining;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::ParallelSizes;

use crate::{AD, assert_close, microbatches, run, scratch, tiny_gpt, tolerance};

/// Microbatches per step.
const MICROBATCHES: usize = 2;

/// Trains `config` on one rank with `FlatAdamW` over `steps` (the step index picks the data),
/// from the latest checkpoint under `load` if given (its optimizer state too, unless
/// `model_only`), saving under `save` at the end. Returns the losses.
fn train(
    config: &TransformerConfig,
    steps: Range<usize>,
    load: Option<(&Path, bool)>,
    save: Option<&Path>,
) -> Vec<f64> {
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let checkpoint = load
            .map(|(root, _)| Checkpoint::open_latest(root))
            .transpose()?;
        if let Some(checkpoint) = &checkpoint {
            model = checkpoint.load_model(model)?;
        }
        let mut optim = FlatAdamWConfig::new()
            .with_weight_decay(0.1)
            .init::<AD, _>(&model)?;
        if let (Some(checkpoint), Some((_, false))) = (&checkpoint, load) {
            optim.load_state(&checkpoint.load_optimizer_state(&model)?)?;
        }
        let mut losses = Vec::new();
        for s in steps.clone() {
            let batch = microbatches(s, MICROBATCHES, config.vocab_size);
            let (loss, grads) = forward_backward_no_pipelining(&model, &batch)?;
            losses.push(loss.into_scalar() as f64);
            model = optim.step(1e-2, model, &grads)?;
        }
        if let Some(root) = save {
            let training = TrainingState {
                iteration: steps.end as u64,
                ..Default::default()
            };
            let saved = optim.state()?;
            Checkpointer::new(root).save(&state, config, &[model], Some(&[saved]), &training)?;
        }
        Ok(losses)
    })
    .remove(0)
}

#[test]
fn flat_adamw_resumes_with_the_losses_of_uninterrupted_training() {
    let config = tiny_gpt();
    let root = scratch("flat-adamw-resume");
    let (n, k) = (3, 3);
    let uninterrupted = train(&config, 0..n + k, None, None);
    let first = train(&config, 0..n, None, Some(&root));
    // Another seed: every value that matters must come from the checkpoint.
    let reseeded = config.clone().with_seed(config.seed + 1);
    let resumed = train(&reseeded, n..n + k, Some((&root, false)), None);
    assert_close(
        "losses before the save",
        &first,
        &uninterrupted[..n],
        tolerance::F32_TRAINING,
    );
    assert_close(
        "losses after the resume",
        &resumed,
        &uninterrupted[n..],
        tolerance::F32_TRAINING,
    );
    // Without the optimizer state the resumed losses differ: the comparison is sharp.
    let model_only = train(&reseeded, n..n + k, Some((&root, true)), None);
    let gap = (model_only[1] - uninterrupted[n + 1]).abs() / uninterrupted[n + 1].abs();
    assert!(
        gap > 100.0 * tolerance::F32_TRAINING,
        "a fresh optimizer gives the same losses ({model_only:?} vs {uninterrupted:?})"
    );
    std::fs::remove_dir_all(root).unwrap();
}
