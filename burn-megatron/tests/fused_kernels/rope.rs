//! The RoPE kernel against the composition, in place, and its backward.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::RopeOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, random, raw, wrap};

/// The RoPE kernel (`RopeOps::packed_rope` and its backward on a CubeCL backend) against
/// the composition, in f32 and f16, for packed layouts with one and several query heads per
/// group, odd sequence lengths and head dims whose halves are and are not whole vectors; every
/// element of a poisoned output is written; value heads are copied bit for bit; a tensor
/// nothing else holds is rotated in place with the same bits and its value heads untouched,
/// and a shared one is left as it was; and the backward undoes the forward (the rotation is
/// orthogonal).
#[test]
fn rope_equals_the_composition_and_its_backward_undoes_it() {
    use burn_megatron::ops::rope::{packed_rope_composition, rotation_table};
    use burn_megatron_kernels::fused::rope as kernel;
    let device = WgpuDevice::default();
    // [batch, seq, groups, heads_per_group + 2, head_dim]
    let shapes = [
        [1, 1, 1, 3, 2],
        [2, 7, 3, 3, 6],
        [1, 33, 2, 4, 64],
        [2, 5, 1, 10, 16],
    ];
    for dims in shapes {
        let [batch, seq, groups, slots, head_dim] = dims;
        let n = dims.iter().product();
        for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
            let name = format!("{dims:?} {dtype:?}");
            let qkv =
                Tensor::<W, 5>::from_data(TensorData::new(random(n, 101, 2.0), dims), &device)
                    .cast(dtype);
            let f32_of = |t: Tensor<W, 5>| t.cast(DType::F32);
            let input = values(f32_of(qkv.clone()));
            for inverse in [false, true] {
                let want = packed_rope_composition(f32_of(qkv.clone()), 10_000.0, inverse);
                let got = if inverse {
                    W::packed_rope_backward(qkv.clone(), 10_000.0)
                } else {
                    W::packed_rope(qkv.clone(), 10_000.0)
                };
                assert_eq!(got.dtype(), dtype);
                let what = format!("{name} inverse={inverse}");
                assert_close(
                    &what,
                    &values(f32_of(got.clone())),
                    &values(want.clone()),
                    bound,
                );
                let values_of = |t: Tensor<W, 5>| values(t.narrow(3, slots - 1, 1));
                assert_eq!(
                    values_of(got.clone()),
                    values_of(qkv.clone()),
                    "{what}: value heads"
                );
                // `qkv` is shared (cloned above), so it was not rotated in place.
                assert_eq!(values(f32_of(qkv.clone())), input, "{what}: input kept");

                // A tensor nothing else holds is rotated in place: query and key rows as
                // above, bit for bit, and value rows left as they were.
                let unique = Tensor::<W, 5>::from_data(qkv.to_data(), (&device, dtype));
                let in_place = if inverse {
                    W::packed_rope_backward(unique, 10_000.0)
                } else {
                    W::packed_rope(unique, 10_000.0)
                };
                assert_eq!(
                    values(f32_of(in_place)),
                    values(f32_of(got.clone())),
                    "{what}: in place"
                );

                let rows = batch * seq * groups * slots;
                let output = Tensor::<W, 2>::full([rows, head_dim], f32::NAN, &device).cast(dtype);
                let table = rotation_table(seq, head_dim, 10_000.0).map(|values| {
                    raw(Tensor::<W, 2>::from_data(
                        TensorData::new(values, [seq, head_dim / 2]),
                        (&device, DType::F32),
                    ))
                });
                kernel::rotate_into(
                    raw(qkv.clone().reshape([rows, head_dim])),
                    table.clone(),
                    kernel::PackedRows { seq, groups, slots },
                    inverse,
                    raw(output.clone()),
                );
                // The in-place kernel itself, called on a buffer that is also held elsewhere.
                let target = Tensor::<W, 2>::from_data(
                    qkv.clone().reshape([rows, head_dim]).to_data(),
                    (&device, dtype),
                );
                let rotated: Tensor<W, 2> = wrap(kernel::rotate_in_place(
                    raw(target.clone()),
                    table,
                    kernel::PackedRows { seq, groups, slots },
                    inverse,
                ));
                assert_eq!(
                    values(f32_of(target.reshape(dims))),
                    values(f32_of(got.clone())),
                    "{what}: rotate_in_place writes over its argument"
                );
                drop(rotated);
                assert_close(
                    &format!("{what} (into a poisoned buffer)"),
                    &values(output.cast(DType::F32)),
                    &values(want),
                    bound,
                );
            }
            let there_and_back = W::packed_rope_backward(W::packed_rope(qkv.clone(), 500.0), 500.0);
            assert_close(
                &format!("{name}: backward ∘ forward"),
                &values(f32_of(there_and_back)),
                &values(f32_of(qkv)),
                bound * 4.0,
            );
        }
    }
}

/// The kernel at given positions (`RopeOps::packed_rope_at`, context parallelism's two
/// chunks of the sequence) against the composition at them, in f32 and f16, forward and
/// backward, at the first call (which builds the table of these positions) and at a later one.
#[test]
fn rope_at_positions_equals_the_composition() {
    use burn_megatron::ops::rope::packed_rope_at_composition;
    let device = WgpuDevice::default();
    // [batch, seq, groups, heads_per_group + 2, head_dim], and rank 1 of CP 2's positions.
    let dims = [2, 6, 2, 4, 16];
    let positions = [3, 4, 5, 6, 7, 8];
    let n = dims.iter().product();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        let qkv = Tensor::<W, 5>::from_data(TensorData::new(random(n, 7, 2.0), dims), &device)
            .cast(dtype);
        let f32_of = |t: Tensor<W, 5>| t.cast(DType::F32);
        for inverse in [false, true] {
            let want =
                packed_rope_at_composition(f32_of(qkv.clone()), &positions, 500_000.0, inverse);
            for call in 0..2 {
                let got = match inverse {
                    true => W::packed_rope_at_backward(qkv.clone(), &positions, 500_000.0),
                    false => W::packed_rope_at(qkv.clone(), &positions, 500_000.0),
                };
                assert_eq!(got.dtype(), dtype);
                assert_close(
                    &format!("{dtype:?} inverse={inverse} call {call}"),
                    &values(f32_of(got)),
                    &values(want.clone()),
                    bound,
                );
            }
        }
    }
}
