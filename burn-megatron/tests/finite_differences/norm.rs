//! `norm` (LayerNorm and RMSNorm, with and without a shift): its forward against the formula
//! evaluated row by row, and its gradients (input, scale, shift) against central differences
//! of that forward, element by element.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::{NormKind, norm};
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

const ROWS: usize = 4;
const HIDDEN: usize = 7;
const EPSILON: f64 = 1e-5;

/// The formula for one row, in plain f64.
fn reference_row(x: &[f64], scale: &[f64], shift: Option<&[f64]>, kind: NormKind) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = match kind {
        NormKind::LayerNorm => x.iter().sum::<f64>() / n,
        NormKind::RmsNorm => 0.0,
    };
    let variance = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let rstd = 1.0 / (variance + EPSILON).sqrt();
    (0..x.len())
        .map(|j| (x[j] - mean) * rstd * scale[j] + shift.map_or(0.0, |s| s[j]))
        .collect()
}

/// `x` (`N(0, 2²)` plus a per-row offset, so LayerNorm's centring matters), a scale and a
/// shift (`N(1, 0.5²)` and `N(0, 1)`), and an upstream weight `w`.
fn inputs() -> [Vec<f64>; 4] {
    let normal = |shape: [usize; 2], std, seed| {
        values(init_full::<B, 2>(
            shape,
            InitDistribution::Normal { std },
            seed,
            &device(),
        ))
    };
    let mut x = normal([ROWS, HIDDEN], 2.0, 21);
    for (i, v) in x.iter_mut().enumerate() {
        *v += (i / HIDDEN) as f64 * 3.0 - 4.0;
    }
    let scale = normal([1, HIDDEN], 0.5, 22)
        .iter()
        .map(|s| s + 1.0)
        .collect();
    [
        x,
        scale,
        normal([1, HIDDEN], 1.0, 23),
        normal([ROWS, HIDDEN], 1.0, 24),
    ]
}

/// `Σ w ∘ norm(x)` through the op on plain NdArray.
fn objective(x: &[f64], scale: &[f64], shift: Option<&[f64]>, w: &[f64], kind: NormKind) -> f64 {
    let y = norm(
        Tensor::<B, 2>::from_data(TensorData::new(x.to_vec(), [ROWS, HIDDEN]), &device()),
        Tensor::from_data(TensorData::new(scale.to_vec(), [HIDDEN]), &device()),
        shift.map(|s| Tensor::from_data(TensorData::new(s.to_vec(), [HIDDEN]), &device())),
        kind,
        EPSILON,
    );
    values(y).iter().zip(w).map(|(y, w)| y * w).sum()
}

/// Central differences of [`objective`] in every element of `which` (0: x, 1: scale, 2:
/// shift).
fn finite_differences(
    inputs: &[Vec<f64>; 3],
    which: usize,
    w: &[f64],
    kind: NormKind,
    with_shift: bool,
) -> Vec<f64> {
    (0..inputs[which].len())
        .map(|i| {
            let at = |delta: f64| {
                let mut moved = inputs.clone();
                moved[which][i] += delta;
                objective(
                    &moved[0],
                    &moved[1],
                    with_shift.then_some(moved[2].as_slice()),
                    w,
                    kind,
                )
            };
            (at(STEP) - at(-STEP)) / (2.0 * STEP)
        })
        .collect()
}

#[test]
fn the_forward_is_the_formula_and_the_gradients_match_finite_differences() {
    let [x, scale, shift, w] = inputs();
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for with_shift in [true, false] {
            let label = |what: &str| format!("{kind:?} shift {with_shift}: {what}");
            let shift_values = with_shift.then_some(shift.as_slice());
            let want: Vec<f64> = x
                .chunks(HIDDEN)
                .flat_map(|row| reference_row(row, &scale, shift_values, kind))
                .collect();

            let tracked_x =
                Tensor::<AD, 2>::from_data(TensorData::new(x.clone(), [ROWS, HIDDEN]), &device())
                    .require_grad();
            let tracked = |v: &Vec<f64>| {
                Tensor::<AD, 1>::from_data(TensorData::new(v.clone(), [HIDDEN]), &device())
                    .require_grad()
            };
            let (tracked_scale, tracked_shift) = (tracked(&scale), tracked(&shift));
            let y = norm(
                tracked_x.clone(),
                tracked_scale.clone(),
                with_shift.then(|| tracked_shift.clone()),
                kind,
                EPSILON,
            );
            assert_close(
                &label("forward"),
                &values(y.clone().inner()),
                &want,
                tolerance::F64,
            );
            let upstream =
                Tensor::<AD, 2>::from_data(TensorData::new(w.clone(), [ROWS, HIDDEN]), &device());
            let grads = (y * upstream).sum().backward();

            let all = [x.clone(), scale.clone(), shift.clone()];
            let mut checks = vec![
                (
                    "dx",
                    values(tracked_x.grad(&grads).expect("x has a gradient")),
                    0,
                ),
                (
                    "dscale",
                    values(tracked_scale.grad(&grads).expect("scale has a gradient")),
                    1,
                ),
            ];
            if with_shift {
                checks.push((
                    "dshift",
                    values(tracked_shift.grad(&grads).expect("shift has a gradient")),
                    2,
                ));
            } else {
                assert!(tracked_shift.grad(&grads).is_none());
            }
            for (name, got, which) in checks {
                let difference = assert_close(
                    &label(name),
                    &got,
                    &finite_differences(&all, which, &w, kind, with_shift),
                    tolerance::FINITE_DIFFERENCE_F64,
                );
                eprintln!("{}: relative difference {difference:.2e}", label(name));
            }
        }
    }
}
