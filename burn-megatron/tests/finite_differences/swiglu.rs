//! `swiglu(gate, up) = silu(gate) · up`: its forward against the formula evaluated element by
//! element, and its gradients against central differences of that forward.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::swiglu;
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
