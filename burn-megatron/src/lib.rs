//! Megatron-style parallel modules, models and training for Burn.
//!
//! Layers are ordinary Burn modules (`#[derive(Module)]`, generic over the backend, working
//! under `Autodiff`) that hold their slice of the parameters and a
//! [`ProcessGroup`](burn_megatron_dist::ProcessGroup) to communicate over.

pub mod error;
pub mod init;
pub mod tensor_parallel;

pub use burn_megatron_dist as dist;
pub use error::ConfigError;
