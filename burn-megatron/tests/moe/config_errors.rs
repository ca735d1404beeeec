//! Invalid MoE settings are refused at init with a message that says what would be valid.

use burn_megatron::transformer::moe::{MoeConfig, RouterScoreFunction};

fn message(config: MoeConfig, ep: usize) -> String {
    config
        .validate(ep)
        .expect_err("an invalid configuration")
        .to_string()
}

#[test]
fn experts_must_split_evenly_over_ep() {
    let m = message(MoeConfig::new(8, 6, 4), 4);
    assert!(m.contains("num_experts (6)"), "{m}");
    assert!(m.contains("valid EP sizes are 1, 2, 3, 6"), "{m}");
    assert!(MoeConfig::new(8, 6, 4).validate(3).is_ok());
}

#[test]
fn top_k_must_be_between_one_and_the_experts() {
    for top_k in [0, 5] {
        let m = message(MoeConfig::new(8, 4, 4).with_top_k(top_k), 1);
        assert!(m.contains(&format!("top_k ({top_k})")), "{m}");
        assert!(m.contains("between 1 and num_experts (4)"), "{m}");
    }
    assert!(MoeConfig::new(8, 4, 4).with_top_k(4).validate(1).is_ok());
}

#[test]
fn sizes_must_be_positive() {
    let m = message(MoeConfig::new(8, 0, 4), 1);
    assert!(m.contains("at least 1"), "{m}");
    let m = message(
        MoeConfig::new(8, 4, 4).with_shared_expert_ffn_hidden_size(Some(0)),
        1,
    );
    assert!(m.contains("shared expert"), "{m}");
}

/// Megatron refuses softmax top-1 without pre-softmax: a softmax over one logit is 1.
#[test]
fn softmax_top1_needs_pre_softmax() {
    let m = message(MoeConfig::new(8, 4, 4).with_top_k(1), 1);
    assert!(m.contains("--moe-router-pre-softmax"), "{m}");
    let ok = |config: MoeConfig| assert!(config.validate(1).is_ok());
    ok(MoeConfig::new(8, 4, 4).with_top_k(1).with_pre_softmax(true));
    ok(MoeConfig::new(8, 4, 4)
        .with_top_k(1)
        .with_score_function(RouterScoreFunction::Sigmoid));
}

/// Group-limited routing: both options, groups that split the experts, `group_top_k` in
/// `1..=num_groups` and not above `top_k`, and `top_k` within the eligible groups' experts.
#[test]
fn group_limited_routing_errors() {
    let groups = |num_groups: Option<usize>, group_top_k: Option<usize>, top_k: usize| {
        MoeConfig::new(8, 8, 4)
            .with_top_k(top_k)
            .with_num_groups(num_groups)
            .with_group_top_k(group_top_k)
    };
    let m = message(groups(Some(3), Some(1), 2), 1);
    assert!(m.contains("num_groups (3"), "{m}");
    assert!(m.contains("valid group counts are 1, 2, 4, 8"), "{m}");
    let m = message(groups(Some(4), Some(5), 2), 1);
    assert!(m.contains("between 1 and num_groups (4)"), "{m}");
    let m = message(groups(Some(4), Some(0), 2), 1);
    assert!(m.contains("between 1 and num_groups (4)"), "{m}");
    // 4 groups of 2: one group holds 2 experts, fewer than top_k 3.
    let m = message(groups(Some(4), Some(1), 3), 1);
    assert!(m.contains("top_k (3) is more than the 2 experts"), "{m}");
    let m = message(groups(Some(4), Some(3), 2), 1);
    assert!(m.contains("must not exceed top_k (2)"), "{m}");
    let m = message(groups(None, Some(1), 2), 1);
    assert!(m.contains("needs num_groups"), "{m}");
    let m = message(groups(Some(4), None, 2), 1);
    assert!(m.contains("set both or neither"), "{m}");
    assert!(groups(Some(4), Some(2), 4).validate(1).is_ok());
    assert!(groups(Some(4), Some(1), 2).validate(2).is_ok());
}

#[test]
fn scaling_factor_must_be_finite_and_positive() {
    for factor in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
        let m = message(
            MoeConfig::new(8, 4, 4).with_top_k_scaling_factor(Some(factor)),
            1,
        );
        assert!(m.contains("--moe-router-topk-scaling-factor"), "{m}");
    }
    assert!(
        MoeConfig::new(8, 4, 4)
            .with_top_k_scaling_factor(Some(2.5))
            .validate(1)
            .is_ok()
    );
}

/// A list of load-balancing types (Megatron's `--moe-router-load-balancing-type aux_loss
/// seq_aux_loss`) holds losses only, each once, with finite coefficients not below 0; the
/// input jitter's ε is in `[0, 1)`.
#[test]
fn load_balancing_lists_and_jitter_errors() {
    use burn_megatron::transformer::moe::{AuxLossTerm, LoadBalancingType};
    let list = |first, more: Vec<AuxLossTerm>| {
        MoeConfig::new(8, 4, 4)
            .with_load_balancing_type(first)
            .with_aux_loss_coeff(0.01)
            .with_more_aux_losses(more)
    };
    let term = AuxLossTerm::new;
    let m = message(
        list(
            LoadBalancingType::Sinkhorn,
            vec![term(LoadBalancingType::AuxLoss, 0.01)],
        ),
        1,
    );
    assert!(
        m.contains("lists sinkhorn: a list combines losses only"),
        "{m}"
    );
    let m = message(
        list(
            LoadBalancingType::AuxLoss,
            vec![term(LoadBalancingType::None, 0.0)],
        ),
        1,
    );
    assert!(m.contains("lists none"), "{m}");
    let m = message(
        list(
            LoadBalancingType::SeqAuxLoss,
            vec![
                term(LoadBalancingType::AuxLoss, 0.01),
                term(LoadBalancingType::SeqAuxLoss, 0.01),
            ],
        ),
        1,
    );
    assert!(m.contains("lists seq_aux_loss twice"), "{m}");
    let m = message(
        list(
            LoadBalancingType::AuxLoss,
            vec![term(LoadBalancingType::GlobalAuxLoss, f64::NAN)],
        ),
        1,
    );
    assert!(
        m.contains("--moe-aux-loss-coeff is NaN for global_aux_loss"),
        "{m}"
    );
    for eps in [1.0, -0.1, f64::INFINITY] {
        let m = message(MoeConfig::new(8, 4, 4).with_input_jitter_eps(Some(eps)), 1);
        assert!(m.contains("--moe-input-jitter-eps is"), "{m}");
    }
    let ok = list(
        LoadBalancingType::AuxLoss,
        vec![
            term(LoadBalancingType::SeqAuxLoss, 0.001),
            term(LoadBalancingType::GlobalAuxLoss, 0.0),
        ],
    )
    .with_input_jitter_eps(Some(0.01));
    assert!(ok.validate(1).is_ok());
}
