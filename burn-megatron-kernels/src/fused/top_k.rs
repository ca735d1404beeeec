//! The router's top-k: the columns of each row's `k` largest scores, best first, in one
//! kernel.
//!
//! Burn has no top-k that stays on a GPU, so the composition takes `k` rounds of an arg-max,
//! a comparison and a masked fill over the whole score table, then a concatenation: about
//! `4k` launches a router at top-6, each a small kernel the host must launch in turn. Here one
//! thread owns a row and keeps its `k` best in registers, inserting each score in order: one
//! launch, the table read once. A router's rows are short (its experts, 8 to 256) and `k`
//! small, so a row a thread is enough.
//!
//! Order: the larger score first; of equal scores the lower column first (a later equal score
//! never displaces an earlier one), as repeated arg-maxes that pick the first maximum give.
//! A NaN counts as below every number, −∞ included, so every row gets `k` distinct columns
//! whatever its scores.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Threads (rows) per cube.
const THREADS: u32 = 128;

/// Whether the score `value` (NaN if `nan`) at a later column ranks above the kept one.
#[cube]
fn ranks_above(value: f32, nan: bool, kept: f32, kept_nan: bool) -> bool {
    !nan && (kept_nan || value > kept)
}

#[cube(launch)]
fn top_k_kernel<F: Float, I: Int>(
    scores: &Tensor<F>,
    output: &mut Tensor<I>,
    #[comptime] k: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    if row < scores.shape(0) {
        let columns = scores.shape(1);
        let mut values = Array::<f32>::new(k);
        let mut nans = Array::<bool>::new(k);
        let mut chosen = Array::<u32>::new(k);
        // The first k columns in order, then each later one inserted where it ranks.
        let mut filled: usize = 0;
        for c in 0..columns {
            let score = scores[row * scores.stride(0) + c * scores.stride(1)];
            let mut carry = f32::cast_from(score);
            let mut carry_nan = f32::is_nan(carry);
            let mut carry_column = c as u32;
            let mut placed = false;
            #[unroll]
            for j in 0..k {
                if j < filled {
                    if placed || ranks_above(carry, carry_nan, values[j], nans[j]) {
                        // Shift the kept entries down from here: once placed, every later
                        // slot takes the one before it.
                        let kept = values[j];
                        let kept_nan = nans[j];
                        let kept_column = chosen[j];
                        values[j] = carry;
                        nans[j] = carry_nan;
                        chosen[j] = carry_column;
                        carry = kept;
                        carry_nan = kept_nan;
                        carry_column = kept_column;
                        placed = true;
                    }
                } else if j == filled {
                    values[j] = carry;
                    nans[j] = carry_nan;
                    chosen[j] = carry_column;
                }
            }
            if filled < k {
                filled += 1;
            }
        }
        #[unroll]
        for j in 0..k {
            output[row * output.stride(0) + j * output.stride(1)] = I::cast_from(chosen[j]);
        }
    }
}

/// The columns of the `k` largest values of each row of `scores` (`[rows, columns]`, any
/// strides, f32/f16/bf16), best first, ties to the lower column, NaN below everything: `[rows,
/// k]` in `int_dtype`. Needs `1 ≤ k ≤ columns`.
pub fn top_k<R: CubeRuntime>(scores: CubeTensor<R>, k: usize, int_dtype: DType) -> CubeTensor<R> {
    let dims = scores.meta.shape().as_slice();
    assert_eq!(dims.len(), 2, "top_k takes [rows, columns]");
    let (rows, columns) = (dims[0], dims[1]);
    assert!(
        k >= 1 && k <= columns,
        "top_k: k = {k} of {columns} columns"
    );
    let client = scores.client.clone();
    let output = empty_device_contiguous_dtype::<R>(
        client.clone(),
        scores.device.clone(),
        Shape::new([rows, k]),
        int_dtype,
    );
    if rows == 0 {
        return output;
    }
    let cubes = rows.div_ceil(THREADS as usize);
    let x = cubes.min(65_535);
    let dtypes = [scores.dtype.into(), int_dtype.into()];
    top_k_kernel::launch::<R>(
        &client,
        CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1),
        CubeDim::new_1d(THREADS),
        scores.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        k,
        dtypes,
    );
    output
}
