//! Megatron's bias-GeLU, `gelu(x + bias)`, and its derivative, each one element-wise kernel.
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

/// Threads per cube.
const THREADS: u32 = 256;
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

/// The element this thread handles, as (row, column), or `terminate!` past the end.
#[cube]
fn element(rows: u32, cols: u32) -> (usize, usize) {
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let index = cube * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if index >= rows as usize * cols as usize {
        terminate!();
    }
    (index / cols as usize, index % cols as usize)
}

/// `x + bias` at (row, col), in f32.
#[cube]
fn biased<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    row: usize,
    col: usize,
    #[comptime] has_bias: bool,
) -> f32 {
    let mut v = f32::cast_from(x[row * x.stride(0) + col * x.stride(1)]);
    if has_bias {
        v += f32::cast_from(bias[col * bias.stride(0)]);
    }
    v
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
fn forward_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    output: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (row, col) = element(rows, cols);
    let v = biased::<F>(x, bias, row, col, has_bias);
    output[row * output.stride(0) + col * output.stride(1)] = F::cast_from(gelu(v, tanh));
}

#[cube(launch)]
fn backward_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    grad: &Tensor<F>,
    grad_x: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[comptime] has_bias: bool,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (row, col) = element(rows, cols);
    let v = biased::<F>(x, bias, row, col, has_bias);
    let dy = f32::cast_from(grad[row * grad.stride(0) + col * grad.stride(1)]);
    grad_x[row * grad_x.stride(0) + col * grad_x.stride(1)] =
        F::cast_from(dy * gelu_derivative(v, tanh));
}

/// A grid of 256-thread cubes covering `elements`, each dimension within every runtime's limit.
fn launch_shape(elements: usize) -> CubeCount {
    let cubes = elements.div_ceil(THREADS as usize).max(1);
    let x = cubes.min(65_535);
    CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1)
}

fn rows_cols(shape: &Shape) -> (usize, usize) {
    let dims = shape.as_slice();
    assert_eq!(dims.len(), 2, "bias-GeLU takes [tokens, features]");
    (dims[0], dims[1])
}

fn output_like<R: CubeRuntime>(x: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    )
}

/// `gelu(x + bias)` for `x: [tokens, features]` (any strides) and `bias: [features]` of the
/// same dtype; the output has `x`'s shape and dtype.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    form: Form,
) -> CubeTensor<R> {
    let (rows, cols) = rows_cols(x.meta.shape());
    let output = output_like(&x);
    if rows * cols == 0 {
        return output;
    }
    let has_bias = bias.is_some();
    let bias = bias.unwrap_or_else(|| x.clone());
    let dtype = x.dtype.into();
    forward_kernel::launch::<R>(
        &x.client.clone(),
        launch_shape(rows * cols),
        CubeDim::new_1d(THREADS),
        x.into_tensor_arg(),
        bias.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
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
    let (rows, cols) = rows_cols(x.meta.shape());
    let grad_x = output_like(&x);
    if rows * cols == 0 {
        return grad_x;
    }
    let has_bias = bias.is_some();
    let bias = bias.unwrap_or_else(|| x.clone());
    let dtype = x.dtype.into();
    backward_kernel::launch::<R>(
        &x.client.clone(),
        launch_shape(rows * cols),
        CubeDim::new_1d(THREADS),
        x.into_tensor_arg(),
        bias.into_tensor_arg(),
        grad.into_tensor_arg(),
        grad_x.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        has_bias,
        form == Form::Tanh,
        dtype,
    );
    grad_x
}
