//! `--first-last-layers-bf16`: the first and last transformer layers run in the model's
//! dtype, the others in FP8 (emulated in f32 on the CPU). The model's logits equal, bit for
//! bit, those of the FP8 model whose kept-out layers are swapped for the same layers built
//! without FP8; and differ from both the all-FP8 model's and the FP8-free model's.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::ops::fp8::Fp8Config;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_testing::compare::data_values;
use burn_megatron_testing::models::token_ids;

use crate::pretrain::config;
use crate::{B, run};

/// A GPT of 5 layers (GeLU, biases).
fn five_layers() -> TransformerConfig {
    TransformerConfig::new(16, 5, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
}

#[test]
fn first_and_last_layers_stay_out_of_fp8() {
    let plain = five_layers();
    let all_fp8 = plain.clone().with_fp8(Some(Fp8Config::new()));
    // One layer at the start and two at the end: layers 0, 3 and 4 stay in f32.
    let first_last = Fp8Config::new()
        .with_first_last_layers_bf16(true)
        .with_num_layers_at_end_in_bf16(2);
    let mixed = plain.clone().with_fp8(Some(first_last));
    let logits = run(1, |ctx| {
        let device = Default::default();
        let init = |c: &TransformerConfig| c.init_gpt::<B>(ctx.world(), &device);
        let (plain, all_fp8, mixed) = (init(&plain)?, init(&all_fp8)?, init(&mixed)?);
        let mut swapped = all_fp8.clone();
        for layer in [0, 3, 4] {
            swapped.block.layers[layer] = plain.block.layers[layer].clone();
        }
        let tokens =
            Tensor::<B, 2, Int>::from_data(TensorData::new(token_ids(16, 50, 3), [2, 8]), &device);
        let logits = |model: &burn_megatron::models::GptModel<B>| {
            model
                .try_forward(tokens.clone())
                .map(|l| data_values(&l.into_data()))
        };
        Ok([
            logits(&mixed)?,
            logits(&swapped)?,
            logits(&all_fp8)?,
            logits(&plain)?,
        ])
    })
    .remove(0);
    let [mixed, swapped, all_fp8, plain] = logits;
    assert!(mixed.iter().all(|v| v.is_finite()));
    assert_eq!(
        mixed, swapped,
        "layers 0, 3 and 4 out of FP8, 1 and 2 in it"
    );
    assert_ne!(mixed, all_fp8, "some layers are out of FP8");
    assert_ne!(mixed, plain, "some layers are in FP8");
}

/// Megatron's options reach the model; without `--fp8-format` or `--first-last-layers-bf16`
/// they are refused, and so is a count that leaves no layer in FP8.
#[test]
fn first_last_options_reach_the_model_or_are_refused() {
    let c = config(&[
        "--fp8-format",
        "hybrid",
        "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16",
        "2",
    ])
    .unwrap();
    let want = Fp8Config::new()
        .with_first_last_layers_bf16(true)
        .with_num_layers_at_start_in_bf16(2);
    assert_eq!(c.model().fp8, Some(want));
    let model = c.model();
    let covered: Vec<bool> = (0..model.num_layers)
        .map(|l| model.fp8_for_layer(l).is_some())
        .collect();
    let mut expected = vec![true; model.num_layers];
    expected[..2].fill(false);
    expected[model.num_layers - 1] = false;
    assert_eq!(covered, expected);
    for (args, needle) in [
        (
            &["--first-last-layers-bf16"][..],
            "--first-last-layers-bf16 takes effect with --fp8-format",
        ),
        (
            &["--fp8-format", "hybrid", "--num-layers-at-end-in-bf16", "2"][..],
            "--num-layers-at-end-in-bf16 takes effect with --first-last-layers-bf16",
        ),
    ] {
        let error = config(args).unwrap_err();
        assert!(error.contains(needle), "{args:?}: {error}");
    }
    let c = config(&[
        "--fp8-format",
        "hybrid",
        "--num-layers",
        "4",
        "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16",
        "2",
        "--num-layers-at-end-in-bf16",
        "2",
    ])
    .unwrap();
    let error = c.check(c.world_size()).unwrap_err().to_string();
    assert!(
        error.contains("leaves none of the 4 layers in FP8"),
        "{error}"
    );
}
