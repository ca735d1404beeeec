//! The README's "use it in your Burn project" listing: a small GPT split over two CPU thread
//! ranks with tensor and sequence parallelism, trained for a few steps with Burn's AdamW.
//! `.ci/check_docs.py` checks that the README shows exactly the lines between the anchors.
//!
//!     cargo run --example quickstart

// ANCHOR: readme
use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor};
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};

type B = Autodiff<NdArray>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Two CPU thread ranks in one tensor-parallel group: each holds half of every layer.
    launch(LaunchConfig::new(2), |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let device = Default::default();
        // hidden 64, 2 layers, 4 heads, FFN 256, vocabulary 1000, sequences of 32
        let config = TransformerConfig::new(64, 2, 4, 256, 1000, 32).with_sequence_parallel(true);
        let mut model = config.init_gpt::<B>(state.tp(), &device)?;
        let mut optim = AdamWConfig::new().init();
        let tokens = Tensor::<B, 1, Int>::arange(0..128, &device).reshape([4, 32]);
        for step in 0..3 {
            let logits = model.try_forward(tokens.clone())?;
            let loss = model.loss(logits, tokens.clone().add_scalar(1))?;
            // Both ranks print the same loss: the one a single device would compute.
            let value = loss.clone().into_scalar();
            println!("rank {} step {step}: loss {value}", ctx.rank());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
        }
        Ok::<_, burn_megatron::Error>(())
    })?;
    Ok(())
}
// ANCHOR_END: readme
