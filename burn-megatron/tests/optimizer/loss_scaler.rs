//! The dynamic loss scaler: an inf injected into one gradient on one rank skips exactly that
//! step on every rank (parameters unchanged bit for bit), halves the scale; clean steps
//! train as without scaling; the scale grows after `growth_interval` clean steps; hysteresis
//! delays the back-off.

use burn::optim::decay::WeightDecayConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::{Tensor, TensorData};
use burn_megatron::models::GptModel;
use burn_megatron::optimizer::{FoundInf, GradClipConfig, LossScalerConfig, clip_grad_norm};
use burn_megatron::pipeline_parallel::forward_backward_no_pipelining;
use burn_megatron::tensor_parallel::gather_full_params;
use burn_megatron_dist::ParallelSizes;

use crate::{AD, B, assert_close, microbatches, run, tiny_gpt, tolerance, values};

/// Every parameter of `model`, gathered over TP, as f32 bits.
fn params(
    model: &GptModel<AD>,
    state: &burn_megatron_dist::ParallelState,
) -> Vec<(String, Vec<u32>)> {
    gather_full_params(model, state.tp())
        .expect("gather")
        .into_iter()
        .map(|(path, data)| {
            let bits = data
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            (path, bits)
        })
        .collect()
}

/// Replaces one element of the position-embedding gradient with +∞.
fn inject_inf(model: &GptModel<AD>, grads: &mut GradientsParams) {
    let id = model
        .position_embedding
        .as_ref()
        .expect("learned positions")
        .id;
    let grad: Tensor<B, 2> = grads.remove(id).expect("a gradient");
    let mut data = grad.to_data().to_vec::<f32>().unwrap();
    data[3] = f32::INFINITY;
    let shape = grad.dims();
    grads.register(
        id,
        Tensor::<B, 2>::from_data(TensorData::new(data, shape), &Default::default()),
    );
}

/// Five steps on TP = 2 with SGD and weight decay: step 2 overflows on TP rank 1 only. Every rank skips it,
/// the scale halves (hysteresis 1) and grows back after two clean steps; the clean steps
/// move the parameters exactly as the unscaled step does (the scale is a power of two).
#[test]
fn an_injected_inf_skips_exactly_that_step() {
    let scales = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let mut config = tiny_gpt();
        config.num_layers = 2;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        // The same model trained without a scaler, for the clean steps' reference.
        let mut plain = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut scaler = LossScalerConfig::new()
            .with_initial_scale(1024.0)
            .with_growth_interval(2)
            .with_hysteresis(1)
            .init::<B>(&Default::default())?;
        // Weight decay moves the parameters even with zero gradients, so only the select
        // keeps them on a skipped step; plain SGD keeps no state between steps.
        let sgd = SgdConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.1)));
        let mut optim = sgd.init();
        let mut plain_optim = sgd.init();
        let mut seen = Vec::new();
        for step in 0..5u64 {
            let mbs = microbatches(1, config.vocab_size, step);
            let batch = &mbs[0];
            let logits = model.try_forward(batch.tokens.clone())?;
            let loss = model.loss(logits, batch.targets.clone())?;
            let grads = GradientsParams::from_grads(scaler.scale_loss(loss).backward(), &model);
            let mut grads = vec![grads];
            if step == 2 && state.tp().rank() == 1 {
                inject_inf(&model, &mut grads[0]);
            }
            let found = scaler.unscale_and_check(
                std::slice::from_ref(&model),
                &mut grads,
                state.model_parallel(),
            )?;
            let norm = clip_grad_norm(
                std::slice::from_ref(&model),
                &mut grads,
                &state,
                &GradClipConfig::new().with_max_norm(1e6),
            )?;
            let before = params(&model, &state);
            let stepped = optim.step(0.1, model.clone(), grads.pop().unwrap());
            model = found.select(model, stepped);
            scaler.update(&found);
            let after = params(&model, &state);
            let overflowed = found.read()?;
            assert_eq!(overflowed, step == 2, "step {step}: the overflow flag");
            if overflowed {
                assert_eq!(
                    before, after,
                    "step {step}: parameters changed on a skipped step"
                );
                // The skipped step's gradients are zeroed: clipping saw a zero norm.
                assert_eq!(values(norm)[0], 0.0, "step {step}: gradients not zeroed");
            } else {
                assert_ne!(
                    before, after,
                    "step {step}: a clean step must move the parameters"
                );
                let (_, plain_grads) = forward_backward_no_pipelining(&plain, &mbs)?;
                plain = plain_optim.step(0.1, plain, plain_grads);
                for ((path, got), (_, want)) in
                    params(&model, &state).iter().zip(params(&plain, &state))
                {
                    let f = |bits: &[u32]| {
                        bits.iter()
                            .map(|&b| f32::from_bits(b) as f64)
                            .collect::<Vec<_>>()
                    };
                    assert_close(
                        &format!("step {step}: {path}"),
                        &f(got),
                        &f(&want),
                        tolerance::F32,
                    );
                }
            }
            seen.push((values(scaler.scale())[0], values(scaler.skipped_steps())[0]));
        }
        Ok(seen)
    });
    for rank in &scales {
        // Clean, clean (grow ×2 after 2), inf (halve), clean, clean (grow).
        let want = [
            (1024.0, 0.0),
            (2048.0, 0.0),
            (1024.0, 1.0),
            (1024.0, 1.0),
            (2048.0, 1.0),
        ];
        assert_eq!(
            rank.as_slice(),
            want.as_slice(),
            "scale and skipped steps per step"
        );
    }
}

/// Megatron's hysteresis: with 2, the first overflow only uses it up, the second backs off;
/// the scale never backs off below `min_scale`; growth restores the hysteresis.
// ANCHOR: hysteresis
#[test]
fn hysteresis_delays_the_back_off_and_min_scale_bounds_it() {
    let device = Default::default();
    let mut scaler = LossScalerConfig::new()
        .with_initial_scale(4.0)
        .with_min_scale(2.0)
        .with_growth_interval(3)
        .init::<B>(&device)
        .unwrap();
    let flag = |v: f32| FoundInf::new(Tensor::<B, 1>::from_floats([v], &device));
    let mut scales = Vec::new();
    for overflow in [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0] {
        scaler.update(&flag(overflow));
        scales.push(values(scaler.scale())[0]);
    }
    // inf (hysteresis 2 → 1), inf (→ 0: 4 → 2), inf (2 is the minimum), three clean (grow to
    // 4, hysteresis back to 2), inf (→ 1), inf (→ 0: 4 → 2).
    assert_eq!(scales, [4.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 2.0]);
    assert_eq!(values(scaler.skipped_steps())[0], 5.0);
}
// ANCHOR_END: hysteresis

#[test]
fn invalid_settings_are_errors() {
    let device = Default::default();
    let err = LossScalerConfig::new()
        .with_backoff_factor(1.5)
        .init::<B>(&device)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("backoff_factor (1.5) must be in (0, 1)"),
        "{err}"
    );
    let err = LossScalerConfig::new()
        .with_growth_interval(0)
        .init::<B>(&device)
        .unwrap_err();
    assert!(err.to_string().contains("growth_interval (0)"), "{err}");
}
