//! Offline conversion of checkpoints (`checkpoint_tool convert`): to another (TP, PP, virtual
//! PP) layout, from a Hugging Face checkpoint, and to one. Runs on CPU thread ranks.
//!
//! A layout conversion never rounds through a model's dtype: each rank of the new layout
//! builds its model chunk only to learn which slice of every tensor it holds (the placements
//! its layers declare), reads those slices in the saved dtype, and saves them, with the
//! optimizer state and the training state, as a save at that layout would. The DP size needs
//! no conversion: the optimizer state is stored per parameter and loads at any DP size.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::backend::NdArray;
use burn_megatron_dist::{LaunchConfig, ParallelSizes, RankContext, launch};

use super::hugging_face::{HfCheckpoint, copy_tokenizer_files, export_tensors};
use super::load::Checkpoint;
use super::metadata::{CheckpointMetadata, TrainingState};
use super::save::Checkpointer;
use crate::error::Result;
use crate::models::GptModel;
use crate::pipeline_parallel::StageSplit;
use crate::transformer::TransformerConfig;

/// The thread ranks' backend: the model is built for its shapes and placements only.
type Cpu = NdArray<f32>;

/// A (TP, PP, virtual PP) layout to convert to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetLayout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Model chunks (virtual stages) per pipeline rank; 1 without interleaving.
    pub virtual_pp: usize,
}

impl TargetLayout {
    /// TP × PP, no virtual stages.
    pub fn new(tp: usize, pp: usize) -> Self {
        Self {
            tp,
            pp,
            virtual_pp: 1,
        }
    }

    /// With `v` virtual stages per pipeline rank.
    pub fn with_virtual_pp(self, v: usize) -> Self {
        Self {
            virtual_pp: v,
            ..self
        }
    }
}

/// Rewrites the checkpoint in `src` (an `iter_*` directory) at `layout` under `dst_root`
/// (as iteration `src`'s iteration, `latest` updated): the model, the optimizer state (if
/// saved), FP8 delayed scaling's states (if saved) and the training state. Returns the new
/// checkpoint's directory.
pub fn convert_layout(src: &Path, dst_root: &Path, layout: TargetLayout) -> Result<PathBuf> {
    let metadata = CheckpointMetadata::read(src)?;
    let config = metadata.model_config.clone();
    let mut dirs = on_threads(layout, |ctx| {
        let (state, chunks) = build(ctx, &config, layout)?;
        let checkpoint = Checkpoint::open(src)?;
        checkpoint.check_config(&config)?;
        let values = chunks
            .iter()
            .map(|c| checkpoint.model_values(c))
            .collect::<Result<Vec<_>>>()?;
        for chunk in &chunks {
            checkpoint.restore_fp8_states(chunk)?;
        }
        let optimizer = match metadata.optimizer {
            Some(_) => Some(
                chunks
                    .iter()
                    .map(|c| checkpoint.load_optimizer_state(c))
                    .collect::<Result<Vec<_>>>()?,
            ),
            None => None,
        };
        Checkpointer::new(dst_root).save_values(
            &state,
            &config,
            &chunks,
            values,
            optimizer.as_deref(),
            checkpoint.training_state(),
        )
    })?;
    Ok(dirs.swap_remove(0))
}

/// Imports the Hugging Face checkpoint in `src` (`config.json` and safetensors weights) at
/// `layout` under `dst_root`, as iteration 0 with no optimizer state; its tokenizer files
/// are copied into the new checkpoint's directory. Returns that directory.
pub fn import_hugging_face(src: &Path, dst_root: &Path, layout: TargetLayout) -> Result<PathBuf> {
    let config = HfCheckpoint::open(src)?.config().clone();
    let mut dirs = on_threads(layout, |ctx| {
        let (state, chunks) = build(ctx, &config, layout)?;
        let hf = HfCheckpoint::open(src)?;
        let chunks = chunks
            .into_iter()
            .map(|c| hf.load_model(c))
            .collect::<Result<Vec<_>>>()?;
        let training = TrainingState::default();
        Checkpointer::new(dst_root).save(&state, &config, &chunks, None, &training)
    })?;
    let dir = dirs.swap_remove(0);
    copy_tokenizer_files(src, &dir)?;
    Ok(dir)
}

/// Exports the checkpoint in `src` (an `iter_*` directory, any layout) to `dst` as a Hugging
/// Face checkpoint (`config.json`, `model.safetensors` in f32), with the tokenizer files
/// found in `src`. Reads each full tensor from its saved slices: no model is built.
pub fn export_hugging_face(src: &Path, dst: &Path) -> Result<()> {
    let checkpoint = Checkpoint::open(src)?;
    let metadata = checkpoint.metadata();
    let tensors = metadata.model_tensors().ok_or_else(|| {
        super::CheckpointError::mismatch(src, "the checkpoint holds no model tensors")
    })?;
    let mut params = std::collections::BTreeMap::new();
    for path in tensors.keys() {
        params.insert(
            path.clone(),
            checkpoint.read_full(super::MODEL_GROUP, path)?,
        );
    }
    export_tensors(&metadata.model_config, params, dst)?;
    copy_tokenizer_files(src, dst)?;
    Ok(())
}

/// Runs `f` on the layout's TP × PP CPU thread ranks.
fn on_threads<T: Send>(
    layout: TargetLayout,
    f: impl Fn(&RankContext) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let config = LaunchConfig::new(layout.tp * layout.pp).with_timeout(Duration::from_secs(600));
    Ok(launch(config, |ctx| f(&ctx))?)
}

/// This rank's layout state and its model chunks (one per virtual stage).
fn build(
    ctx: &RankContext,
    config: &TransformerConfig,
    layout: TargetLayout,
) -> Result<(burn_megatron_dist::ParallelState, Vec<GptModel<Cpu>>)> {
    let sizes = ParallelSizes::default()
        .with_tp(layout.tp)
        .with_pp(layout.pp);
    let state = ctx
        .parallel_state(sizes)?
        .with_virtual_pipeline_size(layout.virtual_pp)?;
    let split = StageSplit::even(config.num_layers, layout.pp * layout.virtual_pp)?;
    let chunks = (0..layout.virtual_pp)
        .map(|c| {
            let stage = split.stage(c * layout.pp + state.pp_rank());
            Ok(config.init_gpt_stage::<Cpu>(state.tp(), &stage, &Default::default())?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((state, chunks))
}
