//! The vocabulary-parallel cross-entropy's two passes over the logits, each one kernel.
//!
//! With the logits of `rows` tokens split by vocabulary over TP ranks, each rank reduces its
//! `[rows, local]` slice to three numbers per row (the forward kernel): the largest logit, the
//! sum of `exp(x - max)` and the target's logit when the target falls in the slice. The TP
//! reductions of those `[rows]` vectors give the loss. The backward kernel writes
//! `(softmax - one_hot(target)) · dloss` for the slice in one pass, from the logits and the two
//! global statistics; the probabilities are never stored. Statistics are f32 for every logit
//! dtype. Columns at or past `real` (vocabulary padding) take no part and get zero gradient.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Threads per row in the forward kernel (a power of two for the tree reduction).
const ROW_THREADS: u32 = 256;
/// Threads per cube in the backward kernel.
const ELEMENT_THREADS: u32 = 256;
/// Stands for "no logit yet" in the running maximum: finite, so that `exp(a - b)` of two of
/// them is 1 rather than NaN, and far below any logit.
const NO_LOGIT: f32 = -1.0e30;

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

#[cube(launch)]
fn statistics_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    max: &mut Tensor<f32>,
    sum_exp: &mut Tensor<f32>,
    target_logit: &mut Tensor<f32>,
    start: u32,
    real: u32,
    #[comptime] threads: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS_X as usize;
    // The launch's cube size (equal to `threads`), read at run time: the halving loop below
    // needs a run-time variable.
    let stride = CUBE_DIM_X as usize;
    let base = row * logits.stride(0);
    let real = real as usize;

    // Each thread keeps a running (max, sum of exp relative to it) over its columns.
    let mut m = f32::new(NO_LOGIT);
    let mut s = f32::new(0.0);
    let mut j = tid;
    while j < real {
        let x = f32::cast_from(logits[base + j * logits.stride(1)]);
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

    if tid == 0 {
        max[row] = maxes[0];
        sum_exp[row] = sums[0];
        let local = i64::cast_from(targets[row]) - i64::cast_from(start);
        let mut picked = f32::new(0.0);
        if local >= 0 && local < i64::cast_from(real) {
            picked = f32::cast_from(logits[base + usize::cast_from(local) * logits.stride(1)]);
        }
        target_logit[row] = picked;
    }
}

#[cube(launch)]
fn gradient_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    max: &Tensor<f32>,
    sum_exp: &Tensor<f32>,
    grad_loss: &Tensor<f32>,
    grad: &mut Tensor<F>,
    start: u32,
    real: u32,
    rows: u32,
    local: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let pos = ABSOLUTE_POS;
    if pos >= rows as usize * local as usize {
        terminate!();
    }
    let row = pos / local as usize;
    let column = pos % local as usize;
    // Strided: the runtime may pitch rows (pad each to an aligned size).
    let input = row * logits.stride(0) + column * logits.stride(1);
    let output = row * grad.stride(0) + column * grad.stride(1);
    let mut g = f32::new(0.0);
    if column < real as usize {
        g = (f32::cast_from(logits[input]) - max[row]).exp() / sum_exp[row];
        let target = i64::cast_from(targets[row]) - i64::cast_from(start);
        if target == i64::cast_from(column) {
            g -= f32::new(1.0);
        }
        g *= grad_loss[row];
    }
    grad[output] = F::cast_from(g);
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
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    statistics_kernel::launch::<R>(
        &logits.client.clone(),
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(ROW_THREADS),
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        stats.max.clone().into_tensor_arg(),
        stats.sum_exp.clone().into_tensor_arg(),
        stats.target_logit.clone().into_tensor_arg(),
        slice.start as u32,
        slice.real as u32,
        ROW_THREADS,
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
    let elements = rows * local;
    if elements == 0 {
        return;
    }
    let dtypes = [logits.dtype.into(), targets.dtype.into()];
    let cubes = elements.div_ceil(ELEMENT_THREADS as usize) as u32;
    // A 2D grid keeps each dimension of the launch within the hardware's limit.
    let (x, y) = match cubes > 65_535 {
        true => (65_535, cubes.div_ceil(65_535)),
        false => (cubes, 1),
    };
    gradient_kernel::launch::<R>(
        &logits.client.clone(),
        CubeCount::Static(x, y, 1),
        CubeDim::new_1d(ELEMENT_THREADS),
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        max.into_tensor_arg(),
        sum_exp.into_tensor_arg(),
        grad_loss.into_tensor_arg(),
        grad.into_tensor_arg(),
        slice.start as u32,
        slice.real as u32,
        rows as u32,
        local as u32,
        dtypes,
    );
}
