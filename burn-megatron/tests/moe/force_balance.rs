//! `--moe-router-force-load-balancing`: the router routes by a hash of its logits, so a batch
//! whose logits all favour one expert is spread evenly; the choice is the top-k of
//! `balancing_logits`; the router's gradient passes straight through to its logits; and
//! through `pretrain_gpt`, EP 2 equals EP 1 with it and the logged load is even.

use burn::tensor::activation::softmax;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::training::{Silent, pretrain_on_threads};
use burn_megatron::transformer::moe::{Router, RouterSettings, balancing_logits};

use crate::pretrain::moe_run_with;
use crate::{AD, B, assert_close, tolerance, top_k_of_rows, values};

const TOKENS: usize = 256;
const HIDDEN: usize = 8;
const EXPERTS: usize = 8;

/// `n` values in `[-1, 1)` from a fixed sequence.
fn fixed(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 50.5 - 1.0)
        .collect()
}

/// A router weight under which every token's logit for expert 0 leads by about 5.
fn skewed_weight() -> Vec<f32> {
    (0..HIDDEN * EXPERTS)
        .map(|i| match i % EXPERTS {
            0 => 5.0,
            e => 0.01 * e as f32,
        })
        .collect()
}

fn tensor<Bk: burn::tensor::backend::Backend>(v: &[f32], shape: [usize; 2]) -> Tensor<Bk, 2> {
    Tensor::from_data(TensorData::new(v.to_vec(), shape), &Default::default())
}

/// Tokens with positive features, so that the skewed weight favours expert 0 for all.
fn tokens() -> Vec<f32> {
    fixed(TOKENS * HIDDEN, 3).iter().map(|v| 1.5 + v).collect()
}

/// The plain router sends every token to expert 0; with the switch each expert gets between
/// half and one and a half times the mean load, and the choice is the top-2 of
/// `balancing_logits` of the logits.
#[test]
fn forced_routing_spreads_a_skewed_batch() {
    let x = tensor::<B>(&tokens(), [TOKENS, HIDDEN]);
    let w = tensor::<B>(&skewed_weight(), [HIDDEN, EXPERTS]);
    let route = |force: bool| {
        let settings = RouterSettings {
            force_load_balancing: force,
            ..Default::default()
        };
        Router::new(w.clone(), settings).route(x.clone())
    };
    let plain = route(false).read_tokens_per_expert().expect("counts");
    assert_eq!(
        plain[0], TOKENS,
        "the plain routing sends every token to expert 0"
    );
    let forced = route(true);
    let load = forced.read_tokens_per_expert().expect("counts");
    let mean = (TOKENS * 2 / EXPERTS) as f64;
    for (e, &n) in load.iter().enumerate() {
        assert!(
            (0.5 * mean..=1.5 * mean).contains(&(n as f64)),
            "expert {e}: {n} of a mean {mean} ({load:?})"
        );
    }
    let hashed = values(balancing_logits(x.clone().matmul(w.clone())));
    let hashed: Vec<f32> = hashed.into_iter().map(|v| v as f32).collect();
    assert!(hashed.iter().all(|v| (0.0..1.0).contains(v)));
    assert_eq!(
        forced.read_experts().expect("experts"),
        top_k_of_rows(&hashed, EXPERTS, 2),
        "the choice"
    );
}

/// The router's weight gradient with the switch is the logits' gradient of the same loss
/// computed from the hashed logits as a leaf, times the tokens: the hash passes the gradient
/// straight through, as Megatron's random logits do.
#[test]
fn forced_routing_passes_the_gradient_straight_through() {
    let probe = fixed(TOKENS * 2, 5);
    let x = tensor::<AD>(&tokens(), [TOKENS, HIDDEN]);
    let w = tensor::<AD>(&fixed(HIDDEN * EXPERTS, 7), [HIDDEN, EXPERTS]).require_grad();
    let settings = RouterSettings {
        force_load_balancing: true,
        ..Default::default()
    };
    let routing = Router::new(w.clone(), settings).route(x.clone());
    let loss = (routing.weights.clone() * tensor::<AD>(&probe, [TOKENS, 2])).sum();
    let got = values(w.grad(&loss.backward()).expect("the weight's gradient"));
    // Softmax routing: the weights are a softmax over the chosen logits.
    let hashed = balancing_logits(x.clone().inner().matmul(w.clone().inner()));
    let leaf = Tensor::<AD, 2>::from_inner(hashed).require_grad();
    let chosen = routing.experts.clone().inner();
    let weights = softmax(leaf.clone().gather(1, Tensor::from_inner(chosen)), 1);
    let loss = (weights * tensor::<AD>(&probe, [TOKENS, 2])).sum();
    let d_logits = leaf.grad(&loss.backward()).expect("the logits' gradient");
    let want = values(x.inner().transpose().matmul(d_logits));
    assert_close("straight through", &got, &want, tolerance::F32);
    assert!(
        want.iter().any(|v| v.abs() > 1e-3),
        "a gradient that is not zero"
    );
}

/// Through `pretrain_gpt`: EP 2 × DP 2 with the switch gives EP 1 × DP 2's losses (the hash
/// is a function of the logits, the same wherever they are routed), and the logged load is
/// even where the plain run's is not.
#[test]
fn forced_routing_equals_ep_1_and_evens_the_logged_load() {
    let train = |ep: usize, extra: &[&str]| {
        pretrain_on_threads(&moe_run_with(2, ep, true, 4, extra), &Silent).expect("pretraining")
    };
    let force = ["--moe-router-force-load-balancing"];
    let (ep1, ep2) = (train(1, &force), train(2, &force));
    assert_close(
        "EP 2 against EP 1",
        &ep2.losses(),
        &ep1.losses(),
        tolerance::F32_TRAINING,
    );
    let plain = train(2, &[]);
    let max_load = |run: &burn_megatron::training::PretrainSummary| {
        run.iterations
            .iter()
            .map(|i| i.moe.expect("a report").expert_load_max)
            .fold(0.0, f64::max)
    };
    assert!(
        max_load(&ep2) < max_load(&plain),
        "forced {} against plain {}",
        max_load(&ep2),
        max_load(&plain)
    );
}
