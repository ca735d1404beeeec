//! Blockwise FP8 casts (DeepSeek-V3's scaling, `--fp8-recipe blockwise`): each block of 128
//! consecutive elements along a row of the cast has the scale of its own amax, the largest
//! power of two at most `max / amax · 2^-margin` (capped at 2^127; 1 for a block of zeros or
//! one holding a NaN or an infinity). One kernel a layout, each reading `x` once and writing
//! the FP8 bits and the reciprocal scales in cuBLASLt's `VEC128_32F` layout (the block column
//! outermost): [`quantize_blockwise`] row-major, blocks along `x`'s rows, or transposed,
//! blocks of 128 rows of one column, which the weight gradient reads;
//! [`quantize_blockwise_both`] both layouts from one read. [`quantize_squares`] casts a weight
//! in 128 × 128 blocks (`BLK128x128_32F`), in either layout, [`quantize_squares_both`] in both.
//!
//! The bits equal those of the cast kernels (`fp8::fp8_bits`) on `x · s` formed in f32, and the
//! scales those of the Burn composition in `burn-megatron` (`ops::fp8::blockwise`).

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::fp8::{CastTarget, cube_max, fp8_bits, scaled};
use super::vectors::{THREADS, launch_shape, vector_width};

/// The side of a block.
pub const BLOCK: usize = 128;
/// Threads a block in the row-major kernel: each casts 4 elements.
const LANES: usize = 32;

/// The scale of a block whose amax has the f32 bits `amax_bits` (a NaN's bits exceed
/// infinity's): `max / amax · factor` with its mantissa cleared (the largest power of two at
/// most it), 2^127 where that overflows, 1 for a zero, infinite or NaN amax.
#[cube]
fn block_scale(amax_bits: u32, max: f32, factor: f32) -> f32 {
    let mut s = 1.0f32;
    if amax_bits > 0 && amax_bits < 0x7F80_0000 {
        let mut bits = u32::reinterpret(max / f32::reinterpret(amax_bits) * factor);
        if bits >= 0x7F80_0000 {
            // Overflow: f32::MAX's bits, whose power of two is 2^127.
            bits = 0x7F7F_FFFFu32;
        }
        s = f32::reinterpret(bits & 0xFF80_0000u32);
    }
    s
}

/// Row-major blockwise cast: [`THREADS`] / [`LANES`] blocks a cube, [`LANES`] threads a block,
/// 4 elements a thread; the block's amax by a tree in shared memory over its lanes.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn quantize_rows_kernel<F: Float, Q: Numeric>(
    x: &Tensor<F>,
    out: &mut Tensor<Q>,
    inv: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    max: f32,
    factor: f32,
    #[comptime] e5m2: bool,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let tid = UNIT_POS_X as usize;
    let lane = tid % LANES;
    let col_blocks = cols as usize / BLOCK;
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let block = cube * (THREADS as usize / LANES) + tid / LANES;
    let valid = block < rows as usize * col_blocks;
    let (r, kb) = (block / col_blocks, block % col_blocks);
    let base = r * cols as usize + kb * BLOCK + lane * 4;
    let mut v = Array::<f32>::new(4usize);
    let mut best = 0u32;
    if valid {
        #[unroll]
        for i in 0..4 {
            let value = f32::cast_from(x[base + i]);
            v[i] = value;
            let bits = u32::reinterpret(f32::abs(value));
            if bits > best {
                best = bits;
            }
        }
    }
    let mut shared = SharedMemory::<u32>::new(THREADS as usize);
    shared[tid] = best;
    sync_cube();
    // Halving steps 16, 8, .., 1 (known when the kernel compiles).
    #[unroll]
    for k in 1..6usize {
        let step = LANES >> k;
        #[allow(clippy::collapsible_if)]
        if lane < step {
            if shared[tid + step] > shared[tid] {
                shared[tid] = shared[tid + step];
            }
        }
        sync_cube();
    }
    if valid {
        let s = block_scale(shared[tid - lane], max, factor);
        #[unroll]
        for i in 0..4 {
            out[base + i] = Q::cast_from(fp8_bits(scaled(v[i], s, max), e5m2));
        }
        if lane == 0 {
            inv[kb * rows as usize + r] = 1.0 / s;
        }
    }
}

/// Blocks of `vector × vector` elements along each side of [`quantize_both_kernel`]'s base
/// grid: its 256 threads hold one block each of a 16 × 16 grid of blocks (the whole 128 × 128
/// tile at 8; at 4, each thread also holds the blocks 16 further down, right, or both).
const GRID: usize = 16;
const _: () = assert!(GRID * GRID == THREADS as usize && 2 * BLOCK == THREADS as usize);
/// Rows of blocks a plane covers in the base grid: its 32 threads hold `PLANE_ROWS`
/// consecutive rows of blocks by `PLANE_COLS` consecutive columns, so that a load reads
/// `PLANE_COLS` consecutive vectors of a row of `x` (128 bytes of bf16 at 8) and a transposed
/// store writes `PLANE_ROWS · vector` consecutive bytes of a row of the transposed layout (a
/// whole 32-byte sector at 8).
const PLANE_ROWS: usize = 4;
/// Columns of blocks a plane covers (see [`PLANE_ROWS`]).
const PLANE_COLS: usize = 32 / PLANE_ROWS;

/// Both layouts of the 1 × 128 blockwise cast from one read of `x`: a cube a 128 × 128 tile,
/// each thread `(128 / vector / 16)²` blocks of `vector × vector` elements (one at 8, four at
/// 4), all loaded before any is used. Each thread's maxima of its blocks' rows and columns go
/// to shared memory; the cube's first 128 threads reduce a row each (its block of 128 along
/// `x`'s rows: the row-major cast's scale), the other 128 a column each (its block of 128 rows:
/// the transposed cast's scale); then each thread casts its blocks under both, writes their
/// rows as vectors of `row` and their columns, transposed in registers, as vectors of
/// `transposed`. The bits and the reciprocal scales (cuBLASLt's `VEC128_32F` layouts) are
/// those of [`quantize_rows_kernel`] and [`quantize_columns_kernel`]. With `square` the tile is
/// one block (a weight's 128 × 128 square) under the scale of the largest of those amaxes,
/// its reciprocal in each layout's `BLK128x128_32F` place: the bits and scales of
/// [`quantize_squares_kernel`] in both layouts, from one read.
#[cube(launch_unchecked)]
// `div_ceil` is not a kernel operation.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn quantize_both_kernel<F: Float, Q: Numeric, N: Size>(
    x: &Tensor<Vector<F, N>>,
    row: &mut Tensor<Vector<Q, N>>,
    row_inv: &mut Tensor<f32>,
    transposed: &mut Tensor<Vector<Q, N>>,
    transposed_inv: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    max: f32,
    factor: f32,
    #[comptime] vector: usize,
    #[comptime] e5m2: bool,
    #[comptime] square: bool,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let tid = UNIT_POS_X as usize;
    let (rows, cols) = (rows as usize, cols as usize);
    let (r0, c0) = (CUBE_POS_Y as usize * BLOCK, CUBE_POS_X as usize * BLOCK);
    // The base grid's copies along each side of the tile.
    let copies = comptime!(BLOCK / vector / GRID);
    // This thread's block of the base grid (`plane` and `lane` as in [`PLANE_ROWS`]).
    let (lane, plane) = (tid % 32, tid / 32);
    let bi = (plane / (GRID / PLANE_COLS)) * PLANE_ROWS + lane % PLANE_ROWS;
    let bj = (plane % (GRID / PLANE_COLS)) * PLANE_COLS + lane / PLANE_ROWS;
    let (x_vectors, t_vectors) = (cols / vector, rows / vector);
    // Block `(gi, gj)` of the copies: rows `r0 + (gi · 16 + bi) · vector ..`, its vectors
    // `loaded[(gi · copies + gj) · vector ..]`.
    let mut loaded = Array::<Vector<F, N>>::new(comptime!(copies * copies * vector));
    #[unroll]
    for gi in 0..copies {
        #[unroll]
        for gj in 0..copies {
            let base = (r0 + (gi * GRID + bi) * vector) * x_vectors + c0 / vector + gj * GRID + bj;
            #[unroll]
            for j in 0..vector {
                loaded[(gi * copies + gj) * vector + j] = x[base + j * x_vectors];
            }
        }
    }
    // `row_parts[r][bj]`: the maximum of tile row `r` over the columns this thread holds;
    // `col_parts[bi][c]`: of tile column `c` over its rows (f32 bits of magnitudes, which
    // order as integers; a NaN's exceed infinity's). Padded against bank conflicts.
    let (row_stride, col_stride) = (comptime!(GRID + 1), comptime!(BLOCK + 1));
    let mut row_parts = SharedMemory::<u32>::new(comptime!(BLOCK * (GRID + 1)));
    let mut col_parts = SharedMemory::<u32>::new(comptime!(GRID * (BLOCK + 1)));
    #[unroll]
    for gi in 0..copies {
        #[unroll]
        for j in 0..vector {
            let mut best = 0u32;
            #[unroll]
            for gj in 0..copies {
                let v = loaded[(gi * copies + gj) * vector + j];
                #[unroll]
                for k in 0..vector {
                    let bits = u32::reinterpret(f32::abs(f32::cast_from(v[k])));
                    if bits > best {
                        best = bits;
                    }
                }
            }
            row_parts[((gi * GRID + bi) * vector + j) * row_stride + bj] = best;
        }
    }
    #[unroll]
    for gj in 0..copies {
        #[unroll]
        for k in 0..vector {
            let mut best = 0u32;
            #[unroll]
            for gi in 0..copies {
                #[unroll]
                for j in 0..vector {
                    let v = loaded[(gi * copies + gj) * vector + j];
                    let bits = u32::reinterpret(f32::abs(f32::cast_from(v[k])));
                    if bits > best {
                        best = bits;
                    }
                }
            }
            col_parts[bi * col_stride + (gj * GRID + bj) * vector + k] = best;
        }
    }
    sync_cube();
    let mut row_scales = SharedMemory::<f32>::new(BLOCK);
    let mut col_scales = SharedMemory::<f32>::new(BLOCK);
    // A row's amax in the first 128 threads, a column's in the others.
    let mut amax = 0u32;
    if tid < BLOCK {
        #[unroll]
        for b in 0..GRID {
            let bits = row_parts[tid * row_stride + b];
            if bits > amax {
                amax = bits;
            }
        }
    } else {
        #[unroll]
        for b in 0..GRID {
            let bits = col_parts[b * col_stride + tid - BLOCK];
            if bits > amax {
                amax = bits;
            }
        }
    }
    if comptime!(square) {
        // One scale for the tile, from the largest of its rows' amaxes.
        let total = cube_max(amax);
        let mut tile_scale = SharedMemory::<f32>::new(1usize);
        if tid == 0 {
            let s = block_scale(total, max, factor);
            tile_scale[0] = s;
            let (row_blocks, col_blocks) = (rows / BLOCK, cols / BLOCK);
            let (rb, cb) = (r0 / BLOCK, c0 / BLOCK);
            // Each layout's rows of scales padded to a multiple of 4 with ones.
            let (padded_cols, padded_rows) = ((col_blocks + 3) / 4 * 4, (row_blocks + 3) / 4 * 4);
            row_inv[rb * padded_cols + cb] = 1.0 / s;
            transposed_inv[cb * padded_rows + rb] = 1.0 / s;
            if cb == col_blocks - 1 {
                for p in col_blocks..padded_cols {
                    row_inv[rb * padded_cols + p] = 1.0;
                }
            }
            if rb == row_blocks - 1 {
                for p in row_blocks..padded_rows {
                    transposed_inv[cb * padded_rows + p] = 1.0;
                }
            }
        }
        sync_cube();
        if tid < BLOCK {
            row_scales[tid] = tile_scale[0];
            col_scales[tid] = tile_scale[0];
        }
    } else {
        let s = block_scale(amax, max, factor);
        if tid < BLOCK {
            row_scales[tid] = s;
            row_inv[(c0 / BLOCK) * rows + r0 + tid] = 1.0 / s;
        } else {
            col_scales[tid - BLOCK] = s;
            transposed_inv[(r0 / BLOCK) * cols + c0 + tid - BLOCK] = 1.0 / s;
        }
    }
    sync_cube();
    let mut col_s = Array::<f32>::new(vector);
    #[unroll]
    for gi in 0..copies {
        #[unroll]
        for gj in 0..copies {
            let (ti, tj) = (gi * GRID + bi, gj * GRID + bj);
            let slot = (gi * copies + gj) * vector;
            let base = (r0 + ti * vector) * x_vectors + c0 / vector + tj;
            #[unroll]
            for j in 0..vector {
                let s = row_scales[ti * vector + j];
                let v = loaded[slot + j];
                let mut q = Vector::<Q, N>::empty();
                #[unroll]
                for k in 0..vector {
                    q[k] = Q::cast_from(fp8_bits(scaled(f32::cast_from(v[k]), s, max), e5m2));
                }
                row[base + j * x_vectors] = q;
            }
            #[unroll]
            for k in 0..vector {
                col_s[k] = col_scales[tj * vector + k];
            }
            // Column `c0 + tj · vector + k` of the block is that row of `transposed`, its
            // elements `r0 + ti · vector ..` one vector.
            let t_base = (c0 + tj * vector) * t_vectors + r0 / vector + ti;
            #[unroll]
            for k in 0..vector {
                let mut t = Vector::<Q, N>::empty();
                #[unroll]
                for j in 0..vector {
                    let v = loaded[slot + j];
                    t[j] =
                        Q::cast_from(fp8_bits(scaled(f32::cast_from(v[k]), col_s[k], max), e5m2));
                }
                transposed[t_base + k * t_vectors] = t;
            }
        }
    }
}

/// Columns of a tile of the transposed kernel.
const TILE_COLS: usize = 32;
/// Rows of the tile each thread reads (the cube is `TILE_COLS × ROW_STEP` threads).
const ROW_STEP: usize = 8;
const PER_THREAD: usize = BLOCK / ROW_STEP;
const _: () = assert!(TILE_COLS * ROW_STEP == THREADS as usize);

/// Transposed blockwise cast, `out[c, r] = cast(x[r, c])` with one scale for 128 rows of a
/// column: a cube a tile of 128 rows × 32 columns, read along `x`'s rows (thread `(tx, ty)`
/// reads rows `ty + 8j` of column `tx`), the column amaxes from the 8 threads of a column
/// through shared memory, the bytes written along `out`'s rows through a shared tile.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn quantize_columns_kernel<F: Float, Q: Numeric>(
    x: &Tensor<F>,
    out: &mut Tensor<Q>,
    inv: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    max: f32,
    factor: f32,
    #[comptime] e5m2: bool,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let (rows, cols) = (rows as usize, cols as usize);
    let r0 = CUBE_POS_Y as usize * BLOCK;
    let c = CUBE_POS_X as usize * TILE_COLS + tx;
    let mut v = Array::<f32>::new(PER_THREAD);
    let mut best = 0u32;
    #[unroll]
    for j in 0..PER_THREAD {
        let value = f32::cast_from(x[(r0 + ty + ROW_STEP * j) * cols + c]);
        v[j] = value;
        let bits = u32::reinterpret(f32::abs(value));
        if bits > best {
            best = bits;
        }
    }
    let mut partial = SharedMemory::<u32>::new(THREADS as usize);
    partial[ty * TILE_COLS + tx] = best;
    sync_cube();
    let mut amax = 0u32;
    #[unroll]
    for k in 0..ROW_STEP {
        let bits = partial[k * TILE_COLS + tx];
        if bits > amax {
            amax = bits;
        }
    }
    let s = block_scale(amax, max, factor);
    // Column `tx` of the tile is row `tx` of the transposed tile (padded against bank
    // conflicts).
    let mut tile = SharedMemory::<u32>::new(TILE_COLS * (BLOCK + 1));
    #[unroll]
    for j in 0..PER_THREAD {
        tile[tx * (BLOCK + 1) + ty + ROW_STEP * j] = fp8_bits(scaled(v[j], s, max), e5m2);
    }
    if ty == 0 {
        inv[(r0 / BLOCK) * cols + c] = 1.0 / s;
    }
    sync_cube();
    // Thread `t` writes 16 consecutive bytes of one of the tile's 32 output rows.
    let t = ty * TILE_COLS + tx;
    let (row, chunk) = (t / ROW_STEP, (t % ROW_STEP) * PER_THREAD);
    let out_base = (CUBE_POS_X as usize * TILE_COLS + row) * rows + r0 + chunk;
    #[unroll]
    for i in 0..PER_THREAD {
        out[out_base + i] = Q::cast_from(tile[row * (BLOCK + 1) + chunk + i]);
    }
}

/// Square blockwise cast (weights: one scale for each 128 × 128 block): a cube a block, thread
/// `(tx, ty)` reading rows `ty + 8j` of columns `32g + tx`; the block's amax by a tree in
/// shared memory over the cube, then the block read again (from the cache) and written
/// row-major, or transposed with `transpose` (a byte a thread: a weight is cast once per
/// optimizer step). The scale rows' padding to a multiple of 4 is written as ones.
#[cube(launch)]
// `div_ceil` is not a kernel operation.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn quantize_squares_kernel<F: Float, Q: Numeric>(
    x: &Tensor<F>,
    out: &mut Tensor<Q>,
    inv: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    max: f32,
    factor: f32,
    #[comptime] e5m2: bool,
    #[comptime] transpose: bool,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let (rows, cols) = (rows as usize, cols as usize);
    let (rb, cb) = (CUBE_POS_Y as usize, CUBE_POS_X as usize);
    let (r0, c0) = (rb * BLOCK, cb * BLOCK);
    let mut best = 0u32;
    #[unroll]
    for g in 0..BLOCK / TILE_COLS {
        #[unroll]
        for j in 0..PER_THREAD {
            let value =
                f32::cast_from(x[(r0 + ty + ROW_STEP * j) * cols + c0 + TILE_COLS * g + tx]);
            let bits = u32::reinterpret(f32::abs(value));
            if bits > best {
                best = bits;
            }
        }
    }
    let tid = ty * TILE_COLS + tx;
    let mut shared = SharedMemory::<u32>::new(THREADS as usize);
    shared[tid] = best;
    sync_cube();
    // Halving steps 128, 64, .., 1 (known when the kernel compiles).
    #[unroll]
    for k in 1..9usize {
        let step = THREADS as usize >> k;
        #[allow(clippy::collapsible_if)]
        if tid < step {
            if shared[tid + step] > shared[tid] {
                shared[tid] = shared[tid + step];
            }
        }
        sync_cube();
    }
    let s = block_scale(shared[0], max, factor);
    #[unroll]
    for g in 0..BLOCK / TILE_COLS {
        #[unroll]
        for j in 0..PER_THREAD {
            let (r, c) = (r0 + ty + ROW_STEP * j, c0 + TILE_COLS * g + tx);
            let code = Q::cast_from(fp8_bits(
                scaled(f32::cast_from(x[r * cols + c]), s, max),
                e5m2,
            ));
            if comptime!(transpose) {
                out[c * rows + r] = code;
            } else {
                out[r * cols + c] = code;
            }
        }
    }
    if tid == 0 {
        // The scales of the cast's rows of blocks: `[row blocks, ⌈column blocks⌉₄]`.
        let (outer, inner, inner_blocks) = if comptime!(transpose) {
            (cb, rb, rows / BLOCK)
        } else {
            (rb, cb, cols / BLOCK)
        };
        let padded = (inner_blocks + 3) / 4 * 4;
        inv[outer * padded + inner] = 1.0 / s;
        if inner == inner_blocks - 1 {
            for p in inner_blocks..padded {
                inv[outer * padded + p] = 1.0;
            }
        }
    }
}

/// `x` contiguous, with its sides, which must be whole blocks of 128.
fn whole_blocks<R: CubeRuntime>(x: CubeTensor<R>) -> (CubeTensor<R>, usize, usize) {
    let x = into_contiguous(x);
    let dims = x.meta.shape().to_vec();
    assert_eq!(dims.len(), 2, "the blockwise cast takes a matrix");
    let (rows, cols) = (dims[0], dims[1]);
    assert!(
        rows % BLOCK == 0 && cols % BLOCK == 0 && rows * cols > 0,
        "the blockwise cast takes whole blocks of 128: [{rows}, {cols}]"
    );
    (x, rows, cols)
}

/// An empty contiguous tensor of `shape` and `dtype` on `x`'s device.
fn empty_on<R: CubeRuntime>(x: &CubeTensor<R>, shape: Vec<usize>, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

/// The square blockwise cast of a weight `x: [rows, cols]` (both sides multiples of 128) to
/// `kind`: `(q, inv)`, `q` `[rows, cols]` or with `transpose` `[cols, rows]` (the same blocks,
/// transposed), `inv` the f32 reciprocal scales in cuBLASLt's `BLK128x128_32F` layout of `q`:
/// `[q's row blocks, its column blocks rounded up to a multiple of 4]`, the padding ones.
pub fn quantize_squares<R: CubeRuntime>(
    x: CubeTensor<R>,
    kind: impl Into<CastTarget>,
    margin: i32,
    transpose: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let kind = kind.into();
    let e5m2 = kind.is_e5m2().expect("a blockwise cast writes FP8 bits");
    let (x, rows, cols) = whole_blocks(x);
    let (out_rows, out_cols) = if transpose {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let padded = (out_cols / BLOCK).next_multiple_of(4);
    let empty = |shape: Vec<usize>, dtype| empty_on(&x, shape, dtype);
    let out = empty(vec![out_rows, out_cols], kind.dtype());
    let inv = empty(vec![out_rows / BLOCK * padded], DType::F32);
    let dtypes = [x.dtype.into(), kind.storage()];
    let client = x.client.clone();
    quantize_squares_kernel::launch::<R>(
        &client,
        CubeCount::Static((cols / BLOCK) as u32, (rows / BLOCK) as u32, 1),
        CubeDim::new_2d(TILE_COLS as u32, ROW_STEP as u32),
        x.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        inv.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        kind.max(),
        2f32.powi(-margin),
        e5m2,
        transpose,
        dtypes,
    );
    (out, inv)
}

/// The blockwise cast of `x: [rows, cols]` (f32, f16 or bf16; both sides multiples of 128) to
/// `kind` (FP8 bits as `U8`, or one a `U32` for a runtime without 8-bit storage), with the
/// scales' factor `2^-margin`: `(q, inv)`, `q` `[rows, cols]` with blocks along its rows, or
/// with `transpose` `[cols, rows]` with blocks of 128 rows of `x`; `inv` the f32 reciprocal
/// scales, `[cols / 128, rows]` (`[rows / 128, cols]` transposed): cuBLASLt's `VEC128_32F`
/// layout of `q`'s scales.
pub fn quantize_blockwise<R: CubeRuntime>(
    x: CubeTensor<R>,
    kind: impl Into<CastTarget>,
    margin: i32,
    transpose: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let kind = kind.into();
    let e5m2 = kind.is_e5m2().expect("a blockwise cast writes FP8 bits");
    let (x, rows, cols) = whole_blocks(x);
    let empty = |shape: Vec<usize>, dtype| empty_on(&x, shape, dtype);
    let (out_shape, inv_shape) = match transpose {
        false => (vec![rows, cols], vec![cols / BLOCK * rows]),
        true => (vec![cols, rows], vec![rows / BLOCK * cols]),
    };
    let out = empty(out_shape, kind.dtype());
    let inv = empty(inv_shape, DType::F32);
    let dtypes = [x.dtype.into(), kind.storage()];
    let factor = 2f32.powi(-margin);
    let client = x.client.clone();
    if transpose {
        quantize_columns_kernel::launch::<R>(
            &client,
            CubeCount::Static((cols / TILE_COLS) as u32, (rows / BLOCK) as u32, 1),
            CubeDim::new_2d(TILE_COLS as u32, ROW_STEP as u32),
            x.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            inv.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            kind.max(),
            factor,
            e5m2,
            dtypes,
        );
    } else {
        quantize_rows_kernel::launch::<R>(
            &client,
            launch_shape(rows * (cols / BLOCK) * LANES),
            CubeDim::new_1d(THREADS),
            x.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            inv.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            kind.max(),
            factor,
            e5m2,
            dtypes,
        );
    }
    (out, inv)
}

/// The widths [`quantize_both_kernel`] reads `x` in, widest first: 128 must be a multiple of
/// 16 times each.
const BOTH_VECTORS: [usize; 2] = [8, 4];

/// The width [`quantize_blockwise_both`]'s kernel reads the contiguous `x` in, `None` where it
/// takes the two kernels of [`quantize_blockwise`].
#[doc(hidden)]
pub fn both_layouts_width<R: CubeRuntime>(x: &CubeTensor<R>) -> Option<usize> {
    let readable = vector_width(&[x]);
    BOTH_VECTORS.into_iter().find(|&v| readable >= v)
}

/// Both layouts of [`quantize_blockwise`] from one read of `x` (`[rows, cols]`, multiples of
/// 128): `[(q, inv), (q_t, inv_t)]`, the row-major cast and the transposed one with their
/// reciprocal scales, the same bits as the two calls give. One kernel where `x` is readable
/// in vectors of 8 or 4 elements, else the two kernels.
pub fn quantize_blockwise_both<R: CubeRuntime>(
    x: CubeTensor<R>,
    kind: impl Into<CastTarget>,
    margin: i32,
) -> [(CubeTensor<R>, CubeTensor<R>); 2] {
    both_layouts(x, kind.into(), margin, false)
}

/// Both layouts of [`quantize_squares`] from one read of `x` (`[rows, cols]`, multiples of
/// 128): `[(q, inv), (q_t, inv_t)]`, the same bits and scales as the two calls give, one
/// kernel where `x` is readable in vectors of 8 or 4 elements.
pub fn quantize_squares_both<R: CubeRuntime>(
    x: CubeTensor<R>,
    kind: impl Into<CastTarget>,
    margin: i32,
) -> [(CubeTensor<R>, CubeTensor<R>); 2] {
    both_layouts(x, kind.into(), margin, true)
}

/// [`quantize_blockwise_both`], or with `square` [`quantize_squares_both`].
fn both_layouts<R: CubeRuntime>(
    x: CubeTensor<R>,
    kind: CastTarget,
    margin: i32,
    square: bool,
) -> [(CubeTensor<R>, CubeTensor<R>); 2] {
    let e5m2 = kind.is_e5m2().expect("a blockwise cast writes FP8 bits");
    let (x, rows, cols) = whole_blocks(x);
    let Some(vector) = both_layouts_width(&x) else {
        let cast = match square {
            true => quantize_squares,
            false => quantize_blockwise,
        };
        return [false, true].map(|t| cast(x.clone(), kind, margin, t));
    };
    let empty = |shape: Vec<usize>, dtype| empty_on(&x, shape, dtype);
    let padded = |blocks: usize| blocks.next_multiple_of(4);
    let (row_scales, transposed_scales) = match square {
        true => (
            rows / BLOCK * padded(cols / BLOCK),
            cols / BLOCK * padded(rows / BLOCK),
        ),
        false => (cols / BLOCK * rows, rows / BLOCK * cols),
    };
    let (row, row_inv) = (
        empty(vec![rows, cols], kind.dtype()),
        empty(vec![row_scales], DType::F32),
    );
    let (transposed, transposed_inv) = (
        empty(vec![cols, rows], kind.dtype()),
        empty(vec![transposed_scales], DType::F32),
    );
    let dtypes = [x.dtype.into(), kind.storage()];
    let client = x.client.clone();
    // SAFETY: the grid is one cube a 128 × 128 tile of `x`, whose sides are whole tiles
    // (`whole_blocks`); each thread reads and writes only inside its cube's tile (vectors of
    // `vector`, which divides 128) and the tile's scales of each layout (with `square` one
    // and its row's padding), and the four outputs are allocated for exactly those shapes
    // (the lavapipe test runs several tiles each way against the one-layout kernels).
    unsafe {
        quantize_both_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static((cols / BLOCK) as u32, (rows / BLOCK) as u32, 1),
            CubeDim::new_1d(THREADS),
            vector,
            x.into_tensor_arg(),
            row.clone().into_tensor_arg(),
            row_inv.clone().into_tensor_arg(),
            transposed.clone().into_tensor_arg(),
            transposed_inv.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            kind.max(),
            2f32.powi(-margin),
            vector,
            e5m2,
            square,
            dtypes,
        );
    }
    [(row, row_inv), (transposed, transposed_inv)]
}
