//! The cached, incremental forward pass against the full forward pass: the same logits, and
//! greedy generation of the same tokens, for GPT and Llama (GQA) at TP 1 and TP 2.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::dist::mapping::gather_from_tensor_parallel_region;
use burn_megatron::inference::{
    FinishReason, KvCache, forward_cached, generate, generate_without_cache,
};
use burn_megatron::models::GptModel;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron::{ConfigError, Error};

use crate::{B, assert_close, greedy, on_ranks, prompts, tokens, tolerance};

fn ids(values: Vec<i64>, shape: [usize; 2]) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// Rank-local logits `[batch, 1, padded_vocab / tp]` gathered to `[batch, vocab]` values.
fn gathered(model: &GptModel<B>, logits: Tensor<B, 3>) -> burn_megatron::Result<Vec<f64>> {
    let full = gather_from_tensor_parallel_region(logits, model.tp())?;
    let vocab = model.vocab().vocab_size;
    let values = full
        .narrow(2, 0, vocab)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    Ok(values.into_iter().map(f64::from).collect())
}

/// Prefill of the left-padded `prompts`, then three decode steps of fixed tokens: after each,
/// every row's last logits against `try_forward` over that row's unpadded sequence.
fn cached_logits_match(config: &TransformerConfig, tp: usize, prompts: Vec<Vec<i64>>) {
    on_ranks(config, tp, |model| {
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
        let mut cache = KvCache::<B>::new(model.layers().len(), pads.clone());
        let mut sequences = prompts.clone();
        let padded: Vec<i64> = prompts
            .iter()
            .zip(&pads)
            .flat_map(|(p, &pad)| std::iter::repeat_n(0, pad).chain(p.iter().copied()))
            .collect();
        let mut input = ids(padded, [prompts.len(), longest]);
        for step in 0..4 {
            let cached = gathered(model, forward_cached(model, input, &mut cache)?)?;
            let vocab = model.vocab().vocab_size;
            for (row, sequence) in sequences.iter().enumerate() {
                let len = sequence.len();
                let full = model.try_forward(ids(sequence.clone(), [1, len]))?;
                let full = gathered(model, full.narrow(1, len - 1, 1))?;
                assert_close(
                    &format!("TP={tp} step {step} row {row}"),
                    &cached[row * vocab..(row + 1) * vocab],
                    &full,
                    tolerance::F32,
                );
            }
            let next: Vec<i64> = (0..prompts.len())
                .map(|row| (7 * step + 11 * row as i64 + 1) % 50)
                .collect();
            for (sequence, &token) in sequences.iter_mut().zip(&next) {
                sequence.push(token);
            }
            input = ids(next, [prompts.len(), 1]);
        }
        assert_eq!(cache.len(), longest + 3);
        Ok(())
    });
}

#[test]
fn cached_logits_match_the_full_forward_gpt() {
    for tp in [1, 2] {
        cached_logits_match(&crate::gpt(), tp, prompts());
    }
}

#[test]
fn cached_logits_match_the_full_forward_llama_gqa() {
    for tp in [1, 2] {
        cached_logits_match(&crate::llama(), tp, prompts());
    }
}

/// QK-norm: the decode steps normalise the new query and key heads before rotating them;
/// with heads wider than hidden / heads (`kv_channels`, as Qwen3's) too.
#[test]
fn cached_logits_match_the_full_forward_with_qk_norm() {
    let config = crate::llama().with_qk_layernorm(true);
    let wide = config.head_dim() * 2;
    for config in [config.clone(), config.with_kv_channels(Some(wide))] {
        for tp in [1, 2] {
            cached_logits_match(&config, tp, prompts());
        }
    }
}

/// Prompts of one length: the prefill runs the flash attention path (no mask), the decode
/// steps the grouped one.
#[test]
fn cached_logits_match_the_full_forward_with_prompts_of_one_length() {
    let prompts = vec![vec![3, 17, 42, 8], vec![25, 1, 0, 49]];
    for config in [crate::gpt(), crate::llama()] {
        for tp in [1, 2] {
            cached_logits_match(&config, tp, prompts.clone());
        }
    }
}

/// Greedy generation with the cache gives the tokens of generation by the full forward pass,
/// on every rank, at TP 1 and TP 2 (and the same tokens at both).
fn greedy_matches(config: &TransformerConfig) {
    let mut by_tp = Vec::new();
    for tp in [1, 2] {
        let results = on_ranks(config, tp, |model| {
            let cached = generate(model, &prompts(), &greedy())?;
            let full = generate_without_cache(model, &prompts(), &greedy())?;
            Ok((cached, full))
        });
        for (rank, (cached, full)) in results.iter().enumerate() {
            assert_eq!(cached, full, "TP={tp} rank {rank}");
            assert_eq!(cached, &results[0].0, "TP={tp} rank {rank} against rank 0");
        }
        let cached = &results[0].0;
        assert_eq!(
            cached.iter().map(|g| g.tokens.len()).collect::<Vec<_>>(),
            vec![8, 9, 5],
            "{cached:?}"
        );
        assert_eq!(cached[1].finish, FinishReason::MaxNewTokens);
        assert_eq!(cached[0].finish, FinishReason::MaxSequenceLength);
        assert_eq!(cached[2].finish, FinishReason::MaxSequenceLength);
        by_tp.push(tokens(cached));
    }
    assert_eq!(by_tp[0], by_tp[1], "TP 1 against TP 2");
}

#[test]
fn greedy_with_the_cache_equals_the_full_forward_gpt() {
    greedy_matches(&crate::gpt());
}

#[test]
fn greedy_with_the_cache_equals_the_full_forward_llama_gqa() {
    greedy_matches(&crate::llama());
}

/// The cache holds the key/value heads of the rank's groups only: 2 groups at TP 1, 1 at
/// TP 2, for 4 query heads.
#[test]
fn the_cache_holds_this_ranks_key_value_groups() {
    for (tp, groups) in [(1, 2), (2, 1)] {
        let shapes = on_ranks(&crate::llama(), tp, |model| {
            let mut cache = KvCache::<B>::new(model.layers().len(), vec![0, 2]);
            forward_cached(model, ids(vec![1, 2, 3, 0, 0, 4], [2, 3]), &mut cache)?;
            Ok((0..model.layers().len())
                .map(|i| cache.layer(i).keys().unwrap().dims())
                .collect::<Vec<_>>())
        });
        for layers in shapes {
            for dims in layers {
                assert_eq!(dims, [2, groups, 3, 4], "TP={tp}");
            }
        }
    }
}

/// The cache allocates its capacity once and holds no more: the buffers keep their columns
/// while they fill, and a step past the capacity is an error that leaves the cache as it was.
/// Without a capacity it is the model's maximum sequence length.
#[test]
fn the_cache_has_a_fixed_capacity() {
    on_ranks(&crate::llama(), 2, |model| {
        let layers = model.layers().len();
        let allocated = |cache: &KvCache<B>| {
            (0..layers)
                .map(|i| cache.layer(i).allocated())
                .collect::<Vec<_>>()
        };
        let mut cache = KvCache::<B>::with_capacity(layers, vec![0, 2], 5);
        assert_eq!(allocated(&cache), vec![None; layers]);
        forward_cached(model, ids(vec![1, 2, 3, 0, 0, 4], [2, 3]), &mut cache)?;
        for step in 0..2 {
            forward_cached(model, ids(vec![5, 6], [2, 1]), &mut cache)?;
            assert_eq!(cache.len(), 4 + step);
            assert_eq!(allocated(&cache), vec![Some(5); layers]);
            assert_eq!(cache.layer(0).keys().unwrap().dims(), [2, 1, 4 + step, 4]);
        }
        let error = forward_cached(model, ids(vec![5, 6], [2, 1]), &mut cache)
            .expect_err("a sixth column does not fit");
        assert!(
            matches!(&error, Error::Config(ConfigError::Invalid(m))
                if m.contains("room for 5 columns") && m.contains("with_capacity")),
            "{error}"
        );
        assert_eq!(cache.len(), 5);
        assert_eq!(cache.capacity(), Some(5));

        let mut cache = KvCache::<B>::new(layers, vec![0]);
        assert_eq!(cache.capacity(), None);
        forward_cached(model, ids(vec![1; 12], [1, 12]), &mut cache)?;
        assert_eq!(cache.capacity(), Some(12));
        assert!(forward_cached(model, ids(vec![1], [1, 1]), &mut cache).is_err());
        Ok(())
    });
}
