//! Sharded, reshardable, crash-safe checkpoints (Megatron-Core's `dist_checkpointing`).
//!
//! - **Sharded save** ([`Checkpointer::save`]): every rank writes only what it owns (its TP
//!   and PP slice of the model and of the optimizer state; DP rank 0 of each model-parallel
//!   rank, or every DP rank for the distributed optimizer's shards) as safetensors, keyed by
//!   the parameter's path in the whole model (`block.layers.3.attention.qkv.weight`, global
//!   layer index under PP). Rank 0 then writes `metadata.json` ([`CheckpointMetadata`]): each
//!   tensor's full shape, dtype, partition dimension and which file holds which slice; the
//!   layout; the model configuration; the caller's [`TrainingState`] (with the loss scaler's);
//!   per file a CRC-32, whole and per block.
//! - **Asynchronous save** ([`AsyncCheckpointer`]): the step waits for the host copies only;
//!   files are written in the background and published at the next save or `finish`.
//! - **Load into any layout** ([`Checkpoint::load_model`],
//!   [`Checkpoint::load_optimizer_state`]): a rank computes the slice its chunk holds (from the
//!   placements its layers declare, see
//!   [`DeclarePlacements`](crate::tensor_parallel::DeclarePlacements)) and copies it out of
//!   whichever saved slices overlap it, so (TP, PP) = (2, 2) loads at (1, 1), (4, 1), (1, 4)...
//!   Files are memory-mapped and checked block by block: a rank reads only what it needs.
//! - **Optimizer state by path**, never by Burn's random `ParamId`: [`adamw_state`] and
//!   [`adamw_record`] convert Burn's AdamW record; [`distributed_adamw_state`] and
//!   [`load_distributed_adamw`] the distributed optimizer's DP shards, at any DP size.
//! - **Safety** ([`latest_checkpoint`], [`keep_last`], [`remove_partial_saves`]): saves go to
//!   a temporary directory renamed into place after every rank finished and the metadata is
//!   written and synced (a re-save moves the old directory aside first); `latest` is then
//!   replaced atomically, but it is only a hint: loaders take the complete checkpoint of the
//!   highest iteration, so a process killed at any step leaves the previous checkpoint or the
//!   new one; a failed sync is an error; the last K are kept; files are checked against
//!   their size and checksums on load, and a wrong model configuration or missing shard is
//!   refused, naming the file or tensor ([`CheckpointError`]).
//! - **Conversion** ([`convert_layout`], [`import_hugging_face`], [`export_hugging_face`]):
//!   offline, to another layout and to or from Hugging Face (`checkpoint_tool convert`).
//! - **Hugging Face** ([`hugging_face`]): transformers' GPT-2 and Llama checkpoints imported
//!   at any layout and exported back.

mod async_save;
mod convert;
mod directory;
mod distributed_optimizer;
pub mod hugging_face;
mod load;
mod metadata;
mod region;
mod save;
mod slices;
mod snapshot;
mod tensor_file;

pub use crate::error::CheckpointError;
pub use crate::optimizer::state::{ADAMW, OptimizerState, ParamState, adamw_record, adamw_state};
pub use async_save::AsyncCheckpointer;
pub use convert::{TargetLayout, convert_layout, export_hugging_face, import_hugging_face};
pub use directory::{
    LATEST_FILE, checkpoint_name, keep_last, latest_checkpoint, list_checkpoints,
    remove_partial_saves,
};
#[doc(hidden)]
pub use directory::{PublishStep, StepHook};
pub use distributed_optimizer::{MAIN_PARAM, distributed_adamw_state, load_distributed_adamw};
pub use load::Checkpoint;
pub use metadata::{
    CheckpointMetadata, FORMAT_VERSION, FP8_GROUP, FileEntry, METADATA_FILE, MODEL_GROUP,
    OptimizerInfo, OptimizerLayout, SavedLayout, ShardEntry, TensorEntry, TrainingState,
};
pub use save::Checkpointer;
pub use tensor_file::CHECKSUM_BLOCK_BYTES;
