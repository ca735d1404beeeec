//! The checkpoint's `metadata.json`: every tensor by its path in the whole model, with its
//! full shape, dtype, partition dimension and which file holds which slice; the layout it was
//! saved in; the model configuration; the training state; a checksum per file.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::error::CheckpointError;
use crate::optimizer::LossScalerState;
use crate::transformer::TransformerConfig;
use crate::transformer::moe::MoeSettings;

/// The format version written by this crate; loading refuses others.
pub const FORMAT_VERSION: u32 = 1;

/// The metadata file's name inside a checkpoint directory.
pub const METADATA_FILE: &str = "metadata.json";

/// The tensor group of the model's parameters.
pub const MODEL_GROUP: &str = "model";

/// The tensor group of the FP8 layers' delayed-scaling states: per layer and operand
/// (`input`, `weight`, `grad_output`) its amax history and scale,
/// `block.layers.5.attention.qkv.input.amax_history` and `….input.scale`, f32.
pub const FP8_GROUP: &str = "fp8_delayed_scaling";

/// The operands of an FP8 layer whose states [`FP8_GROUP`] holds, in the layer's order.
pub(crate) const FP8_OPERANDS: [&str; 3] = ["input", "weight", "grad_output"];

/// A saved checkpoint's description (`metadata.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMetadata {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// The training iteration saved.
    pub iteration: u64,
    /// The parallel layout the checkpoint was saved in (loading may use another).
    pub layout: SavedLayout,
    /// The model's configuration. Fields added to it after a checkpoint was written read as
    /// their defaults, so older checkpoints still load (an MoE saved before `pre_softmax`
    /// existed reads as pre-softmax, as it routed then).
    #[serde(deserialize_with = "model_config_with_defaults")]
    pub model_config: TransformerConfig,
    /// Iteration, data position, seeds, schedules: filled by the caller.
    pub training: TrainingState,
    /// The optimizer whose state is saved, if any.
    pub optimizer: Option<OptimizerInfo>,
    /// Tensors by group (`"model"`, `"optimizer.exp_avg"`, ...) and then by path in the whole
    /// model (`block.layers.3.attention.qkv.weight`: global layer indices under PP).
    pub tensors: BTreeMap<String, BTreeMap<String, TensorEntry>>,
    /// Every data file of the checkpoint, by name, with its size and checksum.
    pub files: BTreeMap<String, FileEntry>,
}

/// The parallel layout of a save.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedLayout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// Virtual pipeline stages (model chunks) per pipeline rank.
    pub virtual_pp: usize,
}

/// One tensor of the whole model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The full shape, without padding (a vocabulary table is `[vocab_size, hidden]`).
    pub shape: Vec<usize>,
    /// The stored dtype, in safetensors' spelling (`F32`, `BF16`, ...).
    pub dtype: String,
    /// The dimension split over TP when saved; `None` for a replicated tensor.
    pub partition_dim: Option<usize>,
    /// The slices that together cover the tensor, each in one file.
    pub shards: Vec<ShardEntry>,
}

/// One slice of a tensor, stored whole under `key` in `file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The data file.
    pub file: String,
    /// The tensor's name inside the safetensors file.
    pub key: String,
    /// Where the slice starts in the full tensor, per dimension.
    pub offsets: Vec<usize>,
    /// The slice's shape.
    pub shape: Vec<usize>,
}

/// A data file's size and checksums.
///
/// Besides the whole file's CRC-32 (what `checkpoint_tool inspect` checks), each block of
/// `block_bytes` has its own: a rank that reads only some slices of a file checks only the
/// blocks it reads, rather than reading the whole file for its checksum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Its length in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of its bytes.
    pub crc32: u32,
    /// The size of the checksummed blocks (the last may be shorter); 0 when the file has no
    /// block checksums (then a read checks the whole file).
    #[serde(default)]
    pub block_bytes: u64,
    /// CRC-32 of each block, in order.
    #[serde(default)]
    pub block_crc32: Vec<u32>,
}

/// Training progress and state outside the model and optimizer tensors, filled by the
/// caller and given back on load.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Iterations (optimizer steps) done.
    pub iteration: u64,
    /// Samples consumed from the data so far (the data position).
    pub consumed_samples: u64,
    /// The seed of the run's random streams (our initialisation and dropout masks are
    /// counter-based, keyed by seed and call number: the seed and the iteration restore them).
    pub rng_seed: u64,
    /// The learning-rate scheduler's state, in whatever form the scheduler serialises to.
    pub lr_scheduler: Option<serde_json::Value>,
    /// The dynamic loss scaler's state (scale, growth and hysteresis counters), for fp16.
    pub loss_scaler: Option<LossScalerState>,
}

/// The saved optimizer state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptimizerInfo {
    /// The optimizer, e.g. `"adamw"`.
    pub kind: String,
    /// How its state tensors are laid out.
    pub layout: OptimizerLayout,
    /// Steps each parameter's state has taken (AdamW's bias correction), by path.
    pub steps: BTreeMap<String, u64>,
    /// Whether the state was saved by a distributed optimizer (ZeRO-1), each DP rank writing
    /// its shard. The tensors are per parameter either way, and load at any DP size.
    #[serde(default)]
    pub dp_sharded: bool,
}

/// How optimizer state is laid out in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimizerLayout {
    /// One tensor per parameter and state (group `optimizer.<state>`, same paths, shapes and
    /// partitions as the parameters): resharded exactly like the model. The distributed
    /// optimizer's shards are stored this way too, each DP rank's flat range of a parameter
    /// written as the boxes of the parameter it covers, so a DP size needs no layout of its
    /// own (Megatron's "fully reshardable" format).
    PerParameter,
}

impl CheckpointMetadata {
    /// Reads and parses `dir/metadata.json`.
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let file = dir.join(METADATA_FILE);
        let bytes = std::fs::read(&file).map_err(|e| CheckpointError::io(&file, "read it", e))?;
        let metadata: Self = serde_json::from_slice(&bytes)
            .map_err(|e| CheckpointError::file(&file, format!("not valid metadata: {e}")))?;
        if metadata.format_version != FORMAT_VERSION {
            return Err(CheckpointError::file(
                &file,
                format!(
                    "format version {} (this build reads version {FORMAT_VERSION})",
                    metadata.format_version
                ),
            ));
        }
        Ok(metadata)
    }

    /// The model's entries.
    pub fn model_tensors(&self) -> Option<&BTreeMap<String, TensorEntry>> {
        self.tensors.get(MODEL_GROUP)
    }
}

/// [`CheckpointMetadata::model_config`] read with [`with_defaults`].
fn model_config_with_defaults<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<TransformerConfig, D::Error> {
    let value = with_defaults(Value::deserialize(deserializer)?);
    serde_json::from_value(value).map_err(serde::de::Error::custom)
}

/// A saved `TransformerConfig` (JSON) with the fields it lacks, which a later version added,
/// set to their defaults, and likewise its MoE settings. A new field's default keeps the
/// behaviour the checkpoint was trained with, with one exception handled here: MoE settings
/// saved before `pre_softmax` existed routed as `pre_softmax = true` does now.
fn with_defaults(mut value: Value) -> Value {
    let Some(config) = value.as_object_mut() else {
        return value;
    };
    let size = |key: &str| config.get(key).and_then(Value::as_u64).map(|n| n as usize);
    let required = [
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "ffn_hidden_size",
        "vocab_size",
        "max_sequence_length",
    ]
    .map(size);
    if let [
        Some(h),
        Some(n),
        Some(heads),
        Some(ffn),
        Some(vocab),
        Some(seq),
    ] = required
    {
        merge(config, TransformerConfig::new(h, n, heads, ffn, vocab, seq));
    }
    if let Some(moe) = config.get_mut("moe").and_then(Value::as_object_mut) {
        moe.entry("pre_softmax").or_insert(Value::Bool(true));
        if let Some(experts) = moe.get("num_experts").and_then(Value::as_u64) {
            merge(moe, MoeSettings::new(experts as usize));
        }
    }
    value
}

/// Adds to `into` the fields of `defaults` it lacks.
fn merge(into: &mut Map<String, Value>, defaults: impl Serialize) {
    if let Ok(Value::Object(defaults)) = serde_json::to_value(defaults) {
        for (key, value) in defaults {
            into.entry(key).or_insert(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configuration saved before some fields existed reads back as the one saved; a saved
    /// MoE without `pre_softmax` keeps routing as it was trained to.
    #[test]
    fn fields_added_later_read_as_their_defaults() {
        let config = TransformerConfig::llama_1b()
            .with_tp_comm_overlap(false)
            .with_moe(Some(
                MoeSettings::new(8).with_top_k(2).with_pre_softmax(true),
            ));
        let mut saved = serde_json::to_value(&config).unwrap();
        let object = saved.as_object_mut().unwrap();
        object.remove("tp_comm_overlap").unwrap();
        object.remove("qk_layernorm").unwrap();
        object.remove("recompute").unwrap();
        let moe = object.get_mut("moe").unwrap().as_object_mut().unwrap();
        moe.remove("pre_softmax").unwrap();
        moe.remove("capacity").unwrap();
        moe.remove("token_dispatcher").unwrap();
        let strict = serde_json::from_value::<TransformerConfig>(saved.clone());
        assert!(
            strict.is_err(),
            "the fields removed are required without defaults"
        );
        let read: TransformerConfig = serde_json::from_value(with_defaults(saved)).unwrap();
        assert_eq!(
            serde_json::to_value(&read).unwrap(),
            serde_json::to_value(&config).unwrap()
        );
    }
}
