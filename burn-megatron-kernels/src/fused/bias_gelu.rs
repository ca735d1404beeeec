//! Megatron's bias-GeLU, `gelu(x + bias)`, and its derivative, each one element-wise kernel
//! reading and writing [`Vector`]s (16-byte accesses where shapes and strides allow).
//!
//! The Burn composition of the tanh form reads and writes the `[tokens, ffn]` activation about
//! eight times forward and twelve times backward; each kernel here reads `x` (and the bias)
//! once and writes once, computing in f32 whatever the storage dtype. Both forms: the exact
//! `x · Φ(x)` (erf) and GPT-2's tanh approximation. The backward is the true derivative of the
//! forward of the same form, `dy · gelu'(x + bias)`; the bias gradient is the caller's column
//! sum of that.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::{
    THREADS, biased, empty_like, launch_shape, rows_cols, vector_offset, vector_position,
    vector_width,
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

#[cube]
fn gelu(v: f32, #[comptime] tanh: bool) -> f32 {
    if tanh {
        let inner = SQRT_2_OVER_PI * v * (1.0 + TANH_CUBIC * v * v);
        0.5 * v * (1.0 + inner.tanh())
    } else {
        0.5 * v * (1.0 + Erf::erf(v * FRAC_1_SQRT_2))
    }
}

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

#[cube(launch)]
fn forward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (row, vector) = vector_position(rows, vectors_per_row);
    let v = biased::<F, N>(x, bias, row, vector, has_bias);
    let mut y = Vector::<f32, N>::empty();
    #[unroll]
    for k in 0..N::value() {
        y[k] = gelu(v[k], tanh);
    }
    output[vector_offset::<F, N>(output, row, vector)] = Vector::cast_from(y);
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    grad_x: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (row, vector) = vector_position(rows, vectors_per_row);
    let v = biased::<F, N>(x, bias, row, vector, has_bias);
    let dy = Vector::<f32, N>::cast_from(grad[vector_offset::<F, N>(grad, row, vector)]);
    let mut dx = Vector::<f32, N>::empty();
    #[unroll]
    for k in 0..N::value() {
        dx[k] = dy[k] * gelu_derivative(v[k], tanh);
    }
    grad_x[vector_offset::<F, N>(grad_x, row, vector)] = Vector::cast_from(dx);
}

/// This thread's column vector and its block's first row, for the row-blocked layout: cubes
/// along x cover a row's vectors, cubes along y (and z, past y's limit) blocks of rows.
/// `terminate!` past the last vector.
#[cube]
fn block_position(vectors_per_row: u32, #[comptime] rows_per_thread: u32) -> (usize, usize) {
    let vector = CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X;
    if vector >= vectors_per_row {
        terminate!();
    }
    let block = CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y;
    (vector as usize, (block * rows_per_thread) as usize)
}

/// [`forward_kernel`] with each thread on one column vector of `rows_per_thread` rows: the
/// bias is read once, the rows' loads are all issued before any is used, and there is no
/// division to find a thread's row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_rows_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] rows_per_thread: u32,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let (vector, first) = block_position(vectors_per_row, rows_per_thread);
    let mut b = Vector::<f32, N>::new(0.0);
    if has_bias {
        b = Vector::<f32, N>::cast_from(bias[vector * width * bias.stride(0) / width]);
    }
    let count = comptime!(rows_per_thread as usize);
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

/// [`backward_kernel`] in the row-blocked layout of [`forward_rows_kernel`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_rows_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    grad_x: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] rows_per_thread: u32,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let (vector, first) = block_position(vectors_per_row, rows_per_thread);
    let mut b = Vector::<f32, N>::new(0.0);
    if has_bias {
        b = Vector::<f32, N>::cast_from(bias[vector * width * bias.stride(0) / width]);
    }
    let count = comptime!(rows_per_thread as usize);
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
            let v = Vector::<f32, N>::cast_from(xs[j]) + b;
            let dy = Vector::<f32, N>::cast_from(dys[j]);
            let mut dx = Vector::<f32, N>::empty();
            #[unroll]
            for k in 0..N::value() {
                dx[k] = dy[k] * gelu_derivative(v[k], tanh);
            }
            grad_x[vector_offset::<F, N>(grad_x, first + j, vector)] = Vector::cast_from(dx);
        }
    }
}

/// How the element-wise kernels spread their work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// One vector a thread, threads numbered over all the rows' vectors.
    #[default]
    Flat,
    /// One column vector a thread over this many consecutive rows (`kernel_bench
    /// gelu_layouts` compares them).
    Rows(u32),
}

/// The grid of the row-blocked layout: `vectors_per_row` vectors along x, blocks of
/// `rows_per_thread` rows along y and z.
fn rows_launch(rows: usize, vectors_per_row: usize, rows_per_thread: u32) -> CubeCount {
    let x = vectors_per_row.div_ceil(THREADS as usize).max(1);
    let blocks = rows.div_ceil(rows_per_thread as usize).max(1);
    let y = blocks.min(65_535);
    CubeCount::Static(x as u32, y as u32, blocks.div_ceil(y) as u32)
}

/// `gelu(x + bias)` for `x: [tokens, features]` (any strides) and `bias: [features]` of the
/// same dtype; the output has `x`'s shape and dtype.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    form: Form,
) -> CubeTensor<R> {
    forward_with(Layout::default(), x, bias, form)
}

/// [`forward`] in a given [`Layout`].
pub fn forward_with<R: CubeRuntime>(
    layout: Layout,
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
    if let Layout::Rows(rows_per_thread) = layout {
        forward_rows_kernel::launch::<R>(
            &x.client.clone(),
            rows_launch(rows, cols / width, rows_per_thread),
            CubeDim::new_1d(THREADS),
            width,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            rows as u32,
            (cols / width) as u32,
            rows_per_thread,
            has_bias,
            form == Form::Tanh,
            dtype,
        );
        return output;
    }
    forward_kernel::launch::<R>(
        &x.client.clone(),
        launch_shape(rows * cols / width),
        CubeDim::new_1d(THREADS),
        width,
        x.into_tensor_arg(),
        bias.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        rows as u32,
        (cols / width) as u32,
        has_bias,
        form == Form::Tanh,
        dtype,
    );
    output
}

/// `grad · gelu'(x + bias)`, the gradient of [`forward`]'s `x` (and, summed over the tokens,
/// of its bias); `grad` has `x`'s shape and dtype, any strides.
pub fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    grad: CubeTensor<R>,
    form: Form,
) -> CubeTensor<R> {
    backward_with(Layout::default(), x, bias, grad, form)
}

/// [`backward`] in a given [`Layout`].
pub fn backward_with<R: CubeRuntime>(
    layout: Layout,
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
    if let Layout::Rows(rows_per_thread) = layout {
        backward_rows_kernel::launch::<R>(
            &x.client.clone(),
            rows_launch(rows, cols / width, rows_per_thread),
            CubeDim::new_1d(THREADS),
            width,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            grad.into_tensor_arg(),
            grad_x.clone().into_tensor_arg(),
            rows as u32,
            (cols / width) as u32,
            rows_per_thread,
            has_bias,
            form == Form::Tanh,
            dtype,
        );
        return grad_x;
    }
    backward_kernel::launch::<R>(
        &x.client.clone(),
        launch_shape(rows * cols / width),
        CubeDim::new_1d(THREADS),
        width,
        x.into_tensor_arg(),
        bias.into_tensor_arg(),
        grad.into_tensor_arg(),
        grad_x.clone().into_tensor_arg(),
        rows as u32,
        (cols / width) as u32,
        has_bias,
        form == Form::Tanh,
        dtype,
    );
    grad_x
}
