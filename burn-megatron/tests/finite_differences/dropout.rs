//! `residual + x ∘ m` (dropout fused with the residual add): its forward against the mask
//! drawn element by element, and its gradients against central differences.

use burn::tensor::Tensor;
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::DropoutMask;
use burn_megatron::ops::DropoutOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

const DIMS: [usize; 4] = [2, 3, 5, 7];

fn mask() -> DropoutMask {
    DropoutMask {
        prob: 0.3,
        seed: 17,
        offset: [1, 0, 4, 2],
    }
}

fn normal(seed: u64) -> Tensor<B, 4> {
    init_full::<B, 4>(DIMS, InitDistribution::Normal { std: 1.0 }, seed, &device())
}

#[test]
fn the_forward_is_the_mask_times_x_plus_the_residual() {
    let (x, residual) = (normal(1), normal(2));
    let m = mask().multipliers(DIMS);
    assert!(
        m.contains(&0.0) && m.iter().any(|v| *v > 1.0),
        "the mask drops and keeps"
    );
    let want: Vec<f64> = values(x.clone())
        .iter()
        .zip(values(residual.clone()))
        .zip(&m)
        .map(|((x, r), m)| r + x * *m as f64)
        .collect();
    let got = B::dropout(x, Some(residual), mask());
    assert_close("dropout + residual", &values(got), &want, tolerance::F64);
}

/// The gradients of `Σ w ∘ (residual + x ∘ m)` from the backward and from central
/// differences (each output element depends on one element of each input).
#[test]
fn the_gradients_match_finite_differences() {
    let (x, residual, w) = (normal(3), normal(4), normal(5));
    let tracked_x = Tensor::<AD, 4>::from_inner(x.clone()).require_grad();
    let tracked_residual = Tensor::<AD, 4>::from_inner(residual.clone()).require_grad();
    let y = AD::dropout(tracked_x.clone(), Some(tracked_residual.clone()), mask());
    let grads = (y * Tensor::from_inner(w.clone())).sum().backward();

    let forward = |x: Tensor<B, 4>, r: Tensor<B, 4>| B::dropout(x, Some(r), mask()) * w.clone();
    let central = |plus: Tensor<B, 4>, minus: Tensor<B, 4>| (plus - minus).div_scalar(2.0 * STEP);
    let fd_x = central(
        forward(x.clone().add_scalar(STEP), residual.clone()),
        forward(x.clone().add_scalar(-STEP), residual.clone()),
    );
    let fd_residual = central(
        forward(x.clone(), residual.clone().add_scalar(STEP)),
        forward(x, residual.add_scalar(-STEP)),
    );
    for (what, got, want) in [
        ("dx", tracked_x.grad(&grads), fd_x),
        ("d_residual", tracked_residual.grad(&grads), fd_residual),
    ] {
        let got = got.unwrap_or_else(|| panic!("{what} is missing"));
        assert_close(
            what,
            &values(got),
            &values(want),
            tolerance::FINITE_DIFFERENCE_F64,
        );
    }
}
