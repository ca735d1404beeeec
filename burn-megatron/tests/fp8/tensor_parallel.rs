//! FP8 layers under tensor parallelism: the amaxes of split operands are reduced over the
//! group, so TP = 2 (with and without sequence parallelism) casts with TP = 1's scales and
//! gives its logits, loss and every gradient (relative 1e-5), for a GPT (GeLU, biases) and a
//! Llama (SwiGLU: the gate, up and down projections; GQA; no biases), under tensorwise and
//! delayed scaling (two batches: the second casts with the histories of the first), and under
//! blockwise scaling, which reduces nothing. Full
//! recomputation reruns the FP8 forward exactly under tensorwise scaling.

use burn::module::AutodiffModule;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::ops::fp8::{Fp8Config, Fp8Format, Fp8Recipe};
use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
use burn_megatron::tensor_parallel::gather_full_grads;
use burn_megatron::transformer::{Recompute, TransformerConfig};
use burn_megatron_dist::ParallelSizes;
use burn_megatron_testing::compare::data_values;
use burn_megatron_testing::models::{llama, token_ids};

use crate::{AD, assert_close, run, tolerance};

/// Logits, loss and gathered gradients of one batch.
struct Outcome {
    logits: Vec<f64>,
    loss: f64,
    grads: Vec<(String, Vec<f64>)>,
}

/// Two sequences of `seq` tokens.
fn tokens(seed: u64, vocab: usize, seq: usize) -> Tensor<AD, 2, Int> {
    Tensor::from_data(
        TensorData::new(token_ids(2 * seq, vocab, seed), [2, seq]),
        &Default::default(),
    )
}

/// Two batches of `config` on `tp` ranks: rank 0's results.
fn outcomes(config: &TransformerConfig, tp: usize) -> Vec<Outcome> {
    let (vocab, seq) = (config.vocab_size, config.max_sequence_length);
    let per_rank = run(tp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut out = Vec::new();
        for batch in 0..2u64 {
            let input = tokens(batch, vocab, seq);
            let targets = tokens(batch + 100, vocab, seq);
            let (loss, grads) =
                forward_backward_no_pipelining(&model, &[Microbatch::new(input.clone(), targets)])?;
            let logits = model
                .valid()
                .try_forward(Tensor::from_data(input.to_data(), &Default::default()))?;
            let logits = state.tp().all_gather(logits, 2)?.narrow(2, 0, vocab);
            let grads = gather_full_grads::<AD, _>(&model, &grads, state.tp())?;
            out.push(Outcome {
                logits: data_values(&logits.into_data()),
                loss: loss.into_scalar() as f64,
                grads: grads
                    .into_iter()
                    .map(|(path, data)| {
                        let v = data_values(&data);
                        // Padding rows of the vocabulary depend on TP: keep the real ones.
                        let v = match path.starts_with("embedding.") || path.starts_with("output.")
                        {
                            true => v[..vocab * data.shape[1]].to_vec(),
                            false => v,
                        };
                        (path, v)
                    })
                    .collect(),
            });
        }
        Ok(out)
    });
    per_rank.into_iter().next().unwrap()
}

fn assert_same(what: &str, got: &[Outcome], want: &[Outcome]) {
    for (batch, (g, w)) in got.iter().zip(want).enumerate() {
        let at = |name: &str| format!("{what} batch {batch}: {name}");
        assert_close(&at("logits"), &g.logits, &w.logits, tolerance::F32);
        assert_close(&at("loss"), &[g.loss], &[w.loss], tolerance::F32);
        assert_eq!(g.grads.len(), w.grads.len());
        for ((path, gv), (wpath, wv)) in g.grads.iter().zip(&w.grads) {
            assert_eq!(path, wpath);
            assert_close(&at(path), gv, wv, tolerance::F32);
        }
    }
}

fn small_gpt() -> TransformerConfig {
    TransformerConfig::new(16, 2, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

fn small_llama() -> TransformerConfig {
    llama(TransformerConfig::new(32, 2, 8, 24, 50, 8).with_num_query_groups(Some(4)))
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

fn assert_tp_equivalent(name: &str, config: TransformerConfig) {
    let reference = outcomes(&config, 1);
    for sp in [false, true] {
        let got = outcomes(&config.clone().with_sequence_parallel(sp), 2);
        assert_same(&format!("{name} TP=2 SP={sp}"), &got, &reference);
    }
}

#[test]
fn gpt_in_fp8_at_tp_2_equals_tp_1() {
    // ANCHOR: fp8_model
    let fp8 = Fp8Config::new().with_format(Fp8Format::Hybrid);
    let config = small_gpt().with_fp8(Some(fp8));
    // ANCHOR_END: fp8_model
    // FP8 is in effect: the loss differs from the model's dtype's.
    let plain = outcomes(&small_gpt(), 1);
    let reference = outcomes(&config, 1);
    let diff = (plain[0].loss - reference[0].loss).abs() / plain[0].loss;
    assert!(
        diff > 1e-6 && diff < 0.05,
        "FP8 against f32 loss: relative {diff:e}"
    );
    assert_tp_equivalent("GPT hybrid tensorwise", config);
}

#[test]
fn llama_in_fp8_at_tp_2_equals_tp_1() {
    let fp8 = Fp8Config::new().with_format(Fp8Format::E4M3);
    assert_tp_equivalent("Llama e4m3 tensorwise", small_llama().with_fp8(Some(fp8)));
}

#[test]
fn delayed_scaling_at_tp_2_equals_tp_1() {
    let fp8 = Fp8Config::new()
        .with_recipe(Fp8Recipe::Delayed)
        .with_amax_history_len(4);
    assert_tp_equivalent(
        "GPT hybrid delayed",
        small_gpt().with_fp8(Some(fp8.clone())),
    );
    assert_tp_equivalent("Llama hybrid delayed", small_llama().with_fp8(Some(fp8)));
}

/// Blockwise scaling reduces nothing: where every rank's part of a weight, an input and an
/// output gradient is whole blocks of 128 (hidden 256, FFN 512, 2 × 64 tokens), each rank
/// casts the blocks one device casts, and TP = 2 equals TP = 1, with and without SP. One
/// layer: the input gradient's all-reduce adds the ranks' block products in another order
/// than one device's sum over the blocks, and a last-bit difference, cast again to FP8 by the
/// layer below, can move a value to the next grid point (E5M2 keeps 2 mantissa bits).
#[test]
fn blockwise_scaling_at_tp_2_equals_tp_1() {
    let fp8 = Fp8Config::new().with_recipe(if std::env::var("TW").is_ok() {
        Fp8Recipe::Tensorwise
    } else {
        Fp8Recipe::Blockwise
    });
    let gpt = TransformerConfig::new(256, 1, 2, 512, 50, 64)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.05);
    let plain = outcomes(&gpt, 1);
    let config = gpt.with_fp8(Some(fp8.clone()));
    let reference = outcomes(&config, 1);
    let diff = (plain[0].loss - reference[0].loss).abs() / plain[0].loss;
    assert!(
        diff > 1e-7 && diff < 0.05,
        "blockwise FP8 against f32 loss: relative {diff:e}"
    );
    assert_tp_equivalent("GPT hybrid blockwise", config);
    let llama = llama(TransformerConfig::new(256, 1, 2, 256, 50, 64))
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.05);
    assert_tp_equivalent("Llama hybrid blockwise", llama.with_fp8(Some(fp8)));
}

/// Tensorwise scaling keeps no state, so a layer rerun from its input in the backward pass
/// casts exactly as its first run: TP 2 with sequence parallelism and full recomputation
/// equals TP 1 without.
#[test]
fn full_recomputation_reruns_fp8_layers_exactly() {
    let fp8 = Fp8Config::new();
    let reference = outcomes(&small_gpt().with_fp8(Some(fp8.clone())), 1);
    let config = small_gpt()
        .with_fp8(Some(fp8))
        .with_sequence_parallel(true)
        .with_recompute(Recompute::Full);
    assert_same(
        "GPT hybrid tensorwise, TP=2 SP, full recompute",
        &outcomes(&config, 2),
        &reference,
    );
}
