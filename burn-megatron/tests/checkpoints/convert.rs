//! Offline conversion (`checkpoint_tool convert`): a checkpoint rewritten at another layout
//! holds every tensor (model and optimizer state) bit for bit, with its training state; a
//! round trip through Hugging Face's format gives the model back bit for bit, tokenizer
//! included; a missing source is an error naming what is missing.

use std::fs;
use std::path::Path;

use burn::optim::{AdamWConfig, Optimizer};
use burn_megatron::checkpointing::{
    Checkpoint, Checkpointer, SavedLayout, TargetLayout, TrainingState, adamw_state,
    convert_layout, export_hugging_face, import_hugging_face,
};

use crate::{build, microbatches, run, scratch, step, tiny_gpt};

/// Saves `tiny_gpt` at TP 2 × PP 2 after one AdamW step (so that optimizer state exists).
fn saved_with_adamw(root: &Path) -> std::path::PathBuf {
    let config = tiny_gpt();
    run(4, |ctx| {
        let (state, chunks) = build(&ctx, &config, 2, 2)?;
        let (_, grads) = step(&state, &chunks, &microbatches(0, 2, config.vocab_size))?;
        let mut optim = AdamWConfig::new().init();
        let chunk = optim.step(
            1e-2,
            chunks.into_iter().next().unwrap(),
            grads.into_iter().next().unwrap(),
        );
        let training = TrainingState {
            iteration: 1,
            consumed_samples: 8,
            rng_seed: 1234,
            ..Default::default()
        };
        let optimizer = [adamw_state(&chunk, &optim).unwrap()];
        Ok(Checkpointer::new(root).save(&state, &config, &[chunk], Some(&optimizer), &training)?)
    })
    .remove(0)
}

/// Every tensor of every group of `got` equals `want`'s, byte for byte.
fn assert_same_tensors(what: &str, got: &Checkpoint, want: &Checkpoint, groups: &[&str]) {
    for &group in groups {
        let (g, w) = (
            &got.metadata().tensors[group],
            &want.metadata().tensors[group],
        );
        assert_eq!(
            g.keys().collect::<Vec<_>>(),
            w.keys().collect::<Vec<_>>(),
            "{what}: {group}"
        );
        for (path, entry) in w {
            assert_eq!(g[path].dtype, entry.dtype, "{what}: {group} {path}");
            let (a, b) = (
                got.read_full(group, path).unwrap(),
                want.read_full(group, path).unwrap(),
            );
            assert_eq!(a.shape, b.shape, "{what}: {group} {path}");
            assert_eq!(a.as_bytes(), b.as_bytes(), "{what}: {group} {path}");
        }
    }
}

#[test]
fn a_layout_conversion_keeps_every_tensor_and_the_training_state() {
    let root = scratch("convert-layout");
    let original = Checkpoint::open(saved_with_adamw(&root.join("src"))).unwrap();
    let groups = ["model", "optimizer.exp_avg", "optimizer.exp_avg_sq"];
    for layout in [
        TargetLayout::new(4, 1),
        TargetLayout::new(1, 1),
        TargetLayout::new(1, 2).with_virtual_pp(2),
    ] {
        let dst = root.join(format!(
            "tp{}pp{}v{}",
            layout.tp, layout.pp, layout.virtual_pp
        ));
        let dir = convert_layout(original.dir(), &dst, layout).unwrap();
        assert_eq!(dir, dst.join("iter_0000001"));
        let converted = Checkpoint::open_latest(&dst).unwrap();
        let meta = converted.metadata();
        assert_eq!(
            meta.layout,
            SavedLayout {
                tp: layout.tp,
                pp: layout.pp,
                dp: 1,
                virtual_pp: layout.virtual_pp
            }
        );
        let files = meta
            .files
            .keys()
            .filter(|f| f.starts_with("model_"))
            .count();
        assert_eq!(
            files,
            layout.tp * layout.pp,
            "{layout:?}: {:?}",
            meta.files.keys()
        );
        assert_eq!(meta.training, original.metadata().training);
        assert_eq!(meta.optimizer, original.metadata().optimizer);
        assert_same_tensors(&format!("{layout:?}"), &converted, &original, &groups);
    }
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_hugging_face_round_trip_through_convert_is_bit_identical() {
    let root = scratch("convert-hf");
    let original = Checkpoint::open(saved_with_adamw(&root.join("src"))).unwrap();
    fs::write(original.dir().join("tokenizer.json"), b"{\"model\": {}}").unwrap();
    let hf = root.join("hf");
    export_hugging_face(original.dir(), &hf).unwrap();
    assert!(hf.join("config.json").is_file() && hf.join("model.safetensors").is_file());
    assert!(!hf.join(".tmp.model.safetensors").exists());
    let back = import_hugging_face(&hf, &root.join("back"), TargetLayout::new(2, 1)).unwrap();
    let back = Checkpoint::open(back).unwrap();
    assert_same_tensors("HF round trip", &back, &original, &["model"]);
    assert_eq!(
        fs::read(back.dir().join("tokenizer.json")).unwrap(),
        b"{\"model\": {}}"
    );
    fs::remove_dir_all(root).unwrap();
}

#[test]
fn converting_a_missing_checkpoint_names_what_is_missing() {
    let root = scratch("convert-missing");
    let err = convert_layout(
        &root.join("nothing"),
        &root.join("dst"),
        TargetLayout::new(2, 1),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("nothing/metadata.json") && err.contains("cannot read"),
        "{err}"
    );
    let err = import_hugging_face(&root, &root.join("dst"), TargetLayout::new(1, 1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    fs::remove_dir_all(root).unwrap();
}
