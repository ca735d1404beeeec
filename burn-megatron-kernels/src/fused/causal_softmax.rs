//! The attention's scaled, causally masked softmax, forward and backward, each one kernel
//! (Megatron's `ScaledUpperTriangMaskedSoftmax`).
//!
//! Rows are the `[batch · heads · seq]` query positions of the `[batch, heads, seq, seq]`
//! scores; query `i` sees keys `0..=i`. The forward reads a row's visible scores once for a
//! running `(max, sum)` and once more to write `exp(scale · x - max) / sum` (and zeros for
//! the future); the backward reads the probabilities and their gradient once for
//! `Σ dP · P` and once more to write `scale · P · (dP - Σ dP · P)`. The statistics are f32
//! for every dtype; a row's threads combine theirs through shared memory (no plane size is
//! assumed).

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Stands for "no score yet" in the running maximum (finite: see the cross-entropy kernel).
const NO_SCORE: f32 = -1.0e30;

/// The launch of one cube per row: a power-of-two thread count fitting the row, and a 2D
/// grid that keeps each dimension within every runtime's limit.
fn launch_shape(rows: usize, seq: usize) -> (CubeCount, u32) {
    let threads = (seq.div_ceil(4)).next_power_of_two().clamp(32, 256) as u32;
    let x = rows.min(65_535) as u32;
    let y = rows.div_ceil(x as usize) as u32;
    (CubeCount::Static(x, y, 1), threads)
}

/// Where row `row` (a query position of `[batch, heads, seq, seq]`) starts in `t`: strided,
/// since the runtime may pitch rows (pad each to an aligned size).
#[cube]
fn row_offset<F: Float>(t: &Tensor<F>, row: usize, heads: usize, seq: usize) -> usize {
    let query = row % seq;
    let batch_head = row / seq;
    (batch_head / heads) * t.stride(0) + (batch_head % heads) * t.stride(1) + query * t.stride(2)
}

#[cube]
fn row_index(rows: usize) -> usize {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= rows {
        terminate!();
    }
    row
}

#[cube(launch)]
fn forward_kernel<F: Float>(
    scores: &Tensor<F>,
    probs: &mut Tensor<F>,
    scale: f32,
    rows: u32,
    heads: u32,
    seq: u32,
    #[comptime] threads: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(rows as usize);
    let tid = UNIT_POS_X as usize;
    let stride = CUBE_DIM_X as usize;
    let seq = seq as usize;
    let input = row_offset::<F>(scores, row, heads as usize, seq);
    let output = row_offset::<F>(probs, row, heads as usize, seq);
    let (step_in, step_out) = (scores.stride(3), probs.stride(3));
    let visible = row % seq + 1;

    let mut m = f32::new(NO_SCORE);
    let mut s = f32::new(0.0);
    let mut j = tid;
    while j < visible {
        let x = f32::cast_from(scores[input + j * step_in]) * scale;
        if x > m {
            s = s * (m - x).exp() + f32::new(1.0);
            m = x;
        } else {
            s += (x - m).exp();
        }
        j += stride;
    }

    let mut maxes = SharedMemory::<f32>::new(threads as usize);
    let mut sums = SharedMemory::<f32>::new(threads as usize);
    maxes[tid] = m;
    sums[tid] = s;
    sync_cube();
    let mut half = stride / 2;
    while half > 0 {
        if tid < half {
            let (m1, s1) = (maxes[tid], sums[tid]);
            let (m2, s2) = (maxes[tid + half], sums[tid + half]);
            let mut top = m1;
            if m2 > m1 {
                top = m2;
            }
            maxes[tid] = top;
            sums[tid] = s1 * (m1 - top).exp() + s2 * (m2 - top).exp();
        }
        sync_cube();
        half /= 2;
    }
    let max = maxes[0];
    let inverse = f32::new(1.0) / sums[0];

    let mut j = tid;
    while j < seq {
        let mut p = f32::new(0.0);
        if j < visible {
            p = (f32::cast_from(scores[input + j * step_in]) * scale - max).exp() * inverse;
        }
        probs[output + j * step_out] = F::cast_from(p);
        j += stride;
    }
}

#[cube(launch)]
fn backward_kernel<F: Float>(
    probs: &Tensor<F>,
    grad_probs: &Tensor<F>,
    grad_scores: &mut Tensor<F>,
    scale: f32,
    rows: u32,
    heads: u32,
    seq: u32,
    #[comptime] threads: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(rows as usize);
    let tid = UNIT_POS_X as usize;
    let stride = CUBE_DIM_X as usize;
    let seq = seq as usize;
    let heads = heads as usize;
    let p_row = row_offset::<F>(probs, row, heads, seq);
    let g_row = row_offset::<F>(grad_probs, row, heads, seq);
    let out_row = row_offset::<F>(grad_scores, row, heads, seq);
    let (p_step, g_step, out_step) = (probs.stride(3), grad_probs.stride(3), grad_scores.stride(3));
    let visible = row % seq + 1;

    let mut dot = f32::new(0.0);
    let mut j = tid;
    while j < visible {
        dot += f32::cast_from(probs[p_row + j * p_step])
            * f32::cast_from(grad_probs[g_row + j * g_step]);
        j += stride;
    }
    let mut dots = SharedMemory::<f32>::new(threads as usize);
    dots[tid] = dot;
    sync_cube();
    let mut half = stride / 2;
    while half > 0 {
        if tid < half {
            dots[tid] += dots[tid + half];
        }
        sync_cube();
        half /= 2;
    }
    let dot = dots[0];

    let mut j = tid;
    while j < seq {
        let mut g = f32::new(0.0);
        if j < visible {
            let p = f32::cast_from(probs[p_row + j * p_step]);
            g = scale * p * (f32::cast_from(grad_probs[g_row + j * g_step]) - dot);
        }
        grad_scores[out_row + j * out_step] = F::cast_from(g);
        j += stride;
    }
}

/// `softmax(scale · scores)` over the last dimension of `scores` (`[.., seq, seq]`, any float
/// dtype), query `i` seeing keys `0..=i`; the probabilities in the scores' dtype.
pub fn forward<R: CubeRuntime>(scores: CubeTensor<R>, scale: f64) -> CubeTensor<R> {
    let shape = scores.meta.shape().clone();
    let probs = empty_device_contiguous_dtype::<R>(
        scores.client.clone(),
        scores.device.clone(),
        shape.clone(),
        scores.dtype,
    );
    forward_into(scores, scale, probs.clone());
    probs
}

/// [`forward`] written into `probs` (the scores' shape and dtype, any strides): tests pass a
/// poisoned buffer to catch elements the kernel does not write.
pub fn forward_into<R: CubeRuntime>(scores: CubeTensor<R>, scale: f64, probs: CubeTensor<R>) {
    let [rows, heads, seq] = rows_heads_seq(scores.meta.shape());
    if rows == 0 {
        return;
    }
    let (count, threads) = launch_shape(rows, seq);
    let dtype = scores.dtype.into();
    forward_kernel::launch::<R>(
        &scores.client.clone(),
        count,
        CubeDim::new_1d(threads),
        scores.into_tensor_arg(),
        probs.into_tensor_arg(),
        scale as f32,
        rows as u32,
        heads as u32,
        seq as u32,
        threads,
        dtype,
    );
}

/// The gradient of [`forward`]'s `scores` given the probabilities and their gradient (both
/// `[.., seq, seq]`, one dtype): `scale · P · (dP - Σ_row dP · P)`, zero for the future.
pub fn backward<R: CubeRuntime>(
    probs: CubeTensor<R>,
    grad_probs: CubeTensor<R>,
    scale: f64,
) -> CubeTensor<R> {
    let shape = probs.meta.shape().clone();
    let grad = empty_device_contiguous_dtype::<R>(
        probs.client.clone(),
        probs.device.clone(),
        shape.clone(),
        probs.dtype,
    );
    backward_into(probs, grad_probs, scale, grad.clone());
    grad
}

/// [`backward`] written into `grad_scores` (the probabilities' shape and dtype, any strides).
pub fn backward_into<R: CubeRuntime>(
    probs: CubeTensor<R>,
    grad_probs: CubeTensor<R>,
    scale: f64,
    grad_scores: CubeTensor<R>,
) {
    let [rows, heads, seq] = rows_heads_seq(probs.meta.shape());
    if rows == 0 {
        return;
    }
    let (count, threads) = launch_shape(rows, seq);
    let dtype = probs.dtype.into();
    backward_kernel::launch::<R>(
        &probs.client.clone(),
        count,
        CubeDim::new_1d(threads),
        probs.into_tensor_arg(),
        grad_probs.into_tensor_arg(),
        grad_scores.into_tensor_arg(),
        scale as f32,
        rows as u32,
        heads as u32,
        seq as u32,
        threads,
        dtype,
    );
}

/// `[rows, heads, seq]` of `[batch, heads, seq, seq]` scores.
fn rows_heads_seq(shape: &Shape) -> [usize; 3] {
    let dims = shape.as_slice();
    assert_eq!(
        dims.len(),
        4,
        "the causal softmax takes [batch, heads, seq, seq] scores"
    );
    assert_eq!(
        dims[2], dims[3],
        "the causal softmax takes square [seq, seq] scores"
    );
    [dims[0] * dims[1] * dims[2], dims[1], dims[3]]
}
