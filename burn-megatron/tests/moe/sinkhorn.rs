//! `--moe-router-load-balancing-type sinkhorn`: the normalisation against Megatron's loop
//! computed on the host, over one rank and over a sequence split over two ranks; the router's
//! choice in training (the normalised top-k) and in evaluation (the weights' top-k), its
//! weights, and the options it refuses.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::transformer::moe::{
    LoadBalancingType, MoeSettings, Router, RouterScoreFunction, RouterSettings,
    SINKHORN_MAX_ITERATIONS, sinkhorn,
};

use crate::{AD, B, assert_close, run, tolerance, top_k_of_rows};

const TOKENS: usize = 12;
const EXPERTS: usize = 4;

/// Logits that all prefer expert 0 (by 2 to 3) and then expert 1: a plain top-k sends every
/// token to the same experts.
fn skewed_logits() -> Vec<f32> {
    (0..TOKENS * EXPERTS)
        .map(|i| {
            let (t, e) = (i / EXPERTS, i % EXPERTS);
            let base = [3.0, 1.0, 0.5, 0.0][e];
            base + ((t * 7 + e * 3) % 11) as f32 / 11.0
        })
        .collect()
}

/// Logits spread over `[-5, 5]` that take Megatron's loop 22 iterations (more than one
/// read's 16).
fn slow_logits() -> Vec<f32> {
    (0..TOKENS * EXPERTS)
        .map(|i| {
            let (t, e) = (i / EXPERTS, i % EXPERTS);
            5.0 * (((t * 13 + e * 7 + t * e * 5) % 17) as f32 / 8.5 - 1.0)
        })
        .collect()
}

/// Megatron's `sinkhorn` as it is written, on the host in f32, with its iterations counted.
fn megatrons_loop(logits: &[f32], tokens: usize, experts: usize) -> (Vec<f32>, usize) {
    megatrons_loop_up_to(logits, tokens, experts, usize::MAX)
}

/// [`megatrons_loop`] stopped after `limit` iterations.
fn megatrons_loop_up_to(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    limit: usize,
) -> (Vec<f32>, usize) {
    let cost: Vec<f32> = logits.iter().map(|l| l.exp()).collect();
    let (mut d0, mut d1) = (vec![1f32; tokens], vec![1f32; experts]);
    let eps = 1e-8f32;
    let mut error = 1e9f32;
    let mut iterations = 0;
    while error > 1e-4 && iterations < limit {
        for t in 0..tokens {
            let row: f32 = (0..experts).map(|e| d1[e] * cost[t * experts + e]).sum();
            d0[t] = (1.0 / tokens as f32) / (row + eps);
        }
        let old = d1.clone();
        for e in 0..experts {
            let column: f32 = (0..tokens).map(|t| d0[t] * cost[t * experts + e]).sum();
            d1[e] = (1.0 / experts as f32) / (column + eps);
        }
        error = old.iter().zip(&d1).map(|(a, b)| (a - b).abs()).sum::<f32>() / experts as f32;
        iterations += 1;
    }
    let out = (0..tokens * experts)
        .map(|i| d1[i % experts] * cost[i] * d0[i / experts])
        .collect();
    (out, iterations)
}

fn tensor<Bk: burn::tensor::backend::Backend>(v: &[f32], shape: [usize; 2]) -> Tensor<Bk, 2> {
    Tensor::from_data(TensorData::new(v.to_vec(), shape), &Default::default())
}

fn f64s<Bk: burn::tensor::backend::Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().expect("f64")
}

/// The normalisation equals Megatron's loop (which takes more than one read's 16 iterations
/// on these logits, so the convergence is checked on the device between reads). Its columns
/// sum to `1 / E` (the expert factors come last) and its rows to `1 / T` within the
/// tolerance.
#[test]
fn sinkhorn_equals_megatrons_loop() {
    let logits = slow_logits();
    let (want, iterations) = megatrons_loop(&logits, TOKENS, EXPERTS);
    assert!((17..=32).contains(&iterations), "{iterations} iterations");
    let got = f64s(sinkhorn(tensor::<B>(&logits, [TOKENS, EXPERTS]), None).expect("sinkhorn"));
    let want: Vec<f64> = want.into_iter().map(f64::from).collect();
    assert_close("sinkhorn", &got, &want, tolerance::F32);
    let rows: Vec<f64> = got.chunks(EXPERTS).map(|r| r.iter().sum()).collect();
    assert_close("rows", &rows, &[1.0 / TOKENS as f64; TOKENS], 1e-3);
    let columns: Vec<f64> = (0..EXPERTS)
        .map(|e| got.iter().skip(e).step_by(EXPERTS).sum())
        .collect();
    assert_close(
        "columns",
        &columns,
        &[1.0 / EXPERTS as f64; EXPERTS],
        tolerance::F32,
    );
}

/// Logits of which one expert leads every token by 8: Megatron's loop runs past 5 000
/// iterations without reaching its tolerance (it would not stop). Here the normalisation
/// stops after [`SINKHORN_MAX_ITERATIONS`], with the loop's values at that count.
#[test]
fn sinkhorn_stops_where_megatrons_loop_would_not() {
    let logits: Vec<f32> = (0..TOKENS * EXPERTS)
        .map(|i| {
            let (t, e) = (i / EXPERTS, i % EXPERTS);
            [8.0, 1.0, 0.5, 0.0][e] + ((t * 7 + e * 3) % 11) as f32 / 11.0
        })
        .collect();
    let (_, iterations) = megatrons_loop_up_to(&logits, TOKENS, EXPERTS, 5000);
    assert_eq!(iterations, 5000, "Megatron's loop converged");
    let (want, _) = megatrons_loop_up_to(&logits, TOKENS, EXPERTS, SINKHORN_MAX_ITERATIONS);
    let got = f64s(sinkhorn(tensor::<B>(&logits, [TOKENS, EXPERTS]), None).expect("sinkhorn"));
    let want: Vec<f64> = want.into_iter().map(f64::from).collect();
    assert_close(
        "after the last iteration",
        &got,
        &want,
        tolerance::F32_LONG_SUM,
    );
}

/// Over a sequence split between two ranks, each expert's sum runs over both halves: the two
/// ranks' rows together are the one-rank normalisation of the whole sequence.
#[test]
fn sinkhorn_over_a_split_sequence_equals_one_rank() {
    let logits = slow_logits();
    let one = f64s(sinkhorn(tensor::<B>(&logits, [TOKENS, EXPERTS]), None).expect("sinkhorn"));
    let half = TOKENS / 2 * EXPERTS;
    let parts = run(2, |ctx| {
        let world = ctx.world();
        let mine = &logits[world.rank() * half..][..half];
        let out = sinkhorn(tensor::<B>(mine, [TOKENS / 2, EXPERTS]), Some(world))?;
        Ok(f64s(out))
    });
    let split: Vec<f64> = parts.concat();
    assert_close("split over two ranks", &split, &one, tolerance::F32);
    let alone = f64s(
        sinkhorn(tensor::<B>(&logits[..half], [TOKENS / 2, EXPERTS]), None).expect("sinkhorn"),
    );
    assert!(
        relative(&alone, &split[..half]) > 1e-3,
        "half a sequence alone must differ from its part of the whole"
    );
}

fn relative(a: &[f64], b: &[f64]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    (diff / norm).sqrt()
}

fn settings(top_k: usize) -> RouterSettings {
    RouterSettings {
        top_k,
        load_balancing: LoadBalancingType::Sinkhorn,
        ..Default::default()
    }
}

/// Tokens and a router weight whose logits are [`skewed_logits`]: the tokens are the identity
/// rows scaled, the weight the logits themselves (`[TOKENS, EXPERTS]` with `hidden = TOKENS`).
fn identity_tokens() -> Vec<f32> {
    (0..TOKENS * TOKENS)
        .map(|i| f32::from(u8::from(i / TOKENS == i % TOKENS)))
        .collect()
}

/// In training (a backend that tracks gradients) the router chooses the top-k of the
/// normalised logits; in evaluation, the top-k of its weights. Its weights are the softmax
/// over all experts at the chosen ones (top-2) or the sigmoid of the chosen logit (top-1),
/// there is no load-balancing loss, and the normalised choice spreads the skewed tokens
/// where the plain one sends them all to expert 0.
#[test]
fn router_chooses_by_sinkhorn_in_training_and_by_weight_in_evaluation() {
    let logits = skewed_logits();
    let (normalised, _) = megatrons_loop(&logits, TOKENS, EXPERTS);
    let top = |scores: &[f32], k: usize| top_k_of_rows(scores, EXPERTS, k);
    for top_k in [1, 2] {
        let training = Router::<AD>::new(tensor(&logits, [TOKENS, EXPERTS]), settings(top_k))
            .route(tensor(&identity_tokens(), [TOKENS, TOKENS]));
        let evaluation = Router::<B>::new(tensor(&logits, [TOKENS, EXPERTS]), settings(top_k))
            .route(tensor(&identity_tokens(), [TOKENS, TOKENS]));
        let chosen = training.read_experts().expect("experts");
        assert_eq!(
            chosen,
            top(&normalised, top_k),
            "training's choice, top-{top_k}"
        );
        let probs: Vec<f32> = match top_k {
            1 => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
            _ => logits
                .chunks(EXPERTS)
                .flat_map(|row| {
                    let sum: f32 = row.iter().map(|l| l.exp()).sum();
                    row.iter().map(move |l| l.exp() / sum).collect::<Vec<_>>()
                })
                .collect(),
        };
        assert_eq!(
            evaluation.read_experts().expect("experts"),
            top(&probs, top_k),
            "evaluation's choice, top-{top_k}"
        );
        let want: Vec<f64> = chosen
            .iter()
            .enumerate()
            .map(|(i, &e)| f64::from(probs[i / top_k * EXPERTS + e]))
            .collect();
        assert_close(
            "weights",
            &f64s(training.weights.clone()),
            &want,
            tolerance::F32,
        );
        assert_eq!(f64s(training.load_balancing_loss.clone()), [0.0]);
        let load = training.read_tokens_per_expert().expect("counts");
        let plain = evaluation.read_tokens_per_expert().expect("counts");
        assert_eq!(
            plain[0], TOKENS,
            "the plain choice sends every token to expert 0"
        );
        assert!(
            load.iter().max() < plain.iter().max(),
            "top-{top_k}: {load:?} against {plain:?}"
        );
    }
}

/// A change to the router's settings.
type Change = fn(&mut RouterSettings);

/// Sinkhorn balancing refuses what it would ignore: a load-balancing loss, sigmoid scores,
/// pre-softmax, normalised or scaled weights, groups, the expert bias and a capacity, each
/// named in the error.
#[test]
fn sinkhorn_refuses_the_options_it_would_ignore() {
    let router = |change: Change| {
        let mut s = settings(2);
        change(&mut s);
        s.validate(EXPERTS).map_err(|e| e.to_string())
    };
    assert!(router(|_| {}).is_ok());
    assert!(
        router(|s| s.top_k = 1).is_ok(),
        "top-1 takes the sigmoid, no pre-softmax"
    );
    let cases: [(Change, &str); 6] = [
        (|s| s.aux_loss_coeff = 0.01, "--moe-aux-loss-coeff"),
        (
            |s| s.score_function = RouterScoreFunction::Sigmoid,
            "--moe-router-score-function sigmoid",
        ),
        (|s| s.pre_softmax = true, "--moe-router-pre-softmax"),
        (|s| s.normalize_top_k = true, "--moe-router-topk-normalize"),
        (
            |s| {
                s.num_groups = Some(2);
                s.group_top_k = Some(1);
            },
            "--moe-router-num-groups",
        ),
        (
            |s| s.scaling_factor = Some(2.0),
            "--moe-router-topk-scaling-factor",
        ),
    ];
    for (change, option) in cases {
        let e = router(change).expect_err(option);
        assert!(
            e.contains("sinkhorn does not take") && e.contains(option),
            "{e}"
        );
    }
    let moe = || MoeSettings::new(EXPERTS).with_load_balancing_type(LoadBalancingType::Sinkhorn);
    assert!(moe().validate(8, 16, 2, 1).is_ok());
    let e = moe()
        .with_expert_bias(true)
        .validate(8, 16, 2, 1)
        .expect_err("expert bias")
        .to_string();
    assert!(e.contains("--moe-router-enable-expert-bias"), "{e}");
    let capacity = burn_megatron::transformer::moe::ExpertCapacity::new(1.0);
    let e = moe()
        .with_capacity(Some(capacity))
        .validate(8, 16, 2, 1)
        .expect_err("capacity")
        .to_string();
    assert!(e.contains("--moe-expert-capacity-factor"), "{e}");
}
