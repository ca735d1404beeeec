//! Megatron's bias-GeLU, `gelu(x + bias)`, and its derivative, each one element-wise kernel
//! reading and writing [`Vector`]s (16-byte accesses where shapes and strides allow).
//!
//! The Burn composition of the tanh form reads and writes the `[tokens, ffn]` activation about
//! eight times forward and twelve times backward; each kernel here reads `x` (and the bias)
//! once and writes once, computing in f32 whatever the storage dtype. Both forms: the exact
//! `x · Φ(x)` (erf) and GPT-2's tanh approximation. The backward is the true derivative of the
//! forward of the same form, `dy · gelu'(x + bias)`; the bias gradient is the caller's column
//! sum of that.

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::column_sum::{ColumnWalk, column_sums_into, walked_rows};
use super::vectors::{
    ElementwiseLayout, THREADS, column_vector, empty_like, rows_cols, thread_position,
    vector_offset, vector_width,
};

/// `sqrt(2 / π)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// `1 / sqrt(2)`.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
/// The cubic coefficient of the tanh approximation.
const TANH_CUBIC: f32 = 0.044_715;

/// Which GeLU the kernels compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `0.5 · x · (1 + erf(x / √2))`.
    Erf,
    /// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`.
    Tanh,
}

// ANCHOR: gelu_fn
#[cube]
fn gelu(v: f32, #[comptime] tanh: bool) -> f32 {
    if tanh {
        let inner = SQRT_2_OVER_PI * v * (1.0 + TANH_CUBIC * v * v);
        0.5 * v * (1.0 + inner.tanh())
    } else {
        0.5 * v * (1.0 + Erf::erf(v * FRAC_1_SQRT_2))
    }
}
// ANCHOR_END: gelu_fn

#[cube]
fn gelu_derivative(v: f32, #[comptime] tanh: bool) -> f32 {
    if tanh {
        // Beyond |v| = 10 the tanh is ±1 in f32: clamping keeps v² finite, where the second
        // term would otherwise be 0 · inf.
        let v = v.clamp(-10.0, 10.0);
        let t = (SQRT_2_OVER_PI * v * (1.0 + TANH_CUBIC * v * v)).tanh();
        let d_inner = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * v * v);
        0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * d_inner
    } else {
        let cdf = 0.5 * (1.0 + Erf::erf(v * FRAC_1_SQRT_2));
        cdf + v * FRAC_1_SQRT_2PI * (-0.5 * v * v).exp()
    }
}

/// `dy · gelu'(x + b)` for one vector of `x` and `dy` as stored, in f32.
#[cube]
fn gelu_backward<F: Float, N: Size>(
    x: Vector<F, N>,
    b: Vector<f32, N>,
    dy: Vector<F, N>,
    #[comptime] tanh: bool,
) -> Vector<f32, N> {
    let v = Vector::<f32, N>::cast_from(x) + b;
    let dy = Vector::<f32, N>::cast_from(dy);
    let mut dx = Vector::<f32, N>::empty();
    #[unroll]
    for k in 0..N::value() {
        dx[k] = dy[k] * gelu_derivative(v[k], tanh);
    }
    dx
}

/// The bias of this thread's column vector, in f32 (zero without `has_bias`).
#[cube]
fn column_bias<F: Float, N: Size>(
    bias: &Tensor<Vector<F, N>>,
    vector: usize,
    #[comptime] has_bias: bool,
) -> Vector<f32, N> {
    let mut b = Vector::<f32, N>::new(0.0);
    if has_bias {
        b = column_vector::<F, N>(bias, vector);
    }
    b
}

// ANCHOR: forward_kernel
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] layout: ElementwiseLayout,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (vector, first) = thread_position(rows, vectors_per_row, layout);
    let b = column_bias::<F, N>(bias, vector, has_bias);
    let count = comptime!(layout.rows_per_thread() as usize);
    // Every row's load first, then the math.
    let mut xs = Array::<Vector<F, N>>::new(count);
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            xs[j] = x[vector_offset::<F, N>(x, first + j, vector)];
        }
    }
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            let v = Vector::<f32, N>::cast_from(xs[j]) + b;
            let mut y = Vector::<f32, N>::empty();
            #[unroll]
            for k in 0..N::value() {
                y[k] = gelu(v[k], tanh);
            }
            output[vector_offset::<F, N>(output, first + j, vector)] = Vector::cast_from(y);
        }
    }
}
// ANCHOR_END: forward_kernel

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    grad_x: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] layout: ElementwiseLayout,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (vector, first) = thread_position(rows, vectors_per_row, layout);
    let b = column_bias::<F, N>(bias, vector, has_bias);
    let count = comptime!(layout.rows_per_thread() as usize);
    let mut xs = Array::<Vector<F, N>>::new(count);
    let mut dys = Array::<Vector<F, N>>::new(count);
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            xs[j] = x[vector_offset::<F, N>(x, first + j, vector)];
            dys[j] = grad[vector_offset::<F, N>(grad, first + j, vector)];
        }
    }
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            let dx = gelu_backward::<F, N>(xs[j], b, dys[j], tanh);
            grad_x[vector_offset::<F, N>(grad_x, first + j, vector)] = Vector::cast_from(dx);
        }
    }
}

/// [`backward_kernel`] with the bias gradient's first stage: a thread walks its column vector
/// down one block of rows, writes `dx`, and adds each row's `dx` as stored into row `block` of
/// `partial` (`[blocks, columns]` f32), rows in order. That is the order of the column sums'
/// first stage ([`column_sum`](super::column_sum)), so the bias gradient has the bits of the
/// column sum of `dx`, without reading `dx` again.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_bias_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    grad_x: &mut Tensor<Vector<F, N>>,
    partial: &mut Tensor<Vector<f32, N>>,
    rows: u32,
    vectors_per_row: u32,
    rows_per_block: u32,
    #[comptime] rows_in_flight: usize,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let (vector, start, end) = walked_rows(rows, vectors_per_row, rows_per_block);
    let block = CUBE_POS_Y as usize;
    let b = column_bias::<F, N>(bias, vector, true);
    let mut total = Vector::<f32, N>::new(0.0);
    // `rows_in_flight` rows' loads are issued before any is used; the sum still takes the
    // rows in order.
    let mut xs = Array::<Vector<F, N>>::new(rows_in_flight);
    let mut dys = Array::<Vector<F, N>>::new(rows_in_flight);
    let mut row = start;
    while row < end {
        #[unroll]
        for j in 0..rows_in_flight {
            if row + j < end {
                xs[j] = x[vector_offset::<F, N>(x, row + j, vector)];
                dys[j] = grad[vector_offset::<F, N>(grad, row + j, vector)];
            }
        }
        #[unroll]
        for j in 0..rows_in_flight {
            if row + j < end {
                let stored =
                    Vector::<F, N>::cast_from(gelu_backward::<F, N>(xs[j], b, dys[j], tanh));
                grad_x[vector_offset::<F, N>(grad_x, row + j, vector)] = stored;
                total += Vector::<f32, N>::cast_from(stored);
            }
        }
        row += rows_in_flight;
    }
    partial[(block * partial.stride(0) + vector * width * partial.stride(1)) / width] = total;
}

/// The forward's layout: two rows a thread (bf16 at 16k × 4096 on an H100: 0.103-0.105 ms
/// against the flat kernel's 0.115; f32 0.189-0.192 against 0.229; `kernel_bench
/// elementwise_layouts`, two calls on 2026-11-26).
pub const FORWARD_LAYOUT: ElementwiseLayout = ElementwiseLayout::Rows(2);
/// The backward's layout: one row a thread (bf16 0.148-0.149 ms against 0.152-0.156 flat and
/// 0.158-0.160 for two rows; f32 0.277 against 0.312-0.314, same calls).
pub const BACKWARD_LAYOUT: ElementwiseLayout = ElementwiseLayout::Rows(1);

/// `gelu(x + bias)` for `x: [tokens, features]` (any strides) and `bias: [features]` of the
/// same dtype; the output has `x`'s shape and dtype.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    form: Form,
) -> CubeTensor<R> {
    forward_with(FORWARD_LAYOUT, x, bias, form)
}

// ANCHOR: launch
/// [`forward`] in a given layout.
pub fn forward_with<R: CubeRuntime>(
    layout: ElementwiseLayout,
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    form: Form,
) -> CubeTensor<R> {
    let (rows, cols) = rows_cols(x.meta.shape(), "bias-GeLU");
    let output = empty_like(&x);
    if rows * cols == 0 {
        return output;
    }
    let has_bias = bias.is_some();
    let bias = bias.unwrap_or_else(|| x.clone());
    let dtype = x.dtype.into();
    let width = vector_width(&[&x, &bias, &output]);
    forward_kernel::launch::<R>(
        &x.client.clone(),
        layout.cube_count(rows, cols / width),
        CubeDim::new_1d(THREADS),
        width,
        x.into_tensor_arg(),
        bias.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        rows as u32,
        (cols / width) as u32,
        layout,
        has_bias,
        form == Form::Tanh,
        dtype,
    );
    output
}
// ANCHOR_END: launch

/// `grad · gelu'(x + bias)`, the gradient of [`forward`]'s `x` (and, summed over the tokens,
/// of its bias); `grad` has `x`'s shape and dtype, any strides.
pub fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    grad: CubeTensor<R>,
    form: Form,
) -> CubeTensor<R> {
    backward_with(BACKWARD_LAYOUT, x, bias, grad, form)
}

/// [`backward`] in a given layout.
pub fn backward_with<R: CubeRuntime>(
    layout: ElementwiseLayout,
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    grad: CubeTensor<R>,
    form: Form,
) -> CubeTensor<R> {
    let (rows, cols) = rows_cols(x.meta.shape(), "bias-GeLU");
    let grad_x = empty_like(&x);
    if rows * cols == 0 {
        return grad_x;
    }
    let has_bias = bias.is_some();
    let bias = bias.unwrap_or_else(|| x.clone());
    let dtype = x.dtype.into();
    let width = vector_width(&[&x, &bias, &grad, &grad_x]);
    backward_kernel::launch::<R>(
        &x.client.clone(),
        layout.cube_count(rows, cols / width),
        CubeDim::new_1d(THREADS),
        width,
        x.into_tensor_arg(),
        bias.into_tensor_arg(),
        grad.into_tensor_arg(),
        grad_x.clone().into_tensor_arg(),
        rows as u32,
        (cols / width) as u32,
        layout,
        has_bias,
        form == Form::Tanh,
        dtype,
    );
    grad_x
}

/// [`backward`] and the bias's gradient, `(dx, Σ_rows dx)`, the gradient in `x`'s dtype: one
/// kernel for `dx` and the column sums' first stage, then their second stage. The same bits as
/// [`backward`] followed by [`column_sum`](super::column_sum::column_sum) of `dx`.
pub fn backward_and_bias_gradient<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    grad: CubeTensor<R>,
    form: Form,
) -> (CubeTensor<R>, CubeTensor<R>) {
    backward_and_bias_gradient_with(BIAS_GRADIENT_ROWS_IN_FLIGHT, x, bias, grad, form)
}

/// Rows whose loads [`backward_and_bias_gradient`] issues before using any.
pub const BIAS_GRADIENT_ROWS_IN_FLIGHT: usize = 2;

/// [`backward_and_bias_gradient`] with `rows_in_flight` rows loaded before any is used (the
/// same bits for any count).
pub fn backward_and_bias_gradient_with<R: CubeRuntime>(
    rows_in_flight: usize,
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    grad: CubeTensor<R>,
    form: Form,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let rows_in_flight = rows_in_flight.max(1);
    let (rows, cols) = rows_cols(x.meta.shape(), "bias-GeLU");
    let grad_x = empty_like(&x);
    let grad_bias = empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        Shape::new([cols]),
        x.dtype,
    );
    if rows == 0 || cols == 0 {
        if cols > 0 {
            column_sums_into(grad_x.clone(), None, Some(grad_bias.clone()), None);
        }
        return (grad_x, grad_bias);
    }
    let walk = ColumnWalk::new(rows);
    let partial = walk.partials(&x, cols);
    let dtype = x.dtype.into();
    let width = vector_width(&[&x, &bias, &grad, &grad_x, &partial]);
    let vectors_per_row = cols / width;
    // SAFETY: the kernel bounds every access itself (threads past the row's vectors stop,
    // rows run from the block's start to the last row) (lavapipe tests on ragged shapes; the
    // GPU test under compute-sanitizer). Without CubeCL's checks it ran 3-10 % faster in bf16
    // on an H100 (2026-11-26).
    unsafe {
        backward_bias_kernel::launch_unchecked::<R>(
            &x.client.clone(),
            walk.cube_count(vectors_per_row),
            walk.cube_dim(),
            width,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            grad.into_tensor_arg(),
            grad_x.clone().into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            rows as u32,
            vectors_per_row as u32,
            walk.rows_per_block as u32,
            rows_in_flight,
            form == Form::Tanh,
            dtype,
        );
    }
    walk.totals_into(partial, grad_bias.clone());
    (grad_x, grad_bias)
}
