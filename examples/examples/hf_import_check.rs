//! Imports transformers checkpoints made by `bench/hf_interop_check.py make DIR` (a tiny GPT-2,
//! a tiny Llama, a tiny Mixtral and a tiny Qwen3-MoE in `DIR/qwen3_moe`, those present), runs
//! them on CPU (NdArray, f32) on the tokens the script used, at TP = 1 and 2 (the MoE models
//! also at EP = 2 and TP 2 × EP 2, on `TP · EP` thread ranks), prints the largest difference
//! from transformers' logits, and exports each model from its last layout back to
//! `DIR/<model>/export` for `hf_interop_check.py compare DIR`. Passes when every difference is
//! below 1e-4 absolute, and the MoE models' below 1e-5 of their largest logit.
//!
//!     cargo run --release -p burn-megatron-examples --example hf_import_check -- DIR

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::checkpointing::hugging_face::{HfCheckpoint, export_model};
use burn_megatron::pipeline_parallel::Stage;
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

/// Our logits (full vocabulary, unpadded) of `dir` at TP = `tp` and EP = `ep` (DP = EP, every
/// rank on the same tokens); the model is exported to `export` when given.
fn our_logits(
    dir: &Path,
    tokens: &[Vec<i64>],
    (tp, ep): (usize, usize),
    export: Option<PathBuf>,
) -> Result<Vec<f32>, BoxError> {
    let (batch, seq) = (tokens.len(), tokens[0].len());
    let flat: Vec<i64> = tokens.iter().flatten().copied().collect();
    let mut out = launch(
        LaunchConfig::new(tp * ep),
        |ctx| -> Result<Vec<f32>, BoxError> {
            let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp).with_ep(ep))?;
            let hf = HfCheckpoint::open(dir)?;
            let config = hf.config().clone();
            let stage = Stage::whole(config.num_layers);
            let model = config.init_gpt_stage_with_ep::<B>(
                state.tp(),
                state.ep(),
                &stage,
                &Default::default(),
            )?;
            let model = hf.load_model(model)?;
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
        },
    )?;
    Ok(out.swap_remove(0))
}

fn main() -> Result<(), BoxError> {
    let root = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: hf_import_check DIR (made by bench/hf_interop_check.py make DIR)")?,
    );
    let (mut worst, mut worst_rel, mut nan) = (0f32, 0f32, false);
    for name in ["gpt2", "llama", "mixtral", "qwen3_moe"] {
        let moe = matches!(name, "mixtral" | "qwen3_moe");
        let dir = root.join(name);
        if !dir.join("reference_logits.json").exists() {
            println!("{name}: not made (no {}), skipped", dir.display());
            continue;
        }
        let (tokens, want) = reference(&dir)?;
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let layouts: &[(usize, usize)] = match moe {
            true => &[(1, 1), (2, 1), (1, 2), (2, 2)],
            false => &[(1, 1), (2, 1)],
        };
        for &(tp, ep) in layouts {
            let last = Some(&(tp, ep)) == layouts.last();
            let got = our_logits(&dir, &tokens, (tp, ep), last.then(|| dir.join("export")))?;
            nan |= got.iter().chain(&want).any(|v| !v.is_finite());
            let max_abs = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let max_rel = got.iter().zip(&want).fold(0f32, |m, (a, b)| {
                m.max((a - b).abs() / b.abs().max(1e-3 * scale))
            });
            worst = worst.max(max_abs);
            if moe {
                worst_rel = worst_rel.max(max_abs / scale);
            }
            println!(
                "{name} TP = {tp}, EP = {ep}: ours vs transformers logits: max abs \
                 {max_abs:.3e}, relative to the largest logit {:.3e}, max rel {max_rel:.3e}",
                max_abs / scale
            );
        }
        println!("{name}: exported to {}", dir.join("export").display());
    }
    let pass = !nan && worst < 1e-4 && worst_rel < 1e-5;
    println!(
        "{} (max abs {worst:.3e}, bound 1e-4; the MoE models' relative to their largest logit \
         {worst_rel:.3e}, bound 1e-5{})",
        if pass { "PASS" } else { "FAIL" },
        if nan { "; a value is not finite" } else { "" }
    );
    if pass {
        Ok(())
    } else {
        Err("logits differ".into())
    }
}
