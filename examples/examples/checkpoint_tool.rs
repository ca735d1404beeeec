//! Inspects and converts sharded checkpoints offline.
//!
//! `inspect` prints a checkpoint's layout, model configuration, training state, every tensor
//! (full shape, dtype, how it is split, in how many slices) and every file with its size,
//! after checking each file's size and CRC-32 against the metadata.
//!
//! `convert` rewrites a checkpoint at another (TP, PP, virtual PP) layout (model, optimizer and
//! training state, in the saved dtypes; the DP size needs no conversion), imports a Hugging
//! Face checkpoint (`--from-hf`), or exports to one (`--to-hf`, any saved layout). It runs on
//! CPU thread ranks.
//!
//!     cargo run --example checkpoint_tool -- inspect target/pretrain_gpt          # the latest
//!     cargo run --example checkpoint_tool -- inspect target/pretrain_gpt/iter_0000100
//!     cargo run --example checkpoint_tool -- convert target/pretrain_gpt ck_tp4 --tp 4 --pp 1
//!     cargo run --example checkpoint_tool -- convert target/pretrain_gpt hf_out --to-hf
//!     cargo run --example checkpoint_tool -- convert hf_model ck --from-hf --tp 2 --pp 2

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn_megatron::checkpointing::{
    Checkpoint, TargetLayout, convert_layout, export_hugging_face, import_hugging_face,
    latest_checkpoint,
};
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
    /// Writes a checkpoint in another layout, or converts to or from Hugging Face.
    Convert {
        /// The checkpoint (`iter_*` or a save root: its latest), or with `--from-hf` a
        /// transformers checkpoint directory.
        src: PathBuf,
        /// The save root to write into (`DST/iter_*`, `DST/latest`), or with `--to-hf` the
        /// transformers checkpoint directory to write.
        dst: PathBuf,
        /// Tensor-parallel size of the new checkpoint.
        #[arg(long, default_value_t = 1)]
        tp: usize,
        /// Pipeline-parallel size of the new checkpoint.
        #[arg(long, default_value_t = 1)]
        pp: usize,
        /// Virtual pipeline stages (model chunks) per pipeline rank.
        #[arg(long, default_value_t = 1)]
        virtual_pp: usize,
        /// SRC is a Hugging Face (transformers) checkpoint: import it.
        #[arg(long, conflicts_with = "to_hf")]
        from_hf: bool,
        /// Export SRC to DST as a Hugging Face checkpoint (f32; the layout options are unused).
        #[arg(long)]
        to_hf: bool,
    },
}

/// The checkpoint directory `path` names: itself, or the latest under a save root.
fn checkpoint_dir(path: &Path) -> Result<PathBuf, BoxError> {
    if path.join("metadata.json").is_file() {
        return Ok(path.to_path_buf());
    }
    latest_checkpoint(path)?.ok_or_else(|| {
        format!(
            "{}: neither a checkpoint (no metadata.json) nor a save root with one",
            path.display()
        )
        .into()
    })
}

fn inspect(path: &Path) -> Result<(), BoxError> {
    let checkpoint = Checkpoint::open(checkpoint_dir(path)?)?;
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

fn convert(
    src: &Path,
    dst: &Path,
    layout: TargetLayout,
    from_hf: bool,
    to_hf: bool,
) -> Result<(), BoxError> {
    let start = std::time::Instant::now();
    if to_hf {
        let dir = checkpoint_dir(src)?;
        export_hugging_face(&dir, dst)?;
        println!(
            "exported {} to {} (transformers)",
            dir.display(),
            dst.display()
        );
    } else {
        let written = match from_hf {
            true => import_hugging_face(src, dst, layout)?,
            false => convert_layout(&checkpoint_dir(src)?, dst, layout)?,
        };
        println!(
            "wrote {} at TP {} × PP {} (virtual stages {})",
            written.display(),
            layout.tp,
            layout.pp,
            layout.virtual_pp
        );
    }
    println!("in {:.2} s", start.elapsed().as_secs_f64());
    Ok(())
}

fn main() {
    let result = match Args::parse().command {
        Command::Inspect { path } => inspect(&path),
        Command::Convert {
            src,
            dst,
            tp,
            pp,
            virtual_pp,
            from_hf,
            to_hf,
        } => convert(
            &src,
            &dst,
            TargetLayout::new(tp, pp).with_virtual_pp(virtual_pp),
            from_hf,
            to_hf,
        ),
    };
    if let Err(error) = result {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}
