//! FP8 training (issue 33) on the CPU, where the FP8 operations are emulated in f32 tensors:
//! the cast against an f64 reference built with the `float8` crate (CUDA's conversion), the
//! scaling recipes (blockwise scaling's casts, products, layer and TP = 2 included), the FP8
//! linear layer's forward and backward against an explicit f64
//! emulation, TP = 2 against TP = 1, the weight gradients through the overlap hook against
//! their reduction after the backward pass, the first and last layers kept out of FP8, and
//! `pretrain_gpt` with `--fp8-format`.

mod blockwise;
mod data_parallel;
mod first_last;
mod linear;
mod overlap;
mod pretrain;
mod quantize;
mod scaling;
mod tensor_parallel;
mod weight_cache;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorData};
use burn_megatron::ops::fp8::Fp8Dtype;
pub use burn_megatron_testing::{assert_close, run, tolerance, values};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;

/// `v` rounded to `dtype`'s grid by the reference (round to nearest even, saturating).
pub fn reference_round(v: f64, dtype: Fp8Dtype) -> f64 {
    match dtype {
        Fp8Dtype::E4M3 => float8::F8E4M3::from_f64(v).to_f64(),
        Fp8Dtype::E5M2 => float8::F8E5M2::from_f64(v).to_f64(),
    }
}

/// Every finite value of `dtype`, both signs (zero once).
pub fn representable(dtype: Fp8Dtype) -> Vec<f64> {
    let mut out: Vec<f64> = (0u8..=255)
        .map(|bits| match dtype {
            Fp8Dtype::E4M3 => float8::F8E4M3::from_bits(bits).to_f64(),
            Fp8Dtype::E5M2 => float8::F8E5M2::from_bits(bits).to_f64(),
        })
        .filter(|v| v.is_finite())
        .collect();
    out.sort_by(f64::total_cmp);
    out.dedup();
    out
}

/// A `[rows, cols]` tensor of `values` (row-major) on `B`'s default device.
pub fn matrix<Bk: burn::tensor::backend::Backend>(
    values: &[f32],
    rows: usize,
    cols: usize,
) -> Tensor<Bk, 2> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), [rows, cols]),
        &Default::default(),
    )
}

/// `n` deterministic values of magnitude up to `scale`, varied in sign and exponent.
pub fn pseudo_random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = ((state >> 33) as f64) / (1u64 << 31) as f64; // [0, 1)
            (scale as f64 * (2.0 * u - 1.0)) as f32
        })
        .collect()
}
