//! Reading and writing `[rows, columns]` tensors as [`Vector`]s: the widest vector the shapes
//! and strides allow (16 bytes on CUDA: 8 bf16 or 4 f32; 4 elements at most on wgpu), and
//! where a thread's vector sits, for the element-wise kernels.

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::tensor_vector_size_parallel;

/// Threads per cube of the element-wise kernels.
pub const THREADS: u32 = 256;

/// The widest vector every tensor can be read with along its last dimension (1 when its
/// stride there is not 1, or no width divides the shape and the other strides). The element
/// size is the first tensor's.
pub fn vector_width<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> usize {
    let client = &tensors[0].client;
    let elem_size = tensors[0].dtype.size();
    tensors
        .iter()
        .map(|t| {
            let rank = t.meta.shape().as_slice().len();
            tensor_vector_size_parallel(
                client.io_optimized_vector_sizes(elem_size),
                t.meta.shape(),
                t.meta.strides(),
                rank - 1,
            )
        })
        .min()
        .unwrap_or(1)
}

/// `(rows, columns)` of the `[tokens, features]` input of the element-wise op `op`.
pub fn rows_cols(shape: &Shape, op: &str) -> (usize, usize) {
    let dims = shape.as_slice();
    assert_eq!(dims.len(), 2, "{op} takes [tokens, features]");
    (dims[0], dims[1])
}

/// A new contiguous tensor of `x`'s shape, dtype and device.
pub fn empty_like<R: CubeRuntime>(x: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    )
}

/// A grid of [`THREADS`]-thread cubes covering `threads` threads, each dimension within every
/// runtime's limit.
pub fn launch_shape(threads: usize) -> CubeCount {
    let cubes = threads.div_ceil(THREADS as usize).max(1);
    let x = cubes.min(65_535);
    CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1)
}

/// This thread's vector as (row, vector within the row), one vector a thread over
/// `rows × vectors_per_row`, or `terminate!` past the end.
#[cube]
pub fn vector_position(rows: u32, vectors_per_row: u32) -> (usize, usize) {
    let cube = CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X;
    let index = cube * CUBE_DIM_X + UNIT_POS_X;
    if index >= rows * vectors_per_row {
        terminate!();
    }
    (
        (index / vectors_per_row) as usize,
        (index % vectors_per_row) as usize,
    )
}

/// How an element-wise kernel spreads `[rows, columns]` over threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ElementwiseLayout {
    /// One vector a thread, threads numbered over all the rows' vectors: a division finds a
    /// thread's row.
    #[default]
    Flat,
    /// One column vector a thread over this many consecutive rows: cubes along x cover a row's
    /// vectors, cubes along y (and z, past y's limit) blocks of rows; the column's bias is
    /// read once and every row's loads are issued before any is used.
    Rows(u32),
}

impl ElementwiseLayout {
    /// Rows each thread computes.
    pub fn rows_per_thread(&self) -> u32 {
        match self {
            ElementwiseLayout::Flat => 1,
            ElementwiseLayout::Rows(n) => (*n).max(1),
        }
    }

    /// The grid over `rows` rows of `vectors_per_row` vectors, [`THREADS`]-thread cubes.
    pub fn cube_count(&self, rows: usize, vectors_per_row: usize) -> CubeCount {
        match self {
            ElementwiseLayout::Flat => launch_shape(rows * vectors_per_row),
            ElementwiseLayout::Rows(_) => {
                let x = vectors_per_row.div_ceil(THREADS as usize).max(1);
                let blocks = rows.div_ceil(self.rows_per_thread() as usize).max(1);
                let y = blocks.min(65_535);
                CubeCount::Static(x as u32, y as u32, blocks.div_ceil(y) as u32)
            }
        }
    }
}

/// This thread's column vector and first row under `layout` (it computes rows `first ..
/// first + layout.rows_per_thread()` that are below `rows`), or `terminate!` when it has none.
#[cube]
pub fn thread_position(
    rows: u32,
    vectors_per_row: u32,
    #[comptime] layout: ElementwiseLayout,
) -> (usize, usize) {
    if comptime!(layout == ElementwiseLayout::Flat) {
        let (row, vector) = vector_position(rows, vectors_per_row);
        (vector, row)
    } else {
        let vector = CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X;
        let block = CUBE_POS_Z * CUBE_COUNT_Y + CUBE_POS_Y;
        let first = block * comptime!(layout.rows_per_thread());
        if vector >= vectors_per_row || first >= rows {
            terminate!();
        }
        (vector as usize, first as usize)
    }
}

/// The offset of vector `vector` of row `row` of a 2D tensor: element offsets over the width
/// (the vectorised axis has stride 1 whenever the width is above 1, and every other stride
/// is a multiple of it).
#[cube]
pub fn vector_offset<F: Float, N: Size>(
    tensor: &Tensor<Vector<F, N>>,
    row: usize,
    vector: usize,
) -> usize {
    let width = N::value();
    (row * tensor.stride(0) + vector * width * tensor.stride(1)) / width
}

/// Vector `vector` of a `[columns]` parameter (a bias), as f32.
#[cube]
pub fn column_vector<F: Float, N: Size>(
    tensor: &Tensor<Vector<F, N>>,
    vector: usize,
) -> Vector<f32, N> {
    let width = N::value();
    Vector::<f32, N>::cast_from(tensor[vector * width * tensor.stride(0) / width])
}
