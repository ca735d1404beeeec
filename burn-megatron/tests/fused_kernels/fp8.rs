//! The FP8 layers' amax kernel, and the cast kernels' tiles, layouts, fused amax and FP8 bits.
//! The casts compute the bits in integer and f32 arithmetic, so they run here: every bf16
//! value's bits are checked against the host's conversion; the other tests check the tiles and
//! layouts on the unrounded f32 values ([`CastTarget::F32`]), and `gemm_bench fp8` checks the
//! bits on the GPU.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::fp8::{
    AmaxComputeAlgo, Fp8Dtype, delayed_update_composition, tensorwise_scale,
};
use burn_megatron_kernels::fused::fp8::{self, CastTarget, Fp8Kind, amax, quantize, quantize_both};
use burn_megatron_testing::{assert_close, values, values_f32};

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

/// The amax with its scales in the amax's two launches (`fp8::amax_scale`) against the amax
/// kernel and then the scale kernel, bit for bit: ordinary tensors of f32 and f16, one
/// holding a NaN, one an infinity, zeros and an empty one, both formats, margins 0 and 3.
#[test]
fn the_amax_with_its_scale_matches_the_amax_then_the_scale() {
    let device = WgpuDevice::default();
    let mut cases = Vec::new();
    for (rows, cols, seed) in [(1, 1, 5), (33, 129, 6), (1000, 1040, 7)] {
        let values = random(rows * cols, seed, 40.0);
        cases.push((values.clone(), [rows, cols]));
        for special in [f32::NAN, f32::INFINITY] {
            let mut poisoned = values.clone();
            poisoned[rows * cols / 2] = special;
            cases.push((poisoned, [rows, cols]));
        }
    }
    cases.push((vec![0.0; 40], [5, 8]));
    cases.push((vec![], [0, 8]));
    for (values, shape) in cases {
        for dtype in [DType::F32, DType::F16] {
            let x = Tensor::<W, 2>::from_data(TensorData::new(values.clone(), shape), &device)
                .cast(dtype);
            for format in [Fp8Dtype::E4M3, Fp8Dtype::E5M2] {
                for margin in [0, 3] {
                    let case = format!("{shape:?} {dtype:?} {format:?} margin {margin}");
                    let want_amax = amax(raw(x.clone()));
                    let (want_scale, want_inv) =
                        fp8::tensorwise_scale(want_amax.clone(), format.max(), margin);
                    let (got_amax, got_scale, got_inv) =
                        fp8::amax_scale(raw(x.clone()), format.max(), margin);
                    for (what, got, want) in [
                        ("amax", got_amax, want_amax),
                        ("scale", got_scale, want_scale),
                        ("reciprocal", got_inv, want_inv),
                    ] {
                        let (got, want): (Tensor<W, 1>, Tensor<W, 1>) = (wrap(got), wrap(want));
                        assert_same_bits(
                            &format!("{case} {what}"),
                            &values_f32(got),
                            &values_f32(want),
                        );
                    }
                }
            }
        }
    }
}

/// The one-thread kernel of the tensorwise scale and its reciprocal against the composition it
/// replaces (`tensorwise_scale`, then `recip`), bit for bit: ordinary amaxes, the largest and smallest f32 (the
/// quotient overflowing to the f32 ceiling), a subnormal, and the amaxes that fall back to 1
/// (zero, NaN, infinity), for both formats and margins 0 and 2.
#[test]
fn the_tensorwise_scale_kernel_matches_the_composition() {
    let device = WgpuDevice::default();
    let amaxes = [
        1.0,
        0.37,
        448.0,
        3.3e4,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        0.0,
        f32::NAN,
        f32::INFINITY,
    ];
    for dtype in [Fp8Dtype::E4M3, Fp8Dtype::E5M2] {
        for margin in [0, 2] {
            for a in amaxes {
                let amax = Tensor::<W, 1>::from_data(TensorData::new(vec![a], [1]), &device);
                let want = tensorwise_scale(amax.clone(), dtype, margin);
                let want_inv = values_f32(want.clone().recip());
                let (got, got_inv) = fp8::tensorwise_scale(raw(amax), dtype.max(), margin);
                let (got, got_inv): (Tensor<W, 1>, Tensor<W, 1>) = (wrap(got), wrap(got_inv));
                let case = format!("{dtype:?} margin {margin} amax {a:e}");
                assert_same_bits(&case, &values_f32(got), &values_f32(want));
                assert_same_bits(
                    &format!("{case}, reciprocal"),
                    &values_f32(got_inv),
                    &want_inv,
                );
            }
        }
    }
}

/// Delayed scaling's update in one kernel (`fp8::delayed_update`) against the composition, bit
/// for bit: histories of 1, 3 and 300 amaxes (more than the cube's threads), fresh (zeros)
/// and filled, both algorithms, margins 0 and 2, and amaxes that are ordinary, the
/// history's new largest, zero, tiny, NaN and infinite (those two change nothing).
#[test]
fn the_delayed_update_kernel_matches_the_composition() {
    let device = WgpuDevice::default();
    let amaxes = [3.5, 1.0e4, 0.0, 1e-40, f32::NAN, f32::INFINITY];
    for len in [1, 3, 300] {
        for filled in [false, true] {
            let history: Vec<f32> = match filled {
                false => vec![0.0; len],
                true => random(len, 21 + len as u64, 50.0)
                    .iter()
                    .map(|v| v.abs())
                    .collect(),
            };
            let history = Tensor::<W, 1>::from_data(TensorData::new(history, [len]), &device);
            let scale = Tensor::<W, 1>::from_data(TensorData::new(vec![0.75f32], [1]), &device);
            for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
                for margin in [0, 2] {
                    for a in amaxes {
                        let name = format!(
                            "len {len} filled {filled} {algo:?} margin {margin} amax {a:e}"
                        );
                        let amax =
                            Tensor::<W, 1>::from_data(TensorData::new(vec![a], [1]), &device);
                        let dtype = Fp8Dtype::E4M3;
                        let (want_history, want_scale) = delayed_update_composition(
                            history.clone(),
                            scale.clone(),
                            amax.clone(),
                            dtype,
                            margin,
                            algo,
                        );
                        let (got_history, got_scale) = fp8::delayed_update(
                            raw(history.clone()),
                            raw(scale.clone()),
                            raw(amax),
                            dtype.max(),
                            margin,
                            algo == AmaxComputeAlgo::MostRecent,
                        );
                        assert_same_bits(
                            &format!("{name}: history"),
                            &values_f32(wrap::<1>(got_history)),
                            &values_f32(want_history),
                        );
                        assert_same_bits(
                            &format!("{name}: scale"),
                            &values_f32(wrap::<1>(got_scale)),
                            &values_f32(want_scale),
                        );
                    }
                }
            }
        }
    }
}

/// `got` and `want` bit for bit, a NaN matching only a NaN: a NaN where a number is expected
/// (or the reverse) fails, naming the index.
fn assert_same_bits(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: sizes differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = match (g.is_nan(), w.is_nan()) {
            (true, true) => true,
            (false, false) => g.to_bits() == w.to_bits(),
            _ => false,
        };
        assert!(same, "{name}[{i}]: got {g} want {w}");
    }
}

/// `quantize_both`'s two layouts against `quantize`'s row-major and transposed kernels and a
/// host reference (`x · scale` saturated to ±448), and its amax against `amax`'s: shapes that
/// are not multiples of the 32 × 32 tile, one past the cubes' limit (cubes walking two tiles),
/// f32 and f16 inputs, with saturating values, zeros, and a NaN (which must stay a NaN in both
/// layouts and make the amax NaN).
#[test]
fn quantize_both_matches_the_two_casts_and_the_amax() {
    let device = WgpuDevice::default();
    let max = Fp8Kind::E4M3.max();
    let target = CastTarget::F32 { max };
    let scale_value = 1.75f32;
    let scale = raw(Tensor::<W, 1>::from_floats([scale_value], &device));
    for dtype in [DType::F32, DType::F16] {
        for (rows, cols, seed) in [
            (1, 1, 1),
            (7, 300, 2),
            (33, 129, 3),
            (100, 45, 4),
            (1000, 4200, 5),
        ] {
            for nan in [false, true] {
                let name = format!(
                    "{dtype:?} [{rows}, {cols}]{}",
                    if nan { " NaN" } else { "" }
                );
                let n = rows * cols;
                let mut v = random(n, seed, 300.0);
                v[n / 2] = 0.0;
                v[n / 3] = -350.0;
                if nan {
                    v[n - 1] = f32::NAN;
                }
                let x = Tensor::<W, 2>::from_data(TensorData::new(v, [rows, cols]), &device)
                    .cast(dtype);
                let host = values_f32(x.clone());
                let row_ref: Vec<f32> = host
                    .iter()
                    .map(|v| (v * scale_value).clamp(-max, max))
                    .collect();
                let mut transposed_ref = vec![0f32; n];
                for r in 0..rows {
                    for c in 0..cols {
                        transposed_ref[c * rows + r] = row_ref[r * cols + c];
                    }
                }
                let cast = |t| values_f32(wrap::<2>(quantize(raw(x.clone()), &scale, target, t)));
                let (row_kernel, transposed_kernel) = (cast(false), cast(true));
                let both = quantize_both(raw(x.clone()), &scale, target, true);
                let both_amax = values_f32(wrap::<1>(both.amax.expect("asked for")))[0];
                let (row, transposed) = (
                    values_f32(wrap::<2>(both.row)),
                    values_f32(wrap::<2>(both.transposed)),
                );
                assert_same_bits(&format!("{name} row vs quantize"), &row, &row_kernel);
                assert_same_bits(
                    &format!("{name} transposed vs quantize"),
                    &transposed,
                    &transposed_kernel,
                );
                assert_same_bits(&format!("{name} row vs host"), &row, &row_ref);
                assert_same_bits(
                    &format!("{name} transposed vs host"),
                    &transposed,
                    &transposed_ref,
                );
                let amax_kernel = values_f32(wrap::<1>(amax(raw(x.clone()))))[0];
                if nan {
                    assert!(both_amax.is_nan(), "{name}: amax {both_amax} for a NaN");
                    assert!(amax_kernel.is_nan(), "{name}: amax kernel {amax_kernel}");
                } else {
                    // Exact, and a NaN on either side fails.
                    assert_close(
                        &format!("{name} the fused amax"),
                        &[both_amax as f64],
                        &[amax_kernel as f64],
                        0.0,
                    );
                    assert_close(
                        &format!("{name} row"),
                        &values(wrap::<2>(quantize_both(raw(x), &scale, target, false).row)),
                        &row_ref.iter().map(|&v| v as f64).collect::<Vec<_>>(),
                        0.0,
                    );
                    assert_eq!(both_amax, 350.0, "{name}");
                }
            }
        }
    }
    // Without the amax there is none; an empty matrix gives empty casts and a zero amax.
    let x = Tensor::<W, 2>::zeros([0, 5], &device);
    let both = quantize_both(raw(x), &scale, target, true);
    assert_eq!(both.row.meta.shape().to_vec(), [0, 5]);
    assert_eq!(both.transposed.meta.shape().to_vec(), [5, 0]);
    assert_eq!(values_f32(wrap::<1>(both.amax.unwrap())), [0.0]);
    let x = Tensor::<W, 2>::ones([3, 4], &device);
    assert!(quantize_both(raw(x), &scale, target, false).amax.is_none());
}

/// The FP8 bits a cast wrote, one a `u32` ([`CastTarget::Fp8InU32`]: WGSL has no 8-bit
/// storage).
fn fp8_bytes(t: burn_cubecl::tensor::CubeTensor<burn::backend::wgpu::WgpuRuntime>) -> Vec<u8> {
    let words = wrap::<2>(t).into_data().to_vec::<u32>().unwrap();
    words
        .into_iter()
        .map(|w| u8::try_from(w).unwrap())
        .collect()
}

/// The FP8 bits every cast kernel writes, against the host's conversion
/// ([`Fp8Kind::encode`], CUDA's): every bf16 value (NaNs, infinities, zeros, subnormals, and the
/// ties of both formats' rounding), the same values with random low bits (just above and below
/// the ties), scaled by 1 and by 2^-10 (into both formats' subnormals), E4M3 and E5M2; the
/// row-major cast, the transposed one, and both fused kernels' two layouts.
#[test]
fn the_casts_write_the_hosts_fp8_bits() {
    let device = WgpuDevice::default();
    let mut noise = random(1 << 16, 41, 1.0).into_iter();
    let bf16 = (0..=u16::MAX).map(|b| f32::from_bits((b as u32) << 16));
    let perturbed = (0..=u16::MAX).map(|b| {
        let low = (noise.next().unwrap().abs() * 65535.0) as u32;
        f32::from_bits(((b as u32) << 16) | low)
    });
    let values: Vec<f32> = bf16.chain(perturbed).collect();
    let (rows, cols) = (256, values.len() / 256);
    let x = Tensor::<W, 2>::from_data(TensorData::new(values.clone(), [rows, cols]), &device);
    for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
        let target = CastTarget::Fp8InU32(kind);
        for scale_value in [1.0f32, 2f32.powi(-10)] {
            let scale = raw(Tensor::<W, 1>::from_floats([scale_value], &device));
            let row_ref: Vec<u8> = values
                .iter()
                .map(|v| kind.encode((v * scale_value) as f64))
                .collect();
            let mut transposed_ref = vec![0u8; row_ref.len()];
            for r in 0..rows {
                for c in 0..cols {
                    transposed_ref[c * rows + r] = row_ref[r * cols + c];
                }
            }
            let check = |what: &str, got: Vec<u8>, want: &[u8]| {
                let wrong: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
                assert!(
                    wrong.is_empty(),
                    "{kind:?} scale {scale_value} {what}: {} of {} bytes differ, first at {}: {:#04x} for {:e}, want {:#04x}",
                    wrong.len(),
                    want.len(),
                    wrong[0],
                    got[wrong[0]],
                    values[wrong[0]],
                    want[wrong[0]]
                );
            };
            let row = quantize(raw(x.clone()), &scale, target, false);
            check("row-major", fp8_bytes(row), &row_ref);
            let transposed = quantize(raw(x.clone()), &scale, target, true);
            check("transposed", fp8_bytes(transposed), &transposed_ref);
            for kernel in [fp8::BothKernel::Tiles, fp8::BothKernel::Blocks] {
                let both = fp8::quantize_both_by(raw(x.clone()), &scale, target, false, kernel, 64);
                check(&format!("{kernel:?} row"), fp8_bytes(both.row), &row_ref);
                check(
                    &format!("{kernel:?} transposed"),
                    fp8_bytes(both.transposed),
                    &transposed_ref,
                );
            }
        }
    }
}

/// The vectorised casts (four elements a thread here, four bytes written at once in each
/// layout; both kernels: 64 × 64 tiles through shared memory, 4 × 4 blocks transposed in
/// registers) and their scalar fallback, for shapes whose sides are multiples of four (tiles
/// and plane groups cut at the edges, a single vector, one tile exactly; the default grid,
/// and 7 cubes walking several tiles or blocks each) and shapes that are not (one side or
/// both): `quantize_both`'s two layouts and amax, and `quantize`'s transposed and row-major
/// casts, against the host reference bit for bit.
#[test]
fn vectorised_casts_match_the_host_for_any_shape() {
    let device = WgpuDevice::default();
    let max = Fp8Kind::E5M2.max();
    let target = CastTarget::F32 { max };
    let scale_value = 96.0f32;
    let scale = raw(Tensor::<W, 1>::from_floats([scale_value], &device));
    for dtype in [DType::F32, DType::F16] {
        for (rows, cols, seed) in [
            (4, 4, 11),
            (64, 64, 12),
            (68, 36, 13),
            (8, 1000, 14),
            (132, 200, 15),
            (4, 6, 16),
            (6, 4, 17),
            (66, 130, 18),
            (1030, 4100, 19),
        ] {
            let name = format!("{dtype:?} [{rows}, {cols}]");
            let n = rows * cols;
            let mut v = random(n, seed, 800.0);
            v[n / 2] = -900.0;
            let x =
                Tensor::<W, 2>::from_data(TensorData::new(v, [rows, cols]), &device).cast(dtype);
            let host = values_f32(x.clone());
            let row_ref: Vec<f32> = host
                .iter()
                .map(|v| (v * scale_value).clamp(-max, max))
                .collect();
            let mut transposed_ref = vec![0f32; n];
            for r in 0..rows {
                for c in 0..cols {
                    transposed_ref[c * rows + r] = row_ref[r * cols + c];
                }
            }
            let both = quantize_both(raw(x.clone()), &scale, target, true);
            let amax = values_f32(wrap::<1>(both.amax.expect("asked for")))[0];
            assert_eq!(amax, 900.0, "{name}: amax");
            assert_same_bits(
                &format!("{name} both, row"),
                &values_f32(wrap::<2>(both.row)),
                &row_ref,
            );
            assert_same_bits(
                &format!("{name} both, transposed"),
                &values_f32(wrap::<2>(both.transposed)),
                &transposed_ref,
            );
            let both = quantize_both(raw(x.clone()), &scale, target, false);
            assert_same_bits(
                &format!("{name} both without amax, transposed"),
                &values_f32(wrap::<2>(both.transposed)),
                &transposed_ref,
            );
            // Few cubes, each walking several tiles or blocks.
            let walked = fp8::quantize_both_in_cubes(raw(x.clone()), &scale, target, true, 7);
            let amax = values_f32(wrap::<1>(walked.amax.expect("asked for")))[0];
            assert_eq!(amax, 900.0, "{name}: amax, 7 cubes");
            assert_same_bits(
                &format!("{name} both in 7 cubes, row"),
                &values_f32(wrap::<2>(walked.row)),
                &row_ref,
            );
            assert_same_bits(
                &format!("{name} both in 7 cubes, transposed"),
                &values_f32(wrap::<2>(walked.transposed)),
                &transposed_ref,
            );
            // Each vectorised kernel whatever the vector (tiles through shared memory, blocks
            // transposed in registers), a tile or block a cube (or thread) and 7 cubes walking
            // several each.
            for kernel in [fp8::BothKernel::Tiles, fp8::BothKernel::Blocks] {
                for cubes in [usize::MAX, 7] {
                    let casts =
                        fp8::quantize_both_by(raw(x.clone()), &scale, target, true, kernel, cubes);
                    let what = format!("{name} {kernel:?} in {cubes} cubes");
                    let amax = values_f32(wrap::<1>(casts.amax.expect("asked for")))[0];
                    assert_eq!(amax, 900.0, "{what}: amax");
                    assert_same_bits(
                        &format!("{what}, row"),
                        &values_f32(wrap::<2>(casts.row)),
                        &row_ref,
                    );
                    assert_same_bits(
                        &format!("{what}, transposed"),
                        &values_f32(wrap::<2>(casts.transposed)),
                        &transposed_ref,
                    );
                }
            }
            for (transpose, want) in [(true, &transposed_ref), (false, &row_ref)] {
                let got = values_f32(wrap::<2>(quantize(
                    raw(x.clone()),
                    &scale,
                    target,
                    transpose,
                )));
                assert_same_bits(
                    &format!("{name} quantize transpose={transpose}"),
                    &got,
                    want,
                );
            }
        }
    }
}

/// The blockwise cast kernels (`fp8_blocks::quantize_blockwise`: the row-major one, a block of
/// 32 threads, and the transposed one, tiles of 128 rows × 32 columns; `quantize_squares` in
/// both layouts, with 3 column blocks, whose scale rows are padded to 4) against the Burn
/// composition of `burn-megatron` (`quantize_blockwise_composition`) on the same tensors, bit
/// for bit: the FP8 values decoded, the reciprocal scales in cuBLASLt's layout. Blocks whose
/// amaxes span 2^-20 to 2^20, a block of zeros, one holding a NaN and one an infinity (scale
/// 1: the NaN stays NaN, the infinity saturates), f32 and f16, both formats, margins 0 and 2.
#[test]
fn the_blockwise_casts_match_the_composition() {
    use burn_megatron::ops::fp8::{Fp8Blocks, quantize_blockwise_composition};
    use burn_megatron_kernels::fused::fp8_blocks::{quantize_blockwise, quantize_squares};
    let device = WgpuDevice::default();
    let (rows, cols) = (256, 384);
    let mut data = random(rows * cols, 42, 1.0);
    for (i, v) in data.iter_mut().enumerate() {
        let (r, c) = (i / cols, i % cols);
        *v *= 2f32.powi((r % 41) as i32 - 20 + (c / 128) as i32);
        if r >= 128 && c < 128 {
            *v = 0.0;
        }
    }
    data[5 * cols + 300] = f32::NAN;
    data[200 * cols + 130] = f32::INFINITY;
    for dtype in [DType::F32, DType::F16] {
        let x = Tensor::<W, 2>::from_data(TensorData::new(data.clone(), [rows, cols]), &device)
            .cast(dtype);
        for (kind, fp8_dtype) in [
            (Fp8Kind::E4M3, Fp8Dtype::E4M3),
            (Fp8Kind::E5M2, Fp8Dtype::E5M2),
        ] {
            for margin in [0, 2] {
                for (blocks, transpose) in [
                    (Fp8Blocks::Row, false),
                    (Fp8Blocks::Row, true),
                    (Fp8Blocks::Square, false),
                    (Fp8Blocks::Square, true),
                ] {
                    let what = format!(
                        "{dtype:?} {kind:?} {blocks:?} margin {margin} transposed {transpose}"
                    );
                    let cast = match blocks {
                        Fp8Blocks::Row => quantize_blockwise,
                        Fp8Blocks::Square => quantize_squares,
                    };
                    let target = CastTarget::Fp8InU32(kind);
                    let (q, inv) = cast(raw(x.clone()), target, margin, transpose);
                    let (want_q, want_inv) = quantize_blockwise_composition(
                        x.clone(),
                        fp8_dtype,
                        blocks,
                        margin,
                        transpose,
                    );
                    let got: Vec<f64> = fp8_bytes(q).into_iter().map(|b| kind.decode(b)).collect();
                    let want = values(want_q.cast(DType::F32));
                    let differ = (0..want.len())
                        .filter(|&i| !(got[i] == want[i] || got[i].is_nan() && want[i].is_nan()))
                        .count();
                    assert_eq!(differ, 0, "{what}: values differ");
                    assert_same_bits(&what, &values_f32(wrap::<1>(inv)), &values_f32(want_inv));
                }
            }
        }
    }
}

/// `fp8_blocks::quantize_blockwise_both` and `quantize_squares_both` (both layouts of the
/// blockwise casts from one read, a cube a 128 × 128 tile) against the kernel of each layout,
/// bit for bit: the bytes and the reciprocal scales (the squares' padded rows included) of
/// 2 × 3 tiles whose blocks' amaxes span 2^-20 to 2^20, with a tile of zeros, a NaN and an
/// infinity (whose block, at scale 1, holds values at both formats' boundaries), f32 and
/// f16, both formats, margins 0 and 3.
#[test]
fn the_blockwise_casts_of_both_layouts_match_each_layouts_kernel() {
    use burn_megatron_kernels::fused::fp8_blocks::{
        both_layouts_width, quantize_blockwise, quantize_blockwise_both, quantize_squares,
        quantize_squares_both,
    };
    let device = WgpuDevice::default();
    let (rows, cols) = (256, 384);
    let mut data = random(rows * cols, 7, 1.0);
    for (i, v) in data.iter_mut().enumerate() {
        let (r, c) = (i / cols, i % cols);
        *v *= 2f32.powi((r % 41) as i32 - 20 + (c % 37) as i32 / 4);
        if r >= 128 && c < 128 {
            *v = 0.0;
        }
    }
    data[5 * cols + 300] = f32::NAN;
    data[200 * cols + 130] = f32::INFINITY;
    data[131 * cols + 260] = -3.0e38;
    // The infinity leaves its row's block at scale 1: values at both formats' boundaries
    // (largest finite, the midpoints above it, smallest normals, subnormals) cast as they are.
    let edges = [
        447.0,
        448.0,
        449.0,
        463.9,
        464.0,
        465.0,
        479.0,
        480.0,
        500.0,
        511.9,
        512.0,
        57343.0,
        57344.0,
        57345.0,
        61439.0,
        61440.0,
        65504.0,
        0.015625,
        0.0156,
        0.0009765625,
        0.001,
        6.1035156e-5,
        6.1e-5,
        1.0e-6,
        3.0e-8,
        0.0,
    ];
    for (i, edge) in edges.iter().enumerate() {
        data[200 * cols + 131 + 2 * i] = *edge;
        data[200 * cols + 132 + 2 * i] = -*edge;
    }
    for dtype in [DType::F32, DType::F16] {
        let x = Tensor::<W, 2>::from_data(TensorData::new(data.clone(), [rows, cols]), &device)
            .cast(dtype);
        // The one-read kernel runs (not the fallback to the one-layout kernels).
        assert_eq!(both_layouts_width(&raw(x.clone())), Some(4), "{dtype:?}");
        for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
            for margin in [0, 3] {
                let target = CastTarget::Fp8InU32(kind);
                for square in [false, true] {
                    let both = match square {
                        false => quantize_blockwise_both(raw(x.clone()), target, margin),
                        true => quantize_squares_both(raw(x.clone()), target, margin),
                    };
                    for (transpose, (q, inv)) in [false, true].into_iter().zip(both) {
                        let what = format!(
                            "{dtype:?} {kind:?} margin {margin} squares {square} transposed {transpose}"
                        );
                        let one_layout = match square {
                            false => quantize_blockwise,
                            true => quantize_squares,
                        };
                        let (want_q, want_inv) =
                            one_layout(raw(x.clone()), target, margin, transpose);
                        assert_eq!(
                            q.meta.shape().to_vec(),
                            want_q.meta.shape().to_vec(),
                            "{what}"
                        );
                        let (got, want) = (fp8_bytes(q), fp8_bytes(want_q));
                        let differ = (0..want.len()).filter(|&i| got[i] != want[i]).count();
                        assert_eq!(differ, 0, "{what}: bytes differ");
                        assert_same_bits(
                            &what,
                            &values_f32(wrap::<1>(inv)),
                            &values_f32(wrap::<1>(want_inv)),
                        );
                    }
                }
            }
        }
    }
}
