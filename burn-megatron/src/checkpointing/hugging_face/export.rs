//! Exporting a model to a transformers checkpoint directory: `config.json` and
//! `model.safetensors` with transformers' names and layouts, the vocabulary unpadded.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};

use super::HF_WEIGHTS_FILE;
use super::config::HfConfig;
use super::layout::{Dense, QkvSource, Recipe, qkv_order, recipe};
use crate::ModelBackend;
use crate::checkpointing::CheckpointError;
use crate::checkpointing::directory::{publish_file, temp_file, write_atomic};
use crate::checkpointing::slices::local_slices;
use crate::error::Result;
use crate::models::GptModel;
use crate::tensor_parallel::gather_full_params;
use crate::transformer::TransformerConfig;

/// Writes `model` (a whole model of `config`, PP = 1, at any TP and EP) to `dir` as a
/// transformers checkpoint: `config.json` and `model.safetensors` (f32). Every rank of the TP
/// group and of the expert-parallel group must call it (the parameters are gathered over TP,
/// the routed experts over EP); TP rank 0 of EP rank 0 writes. An error when transformers has
/// no class of this architecture (see [`HfFamily::of`](super::HfFamily::of)).
pub fn export_model<B: ModelBackend>(
    model: &GptModel<B>,
    config: &TransformerConfig,
    dir: &Path,
) -> Result<()> {
    if model.stage().num_stages != 1 {
        return Err(CheckpointError::mismatch(
            dir,
            "a transformers export needs the whole model on each rank (PP = 1): load the \
             checkpoint at PP = 1 first",
        )
        .into());
    }
    let mut params = gather_full_params(model, model.tp())?;
    let mut ep_rank = 0;
    if let Some(ep) = model.expert_parallel_group().filter(|ep| ep.size() > 1) {
        ep_rank = ep.rank();
        let experts: HashSet<String> = local_slices(model)?
            .into_iter()
            .filter(|slice| slice.expert)
            .map(|slice| slice.path)
            .collect();
        let device = model.devices().into_iter().next().unwrap_or_default();
        for (path, data) in params.iter_mut().filter(|(path, _)| experts.contains(path)) {
            let local = Tensor::<B, 3>::from_data(data.clone(), &device);
            *data = ep
                .all_gather(local, 0)?
                .try_into_data()
                .map_err(|e| CheckpointError::mismatch(dir, format!("parameter {path}: {e}")))?;
        }
    }
    if model.tp().rank() == 0 && ep_rank == 0 {
        export_tensors(config, params.into_iter().collect(), dir)?;
    }
    Ok(())
}

/// Writes the full (unpadded) tensors of a whole model of `config`, keyed by our paths
/// (`block.layers.0.attention.qkv.weight`), to `dir` as a transformers checkpoint.
pub fn export_tensors(
    config: &TransformerConfig,
    params: BTreeMap<String, TensorData>,
    dir: &Path,
) -> Result<()> {
    let json = HfConfig::to_json(config).map_err(|problem| {
        CheckpointError::mismatch(dir, format!("cannot export to transformers: {problem}"))
    })?;
    let family = super::HfFamily::of(config).expect("to_json checked the family");
    let mut out: BTreeMap<String, Dense> = BTreeMap::new();
    for (path, data) in params {
        let dense = Dense {
            shape: data.shape.to_vec(),
            values: data
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| CheckpointError::mismatch(dir, format!("parameter {path}: {e:?}")))?,
        };
        let recipe = recipe(family, &path, config).ok_or_else(|| {
            CheckpointError::mismatch(
                dir,
                format!("our parameter {path} has no counterpart in a transformers {family:?}"),
            )
        })?;
        match recipe {
            Recipe::Copy(name) => {
                out.insert(name, dense);
            }
            Recipe::Transpose(name) => {
                out.insert(name, dense.transpose());
            }
            Recipe::Experts { per_expert, .. } => {
                let (rows, cols) = (dense.shape[1], dense.shape[2]);
                let matrices = dense.values.chunks(rows * cols);
                for (name, values) in per_expert.into_iter().zip(matrices) {
                    let matrix = Dense {
                        shape: vec![rows, cols],
                        values: values.to_vec(),
                    };
                    out.insert(name, matrix.transpose());
                }
            }
            Recipe::Qkv(source) => {
                let order = qkv_order(config);
                let mut inverse = vec![0; order.len()];
                for (ours, &theirs) in order.iter().enumerate() {
                    inverse[theirs] = ours;
                }
                let qkv = dense.columns(&inverse);
                match source {
                    QkvSource::Fused(name) => {
                        out.insert(name, qkv);
                    }
                    QkvSource::Split(names) => {
                        let head_dim = config.head_dim();
                        let kv = config.query_groups() * head_dim;
                        let widths = [config.num_attention_heads * head_dim, kv, kv];
                        for (name, part) in names.into_iter().zip(qkv.split_columns(&widths)) {
                            out.insert(name, part.transpose());
                        }
                    }
                }
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, "create it", e))?;
    let text = serde_json::to_string_pretty(&json).expect("a JSON value serialises");
    write_atomic(&dir.join("config.json"), text.as_bytes())?;
    let bytes: BTreeMap<String, (Vec<usize>, Vec<u8>)> = out
        .into_iter()
        .map(|(name, d)| {
            let b = d.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name, (d.shape, b))
        })
        .collect();
    let views = bytes.iter().map(|(name, (shape, b))| {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
            .expect("the byte count matches the shape");
        (name.as_str(), view)
    });
    // transformers refuses safetensors files without `format: pt` in their metadata.
    let metadata = Some([("format".to_string(), "pt".to_string())].into());
    // Each file is written beside its name and renamed into place: a crash leaves the old
    // file or the new one, never half of one.
    let weights = dir.join(HF_WEIGHTS_FILE);
    let tmp = temp_file(&weights);
    safetensors::serialize_to_file(views, metadata, &tmp)
        .map_err(|e| CheckpointError::file(&weights, format!("cannot write it: {e}")))?;
    publish_file(&tmp, &weights)?;
    Ok(())
}
