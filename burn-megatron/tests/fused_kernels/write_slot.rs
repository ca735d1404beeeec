//! `write_slot` and `add_slot`: a gradient cast into (or added to) its slot of the flat f32
//! buffer.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::WriteSlotOps;
use burn_megatron_testing::values_f32;

use crate::helpers::{W, matrix, random, vector};

/// `WriteSlotOps::write_slot` (a gradient cast into its slot of the flat f32 buffer, one
/// kernel, in place) and `add_slot` (added to it) equal their compositions bit for bit, for f32 and f16
/// values, packed and strided, at slot starts that are and are not whole vectors; elements
/// outside the slot keep their values; and a buffer someone else still holds is not written
/// through (the holder's copy is unchanged).
#[test]
fn write_slot_equals_the_composition_and_leaves_shared_buffers_alone() {
    use burn_megatron::ops::write_slot::{add_slot_composition, write_slot_composition};
    let device = WgpuDevice::default();
    let numel = 64;
    let fresh =
        || Tensor::<W, 1>::from_data(TensorData::new(random(numel, 91, 1.0), [numel]), &device);
    for dtype in [DType::F32, DType::F16] {
        for (start, n, strided) in [
            (0, 16, false),
            (8, 24, false),
            (3, 7, false),
            (12, 10, true),
        ] {
            let name = format!("{dtype:?} {start}..{} strided {strided}", start + n);
            let values = if strided {
                matrix(n, 2, 92, 3.0, &device)
                    .cast(dtype)
                    .narrow(1, 0, 1)
                    .reshape([n])
            } else {
                vector(n, 92, 0.0, &device).cast(dtype)
            };
            let want = values_f32(write_slot_composition(fresh(), start, values.clone()));
            let got = values_f32(W::write_slot(fresh(), start, values.clone()));
            assert_eq!(got, want, "{name}");

            let buffer = fresh();
            let held = buffer.clone();
            let before = values_f32(held.clone());
            let got = values_f32(W::write_slot(buffer, start, values.clone()));
            assert_eq!(got, want, "{name}: shared buffer");
            assert_eq!(
                values_f32(held),
                before,
                "{name}: written through a shared buffer"
            );

            // Added to the slot: the sum in f32, elements outside the slot unchanged.
            let want = values_f32(add_slot_composition(fresh(), start, values.clone()));
            let got = values_f32(W::add_slot(fresh(), start, values.clone()));
            assert_eq!(got, want, "{name}: add");
            let outside = values_f32(fresh());
            for (i, (g, o)) in got.iter().zip(&outside).enumerate() {
                if !(start..start + n).contains(&i) {
                    assert_eq!(g.to_bits(), o.to_bits(), "{name}: add wrote element {i}");
                }
            }
            let buffer = fresh();
            let held = buffer.clone();
            let got = values_f32(W::add_slot(buffer, start, values));
            assert_eq!(got, want, "{name}: add, shared buffer");
            assert_eq!(
                values_f32(held),
                before,
                "{name}: added through a shared buffer"
            );
        }
    }
}
