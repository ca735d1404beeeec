//! Loading a checkpoint into any layout: each rank works out which slice of each tensor its
//! model chunk holds, reads the overlapping slices from whatever files hold them, and
//! assembles its own shard. Files are memory-mapped and checked block by block as they are
//! read (`tensor_file.rs`): a rank reads only the parts of the files that hold its slices.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Bytes, Tensor, TensorData};

use super::directory::latest_checkpoint;
use super::metadata::{
    CheckpointMetadata, FP8_GROUP, FP8_OPERANDS, MODEL_GROUP, OptimizerLayout, TensorEntry,
    TrainingState,
};
use super::region::{
    Region, copy_region, flat_range_boxes, flat_start, intersect, source_runs, volume,
};
use super::slices::{LocalSlice, dtype_from_name, local_slices};
use super::tensor_file::MappedFile;
use crate::ModelBackend;
use crate::error::CheckpointError;
use crate::error::Result;
use crate::models::GptModel;
use crate::ops::HostTransferOps;
use crate::ops::fp8::{DelayedData, Fp8Recipe};
use crate::optimizer::state::{OptimizerState, ParamState};
use crate::transformer::TransformerConfig;

/// A saved checkpoint opened for loading: its metadata, and the data files mapped so far
/// (each block checked against its checksum the first time it is read).
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    metadata: CheckpointMetadata,
    files: Mutex<HashMap<String, Arc<MappedFile>>>,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir` (reads and checks its metadata).
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        let metadata = CheckpointMetadata::read(&dir)?;
        Ok(Self {
            dir,
            metadata,
            files: Mutex::new(HashMap::new()),
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
        let fields: [(&str, String, String); 14] = [
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
            (
                "head dimension (kv_channels)",
                saved.head_dim().to_string(),
                config.head_dim().to_string(),
            ),
            (
                "qk_layernorm",
                saved.qk_layernorm.to_string(),
                config.qk_layernorm.to_string(),
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
    /// Its FP8 layers under delayed scaling start from the saved amax histories and scales
    /// where the checkpoint has them ([`FP8_GROUP`]; a layer it has none for starts afresh).
    pub fn load_model<B: ModelBackend>(&self, model: GptModel<B>) -> Result<GptModel<B>> {
        let values = self.model_values(&model)?;
        self.restore_fp8_states(&model)?;
        Ok(model.map(&mut Replace { values }))
    }

    /// Gives `model`'s delayed-scaling FP8 layers the states saved for them.
    pub(crate) fn restore_fp8_states<B: ModelBackend>(&self, model: &GptModel<B>) -> Result<()> {
        let Some(saved) = self.metadata.tensors.get(FP8_GROUP) else {
            return Ok(());
        };
        for (path, fp8) in model.fp8_layers() {
            if fp8.config().recipe != Fp8Recipe::Delayed
                || !saved.contains_key(&format!("{path}.input.scale"))
            {
                continue;
            }
            let read = |operand: &str, name: &str| -> Result<Vec<f32>> {
                let data = self.read_full(FP8_GROUP, &format!("{path}.{operand}.{name}"))?;
                Ok(data.iter::<f32>().collect())
            };
            let mut states = Vec::with_capacity(FP8_OPERANDS.len());
            for operand in FP8_OPERANDS {
                let scale = read(operand, "scale")?;
                let [scale] = scale[..] else {
                    return Err(CheckpointError::mismatch(
                        &self.dir,
                        format!(
                            "{FP8_GROUP} {path}.{operand}.scale has {} values, not 1",
                            scale.len()
                        ),
                    )
                    .into());
                };
                states.push(DelayedData {
                    amax_history: read(operand, "amax_history")?,
                    scale,
                });
            }
            let states: [DelayedData; 3] = states
                .try_into()
                .expect("one state per operand of FP8_OPERANDS");
            fp8.restore_delayed(states);
        }
        Ok(())
    }

    /// The saved values of `model`'s parameters (one chunk of any layout), in the saved
    /// dtype, by the chunk's parameter ids.
    pub(crate) fn model_values<B: ModelBackend>(
        &self,
        model: &GptModel<B>,
    ) -> Result<HashMap<ParamId, TensorData>> {
        let tensors = self.metadata.model_tensors().ok_or_else(|| {
            CheckpointError::mismatch(&self.dir, "the checkpoint holds no model tensors")
        })?;
        let slices = local_slices(model)?;
        let entries = slices
            .iter()
            .map(|slice| self.entry(tensors, MODEL_GROUP, slice))
            .collect::<Result<Vec<_>>>()?;
        let device = model.devices().into_iter().next();
        let mut values = HashMap::new();
        for (slice, entry) in slices.iter().zip(entries) {
            let buffer = |len| match &device {
                Some(device) => B::host_buffer(device, len),
                None => Bytes::from_bytes_vec(vec![0; len]),
            };
            values.insert(slice.id, self.assemble(MODEL_GROUP, entry, slice, buffer)?);
        }
        Ok(values)
    }

    /// The saved optimizer state of `model`'s parameters (one chunk of any layout), keyed by
    /// the chunk's parameter ids: give it to [`adamw_record`](super::adamw_record). An error
    /// when the checkpoint holds no optimizer state.
    pub fn load_optimizer_state<B: ModelBackend>(
        &self,
        model: &GptModel<B>,
    ) -> Result<OptimizerState> {
        self.optimizer_state(model, None)
    }

    /// The saved optimizer state of the elements `ranges[id]` (row-major, of the chunk's local
    /// tensor) of each parameter in `ranges`: a distributed optimizer's shard, at any DP size
    /// (see [`load_distributed_adamw`](super::load_distributed_adamw)). Each state tensor is
    /// `[range.len()]`; vocabulary padding is zero.
    pub fn load_optimizer_shard<B: ModelBackend>(
        &self,
        model: &GptModel<B>,
        ranges: &HashMap<ParamId, Range<usize>>,
    ) -> Result<OptimizerState> {
        self.optimizer_state(model, Some(ranges))
    }

    fn optimizer_state<B: ModelBackend>(
        &self,
        model: &GptModel<B>,
        ranges: Option<&HashMap<ParamId, Range<usize>>>,
    ) -> Result<OptimizerState> {
        let info = self.metadata.optimizer.as_ref().ok_or_else(|| {
            CheckpointError::mismatch(&self.dir, "the checkpoint holds no optimizer state")
        })?;
        let OptimizerLayout::PerParameter = info.layout;
        let mut params = HashMap::new();
        for slice in local_slices(model)? {
            let Some(&step) = info.steps.get(&slice.path) else {
                continue;
            };
            let range = match ranges {
                None => None,
                Some(ranges) => match ranges.get(&slice.id) {
                    Some(range) => Some(range.clone()),
                    None => continue,
                },
            };
            let mut tensors = BTreeMap::new();
            for (group, entries) in &self.metadata.tensors {
                let Some(name) = group.strip_prefix("optimizer.") else {
                    continue;
                };
                let entry = self.entry(entries, group, &slice)?;
                let data = match &range {
                    None => self.assemble(group, entry, &slice, |len| {
                        Bytes::from_bytes_vec(vec![0; len])
                    })?,
                    Some(range) => self.assemble_range(group, entry, &slice, range.clone())?,
                };
                tensors.insert(name.to_string(), data);
            }
            params.insert(
                slice.id,
                ParamState {
                    step,
                    tensors,
                    range,
                },
            );
        }
        Ok(OptimizerState {
            kind: info.kind.clone(),
            params,
            dp_sharded: ranges.is_some(),
        })
    }

    /// The full (unpadded) tensor `path` of `group` (`"model"`, `"optimizer.exp_avg"`, ...),
    /// assembled from its saved slices: for tools and exports, which need no model.
    pub fn read_full(&self, group: &str, path: &str) -> Result<TensorData> {
        let entry = self
            .metadata
            .tensors
            .get(group)
            .and_then(|t| t.get(path))
            .ok_or_else(|| {
                CheckpointError::mismatch(&self.dir, format!("{group} {path} is missing"))
            })?;
        let (dtype, _) = self.dtype(group, path, entry)?;
        let full: Region = entry.shape.iter().map(|&n| 0..n).collect();
        let origin = vec![0; full.len()];
        let mut out = vec![0u8; volume(&full) * dtype.size()];
        self.read_region(group, path, entry, &full, (&mut out, &entry.shape, &origin))?;
        Ok(TensorData::from_bytes_vec(out, entry.shape.clone(), dtype))
    }

    /// Bytes of data files checked against their checksums so far, which is what was read of
    /// them: a rank that needs only some slices reads only the blocks holding them.
    pub fn bytes_checked(&self) -> u64 {
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files.values().map(|f| f.checked_bytes()).sum()
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
    ///
    /// A large tensor is read by several threads, each a band of its rows: the band's bytes
    /// are contiguous in the local tensor, so the threads write disjoint parts of it.
    ///
    /// `buffer(len)` gives the host buffer to read into (a page-locked one on our CUDA
    /// backend, see [`HostTransferOps::host_buffer`]); what the saved shards do not cover (the
    /// padding) is zeroed.
    fn assemble(
        &self,
        group: &str,
        entry: &TensorEntry,
        slice: &LocalSlice,
        buffer: impl FnOnce(usize) -> Bytes,
    ) -> Result<TensorData> {
        let (dtype, _) = self.dtype(group, &slice.path, entry)?;
        let mut out = buffer(slice.local_shape.iter().product::<usize>() * dtype.size());
        if slice.real().as_ref() != Some(&slice.held) {
            out.fill(0);
        }
        let Some(need) = slice.real() else {
            return Ok(TensorData::from_bytes(
                out,
                slice.local_shape.clone(),
                dtype,
            ));
        };
        let origin: Vec<usize> = slice.held.iter().map(|r| r.start).collect();
        let threads = read_threads(out.len());
        if threads == 1 || need.is_empty() || need[1..] != slice.held[1..] {
            let dst = (&mut out[..], &slice.local_shape[..], &origin[..]);
            self.read_region(group, &slice.path, entry, &need, dst)?;
        } else {
            let row = slice.local_shape[1..].iter().product::<usize>() * dtype.size();
            let rows = need[0].clone();
            let per = rows.len().div_ceil(threads);
            let first = (rows.start - origin[0]) * row;
            let body = &mut out[first..first + rows.len() * row];
            std::thread::scope(|scope| {
                let bands: Vec<_> = body
                    .chunks_mut(per * row)
                    .enumerate()
                    .map(|(i, dst)| {
                        let start = rows.start + i * per;
                        let mut band = need.clone();
                        band[0] = start..start + dst.len() / row;
                        let mut shape = slice.local_shape.clone();
                        shape[0] = band[0].len();
                        let mut band_origin = origin.clone();
                        band_origin[0] = start;
                        scope.spawn(move || {
                            let dst = (dst, &shape[..], &band_origin[..]);
                            self.read_region(group, &slice.path, entry, &band, dst)
                        })
                    })
                    .collect();
                bands
                    .into_iter()
                    .map(|band| band.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect::<Result<Vec<()>>>()
            })?;
        }
        Ok(TensorData::from_bytes(
            out,
            slice.local_shape.clone(),
            dtype,
        ))
    }

    /// The elements `range` (row-major) of this rank's local tensor of `slice` (padding zero),
    /// `[range.len()]`.
    fn assemble_range(
        &self,
        group: &str,
        entry: &TensorEntry,
        slice: &LocalSlice,
        range: Range<usize>,
    ) -> Result<TensorData> {
        let (dtype, _) = self.dtype(group, &slice.path, entry)?;
        let elem = dtype.size();
        let full: Region = slice.global_shape.iter().map(|&n| 0..n).collect();
        let mut out = vec![0u8; range.len() * elem];
        for local in flat_range_boxes(&slice.local_shape, range.clone()) {
            let first = flat_start(&slice.local_shape, &local) - range.start;
            let dst = &mut out[first * elem..(first + volume(&local)) * elem];
            let global: Region = local
                .iter()
                .zip(&slice.held)
                .map(|(r, h)| r.start + h.start..r.end + h.start)
                .collect();
            let Some(need) = intersect(&global, &full) else {
                continue;
            };
            let shape: Vec<usize> = global.iter().map(|r| r.len()).collect();
            let origin: Vec<usize> = global.iter().map(|r| r.start).collect();
            self.read_region(group, &slice.path, entry, &need, (dst, &shape, &origin))?;
        }
        Ok(TensorData::from_bytes_vec(out, [range.len()], dtype))
    }

    /// The Burn and safetensors dtypes of a saved tensor.
    fn dtype(
        &self,
        group: &str,
        path: &str,
        entry: &TensorEntry,
    ) -> Result<(burn::tensor::DType, safetensors::Dtype)> {
        Ok(dtype_from_name(&entry.dtype).ok_or_else(|| {
            CheckpointError::mismatch(
                &self.dir,
                format!("{group} {path}: unknown dtype {}", entry.dtype),
            )
        })?)
    }

    /// Copies the box `need` (global coordinates, inside the tensor) of a saved tensor into
    /// `dst` (its shape and the global index of its first element) from the saved shards that
    /// overlap it, checking the blocks it reads; an error unless the shards cover `need`.
    fn read_region(
        &self,
        group: &str,
        path: &str,
        entry: &TensorEntry,
        need: &Region,
        (dst, dst_shape, dst_origin): (&mut [u8], &[usize], &[usize]),
    ) -> Result<()> {
        let (dtype, st_dtype) = self.dtype(group, path, entry)?;
        let elem = dtype.size();
        let mut covered = 0;
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
            let file = self.file(&shard.file)?;
            let (info, data, start) = file.tensor(&shard.key)?;
            if info.dtype != st_dtype || info.shape != shard.shape {
                return Err(CheckpointError::file(
                    file.path(),
                    format!(
                        "{} is {:?} {:?}, the metadata says {} {:?}",
                        shard.key, info.dtype, info.shape, entry.dtype, shard.shape
                    ),
                )
                .into());
            }
            // Check the blocks the copy reads, consecutive runs merged into one span.
            let mut spans: Vec<Range<usize>> = Vec::new();
            source_runs(
                &overlap,
                elem,
                &shard.shape,
                &shard.offsets,
                |run| match spans.last_mut() {
                    Some(last) if last.end == run.start => last.end = run.end,
                    _ => spans.push(run),
                },
            );
            for span in spans {
                file.check(start + span.start..start + span.end)?;
            }
            copy_region(
                &overlap,
                elem,
                (data, &shard.shape, &shard.offsets),
                (dst, dst_shape, dst_origin),
            );
            covered += volume(&overlap);
        }
        if covered != volume(need) {
            return Err(CheckpointError::mismatch(
                &self.dir,
                format!(
                    "{group} {path}: the saved shards cover {covered} of the {} elements this \
                     rank needs (a shard is missing from the metadata)",
                    volume(need)
                ),
            )
            .into());
        }
        Ok(())
    }

    /// Data file `name`, mapped once, its size checked against the metadata.
    fn file(&self, name: &str) -> Result<Arc<MappedFile>> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(file) = files.get(name) {
            return Ok(file.clone());
        }
        let path = self.dir.join(name);
        let expected = self.metadata.files.get(name).ok_or_else(|| {
            CheckpointError::file(&path, "not listed in the metadata (no checksum to check)")
        })?;
        let file = Arc::new(MappedFile::open(&path, expected)?);
        files.insert(name.to_string(), file.clone());
        Ok(file)
    }
}

/// Threads to read `bytes` with: one per 4 MiB, at most one per core and 16. Reading a
/// checkpoint is checksums, page faults and copies, which one thread does at a fraction of the
/// memory's speed.
fn read_threads(bytes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(16).min(bytes / (4 << 20)).max(1)
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

impl<B: HostTransferOps> ModuleMapper<B> for Replace {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(data) = self.values.remove(&param.id) else {
            return param;
        };
        param.map(|old| {
            let require_grad = old.is_require_grad();
            let new = B::upload(data, &old.device(), old.dtype());
            if require_grad {
                new.require_grad()
            } else {
                new
            }
        })
    }
}
