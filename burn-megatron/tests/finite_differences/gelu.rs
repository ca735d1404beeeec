//! `bias_gelu` in both forms: its forward against the formulas evaluated element by element,
//! and its gradients (input and bias) against central differences of that forward.

use std::f64::consts::PI;

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::{GeluForm, bias_gelu};
use burn_megatron_testing::{assert_close, relative_difference, tolerance, values};

use crate::{AD, B, STEP, device};

/// The formulas, in plain f64.
fn reference(form: GeluForm, x: f64) -> f64 {
    match form {
        GeluForm::Erf => 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt())),
        GeluForm::Tanh => 0.5 * x * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()),
    }
}

/// Values where GeLU's pieces change regime: zero (both signs), tiny, around the tanh
/// form's clamp at ±10, the tails where erf and tanh saturate, and far out.
const SPECIAL: [f64; 14] = [
    0.0, -0.0, 1e-9, -1e-9, 1.5, -0.75, 5.0, -5.0, 9.99, 10.01, -10.01, 30.0, -30.0, 1e3,
];

/// `N(0, 3²)` values of `shape` with [`SPECIAL`] written over every seventh element.
fn input<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    let random = init_full::<B, D>(
        shape,
        InitDistribution::Normal { std: 3.0 },
        seed,
        &device(),
    );
    let mut values = values(random);
    for (i, special) in SPECIAL.iter().enumerate() {
        let at = (7 * i) % values.len();
        values[at] = *special;
    }
    Tensor::from_data(TensorData::new(values, shape), &device())
}

/// The cases: an `x` of 7 × 13 with a bias, and one of 3 × 5 × 11 without (sizes that are
/// multiples of nothing in particular).
fn cases() -> Vec<(Tensor<B, 3>, Option<Tensor<B, 1>>)> {
    vec![
        (
            input([1, 7, 13], 1),
            Some(input::<1>([13], 2).mul_scalar(0.5)),
        ),
        (input([3, 5, 11], 3), None),
    ]
}

#[test]
fn the_forward_is_the_formula() {
    for form in [GeluForm::Erf, GeluForm::Tanh] {
        for (case, (x, bias)) in cases().into_iter().enumerate() {
            let z = match &bias {
                Some(b) => x.clone() + b.clone().unsqueeze(),
                None => x.clone(),
            };
            let want: Vec<f64> = values(z).into_iter().map(|z| reference(form, z)).collect();
            let plain = bias_gelu(x.clone(), bias.clone(), form);
            let tracked = bias_gelu(
                Tensor::<AD, 3>::from_inner(x).require_grad(),
                bias.map(|b| Tensor::from_inner(b).require_grad()),
                form,
            );
            let name = format!("{form:?} case {case}");
            assert_close(&name, &values(plain), &want, tolerance::F64);
            assert_close(&name, &values(tracked.inner()), &want, tolerance::F64);
        }
    }
}

/// The gradients of `Σ w ∘ y` (an arbitrary upstream gradient `w`) for `y = gelu(x + b)`:
/// from the backward, and from central differences. Each output element depends on one
/// element of `x` and one of `b`, so one shifted evaluation per sign estimates every
/// element's derivative at once: all of `x` shifted by `±h` for `x`, all of `b` for `b`
/// (the bias's estimate is then the column sum).
fn gradients(
    x: Tensor<B, 3>,
    bias: Option<Tensor<B, 1>>,
    gelu: impl Fn(Tensor<AD, 3>, Option<Tensor<AD, 1>>) -> Tensor<AD, 3>,
) -> [(Vec<f64>, Vec<f64>); 2] {
    let w = init_full::<B, 3>(
        x.dims(),
        InitDistribution::Normal { std: 1.0 },
        9,
        &device(),
    );
    let tracked_x = Tensor::<AD, 3>::from_inner(x.clone()).require_grad();
    let tracked_bias = bias.clone().map(|b| Tensor::from_inner(b).require_grad());
    let y = gelu(tracked_x.clone(), tracked_bias.clone());
    let grads = (y * Tensor::from_inner(w.clone())).sum().backward();
    let grad_x = values(tracked_x.grad(&grads).expect("x has a gradient"));
    let grad_bias = tracked_bias
        .map(|b| values(b.grad(&grads).expect("the bias has a gradient")))
        .unwrap_or_default();

    let forward = |x: Tensor<B, 3>, bias: Option<Tensor<B, 1>>| {
        let y = gelu(Tensor::from_inner(x), bias.map(Tensor::from_inner)).inner();
        y * w.clone()
    };
    let central = |plus: Tensor<B, 3>, minus: Tensor<B, 3>| (plus - minus).div_scalar(2.0 * STEP);
    let fd_x = central(
        forward(x.clone().add_scalar(STEP), bias.clone()),
        forward(x.clone().add_scalar(-STEP), bias.clone()),
    );
    let fd_bias = match bias {
        Some(b) => {
            let fd = central(
                forward(x.clone(), Some(b.clone().add_scalar(STEP))),
                forward(x, Some(b.add_scalar(-STEP))),
            );
            values(fd.sum_dim(1).sum_dim(0).flatten::<1>(0, 2))
        }
        None => Vec::new(),
    };
    [(grad_x, values(fd_x)), (grad_bias, fd_bias)]
}

#[test]
fn the_gradients_match_finite_differences() {
    for form in [GeluForm::Erf, GeluForm::Tanh] {
        for (case, (x, bias)) in cases().into_iter().enumerate() {
            let [(grad_x, fd_x), (grad_b, fd_b)] = gradients(x, bias, |x, b| bias_gelu(x, b, form));
            let name = format!("{form:?} case {case}");
            let dx = assert_close(
                &format!("{name} dx"),
                &grad_x,
                &fd_x,
                tolerance::FINITE_DIFFERENCE_F64,
            );
            let db = assert_close(
                &format!("{name} dbias"),
                &grad_b,
                &fd_b,
                tolerance::FINITE_DIFFERENCE_F64,
            );
            eprintln!("{name}: relative difference dx {dx:.2e}, dbias {db:.2e}");
        }
    }
}

/// Why this op exists: Burn 0.21's `gelu` computes the erf form but backpropagates the tanh
/// form's derivative. If this fails, Burn has fixed it; our op stays (it is where a fused
/// kernel goes, and it has the tanh form).
#[test]
fn burns_gelu_backward_is_not_its_derivative() {
    let (x, _) = cases().remove(1);
    let [(grad_x, fd_x), _] = gradients(x, None, |x, _| burn::tensor::activation::gelu(x));
    let diff = relative_difference("Burn's gelu dx", &grad_x, &fd_x);
    eprintln!("Burn's gelu: relative difference dx {diff:.2e}");
    assert!(
        diff > 1e-4,
        "Burn's gelu backward now matches its forward ({diff:.2e}): Burn fixed it"
    );
}
