//! A tensor written into (or added to) a slot of a flat f32 buffer, cast on the way: how each
//! parameter's gradient enters the flat fp32 gradient buffer, in one kernel where Burn takes
//! two (a cast, then a `slice_assign`) or four (to add: a cast, a slice, the sum, a
//! `slice_assign`), 16-byte vectors where the slot allows.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::{THREADS, launch_shape, vector_width};

#[cube(launch)]
fn copy_kernel<F: Float, N: Size>(
    values: &Tensor<Vector<F, N>>,
    buffer: &mut Tensor<Vector<f32, N>>,
    start: u32,
    vectors: u32,
    #[comptime] add: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if i >= vectors {
        terminate!();
    }
    let width = N::value();
    let i = i as usize;
    let value = Vector::cast_from(values[i * width * values.stride(0) / width]);
    if add {
        buffer[start as usize + i] += value;
    } else {
        buffer[start as usize + i] = value;
    }
}

/// Writes `values` (`[n]`, any strides, f32/f16/bf16) cast to f32 into
/// `buffer[start..start + n]` (`buffer`: `[numel]`, contiguous f32) in place. The caller owns `buffer`: nothing
/// else may read it while this runs (check `buffer.can_mut()`).
pub fn copy_into<R: CubeRuntime>(values: CubeTensor<R>, buffer: &CubeTensor<R>, start: usize) {
    launch(values, buffer, start, false);
}

/// Adds `values` (`[n]`, any strides, f32/f16/bf16) cast to f32 to `buffer[start..start + n]`
/// in place: a later microbatch's gradient added to the f32 sum (Megatron's `main_grad`),
/// reading the gradient and the sum once and writing the sum once. The same ownership rule
/// as [`copy_into`].
pub fn add_into<R: CubeRuntime>(values: CubeTensor<R>, buffer: &CubeTensor<R>, start: usize) {
    launch(values, buffer, start, true);
}

fn launch<R: CubeRuntime>(values: CubeTensor<R>, buffer: &CubeTensor<R>, start: usize, add: bool) {
    let n = values.meta.shape().as_slice()[0];
    assert_eq!(buffer.dtype, DType::F32, "the flat buffer is f32");
    assert!(buffer.is_contiguous(), "the flat buffer is contiguous");
    let numel = buffer.meta.shape().as_slice()[0];
    assert!(
        start + n <= numel,
        "slot {start}..{} past the buffer's {numel}",
        start + n
    );
    if n == 0 {
        return;
    }
    // The slot's start must be a whole number of vectors too.
    let mut width = vector_width(&[&values, buffer]);
    while !start.is_multiple_of(width) {
        width /= 2;
    }
    let dtype = values.dtype.into();
    copy_kernel::launch::<R>(
        &values.client.clone(),
        launch_shape(n / width),
        CubeDim::new_1d(THREADS),
        width,
        values.into_tensor_arg(),
        buffer.clone().into_tensor_arg(),
        (start / width) as u32,
        (n / width) as u32,
        add,
        dtype,
    );
}
