//! The router on two tokens and three experts whose logits are logarithms, so that every
//! score, weight and loss is a fraction worked out by hand in the comments.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::transformer::moe::{
    Router, RouterScoreFunction, RouterSettings, Routing, expert_bias_update,
};

use crate::{B, assert_close, tolerance, values};

/// Token 0 is `[1, 0]`, token 1 is `[0, 1]`, so their logits are the weight's rows:
/// `[0, ln 2, ln 1.5]` (softmax `[2, 4, 3] / 9`, log-sum-exp `ln 4.5`) and
/// `[ln 3, 0, ln 2]` (softmax `[3, 1, 2] / 6`, log-sum-exp `ln 6`).
fn route(score_function: RouterScoreFunction, top_k: usize, normalize_top_k: bool) -> Routing<B> {
    let device = Default::default();
    let (ln2, ln3, ln15) = (2f32.ln(), 3f32.ln(), 1.5f32.ln());
    let weight = Tensor::from_data(
        TensorData::new(vec![0.0, ln2, ln15, ln3, 0.0, ln2], [2, 3]),
        &device,
    );
    let router = Router::<B>::new(
        weight,
        RouterSettings {
            score_function,
            top_k,
            normalize_top_k,
            aux_loss_coeff: 0.1,
            z_loss_coeff: 0.01,
        },
    );
    let tokens = Tensor::from_data(TensorData::new(vec![1f32, 0.0, 0.0, 1.0], [2, 2]), &device);
    router.route(tokens)
}

fn close(name: &str, got: Tensor<B, 1>, want: f64) {
    assert_close(name, &values(got), &[want], tolerance::F32);
}

#[test]
fn softmax_top1() {
    let r = route(RouterScoreFunction::Softmax, 1, false);
    // Token 0 picks expert 1 (4/9), token 1 expert 0 (3/6).
    assert_eq!(r.read_experts().unwrap(), vec![1, 0]);
    assert_eq!(r.read_tokens_per_expert().unwrap(), vec![1, 1, 0]);
    assert_close(
        "weights",
        &values(r.weights),
        &[4.0 / 9.0, 0.5],
        tolerance::F32,
    );
    // f = [1/2, 1/2, 0]; P = ([2/9, 4/9, 3/9] + [3/6, 1/6, 2/6]) / 2 = [13, 11, 12] / 36;
    // 0.1 · 3 · (13/72 + 11/72) = 0.1.
    close("load-balancing loss", r.load_balancing_loss, 0.1);
    // 0.01 · ((ln 4.5)² + (ln 6)²) / 2.
    let z = 0.01 * (4.5f64.ln().powi(2) + 6f64.ln().powi(2)) / 2.0;
    close("z-loss", r.z_loss, z);
}

#[test]
fn softmax_top2_normalized() {
    let r = route(RouterScoreFunction::Softmax, 2, true);
    // Token 0: experts 1 and 2 (4/9, 3/9); token 1: experts 0 and 2 (3/6, 2/6).
    assert_eq!(r.read_experts().unwrap(), vec![1, 2, 0, 2]);
    assert_eq!(r.read_tokens_per_expert().unwrap(), vec![1, 1, 2]);
    // Normalised: [4/7, 3/7] and [3/5, 2/5].
    assert_close(
        "weights",
        &values(r.weights),
        &[4.0 / 7.0, 3.0 / 7.0, 0.6, 0.4],
        tolerance::F32,
    );
    // f = [1, 1, 2] / 4, P = [13, 11, 12] / 36: 0.1 · 3 · (13 + 11 + 24) / 144 = 0.1.
    close("load-balancing loss", r.load_balancing_loss, 0.1);
}

#[test]
fn unbalanced_load_costs_more() {
    // Both tokens on the same expert: weight rows [0, 0, ln 2] and [0, 0, ln 3], that is
    // softmax [1, 1, 2] / 4 and [1, 1, 3] / 5; both tokens pick expert 2.
    let device = Default::default();
    let weight = Tensor::from_data(
        TensorData::new(vec![0.0, 0.0, 2f32.ln(), 0.0, 0.0, 3f32.ln()], [2, 3]),
        &device,
    );
    let router = Router::<B>::new(
        weight,
        RouterSettings {
            score_function: RouterScoreFunction::Softmax,
            top_k: 1,
            normalize_top_k: false,
            aux_loss_coeff: 0.1,
            z_loss_coeff: 0.0,
        },
    );
    let tokens = Tensor::from_data(TensorData::new(vec![1f32, 0.0, 0.0, 1.0], [2, 2]), &device);
    let r = router.route(tokens);
    assert_eq!(r.read_experts().unwrap(), vec![2, 2]);
    // f = [0, 0, 1], P_2 = (2/4 + 3/5) / 2 = 11/20: 0.1 · 3 · 11/20 = 0.165.
    close("load-balancing loss", r.load_balancing_loss, 0.165);
    close("z-loss (coefficient 0)", r.z_loss, 0.0);
}

#[test]
fn sigmoid_top1() {
    let r = route(RouterScoreFunction::Sigmoid, 1, false);
    // σ of the logits: [1/2, 2/3, 3/5] and [3/4, 1/2, 2/3]: experts 1 and 0.
    assert_eq!(r.read_experts().unwrap(), vec![1, 0]);
    assert_close(
        "weights",
        &values(r.weights),
        &[2.0 / 3.0, 0.75],
        tolerance::F32,
    );
    // The loss normalises each token's scores: [15, 20, 18] / 53 and [9, 6, 8] / 23;
    // f = [1/2, 1/2, 0]: 0.1 · 3 · (1/2 · P_0 + 1/2 · P_1).
    let p0 = (15.0 / 53.0 + 9.0 / 23.0) / 2.0;
    let p1 = (20.0 / 53.0 + 6.0 / 23.0) / 2.0;
    close(
        "load-balancing loss",
        r.load_balancing_loss,
        0.3 * (p0 + p1) / 2.0,
    );
    // The z-loss reads the logits, whatever the score function.
    let z = 0.01 * (4.5f64.ln().powi(2) + 6f64.ln().powi(2)) / 2.0;
    close("z-loss", r.z_loss, z);
}

/// DeepSeek-V3's expert bias changes the choice, not the weight: a bias of `[0.3, 0, 0]`
/// lifts expert 0 (2/9 + 0.3 > 4/9) for token 0, whose weight is still its score 2/9; token 1
/// keeps expert 0 (3/6).
#[test]
fn expert_bias_picks_the_experts_but_not_their_weights() {
    let device = Default::default();
    let (ln2, ln3, ln15) = (2f32.ln(), 3f32.ln(), 1.5f32.ln());
    let weight = Tensor::from_data(
        TensorData::new(vec![0.0, ln2, ln15, ln3, 0.0, ln2], [2, 3]),
        &device,
    );
    let settings = RouterSettings {
        score_function: RouterScoreFunction::Softmax,
        top_k: 1,
        normalize_top_k: false,
        aux_loss_coeff: 0.0,
        z_loss_coeff: 0.0,
    };
    let bias = Tensor::from_data(TensorData::new(vec![0.3f32, 0.0, 0.0], [3]), &device);
    let router = Router::<B>::new(weight, settings).with_expert_bias(bias);
    let tokens = Tensor::from_data(TensorData::new(vec![1f32, 0.0, 0.0, 1.0], [2, 2]), &device);
    let r = router.route(tokens);
    assert_eq!(r.read_experts().unwrap(), vec![0, 0]);
    assert_eq!(r.read_tokens_per_expert().unwrap(), vec![2, 0, 0]);
    assert_close(
        "weights",
        &values(r.weights),
        &[2.0 / 9.0, 0.5],
        tolerance::F32,
    );
}

/// Megatron's update: counts `[6, 2, 2, 2]` (mean 3) move the bias by `rate · sign(mean −
/// count)`: down for the busy expert, up for the others; a count at the mean stays.
#[test]
fn expert_bias_update_follows_the_load() {
    assert_eq!(
        expert_bias_update(&[6.0, 2.0, 2.0, 2.0], 0.01),
        vec![-0.01, 0.01, 0.01, 0.01]
    );
    assert_eq!(
        expert_bias_update(&[3.0, 1.0, 2.0], 0.5),
        vec![-0.5, 0.5, 0.0]
    );
}
