//! A tiny tensor-parallel MLP trained with Adam on CPU thread ranks (the book's tutorial
//! "Add tensor parallelism to a Burn model" includes it). It prints the falling loss, then trains the same model on one
//! rank and shows that the two loss curves agree.
//!
//!     cargo run --release --example tp_mlp -- --tp 4 --steps 40

use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_megatron::ModelBackend;
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::{GeluForm, gelu};
use burn_megatron::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
};
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};

type Train = Autodiff<NdArray>;

const D_MODEL: usize = 16;
const D_FFN: usize = 64;
const BATCH: usize = 32;

// ANCHOR: model
/// Megatron's MLP block: a column-parallel up-projection, GeLU on the rank's own features,
/// and a row-parallel down-projection whose partial products are summed over TP.
#[derive(Module, Debug)]
struct TpMlp<B: Backend> {
    up: ColumnParallelLinear<B>,
    down: RowParallelLinear<B>,
}

impl<B: ModelBackend> TpMlp<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.down.forward(gelu(self.up.forward(x), GeluForm::Erf))
    }
}
// ANCHOR_END: model

/// A batch of the regression task `y = sin(2x)`, identical on every rank.
fn batch<B: ModelBackend>(step: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x = init_full::<B, 2>(
        [BATCH, D_MODEL],
        InitDistribution::Normal { std: 1.0 },
        step as u64,
        device,
    );
    let y = x.clone().mul_scalar(2.0).sin();
    (x, y)
}

/// Trains on `tp` thread ranks; returns rank 0's loss after every step.
fn train(
    tp: usize,
    steps: usize,
    lr: f64,
    verbose: bool,
) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    // ANCHOR: train
    let losses = launch(
        LaunchConfig::new(tp),
        |ctx| -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
            let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
            let device = Default::default();
            let mut model = TpMlp::<Train> {
                up: ColumnParallelLinearConfig::new(D_MODEL, D_FFN)
                    .with_init_std(0.3)
                    .init(state.tp(), 1, &device)?,
                down: RowParallelLinearConfig::new(D_FFN, D_MODEL)
                    .with_init_std(0.1)
                    .init(state.tp(), 2, &device)?,
            };
            let mut optim = AdamConfig::new().init();
            let mut losses = Vec::with_capacity(steps);
            for step in 0..steps {
                let (x, y) = batch::<Train>(step, &device);
                let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
                let value = loss.clone().into_scalar();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(lr, model, grads);
                if verbose && ctx.rank() == 0 && (step % 5 == 0 || step + 1 == steps) {
                    println!("step {step:>4}  loss {value:.6}");
                }
                losses.push(value);
            }
            Ok(losses)
        },
    )?;
    // ANCHOR_END: train
    Ok(losses.into_iter().next().unwrap())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut tp = 4;
    let mut steps = 40;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || -> Result<usize, Box<dyn std::error::Error>> {
            Ok(args.next().ok_or(format!("{arg} needs a value"))?.parse()?)
        };
        match arg.as_str() {
            "--tp" => tp = value()?,
            "--steps" => steps = value()?,
            _ => return Err(format!("unknown argument {arg}; use --tp N --steps N").into()),
        }
    }
    let lr = 1e-2;
    println!(
        "Tensor-parallel MLP ({D_MODEL} -> {D_FFN} -> {D_MODEL}) on {tp} CPU thread ranks, Adam lr {lr}"
    );
    let started = Instant::now();
    let parallel = train(tp, steps, lr, true)?;
    println!("trained in {:.2?}", started.elapsed());

    let single = train(1, steps, lr, false)?;
    let worst = parallel
        .iter()
        .zip(&single)
        .map(|(a, b)| ((a - b) / b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "loss {:.6} -> {:.6} (TP={tp}); the same model on 1 rank: {:.6} -> {:.6}",
        parallel[0],
        parallel[steps - 1],
        single[0],
        single[steps - 1]
    );
    println!("largest relative difference between the two loss curves: {worst:.2e}");
    if parallel[steps - 1] >= parallel[0] {
        return Err("the loss did not fall".into());
    }
    Ok(())
}
