//! Every schedule's loss and gradients equal the single-device model's with gradient
//! accumulation over the same microbatches (f32, 1e-5 relative): PP ∈ {1, 2, 4}, M ∈ {1, 4,
//! 8}, and PP = 2 with TP = 2 on 4 ranks.

use std::collections::BTreeMap;

use burn::tensor::TensorData;
use burn_megatron::pipeline_parallel::{
    Schedule, StageSplit, forward_backward, forward_backward_no_pipelining,
};
use burn_megatron::tensor_parallel::gather_full_grads;
use burn_megatron::transformer::{Recompute, TransformerConfig};
use burn_megatron_dist::ParallelSizes;

use crate::{AD, assert_close, data_values, microbatches, run, tiny_gpt, tolerance};

/// The step's loss and each parameter's full gradient, by its path in the whole model.
struct Outcome {
    loss: f64,
    grads: BTreeMap<String, TensorData>,
}

fn reference(config: &TransformerConfig, m: usize) -> Outcome {
    let config = config.clone().with_recompute(Recompute::None);
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let (loss, grads) =
            forward_backward_no_pipelining(&model, &microbatches(m, config.vocab_size))?;
        let grads = gather_full_grads::<AD, _>(&model, &grads, state.tp())?;
        Ok(Outcome {
            loss: loss.into_scalar() as f64,
            grads: grads.into_iter().collect(),
        })
    })
    .remove(0)
}

/// Runs `schedule` on PP × TP ranks with `v` chunks per rank (layers split by `counts`, or
/// evenly) and puts the pipeline's gradients back together under the whole model's paths.
fn pipelined(
    config: &TransformerConfig,
    schedule: Schedule,
    pp: usize,
    tp: usize,
    v: usize,
    m: usize,
    counts: Option<Vec<usize>>,
) -> Outcome {
    let per_rank = run(pp * tp, |ctx| {
        let state = ctx
            .parallel_state(ParallelSizes::default().with_pp(pp).with_tp(tp))?
            .with_virtual_pipeline_size(v)?;
        let split = match &counts {
            Some(c) => StageSplit::explicit(c.clone(), pp * v, config.num_layers)?,
            None => StageSplit::even(config.num_layers, pp * v)?,
        };
        let chunks = (0..v)
            .map(|c| {
                let stage = split.stage(state.virtual_stage(c));
                config.init_gpt_stage::<AD>(state.tp(), &stage, &Default::default())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let out = forward_backward(
            schedule,
            &state,
            &chunks,
            &microbatches(m, config.vocab_size),
        )?;
        let mut grads = Vec::new();
        for (chunk, chunk_grads) in chunks.iter().zip(&out.grads) {
            for (path, data) in gather_full_grads::<AD, _>(chunk, chunk_grads, state.tp())? {
                grads.push((chunk.global_path(&path), data));
            }
        }
        let loss = out.loss.map(|l| l.into_scalar() as f64);
        Ok((state.tp().rank(), loss, grads))
    });
    let mut loss = None;
    let mut grads = BTreeMap::new();
    for (tp_rank, rank_loss, rank_grads) in per_rank {
        if tp_rank != 0 {
            continue;
        }
        loss = loss.or(rank_loss);
        for (path, data) in rank_grads {
            if let Some(previous) = grads.insert(path.clone(), data.clone()) {
                // The tied table's two copies must hold the same (all-reduced) gradient.
                assert_eq!(previous, data, "the copies of {path} differ");
            }
        }
    }
    Outcome {
        loss: loss.expect("the last stage reports the loss"),
        grads,
    }
}

/// Padding rows of vocabulary-split tables depend on TP: compare the real rows only.
fn real_rows(path: &str, data: &TensorData, vocab: usize) -> Vec<f64> {
    let values = data_values(data);
    if path.starts_with("embedding.") || path.starts_with("output.") {
        values[..vocab * data.shape[1]].to_vec()
    } else {
        values
    }
}

fn assert_matches(what: &str, got: &Outcome, want: &Outcome, vocab: usize) {
    assert_close(
        &format!("{what}: loss"),
        &[got.loss],
        &[want.loss],
        tolerance::F32,
    );
    let got_paths: Vec<_> = got.grads.keys().collect();
    let want_paths: Vec<_> = want.grads.keys().collect();
    assert_eq!(got_paths, want_paths, "{what}: parameters");
    for (path, data) in &want.grads {
        assert_close(
            &format!("{what}: gradient of {path}"),
            &real_rows(path, &got.grads[path], vocab),
            &real_rows(path, data, vocab),
            tolerance::F32,
        );
    }
}

/// PP ∈ {1, 2, 4} for no pipelining, GPipe and 1F1B, with M ∈ {1, 4, 8}.
#[test]
fn schedules_match_gradient_accumulation() {
    let config = tiny_gpt();
    for m in [1, 4, 8] {
        let want = reference(&config, m);
        for schedule in [Schedule::NoPipelining, Schedule::GPipe, Schedule::OneFOneB] {
            for pp in [1, 2, 4] {
                let got = pipelined(&config, schedule, pp, 1, 1, m, None);
                let what = format!("{schedule} PP={pp} M={m}");
                assert_matches(&what, &got, &want, config.vocab_size);
            }
        }
    }
}

/// Interleaving with V = 2: PP = 2 (even split) and PP = 4 (explicit counts, with stages that
/// hold no layer); M ∈ {4, 8}. M = 1 is not divisible by PP: an error saying so.
#[test]
fn interleaved_matches_gradient_accumulation() {
    let config = tiny_gpt();
    for m in [4, 8] {
        let want = reference(&config, m);
        let got = pipelined(&config, Schedule::Interleaved, 2, 1, 2, m, None);
        assert_matches(
            &format!("interleaved PP=2 V=2 M={m}"),
            &got,
            &want,
            config.vocab_size,
        );
        let counts = vec![1, 0, 1, 0, 1, 1, 0, 0];
        let got = pipelined(&config, Schedule::Interleaved, 4, 1, 2, m, Some(counts));
        assert_matches(
            &format!("interleaved PP=4 V=2 M={m}"),
            &got,
            &want,
            config.vocab_size,
        );
    }
    let err = burn_megatron_dist::launch(burn_megatron_dist::LaunchConfig::new(2), |ctx| {
        let state = ctx
            .parallel_state(ParallelSizes::default().with_pp(2))?
            .with_virtual_pipeline_size(2)?;
        let split = StageSplit::even(4, 4)?;
        let chunks = (0..2)
            .map(|c| {
                config.init_gpt_stage::<AD>(
                    state.tp(),
                    &split.stage(state.virtual_stage(c)),
                    &Default::default(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        forward_backward(Schedule::Interleaved, &state, &chunks, &microbatches(1, 50))?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .unwrap_err();
    assert!(
        err.message.contains("divisible by PP (2)"),
        "{}",
        err.message
    );
}

/// PP = 2 × TP = 2 on 4 ranks, with and without sequence parallelism, for each schedule; with
/// dropout and full recomputation under 1F1B; and an untied Llama-style model.
#[test]
fn pp2_with_tp2_matches_gradient_accumulation() {
    let config = tiny_gpt();
    for m in [1, 4, 8] {
        let want = reference(&config, m);
        for schedule in [Schedule::NoPipelining, Schedule::GPipe, Schedule::OneFOneB] {
            for sp in [false, true] {
                let c = config.clone().with_sequence_parallel(sp);
                let got = pipelined(&c, schedule, 2, 2, 1, m, None);
                let what = format!("{schedule} PP=2 TP=2 SP={sp} M={m}");
                assert_matches(&what, &got, &want, config.vocab_size);
            }
        }
        if m >= 2 {
            let got = pipelined(&config, Schedule::Interleaved, 2, 2, 2, m, None);
            let what = format!("interleaved PP=2 TP=2 V=2 M={m}");
            assert_matches(&what, &got, &want, config.vocab_size);
        }
    }
    let dropout = config
        .clone()
        .with_hidden_dropout(0.1)
        .with_attention_dropout(0.1);
    let want = reference(&dropout, 4);
    for recompute in [
        Recompute::None,
        Recompute::Full,
        Recompute::FullUniform { layers: 2 },
        Recompute::FullBlock { layers: 1 },
    ] {
        let c = dropout
            .clone()
            .with_recompute(recompute)
            .with_sequence_parallel(true);
        let got = pipelined(&c, Schedule::OneFOneB, 2, 2, 1, 4, None);
        let what = format!("1F1B PP=2 TP=2 dropout recompute={recompute:?}");
        assert_matches(&what, &got, &want, config.vocab_size);
    }
    let llama = crate::tiny_llama();
    let want = reference(&llama, 4);
    let got = pipelined(&llama, Schedule::OneFOneB, 2, 2, 1, 4, None);
    assert_matches("Llama 1F1B PP=2 TP=2", &got, &want, llama.vocab_size);
}
