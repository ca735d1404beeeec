//! The overlap hook (`--overlap-grad-reduce`) with routed experts: their flat parts have hooks
//! of their own, reduced over expert DP, and with gradient-accumulation fusion the experts'
//! grouped weight-gradient products add into the parts' f32 buffers in the backward pass.
//!
//! Two clipped steps of four microbatches (so that the hook sums several backward passes)
//! give the same bits, parameters and norms, as the reduction after the backward pass, fused
//! or not, at EP 1 (DP 1, and DP 2 with ZeRO-1), EP 2 × DP 2 and EP 2 × expert-DP 2 with
//! ZeRO-1, and with the experts cut into several parts. With the fusion, every routed and
//! shared expert's weights, and every dense layer's, went to the buffers by their products
//! (the router's weight, a plain product, goes through the gradient container).

use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::models::{GptModel, Stage};
use burn_megatron::optimizer::{DistributedAdamWConfig, FlatAdamWConfig, MAX_FLAT_NUMEL};
use burn_megatron::pipeline_parallel::{Schedule, forward_backward};
use burn_megatron::tensor_parallel::param_infos;
use burn_megatron_dist::ParallelSizes;
use burn_megatron_testing::models::microbatch;
use burn_megatron_testing::paired;

use crate::gpt_model::moe_gpt;
use crate::optimizer::full_params;
use crate::{AD, assert_close, run, values};

/// Microbatches a step, over every data-parallel rank.
const MICROBATCHES: usize = 4;
/// A clip that binds on every step of the tiny model.
const CLIP: f64 = 0.05;
/// The part size that cuts the tiny model's experts into several parts (see `expert_parts`).
const SEVERAL: usize = 1536;

/// How the gradients reach the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reduce {
    /// Collected from the gradient container after the backward pass.
    AfterBackward,
    /// Taken by the overlap hook, the weights' products accumulating in its buffers.
    Fused,
    /// Taken by the overlap hook from the gradient container.
    Unfused,
}

/// The world's ranks (all data-parallel), EP, ZeRO-1, and the part size.
#[derive(Debug, Clone, Copy)]
struct Layout {
    world: usize,
    ep: usize,
    zero1: bool,
    part_numel: usize,
}

/// Elements whose gradients the products should add to the hook's buffers: every weight of
/// the layers but the routers' (plain products, outside the hook).
fn fusable_numel(model: &GptModel<AD>) -> usize {
    model
        .layers()
        .iter()
        .flat_map(param_infos)
        .filter(|info| info.shape.len() >= 2 && !info.path.contains("router"))
        .map(|info| info.shape.iter().product::<usize>())
        .sum()
}

type Params = Vec<(String, Vec<f64>)>;

/// Two steps at `layout`: every parameter after them (experts gathered over EP) and the two
/// gradient norms. Checks the hook's counts of fused elements on every rank.
fn two_steps(layout: Layout, reduce: Reduce) -> (Params, Vec<f64>) {
    let config = moe_gpt();
    run(layout.world, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_ep(layout.ep))?;
        let mut model = config.init_gpt_stage_with_ep::<AD>(
            state.tp(),
            state.ep(),
            &Stage::whole(config.num_layers),
            &Default::default(),
        )?;
        let mut optim = DistributedAdamWConfig::new()
            .with_adam(FlatAdamWConfig::new().with_weight_decay(0.1))
            .with_clip_grad(Some(CLIP))
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(layout.zero1)
                    .with_gradient_accumulation_fusion(reduce == Reduce::Fused)
                    .with_bucket_numel(700),
            )
            .with_part_numel(layout.part_numel)
            .init(&model, &state, &[])?;
        let per_rank = MICROBATCHES / layout.world;
        if reduce != Reduce::AfterBackward {
            let hook = optim.overlap_hook(&model, per_rank);
            model.set_backward_hook(Some(hook));
        }
        let mut norms = Vec::new();
        for step in 0..2 {
            let first = MICROBATCHES * step + state.coords().dp * per_rank;
            let microbatches: Vec<_> = (first..first + per_rank)
                .map(|seed| microbatch::<AD>(50, seed as u64))
                .collect();
            let mut out = forward_backward(
                Schedule::NoPipelining,
                &state,
                std::slice::from_ref(&model),
                &microbatches,
            )?;
            let fusable = fusable_numel(&model);
            let stepped = optim.step(1e-2, model, &out.grads.remove(0))?;
            model = stepped.model;
            norms.push(values(stepped.grad_norm)[0]);
            let fused = match reduce {
                Reduce::Fused => fusable,
                _ => 0,
            };
            assert_eq!(
                optim.fused_numel(),
                fused,
                "{layout:?}, {reduce:?}: elements whose products went to the buffers"
            );
        }
        Ok((full_params(&model, &state)?, norms))
    })
    .into_iter()
    .next()
    .expect("rank 0")
}

#[test]
fn experts_reduced_by_the_overlap_hook_equal_the_reduction_after_backward() {
    let layout = |world, ep, zero1, part_numel| Layout {
        world,
        ep,
        zero1,
        part_numel,
    };
    for l in [
        layout(1, 1, false, MAX_FLAT_NUMEL),
        layout(2, 1, true, MAX_FLAT_NUMEL),
        layout(2, 2, false, MAX_FLAT_NUMEL),
        layout(4, 2, true, MAX_FLAT_NUMEL),
        layout(1, 1, false, SEVERAL),
        layout(4, 2, true, SEVERAL),
    ] {
        let want = two_steps(l, Reduce::AfterBackward);
        assert!(want.1[0] > CLIP, "{l:?}: the clip must bind");
        for reduce in [Reduce::Fused, Reduce::Unfused] {
            let name = format!("{l:?}, {reduce:?}");
            let got = two_steps(l, reduce);
            assert_close(&format!("{name}: norms"), &got.1, &want.1, 0.0);
            for (path, g, w) in paired(&name, &got.0, &want.0) {
                assert_close(&format!("{name}: {path}"), g, w, 0.0);
            }
        }
    }
}
