//! The cast ([`Fp8Ops::fp8_quantize`]), the amax and the GEMM of the compositions against an
//! f64 reference: the `float8` crate's conversion (a port of CUDA's `__nv_cvt_double_to_fp8`
//! with `satfinite`: round to nearest, ties to even, saturation to ±max).

use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::fp8::{Fp8Dtype, Fp8Ops, tensorwise_scale};
use burn_megatron_testing::values_f32;

use crate::{B, assert_close, matrix, pseudo_random, reference_round, representable, tolerance};

const DTYPES: [Fp8Dtype; 2] = [Fp8Dtype::E4M3, Fp8Dtype::E5M2];

fn scale(value: f32) -> Tensor<B, 1> {
    Tensor::from_floats([value], &Default::default())
}

/// The cast of a row of `values` times `scale`.
fn cast(values: &[f32], by: f32, dtype: Fp8Dtype) -> Vec<f32> {
    let x = matrix::<B>(values, 1, values.len());
    values_f32(B::fp8_quantize(x, scale(by), dtype, false))
}

/// `got` equals the reference's rounding of `v · by` (the product formed in f32, as the
/// kernels do) bit for bit, naming the first value that differs.
fn assert_rounds_like_reference(what: &str, values: &[f32], by: f32, dtype: Fp8Dtype) {
    let got = cast(values, by, dtype);
    for (i, (&v, &g)) in values.iter().zip(&got).enumerate() {
        let want = reference_round((v * by) as f64, dtype) as f32;
        assert!(
            g == want || (g.is_nan() && want.is_nan()),
            "{what}, {}: {v:e} · {by} cast to {g:e}, the reference gives {want:e} (index {i})",
            dtype.name()
        );
    }
}

#[test]
fn every_representable_value_is_kept() {
    for dtype in DTYPES {
        let values: Vec<f32> = representable(dtype).iter().map(|&v| v as f32).collect();
        assert_eq!(
            values.len(),
            if dtype == Fp8Dtype::E4M3 { 253 } else { 247 }
        );
        assert_eq!(cast(&values, 1.0, dtype), values, "{}", dtype.name());
        assert_eq!(values.last().copied(), Some(dtype.max()));
    }
}

/// Midpoints between neighbours (exact ties), quarter points and the f32 values next to each
/// midpoint, over the whole range, subnormals included.
#[test]
fn ties_round_to_even_and_near_ties_to_nearest() {
    for dtype in DTYPES {
        let grid = representable(dtype);
        let mut values = Vec::new();
        for pair in grid.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            let mid = ((a + b) / 2.0) as f32;
            values.extend([
                mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
                (a + (b - a) / 4.0) as f32,
                (b - (b - a) / 4.0) as f32,
            ]);
        }
        assert_rounds_like_reference("ties", &values, 1.0, dtype);
        // Ties go both ways: to the even neighbour, which is sometimes the larger one.
        let ups = values
            .iter()
            .step_by(5)
            .zip(cast(&values, 1.0, dtype).iter().step_by(5))
            .filter(|(v, q)| q.abs() > v.abs())
            .count();
        assert!(ups > 0 && ups < grid.len() - 1, "{ups} ties rounded up");
    }
}

#[test]
fn random_values_of_every_exponent_round_like_the_reference() {
    for dtype in DTYPES {
        let mut values = Vec::new();
        for (k, exponent) in (-26..20).enumerate() {
            let scale = 2f32.powi(exponent);
            values.extend(pseudo_random(64, k as u64, scale));
        }
        assert_rounds_like_reference("random", &values, 1.0, dtype);
        // The product with a scale is rounded to f32 first, then to the grid.
        assert_rounds_like_reference("scaled", &values, 3.7, dtype);
        assert_rounds_like_reference("scaled down", &values, 0.011, dtype);
    }
}

#[test]
fn large_values_and_infinities_saturate() {
    for dtype in DTYPES {
        let max = dtype.max();
        let values = [
            max * 1.03,
            max * 1.1,
            max * 2.0,
            1e30,
            f32::MAX,
            f32::INFINITY,
            -max * 1.1,
            f32::NEG_INFINITY,
        ];
        let got = cast(&values, 1.0, dtype);
        let want: Vec<f32> = values.iter().map(|v| max.copysign(*v)).collect();
        assert_eq!(got, want, "{}", dtype.name());
        assert_rounds_like_reference("saturation", &values, 1.0, dtype);
    }
}

#[test]
fn subnormals_and_underflow() {
    for dtype in DTYPES {
        let smallest = 2f32.powi(dtype.min_normal_exponent() - dtype.mantissa_bits());
        let values = [
            smallest,
            smallest / 2.0,                                 // a tie with 0: stays 0
            f32::from_bits((smallest / 2.0).to_bits() + 1), // just above: the smallest
            smallest * 1.5,                                 // a tie: 2 · smallest (even)
            smallest * 2.5,                                 // a tie: 2 · smallest (even)
            smallest * 3.0,
            smallest / 3.0,
            1e-30,
            1e-40, // an f32 subnormal
            -smallest * 0.75,
        ];
        assert_rounds_like_reference("subnormals", &values, 1.0, dtype);
        let got = cast(&values, 1.0, dtype);
        assert_eq!(
            &got[..6],
            &[
                smallest,
                0.0,
                smallest,
                2.0 * smallest,
                2.0 * smallest,
                3.0 * smallest
            ]
        );
    }
}

#[test]
fn zero_tensors_have_amax_zero_scale_one_and_cast_to_zero() {
    let x = Tensor::<B, 2>::zeros([3, 4], &Default::default());
    let amax = B::fp8_amax(x.clone());
    assert_eq!(values_f32(amax.clone()), [0.0]);
    let scale = tensorwise_scale(amax, Fp8Dtype::E4M3, 0);
    assert_eq!(values_f32(scale.clone()), [1.0]);
    for dtype in DTYPES {
        assert_eq!(
            values_f32(B::fp8_quantize(x.clone(), scale.clone(), dtype, true)),
            [0.0; 12]
        );
    }
}

#[test]
fn nan_stays_nan_and_makes_the_amax_nan() {
    let values = [1.0, f32::NAN, -3.0, 0.3];
    for dtype in DTYPES {
        let got = cast(&values, 1.0, dtype);
        assert!(got[1].is_nan(), "{}: NaN cast to {}", dtype.name(), got[1]);
        assert_eq!([got[0], got[2]], [1.0, -3.0]);
        assert_eq!(got[3] as f64, reference_round(0.3f32 as f64, dtype));
    }
    let amax = |v: &[f32]| values_f32(B::fp8_amax(matrix::<B>(v, 2, 2)))[0];
    assert!(amax(&values).is_nan());
    assert_eq!(amax(&[1.0, -7.5, 2.0, 0.0]), 7.5);
    assert_eq!(amax(&[1.0, f32::NEG_INFINITY, 2.0, 0.0]), f32::INFINITY);
    let amax_tensor = B::fp8_amax(matrix::<B>(&values, 2, 2));
    assert_eq!(amax_tensor.dims(), [1]);
    assert_eq!(amax_tensor.dtype(), DType::F32);
}

#[test]
fn transposed_cast_is_the_cast_transposed() {
    let values = pseudo_random(35, 3, 600.0);
    let x = matrix::<B>(&values, 5, 7);
    for dtype in DTYPES {
        let plain = B::fp8_quantize(x.clone(), scale(0.7), dtype, false);
        let transposed = B::fp8_quantize(x.clone(), scale(0.7), dtype, true);
        assert_eq!(transposed.dims(), [7, 5]);
        assert_eq!(values_f32(transposed), values_f32(plain.transpose()));
    }
}

/// The cast in both layouts (with and without the amax) is the two casts and the amax, a
/// NaN included.
#[test]
fn both_layouts_are_the_two_casts() {
    let mut values = pseudo_random(35, 4, 600.0);
    values[17] = f32::NAN;
    let x = matrix::<B>(&values, 5, 7);
    let bits = |t: Tensor<B, 2>| {
        values_f32(t)
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    for dtype in DTYPES {
        let plain = bits(B::fp8_quantize(x.clone(), scale(0.7), dtype, false));
        let transposed = bits(B::fp8_quantize(x.clone(), scale(0.7), dtype, true));
        let (row, t) = B::fp8_quantize_both(x.clone(), scale(0.7), dtype);
        assert_eq!((bits(row), bits(t)), (plain.clone(), transposed.clone()));
        let (row, t, amax) = B::fp8_quantize_both_amax(x.clone(), scale(0.7), dtype);
        assert_eq!((bits(row), bits(t)), (plain, transposed));
        assert!(values_f32(amax)[0].is_nan());
    }
}

/// An f64 tensor is cast in f64: a value just above a tie rounds up, where f32 would see
/// the tie itself and round to even.
#[test]
fn f64_tensors_round_once() {
    let device = Default::default();
    let v = 1.0625 + 2f64.powi(-40); // between 1 and 1.125 (E4M3), just above the tie
    let x = Tensor::<B, 2>::from_data(TensorData::new(vec![v], [1, 1]), (&device, DType::F64));
    let q = B::fp8_quantize(x, scale(1.0), Fp8Dtype::E4M3, false);
    assert_eq!(q.dtype(), DType::F64);
    assert_eq!(crate::values(q), [1.125]);
    assert_eq!(reference_round(v, Fp8Dtype::E4M3), 1.125);
    assert_eq!(cast(&[v as f32], 1.0, Fp8Dtype::E4M3), [1.0]);
}

/// The GEMM of cast tensors against the f64 product of the same values, scaled.
#[test]
fn gemm_is_the_scaled_product_of_the_cast_values() {
    let (m, n, k) = (5, 3, 16);
    let a = B::fp8_quantize(
        matrix::<B>(&pseudo_random(m * k, 1, 2.0), m, k),
        scale(100.0),
        Fp8Dtype::E4M3,
        false,
    );
    let b = B::fp8_quantize(
        matrix::<B>(&pseudo_random(n * k, 2, 0.01), n, k),
        scale(1e6),
        Fp8Dtype::E5M2,
        false,
    );
    let (av, bv) = (crate::values(a.clone()), crate::values(b.clone()));
    let got = B::fp8_gemm(
        a,
        Fp8Dtype::E4M3,
        scale(0.01),
        b,
        Fp8Dtype::E5M2,
        scale(1e-6),
        DType::F32,
    );
    assert_eq!(got.dims(), [m, n]);
    let factor = 0.01f32 as f64 * 1e-6f32 as f64;
    let want: Vec<f64> = (0..m * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            (0..k).map(|j| av[r * k + j] * bv[c * k + j]).sum::<f64>() * factor
        })
        .collect();
    assert_close("fp8 gemm", &crate::values(got), &want, tolerance::F32);
}
