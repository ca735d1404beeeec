//! FP8 delayed scaling under data parallelism (`GptModel::reduce_fp8_histories`, which the
//! training loops run once a step): after it every DP rank holds the same amax histories,
//! each entry the maximum of the ranks' own, and the scales computed from them; the next step
//! then casts with the same scales on every rank.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::models::GptModel;
use burn_megatron::ops::fp8::{DelayedData, Fp8Config, Fp8Dtype, Fp8Recipe};
use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::ParallelSizes;
use burn_megatron_testing::compare::data_values;
use burn_megatron_testing::models::token_ids;

use crate::{AD, B, run};

/// Every FP8 layer's `[input, weight, grad_output]` states on this rank.
fn states(model: &GptModel<AD>) -> Vec<[DelayedData; 3]> {
    model
        .fp8_layers()
        .into_iter()
        .map(|(_, fp8)| fp8.delayed_data().unwrap().expect("the layer has run"))
        .collect()
}

fn tokens(seed: u64, vocab: usize) -> Tensor<AD, 2, burn::tensor::Int> {
    Tensor::from_data(
        TensorData::new(token_ids(16, vocab, seed), [2, 8]),
        &Default::default(),
    )
}

/// Each DP rank's states before and after the reduction, and the scale its next cast of the
/// first layer's input uses; two DP ranks with their own batches.
type RankStates = (Vec<[DelayedData; 3]>, Vec<[DelayedData; 3]>, f64);

fn reduce_over_two_ranks(tp_only: bool) -> Vec<RankStates> {
    let config = TransformerConfig::new(16, 2, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
        .with_fp8(Some(
            Fp8Config::new()
                .with_recipe(Fp8Recipe::Delayed)
                .with_amax_history_len(4)
                .with_tp_only_amax_reduction(tp_only),
        ));
    let vocab = config.vocab_size;
    run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?; // DP 2: the world
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        // Each DP rank its own two micro-batches, with their own amaxes.
        let seed = 3 * state.dp().rank() as u64;
        let microbatches: Vec<_> = (0..2)
            .map(|m| Microbatch::new(tokens(seed + m, vocab), tokens(seed + m + 20, vocab)))
            .collect();
        forward_backward_no_pipelining(&model, &microbatches)?;
        let before = states(&model);
        model.reduce_fp8_histories::<B>(state.dp())?;
        let after = states(&model);
        // The next forward pass casts with the reduced scale.
        let next = model.fp8_layers()[0].1.delayed_states::<B>().expect("run");
        Ok((before, after, data_values(&next[0].scale().into_data())[0]))
    })
}

#[test]
fn delayed_histories_become_their_maximum_over_data_parallel_ranks() {
    let ranks = reduce_over_two_ranks(false);
    let [(before_0, after_0, next_0), (before_1, after_1, _)] = ranks.try_into().ok().unwrap();
    assert_eq!(after_0, after_1, "every DP rank holds the same states");
    assert_eq!(after_0.len(), 8);
    let mut differed = false;
    for (layer, after) in after_0.iter().enumerate() {
        for operand in 0..3 {
            let (a, b) = (&before_0[layer][operand], &before_1[layer][operand]);
            differed |= a.amax_history != b.amax_history;
            let max: Vec<f32> = (a.amax_history.iter().zip(&b.amax_history))
                .map(|(x, y)| x.max(*y))
                .collect();
            let got = &after[operand];
            assert_eq!(got.amax_history, max, "layer {layer} operand {operand}");
            // The scale from the reduced history (`max` over it, no margin), in f32.
            let dtype = match operand {
                2 => Fp8Dtype::E5M2,
                _ => Fp8Dtype::E4M3,
            };
            let amax = max.iter().fold(0f32, |m, v| m.max(*v));
            assert!(amax > 0.0);
            assert_eq!(
                got.scale,
                dtype.max() / amax,
                "layer {layer} operand {operand}"
            );
        }
    }
    assert!(
        differed,
        "the ranks' own histories differ: the test is sharp"
    );
    assert_eq!(next_0 as f32, after_0[0][0].scale);
}

/// `--tp-only-amax-red`: the reduction leaves each rank's own states.
#[test]
fn tp_only_amax_reduction_leaves_each_rank_its_own_states() {
    for (before, after, _) in reduce_over_two_ranks(true) {
        assert_eq!(after, before);
    }
}
