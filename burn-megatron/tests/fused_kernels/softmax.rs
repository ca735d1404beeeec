//! The causal and the padded (masked) softmax kernels against their compositions.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use burn_megatron::ops::SoftmaxOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, poisoned, random_4d, raw4};

/// `[batch, heads, seq, seq]` shapes: a single element, ragged sizes, a row longer than the
/// 256-thread block.
/// Rows of one key to more than a 32-thread group holds at 32 elements a thread (1 030 keys,
/// read two at a time), and row counts that leave rows of the last cube idle.
const SOFTMAX_SHAPES: [[usize; 4]; 5] = [
    [1, 1, 1, 1],
    [2, 3, 5, 5],
    [1, 2, 37, 37],
    [2, 1, 300, 300],
    [1, 1, 1030, 1030],
];

#[test]
fn causal_softmax_equals_the_composition_and_writes_every_element() {
    use burn_megatron::ops::causal_softmax::{backward_composition, forward_composition};
    use burn_megatron_kernels::fused::causal_softmax as softmax;
    let device = WgpuDevice::default();
    let scale = 0.125;
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for shape in SOFTMAX_SHAPES {
            let label = |what: &str| format!("{dtype:?} {shape:?} {what}");
            let scores = random_4d(shape, 11, 30.0, dtype, &device);
            let want = forward_composition(scores.clone(), scale);
            let got = poisoned(shape, dtype, &device);
            softmax::forward_into(raw4(scores.clone()), scale, raw4(got.clone()));
            assert_eq!(got.dtype(), dtype);
            assert_close(
                &label("probabilities"),
                &values(got),
                &values(want.clone()),
                bound,
            );
            // Both kernel sets: rows in registers (the default) and streamed.
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let got = poisoned(shape, dtype, &device);
                softmax::masked_forward_into_with(
                    raw4(scores.clone()),
                    None,
                    scale,
                    true,
                    raw4(got.clone()),
                    kernels,
                );
                assert_close(
                    &label(&format!("probabilities, {kernels:?}")),
                    &values(got),
                    &values(want.clone()),
                    bound,
                );
            }
            // With a fresh output.
            let fresh = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(softmax::forward(
                raw4(scores),
                scale,
            )));
            assert_close(
                &label("fresh output"),
                &values(fresh),
                &values(want.clone()),
                bound,
            );

            let grad = random_4d(shape, 12, 1.0, dtype, &device);
            let want = backward_composition(want.clone(), grad.clone(), scale);
            let got = poisoned(shape, dtype, &device);
            let probs = forward_composition(random_4d(shape, 11, 30.0, dtype, &device), scale);
            softmax::backward_into(
                raw4(probs.clone()),
                raw4(grad.clone()),
                scale,
                raw4(got.clone()),
            );
            assert_close(
                &label("gradient"),
                &values(got),
                &values(want.clone()),
                bound,
            );
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let got = poisoned(shape, dtype, &device);
                softmax::masked_backward_into_with(
                    raw4(probs.clone()),
                    raw4(grad.clone()),
                    scale,
                    true,
                    raw4(got.clone()),
                    kernels,
                );
                assert_close(
                    &label(&format!("gradient, {kernels:?}")),
                    &values(got),
                    &values(want.clone()),
                    bound,
                );
            }
        }
    }
}

/// The padded softmax kernels (`SoftmaxOps::masked_softmax` and its backward on a CubeCL
/// backend) against the composition, f32 and f16, with and without the causal mask, for key
/// lengths of zero (a row with no visible key is zeros), within and beyond the row, rectangular
/// scores and rows longer than a cube's threads; every element of a poisoned output written.
#[test]
fn masked_softmax_equals_the_composition_and_writes_every_element() {
    use burn_megatron::ops::causal_softmax::{backward_composition, masked_forward_composition};
    use burn_megatron_kernels::fused::causal_softmax as softmax;
    let device = WgpuDevice::default();
    let cases: [([usize; 4], bool, Option<[i32; 3]>); 6] = [
        ([3, 2, 5, 5], true, Some([0, 3, 9])),
        ([3, 2, 5, 5], false, Some([5, 1, 0])),
        ([3, 1, 4, 700], false, Some([700, 333, 1])),
        ([3, 2, 37, 37], true, Some([37, 20, 2])),
        ([3, 2, 6, 9], false, None),
        ([3, 1, 1, 1], false, Some([1, 0, 1])),
    ];
    for (i, (dims, causal, lengths)) in cases.into_iter().enumerate() {
        for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
            let name = format!("{dims:?} causal={causal} lengths={lengths:?} {dtype:?}");
            let scores = random_4d(dims, 111 + i as u64, 4.0, dtype, &device);
            let grad = random_4d(dims, 121 + i as u64, 1.0, dtype, &device);
            let key_lengths = lengths
                .map(|l| Tensor::<W, 1, Int>::from_data(TensorData::new(l.to_vec(), [3]), &device));
            let f32_of = |t: Tensor<W, 4>| t.cast(DType::F32);
            let want = masked_forward_composition(
                f32_of(scores.clone()),
                key_lengths.clone(),
                0.7,
                causal,
            );
            let got = W::masked_softmax(scores.clone(), key_lengths.clone(), 0.7, causal);
            assert_eq!(got.dtype(), dtype);
            let probs_f32 = values(f32_of(got.clone()));
            assert!(
                probs_f32.iter().all(|p| p.is_finite()),
                "{name}: not finite"
            );
            assert_close(
                &format!("forward {name}"),
                &probs_f32,
                &values(want.clone()),
                bound,
            );
            // Both kernel sets (rows in registers, rows streamed), into poisoned buffers.
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let probs = poisoned(dims, dtype, &device);
                softmax::masked_forward_into_with(
                    raw4(scores.clone()),
                    key_lengths.clone().map(|l| l.into_primitive()),
                    0.7,
                    causal,
                    raw4(probs.clone()),
                    kernels,
                );
                assert_close(
                    &format!("forward {name} (into a poisoned buffer, {kernels:?})"),
                    &values(f32_of(probs)),
                    &values(want.clone()),
                    bound,
                );
            }

            let want = backward_composition(want, f32_of(grad.clone()), 0.7);
            let got_grad = W::masked_softmax_backward(got.clone(), grad.clone(), 0.7, causal);
            assert_close(
                &format!("backward {name}"),
                &values(f32_of(got_grad)),
                &values(want.clone()),
                bound,
            );
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let grad_scores = poisoned(dims, dtype, &device);
                softmax::masked_backward_into_with(
                    raw4(got.clone()),
                    raw4(grad.clone()),
                    0.7,
                    causal,
                    raw4(grad_scores.clone()),
                    kernels,
                );
                assert_close(
                    &format!("backward {name} (into a poisoned buffer, {kernels:?})"),
                    &values(f32_of(grad_scores)),
                    &values(want.clone()),
                    bound,
                );
            }
        }
    }
}
