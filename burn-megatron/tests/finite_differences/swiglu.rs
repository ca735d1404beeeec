//! `swiglu(gate, up) = silu(gate) · up` and `bias_swiglu`: the forward against the formula
//! evaluated element by element, and the gradients (inputs and biases) against central
//! differences of that forward.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::{bias_swiglu, swiglu};
use burn_megatron_testing::{assert_close, relative_difference, tolerance, values};

use crate::{AD, B, STEP, device};

/// The formula, in plain f64.
fn reference(gate: f64, up: f64) -> f64 {
    gate / (1.0 + (-gate).exp()) * up
}

/// Gates where SiLU's pieces change regime: zero (both signs), tiny, moderate, and far
/// enough out that `e^(-x)` overflows or vanishes.
const SPECIAL: [f64; 12] = [
    0.0, -0.0, 1e-9, -1e-9, 1.5, -2.5, 20.0, -20.0, 40.0, -40.0, 800.0, -800.0,
];

/// `gate` (`N(0, 4²)` with [`SPECIAL`] over every fifth element) and `up` (`N(0, 1)`), both
/// 3 × 7 × 9.
fn inputs() -> (Tensor<B, 3>, Tensor<B, 3>) {
    let shape = [3, 7, 9];
    let normal =
        |std, seed| init_full::<B, 3>(shape, InitDistribution::Normal { std }, seed, &device());
    let mut gate = values(normal(4.0, 5));
    for (i, special) in SPECIAL.iter().enumerate() {
        gate[5 * i] = *special;
    }
    let gate = Tensor::from_data(TensorData::new(gate, shape), &device());
    (gate, normal(1.0, 6))
}

#[test]
fn the_forward_is_the_formula() {
    let (gate, up) = inputs();
    let want: Vec<f64> = values(gate.clone())
        .into_iter()
        .zip(values(up.clone()))
        .map(|(g, u)| reference(g, u))
        .collect();
    let plain = swiglu(gate.clone(), up.clone());
    let tracked = swiglu(
        Tensor::<AD, 3>::from_inner(gate).require_grad(),
        Tensor::<AD, 3>::from_inner(up).require_grad(),
    );
    assert_close("swiglu", &values(plain), &want, tolerance::F64);
    assert_close(
        "swiglu (autodiff)",
        &values(tracked.inner()),
        &want,
        tolerance::F64,
    );
}

/// The gradients of `Σ w ∘ swiglu(gate, up)` from the backward and from central differences
/// (each output element depends on one element of each input, so shifting a whole input by
/// `±h` estimates every element's derivative at once).
#[test]
fn the_gradients_match_finite_differences() {
    let (gate, up) = inputs();
    let w = init_full::<B, 3>(
        gate.dims(),
        InitDistribution::Normal { std: 1.0 },
        7,
        &device(),
    );
    let tracked_gate = Tensor::<AD, 3>::from_inner(gate.clone()).require_grad();
    let tracked_up = Tensor::<AD, 3>::from_inner(up.clone()).require_grad();
    let y = swiglu(tracked_gate.clone(), tracked_up.clone());
    let grads = (y * Tensor::from_inner(w.clone())).sum().backward();

    let forward = |gate: Tensor<B, 3>, up: Tensor<B, 3>| swiglu(gate, up) * w.clone();
    let central = |plus: Tensor<B, 3>, minus: Tensor<B, 3>| (plus - minus).div_scalar(2.0 * STEP);
    let fd_gate = central(
        forward(gate.clone().add_scalar(STEP), up.clone()),
        forward(gate.clone().add_scalar(-STEP), up.clone()),
    );
    let fd_up = central(
        forward(gate.clone(), up.clone().add_scalar(STEP)),
        forward(gate, up.add_scalar(-STEP)),
    );
    let d_gate = assert_close(
        "d_gate",
        &values(tracked_gate.grad(&grads).expect("gate has a gradient")),
        &values(fd_gate),
        tolerance::FINITE_DIFFERENCE_F64,
    );
    let d_up = assert_close(
        "d_up",
        &values(tracked_up.grad(&grads).expect("up has a gradient")),
        &values(fd_up),
        tolerance::FINITE_DIFFERENCE_F64,
    );
    eprintln!("swiglu: relative difference d_gate {d_gate:.2e}, d_up {d_up:.2e}");
}

/// `bias_swiglu` with both biases: the forward is the formula on `gate + b_g`, `up + b_u`, and
/// the gradients of `Σ w ∘ y` for the inputs (whole-input shifts) and for each bias element
/// (one element shifted at a time) match central differences.
#[test]
fn the_bias_gradients_match_finite_differences() {
    let (gate, up) = inputs();
    let features = gate.dims()[2];
    let normal = |std, seed| {
        init_full::<B, 1>(
            [features],
            InitDistribution::Normal { std },
            seed,
            &device(),
        )
    };
    let (gate_bias, up_bias) = (normal(2.0, 8), normal(1.0, 9));
    let w = init_full::<B, 3>(
        gate.dims(),
        InitDistribution::Normal { std: 1.0 },
        10,
        &device(),
    );
    let (gb, ub) = (values(gate_bias.clone()), values(up_bias.clone()));
    let want: Vec<f64> = values(gate.clone())
        .into_iter()
        .zip(values(up.clone()))
        .enumerate()
        .map(|(i, (g, u))| reference(g + gb[i % features], u + ub[i % features]))
        .collect();
    let plain = bias_swiglu(
        gate.clone(),
        up.clone(),
        Some([gate_bias.clone(), up_bias.clone()]),
    );
    assert_close("bias_swiglu", &values(plain), &want, tolerance::F64);

    let tracked = |t: Tensor<B, 3>| Tensor::<AD, 3>::from_inner(t).require_grad();
    let tracked_bias = |t: Tensor<B, 1>| Tensor::<AD, 1>::from_inner(t).require_grad();
    let (t_gate, t_up) = (tracked(gate.clone()), tracked(up.clone()));
    let (t_gate_bias, t_up_bias) = (
        tracked_bias(gate_bias.clone()),
        tracked_bias(up_bias.clone()),
    );
    let y = bias_swiglu(
        t_gate.clone(),
        t_up.clone(),
        Some([t_gate_bias.clone(), t_up_bias.clone()]),
    );
    let grads = (y * Tensor::from_inner(w.clone())).sum().backward();

    let loss =
        |gate: Tensor<B, 3>, up: Tensor<B, 3>, gate_bias: Tensor<B, 1>, up_bias: Tensor<B, 1>| {
            bias_swiglu(gate, up, Some([gate_bias, up_bias])) * w.clone()
        };
    let central = |plus: Tensor<B, 3>, minus: Tensor<B, 3>| (plus - minus).div_scalar(2.0 * STEP);
    let fd_gate = central(
        loss(
            gate.clone().add_scalar(STEP),
            up.clone(),
            gate_bias.clone(),
            up_bias.clone(),
        ),
        loss(
            gate.clone().add_scalar(-STEP),
            up.clone(),
            gate_bias.clone(),
            up_bias.clone(),
        ),
    );
    let fd_up = central(
        loss(
            gate.clone(),
            up.clone().add_scalar(STEP),
            gate_bias.clone(),
            up_bias.clone(),
        ),
        loss(
            gate.clone(),
            up.clone().add_scalar(-STEP),
            gate_bias.clone(),
            up_bias.clone(),
        ),
    );
    // One bias element at a time: it reaches a whole column of the output.
    let one_hot = |j: usize, h: f64| {
        let mut v = vec![0.0; features];
        v[j] = h;
        Tensor::<B, 1>::from_data(TensorData::new(v, [features]), &device())
    };
    let fd_bias = |which: usize| -> Vec<f64> {
        (0..features)
            .map(|j| {
                let shifted = |h: f64| {
                    let (g, u) = if which == 0 {
                        (gate_bias.clone() + one_hot(j, h), up_bias.clone())
                    } else {
                        (gate_bias.clone(), up_bias.clone() + one_hot(j, h))
                    };
                    loss(gate.clone(), up.clone(), g, u).sum().into_scalar()
                };
                (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
            })
            .collect()
    };
    let grad = |t: &Tensor<AD, 3>| values(t.grad(&grads).expect("a gradient"));
    let grad_bias = |t: &Tensor<AD, 1>| values(t.grad(&grads).expect("a gradient"));
    let bound = tolerance::FINITE_DIFFERENCE_F64;
    let d_gate = assert_close("d_gate", &grad(&t_gate), &values(fd_gate), bound);
    let d_up = assert_close("d_up", &grad(&t_up), &values(fd_up), bound);
    let d_gate_bias = assert_close("d_gate_bias", &grad_bias(&t_gate_bias), &fd_bias(0), bound);
    let d_up_bias = assert_close("d_up_bias", &grad_bias(&t_up_bias), &fd_bias(1), bound);
    eprintln!(
        "bias_swiglu: relative difference d_gate {d_gate:.2e}, d_up {d_up:.2e}, \
         d_gate_bias {d_gate_bias:.2e}, d_up_bias {d_up_bias:.2e}"
    );
}

/// Why [`burn_megatron::ops::sigmoid`] exists: Burn 0.21's `sigmoid` computes in f32, so an
/// f64 SiLU is only f32-accurate. If this fails, Burn computes it in f64 now.
#[test]
fn burns_sigmoid_is_f32_in_f64() {
    let (gate, _) = inputs();
    let want: Vec<f64> = values(gate.clone())
        .into_iter()
        .map(|g| 1.0 / (1.0 + (-g).exp()))
        .collect();
    let ours = relative_difference(
        "our sigmoid",
        &values(burn_megatron::ops::sigmoid(gate.clone())),
        &want,
    );
    let burns = relative_difference(
        "Burn's sigmoid",
        &values(burn::tensor::activation::sigmoid(gate)),
        &want,
    );
    eprintln!("sigmoid in f64: relative difference ours {ours:.2e}, Burn's {burns:.2e}");
    assert!(ours <= tolerance::F64, "our sigmoid: {ours:.2e}");
    assert!(
        burns > 1e-10,
        "Burn's sigmoid is f64-accurate now ({burns:.2e})"
    );
}
