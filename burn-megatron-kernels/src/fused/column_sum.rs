//! Deterministic column sums over the rows of `dy: [rows, columns]`, f32 accumulation and no
//! atomics: the bias gradients of the linear layers and bias-GeLU (`Σ_rows dy`) and the
//! norms' weight gradients (`Σ_rows dy · x̂` and `Σ_rows dy`).
//!
//! Two stages, each in a fixed order, so the same inputs give the same bits on every run:
//! 1. `partials_kernel`: cube `(i, b)` sums rows `b · rows_per_block ..` of a span of
//!    columns into row `b` of a `[blocks, columns]` f32 buffer. A thread holds one [`Vector`]
//!    of columns (coalesced 16-byte loads in bf16) and one of `row_lanes` interleaved lanes of
//!    the block's rows, with `loads_in_flight` rows loaded before they are added (the stage is
//!    bound by load latency otherwise); the lanes are then added in order.
//! 2. `total_kernel`: each column's blocks, in `lanes` interleaved lanes, then the lanes in
//!    order; written in the output's dtype.
//!
//! [`ColumnSumLayout`] holds these shapes; `kernel_bench column_sum_layouts` measures them.
//!
//! The norms' backward writes its stage-one partials itself, next to `dx`, and calls
//! [`totals_into_with`] with its own layout.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::vector_width;

/// The shapes of the two stages. The default is the fastest measured on an H100
/// (`kernel_bench column_sum_layouts`); the result's bits depend on the layout, never on the
/// run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ColumnSumLayout {
    /// Column vectors per cube of the first stage (`CUBE_DIM_X`).
    pub column_vectors: u32,
    /// Threads per column vector of the first stage (`CUBE_DIM_Y`), each summing every
    /// `row_lanes`-th row of the block.
    pub row_lanes: u32,
    /// Rows a first-stage thread loads before adding them.
    pub loads_in_flight: u32,
    /// Rows per block of the first stage, at least; more when there would be more than
    /// `max_blocks` blocks.
    pub min_rows_per_block: usize,
    /// Partial sums per column, at most.
    pub max_blocks: usize,
    /// Columns per cube of the second stage.
    pub total_columns: u32,
    /// Threads per column of the second stage, each summing every `total_lanes`-th block.
    pub total_lanes: u32,
    /// Let CubeCL check the bounds of every tensor access in both stages (they bound every
    /// access themselves). On by default: the sums were as fast or faster with the checks
    /// (H100, 2026-11-26: bf16 16 384 × 4 096 in 0.071 ms against 0.076 without; all 8
    /// shapes), their loops having few accesses to check.
    pub checked: bool,
}

impl Default for ColumnSumLayout {
    fn default() -> Self {
        // Against the layout before the sweep (128 vectors, one load in flight, 32-row blocks,
        // at most 512 blocks): bf16 16 384 × 4 096 in 0.074 ms instead of 0.085; the geometric
        // mean over bf16 and f32 at 768 to 4 096 columns 1.04× the best layout's time at each
        // size, the old one's 1.08× (2026-11-25).
        Self {
            column_vectors: 64,
            row_lanes: 1,
            loads_in_flight: 4,
            min_rows_per_block: 64,
            max_blocks: 256,
            total_columns: 4,
            total_lanes: 64,
            checked: true,
        }
    }
}

impl ColumnSumLayout {
    /// `(blocks, rows_per_block)` of the first stage over `rows` rows.
    pub fn blocks(&self, rows: usize) -> (usize, usize) {
        let rows_per_block = rows
            .div_ceil(self.max_blocks.max(1))
            .max(self.min_rows_per_block.max(1));
        (rows.div_ceil(rows_per_block).max(1), rows_per_block)
    }
}

/// The grid of a kernel that writes the column sums' first-stage partials itself as it walks
/// each column vector down a block of rows (the bias-GeLU and SwiGLU backward): the default
/// layout's blocks, one thread a column vector, [`walked_rows()`] inside the kernel, then
/// [`totals_into_with`] on the partials.
#[derive(Debug, Clone, Copy)]
pub struct ColumnWalk {
    pub layout: ColumnSumLayout,
    pub blocks: usize,
    pub rows_per_block: usize,
}

impl ColumnWalk {
    /// The walk over `rows` rows.
    pub fn new(rows: usize) -> Self {
        let layout = ColumnSumLayout::default();
        let (blocks, rows_per_block) = layout.blocks(rows);
        Self {
            layout,
            blocks,
            rows_per_block,
        }
    }

    /// Cubes along x over a row's `vectors_per_row` vectors, along y over the blocks.
    pub fn cube_count(&self, vectors_per_row: usize) -> CubeCount {
        CubeCount::Static(
            vectors_per_row.div_ceil(self.layout.column_vectors as usize) as u32,
            self.blocks as u32,
            1,
        )
    }

    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_1d(self.layout.column_vectors)
    }

    /// A `[blocks, columns]` f32 buffer for the partials, on `like`'s device.
    pub fn partials<R: CubeRuntime>(&self, like: &CubeTensor<R>, columns: usize) -> CubeTensor<R> {
        buffer(like, Shape::new([self.blocks, columns]), DType::F32)
    }

    /// The totals of `partial` (from [`partials`](Self::partials)) written into `out`.
    pub fn totals_into<R: CubeRuntime>(&self, partial: CubeTensor<R>, out: CubeTensor<R>) {
        totals_into_with(self.layout, partial, self.blocks, out);
    }
}

/// This thread's column vector and its block's rows `start..end` in a [`ColumnWalk`], or
/// `terminate!` past the row's vectors.
#[cube]
pub fn walked_rows(rows: u32, vectors_per_row: u32, rows_per_block: u32) -> (usize, usize, usize) {
    let vector = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if vector >= vectors_per_row as usize {
        terminate!();
    }
    let start = CUBE_POS_Y as usize * rows_per_block as usize;
    let mut end = start + rows_per_block as usize;
    if end > rows as usize {
        end = rows as usize;
    }
    (vector, start, end)
}

/// The normalised input `x̂ = (x - mean) · rstd` of a norm, whose products with `dy` are summed
/// next to `dy` itself (the scale and shift gradients).
#[derive(Debug, Clone)]
pub struct Normalised<R: CubeRuntime> {
    /// `[rows, columns]`, `dy`'s dtype.
    pub x: CubeTensor<R>,
    /// `[rows]` f32 (ignored for RMSNorm).
    pub mean: CubeTensor<R>,
    /// `[rows]` f32.
    pub rstd: CubeTensor<R>,
    /// Whether `mean` is subtracted (LayerNorm) or not (RMSNorm).
    pub centred: bool,
}

/// `dy` (and `dy · x̂`) of one row at this thread's columns, in f32, added to the totals.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_row<F: Float, N: Size>(
    g: Vector<F, N>,
    value: Vector<F, N>,
    row: usize,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    total_dy: &mut Vector<f32, N>,
    total_dyx: &mut Vector<f32, N>,
    #[comptime] sum_dy: bool,
    #[comptime] normalised: bool,
    #[comptime] centred: bool,
) {
    let g = Vector::<f32, N>::cast_from(g);
    if sum_dy {
        *total_dy += g;
    }
    if normalised {
        let mut mu = f32::new(0.0);
        if centred {
            mu = mean[row * mean.stride(0)];
        }
        let x_hat = (Vector::<f32, N>::cast_from(value) - Vector::new(mu))
            * Vector::new(rstd[row * rstd.stride(0)]);
        *total_dyx += g * x_hat;
    }
}

/// Stage one: partial sums of `dy` (into `partial_dy`, when `sum_dy`) and of `dy · x̂` (into
/// `partial_dyx`, when `normalised`).
#[cube(launch, launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn partials_kernel<F: Float, N: Size>(
    dy: &Tensor<Vector<F, N>>,
    x: &Tensor<Vector<F, N>>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    partial_dy: &mut Tensor<Vector<f32, N>>,
    partial_dyx: &mut Tensor<Vector<f32, N>>,
    rows: u32,
    rows_per_block: u32,
    #[comptime] layout: ColumnSumLayout,
    #[comptime] sum_dy: bool,
    #[comptime] normalised: bool,
    #[comptime] centred: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let vector = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    // Threads past the last column still reach the lanes' barrier.
    let active = vector < dy.shape(1) / width;
    // Element offsets to vector offsets: the vectorised axis has stride 1 whenever `width` is
    // above 1, and every other stride is a multiple of `width`.
    let column = vector * width;
    let block = CUBE_POS_Y as usize;
    let start = block * rows_per_block as usize;
    let mut end = start + rows_per_block as usize;
    if end > rows as usize {
        end = rows as usize;
    }
    if !active {
        end = start;
    }
    let lanes = comptime!(layout.row_lanes as usize);
    let in_flight = comptime!(layout.loads_in_flight as usize);
    let mut total_dy = Vector::<f32, N>::new(0.0);
    let mut total_dyx = Vector::<f32, N>::new(0.0);
    let mut gs = Array::<Vector<F, N>>::new(in_flight);
    let mut xs = Array::<Vector<F, N>>::new(in_flight);
    let mut row = start + UNIT_POS_Y as usize;
    // Whole groups of `loads_in_flight` rows: every load first, then the adds in row order.
    while row + (in_flight - 1) * lanes < end {
        #[unroll]
        for j in 0..in_flight {
            let r = row + j * lanes;
            gs[j] = dy[(r * dy.stride(0) + column * dy.stride(1)) / width];
            if normalised {
                xs[j] = x[(r * x.stride(0) + column * x.stride(1)) / width];
            }
        }
        #[unroll]
        for j in 0..in_flight {
            let mut value = gs[j];
            if normalised {
                value = xs[j];
            }
            add_row::<F, N>(
                gs[j],
                value,
                row + j * lanes,
                mean,
                rstd,
                &mut total_dy,
                &mut total_dyx,
                sum_dy,
                normalised,
                centred,
            );
        }
        row += in_flight * lanes;
    }
    while row < end {
        let g = dy[(row * dy.stride(0) + column * dy.stride(1)) / width];
        let mut value = g;
        if normalised {
            value = x[(row * x.stride(0) + column * x.stride(1)) / width];
        }
        add_row::<F, N>(
            g,
            value,
            row,
            mean,
            rstd,
            &mut total_dy,
            &mut total_dyx,
            sum_dy,
            normalised,
            centred,
        );
        row += lanes;
    }
    if lanes > 1 {
        // The lanes' totals, added in lane order by lane 0.
        let slots = comptime!((layout.row_lanes * layout.column_vectors) as usize);
        let mut shared_dy = SharedMemory::<Vector<f32, N>>::new(slots);
        let mut shared_dyx = SharedMemory::<Vector<f32, N>>::new(slots);
        let slot = UNIT_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
        if sum_dy {
            shared_dy[slot] = total_dy;
        }
        if normalised {
            shared_dyx[slot] = total_dyx;
        }
        sync_cube();
        if UNIT_POS_Y == 0 {
            total_dy = Vector::new(0.0);
            total_dyx = Vector::new(0.0);
            #[unroll]
            for l in 0..lanes {
                let slot = l * CUBE_DIM_X as usize + UNIT_POS_X as usize;
                if sum_dy {
                    total_dy += shared_dy[slot];
                }
                if normalised {
                    total_dyx += shared_dyx[slot];
                }
            }
        }
    }
    if active && UNIT_POS_Y == 0 {
        if sum_dy {
            partial_dy[(block * partial_dy.stride(0) + column * partial_dy.stride(1)) / width] =
                total_dy;
        }
        if normalised {
            partial_dyx[(block * partial_dyx.stride(0) + column * partial_dyx.stride(1)) / width] =
                total_dyx;
        }
    }
}

/// Stage two: lane `l` of a column sums blocks `l, l + lanes, …` in order, then lane 0 adds
/// the lanes in order and writes the total in `O`.
#[cube(launch, launch_unchecked)]
fn total_kernel<O: Float>(
    partial: &Tensor<f32>,
    total: &mut Tensor<O>,
    blocks: u32,
    columns: u32,
    #[comptime] slots: u32,
    #[define(O)] _dtype: StorageType,
) {
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let lane = UNIT_POS_Y as usize;
    let lanes = CUBE_DIM_Y as usize;
    let mut lane_sums = SharedMemory::<f32>::new(comptime!(slots as usize));
    let slot = UNIT_POS_X as usize * lanes;
    let mut sum = f32::new(0.0);
    if col < columns as usize {
        let mut block = lane;
        while block < blocks as usize {
            sum += partial[block * partial.stride(0) + col * partial.stride(1)];
            block += lanes;
        }
    }
    lane_sums[slot + lane] = sum;
    sync_cube();
    if lane == 0 && col < columns as usize {
        let mut total_sum = f32::new(0.0);
        let mut l: usize = 0;
        while l < lanes {
            total_sum += lane_sums[slot + l];
            l += 1;
        }
        total[col * total.stride(0)] = O::cast_from(total_sum);
    }
}

fn buffer<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(like.client.clone(), like.device.clone(), shape, dtype)
}

/// The column sums of `dy` (`[rows, columns]`, any strides, f32/f16/bf16) written into
/// `sum_dy` (when given) and of `dy · x̂` into `sum_dyx` (when `normalised` is given): both
/// `[columns]`, any float dtype, any stride.
pub fn column_sums_into<R: CubeRuntime>(
    dy: CubeTensor<R>,
    normalised: Option<Normalised<R>>,
    sum_dy: Option<CubeTensor<R>>,
    sum_dyx: Option<CubeTensor<R>>,
) {
    column_sums_into_with(ColumnSumLayout::default(), dy, normalised, sum_dy, sum_dyx);
}

/// [`column_sums_into`] with the stages shaped by `layout`.
pub fn column_sums_into_with<R: CubeRuntime>(
    layout: ColumnSumLayout,
    dy: CubeTensor<R>,
    normalised: Option<Normalised<R>>,
    sum_dy: Option<CubeTensor<R>>,
    sum_dyx: Option<CubeTensor<R>>,
) {
    let dims = dy.meta.shape().as_slice();
    assert_eq!(dims.len(), 2, "column sums take dy: [rows, columns]");
    let (rows, columns) = (dims[0], dims[1]);
    assert_eq!(
        normalised.is_some(),
        sum_dyx.is_some(),
        "dy · x̂ is summed exactly when x̂ is given"
    );
    if columns == 0 || (sum_dy.is_none() && sum_dyx.is_none()) {
        return;
    }
    let client = dy.client.clone();
    let (blocks, rows_per_block) = layout.blocks(rows);
    let partial_dy = sum_dy
        .as_ref()
        .map(|_| buffer(&dy, Shape::new([blocks, columns]), DType::F32));
    let partial_dyx = sum_dyx
        .as_ref()
        .map(|_| buffer(&dy, Shape::new([blocks, columns]), DType::F32));
    let placeholder = partial_dy
        .clone()
        .or_else(|| partial_dyx.clone())
        .expect("one sum is asked for");
    let (x, mean, rstd, centred) = match &normalised {
        Some(n) => (n.x.clone(), n.mean.clone(), n.rstd.clone(), n.centred),
        None => (dy.clone(), placeholder.clone(), placeholder.clone(), false),
    };
    let width = {
        let mut tensors = vec![&dy, &placeholder];
        if normalised.is_some() {
            tensors.push(&x);
        }
        vector_width(&tensors)
    };
    let cubes = (columns / width).div_ceil(layout.column_vectors as usize) as u32;
    if rows > 0 {
        launch_checked_or_not!(
            partials_kernel,
            layout.checked,
            &client,
            CubeCount::Static(cubes, blocks as u32, 1),
            CubeDim::new_2d(layout.column_vectors, layout.row_lanes),
            width,
            dy.clone().into_tensor_arg(),
            x.into_tensor_arg(),
            mean.into_tensor_arg(),
            rstd.into_tensor_arg(),
            partial_dy
                .clone()
                .unwrap_or_else(|| placeholder.clone())
                .into_tensor_arg(),
            partial_dyx
                .clone()
                .unwrap_or_else(|| placeholder.clone())
                .into_tensor_arg(),
            rows as u32,
            rows_per_block as u32,
            layout,
            partial_dy.is_some(),
            normalised.is_some(),
            centred,
            dy.dtype.into(),
        );
    }
    // With no rows the partials are never written: sum no block instead.
    let blocks = if rows > 0 { blocks } else { 0 };
    if let (Some(partial), Some(out)) = (partial_dy, sum_dy) {
        totals_into_with(layout, partial, blocks, out);
    }
    if let (Some(partial), Some(out)) = (partial_dyx, sum_dyx) {
        totals_into_with(layout, partial, blocks, out);
    }
}

/// Stage two on its own: the sums over the first `blocks` rows of `partial` (`[at least
/// blocks, columns]`, f32), written into `out` (`[columns]`, any float dtype and stride). The
/// norms' backward kernel writes such partials itself.
pub fn totals_into<R: CubeRuntime>(partial: CubeTensor<R>, blocks: usize, out: CubeTensor<R>) {
    totals_into_with(ColumnSumLayout::default(), partial, blocks, out);
}

/// [`totals_into`] shaped by `layout`'s `total_columns` and `total_lanes`.
pub fn totals_into_with<R: CubeRuntime>(
    layout: ColumnSumLayout,
    partial: CubeTensor<R>,
    blocks: usize,
    out: CubeTensor<R>,
) {
    let columns = partial.meta.shape().as_slice()[1];
    if columns == 0 {
        return;
    }
    let dtype = out.dtype.into();
    launch_checked_or_not!(
        total_kernel,
        layout.checked,
        &partial.client.clone(),
        CubeCount::Static(columns.div_ceil(layout.total_columns as usize) as u32, 1, 1),
        CubeDim::new_2d(layout.total_columns, layout.total_lanes),
        partial.into_tensor_arg(),
        out.into_tensor_arg(),
        blocks as u32,
        columns as u32,
        layout.total_columns * layout.total_lanes,
        dtype,
    );
}

/// `Σ_rows dy` of `dy: [rows, columns]` (any strides, f32/f16/bf16), accumulated in f32 in a
/// fixed order, as `[columns]` in `dtype`: the bias gradient of a layer whose output
/// gradient is `dy`.
pub fn column_sum<R: CubeRuntime>(dy: CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    column_sum_with(ColumnSumLayout::default(), dy, dtype)
}

/// [`column_sum`] with the stages shaped by `layout`.
pub fn column_sum_with<R: CubeRuntime>(
    layout: ColumnSumLayout,
    dy: CubeTensor<R>,
    dtype: DType,
) -> CubeTensor<R> {
    let columns = dy.meta.shape().as_slice().get(1).copied().unwrap_or(0);
    let out = buffer(&dy, Shape::new([columns]), dtype);
    column_sums_into_with(layout, dy, None, Some(out.clone()), None);
    out
}
