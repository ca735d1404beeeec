//! One decode step's attention, one kernel a layer: RoPE on the new token's query and key,
//! the key and value written to the KV cache's column, and `softmax(scale · q kᵀ) v` of each
//! query head over its group's cached keys, masked to the row's visible columns.
//!
//! The unfused step runs some sixteen kernels here (the rotation's products and
//! concatenation, the key and value copies into the cache, the score product, the mask, the
//! softmax, the product with the values, the layout copies): at batch 1 each is a few
//! microseconds of launch for almost no work, and a decode step is hundreds of them.
//!
//! One cube a (batch row, query head). The new token's query, key and value are read from the
//! packed QKV projection (`[batch, 1, groups, heads_per_group + 2, head_dim]`: per group its
//! query heads, its key head, its value head), rotated in f32 at the row's position and
//! rounded to the storage dtype as the unfused step rounds them; the group's first query head
//! writes the key and value to the cache at `column`. Attention then reads the cache's columns
//! `pads[b]..column` (earlier columns are left padding) and the new key and value from shared
//! memory, never the column being written, so no cube reads what another writes. Columns are
//! taken a tile of 256 at a time with a running maximum and sum (the online softmax of flash
//! attention), each thread a column's score (its key row loaded as vectors of up to 8, all
//! issued before the products: a decode step's attention waits on memory latency, not
//! bandwidth), then the threads split as vectors of lanes times column subsets for the
//! product with the values. The head dimension is a compile-time constant (the loops over a
//! row unrolled). Statistics and sums are f32 for every storage dtype.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::rows::{fixed_plane_size, row_max, row_sum};
use super::vectors::vector_width;

/// Threads a cube: columns a tile.
const THREADS: u32 = 256;

/// The largest head dimension: a thread a lane of the query, key and value.
pub const MAX_HEAD_DIM: usize = THREADS as usize;

/// The widest vector the caches are read with (the partial products' shared memory holds
/// this many floats a thread).
const MAX_VECTOR: usize = 8;

/// Stands for "no score yet" in the running maximum (finite, so that `exp(old - new)` is 0
/// and never NaN).
const NO_SCORE: f32 = -1.0e30;

/// A non-negative index read from an int tensor (negative values clamp to 0).
#[cube]
fn index_at<I: Int>(t: &Tensor<I>, at: usize) -> usize {
    let value = i64::cast_from(t[at]);
    let mut index = 0usize;
    if value > 0 {
        index = value as usize;
    }
    index
}

/// Lane `lane` of the head starting at `at` in `qkv`, rotated by the angle whose cosine and
/// sine are at `entry` of the tables (the "rotate half" pairs `(i, i + head_dim / 2)`), or as
/// it is without `rotate`; rounded to the storage dtype as the unfused step rounds it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn head_lane<F: Float>(
    qkv: &Tensor<F>,
    at: usize,
    lane: usize,
    half: usize,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    entry: usize,
    #[comptime] rotate: bool,
) -> f32 {
    let x = f32::cast_from(qkv[at + lane]);
    let mut out = x;
    if rotate {
        let c = cos[entry + lane];
        let s = sin[entry + lane];
        if lane < half {
            out = x * c - f32::cast_from(qkv[at + lane + half]) * s;
        } else {
            out = x * c + f32::cast_from(qkv[at + lane - half]) * s;
        }
    }
    f32::cast_from(F::cast_from(out))
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn decode_attention_kernel<F: Float, I: Int, N: Size>(
    qkv: &Tensor<F>,
    keys: &mut Tensor<Vector<F, N>>,
    values: &mut Tensor<Vector<F, N>>,
    column: &Tensor<I>,
    pads: &Tensor<I>,
    positions: &Tensor<I>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    context: &mut Tensor<F>,
    groups: u32,
    per_group: u32,
    capacity: u32,
    table_rows: u32,
    scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] vectors: u32,
    #[comptime] rotate: bool,
    #[comptime] plane: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let tid = UNIT_POS_X as usize;
    let threads = THREADS as usize;
    let width = N::value();
    let head = CUBE_POS_X as usize;
    let b = CUBE_POS_Y as usize;
    let dim = comptime!(head_dim as usize);
    let half = dim / 2;
    let per_group = per_group as usize;
    let slots = per_group + 2;
    let group = head / per_group;
    // This query head's place in its group (the group's first writes the cache).
    let slot = head % per_group;
    let group_row = (b * groups as usize + group) * slots;
    // The host checks that the column fits; clamped here only to keep every access inside.
    let mut column = index_at::<I>(column, 0);
    if column >= capacity as usize {
        column = capacity as usize - 1;
    }
    // The new column is always visible: a padding row attends to itself, as unfused.
    let mut first = index_at::<I>(pads, b);
    if first > column {
        first = column;
    }
    let mut position = index_at::<I>(positions, b);
    if position >= table_rows as usize {
        position = table_rows as usize - 1;
    }
    let entry = position * dim;
    // The group's cache rows, in vectors.
    let cache = (b * groups as usize + group) * capacity as usize * comptime!(vectors as usize);

    // The new token's (rotated, scaled) query, key and value, a lane a thread.
    let mut query = SharedMemory::<f32>::new(MAX_HEAD_DIM);
    let mut new_key = SharedMemory::<f32>::new(MAX_HEAD_DIM);
    let mut new_value = SharedMemory::<f32>::new(MAX_HEAD_DIM);
    if tid < dim {
        let q = head_lane::<F>(
            qkv,
            (group_row + slot) * dim,
            tid,
            half,
            cos,
            sin,
            entry,
            rotate,
        );
        let k = head_lane::<F>(
            qkv,
            (group_row + per_group) * dim,
            tid,
            half,
            cos,
            sin,
            entry,
            rotate,
        );
        query[tid] = q * scale;
        new_key[tid] = k;
        new_value[tid] = f32::cast_from(qkv[(group_row + per_group + 1) * dim + tid]);
    }
    sync_cube();
    // The group's first query head writes the new key and value to the cache, a vector a
    // thread (other cubes of the group read the new column from their shared memory).
    if slot == 0 && tid < comptime!(vectors as usize) {
        let mut k = Vector::<F, N>::new(F::new(0.0));
        let mut v = Vector::<F, N>::new(F::new(0.0));
        #[unroll]
        for e in 0..N::value() {
            k[e] = F::cast_from(new_key[tid * width + e]);
            v[e] = F::cast_from(new_value[tid * width + e]);
        }
        let at = cache + column * comptime!(vectors as usize) + tid;
        keys[at] = k;
        values[at] = v;
    }

    // For the product with the values: a vector of lanes and a subset of columns a thread.
    let parts = threads / comptime!(vectors as usize);
    let part = tid / comptime!(vectors as usize);
    let lanes = tid % comptime!(vectors as usize);
    let mut probs = SharedMemory::<f32>::new(THREADS as usize);
    let mut shared = SharedMemory::<f32>::new(THREADS as usize);
    let mut max = f32::new(NO_SCORE);
    let mut sum = f32::new(0.0);
    let mut acc = Vector::<f32, N>::new(0.0);
    let end = column + 1;
    let mut start = first;
    // The same tiles for every thread of the cube: the barriers inside are uniform.
    while start < end {
        let j = start + tid;
        let mut score = f32::new(NO_SCORE);
        if j < end {
            let mut dot = f32::new(0.0);
            if j == column {
                for e in 0..dim {
                    dot += query[e] * new_key[e];
                }
            } else {
                // The row's vectors loaded back to back, then their products.
                let row = cache + j * comptime!(vectors as usize);
                #[unroll]
                for v in 0..comptime!(vectors as usize) {
                    let key = Vector::<f32, N>::cast_from(keys[row + v]);
                    #[unroll]
                    for e in 0..N::value() {
                        dot += query[v * width + e] * key[e];
                    }
                }
            }
            score = dot;
        }
        let tile_max = row_max(&mut shared, score, THREADS, plane);
        let top = f32::max(max, tile_max);
        let mut p = f32::new(0.0);
        if j < end {
            p = (score - top).exp();
        }
        probs[tid] = p;
        let tile_sum = row_sum(&mut shared, p, THREADS, plane);
        let factor = (max - top).exp();
        sum = sum * factor + tile_sum;
        acc *= Vector::new(factor);
        let mut c = part;
        if part >= parts {
            // Threads past the last whole subset (when the vectors a row do not divide 256).
            c = threads;
        }
        while c < threads && start + c < end {
            let at = start + c;
            let mut v = Vector::<f32, N>::new(0.0);
            if at == column {
                #[unroll]
                for e in 0..N::value() {
                    v[e] = new_value[lanes * width + e];
                }
            } else {
                v = Vector::cast_from(values[cache + at * comptime!(vectors as usize) + lanes]);
            }
            acc += Vector::new(probs[c]) * v;
            c += parts;
        }
        max = top;
        // Every thread has read this tile's probabilities before the next writes them.
        sync_cube();
        start += threads;
    }

    // The column subsets' partial products summed, divided by the row's sum.
    let mut partials = SharedMemory::<f32>::new(comptime!(THREADS as usize * MAX_VECTOR));
    #[unroll]
    for e in 0..N::value() {
        partials[tid * width + e] = acc[e];
    }
    sync_cube();
    if tid < dim {
        let mut total = f32::new(0.0);
        for p in 0..parts {
            total += partials[p * dim + tid];
        }
        let heads = groups as usize * per_group;
        context[(b * heads + head) * dim + tid] = F::cast_from(total / sum);
    }
}

/// The shape of a decode step's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLayout {
    /// Query groups (key/value heads) of this rank.
    pub groups: usize,
    /// Query heads a group.
    pub heads_per_group: usize,
    /// Lanes a head (even, at most [`MAX_HEAD_DIM`]).
    pub head_dim: usize,
}

/// The inputs of [`attend`] that the step keeps on the device, one int dtype.
///
/// # Shapes
/// - column: `[1]`, the cache column the new token is written to (the same for every row)
/// - pads: `[batch]`, each row's left padding (its first visible column)
/// - positions: `[batch]`, each row's RoPE position (clamped to the table's last row)
pub struct DecodeIndices<R: CubeRuntime> {
    pub column: CubeTensor<R>,
    pub pads: CubeTensor<R>,
    pub positions: CubeTensor<R>,
}

/// One decode step's attention over `qkv`, the new token's packed projection: returns the
/// context and the key and value caches with the new token's key and value written at the
/// column (in place where nothing else holds a cache's buffer, else into a copy). `table`: the
/// RoPE cosines and sines (`[rows, head_dim]` each, f32, both halves of a row equal), `None`
/// without RoPE. Columns past `column` and before a row's padding are masked.
///
/// # Shapes
/// - qkv: `[batch, 1, groups, heads_per_group + 2, head_dim]`
/// - keys, values: `[batch, groups, capacity, head_dim]`
/// - output: `[batch, 1, groups · heads_per_group, head_dim]`
pub fn attend<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    [keys, values]: [CubeTensor<R>; 2],
    indices: DecodeIndices<R>,
    table: Option<[CubeTensor<R>; 2]>,
    layout: DecodeLayout,
    scale: f64,
) -> [CubeTensor<R>; 3] {
    let DecodeLayout {
        groups,
        heads_per_group,
        head_dim,
    } = layout;
    let batch = qkv.meta.shape().as_slice()[0];
    assert_eq!(
        qkv.meta.shape().as_slice(),
        [batch, 1, groups, heads_per_group + 2, head_dim],
        "decode attention: qkv is one token's packed projection"
    );
    assert!(
        head_dim.is_multiple_of(2) && (2..=MAX_HEAD_DIM).contains(&head_dim),
        "decode attention: an even head dimension up to {MAX_HEAD_DIM}, got {head_dim}"
    );
    let capacity = keys.meta.shape().as_slice()[2];
    for cache in [&keys, &values] {
        assert_eq!(
            cache.meta.shape().as_slice(),
            [batch, groups, capacity, head_dim],
            "decode attention: caches of [batch, groups, capacity, head_dim]"
        );
        assert_eq!(cache.dtype, qkv.dtype, "decode attention: one float dtype");
    }
    let DecodeIndices {
        column,
        pads,
        positions,
    } = indices;
    assert_eq!(column.meta.shape().as_slice(), [1], "one cache column");
    for t in [&pads, &positions] {
        assert_eq!(
            t.meta.shape().as_slice(),
            [batch],
            "a pad and a position a row"
        );
        assert_eq!(t.dtype, column.dtype, "decode attention: one int dtype");
    }
    // Written in place: contiguous and held by nobody else, else a copy first.
    let unique = |t: CubeTensor<R>| match t.can_mut() && t.is_contiguous() {
        true => t,
        false => into_contiguous(t.copy()),
    };
    let [keys, values] = [keys, values].map(unique);
    let qkv = into_contiguous(qkv);
    let [column, pads, positions] = [column, pads, positions].map(into_contiguous);
    let client = qkv.client.clone();
    let rotate = table.is_some();
    let [cos, sin] = match table {
        Some(table) => table.map(into_contiguous),
        // Without RoPE the kernel reads no table: one-element placeholders.
        None => [(); 2].map(|_| {
            empty_device_contiguous_dtype::<R>(
                client.clone(),
                qkv.device.clone(),
                Shape::new([1, head_dim]),
                DType::F32,
            )
        }),
    };
    for t in [&cos, &sin] {
        assert_eq!(t.dtype, DType::F32, "decode attention: f32 RoPE tables");
        assert_eq!(
            t.meta.shape().as_slice()[1..],
            [head_dim],
            "decode attention: RoPE tables of [rows, head_dim]"
        );
    }
    let table_rows = cos.meta.shape().as_slice()[0];
    let heads = groups * heads_per_group;
    let context = empty_device_contiguous_dtype::<R>(
        client.clone(),
        qkv.device.clone(),
        Shape::new([batch, 1, heads, head_dim]),
        qkv.dtype,
    );
    if batch * heads == 0 || capacity == 0 || table_rows == 0 {
        return [context, keys, values];
    }
    let plane = fixed_plane_size(&client)
        .filter(|plane| THREADS.is_multiple_of(*plane))
        .unwrap_or(0);
    // The caches' rows read as vectors of up to 8 (16 bytes in bf16).
    let mut width = vector_width(&[&keys, &values]).min(MAX_VECTOR);
    while !head_dim.is_multiple_of(width) {
        width /= 2;
    }
    let dtypes = [qkv.dtype.into(), column.dtype.into()];
    decode_attention_kernel::launch::<R>(
        &client,
        CubeCount::Static(heads as u32, batch as u32, 1),
        CubeDim::new_1d(THREADS),
        width,
        qkv.into_tensor_arg(),
        keys.clone().into_tensor_arg(),
        values.clone().into_tensor_arg(),
        column.into_tensor_arg(),
        pads.into_tensor_arg(),
        positions.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        context.clone().into_tensor_arg(),
        groups as u32,
        heads_per_group as u32,
        capacity as u32,
        table_rows as u32,
        scale as f32,
        head_dim as u32,
        (head_dim / width) as u32,
        rotate,
        plane,
        dtypes,
    );
    [context, keys, values]
}
