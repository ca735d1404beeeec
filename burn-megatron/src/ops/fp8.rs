//! FP8 GEMMs (issue 33): a tensor's largest magnitude, its cast to an FP8 grid under a scale,
//! and the product of two cast tensors with f32 accumulation.
//!
//! [`Fp8Ops`] is the backend's part: three operations whose defaults are plain Burn
//! compositions that *emulate* FP8 in a float tensor (every E4M3 and E5M2 value is exact in
//! bf16, f16 and f32, so the cast's result is held without loss and the GEMM of those values
//! in f32 is what an FP8 tensor core computes, up to the f32 sums' order), and the cast in both
//! layouts (with or without the amax), which defaults to those three. Our CUDA backend
//! replaces them with cast kernels whose output is opaque 1-byte storage (one pass for both
//! layouts and the amax) and cuBLASLt's FP8 GEMM; code above the backend therefore never
//! applies a Burn operation to a cast tensor: it only hands it to [`Fp8Ops::fp8_gemm`].
//!
//! The layer above the backend lives in this op's folder:
//! - `fp8/scaling.rs`: Megatron's `--fp8-format`, `--fp8-recipe` and the scale computations
//!   ([`Fp8Config`], [`DelayedScaling`], [`scale_from_amax`]).
//! - `fp8/blockwise.rs`: blockwise scaling's casts and products as compositions
//!   ([`Fp8Blocks`], [`quantize_blockwise_composition`], [`gemm_blockwise_composition`]).
//! - `fp8/linear.rs`: the FP8 linear layer as one autodiff operation ([`fp8_linear`]): three
//!   FP8 GEMMs (forward, input gradient, weight gradient), each operand K-contiguous, amaxes
//!   reduced over the tensor-parallel group where the operand is split.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

use super::linear::LinearOps;

pub mod blockwise;
pub mod linear;
pub mod scaling;

pub use blockwise::{
    BLOCK, Fp8Blocks, check_blockwise_shape, gemm_blockwise_composition,
    quantize_blockwise_composition,
};

pub use linear::{
    Fp8Linear, Fp8LinearOps, Fp8Split, fp8_linear, hooked_fp8_linear, reduce_delayed_states,
};
pub use scaling::{
    AmaxComputeAlgo, DelayedData, DelayedScaling, Fp8Backward, Fp8Config, Fp8Format, Fp8Recipe,
    delayed_update_composition, history_amaxes, scale_from_amax, scales_from_amaxes,
    tensorwise_scale,
};

/// An FP8 storage format (OCP): E4M3 (max 448, Megatron's activations/weights) and E5M2 (max
/// 57344, gradients in the `hybrid` format).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Dtype {
    /// 4 exponent bits (bias 7), 3 mantissa bits, no infinities (OCP's `E4M3FN`): normal
    /// numbers from 2⁻⁶ to 448, subnormals down to 2⁻⁹.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: normal numbers from 2⁻¹⁴ to
    /// 57344, subnormals down to 2⁻¹⁶.
    E5M2,
}

impl Fp8Dtype {
    /// The largest finite value, which the cast saturates to.
    pub const fn max(self) -> f32 {
        match self {
            Self::E4M3 => 448.0,
            Self::E5M2 => 57344.0,
        }
    }

    /// Explicit mantissa bits.
    pub const fn mantissa_bits(self) -> i32 {
        match self {
            Self::E4M3 => 3,
            Self::E5M2 => 2,
        }
    }

    /// The exponent of the smallest normal number; below it the grid's spacing stays
    /// `2^(min_normal_exponent - mantissa_bits)` (the subnormals).
    pub const fn min_normal_exponent(self) -> i32 {
        match self {
            Self::E4M3 => -6,
            Self::E5M2 => -14,
        }
    }

    /// The exponent of the largest binade (`max` lies in `[2^e, 2^(e + 1))`).
    pub const fn max_exponent(self) -> i32 {
        match self {
            Self::E4M3 => 8,
            Self::E5M2 => 15,
        }
    }

    /// Megatron's name (`e4m3`, `e5m2`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::E4M3 => "e4m3",
            Self::E5M2 => "e5m2",
        }
    }
}

/// The backend's FP8 operations. The defaults emulate them with Burn operations on float
/// tensors ([`amax_composition`], [`quantize_composition`], [`gemm_composition`]); our CUDA
/// backend runs kernels and cuBLASLt.
pub trait Fp8Ops: LinearOps {
    /// Largest |x| of `x` as a `[1]` f32 tensor on x's device (NaN if x holds a NaN). No host
    /// read.
    fn fp8_amax(x: Tensor<Self, 2>) -> Tensor<Self, 1> {
        amax_composition(x)
    }

    /// The tensorwise scale of a cast to `dtype` from the tensor's `amax` (`[1]` f32), and its
    /// reciprocal (what the FP8 GEMM multiplies by): `(scale, 1 / scale)`,
    /// [`tensorwise_scale`]'s value and its `recip()`, as `[1]` f32 tensors. Our CUDA backend
    /// computes both in one kernel; the composition launches about eleven, once per cast.
    fn fp8_tensorwise_scale(
        amax: Tensor<Self, 1>,
        dtype: Fp8Dtype,
        margin: i32,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>) {
        let scale = tensorwise_scale(amax, dtype, margin);
        (scale.clone(), scale.recip())
    }

    /// `x`'s [`fp8_amax`](Self::fp8_amax) and the [`fp8_tensorwise_scale`](Self::fp8_tensorwise_scale)
    /// from it, `(amax, scale, 1 / scale)`: for a cast whose amax is not reduced over other
    /// ranks. Our CUDA backend computes the scales in the amax's last launch.
    fn fp8_amax_scale(
        x: Tensor<Self, 2>,
        dtype: Fp8Dtype,
        margin: i32,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>, Tensor<Self, 1>) {
        let amax = Self::fp8_amax(x);
        let (scale, scale_inv) = Self::fp8_tensorwise_scale(amax.clone(), dtype, margin);
        (amax, scale, scale_inv)
    }

    /// Delayed scaling's update after a cast: `(history, scale)` with `amax` (`[1]` f32)
    /// recorded, [`delayed_update_composition`]'s values (`history`: `[len]` f32, newest
    /// first; `scale`: `[1]` f32). Our CUDA backend runs one kernel; the composition launches
    /// about fifteen, once per cast.
    fn fp8_delayed_update(
        history: Tensor<Self, 1>,
        scale: Tensor<Self, 1>,
        amax: Tensor<Self, 1>,
        dtype: Fp8Dtype,
        margin: i32,
        algo: AmaxComputeAlgo,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>) {
        delayed_update_composition(history, scale, amax, dtype, margin, algo)
    }

    /// `x · scale` rounded to nearest (ties to even) on `dtype`'s grid, saturated to ±max, in
    /// the backend's FP8 storage: `[r, c]` -> `[r, c]`, or `[c, r]` (contiguous, row-major)
    /// with `transpose`. `scale: [1]` f32.
    /// Composition: a float tensor (x's float dtype; bf16/f16/f32 hold every E4M3/E5M2 value
    /// exactly) holding the grid values.
    fn fp8_quantize(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        dtype: Fp8Dtype,
        transpose: bool,
    ) -> Tensor<Self, 2> {
        quantize_composition(x, scale, dtype, transpose)
    }

    /// [`fp8_quantize`](Self::fp8_quantize) in both layouts, `(row, transposed)`: `[r, c]`
    /// and `[c, r]`, the values of the two calls it defaults to. Our CUDA backend reads `x`
    /// once for both (the FP8 linear layer casts its input, weight and output gradient in both
    /// layouts).
    fn fp8_quantize_both(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        dtype: Fp8Dtype,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        (
            Self::fp8_quantize(x.clone(), scale.clone(), dtype, false),
            Self::fp8_quantize(x, scale, dtype, true),
        )
    }

    /// [`fp8_quantize_both`](Self::fp8_quantize_both) and `x`'s
    /// [`fp8_amax`](Self::fp8_amax), `(row, transposed, amax)`: for delayed scaling, whose
    /// scale comes from a history and whose amax is only recorded. Our CUDA backend takes the
    /// amax from the casts' pass (the same bits as the amax kernel).
    fn fp8_quantize_both_amax(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        dtype: Fp8Dtype,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>, Tensor<Self, 1>) {
        let amax = Self::fp8_amax(x.clone());
        let (row, transposed) = Self::fp8_quantize_both(x, scale, dtype);
        (row, transposed, amax)
    }

    /// `(a · bᵀ) · a_scale_inv · b_scale_inv` for quantised `a: [m, k]` and `b: [n, k]` (both
    /// K-contiguous, as cuBLASLt's FP8 GEMM requires), accumulated in f32, output `[m, n]` of
    /// dtype `out`. Never both operands E5M2.
    fn fp8_gemm(
        a: Tensor<Self, 2>,
        a_dtype: Fp8Dtype,
        a_scale_inv: Tensor<Self, 1>,
        b: Tensor<Self, 2>,
        b_dtype: Fp8Dtype,
        b_scale_inv: Tensor<Self, 1>,
        out: DType,
    ) -> Tensor<Self, 2> {
        debug_assert!(
            !(a_dtype == Fp8Dtype::E5M2 && b_dtype == Fp8Dtype::E5M2),
            "an FP8 GEMM of two E5M2 operands (cuBLASLt has none)"
        );
        gemm_composition(a, a_scale_inv, b, b_scale_inv, out)
    }

    /// The blockwise cast of `x: [r, c]` to `dtype` (Megatron's `blockwise` recipe, see
    /// [`blockwise`]): each block under the scale of its own amax (with `margin`), `[r, c]`
    /// or, with `transpose`, `[c, r]` (the blocks then run along `x`'s columns), and the
    /// reciprocal scales, f32, flattened in cuBLASLt's layout ([`Fp8Blocks::scale_len`]).
    /// Both sides multiples of 128. Composition: grid values in `x`'s float dtype.
    fn fp8_quantize_blockwise(
        x: Tensor<Self, 2>,
        dtype: Fp8Dtype,
        blocks: Fp8Blocks,
        margin: i32,
        transpose: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        quantize_blockwise_composition(x, dtype, blocks, margin, transpose)
    }

    /// Both layouts of [`fp8_quantize_blockwise`](Self::fp8_quantize_blockwise):
    /// `[(q, inv), (q_t, inv_t)]`, row-major then transposed, for an operand that both the
    /// product and a gradient's product read. Composition: the two casts.
    fn fp8_quantize_blockwise_both(
        x: Tensor<Self, 2>,
        dtype: Fp8Dtype,
        blocks: Fp8Blocks,
        margin: i32,
    ) -> [(Tensor<Self, 2>, Tensor<Self, 1>); 2] {
        [false, true].map(|transpose| {
            Self::fp8_quantize_blockwise(x.clone(), dtype, blocks, margin, transpose)
        })
    }

    /// `a · bᵀ` of two blockwise casts (`a: [m, k]`, `b: [n, k]`, K-contiguous), each block's
    /// partial product scaled by its operands' reciprocal scales, accumulated in f32, output
    /// `[m, n]` of dtype `out`. Never both operands E5M2.
    #[allow(clippy::too_many_arguments)]
    fn fp8_gemm_blockwise(
        a: Tensor<Self, 2>,
        a_dtype: Fp8Dtype,
        a_scale_inv: Tensor<Self, 1>,
        a_blocks: Fp8Blocks,
        b: Tensor<Self, 2>,
        b_dtype: Fp8Dtype,
        b_scale_inv: Tensor<Self, 1>,
        b_blocks: Fp8Blocks,
        out: DType,
    ) -> Tensor<Self, 2> {
        debug_assert!(
            !(a_dtype == Fp8Dtype::E5M2 && b_dtype == Fp8Dtype::E5M2),
            "an FP8 GEMM of two E5M2 operands (cuBLASLt has none)"
        );
        gemm_blockwise_composition(a, a_scale_inv, a_blocks, b, b_scale_inv, b_blocks, out)
    }
}

/// The dtype the compositions compute in: f64 for f64 tensors (so that an f64 model's
/// emulation rounds once), f32 for every narrower float.
fn work_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// [`Fp8Ops::fp8_amax`] as Burn operations: `max |x|` in f32, set to NaN where `x` holds a
/// NaN (a maximum drops NaN on some backends; the scaling must see it to skip its update).
pub fn amax_composition<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 1> {
    let has_nan = x.clone().is_nan().any();
    x.abs().max().cast(DType::F32).mask_fill(has_nan, f32::NAN)
}

/// [`Fp8Ops::fp8_quantize`] as Burn operations: the grid values in `x`'s float dtype.
///
/// `v = x · scale` is formed in f32 (f64 for f64 `x`); `|v|` is clamped to the format's max
/// (so ±∞ and anything beyond saturate, as the cast kernels' `satfinite` does), its binade
/// `2^e` (`e` at least the smallest normal exponent) found by five exact comparisons against
/// powers of two, and `|v| / 2^(e - mantissa_bits)` rounded half to even: exact arithmetic
/// only (powers of two), so the result does not depend on a backend's `log2` or fused
/// multiply-adds. NaN stays NaN.
///
/// # Shapes
/// - `x`: `[r, c]`; `scale`: `[1]`
/// - output: `[r, c]`, or `[c, r]` with `transpose`
pub fn quantize_composition<B: Backend>(
    x: Tensor<B, 2>,
    scale: Tensor<B, 1>,
    dtype: Fp8Dtype,
    transpose: bool,
) -> Tensor<B, 2> {
    let out_dtype = x.dtype();
    let work = work_dtype(out_dtype);
    let v = x.cast(work) * scale.cast(work).unsqueeze::<2>();
    let q = round_to_grid(v, dtype).cast(out_dtype);
    if transpose { q.transpose() } else { q }
}

/// `v` (already scaled, in the work dtype) rounded on `dtype`'s grid as
/// [`quantize_composition`] describes: saturated, rounded half to even with exact arithmetic,
/// NaN kept.
pub(crate) fn round_to_grid<B: Backend>(v: Tensor<B, 2>, dtype: Fp8Dtype) -> Tensor<B, 2> {
    let a = v.clone().abs().clamp_max(dtype.max());
    // The binade: the largest 2^e <= a with e in [min_normal, min_normal + 31].
    let mut binade = a
        .zeros_like()
        .add_scalar(2f64.powi(dtype.min_normal_exponent()));
    for step in [16, 8, 4, 2, 1] {
        let higher = binade.clone().mul_scalar(2f64.powi(step));
        binade = binade.mask_where(a.clone().greater_equal(higher.clone()), higher);
    }
    let ulp = binade.mul_scalar(2f64.powi(-dtype.mantissa_bits()));
    let magnitude = (a / ulp.clone()).round() * ulp;
    let q = magnitude * v.clone().sign();
    q.mask_where(v.clone().is_nan(), v)
}

/// [`Fp8Ops::fp8_gemm`] as Burn operations: `a · bᵀ` in f32 (f64 for f64 operands), times
/// `a_scale_inv · b_scale_inv` (one f32 product), cast to `out`.
///
/// # Shapes
/// - `a`: `[m, k]`, `b`: `[n, k]`, the scales `[1]`
/// - output: `[m, n]`
pub fn gemm_composition<B: Backend>(
    a: Tensor<B, 2>,
    a_scale_inv: Tensor<B, 1>,
    b: Tensor<B, 2>,
    b_scale_inv: Tensor<B, 1>,
    out: DType,
) -> Tensor<B, 2> {
    let work = work_dtype(a.dtype());
    let product = a.cast(work).matmul(b.cast(work).transpose());
    let scale = (a_scale_inv.cast(DType::F32) * b_scale_inv.cast(DType::F32)).cast(work);
    (product * scale.unsqueeze::<2>()).cast(out)
}

/// On `Autodiff<B>` the FP8 operations are not differentiable: they run on the inner tensors
/// and return untracked ones. The differentiable FP8 layer is [`fp8_linear`], one node.
impl<B: Fp8Ops, C: CheckpointStrategy> Fp8Ops for Autodiff<B, C> {
    fn fp8_amax(x: Tensor<Self, 2>) -> Tensor<Self, 1> {
        Tensor::from_inner(B::fp8_amax(x.inner()))
    }

    fn fp8_tensorwise_scale(
        amax: Tensor<Self, 1>,
        dtype: Fp8Dtype,
        margin: i32,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>) {
        let (scale, scale_inv) = B::fp8_tensorwise_scale(amax.inner(), dtype, margin);
        (Tensor::from_inner(scale), Tensor::from_inner(scale_inv))
    }

    fn fp8_amax_scale(
        x: Tensor<Self, 2>,
        dtype: Fp8Dtype,
        margin: i32,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>, Tensor<Self, 1>) {
        let (amax, scale, scale_inv) = B::fp8_amax_scale(x.inner(), dtype, margin);
        (
            Tensor::from_inner(amax),
            Tensor::from_inner(scale),
            Tensor::from_inner(scale_inv),
        )
    }

    fn fp8_delayed_update(
        history: Tensor<Self, 1>,
        scale: Tensor<Self, 1>,
        amax: Tensor<Self, 1>,
        dtype: Fp8Dtype,
        margin: i32,
        algo: AmaxComputeAlgo,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>) {
        let (history, scale) = B::fp8_delayed_update(
            history.inner(),
            scale.inner(),
            amax.inner(),
            dtype,
            margin,
            algo,
        );
        (Tensor::from_inner(history), Tensor::from_inner(scale))
    }

    fn fp8_quantize(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        dtype: Fp8Dtype,
        transpose: bool,
    ) -> Tensor<Self, 2> {
        Tensor::from_inner(B::fp8_quantize(x.inner(), scale.inner(), dtype, transpose))
    }

    fn fp8_quantize_both(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        dtype: Fp8Dtype,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (row, transposed) = B::fp8_quantize_both(x.inner(), scale.inner(), dtype);
        (Tensor::from_inner(row), Tensor::from_inner(transposed))
    }

    fn fp8_quantize_both_amax(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        dtype: Fp8Dtype,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>, Tensor<Self, 1>) {
        let (row, transposed, amax) = B::fp8_quantize_both_amax(x.inner(), scale.inner(), dtype);
        (
            Tensor::from_inner(row),
            Tensor::from_inner(transposed),
            Tensor::from_inner(amax),
        )
    }

    fn fp8_gemm(
        a: Tensor<Self, 2>,
        a_dtype: Fp8Dtype,
        a_scale_inv: Tensor<Self, 1>,
        b: Tensor<Self, 2>,
        b_dtype: Fp8Dtype,
        b_scale_inv: Tensor<Self, 1>,
        out: DType,
    ) -> Tensor<Self, 2> {
        Tensor::from_inner(B::fp8_gemm(
            a.inner(),
            a_dtype,
            a_scale_inv.inner(),
            b.inner(),
            b_dtype,
            b_scale_inv.inner(),
            out,
        ))
    }

    fn fp8_quantize_blockwise(
        x: Tensor<Self, 2>,
        dtype: Fp8Dtype,
        blocks: Fp8Blocks,
        margin: i32,
        transpose: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        let (q, inv) = B::fp8_quantize_blockwise(x.inner(), dtype, blocks, margin, transpose);
        (Tensor::from_inner(q), Tensor::from_inner(inv))
    }

    fn fp8_quantize_blockwise_both(
        x: Tensor<Self, 2>,
        dtype: Fp8Dtype,
        blocks: Fp8Blocks,
        margin: i32,
    ) -> [(Tensor<Self, 2>, Tensor<Self, 1>); 2] {
        B::fp8_quantize_blockwise_both(x.inner(), dtype, blocks, margin)
            .map(|(q, inv)| (Tensor::from_inner(q), Tensor::from_inner(inv)))
    }

    fn fp8_gemm_blockwise(
        a: Tensor<Self, 2>,
        a_dtype: Fp8Dtype,
        a_scale_inv: Tensor<Self, 1>,
        a_blocks: Fp8Blocks,
        b: Tensor<Self, 2>,
        b_dtype: Fp8Dtype,
        b_scale_inv: Tensor<Self, 1>,
        b_blocks: Fp8Blocks,
        out: DType,
    ) -> Tensor<Self, 2> {
        Tensor::from_inner(B::fp8_gemm_blockwise(
            a.inner(),
            a_dtype,
            a_scale_inv.inner(),
            a_blocks,
            b.inner(),
            b_dtype,
            b_scale_inv.inner(),
            b_blocks,
            out,
        ))
    }
}

/// Our CUDA backend: the CubeCL amax and cast kernels (one pass for both layouts and the
/// amax where asked together), whose FP8 bits are `U8` tensors that
/// only the FP8 GEMM reads, and cuBLASLt's FP8 GEMM (`burn_megatron_kernels::fused::fp8`,
/// `burn_megatron_kernels::cuda::gemm::gemm_fp8`); burn-cuda keeps the compositions.
#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_megatron_kernels::cuda::{MegatronCudaRuntime, gemm};
    use burn_megatron_kernels::fused::fp8::{self, Fp8Kind};
    use burn_megatron_kernels::fused::fp8_blocks;

    use super::{AmaxComputeAlgo, Fp8Blocks, Fp8Dtype, Fp8Ops};
    use crate::ops::primitive::{raw, wrap};

    /// Whether `part` of the FP8 operations runs as the Burn compositions (the CPU's
    /// emulation) instead of the kernels, as the environment variable `BM_FP8_COMPOSITIONS`
    /// asks: `scales` (amaxes, scales, delayed scaling's update), `casts` (the casts and, as
    /// their values are then grid values in the input's dtype, the GEMMs) or `all`. A
    /// diagnosis aid, read once: a run that changes with it has a kernel at fault, not FP8.
    pub(super) fn composed(part: &str) -> bool {
        static WHICH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let which = WHICH.get_or_init(|| std::env::var("BM_FP8_COMPOSITIONS").unwrap_or_default());
        which == "all" || which == part
    }

    /// The kernels' name of an FP8 format.
    pub(super) fn kind(dtype: Fp8Dtype) -> Fp8Kind {
        match dtype {
            Fp8Dtype::E4M3 => Fp8Kind::E4M3,
            Fp8Dtype::E5M2 => Fp8Kind::E5M2,
        }
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> Fp8Ops
        for CubeBackend<MegatronCudaRuntime, F, I, BT>
    {
        fn fp8_amax(x: Tensor<Self, 2>) -> Tensor<Self, 1> {
            if composed("scales") {
                return super::amax_composition(x);
            }
            wrap(fp8::amax(raw(x)))
        }

        fn fp8_tensorwise_scale(
            amax: Tensor<Self, 1>,
            dtype: Fp8Dtype,
            margin: i32,
        ) -> (Tensor<Self, 1>, Tensor<Self, 1>) {
            if composed("scales") {
                let scale = super::tensorwise_scale(amax, dtype, margin);
                return (scale.clone(), scale.recip());
            }
            let (scale, scale_inv) =
                fp8::tensorwise_scale(raw(amax.cast(DType::F32)), dtype.max(), margin);
            (wrap(scale), wrap(scale_inv))
        }

        fn fp8_amax_scale(
            x: Tensor<Self, 2>,
            dtype: Fp8Dtype,
            margin: i32,
        ) -> (Tensor<Self, 1>, Tensor<Self, 1>, Tensor<Self, 1>) {
            if composed("scales") {
                let amax = Self::fp8_amax(x);
                let (scale, inv) = Self::fp8_tensorwise_scale(amax.clone(), dtype, margin);
                return (amax, scale, inv);
            }
            let (amax, scale, scale_inv) = fp8::amax_scale(raw(x), dtype.max(), margin);
            (wrap(amax), wrap(scale), wrap(scale_inv))
        }

        fn fp8_delayed_update(
            history: Tensor<Self, 1>,
            scale: Tensor<Self, 1>,
            amax: Tensor<Self, 1>,
            dtype: Fp8Dtype,
            margin: i32,
            algo: AmaxComputeAlgo,
        ) -> (Tensor<Self, 1>, Tensor<Self, 1>) {
            if composed("scales") {
                return super::delayed_update_composition(
                    history, scale, amax, dtype, margin, algo,
                );
            }
            let (history, scale) = fp8::delayed_update(
                raw(history.cast(DType::F32)),
                raw(scale.cast(DType::F32)),
                raw(amax.cast(DType::F32)),
                dtype.max(),
                margin,
                algo == AmaxComputeAlgo::MostRecent,
            );
            (wrap(history), wrap(scale))
        }

        fn fp8_quantize(
            x: Tensor<Self, 2>,
            scale: Tensor<Self, 1>,
            dtype: Fp8Dtype,
            transpose: bool,
        ) -> Tensor<Self, 2> {
            if composed("casts") {
                return super::quantize_composition(x, scale, dtype, transpose);
            }
            let scale = raw(scale.cast(DType::F32));
            wrap(fp8::quantize(raw(x), &scale, kind(dtype), transpose))
        }

        fn fp8_quantize_both(
            x: Tensor<Self, 2>,
            scale: Tensor<Self, 1>,
            dtype: Fp8Dtype,
        ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
            if composed("casts") {
                let row = super::quantize_composition(x.clone(), scale.clone(), dtype, false);
                return (row, super::quantize_composition(x, scale, dtype, true));
            }
            let scale = raw(scale.cast(DType::F32));
            let casts = fp8::quantize_both(raw(x), &scale, kind(dtype), false);
            (wrap(casts.row), wrap(casts.transposed))
        }

        fn fp8_quantize_both_amax(
            x: Tensor<Self, 2>,
            scale: Tensor<Self, 1>,
            dtype: Fp8Dtype,
        ) -> (Tensor<Self, 2>, Tensor<Self, 2>, Tensor<Self, 1>) {
            if composed("casts") {
                let amax = Self::fp8_amax(x.clone());
                let (row, transposed) = Self::fp8_quantize_both(x, scale, dtype);
                return (row, transposed, amax);
            }
            let scale = raw(scale.cast(DType::F32));
            let casts = fp8::quantize_both(raw(x), &scale, kind(dtype), true);
            let amax = casts
                .amax
                .expect("quantize_both returns the amax it is asked for");
            (wrap(casts.row), wrap(casts.transposed), wrap(amax))
        }

        fn fp8_gemm(
            a: Tensor<Self, 2>,
            a_dtype: Fp8Dtype,
            a_scale_inv: Tensor<Self, 1>,
            b: Tensor<Self, 2>,
            b_dtype: Fp8Dtype,
            b_scale_inv: Tensor<Self, 1>,
            out: DType,
        ) -> Tensor<Self, 2> {
            if composed("casts") {
                return super::gemm_composition(a, a_scale_inv, b, b_scale_inv, out);
            }
            let (a, b) = (raw(a), raw(b));
            let (a_shape, b_shape) = (a.meta.shape().to_vec(), b.meta.shape().to_vec());
            let a_scale_inv = raw(a_scale_inv.cast(DType::F32));
            let b_scale_inv = raw(b_scale_inv.cast(DType::F32));
            let product = gemm::gemm_fp8(
                &a,
                kind(a_dtype),
                &a_scale_inv,
                &b,
                kind(b_dtype),
                &b_scale_inv,
                out,
                false,
            );
            // cuBLASLt's FP8 GEMMs need each reduced dimension (d_in, d_out and the tokens of
            // a microbatch) a multiple of 16: the main job checks its layout before it starts.
            wrap(product.unwrap_or_else(|e| {
                panic!("FP8 GEMM [{a_shape:?}] x [{b_shape:?}]^T: cuBLASLt cannot take it: {e:?}")
            }))
        }

        /// One kernel a layout (`fused::fp8_blocks`): 1 × 128 blocks, or 128 × 128 squares.
        fn fp8_quantize_blockwise(
            x: Tensor<Self, 2>,
            dtype: Fp8Dtype,
            blocks: Fp8Blocks,
            margin: i32,
            transpose: bool,
        ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
            if composed("casts") {
                return super::quantize_blockwise_composition(x, dtype, blocks, margin, transpose);
            }
            let cast = match blocks {
                Fp8Blocks::Row => fp8_blocks::quantize_blockwise,
                Fp8Blocks::Square => fp8_blocks::quantize_squares,
            };
            let (q, inv) = cast(raw(x), fp8::CastTarget::Fp8(kind(dtype)), margin, transpose);
            (wrap(q), wrap(inv))
        }

        /// Both layouts from one read (`fp8_blocks::quantize_blockwise_both`,
        /// `quantize_squares_both`).
        fn fp8_quantize_blockwise_both(
            x: Tensor<Self, 2>,
            dtype: Fp8Dtype,
            blocks: Fp8Blocks,
            margin: i32,
        ) -> [(Tensor<Self, 2>, Tensor<Self, 1>); 2] {
            if composed("casts") {
                // The one-layout casts, which compose there too.
                return [false, true].map(|transpose| {
                    Self::fp8_quantize_blockwise(x.clone(), dtype, blocks, margin, transpose)
                });
            }
            let cast = match blocks {
                Fp8Blocks::Row => fp8_blocks::quantize_blockwise_both,
                Fp8Blocks::Square => fp8_blocks::quantize_squares_both,
            };
            cast(raw(x), fp8::CastTarget::Fp8(kind(dtype)), margin)
                .map(|(q, inv)| (wrap(q), wrap(inv)))
        }

        fn fp8_gemm_blockwise(
            a: Tensor<Self, 2>,
            a_dtype: Fp8Dtype,
            a_scale_inv: Tensor<Self, 1>,
            a_blocks: Fp8Blocks,
            b: Tensor<Self, 2>,
            b_dtype: Fp8Dtype,
            b_scale_inv: Tensor<Self, 1>,
            b_blocks: Fp8Blocks,
            out: DType,
        ) -> Tensor<Self, 2> {
            if composed("casts") {
                return super::gemm_blockwise_composition(
                    a,
                    a_scale_inv,
                    a_blocks,
                    b,
                    b_scale_inv,
                    b_blocks,
                    out,
                );
            }
            let (a, b) = (raw(a), raw(b));
            let (a_shape, b_shape) = (a.meta.shape().to_vec(), b.meta.shape().to_vec());
            let product = gemm::gemm_fp8_blockwise(
                &a,
                kind(a_dtype),
                &raw(a_scale_inv.cast(DType::F32)),
                scaling(a_blocks),
                &b,
                kind(b_dtype),
                &raw(b_scale_inv.cast(DType::F32)),
                scaling(b_blocks),
                out,
            );
            wrap(product.unwrap_or_else(|e| {
                panic!(
                    "blockwise FP8 GEMM [{a_shape:?}] x [{b_shape:?}]^T: cuBLASLt cannot take \
                     it: {e:?}"
                )
            }))
        }
    }

    /// cuBLASLt's scale mode of a block shape.
    fn scaling(blocks: Fp8Blocks) -> gemm::BlockScaling {
        match blocks {
            Fp8Blocks::Row => gemm::BlockScaling::Vec128,
            Fp8Blocks::Square => gemm::BlockScaling::Square128,
        }
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> Fp8Ops
        for CubeBackend<CudaRuntime, F, I, BT>
    {
    }
}

/// wgpu: the compositions.
#[cfg(feature = "wgpu")]
impl<F, I, BT> Fp8Ops for burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}
