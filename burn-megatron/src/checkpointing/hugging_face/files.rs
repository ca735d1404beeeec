//! Reading tensors by name from a transformers checkpoint directory: `model.safetensors`, or
//! the shards listed in `model.safetensors.index.json`. Files are memory-mapped, so only the
//! tensors read are paged in.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};
use memmap2::Mmap;
use safetensors::tensor::Metadata;

use super::layout::Dense;
use crate::checkpointing::CheckpointError;
use crate::error::Result;

/// The single-file weights of a transformers checkpoint.
pub const HF_WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights (`weight_map`: tensor name → file).
pub const HF_INDEX_FILE: &str = "model.safetensors.index.json";

/// One mapped safetensors file and its parsed header.
struct Mapped {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    metadata: Metadata,
}

/// The safetensors files of a transformers checkpoint, by tensor name.
pub(crate) struct HfFiles {
    dir: PathBuf,
    files: Vec<Mapped>,
    by_name: HashMap<String, usize>,
}

impl HfFiles {
    /// Opens the weights in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join(HF_INDEX_FILE);
        let names: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| CheckpointError::io(&index, "read it", e))?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let parsed: Index = serde_json::from_str(&text).map_err(|e| {
                CheckpointError::file(&index, format!("not a safetensors index: {e}"))
            })?;
            let mut files: Vec<String> = parsed.weight_map.into_values().collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec![HF_WEIGHTS_FILE.to_string()]
        };
        let mut out = Self {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            by_name: HashMap::new(),
        };
        for name in names {
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|e| CheckpointError::io(&path, "open it", e))?;
            // SAFETY: the mapping is only read, and checkpoint files are not modified while
            // a model is imported from them (as for any memory-mapped dataset).
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(&path, "map it", e))?;
            let (header, metadata) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| CheckpointError::file(&path, format!("not safetensors: {e}")))?;
            for tensor in metadata.tensors().keys() {
                out.by_name.insert(tensor.clone(), out.files.len());
            }
            out.files.push(Mapped {
                path,
                map,
                data_start: 8 + header,
                metadata,
            });
        }
        Ok(out)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Tensor `name` as f32 (any float dtype is converted), checked to have `shape`.
    pub fn read(&self, name: &str, shape: &[usize]) -> Result<Dense> {
        self.read_leading(name, shape, 0..shape.first().copied().unwrap_or(1))
    }

    /// Entries `leading` of dimension 0 of tensor `name` (checked to have `shape`), as f32:
    /// `[leading.len(), shape[1..]]`, read from that part of the file only.
    pub fn read_leading(
        &self,
        name: &str,
        shape: &[usize],
        leading: core::ops::Range<usize>,
    ) -> Result<Dense> {
        let missing = || {
            let file = match self.files.as_slice() {
                [one] => one.path.clone(),
                _ => self.dir.join(HF_INDEX_FILE),
            };
            CheckpointError::file(&file, format!("tensor {name} is missing"))
        };
        let file = &self.files[*self.by_name.get(name).ok_or_else(missing)?];
        let info = file.metadata.info(name).ok_or_else(missing)?;
        if info.shape != shape {
            return Err(CheckpointError::file(
                &file.path,
                format!(
                    "tensor {name} has shape {:?}, the model needs {shape:?}",
                    info.shape
                ),
            )
            .into());
        }
        let dtype = match info.dtype {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F64 => DType::F64,
            other => {
                return Err(CheckpointError::file(
                    &file.path,
                    format!("tensor {name} has dtype {other:?}, not a float dtype"),
                )
                .into());
            }
        };
        let (start, end) = info.data_offsets;
        let row = (end - start) / shape.first().copied().unwrap_or(1).max(1);
        let (start, end) = (start + leading.start * row, start + leading.end * row);
        let bytes = file.map[file.data_start + start..file.data_start + end].to_vec();
        let mut shape = shape.to_vec();
        if let Some(first) = shape.first_mut() {
            *first = leading.len();
        }
        let data = TensorData::from_bytes_vec(bytes, shape.clone(), dtype).convert::<f32>();
        let values = data
            .into_vec::<f32>()
            .map_err(|e| CheckpointError::file(&file.path, format!("tensor {name}: {e:?}")))?;
        Ok(Dense { shape, values })
    }
}
