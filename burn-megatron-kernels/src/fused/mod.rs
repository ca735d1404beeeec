//! Fused CubeCL kernels, for any CubeCL runtime (our CUDA runtime, burn-cuda, wgpu).
//!
//! Each kernel replaces a chain of Burn ops that would read and write a large tensor several
//! times. The model reaches them through `burn_megatron::ModelBackend`, whose default
//! implementation of each is the plain Burn composition (on NdArray, and the reference the
//! kernels are tested against). No kernel assumes a plane (warp) size: reductions use plane
//! operations only where the runtime reports one fixed plane size ([`rows`]), else shared
//! memory, so they run where planes are absent or narrow (lavapipe, which runs CI's kernel
//! tests, reports none).

/// Launches `$kernel` (declared `#[cube(launch, launch_unchecked)]`) with CubeCL's bounds check
/// on every tensor access (`$checked`) or without. Only for kernels that bound every access
/// themselves (rows past the end and vectors past a row are never read or written): there the
/// checks cost instructions and nothing else. `R` is the caller's runtime parameter.
macro_rules! launch_checked_or_not {
    ($kernel:ident, $checked:expr, $client:expr, $($arg:expr),* $(,)?) => {
        if $checked {
            $kernel::launch::<R>($client, $($arg),*)
        } else {
            // SAFETY: the kernel bounds every read and write itself (see its launcher; the
            // lavapipe tests run it on ragged shapes into poisoned outputs, and the GPU tests
            // under compute-sanitizer).
            unsafe { $kernel::launch_unchecked::<R>($client, $($arg),*) }
        }
    };
}

pub mod adamw;
pub mod bias_gelu;
pub mod causal_softmax;
pub mod column_sum;
pub mod counter_normal;
pub mod cross_entropy;
pub mod decode_attention;
pub mod dropout;
pub mod embedding;
pub mod flash_attention;
pub mod flat_copy;
pub mod fp8;
pub mod fp8_blocks;
pub mod lse_merge;
pub mod norm;
pub mod rope;
pub mod row_gather;
pub mod row_inverse;
pub mod rows;
pub mod swiglu;
pub mod top_k;
pub mod vectors;
