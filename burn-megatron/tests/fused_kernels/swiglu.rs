//! The SwiGLU kernels (forward, backward, and the backward with the bias gradients).

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor};
use burn_megatron::ops::SwiGluOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, matrix, raw, vector, wrap};

/// The SwiGLU backward with both bias gradients' first stage inside it
/// (`swiglu::backward_and_bias_gradients`, `SwiGluOps::swiglu_backward_and_bias_gradients`
/// on a CubeCL backend) gives the bits of the backward kernel followed by the column sums of
/// `d_gate` and `d_up`: f32 and f16 storage, one row, fewer rows than a block and several
/// blocks with a partial last one, strided views (element by element) and packed rows
/// (vectors), into poisoned outputs.
#[test]
fn swiglu_backward_with_the_bias_gradients_equals_the_kernel_and_column_sums() {
    use burn_megatron_kernels::fused::column_sum::column_sum;
    use burn_megatron_kernels::fused::swiglu::{
        Biases, backward, backward_and_bias_gradients, backward_and_bias_gradients_with,
    };
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
            let (gate, up, grad) = (view(111, 6.0), view(112, 2.0), view(113, 1.0));
            let gate_bias = vector(cols, 114, 0.5, &device).cast(dtype);
            let up_bias = vector(cols, 115, -0.5, &device).cast(dtype);
            let biases = || Biases {
                gate: raw(gate_bias.clone()),
                up: raw(up_bias.clone()),
            };
            let name = format!("{dtype:?} {rows}x{cols}");
            let derivatives = backward(
                raw(gate.clone()),
                raw(up.clone()),
                Some(biases()),
                raw(grad.clone()),
            )
            .map(wrap::<2>);
            let want_db = derivatives
                .clone()
                .map(|d| bits1(wrap::<1>(column_sum(raw(d), dtype))));
            let want_d = derivatives.map(bits);
            // Poison the pool with the outputs' sizes (see the layouts' test).
            drop((
                Tensor::<W, 2>::full([rows, cols], f32::NAN, &device).cast(dtype),
                Tensor::<W, 2>::full([rows, cols], f32::NAN, &device).cast(dtype),
                Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dtype),
                Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dtype),
            ));
            let (got_d, got_db) = backward_and_bias_gradients(
                raw(gate.clone()),
                raw(up.clone()),
                biases(),
                raw(grad.clone()),
            );
            let got_d = got_d.map(|d| bits(wrap::<2>(d)));
            let got_db = got_db.map(|d| bits1(wrap::<1>(d)));
            for (i, what) in ["gate", "up"].iter().enumerate() {
                assert_eq!(got_d[i], want_d[i], "d_{what} {name}");
                assert_eq!(got_db[i], want_db[i], "{what} bias gradient {name}");
                assert!(
                    got_d[i].iter().all(|&b| f64::from_bits(b).is_finite()),
                    "d_{what} {name}: not finite"
                );
                assert!(
                    got_db[i].iter().all(|&b| f64::from_bits(b).is_finite()),
                    "{what} bias gradient {name}: not finite"
                );
            }
            // Any number of rows in flight, a partial last group included: the same bits.
            for rows_in_flight in [1, 3] {
                let (d, db) = backward_and_bias_gradients_with(
                    rows_in_flight,
                    raw(gate.clone()),
                    raw(up.clone()),
                    biases(),
                    raw(grad.clone()),
                );
                let what = format!("{name}, {rows_in_flight} rows in flight");
                assert_eq!(d.map(|d| bits(wrap::<2>(d))), want_d, "derivatives {what}");
                assert_eq!(
                    db.map(|d| bits1(wrap::<1>(d))),
                    want_db,
                    "bias gradients {what}"
                );
            }
            // Through the backend, as the autodiff node calls it.
            let (d, db) = W::swiglu_backward_and_bias_gradients(
                gate.clone(),
                up.clone(),
                [gate_bias.clone(), up_bias.clone()],
                grad.clone(),
            );
            assert_eq!(d.map(bits), want_d, "backend derivatives {name}");
            assert_eq!(db.map(bits1), want_db, "backend bias gradients {name}");
        }
    }
}

/// SwiGLU (`SwiGluOps::swiglu` and `swiglu_backward` on a CubeCL backend: one kernel each
/// way, with and without the projections' biases) against the Burn compositions in f32, for
/// f32 and f16 storage, on strided views read element by element and packed rows read as
/// vectors, with f32 gates far into both tails of the sigmoid. Under `Autodiff` the biases'
/// gradients are the column sums of the inputs' gradients.
#[test]
fn swiglu_equals_the_composition() {
    use burn_megatron::ops::swiglu::{add_swiglu_bias, swiglu_derivatives, swiglu_forward};
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, cols, extra) in [(1, 1, 3), (7, 300, 5), (9, 256, 0), (33, 129, 1)] {
            for with_bias in [false, true] {
                let view = |seed, scale| {
                    matrix(rows, cols + extra, seed, scale, &device)
                        .cast(dtype)
                        .narrow(1, 0, cols)
                };
                // f32 gates reach far into the sigmoid's tails; f16 ones stay where silu is
                // representable (silu(-40) ≈ -2e-16 is below f16's smallest subnormal).
                let gate_scale = if dtype == DType::F32 { 40.0 } else { 6.0 };
                let (gate, up, grad) = (view(81, gate_scale), view(82, 2.0), view(83, 1.0));
                let bias = with_bias.then(|| {
                    [
                        vector(cols, 84, 0.5, &device).cast(dtype),
                        vector(cols, 85, -0.5, &device).cast(dtype),
                    ]
                });
                let f32_of = |t: Tensor<W, 2>| t.cast(DType::F32);
                let bias32 = bias.clone().map(|b| b.map(|t| t.cast(DType::F32)));
                let (gate32, up32) =
                    add_swiglu_bias(f32_of(gate.clone()), f32_of(up.clone()), bias32);
                let want = swiglu_forward(gate32.clone(), up32.clone());
                let [want_gate, want_up] = swiglu_derivatives(gate32, up32, f32_of(grad.clone()));
                let got = W::swiglu(gate.clone(), up.clone(), bias.clone());
                let [got_gate, got_up] =
                    W::swiglu_backward(gate.clone(), up.clone(), bias.clone(), grad.clone());
                let name = format!("{dtype:?} {rows}x{cols} (+{extra}) bias {with_bias}");
                for (what, got, want) in [
                    ("forward", got, want),
                    ("d_gate", got_gate.clone(), want_gate),
                    ("d_up", got_up.clone(), want_up),
                ] {
                    assert_eq!(got.dtype(), dtype, "{what} {name}");
                    assert_close(
                        &format!("{what} {name}"),
                        &values(f32_of(got)),
                        &values(want),
                        bound,
                    );
                }
                let Some([gate_bias, up_bias]) = bias else {
                    continue;
                };
                // The autodiff node: the biases' gradients are the column sums of d_gate, d_up.
                type A = burn::backend::Autodiff<W>;
                let tracked = |t: Tensor<W, 1>| Tensor::<A, 1>::from_inner(t).require_grad();
                let (tracked_gate_bias, tracked_up_bias) = (tracked(gate_bias), tracked(up_bias));
                let y = A::swiglu(
                    Tensor::from_inner(gate),
                    Tensor::from_inner(up),
                    Some([tracked_gate_bias.clone(), tracked_up_bias.clone()]),
                );
                let grads = (y * Tensor::from_inner(grad)).sum().backward();
                for (what, tracked, d) in [
                    ("gate bias", tracked_gate_bias, got_gate),
                    ("up bias", tracked_up_bias, got_up),
                ] {
                    let want = f32_of(d).sum_dim(0).squeeze_dim::<1>(0);
                    let got = tracked.grad(&grads).expect("the bias has a gradient");
                    assert_close(
                        &format!("{what} gradient {name}"),
                        &values(got.cast(DType::F32)),
                        &values(want),
                        bound,
                    );
                }
            }
        }
    }
}
