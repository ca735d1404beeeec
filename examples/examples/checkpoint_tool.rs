//! Inspects a sharded checkpoint offline: its layout, model configuration, training state,
//! every tensor (full shape, dtype, how it is split, in how many slices) and every file with
//! its size, after checking each file's size and CRC-32 against the metadata.
//!
//!     cargo run --example checkpoint_tool -- inspect target/pretrain_gpt          # the latest
//!     cargo run --example checkpoint_tool -- inspect target/pretrain_gpt/iter_0000100
//!
//! Converting between layouts and to or from Hugging Face goes through the library
//! (`Checkpoint::load_model` at the new layout, `checkpointing::hugging_face`); a `convert`
//! command is not written yet.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn_megatron::checkpointing::Checkpoint;
use clap::{Parser, Subcommand};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Reads burn-megatron checkpoints.
#[derive(Debug, Parser)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prints a checkpoint's layout, configuration, training state, tensors and files, and
    /// checks every file against its recorded size and CRC-32.
    Inspect {
        /// A checkpoint directory (`iter_*`) or a save root (its latest checkpoint is read).
        path: PathBuf,
    },
}

fn open(path: &Path) -> Result<Checkpoint, BoxError> {
    Ok(match path.join("metadata.json").is_file() {
        true => Checkpoint::open(path)?,
        false => Checkpoint::open_latest(path)?,
    })
}

fn inspect(path: &Path) -> Result<(), BoxError> {
    let checkpoint = open(path)?;
    let meta = checkpoint.metadata();
    let config = &meta.model_config;
    let layout = meta.layout;
    println!("checkpoint {}", checkpoint.dir().display());
    println!(
        "  format {}, iteration {}; saved at TP {} × PP {} × DP {} (virtual stages {})",
        meta.format_version, meta.iteration, layout.tp, layout.pp, layout.dp, layout.virtual_pp
    );
    println!(
        "  model: {} layers, hidden {}, {} heads, ffn {}, vocabulary {}, sequence {}",
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.ffn_hidden_size,
        config.vocab_size,
        config.max_sequence_length
    );
    let training = &meta.training;
    println!(
        "  training: iteration {}, {} samples consumed, seed {}",
        training.iteration, training.consumed_samples, training.rng_seed
    );
    match &meta.optimizer {
        Some(optimizer) => {
            let steps = optimizer.steps.values();
            let (low, high) = (steps.clone().min().unwrap_or(&0), steps.max().unwrap_or(&0));
            println!(
                "  optimizer: {} ({:?}), steps {low} to {high} over {} parameters",
                optimizer.kind,
                optimizer.layout,
                optimizer.steps.len()
            );
        }
        None => println!("  optimizer: none saved"),
    }
    for (group, tensors) in &meta.tensors {
        let elements: usize = tensors
            .values()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        println!("  {group}: {} tensors, {elements} elements", tensors.len());
        for (name, tensor) in tensors {
            let split = match tensor.partition_dim {
                Some(dim) => format!("split on dim {dim}"),
                None => "replicated".to_string(),
            };
            println!(
                "    {name:<48} {:<16} {:<5} {split}, {} slice(s)",
                format!("{:?}", tensor.shape),
                tensor.dtype,
                tensor.shards.len()
            );
        }
    }
    let mut failures = BTreeMap::new();
    let mut total = 0;
    println!("  files:");
    for (name, entry) in &meta.files {
        total += entry.bytes;
        let verdict = match std::fs::read(checkpoint.dir().join(name)) {
            Err(error) => format!("cannot be read: {error}"),
            Ok(bytes) if bytes.len() as u64 != entry.bytes => {
                format!("{} bytes, the metadata says {}", bytes.len(), entry.bytes)
            }
            Ok(bytes) if crc32fast::hash(&bytes) != entry.crc32 => "checksum differs".to_string(),
            Ok(_) => "ok".to_string(),
        };
        println!("    {name:<40} {:>12} bytes  {verdict}", entry.bytes);
        if verdict != "ok" {
            failures.insert(name.clone(), verdict);
        }
    }
    println!("  {} files, {total} bytes", meta.files.len());
    match failures.is_empty() {
        true => Ok(()),
        false => Err(format!("{} damaged file(s): {failures:?}", failures.len()).into()),
    }
}

fn main() {
    let result = match Args::parse().command {
        Command::Inspect { path } => inspect(&path),
    };
    if let Err(error) = result {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}
