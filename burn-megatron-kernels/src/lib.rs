//! burn-megatron's GPU pieces.
//!
//! With the `cuda` feature: `cuda`, our CUDA backend (a CubeCL runtime that owns its
//! streams) and the in-band foreign operations that NCCL collectives and cuBLASLt GEMMs run
//! through. Fused kernels and GEMM paths build on it.
//!
//! Always: [`counter_rng`], the random bits of the dropout masks (the host reference of the
//! dropout kernel), and [`adamw_scalars`], the fused AdamW step's hyper-parameters.
//!
//! With the `fused` feature (implied by `cuda` and `wgpu`): `fused`, CubeCL kernels for any
//! CubeCL runtime.

pub mod adamw_scalars;
pub mod counter_rng;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "fused")]
pub mod fused;
