//! The weight cast kept across microbatches (`Fp8Config::cache_weights`): under tensorwise
//! scaling, several optimizer steps of several microbatches each, at TP 2 with sequence
//! parallelism, give bit for bit the losses, gradients and parameters of the run that casts
//! every weight in every forward pass, with and without full recomputation, under our
//! distributed AdamW and Burn's (each makes new parameter tensors, which is what renews the
//! cache); each FP8 layer then keeps one weight's cast, and a layer without the cache none.
//! Under delayed scaling the cached cast is the first microbatch's: with one microbatch a step
//! the run equals the uncached one bit for bit, and with several the weight's amax history
//! holds one entry a step where the input's holds one a microbatch.

use burn::module::Module;
use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::models::GptModel;
use burn_megatron::ops::fp8::{Fp8Config, Fp8Recipe};
use burn_megatron::optimizer::DistributedAdamWConfig;
use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
use burn_megatron::tensor_parallel::gather_full_grads;
use burn_megatron::transformer::{Recompute, TransformerConfig};
use burn_megatron_dist::ParallelSizes;
use burn_megatron_testing::compare::data_values;
use burn_megatron_testing::models::token_ids;

use crate::{AD, B, run};

const STEPS: u64 = 3;

/// Every step's loss, the gathered gradients of each step, and the final parameters, as bits.
#[derive(Debug, PartialEq)]
struct Outcome {
    losses: Vec<u32>,
    grads: Vec<(String, Vec<u64>)>,
    params: Vec<Vec<u64>>,
    /// The weights each FP8 layer keeps cast before each optimizer step.
    cached: Vec<usize>,
    /// Under delayed scaling, the nonzero entries of the first layer's QKV input and weight
    /// amax histories at the end.
    recorded: Option<[usize; 2]>,
}

fn tokens(seed: u64, vocab: usize) -> Tensor<AD, 2, Int> {
    Tensor::from_data(
        TensorData::new(token_ids(16, vocab, seed), [2, 8]),
        &Default::default(),
    )
}

fn bits(values: Vec<f64>) -> Vec<u64> {
    values.into_iter().map(f64::to_bits).collect()
}

/// The weights each FP8 layer of `model` keeps cast.
fn cached(model: &GptModel<AD>) -> Vec<usize> {
    let mut out = Vec::new();
    for layer in &model.block.layers {
        let attention = &layer.attention;
        for fp8 in [attention.qkv.fp8(), attention.output.fp8()] {
            out.push(fp8.expect("an FP8 layer").cached_weights());
        }
    }
    out
}

/// The nonzero entries of the first layer's QKV input and weight amax histories (delayed
/// scaling only).
fn recorded(model: &GptModel<AD>) -> Option<[usize; 2]> {
    let fp8 = model.block.layers[0].attention.qkv.fp8()?;
    let [input, weight, _] = fp8.delayed_states::<B>()?;
    let nonzero = |h: burn::tensor::Tensor<_, 1>| {
        data_values(&h.into_data())
            .iter()
            .filter(|&&v| v != 0.0)
            .count()
    };
    Some([nonzero(input.history()), nonzero(weight.history())])
}

/// `STEPS` steps of `microbatches` microbatches of `config` at TP 2, stepped by our
/// distributed AdamW or (`burn_adamw`) Burn's: rank 0's outcome.
fn train(config: &TransformerConfig, burn_adamw: bool, microbatches: u64) -> Outcome {
    let vocab = config.vocab_size;
    let per_rank = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut ours = DistributedAdamWConfig::new().init(&model, &state, &[])?;
        let mut burns = AdamWConfig::new().init::<AD, GptModel<AD>>();
        let (mut losses, mut grads_seen, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        for step in 0..STEPS {
            let microbatches: Vec<_> = (0..microbatches)
                .map(|m| {
                    let seed = 10 * step + m;
                    Microbatch::new(tokens(seed, vocab), tokens(seed + 100, vocab))
                })
                .collect();
            let (loss, grads) = forward_backward_no_pipelining(&model, &microbatches)?;
            losses.push(loss.into_scalar().to_bits());
            for (path, data) in gather_full_grads::<AD, _>(&model, &grads, state.tp())? {
                grads_seen.push((format!("step {step} {path}"), bits(data_values(&data))));
            }
            kept.extend(cached(&model));
            model = match burn_adamw {
                true => burns.step(1e-2, model, grads),
                false => ours.step(1e-2, model, &grads)?.model,
            };
        }
        let mut values = Vec::new();
        struct Collect<'a>(&'a mut Vec<Vec<u64>>);
        impl burn::module::ModuleVisitor<AD> for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<AD, D>>) {
                self.0.push(bits(data_values(&param.val().into_data())));
            }
        }
        model.visit(&mut Collect(&mut values));
        Ok(Outcome {
            losses,
            grads: grads_seen,
            params: values,
            cached: kept,
            recorded: recorded(&model),
        })
    });
    per_rank.into_iter().next().unwrap()
}

fn small_gpt(cache: bool, recompute: Recompute, recipe: Fp8Recipe) -> TransformerConfig {
    TransformerConfig::new(16, 2, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
        .with_sequence_parallel(true)
        .with_recompute(recompute)
        .with_fp8(Some(
            Fp8Config::new()
                .with_cache_weights(cache)
                .with_recipe(recipe),
        ))
}

#[test]
fn cached_weight_casts_train_bit_for_bit_like_fresh_ones() {
    for (recompute, burn_adamw) in [
        (Recompute::None, false),
        (Recompute::Full, false),
        (Recompute::None, true),
    ] {
        let tensorwise = Fp8Recipe::Tensorwise;
        let fresh = train(&small_gpt(false, recompute, tensorwise), burn_adamw, 3);
        let cached = train(&small_gpt(true, recompute, tensorwise), burn_adamw, 3);
        let name = format!("{recompute:?}, Burn's AdamW {burn_adamw}");
        assert!(
            fresh.cached.iter().all(|&n| n == 0),
            "{name}: {:?}",
            fresh.cached
        );
        assert!(
            cached.cached.iter().all(|&n| n == 1),
            "{name}: {:?}",
            cached.cached
        );
        assert_eq!(cached.losses, fresh.losses, "{name}: losses");
        assert_eq!(cached.grads.len(), fresh.grads.len());
        for ((path, got), (_, want)) in cached.grads.iter().zip(&fresh.grads) {
            assert!(got == want, "{name}: {path} differs");
        }
        assert!(cached.params == fresh.params, "{name}: parameters differ");
        // The parameters moved: the steps did something the cache had to follow.
        assert_ne!(fresh.losses[0], fresh.losses[STEPS as usize - 1]);
    }
}

#[test]
fn delayed_scaling_casts_each_weight_once_a_step() {
    let delayed = Fp8Recipe::Delayed;
    // One microbatch a step and no recomputation: every weight is cast once a step either way.
    let fresh = train(&small_gpt(false, Recompute::None, delayed), false, 1);
    let cached = train(&small_gpt(true, Recompute::None, delayed), false, 1);
    assert!(fresh.cached.iter().all(|&n| n == 0), "{:?}", fresh.cached);
    assert!(cached.cached.iter().all(|&n| n == 1), "{:?}", cached.cached);
    assert_eq!(cached.losses, fresh.losses, "losses");
    for ((path, got), (_, want)) in cached.grads.iter().zip(&fresh.grads) {
        assert!(got == want, "{path} differs");
    }
    assert!(cached.params == fresh.params, "parameters differ");
    assert_eq!(fresh.recorded, Some([STEPS as usize; 2]));
    assert_ne!(fresh.losses[0], fresh.losses[STEPS as usize - 1]);
    // Three microbatches a step: the input's amax is recorded every microbatch, the weight's
    // once a step with the cache and every microbatch without.
    let fresh = train(&small_gpt(false, Recompute::None, delayed), false, 3);
    let cached = train(&small_gpt(true, Recompute::None, delayed), false, 3);
    let every = 3 * STEPS as usize;
    assert_eq!(fresh.recorded, Some([every, every]));
    assert_eq!(cached.recorded, Some([every, STEPS as usize]));
    assert!(cached.cached.iter().all(|&n| n == 1), "{:?}", cached.cached);
    // The uncached run casts the weight of later microbatches with other scales.
    assert_ne!(cached.losses, fresh.losses);
}
