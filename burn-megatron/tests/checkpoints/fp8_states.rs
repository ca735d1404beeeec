//! FP8 delayed scaling's amax histories and scales go into checkpoints and come back: saved
//! at (TP, PP) = (2, 2) after two steps, they load bit for bit at (2, 2), (1, 1) and (1, 2), a
//! run continued from the loaded model at (2, 2) steps exactly as the saved one continues,
//! and a conversion to another layout carries them.

use std::collections::BTreeMap;
use std::path::Path;

use burn_megatron::checkpointing::{
    Checkpoint, Checkpointer, TargetLayout, TrainingState, convert_layout,
};
use burn_megatron::models::GptModel;
use burn_megatron::ops::fp8::{DelayedData, Fp8Config, Fp8Recipe};
use burn_megatron::transformer::TransformerConfig;

use burn_megatron_dist::ParallelState;

use crate::{AD, BoxError, build, microbatches, run, scratch, step, tiny_gpt};

/// Every FP8 layer's states, by path in the whole model.
type States = BTreeMap<String, [DelayedData; 3]>;

/// Without the weight cache: these steps do not change the weights, so a cached cast would
/// carry the first step's scale into the third in the saved run but not in the loaded one.
fn config() -> TransformerConfig {
    let fp8 = Fp8Config::new()
        .with_recipe(Fp8Recipe::Delayed)
        .with_amax_history_len(4)
        .with_cache_weights(false);
    tiny_gpt().with_fp8(Some(fp8))
}

/// The states of `chunks` on this rank (TP rank 0 only: the others hold the same).
fn states(chunks: &[GptModel<AD>], tp_rank: usize) -> States {
    let mut out = States::new();
    if tp_rank != 0 {
        return out;
    }
    for chunk in chunks {
        for (path, fp8) in chunk.fp8_layers() {
            let data = fp8
                .delayed_data()
                .unwrap()
                .expect("the layer has run or was loaded");
            out.insert(path, data);
        }
    }
    out
}

/// One rank's states now, then after the third step, and that step's loss (last stage).
type RankOutcome = (States, States, Option<f64>);

/// `chunks`' states, then the third step and the states after it.
fn states_around_third_step(
    state: &ParallelState,
    chunks: &[GptModel<AD>],
) -> Result<RankOutcome, BoxError> {
    let before = states(chunks, state.tp().rank());
    let (third, _) = step(state, chunks, &microbatches(2, 4, 50))?;
    Ok((before, states(chunks, state.tp().rank()), third.loss))
}

/// The ranks' outcomes merged: the states before and after the third step, and its loss.
fn merged(ranks: Vec<RankOutcome>) -> (States, (States, Vec<f64>)) {
    let (mut before, mut after, mut losses) = (States::new(), States::new(), Vec::new());
    for (b, a, loss) in ranks {
        before.extend(b);
        after.extend(a);
        losses.extend(loss);
    }
    (before, (after, losses))
}

/// Two steps at (2, 2), saved under `root`; the states then, and after a third step with its
/// loss.
fn save(root: &Path) -> (States, (States, Vec<f64>)) {
    merged(run(4, |ctx| {
        let (state, chunks) = build(&ctx, &config(), 2, 2)?;
        for s in 0..2 {
            step(&state, &chunks, &microbatches(s, 4, 50))?;
        }
        let training = TrainingState {
            iteration: 2,
            ..Default::default()
        };
        Checkpointer::new(root).save(&state, &config(), &chunks, None, &training)?;
        states_around_third_step(&state, &chunks)
    }))
}

/// Loads `dir` at TP × PP into a model of another seed: the states as loaded, and after the
/// third step with its loss.
fn load(dir: &Path, tp: usize, pp: usize) -> (States, (States, Vec<f64>)) {
    let other = config().with_seed(config().seed + 1);
    merged(run(tp * pp, |ctx| {
        let (state, chunks) = build(&ctx, &other, tp, pp)?;
        let checkpoint = Checkpoint::open(dir)?;
        let chunks = chunks
            .into_iter()
            .map(|c| checkpoint.load_model(c))
            .collect::<Result<Vec<_>, _>>()?;
        states_around_third_step(&state, &chunks)
    }))
}

#[test]
fn fp8_delayed_states_are_saved_and_loaded_in_any_layout() {
    let root = scratch("fp8-states");
    let (saved, (continued, continued_loss)) = save(&root);
    // 4 layers × (qkv, attention output, fc1, fc2), histories filled by the two steps.
    assert_eq!(saved.len(), 16);
    for (path, [input, weight, grad_output]) in &saved {
        assert!(
            input.amax_history[..2].iter().all(|&a| a > 0.0),
            "{path}: {input:?}"
        );
        assert!(weight.amax_history[0] > 0.0, "{path}: {weight:?}");
        assert!(grad_output.amax_history[0] > 0.0, "{path}: {grad_output:?}");
        assert!(input.scale != 1.0, "{path}: the scale moved from its start");
    }
    let dir = root.join("iter_0000002");

    // The same layout: loaded bit for bit, and the next step the saved model's, bit for bit.
    let (loaded, (stepped, loss)) = load(&dir, 2, 2);
    assert_eq!(loaded, saved, "loaded at (2, 2)");
    assert_eq!(loss, continued_loss, "the step after the load at (2, 2)");
    assert_eq!(stepped, continued, "the states after that step at (2, 2)");

    // Other layouts: the states are per layer, equal over TP.
    for (tp, pp) in [(1, 1), (1, 2)] {
        let (loaded, _) = load(&dir, tp, pp);
        assert_eq!(loaded, saved, "loaded at ({tp}, {pp})");
    }

    // A conversion to (1, 1) carries them.
    let converted_root = scratch("fp8-states-converted");
    let converted = convert_layout(&dir, &converted_root, TargetLayout::new(1, 1)).unwrap();
    let (loaded, _) = load(&converted, 1, 1);
    assert_eq!(loaded, saved, "converted to (1, 1)");
    std::fs::remove_dir_all(root).unwrap();
    std::fs::remove_dir_all(converted_root).unwrap();
}
