//! Sharded save: every rank writes only what it owns, in parallel, into one temporary
//! directory; rank 0 writes the metadata once all have finished, then the directory is
//! renamed into place.
//!
//! Files: `model_tp{t}_pp{p}.safetensors` per model-parallel rank (DP rank 0 only: the
//! data-parallel replicas are equal), holding that rank's slices of its chunks' parameters,
//! and `optimizer_tp{t}_pp{p}.safetensors` with the optimizer state sliced the same way.
//! A replicated parameter is written by TP rank 0; vocabulary padding is never written.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::{DistBackend, ParallelState, ReduceOp};
use serde::{Deserialize, Serialize};

use super::directory::{
    LATEST_FILE, checkpoint_name, crc32, keep_last, remove_partial_saves, sync_dir, temp_dir,
    write_atomic, write_synced,
};
use super::error::CheckpointError;
use super::metadata::{
    CheckpointMetadata, FORMAT_VERSION, FileEntry, METADATA_FILE, MODEL_GROUP, OptimizerInfo,
    OptimizerLayout, SavedLayout, ShardEntry, TensorEntry, TrainingState,
};
use super::optimizer_state::OptimizerState;
use super::region::{Region, copy_region, volume};
use super::slices::{LocalSlice, dtype_from_name, dtype_name, local_slices};
use crate::ModelBackend;
use crate::error::Result;
use crate::models::GptModel;
use crate::transformer::TransformerConfig;

/// Saves checkpoints under a root directory (`root/iter_0000100/`, `root/latest`), keeping
/// the newest `keep_last`.
#[derive(Debug, Clone)]
pub struct Checkpointer {
    root: PathBuf,
    keep_last: usize,
    fail_rank: Option<usize>,
}

/// What one rank wrote: its file and the slices in it. Rank 0 merges these into the metadata.
#[derive(Debug, Default, Serialize, Deserialize)]
struct RankManifest {
    files: BTreeMap<String, FileEntry>,
    entries: Vec<ManifestEntry>,
    optimizer_kind: Option<String>,
    steps: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ManifestEntry {
    group: String,
    path: String,
    shape: Vec<usize>,
    dtype: String,
    partition_dim: Option<usize>,
    shard: ShardEntry,
}

/// One tensor to write: its safetensors dtype, shape and bytes.
struct Blob {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl safetensors::View for &Blob {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

impl Checkpointer {
    /// Checkpoints under `root`, keeping the newest 3.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            keep_last: 3,
            fail_rank: None,
        }
    }

    /// Keeps the newest `k` checkpoints (at least 1); older ones are removed after a save.
    pub fn with_keep_last(mut self, k: usize) -> Self {
        self.keep_last = k.max(1);
        self
    }

    /// Makes global rank `rank` fail after writing its files, as a crash mid-save would:
    /// for tests of the save's safety.
    #[doc(hidden)]
    pub fn with_injected_failure(mut self, rank: usize) -> Self {
        self.fail_rank = Some(rank);
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
    /// checkpoints are untouched.
    pub fn save<B: ModelBackend>(
        &self,
        state: &ParallelState,
        config: &TransformerConfig,
        chunks: &[GptModel<B>],
        optimizer: Option<&[OptimizerState]>,
        training: &TrainingState,
    ) -> Result<PathBuf> {
        let world = state.world();
        let tmp = temp_dir(&self.root, training.iteration);
        let final_dir = self.root.join(checkpoint_name(training.iteration));
        // Rank 0 clears what a crashed save left behind and makes the temporary directory
        // before anyone writes into it.
        let prepared = if world.rank() == 0 {
            fs::create_dir_all(&self.root)
                .map_err(|e| CheckpointError::io(&self.root, "create it", e))
                .and_then(|_| remove_partial_saves(&self.root))
                .and_then(|_| {
                    fs::create_dir_all(&tmp).map_err(|e| CheckpointError::io(&tmp, "create it", e))
                })
        } else {
            Ok(())
        };
        agree::<B>(state, prepared.is_ok(), &tmp)?;
        prepared?;

        let written = self.write_rank(state, chunks, optimizer, &tmp);
        let written = match (written, self.fail_rank) {
            (Ok(_), Some(r)) if r == world.rank() => {
                Err(CheckpointError::file(&tmp, format!("injected failure on rank {r}")).into())
            }
            (w, _) => w,
        };
        if let Err(e) = agree::<B>(state, written.is_ok(), &tmp) {
            if world.rank() == 0 {
                let _ = fs::remove_dir_all(&tmp);
            }
            return Err(written.err().unwrap_or(e));
        }

        let published = if world.rank() == 0 {
            self.publish(state, config, training, &tmp, &final_dir)
        } else {
            Ok(())
        };
        if let Err(e) = agree::<B>(state, published.is_ok(), &final_dir) {
            if world.rank() == 0 {
                let _ = fs::remove_dir_all(&tmp);
            }
            return Err(published.err().unwrap_or(e));
        }
        Ok(final_dir)
    }

    /// Writes this rank's tensor files and its manifest into `tmp`.
    fn write_rank<B: ModelBackend>(
        &self,
        state: &ParallelState,
        chunks: &[GptModel<B>],
        optimizer: Option<&[OptimizerState]>,
        tmp: &Path,
    ) -> Result<()> {
        let mut manifest = RankManifest::default();
        if state.dp().rank() == 0 {
            let (t, p) = (state.tp().rank(), state.pp_rank());
            let mut model = Vec::new();
            let mut optim = Vec::new();
            for (i, chunk) in chunks.iter().enumerate() {
                let values = param_values(chunk);
                let chunk_state = optimizer.and_then(|o| o.get(i));
                for slice in local_slices(chunk)?.into_iter().filter(|s| s.writes) {
                    let Some(value) = values.get(&slice.id) else {
                        continue;
                    };
                    model.push((MODEL_GROUP.to_string(), slice.clone(), value.clone()));
                    let Some(param_state) = chunk_state.and_then(|s| s.params.get(&slice.id))
                    else {
                        continue;
                    };
                    manifest.steps.insert(slice.path.clone(), param_state.step);
                    for (name, data) in &param_state.tensors {
                        optim.push((format!("optimizer.{name}"), slice.clone(), data.clone()));
                    }
                }
                if let Some(s) = chunk_state {
                    manifest.optimizer_kind = Some(s.kind.clone());
                }
            }
            write_file(
                tmp,
                &format!("model_tp{t}_pp{p}.safetensors"),
                model,
                &mut manifest,
            )?;
            if optimizer.is_some() {
                let name = format!("optimizer_tp{t}_pp{p}.safetensors");
                write_file(tmp, &name, optim, &mut manifest)?;
            }
        }
        let file = tmp.join(format!("rank_{}.json", state.world().rank()));
        let json = serde_json::to_vec(&manifest)
            .map_err(|e| CheckpointError::file(&file, format!("cannot encode: {e}")))?;
        write_synced(&file, &json)?;
        Ok(())
    }

    /// Rank 0: merges the ranks' manifests into the metadata, renames the directory into
    /// place, points `latest` at it and removes old checkpoints.
    fn publish(
        &self,
        state: &ParallelState,
        config: &TransformerConfig,
        training: &TrainingState,
        tmp: &Path,
        final_dir: &Path,
    ) -> Result<()> {
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
        sync_dir(tmp);
        if final_dir.exists() {
            fs::remove_dir_all(final_dir)
                .map_err(|e| CheckpointError::io(final_dir, "replace it", e))?;
        }
        fs::rename(tmp, final_dir)
            .map_err(|e| CheckpointError::io(final_dir, "rename the finished save to it", e))?;
        sync_dir(&self.root);
        write_atomic(
            &self.root.join(LATEST_FILE),
            checkpoint_name(training.iteration).as_bytes(),
        )?;
        sync_dir(&self.root);
        keep_last(&self.root, self.keep_last)?;
        Ok(())
    }
}

/// Whether every rank of the world reports `ok`: an all-reduce of the failures, so that all
/// ranks take the same branch.
fn agree<B: DistBackend>(state: &ParallelState, ok: bool, dir: &Path) -> Result<()> {
    let flag = Tensor::<B, 1>::from_floats([if ok { 0.0 } else { 1.0 }], &Default::default());
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

/// Every float parameter's local value, by id.
fn param_values<B: Backend>(
    chunk: &GptModel<B>,
) -> std::collections::HashMap<burn::module::ParamId, TensorData> {
    use burn::module::{Module, ModuleVisitor, Param};
    struct Collect(std::collections::HashMap<burn::module::ParamId, TensorData>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.insert(param.id, param.val().into_data());
        }
    }
    let mut collect = Collect(Default::default());
    chunk.visit(&mut collect);
    collect.0
}

/// Writes `tensors` (group, slice, local data) to `dir/name`, each cut to its real region,
/// and records the file and its slices in `manifest`.
fn write_file(
    dir: &Path,
    name: &str,
    tensors: Vec<(String, LocalSlice, TensorData)>,
    manifest: &mut RankManifest,
) -> Result<()> {
    let path = dir.join(name);
    let mut blobs: Vec<(String, Blob)> = Vec::new();
    for (group, slice, data) in tensors {
        let Some(real) = slice.real() else { continue };
        let dtype = dtype_name(data.dtype).ok_or_else(|| {
            CheckpointError::file(
                &path,
                format!(
                    "{} has dtype {:?}, which checkpoints do not store",
                    slice.path, data.dtype
                ),
            )
        })?;
        let (_, st_dtype) = dtype_from_name(dtype).expect("a stored dtype");
        let elem = data.dtype.size();
        let bytes = cut(&data, &slice, &real, elem);
        let key = format!("{group}/{}", slice.path);
        let shape: Vec<usize> = real.iter().map(|r| r.len()).collect();
        manifest.entries.push(ManifestEntry {
            group,
            path: slice.path.clone(),
            shape: slice.global_shape.clone(),
            dtype: dtype.to_string(),
            partition_dim: slice.partition_dim,
            shard: ShardEntry {
                file: name.to_string(),
                key: key.clone(),
                offsets: real.iter().map(|r| r.start).collect(),
                shape: shape.clone(),
            },
        });
        blobs.push((
            key,
            Blob {
                dtype: st_dtype,
                shape,
                bytes,
            },
        ));
    }
    let bytes = safetensors::serialize(blobs.iter().map(|(k, b)| (k.as_str(), b)), None)
        .map_err(|e| CheckpointError::file(&path, format!("cannot encode safetensors: {e}")))?;
    write_synced(&path, &bytes)?;
    manifest.files.insert(
        name.to_string(),
        FileEntry {
            bytes: bytes.len() as u64,
            crc32: crc32(&bytes),
        },
    );
    Ok(())
}

/// The bytes of `real` (global coordinates) out of the local tensor `data`.
fn cut(data: &TensorData, slice: &LocalSlice, real: &Region, elem: usize) -> Vec<u8> {
    if *real == slice.held {
        return data.as_bytes().to_vec();
    }
    let mut out = vec![0u8; volume(real) * elem];
    let origin: Vec<usize> = slice.held.iter().map(|r| r.start).collect();
    let dst_origin: Vec<usize> = real.iter().map(|r| r.start).collect();
    let dst_shape: Vec<usize> = real.iter().map(|r| r.len()).collect();
    copy_region(
        real,
        elem,
        (data.as_bytes(), &slice.local_shape, &origin),
        (&mut out, &dst_shape, &dst_origin),
    );
    out
}
