//! The decode step's attention kernel against its composition.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron::ops::decode_attention::decode_attention_composition;
use burn_megatron::ops::rope::rotation_table;
use burn_megatron::ops::{DecodeAttentionOps, DecodeIndices};
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, random};

/// One case: `[batch, groups, heads_per_group, head_dim, capacity, column]` and each row's
/// left padding.
struct Case {
    dims: [usize; 6],
    pads: &'static [i64],
}

/// A single element; a padding row that sees only the new column (pad = column); a row of
/// more than one 256-column tile; a head dimension that leaves threads of the value product
/// idle (96: two column subsets of 96 lanes); the last column of the cache.
const CASES: [Case; 4] = [
    Case {
        dims: [1, 1, 1, 2, 1, 0],
        pads: &[0],
    },
    Case {
        dims: [3, 2, 3, 16, 20, 11],
        pads: &[0, 4, 11],
    },
    Case {
        dims: [2, 2, 4, 64, 300, 290],
        pads: &[0, 7],
    },
    Case {
        dims: [2, 1, 2, 96, 40, 39],
        pads: &[1, 0],
    },
];

/// `DecodeAttentionOps::decode_attention` on a CubeCL backend (one kernel) against the
/// composition, f32 and f16, with and without RoPE: the context, and both caches whole (the
/// new column written, every other column as it was, including those past the new one,
/// which hold values the mask must hide). One row's position lies past the RoPE table and
/// takes its last row. A cache something else holds is left as it was.
#[test]
fn decode_attention_equals_the_composition() {
    let device = WgpuDevice::default();
    for case in CASES {
        let [batch, groups, per_group, head_dim, capacity, column] = case.dims;
        let slots = per_group + 2;
        let qkv_dims = [batch, 1, groups, slots, head_dim];
        let cache_dims = [batch, groups, capacity, head_dim];
        let int = |v: Vec<i64>| {
            let n = v.len();
            Tensor::<W, 1, Int>::from_data(TensorData::new(v, [n]), &device)
        };
        let table_rows = column + 1;
        // Each row's position is its column less its padding; the first row's lies past the
        // table.
        let positions: Vec<i64> = case
            .pads
            .iter()
            .enumerate()
            .map(|(b, &pad)| match b {
                0 => table_rows as i64 + 5,
                _ => column as i64 - pad,
            })
            .collect();
        let indices = DecodeIndices::<W> {
            column: int(vec![column as i64]),
            pads: int(case.pads.to_vec()),
            positions: int(positions),
        };
        let table = rotation_table(table_rows, head_dim, 10_000.0).map(|half| {
            let half = Tensor::<W, 2>::from_data(
                TensorData::new(half, [table_rows, head_dim / 2]),
                &device,
            );
            Tensor::cat(vec![half.clone(), half], 1)
        });
        for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
            let qkv = Tensor::<W, 5>::from_data(
                TensorData::new(random(qkv_dims.iter().product(), 7, 1.5), qkv_dims),
                &device,
            )
            .cast(dtype);
            let cache = |seed: u64| {
                let n = cache_dims.iter().product();
                Tensor::<W, 4>::from_data(
                    TensorData::new(random(n, seed, 1.5), cache_dims),
                    &device,
                )
                .cast(dtype)
            };
            let (keys, vals) = (cache(8), cache(9));
            for rope in [None, Some(table.clone())] {
                let what = format!("{:?} {dtype:?} rope={}", case.dims, rope.is_some());
                let wide = |t: Tensor<W, 4>| values(t.cast(DType::F32));
                let [want_context, want_keys, want_values] = decode_attention_composition(
                    qkv.clone().cast(DType::F32),
                    [keys.clone(), vals.clone()].map(|t| t.cast(DType::F32)),
                    indices.clone(),
                    rope.clone(),
                    0.3,
                );
                let (keys_before, values_before) = (wide(keys.clone()), wide(vals.clone()));
                // The caches are shared here (the clones above), so the kernel writes copies.
                let [context, new_keys, new_values] = W::decode_attention(
                    qkv.clone(),
                    [keys.clone(), vals.clone()],
                    indices.clone(),
                    rope.clone(),
                    0.3,
                );
                assert_eq!(context.dims(), [batch, 1, groups * per_group, head_dim]);
                assert_eq!(context.dtype(), dtype);
                assert_close(
                    &format!("{what}: context"),
                    &wide(context),
                    &values(want_context),
                    bound,
                );
                assert_close(
                    &format!("{what}: keys"),
                    &wide(new_keys),
                    &values(want_keys),
                    bound,
                );
                assert_close(
                    &format!("{what}: values"),
                    &wide(new_values),
                    &values(want_values),
                    bound,
                );
                assert_eq!(wide(keys.clone()), keys_before, "{what}: shared keys kept");
                assert_eq!(
                    wide(vals.clone()),
                    values_before,
                    "{what}: shared values kept"
                );
            }
        }
    }
}
