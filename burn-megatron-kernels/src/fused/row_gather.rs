//! The MoE dispatcher's row moves in one kernel: each output row the (weighted) sum of `c`
//! source rows named by an index, a masked index giving a zero row.
//!
//! `y[i] = Σ_{j < c} w[i, j] · x[rows[i·c + j]]`, where a row whose `zero` flag is set, or
//! whose index is past the source, adds nothing. With `c = 1` and no weights it is a row
//! gather (Megatron's permute); with weights, the weighted combine of each token's `k` expert
//! outputs (unpermute); without weights, the gradient's sum over a row's readers.
//!
//! Burn's `select` gives each element a thread that reads its index and one value, and the
//! mask, the product and the sum over `c` are kernels of their own: a 25 MB gather ran at
//! about 90 µs on an H200, a sixth of the memory's speed. Here a cube owns an output row:
//! its threads read the row's indices once and move 16-byte vectors, summing in f32 in `j`
//! order (one rounding to the output's dtype).

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::vector_width;

/// Threads per cube (one output row a cube).
const THREADS: u32 = 128;

/// Every term's weight is 1.
const UNWEIGHTED: u32 = 0;
/// Term `j` of output row `i` is weighted by `weights[i, j]`.
const WEIGHT_BY_OUTPUT: u32 = 1;
/// A term whose index is `a` is weighted by `weights[a / divide, a % divide]`.
const WEIGHT_BY_INDEX: u32 = 2;

/// How [`row_gather`] weights its terms.
#[derive(Debug, Clone)]
pub enum RowWeights<R: CubeRuntime> {
    /// Each term counts once.
    None,
    /// `[m, c]`: term `j` of output row `i` times `weights[i, j]`.
    ByOutput(CubeTensor<R>),
    /// `[n, divide]`: a term whose index is `a` reads source row `a / divide`, times
    /// `weights[a / divide, a % divide]` (the gradient of a weighted combine: each expert
    /// output's row back to its token, times the router's weight).
    ByIndex(CubeTensor<R>),
}

#[cube(launch)]
fn row_gather_kernel<F: Float, I: Int, M: Int, N: Size>(
    x: &Tensor<Vector<F, N>>,
    rows: &Tensor<I>,
    zero: &Tensor<M>,
    weights: &Tensor<F>,
    output: &mut Tensor<Vector<F, N>>,
    divide: u32,
    #[comptime] c: usize,
    #[comptime] has_zero: bool,
    #[comptime] weighting: u32,
    #[define(F, I, M)] _dtypes: [StorageType; 3],
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if i < output.shape(0) {
        let width = N::value();
        let vectors = output.shape(1) / width;
        let sources = x.shape(0);
        // Each term's source row (`sources` for a zero row) and weight.
        let mut source = Array::<usize>::new(c);
        let mut weight = Array::<f32>::new(c);
        #[unroll]
        for j in 0..c {
            let a = i * c + j;
            let index = usize::cast_from(rows[a * rows.stride(0)]);
            let d = divide as usize;
            let mut r = index / d;
            // `has_zero` is a compile-time flag: the inner test is compiled only with a mask.
            #[allow(clippy::collapsible_if)]
            if has_zero {
                if zero[a * zero.stride(0)] != M::new(0) {
                    r = sources;
                }
            }
            weight[j] = 1.0;
            if weighting == WEIGHT_BY_OUTPUT {
                weight[j] = f32::cast_from(weights[i * weights.stride(0) + j * weights.stride(1)]);
            }
            if weighting == WEIGHT_BY_INDEX {
                // `index` names an element of the `[rows, divide]` weights.
                if r < sources {
                    weight[j] = f32::cast_from(
                        weights[(index / d) * weights.stride(0) + (index % d) * weights.stride(1)],
                    );
                }
            }
            source[j] = r;
        }
        let mut v = UNIT_POS_X as usize;
        while v < vectors {
            let mut sum = Vector::<f32, N>::new(0.0);
            #[unroll]
            for j in 0..c {
                let r = source[j];
                if r < sources {
                    let value = Vector::<f32, N>::cast_from(x[(r * x.stride(0)) / width + v]);
                    if weighting == UNWEIGHTED {
                        sum += value;
                    } else {
                        sum += value * Vector::new(weight[j]);
                    }
                }
            }
            output[(i * output.stride(0)) / width + v] = Vector::cast_from(sum);
            v += CUBE_DIM_X as usize;
        }
    }
}

/// `y[i] = Σ_{j < c} w · x[rows[i·c + j] / divide]` (see the module and [`RowWeights`]),
/// `[rows.len() / c, hidden]` in `x`'s dtype.
///
/// - `x`: `[n, hidden]` (f32/f16/bf16)
/// - `rows`: `[m · c]`, any int dtype; a source row outside `0..n` reads as zero
/// - `zero`: `[m · c]` flags (a bool tensor's storage), set for zero rows
/// - `divide`: 1, or the weights' columns for [`RowWeights::ByIndex`]
pub fn row_gather<R: CubeRuntime>(
    x: CubeTensor<R>,
    rows: CubeTensor<R>,
    zero: Option<CubeTensor<R>>,
    weights: RowWeights<R>,
    c: usize,
) -> CubeTensor<R> {
    let dims = x.meta.shape().as_slice();
    assert_eq!(dims.len(), 2, "row_gather takes x as [n, hidden]");
    let hidden = dims[1];
    let len = rows.meta.shape().as_slice()[0];
    assert!(
        c >= 1 && len.is_multiple_of(c),
        "row_gather: {len} indices, {c} a row"
    );
    let m = len / c;
    // The kernel reads whole rows of unit column stride.
    let x = match x.meta.strides()[1] {
        1 => x,
        _ => burn_cubecl::kernel::into_contiguous(x),
    };
    let (weighting, divide, weights) = match weights {
        RowWeights::None => (UNWEIGHTED, 1, x.clone()),
        RowWeights::ByOutput(w) => {
            assert_eq!(
                w.meta.shape().as_slice(),
                [m, c],
                "row_gather: weights [m, c]"
            );
            (WEIGHT_BY_OUTPUT, 1, w)
        }
        RowWeights::ByIndex(w) => {
            let divide = w.meta.shape().as_slice()[1];
            (WEIGHT_BY_INDEX, divide, w)
        }
    };
    assert_eq!(weights.dtype, x.dtype, "row_gather: weights in x's dtype");
    let client = x.client.clone();
    let output = empty_device_contiguous_dtype::<R>(
        client.clone(),
        x.device.clone(),
        Shape::new([m, hidden]),
        x.dtype,
    );
    if m * hidden == 0 {
        return output;
    }
    let width = vector_width(&[&x, &output]);
    let has_zero = zero.is_some();
    let zero = zero.unwrap_or_else(|| rows.clone());
    let dtypes = [x.dtype.into(), rows.dtype.into(), zero.dtype.into()];
    let cubes_x = m.min(65_535);
    row_gather_kernel::launch::<R>(
        &client,
        CubeCount::Static(cubes_x as u32, m.div_ceil(cubes_x) as u32, 1),
        CubeDim::new_1d(THREADS),
        width,
        x.into_tensor_arg(),
        rows.into_tensor_arg(),
        zero.into_tensor_arg(),
        weights.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        divide as u32,
        c,
        has_zero,
        weighting,
        dtypes,
    );
    output
}
