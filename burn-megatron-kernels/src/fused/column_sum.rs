//! Deterministic column sums over the rows of `dy: [rows, columns]`, f32 accumulation and no
//! atomics: the bias gradients of the linear layers and bias-GeLU (`Σ_rows dy`) and the
//! norms' weight gradients (`Σ_rows dy · x̂` and `Σ_rows dy`).
//!
//! Two stages, each in a fixed order, so the same inputs give the same bits on every run:
//! 1. [`partials_kernel`]: cube `(i, b)` sums rows `b · rows_per_block ..` of a span of
//!    columns, one [`Vector`] of columns a thread (coalesced 16-byte loads in bf16), into row
//!    `b` of a `[blocks, columns]` f32 buffer.
//! 2. [`total_kernel`]: each column's blocks, in [`SUM_LANES`] interleaved lanes, then the lanes
//!    in order; written in the output's dtype.
//!
//! The norms' backward writes its stage-one partials itself, next to `dx`, and calls
//! [`totals_into`].

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::vector_width;

/// Threads per cube of the first stage.
const PARTIAL_THREADS: u32 = 128;
/// Rows per block of the first stage, at least; more when there would be more than
/// [`MAX_BLOCKS`] blocks.
const MIN_ROWS_PER_BLOCK: usize = 32;
/// At most this many partial sums per column.
const MAX_BLOCKS: usize = 512;
/// Columns per cube of the second stage.
const SUM_COLUMNS: u32 = 4;
/// Threads per column of the second stage: each sums every `SUM_LANES`-th block, so a lane
/// waits on at most `MAX_BLOCKS / SUM_LANES` loads in a row (at 16 lanes, 32 loads made the
/// stage latency-bound: 12 µs a launch on the H100).
pub const SUM_LANES: u32 = 64;

/// The normalised input `x̂ = (x - mean) · rstd` of a norm, whose products with `dy` are summed
/// next to `dy` itself (the scale and shift gradients).
#[derive(Debug, Clone)]
pub struct Normalised<R: CubeRuntime> {
    /// `[rows, columns]`, `dy`'s dtype.
    pub x: CubeTensor<R>,
    /// `[rows]` f32 (ignored for RMSNorm).
    pub mean: CubeTensor<R>,
    /// `[rows]` f32.
    pub rstd: CubeTensor<R>,
    /// Whether `mean` is subtracted (LayerNorm) or not (RMSNorm).
    pub centred: bool,
}

/// Stage one: partial sums of `dy` (into `partial_dy`, when `sum_dy`) and of `dy · x̂` (into
/// `partial_dyx`, when `normalised`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn partials_kernel<F: Float, N: Size>(
    dy: &Tensor<Vector<F, N>>,
    x: &Tensor<Vector<F, N>>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    partial_dy: &mut Tensor<Vector<f32, N>>,
    partial_dyx: &mut Tensor<Vector<f32, N>>,
    rows: u32,
    rows_per_block: u32,
    #[comptime] sum_dy: bool,
    #[comptime] normalised: bool,
    #[comptime] centred: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let vector = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if vector >= dy.shape(1) / width {
        terminate!();
    }
    // Element offsets to vector offsets: the vectorised axis has stride 1 whenever `width` is
    // above 1, and every other stride is a multiple of `width`.
    let column = vector * width;
    let block = CUBE_POS_Y as usize;
    let start = block * rows_per_block as usize;
    let mut end = start + rows_per_block as usize;
    if end > rows as usize {
        end = rows as usize;
    }
    let mut total_dy = Vector::<f32, N>::new(0.0);
    let mut total_dyx = Vector::<f32, N>::new(0.0);
    let mut row = start;
    while row < end {
        let g =
            Vector::<f32, N>::cast_from(dy[(row * dy.stride(0) + column * dy.stride(1)) / width]);
        if sum_dy {
            total_dy += g;
        }
        if normalised {
            let mut mu = f32::new(0.0);
            if centred {
                mu = mean[row * mean.stride(0)];
            }
            let value =
                Vector::<f32, N>::cast_from(x[(row * x.stride(0) + column * x.stride(1)) / width]);
            let x_hat = (value - Vector::new(mu)) * Vector::new(rstd[row * rstd.stride(0)]);
            total_dyx += g * x_hat;
        }
        row += 1;
    }
    if sum_dy {
        partial_dy[(block * partial_dy.stride(0) + column * partial_dy.stride(1)) / width] =
            total_dy;
    }
    if normalised {
        partial_dyx[(block * partial_dyx.stride(0) + column * partial_dyx.stride(1)) / width] =
            total_dyx;
    }
}

/// Stage two: lane `l` of a column sums blocks `l, l + SUM_LANES, …` in order, then lane 0
/// adds the lanes in order and writes the total in `O`.
#[cube(launch)]
fn total_kernel<O: Float>(
    partial: &Tensor<f32>,
    total: &mut Tensor<O>,
    blocks: u32,
    columns: u32,
    #[define(O)] _dtype: StorageType,
) {
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let lane = UNIT_POS_Y as usize;
    let lanes = CUBE_DIM_Y as usize;
    let mut lane_sums = SharedMemory::<f32>::new((SUM_COLUMNS * SUM_LANES) as usize);
    let slot = UNIT_POS_X as usize * lanes;
    let mut sum = f32::new(0.0);
    if col < columns as usize {
        let mut block = lane;
        while block < blocks as usize {
            sum += partial[block * partial.stride(0) + col * partial.stride(1)];
            block += lanes;
        }
    }
    lane_sums[slot + lane] = sum;
    sync_cube();
    if lane == 0 && col < columns as usize {
        let mut total_sum = f32::new(0.0);
        let mut l: usize = 0;
        while l < lanes {
            total_sum += lane_sums[slot + l];
            l += 1;
        }
        total[col * total.stride(0)] = O::cast_from(total_sum);
    }
}

/// `(blocks, rows_per_block)` of the first stage.
fn blocks(rows: usize) -> (usize, usize) {
    let rows_per_block = rows.div_ceil(MAX_BLOCKS).max(MIN_ROWS_PER_BLOCK);
    (rows.div_ceil(rows_per_block).max(1), rows_per_block)
}

fn buffer<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(like.client.clone(), like.device.clone(), shape, dtype)
}

/// The column sums of `dy` (`[rows, columns]`, any strides, f32/f16/bf16) written into
/// `sum_dy` (when given) and of `dy · x̂` into `sum_dyx` (when `normalised` is given): both
/// `[columns]`, any float dtype, any stride.
pub fn column_sums_into<R: CubeRuntime>(
    dy: CubeTensor<R>,
    normalised: Option<Normalised<R>>,
    sum_dy: Option<CubeTensor<R>>,
    sum_dyx: Option<CubeTensor<R>>,
) {
    let dims = dy.meta.shape().as_slice();
    assert_eq!(dims.len(), 2, "column sums take dy: [rows, columns]");
    let (rows, columns) = (dims[0], dims[1]);
    assert_eq!(
        normalised.is_some(),
        sum_dyx.is_some(),
        "dy · x̂ is summed exactly when x̂ is given"
    );
    if columns == 0 || (sum_dy.is_none() && sum_dyx.is_none()) {
        return;
    }
    let client = dy.client.clone();
    let (blocks, rows_per_block) = blocks(rows);
    let partial_dy = sum_dy
        .as_ref()
        .map(|_| buffer(&dy, Shape::new([blocks, columns]), DType::F32));
    let partial_dyx = sum_dyx
        .as_ref()
        .map(|_| buffer(&dy, Shape::new([blocks, columns]), DType::F32));
    let placeholder = partial_dy
        .clone()
        .or_else(|| partial_dyx.clone())
        .expect("one sum is asked for");
    let (x, mean, rstd, centred) = match &normalised {
        Some(n) => (n.x.clone(), n.mean.clone(), n.rstd.clone(), n.centred),
        None => (dy.clone(), placeholder.clone(), placeholder.clone(), false),
    };
    let width = {
        let mut tensors = vec![&dy, &placeholder];
        if normalised.is_some() {
            tensors.push(&x);
        }
        vector_width(&tensors)
    };
    let cubes = (columns / width).div_ceil(PARTIAL_THREADS as usize) as u32;
    if rows > 0 {
        partials_kernel::launch::<R>(
            &client,
            CubeCount::Static(cubes, blocks as u32, 1),
            CubeDim::new_1d(PARTIAL_THREADS),
            width,
            dy.clone().into_tensor_arg(),
            x.into_tensor_arg(),
            mean.into_tensor_arg(),
            rstd.into_tensor_arg(),
            partial_dy
                .clone()
                .unwrap_or_else(|| placeholder.clone())
                .into_tensor_arg(),
            partial_dyx
                .clone()
                .unwrap_or_else(|| placeholder.clone())
                .into_tensor_arg(),
            rows as u32,
            rows_per_block as u32,
            partial_dy.is_some(),
            normalised.is_some(),
            centred,
            dy.dtype.into(),
        );
    }
    // With no rows the partials are never written: sum no block instead.
    let blocks = if rows > 0 { blocks } else { 0 };
    if let (Some(partial), Some(out)) = (partial_dy, sum_dy) {
        totals_into(partial, blocks, out);
    }
    if let (Some(partial), Some(out)) = (partial_dyx, sum_dyx) {
        totals_into(partial, blocks, out);
    }
}

/// Stage two on its own: the sums over the first `blocks` rows of `partial` (`[at least
/// blocks, columns]`, f32), written into `out` (`[columns]`, any float dtype and stride). The
/// norms' backward kernel writes such partials itself.
pub fn totals_into<R: CubeRuntime>(partial: CubeTensor<R>, blocks: usize, out: CubeTensor<R>) {
    let columns = partial.meta.shape().as_slice()[1];
    if columns == 0 {
        return;
    }
    let dtype = out.dtype.into();
    total_kernel::launch::<R>(
        &partial.client.clone(),
        CubeCount::Static(columns.div_ceil(SUM_COLUMNS as usize) as u32, 1, 1),
        CubeDim::new_2d(SUM_COLUMNS, SUM_LANES),
        partial.into_tensor_arg(),
        out.into_tensor_arg(),
        blocks as u32,
        columns as u32,
        dtype,
    );
}

/// `Σ_rows dy` of `dy: [rows, columns]` (any strides, f32/f16/bf16), accumulated in f32 in a
/// fixed order, as `[columns]` in `dtype`: the bias gradient of a layer whose output
/// gradient is `dy`.
pub fn column_sum<R: CubeRuntime>(dy: CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    let columns = dy.meta.shape().as_slice().get(1).copied().unwrap_or(0);
    let out = buffer(&dy, Shape::new([columns]), dtype);
    column_sums_into(dy, None, Some(out.clone()), None);
    out
}
