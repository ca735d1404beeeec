//! One rank's part of a save, copied to the host, and the writing of it.
//!
//! Taking the snapshot is the only part of a save that touches the model: once it is taken,
//! training may change the parameters while the files are written (in the background, for an
//! asynchronous save). Writing produces the rank's safetensors files and a manifest
//! (`rank_{r}.json`: the files' checksums and the slices they hold) that rank 0 merges into
//! the metadata.
//!
//! Files: `model_tp{t}_pp{p}.safetensors` per model-parallel rank (DP rank 0 only: the
//! data-parallel replicas are equal), and `optimizer_tp{t}_pp{p}.safetensors` with the
//! optimizer state sliced the same way; a distributed optimizer's state is written by every
//! DP rank (`optimizer_tp{t}_pp{p}_dp{d}.safetensors`), each holding its shard, and under
//! context parallelism by every DP × CP rank (`optimizer_tp{t}_pp{p}_dp{d}_cp{c}.safetensors`:
//! the state is sharded over both). A replicated
//! parameter is written by TP rank 0; vocabulary padding is never written. Routed experts go
//! to files of their EP rank (`model_tp{t}_pp{p}_ep{e}.safetensors`, the optimizer's
//! `optimizer_tp{t}_pp{p}_ep{e}[_edp{x}].safetensors`), written by expert-DP rank 0 (or, for
//! a sharded optimizer, every expert-DP rank), each tensor keyed by its full shape over all
//! experts, so that a checkpoint loads at any EP size.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::module::ParamId;
use burn::tensor::TensorData;
use burn_megatron_dist::ParallelState;
use serde::{Deserialize, Serialize};

use super::directory::write_synced;
use super::metadata::{FP8_GROUP, FP8_OPERANDS, FileEntry, MODEL_GROUP, ShardEntry};
use super::region::{Region, copy_region, flat_range_boxes, flat_start, intersect, volume};
use super::slices::{LocalSlice, dtype_from_name, dtype_name, local_slices};
use super::tensor_file::{Blob, BlobBytes, write_tensor_file};
use crate::ModelBackend;
use crate::error::Result;
use crate::error::{CheckpointError, DeviceError, read_params};
use crate::models::GptModel;
use crate::optimizer::state::OptimizerState;

/// What one rank wrote: its files and the slices in them. Rank 0 merges these into the
/// metadata.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct RankManifest {
    pub files: BTreeMap<String, FileEntry>,
    pub entries: Vec<ManifestEntry>,
    pub optimizer_kind: Option<String>,
    pub dp_sharded: bool,
    pub steps: BTreeMap<String, u64>,
}

/// One slice of one tensor, as a rank wrote it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ManifestEntry {
    pub group: String,
    pub path: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub partition_dim: Option<usize>,
    pub shard: ShardEntry,
}

/// One rank's files, on the host, ready to write.
pub(crate) struct RankSnapshot {
    rank: usize,
    files: Vec<(String, Vec<(String, Blob)>)>,
    manifest: RankManifest,
}

/// One slice of a tensor to store: its group, its place in the whole model, and the bytes of
/// the box `stored` (global coordinates).
struct Piece {
    group: String,
    slice: LocalSlice,
    stored: Region,
    key: String,
    bytes: BlobBytes,
    dtype: burn::tensor::DType,
}

impl RankSnapshot {
    /// Copies what this rank writes to the host: its slices of `chunks`' parameters (DP rank
    /// 0) and of their optimizer state (`optimizer[i]` for `chunks[i]`). `values[i]`, when
    /// given, replaces `chunks[i]`'s parameter values (a conversion writes a checkpoint's
    /// values, in their dtype, in the layout of `chunks`). A parameter that cannot be read
    /// (a device error) is a [`DeviceError`](crate::error::DeviceError) naming it and
    /// `iteration`, the checkpoint's.
    pub fn take<B: ModelBackend>(
        state: &ParallelState,
        chunks: &[GptModel<B>],
        values: Option<Vec<HashMap<ParamId, TensorData>>>,
        optimizer: Option<&[OptimizerState]>,
        iteration: u64,
    ) -> Result<Self> {
        let (t, p, d) = (state.tp().rank(), state.pp_rank(), state.dp().rank());
        let dp_sharded = optimizer.is_some_and(|o| o.iter().any(|s| s.dp_sharded));
        let mut manifest = RankManifest {
            dp_sharded,
            ..Default::default()
        };
        let (mut model, mut optim) = (Vec::new(), Vec::new());
        // The ranks of a CP group hold the same parameters (the gradients are summed over CP):
        // CP rank 0 writes them. The distributed optimizer shards its state over DP × CP:
        // every rank writes its shard.
        let cp_first = state.coords().cp == 0;
        let writes_model = d == 0 && cp_first;
        let writes_optimizer = optimizer.is_some() && ((d == 0 && cp_first) || dp_sharded);
        // Routed experts differ between the ranks of an EP group: expert-DP rank 0 of each
        // writes its experts (every expert-DP rank its shard of their optimizer state).
        let (e, edp) = (state.coords().ep, state.coords().expert_dp);
        let writes_experts = edp == 0;
        let writes_expert_optimizer = optimizer.is_some() && (edp == 0 || dp_sharded);
        let (mut expert_model, mut expert_optim) = (Vec::new(), Vec::new());
        let mut given = values.map(Vec::into_iter);
        for (i, chunk) in chunks.iter().enumerate() {
            let chunk_state = optimizer.and_then(|o| o.get(i));
            if let Some(s) = chunk_state {
                manifest.optimizer_kind = Some(s.kind.clone());
            }
            let mut values = match given.as_mut().and_then(Iterator::next) {
                Some(values) => values,
                None if writes_model || writes_experts => {
                    param_values(chunk, iteration).map_err(|e| e.on_rank(state.world().rank()))?
                }
                None => Default::default(),
            };
            // The FP8 layers' delayed-scaling states: equal on the ranks of a TP group (the
            // amaxes of split operands are reduced over it), so TP rank 0 writes them.
            if writes_model && t == 0 {
                model.extend(fp8_pieces(chunk).map_err(|e| e.on_rank(state.world().rank()))?);
            }
            for slice in local_slices(chunk)?.into_iter().filter(|s| s.writes) {
                let (writes_model, writes_optimizer, model, optim) = match slice.expert {
                    true => (
                        writes_experts,
                        writes_expert_optimizer,
                        &mut expert_model,
                        &mut expert_optim,
                    ),
                    false => (writes_model, writes_optimizer, &mut model, &mut optim),
                };
                if let Some(value) = values.remove(&slice.id).filter(|_| writes_model) {
                    model.extend(whole(MODEL_GROUP, &slice, value));
                }
                let Some(param_state) = chunk_state.and_then(|s| s.params.get(&slice.id)) else {
                    continue;
                };
                if !writes_optimizer {
                    continue;
                }
                manifest.steps.insert(slice.path.clone(), param_state.step);
                for (name, data) in &param_state.tensors {
                    let group = format!("optimizer.{name}");
                    match &param_state.range {
                        None => optim.extend(whole(&group, &slice, data.clone())),
                        Some(range) => optim.extend(ranged(&group, &slice, data, range.clone())),
                    }
                }
            }
        }
        let mut files = Vec::new();
        if writes_model {
            files.push((format!("model_tp{t}_pp{p}.safetensors"), model));
        }
        if writes_optimizer {
            let c = state.coords().cp;
            let name = match (dp_sharded, state.cp().size()) {
                (true, 1) => format!("optimizer_tp{t}_pp{p}_dp{d}.safetensors"),
                (true, _) => format!("optimizer_tp{t}_pp{p}_dp{d}_cp{c}.safetensors"),
                (false, _) => format!("optimizer_tp{t}_pp{p}.safetensors"),
            };
            files.push((name, optim));
        }
        if !expert_model.is_empty() {
            files.push((format!("model_tp{t}_pp{p}_ep{e}.safetensors"), expert_model));
        }
        if !expert_optim.is_empty() {
            let name = match dp_sharded {
                true => format!("optimizer_tp{t}_pp{p}_ep{e}_edp{edp}.safetensors"),
                false => format!("optimizer_tp{t}_pp{p}_ep{e}.safetensors"),
            };
            files.push((name, expert_optim));
        }
        let mut blobs = Vec::new();
        for (name, pieces) in files {
            let mut tensors = Vec::new();
            for piece in pieces {
                tensors.push(piece.into_blob(&name, &mut manifest)?);
            }
            blobs.push((name, tensors));
        }
        Ok(Self {
            rank: state.world().rank(),
            files: blobs,
            manifest,
        })
    }

    /// Writes the files and the manifest into `dir`, each file synced, with block checksums
    /// of `block_bytes`. Needs nothing but the snapshot: it may run on another thread.
    pub fn write(mut self, dir: &Path, block_bytes: usize) -> Result<()> {
        for (name, tensors) in self.files {
            let entry = write_tensor_file(&dir.join(&name), tensors, block_bytes)?;
            self.manifest.files.insert(name, entry);
        }
        let file = dir.join(format!("rank_{}.json", self.rank));
        let json = serde_json::to_vec(&self.manifest)
            .map_err(|e| CheckpointError::file(&file, format!("cannot encode: {e}")))?;
        write_synced(&file, &json)?;
        Ok(())
    }
}

impl Piece {
    /// The piece as a blob of file `file`, its slice recorded in `manifest`.
    fn into_blob(self, file: &str, manifest: &mut RankManifest) -> Result<(String, Blob)> {
        let path = Path::new(file);
        let dtype = dtype_name(self.dtype).ok_or_else(|| {
            CheckpointError::file(
                path,
                format!(
                    "{} {} has dtype {:?}, which checkpoints do not store",
                    self.group, self.slice.path, self.dtype
                ),
            )
        })?;
        let (_, st_dtype) = dtype_from_name(dtype).expect("a stored dtype");
        let shape: Vec<usize> = self.stored.iter().map(|r| r.len()).collect();
        manifest.entries.push(ManifestEntry {
            group: self.group,
            path: self.slice.path.clone(),
            shape: self.slice.global_shape.clone(),
            dtype: dtype.to_string(),
            partition_dim: self.slice.partition_dim,
            shard: ShardEntry {
                file: file.to_string(),
                key: self.key.clone(),
                offsets: self.stored.iter().map(|r| r.start).collect(),
                shape: shape.clone(),
            },
        });
        let blob = Blob {
            dtype: st_dtype,
            shape,
            bytes: self.bytes,
        };
        Ok((self.key, blob))
    }
}

/// The pieces of `chunk`'s FP8 delayed-scaling states ([`FP8_GROUP`]): per layer and
/// operand its amax history and scale, whole.
fn fp8_pieces<B: ModelBackend>(
    chunk: &GptModel<B>,
) -> core::result::Result<Vec<Piece>, DeviceError> {
    let mut pieces = Vec::new();
    for (path, fp8) in chunk.fp8_layers() {
        let Some(states) = fp8.delayed_data()? else {
            continue;
        };
        for (operand, state) in FP8_OPERANDS.iter().zip(states) {
            let tensors = [
                ("amax_history", state.amax_history),
                ("scale", vec![state.scale]),
            ];
            for (name, values) in tensors {
                let len = values.len();
                let slice = LocalSlice {
                    id: ParamId::new(),
                    path: format!("{path}.{operand}.{name}"),
                    global_shape: vec![len],
                    partition_dim: None,
                    local_shape: vec![len],
                    held: std::iter::once(0..len).collect(),
                    writes: true,
                    expert: false,
                };
                let data = TensorData::new(values, [len]);
                pieces.extend(whole(FP8_GROUP, &slice, data));
            }
        }
    }
    Ok(pieces)
}

/// The piece of a whole local tensor `data` of `slice`: its real (unpadded) part, `None` when
/// the rank holds padding only.
fn whole(group: &str, slice: &LocalSlice, data: TensorData) -> Option<Piece> {
    let real = slice.real()?;
    let dtype = data.dtype;
    let bytes = if real == slice.held {
        BlobBytes::Data(data)
    } else if real[1..] == slice.held[1..] {
        // Padding rows only (the vocabulary's): the real rows are a prefix of the bytes.
        let row = slice.local_shape[1..].iter().product::<usize>() * dtype.size();
        let start = (real[0].start - slice.held[0].start) * row;
        BlobBytes::Range(data, start..start + real[0].len() * row)
    } else {
        let origin: Vec<usize> = slice.held.iter().map(|r| r.start).collect();
        BlobBytes::Owned(cut(
            data.as_bytes(),
            (&slice.local_shape, &origin),
            &real,
            dtype.size(),
        ))
    };
    Some(Piece {
        group: group.to_string(),
        key: format!("{group}/{}", slice.path),
        slice: slice.clone(),
        stored: real,
        bytes,
        dtype,
    })
}

/// The pieces of `data`, the elements `range` (row-major) of the local tensor of `slice`: one
/// per contiguous box of the range, padding left out.
fn ranged(
    group: &str,
    slice: &LocalSlice,
    data: &TensorData,
    range: std::ops::Range<usize>,
) -> Vec<Piece> {
    let elem = data.dtype.size();
    let full: Region = slice.global_shape.iter().map(|&n| 0..n).collect();
    let mut pieces = Vec::new();
    for local in flat_range_boxes(&slice.local_shape, range.clone()) {
        let first = flat_start(&slice.local_shape, &local) - range.start;
        let bytes = &data.as_bytes()[first * elem..(first + volume(&local)) * elem];
        let global: Region = local
            .iter()
            .zip(&slice.held)
            .map(|(r, h)| r.start + h.start..r.end + h.start)
            .collect();
        let Some(stored) = intersect(&global, &full) else {
            continue;
        };
        let shape: Vec<usize> = global.iter().map(|r| r.len()).collect();
        let origin: Vec<usize> = global.iter().map(|r| r.start).collect();
        let offsets: Vec<String> = stored.iter().map(|r| r.start.to_string()).collect();
        pieces.push(Piece {
            group: group.to_string(),
            key: format!("{group}/{}@{}", slice.path, offsets.join(",")),
            slice: slice.clone(),
            bytes: BlobBytes::Owned(cut(bytes, (&shape, &origin), &stored, elem)),
            stored,
            dtype: data.dtype,
        });
    }
    pieces
}

/// The bytes of box `region` (global coordinates) out of `src` (its shape, and the global
/// index of its first element).
fn cut(src: &[u8], (shape, origin): (&[usize], &[usize]), region: &Region, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; volume(region) * elem];
    let dst_origin: Vec<usize> = region.iter().map(|r| r.start).collect();
    let dst_shape: Vec<usize> = region.iter().map(|r| r.len()).collect();
    copy_region(
        region,
        elem,
        (src, shape, origin),
        (&mut out, &dst_shape, &dst_origin),
    );
    out
}

/// Every float parameter's local value, by id (the host copy); a device error names the
/// parameter by its path in the whole model.
pub(crate) fn param_values<B: ModelBackend>(
    chunk: &GptModel<B>,
    iteration: u64,
) -> core::result::Result<HashMap<ParamId, TensorData>, DeviceError> {
    let purpose = format!("for the checkpoint at iteration {iteration}");
    let values = read_params(chunk, |path| chunk.global_path(path), &purpose)?;
    Ok(values.into_iter().collect())
}
