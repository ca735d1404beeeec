//! The bias-GeLU kernels (forward, backward, and the backward with the bias gradient).

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron::ops::GeluOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, matrix, random, raw, vector, wrap};

/// `gelu(x + bias)` and its derivative as one kernel each (`GeluOps::bias_gelu` and
/// `bias_gelu_backward` on a CubeCL backend) against the Burn compositions, both forms, with
/// and without a bias, on a narrowed (strided) `x`, with values out to ±12 (past the tanh
/// form's clamp) and sizes that are not multiples of the 256-thread cube.
// ANCHOR: test
#[test]
fn bias_gelu_equals_the_composition() {
    use burn_megatron::ops::GeluForm;
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for form in [GeluForm::Erf, GeluForm::Tanh] {
            // (rows, columns, extra columns the view leaves out): odd row pitches read
            // element by element, packed rows of a multiple of 4 as vectors.
            for (rows, cols, extra) in [(1, 1, 5), (7, 300, 5), (33, 129, 5), (9, 256, 0)] {
                for with_bias in [false, true] {
                    let wide = Tensor::<W, 2>::from_data(
                        TensorData::new(
                            random(rows * (cols + extra), 3, 12.0),
                            [rows, cols + extra],
                        ),
                        &device,
                    )
                    .cast(dtype);
                    let x = wide.narrow(1, extra.min(2), cols);
                    let bias = with_bias.then(|| {
                        Tensor::<W, 1>::from_data(
                            TensorData::new(random(cols, 4, 1.0), [cols]),
                            &device,
                        )
                        .cast(dtype)
                    });
                    let grad = Tensor::<W, 2>::from_data(
                        TensorData::new(random(rows * cols, 5, 1.0), [rows, cols]),
                        &device,
                    )
                    .cast(dtype);
                    let biased = |x: Tensor<W, 2>| match &bias {
                        Some(b) => x + b.clone().unsqueeze(),
                        None => x,
                    };
                    // The compositions in f32, so that the bound measures the kernel alone.
                    let wide32 = |t: Tensor<W, 2>| t.cast(DType::F32);
                    let forward_reference = form.forward(wide32(biased(x.clone())));
                    let backward_reference =
                        wide32(grad.clone()) * form.derivative(wide32(biased(x.clone())));
                    let forward = W::bias_gelu(x.clone(), bias.clone(), form);
                    let backward =
                        W::bias_gelu_backward(x.clone(), bias.clone(), grad.clone(), form);
                    assert_eq!(forward.dtype(), dtype);
                    assert_eq!(backward.dtype(), dtype);
                    let name = format!("{form:?} {dtype:?} {rows}x{cols} bias {with_bias}");
                    assert_close(
                        &format!("forward {name}"),
                        &values(forward.cast(DType::F32)),
                        &values(forward_reference),
                        bound,
                    );
                    assert_close(
                        &format!("backward {name}"),
                        &values(backward.cast(DType::F32)),
                        &values(backward_reference),
                        bound,
                    );
                }
            }
        }
    }
}
// ANCHOR_END: test

/// The bias-GeLU backward with the bias gradient's first stage inside it
/// (`bias_gelu::backward_and_bias_gradient`, `GeluOps::bias_gelu_backward_and_bias_gradient`
/// on a CubeCL backend) gives the bits of the backward kernel followed by the column sum of
/// `dx`: both forms, f32 and f16 storage, one row, fewer rows than a block and several blocks
/// with a partial last one, strided views (element by element) and packed rows (vectors), into
/// poisoned outputs.
#[test]
fn bias_gelu_backward_with_the_bias_gradient_equals_the_two_kernels() {
    use burn_megatron::ops::GeluForm;
    use burn_megatron_kernels::fused::bias_gelu::{
        Form, backward, backward_and_bias_gradient, backward_and_bias_gradient_with,
    };
    use burn_megatron_kernels::fused::column_sum::column_sum;
    let device = WgpuDevice::default();
    let bits = |t: Tensor<W, 2>| -> Vec<u64> { values(t).iter().map(|v| v.to_bits()).collect() };
    let bits1 = |t: Tensor<W, 1>| -> Vec<u64> { values(t).iter().map(|v| v.to_bits()).collect() };
    for dtype in [DType::F32, DType::F16] {
        for (rows, cols, extra) in [(1, 8, 0), (7, 300, 5), (200, 129, 1), (130, 2052, 0)] {
            let view = |seed, scale| {
                matrix(rows, cols + extra, seed, scale, &device)
                    .cast(dtype)
                    .narrow(1, 0, cols)
            };
            let (x, grad) = (view(101, 6.0), view(102, 1.0));
            let bias = vector(cols, 103, 0.5, &device).cast(dtype);
            for (form, model_form) in [(Form::Erf, GeluForm::Erf), (Form::Tanh, GeluForm::Tanh)] {
                let name = format!("{dtype:?} {rows}x{cols} {form:?}");
                let dx = wrap::<2>(backward(
                    raw(x.clone()),
                    Some(raw(bias.clone())),
                    raw(grad.clone()),
                    form,
                ));
                let db = wrap::<1>(column_sum(raw(dx.clone()), dtype));
                let (want_dx, want_db) = (bits(dx), bits1(db));
                // Poison the pool with the outputs' sizes (see the layouts' test).
                drop((
                    Tensor::<W, 2>::full([rows, cols], f32::NAN, &device).cast(dtype),
                    Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dtype),
                ));
                let (dx, db) = backward_and_bias_gradient(
                    raw(x.clone()),
                    raw(bias.clone()),
                    raw(grad.clone()),
                    form,
                );
                let (got_dx, got_db) = (bits(wrap::<2>(dx)), bits1(wrap::<1>(db)));
                assert_eq!(got_dx, want_dx, "dx {name}");
                assert_eq!(got_db, want_db, "db {name}");
                assert!(
                    got_db.iter().all(|&b| f64::from_bits(b).is_finite()),
                    "db {name}: not finite"
                );
                assert!(
                    got_dx.iter().all(|&b| f64::from_bits(b).is_finite()),
                    "dx {name}: not finite"
                );
                // Any number of rows in flight, a partial last group included: the same bits.
                for rows_in_flight in [1, 3] {
                    let (dx, db) = backward_and_bias_gradient_with(
                        rows_in_flight,
                        raw(x.clone()),
                        raw(bias.clone()),
                        raw(grad.clone()),
                        form,
                    );
                    assert_eq!(
                        bits(wrap::<2>(dx)),
                        want_dx,
                        "dx {name} {rows_in_flight} rows"
                    );
                    assert_eq!(
                        bits1(wrap::<1>(db)),
                        want_db,
                        "db {name} {rows_in_flight} rows"
                    );
                }
                // Through the backend, as the autodiff node calls it.
                let (dx, db) = W::bias_gelu_backward_and_bias_gradient(
                    x.clone(),
                    bias.clone(),
                    grad.clone(),
                    model_form,
                );
                assert_eq!(bits(dx), want_dx, "backend dx {name}");
                assert_eq!(bits1(db), want_db, "backend db {name}");
            }
        }
    }
}
