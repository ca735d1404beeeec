//! The vocabulary-parallel cross-entropy's two passes over the logits, each one kernel.
//!
//! With the logits of `rows` tokens split by vocabulary over TP ranks, each rank reduces its
//! `[rows, local]` slice to three numbers per row (the forward kernel): the largest logit, the
//! sum of `exp(x - max)` and the target's logit when the target falls in the slice. The TP
//! reductions of those `[rows]` vectors give the loss. The backward kernel writes
//! `(softmax - one_hot(target)) · dloss` for the slice in one pass, from the logits and the two
//! global statistics; the probabilities are never stored. Statistics are f32 for every logit
//! dtype. Columns at or past `real` (vocabulary padding) take no part and get zero gradient.
//!
//! Both kernels are memory-bound by design: each logit is read once (and, backward, each
//! gradient element written once), in wide loads, with little work per byte:
//!
//! - One cube owns a row; its threads (up to `MAX_THREADS`, fewer for short rows) read it as
//!   [`Vector`]s, the widest the row length and stride allow (16 bytes on CUDA: 8 bf16 or 4
//!   f32), `UNROLL` vectors loaded per thread before any is used. Rows are read in place by
//!   stride: a pitched row (our CUDA runtime pads 50304 bf16 to a 50432-element stride) is not
//!   copied. When no width above 1 divides the row, the kernels read single elements.
//! - Vectors that real columns fill take the vector path. The vector that `real` cuts and the
//!   padding vectors after it are handled lane by lane, so any `real` is exact.
//! - The forward pass is one pass (an online softmax): each thread keeps a running `(max,
//!   Σ exp(x - max))` and rescales its sum once per `UNROLL` vectors to their maximum. The
//!   cube then combines the threads' pairs in one reduction: where the client has plane
//!   (warp) operations and one fixed plane size, a plane reduction, one barrier and a plane
//!   reduction of the planes' pairs; otherwise (wgpu on lavapipe reports no planes, some GPUs
//!   a variable size) a shared-memory tree. The choice is made at compile time from the
//!   client's properties. Thread 0 loads the target's logit first, so that load overlaps the
//!   row's.
//! - The backward pass needs no reduction: each thread writes `exp(x - max) · (1 / sum_exp)
//!   · dloss` for its vectors and `(p - 1) · dloss` at the target's lane.
//! - `exp` of f32 may compile to the GPU's approximate exponential (CUDA's `__expf`, as
//!   Triton's `exp` in torch.compile's kernels): a relative error near `|x| · 6e-8`, far
//!   inside the statistics' f32 tolerance, for a fraction of an exact `expf`'s instructions.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::EnumSet;
use cubecl::prelude::*;

use super::vectors::vector_width;

/// Most threads a row's cube gets (a power of two for the tree reduction).
const MAX_THREADS: usize = 256;
/// Fewest threads a row's cube gets (short rows).
const MIN_THREADS: usize = 32;
/// Vectors each thread loads before it uses them.
const UNROLL: usize = 4;
/// Stands for "no logit yet" in the running maximum: finite, so that `exp(a - b)` of two of
/// them is 1 rather than NaN, and far below any logit.
const NO_LOGIT: f32 = -1.0e30;
/// The kernels' fast-math flags: those that f32 `exp` needs for its approximate form (see the
/// module doc). The kernels' one division (`1 / sum_exp`) needs more, and stays exact.
fn fast_exp() -> EnumSet<FastMath> {
    FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
}

/// Where this rank's slice sits in the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabSlice {
    /// The vocabulary id of the slice's first column.
    pub start: usize,
    /// Columns of the slice that are real tokens (the rest is padding).
    pub real: usize,
}

/// Per-row statistics of a logits slice: `(max, sum_exp, target_logit)`, each `[rows]` f32.
pub struct RowStatistics<R: CubeRuntime> {
    /// The largest real logit of the row (`-1e30` when the slice holds no real column).
    pub max: CubeTensor<R>,
    /// `Σ exp(x - max)` over the row's real columns.
    pub sum_exp: CubeTensor<R>,
    /// The target's logit when the target is in this slice, else 0.
    pub target_logit: CubeTensor<R>,
}

/// The row this cube owns: rows past 65535 go on in the grid's second dimension.
#[cube]
fn cube_row() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// Lane `lane` (a run-time index below the width) of `x`.
#[cube]
fn lane_of<N: Size>(x: Vector<f32, N>, lane: usize) -> f32 {
    let mut value = x[0];
    #[unroll]
    for i in 1..N::value() {
        if i == lane {
            value = x[i];
        }
    }
    value
}

/// The largest lane of `x`.
#[cube]
fn vector_max<N: Size>(x: Vector<f32, N>) -> f32 {
    let mut top = x[0];
    #[unroll]
    for i in 1..N::value() {
        top = f32::max(top, x[i]);
    }
    top
}

/// Two running `(max, Σ exp(x - max))` pairs as one.
#[cube]
fn combine(m1: f32, s1: f32, m2: f32, s2: f32) -> (f32, f32) {
    let top = f32::max(m1, m2);
    (top, s1 * (m1 - top).exp() + s2 * (m2 - top).exp())
}

/// The sum of the lanes of `x`.
#[cube]
fn vector_total<N: Size>(x: Vector<f32, N>) -> f32 {
    let mut total = x[0];
    #[unroll]
    for i in 1..N::value() {
        total += x[i];
    }
    total
}

/// The cube's `(max, Σ exp(x - max))` from each thread's pair, valid in thread 0. `plane` is
/// the fixed plane size, or 0 for the shared-memory tree.
#[cube]
fn reduce_row(m: f32, s: f32, #[comptime] threads: usize, #[comptime] plane: usize) -> (f32, f32) {
    if comptime!(plane > 0) {
        reduce_by_planes(m, s, threads, plane)
    } else {
        reduce_by_tree(m, s, threads)
    }
}

/// [`reduce_row`] with plane operations: a plane reduction, one barrier, and the first plane
/// reduces the planes' pairs.
#[cube]
fn reduce_by_planes(
    m: f32,
    s: f32,
    #[comptime] threads: usize,
    #[comptime] plane: usize,
) -> (f32, f32) {
    let tid = UNIT_POS_X as usize;
    let top = plane_max(m);
    let mut m_out = top;
    let mut s_out = plane_sum(s * (m - top).exp());
    if comptime!(threads > plane) {
        let planes = comptime!(threads / plane);
        let mut maxes = SharedMemory::<f32>::new(planes);
        let mut sums = SharedMemory::<f32>::new(planes);
        if UNIT_POS_PLANE == 0 {
            maxes[tid / plane] = m_out;
            sums[tid / plane] = s_out;
        }
        sync_cube();
        // Uniform over each plane: the first plane, whole, takes this branch.
        if tid < plane {
            let mut m2 = f32::new(NO_LOGIT);
            let mut s2 = f32::new(0.0);
            let mut k = tid;
            while k < planes {
                let (m3, s3) = combine(m2, s2, maxes[k], sums[k]);
                m2 = m3;
                s2 = s3;
                k += plane;
            }
            let top = plane_max(m2);
            s_out = plane_sum(s2 * (m2 - top).exp());
            m_out = top;
        }
    }
    (m_out, s_out)
}

/// [`reduce_row`] through a shared-memory tree, for clients without fixed-size planes.
#[cube]
fn reduce_by_tree(m: f32, s: f32, #[comptime] threads: usize) -> (f32, f32) {
    let tid = UNIT_POS_X as usize;
    let mut maxes = SharedMemory::<f32>::new(threads);
    let mut sums = SharedMemory::<f32>::new(threads);
    maxes[tid] = m;
    sums[tid] = s;
    sync_cube();
    // The launch's cube size (equal to `threads`), read at run time: the halving loop needs a
    // run-time variable.
    let mut half = CUBE_DIM_X as usize / 2;
    while half > 0 {
        if tid < half {
            let (m3, s3) = combine(maxes[tid], sums[tid], maxes[tid + half], sums[tid + half]);
            maxes[tid] = m3;
            sums[tid] = s3;
        }
        sync_cube();
        half /= 2;
    }
    (maxes[0], sums[0])
}

#[cube(launch, fast_math = fast_exp())]
fn statistics_kernel<F: Float, I: Int, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    targets: &Tensor<I>,
    max: &mut Tensor<f32>,
    sum_exp: &mut Tensor<f32>,
    target_logit: &mut Tensor<f32>,
    start: u32,
    real: u32,
    #[comptime] threads: usize,
    #[comptime] plane: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = cube_row();
    if row >= max.shape(0) {
        terminate!();
    }
    let tid = UNIT_POS_X as usize;
    let width = N::value();
    let real = real as usize;
    // Vector offsets: the vectorised axis has stride 1 whenever `width` is above 1, and the
    // row stride is then a multiple of `width`.
    let first = row * logits.stride(0) / width;
    let step = logits.stride(1);
    // Vectors of real columns only.
    let full = real / width;

    let mut picked = f32::new(0.0);
    if tid == 0 {
        let local = i64::cast_from(targets[row]) - i64::cast_from(start);
        if local >= 0 && local < i64::cast_from(real) {
            let column = usize::cast_from(local);
            let x = Vector::<f32, N>::cast_from(logits[first + column / width * step]);
            picked = lane_of(x, column % width);
        }
    }

    // Each thread keeps a running (max, sum of exp relative to it) over its vectors, rescaled
    // once per UNROLL vectors.
    let mut m = f32::new(NO_LOGIT);
    let mut s = f32::new(0.0);
    // Held in the logits' dtype (fewer registers) and widened where used.
    let mut xs = Array::<Vector<F, N>>::new(UNROLL);
    let mut v = tid;
    while v + (UNROLL - 1) * threads < full {
        #[unroll]
        for u in 0..UNROLL {
            xs[u] = logits[first + (v + u * threads) * step];
        }
        let mut top = m;
        #[unroll]
        for u in 0..UNROLL {
            top = f32::max(top, vector_max(Vector::<f32, N>::cast_from(xs[u])));
        }
        let mut sum = s * (m - top).exp();
        #[unroll]
        for u in 0..UNROLL {
            let x = Vector::<f32, N>::cast_from(xs[u]);
            sum += vector_total((x - Vector::new(top)).exp());
        }
        m = top;
        s = sum;
        v += UNROLL * threads;
    }
    while v < full {
        let x = Vector::<f32, N>::cast_from(logits[first + v * step]);
        let top = f32::max(m, vector_max(x));
        s = s * (m - top).exp() + vector_total((x - Vector::new(top)).exp());
        m = top;
        v += threads;
    }
    // The vector `real` cuts, lane by lane.
    if full * width < real && tid == full % threads {
        let x = Vector::<f32, N>::cast_from(logits[first + full * step]);
        #[unroll]
        for i in 0..width {
            if full * width + i < real {
                let (m2, s2) = combine(m, s, x[i], f32::new(1.0));
                m = m2;
                s = s2;
            }
        }
    }

    let (m, s) = reduce_row(m, s, threads, plane);
    if tid == 0 {
        max[row] = m;
        sum_exp[row] = s;
        target_logit[row] = picked;
    }
}

#[cube(launch, fast_math = fast_exp())]
fn gradient_kernel<F: Float, I: Int, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    targets: &Tensor<I>,
    max: &Tensor<f32>,
    sum_exp: &Tensor<f32>,
    grad_loss: &Tensor<f32>,
    grad: &mut Tensor<Vector<F, N>>,
    start: u32,
    real: u32,
    #[comptime] threads: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = cube_row();
    if row >= max.shape(0) {
        terminate!();
    }
    let tid = UNIT_POS_X as usize;
    let width = N::value();
    let real = real as usize;
    let vectors = logits.shape(1) / width;
    let full = real / width;
    // Strided: the runtime may pitch rows (pad each to an aligned size).
    let input = row * logits.stride(0) / width;
    let in_step = logits.stride(1);
    let output = row * grad.stride(0) / width;
    let out_step = grad.stride(1);

    let top = max[row];
    let inverse = f32::new(1.0) / sum_exp[row];
    let dloss = grad_loss[row];
    // The target's column, or `real` (no column) when it is outside the slice.
    let local = i64::cast_from(targets[row]) - i64::cast_from(start);
    let mut target = real;
    if local >= 0 && local < i64::cast_from(real) {
        target = usize::cast_from(local);
    }
    let target_vector = target / width;
    let target_lane = target % width;

    // Vectors of real columns only: vector arithmetic, and a fix-up at the target's lane.
    let mut xs = Array::<Vector<F, N>>::new(UNROLL);
    let mut v = tid;
    while v + (UNROLL - 1) * threads < full {
        #[unroll]
        for u in 0..UNROLL {
            xs[u] = logits[input + (v + u * threads) * in_step];
        }
        #[unroll]
        for u in 0..UNROLL {
            let at = v + u * threads;
            let g = softmax_gradient(xs[u], top, inverse, dloss, at == target_vector, target_lane);
            grad[output + at * out_step] = g;
        }
        v += UNROLL * threads;
    }
    while v < full {
        let g = softmax_gradient(
            logits[input + v * in_step],
            top,
            inverse,
            dloss,
            v == target_vector,
            target_lane,
        );
        grad[output + v * out_step] = g;
        v += threads;
    }
    // The vector `real` cuts and the padding: lane by lane, zero past `real`.
    let mut v = full + tid;
    while v < vectors {
        let x = Vector::<f32, N>::cast_from(logits[input + v * in_step]);
        let mut g = Vector::<f32, N>::empty();
        #[unroll]
        for i in 0..width {
            let column = v * width + i;
            let mut gi = f32::new(0.0);
            if column < real {
                gi = (x[i] - top).exp() * inverse;
                if column == target {
                    gi -= f32::new(1.0);
                }
                gi *= dloss;
            }
            g[i] = gi;
        }
        grad[output + v * out_step] = Vector::cast_from(g);
        v += threads;
    }
}

/// `(exp(x - top) · inverse - one_hot) · dloss` for a vector of real columns, the one-hot at
/// `lane` when `has_target`.
#[cube]
fn softmax_gradient<F: Float, N: Size>(
    x: Vector<F, N>,
    top: f32,
    inverse: f32,
    dloss: f32,
    has_target: bool,
    lane: usize,
) -> Vector<F, N> {
    let p = (Vector::<f32, N>::cast_from(x) - Vector::new(top)).exp() * Vector::new(inverse);
    let mut g = p * Vector::new(dloss);
    if has_target {
        #[unroll]
        for i in 0..N::value() {
            if i == lane {
                g[i] = (p[i] - f32::new(1.0)) * dloss;
            }
        }
    }
    Vector::cast_from(g)
}

/// The grid of a kernel with one cube per row: 2D past 65535 rows, the limit of one dimension
/// on some backends.
fn row_grid(rows: usize) -> CubeCount {
    let rows = rows as u32;
    match rows > 65_535 {
        true => CubeCount::Static(65_535, rows.div_ceil(65_535), 1),
        false => CubeCount::Static(rows, 1, 1),
    }
}

/// Threads of a row's cube for rows of `vectors` vectors: enough for `UNROLL` vectors each,
/// a power of two, whole planes.
fn row_threads(vectors: usize, plane: usize) -> usize {
    vectors
        .div_ceil(UNROLL)
        .next_power_of_two()
        .clamp(MIN_THREADS.max(plane), MAX_THREADS)
}

/// The client's fixed plane size ([`super::rows::fixed_plane_size`]) if whole cubes of
/// [`MIN_THREADS`]..=`MAX_THREADS` threads split into such planes, else 0 (the
/// shared-memory tree).
fn fixed_plane_size<R: CubeRuntime>(client: &ComputeClient<R>) -> usize {
    super::rows::fixed_plane_size(client)
        .map(|size| size as usize)
        .filter(|size| size.is_power_of_two() && *size <= MAX_THREADS)
        .unwrap_or(0)
}

/// The forward kernel: row statistics of `logits` (`[rows, local]`, any float dtype) against
/// `targets` (`[rows]`, global vocabulary ids; negative ones are never in a slice).
pub fn row_statistics<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    slice: VocabSlice,
) -> RowStatistics<R> {
    // Strided reads: no copy of a pitched or transposed slice.
    let targets = into_contiguous(targets);
    let rows = logits.meta.shape()[0];
    let local = logits.meta.shape()[1];
    let new_stat = || {
        empty_device_contiguous_dtype::<R>(
            logits.client.clone(),
            logits.device.clone(),
            Shape::new([rows]),
            DType::F32,
        )
    };
    let stats = RowStatistics {
        max: new_stat(),
        sum_exp: new_stat(),
        target_logit: new_stat(),
    };
    if rows == 0 {
        return stats;
    }
    let client = logits.client.clone();
    let width = vector_width(&[&logits]);
    let plane = fixed_plane_size(&client);
    let threads = row_threads(local / width, plane);
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    statistics_kernel::launch::<R>(
        &client,
        row_grid(rows),
        CubeDim::new_1d(threads as u32),
        width,
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        stats.max.clone().into_tensor_arg(),
        stats.sum_exp.clone().into_tensor_arg(),
        stats.target_logit.clone().into_tensor_arg(),
        slice.start as u32,
        slice.real as u32,
        threads,
        plane,
        dtypes,
    );
    stats
}

/// The backward kernel: `(exp(x - max) / sum_exp - one_hot(target)) · grad_loss` per row of
/// `logits` (`[rows, local]`), 0 in padding columns, in the logits' dtype. `max`, `sum_exp`
/// and `grad_loss` are `[rows]` f32; `max` and `sum_exp` are the global (TP-reduced) values.
pub fn gradient<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    max: CubeTensor<R>,
    sum_exp: CubeTensor<R>,
    grad_loss: CubeTensor<R>,
    slice: VocabSlice,
) -> CubeTensor<R> {
    let shape = logits.meta.shape().clone();
    let grad = empty_device_contiguous_dtype::<R>(
        logits.client.clone(),
        logits.device.clone(),
        shape.clone(),
        logits.dtype,
    );
    gradient_into(
        logits,
        targets,
        max,
        sum_exp,
        grad_loss,
        slice,
        grad.clone(),
    );
    grad
}

/// [`gradient`] written into `grad` (`[rows, local]`, the logits' dtype, any row stride):
/// tests pass a poisoned buffer to catch elements the kernel does not write.
pub fn gradient_into<R: CubeRuntime>(
    logits: CubeTensor<R>,
    targets: CubeTensor<R>,
    max: CubeTensor<R>,
    sum_exp: CubeTensor<R>,
    grad_loss: CubeTensor<R>,
    slice: VocabSlice,
    grad: CubeTensor<R>,
) {
    let [targets, max, sum_exp, grad_loss] =
        [targets, max, sum_exp, grad_loss].map(into_contiguous);
    let shape = logits.meta.shape().clone();
    let (rows, local) = (shape[0], shape[1]);
    if rows * local == 0 {
        return;
    }
    let client = logits.client.clone();
    let width = vector_width(&[&logits, &grad]);
    let threads = row_threads(local / width, fixed_plane_size(&client));
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    gradient_kernel::launch::<R>(
        &client,
        row_grid(rows),
        CubeDim::new_1d(threads as u32),
        width,
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        max.into_tensor_arg(),
        sum_exp.into_tensor_arg(),
        grad_loss.into_tensor_arg(),
        grad.into_tensor_arg(),
        slice.start as u32,
        slice.real as u32,
        threads,
        dtypes,
    );
}
