//! SwiGLU's element-wise part with the projections' biases, `silu(gate + b_g) · (up + b_u)`,
//! and its two gradients, each one kernel that reads and writes [`Vector`]s, in f32 whatever
//! the storage dtype.
//!
//! The Burn composition reads and writes `[tokens, ffn]` tensors about five times forward and
//! eight times backward (two more each with the bias adds); here the forward reads `gate` and
//! `up` once and writes once, the backward reads `gate`, `up` and `dy` once and writes `d_gate`
//! and `d_up` once. [`backward_and_bias_gradients`] also sums them over the rows (the biases'
//! gradients) as it writes them.

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

/// `σ(x) = 1 / (1 + e^(-x))`; 0 where `e^(-x)` overflows, as it should be.
#[cube]
fn sigmoid(x: f32) -> f32 {
    f32::new(1.0) / (f32::new(1.0) + (-x).exp())
}

/// `(d_gate, d_up)` at `g = gate + b_g`, `u = up + b_u` given the output's gradient `dy`.
#[cube]
fn swiglu_derivative<N: Size>(
    g: Vector<f32, N>,
    u: Vector<f32, N>,
    dy: Vector<f32, N>,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let mut dg = Vector::<f32, N>::empty();
    let mut du = Vector::<f32, N>::empty();
    #[unroll]
    for k in 0..N::value() {
        let s = sigmoid(g[k]);
        du[k] = dy[k] * g[k] * s;
        dg[k] = dy[k] * u[k] * s * (f32::new(1.0) + g[k] * (f32::new(1.0) - s));
    }
    (dg, du)
}

/// The biases of this thread's column vector, in f32 (zero without `has_bias`).
#[cube]
fn column_biases<F: Float, N: Size>(
    gate_bias: &Tensor<Vector<F, N>>,
    up_bias: &Tensor<Vector<F, N>>,
    vector: usize,
    #[comptime] has_bias: bool,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let mut bg = Vector::<f32, N>::new(0.0);
    let mut bu = Vector::<f32, N>::new(0.0);
    if has_bias {
        bg = column_vector::<F, N>(gate_bias, vector);
        bu = column_vector::<F, N>(up_bias, vector);
    }
    (bg, bu)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    gate_bias: &Tensor<Vector<F, N>>,
    up_bias: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] layout: ElementwiseLayout,
    #[comptime] has_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (vector, first) = thread_position(rows, vectors_per_row, layout);
    let (bg, bu) = column_biases::<F, N>(gate_bias, up_bias, vector, has_bias);
    let count = comptime!(layout.rows_per_thread() as usize);
    // Every row's loads first, then the math.
    let mut gs = Array::<Vector<F, N>>::new(count);
    let mut us = Array::<Vector<F, N>>::new(count);
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            gs[j] = gate[vector_offset::<F, N>(gate, first + j, vector)];
            us[j] = up[vector_offset::<F, N>(up, first + j, vector)];
        }
    }
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            let g = Vector::<f32, N>::cast_from(gs[j]) + bg;
            let u = Vector::<f32, N>::cast_from(us[j]) + bu;
            let mut y = Vector::<f32, N>::empty();
            #[unroll]
            for k in 0..N::value() {
                y[k] = g[k] * sigmoid(g[k]) * u[k];
            }
            output[vector_offset::<F, N>(output, first + j, vector)] = Vector::cast_from(y);
        }
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    gate_bias: &Tensor<Vector<F, N>>,
    up_bias: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    grad_gate: &mut Tensor<Vector<F, N>>,
    grad_up: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    #[comptime] layout: ElementwiseLayout,
    #[comptime] has_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (vector, first) = thread_position(rows, vectors_per_row, layout);
    let (bg, bu) = column_biases::<F, N>(gate_bias, up_bias, vector, has_bias);
    let count = comptime!(layout.rows_per_thread() as usize);
    let mut gs = Array::<Vector<F, N>>::new(count);
    let mut us = Array::<Vector<F, N>>::new(count);
    let mut dys = Array::<Vector<F, N>>::new(count);
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            gs[j] = gate[vector_offset::<F, N>(gate, first + j, vector)];
            us[j] = up[vector_offset::<F, N>(up, first + j, vector)];
            dys[j] = grad[vector_offset::<F, N>(grad, first + j, vector)];
        }
    }
    #[unroll]
    for j in 0..count {
        if first + j < rows as usize {
            let g = Vector::<f32, N>::cast_from(gs[j]) + bg;
            let u = Vector::<f32, N>::cast_from(us[j]) + bu;
            let dy = Vector::<f32, N>::cast_from(dys[j]);
            let (dg, du) = swiglu_derivative::<N>(g, u, dy);
            let row = first + j;
            grad_gate[vector_offset::<F, N>(grad_gate, row, vector)] = Vector::cast_from(dg);
            grad_up[vector_offset::<F, N>(grad_up, row, vector)] = Vector::cast_from(du);
        }
    }
}

/// [`backward_kernel`] with both biases' gradients' first stage: a thread walks its column
/// vector down one block of rows, writes `d_gate` and `d_up`, and adds each row's gradients as
/// stored into row `block` of `partial_gate` and `partial_up` (`[blocks, columns]` f32), rows
/// in order. That is the order of the column sums' first stage
/// ([`column_sum`](super::column_sum)), so each bias gradient has the bits of the column sum
/// of its input's gradient, without reading it again.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_bias_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    gate_bias: &Tensor<Vector<F, N>>,
    up_bias: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    grad_gate: &mut Tensor<Vector<F, N>>,
    grad_up: &mut Tensor<Vector<F, N>>,
    partial_gate: &mut Tensor<Vector<f32, N>>,
    partial_up: &mut Tensor<Vector<f32, N>>,
    rows: u32,
    vectors_per_row: u32,
    rows_per_block: u32,
    #[comptime] rows_in_flight: usize,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let (vector, start, end) = walked_rows(rows, vectors_per_row, rows_per_block);
    let block = CUBE_POS_Y as usize;
    let (bg, bu) = column_biases::<F, N>(gate_bias, up_bias, vector, true);
    let mut total_gate = Vector::<f32, N>::new(0.0);
    let mut total_up = Vector::<f32, N>::new(0.0);
    // `rows_in_flight` rows' loads are issued before any is used (the walk is bound by load
    // latency otherwise); the sums still take the rows in order.
    let mut gs = Array::<Vector<F, N>>::new(rows_in_flight);
    let mut us = Array::<Vector<F, N>>::new(rows_in_flight);
    let mut dys = Array::<Vector<F, N>>::new(rows_in_flight);
    let mut row = start;
    while row < end {
        #[unroll]
        for j in 0..rows_in_flight {
            if row + j < end {
                gs[j] = gate[vector_offset::<F, N>(gate, row + j, vector)];
                us[j] = up[vector_offset::<F, N>(up, row + j, vector)];
                dys[j] = grad[vector_offset::<F, N>(grad, row + j, vector)];
            }
        }
        #[unroll]
        for j in 0..rows_in_flight {
            if row + j < end {
                let g = Vector::<f32, N>::cast_from(gs[j]) + bg;
                let u = Vector::<f32, N>::cast_from(us[j]) + bu;
                let dy = Vector::<f32, N>::cast_from(dys[j]);
                let (dg, du) = swiglu_derivative::<N>(g, u, dy);
                let stored_gate = Vector::<F, N>::cast_from(dg);
                let stored_up = Vector::<F, N>::cast_from(du);
                grad_gate[vector_offset::<F, N>(grad_gate, row + j, vector)] = stored_gate;
                grad_up[vector_offset::<F, N>(grad_up, row + j, vector)] = stored_up;
                total_gate += Vector::<f32, N>::cast_from(stored_gate);
                total_up += Vector::<f32, N>::cast_from(stored_up);
            }
        }
        row += rows_in_flight;
    }
    let at = (block * partial_gate.stride(0) + vector * width * partial_gate.stride(1)) / width;
    partial_gate[at] = total_gate;
    let at = (block * partial_up.stride(0) + vector * width * partial_up.stride(1)) / width;
    partial_up[at] = total_up;
}

/// Rows whose loads [`backward_and_bias_gradients`] issues before using any.
pub const BIAS_GRADIENT_ROWS_IN_FLIGHT: usize = 2;

/// The forward's layout: one row a thread (f32 at 16k × 4096 on an H100: 0.276 ms against the
/// flat kernel's 0.309; bf16 0.146 against 0.150; two rows a thread is slower in bf16;
/// `kernel_bench elementwise_layouts`, 2026-11-26).
pub const FORWARD_LAYOUT: ElementwiseLayout = ElementwiseLayout::Rows(1);
/// The backward's layout: one row a thread (f32 0.457 ms against 0.490 flat; bf16 0.235, the
/// same as flat; same call).
pub const BACKWARD_LAYOUT: ElementwiseLayout = ElementwiseLayout::Rows(1);

/// The biases of the gate and up projections, `[features]` each, of `gate`'s dtype.
#[derive(Debug, Clone)]
pub struct Biases<R: CubeRuntime> {
    pub gate: CubeTensor<R>,
    pub up: CubeTensor<R>,
}

/// The kernels' bias arguments: the biases, or `like` twice as unread placeholders.
fn bias_args<R: CubeRuntime>(
    bias: Option<Biases<R>>,
    like: &CubeTensor<R>,
) -> (bool, CubeTensor<R>, CubeTensor<R>) {
    match bias {
        Some(b) => (true, b.gate, b.up),
        None => (false, like.clone(), like.clone()),
    }
}

/// `silu(gate + b_g) · (up + b_u)` for `gate, up: [tokens, features]` (any strides, one float
/// dtype) and optional biases; the output has `gate`'s shape and dtype.
pub fn forward<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    bias: Option<Biases<R>>,
) -> CubeTensor<R> {
    forward_with(FORWARD_LAYOUT, gate, up, bias)
}

/// [`forward`] in a given layout.
pub fn forward_with<R: CubeRuntime>(
    layout: ElementwiseLayout,
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    bias: Option<Biases<R>>,
) -> CubeTensor<R> {
    let (rows, cols) = rows_cols(gate.meta.shape(), "SwiGLU");
    assert_eq!(
        gate.meta.shape(),
        up.meta.shape(),
        "gate and up differ in shape"
    );
    let output = empty_like(&gate);
    if rows * cols == 0 {
        return output;
    }
    let (has_bias, gate_bias, up_bias) = bias_args(bias, &gate);
    let width = vector_width(&[&gate, &up, &gate_bias, &up_bias, &output]);
    let dtype = gate.dtype.into();
    forward_kernel::launch::<R>(
        &gate.client.clone(),
        layout.cube_count(rows, cols / width),
        CubeDim::new_1d(THREADS),
        width,
        gate.into_tensor_arg(),
        up.into_tensor_arg(),
        gate_bias.into_tensor_arg(),
        up_bias.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        rows as u32,
        (cols / width) as u32,
        layout,
        has_bias,
        dtype,
    );
    output
}

/// `[d_gate, d_up]` of [`forward`] given its output's gradient `grad` (`gate`'s shape and
/// dtype, any strides): with `g = gate + b_g`, `u = up + b_u`,
/// `grad · u · σ(g) · (1 + g · (1 - σ(g)))` and `grad · silu(g)`. Summed over the tokens
/// they are the biases' gradients.
pub fn backward<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    bias: Option<Biases<R>>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 2] {
    backward_with(BACKWARD_LAYOUT, gate, up, bias, grad)
}

/// [`backward`] in a given layout.
pub fn backward_with<R: CubeRuntime>(
    layout: ElementwiseLayout,
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    bias: Option<Biases<R>>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 2] {
    let (rows, cols) = rows_cols(gate.meta.shape(), "SwiGLU");
    let (grad_gate, grad_up) = (empty_like(&gate), empty_like(&gate));
    if rows * cols == 0 {
        return [grad_gate, grad_up];
    }
    let (has_bias, gate_bias, up_bias) = bias_args(bias, &gate);
    let width = vector_width(&[
        &gate, &up, &gate_bias, &up_bias, &grad, &grad_gate, &grad_up,
    ]);
    let dtype = gate.dtype.into();
    backward_kernel::launch::<R>(
        &gate.client.clone(),
        layout.cube_count(rows, cols / width),
        CubeDim::new_1d(THREADS),
        width,
        gate.into_tensor_arg(),
        up.into_tensor_arg(),
        gate_bias.into_tensor_arg(),
        up_bias.into_tensor_arg(),
        grad.into_tensor_arg(),
        grad_gate.clone().into_tensor_arg(),
        grad_up.clone().into_tensor_arg(),
        rows as u32,
        (cols / width) as u32,
        layout,
        has_bias,
        dtype,
    );
    [grad_gate, grad_up]
}

/// [`backward`] and both biases' gradients, `([d_gate, d_up], [Σ_rows d_gate, Σ_rows d_up])`,
/// the gradients in `gate`'s dtype: one kernel for the derivatives and the column sums' first
/// stage, then their second stage. The same bits as [`backward`] followed by
/// [`column_sum`](super::column_sum::column_sum) of each derivative.
pub fn backward_and_bias_gradients<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    bias: Biases<R>,
    grad: CubeTensor<R>,
) -> ([CubeTensor<R>; 2], [CubeTensor<R>; 2]) {
    backward_and_bias_gradients_with(BIAS_GRADIENT_ROWS_IN_FLIGHT, gate, up, bias, grad)
}

/// [`backward_and_bias_gradients`] with `rows_in_flight` rows loaded before any is used (the
/// same bits for any count).
pub fn backward_and_bias_gradients_with<R: CubeRuntime>(
    rows_in_flight: usize,
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    bias: Biases<R>,
    grad: CubeTensor<R>,
) -> ([CubeTensor<R>; 2], [CubeTensor<R>; 2]) {
    let rows_in_flight = rows_in_flight.max(1);
    let (rows, cols) = rows_cols(gate.meta.shape(), "SwiGLU");
    assert_eq!(
        gate.meta.shape(),
        up.meta.shape(),
        "gate and up differ in shape"
    );
    let (grad_gate, grad_up) = (empty_like(&gate), empty_like(&gate));
    let bias_gradient = || {
        empty_device_contiguous_dtype::<R>(
            gate.client.clone(),
            gate.device.clone(),
            Shape::new([cols]),
            gate.dtype,
        )
    };
    let (db_gate, db_up) = (bias_gradient(), bias_gradient());
    let derivatives = [grad_gate.clone(), grad_up.clone()];
    let bias_gradients = [db_gate.clone(), db_up.clone()];
    if rows == 0 || cols == 0 {
        if cols > 0 {
            column_sums_into(grad_gate, None, Some(db_gate), None);
            column_sums_into(grad_up, None, Some(db_up), None);
        }
        return (derivatives, bias_gradients);
    }
    let walk = ColumnWalk::new(rows);
    let (partial_gate, partial_up) = (walk.partials(&gate, cols), walk.partials(&gate, cols));
    let width = vector_width(&[
        &gate,
        &up,
        &bias.gate,
        &bias.up,
        &grad,
        &grad_gate,
        &grad_up,
        &partial_gate,
    ]);
    let vectors_per_row = cols / width;
    let dtype = gate.dtype.into();
    // SAFETY: the kernel bounds every access itself (threads past the row's vectors stop,
    // rows run from the block's start to the last row) (lavapipe tests on ragged shapes; the
    // GPU test under compute-sanitizer). Without CubeCL's checks it ran as fast as with them on
    // an H100 (2026-11-26), the bias-GeLU walk 3-10 % faster in bf16.
    unsafe {
        backward_bias_kernel::launch_unchecked::<R>(
            &gate.client.clone(),
            walk.cube_count(vectors_per_row),
            walk.cube_dim(),
            width,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            bias.gate.into_tensor_arg(),
            bias.up.into_tensor_arg(),
            grad.into_tensor_arg(),
            grad_gate.into_tensor_arg(),
            grad_up.into_tensor_arg(),
            partial_gate.clone().into_tensor_arg(),
            partial_up.clone().into_tensor_arg(),
            rows as u32,
            vectors_per_row as u32,
            walk.rows_per_block as u32,
            rows_in_flight,
            dtype,
        );
    }
    walk.totals_into(partial_gate, db_gate);
    walk.totals_into(partial_up, db_up);
    (derivatives, bias_gradients)
}
