//! Every invalid configuration is refused at construction with a message saying what is
//! wrong and what would be valid.

use burn_megatron::transformer::{PositionEmbedding, TransformerConfig};

use crate::{AD, run};

/// The error `config` gives on `tp` ranks, as rank 0 reports it.
fn error(config: TransformerConfig, tp: usize) -> String {
    run(tp, |ctx| {
        Ok(
            match config.init_gpt::<AD>(ctx.world(), &Default::default()) {
                Ok(_) => "no error".to_string(),
                Err(e) => e.to_string(),
            },
        )
    })
    .remove(0)
}

#[test]
fn heads_not_divisible_by_tp() {
    assert_eq!(
        error(TransformerConfig::new(24, 1, 6, 32, 64, 8), 4),
        "attention heads (6) must be divisible by TP (4): valid TP sizes are 1, 2, 3, 6"
    );
}

#[test]
fn query_groups_not_divisible_by_tp() {
    assert_eq!(
        error(
            TransformerConfig::new(16, 1, 4, 32, 64, 8).with_num_query_groups(Some(1)),
            2
        ),
        "query groups (1) must be divisible by TP (2): valid TP sizes are 1"
    );
}

#[test]
fn ffn_not_divisible_by_tp() {
    assert_eq!(
        error(TransformerConfig::new(16, 1, 4, 30, 64, 8), 4),
        "FFN hidden size (30) must be divisible by TP (4): valid TP sizes are 1, 2, 3, 5, 6, 10, 15, 30"
    );
}

#[test]
fn sequence_not_divisible_by_tp_under_sequence_parallelism() {
    let config = TransformerConfig::new(16, 1, 4, 32, 64, 6).with_sequence_parallel(true);
    assert_eq!(
        error(config, 4),
        "maximum sequence length (sequence parallelism splits it) (6) must be divisible by TP (4): valid TP sizes are 1, 2, 3, 6"
    );
}

#[test]
fn heads_not_dividing_hidden_or_groups_not_dividing_heads() {
    assert_eq!(
        error(TransformerConfig::new(18, 1, 4, 32, 64, 8), 1),
        "hidden size (18) must be divisible by the attention heads (4)"
    );
    assert_eq!(
        error(
            TransformerConfig::new(16, 1, 4, 32, 64, 8).with_num_query_groups(Some(3)),
            1
        ),
        "attention heads (4) must be divisible by the query groups (3)"
    );
}

#[test]
fn other_bad_settings() {
    let base = || TransformerConfig::new(16, 1, 4, 32, 64, 8);
    assert_eq!(
        error(TransformerConfig::new(16, 0, 4, 32, 64, 8), 1),
        "num_layers must be at least 1"
    );
    assert_eq!(
        error(base().with_hidden_dropout(1.0), 1),
        "hidden_dropout must be in [0, 1), got 1"
    );
    assert_eq!(
        error(base().with_norm_epsilon(0.0), 1),
        "norm_epsilon must be positive, got 0"
    );
    assert_eq!(
        error(
            TransformerConfig::new(12, 1, 4, 32, 64, 8)
                .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 }),
            1
        ),
        "RoPE needs an even head dimension (got 3) and a base above 1 (got 10000)"
    );
}

#[test]
fn vocab_not_divisible_by_tp_is_padded_and_said() {
    let notes = run(2, |ctx| {
        let model = TransformerConfig::new(16, 1, 4, 32, 50257, 8)
            .init_gpt::<AD>(ctx.world(), &Default::default())?;
        Ok((model.notes().to_vec(), model.vocab().padded_size))
    });
    assert_eq!(notes[0].1, 50432);
    assert_eq!(
        notes[0].0,
        vec!["vocabulary of 50257 tokens padded to 50432 (175 dummy tokens) to split evenly over TP = 2".to_string()]
    );
}

#[test]
fn presets_validate_where_they_should() {
    for (config, tp) in [
        (TransformerConfig::gpt2_124m(), 4),
        (TransformerConfig::gpt2_350m(), 8),
        (TransformerConfig::gpt2_774m(), 4),
        (TransformerConfig::gpt2_1_5b(), 5),
        (TransformerConfig::llama_1b(), 8),
        (TransformerConfig::llama_3b(), 8),
        (TransformerConfig::llama_8b(), 8),
    ] {
        config
            .validate(tp, 0)
            .unwrap_or_else(|e| panic!("{config:?} at TP={tp}: {e}"));
    }
    assert!(
        TransformerConfig::gpt2_1_5b()
            .validate(2, 0)
            .unwrap_err()
            .to_string()
            .contains("valid TP sizes are 1, 5, 25")
    );
    assert_eq!(TransformerConfig::llama_8b().head_dim(), 128);
}
