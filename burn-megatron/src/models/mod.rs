//! Models built from the transformer pieces.

mod gpt;
mod stage;

pub use gpt::GptModel;
pub use stage::{Stage, StageSplit};
