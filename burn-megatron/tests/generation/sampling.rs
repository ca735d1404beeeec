//! Picking on the device: greedy is the host's argmax; seeded sampling is reproducible, the
//! same with and without the cache, on every rank and at TP 1 and TP 2, and follows the
//! probabilities; top-k 1 and a tiny top-p are greedy; stop tokens end a prompt.

use burn_megatron::inference::{
    FinishReason, GenerationConfig, Sampling, generate, generate_without_cache,
};

use burn::tensor::{Int, Tensor, TensorData};

use crate::{B, greedy, on_ranks, prompts, tokens};

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

/// `rows` copies of `logits` as one `[rows, vocab]` tensor.
fn repeated(logits: &[f32], rows: usize) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..rows).flat_map(|_| logits.iter().copied()).collect();
    Tensor::from_data(
        TensorData::new(values, [rows, logits.len()]),
        &Default::default(),
    )
}

/// The device's picks as host ids.
fn ids(picked: Tensor<B, 1, Int>) -> Vec<i64> {
    picked.into_data().convert::<i64>().to_vec().unwrap()
}

/// Greedy picking on the device is the host's argmax, the lowest id among equal maxima.
#[test]
fn greedy_on_the_device_is_the_host_argmax() {
    let rows: [&[f32]; 5] = [
        &[0.0, 2.0, 1.0, 2.0],
        &[5.0, 5.0, 5.0, 5.0],
        &[-1.0, -3.0, -1.0, -2.0],
        &[-7.0, -7.5, 0.25, 0.25],
        &[1.0, 0.5, 3.0, -2.0],
    ];
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    let logits = Tensor::<B, 2>::from_data(TensorData::new(flat, [5, 4]), &Default::default());
    let host: Vec<i64> = rows
        .iter()
        .map(|r| {
            let mut best = 0;
            for (i, &x) in r.iter().enumerate() {
                if x > r[best] {
                    best = i;
                }
            }
            best as i64
        })
        .collect();
    assert_eq!(host, vec![1, 0, 0, 2, 2]);
    assert_eq!(ids(Sampling::Greedy.pick(logits, 0, 0)), host);
}

/// The shares of `draws` device draws from `logits` (one row a draw, rows keying the random
/// numbers) under `sampling`.
fn shares(logits: &[f32], sampling: Sampling, draws: usize) -> Vec<f64> {
    let mut counts = vec![0usize; logits.len()];
    for id in ids(sampling.pick(repeated(logits, draws), 0, 0)) {
        counts[id as usize] += 1;
    }
    counts.iter().map(|&n| n as f64 / draws as f64).collect()
}

#[test]
fn pick_follows_the_probabilities() {
    let logits = [0.0f32, 2.0, 1.0, 2.0];
    let random = |top_k, top_p| Sampling::Random {
        temperature: 1.0,
        top_k,
        top_p,
        seed: 11,
    };
    // Probabilities 1 : e² : e : e² (0.054, 0.400, 0.147, 0.400); top-k 3 and top-p 0.9 both
    // keep the three likeliest: e² : e : e² renormalised, 0.422, 0.155, 0.422.
    for sampling in [random(Some(3), None), random(None, Some(0.9))] {
        let share = shares(&logits, sampling, 4000);
        assert_eq!(
            share[0], 0.0,
            "{sampling:?} drops the least likely: {share:?}"
        );
        for (i, want) in [(1, 0.4223), (2, 0.1554), (3, 0.4223)] {
            assert!((share[i] - want).abs() < 0.03, "{sampling:?}: {share:?}");
        }
    }
    // Everything kept: 0.054, 0.400, 0.147, 0.400.
    let share = shares(&logits, random(None, None), 4000);
    for (i, want) in [(0, 0.0541), (1, 0.3996), (2, 0.1470), (3, 0.3996)] {
        assert!((share[i] - want).abs() < 0.03, "{share:?}");
    }
    // Top-p 0.5 needs the two tied maxima (0.400 alone is short): half each.
    let share = shares(&logits, random(None, Some(0.5)), 4000);
    assert_eq!(share[0] + share[2], 0.0, "{share:?}");
    assert!((share[1] - 0.5).abs() < 0.03, "{share:?}");
}

/// The same seed, prompt and step draw the same token; other seeds, prompts or steps draw
/// others (over many uniform draws).
#[test]
fn draws_depend_on_seed_prompt_and_step_only() {
    let logits = repeated(&[0.0; 64], 200);
    let sampling = |seed| Sampling::Random {
        temperature: 1.0,
        top_k: None,
        top_p: None,
        seed,
    };
    let draw = |seed, first_row, step| ids(sampling(seed).pick(logits.clone(), first_row, step));
    let base = draw(1, 0, 0);
    assert_eq!(draw(1, 0, 0), base);
    // Row 5 of a batch from prompt 0 is the first row of a batch from prompt 5.
    assert_eq!(draw(1, 5, 0)[..195], base[5..]);
    for other in [draw(2, 0, 0), draw(1, 0, 1)] {
        let same = other.iter().zip(&base).filter(|(a, b)| a == b).count();
        assert!(
            same < 20,
            "{same} of 200 uniform draws over 64 tokens agree"
        );
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
