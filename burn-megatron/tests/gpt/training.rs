//! A short AdamW run at TP = 2 follows the TP = 1 loss curve.

use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn_megatron_dist::ParallelSizes;

use crate::{AD, assert_close, run, tokens, tolerance};

fn loss_curve(tp: usize, sequence_parallel: bool, steps: usize) -> Vec<f32> {
    let config = crate::small_llama().with_sequence_parallel(sequence_parallel);
    run(tp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut optim = AdamWConfig::new().with_weight_decay(0.01).init();
        let mut curve = Vec::new();
        for step in 0..steps {
            // A small fixed corpus, so the loss has something to fall on.
            let batch = (step % 3) as u64;
            let input = tokens(2, 8, config.vocab_size, batch);
            let targets = tokens(2, 8, config.vocab_size, batch + 50);
            let logits = model.try_forward(input)?;
            let loss = model.loss(logits, targets)?;
            curve.push(loss.clone().into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(3e-3, model, grads);
        }
        Ok(curve)
    })
    .remove(0)
}

#[test]
fn twenty_adamw_steps_at_tp2_follow_tp1() {
    let single = loss_curve(1, false, 20);
    assert!(
        single[19] < single[0] * 0.9,
        "the loss should fall: {single:?}"
    );
    for sp in [false, true] {
        let parallel = loss_curve(2, sp, 20);
        for (step, (a, b)) in parallel.iter().zip(&single).enumerate() {
            let (a, b) = (*a as f64, *b as f64);
            assert_close(
                &format!("SP={sp} step {step} loss"),
                &[a],
                &[b],
                tolerance::F32_TRAINING,
            );
        }
    }
}
