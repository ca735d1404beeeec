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
//! element by element inside a vector. The statistics are f32 for every dtype.
//!
//! Two kernel sets ([`SoftmaxKernels`]):
//! - **rows in registers** (the default wherever a row fits, up to 64 elements a thread):
//!   a group of threads a row ([`RowLayout`], several rows a cube), one read of the row, one
//!   exponential per visible element, and the row's maximum and sum as plane reductions
//!   where the device has fixed-size planes (shared memory otherwise, as on lavapipe);
//! - **streamed**: one cube a row, a running `(max, sum)` over one read and the writes over a
//!   second, combined through shared memory. Any row length.

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::rows::{RowLayout, row_max, row_of_thread, row_sum};
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

/// [`forward_kernel`] with the row in registers ([`RowLayout`]): the row's maximum, then its
/// exponentials kept in registers and their sum, then the writes. One read of the scores and
/// one exponential per visible element; the reductions are plane operations where the device
/// has fixed-size planes, and several rows share a cube.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_rows_kernel<F: Float, I: Int, N: Size>(
    scores: &Tensor<Vector<F, N>>,
    key_lengths: &Tensor<I>,
    probs: &mut Tensor<Vector<F, N>>,
    scale: f32,
    rows: u32,
    heads: u32,
    seq: u32,
    keys: u32,
    #[comptime] layout: RowLayout,
    #[comptime] causal: bool,
    #[comptime] padded: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let width = N::value();
    let threads = comptime!(layout.threads as usize);
    let tid = UNIT_POS_X as usize;
    let mut row = row_of_thread();
    let active = row < rows as usize;
    if !active {
        // Idle rows still take part in the row reductions' barriers.
        row = 0;
    }
    let seq = seq as usize;
    let keys = keys as usize;
    let input = row_offset::<F, N>(scores, row, heads as usize, seq);
    let output = row_offset::<F, N>(probs, row, heads as usize, seq);
    let (step_in, step_out) = (scores.stride(3), probs.stride(3));
    let mut visible =
        visible_keys::<I>(row, heads as usize, seq, keys, key_lengths, causal, padded);
    if !active {
        visible = 0;
    }
    let mut shared = SharedMemory::<f32>::new(comptime!(layout.shared_slots()));

    // The scaled visible scores (NO_SCORE elsewhere) and their maximum.
    let mut values = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    let mut m = f32::new(NO_SCORE);
    #[unroll]
    for i in 0..comptime!(layout.per_thread) {
        let vector = tid + i * threads;
        let mut x = Vector::<f32, N>::new(NO_SCORE);
        if vector * width < visible {
            let raw = Vector::<f32, N>::cast_from(scores[input + vector * step_in]);
            #[unroll]
            for k in 0..N::value() {
                if vector * width + k < visible {
                    x[k] = raw[k] * scale;
                    m = f32::max(m, x[k]);
                }
            }
        }
        values[i] = x;
    }
    let max = row_max(&mut shared, m, layout.threads, layout.plane);

    let mut s = f32::new(0.0);
    #[unroll]
    for i in 0..comptime!(layout.per_thread) {
        let vector = tid + i * threads;
        let x = values[i];
        let mut e = Vector::<f32, N>::new(0.0);
        if vector * width < visible {
            #[unroll]
            for k in 0..N::value() {
                if vector * width + k < visible {
                    e[k] = (x[k] - max).exp();
                    s += e[k];
                }
            }
        }
        values[i] = e;
    }
    let sum = row_sum(&mut shared, s, layout.threads, layout.plane);
    // A row that sees no key has no sum: its probabilities are the zeros in `values`.
    let mut inverse = f32::new(0.0);
    if sum > 0.0 {
        inverse = f32::new(1.0) / sum;
    }

    if active {
        #[unroll]
        for i in 0..comptime!(layout.per_thread) {
            let vector = tid + i * threads;
            if vector * width < keys {
                probs[output + vector * step_out] =
                    Vector::cast_from(values[i] * Vector::new(inverse));
            }
        }
    }
}

/// [`backward_kernel`] with the row's probabilities and gradient in registers: one read of
/// each.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn backward_rows_kernel<F: Float, N: Size>(
    probs: &Tensor<Vector<F, N>>,
    grad_probs: &Tensor<Vector<F, N>>,
    grad_scores: &mut Tensor<Vector<F, N>>,
    scale: f32,
    rows: u32,
    heads: u32,
    seq: u32,
    keys: u32,
    #[comptime] layout: RowLayout,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let threads = comptime!(layout.threads as usize);
    let tid = UNIT_POS_X as usize;
    let mut row = row_of_thread();
    let active = row < rows as usize;
    if !active {
        row = 0;
    }
    let seq = seq as usize;
    let heads = heads as usize;
    let keys = keys as usize;
    let p_row = row_offset::<F, N>(probs, row, heads, seq);
    let g_row = row_offset::<F, N>(grad_probs, row, heads, seq);
    let out_row = row_offset::<F, N>(grad_scores, row, heads, seq);
    let (p_step, g_step, out_step) = (probs.stride(3), grad_probs.stride(3), grad_scores.stride(3));
    // As in `backward_kernel`: beyond the causal limit nothing is read.
    let mut visible = keys;
    if causal {
        visible = row % seq + 1;
    }
    if !active {
        visible = 0;
    }
    let mut shared = SharedMemory::<f32>::new(comptime!(layout.shared_slots()));

    let mut ps = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    let mut gs = Array::<Vector<f32, N>>::new(comptime!(layout.per_thread));
    let mut dot = f32::new(0.0);
    #[unroll]
    for i in 0..comptime!(layout.per_thread) {
        let vector = tid + i * threads;
        let mut p = Vector::<f32, N>::new(0.0);
        let mut g = Vector::<f32, N>::new(0.0);
        if vector * width < visible {
            let p_in = Vector::<f32, N>::cast_from(probs[p_row + vector * p_step]);
            let g_in = Vector::<f32, N>::cast_from(grad_probs[g_row + vector * g_step]);
            #[unroll]
            for k in 0..N::value() {
                if vector * width + k < visible {
                    p[k] = p_in[k];
                    g[k] = g_in[k];
                    dot += p_in[k] * g_in[k];
                }
            }
        }
        ps[i] = p;
        gs[i] = g;
    }
    let dot = row_sum(&mut shared, dot, layout.threads, layout.plane);

    if active {
        #[unroll]
        for i in 0..comptime!(layout.per_thread) {
            let vector = tid + i * threads;
            if vector * width < keys {
                let out = Vector::new(scale) * ps[i] * (gs[i] - Vector::new(dot));
                grad_scores[out_row + vector * out_step] = Vector::cast_from(out);
            }
        }
    }
}

/// Which kernels run a softmax: the rows held in registers (the default wherever a row fits:
/// up to [`MAX_REGISTER_ELEMENTS`] elements a thread), or streamed twice through one cube a
/// row (any length).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SoftmaxKernels {
    /// [`RowLayout`]'s rows in registers.
    Registers,
    /// One cube a row, the row read twice.
    Streaming,
}

/// Most elements a thread of the register kernels holds (per array: the backward holds two).
pub const MAX_REGISTER_ELEMENTS: usize = 64;

impl SoftmaxKernels {
    /// The kernels for rows of `keys` elements read `width` at a time on `client`'s device.
    pub fn for_rows<R: CubeRuntime>(client: &ComputeClient<R>, keys: usize, width: usize) -> Self {
        let layout = RowLayout::for_row(client, keys / width, width);
        match layout.per_thread * width <= MAX_REGISTER_ELEMENTS {
            true => Self::Registers,
            false => Self::Streaming,
        }
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
    let keys = scores.meta.shape().as_slice().last().copied().unwrap_or(0);
    let width = vector_width(&[&scores, &probs]);
    let kernels = SoftmaxKernels::for_rows(&scores.client, keys, width);
    masked_forward_into_with(scores, key_lengths, scale, causal, probs, kernels)
}

/// [`masked_forward_into`] through the given kernels (tests and benchmarks compare them).
pub fn masked_forward_into_with<R: CubeRuntime>(
    scores: CubeTensor<R>,
    key_lengths: Option<CubeTensor<R>>,
    scale: f64,
    causal: bool,
    probs: CubeTensor<R>,
    kernels: SoftmaxKernels,
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
    let dtypes = [scores.dtype.into(), key_lengths.dtype.into()];
    let client = scores.client.clone();
    match kernels {
        SoftmaxKernels::Registers => {
            let layout = RowLayout::for_row(&client, keys.div_ceil(width), width);
            forward_rows_kernel::launch::<R>(
                &client,
                layout.cube_count(rows),
                layout.cube_dim(),
                width,
                scores.into_tensor_arg(),
                key_lengths.into_tensor_arg(),
                probs.into_tensor_arg(),
                scale as f32,
                rows as u32,
                heads as u32,
                seq as u32,
                keys as u32,
                layout,
                causal,
                padded,
                dtypes,
            );
        }
        SoftmaxKernels::Streaming => {
            let (count, threads) = launch_shape(rows, keys / width);
            forward_kernel::launch::<R>(
                &client,
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
    }
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
    let keys = probs.meta.shape().as_slice().last().copied().unwrap_or(0);
    let width = vector_width(&[&probs, &grad_probs, &grad_scores]);
    let kernels = SoftmaxKernels::for_rows(&probs.client, keys, width);
    masked_backward_into_with(probs, grad_probs, scale, causal, grad_scores, kernels)
}

/// [`masked_backward_into`] through the given kernels.
pub fn masked_backward_into_with<R: CubeRuntime>(
    probs: CubeTensor<R>,
    grad_probs: CubeTensor<R>,
    scale: f64,
    causal: bool,
    grad_scores: CubeTensor<R>,
    kernels: SoftmaxKernels,
) {
    let [rows, heads, seq, keys] = rows_heads_seq_keys(probs.meta.shape(), causal);
    if rows * keys == 0 {
        return;
    }
    let width = vector_width(&[&probs, &grad_probs, &grad_scores]);
    let dtype = probs.dtype.into();
    let client = probs.client.clone();
    match kernels {
        SoftmaxKernels::Registers => {
            let layout = RowLayout::for_row(&client, keys.div_ceil(width), width);
            backward_rows_kernel::launch::<R>(
                &client,
                layout.cube_count(rows),
                layout.cube_dim(),
                width,
                probs.into_tensor_arg(),
                grad_probs.into_tensor_arg(),
                grad_scores.into_tensor_arg(),
                scale as f32,
                rows as u32,
                heads as u32,
                seq as u32,
                keys as u32,
                layout,
                causal,
                dtype,
            );
        }
        SoftmaxKernels::Streaming => {
            let (count, threads) = launch_shape(rows, keys / width);
            backward_kernel::launch::<R>(
                &client,
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
    }
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
