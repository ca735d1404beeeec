//! `grouped_linear` (the experts' grouped GEMM, a backward written out: `dx = grouped(dy, wᵀ)`,
//! `dw[e] = x_eᵀ · dy_e`): the gradients of the tokens and of every expert's weights against
//! central differences, one element at a time, with an expert of zero rows (its gradient
//! exactly zero); and the experts with their blocks padded to one size around those products.

use burn::module::Param;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::grouped_linear;
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::{GroupedExperts, GroupedExpertsConfig};
use burn_megatron_testing::{assert_close, assert_near_zero, tolerance, values};

use crate::{AD, B, STEP, device};

fn normal<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    init_full::<B, D>(
        shape,
        InitDistribution::Normal { std: 1.0 },
        seed,
        &device(),
    )
}

/// Central differences of `loss` at `x`, one element at a time.
fn finite_differences<const D: usize>(
    x: &Tensor<B, D>,
    loss: impl Fn(Tensor<B, D>) -> f64,
) -> Vec<f64> {
    let shape = x.dims();
    let base = values(x.clone());
    (0..base.len())
        .map(|i| {
            let shifted = |h: f64| {
                let mut v = base.clone();
                v[i] += h;
                loss(Tensor::from_data(TensorData::new(v, shape), &device()))
            };
            (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
        })
        .collect()
}

#[test]
fn the_grouped_linear_gradients_match_finite_differences() {
    let counts = [2, 0, 3, 1];
    let (k, m) = (3, 4);
    let n: usize = counts.iter().sum();
    let x = normal([n, k], 11);
    let w = normal([counts.len(), k, m], 12);
    let upstream = normal([n, m], 13);
    let loss = |x: Tensor<AD, 2>, w: Tensor<AD, 3>| {
        (grouped_linear(x, w, &counts) * Tensor::from_inner(upstream.clone())).sum()
    };
    let (tx, tw) = (
        Tensor::<AD, 2>::from_inner(x.clone()).require_grad(),
        Tensor::<AD, 3>::from_inner(w.clone()).require_grad(),
    );
    let grads = loss(tx.clone(), tw.clone()).backward();
    let at = |x: &Tensor<B, 2>, w: &Tensor<B, 3>| {
        values(loss(Tensor::from_inner(x.clone()), Tensor::from_inner(w.clone())).inner())[0]
    };
    let fd_x = finite_differences(&x, |x| at(&x, &w));
    let fd_w = finite_differences(&w, |w| at(&x, &w));
    let dx = values(tx.grad(&grads).expect("x has a gradient"));
    let dw = values(tw.grad(&grads).expect("w has a gradient"));
    assert_close(
        "grouped_linear dx",
        &dx,
        &fd_x,
        tolerance::FINITE_DIFFERENCE_F64,
    );
    assert_close(
        "grouped_linear dw",
        &dw,
        &fd_w,
        tolerance::FINITE_DIFFERENCE_F64,
    );
    assert_near_zero("dw of the expert without rows", &dw[k * m..2 * k * m], 0.0);
}

/// The experts with their blocks padded to one size (`GroupedExperts::forward_padded`: row
/// gathers into the padded blocks and back around the grouped products): the gradients of the
/// tokens and of every weight of SwiGLU experts, one without tokens.
#[test]
fn the_padded_experts_gradients_match_finite_differences() {
    let counts = [2, 0, 3];
    let (hidden, rows) = (3, 8);
    let total: usize = counts.iter().sum();
    let experts = GroupedExpertsConfig::new(hidden, 2, counts.len())
        .with_activation(Activation::SwiGlu)
        .with_init_std(0.7)
        .init::<AD>(0..counts.len(), 5, "experts", &device());
    let tokens = normal([total, hidden], 14);
    let upstream = normal([total + 1, hidden], 15);
    // The dispatcher's zero row ends the tokens.
    let with_zero_row =
        |x: Tensor<AD, 2>| Tensor::cat(vec![x, Tensor::zeros([1, hidden], &device())], 0);
    let loss = |e: &GroupedExperts<AD>, x: Tensor<AD, 2>| {
        let y = e.forward_padded(with_zero_row(x), &counts, rows);
        values((y * Tensor::from_inner(upstream.clone())).sum().inner())[0]
    };
    let tx = Tensor::<AD, 2>::from_inner(tokens.clone()).require_grad();
    let y = experts.forward_padded(with_zero_row(tx.clone()), &counts, rows);
    let grads = (y * Tensor::from_inner(upstream.clone())).sum().backward();
    let dx = values(tx.grad(&grads).expect("the tokens have a gradient"));
    let fd_x = finite_differences(&tokens, |x| loss(&experts, Tensor::from_inner(x)));
    assert_close(
        "padded experts dx",
        &dx,
        &fd_x,
        tolerance::FINITE_DIFFERENCE_F64,
    );
    type Pick = fn(&mut GroupedExperts<AD>) -> &mut Param<Tensor<AD, 3>>;
    let weights: [(&str, Pick); 3] = [
        ("fc1", |e| &mut e.fc1),
        ("gate", |e| e.gate.as_mut().expect("SwiGLU has a gate")),
        ("fc2", |e| &mut e.fc2),
    ];
    for (name, pick) in weights {
        let mut probe = experts.clone();
        let grad = values(pick(&mut probe).grad(&grads).expect("a weight's gradient"));
        let at = pick(&mut probe).val().inner();
        let fd = finite_differences(&at, |w| {
            let mut shifted = experts.clone();
            *pick(&mut shifted) = Param::from_tensor(Tensor::from_inner(w));
            loss(&shifted, Tensor::from_inner(tokens.clone()))
        });
        assert_close(
            &format!("padded experts d{name}"),
            &grad,
            &fd,
            tolerance::FINITE_DIFFERENCE_F64,
        );
        // Each expert's block is 6 elements ([3, 2] or [2, 3]); the second has no tokens.
        assert_near_zero(&format!("d{name}[1] (no tokens)"), &grad[6..12], 0.0);
    }
}
