//! The vocabulary-parallel cross-entropy kernels (statistics and gradient): exact values,
//! the composition, strided and pitched rows, and more rows than one grid dimension.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use burn_megatron::ops::CrossEntropyOps;
use burn_megatron::ops::cross_entropy::{VocabSlice, gradient_composition, statistics_composition};
use burn_megatron_kernels::fused::cross_entropy as kernels;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, random, random_4d, raw4};

struct Case {
    rows: usize,
    local: usize,
    slice: VocabSlice,
}

/// Shapes that are not multiples of the 256-thread block, a single element, a row of
/// GPT-2's padded vocabulary, a slice with no real column, and a slice that starts inside the
/// vocabulary (a TP rank's). The kernels read rows as vectors of the widest width that divides
/// the row (at most 4 on wgpu, 8 bf16 on CUDA): the cases take widths 4, 2 and 1, rows of
/// whole vectors and rows whose last real vector `real` cuts, rows shorter than one vector a
/// thread and rows of many unrolled rounds.
fn cases() -> Vec<Case> {
    let case = |rows, local, start, real| Case {
        rows,
        local,
        slice: VocabSlice { start, real },
    };
    vec![
        case(1, 1, 0, 1),
        case(3, 7, 0, 7),
        case(5, 1000, 0, 997),
        case(9, 300, 600, 300),
        case(4, 130, 650, 0),
        case(2, 50_304, 0, 50_257),
        // Width 4: one whole vector; a vector cut after one lane; three lanes of padding.
        case(4, 8, 0, 8),
        case(4, 8, 0, 5),
        case(4, 12, 40, 9),
        // Width 2, and a row of unrolled rounds, a remainder and a cut vector.
        case(4, 6, 0, 6),
        case(4, 4100, 0, 4099),
        // Padding vectors past the cut one, in a slice inside the vocabulary.
        case(4, 2048, 1000, 1023),
        // Width 1 (an odd row): the scalar path over a ragged GPT-2-sized row.
        case(4, 50_307, 0, 50_300),
    ]
}

fn inputs(case: &Case, dtype: DType, device: &WgpuDevice) -> (Tensor<W, 2>, Tensor<W, 1, Int>) {
    let Case { rows, local, slice } = *case;
    let logits = Tensor::<W, 2>::from_data(
        TensorData::new(random(rows * local, 7, 8.0), [rows, local]),
        device,
    )
    .cast(dtype);
    // Targets inside the slice, outside it (another rank's), ignored (-100), and the last real
    // column (in the vector `real` cuts, when it cuts one).
    let targets: Vec<i32> = (0..rows)
        .map(|r| match r % 4 {
            0 => (slice.start + (r * 31) % slice.real.max(1)) as i32,
            1 => (slice.start + slice.real + 5) as i32,
            2 => -100,
            _ => (slice.start + slice.real) as i32 - 1,
        })
        .collect();
    let targets = Tensor::<W, 1, Int>::from_data(TensorData::new(targets, [rows]), device);
    (logits, targets)
}

/// `[max, Σ exp(x - max), target logit]` of each row in f64 on the host: the exact values.
fn exact_statistics(logits: &[f64], targets: &[i64], case: &Case) -> [Vec<f64>; 3] {
    let Case { rows, local, slice } = *case;
    let mut out = [vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]];
    for r in 0..rows {
        let row = &logits[r * local..r * local + slice.real];
        let max = row.iter().cloned().fold(-1.0e30, f64::max);
        out[0][r] = max;
        out[1][r] = row.iter().map(|x| (x - max).exp()).sum();
        let column = targets[r] - slice.start as i64;
        if column >= 0 && (column as usize) < slice.real {
            out[2][r] = row[column as usize];
        }
    }
    out
}

#[test]
fn cross_entropy_statistics_are_exact_and_equal_the_composition() {
    let device = WgpuDevice::default();
    for dtype in [DType::F32, DType::F16] {
        for case in cases() {
            let (logits, targets) = inputs(&case, dtype, &device);
            let host_targets: Vec<i64> = targets
                .clone()
                .into_data()
                .convert::<i64>()
                .to_vec()
                .expect("i64 targets");
            let exact = exact_statistics(&values(logits.clone()), &host_targets, &case);
            let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), case.slice);
            let plain = statistics_composition(logits, targets, case.slice);
            let names = ["max", "sum_exp", "target_logit"];
            for (((name, fused), plain), exact) in names.iter().zip(fused).zip(plain).zip(&exact) {
                assert_eq!(fused.dtype(), DType::F32, "statistics are f32");
                let label = format!(
                    "{dtype:?} {}x{} {:?} {name}",
                    case.rows, case.local, case.slice
                );
                let fused = values(fused);
                assert_close(
                    &format!("{label} (fused vs exact)"),
                    &fused,
                    exact,
                    tolerance::F32,
                );
                // Burn's own sum of a 50k-column f32 row on wgpu is off by ~5e-5 from the exact
                // value (the fused kernel by ~1e-7), hence the wider bound here.
                assert_close(
                    &format!("{label} (Burn ops vs fused)"),
                    &values(plain),
                    &fused,
                    tolerance::F32_LONG_SUM,
                );
            }
        }
    }
}

#[test]
fn cross_entropy_gradient_equals_the_composition_and_writes_every_element() {
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for case in cases() {
            let (logits, targets) = inputs(&case, dtype, &device);
            let [max, sum_exp, _] =
                statistics_composition(logits.clone(), targets.clone(), case.slice);
            let grad_loss = Tensor::<W, 1>::from_data(
                TensorData::new(random(case.rows, 3, 1.0), [case.rows]),
                &device,
            );
            let plain = gradient_composition(
                logits.clone(),
                targets.clone(),
                max.clone(),
                sum_exp.clone(),
                grad_loss.clone(),
                case.slice,
            );
            // Poisoned: an element the kernel leaves unwritten stays NaN and fails the check.
            let poisoned =
                Tensor::<W, 2>::full([case.rows, case.local], f32::NAN, &device).cast(dtype);
            let raw = |t: Tensor<W, 1>| t.into_primitive().tensor();
            kernels::gradient_into(
                logits.into_primitive().tensor(),
                targets.into_primitive(),
                raw(max),
                raw(sum_exp),
                raw(grad_loss),
                kernels::VocabSlice {
                    start: case.slice.start,
                    real: case.slice.real,
                },
                poisoned.clone().into_primitive().tensor(),
            );
            let fused: Tensor<W, 2> =
                Tensor::from_primitive(TensorPrimitive::Float(poisoned.into_primitive().tensor()));
            assert_eq!(fused.dtype(), dtype);
            let label = format!(
                "{dtype:?} {}x{} {:?} gradient",
                case.rows, case.local, case.slice
            );
            assert_close(&label, &values(fused), &values(plain), bound);
        }
    }
}

/// Inputs whose rows are not packed (a narrowed view: as our CUDA runtime pitches rows to an
/// aligned size) are read in place, by stride.
#[test]
fn kernels_read_strided_rows_in_place() {
    use burn_megatron::ops::causal_softmax::{backward_composition, forward_composition};
    let device = WgpuDevice::default();
    let (rows, local, pad) = (6, 300, 13);
    let slice = VocabSlice {
        start: 0,
        real: 297,
    };
    let wide = Tensor::<W, 2>::from_data(
        TensorData::new(random(rows * (local + pad), 5, 8.0), [rows, local + pad]),
        &device,
    );
    let logits = wide.narrow(1, 0, local);
    let targets = Tensor::<W, 1, Int>::from_data(
        TensorData::new(vec![3i32, 299, -100, 0, 296, 150], [rows]),
        &device,
    );
    let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), slice);
    let plain = statistics_composition(logits.clone(), targets.clone(), slice);
    for (i, (a, b)) in fused.into_iter().zip(plain).enumerate() {
        assert_close(
            &format!("strided statistic {i}"),
            &values(a),
            &values(b),
            tolerance::F32,
        );
    }
    let [max, sum_exp, _] = statistics_composition(logits.clone(), targets.clone(), slice);
    let grad_loss = Tensor::<W, 1>::ones([rows], &device);
    let want = gradient_composition(
        logits.clone(),
        targets.clone(),
        max.clone(),
        sum_exp.clone(),
        grad_loss.clone(),
        slice,
    );
    let got = W::cross_entropy_gradient(logits, targets, max, sum_exp, grad_loss, slice);
    assert_close(
        "strided gradient",
        &values(got),
        &values(want),
        tolerance::F32,
    );

    let shape = [2, 3, 40, 40];
    let wide = random_4d([2, 3, 40, 47], 9, 20.0, DType::F32, &device);
    let scores = wide.narrow(3, 0, 40);
    assert_eq!(scores.dims(), shape);
    let want = forward_composition(scores.clone(), 0.5);
    let got = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(
        burn_megatron_kernels::fused::causal_softmax::forward(raw4(scores), 0.5),
    ));
    assert_close(
        "strided softmax",
        &values(got.clone()),
        &values(want.clone()),
        tolerance::F32,
    );
    let grad = random_4d([2, 3, 40, 47], 10, 1.0, DType::F32, &device).narrow(3, 0, 40);
    let expect = backward_composition(want.clone(), grad.clone(), 0.5);
    let got = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(
        burn_megatron_kernels::fused::causal_softmax::backward(raw4(want), raw4(grad), 0.5),
    ));
    assert_close(
        "strided softmax gradient",
        &values(got),
        &values(expect),
        tolerance::F32,
    );
}

/// Pitched rows whose stride allows vector reads (as our CUDA runtime pitches GPT-2's 50304
/// columns to 50432): the cross-entropy kernels read the logits by vector in place and write
/// the gradient into a pitched output, every element of the view and nothing past it.
#[test]
fn cross_entropy_reads_and_writes_pitched_rows_by_vector() {
    let device = WgpuDevice::default();
    let (rows, local, pitch, out_pitch) = (6, 304, 312, 320);
    let slice = VocabSlice {
        start: 0,
        real: 301,
    };
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        let label = |what: &str| format!("{dtype:?} pitched {what}");
        let wide = Tensor::<W, 2>::from_data(
            TensorData::new(random(rows * pitch, 21, 8.0), [rows, pitch]),
            &device,
        )
        .cast(dtype);
        let logits = wide.narrow(1, 0, local);
        // The last real column (in the vector `real` cuts), a padding column, ignored, ...
        let targets = Tensor::<W, 1, Int>::from_data(
            TensorData::new(vec![300i32, 303, -100, 0, 150, 299], [rows]),
            &device,
        );
        let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), slice);
        let plain = statistics_composition(logits.clone(), targets.clone(), slice);
        for (name, (a, b)) in ["max", "sum_exp", "target_logit"]
            .iter()
            .zip(fused.into_iter().zip(plain))
        {
            assert_close(&label(name), &values(a), &values(b), tolerance::F32);
        }

        let [max, sum_exp, _] = statistics_composition(logits.clone(), targets.clone(), slice);
        let grad_loss =
            Tensor::<W, 1>::from_data(TensorData::new(random(rows, 22, 1.0), [rows]), &device);
        let want = gradient_composition(
            logits.clone(),
            targets.clone(),
            max.clone(),
            sum_exp.clone(),
            grad_loss.clone(),
            slice,
        );
        let out = Tensor::<W, 2>::full([rows, out_pitch], f32::NAN, &device).cast(dtype);
        let raw = |t: Tensor<W, 1>| t.into_primitive().tensor();
        kernels::gradient_into(
            logits.into_primitive().tensor(),
            targets.into_primitive(),
            raw(max),
            raw(sum_exp),
            raw(grad_loss),
            kernels::VocabSlice {
                start: slice.start,
                real: slice.real,
            },
            out.clone().narrow(1, 0, local).into_primitive().tensor(),
        );
        assert_close(
            &label("gradient"),
            &values(out.clone().narrow(1, 0, local)),
            &values(want),
            bound,
        );
        let past = values(out.narrow(1, local, out_pitch - local));
        assert!(
            past.iter().all(|x| x.is_nan()),
            "{}",
            label("gradient wrote past its view")
        );
    }
}

/// More rows than one grid dimension holds (65535 cubes on some backends): the kernels' grid
/// goes on in its second dimension.
#[test]
fn cross_entropy_kernels_cover_more_rows_than_one_grid_dimension() {
    let device = WgpuDevice::default();
    let case = Case {
        rows: 65_537,
        local: 5,
        slice: VocabSlice { start: 0, real: 4 },
    };
    let (logits, targets) = inputs(&case, DType::F32, &device);
    let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), case.slice);
    let plain = statistics_composition(logits.clone(), targets.clone(), case.slice);
    for (name, (a, b)) in ["max", "sum_exp", "target_logit"]
        .iter()
        .zip(fused.into_iter().zip(plain))
    {
        assert_close(name, &values(a), &values(b), tolerance::F32);
    }
    let [max, sum_exp, _] = statistics_composition(logits.clone(), targets.clone(), case.slice);
    let grad_loss = Tensor::<W, 1>::ones([case.rows], &device);
    let want = gradient_composition(
        logits.clone(),
        targets.clone(),
        max.clone(),
        sum_exp.clone(),
        grad_loss.clone(),
        case.slice,
    );
    let got = W::cross_entropy_gradient(logits, targets, max, sum_exp, grad_loss, case.slice);
    assert_close("gradient", &values(got), &values(want), tolerance::F32);
}
