//! The dynamic loss scaler with the distributed optimizer, at DP = 2, TP = 2 × DP = 2 and
//! PP = 2 × DP = 2 (1F1B), with and without ZeRO-1. The backward passes start from the scaled
//! loss (`forward_backward_scaled`). An +∞ injected into one gradient of one rank (the last of
//! the world: DP rank 1, and TP rank 1 or the last stage) at one step skips exactly that step
//! on every rank (parameters unchanged bit for bit, step count not advanced) and halves the
//! scale, which grows back after its window. Every other step equals unscaled training: the
//! run ends with the losses, norms and parameters of the flat-buffer AdamW on one device that
//! leaves out the skipped step.

use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::models::GptModel;
use burn_megatron::optimizer::{DistributedAdamWConfig, MAX_FLAT_NUMEL};
use burn_megatron::optimizer::{LossScalerConfig, shared_copies};
use burn_megatron::pipeline_parallel::{Schedule, forward_backward_scaled};
use burn_megatron::tensor_parallel::param_infos;
use burn_megatron_dist::ReduceOp;

use super::data_parallel::{
    Layout, MAX_NORM, RankRun, adam, check, lr, merge_stages, my_microbatches, one_device,
};
use super::flat_adamw::full_params;
use crate::{AD, B, run, tiny_gpt, tolerance, values};

pub(crate) const STEPS: usize = 8;
/// The step whose gradients get the +∞.
pub(crate) const OVERFLOW: usize = 3;

/// Replaces element 3 of the gradient of the rank's first replicated one-dimensional
/// parameter (a norm's scale or a bias) with +∞. Replicated parameters count in the norm on
/// TP rank 0 only, so on another TP rank only the NaN of ∞ · 0 carries the overflow.
fn inject_inf(model: &GptModel<AD>, grads: &mut GradientsParams) {
    let info = param_infos(model)
        .into_iter()
        .find(|p| p.shape.len() == 1 && p.placement.dim().is_none())
        .expect("a replicated vector");
    let grad: Tensor<B, 1> = grads.remove(info.id).expect("a gradient");
    let mut data = grad.to_data().to_vec::<f32>().unwrap();
    data[3] = f32::INFINITY;
    let len = data.len();
    grads.register(
        info.id,
        Tensor::<B, 1>::from_data(TensorData::new(data, [len]), &Default::default()),
    );
}

/// `layout`'s ranks train with a loss scale of 1024 (growth after 3 clean steps, no
/// hysteresis); the last rank of the world injects +∞ at step [`OVERFLOW`]. Each rank checks
/// its own flags, parameters, scales and step counts (of every part of the optimizer's flat
/// buffers, cut into parts of at most `part_numel` elements).
pub(crate) fn scaled(layout: Layout, zero: bool, part_numel: usize) -> Vec<RankRun> {
    let config = tiny_gpt();
    let world = layout.tp * layout.pp * layout.dp;
    run(world, |ctx| {
        let state = layout.state(&ctx);
        let mut model = layout.stage(&config, &state);
        // ANCHOR: scaled_step
        let mut optim = DistributedAdamWConfig::new()
            .with_adam(adam())
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(zero)
                    .with_bucket_numel(700),
            )
            .with_clip_grad(Some(MAX_NORM))
            .with_part_numel(part_numel)
            .init::<AD, _>(&model, &state, &shared_copies(&model))?;
        let mut scaler = LossScalerConfig::new()
            .with_initial_scale(1024.0)
            .with_growth_interval(3)
            .with_hysteresis(1)
            .init::<B>(&Default::default())?;
        let injects = ctx.rank() == world - 1;
        let (mut losses, mut norms, mut scales) = (Vec::new(), Vec::new(), Vec::new());
        for step in 0..STEPS {
            let chunks = std::slice::from_ref(&model);
            let mbs = my_microbatches(&state, step);
            let mut out =
                forward_backward_scaled(Schedule::OneFOneB, &state, chunks, &mbs, scaler.scale())?;
            if let Some(loss) = out.loss {
                losses.push(values(state.dp().all_reduce(loss, ReduceOp::Avg)?)[0]);
            }
            let mut grads = out.grads.remove(0);
            if injects && step == OVERFLOW {
                inject_inf(&model, &mut grads);
            }
            let before = full_params(&model, &state);
            let stepped = optim.step_scaled(lr(step), model, &grads, &mut scaler)?;
            model = stepped.model;
            let found = stepped.found_inf.expect("a scaled step reports its flag");
            assert_eq!(found.read()?, step == OVERFLOW, "step {step}: the flag");
            if step == OVERFLOW {
                // Bit for bit: f64 holds every f32 exactly.
                assert_eq!(before, full_params(&model, &state), "a skipped step moved");
                let norm = values(stepped.grad_norm)[0];
                assert!(!norm.is_finite(), "the skipped step's norm {norm}");
            } else {
                norms.push(values(stepped.grad_norm)[0]);
            }
            scales.push(values(scaler.scale())[0]);
        }
        // ANCHOR_END: scaled_step
        // Three clean steps grow the scale, the overflow halves it, three more grow it.
        let want_scales = [
            1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0, 2048.0,
        ];
        assert_eq!(scales, want_scales, "the scale after each step");
        assert_eq!(values(scaler.skipped_steps())[0], 1.0, "skipped steps");
        assert_eq!(values(optim.step_count())[0], (STEPS - 1) as f64, "steps");
        for part in optim.dense_states()? {
            assert_eq!(part.state.step, (STEPS - 1) as u64, "every part's steps");
        }
        Ok(RankRun::new(&model, &state, losses, norms))
    })
}

#[test]
fn an_injected_inf_skips_that_step_on_every_rank() {
    let want = one_device(&tiny_gpt(), STEPS, Some(OVERFLOW));
    for (tp, pp, dp) in [(1, 1, 2), (2, 1, 2), (1, 2, 2)] {
        for zero in [false, true] {
            let layout = Layout { tp, pp, dp };
            let got = merge_stages(scaled(layout, zero, MAX_FLAT_NUMEL), &want);
            assert_eq!(got.len(), tp * dp);
            check(
                &format!("tp {tp} × pp {pp} × dp {dp}, distributed optimizer {zero}, loss scale"),
                &tiny_gpt(),
                &got,
                &want,
                tolerance::F32,
            );
        }
    }
}
