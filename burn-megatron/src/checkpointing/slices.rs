//! Which slice of which tensor of the whole model a rank's model chunk holds: the bridge
//! between a chunk's parameters (local paths, padded local shapes) and the checkpoint's
//! tensors (paths in the whole model, full unpadded shapes).

use burn::module::ParamId;
use burn::tensor::DType;

use super::region::{Region, intersect};
use crate::ModelBackend;
use crate::error::Result;
use crate::models::GptModel;
use crate::tensor_parallel::try_param_infos;

/// One parameter of a chunk, placed in the whole model.
#[derive(Debug, Clone)]
pub(crate) struct LocalSlice {
    /// The parameter's id in this chunk.
    pub id: ParamId,
    /// Its path in the whole model (`block.layers.5.mlp.fc1.weight`).
    pub path: String,
    /// The full shape, without padding.
    pub global_shape: Vec<usize>,
    /// The TP-split dimension, `None` when replicated.
    pub partition_dim: Option<usize>,
    /// This rank's local (possibly padded) shape.
    pub local_shape: Vec<usize>,
    /// The box of the padded full tensor the local tensor covers.
    pub held: Region,
    /// Whether this rank writes the slice on save: TP rank 0 for replicated parameters, and
    /// never the last stage's copy of a tied embedding table (the first stage writes it).
    pub writes: bool,
    /// Whether it is a routed expert's weight, this rank's experts along dimension 0: written
    /// by expert-DP rank 0 of each EP rank instead of DP rank 0.
    pub expert: bool,
}

impl LocalSlice {
    /// The part of `held` inside the full tensor (padding left out), `None` when the rank
    /// holds padding only.
    pub fn real(&self) -> Option<Region> {
        let full: Region = self.global_shape.iter().map(|&n| 0..n).collect();
        intersect(&self.held, &full)
    }
}

/// Every float parameter of `chunk`, placed in the whole model.
pub(crate) fn local_slices<B: ModelBackend>(chunk: &GptModel<B>) -> Result<Vec<LocalSlice>> {
    let tied_copy = chunk.ties_embeddings() && !chunk.stage().is_first();
    let tp_rank = chunk.tp().rank();
    let infos = try_param_infos(chunk)?;
    Ok(infos
        .into_iter()
        .map(|info| {
            let copy = tied_copy && info.path == "output.weight";
            let path = chunk.global_path(&info.path);
            let placement = info.placement;
            let held = info
                .shape
                .iter()
                .enumerate()
                .map(|(d, &n)| match placement.expert {
                    Some(e) if d == 0 => e.rank * n..(e.rank + 1) * n,
                    _ if placement.dim() == Some(d) => placement.local_range(n),
                    _ => 0..n,
                })
                .collect();
            LocalSlice {
                id: info.id,
                global_shape: info.global_shape(),
                partition_dim: placement.dim().or(placement.expert.map(|_| 0)),
                local_shape: info.shape,
                held,
                writes: !copy && (placement.dim().is_some() || tp_rank == 0),
                expert: placement.is_expert(),
                path,
            }
        })
        .collect())
}

/// safetensors' name of a Burn float dtype, `None` for dtypes checkpoints do not store.
pub(crate) fn dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F64 => "F64",
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        _ => return None,
    })
}

/// The Burn dtype and safetensors dtype of a stored dtype name.
pub(crate) fn dtype_from_name(name: &str) -> Option<(DType, safetensors::Dtype)> {
    Some(match name {
        "F64" => (DType::F64, safetensors::Dtype::F64),
        "F32" => (DType::F32, safetensors::Dtype::F32),
        "F16" => (DType::F16, safetensors::Dtype::F16),
        "BF16" => (DType::BF16, safetensors::Dtype::BF16),
        _ => return None,
    })
}
