//! Sharded save: every rank copies what it owns to the host and writes it, in parallel, into
//! one temporary directory; rank 0 writes the metadata once all have finished, then publishes
//! the directory by the protocol described in `directory.rs`. The files each rank writes are
//! described in `snapshot.rs`.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use burn::backend::ndarray::NdArrayDevice;
use burn::module::ParamId;
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::{ParallelState, ReduceOp};

use super::directory::{
    LATEST_FILE, PublishStep, StepHook, checkpoint_name, create_root, discard, exchange,
    is_complete, keep_last_except, latest_checkpoint, old_dir, remove_partial_saves,
    rename_into_place, run_hook, sync_dir, temp_dir, temp_file, write_synced,
};
use super::metadata::{
    CheckpointMetadata, FORMAT_VERSION, METADATA_FILE, OptimizerInfo, OptimizerLayout, SavedLayout,
    TensorEntry, TrainingState,
};
use super::snapshot::{RankManifest, RankSnapshot};
use super::tensor_file::CHECKSUM_BLOCK_BYTES;
use crate::ModelBackend;
use crate::error::CheckpointError;
use crate::error::Result;
use crate::models::GptModel;
use crate::optimizer::state::OptimizerState;
use crate::transformer::TransformerConfig;

/// Saves checkpoints under a root directory (`root/iter_0000100/`, `root/latest`), keeping
/// the newest `keep_last`.
#[derive(Debug, Clone)]
pub struct Checkpointer {
    root: PathBuf,
    keep_last: usize,
    block_bytes: usize,
    fail_rank: Option<usize>,
    step_hook: Option<StepHook>,
    exchange: bool,
}

/// A save whose snapshot is taken and whose files are not yet published: what the write
/// needs, and what publishing needs afterwards.
pub(crate) struct Started {
    pub snapshot: RankSnapshot,
    pub tmp: PathBuf,
    pub config: TransformerConfig,
    pub training: TrainingState,
}

impl Checkpointer {
    /// Checkpoints under `root`, keeping the newest 3.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            keep_last: 3,
            block_bytes: CHECKSUM_BLOCK_BYTES,
            fail_rank: None,
            step_hook: None,
            exchange: true,
        }
    }

    /// Keeps the newest `k` checkpoints (at least 1); older ones are removed after a save.
    pub fn with_keep_last(mut self, k: usize) -> Self {
        self.keep_last = k.max(1);
        self
    }

    /// Checksums each block of `bytes` of a data file (at least 1), besides the whole file: a
    /// load checks, and reads, only the blocks holding the slices it needs. Default
    /// [`CHECKSUM_BLOCK_BYTES`].
    pub fn with_checksum_block(mut self, bytes: usize) -> Self {
        self.block_bytes = bytes.max(1);
        self
    }

    /// Makes global rank `rank` fail after writing its files, as a crash mid-save would:
    /// for tests of the save's safety.
    #[doc(hidden)]
    pub fn with_injected_failure(mut self, rank: usize) -> Self {
        self.fail_rank = Some(rank);
        self
    }

    /// Calls `hook` on the publishing rank (rank 0) as each step of the publish protocol
    /// completes; an error it returns is handled as that step's failure: for tests that kill
    /// the process, or fail, at each step.
    #[doc(hidden)]
    pub fn with_step_hook(mut self, hook: StepHook) -> Self {
        self.step_hook = Some(hook);
        self
    }

    /// Whether a re-save exchanges the old and the new directory atomically where the system
    /// can (the default), or always moves the old one aside first (what happens where it
    /// cannot): for tests of both.
    #[doc(hidden)]
    pub fn with_exchange(mut self, exchange: bool) -> Self {
        self.exchange = exchange;
        self
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Saves `chunks` (this rank's model chunks, one per virtual stage), their optimizer state
    /// (`optimizer[i]` for `chunks[i]`, e.g. from [`adamw_state`](super::adamw_state)) and
    /// `training` as iteration `training.iteration`, and returns the checkpoint's directory.
    ///
    /// Every rank of `state`'s world must call it. The checkpoint appears (renamed from its
    /// temporary directory, `latest` updated) only once every rank has written its files and
    /// rank 0 the metadata; if any rank fails, every rank returns an error and the previous
    /// checkpoints are untouched. A process killed at any point leaves the previous checkpoint
    /// or the new one loadable ([`Checkpoint::open_latest`](super::Checkpoint::open_latest)),
    /// re-saves of an existing iteration included. Removing checkpoints beyond keep-last
    /// after publishing may fail: rank 0 prints a warning and the save succeeds.
    pub fn save<B: ModelBackend>(
        &self,
        state: &ParallelState,
        config: &TransformerConfig,
        chunks: &[GptModel<B>],
        optimizer: Option<&[OptimizerState]>,
        training: &TrainingState,
    ) -> Result<PathBuf> {
        let started = self.begin(state, config, chunks, None, optimizer, training)?;
        let written = self.write(started.snapshot, &started.tmp, state.world().rank());
        self.finish(
            state,
            &started.config,
            &started.training,
            &started.tmp,
            written,
        )
    }

    /// Saves `values[i]` (parameter values by id, any stored dtype) in the layout of
    /// `chunks[i]` instead of the chunks' own values: how a conversion rewrites a checkpoint
    /// in another layout without a round trip through the model's dtype.
    pub(crate) fn save_values<B: ModelBackend>(
        &self,
        state: &ParallelState,
        config: &TransformerConfig,
        chunks: &[GptModel<B>],
        values: Vec<HashMap<ParamId, TensorData>>,
        optimizer: Option<&[OptimizerState]>,
        training: &TrainingState,
    ) -> Result<PathBuf> {
        let started = self.begin(state, config, chunks, Some(values), optimizer, training)?;
        let written = self.write(started.snapshot, &started.tmp, state.world().rank());
        self.finish(
            state,
            &started.config,
            &started.training,
            &started.tmp,
            written,
        )
    }

    /// The first part of a save, every rank together: rank 0 repairs what a killed save left
    /// behind ([`remove_partial_saves`](super::remove_partial_saves)) and makes the temporary
    /// directory, then each rank copies its part to the host.
    pub(crate) fn begin<B: ModelBackend>(
        &self,
        state: &ParallelState,
        config: &TransformerConfig,
        chunks: &[GptModel<B>],
        values: Option<Vec<HashMap<ParamId, TensorData>>>,
        optimizer: Option<&[OptimizerState]>,
        training: &TrainingState,
    ) -> Result<Started> {
        let tmp = temp_dir(&self.root, training.iteration);
        let prepared = if state.world().rank() == 0 {
            create_root(&self.root)
                .and_then(|_| remove_partial_saves(&self.root))
                .and_then(|_| {
                    fs::create_dir_all(&tmp).map_err(|e| CheckpointError::io(&tmp, "create it", e))
                })
        } else {
            Ok(())
        };
        agree(state, prepared.is_ok(), &tmp)?;
        prepared?;
        let snapshot = RankSnapshot::take(state, chunks, values, optimizer, training.iteration);
        agree(state, snapshot.is_ok(), &tmp)?;
        Ok(Started {
            snapshot: snapshot?,
            tmp,
            config: config.clone(),
            training: training.clone(),
        })
    }

    /// The second part, each rank alone (on any thread): writes the snapshot into `tmp`.
    pub(crate) fn write(&self, snapshot: RankSnapshot, tmp: &Path, rank: usize) -> Result<()> {
        snapshot.write(tmp, self.block_bytes)?;
        match self.fail_rank {
            Some(r) if r == rank => {
                Err(CheckpointError::file(tmp, format!("injected failure on rank {r}")).into())
            }
            _ => Ok(()),
        }
    }

    /// The last part, every rank together, once this rank's write has ended with `written`:
    /// if every rank wrote its files, rank 0 publishes the checkpoint. Returns its directory;
    /// if any rank failed, every rank returns an error and nothing is published.
    pub(crate) fn finish(
        &self,
        state: &ParallelState,
        config: &TransformerConfig,
        training: &TrainingState,
        tmp: &Path,
        written: Result<()>,
    ) -> Result<PathBuf> {
        let world = state.world();
        let final_dir = self.root.join(checkpoint_name(training.iteration));
        if let Err(e) = agree(state, written.is_ok(), tmp) {
            if world.rank() == 0 {
                let _ = fs::remove_dir_all(tmp);
            }
            return Err(written.err().unwrap_or(e));
        }
        let published = if world.rank() == 0 {
            self.publish(state, config, training, tmp, &final_dir)
        } else {
            Ok(())
        };
        if let Err(e) = agree(state, published.is_ok(), &final_dir) {
            if world.rank() == 0 {
                let _ = fs::remove_dir_all(tmp);
            }
            return Err(published.err().unwrap_or(e));
        }
        Ok(final_dir)
    }

    /// Rank 0: merges the ranks' manifests into the metadata and publishes the directory (the
    /// protocol of `directory.rs`): metadata synced, renamed into place (a re-save exchanging
    /// it with the old one, or moving that aside first), `latest` updated, superseded
    /// checkpoints removed. An error once
    /// the directory is renamed (a failed sync, `latest` not updated) leaves the new
    /// checkpoint complete in place; failures to remove old checkpoints are warnings.
    fn publish(
        &self,
        state: &ParallelState,
        config: &TransformerConfig,
        training: &TrainingState,
        tmp: &Path,
        final_dir: &Path,
    ) -> Result<()> {
        self.step(PublishStep::FilesWritten, tmp)?;
        let mut metadata = CheckpointMetadata {
            format_version: FORMAT_VERSION,
            iteration: training.iteration,
            layout: SavedLayout {
                tp: state.tp().size(),
                pp: state.pp().size(),
                dp: state.dp().size(),
                virtual_pp: state.virtual_pipeline_size(),
            },
            model_config: config.clone(),
            training: training.clone(),
            optimizer: None,
            tensors: BTreeMap::new(),
            files: BTreeMap::new(),
        };
        for rank in 0..state.world().size() {
            let file = tmp.join(format!("rank_{rank}.json"));
            let bytes = fs::read(&file).map_err(|e| CheckpointError::io(&file, "read it", e))?;
            let manifest: RankManifest = serde_json::from_slice(&bytes)
                .map_err(|e| CheckpointError::file(&file, format!("not a manifest: {e}")))?;
            metadata.files.extend(manifest.files);
            if let Some(kind) = manifest.optimizer_kind {
                let info = metadata.optimizer.get_or_insert_with(|| OptimizerInfo {
                    kind,
                    layout: OptimizerLayout::PerParameter,
                    steps: BTreeMap::new(),
                    dp_sharded: manifest.dp_sharded,
                });
                info.steps.extend(manifest.steps);
            }
            for e in manifest.entries {
                let entry = metadata
                    .tensors
                    .entry(e.group.clone())
                    .or_default()
                    .entry(e.path.clone())
                    .or_insert_with(|| TensorEntry {
                        shape: e.shape.clone(),
                        dtype: e.dtype.clone(),
                        partition_dim: e.partition_dim,
                        shards: Vec::new(),
                    });
                if entry.shape != e.shape || entry.dtype != e.dtype {
                    return Err(CheckpointError::file(
                        &file,
                        format!(
                            "{} {} is {:?} {} here but {:?} {} on another rank",
                            e.group, e.path, e.shape, e.dtype, entry.shape, entry.dtype
                        ),
                    )
                    .into());
                }
                entry.shards.push(e.shard);
            }
            fs::remove_file(&file).map_err(|e| CheckpointError::io(&file, "remove it", e))?;
        }
        for (group, tensors) in &metadata.tensors {
            for (path, entry) in tensors {
                let stored: usize = entry
                    .shards
                    .iter()
                    .map(|s| s.shape.iter().product::<usize>())
                    .sum();
                if stored != entry.shape.iter().product::<usize>() {
                    return Err(CheckpointError::mismatch(
                        tmp,
                        format!("{group} {path}: the ranks' slices do not cover it exactly"),
                    )
                    .into());
                }
            }
        }
        let json = serde_json::to_vec_pretty(&metadata)
            .map_err(|e| CheckpointError::file(&tmp.join(METADATA_FILE), e.to_string()))?;
        write_synced(&tmp.join(METADATA_FILE), &json)?;
        sync_dir(tmp)?;
        self.step(PublishStep::MetadataWritten, tmp)?;
        let aside = self.rename_into_place(tmp, final_dir, training.iteration)?;
        self.step(PublishStep::Renamed, final_dir)?;

        // `latest` names the newest complete checkpoint: this one, unless a newer iteration
        // was saved here before.
        let newest = latest_checkpoint(&self.root)?.unwrap_or_else(|| final_dir.to_path_buf());
        if newest != final_dir {
            eprintln!(
                "warning: the checkpoint of iteration {} was saved to {}, but {} is of a later \
                 iteration: loading the latest checkpoint of {} picks that one",
                training.iteration,
                final_dir.display(),
                newest.display(),
                self.root.display()
            );
        }
        let name = newest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let latest = self.root.join(LATEST_FILE);
        let latest_tmp = temp_file(&latest);
        write_synced(&latest_tmp, name.as_bytes())?;
        self.step(PublishStep::LatestWritten, &latest_tmp)?;
        rename_into_place(&latest_tmp, &latest)?;
        self.step(PublishStep::LatestUpdated, &latest)?;

        // Published: what is left is clean-up, whose failures are warnings (this rank only).
        let mut problems = Vec::new();
        if let Some(old) = aside
            && let Err(e) = discard(&self.root, &old, self.step_hook)
        {
            problems.push(e);
        }
        match keep_last_except(&self.root, self.keep_last, Some(final_dir), self.step_hook) {
            Ok(errors) => problems.extend(errors),
            Err(e) => problems.push(e),
        }
        if !problems.is_empty() {
            let problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
            eprintln!(
                "warning: the checkpoint of iteration {} was saved to {}, but removing the \
                 checkpoints it supersedes failed (the next save tries again): {}",
                training.iteration,
                final_dir.display(),
                problems.join("; ")
            );
        }
        Ok(())
    }

    /// Renames the finished temporary directory `tmp` to `final_dir`, the root synced, and
    /// returns where the checkpoint it replaces now is (a re-save), to be discarded. A complete
    /// checkpoint already in `final_dir` is exchanged with `tmp` atomically where the system
    /// can; elsewhere it is first renamed aside, to `.old.iter_N` (readers take it for
    /// checkpoint N until the new one is in place), and put back if the rename fails.
    fn rename_into_place(
        &self,
        tmp: &Path,
        final_dir: &Path,
        iteration: u64,
    ) -> Result<Option<PathBuf>> {
        if self.exchange && is_complete(final_dir) && exchange(tmp, final_dir)? {
            sync_dir(&self.root)?;
            return Ok(Some(tmp.to_path_buf()));
        }
        let mut aside = None;
        if is_complete(final_dir) {
            let old = old_dir(&self.root, iteration);
            if old.exists() {
                // Left by an earlier re-save; `final_dir` is complete, so it is not needed.
                fs::remove_dir_all(&old).map_err(|e| CheckpointError::io(&old, "remove it", e))?;
            }
            fs::rename(final_dir, &old)
                .map_err(|e| CheckpointError::io(final_dir, "move it aside to replace it", e))?;
            aside = Some(old);
        } else if final_dir.exists() {
            // A directory without metadata is no checkpoint (what an interrupted removal by an
            // earlier version left behind).
            fs::remove_dir_all(final_dir)
                .map_err(|e| CheckpointError::io(final_dir, "replace it", e))?;
        }
        let renamed = (|| -> Result<()> {
            if let Some(old) = &aside {
                sync_dir(&self.root)?;
                self.step(PublishStep::OldMovedAside, old)?;
            }
            fs::rename(tmp, final_dir)
                .map_err(|e| CheckpointError::io(final_dir, "rename the finished save to it", e))?;
            Ok(())
        })();
        if let Err(e) = renamed {
            if let Some(old) = &aside
                && !final_dir.exists()
                && fs::rename(old, final_dir).is_ok()
            {
                let _ = sync_dir(&self.root);
            }
            return Err(e);
        }
        sync_dir(&self.root)?;
        Ok(aside)
    }

    /// Runs the step hook, if any, for `step` (an error naming `path`).
    fn step(&self, step: PublishStep, path: &Path) -> Result<()> {
        Ok(run_hook(self.step_hook, step, path)?)
    }
}

/// Whether every rank of the world reports `ok`: an all-reduce of the failures, so that all
/// ranks take the same branch. The flag is a host tensor, through the group's host transport:
/// a tensor on the model's backend would need this rank's device (the default device, GPU 0,
/// failed on the second rank of a two-GPU run).
fn agree(state: &ParallelState, ok: bool, dir: &Path) -> Result<()> {
    let flag = Tensor::<NdArray, 1>::from_floats([if ok { 0.0 } else { 1.0 }], &NdArrayDevice::Cpu);
    let failed = state.world().all_reduce(flag, ReduceOp::Sum)?.into_scalar();
    let failed: f64 = burn::tensor::ElementConversion::elem(failed);
    if failed > 0.0 {
        return Err(CheckpointError::OtherRank {
            dir: dir.to_path_buf(),
            problem: format!("{failed} rank(s) failed; nothing was published"),
        }
        .into());
    }
    Ok(())
}
