//! The FP8 linear layer (one autodiff node) against an explicit f64 emulation: the same
//! scales (computed in f32, as the layer does), each operand rounded by the reference, the
//! products summed in f64 and scaled. Forward, input, weight and bias gradients, for both
//! formats and both recipes.

use burn::tensor::Tensor;
use burn_megatron::ops::fp8::{
    AmaxComputeAlgo, Fp8Backward, Fp8Config, Fp8Dtype, Fp8Format, Fp8Linear, Fp8Recipe, Fp8Split,
    fp8_linear,
};
use burn_megatron::ops::linear::linear;
use burn_megatron_testing::values_f32;

use crate::{AD, B, assert_close, matrix, pseudo_random, reference_round, tolerance, values};

const TOKENS: usize = 6;
const D_IN: usize = 8;
const D_OUT: usize = 5;

/// One step's inputs: `x: [2, 3, d_in]` (flattened: `[tokens, d_in]`), `w: [d_in, d_out]`,
/// `bias: [d_out]`, and the output gradient `g: [tokens, d_out]`.
struct Inputs {
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
    g: Vec<f32>,
}

fn inputs(step: u64) -> Inputs {
    Inputs {
        x: pseudo_random(TOKENS * D_IN, 10 + step, 3.0 + step as f32),
        w: pseudo_random(D_IN * D_OUT, 20 + step, 0.2),
        bias: pseudo_random(D_OUT, 30 + step, 0.1),
        g: pseudo_random(TOKENS * D_OUT, 40 + step, 1e-3 / (1 + step) as f32),
    }
}

/// `[y, dx, dw, db]` of the layer.
fn layer(inputs: &Inputs, fp8: &Fp8Linear) -> [Vec<f64>; 4] {
    let x = matrix::<AD>(&inputs.x, TOKENS, D_IN)
        .reshape([2, 3, D_IN])
        .require_grad();
    let w = matrix::<AD>(&inputs.w, D_IN, D_OUT).require_grad();
    let bias =
        Tensor::<AD, 1>::from_floats(inputs.bias.as_slice(), &Default::default()).require_grad();
    let y = fp8_linear(x.clone(), w.clone(), Some(bias.clone()), fp8).unwrap();
    assert_eq!(y.dims(), [2, 3, D_OUT]);
    let g = matrix::<AD>(&inputs.g, TOKENS, D_OUT).reshape([2, 3, D_OUT]);
    let grads = (y.clone() * g).sum().backward();
    [
        values(y.inner()),
        values(x.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
        values(bias.grad(&grads).unwrap()),
    ]
}

/// The emulation's scale of a tensor: `max / amax / 2^margin` in f32 (1 for a zero amax).
pub(crate) fn scale(amax: f32, dtype: Fp8Dtype, margin: i32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        dtype.max() / amax * 2f32.powi(-margin)
    } else {
        1.0
    }
}

fn amax(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// `v · scale` rounded by the reference.
fn cast(v: &[f32], scale: f32, dtype: Fp8Dtype) -> Vec<f64> {
    v.iter()
        .map(|&x| reference_round((x * scale) as f64, dtype))
        .collect()
}

/// `Σ_k a[i, k] · b[j, k]` for row-major `a: [m, k]` read through `ai(i, k)` and `b` through
/// `bj(j, k)`, times `factor`.
fn product(
    m: usize,
    n: usize,
    k: usize,
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
    factor: f64,
) -> Vec<f64> {
    (0..m * n)
        .map(|i| (0..k).map(|l| a(i / n, l) * b(i % n, l)).sum::<f64>() * factor)
        .collect()
}

/// The scales `[x, w, g]` one step casts with.
type Scales = [f32; 3];

/// `[y, dx, dw, db]` emulated in f64 with the given scales.
fn emulate(inputs: &Inputs, format: Fp8Format, scales: Scales) -> [Vec<f64>; 4] {
    let (fwd, grad) = (format.forward_dtype(), format.gradient_dtype());
    let [sx, sw, sg] = scales;
    let (qx, qw, qg) = (
        cast(&inputs.x, sx, fwd),
        cast(&inputs.w, sw, fwd),
        cast(&inputs.g, sg, grad),
    );
    let inv = |s: f32| (1.0 / s) as f64;
    let mut y = product(
        TOKENS,
        D_OUT,
        D_IN,
        |t, i| qx[t * D_IN + i],
        |o, i| qw[i * D_OUT + o],
        inv(sx) * inv(sw),
    );
    for (i, v) in y.iter_mut().enumerate() {
        *v += inputs.bias[i % D_OUT] as f64;
    }
    let dx = product(
        TOKENS,
        D_IN,
        D_OUT,
        |t, o| qg[t * D_OUT + o],
        |i, o| qw[i * D_OUT + o],
        inv(sg) * inv(sw),
    );
    let dw = product(
        D_IN,
        D_OUT,
        TOKENS,
        |i, t| qx[t * D_IN + i],
        |o, t| qg[t * D_OUT + o],
        inv(sx) * inv(sg),
    );
    let db = (0..D_OUT)
        .map(|o| (0..TOKENS).map(|t| inputs.g[t * D_OUT + o] as f64).sum())
        .collect();
    [y, dx, dw, db]
}

fn assert_matches(what: &str, got: &[Vec<f64>; 4], want: &[Vec<f64>; 4]) {
    for (name, (g, w)) in ["y", "dx", "dw", "db"].iter().zip(got.iter().zip(want)) {
        assert_close(&format!("{what}: {name}"), g, w, tolerance::F32);
    }
}

/// Tensorwise scaling: every cast's scale from the tensor's own amax.
#[test]
fn tensorwise_layer_equals_the_f64_emulation() {
    for (format, margin) in [
        (Fp8Format::Hybrid, 0),
        (Fp8Format::E4M3, 0),
        (Fp8Format::Hybrid, 2),
    ] {
        let config = Fp8Config::new().with_format(format).with_margin(margin);
        let fp8 = Fp8Linear::new(config, None, Fp8Split::NONE);
        for step in 0..2 {
            let inputs = inputs(step);
            let scales = [
                scale(amax(&inputs.x), format.forward_dtype(), margin),
                scale(amax(&inputs.w), format.forward_dtype(), margin),
                scale(amax(&inputs.g), format.gradient_dtype(), margin),
            ];
            let got = layer(&inputs, &fp8);
            assert_matches(
                &format!("{format:?} margin {margin} step {step}"),
                &got,
                &emulate(&inputs, format, scales),
            );
            // FP8 is close to the exact layer (E4M3 keeps 3 mantissa bits: a few per cent).
            let exact = emulate_exact(&inputs);
            assert_close("y against the exact product", &got[0], &exact, 0.1);
        }
        assert!(
            fp8.delayed_states::<B>().is_none(),
            "tensorwise keeps no state"
        );
    }
}

/// `x · w + bias` in f64, for the sanity check.
fn emulate_exact(inputs: &Inputs) -> Vec<f64> {
    let mut y = product(
        TOKENS,
        D_OUT,
        D_IN,
        |t, i| inputs.x[t * D_IN + i] as f64,
        |o, i| inputs.w[i * D_OUT + o] as f64,
        1.0,
    );
    for (i, v) in y.iter_mut().enumerate() {
        *v += inputs.bias[i % D_OUT] as f64;
    }
    y
}

/// Delayed scaling over four steps: each cast uses the scale of the amaxes recorded before
/// it (1 at first), the input and weight recorded in the forward pass, the output gradient
/// in the backward pass; the histories hold the amaxes, newest first.
#[test]
fn delayed_layer_equals_the_f64_emulation() {
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        let format = Fp8Format::Hybrid;
        let config = Fp8Config::new()
            .with_recipe(Fp8Recipe::Delayed)
            .with_amax_history_len(3)
            .with_amax_compute_algo(algo);
        let fp8 = Fp8Linear::new(config, None, Fp8Split::NONE);
        let mut history: [Vec<f32>; 3] = Default::default();
        let dtypes = [
            format.forward_dtype(),
            format.forward_dtype(),
            format.gradient_dtype(),
        ];
        for step in 0..4 {
            let inputs = inputs(step);
            let scales: Scales = std::array::from_fn(|i| {
                let h = &history[i];
                let chosen = match algo {
                    AmaxComputeAlgo::Max => h.iter().rev().take(3).fold(0.0f32, |m, a| m.max(*a)),
                    AmaxComputeAlgo::MostRecent => h.last().copied().unwrap_or(0.0),
                };
                scale(chosen, dtypes[i], 0)
            });
            let got = layer(&inputs, &fp8);
            assert_matches(
                &format!("delayed {algo:?} step {step}"),
                &got,
                &emulate(&inputs, format, scales),
            );
            for (h, tensor) in history.iter_mut().zip([&inputs.x, &inputs.w, &inputs.g]) {
                h.push(amax(tensor));
            }
        }
        let states = fp8
            .delayed_states::<B>()
            .expect("delayed scaling keeps state");
        for (state, h) in states.iter().zip(&history) {
            let newest_first: Vec<f32> = h.iter().rev().take(3).copied().collect();
            assert_eq!(values_f32(state.history()), newest_first);
        }
    }
}

/// A NaN in the input reaches the output, and delayed scaling does not record its amax.
#[test]
fn nan_input_propagates_and_is_not_recorded() {
    let config = Fp8Config::new()
        .with_recipe(Fp8Recipe::Delayed)
        .with_amax_history_len(2);
    let fp8 = Fp8Linear::new(config, None, Fp8Split::NONE);
    layer(&inputs(0), &fp8);
    let before = fp8.delayed_states::<B>().unwrap();
    let mut bad = inputs(1);
    bad.x[3] = f32::NAN;
    let x = matrix::<AD>(&bad.x, TOKENS, D_IN);
    let w = matrix::<AD>(&bad.w, D_IN, D_OUT);
    let y = values_f32(fp8_linear(x, w, None, &fp8).unwrap().inner());
    assert!(
        y[..D_OUT].iter().all(|v| v.is_nan()),
        "the row with the NaN: {y:?}"
    );
    assert!(
        y[D_OUT..].iter().all(|v| v.is_finite()),
        "the other rows stay finite"
    );
    let after = fp8.delayed_states::<B>().unwrap();
    assert_eq!(
        values_f32(after[0].history()),
        values_f32(before[0].history())
    );
    assert_eq!(values_f32(after[0].scale()), values_f32(before[0].scale()));
    assert_ne!(
        values_f32(after[1].history()),
        values_f32(before[1].history()),
        "the weight's amax is recorded"
    );
}

/// `[y, dx, dw]` of the layer with only the inputs `tracked` (`[x, w]`) needing a gradient
/// (`None` for the other): the casts the node keeps and the backward makes are then one layout
/// an operand.
fn layer_tracking(inputs: &Inputs, fp8: &Fp8Linear, tracked: [bool; 2]) -> [Option<Vec<f64>>; 3] {
    let track = |t: Tensor<AD, 2>, on: bool| if on { t.require_grad() } else { t };
    let x = track(matrix::<AD>(&inputs.x, TOKENS, D_IN), tracked[0]);
    let w = track(matrix::<AD>(&inputs.w, D_IN, D_OUT), tracked[1]);
    let y = fp8_linear(x.clone(), w.clone(), None, fp8).unwrap();
    let grads = (y.clone() * matrix::<AD>(&inputs.g, TOKENS, D_OUT))
        .sum()
        .backward();
    [
        Some(values(y.inner())),
        x.grad(&grads).map(values),
        w.grad(&grads).map(values),
    ]
}

/// A frozen weight (only `dx`) or a frozen input (only `dw`) gives the gradient the layer
/// gives with both tracked, bit for bit, under both recipes (two steps, so that delayed scaling
/// uses a recorded history).
#[test]
fn one_tracked_operand_gives_the_same_gradient() {
    for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Delayed] {
        let config = || Fp8Config::new().with_recipe(recipe);
        let [both, x_only, w_only] =
            [0, 1, 2].map(|_| Fp8Linear::new(config(), None, Fp8Split::NONE));
        for step in 0..2 {
            let inputs = inputs(step);
            let want = layer_tracking(&inputs, &both, [true, true]);
            let dx = layer_tracking(&inputs, &x_only, [true, false]);
            let dw = layer_tracking(&inputs, &w_only, [false, true]);
            let what = |s: &str| format!("{recipe:?} step {step}: {s}");
            assert!(dx[2].is_none() && dw[1].is_none());
            for (name, got, want) in [
                ("y (frozen w)", &dx[0], &want[0]),
                ("y (frozen x)", &dw[0], &want[0]),
                ("dx", &dx[1], &want[1]),
                ("dw", &dw[2], &want[2]),
            ] {
                let (got, want) = (got.as_ref().unwrap(), want.as_ref().unwrap());
                assert_close(&what(name), got, want, 0.0);
            }
        }
    }
}

/// `[y, dx, dw]` of the plain linear layer in the model's dtype (`ops::linear`), against the
/// same output gradient.
fn plain(inputs: &Inputs) -> [Vec<f64>; 3] {
    let x = matrix::<AD>(&inputs.x, TOKENS, D_IN).require_grad();
    let w = matrix::<AD>(&inputs.w, D_IN, D_OUT).require_grad();
    let y = linear(x.clone(), w.clone(), None);
    let grads = (y.clone() * matrix::<AD>(&inputs.g, TOKENS, D_OUT))
        .sum()
        .backward();
    [
        values(y.inner()),
        values(x.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
    ]
}

/// `Fp8Config::backward` (`--fp8-backward-bf16`): the gradient it names is the plain layer's,
/// bit for bit (the same GEMM of the unquantised operands against the same output gradient),
/// and the other, and the forward, the FP8 layer's, bit for bit, under both recipes over two
/// steps (delayed scaling still records the output gradient's amax).
#[test]
fn backward_override_runs_the_named_gradients_unquantised() {
    for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Delayed] {
        for backward in [Fp8Backward::Dgrad, Fp8Backward::Wgrad, Fp8Backward::Both] {
            let config = Fp8Config::new().with_recipe(recipe);
            let fp8 = Fp8Linear::new(config.clone(), None, Fp8Split::NONE);
            let fp8_overridden =
                Fp8Linear::new(config.with_backward(backward), None, Fp8Split::NONE);
            for step in 0..2 {
                let inputs = inputs(step);
                let want_fp8 = layer_tracking(&inputs, &fp8, [true, true]).map(Option::unwrap);
                let got =
                    layer_tracking(&inputs, &fp8_overridden, [true, true]).map(Option::unwrap);
                let want_plain = plain(&inputs);
                let what = |s: &str| format!("{recipe:?} {backward:?} step {step}: {s}");
                let dx = match backward.dgrad_unquantised() {
                    true => &want_plain[1],
                    false => &want_fp8[1],
                };
                let dw = match backward.wgrad_unquantised() {
                    true => &want_plain[2],
                    false => &want_fp8[2],
                };
                assert_close(&what("y"), &got[0], &want_fp8[0], 0.0);
                assert_close(&what("dx"), &got[1], dx, 0.0);
                assert_close(&what("dw"), &got[2], dw, 0.0);
                // The FP8 gradient is not the plain one: the comparison above is sharp.
                assert!(want_fp8[1] != want_plain[1] && want_fp8[2] != want_plain[2]);
            }
            if recipe == Fp8Recipe::Delayed {
                let states = |l: &Fp8Linear| l.delayed_data().unwrap().expect("recorded");
                let (got, want) = (states(&fp8_overridden), states(&fp8));
                assert_eq!(got, want, "{backward:?}: the amaxes are recorded as in FP8");
                assert!(want[2].amax_history[..2].iter().all(|&a| a > 0.0));
            }
        }
    }
}
