//! The inverse of an injective row index on the device, `inverse[rows[i]] = i`: the MoE
//! dispatcher's map from each send row back to its assignment.
//!
//! CubeCL's `scatter` gives a 1-D index one thread, and the stand-in before this kernel (the
//! embedding gradient's kernel on the positions) needed the positions uploaded from the host
//! each layer, a wait the GPU saw. Here a thread an index writes its position: the rows are
//! distinct, so no two threads write one element.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::zeros_client;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::{THREADS, launch_shape};

#[cube(launch)]
fn row_inverse_kernel<I: Int>(
    rows: &Tensor<I>,
    inverse: &mut Tensor<I>,
    #[define(I)] _dtype: StorageType,
) {
    let i = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    if i < rows.shape(0) {
        // A negative index reads as a huge one and is skipped with those past the end.
        let r = usize::cast_from(rows[i * rows.stride(0)]);
        if r < inverse.shape(0) {
            inverse[r * inverse.stride(0)] = I::cast_from(i);
        }
    }
}

/// `[n]` in `rows`' dtype: `inverse[rows[i]] = i` for every `rows[i]` in `0..n`, zero where
/// no index names the row. `rows` (`[m]`, any int dtype) must be distinct where in range
/// (where two name one row, either position may win).
pub fn row_inverse<R: CubeRuntime>(rows: CubeTensor<R>, n: usize) -> CubeTensor<R> {
    let dims = rows.meta.shape().as_slice();
    assert_eq!(dims.len(), 1, "row_inverse takes a 1-D index");
    let m = dims[0];
    let dtype: DType = rows.dtype;
    let inverse = zeros_client::<R>(
        rows.client.clone(),
        rows.device.clone(),
        Shape::new([n]),
        dtype,
    );
    if m == 0 || n == 0 {
        return inverse;
    }
    let client = rows.client.clone();
    row_inverse_kernel::launch::<R>(
        &client,
        launch_shape(m),
        CubeDim::new_1d(THREADS),
        rows.into_tensor_arg(),
        inverse.clone().into_tensor_arg(),
        dtype.into(),
    );
    inverse
}
