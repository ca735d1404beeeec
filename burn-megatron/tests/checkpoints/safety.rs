//! A crash mid-save leaves the previous checkpoint loadable; corrupt, truncated,
//! incomplete and mismatched checkpoints are refused, naming the file and the problem; the
//! last K checkpoints are kept.

use std::fs;
use std::path::Path;

use burn_megatron::checkpointing::{
    Checkpoint, Checkpointer, TrainingState, latest_checkpoint, list_checkpoints,
};
use burn_megatron::transformer::TransformerConfig;

use crate::{build, run, scratch, tiny_gpt};

fn save_at(root: &Path, config: &TransformerConfig, tp: usize, iteration: u64, keep: usize) {
    run(tp, |ctx| {
        let (state, chunks) = build(&ctx, config, tp, 1)?;
        let training = TrainingState {
            iteration,
            ..Default::default()
        };
        Checkpointer::new(root)
            .with_keep_last(keep)
            .save(&state, config, &chunks, None, &training)?;
        Ok(())
    });
}

/// The error of loading the latest checkpoint under `root` into a TP = `tp` model.
fn load_error(root: &Path, config: &TransformerConfig, tp: usize) -> String {
    let errors = run(tp, |ctx| {
        let (_, chunks) = build(&ctx, config, tp, 1)?;
        let result = Checkpoint::open_latest(root).and_then(|c| {
            c.check_config(config)?;
            c.load_model(chunks.into_iter().next().unwrap())
        });
        Ok(result.err().map(|e| e.to_string()))
    });
    errors.into_iter().flatten().next().expect("loading fails")
}

fn loads(root: &Path, config: &TransformerConfig) -> u64 {
    run(1, |ctx| {
        let (_, chunks) = build(&ctx, config, 1, 1)?;
        let checkpoint = Checkpoint::open_latest(root)?;
        checkpoint.load_model(chunks.into_iter().next().unwrap())?;
        Ok(checkpoint.training_state().iteration)
    })[0]
}

#[test]
fn a_crash_mid_save_leaves_the_previous_checkpoint() {
    let config = tiny_gpt();
    let root = scratch("crash");
    save_at(&root, &config, 2, 1, 3);
    // A save killed half-way: its temporary directory holds a partial shard, no metadata.
    let partial = root.join(".tmp.iter_0000002");
    fs::create_dir_all(&partial).unwrap();
    fs::write(partial.join("model_tp0_pp0.safetensors"), b"half a file").unwrap();
    assert_eq!(
        latest_checkpoint(&root).unwrap(),
        Some(root.join("iter_0000001"))
    );
    assert_eq!(loads(&root, &config), 1);

    // A rank failing after writing its files: every rank gets an error, nothing appears.
    let results = run(2, |ctx| {
        let (state, chunks) = build(&ctx, &config, 2, 1)?;
        let training = TrainingState {
            iteration: 3,
            ..Default::default()
        };
        let saved = Checkpointer::new(&root)
            .with_injected_failure(1)
            .save(&state, &config, &chunks, None, &training);
        Ok(saved.err().map(|e| e.to_string()))
    });
    assert!(results.iter().all(Option::is_some), "{results:?}");
    assert!(
        results[1]
            .as_ref()
            .unwrap()
            .contains("injected failure on rank 1")
    );
    assert!(!root.join("iter_0000003").exists());
    assert!(!root.join(".tmp.iter_0000003").exists());
    assert_eq!(loads(&root, &config), 1);

    // The next save cleans the partial directory up and becomes the latest.
    save_at(&root, &config, 2, 4, 3);
    assert!(!partial.exists());
    assert_eq!(loads(&root, &config), 4);
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn the_last_k_checkpoints_are_kept() {
    let config = tiny_gpt();
    let root = scratch("keep");
    for iteration in 1..=4 {
        save_at(&root, &config, 1, iteration, 2);
    }
    let kept: Vec<u64> = list_checkpoints(&root)
        .unwrap()
        .into_iter()
        .map(|(i, _)| i)
        .collect();
    assert_eq!(kept, vec![3, 4]);
    assert_eq!(
        fs::read_to_string(root.join("latest")).unwrap(),
        "iter_0000004"
    );
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn broken_checkpoints_are_refused_with_the_file_and_the_problem() {
    let config = tiny_gpt();
    let root = scratch("broken");
    save_at(&root, &config, 2, 1, 3);
    let dir = root.join("iter_0000001");
    let shard = dir.join("model_tp1_pp0.safetensors");
    let original = fs::read(&shard).unwrap();

    // One flipped byte in the data.
    let mut corrupt = original.clone();
    let last = corrupt.len() - 3;
    corrupt[last] ^= 0x40;
    fs::write(&shard, &corrupt).unwrap();
    let err = load_error(&root, &config, 1);
    assert!(
        err.contains("model_tp1_pp0.safetensors") && err.contains("corrupt"),
        "{err}"
    );

    // A truncated file.
    fs::write(&shard, &original[..original.len() / 2]).unwrap();
    let err = load_error(&root, &config, 2);
    assert!(
        err.contains("model_tp1_pp0.safetensors") && err.contains("truncated"),
        "{err}"
    );

    // A missing shard file.
    fs::remove_file(&shard).unwrap();
    let err = load_error(&root, &config, 1);
    assert!(
        err.contains("model_tp1_pp0.safetensors") && err.contains("missing"),
        "{err}"
    );
    fs::write(&shard, &original).unwrap();

    // Another model configuration.
    let mut wider = config.clone();
    wider.hidden_size = 32;
    let err = load_error(&root, &wider, 1);
    assert!(
        err.contains("iter_0000001") && err.contains("hidden_size = 16"),
        "{err}"
    );

    // Metadata that lacks a shard: the tensor is not covered.
    let meta = dir.join("metadata.json");
    let text = fs::read_to_string(&meta).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["tensors"]["model"]["block.layers.0.mlp.fc1.weight"]["shards"]
        .as_array_mut()
        .unwrap()
        .pop();
    fs::write(&meta, serde_json::to_string(&json).unwrap()).unwrap();
    let err = load_error(&root, &config, 1);
    assert!(
        err.contains("block.layers.0.mlp.fc1.weight") && err.contains("missing"),
        "{err}"
    );

    // Unreadable metadata.
    fs::write(&meta, "{").unwrap();
    let err = load_error(&root, &config, 1);
    assert!(
        err.contains("metadata.json") && err.contains("not valid metadata"),
        "{err}"
    );
    fs::remove_dir_all(root).unwrap();
}
