//! Loading a checkpoint into any layout: each rank works out which slice of each tensor its
//! model chunk holds, reads the overlapping slices from whatever files hold them (checking
//! each file's size and checksum first), and assembles its own shard.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::directory::{crc32, latest_checkpoint};
use super::error::CheckpointError;
use super::metadata::{
    CheckpointMetadata, MODEL_GROUP, OptimizerLayout, TensorEntry, TrainingState,
};
use super::optimizer_state::{OptimizerState, ParamState};
use super::region::{copy_region, intersect, volume};
use super::slices::{LocalSlice, dtype_from_name, local_slices};
use crate::ModelBackend;
use crate::error::Result;
use crate::models::GptModel;
use crate::transformer::TransformerConfig;

/// A saved checkpoint opened for loading: its metadata, and the files read so far (each
/// checked against its checksum once).
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    metadata: CheckpointMetadata,
    files: RefCell<HashMap<String, std::rc::Rc<Vec<u8>>>>,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir` (reads and checks its metadata).
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        let metadata = CheckpointMetadata::read(&dir)?;
        Ok(Self {
            dir,
            metadata,
            files: RefCell::new(HashMap::new()),
        })
    }

    /// Opens the newest complete checkpoint under `root` (see
    /// [`latest_checkpoint`](super::latest_checkpoint)); an error when there is none.
    pub fn open_latest(root: &Path) -> Result<Self> {
        match latest_checkpoint(root)? {
            Some(dir) => Self::open(dir),
            None => Err(CheckpointError::NotFound {
                root: root.to_path_buf(),
                problem: "no directory iter_* with a metadata.json".to_string(),
            }
            .into()),
        }
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The checkpoint's metadata.
    pub fn metadata(&self) -> &CheckpointMetadata {
        &self.metadata
    }

    /// The training state saved with it.
    pub fn training_state(&self) -> &TrainingState {
        &self.metadata.training
    }

    /// Checks that `config` describes the same model as the saved one: every setting that
    /// shapes a parameter must agree (parallelism, recomputation, dropout and vocabulary
    /// padding may differ).
    pub fn check_config(&self, config: &TransformerConfig) -> Result<()> {
        let saved = &self.metadata.model_config;
        let fields: [(&str, String, String); 12] = [
            (
                "hidden_size",
                saved.hidden_size.to_string(),
                config.hidden_size.to_string(),
            ),
            (
                "num_layers",
                saved.num_layers.to_string(),
                config.num_layers.to_string(),
            ),
            (
                "num_attention_heads",
                saved.num_attention_heads.to_string(),
                config.num_attention_heads.to_string(),
            ),
            (
                "num_query_groups",
                saved.query_groups().to_string(),
                config.query_groups().to_string(),
            ),
            (
                "ffn_hidden_size",
                saved.ffn_hidden_size.to_string(),
                config.ffn_hidden_size.to_string(),
            ),
            (
                "vocab_size",
                saved.vocab_size.to_string(),
                config.vocab_size.to_string(),
            ),
            (
                "max_sequence_length",
                saved.max_sequence_length.to_string(),
                config.max_sequence_length.to_string(),
            ),
            (
                "normalization",
                format!("{:?}", saved.normalization),
                format!("{:?}", config.normalization),
            ),
            (
                "activation",
                format!("{:?}", saved.activation),
                format!("{:?}", config.activation),
            ),
            (
                "position_embedding",
                format!("{:?}", saved.position_embedding),
                format!("{:?}", config.position_embedding),
            ),
            (
                "add_bias_linear",
                saved.add_bias_linear.to_string(),
                config.add_bias_linear.to_string(),
            ),
            (
                "tie_embeddings",
                saved.tie_embeddings.to_string(),
                config.tie_embeddings.to_string(),
            ),
        ];
        for (name, saved, given) in fields {
            if saved != given {
                return Err(CheckpointError::mismatch(
                    &self.dir,
                    format!("saved with {name} = {saved}, the model has {name} = {given}"),
                )
                .into());
            }
        }
        Ok(())
    }

    /// `model` (one chunk of any layout, built from the saved configuration) with every
    /// parameter replaced by its slice of the saved one. Vocabulary padding rows are zero.
    pub fn load_model<B: ModelBackend>(&self, model: GptModel<B>) -> Result<GptModel<B>> {
        let tensors = self.metadata.model_tensors().ok_or_else(|| {
            CheckpointError::mismatch(&self.dir, "the checkpoint holds no model tensors")
        })?;
        let mut values = HashMap::new();
        for slice in local_slices(&model)? {
            let entry = self.entry(tensors, MODEL_GROUP, &slice)?;
            values.insert(slice.id, self.assemble(MODEL_GROUP, entry, &slice)?);
        }
        Ok(model.map(&mut Replace { values }))
    }

    /// The saved optimizer state of `model`'s parameters (one chunk of any layout), keyed by
    /// the chunk's parameter ids: give it to [`adamw_record`](super::adamw_record). An error
    /// when the checkpoint holds no optimizer state or its layout is not supported.
    pub fn load_optimizer_state<B: ModelBackend>(
        &self,
        model: &GptModel<B>,
    ) -> Result<OptimizerState> {
        let info = self.metadata.optimizer.as_ref().ok_or_else(|| {
            CheckpointError::mismatch(&self.dir, "the checkpoint holds no optimizer state")
        })?;
        if info.layout != OptimizerLayout::PerParameter {
            return Err(CheckpointError::mismatch(
                &self.dir,
                format!("optimizer layout {:?} cannot be loaded yet", info.layout),
            )
            .into());
        }
        let mut params = HashMap::new();
        for slice in local_slices(model)? {
            let Some(&step) = info.steps.get(&slice.path) else {
                continue;
            };
            let mut tensors = BTreeMap::new();
            for (group, entries) in &self.metadata.tensors {
                let Some(name) = group.strip_prefix("optimizer.") else {
                    continue;
                };
                let entry = self.entry(entries, group, &slice)?;
                tensors.insert(name.to_string(), self.assemble(group, entry, &slice)?);
            }
            params.insert(slice.id, ParamState { step, tensors });
        }
        Ok(OptimizerState {
            kind: info.kind.clone(),
            params,
        })
    }

    /// The entry of `slice`'s tensor in `group`, checked against the model's full shape.
    fn entry<'a>(
        &self,
        tensors: &'a BTreeMap<String, TensorEntry>,
        group: &str,
        slice: &LocalSlice,
    ) -> Result<&'a TensorEntry> {
        let entry = tensors.get(&slice.path).ok_or_else(|| {
            CheckpointError::mismatch(&self.dir, format!("{group} {} is missing", slice.path))
        })?;
        if entry.shape != slice.global_shape {
            return Err(CheckpointError::mismatch(
                &self.dir,
                format!(
                    "{group} {} has shape {:?} in the checkpoint, the model's is {:?}",
                    slice.path, entry.shape, slice.global_shape
                ),
            )
            .into());
        }
        Ok(entry)
    }

    /// This rank's local tensor of `slice` (padding zero), from the saved shards that
    /// overlap it.
    fn assemble(&self, group: &str, entry: &TensorEntry, slice: &LocalSlice) -> Result<TensorData> {
        let (dtype, st_dtype) = dtype_from_name(&entry.dtype).ok_or_else(|| {
            CheckpointError::mismatch(
                &self.dir,
                format!("{group} {}: unknown dtype {}", slice.path, entry.dtype),
            )
        })?;
        let elem = dtype.size();
        let mut out = vec![0u8; slice.local_shape.iter().product::<usize>() * elem];
        let need = slice.real();
        let mut covered = 0;
        if let Some(need) = &need {
            let dst_origin: Vec<usize> = slice.held.iter().map(|r| r.start).collect();
            for shard in &entry.shards {
                let have: Vec<_> = shard
                    .offsets
                    .iter()
                    .zip(&shard.shape)
                    .map(|(&o, &n)| o..o + n)
                    .collect();
                let Some(overlap) = intersect(need, &have) else {
                    continue;
                };
                let bytes = self.file(&shard.file)?;
                let file = self.dir.join(&shard.file);
                let tensors = safetensors::SafeTensors::deserialize(&bytes)
                    .map_err(|e| CheckpointError::file(&file, format!("not safetensors: {e}")))?;
                let view = tensors.tensor(&shard.key).map_err(|e| {
                    CheckpointError::file(&file, format!("no tensor {}: {e}", shard.key))
                })?;
                if view.dtype() != st_dtype || view.shape() != shard.shape.as_slice() {
                    return Err(CheckpointError::file(
                        &file,
                        format!(
                            "{} is {:?} {:?}, the metadata says {} {:?}",
                            shard.key,
                            view.dtype(),
                            view.shape(),
                            entry.dtype,
                            shard.shape
                        ),
                    )
                    .into());
                }
                copy_region(
                    &overlap,
                    elem,
                    (view.data(), &shard.shape, &shard.offsets),
                    (&mut out, &slice.local_shape, &dst_origin),
                );
                covered += volume(&overlap);
            }
            if covered != volume(need) {
                return Err(CheckpointError::mismatch(
                    &self.dir,
                    format!(
                        "{group} {}: the saved shards cover {covered} of the {} elements this \
                         rank needs (a shard is missing from the metadata)",
                        slice.path,
                        volume(need)
                    ),
                )
                .into());
            }
        }
        Ok(TensorData::from_bytes_vec(
            out,
            slice.local_shape.clone(),
            dtype,
        ))
    }

    /// The bytes of data file `name`, read once and checked against the metadata's size and
    /// checksum.
    fn file(&self, name: &str) -> Result<std::rc::Rc<Vec<u8>>> {
        if let Some(bytes) = self.files.borrow().get(name) {
            return Ok(bytes.clone());
        }
        let path = self.dir.join(name);
        let expected = self.metadata.files.get(name).ok_or_else(|| {
            CheckpointError::file(&path, "not listed in the metadata (no checksum to check)")
        })?;
        let bytes = std::fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CheckpointError::file(&path, "missing (a shard file of this checkpoint)")
            }
            _ => CheckpointError::io(&path, "read it", e),
        })?;
        if bytes.len() as u64 != expected.bytes {
            return Err(CheckpointError::file(
                &path,
                format!(
                    "truncated or extended: {} bytes, the metadata says {}",
                    bytes.len(),
                    expected.bytes
                ),
            )
            .into());
        }
        let crc = crc32(&bytes);
        if crc != expected.crc32 {
            return Err(CheckpointError::file(
                &path,
                format!(
                    "corrupt: CRC-32 {crc:08x}, the metadata says {:08x}",
                    expected.crc32
                ),
            )
            .into());
        }
        let bytes = std::rc::Rc::new(bytes);
        self.files
            .borrow_mut()
            .insert(name.to_string(), bytes.clone());
        Ok(bytes)
    }
}

/// Replaces parameters by id with new values (in each parameter's dtype and device, keeping
/// whether it requires a gradient).
pub(crate) struct Replace {
    values: HashMap<ParamId, TensorData>,
}

impl Replace {
    /// Replaces the parameters whose ids are keys of `values`.
    pub(crate) fn new(values: HashMap<ParamId, TensorData>) -> Self {
        Self { values }
    }
}

impl<B: Backend> ModuleMapper<B> for Replace {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(data) = self.values.remove(&param.id) else {
            return param;
        };
        param.map(|old| {
            let require_grad = old.is_require_grad();
            let data = data.convert_dtype(old.dtype());
            let new = Tensor::from_data(data, &old.device());
            if require_grad {
                new.require_grad()
            } else {
                new
            }
        })
    }
}
