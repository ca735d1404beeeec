//! Rotary position embeddings on the packed QKV projection, one kernel each way.
//!
//! The input is `qkv` viewed as `[rows, head_dim]`, a row per (token, group, slot) of Megatron's
//! packed layout `[batch, seq, groups, heads_per_group + 2, head_dim]`: per group its query
//! heads, its key head, its value head. Query and key rows are rotated (the "rotate half"
//! pairs `(i, i + head_dim / 2)` of GPT-NeoX and Llama, by the angle of the token's position
//! `p` and the pair `i`), value rows are copied, so the result is again the packed layout
//! that attention reads. Where nothing else holds `qkv`'s buffer the query and key rows are
//! rotated in place and the value rows are not touched at all. The cosines and sines come
//! from `[seq, head_dim / 2]` f32 tables (computed once by the caller, as Megatron caches
//! them): computing them in the kernel costs precise `sin`/`cos` of arguments up to `seq`
//! radians for every pair of every head.
//! The rotation is orthogonal: the backward is the rotation by `-angle` of the output's
//! gradient, the same kernel with the sine's sign flipped. The math is f32 for every storage
//! dtype.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::vectors::{
    THREADS, empty_like, launch_shape, rows_cols, vector_offset, vector_position, vector_width,
};

/// The packed layout of the rows: `slots = heads_per_group + 2` rows a group, `groups` groups a
/// token, `seq` tokens a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedRows {
    /// Tokens in a sequence (positions `0..seq`).
    pub seq: usize,
    /// Query groups.
    pub groups: usize,
    /// Rows of one group: its query heads, its key head, its value head.
    pub slots: usize,
}

/// The pair `(lo, hi)` rotated by the angle at `entry` of the tables (by its negative when
/// `sign` is -1): `(lo · cos - hi · sin, hi · cos + lo · sin)`, in f32.
#[cube]
fn rotate_pair<N: Size>(
    lo: Vector<f32, N>,
    hi: Vector<f32, N>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    entry: usize,
    sign: f32,
) -> (Vector<f32, N>, Vector<f32, N>) {
    let c = cos[entry];
    let s = sin[entry] * Vector::new(sign);
    (lo * c - hi * s, hi * c + lo * s)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: u32,
    vectors_per_half: u32,
    seq: u32,
    groups: u32,
    slots: u32,
    sign: f32,
    #[define(F)] _dtype: StorageType,
) {
    let (row, vector) = vector_position(rows, vectors_per_half);
    let r = row as u32;
    let slot = r % slots;
    let position = ((r / (slots * groups)) % seq) as usize;
    let half = vectors_per_half as usize;
    let lo_in = vector_offset::<F, N>(input, row, vector);
    let hi_in = vector_offset::<F, N>(input, row, vector + half);
    let lo_out = vector_offset::<F, N>(output, row, vector);
    let hi_out = vector_offset::<F, N>(output, row, vector + half);
    if slot == slots - 1 {
        // The value head.
        output[lo_out] = input[lo_in];
        output[hi_out] = input[hi_in];
    } else {
        let lo = Vector::<f32, N>::cast_from(input[lo_in]);
        let hi = Vector::<f32, N>::cast_from(input[hi_in]);
        let (lo, hi) = rotate_pair::<N>(lo, hi, cos, sin, position * half + vector, sign);
        output[lo_out] = Vector::cast_from(lo);
        output[hi_out] = Vector::cast_from(hi);
    }
}

/// The rotation of the query and key rows only, written over them: value rows are neither
/// read nor written. `rotated` query/key rows are launched; the `i`-th is row
/// `(i / (slots - 1)) · slots + i % (slots - 1)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rope_in_place_kernel<F: Float, N: Size>(
    qkv: &mut Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    rotated: u32,
    vectors_per_half: u32,
    seq: u32,
    groups: u32,
    slots: u32,
    sign: f32,
    #[define(F)] _dtype: StorageType,
) {
    let (index, vector) = vector_position(rotated, vectors_per_half);
    let i = index as u32;
    let heads = slots - 1;
    let r = (i / heads) * slots + i % heads;
    let row = r as usize;
    let position = ((r / (slots * groups)) % seq) as usize;
    let half = vectors_per_half as usize;
    let lo_at = vector_offset::<F, N>(qkv, row, vector);
    let hi_at = vector_offset::<F, N>(qkv, row, vector + half);
    let lo = Vector::<f32, N>::cast_from(qkv[lo_at]);
    let hi = Vector::<f32, N>::cast_from(qkv[hi_at]);
    let (lo, hi) = rotate_pair::<N>(lo, hi, cos, sin, position * half + vector, sign);
    qkv[lo_at] = Vector::cast_from(lo);
    qkv[hi_at] = Vector::cast_from(hi);
}

/// `qkv` (`[rows, head_dim]`, any strides, laid out as `layout`) with its query and key rows
/// rotated by the angles whose cosines and sines are `table` (`[seq, head_dim / 2]` each, f32,
/// contiguous), or by their negatives when `inverse` (the backward); value rows unchanged. The
/// output has `qkv`'s shape and dtype.
///
/// When nothing else holds `qkv`'s buffer (the usual case: the QKV projection's fresh output,
/// or its gradient) the query and key rows are rotated in place ([`rotate_in_place`]) and the
/// value rows are not touched, as torch rotates `q` and `k` only; otherwise the result is a
/// new tensor and the value rows are copied into it.
pub fn rotate<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    table: [CubeTensor<R>; 2],
    layout: PackedRows,
    inverse: bool,
) -> CubeTensor<R> {
    if qkv.can_mut() && qkv.is_nonoverlapping() {
        return rotate_in_place(qkv, table, layout, inverse);
    }
    let output = empty_like(&qkv);
    rotate_into(qkv, table, layout, inverse, output.clone());
    output
}

/// [`rotate`] written over `qkv`'s query and key rows, whatever else holds its buffer (the
/// caller makes sure nothing does, or wants it changed). Value rows are left as they are.
pub fn rotate_in_place<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    table: [CubeTensor<R>; 2],
    layout: PackedRows,
    inverse: bool,
) -> CubeTensor<R> {
    let (rows, half) = check(&qkv, &table, layout);
    if rows * half == 0 {
        return qkv;
    }
    let PackedRows { seq, groups, slots } = layout;
    let rotated = rows / slots * (slots - 1);
    let [cos, sin] = table;
    let mut width = vector_width(&[&qkv]);
    while !half.is_multiple_of(width) {
        width /= 2;
    }
    let dtype = qkv.dtype.into();
    rope_in_place_kernel::launch::<R>(
        &qkv.client.clone(),
        launch_shape(rotated * half / width),
        CubeDim::new_1d(THREADS),
        width,
        qkv.clone().into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        rotated as u32,
        (half / width) as u32,
        seq as u32,
        groups as u32,
        slots as u32,
        if inverse { -1.0 } else { 1.0 },
        dtype,
    );
    qkv
}

/// Checks `qkv`'s layout and the table's shape: `(rows, head_dim / 2)`.
fn check<R: CubeRuntime>(
    qkv: &CubeTensor<R>,
    table: &[CubeTensor<R>; 2],
    layout: PackedRows,
) -> (usize, usize) {
    let (rows, head_dim) = rows_cols(qkv.meta.shape(), "RoPE");
    let PackedRows { seq, groups, slots } = layout;
    assert!(
        head_dim.is_multiple_of(2),
        "RoPE needs an even head dimension, got {head_dim}"
    );
    assert!(
        slots >= 2 && seq * groups * slots > 0 && rows.is_multiple_of(seq * groups * slots),
        "RoPE: {rows} rows are not sequences of {seq} tokens × {groups} groups × {slots} slots"
    );
    let half = head_dim / 2;
    for t in table {
        assert_eq!(
            t.meta.shape().as_slice(),
            [seq, half],
            "RoPE: a [seq, head_dim / 2] table of cosines and of sines"
        );
        assert_eq!(t.dtype, DType::F32, "RoPE: f32 tables");
    }
    (rows, half)
}

/// [`rotate`] written into `output` (`qkv`'s shape and dtype, any strides): tests pass a
/// poisoned buffer to catch elements the kernel does not write.
pub fn rotate_into<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    table: [CubeTensor<R>; 2],
    layout: PackedRows,
    inverse: bool,
    output: CubeTensor<R>,
) {
    let (rows, half) = check(&qkv, &table, layout);
    if rows * half == 0 {
        return;
    }
    let PackedRows { seq, groups, slots } = layout;
    let [cos, sin] = table;
    let mut width = vector_width(&[&qkv, &output]);
    while !half.is_multiple_of(width) {
        width /= 2;
    }
    let dtype = qkv.dtype.into();
    rope_kernel::launch::<R>(
        &qkv.client.clone(),
        launch_shape(rows * half / width),
        CubeDim::new_1d(THREADS),
        width,
        qkv.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        output.into_tensor_arg(),
        rows as u32,
        (half / width) as u32,
        seq as u32,
        groups as u32,
        slots as u32,
        if inverse { -1.0 } else { 1.0 },
        dtype,
    );
}
