//! Models built from the transformer pieces.

mod gpt;

pub use gpt::GptModel;
