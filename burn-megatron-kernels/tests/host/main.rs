//! What of the kernels crate runs on the host, tested without a GPU: the dropout masks' random
//! bits, AdamW's step scalars, the fused kernels' launch layouts (`fused` feature) and the
//! host-side pieces of the CUDA runtime (`cuda` feature).
//!
//! `cargo test -p burn-megatron-kernels` runs the first two; add `--features fused` or
//! `--features cuda` for the others. None of them needs a device.

mod adamw_scalars;
mod counter_rng;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "fused")]
mod layouts;
