//! The all-gather token dispatcher (`--moe-token-dispatcher-type allgather`): at EP 1, 2 and
//! 4 against the single-device layer (the all-to-all dispatcher at EP 1) on each rank's
//! batch, ranks of different batch lengths: outputs, losses, the input's and every
//! parameter's gradient (f32, 1e-5), top-1 and top-2, experts (and whole ranks) without
//! tokens, capacities that drop under both policies, padded or not; against the all-to-all
//! dispatcher on the same inputs: the same plan (kept assignments, capacities, blocks) and
//! the same expert input rows bit for bit, and the same layer results; `pretrain_gpt`'s
//! option, and a run at EP 2 × expert-DP 2 against the same run with `alltoall`. The GPT
//! model at EP × DP is in `gpt_model`, the f64 finite differences in the
//! `finite_differences` target.

use burn_megatron::training::{MoeReport, PretrainArgs, Silent, pretrain_on_threads};
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::{
    ExpertCapacity, MoeConfig, RouterScoreFunction, TokenDispatcher, TokenDispatcherType,
    TokenDropPolicy,
};
use burn_megatron_dist::ParallelSizes;

use crate::expert_parallel::{Routing, assert_equivalent, batch, config, expert_parallel};
use burn_megatron_testing::{paired, values_f32};
use clap::Parser;

use crate::{B, assert_close, run, tolerance, values};

fn all_gather(config: MoeConfig) -> MoeConfig {
    config.with_token_dispatcher(TokenDispatcherType::AllGather)
}

fn capacity(factor: f64, policy: TokenDropPolicy, pad: bool) -> Option<ExpertCapacity> {
    Some(
        ExpertCapacity::new(factor)
            .with_drop_policy(policy)
            .with_pad_to_capacity(pad),
    )
}

#[test]
fn top1_equals_one_device() {
    let config = all_gather(config(1, Activation::SwiGlu, false));
    assert_equivalent("all-gather top-1", &config, Routing::Free);
}

#[test]
fn top2_shared_expert_equals_one_device() {
    let config = all_gather(config(2, Activation::SwiGlu, true));
    assert_equivalent("all-gather top-2 shared", &config, Routing::Free);
}

/// Experts 2 and 3 get no token: at EP 2 rank 1's experts have no work, at EP 4 ranks 2 and
/// 3's; their gradients must be there (zero) and every rank still runs every collective.
#[test]
fn starved_experts_equal_one_device() {
    let top2 = all_gather(config(2, Activation::Gelu, false));
    assert_equivalent("all-gather top-2 starved", &top2, Routing::StarveExperts23);
    let top1 = all_gather(config(1, Activation::SwiGlu, true));
    assert_equivalent("all-gather top-1 starved", &top1, Routing::StarveExperts23);
}

/// Capacities that drop: top-2 by probs at factor 0.5 with a shared expert; sigmoid top-2 by
/// position, padded; top-1 with experts 2 and 3 starved while 0 and 1 overflow, under both
/// policies, padded or not; eight experts (two or four a rank), padded.
#[test]
fn dropping_equals_one_device() {
    let probs = all_gather(config(2, Activation::SwiGlu, true)).with_capacity(capacity(
        0.5,
        TokenDropPolicy::Probs,
        false,
    ));
    assert_equivalent("all-gather top-2 probs 0.5", &probs, Routing::Free);
    let position = all_gather(config(2, Activation::Gelu, false))
        .with_score_function(RouterScoreFunction::Sigmoid)
        .with_normalize_top_k(true)
        .with_capacity(capacity(1.0, TokenDropPolicy::Position, true));
    assert_equivalent("all-gather top-2 position padded", &position, Routing::Free);
    for policy in [TokenDropPolicy::Probs, TokenDropPolicy::Position] {
        for pad in [false, true] {
            let top1 = all_gather(config(1, Activation::SwiGlu, true))
                .with_capacity(capacity(1.0, policy, pad));
            assert_equivalent(
                &format!("all-gather top-1 {policy:?} pad {pad}"),
                &top1,
                Routing::StarveExperts23,
            );
        }
    }
    let eight = MoeConfig {
        num_experts: 8,
        ..all_gather(config(2, Activation::SwiGlu, false))
    }
    .with_capacity(capacity(1.0, TokenDropPolicy::Probs, true));
    assert_equivalent(
        "all-gather eight experts probs padded",
        &eight,
        Routing::Free,
    );
}

/// The two dispatchers on the same routing at EP 1, 2 and 4: the same plan (each expert's
/// kept load, the capacity, the assignments dropped, the rows each local expert receives)
/// and the same rows handed to the experts, bit for bit (so the same assignments dropped);
/// combining the same expert outputs gives the same tokens up to the order of the sums.
#[test]
fn both_dispatchers_plan_and_dispatch_the_same_rows() {
    let cases = [
        ("dropless top-2", None, 2),
        (
            "probs 0.5 top-2",
            capacity(0.5, TokenDropPolicy::Probs, false),
            2,
        ),
        (
            "position 0.75 top-1 padded",
            capacity(0.75, TokenDropPolicy::Position, true),
            1,
        ),
    ];
    for (name, capacity, top_k) in cases {
        let eight = MoeConfig {
            num_experts: 8,
            ..config(top_k, Activation::SwiGlu, false)
        };
        for ep in [1, 2, 4] {
            let ranks = run(ep, |ctx| {
                let state = ctx.parallel_state(ParallelSizes::default().with_ep(ep))?;
                let layer = eight
                    .init::<B>(state.ep(), 7, &Default::default())
                    .expect("a valid configuration");
                let (x, _) = batch(state.ep().rank(), Routing::Free);
                let [b, s, h] = x.dims();
                let tokens = x.reshape([b * s, h]);
                let routing = layer.router.route(tokens.clone());
                let mut got = Vec::new();
                for kind in [
                    TokenDispatcherType::AllToAll,
                    TokenDispatcherType::AllGather,
                ] {
                    let dispatcher = TokenDispatcher::new(state.ep(), 8, kind);
                    let plan = match &capacity {
                        None => dispatcher
                            .plan(routing.experts.clone(), routing.tokens_per_expert.clone())?,
                        Some(c) => dispatcher.plan_with_capacity(
                            routing.experts.clone(),
                            routing.tokens_per_expert.clone(),
                            routing.weights.clone(),
                            c,
                        )?,
                    };
                    let rows = dispatcher.dispatch(&plan, tokens.clone())?;
                    let output = dispatcher.combine(
                        &plan,
                        rows.clone().mul_scalar(2.0),
                        routing.weights.clone(),
                    )?;
                    got.push((
                        (
                            plan.tokens_per_expert.clone(),
                            plan.capacity,
                            plan.dropped,
                            plan.local_counts.clone(),
                        ),
                        values_f32(rows),
                        values(output),
                    ));
                }
                Ok(got)
            });
            for (rank, got) in ranks.iter().enumerate() {
                let at = format!("{name} EP {ep} rank {rank}");
                let [(a_plan, a_rows, a_out), (g_plan, g_rows, g_out)] = &got[..] else {
                    panic!("two dispatchers");
                };
                assert_eq!(g_plan, a_plan, "{at}: the plans");
                if capacity.is_some() {
                    assert!(ranks.iter().any(|r| r[0].0.2 > 0), "{at}: something drops");
                }
                assert_eq!(g_rows, a_rows, "{at}: the experts' rows");
                assert_close(&format!("{at}: combined"), g_out, a_out, tolerance::F32);
            }
        }
    }
}

/// The whole layer with each dispatcher on the same inputs at EP 2 and 4: outputs, losses,
/// loads, the input's and every parameter's gradient agree (f32, 1e-5), dropless and
/// dropping.
#[test]
fn both_dispatchers_give_the_same_layer() {
    let configs = [
        config(2, Activation::SwiGlu, true),
        config(2, Activation::Gelu, false).with_capacity(capacity(
            0.5,
            TokenDropPolicy::Probs,
            true,
        )),
    ];
    for base in configs {
        for ep in [2, 4] {
            let a = expert_parallel(
                &base
                    .clone()
                    .with_token_dispatcher(TokenDispatcherType::AllToAll),
                ep,
                Routing::Free,
            );
            let g = expert_parallel(&all_gather(base.clone()), ep, Routing::Free);
            for (rank, ((a, a_grads), (g, g_grads))) in a.iter().zip(&g).enumerate() {
                let at = |what: &str| format!("EP {ep} rank {rank}: {what}");
                assert_eq!(g.tokens_per_expert, a.tokens_per_expert, "{}", at("load"));
                assert_close(&at("output"), &g.output, &a.output, tolerance::F32);
                assert_close(
                    &at("input gradient"),
                    &g.input_grad,
                    &a.input_grad,
                    tolerance::F32,
                );
                assert_close(
                    &at("losses"),
                    &[g.load_balancing_loss, g.z_loss],
                    &[a.load_balancing_loss, a.z_loss],
                    tolerance::F32,
                );
                for (path, gg, ag) in paired(&at("grads"), g_grads, a_grads) {
                    assert_close(&at(path), gg, ag, tolerance::F32);
                }
            }
        }
    }
}

/// `--moe-token-dispatcher-type`: Megatron's names reach every MoE layer of the model; the
/// default is `alltoall` (see the option's doc); `flex`, an unknown name, and the option
/// without `--num-experts` are refused, naming the option.
#[test]
fn pretrain_gpt_dispatcher_option() {
    let parse = |extra: &[&str]| {
        let base = [
            "pretrain_gpt",
            "--tensor-model-parallel-size",
            "1",
            "--pipeline-model-parallel-size",
            "1",
        ];
        PretrainArgs::parse_from(base.iter().chain(extra)).into_config()
    };
    let kind = |extra: &[&str]| {
        let with_experts = [&["--num-experts", "4"][..], extra].concat();
        let config = parse(&with_experts).expect("valid options");
        config.model().moe.expect("MoE").token_dispatcher
    };
    assert_eq!(kind(&[]), TokenDispatcherType::AllToAll);
    assert_eq!(
        kind(&["--moe-token-dispatcher-type", "alltoall"]),
        TokenDispatcherType::AllToAll
    );
    let config = parse(&[
        "--num-experts",
        "4",
        "--moe-token-dispatcher-type",
        "allgather",
        "--moe-layer-freq",
        "([1]*1+[0]*1+[1]*1)",
        "--num-layers",
        "3",
    ])
    .expect("valid options");
    let layers = run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = config
            .model()
            .init_gpt::<B>(state.tp(), &Default::default())?;
        Ok(model
            .block
            .layers
            .iter()
            .map(|layer| layer.moe.as_ref().map(|moe| moe.dispatcher().kind()))
            .collect::<Vec<_>>())
    });
    let all_gather = Some(TokenDispatcherType::AllGather);
    assert_eq!(layers[0], [all_gather, None, all_gather]);

    for (name, want) in [
        (
            "flex",
            "flex (Megatron's DeepEP dispatcher) is not implemented",
        ),
        ("all_to_all", "\"all_to_all\": use alltoall"),
    ] {
        let m = parse(&["--num-experts", "4", "--moe-token-dispatcher-type", name])
            .expect_err("refused")
            .to_string();
        assert!(
            m.contains("--moe-token-dispatcher-type") && m.contains(want),
            "{m}"
        );
    }
    let config = parse(&["--moe-token-dispatcher-type", "allgather"]).expect("parsed");
    let m = config
        .check(config.world_size())
        .expect_err("refused")
        .to_string();
    assert!(m.contains("need --num-experts"), "{m}");
}

/// `pretrain_gpt` at EP 2 × expert-DP 2 (DP 4) with capacity factor 1: six steps with
/// `--moe-token-dispatcher-type allgather` give the losses and MoE reports of the same run
/// with `alltoall` (1e-4: AdamW amplifies last-bit differences from step to step), and the
/// loss falls.
#[test]
fn pretrain_gpt_with_the_all_gather_dispatcher_trains_as_all_to_all() {
    let run_with = |kind: &str| {
        let config = crate::pretrain::config(&[
            "--data-parallel-size",
            "4",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--moe-ffn-hidden-size",
            "24",
            "--moe-aux-loss-coeff",
            "0.01",
            "--moe-z-loss-coeff",
            "0.001",
            "--moe-expert-capacity-factor",
            "1.0",
            "--moe-token-dispatcher-type",
            kind,
        ]);
        pretrain_on_threads(&config, &Silent).expect("pretraining")
    };
    let (gathered, all_to_all) = (run_with("allgather"), run_with("alltoall"));
    let losses = gathered.losses();
    assert!(
        losses.iter().all(|l| l.is_finite()) && losses[5] < losses[0] - 0.3,
        "the loss must fall: {losses:?}"
    );
    assert_close(
        "losses",
        &losses,
        &all_to_all.losses(),
        tolerance::F32_TRAINING,
    );
    for (step, (g, a)) in gathered
        .iterations
        .iter()
        .zip(&all_to_all.iterations)
        .enumerate()
    {
        let report = |r: Option<MoeReport>| {
            let r = r.expect("the MoE report");
            [
                r.load_balancing_loss,
                r.z_loss,
                r.expert_load_min,
                r.expert_load_max,
            ]
        };
        assert_close(
            &format!("step {step}'s MoE report"),
            &report(g.moe),
            &report(a.moe),
            tolerance::F32_TRAINING,
        );
    }
}
