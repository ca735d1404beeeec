//! Expert capacity (Megatron's `--moe-expert-capacity-factor`, `--moe-token-drop-policy`,
//! `--moe-pad-expert-input-to-capacity`): which assignments drop, by hand and against the
//! host-side statement of each policy; the output of a layer that drops, computed token by
//! token; padding changing nothing; a large factor bit-equal to the dropless layer; EP 1, 2,
//! 4 equal to the single device while dropping; the errors.
//!
//! What "equal to the single device" means with dropping: the capacity is each rank's, over
//! the tokens it routes (Megatron's sub-sequence dropping), so the dropped set depends on how
//! the tokens are split over the data-parallel ranks, not on the expert-parallel size. The
//! reference ([`reference`]) runs the EP = 1 layer on each rank's batch separately, so that it
//! drops what each rank drops; EP then only moves the kept assignments around.

use burn::module::Param;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::training::{PretrainArgs, Silent, pretrain_on_threads};
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::capacity::{keep_by_position, keep_by_weight};
use burn_megatron::transformer::moe::dispatcher::exclusive_cumsum_rows;
use burn_megatron::transformer::moe::{
    ExpertCapacity, MoeConfig, MoeSettings, RouterScoreFunction, TokenDropPolicy,
};
use clap::Parser;

use crate::expert_parallel::{Routing, assert_equivalent, batch, config, reference};
use crate::{B, assert_close, run, tolerance, values};

fn capacity(factor: f64, policy: TokenDropPolicy, pad: bool) -> Option<ExpertCapacity> {
    Some(
        ExpertCapacity::new(factor)
            .with_drop_policy(policy)
            .with_pad_to_capacity(pad),
    )
}

#[test]
fn capacity_is_megatrons_formula() {
    let c = |factor: f64, assignments, experts| {
        ExpertCapacity::new(factor).capacity(assignments, experts)
    };
    // ceil(assignments / experts · factor)
    assert_eq!(c(1.0, 8, 4), 2);
    assert_eq!(c(1.0, 9, 4), 3);
    assert_eq!(c(1.25, 12, 4), 4);
    assert_eq!(c(0.5, 12, 4), 2);
    assert_eq!(c(0.01, 12, 4), 1);
    let pad = ExpertCapacity::new(3.0).with_pad_to_capacity(true);
    assert_eq!(
        pad.padded_rows(9, 4),
        Some(4),
        "never more rows than tokens"
    );
    assert_eq!(pad.padded_rows(3, 4), Some(3));
    assert_eq!(ExpertCapacity::new(3.0).padded_rows(3, 4), None);
}

/// Seven tokens, top-1, capacity 2. Expert 0 gets tokens 0, 2, 4 and 6 with weights 0.5,
/// 0.7, 0.6, 0.6: by weight it keeps 2 (0.7) and 4 (0.6, tied with 6 but earlier); by
/// position 0 and 2. Experts 1 (tokens 1, 5) and 2 (token 3) are within capacity.
#[test]
fn which_assignments_drop_by_hand() {
    let experts = [0, 1, 0, 2, 0, 1, 0];
    let weights = [0.5, 0.9, 0.7, 0.3, 0.6, 0.8, 0.6];
    assert_eq!(
        keep_by_weight(&experts, &weights, 3, 2),
        [false, true, true, true, true, true, false]
    );
    assert_eq!(
        keep_by_position(&experts, 3, 2),
        [true, true, true, true, false, true, false]
    );
    // Top-2 (token-major): token t's assignments are 2t and 2t + 1.
    let experts = [0, 1, 1, 0, 0, 1];
    let weights = [0.6, 0.4, 0.9, 0.1, 0.5, 0.5];
    // Expert 0: tokens 0 (0.6), 1 (0.1), 2 (0.5); expert 1: 0 (0.4), 1 (0.9), 2 (0.5).
    assert_eq!(
        keep_by_weight(&experts, &weights, 2, 2),
        [true, false, true, false, true, true]
    );
    assert_eq!(
        keep_by_position(&experts, 2, 2),
        [true, true, true, true, false, false]
    );
}

/// A layer of two experts, top-1 of sigmoid scores, capacity 2 (4 tokens · 1 / 2 experts ·
/// factor 1), whose router sends tokens 0, 1, 2 to expert 0 with weights σ(0.5), σ(2), σ(1)
/// and token 3 to expert 1: the position policy drops token 2 (its output row is zeros), the probs policy
/// token 0; the other rows equal the dropless layer's, with or without padding.
#[test]
fn the_layer_drops_what_the_policy_says() {
    let x: Vec<f32> = [0.5, 2.0, 1.0, -1.0]
        .iter()
        .flat_map(|&a| [a, 0.3])
        .collect();
    let outputs = |capacity: Option<ExpertCapacity>| {
        run(1, |ctx| {
            let device = Default::default();
            let mut layer = MoeConfig::new(2, 2, 3)
                .with_top_k(1)
                .with_score_function(RouterScoreFunction::Sigmoid)
                .with_init_std(0.5)
                .with_capacity(capacity)
                .init::<B>(ctx.world(), 3, &device)
                .expect("a valid configuration");
            layer.router.weight = Param::from_tensor(Tensor::from_data(
                TensorData::new(vec![1.0f32, -1.0, 0.0, 0.0], [2, 2]),
                &device,
            ));
            let x = Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [1, 4, 2]), &device);
            let out = layer.try_forward(x)?;
            Ok((values(out.output), out.tokens_per_expert))
        })
        .pop()
        .expect("one rank")
    };
    let (dropless, counts) = outputs(None);
    assert_eq!(counts, [3, 1]);
    let row = |v: &[f64], t: usize| v[2 * t..2 * t + 2].to_vec();
    for (policy, dropped) in [(TokenDropPolicy::Position, 2), (TokenDropPolicy::Probs, 0)] {
        for pad in [false, true] {
            let (got, counts) = outputs(capacity(1.0, policy, pad));
            assert_eq!(counts, [2, 1], "{policy:?} pad {pad}: the kept load");
            for t in 0..4 {
                let at = format!("{policy:?} pad {pad} token {t}");
                if t == dropped {
                    assert_eq!(row(&got, t), [0.0, 0.0], "{at}: dropped");
                } else {
                    assert!(row(&got, t).iter().any(|&v| v != 0.0), "{at}: kept");
                    assert_close(&at, &row(&got, t), &row(&dropless, t), tolerance::F32);
                }
            }
        }
    }
}

/// Twelve tokens, four experts, top-2, factor 1 (capacity 6) and 0.5 (capacity 3): each
/// token's output is the weighted sum of the experts of the assignments the policy keeps
/// (computed token by token from the router's choice and the experts themselves).
#[test]
fn the_layer_output_is_the_sum_over_kept_assignments() {
    for factor in [1.0, 0.5] {
        for policy in [TokenDropPolicy::Probs, TokenDropPolicy::Position] {
            run(1, |ctx| {
                let device = Default::default();
                let config = MoeConfig::new(8, 4, 6)
                    .with_top_k(2)
                    .with_init_std(0.5)
                    .with_capacity(capacity(factor, policy, false));
                let layer = config
                    .init::<B>(ctx.world(), 11, &device)
                    .expect("a valid configuration");
                let (x, _) = batch(0, Routing::Free);
                let x = Tensor::cat(vec![x.clone(), x.clone().mul_scalar(-0.7), x], 1);
                let [b, s, h] = x.dims();
                let tokens = x.clone().reshape([b * s, h]);
                let routing = layer.router.route(tokens.clone());
                let chosen = routing.read_experts().expect("the choice");
                let weights = values(routing.weights.clone());
                let weights_f32: Vec<f32> = weights.iter().map(|&w| w as f32).collect();
                let cap = config.capacity.unwrap().capacity(chosen.len(), 4);
                let keep = match policy {
                    TokenDropPolicy::Probs => keep_by_weight(&chosen, &weights_f32, 4, cap),
                    TokenDropPolicy::Position => keep_by_position(&chosen, 4, cap),
                };
                if factor < 1.0 {
                    assert!(keep.contains(&false), "factor {factor}: something drops");
                }
                let out = layer.try_forward(x)?;
                let got = values(out.output);
                let mut want = vec![0.0; b * s * h];
                for (a, (&e, &kept)) in chosen.iter().zip(&keep).enumerate() {
                    if !kept {
                        continue;
                    }
                    let t = a / 2;
                    let y = values(
                        layer
                            .experts
                            .forward_expert(e, tokens.clone().narrow(0, t, 1)),
                    );
                    for (w, y) in want[t * h..(t + 1) * h].iter_mut().zip(y) {
                        *w += weights[a] * y;
                    }
                }
                assert_close(
                    &format!("factor {factor} {policy:?}"),
                    &got,
                    &want,
                    tolerance::F32,
                );
                let mut kept_load = [0usize; 4];
                for (&e, &k) in chosen.iter().zip(&keep) {
                    kept_load[e] += usize::from(k);
                }
                assert_eq!(out.tokens_per_expert, kept_load);
                assert!(out.tokens_per_expert.iter().all(|&n| n <= cap));
                Ok(())
            });
        }
    }
}

/// Assignments dropped on each of `ranks` ranks' batches by the reference.
fn dropped(config: &MoeConfig, ranks: usize, routing: Routing) -> Vec<usize> {
    let (outcomes, _) = reference(config, ranks, routing);
    outcomes
        .iter()
        .enumerate()
        .map(|(rank, o)| 2 * (2 + rank) * config.top_k - o.tokens_per_expert.iter().sum::<usize>())
        .collect()
}

#[test]
fn ep_with_dropping_by_probs_equals_one_device() {
    let config = config(2, Activation::SwiGlu, true).with_capacity(capacity(
        0.5,
        TokenDropPolicy::Probs,
        false,
    ));
    assert!(dropped(&config, 4, Routing::Free).iter().all(|&d| d > 0));
    assert_equivalent("top-2 probs 0.5", &config, Routing::Free);
}

#[test]
fn ep_with_dropping_by_position_padded_equals_one_device() {
    let config = config(2, Activation::Gelu, false)
        .with_score_function(RouterScoreFunction::Sigmoid)
        .with_normalize_top_k(true)
        .with_capacity(capacity(1.0, TokenDropPolicy::Position, true));
    assert!(dropped(&config, 4, Routing::Free).iter().sum::<usize>() > 0);
    assert_equivalent("top-2 position 1.0 padded", &config, Routing::Free);
}

/// Experts 2 and 3 get no token at all (ranks with no work at EP 2 and 4) while experts 0
/// and 1 overflow.
#[test]
fn ep_with_dropping_and_starved_experts_equals_one_device() {
    for policy in [TokenDropPolicy::Probs, TokenDropPolicy::Position] {
        for pad in [false, true] {
            let config =
                config(1, Activation::SwiGlu, true).with_capacity(capacity(1.0, policy, pad));
            assert!(
                dropped(&config, 4, Routing::StarveExperts23)
                    .iter()
                    .all(|&d| d > 0)
            );
            assert_equivalent(
                &format!("top-1 {policy:?} pad {pad}"),
                &config,
                Routing::StarveExperts23,
            );
        }
    }
}

#[test]
fn ep_with_dropping_over_eight_experts_equals_one_device() {
    let config = MoeConfig {
        num_experts: 8,
        ..config(2, Activation::SwiGlu, false)
    }
    .with_capacity(capacity(1.0, TokenDropPolicy::Probs, true));
    assert!(dropped(&config, 4, Routing::Free).iter().sum::<usize>() > 0);
    assert_equivalent("top-2 eight experts probs padded", &config, Routing::Free);
}

/// Padding to capacity changes neither outputs, losses nor any gradient.
#[test]
fn padding_changes_nothing() {
    for policy in [TokenDropPolicy::Probs, TokenDropPolicy::Position] {
        let base = config(2, Activation::SwiGlu, true);
        let (plain, plain_grads) = reference(
            &base.clone().with_capacity(capacity(0.5, policy, false)),
            3,
            Routing::Free,
        );
        let (padded, padded_grads) = reference(
            &base.with_capacity(capacity(0.5, policy, true)),
            3,
            Routing::Free,
        );
        for (rank, (p, q)) in plain.iter().zip(&padded).enumerate() {
            let at = |what: &str| format!("{policy:?} rank {rank}: {what}");
            assert_eq!(p.tokens_per_expert, q.tokens_per_expert, "{}", at("load"));
            assert_close(&at("output"), &q.output, &p.output, tolerance::F32);
            assert_close(
                &at("input gradient"),
                &q.input_grad,
                &p.input_grad,
                tolerance::F32,
            );
            assert_eq!(
                [p.load_balancing_loss, p.z_loss],
                [q.load_balancing_loss, q.z_loss],
                "{}",
                at("losses")
            );
        }
        for ((path, p), (_, q)) in plain_grads.iter().zip(&padded_grads) {
            assert_close(
                &format!("{policy:?}: gradient of {path}"),
                q,
                p,
                tolerance::F32,
            );
        }
    }
}

/// A factor large enough that no expert overflows gives the dropless layer, bit for bit.
#[test]
fn a_large_factor_is_dropless_bit_for_bit() {
    let base = config(2, Activation::SwiGlu, true);
    let (want, want_grads) = reference(&base, 3, Routing::Free);
    for policy in [TokenDropPolicy::Probs, TokenDropPolicy::Position] {
        let (got, got_grads) = reference(
            &base.clone().with_capacity(capacity(4.0, policy, false)),
            3,
            Routing::Free,
        );
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.output, w.output, "{policy:?}");
            assert_eq!(g.input_grad, w.input_grad, "{policy:?}");
            assert_eq!(g.tokens_per_expert, w.tokens_per_expert, "{policy:?}");
            assert_eq!(
                [g.load_balancing_loss, g.z_loss],
                [w.load_balancing_loss, w.z_loss]
            );
        }
        assert_eq!(got_grads, want_grads, "{policy:?}");
    }
}

#[test]
fn capacity_factor_must_be_finite_and_positive() {
    for factor in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let m = MoeConfig::new(8, 4, 4)
            .with_capacity(Some(ExpertCapacity::new(factor)))
            .validate(1)
            .expect_err("an invalid factor")
            .to_string();
        assert!(m.contains("--moe-expert-capacity-factor"), "{m}");
        assert!(m.contains("finite number above 0"), "{m}");
        let m = MoeSettings::new(4)
            .with_capacity(Some(ExpertCapacity::new(factor)))
            .validate(8, 16, 2, 1)
            .expect_err("an invalid factor")
            .to_string();
        assert!(m.contains("--moe-expert-capacity-factor"), "{m}");
    }
}

/// `pretrain_gpt`'s options: parsed into the model's settings, and refused where they make
/// no sense, each error naming the option.
#[test]
fn pretrain_gpt_capacity_options() {
    let parse = |extra: &[&str]| {
        let base = [
            "pretrain_gpt",
            "--tensor-model-parallel-size",
            "1",
            "--pipeline-model-parallel-size",
            "1",
            "--data-parallel-size",
            "2",
            "--num-experts",
            "4",
        ];
        PretrainArgs::parse_from(base.iter().chain(extra)).into_config()
    };
    let config = parse(&[
        "--moe-expert-capacity-factor",
        "1.25",
        "--moe-token-drop-policy",
        "position",
        "--moe-pad-expert-input-to-capacity",
    ])
    .expect("valid options");
    assert_eq!(
        config.model().moe.expect("MoE").capacity,
        capacity(1.25, TokenDropPolicy::Position, true)
    );
    let config = parse(&["--moe-expert-capacity-factor", "2"]).expect("valid options");
    assert_eq!(
        config.model().moe.expect("MoE").capacity,
        capacity(2.0, TokenDropPolicy::Probs, false)
    );
    assert_eq!(
        parse(&[])
            .expect("valid")
            .model()
            .moe
            .expect("MoE")
            .capacity,
        None
    );

    let m = parse(&["--moe-token-drop-policy", "random"])
        .expect_err("an unknown policy")
        .to_string();
    assert!(
        m.contains("--moe-token-drop-policy \"random\": use probs"),
        "{m}"
    );
    let checked = |extra: &[&str]| {
        let config = parse(extra).expect("parsed");
        config
            .check(config.world_size())
            .expect_err("refused")
            .to_string()
    };
    for extra in [
        &["--moe-token-drop-policy", "probs"][..],
        &["--moe-pad-expert-input-to-capacity"][..],
    ] {
        let m = checked(extra);
        assert!(m.contains(extra[0]), "{m}");
        assert!(
            m.contains("takes effect with --moe-expert-capacity-factor"),
            "{m}"
        );
    }
    for factor in ["0", "NaN", "inf"] {
        let m = checked(&["--moe-expert-capacity-factor", factor]);
        assert!(m.contains("--moe-expert-capacity-factor is"), "{m}");
    }
    let config = PretrainArgs::parse_from([
        "pretrain_gpt",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--moe-expert-capacity-factor",
        "1",
    ])
    .into_config()
    .expect("parsed");
    let m = config
        .check(config.world_size())
        .expect_err("refused")
        .to_string();
    assert!(m.contains("need --num-experts"), "{m}");
}

/// `pretrain_gpt` at EP 2 with capacity factor 1, the position policy and padding: the loss
/// falls and the load logged never exceeds what the capacity lets through.
#[test]
fn pretrain_gpt_with_capacity_trains() {
    let mut args = crate::pretrain::EP_2.to_vec();
    args.extend_from_slice(&[
        "--moe-aux-loss-coeff",
        "0.01",
        "--moe-expert-capacity-factor",
        "1.0",
        "--moe-token-drop-policy",
        "position",
        "--moe-pad-expert-input-to-capacity",
    ]);
    let config = crate::pretrain::config(&args);
    let summary = pretrain_on_threads(&config, &Silent).expect("pretraining");
    let losses = summary.losses();
    assert!(
        losses.iter().all(|l| l.is_finite()) && losses[5] < losses[0] - 0.3,
        "the loss must fall: {losses:?}"
    );
    let report = summary.iterations[5].moe.expect("the MoE report");
    assert!(report.expert_load_max.is_finite() && report.expert_load_max > 0.0);
    // 8 sequences of 16 tokens a step, 2 experts each, in 2 MoE layers.
    assert_eq!(report.assignments, 512.0, "{report:?}");
    let dropped = report.dropped_assignments.expect("a capacity");
    assert!((0.0..512.0).contains(&dropped), "{report:?}");
}

/// The log counts the assignments dropped: at capacity factor 0.5 each expert keeps at most
/// `ceil(32 · 2 / 4 · 0.5) = 8` of a rank's 64 assignments in a microbatch, so at least half
/// of the step's 512 drop; dropless layers report none.
#[test]
fn pretrain_gpt_logs_the_assignments_dropped() {
    let run = |extra: &[&str]| {
        let mut args = crate::pretrain::EP_2.to_vec();
        args.extend_from_slice(extra);
        let config = crate::pretrain::config(&args).with_train_iters(2);
        let summary = pretrain_on_threads(&config, &Silent).expect("pretraining");
        summary.iterations[1].moe.expect("the MoE report")
    };
    let report = run(&["--moe-expert-capacity-factor", "0.5"]);
    assert_eq!(report.assignments, 512.0, "{report:?}");
    let dropped = report.dropped_assignments.expect("a capacity");
    assert!((256.0..512.0).contains(&dropped), "{report:?}");
    let report = run(&[]);
    assert_eq!(report.assignments, 512.0, "{report:?}");
    assert_eq!(report.dropped_assignments, None, "{report:?}");
}

/// The dispatcher's cumulative sum in blocks of `√n` rows (which replaced one long `cumsum`,
/// quadratic on CubeCL) against the plain sum of the rows before, for every `n` to 40 (whole,
/// partial and single blocks).
#[test]
fn blocked_cumulative_sum_is_the_sum_of_the_rows_before() {
    let device = Default::default();
    for n in 1..=40usize {
        let x: Vec<i64> = (0..n * 3).map(|i| ((i * 7 + n) % 5) as i64 - 1).collect();
        let tensor = Tensor::<B, 2, Int>::from_data(TensorData::new(x.clone(), [n, 3]), &device);
        let got: Vec<i64> = exclusive_cumsum_rows(tensor)
            .into_data()
            .convert::<i64>()
            .to_vec()
            .expect("integers");
        let mut want = vec![0i64; n * 3];
        for i in 1..n {
            for c in 0..3 {
                want[i * 3 + c] = want[(i - 1) * 3 + c] + x[(i - 1) * 3 + c];
            }
        }
        assert_eq!(got, want, "n = {n}");
    }
}
