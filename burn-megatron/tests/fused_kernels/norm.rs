//! The LayerNorm and RMSNorm kernels: compositions, exact values, layouts, determinism.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor};
use burn_megatron::ops::NormOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, matrix, raw, vector, wrap};

/// Hidden sizes of the norm tests: one element, fewer than a cube's threads, not a multiple
/// of the block, and the widest rows (16k) the model takes.
const NORM_SHAPES: [(usize, usize); 5] = [(3, 1), (37, 7), (70, 300), (5, 4099), (3, 16_384)];

/// LayerNorm and RMSNorm (`NormOps::norm_forward` and `norm_backward` on a CubeCL
/// backend: one kernel forward, three backward) against the Burn compositions in f32, for f32
/// and f16 storage, with and without a shift, on narrowed (strided) `x` and `dy` whose rows
/// are not packed, for rows of 1 to 16k elements and row counts that are not multiples of the
/// column stage's 32-row blocks. Every output is first poisoned with NaN, so an unwritten
/// element fails.
#[test]
fn norm_equals_the_composition_and_writes_every_element() {
    use burn_megatron::ops::NormKind;
    use burn_megatron::ops::norm::{backward_composition, forward_composition};
    use burn_megatron_kernels::fused::norm as kernels;
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, hidden) in NORM_SHAPES {
            // A one-element RMSNorm row has `dx = dy · scale · rstd · eps / (x² + eps)`, the
            // difference of two nearly equal terms: with eps = 1e-5 it is f32 rounding noise
            // in any implementation, so that row gets an eps that keeps it well conditioned.
            let epsilon = if hidden == 1 { 0.1 } else { 1e-5 };
            // Burn slices in place only where the cut is aligned (else it copies): a start of
            // 0 and 128 dropped columns keep both views strided, which the asserts check.
            let x = matrix(rows, hidden + 128, 31, 4.0, &device)
                .add_scalar(1.5)
                .cast(dtype)
                .narrow(1, 0, hidden);
            let grad = matrix(rows, hidden + 128, 32, 1.0, &device)
                .cast(dtype)
                .narrow(1, 0, hidden);
            if rows > 1 {
                assert!(!raw(x.clone()).is_contiguous(), "x is a strided view");
                assert!(!raw(grad.clone()).is_contiguous(), "dy is a strided view");
            }
            let scale = vector(hidden, 33, 1.0, &device).cast(dtype);
            let shift = vector(hidden, 34, 0.0, &device).cast(dtype);
            let f32_of = |t: Tensor<W, 2>| t.cast(DType::F32);
            for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
                for with_shift in [true, false] {
                    let name = format!("{kind:?} {dtype:?} {rows}x{hidden} shift {with_shift}");
                    let shift = with_shift.then(|| shift.clone());
                    let want = forward_composition(
                        f32_of(x.clone()),
                        scale.clone().cast(DType::F32),
                        shift.clone().map(|s| s.cast(DType::F32)),
                        kind,
                        epsilon,
                    );
                    let got =
                        W::norm_forward(x.clone(), scale.clone(), shift.clone(), kind, epsilon);
                    assert_eq!(got.output.dtype(), dtype);
                    assert_eq!(got.rstd.dtype(), DType::F32);
                    assert_close(
                        &format!("output {name}"),
                        &values(got.output.cast(DType::F32)),
                        &values(want.output),
                        bound,
                    );
                    assert_close(
                        &format!("rstd {name}"),
                        &values(got.rstd.clone()),
                        &values(want.rstd.clone()),
                        tolerance::F32,
                    );
                    if kind == NormKind::LayerNorm {
                        assert_close(
                            &format!("mean {name}"),
                            &values(got.mean.clone()),
                            &values(want.mean.clone()),
                            tolerance::F32,
                        );
                    }

                    // Poisoned outputs, written by the kernels directly.
                    let nan = |shape: [usize; 2], dtype| {
                        Tensor::<W, 2>::full(shape, f32::NAN, &device).cast(dtype)
                    };
                    let poisoned = kernels::Forward {
                        output: raw(nan([rows, hidden], dtype)),
                        mean: raw(nan([1, rows], DType::F32).reshape([rows])),
                        rstd: raw(nan([1, rows], DType::F32).reshape([rows])),
                    };
                    let kernel_kind = match kind {
                        NormKind::LayerNorm => kernels::Kind::LayerNorm,
                        NormKind::RmsNorm => kernels::Kind::RmsNorm,
                    };
                    let (output, mean, rstd) = (
                        poisoned.output.clone(),
                        poisoned.mean.clone(),
                        poisoned.rstd.clone(),
                    );
                    kernels::forward_into(
                        raw(x.clone()),
                        raw(scale.clone()),
                        shift.clone().map(raw),
                        kernel_kind,
                        epsilon,
                        poisoned,
                    );
                    assert_close(
                        &format!("poisoned output {name}"),
                        &values(wrap::<2>(output).cast(DType::F32)),
                        &values(
                            forward_composition(
                                f32_of(x.clone()),
                                scale.clone().cast(DType::F32),
                                shift.clone().map(|s| s.cast(DType::F32)),
                                kind,
                                epsilon,
                            )
                            .output,
                        ),
                        bound,
                    );
                    assert_close(
                        &format!("poisoned rstd {name}"),
                        &values(wrap::<1>(rstd)),
                        &values(want.rstd.clone()),
                        tolerance::F32,
                    );
                    // RMSNorm's mean is zero; the kernel writes it all the same.
                    assert_eq!(
                        values(wrap::<1>(mean))
                            .iter()
                            .map(|m| m.is_finite())
                            .collect::<Vec<_>>(),
                        vec![true; rows],
                        "{name}: every mean is written"
                    );

                    let want_grads = backward_composition(
                        f32_of(x.clone()),
                        scale.clone().cast(DType::F32),
                        want.mean.clone(),
                        want.rstd.clone(),
                        f32_of(grad.clone()),
                        kind,
                        with_shift,
                    );
                    let poisoned = kernels::Gradients {
                        x: raw(nan([rows, hidden], dtype)),
                        scale: raw(nan([1, hidden], DType::F32).reshape([hidden])),
                        shift: with_shift
                            .then(|| raw(nan([1, hidden], DType::F32).reshape([hidden]))),
                    };
                    let (gx, gscale, gshift) = (
                        poisoned.x.clone(),
                        poisoned.scale.clone(),
                        poisoned.shift.clone(),
                    );
                    kernels::backward_into(
                        raw(x.clone()),
                        raw(scale.clone()),
                        raw(got.mean.clone()),
                        raw(got.rstd.clone()),
                        raw(grad.clone()),
                        kernel_kind,
                        poisoned,
                    );
                    let got_grads = W::norm_backward(
                        x.clone(),
                        scale.clone(),
                        got.mean,
                        got.rstd,
                        grad.clone(),
                        kind,
                        with_shift,
                    );
                    assert_eq!(got_grads.x.dtype(), dtype);
                    assert_eq!(got_grads.scale.dtype(), dtype);
                    for (what, got, want) in [
                        (
                            "dx",
                            values(wrap::<2>(gx).cast(DType::F32)),
                            values(want_grads.x.clone()),
                        ),
                        (
                            "dx (hook)",
                            values(got_grads.x.cast(DType::F32)),
                            values(want_grads.x),
                        ),
                        (
                            "dscale",
                            values(wrap::<1>(gscale)),
                            values(want_grads.scale.clone()),
                        ),
                        (
                            "dscale (hook)",
                            values(got_grads.scale.cast(DType::F32)),
                            values(want_grads.scale),
                        ),
                    ] {
                        assert_close(&format!("{what} {name}"), &got, &want, bound);
                    }
                    match (gshift, got_grads.shift, want_grads.shift) {
                        (Some(kernel), Some(hook), Some(want)) => {
                            assert_close(
                                &format!("dshift {name}"),
                                &values(wrap::<1>(kernel)),
                                &values(want.clone()),
                                bound,
                            );
                            assert_close(
                                &format!("dshift (hook) {name}"),
                                &values(hook.cast(DType::F32)),
                                &values(want),
                                bound,
                            );
                        }
                        (None, None, None) => assert!(!with_shift),
                        _ => panic!("{name}: a shift gradient only with a shift"),
                    }
                }
            }
        }
    }
}

/// The norm kernels against the formulas evaluated in f64 on the host, for a small LayerNorm
/// with a shift and an RMSNorm: output, `dx`, `dscale` and `dshift`.
#[test]
fn norm_kernels_equal_exact_f64_values() {
    use burn_megatron::ops::NormKind;
    let device = WgpuDevice::default();
    let (rows, hidden, epsilon) = (5, 9, 1e-5);
    let x = matrix(rows, hidden, 41, 3.0, &device).add_scalar(2.0);
    let grad = matrix(rows, hidden, 42, 1.0, &device);
    let scale = vector(hidden, 43, 1.0, &device);
    let shift = vector(hidden, 44, 0.0, &device);
    let (xs, gs, ss, bs) = (
        values(x.clone()),
        values(grad.clone()),
        values(scale.clone()),
        values(shift.clone()),
    );
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        let n = hidden as f64;
        let (mut y, mut dx) = (vec![], vec![]);
        let (mut dscale, mut dshift) = (vec![0.0; hidden], vec![0.0; hidden]);
        for r in 0..rows {
            let row = &xs[r * hidden..(r + 1) * hidden];
            let dy = &gs[r * hidden..(r + 1) * hidden];
            let mean = match kind {
                NormKind::LayerNorm => row.iter().sum::<f64>() / n,
                NormKind::RmsNorm => 0.0,
            };
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            let rstd = 1.0 / (var + epsilon).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
            let g: Vec<f64> = (0..hidden).map(|j| dy[j] * ss[j]).collect();
            let mean_g = match kind {
                NormKind::LayerNorm => g.iter().sum::<f64>() / n,
                NormKind::RmsNorm => 0.0,
            };
            let mean_gx = (0..hidden).map(|j| g[j] * xhat[j]).sum::<f64>() / n;
            for j in 0..hidden {
                y.push(xhat[j] * ss[j] + bs[j]);
                dx.push(rstd * (g[j] - mean_g - xhat[j] * mean_gx));
                dscale[j] += dy[j] * xhat[j];
                dshift[j] += dy[j];
            }
        }
        let forward = W::norm_forward(x.clone(), scale.clone(), Some(shift.clone()), kind, epsilon);
        let grads = W::norm_backward(
            x.clone(),
            scale.clone(),
            forward.mean,
            forward.rstd,
            grad.clone(),
            kind,
            true,
        );
        let name = |what: &str| format!("{kind:?} {what} against f64");
        assert_close(&name("output"), &values(forward.output), &y, tolerance::F32);
        assert_close(&name("dx"), &values(grads.x), &dx, tolerance::F32);
        assert_close(
            &name("dscale"),
            &values(grads.scale),
            &dscale,
            tolerance::F32,
        );
        assert_close(
            &name("dshift"),
            &values(grads.shift.expect("asked for")),
            &dshift,
            tolerance::F32,
        );
    }
}

/// The norm backward's work layouts (`NormBackwardLayout`: bytes a thread, blocks, the second
/// stage's shape, CubeCL's bounds checks) give the default layout's gradients, with the last
/// block ending inside the rows and rows shorter than a thread group; the bounds checks alone
/// give its bits.
#[test]
fn norm_backward_layouts_agree() {
    use burn_megatron_kernels::fused::norm::{self, Kind, NormBackwardLayout};
    let device = WgpuDevice::default();
    let layouts = [
        NormBackwardLayout {
            totals: burn_megatron_kernels::fused::column_sum::ColumnSumLayout {
                total_columns: 32,
                total_lanes: 8,
                ..Default::default()
            },
            ..NormBackwardLayout::default()
        },
        NormBackwardLayout {
            bytes_per_thread: 16,
            target_threads: 1 << 10,
            rows_per_block: (3, 5),
            ..NormBackwardLayout::default()
        },
        NormBackwardLayout {
            bytes_per_thread: 64,
            target_threads: 1 << 12,
            rows_per_block: (1, 200),
            ..NormBackwardLayout::default()
        },
        NormBackwardLayout {
            checked: true,
            ..NormBackwardLayout::default()
        },
    ];
    let default = NormBackwardLayout::default();
    // CubeCL's bounds checks change no arithmetic: that layout gives the default's bits.
    let same_bits = |layout: &NormBackwardLayout| {
        NormBackwardLayout {
            checked: false,
            ..*layout
        } == default
    };
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, hidden) in [(1, 3), (37, 7), (301, 300), (9, 4099)] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                let x = matrix(rows, hidden, 66, 3.0, &device).cast(dtype);
                let grad = matrix(rows, hidden, 67, 1.0, &device).cast(dtype);
                let scale = vector(hidden, 68, 1.0, &device).cast(dtype);
                let stats = norm::forward(raw(x.clone()), raw(scale.clone()), None, kind, 1e-5);
                let run = |layout: NormBackwardLayout| {
                    let g = norm::backward_with(
                        layout,
                        raw(x.clone()),
                        raw(scale.clone()),
                        stats.mean.clone(),
                        stats.rstd.clone(),
                        raw(grad.clone()),
                        kind,
                        true,
                    );
                    [
                        values(wrap::<2>(g.x).cast(DType::F32)),
                        values(wrap::<1>(g.scale)),
                        values(wrap::<1>(g.shift.expect("asked for"))),
                    ]
                };
                let want = run(NormBackwardLayout::default());
                for (l, layout) in layouts.iter().enumerate() {
                    let got = run(*layout);
                    if same_bits(layout) {
                        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        for (what, (got, want)) in
                            ["dx", "dscale", "dshift"].iter().zip(got.iter().zip(&want))
                        {
                            assert_eq!(
                                bits(got),
                                bits(want),
                                "{what} {kind:?} {dtype:?} {rows}x{hidden} layout {l}: not the default's bits"
                            );
                        }
                    }
                    for (what, got, want) in ["dx", "dscale", "dshift"]
                        .iter()
                        .zip(&got)
                        .zip(&want)
                        .map(|((w, g), v)| (w, g, v))
                    {
                        assert_close(
                            &format!("{what} {kind:?} {dtype:?} {rows}x{hidden} layout {l}"),
                            got,
                            want,
                            bound,
                        );
                    }
                }
            }
        }
    }
}

/// The norm forward's work layouts (`NormForwardLayout`: elements a thread, threads a cube,
/// CubeCL's bounds checks) give the default layout's output and statistics, into poisoned
/// outputs, with rows shorter than a thread group and longer than a cube; the bounds checks
/// alone give its bits.
#[test]
fn norm_forward_layouts_agree() {
    use burn_megatron_kernels::fused::norm::{self, Forward, Kind, NormForwardLayout};
    let device = WgpuDevice::default();
    let default = NormForwardLayout::default();
    let layouts = [
        NormForwardLayout {
            elements_per_thread: 8,
            cube_threads: 512,
            ..default
        },
        NormForwardLayout {
            elements_per_thread: 64,
            cube_threads: 128,
            checked: true,
        },
        NormForwardLayout {
            checked: true,
            ..default
        },
    ];
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, hidden) in [(1, 3), (37, 7), (301, 300), (9, 4099)] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                let x = matrix(rows, hidden, 76, 3.0, &device).cast(dtype);
                let scale = vector(hidden, 77, 1.0, &device).cast(dtype);
                let shift = vector(hidden, 78, 0.5, &device).cast(dtype);
                let run = |layout: NormForwardLayout| {
                    let nan = |shape: [usize; 2], dtype| {
                        Tensor::<W, 2>::full(shape, f32::NAN, &device).cast(dtype)
                    };
                    let out = Forward {
                        output: raw(nan([rows, hidden], dtype)),
                        mean: raw(nan([1, rows], DType::F32).reshape([rows])),
                        rstd: raw(nan([1, rows], DType::F32).reshape([rows])),
                    };
                    let (output, mean, rstd) =
                        (out.output.clone(), out.mean.clone(), out.rstd.clone());
                    norm::forward_into_with(
                        layout,
                        raw(x.clone()),
                        raw(scale.clone()),
                        Some(raw(shift.clone())),
                        kind,
                        1e-5,
                        out,
                        None,
                    );
                    [
                        values(wrap::<2>(output).cast(DType::F32)),
                        values(wrap::<1>(mean)),
                        values(wrap::<1>(rstd)),
                    ]
                };
                let want = run(default);
                for (l, layout) in layouts.iter().enumerate() {
                    let got = run(*layout);
                    let same_bits = NormForwardLayout {
                        checked: false,
                        ..*layout
                    } == default;
                    for (what, (got, want)) in
                        ["output", "mean", "rstd"].iter().zip(got.iter().zip(&want))
                    {
                        let name = format!("{what} {kind:?} {dtype:?} {rows}x{hidden} layout {l}");
                        assert!(got.iter().all(|v| v.is_finite()), "{name}: not finite");
                        if same_bits {
                            let bits =
                                |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(got), bits(want), "{name}: not the default's bits");
                        } else {
                            assert_close(&name, got, want, bound);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn norm_parameter_gradients_are_deterministic() {
    use burn_megatron::ops::NormKind;
    let device = WgpuDevice::default();
    let (rows, hidden) = (1000, 300);
    let x = matrix(rows, hidden, 51, 3.0, &device);
    let grad = matrix(rows, hidden, 52, 1.0, &device);
    let scale = vector(hidden, 53, 1.0, &device);
    let forward = W::norm_forward(x.clone(), scale.clone(), None, NormKind::LayerNorm, 1e-5);
    let run = || {
        let g = W::norm_backward(
            x.clone(),
            scale.clone(),
            forward.mean.clone(),
            forward.rstd.clone(),
            grad.clone(),
            NormKind::LayerNorm,
            true,
        );
        let bits = |t: Tensor<W, 1>| -> Vec<u32> {
            t.into_data()
                .to_vec::<f32>()
                .expect("f32")
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        (bits(g.scale), bits(g.shift.expect("asked for")))
    };
    let (first, second) = (run(), run());
    assert_eq!(
        (first.0.len(), first.1.len()),
        (hidden, hidden),
        "dscale, dshift sizes"
    );
    assert_eq!(
        (second.0.len(), second.1.len()),
        (hidden, hidden),
        "dscale, dshift sizes"
    );
    for bits in [&first.0, &first.1] {
        assert!(
            bits.iter().all(|v| f32::from_bits(*v).is_finite()),
            "not finite"
        );
    }
    let differing = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(a, b)| a != b).count();
    assert_eq!(
        (
            differing(&first.0, &second.0),
            differing(&first.1, &second.1)
        ),
        (0, 0),
        "elements of (dscale, dshift) that differ between two runs"
    );
}

/// `NormOps::add_norm` on a CubeCL backend (the residual add and the norm in one kernel)
/// against the separate add and norm of the same backend, f32 and f16, LayerNorm with a shift
/// and RMSNorm, strided inputs: the sum has the add's bits (rounded to the storage dtype, as
/// the add rounds it), the output the norm of that sum.
#[test]
fn add_norm_equals_the_add_then_the_norm() {
    use burn_megatron::ops::NormKind;
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, hidden) in NORM_SHAPES {
            let strided = |seed: u64| {
                matrix(rows, hidden + 128, seed, 4.0, &device)
                    .cast(dtype)
                    .narrow(1, 0, hidden)
            };
            let (x, residual) = (strided(41), strided(42));
            let scale = vector(hidden, 43, 1.0, &device).cast(dtype);
            let shift = vector(hidden, 44, 0.0, &device).cast(dtype);
            for (kind, shift) in [
                (NormKind::LayerNorm, Some(shift.clone())),
                (NormKind::RmsNorm, None),
            ] {
                let name = format!("{kind:?} {dtype:?} {rows}x{hidden}");
                let [sum, output] = W::add_norm(
                    x.clone(),
                    residual.clone(),
                    scale.clone(),
                    shift.clone(),
                    kind,
                    0.1,
                );
                let want_sum = x.clone() + residual.clone();
                let want = W::norm(want_sum.clone(), scale.clone(), shift.clone(), kind, 0.1);
                assert_eq!(sum.dtype(), dtype);
                assert_eq!(
                    values(sum.cast(DType::F32)),
                    values(want_sum.cast(DType::F32)),
                    "sum {name}"
                );
                assert_close(
                    &format!("output {name}"),
                    &values(output.cast(DType::F32)),
                    &values(want.cast(DType::F32)),
                    bound,
                );
            }
        }
    }
}
