//! Invalid MoE settings are refused at init with a message that says what would be valid.

use burn_megatron::transformer::moe::MoeConfig;

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
