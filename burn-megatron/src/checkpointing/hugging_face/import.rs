//! Importing a transformers checkpoint into one chunk of any (TP, PP) layout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{DType, TensorData};

use super::config::{HfConfig, HfFamily};
use super::files::HfFiles;
use super::layout::{Dense, QkvSource, Recipe, alias, qkv_order, recipe};
use crate::ModelBackend;
use crate::checkpointing::CheckpointError;
use crate::checkpointing::load::Replace;
use crate::checkpointing::region::copy_region;
use crate::checkpointing::slices::{LocalSlice, local_slices};
use crate::error::Result;
use crate::models::GptModel;
use crate::transformer::TransformerConfig;

/// A transformers checkpoint directory (`config.json`, `model.safetensors` or its sharded
/// form) opened for import.
///
/// Build the model from [`config`](Self::config) (set the layout's settings such as
/// `sequence_parallel` or `make_vocab_size_divisible_by` as you like; nothing that shapes a
/// parameter), then [`load_model`](Self::load_model) on every rank: each rank reads the full
/// transformers tensors its chunk needs (memory-mapped), converts them to our layout and keeps
/// its slice.
pub struct HfCheckpoint {
    hf: HfConfig,
    files: HfFiles,
}

impl HfCheckpoint {
    /// Opens the checkpoint in `dir`: reads `config.json` and the safetensors headers.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        Ok(Self {
            hf: HfConfig::read(&dir)?,
            files: HfFiles::open(&dir)?,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        self.files.dir()
    }

    /// The model family.
    pub fn family(&self) -> HfFamily {
        self.hf.family
    }

    /// Our configuration of the saved model.
    pub fn config(&self) -> &TransformerConfig {
        &self.hf.config
    }

    /// Copies the tokenizer files next to the checkpoint (`tokenizer.json`,
    /// `tokenizer_config.json`, `special_tokens_map.json`, those that exist) into `dir`, to
    /// carry them along with an export. Returns the names copied.
    pub fn copy_tokenizer(&self, dir: &Path) -> Result<Vec<&'static str>> {
        copy_tokenizer_files(self.dir(), dir)
    }

    /// `model` (one chunk of any layout of [`config`](Self::config)) with every parameter
    /// replaced by its slice of the checkpoint's; vocabulary padding rows are zero. A missing
    /// tensor or one of the wrong shape is an error naming the file and the tensor.
    pub fn load_model<B: ModelBackend>(&self, model: GptModel<B>) -> Result<GptModel<B>> {
        let mut values = HashMap::new();
        for slice in local_slices(&model)? {
            // A routed expert's weight: only this rank's experts are read.
            let experts = match slice.expert {
                true => slice.real().map_or(0..0, |real| real[0].clone()),
                false => 0..slice.global_shape.first().copied().unwrap_or(1),
            };
            let part = self.full_tensor(&slice.path, &slice.global_shape, experts.clone())?;
            values.insert(slice.id, cut(&part, experts.start, &slice));
        }
        Ok(model.map(&mut Replace::new(values)))
    }

    /// Our full tensor `path` of `shape` (unpadded), made from the transformers tensors; of a
    /// routed expert's weight (`[experts, in, out]`), only the experts `experts`.
    fn full_tensor(
        &self,
        path: &str,
        shape: &[usize],
        experts: core::ops::Range<usize>,
    ) -> Result<Dense> {
        let config = &self.hf.config;
        let recipe = recipe(self.hf.family, path, config).ok_or_else(|| {
            CheckpointError::mismatch(
                self.dir(),
                format!(
                    "our parameter {path} has no counterpart in a transformers {:?} model",
                    self.hf.family
                ),
            )
        })?;
        Ok(match recipe {
            Recipe::Copy(name) => self.read(&name, shape)?,
            Recipe::Transpose(name) => self.read(&name, &[shape[1], shape[0]])?.transpose(),
            Recipe::Qkv(QkvSource::Fused(name)) => {
                self.read(&name, shape)?.columns(&qkv_order(config))
            }
            Recipe::Qkv(QkvSource::Split([q, k, v])) => {
                let (hidden, head_dim) = (config.hidden_size, config.head_dim());
                let q_rows = config.num_attention_heads * head_dim;
                let kv_rows = config.query_groups() * head_dim;
                let parts = [
                    self.read(&q, &[q_rows, hidden])?.transpose(),
                    self.read(&k, &[kv_rows, hidden])?.transpose(),
                    self.read(&v, &[kv_rows, hidden])?.transpose(),
                ];
                Dense::concat_columns(&parts).columns(&qkv_order(config))
            }
            Recipe::Experts {
                per_expert,
                fused,
                rows,
                total_rows,
            } => {
                let (rows_in, out) = (shape[1], shape[2]);
                let mut values = Vec::with_capacity(experts.len() * rows_in * out);
                if !self.files.contains(&per_expert[0]) && self.files.contains(&fused) {
                    let all = [shape[0], total_rows, rows_in];
                    let part = self.files.read_leading(&fused, &all, experts.clone())?;
                    for matrix in part.values.chunks(total_rows * rows_in) {
                        let dense = Dense {
                            shape: vec![rows.len(), rows_in],
                            values: matrix[rows.start * rows_in..rows.end * rows_in].to_vec(),
                        };
                        values.extend(dense.transpose().values);
                    }
                } else {
                    for name in &per_expert[experts.clone()] {
                        values.extend(self.read(name, &[out, rows_in])?.transpose().values);
                    }
                }
                Dense {
                    shape: vec![experts.len(), rows_in, out],
                    values,
                }
            }
        })
    }

    /// Tensor `name`, or its [`alias`] when only that is in the files.
    fn read(&self, name: &str, shape: &[usize]) -> Result<Dense> {
        match alias(name) {
            Some(other) if !self.files.contains(name) && self.files.contains(&other) => {
                self.files.read(&other, shape)
            }
            _ => self.files.read(name, shape),
        }
    }
}

/// The tokenizer files transformers keeps next to a checkpoint.
const TOKENIZER_FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// Copies the tokenizer files found in `from` (those of [`TOKENIZER_FILES`] that exist) into
/// `to`. Returns the names copied.
pub(crate) fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<Vec<&'static str>> {
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let file = from.join(name);
        if file.exists() {
            std::fs::create_dir_all(to).map_err(|e| CheckpointError::io(to, "create it", e))?;
            std::fs::copy(&file, to.join(name))
                .map_err(|e| CheckpointError::io(&file, "copy it", e))?;
            copied.push(name);
        }
    }
    Ok(copied)
}

/// This rank's local tensor of `slice` (padding zero) out of `part`, the full tensor or, for
/// a routed expert's weight, the experts from `first_expert` on.
fn cut(part: &Dense, first_expert: usize, slice: &LocalSlice) -> TensorData {
    const F32: usize = 4;
    let mut out = vec![0u8; slice.local_shape.iter().product::<usize>() * F32];
    if let Some(real) = slice.real() {
        let src: Vec<u8> = part.values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let mut origin = vec![0; part.shape.len()];
        if let Some(first) = origin.first_mut() {
            *first = first_expert;
        }
        let dst_origin: Vec<usize> = slice.held.iter().map(|r| r.start).collect();
        copy_region(
            &real,
            F32,
            (&src, &part.shape, &origin),
            (&mut out, &slice.local_shape, &dst_origin),
        );
    }
    TensorData::from_bytes_vec(out, slice.local_shape.clone(), DType::F32)
}
