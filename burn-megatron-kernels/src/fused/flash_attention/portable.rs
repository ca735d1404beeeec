//! Flash attention for any CubeCL runtime: one thread per output row, f32 arithmetic, tiles of
//! the other operand staged in shared memory, no tensor cores and no plane operations.
//!
//! - `forward_kernel`: a cube owns up to [`ROW_THREADS`] query rows of one (batch, head). Its
//!   threads copy a tile of K and V rows (f32) into shared memory together; then each thread
//!   takes its query row's scores over the tile, rescales its running sum and output
//!   accumulator once by `exp(m_old - m_new)`, and adds `p · v` over the tile.
//! - `delta_kernel`: one thread per query row, `delta = Σ dO ∘ O`.
//! - `grad_q_kernel`: a cube of query rows as in the forward, tiles of K and V; each thread
//!   adds `ds · k` over the keys its row sees.
//! - `grad_kv_kernel`: a cube owns up to [`ROW_THREADS`] key rows of one (batch, kv head); for
//!   each query head of the group it stages tiles of Q and dO rows with their `lse` and
//!   `delta`, and each thread adds `p · dO` (dv) and `ds · q` (dk) over the queries that see
//!   its key.
//!
//! Causal cubes stop at the last key their rows see (forward, dq) or start at the first
//! query that sees their keys (dk, dv). A thread's rows (query, output accumulator, ...) are
//! local arrays sized by the comptime `head_dim`, so each head dimension compiles its own
//! kernels; a tile's per-row values (scores, probabilities) are registers, the loops over a
//! tile being unrolled (`tile` is comptime too).
//!
//! The loops run over `head_dim` outside and over the tile inside: each element of a thread's
//! row is read once per tile, not once per key. This also matters on lavapipe, which stops
//! every loop of a shader invocation, silently, once all of them together have run 65 535
//! iterations (Mesa's `LP_MAX_TGSI_LOOP_ITERATIONS`): with a loop over `head_dim` per key, a
//! thread of the dk/dv kernel at head_dim 128 gave up after a few hundred query rows. Now a thread
//! runs about `3 · head_dim / tile` loop iterations per key (forward, dq) or query row (dk,
//! dv, over the group's heads) it visits, so on lavapipe a row can visit about 5 000 of them
//! at head_dim 64, 2 000 at 128 and 500 at 256. GPUs have no such limit. (Unrolling the
//! `head_dim` loops instead made lavapipe's compiler take minutes per kernel.)

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{AttentionOptions, Dims};

/// Rows (threads) per cube, at most.
const ROW_THREADS: usize = 64;
/// Shared memory per cube: two staged tiles of rows and two f32 per row fit in 16 KiB, the
/// smallest budget among CubeCL's runtimes (WebGPU's default limit).
const SHARED_BYTES: usize = 16 * 1024;
/// Rows per staged tile, at most: a thread keeps two values per row in registers, and the
/// unrolled loops over a tile grow with it (lavapipe compiles 32-row tiles of small head dims
/// slowly).
const MAX_TILE: usize = 16;
/// Threads per cube of the `delta` kernel.
const DELTA_THREADS: usize = 256;
/// Stands for "no score yet" in the running maximum: finite (WGSL has no infinity literal),
/// far below any score.
const NO_SCORE: f32 = -1.0e30;

/// The cube's index in a 2D grid (see [`grid`]).
#[cube]
fn cube_index() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// Row `row` of head `head` of batch `batch` of `t` (`[batch, heads, seq, head_dim]`, any
/// strides) times `scale`, as f32, or zeros when `!valid`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_row<F: Float>(
    t: &Tensor<F>,
    batch: usize,
    head: usize,
    row: usize,
    valid: bool,
    scale: f32,
    #[comptime] head_dim: usize,
) -> Array<f32> {
    let mut out = Array::<f32>::new(head_dim);
    let base = batch * t.stride(0) + head * t.stride(1) + row * t.stride(2);
    for d in 0..head_dim {
        let mut x = f32::new(0.0);
        if valid {
            x = f32::cast_from(t[base + d * t.stride(3)]) * scale;
        }
        out[d] = x;
    }
    out
}

/// A local array of `len` zeros.
#[cube]
fn zeros(#[comptime] len: usize) -> Array<f32> {
    let mut out = Array::<f32>::new(len);
    for i in 0..len {
        out[i] = f32::new(0.0);
    }
    out
}

/// Writes `scale · values` as row `row` of head `head` of batch `batch` of `t`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_row<F: Float>(
    t: &mut Tensor<F>,
    values: &Array<f32>,
    scale: f32,
    batch: usize,
    head: usize,
    row: usize,
    #[comptime] head_dim: usize,
) {
    let base = batch * t.stride(0) + head * t.stride(1) + row * t.stride(2);
    for d in 0..head_dim {
        t[base + d * t.stride(3)] = F::cast_from(values[d] * scale);
    }
}

/// Rows `start..start + tile` (those below `end`; zeros past it) of head `head` of batch
/// `batch` of `a` and `b` into `to_a` and `to_b`, row-major, by all of the cube's threads.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_tiles<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    to_a: &mut SharedMemory<f32>,
    to_b: &mut SharedMemory<f32>,
    batch: usize,
    head: usize,
    start: usize,
    end: usize,
    #[comptime] tile: usize,
    #[comptime] head_dim: usize,
) {
    let base_a = batch * a.stride(0) + head * a.stride(1);
    let base_b = batch * b.stride(0) + head * b.stride(1);
    let mut i = UNIT_POS_X as usize;
    while i < tile * head_dim {
        let row = start + i / head_dim;
        let d = i % head_dim;
        let mut x = f32::new(0.0);
        let mut y = f32::new(0.0);
        if row < end {
            x = f32::cast_from(a[base_a + row * a.stride(2) + d * a.stride(3)]);
            y = f32::cast_from(b[base_b + row * b.stride(2) + d * b.stride(3)]);
        }
        to_a[i] = x;
        to_b[i] = y;
        i += CUBE_DIM_X as usize;
    }
}

/// `out[t] = Σ_d a[d] · tile_a[t][d]` and `out_b[t] = Σ_d b[d] · tile_b[t][d]` for the rows
/// `t` of two staged tiles (the second pair only when `pair`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn tile_dots(
    a: &Array<f32>,
    tile_a: &SharedMemory<f32>,
    out_a: &mut Array<f32>,
    b: &Array<f32>,
    tile_b: &SharedMemory<f32>,
    out_b: &mut Array<f32>,
    #[comptime] pair: bool,
    #[comptime] tile: usize,
    #[comptime] head_dim: usize,
) {
    #[unroll]
    for t in 0..tile {
        out_a[t] = f32::new(0.0);
        out_b[t] = f32::new(0.0);
    }
    for d in 0..head_dim {
        let x = a[d];
        let y = b[d];
        #[unroll]
        for t in 0..tile {
            out_a[t] += x * tile_a[t * head_dim + d];
            if pair {
                out_b[t] += y * tile_b[t * head_dim + d];
            }
        }
    }
}

/// `acc[d] = acc_scale · acc[d] + Σ_t weights[t] · tile[t][d]` over a staged tile.
#[cube]
fn accumulate(
    acc: &mut Array<f32>,
    acc_scale: f32,
    weights: &Array<f32>,
    tile_rows: &SharedMemory<f32>,
    #[comptime] tile: usize,
    #[comptime] head_dim: usize,
) {
    for d in 0..head_dim {
        let mut sum = acc[d] * acc_scale;
        #[unroll]
        for t in 0..tile {
            sum += weights[t] * tile_rows[t * head_dim + d];
        }
        acc[d] = sum;
    }
}

/// The element of `[batch, heads, seq]` statistics `t` for a row.
#[cube]
fn row_statistic(t: &Tensor<f32>, batch: usize, head: usize, row: usize) -> usize {
    batch * t.stride(0) + head * t.stride(1) + row * t.stride(2)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    heads: u32,
    group: u32,
    seq_q: u32,
    seq_k: u32,
    blocks: u32,
    cubes: u32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let cube = cube_index();
    if cube >= cubes as usize {
        terminate!();
    }
    let threads = CUBE_DIM_X as usize;
    let batch_head = cube / blocks as usize;
    let first = (cube % blocks as usize) * threads;
    let batch = batch_head / heads as usize;
    let head = batch_head % heads as usize;
    let kv_head = head / group as usize;
    let row = first + UNIT_POS_X as usize;
    let valid = row < seq_q as usize;

    // The scale is folded into the query row.
    let query = load_row::<F>(q, batch, head, row, valid, scale, head_dim);
    let mut acc = zeros(head_dim);
    let mut scores = zeros(tile);
    let mut unused = zeros(tile);
    let mut keys = SharedMemory::<f32>::new(tile * head_dim);
    let mut values = SharedMemory::<f32>::new(tile * head_dim);

    let mut end = seq_k as usize;
    if causal && first + threads < end {
        end = first + threads;
    }
    let mut m = f32::new(NO_SCORE);
    let mut l = f32::new(0.0);
    let mut start = 0;
    while start < end {
        stage_tiles::<F>(
            k,
            v,
            &mut keys,
            &mut values,
            batch,
            kv_head,
            start,
            end,
            tile,
            head_dim,
        );
        sync_cube();
        if valid {
            tile_dots(
                &query,
                &keys,
                &mut scores,
                &query,
                &keys,
                &mut unused,
                false,
                tile,
                head_dim,
            );
            let mut top = m;
            #[unroll]
            for t in 0..tile {
                let key = start + t;
                if key < end && (!causal || key <= row) && scores[t] > top {
                    top = scores[t];
                }
            }
            let correction = (m - top).exp();
            l *= correction;
            #[unroll]
            for t in 0..tile {
                let key = start + t;
                let mut p = f32::new(0.0);
                if key < end && (!causal || key <= row) {
                    p = (scores[t] - top).exp();
                }
                scores[t] = p;
                l += p;
            }
            accumulate(&mut acc, correction, &scores, &values, tile, head_dim);
            m = top;
        }
        sync_cube();
        start += tile;
    }
    if valid {
        store_row::<F>(out, &acc, f32::new(1.0) / l, batch, head, row, head_dim);
        let at = row_statistic(lse, batch, head, row);
        lse[at] = m + l.ln();
    }
}

#[cube(launch)]
fn delta_kernel<F: Float>(
    out: &Tensor<F>,
    grad_out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    heads: u32,
    seq_q: u32,
    rows: u32,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let index = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if index >= rows as usize {
        terminate!();
    }
    let row = index % seq_q as usize;
    let batch_head = index / seq_q as usize;
    let (batch, head) = (batch_head / heads as usize, batch_head % heads as usize);
    let o = batch * out.stride(0) + head * out.stride(1) + row * out.stride(2);
    let g = batch * grad_out.stride(0) + head * grad_out.stride(1) + row * grad_out.stride(2);
    let mut sum = f32::new(0.0);
    for d in 0..head_dim {
        sum += f32::cast_from(out[o + d * out.stride(3)])
            * f32::cast_from(grad_out[g + d * grad_out.stride(3)]);
    }
    let at = row_statistic(delta, batch, head, row);
    delta[at] = sum;
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn grad_q_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    grad_q: &mut Tensor<F>,
    scale: f32,
    heads: u32,
    group: u32,
    seq_q: u32,
    seq_k: u32,
    blocks: u32,
    cubes: u32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let cube = cube_index();
    if cube >= cubes as usize {
        terminate!();
    }
    let threads = CUBE_DIM_X as usize;
    let batch_head = cube / blocks as usize;
    let first = (cube % blocks as usize) * threads;
    let batch = batch_head / heads as usize;
    let head = batch_head % heads as usize;
    let kv_head = head / group as usize;
    let row = first + UNIT_POS_X as usize;
    let valid = row < seq_q as usize;

    let query = load_row::<F>(q, batch, head, row, valid, scale, head_dim);
    let grad_row = load_row::<F>(grad_out, batch, head, row, valid, f32::new(1.0), head_dim);
    let mut acc = zeros(head_dim);
    let mut scores = zeros(tile);
    let mut grad_probs = zeros(tile);
    let mut row_lse = f32::new(0.0);
    let mut row_delta = f32::new(0.0);
    if valid {
        row_lse = lse[row_statistic(lse, batch, head, row)];
        row_delta = delta[row_statistic(delta, batch, head, row)];
    }
    let mut keys = SharedMemory::<f32>::new(tile * head_dim);
    let mut values = SharedMemory::<f32>::new(tile * head_dim);

    let mut end = seq_k as usize;
    if causal && first + threads < end {
        end = first + threads;
    }
    let mut start = 0;
    while start < end {
        stage_tiles::<F>(
            k,
            v,
            &mut keys,
            &mut values,
            batch,
            kv_head,
            start,
            end,
            tile,
            head_dim,
        );
        sync_cube();
        if valid {
            tile_dots(
                &query,
                &keys,
                &mut scores,
                &grad_row,
                &values,
                &mut grad_probs,
                true,
                tile,
                head_dim,
            );
            // `scores` becomes `ds = p · (dp - delta)`.
            #[unroll]
            for t in 0..tile {
                let key = start + t;
                let mut ds = f32::new(0.0);
                if key < end && (!causal || key <= row) {
                    ds = (scores[t] - row_lse).exp() * (grad_probs[t] - row_delta);
                }
                scores[t] = ds;
            }
            accumulate(&mut acc, f32::new(1.0), &scores, &keys, tile, head_dim);
        }
        sync_cube();
        start += tile;
    }
    if valid {
        store_row::<F>(grad_q, &acc, scale, batch, head, row, head_dim);
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn grad_kv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    grad_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    grad_k: &mut Tensor<F>,
    grad_v: &mut Tensor<F>,
    scale: f32,
    kv_heads: u32,
    group: u32,
    seq_q: u32,
    seq_k: u32,
    blocks: u32,
    cubes: u32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let cube = cube_index();
    if cube >= cubes as usize {
        terminate!();
    }
    let threads = CUBE_DIM_X as usize;
    let batch_head = cube / blocks as usize;
    let first = (cube % blocks as usize) * threads;
    let batch = batch_head / kv_heads as usize;
    let kv_head = batch_head % kv_heads as usize;
    let key = first + UNIT_POS_X as usize;
    let valid = key < seq_k as usize;

    // The scale is folded into the key row for the scores.
    let key_row = load_row::<F>(k, batch, kv_head, key, valid, scale, head_dim);
    let value_row = load_row::<F>(v, batch, kv_head, key, valid, f32::new(1.0), head_dim);
    let mut grad_key = zeros(head_dim);
    let mut grad_value = zeros(head_dim);
    let mut probs = zeros(tile);
    let mut grad_scores = zeros(tile);
    let mut queries = SharedMemory::<f32>::new(tile * head_dim);
    let mut grads = SharedMemory::<f32>::new(tile * head_dim);
    let mut lses = SharedMemory::<f32>::new(tile);
    let mut deltas = SharedMemory::<f32>::new(tile);

    let end = seq_q as usize;
    let mut begin = 0;
    if causal {
        begin = first;
    }
    // One loop over (query head of the group, tile of its queries).
    let tiles = (end - begin).div_ceil(tile);
    let steps = group as usize * tiles;
    let mut step = 0;
    while step < steps {
        let head = kv_head * group as usize + step / tiles;
        let start = begin + (step % tiles) * tile;
        stage_tiles::<F>(
            q,
            grad_out,
            &mut queries,
            &mut grads,
            batch,
            head,
            start,
            end,
            tile,
            head_dim,
        );
        let mut t = UNIT_POS_X as usize;
        while t < tile {
            let mut row_lse = f32::new(0.0);
            let mut row_delta = f32::new(0.0);
            if start + t < end {
                row_lse = lse[row_statistic(lse, batch, head, start + t)];
                row_delta = delta[row_statistic(delta, batch, head, start + t)];
            }
            lses[t] = row_lse;
            deltas[t] = row_delta;
            t += CUBE_DIM_X as usize;
        }
        sync_cube();
        if valid {
            tile_dots(
                &key_row,
                &queries,
                &mut probs,
                &value_row,
                &grads,
                &mut grad_scores,
                true,
                tile,
                head_dim,
            );
            // `probs` becomes `p`, `grad_scores` becomes `ds = p · (dp - delta)`.
            #[unroll]
            for t in 0..tile {
                let query = start + t;
                let mut p = f32::new(0.0);
                let mut ds = f32::new(0.0);
                if query < end && (!causal || key <= query) {
                    p = (probs[t] - lses[t]).exp();
                    ds = p * (grad_scores[t] - deltas[t]);
                }
                probs[t] = p;
                grad_scores[t] = ds;
            }
            accumulate(
                &mut grad_value,
                f32::new(1.0),
                &probs,
                &grads,
                tile,
                head_dim,
            );
            accumulate(
                &mut grad_key,
                f32::new(1.0),
                &grad_scores,
                &queries,
                tile,
                head_dim,
            );
        }
        sync_cube();
        step += 1;
    }
    if valid {
        store_row::<F>(grad_k, &grad_key, scale, batch, kv_head, key, head_dim);
        store_row::<F>(
            grad_v,
            &grad_value,
            f32::new(1.0),
            batch,
            kv_head,
            key,
            head_dim,
        );
    }
}

/// Threads per cube for `rows` rows: a power of two, at most [`ROW_THREADS`].
fn row_threads(rows: usize) -> usize {
    rows.next_power_of_two().clamp(8, ROW_THREADS)
}

/// Rows per staged tile for `head_dim`.
fn tile_rows(head_dim: usize) -> usize {
    (SHARED_BYTES / (4 * (2 * head_dim + 2))).clamp(1, MAX_TILE)
}

/// A 2D grid of `cubes` cubes, each dimension within every runtime's limit.
fn grid(cubes: usize) -> CubeCount {
    let x = cubes.clamp(1, 65_535);
    CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1)
}

fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(like.client.clone(), like.device.clone(), shape, dtype)
}

/// Writes the output into `out` (q's shape, any strides) and the log-sum-exp into `lse`
/// (`[batch, heads, seq_q]`, f32). At least one query row.
pub(super) fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    dims: Dims,
    options: AttentionOptions,
) {
    let threads = row_threads(dims.seq_q);
    let blocks = dims.seq_q.div_ceil(threads);
    let cubes = dims.batch * dims.heads * blocks;
    let dtype = q.dtype.into();
    forward_kernel::launch::<R>(
        &q.client.clone(),
        grid(cubes),
        CubeDim::new_1d(threads as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.into_tensor_arg(),
        lse.into_tensor_arg(),
        options.scale,
        dims.heads as u32,
        dims.group() as u32,
        dims.seq_q as u32,
        dims.seq_k as u32,
        blocks as u32,
        cubes as u32,
        dims.head_dim,
        tile_rows(dims.head_dim),
        options.causal,
        dtype,
    );
}

/// `delta = rowsum(dO ∘ O)` per query row (`[batch, heads, seq_q]`, f32), which every
/// backward needs first (the tensor-core one too). `dims.seq_q` rows per head, at least one.
pub(super) fn delta<R: CubeRuntime>(
    out: CubeTensor<R>,
    grad_out: CubeTensor<R>,
    dims: Dims,
) -> CubeTensor<R> {
    let rows = dims.batch * dims.heads * dims.seq_q;
    let delta = empty(
        &out,
        Shape::new([dims.batch, dims.heads, dims.seq_q]),
        DType::F32,
    );
    let dtype: StorageType = out.dtype.into();
    delta_kernel::launch::<R>(
        &out.client.clone(),
        grid(rows.div_ceil(DELTA_THREADS)),
        CubeDim::new_1d(DELTA_THREADS as u32),
        out.into_tensor_arg(),
        grad_out.into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dims.heads as u32,
        dims.seq_q as u32,
        rows as u32,
        dims.head_dim,
        dtype,
    );
    delta
}

/// Writes `[dq, dk, dv]` into `grads` (q's, k's and v's shapes, any strides). At least one
/// query row and one key row.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad_out: CubeTensor<R>,
    grads: [CubeTensor<R>; 3],
    dims: Dims,
    options: AttentionOptions,
) {
    let [grad_q, grad_k, grad_v] = grads;
    let client = q.client.clone();
    let dtype: StorageType = q.dtype.into();
    let tile = tile_rows(dims.head_dim);

    let delta = delta(out, grad_out.clone(), dims);

    let threads = row_threads(dims.seq_q);
    let blocks = dims.seq_q.div_ceil(threads);
    let cubes = dims.batch * dims.heads * blocks;
    grad_q_kernel::launch::<R>(
        &client,
        grid(cubes),
        CubeDim::new_1d(threads as u32),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        grad_out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        grad_q.into_tensor_arg(),
        options.scale,
        dims.heads as u32,
        dims.group() as u32,
        dims.seq_q as u32,
        dims.seq_k as u32,
        blocks as u32,
        cubes as u32,
        dims.head_dim,
        tile,
        options.causal,
        dtype,
    );

    let threads = row_threads(dims.seq_k);
    let blocks = dims.seq_k.div_ceil(threads);
    let cubes = dims.batch * dims.kv_heads * blocks;
    grad_kv_kernel::launch::<R>(
        &client,
        grid(cubes),
        CubeDim::new_1d(threads as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        grad_out.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        grad_k.into_tensor_arg(),
        grad_v.into_tensor_arg(),
        options.scale,
        dims.kv_heads as u32,
        dims.group() as u32,
        dims.seq_q as u32,
        dims.seq_k as u32,
        blocks as u32,
        cubes as u32,
        dims.head_dim,
        tile,
        options.causal,
        dtype,
    );
}
