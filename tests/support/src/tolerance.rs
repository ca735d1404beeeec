//! Relative tolerances, named once: `max |got - want| / max |want|` must not exceed them.
//!
//! The bound of a comparison follows from the dtype of its arithmetic and from how much the
//! two sides may legitimately differ (a reordered sum, a TF32 GEMM), never retyped per file.

/// f64 on the CPU: only summation order differs.
pub const F64: f64 = 1e-12;
/// f32 on the CPU, the bound every layout-equivalence test meets (the brief's 1e-5).
pub const F32: f64 = 1e-5;
/// f32 where both sides compute the same sums in the same order but through different
/// kernels (a hand-written backward against Burn's autodiff).
pub const F32_SAME_ORDER: f64 = 1e-6;
/// f32 losses after several optimizer steps: AdamW divides by `sqrt(v)`, which amplifies
/// last-bit differences of tiny gradients from step to step.
pub const F32_TRAINING: f64 = 1e-4;
/// f32 on the GPU through different kernels (autotune may pick another accumulation order
/// on each backend), summed over a whole network's gradient.
pub const GPU_F32: f64 = 1e-3;
/// An f32-accumulating GEMM of exactly representable inputs against the exact product.
pub const F32_GEMM: f64 = 1e-4;
/// Two f32 sums of tens of thousands of terms taken in different orders (a vocabulary row):
/// a sequential sum is off by up to ~n·ε/10 relative.
pub const F32_LONG_SUM: f64 = 2e-4;
/// f32 GEMMs on the GPU, which may run in TF32 (10-bit mantissa inputs, f32 accumulation).
pub const TF32: f64 = 5e-3;
/// f16 storage with f32 accumulation.
pub const F16: f64 = 5e-3;
/// bf16 storage with f32 accumulation.
pub const BF16: f64 = 1e-2;
/// A gradient against central finite differences in f64 (step ~1e-5: truncation ~1e-10,
/// rounding ~1e-11 relative to the function's scale).
pub const FINITE_DIFFERENCE_F64: f64 = 1e-6;
