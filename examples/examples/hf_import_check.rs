//! Imports transformers checkpoints made by `bench/hf_interop_check.py make DIR` (a tiny GPT-2
//! and a tiny Llama), runs them on CPU (NdArray, f32) at TP = 1 and TP = 2 on the tokens the
//! script used, prints the largest difference from transformers' logits, and exports each model
//! back to `DIR/<model>/export` for `hf_interop_check.py compare DIR`.
//!
//!     cargo run --release -p burn-megatron-examples --example hf_import_check -- DIR

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::checkpointing::hugging_face::{HfCheckpoint, export_model};
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};

type B = NdArray<f32>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The tokens `[batch, seq]` and logits `[batch, seq, vocab]` the script saved.
fn reference(dir: &Path) -> Result<(Vec<Vec<i64>>, Vec<f32>), BoxError> {
    let text = std::fs::read_to_string(dir.join("reference_logits.json"))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let tokens: Vec<Vec<i64>> = serde_json::from_value(json["tokens"].clone())?;
    let logits: Vec<Vec<Vec<f32>>> = serde_json::from_value(json["logits"].clone())?;
    Ok((tokens, logits.into_iter().flatten().flatten().collect()))
}

/// Our logits (full vocabulary, unpadded) of `dir` at TP = `tp`; rank 0 exports the model to
/// `export` when given.
fn our_logits(
    dir: &Path,
    tokens: &[Vec<i64>],
    tp: usize,
    export: Option<PathBuf>,
) -> Result<Vec<f32>, BoxError> {
    let (batch, seq) = (tokens.len(), tokens[0].len());
    let flat: Vec<i64> = tokens.iter().flatten().copied().collect();
    let mut out = launch(LaunchConfig::new(tp), |ctx| -> Result<Vec<f32>, BoxError> {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        let hf = HfCheckpoint::open(dir)?;
        let config = hf.config().clone();
        let model = hf.load_model(config.init_gpt::<B>(state.tp(), &Default::default())?)?;
        let tokens = Tensor::<B, 2, Int>::from_data(
            TensorData::new(flat.clone(), [batch, seq]),
            &Default::default(),
        );
        let local = model.try_forward(tokens)?;
        let logits = state
            .tp()
            .all_gather(local, 2)?
            .narrow(2, 0, config.vocab_size);
        if let Some(export) = &export {
            export_model(&model, &config, export)?;
            hf.copy_tokenizer(export)?;
        }
        Ok(logits.into_data().convert::<f32>().into_vec::<f32>()?)
    })?;
    Ok(out.swap_remove(0))
}

fn main() -> Result<(), BoxError> {
    let root = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: hf_import_check DIR (made by bench/hf_interop_check.py make DIR)")?,
    );
    let mut worst: f32 = 0.0;
    for name in ["gpt2", "llama"] {
        let dir = root.join(name);
        let (tokens, want) = reference(&dir)?;
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for tp in [1, 2] {
            let export = (tp == 1).then(|| dir.join("export"));
            let got = our_logits(&dir, &tokens, tp, export)?;
            let max_abs = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let max_rel = got.iter().zip(&want).fold(0f32, |m, (a, b)| {
                m.max((a - b).abs() / b.abs().max(1e-3 * scale))
            });
            worst = worst.max(max_abs);
            println!(
                "{name} TP = {tp}: ours vs transformers logits: max abs {max_abs:.3e}, max rel \
                 {max_rel:.3e}"
            );
        }
        println!("{name}: exported to {}", dir.join("export").display());
    }
    let pass = worst < 1e-4;
    println!(
        "{} (max abs {worst:.3e}, bound 1e-4)",
        if pass { "PASS" } else { "FAIL" }
    );
    if pass {
        Ok(())
    } else {
        Err("logits differ".into())
    }
}
