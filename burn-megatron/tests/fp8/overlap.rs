//! FP8 layers under the overlap hook (`--overlap-grad-reduce`): with gradient-accumulation
//! fusion, each FP8 layer's weight-gradient GEMM adds into the hook's f32 buffer (on our CUDA
//! backend one cuBLASLt FP8 GEMM with beta 1; here the emulated product, then its addition).
//!
//! Two clipped steps of four microbatches give the same bits, parameters and norms, as the
//! reduction after the backward pass, fused or not, under tensorwise and delayed scaling, at
//! DP 1, DP 2 with ZeRO-1, and TP 2 with sequence parallelism × DP 2 with ZeRO-1. With the
//! fusion, every weight of the layers, all of them FP8 layers, reached the buffer by its
//! product (the hook's count, exact).

use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::models::GptModel;
use burn_megatron::ops::fp8::{Fp8Config, Fp8Recipe};
use burn_megatron::optimizer::DistributedAdamWConfig;
use burn_megatron::pipeline_parallel::{Schedule, forward_backward};
use burn_megatron::tensor_parallel::{gather_full_params, param_infos};
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{ParallelSizes, ReduceOp};
use burn_megatron_testing::compare::data_values;
use burn_megatron_testing::models::microbatch;

use crate::{AD, assert_close, run, values};

/// Microbatches a step, over every data-parallel rank.
const MICROBATCHES: usize = 4;
/// A clip that binds on every step of the small model.
const CLIP: f64 = 0.05;

/// How the gradients reach the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reduce {
    /// Collected from the gradient container after the backward pass.
    AfterBackward,
    /// Taken by the overlap hook, the weights' FP8 GEMMs accumulating in its buffer.
    Fused,
    /// Taken by the overlap hook from the gradient container.
    Unfused,
}

fn small_gpt(recipe: Fp8Recipe, tp: usize) -> TransformerConfig {
    TransformerConfig::new(16, 2, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
        .with_sequence_parallel(tp > 1)
        .with_fp8(Some(Fp8Config::new().with_recipe(recipe)))
}

/// Elements whose gradients the FP8 GEMMs should add to the hook's buffer: every weight of
/// the layers.
fn weights_numel(model: &GptModel<AD>) -> usize {
    model
        .layers()
        .iter()
        .flat_map(param_infos)
        .filter(|info| info.shape.len() == 2)
        .map(|info| info.shape.iter().product::<usize>())
        .sum()
}

/// Two steps at TP `tp` × DP `dp`: the loss of each step, the global norms, and every
/// parameter after them (gathered over TP), from rank 0.
type Outcome = (Vec<f64>, Vec<f64>, Vec<(String, Vec<f64>)>);

fn two_steps(config: &TransformerConfig, tp: usize, dp: usize, reduce: Reduce) -> Outcome {
    run(tp * dp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut optim = DistributedAdamWConfig::new()
            .with_clip_grad(Some(CLIP))
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(dp > 1)
                    .with_gradient_accumulation_fusion(reduce == Reduce::Fused)
                    .with_bucket_numel(500),
            )
            .init(&model, &state, &[])?;
        let per_rank = MICROBATCHES / dp;
        if reduce != Reduce::AfterBackward {
            let hook = optim.overlap_hook(&model, per_rank);
            model.set_backward_hook(Some(hook));
        }
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..2 {
            let first = MICROBATCHES * step + state.coords().dp * per_rank;
            let microbatches: Vec<_> = (first..first + per_rank)
                .map(|seed| microbatch::<AD>(config.vocab_size, seed as u64))
                .collect();
            let mut out = forward_backward(
                Schedule::NoPipelining,
                &state,
                std::slice::from_ref(&model),
                &microbatches,
            )?;
            let loss = out.loss.ok_or("the loss of the only stage")?;
            losses.push(values(state.dp().all_reduce(loss, ReduceOp::Avg)?)[0]);
            let weights = weights_numel(&model);
            let stepped = optim.step(1e-2, model, &out.grads.remove(0))?;
            model = stepped.model;
            norms.push(values(stepped.grad_norm)[0]);
            let fused = match reduce {
                Reduce::Fused => weights,
                _ => 0,
            };
            assert_eq!(
                optim.fused_numel(),
                fused,
                "TP {tp} x DP {dp}, {reduce:?}: elements whose FP8 GEMMs went to the buffer"
            );
        }
        let params = gather_full_params::<AD, _>(&model, state.tp())?
            .into_iter()
            .map(|(path, data)| (path, data_values(&data)))
            .collect();
        Ok((losses, norms, params))
    })
    .into_iter()
    .next()
    .expect("rank 0")
}

#[test]
fn fp8_weight_gradients_through_the_overlap_hook_equal_the_reduction_after_backward() {
    for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Delayed] {
        for (tp, dp) in [(1, 1), (1, 2), (2, 2)] {
            let config = small_gpt(recipe, tp);
            let want = two_steps(&config, tp, dp, Reduce::AfterBackward);
            assert!(want.1[0] > CLIP, "the clip must bind: norms {:?}", want.1);
            for reduce in [Reduce::Fused, Reduce::Unfused] {
                let name = format!("{recipe:?}, TP {tp} x DP {dp}, {reduce:?}");
                let got = two_steps(&config, tp, dp, reduce);
                assert_close(&format!("{name}: losses"), &got.0, &want.0, 0.0);
                assert_close(&format!("{name}: norms"), &got.1, &want.1, 0.0);
                assert_eq!(got.2.len(), want.2.len(), "{name}: parameters");
                for ((path, g), (want_path, w)) in got.2.iter().zip(&want.2) {
                    assert_eq!(path, want_path, "{name}: parameter order");
                    assert_close(&format!("{name}: {path}"), g, w, 0.0);
                }
            }
        }
    }
}
