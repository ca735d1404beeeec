//! Blockwise FP8 scaling (Megatron's `--fp8-recipe blockwise`, DeepSeek-V3's recipe): each
//! block of a tensor is cast under the scale of its own amax, so one outlier costs its block
//! the precision, not the whole tensor. Activations and gradients use blocks of 1 × 128 along
//! the GEMM's inner dimension, weights 128 × 128 squares; cuBLASLt's FP8 GEMM applies the
//! reciprocal scales block by block (its `VEC128_32F` and `BLK128x128_32F` scale modes).
//!
//! A cast in one layout gives the FP8 values and the reciprocal scales, flattened in the
//! layout cuBLASLt reads ([`Fp8Blocks::scale_len`]):
//! - 1 × 128 of a `[rows, k]` operand: `[k / 128, rows]`, the block column outermost
//!   (`inv[kb · rows + r]` for row `r`'s block `kb`);
//! - 128 × 128 of a `[rows, k]` operand: `[rows / 128, ⌈k / 128⌉₄]`, row-major, each row
//!   padded to a multiple of 4 scales (16 bytes; the padding holds ones and is not read).
//!
//! The two layouts of an activation are different casts (the row-major one has blocks along
//! the features, the transposed one, which the weight gradient reads, along the tokens); a
//! weight's two layouts share their squares. Every dimension is a multiple of 128 (checked by
//! the layer, [`check_blockwise_shape`]).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use super::{Fp8Dtype, round_to_grid, scales_from_amaxes, work_dtype};

/// The side of a block.
pub const BLOCK: usize = 128;

/// How a blockwise cast groups the elements under one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Blocks {
    /// 128 consecutive elements of a row of the cast (1 × 128): activations and gradients.
    Row,
    /// 128 × 128 squares: weights.
    Square,
}

impl Fp8Blocks {
    /// The number of reciprocal scales of a `[rows, cols]` cast, padding included.
    pub fn scale_len(self, rows: usize, cols: usize) -> usize {
        match self {
            Self::Row => rows * (cols / BLOCK),
            Self::Square => rows / BLOCK * padded_blocks(cols),
        }
    }
}

/// `⌈cols / 128⌉` rounded up to a multiple of 4: a square-block scale row's length.
fn padded_blocks(cols: usize) -> usize {
    cols.div_ceil(BLOCK).next_multiple_of(4)
}

/// Whether a blockwise cast can take a `[rows, cols]` tensor: both multiples of 128.
pub fn check_blockwise_shape(rows: usize, cols: usize) -> Result<(), String> {
    match rows.is_multiple_of(BLOCK) && cols.is_multiple_of(BLOCK) && rows * cols > 0 {
        true => Ok(()),
        false => Err(format!(
            "blockwise FP8 scaling casts blocks of 128: a [{rows}, {cols}] operand needs both \
             sides a positive multiple of 128 (hidden and FFN sizes per tensor-parallel rank, \
             and the tokens of a micro-batch per context-parallel rank)"
        )),
    }
}

/// The values of `x`'s blockwise cast before rounding, `x · scale` of each element's block in
/// the work dtype (f32, f64 for f64), laid out as the cast (`[c, r]` with `transpose`), and the
/// reciprocal scales in cuBLASLt's layout (f32). Each block's scale is the largest power of
/// two at most [`scales_from_amaxes`]' `max / amax / 2^margin`, 1 for a block of zeros or one
/// holding a NaN or an infinity (a NaN stays NaN through the cast, as under tensorwise
/// scaling).
///
/// # Shapes
/// - `x`: `[r, c]`, both multiples of 128
/// - output: `[r, c]` (`[c, r]` with `transpose`), and `[scale_len]`
fn blockwise_scaled<B: Backend>(
    x: Tensor<B, 2>,
    dtype: Fp8Dtype,
    blocks: Fp8Blocks,
    margin: i32,
    transpose: bool,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let work = work_dtype(x.dtype());
    let x = x.cast(work);
    let x = if transpose { x.transpose() } else { x };
    let [rows, cols] = x.dims();
    let col_blocks = cols / BLOCK;
    // `[row groups, rows a group, column blocks, 128]`: a block is one group's one column block.
    let (groups, per_group) = match blocks {
        Fp8Blocks::Row => (rows, 1),
        Fp8Blocks::Square => (rows / BLOCK, BLOCK),
    };
    let grouped = x.reshape([groups, per_group, col_blocks, BLOCK]);
    let has_nan = grouped.clone().is_nan().any_dim(3).any_dim(1);
    let amax = grouped
        .clone()
        .abs()
        .max_dim(3)
        .max_dim(1)
        .cast(DType::F32)
        .mask_fill(has_nan, f32::NAN);
    let n = groups * col_blocks;
    let device = amax.device();
    let ones = Tensor::<B, 1>::ones([n], (&device, DType::F32));
    let tops = Tensor::<B, 1>::full([n], dtype.max(), (&device, DType::F32));
    let scales = power_of_two_below(scales_from_amaxes(amax.reshape([n]), ones, tops, margin));
    let scaled = grouped
        * scales
            .clone()
            .cast(work)
            .reshape([groups, 1, col_blocks, 1]);
    let inv = scales.recip().reshape([groups, col_blocks]);
    let inv = match blocks {
        Fp8Blocks::Row => inv.transpose(),
        Fp8Blocks::Square => match padded_blocks(cols) - col_blocks {
            0 => inv,
            pad => {
                let padding = Tensor::<B, 2>::ones([groups, pad], (&device, DType::F32));
                Tensor::cat(vec![inv, padding], 1)
            }
        },
    };
    let len = blocks.scale_len(rows, cols);
    (scaled.reshape([rows, cols]), inv.reshape([len]))
}

/// The largest power of two at most each element of `s` (positive, finite, normal f32):
/// `2^⌊log₂ s⌋` from the natural log, corrected by exact comparisons where the logarithm
/// lands a binade off. Blockwise scales are powers of two (Transformer Engine's default for
/// this recipe): the scaling and the GEMM's rescaling of each block are then exact, so a
/// product split over ranks by blocks sums the same values as on one device.
fn power_of_two_below<B: Backend>(s: Tensor<B, 1>) -> Tensor<B, 1> {
    let exponent = (s.clone().log() / std::f64::consts::LN_2).floor();
    let p = exponent.ones_like().mul_scalar(2.0).powf(exponent);
    let p = p
        .clone()
        .mask_where(p.clone().greater(s.clone()), p.div_scalar(2.0));
    let doubled = p.clone().mul_scalar(2.0);
    p.mask_where(doubled.clone().lower_equal(s), doubled)
}

/// [`Fp8Ops::fp8_quantize_blockwise`](super::Fp8Ops::fp8_quantize_blockwise) as Burn
/// operations: each block's amax, its scale (the largest power of two at most `max / amax /
/// 2^margin`, 1 for a block of zeros or one holding a NaN or an infinity), the values times
/// their block's scale in f32 (f64 for f64 `x`) rounded on `dtype`'s grid (as
/// [`quantize_composition`](super::quantize_composition) rounds), in `x`'s float dtype, and
/// the reciprocal scales in cuBLASLt's layout.
///
/// # Shapes
/// - `x`: `[r, c]`, both multiples of 128
/// - output: `[r, c]` (`[c, r]` with `transpose`), and `[Fp8Blocks::scale_len]`
pub fn quantize_blockwise_composition<B: Backend>(
    x: Tensor<B, 2>,
    dtype: Fp8Dtype,
    blocks: Fp8Blocks,
    margin: i32,
    transpose: bool,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let out = x.dtype();
    let (scaled, inv) = blockwise_scaled(x, dtype, blocks, margin, transpose);
    (round_to_grid(scaled, dtype).cast(out), inv)
}

/// The reciprocal scale of each row's block of 128 along `k`, `[k / 128, rows]`, from a
/// blockwise cast's scales in cuBLASLt's layout (a square's scale repeated over its 128 rows).
fn row_factors<B: Backend>(
    inv: Tensor<B, 1>,
    blocks: Fp8Blocks,
    rows: usize,
    k: usize,
) -> Tensor<B, 2> {
    let col_blocks = k / BLOCK;
    match blocks {
        Fp8Blocks::Row => inv.reshape([col_blocks, rows]),
        Fp8Blocks::Square => {
            let squares = inv
                .reshape([rows / BLOCK, padded_blocks(k)])
                .narrow(1, 0, col_blocks)
                .transpose();
            squares
                .reshape([col_blocks, rows / BLOCK, 1])
                .expand([col_blocks, rows / BLOCK, BLOCK])
                .reshape([col_blocks, rows])
        }
    }
}

/// [`Fp8Ops::fp8_gemm_blockwise`](super::Fp8Ops::fp8_gemm_blockwise) as Burn operations, as
/// the GPU computes it: for each block of 128 along `k`, the product of the grid values (in
/// f32, f64 for f64 operands: exact but for long carries) scaled by the two operands'
/// reciprocal scales of that block, then the blocks' partial products summed. A product split
/// over ranks by whole blocks of `k` (a row-parallel layer) sums the same partial products.
///
/// # Shapes
/// - `a`: `[m, k]`, `b`: `[n, k]`, the scales in cuBLASLt's layout
/// - output: `[m, n]`
pub fn gemm_blockwise_composition<B: Backend>(
    a: Tensor<B, 2>,
    a_scale_inv: Tensor<B, 1>,
    a_blocks: Fp8Blocks,
    b: Tensor<B, 2>,
    b_scale_inv: Tensor<B, 1>,
    b_blocks: Fp8Blocks,
    out: DType,
) -> Tensor<B, 2> {
    let work = work_dtype(a.dtype());
    let ([m, k], [n, _]) = (a.dims(), b.dims());
    let col_blocks = k / BLOCK;
    // `[k / 128, rows, 128]`: each block of `k` a batch.
    let batched = |q: Tensor<B, 2>, rows| {
        q.cast(work)
            .reshape([rows, col_blocks, BLOCK])
            .swap_dims(0, 1)
    };
    let partial = batched(a, m).matmul(batched(b, n).swap_dims(1, 2));
    let a_inv = row_factors(a_scale_inv, a_blocks, m, k).cast(work);
    let b_inv = row_factors(b_scale_inv, b_blocks, n, k).cast(work);
    let scaled = partial * a_inv.reshape([col_blocks, m, 1]) * b_inv.reshape([col_blocks, 1, n]);
    scaled.sum_dim(0).reshape([m, n]).cast(out)
}
