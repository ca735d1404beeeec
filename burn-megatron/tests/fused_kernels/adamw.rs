//! The fused AdamW kernel over the flat buffers against its composition.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::AdamWOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, random};

/// The fused AdamW kernel against the composition: weights in f32 (out of place: a model
/// views them) and in f16 (in place, with an f16 copy for the model), decayed and exempt
/// blocks, a gradient factor, the bias correction at steps 1 and 1000, and a skipped step
/// (every input unchanged, though the gradients hold NaN); blocks of 8 (the kernel reads
/// vectors of 4) and of 3 (single elements).
#[test]
fn flat_adamw_equals_the_composition() {
    for block in [8, 3] {
        flat_adamw_in_blocks_of(block);
    }
}

fn flat_adamw_in_blocks_of(block: usize) {
    use burn_megatron::ops::adamw::{AdamWScalars, FlatAdamWBuffers, flat_adamw_composition};
    let device = WgpuDevice::default();
    let blocks = 129;
    let n = block * blocks;
    let f32s = |v: Vec<f32>| {
        let len = v.len();
        Tensor::<W, 1>::from_data(TensorData::new(v, [len]), (&device, DType::F32))
    };
    let flags: Vec<f32> = (0..blocks).map(|b| (b % 3 != 0) as u8 as f32).collect();
    let scalars = AdamWScalars::new(3e-3, 0.9, 0.95, 1e-8, 0.1, block);
    for (model_dtype, step, found, shared) in [
        (None, 0.0, 0.0, true),
        (None, 999.0, 0.0, false),
        (Some(DType::F16), 0.0, 0.0, false),
        (Some(DType::F16), 4.0, 0.0, true),
        (None, 4.0, 1.0, false),
        (Some(DType::F16), 4.0, 1.0, false),
    ] {
        let label = format!(
            "blocks of {block}, {model_dtype:?} step {step} found_inf {found} shared {shared}"
        );
        let mut grad = random(n, 21, 1e-2);
        if found != 0.0 {
            grad[5] = f32::NAN;
            grad[n - 1] = f32::INFINITY;
        }
        let buffers = || FlatAdamWBuffers {
            master: f32s(random(n, 20, 0.5)),
            grad: f32s(grad.clone()),
            exp_avg: f32s(random(n, 22, 1e-3)),
            exp_avg_sq: f32s(random(n, 23, 1e-4).iter().map(|v| v.abs()).collect()),
            decay: f32s(flags.clone()),
            step: f32s(vec![step]),
            grad_factor: f32s(vec![0.7]),
            found_inf: f32s(vec![found]),
        };
        let want = flat_adamw_composition(buffers(), &scalars, model_dtype);
        let inputs = buffers();
        // A view of the master weights held elsewhere forces the out-of-place path.
        let view = shared.then(|| inputs.master.clone());
        let before =
            [&inputs.master, &inputs.exp_avg, &inputs.exp_avg_sq].map(|t| values(t.clone()));
        let got = W::flat_adamw(inputs, &scalars, model_dtype);
        if let Some(view) = view {
            assert_eq!(
                values(view),
                before[0],
                "{label}: a shared master is not written"
            );
        }
        let pairs = [
            ("master", got.master, want.master),
            ("exp_avg", got.exp_avg, want.exp_avg),
            ("exp_avg_sq", got.exp_avg_sq, want.exp_avg_sq),
        ];
        for (i, (name, got, want)) in pairs.into_iter().enumerate() {
            let (got, want) = (values(got), values(want));
            if found != 0.0 {
                assert_eq!(
                    got, before[i],
                    "{label}: {name} unchanged by a skipped step"
                );
            }
            assert_close(
                &format!("{label}: {name}"),
                &got,
                &want,
                tolerance::F32_SAME_ORDER,
            );
        }
        assert_eq!(got.model.is_some(), model_dtype.is_some());
        if let (Some(got), Some(want)) = (got.model, want.model) {
            assert_eq!(got.dtype(), DType::F16);
            assert_close(
                &format!("{label}: model copy"),
                &values(got),
                &values(want),
                tolerance::F16,
            );
        }
    }
}
