//! Two attention results over disjoint sets of keys merged by their log-sum-exps, in one
//! kernel: how ring attention (context parallelism) combines its block pairs. Burn's
//! composition takes about twelve kernels (a cast, the maximum, two exponentials, the sum, the
//! log, two divisions, two products and a sum), each a pass over the output.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::{THREADS, launch_shape, vector_width};

/// One vector of the merged output a thread; the thread holding a row's first vector writes
/// the row's log-sum-exp. `W` is the wide dtype of the merge (f32, or f64). The partial
/// outputs are read through their strides (the fused attention writes them sequence-major),
/// the merged one written contiguous.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn merge_kernel<A: Float, B: Float, W: Float, N: Size>(
    out_a: &Tensor<Vector<A, N>>,
    lse_a: &Tensor<W>,
    out_b: &Tensor<Vector<B, N>>,
    lse_b: &Tensor<W>,
    out: &mut Tensor<Vector<W, N>>,
    lse: &mut Tensor<W>,
    heads: u32,
    len: u32,
    rows: u32,
    vectors_per_row: u32,
    #[define(A, B, W)] _dtypes: [StorageType; 3],
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if i >= rows * vectors_per_row {
        terminate!();
    }
    let row = i / vectors_per_row;
    let vector_in_row = (i % vectors_per_row) as usize;
    // Row `row` is (batch, head, token) of `[batch, heads, len, head_dim]`.
    let token = (row % len) as usize;
    let head = ((row / len) % heads) as usize;
    let batch = (row / len / heads) as usize;
    let width = N::value();
    let a_at = (batch * out_a.stride(0) + head * out_a.stride(1) + token * out_a.stride(2)) / width
        + vector_in_row;
    let b_at = (batch * out_b.stride(0) + head * out_b.stride(1) + token * out_b.stride(2)) / width
        + vector_in_row;
    let row = row as usize;
    let (la, lb) = (lse_a[row], lse_b[row]);
    // The composition's operations in its order: the larger log-sum-exp subtracted, so that
    // both exponentials are at most 1.
    let max = W::max(la, lb);
    let weight_a = W::exp(la - max);
    let weight_b = W::exp(lb - max);
    let sum = weight_a + weight_b;
    let (wa, wb) = (weight_a / sum, weight_b / sum);
    let a = Vector::<W, N>::cast_from(out_a[a_at]);
    let b = Vector::<W, N>::cast_from(out_b[b_at]);
    out[i as usize] = a * Vector::new(wa) + b * Vector::new(wb);
    if vector_in_row == 0 {
        lse[row] = max + W::ln(sum);
    }
}

/// `(out, lse)` of attention over the union of two disjoint key sets from each set's result:
/// `lse = log(exp(lse_a) + exp(lse_b))` and `out = exp(lse_a - lse) · out_a + exp(lse_b -
/// lse) · out_b`, computed as Burn's composition does (the larger log-sum-exp subtracted
/// first). `out_a`, `out_b`: `[batch, heads, len, head_dim]` in any float dtypes and any
/// strides with contiguous rows (read where they lie); `lse_a`, `lse_b`: `[batch, heads, len]`
/// in `wide` (f32 or f64), the dtype of both results (contiguous).
pub fn lse_merge<R: CubeRuntime>(
    (out_a, lse_a): (CubeTensor<R>, CubeTensor<R>),
    (out_b, lse_b): (CubeTensor<R>, CubeTensor<R>),
    wide: DType,
) -> (CubeTensor<R>, CubeTensor<R>) {
    // Rows contiguous, else a copy; the log-sum-exps contiguous.
    let rows_contiguous = |t: CubeTensor<R>| match t.meta.strides().last() {
        Some(1) => t,
        _ => into_contiguous(t),
    };
    let [out_a, out_b] = [out_a, out_b].map(rows_contiguous);
    let [lse_a, lse_b] = [lse_a, lse_b].map(into_contiguous);
    let dims = out_a.meta.shape().as_slice().to_vec();
    assert_eq!(
        dims.len(),
        4,
        "merged outputs are [batch, heads, len, head_dim]"
    );
    assert_eq!(
        out_a.meta.shape(),
        out_b.meta.shape(),
        "merged outputs have one shape"
    );
    assert_eq!(
        lse_a.meta.shape().as_slice(),
        &dims[..3],
        "a log-sum-exp a row of the output"
    );
    assert_eq!(
        lse_a.meta.shape(),
        lse_b.meta.shape(),
        "merged log-sum-exps have one shape"
    );
    assert!(
        lse_a.dtype == wide && lse_b.dtype == wide,
        "the log-sum-exps are in the merge's dtype"
    );
    let (heads, len, head_dim) = (dims[1], dims[2], dims[3]);
    let rows = dims[0] * heads * len;
    let (client, device) = (out_a.client.clone(), out_a.device.clone());
    let out =
        empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), Shape::from(dims), wide);
    let lse = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device,
        lse_a.meta.shape().clone(),
        wide,
    );
    if rows * head_dim == 0 {
        return (out, lse);
    }
    // A vector never crosses a row, and every stride is a whole number of vectors
    // (`vector_width` checks the last dimension and the other strides of each tensor).
    let width = vector_width(&[&out, &out_a, &out_b]);
    let vectors_per_row = head_dim / width;
    let dtypes = [out_a.dtype.into(), out_b.dtype.into(), wide.into()];
    // SAFETY: every thread past `rows * vectors_per_row` ends before touching memory; the
    // rest read rows of `[batch, heads, len]` through the inputs' own strides and write
    // inside the contiguous outputs.
    unsafe {
        merge_kernel::launch_unchecked::<R>(
            &client,
            launch_shape(rows * vectors_per_row),
            CubeDim::new_1d(THREADS),
            width,
            out_a.into_tensor_arg(),
            lse_a.into_tensor_arg(),
            out_b.into_tensor_arg(),
            lse_b.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            heads as u32,
            len as u32,
            rows as u32,
            vectors_per_row as u32,
            dtypes,
        )
    };
    (out, lse)
}
