//! The fused CubeCL kernels against the plain Burn compositions they replace, on Burn's wgpu
//! backend: in CI that is Mesa's software Vulkan driver (lavapipe), with no GPU.
//!
//!     apt-get install -y mesa-vulkan-drivers
//!     XDG_RUNTIME_DIR=/tmp cargo test -p burn-megatron --features wgpu --test fused_kernels
//!
//! lavapipe reports no plane (subgroup) support, so this runs the kernels' portable
//! shared-memory reductions. The same comparisons run on the GPU in tests/tests/gpu.rs.

mod helpers;

mod adamw;
mod column_sum;
mod counter_normal;
mod cross_entropy;
mod decode_attention;
mod dropout;
mod elementwise_layouts;
mod embedding;
mod flash_attention;
mod fp8;
mod gelu;
mod lse_merge;
mod moe;
mod norm;
mod packed_flash_attention;
mod rope;
mod row_gather;
mod softmax;
mod swiglu;
mod top_k;
mod training_step;
mod write_slot;
