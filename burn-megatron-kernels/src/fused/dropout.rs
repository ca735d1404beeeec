//! Dropout with its mask drawn in the kernel, optionally fused with the residual add that
//! follows it (Megatron's bias-dropout-add, the bias already added by the GEMM's epilogue):
//! `residual + x ∘ m`, or `x ∘ m`, in one read of each input and one write.
//!
//! An element's multiplier `m` (0 or `1 / (1 - p)`) comes from
//! [`crate::counter_rng::element_bits`] of the element's global coordinates, computed here in
//! 32-bit integers: no mask is made on the host, uploaded or stored for the backward pass,
//! which is this same kernel applied to the output's gradient (`dx = dy ∘ m`).

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::{
    THREADS, empty_like, launch_shape, rows_cols, vector_offset, vector_position, vector_width,
};
use crate::counter_rng::{drop_threshold, stream_key};

/// Where a `[rows, columns]` block sits in the global 4D tensor whose mask it takes, and the
/// stream that draws the mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskPlacement {
    /// The drop probability, in `[0, 1)`.
    pub prob: f64,
    /// The stream's 64-bit seed (see [`stream_key`]).
    pub seed: u64,
    /// The block's sizes along the global tensor's second and third axes: its rows are
    /// `[d0, d1, d2]` flattened, the first axis outermost.
    pub inner: [usize; 2],
    /// The block's first element in the global tensor.
    pub offset: [usize; 4],
}

/// [`crate::counter_rng::mix`] in the kernel (also the initial values' hash,
/// [`super::counter_normal`]).
#[cube]
pub(crate) fn mix(x: u32) -> u32 {
    let mut x = x;
    x ^= x >> 16u32;
    x *= 0x7feb_352du32;
    x ^= x >> 15u32;
    x *= 0x846c_a68bu32;
    x ^ (x >> 16u32)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dropout_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    residual: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_row: u32,
    dim1: u32,
    dim2: u32,
    offset0: u32,
    offset1: u32,
    offset2: u32,
    offset3: u32,
    key: u32,
    threshold: u32,
    scale: f32,
    #[comptime] with_residual: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (row, vector) = vector_position(rows, vectors_per_row);
    let r = row as u32;
    let i2 = r % dim2;
    let i1 = (r / dim2) % dim1;
    let i0 = r / (dim1 * dim2);
    let mut prefix = mix(key ^ (i0 + offset0));
    prefix = mix(prefix ^ (i1 + offset1));
    prefix = mix(prefix ^ (i2 + offset2));
    let first = vector as u32 * N::value() as u32 + offset3;

    let value = Vector::<f32, N>::cast_from(x[vector_offset::<F, N>(x, row, vector)]);
    let mut y = Vector::<f32, N>::empty();
    #[unroll]
    for k in 0..N::value() {
        let bits = mix(prefix ^ (first + k as u32));
        let mut m = scale;
        if bits < threshold {
            m = f32::new(0.0);
        }
        y[k] = value[k] * m;
    }
    if with_residual {
        y += Vector::<f32, N>::cast_from(residual[vector_offset::<F, N>(residual, row, vector)]);
    }
    output[vector_offset::<F, N>(output, row, vector)] = Vector::cast_from(y);
}

/// `residual + x ∘ m` (without a residual, `x ∘ m`) for `x: [rows, columns]` (any strides;
/// `residual` of the same shape and dtype), placed by `placement`; the output has `x`'s shape
/// and dtype, computed in f32.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    residual: Option<CubeTensor<R>>,
    placement: MaskPlacement,
) -> CubeTensor<R> {
    let output = empty_like(&x);
    forward_into(x, residual, placement, output.clone());
    output
}

/// [`forward`] written into `output` (`x`'s shape and dtype, any strides): tests pass a
/// poisoned buffer to catch elements the kernel does not write.
pub fn forward_into<R: CubeRuntime>(
    x: CubeTensor<R>,
    residual: Option<CubeTensor<R>>,
    placement: MaskPlacement,
    output: CubeTensor<R>,
) {
    let (rows, cols) = rows_cols(x.meta.shape(), "dropout");
    if let Some(residual) = &residual {
        assert_eq!(
            residual.meta.shape(),
            x.meta.shape(),
            "dropout: the residual and x differ in shape"
        );
        assert_eq!(
            residual.dtype, x.dtype,
            "dropout: the residual and x differ in dtype"
        );
    }
    let [d1, d2] = placement.inner;
    assert!(
        d1 * d2 > 0 && rows.is_multiple_of(d1 * d2),
        "dropout: {rows} rows are not blocks of {d1} × {d2}"
    );
    let fits = |n: usize| u32::try_from(n).is_ok();
    assert!(
        fits(rows * cols)
            && placement
                .offset
                .iter()
                .zip([rows / (d1 * d2), d1, d2, cols])
                .all(|(o, n)| fits(o + n)),
        "dropout: coordinates beyond 32 bits"
    );
    if rows * cols == 0 {
        return;
    }
    let with_residual = residual.is_some();
    let residual = residual.unwrap_or_else(|| x.clone());
    let width = vector_width(&[&x, &residual, &output]);
    let dtype = x.dtype.into();
    let [o0, o1, o2, o3] = placement.offset.map(|o| o as u32);
    dropout_kernel::launch::<R>(
        &x.client.clone(),
        launch_shape(rows * cols / width),
        CubeDim::new_1d(THREADS),
        width,
        x.into_tensor_arg(),
        residual.into_tensor_arg(),
        output.into_tensor_arg(),
        rows as u32,
        (cols / width) as u32,
        d1 as u32,
        d2 as u32,
        o0,
        o1,
        o2,
        o3,
        stream_key(placement.seed),
        drop_threshold(placement.prob),
        (1.0 / (1.0 - placement.prob)) as f32,
        with_residual,
        dtype,
    );
}
