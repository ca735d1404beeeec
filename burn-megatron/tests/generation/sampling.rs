//! Seeded sampling: reproducible, the same with and without the cache, on every rank and at
//! TP 1 and TP 2; top-k 1 and a tiny top-p are greedy; stop tokens end a prompt.

use burn_megatron::inference::{
    FinishReason, GenerationConfig, Sampling, generate, generate_without_cache,
};

use crate::{greedy, on_ranks, prompts, tokens};

fn random(seed: u64) -> GenerationConfig {
    GenerationConfig::greedy(9).with_sampling(Sampling::Random {
        temperature: 0.8,
        top_k: Some(20),
        top_p: Some(0.95),
        seed,
    })
}

#[test]
fn seeded_sampling_is_reproducible_and_the_same_at_tp_1_and_2() {
    for config in [crate::gpt(), crate::llama()] {
        let mut by_tp = Vec::new();
        for tp in [1, 2] {
            let results = on_ranks(&config, tp, |model| {
                let first = generate(model, &prompts(), &random(7))?;
                let again = generate(model, &prompts(), &random(7))?;
                let full = generate_without_cache(model, &prompts(), &random(7))?;
                let other = generate(model, &prompts(), &random(8))?;
                Ok((
                    tokens(&first),
                    tokens(&again),
                    tokens(&full),
                    tokens(&other),
                ))
            });
            for (rank, (first, again, full, other)) in results.iter().enumerate() {
                assert_eq!(first, again, "TP={tp} rank {rank}: the same seed twice");
                assert_eq!(
                    first, full,
                    "TP={tp} rank {rank}: with and without the cache"
                );
                assert_eq!(first, &results[0].0, "TP={tp} rank {rank} against rank 0");
                assert_ne!(first, other, "TP={tp}: seeds 7 and 8 drew the same tokens");
            }
            by_tp.push(results[0].0.clone());
        }
        assert_eq!(by_tp[0], by_tp[1], "TP 1 against TP 2");
    }
}

#[test]
fn top_k_1_and_a_tiny_top_p_are_greedy() {
    let results = on_ranks(&crate::llama(), 1, |model| {
        let greedy = tokens(&generate(model, &prompts(), &greedy())?);
        let sample = |top_k, top_p| {
            let sampling = Sampling::Random {
                temperature: 1.5,
                top_k,
                top_p,
                seed: 3,
            };
            generate(
                model,
                &prompts(),
                &GenerationConfig::greedy(9).with_sampling(sampling),
            )
            .map(|g| tokens(&g))
        };
        Ok((greedy, sample(Some(1), None)?, sample(None, Some(1e-9))?))
    });
    let (greedy, top_k, top_p) = &results[0];
    assert_eq!(top_k, greedy);
    assert_eq!(top_p, greedy);
}

#[test]
fn pick_follows_the_probabilities() {
    let logits = [0.0f32, 2.0, 1.0, 2.0];
    assert_eq!(
        Sampling::Greedy.pick(&logits, 0, 0),
        1,
        "the first of equal maxima"
    );
    let sampling = Sampling::Random {
        temperature: 1.0,
        top_k: Some(3),
        top_p: None,
        seed: 11,
    };
    let mut counts = [0usize; 4];
    for step in 0..4000 {
        counts[sampling.pick(&logits, 0, step) as usize] += 1;
    }
    assert_eq!(counts[0], 0, "top-k 3 drops the least likely: {counts:?}");
    // Probabilities e² : e : e² over the kept three: 0.422, 0.155, 0.422.
    let share = |n: usize| n as f64 / 4000.0;
    for (i, want) in [(1, 0.4223), (2, 0.1554), (3, 0.4223)] {
        assert!((share(counts[i]) - want).abs() < 0.03, "{counts:?}");
    }
}

#[test]
fn a_stop_token_ends_its_prompt() {
    let results = on_ranks(&crate::gpt(), 2, |model| {
        let free = generate(model, &prompts(), &greedy())?;
        let stop = free[1].tokens[2];
        let stopped = generate(model, &prompts(), &greedy().with_stop_tokens(vec![stop]))?;
        Ok((free, stop, stopped))
    });
    let (free, stop, stopped) = &results[0];
    for (row, (free, stopped)) in free.iter().zip(stopped).enumerate() {
        match free.tokens.iter().position(|t| t == stop) {
            Some(i) => {
                assert_eq!(stopped.tokens, free.tokens[..=i], "row {row}");
                assert_eq!(stopped.finish, FinishReason::Stop, "row {row}");
            }
            None => assert_eq!(stopped, free, "row {row}"),
        }
    }
}
