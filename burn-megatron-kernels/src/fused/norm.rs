//! LayerNorm and RMSNorm over the rows of `x: [rows, hidden]`, forward and backward, with f32
//! statistics and math for any storage dtype (Megatron's `FusedLayerNormAffineFunction` and
//! `FusedRMSNormAffineFunction`).
//!
//! - Forward: one cube per row. Its threads stride over the row (any width; 16k is 64
//!   elements a thread), sum through shared memory for the mean (LayerNorm), then again for
//!   the variance of the centred row (two passes: no cancellation), and write
//!   `(x - mean) · rstd · scale (+ shift)` and the row's f32 `mean` and `rstd`.
//! - Backward, `dx`: one cube per row, two shared-memory sums (`Σ ĝ` and `Σ ĝ · x̂`, with
//!   `ĝ = dy · scale`), then `rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ · x̂))`.
//! - Backward, `dscale` and `dshift`: a column sum over the rows, in two deterministic stages
//!   and no atomics. Each cube of `column_partials_kernel` owns a chunk of rows and a span
//!   of columns, one thread a column, and writes its partial sums of `dy · x̂` and `dy` to a
//!   `[blocks, hidden]` f32 buffer; `column_sum_kernel` then adds the blocks of each column
//!   in a fixed order (16 interleaved lanes, then the lanes). The same inputs give the same
//!   bits on every run.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Threads per cube of the column kernels.
const COLUMN_THREADS: u32 = 256;
/// Rows per block of the first column stage, at least; more when there would be more than
/// [`MAX_BLOCKS`] blocks.
const MIN_ROWS_PER_BLOCK: usize = 32;
/// At most this many partial sums per column.
const MAX_BLOCKS: usize = 512;

/// Which normalisation the kernels compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `(x - mean) / sqrt(var + eps)`.
    LayerNorm,
    /// `x / sqrt(mean(x²) + eps)`.
    RmsNorm,
}

/// The forward's output and per-row statistics.
#[derive(Debug)]
pub struct Forward<R: CubeRuntime> {
    /// `[rows, hidden]`, `x`'s dtype.
    pub output: CubeTensor<R>,
    /// `[rows]` f32; zero for RMSNorm.
    pub mean: CubeTensor<R>,
    /// `[rows]` f32, `1 / sqrt(var + eps)`.
    pub rstd: CubeTensor<R>,
}

/// The backward's gradients.
#[derive(Debug)]
pub struct Gradients<R: CubeRuntime> {
    /// `[rows, hidden]`, `x`'s dtype.
    pub x: CubeTensor<R>,
    /// `[hidden]` f32.
    pub scale: CubeTensor<R>,
    /// `[hidden]` f32, when asked for.
    pub shift: Option<CubeTensor<R>>,
}

/// The sum of every thread's `value` over the cube, through `partials` (one slot a thread;
/// free again on return).
#[cube]
fn cube_sum(partials: &mut SharedMemory<f32>, value: f32) -> f32 {
    let tid = UNIT_POS_X as usize;
    partials[tid] = value;
    sync_cube();
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if tid < half {
            partials[tid] += partials[tid + half];
        }
        sync_cube();
        half /= 2;
    }
    let total = partials[0];
    // Every thread has read the total before the next sum overwrites it.
    sync_cube();
    total
}

#[cube]
fn row_index(rows: u32) -> usize {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= rows as usize {
        terminate!();
    }
    row
}

#[cube(launch)]
fn forward_kernel<F: Float>(
    x: &Tensor<F>,
    scale: &Tensor<F>,
    shift: &Tensor<F>,
    output: &mut Tensor<F>,
    mean: &mut Tensor<f32>,
    rstd: &mut Tensor<f32>,
    rows: u32,
    hidden: u32,
    epsilon: f32,
    #[comptime] threads: u32,
    #[comptime] layer_norm: bool,
    #[comptime] has_shift: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(rows);
    let tid = UNIT_POS_X as usize;
    let stride = CUBE_DIM_X as usize;
    let n = f32::cast_from(hidden);
    let hidden = hidden as usize;
    let (x_row, x_step) = (row * x.stride(0), x.stride(1));
    let mut partials = SharedMemory::<f32>::new(threads as usize);

    let mut mu = f32::new(0.0);
    if layer_norm {
        let mut sum = f32::new(0.0);
        let mut j = tid;
        while j < hidden {
            sum += f32::cast_from(x[x_row + j * x_step]);
            j += stride;
        }
        mu = cube_sum(&mut partials, sum) / n;
    }
    let mut squares = f32::new(0.0);
    let mut j = tid;
    while j < hidden {
        let centred = f32::cast_from(x[x_row + j * x_step]) - mu;
        squares += centred * centred;
        j += stride;
    }
    let variance = cube_sum(&mut partials, squares) / n;
    let r = f32::new(1.0) / (variance + epsilon).sqrt();

    let (out_row, out_step) = (row * output.stride(0), output.stride(1));
    let mut j = tid;
    while j < hidden {
        let normalised = (f32::cast_from(x[x_row + j * x_step]) - mu) * r;
        let mut y = normalised * f32::cast_from(scale[j * scale.stride(0)]);
        if has_shift {
            y += f32::cast_from(shift[j * shift.stride(0)]);
        }
        output[out_row + j * out_step] = F::cast_from(y);
        j += stride;
    }
    if tid == 0 {
        mean[row * mean.stride(0)] = mu;
        rstd[row * rstd.stride(0)] = r;
    }
}

#[cube(launch)]
fn backward_kernel<F: Float>(
    x: &Tensor<F>,
    scale: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    grad: &Tensor<F>,
    grad_x: &mut Tensor<F>,
    rows: u32,
    hidden: u32,
    #[comptime] threads: u32,
    #[comptime] layer_norm: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(rows);
    let tid = UNIT_POS_X as usize;
    let stride = CUBE_DIM_X as usize;
    let n = f32::cast_from(hidden);
    let hidden = hidden as usize;
    let (x_row, x_step) = (row * x.stride(0), x.stride(1));
    let (g_row, g_step) = (row * grad.stride(0), grad.stride(1));
    let mut mu = f32::new(0.0);
    if layer_norm {
        mu = mean[row * mean.stride(0)];
    }
    let r = rstd[row * rstd.stride(0)];

    let mut sum_g = f32::new(0.0);
    let mut sum_gx = f32::new(0.0);
    let mut j = tid;
    while j < hidden {
        let normalised = (f32::cast_from(x[x_row + j * x_step]) - mu) * r;
        let g =
            f32::cast_from(grad[g_row + j * g_step]) * f32::cast_from(scale[j * scale.stride(0)]);
        sum_g += g;
        sum_gx += g * normalised;
        j += stride;
    }
    let mut partials = SharedMemory::<f32>::new(threads as usize);
    let mut mean_g = f32::new(0.0);
    if layer_norm {
        mean_g = cube_sum(&mut partials, sum_g) / n;
    }
    let mean_gx = cube_sum(&mut partials, sum_gx) / n;

    let (out_row, out_step) = (row * grad_x.stride(0), grad_x.stride(1));
    let mut j = tid;
    while j < hidden {
        let normalised = (f32::cast_from(x[x_row + j * x_step]) - mu) * r;
        let g =
            f32::cast_from(grad[g_row + j * g_step]) * f32::cast_from(scale[j * scale.stride(0)]);
        grad_x[out_row + j * out_step] = F::cast_from(r * (g - mean_g - normalised * mean_gx));
        j += stride;
    }
}

/// Stage one of `dscale` (and `dshift`): cube `(i, b)` sums rows `b · rows_per_block ..` of
/// columns `i · 256 ..`, one thread a column, into row `b` of the partial buffers.
#[cube(launch)]
fn column_partials_kernel<F: Float>(
    x: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    grad: &Tensor<F>,
    partial_scale: &mut Tensor<f32>,
    partial_shift: &mut Tensor<f32>,
    rows: u32,
    hidden: u32,
    rows_per_block: u32,
    #[comptime] layer_norm: bool,
    #[comptime] has_shift: bool,
    #[define(F)] _dtype: StorageType,
) {
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if col >= hidden as usize {
        terminate!();
    }
    let block = CUBE_POS_Y as usize;
    let start = block * rows_per_block as usize;
    let mut end = start + rows_per_block as usize;
    if end > rows as usize {
        end = rows as usize;
    }
    let mut sum_scale = f32::new(0.0);
    let mut sum_shift = f32::new(0.0);
    let mut row = start;
    while row < end {
        let mut mu = f32::new(0.0);
        if layer_norm {
            mu = mean[row * mean.stride(0)];
        }
        let normalised = (f32::cast_from(x[row * x.stride(0) + col * x.stride(1)]) - mu)
            * rstd[row * rstd.stride(0)];
        let dy = f32::cast_from(grad[row * grad.stride(0) + col * grad.stride(1)]);
        sum_scale += dy * normalised;
        sum_shift += dy;
        row += 1;
    }
    partial_scale[block * partial_scale.stride(0) + col * partial_scale.stride(1)] = sum_scale;
    if has_shift {
        partial_shift[block * partial_shift.stride(0) + col * partial_shift.stride(1)] = sum_shift;
    }
}

/// Columns per cube of [`column_sum_kernel`].
const SUM_COLUMNS: u32 = 16;
/// Threads per column of [`column_sum_kernel`]: each sums every `SUM_LANES`-th block.
const SUM_LANES: u32 = 16;

/// Stage two: each column's partial sums over the blocks. Lane `l` of a column sums blocks
/// `l, l + SUM_LANES, …` in order, then lane 0 adds the lanes in order: a fixed order, so
/// the same bits on every run, with `SUM_LANES` loads in flight per column instead of one.
#[cube(launch)]
fn column_sum_kernel(partial: &Tensor<f32>, total: &mut Tensor<f32>, blocks: u32, hidden: u32) {
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let lane = UNIT_POS_Y as usize;
    let lanes = CUBE_DIM_Y as usize;
    let mut lane_sums = SharedMemory::<f32>::new((SUM_COLUMNS * SUM_LANES) as usize);
    let slot = UNIT_POS_X as usize * lanes;
    let mut sum = f32::new(0.0);
    if col < hidden as usize {
        let mut block = lane;
        while block < blocks as usize {
            sum += partial[block * partial.stride(0) + col * partial.stride(1)];
            block += lanes;
        }
    }
    lane_sums[slot + lane] = sum;
    sync_cube();
    if lane == 0 && col < hidden as usize {
        let mut total_sum = f32::new(0.0);
        let mut l: usize = 0;
        while l < lanes {
            total_sum += lane_sums[slot + l];
            l += 1;
        }
        total[col * total.stride(0)] = total_sum;
    }
}

/// One cube per row (a 2D grid within every runtime's limit) of a power-of-two thread count
/// fitting the row.
fn row_launch(rows: usize, hidden: usize) -> (CubeCount, u32) {
    let threads = hidden.div_ceil(4).next_power_of_two().clamp(32, 256) as u32;
    let x = rows.min(65_535);
    (
        CubeCount::Static(x as u32, rows.div_ceil(x) as u32, 1),
        threads,
    )
}

/// `(blocks, rows_per_block)` of the first column stage.
fn column_blocks(rows: usize) -> (usize, usize) {
    let rows_per_block = rows.div_ceil(MAX_BLOCKS).max(MIN_ROWS_PER_BLOCK);
    (rows.div_ceil(rows_per_block), rows_per_block)
}

fn rows_hidden(shape: &Shape) -> (usize, usize) {
    let dims = shape.as_slice();
    assert_eq!(dims.len(), 2, "the norm kernels take x: [rows, hidden]");
    (dims[0], dims[1])
}

fn f32_buffer<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(like.client.clone(), like.device.clone(), shape, DType::F32)
}

/// `(x - mean) · rstd · scale (+ shift)` (LayerNorm) or `x · rstd · scale (+ shift)`
/// (RMSNorm) for `x: [rows, hidden]` (any strides, any float dtype) and `scale`, `shift:
/// [hidden]` of `x`'s dtype, with each row's f32 statistics.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    shift: Option<CubeTensor<R>>,
    kind: Kind,
    epsilon: f64,
) -> Forward<R> {
    let (rows, _) = rows_hidden(x.meta.shape());
    let output = empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    );
    let mean = f32_buffer(&x, Shape::new([rows]));
    let rstd = f32_buffer(&x, Shape::new([rows]));
    forward_into(
        x,
        scale,
        shift,
        kind,
        epsilon,
        Forward {
            output: output.clone(),
            mean: mean.clone(),
            rstd: rstd.clone(),
        },
    );
    Forward { output, mean, rstd }
}

/// [`forward`] written into `out` (any strides): tests pass poisoned buffers to catch
/// elements the kernel does not write.
pub fn forward_into<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    shift: Option<CubeTensor<R>>,
    kind: Kind,
    epsilon: f64,
    out: Forward<R>,
) {
    let (rows, hidden) = rows_hidden(x.meta.shape());
    if rows == 0 || hidden == 0 {
        return;
    }
    let (count, threads) = row_launch(rows, hidden);
    let has_shift = shift.is_some();
    let shift = shift.unwrap_or_else(|| scale.clone());
    let dtype = x.dtype.into();
    forward_kernel::launch::<R>(
        &x.client.clone(),
        count,
        CubeDim::new_1d(threads),
        x.into_tensor_arg(),
        scale.into_tensor_arg(),
        shift.into_tensor_arg(),
        out.output.into_tensor_arg(),
        out.mean.into_tensor_arg(),
        out.rstd.into_tensor_arg(),
        rows as u32,
        hidden as u32,
        epsilon as f32,
        threads,
        kind == Kind::LayerNorm,
        has_shift,
        dtype,
    );
}

/// The gradients of [`forward`]'s `x`, scale and (with `with_shift`) shift, given `x`, the
/// scale (`x`'s dtype), the forward's f32 `mean` and `rstd`, and the output's gradient `grad`
/// (`x`'s shape and dtype, any strides).
pub fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    mean: CubeTensor<R>,
    rstd: CubeTensor<R>,
    grad: CubeTensor<R>,
    kind: Kind,
    with_shift: bool,
) -> Gradients<R> {
    let (_, hidden) = rows_hidden(x.meta.shape());
    let grad_x = empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    );
    let grad_scale = f32_buffer(&x, Shape::new([hidden]));
    let grad_shift = with_shift.then(|| f32_buffer(&x, Shape::new([hidden])));
    backward_into(
        x,
        scale,
        mean,
        rstd,
        grad,
        kind,
        Gradients {
            x: grad_x.clone(),
            scale: grad_scale.clone(),
            shift: grad_shift.clone(),
        },
    );
    Gradients {
        x: grad_x,
        scale: grad_scale,
        shift: grad_shift,
    }
}

/// [`backward`] written into `out` (any strides; `out.shift` present for a shift gradient).
pub fn backward_into<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    mean: CubeTensor<R>,
    rstd: CubeTensor<R>,
    grad: CubeTensor<R>,
    kind: Kind,
    out: Gradients<R>,
) {
    let (rows, hidden) = rows_hidden(x.meta.shape());
    if hidden == 0 {
        return;
    }
    let client = x.client.clone();
    let dtype: StorageType = x.dtype.into();
    let layer_norm = kind == Kind::LayerNorm;
    if rows > 0 {
        let (count, threads) = row_launch(rows, hidden);
        backward_kernel::launch::<R>(
            &client,
            count,
            CubeDim::new_1d(threads),
            x.clone().into_tensor_arg(),
            scale.into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            out.x.into_tensor_arg(),
            rows as u32,
            hidden as u32,
            threads,
            layer_norm,
            dtype,
        );
    }

    let (blocks, rows_per_block) = column_blocks(rows);
    let blocks = blocks.max(1);
    let partial_scale = f32_buffer(&x, Shape::new([blocks, hidden]));
    let partial_shift = out
        .shift
        .as_ref()
        .map(|_| f32_buffer(&x, Shape::new([blocks, hidden])));
    let column_cubes = hidden.div_ceil(COLUMN_THREADS as usize) as u32;
    column_partials_kernel::launch::<R>(
        &client,
        CubeCount::Static(column_cubes, blocks as u32, 1),
        CubeDim::new_1d(COLUMN_THREADS),
        x.into_tensor_arg(),
        mean.into_tensor_arg(),
        rstd.into_tensor_arg(),
        grad.into_tensor_arg(),
        partial_scale.clone().into_tensor_arg(),
        partial_shift
            .clone()
            .unwrap_or_else(|| partial_scale.clone())
            .into_tensor_arg(),
        rows as u32,
        hidden as u32,
        rows_per_block as u32,
        layer_norm,
        partial_shift.is_some(),
        dtype,
    );
    let column_sum = |partial: CubeTensor<R>, total: CubeTensor<R>| {
        column_sum_kernel::launch::<R>(
            &client,
            CubeCount::Static(hidden.div_ceil(SUM_COLUMNS as usize) as u32, 1, 1),
            CubeDim::new_2d(SUM_COLUMNS, SUM_LANES),
            partial.into_tensor_arg(),
            total.into_tensor_arg(),
            blocks as u32,
            hidden as u32,
        );
    };
    column_sum(partial_scale, out.scale);
    if let (Some(partial), Some(total)) = (partial_shift, out.shift) {
        column_sum(partial, total);
    }
}
