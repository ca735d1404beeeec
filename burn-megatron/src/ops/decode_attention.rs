//! One decode step's attention as one operation: RoPE on the new token's query and key at
//! each row's position, the key and value written to the KV cache's column, and each query
//! head's `softmax(q kᵀ / sqrt(d)) v` over its group's cached keys, masked to the row's
//! columns (from its left padding to the new column).
//!
//! The composition is the unfused step's, some sixteen Burn operations a layer
//! ([`Rotation`], a `select_assign` into each cache, [`grouped_attention`] under the mask of
//! [`decode_mask`]); on CubeCL backends it is one kernel
//! (`burn_megatron_kernels::fused::decode_attention`), which is what lets a captured decode
//! step of a small model run at the GPU's pace rather than its launches'. Inference only: no
//! autodiff node (under `Autodiff<B>` the composition runs).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

use crate::ops::SoftmaxOps;

/// The device-resident indices of a decode step (one int dtype).
///
/// # Shapes
/// - column: `[1]`, the cache column the new token is written to, the same for every row
/// - pads: `[batch]`, each row's left padding: the columns before it are masked
/// - positions: `[batch]`, each row's position (RoPE's angle)
#[derive(Debug, Clone)]
pub struct DecodeIndices<B: Backend> {
    pub column: Tensor<B, 1, Int>,
    pub pads: Tensor<B, 1, Int>,
    pub positions: Tensor<B, 1, Int>,
}

/// A decode step's attention.
pub trait DecodeAttentionOps: SoftmaxOps {
    /// The attention of one new token a row, from `qkv`, its packed projection: returns the
    /// context and the key and value caches with the token's key and value written at
    /// `indices.column` (in place where the backend can and nothing else holds a cache).
    /// `rope`: RoPE's cosines and sines (`[rows, head_dim]` each, f32, both halves of a row
    /// equal: see [`KvCache`](crate::inference::KvCache)), `None` without RoPE; positions past
    /// the table's last row take its last row. Row `b` sees the cache's columns
    /// `pads[b]..=column`. CubeCL backends run one kernel (f64 and head dimensions above 256:
    /// the composition).
    ///
    /// # Shapes
    /// - qkv: `[batch, 1, groups, heads_per_group + 2, head_dim]`
    /// - cache: keys and values, `[batch, groups, capacity, head_dim]` each
    /// - output: the context `[batch, 1, groups · heads_per_group, head_dim]`, then the caches
    fn decode_attention(
        qkv: Tensor<Self, 5>,
        cache: [Tensor<Self, 4>; 2],
        indices: DecodeIndices<Self>,
        rope: Option<[Tensor<Self, 2>; 2]>,
        scale: f64,
    ) -> [Tensor<Self, 4>; 3] {
        decode_attention_composition(qkv, cache, indices, rope, scale)
    }
}

/// [`DecodeAttentionOps::decode_attention`] as Burn operations.
pub fn decode_attention_composition<B: SoftmaxOps>(
    qkv: Tensor<B, 5>,
    [keys, values]: [Tensor<B, 4>; 2],
    indices: DecodeIndices<B>,
    rope: Option<[Tensor<B, 2>; 2]>,
    scale: f64,
) -> [Tensor<B, 4>; 3] {
    let [batch, _, groups, slots, head_dim] = qkv.dims();
    let per_group = slots - 2;
    let capacity = keys.dims()[2];
    let heads = qkv.clone().narrow(3, 0, per_group + 1);
    let value = qkv.narrow(3, per_group + 1, 1);
    let heads = match rope {
        Some(table) => {
            let rows = table[0].dims()[0] as i64;
            let positions = indices.positions.clone().clamp(0, rows - 1);
            Rotation::at(table, positions, [batch, 1], heads.dtype()).apply(heads)
        }
        None => heads,
    };
    let [key, value] = [heads.clone().narrow(3, per_group, 1), value]
        .map(|t| t.reshape([batch, 1, groups, head_dim]).swap_dims(1, 2));
    // The column replaced, whatever it held.
    let device = key.device();
    let at = Tensor::<B, 1, Int>::arange(0..capacity as i64, &device)
        .reshape([1, 1, capacity, 1])
        .equal(
            indices
                .column
                .clone()
                .reshape([1, 1, 1, 1])
                .expand([1, 1, capacity, 1]),
        )
        .expand([batch, groups, capacity, head_dim]);
    let write = |cache: Tensor<B, 4>, new: Tensor<B, 4>| {
        cache.mask_where(at.clone(), new.expand([batch, groups, capacity, head_dim]))
    };
    let (keys, values) = (write(keys, key), write(values, value));
    let mask = decode_mask(&indices, capacity);
    let context = grouped_attention(
        heads.narrow(3, 0, per_group),
        keys.clone(),
        values.clone(),
        grouped_mask(mask, groups, per_group),
        scale,
    );
    [context, keys, values]
}

/// The columns a decode step must not attend to (`true`: masked): those past `column` (not
/// written yet) and each row's left padding, except the new column itself.
///
/// # Shapes
/// - output: `[batch, 1, 1, capacity]`
pub fn decode_mask<B: Backend>(indices: &DecodeIndices<B>, capacity: usize) -> Tensor<B, 4, Bool> {
    let batch = indices.pads.dims()[0];
    let device = indices.pads.device();
    let columns = Tensor::<B, 1, Int>::arange(0..capacity as i64, &device)
        .reshape([1, capacity])
        .expand([batch, capacity]);
    let current = indices
        .column
        .clone()
        .reshape([1, 1])
        .expand([batch, capacity]);
    let pads = indices
        .pads
        .clone()
        .reshape([batch, 1])
        .expand([batch, capacity]);
    let future = columns.clone().greater(current.clone());
    let padding = columns
        .clone()
        .lower(pads)
        .bool_and(columns.not_equal(current));
    future.bool_or(padding).reshape([batch, 1, 1, capacity])
}

/// The cosines and sines of the new columns' positions, `[batch, new, 1, 1, head_dim]` each
/// (the "rotate half" layout of [`crate::ops::rope`]), gathered on the device from a table
/// by a tensor of positions and cast to the activations' dtype once a step; the sines' first
/// half negated, so that a rotation is `x · cos + swap_halves(x) · sin` (the same products
/// as `x · cos + rotate_half(x) · sin`).
pub struct Rotation<B: Backend> {
    cos: Tensor<B, 5>,
    signed_sin: Tensor<B, 5>,
}

impl<B: Backend> Rotation<B> {
    /// The rotation at the positions of a device tensor `ids` (`batch · new` values,
    /// row-major, each a row of the tables).
    ///
    /// # Shapes
    /// - table: `[rows, head_dim]` each (both halves of a row equal)
    pub fn at(
        [cos, sin]: [Tensor<B, 2>; 2],
        ids: Tensor<B, 1, Int>,
        [batch, new]: [usize; 2],
        dtype: DType,
    ) -> Self {
        let head_dim = cos.dims()[1];
        let half = head_dim / 2;
        let rows = |table: Tensor<B, 2>| {
            table
                .select(0, ids.clone())
                .cast(dtype)
                .reshape([batch, new, 1, 1, head_dim])
        };
        let sin = rows(sin);
        let signed_sin = Tensor::cat(
            vec![
                sin.clone().narrow(4, 0, half).neg(),
                sin.narrow(4, half, half),
            ],
            4,
        );
        Self {
            cos: rows(cos),
            signed_sin,
        }
    }

    /// Query and key `heads` (`[batch, new, groups, slots, head_dim]`) rotated, as
    /// [`RopeOps::packed_rope`](crate::ops::RopeOps::packed_rope) rotates them at positions
    /// `0..seq`.
    pub fn apply(&self, heads: Tensor<B, 5>) -> Tensor<B, 5> {
        let half = heads.dims()[4] / 2;
        let swapped = Tensor::cat(
            vec![
                heads.clone().narrow(4, half, half),
                heads.clone().narrow(4, 0, half),
            ],
            4,
        );
        heads * self.cos.clone() + swapped * self.signed_sin.clone()
    }
}

/// `softmax(scale · q kᵀ + mask) v` of the new columns' query heads against their group's
/// cached key/value head, without copying K and V per query head: a group's query heads are
/// rows of one matrix (`[new · heads_per_group, head_dim]`) against the group's keys. The
/// scores are the product's, masked, and the softmax ([`SoftmaxOps::masked_softmax`]: one
/// kernel on CubeCL backends) scales them and keeps f32 statistics.
///
/// # Shapes
/// - queries: `[batch, new, groups, heads_per_group, head_dim]` (rotated)
/// - keys, values: `[batch, groups, total, head_dim]`
/// - mask: `[batch, groups, new · heads_per_group, total]` (see [`grouped_mask`])
/// - output: `[batch, new, heads, head_dim]`, heads group by group
pub fn grouped_attention<B: SoftmaxOps>(
    queries: Tensor<B, 5>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    scale: f64,
) -> Tensor<B, 4> {
    let [batch, new, groups, per_group, head_dim] = queries.dims();
    let rows = new * per_group;
    let q = queries
        .swap_dims(1, 2)
        .reshape([batch, groups, rows, head_dim]);
    let scores = q
        .matmul(keys.swap_dims(2, 3))
        .mask_fill(mask, f32::NEG_INFINITY);
    B::masked_softmax(scores, None, scale, false)
        .matmul(values)
        .reshape([batch, groups, new, per_group, head_dim])
        .swap_dims(1, 2)
        .reshape([batch, new, groups * per_group, head_dim])
}

/// A mask of `[batch, 1, new, total]` (`true`: masked) laid out for [`grouped_attention`]'s
/// rows (token-major, then the group's query heads).
///
/// # Shapes
/// - mask: `[batch, 1, new, total]`
/// - output: `[batch, groups, new · heads_per_group, total]`
pub fn grouped_mask<B: Backend>(
    mask: Tensor<B, 4, Bool>,
    groups: usize,
    per_group: usize,
) -> Tensor<B, 4, Bool> {
    let [batch, _, new, total] = mask.dims();
    mask.reshape([batch, 1, new, 1, total])
        .expand([batch, groups, new, per_group, total])
        .reshape([batch, groups, new * per_group, total])
}

/// The composition on the autodiff backend (generation records no gradient).
impl<B: DecodeAttentionOps, C: CheckpointStrategy> DecodeAttentionOps for Autodiff<B, C> {}

/// CubeCL backends: one kernel (f64 and head dimensions above 256: the composition).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::decode_attention as kernels;

    use super::{DecodeAttentionOps, DecodeIndices, decode_attention_composition};
    use crate::ops::primitive::{raw, wrap};

    impl<R, F, I, BT> DecodeAttentionOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn decode_attention(
            qkv: Tensor<Self, 5>,
            cache: [Tensor<Self, 4>; 2],
            indices: DecodeIndices<Self>,
            rope: Option<[Tensor<Self, 2>; 2]>,
            scale: f64,
        ) -> [Tensor<Self, 4>; 3] {
            let [_, _, groups, slots, head_dim] = qkv.dims();
            if qkv.dtype() == DType::F64 || head_dim > kernels::MAX_HEAD_DIM || head_dim % 2 == 1 {
                return decode_attention_composition(qkv, cache, indices, rope, scale);
            }
            let layout = kernels::DecodeLayout {
                groups,
                heads_per_group: slots - 2,
                head_dim,
            };
            let DecodeIndices {
                column,
                pads,
                positions,
            } = indices;
            let indices = kernels::DecodeIndices {
                column: column.into_primitive(),
                pads: pads.into_primitive(),
                positions: positions.into_primitive(),
            };
            kernels::attend(
                raw(qkv),
                cache.map(raw),
                indices,
                rope.map(|table| table.map(raw)),
                layout,
                scale,
            )
            .map(wrap)
        }
    }
}
