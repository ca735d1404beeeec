//! LayerNorm and RMSNorm over the rows of `x: [rows, hidden]`, forward and backward, with f32
//! statistics and math for any storage dtype (Megatron's `FusedLayerNormAffineFunction` and
//! `FusedRMSNormAffineFunction`).
//!
//! - Forward: each row is loaded once into registers as [`Vector`]s (16-byte loads where the
//!   shapes and strides allow), by a group of threads sized to the row ([`RowLayout`]: 16
//!   elements a thread by default, up to 1 024 threads for 16k; several rows a cube for short
//!   rows). The
//!   group sums for the mean (LayerNorm), then for the variance of the centred row (two
//!   passes over the registers: no cancellation), and writes
//!   `(x - mean) · rstd · scale (+ shift)` and the row's f32 `mean` and `rstd`.
//! - Backward, one kernel: each row group walks a block of rows (16 to 64); per row, `x̂` and
//!   `ĝ = dy · scale` in registers, two row sums (`Σ ĝ` and `Σ ĝ · x̂`), then
//!   `dx = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ · x̂))`; meanwhile each thread adds its columns'
//!   `dy · x̂` and `dy` over the block's rows in registers and writes them as one row of
//!   `[blocks, hidden]` f32 partials. `dscale` and `dshift` are then the partials' sums over
//!   the blocks in a fixed order ([`super::column_sum::totals_into`]): no atomics, the same
//!   bits on every run, and `x` and `dy` read once for all three gradients.
//!
//! Both kernels bound every access themselves, so they launch without CubeCL's per-access
//! bounds checks, and read each tensor's strides once: in bf16 the checks and the index
//! arithmetic cost more than a tenth of the forward's time. How many elements a thread holds
//! decides the registers, and so how many cubes share an SM ([`NormForwardLayout`],
//! [`NormBackwardLayout`], measured by `kernel_bench norm_forward_layouts` and
//! `norm_backward_layouts`).

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::column_sum::{ColumnSumLayout, Normalised, column_sums_into, totals_into_with};
use super::rows::{RowLayout, row_of_thread, row_sum, row_sum_pair};
use super::vectors::vector_width;

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

/// The strides of a `[rows, hidden]` tensor in vectors, `(row, vector)`, read once per kernel
/// rather than at every access: vector `v` of row `r` is at `r · row + v · vector` (the
/// vectorised axis has stride 1 whenever the width is above 1, and the row stride is a
/// multiple of the width).
#[cube]
fn vector_strides<F: Float, N: Size>(tensor: &Tensor<Vector<F, N>>) -> (usize, usize) {
    (tensor.stride(0) / N::value(), tensor.stride(1))
}

/// This thread's vector `vector` of row `row`, as f32 (zero past the row's end), with the
/// tensor's [`vector_strides`].
#[cube]
fn load_row<F: Float, N: Size>(
    tensor: &Tensor<Vector<F, N>>,
    strides: (usize, usize),
    row: usize,
    vector: usize,
    vectors: usize,
) -> Vector<f32, N> {
    let mut value = Vector::<f32, N>::new(0.0);
    if vector < vectors {
        value = Vector::cast_from(tensor[row * strides.0 + vector * strides.1]);
    }
    value
}

/// Vector `vector` of a `[hidden]` parameter whose stride is `stride` elements, as f32.
#[cube]
fn load_parameter<F: Float, N: Size>(
    tensor: &Tensor<Vector<F, N>>,
    stride: usize,
    vector: usize,
) -> Vector<f32, N> {
    Vector::cast_from(tensor[vector * stride])
}

/// Row `row`'s `x` and `dy` at this thread's vectors, as stored, into `xs` and `dys` (zero past
/// the row's end and for rows past the last).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_row_raw<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    strides: ((usize, usize), (usize, usize)),
    xs: &mut Array<Vector<F, N>>,
    dys: &mut Array<Vector<F, N>>,
    row: usize,
    rows: u32,
    vectors: usize,
    #[comptime] layout: RowLayout,
) {
    let (x_strides, grad_strides) = strides;
    let threads = comptime!(layout.threads as usize);
    #[unroll]
    for i in 0..comptime!(layout.per_thread) {
        let vector = UNIT_POS_X as usize + i * threads;
        let mut xv = Vector::<F, N>::new(F::new(0.0));
        let mut dv = Vector::<F, N>::new(F::new(0.0));
        if vector < vectors && row < rows as usize {
            xv = x[row * x_strides.0 + vector * x_strides.1];
            dv = grad[row * grad_strides.0 + vector * grad_strides.1];
        }
        xs[i] = xv;
        dys[i] = dv;
    }
}

/// The sum of a vector's elements.
#[cube]
fn lanes_sum<N: Size>(value: Vector<f32, N>) -> f32 {
    let mut sum = f32::new(0.0);
    #[unroll]
    for k in 0..N::value() {
        sum += value[k];
    }
    sum
}

#[cube(launch, launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    residual: &Tensor<Vector<F, N>>,
    scale: &Tensor<Vector<F, N>>,
    shift: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    sum_out: &mut Tensor<Vector<F, N>>,
    mean: &mut Tensor<f32>,
    rstd: &mut Tensor<f32>,
    rows: u32,
    hidden: u32,
    epsilon: f32,
    #[comptime] layout: RowLayout,
    #[comptime] layer_norm: bool,
    #[comptime] has_shift: bool,
    #[comptime] has_residual: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let vectors = hidden as usize / width;
    let threads = comptime!(layout.threads as usize);
    let tid = UNIT_POS_X as usize;
    let mut row = row_of_thread();
    let active = row < rows as usize;
    if !active {
        // Idle rows still take part in the row sums' barriers.
        row = 0;
    }
    let n = f32::cast_from(hidden);
    let mut shared = SharedMemory::<f32>::new(comptime!(layout.shared_slots()));
    let x_strides = vector_strides::<F, N>(x);
    let out_strides = vector_strides::<F, N>(output);
    let (scale_stride, shift_stride) = (scale.stride(0), shift.stride(0));

    let mut values = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    let mut sum = f32::new(0.0);
    #[unroll]
    for i in 0..comptime!(layout.per_thread) {
        let vector = tid + i * threads;
        let mut value = load_row::<F, N>(x, x_strides, row, vector, vectors);
        if has_residual {
            // `x + residual` rounded to the storage dtype, written, and normalised as read
            // back: the bits of the separate add and norm.
            let added = Vector::<F, N>::cast_from(
                value
                    + load_row::<F, N>(
                        residual,
                        vector_strides::<F, N>(residual),
                        row,
                        vector,
                        vectors,
                    ),
            );
            if active && vector < vectors {
                let sum_strides = vector_strides::<F, N>(sum_out);
                sum_out[row * sum_strides.0 + vector * sum_strides.1] = added;
            }
            value = Vector::cast_from(added);
        }
        values[i] = value;
        sum += lanes_sum::<N>(value);
    }
    let mut mu = f32::new(0.0);
    if layer_norm {
        mu = row_sum(&mut shared, sum, layout.threads, layout.plane) / n;
    }
    // The variance of the centred row: a second pass over the registers, no cancellation.
    let mut squares = f32::new(0.0);
    #[unroll]
    for i in 0..comptime!(layout.per_thread) {
        if tid + i * threads < vectors {
            let centred = values[i] - Vector::new(mu);
            squares += lanes_sum::<N>(centred * centred);
        }
    }
    let variance = row_sum(&mut shared, squares, layout.threads, layout.plane) / n;
    let r = f32::new(1.0) / (variance + epsilon).sqrt();

    if active {
        #[unroll]
        for i in 0..comptime!(layout.per_thread) {
            let vector = tid + i * threads;
            if vector < vectors {
                let mut y = (values[i] - Vector::new(mu))
                    * Vector::new(r)
                    * load_parameter::<F, N>(scale, scale_stride, vector);
                if has_shift {
                    y += load_parameter::<F, N>(shift, shift_stride, vector);
                }
                output[row * out_strides.0 + vector * out_strides.1] = Vector::cast_from(y);
            }
        }
        if tid == 0 {
            mean[row * mean.stride(0)] = mu;
            rstd[row * rstd.stride(0)] = r;
        }
    }
}

#[cube(launch, launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    scale: &Tensor<Vector<F, N>>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    grad: &Tensor<Vector<F, N>>,
    grad_x: &mut Tensor<Vector<F, N>>,
    partial_scale: &mut Tensor<Vector<f32, N>>,
    partial_shift: &mut Tensor<Vector<f32, N>>,
    rows: u32,
    hidden: u32,
    rows_per_block: u32,
    #[comptime] layout: RowLayout,
    #[comptime] layer_norm: bool,
    #[comptime] has_shift: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let vectors = hidden as usize / width;
    let threads = comptime!(layout.threads as usize);
    let per_thread = comptime!(layout.per_thread);
    let tid = UNIT_POS_X as usize;
    let n = f32::cast_from(hidden);
    let block = row_of_thread();
    let first = block * rows_per_block as usize;
    // Room for two row sums at once (`row_sum_pair`).
    let mut shared = SharedMemory::<f32>::new(comptime!(2 * layout.shared_slots()));
    let strides = (vector_strides::<F, N>(x), vector_strides::<F, N>(grad));
    let dx_strides = vector_strides::<F, N>(grad_x);
    let scale_stride = scale.stride(0);
    let (mean_stride, rstd_stride) = (mean.stride(0), rstd.stride(0));

    // This thread's columns of the block's `Σ dy · x̂` and `Σ dy`, in rows' order.
    let mut sum_dyx = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    let mut sum_dy = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    #[unroll]
    for i in 0..comptime!(layout.per_thread) {
        sum_dyx[i] = Vector::new(0.0);
        sum_dy[i] = Vector::new(0.0);
    }
    // x̂ and ĝ = dy · scale in registers; zero past the row's end, so they add nothing.
    let mut x_hat = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    let mut g_hat = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    // The row as stored, loaded before any of it is converted.
    let mut x_row = Array::<Vector<F, N>>::new(per_thread);
    let mut dy_row = Array::<Vector<F, N>>::new(per_thread);

    // Every row group of the cube runs the same number of rows (the row sums synchronise the
    // cube); rows past the end are idle.
    let mut k = 0u32;
    while k < rows_per_block {
        let mut row = first + k as usize;
        let active = row < rows as usize;
        if !active {
            row = 0;
        }
        let mut mu = f32::new(0.0);
        if layer_norm {
            mu = mean[row * mean_stride];
        }
        let r = rstd[row * rstd_stride];
        load_row_raw::<F, N>(
            x,
            grad,
            strides,
            &mut x_row,
            &mut dy_row,
            row,
            rows,
            vectors,
            layout,
        );
        let mut sum_g = f32::new(0.0);
        let mut sum_gx = f32::new(0.0);
        #[unroll]
        for i in 0..comptime!(layout.per_thread) {
            let vector = tid + i * threads;
            let mut xh = Vector::<f32, N>::new(0.0);
            let mut dy = Vector::<f32, N>::new(0.0);
            let mut gh = Vector::<f32, N>::new(0.0);
            // Past the row's end nothing is read: an out-of-bounds `scale` may hold NaN.
            if vector < vectors && active {
                xh = (Vector::<f32, N>::cast_from(x_row[i]) - Vector::new(mu)) * Vector::new(r);
                dy = Vector::<f32, N>::cast_from(dy_row[i]);
                gh = dy * load_parameter::<F, N>(scale, scale_stride, vector);
            }
            x_hat[i] = xh;
            g_hat[i] = gh;
            sum_dyx[i] += dy * xh;
            if has_shift {
                sum_dy[i] += dy;
            }
            sum_g += lanes_sum::<N>(gh);
            sum_gx += lanes_sum::<N>(gh * xh);
        }
        let mut mean_g = f32::new(0.0);
        let mut mean_gx = sum_gx;
        if layer_norm {
            // Both row sums behind one set of barriers (the row is latency-bound in bf16).
            let (total_g, total_gx) = row_sum_pair(
                &mut shared,
                sum_g,
                sum_gx,
                layout.threads,
                layout.plane,
                comptime!(layout.shared_slots()),
            );
            mean_g = total_g / n;
            mean_gx = total_gx / n;
        } else {
            mean_gx = row_sum(&mut shared, mean_gx, layout.threads, layout.plane) / n;
        }

        if active {
            #[unroll]
            for i in 0..comptime!(layout.per_thread) {
                let vector = tid + i * threads;
                if vector < vectors {
                    let dx = (g_hat[i] - Vector::new(mean_g) - x_hat[i] * Vector::new(mean_gx))
                        * Vector::new(r);
                    grad_x[row * dx_strides.0 + vector * dx_strides.1] = Vector::cast_from(dx);
                }
            }
        }
        k += 1;
    }

    if first < rows as usize {
        #[unroll]
        for i in 0..comptime!(layout.per_thread) {
            let vector = tid + i * threads;
            if vector < vectors {
                let column = vector * width;
                partial_scale[(block * partial_scale.stride(0)
                    + column * partial_scale.stride(1))
                    / width] = sum_dyx[i];
                if has_shift {
                    partial_shift[(block * partial_shift.stride(0)
                        + column * partial_shift.stride(1))
                        / width] = sum_dy[i];
                }
            }
        }
    }
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
    forward_with(NormForwardLayout::default(), x, scale, shift, kind, epsilon)
}

/// [`forward`] with its work spread by `tuning`.
pub fn forward_with<R: CubeRuntime>(
    tuning: NormForwardLayout,
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
    forward_into_with(
        tuning,
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
        None,
    );
    Forward { output, mean, rstd }
}

/// A residual added before the norm ([`add_forward`]): `input` is added to `x`, and the sum,
/// rounded to `x`'s dtype, is written to `sum` (`[rows, hidden]`, any strides) and normalised.
#[derive(Debug)]
pub struct Residual<R: CubeRuntime> {
    pub input: CubeTensor<R>,
    pub sum: CubeTensor<R>,
}

/// `x + residual` (rounded to `x`'s dtype) and its [`forward`], in one kernel: the residual
/// stream's add fused with the norm that reads it (a decode step's add and norm are two
/// launches for a few kilobytes each). Returns the sum and the norm's output and statistics.
pub fn add_forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    residual: CubeTensor<R>,
    scale: CubeTensor<R>,
    shift: Option<CubeTensor<R>>,
    kind: Kind,
    epsilon: f64,
) -> (CubeTensor<R>, Forward<R>) {
    assert_eq!(
        x.meta.shape(),
        residual.meta.shape(),
        "the residual added before a norm has the input's shape"
    );
    assert_eq!(
        x.dtype, residual.dtype,
        "the residual has the input's dtype"
    );
    let (rows, _) = rows_hidden(x.meta.shape());
    let empty = |shape: Shape, dtype| {
        empty_device_contiguous_dtype::<R>(x.client.clone(), x.device.clone(), shape, dtype)
    };
    let sum = empty(x.meta.shape().clone(), x.dtype);
    let out = Forward {
        output: empty(x.meta.shape().clone(), x.dtype),
        mean: f32_buffer(&x, Shape::new([rows])),
        rstd: f32_buffer(&x, Shape::new([rows])),
    };
    let (output, mean, rstd) = (out.output.clone(), out.mean.clone(), out.rstd.clone());
    forward_into_with(
        NormForwardLayout::default(),
        x,
        scale,
        shift,
        kind,
        epsilon,
        out,
        Some(Residual {
            input: residual,
            sum: sum.clone(),
        }),
    );
    (sum, Forward { output, mean, rstd })
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
    forward_into_with(
        NormForwardLayout::default(),
        x,
        scale,
        shift,
        kind,
        epsilon,
        out,
        None,
    );
}

/// [`forward_into`] with its work spread by `tuning`, and `residual` added first (see
/// [`add_forward`]).
#[allow(clippy::too_many_arguments)]
pub fn forward_into_with<R: CubeRuntime>(
    tuning: NormForwardLayout,
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    shift: Option<CubeTensor<R>>,
    kind: Kind,
    epsilon: f64,
    out: Forward<R>,
    residual: Option<Residual<R>>,
) {
    let (rows, hidden) = rows_hidden(x.meta.shape());
    if rows == 0 || hidden == 0 {
        return;
    }
    let has_shift = shift.is_some();
    let shift = shift.unwrap_or_else(|| scale.clone());
    let has_residual = residual.is_some();
    let mut vectorised = vec![&x, &scale, &shift, &out.output];
    if let Some(Residual { input, sum }) = &residual {
        vectorised.extend([input, sum]);
    }
    let width = vector_width(&vectorised);
    // Without a residual the kernel reads and writes neither: `x` and a one-vector buffer
    // (not `x` or the output: a buffer bound twice for writing is refused by some runtimes)
    // stand in.
    let Residual {
        input: residual,
        sum,
    } = residual.unwrap_or_else(|| Residual {
        input: x.clone(),
        sum: empty_device_contiguous_dtype::<R>(
            x.client.clone(),
            x.device.clone(),
            Shape::new([1, width]),
            x.dtype,
        ),
    });
    let layout = RowLayout::for_row_in_cubes_of(
        &x.client,
        hidden / width,
        width,
        tuning.elements_per_thread,
        tuning.cube_threads,
    );
    let dtype = x.dtype.into();
    launch_checked_or_not!(
        forward_kernel,
        tuning.checked,
        &x.client.clone(),
        layout.cube_count(rows),
        layout.cube_dim(),
        width,
        x.into_tensor_arg(),
        residual.into_tensor_arg(),
        scale.into_tensor_arg(),
        shift.into_tensor_arg(),
        out.output.into_tensor_arg(),
        sum.into_tensor_arg(),
        out.mean.into_tensor_arg(),
        out.rstd.into_tensor_arg(),
        rows as u32,
        hidden as u32,
        epsilon as f32,
        layout,
        kind == Kind::LayerNorm,
        has_shift,
        has_residual,
        dtype,
    );
}

/// How the forward spreads its work. The default is the fastest measured on an H100
/// (`kernel_bench norm_forward_layouts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormForwardLayout {
    /// Elements of `x` a thread holds, at most (more threads a row when the row is longer).
    pub elements_per_thread: usize,
    /// Threads per cube the rows are stacked to.
    pub cube_threads: u32,
    /// Let CubeCL check the bounds of every tensor access (the kernel bounds them itself).
    pub checked: bool,
}

impl Default for NormForwardLayout {
    fn default() -> Self {
        // 16 elements a thread (40 registers, 70 % occupancy) without CubeCL's bounds checks:
        // on an H100 at 16 384 × 4 096, bf16 0.111-0.113 ms against 0.139 with 32 elements
        // (64 registers) and 0.127 with the checks; f32 unchanged (0.196 ms, at the copy
        // bandwidth). Loading the scale and shift with the row, before the row sums, was
        // slower everywhere (registers) (2026-11-26).
        Self {
            elements_per_thread: 16,
            cube_threads: 256,
            checked: false,
        }
    }
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
    let layout = NormBackwardLayout::default();
    backward_with(layout, x, scale, mean, rstd, grad, kind, with_shift)
}

/// [`backward`] with its work spread by `layout`.
#[allow(clippy::too_many_arguments)]
pub fn backward_with<R: CubeRuntime>(
    layout: NormBackwardLayout,
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
    backward_into_with(
        layout,
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
    let layout = NormBackwardLayout::default();
    backward_into_with(layout, x, scale, mean, rstd, grad, kind, out);
}

/// [`backward_into`] with its work spread by `tuning`.
#[allow(clippy::too_many_arguments)]
pub fn backward_into_with<R: CubeRuntime>(
    tuning: NormBackwardLayout,
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
    let layer_norm = kind == Kind::LayerNorm;
    if rows == 0 {
        // No row: the parameter gradients are sums over nothing.
        let normalised = Normalised {
            x,
            mean,
            rstd,
            centred: layer_norm,
        };
        column_sums_into(grad, Some(normalised), out.shift, Some(out.scale));
        return;
    }
    let width = vector_width(&[&x, &scale, &grad, &out.x]);
    let elements_per_thread = (tuning.bytes_per_thread / x.dtype.size()).max(1);
    let layout = RowLayout::for_row_with(&x.client, hidden / width, width, elements_per_thread);
    let rows_per_block = tuning.rows_per_block(rows, layout.threads);
    let blocks = rows.div_ceil(rows_per_block);
    let partial = || f32_buffer(&x, Shape::new([blocks, hidden]));
    let partial_scale = partial();
    let partial_shift = out.shift.as_ref().map(|_| partial());
    let dtype = x.dtype.into();
    launch_checked_or_not!(
        backward_kernel,
        tuning.checked,
        &x.client.clone(),
        layout.cube_count(blocks),
        layout.cube_dim(),
        width,
        x.into_tensor_arg(),
        scale.into_tensor_arg(),
        mean.into_tensor_arg(),
        rstd.into_tensor_arg(),
        grad.into_tensor_arg(),
        out.x.into_tensor_arg(),
        partial_scale.clone().into_tensor_arg(),
        partial_shift
            .clone()
            .unwrap_or_else(|| partial_scale.clone())
            .into_tensor_arg(),
        rows as u32,
        hidden as u32,
        rows_per_block as u32,
        layout,
        layer_norm,
        partial_shift.is_some(),
        dtype,
    );
    totals_into_with(tuning.totals, partial_scale, blocks, out.scale);
    if let (Some(partial), Some(shift)) = (partial_shift, out.shift) {
        totals_into_with(tuning.totals, partial, blocks, shift);
    }
}

/// How the backward spreads its work. The default is the fastest measured on an H100
/// (`kernel_bench norm_backward_layouts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormBackwardLayout {
    /// Bytes of `x` a thread holds per row, at most (16 bf16 or 8 f32 elements at 32). Fewer
    /// give a row more threads (more barrier cost a row) and fewer registers a thread; what
    /// counts is how many cubes then share an SM.
    pub bytes_per_thread: usize,
    /// Threads the blocks should add up to (enough to fill the device).
    pub target_threads: usize,
    /// Rows per block at least and at most (each block writes one row of f32 partials, so
    /// short blocks cost partials traffic, long ones parallelism).
    pub rows_per_block: (usize, usize),
    /// The second stage, summing the blocks' partials.
    pub totals: ColumnSumLayout,
    /// Let CubeCL check the bounds of every tensor access (the kernel bounds them itself).
    pub checked: bool,
}

impl Default for NormBackwardLayout {
    fn default() -> Self {
        // 32 bytes a thread, without CubeCL's bounds checks and with each tensor's strides
        // read once: on an H100 at 16 384 × 4 096, bf16 0.213-0.217 ms (16 elements: 256
        // threads a row, 123 registers, two cubes an SM) against 0.280 with 8 elements (512
        // threads a row, 81 registers: one cube an SM) and 0.255 with the checks; f32 0.325 ms
        // (8 elements) (2026-11-26). Tried and slower or no faster there: loading the next
        // row while computing this one (bf16 at 4 096: 0.40 ms against 0.28), holding the row
        // as stored instead of `x̂` and `ĝ` in f32 (0.298 against 0.275) (2026-11-25); the scale
        // held in registers for the block, and the column sums in shared memory instead of
        // registers (2026-11-26: within noise).
        Self {
            bytes_per_thread: 32,
            target_threads: 1 << 17,
            rows_per_block: (16, 64),
            totals: ColumnSumLayout::default(),
            checked: false,
        }
    }
}

impl NormBackwardLayout {
    /// Rows per block for `rows` rows of `threads_per_row` threads each.
    pub fn rows_per_block(&self, rows: usize, threads_per_row: u32) -> usize {
        let groups_wanted = self.target_threads / threads_per_row as usize;
        let (least, most) = self.rows_per_block;
        rows.div_ceil(groups_wanted.max(1))
            .clamp(least.max(1), most.max(least.max(1)))
    }
}
