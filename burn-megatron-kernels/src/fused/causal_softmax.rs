//! The attention's scaled, masked softmax, forward and backward, each one kernel (Megatron's
//! `ScaledUpperTriangMaskedSoftmax` and `ScaledMaskedSoftmax` for padding).
//!
//! Rows are the `[batch · heads · queries]` query positions of the `[batch, heads, queries,
//! keys]` scores. With the causal mask (square scores) query `i` sees keys `0..=i`; with a
//! padding mask, batch element `b` sees keys `0..key_lengths[b]`; with both, the intersection.
//! A row that sees no key is all zeros. The forward reads a row's visible scores once for a
//! running `(max, sum)` and once more to write `exp(scale · x - max) / sum` (and zeros for
//! the future); the backward reads the probabilities and their gradient once for
//! `Σ dP · P` and once more to write `scale · P · (dP - Σ dP · P)`. Rows are read and written
//! as [`Vector`]s (16-byte accesses where the shapes and strides allow), the masks applied
//! element by element inside a vector. The statistics are f32 for every dtype; a row's
//! threads combine theirs through shared memory (no plane size is assumed).

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::vector_width;

/// Stands for "no score yet" in the running maximum (finite: see the cross-entropy kernel).
const NO_SCORE: f32 = -1.0e30;

/// The launch of one cube per row: a power-of-two thread count fitting the row's `vectors`
/// (about two a thread), and a 2D grid that keeps each dimension within every runtime's limit.
fn launch_shape(rows: usize, vectors: usize) -> (CubeCount, u32) {
    let threads = (vectors.div_ceil(2)).next_power_of_two().clamp(32, 256) as u32;
    let x = rows.min(65_535) as u32;
    let y = rows.div_ceil(x as usize) as u32;
    (CubeCount::Static(x, y, 1), threads)
}

/// Where row `row` (a query position of `[batch, heads, seq, keys]`) starts in `t`, in
/// vectors: strided, since the runtime may pitch rows (pad each to an aligned size). The keys'
/// axis has stride 1 whenever the width is above 1, and every other stride is then a multiple
/// of it.
#[cube]
fn row_offset<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    row: usize,
    heads: usize,
    seq: usize,
) -> usize {
    let query = row % seq;
    let batch_head = row / seq;
    ((batch_head / heads) * t.stride(0) + (batch_head % heads) * t.stride(1) + query * t.stride(2))
        / N::value()
}

#[cube]
fn row_index(rows: usize) -> usize {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= rows {
        terminate!();
    }
    row
}

/// The keys row `row` sees: `0..visible`.
#[cube]
fn visible_keys<I: Int>(
    row: usize,
    heads: usize,
    seq: usize,
    keys: usize,
    key_lengths: &Tensor<I>,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
) -> usize {
    let mut visible = keys;
    if causal {
        visible = row % seq + 1;
    }
    if padded {
        let length = i64::cast_from(key_lengths[row / seq / heads]);
        let mut limit = 0usize;
        if length > 0 {
            limit = length as usize;
        }
        if limit < visible {
            visible = limit;
        }
    }
    visible
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float, I: Int, N: Size>(
    scores: &Tensor<Vector<F, N>>,
    key_lengths: &Tensor<I>,
    probs: &mut Tensor<Vector<F, N>>,
    scale: f32,
    rows: u32,
    heads: u32,
    seq: u32,
    keys: u32,
    #[comptime] threads: u32,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = row_index(rows as usize);
    let width = N::value();
    let tid = UNIT_POS_X as usize;
    let stride = CUBE_DIM_X as usize;
    let seq = seq as usize;
    let keys = keys as usize;
    let input = row_offset::<F, N>(scores, row, heads as usize, seq);
    let output = row_offset::<F, N>(probs, row, heads as usize, seq);
    let (step_in, step_out) = (scores.stride(3), probs.stride(3));
    let visible = visible_keys::<I>(row, heads as usize, seq, keys, key_lengths, causal, padded);

    // The running (max, sum) over the visible keys, a vector at a time.
    let mut m = f32::new(NO_SCORE);
    let mut s = f32::new(0.0);
    let mut v = tid;
    while v * width < visible {
        let x = Vector::<f32, N>::cast_from(scores[input + v * step_in]);
        #[unroll]
        for k in 0..N::value() {
            if v * width + k < visible {
                let xs = x[k] * scale;
                if xs > m {
                    s = s * (m - xs).exp() + f32::new(1.0);
                    m = xs;
                } else {
                    s += (xs - m).exp();
                }
            }
        }
        v += stride;
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

    let mut v = tid;
    while v * width < keys {
        let mut p = Vector::<f32, N>::new(0.0);
        // A vector past the visible keys is written as zeros without being read.
        if v * width < visible {
            let x = Vector::<f32, N>::cast_from(scores[input + v * step_in]);
            #[unroll]
            for k in 0..N::value() {
                if v * width + k < visible {
                    p[k] = (x[k] * scale - max).exp() * inverse;
                }
            }
        }
        probs[output + v * step_out] = Vector::cast_from(p);
        v += stride;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_kernel<F: Float, N: Size>(
    probs: &Tensor<Vector<F, N>>,
    grad_probs: &Tensor<Vector<F, N>>,
    grad_scores: &mut Tensor<Vector<F, N>>,
    scale: f32,
    rows: u32,
    heads: u32,
    seq: u32,
    keys: u32,
    #[comptime] threads: u32,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(rows as usize);
    let width = N::value();
    let tid = UNIT_POS_X as usize;
    let stride = CUBE_DIM_X as usize;
    let seq = seq as usize;
    let heads = heads as usize;
    let p_row = row_offset::<F, N>(probs, row, heads, seq);
    let g_row = row_offset::<F, N>(grad_probs, row, heads, seq);
    let out_row = row_offset::<F, N>(grad_scores, row, heads, seq);
    let (p_step, g_step, out_step) = (probs.stride(3), grad_probs.stride(3), grad_scores.stride(3));
    let keys = keys as usize;
    // Masked probabilities are zero and so are their gradients: beyond the causal limit they
    // are not read, padded keys are read like any other.
    let mut visible = keys;
    if causal {
        visible = row % seq + 1;
    }

    let mut dot = f32::new(0.0);
    let mut v = tid;
    while v * width < visible {
        let p = Vector::<f32, N>::cast_from(probs[p_row + v * p_step]);
        let g = Vector::<f32, N>::cast_from(grad_probs[g_row + v * g_step]);
        #[unroll]
        for k in 0..N::value() {
            if v * width + k < visible {
                dot += p[k] * g[k];
            }
        }
        v += stride;
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

    let mut v = tid;
    while v * width < keys {
        let mut out = Vector::<f32, N>::new(0.0);
        if v * width < visible {
            let p = Vector::<f32, N>::cast_from(probs[p_row + v * p_step]);
            let g = Vector::<f32, N>::cast_from(grad_probs[g_row + v * g_step]);
            #[unroll]
            for k in 0..N::value() {
                if v * width + k < visible {
                    out[k] = scale * p[k] * (g[k] - dot);
                }
            }
        }
        grad_scores[out_row + v * out_step] = Vector::cast_from(out);
        v += stride;
    }
}

/// `softmax(scale · scores)` over the last dimension of `scores` (`[.., seq, seq]`, any float
/// dtype), query `i` seeing keys `0..=i`; the probabilities in the scores' dtype.
pub fn forward<R: CubeRuntime>(scores: CubeTensor<R>, scale: f64) -> CubeTensor<R> {
    masked_forward(scores, None, scale, true)
}

/// [`forward`] written into `probs` (the scores' shape and dtype, any strides): tests pass a
/// poisoned buffer to catch elements the kernel does not write.
pub fn forward_into<R: CubeRuntime>(scores: CubeTensor<R>, scale: f64, probs: CubeTensor<R>) {
    masked_forward_into(scores, None, scale, true, probs)
}

/// `softmax(scale · scores)` over the last dimension of `scores` (`[batch, heads, queries,
/// keys]`, any float dtype), batch element `b` seeing keys `0..key_lengths[b]` (`[batch]`, any
/// integer dtype; all keys without it) and, when `causal` (square scores), query `i` keys
/// `0..=i`; rows that see no key are zeros. The probabilities in the scores' dtype.
pub fn masked_forward<R: CubeRuntime>(
    scores: CubeTensor<R>,
    key_lengths: Option<CubeTensor<R>>,
    scale: f64,
    causal: bool,
) -> CubeTensor<R> {
    let probs = empty_device_contiguous_dtype::<R>(
        scores.client.clone(),
        scores.device.clone(),
        scores.meta.shape().clone(),
        scores.dtype,
    );
    masked_forward_into(scores, key_lengths, scale, causal, probs.clone());
    probs
}

/// [`masked_forward`] written into `probs` (the scores' shape and dtype, any strides).
pub fn masked_forward_into<R: CubeRuntime>(
    scores: CubeTensor<R>,
    key_lengths: Option<CubeTensor<R>>,
    scale: f64,
    causal: bool,
    probs: CubeTensor<R>,
) {
    let [rows, heads, seq, keys] = rows_heads_seq_keys(scores.meta.shape(), causal);
    if let Some(lengths) = &key_lengths {
        assert_eq!(
            lengths.meta.shape().as_slice(),
            [scores.meta.shape().as_slice()[0]],
            "the padded softmax takes one key length per batch element"
        );
    }
    if rows * keys == 0 {
        return;
    }
    let padded = key_lengths.is_some();
    // Without a padding mask the kernel reads no length: a one-element placeholder.
    let key_lengths = key_lengths.unwrap_or_else(|| {
        empty_device_contiguous_dtype::<R>(
            scores.client.clone(),
            scores.device.clone(),
            Shape::new([1]),
            burn::tensor::DType::I32,
        )
    });
    let width = vector_width(&[&scores, &probs]);
    let (count, threads) = launch_shape(rows, keys / width);
    let dtypes = [scores.dtype.into(), key_lengths.dtype.into()];
    forward_kernel::launch::<R>(
        &scores.client.clone(),
        count,
        CubeDim::new_1d(threads),
        width,
        scores.into_tensor_arg(),
        key_lengths.into_tensor_arg(),
        probs.into_tensor_arg(),
        scale as f32,
        rows as u32,
        heads as u32,
        seq as u32,
        keys as u32,
        threads,
        causal,
        padded,
        dtypes,
    );
}

/// The gradient of [`forward`]'s `scores` given the probabilities and their gradient (both
/// `[.., seq, seq]`, one dtype): `scale · P · (dP - Σ_row dP · P)`, zero for the future.
pub fn backward<R: CubeRuntime>(
    probs: CubeTensor<R>,
    grad_probs: CubeTensor<R>,
    scale: f64,
) -> CubeTensor<R> {
    masked_backward(probs, grad_probs, scale, true)
}

/// [`backward`] written into `grad_scores` (the probabilities' shape and dtype, any strides).
pub fn backward_into<R: CubeRuntime>(
    probs: CubeTensor<R>,
    grad_probs: CubeTensor<R>,
    scale: f64,
    grad_scores: CubeTensor<R>,
) {
    masked_backward_into(probs, grad_probs, scale, true, grad_scores)
}

/// The gradient of [`masked_forward`]'s `scores` given the probabilities and their gradient
/// (both `[batch, heads, queries, keys]`, one dtype): `scale · P · (dP - Σ_row dP · P)`. Masked
/// probabilities are zero, so are their gradients; only the causal mask is needed (to skip
/// the future), not the key lengths.
pub fn masked_backward<R: CubeRuntime>(
    probs: CubeTensor<R>,
    grad_probs: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> CubeTensor<R> {
    let grad = empty_device_contiguous_dtype::<R>(
        probs.client.clone(),
        probs.device.clone(),
        probs.meta.shape().clone(),
        probs.dtype,
    );
    masked_backward_into(probs, grad_probs, scale, causal, grad.clone());
    grad
}

/// [`masked_backward`] written into `grad_scores` (the probabilities' shape and dtype, any
/// strides).
pub fn masked_backward_into<R: CubeRuntime>(
    probs: CubeTensor<R>,
    grad_probs: CubeTensor<R>,
    scale: f64,
    causal: bool,
    grad_scores: CubeTensor<R>,
) {
    let [rows, heads, seq, keys] = rows_heads_seq_keys(probs.meta.shape(), causal);
    if rows * keys == 0 {
        return;
    }
    let width = vector_width(&[&probs, &grad_probs, &grad_scores]);
    let (count, threads) = launch_shape(rows, keys / width);
    let dtype = probs.dtype.into();
    backward_kernel::launch::<R>(
        &probs.client.clone(),
        count,
        CubeDim::new_1d(threads),
        width,
        probs.into_tensor_arg(),
        grad_probs.into_tensor_arg(),
        grad_scores.into_tensor_arg(),
        scale as f32,
        rows as u32,
        heads as u32,
        seq as u32,
        keys as u32,
        threads,
        causal,
        dtype,
    );
}

/// `[rows, heads, queries, keys]` of `[batch, heads, queries, keys]` scores (square when
/// `causal`).
fn rows_heads_seq_keys(shape: &Shape, causal: bool) -> [usize; 4] {
    let dims = shape.as_slice();
    assert_eq!(
        dims.len(),
        4,
        "the masked softmax takes [batch, heads, queries, keys] scores"
    );
    assert!(
        !causal || dims[2] == dims[3],
        "the causal softmax takes square [seq, seq] scores, got {dims:?}"
    );
    [dims[0] * dims[1] * dims[2], dims[1], dims[2], dims[3]]
}
