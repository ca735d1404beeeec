//! The book's checkpoint tutorial (book/src/tutorial_checkpoints.md): a small GPT-2-shaped
//! model saved at TP 2 × PP 2 on four CPU thread ranks, loaded at TP 1 (resharded on load),
//! rewritten offline at TP 4, exported to Hugging Face transformers' format and imported back.
//! Every step checks that the values did not change, and the program fails if one did.
//!
//!     cargo run --example checkpoint_tutorial

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::checkpointing::hugging_face::HfCheckpoint;
use burn_megatron::checkpointing::{
    Checkpoint, Checkpointer, MODEL_GROUP, TargetLayout, TrainingState, convert_layout,
    export_hugging_face, import_hugging_face,
};
use burn_megatron::pipeline_parallel::StageSplit;
use burn_megatron::transformer::{Activation, TransformerConfig};
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};

type B = NdArray<f32>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ANCHOR: config
/// GPT-2's architecture (LayerNorm, learned positions, tanh GeLU, tied embeddings), tiny:
/// hidden 64, 4 layers, 4 heads, FFN 256, vocabulary 1000, sequences of 32.
fn config() -> TransformerConfig {
    TransformerConfig::new(64, 4, 4, 256, 1000, 32).with_activation(Activation::GeluTanh)
}
// ANCHOR_END: config

// ANCHOR: save
/// Four thread ranks, TP 2 × PP 2: each builds its stage's slice and writes only that.
fn save_at_tp2_pp2(root: &Path) -> Result<PathBuf, BoxError> {
    let config = config();
    let mut dirs = launch(LaunchConfig::new(4), |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2).with_pp(2))?;
        let stage = StageSplit::even(config.num_layers, 2)?.stage(state.pp_rank());
        let chunk = config.init_gpt_stage::<B>(state.tp(), &stage, &Default::default())?;
        // ... train `chunk` here ...
        let training = TrainingState {
            iteration: 100,
            consumed_samples: 3200,
            ..Default::default()
        };
        // Every rank calls save; rank 0 publishes `root/iter_0000100` once all have written.
        let dir = Checkpointer::new(root).save(&state, &config, &[chunk], None, &training)?;
        Ok::<_, BoxError>(dir)
    })?;
    Ok(dirs.swap_remove(0))
}
// ANCHOR_END: save

// ANCHOR: load
/// One rank (TP 1, PP 1): build a model from another seed, load the checkpoint into it, and
/// return its logits for fixed tokens (the vocabulary padding cut off).
fn load_at_tp1(root: &Path) -> Result<Vec<f32>, BoxError> {
    let config = config().with_seed(7); // other initial values: the load must replace them all
    let mut logits = launch(LaunchConfig::new(1), |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let checkpoint = Checkpoint::open_latest(root)?;
        checkpoint.check_config(&config)?; // the same shapes; parallelism may differ
        println!(
            "loading iteration {} (saved at TP {} × PP {}) at TP 1 × PP 1",
            checkpoint.training_state().iteration,
            checkpoint.metadata().layout.tp,
            checkpoint.metadata().layout.pp
        );
        let model = config.init_gpt::<B>(state.tp(), &Default::default())?;
        let model = checkpoint.load_model(model)?;
        Ok::<_, BoxError>(logits_of(&model_logits(model)?))
    })?;
    Ok(logits.swap_remove(0))
}
// ANCHOR_END: load

/// The logits of `model` (TP 1) for fixed tokens `[2, 32]`, unpadded.
fn model_logits(
    model: burn_megatron::models::GptModel<B>,
) -> Result<Tensor<B, 3>, burn_megatron::Error> {
    let vocab = config().vocab_size;
    let ids: Vec<i64> = (0..64).map(|i| (i * 37 + 11) % vocab as i64).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, 32]), &Default::default());
    Ok(model.try_forward(tokens)?.narrow(2, 0, vocab))
}

fn logits_of(logits: &Tensor<B, 3>) -> Vec<f32> {
    logits.clone().into_data().into_vec::<f32>().unwrap()
}

/// The logits of a model of `config` built at TP 1 without any checkpoint. With `config()`'s
/// seed this is the saved model: initial values depend on the seed and the element's place in
/// the full tensor only, so the TP 2 × PP 2 slices are this model cut in four.
fn reference_logits(config: &TransformerConfig) -> Result<Vec<f32>, BoxError> {
    let mut logits = launch(LaunchConfig::new(1), |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = config.init_gpt::<B>(state.tp(), &Default::default())?;
        Ok::<_, BoxError>(logits_of(&model_logits(model)?))
    })?;
    Ok(logits.swap_remove(0))
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

// ANCHOR: same_tensors
/// Every model tensor of checkpoint `a` equals checkpoint `b`'s, bit for bit, whatever the
/// layouts they were saved in (`read_full` assembles a full tensor from its slices).
fn same_tensors(a: &Path, b: &Path) -> Result<usize, BoxError> {
    let (a, b) = (Checkpoint::open(a)?, Checkpoint::open(b)?);
    let paths: Vec<String> = a
        .metadata()
        .model_tensors()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    for path in &paths {
        let (x, y) = (
            a.read_full(MODEL_GROUP, path)?,
            b.read_full(MODEL_GROUP, path)?,
        );
        if x.shape != y.shape || x.as_bytes() != y.as_bytes() {
            return Err(format!("{path} differs between {a:?} and {b:?}", a = a.dir()).into());
        }
    }
    Ok(paths.len())
}
// ANCHOR_END: same_tensors

fn main() -> Result<(), BoxError> {
    let work = std::env::temp_dir().join(format!("checkpoint_tutorial_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);

    // ANCHOR: main_load
    // 1. Save at TP 2 × PP 2.
    let saved = save_at_tp2_pp2(&work.join("ck"))?;
    println!("saved {}", saved.display());

    // 2. Load at TP 1: the loader reads the slices it needs from the four ranks' files.
    let loaded = load_at_tp1(&work.join("ck"))?;
    let difference = max_difference(&loaded, &reference_logits(&config())?);
    println!("logits at TP 1 vs the saved model's: largest difference {difference:e}");
    assert_eq!(
        difference, 0.0,
        "the loaded model differs from the saved one"
    );
    // ANCHOR_END: main_load
    // The seed-7 model before loading differs: the load did replace its values.
    let unloaded = reference_logits(&config().with_seed(7))?;
    assert!(max_difference(&unloaded, &loaded) > 1e-3);
    // ANCHOR: main_convert

    // 3. Reshard offline: rewrite the checkpoint at TP 4 × PP 1 (what `checkpoint_tool
    //    convert ck ck_tp4 --tp 4 --pp 1` does).
    let tp4 = convert_layout(&saved, &work.join("ck_tp4"), TargetLayout::new(4, 1))?;
    let count = same_tensors(&saved, &tp4)?;
    println!(
        "resharded to {}: {count} tensors bit-identical",
        tp4.display()
    );

    // 4. Export to Hugging Face (GPT2LMHeadModel: config.json, model.safetensors) straight
    //    from the sharded files, then read it back as transformers' format.
    let hf = work.join("hf");
    export_hugging_face(&saved, &hf)?;
    let family = HfCheckpoint::open(&hf)?.family();
    println!("exported to {} ({family:?})", hf.display());

    // 5. Import it at TP 2 × PP 2 again, as a new checkpoint (iteration 0, no optimizer).
    let imported = import_hugging_face(&hf, &work.join("from_hf"), TargetLayout::new(2, 2))?;
    let count = same_tensors(&saved, &imported)?;
    println!(
        "imported to {}: {count} tensors bit-identical",
        imported.display()
    );
    // ANCHOR_END: main_convert

    std::fs::remove_dir_all(&work)?;
    Ok(())
}
