//! The FP8 layers' amax kernel (the casts need FP8 conversions, which Vulkan lacks: they are
//! checked bit for bit on the GPU by `gemm_bench fp8`).

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron_kernels::fused::fp8::amax;

use crate::helpers::{W, random, raw, wrap};

fn device_amax(x: Tensor<W, 2>) -> f32 {
    let out: Tensor<W, 1> = wrap(amax(raw(x)));
    out.into_data().to_vec::<f32>().unwrap()[0]
}

/// `max |x|` over tensors of one element up to several cubes' grid-wide walk, f32 and f16,
/// against the host's; a NaN anywhere gives NaN, an infinity infinity, zeros zero.
#[test]
fn amax_is_the_largest_magnitude() {
    let device = WgpuDevice::default();
    for dtype in [DType::F32, DType::F16] {
        for (rows, cols, seed) in [(1, 1, 1), (7, 300, 2), (33, 129, 3), (1000, 1040, 4)] {
            let mut values = random(rows * cols, seed, 3.0);
            // The largest magnitude negative, somewhere in the middle.
            let at = (rows * cols) / 3;
            values[at] = -7.5;
            let x =
                Tensor::<W, 2>::from_data(TensorData::new(values.clone(), [rows, cols]), &device)
                    .cast(dtype);
            let host = x
                .clone()
                .cast(DType::F32)
                .into_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(host, 7.5);
            assert_eq!(device_amax(x), host, "{dtype:?} [{rows}, {cols}]");
            for (special, want) in [(f32::NAN, None), (f32::NEG_INFINITY, Some(f32::INFINITY))] {
                let mut poisoned = values.clone();
                poisoned[rows * cols - 1] = special;
                let x = Tensor::<W, 2>::from_data(TensorData::new(poisoned, [rows, cols]), &device)
                    .cast(dtype);
                let got = device_amax(x);
                match want {
                    None => assert!(got.is_nan(), "{dtype:?} [{rows}, {cols}]: {got} for a NaN"),
                    Some(want) => assert_eq!(got, want, "{dtype:?} [{rows}, {cols}]"),
                }
            }
        }
    }
    let zeros = Tensor::<W, 2>::zeros([5, 8], &device);
    assert_eq!(device_amax(zeros), 0.0);
}
