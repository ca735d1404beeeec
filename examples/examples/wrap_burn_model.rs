//! Data parallelism and the distributed optimizer (ZeRO-1) for a Burn model that is not
//! ours: a small language model made of burn-nn's `TransformerEncoder`, trained through
//! burn-train's `Learner` on DP thread ranks. Then the same steps run in a plain loop on one
//! rank over the global batches, and the example checks that the losses are equal.
//!
//! What the model needs for this: `TrainStep`/`InferenceStep` reporting a
//! `LanguageModelOutput`, and one line declaring its parameters replicated. The training
//! setup differs from a single-device burn-train run in four lines (marked `// DP:`).
//!
//! ```sh
//! cargo run --example wrap_burn_model -- --dp 2 --steps 8
//! ```

use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use burn::train::metric::LossMetric;
use burn::train::{InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep};
use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::optimizer::DistributedAdamWConfig;
use burn_megatron::optimizer::LrScheduleConfig;
use burn_megatron::tensor_parallel::{DeclarePlacements, Placements};
use burn_megatron::training::learner::{
    DataParallelShard, LanguageModelOutput, MegatronOptimizer, MegatronStrategy, MegatronTraining,
    MetricRecorder, QuietRenderer,
};
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};
use clap::Parser;

type Train = Autodiff<NdArray<f32>>;

const VOCAB: usize = 64;
const SEQ: usize = 16;

/// A next-token model from burn-nn parts (not one of ours).
#[derive(Module, Debug)]
struct TinyLm<B: Backend> {
    embedding: Embedding<B>,
    encoder: TransformerEncoder<B>,
    output: Linear<B>,
}

impl<B: Backend> TinyLm<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, 32).init(device),
            encoder: TransformerEncoderConfig::new(32, 64, 4, 2)
                .with_dropout(0.0)
                .init(device),
            output: LinearConfig::new(32, VOCAB).init(device),
        }
    }

    /// Mean next-token cross-entropy of a `[batch, SEQ + 1]` token batch.
    fn loss(&self, batch: &Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch_size, _] = batch.dims();
        let inputs = batch.clone().narrow(1, 0, SEQ);
        let targets = batch.clone().narrow(1, 1, SEQ).reshape([batch_size * SEQ]);
        let device = batch.device();
        let mask = generate_autoregressive_mask::<B>(batch_size, SEQ, &device);
        let hidden = self
            .encoder
            .forward(TransformerEncoderInput::new(self.embedding.forward(inputs)).mask_attn(mask));
        let logits = self
            .output
            .forward(hidden)
            .reshape([batch_size * SEQ, VOCAB]);
        CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, targets)
    }
}

// ANCHOR: placements
// DP: the model declares its parameters replicated (it has no tensor parallelism).
impl<B: Backend> DeclarePlacements for TinyLm<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare_replicated(self);
    }
}
// ANCHOR_END: placements

// ANCHOR: steps
impl<B: AutodiffBackend> TrainStep for TinyLm<B> {
    type Input = Tensor<B, 2, Int>;
    type Output = LanguageModelOutput<B::InnerBackend>;

    fn step(&self, batch: Tensor<B, 2, Int>) -> TrainOutput<Self::Output> {
        let tokens = batch.dims()[0] * SEQ;
        let loss = self.loss(&batch);
        let grads = loss.backward();
        let item = LanguageModelOutput::new(loss.inner(), tokens, 0.0, 1);
        TrainOutput::new(self, grads, item)
    }
}

impl<B: Backend> InferenceStep for TinyLm<B> {
    type Input = Tensor<B, 2, Int>;
    type Output = LanguageModelOutput<B>;

    fn step(&self, batch: Tensor<B, 2, Int>) -> LanguageModelOutput<B> {
        LanguageModelOutput::new(self.loss(&batch), batch.dims()[0] * SEQ, 0.0, 1)
    }
}
// ANCHOR_END: steps

/// Token windows of a repeating, learnable sequence.
fn dataset(samples: usize) -> InMemDataset<Vec<i64>> {
    let text: Vec<i64> = (0..samples * 7 + SEQ + 1)
        .map(|i| ((i * i + 3 * i) % VOCAB) as i64)
        .collect();
    InMemDataset::new(
        (0..samples)
            .map(|s| text[s * 7..s * 7 + SEQ + 1].to_vec())
            .collect(),
    )
}

#[derive(Clone)]
struct TokenBatcher;

impl<B: Backend> Batcher<B, Vec<i64>, Tensor<B, 2, Int>> for TokenBatcher {
    fn batch(&self, items: Vec<Vec<i64>>, device: &B::Device) -> Tensor<B, 2, Int> {
        let rows = items.len();
        let data = TensorData::new(items.concat(), [rows, SEQ + 1]);
        Tensor::from_data(data, device)
    }
}

fn loader<B: Backend>(batch: usize, samples: usize) -> Arc<dyn DataLoader<B, Tensor<B, 2, Int>>> {
    DataLoaderBuilder::new(TokenBatcher)
        .batch_size(batch)
        .build(dataset(samples))
}

#[derive(Parser, Debug)]
#[command(about = "DP + ZeRO-1 for a burn-nn model through burn-train's Learner")]
struct Args {
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Training steps (global batches).
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let device = Default::default();
    let samples = args.steps * args.batch * args.dp;
    let schedule = LrScheduleConfig::new(3e-3)
        .with_warmup_steps(2)
        .with_decay_steps(args.steps);
    // ANCHOR: optimizer
    let optimizer = DistributedAdamWConfig::new()
        .with_data_parallel(DataParallelConfig::new().with_use_distributed_optimizer(true))
        .with_clip_grad(Some(1.0));
    // ANCHOR_END: optimizer
    // One initial model for every rank. Burn initialises parameters lazily, and each clone of
    // an uninitialised module on its own: materialise the values once, before cloning.
    <Train as Backend>::seed(&device, 42);
    let initial = TinyLm::<Train>::new(&device);
    let initial = initial.clone().load_record(initial.into_record());

    let recorder = MetricRecorder::new();
    let dir = std::env::temp_dir().join(format!("wrap_burn_model-{}", std::process::id()));
    // ANCHOR: launch
    launch(LaunchConfig::new(args.dp), |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        // Each thread rank gets autodiff leaves of its own (a plain clone would share them,
        // and burn-autodiff would merge the ranks' graphs: see the book's "Pretraining").
        let model = initial.clone().fork(&device);
        // DP: the distributed optimizer over this rank's model, shared with the strategy.
        let optim = MegatronOptimizer::new(optimizer.init(&model, &state, &[])?);
        // DP: each rank reads its share of the batches.
        let train = DataParallelShard::new(loader::<Train>(args.batch, samples), &state);
        let valid = loader::<NdArray>(args.batch, 2 * args.batch);
        let mut training = SupervisedTraining::new(&dir, Arc::new(train), valid)
            .metric_train_numeric(LossMetric::new())
            .with_metric_logger(recorder.clone())
            .with_application_logger(None)
            .num_epochs(1);
        if !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            training = training.renderer(QuietRenderer);
        }
        // DP: the strategy that runs this rank of the job.
        let strategy = MegatronStrategy::new(&state, &optim);
        // burn-train's loop returns no `Result`: the strategy keeps the error that stopped it.
        let failure = strategy.failure();
        let training = training.with_megatron(strategy);
        training.launch(Learner::new(model, optim, schedule.init()?));
        match failure.take() {
            Some(error) => Err(error),
            None => Ok::<_, burn_megatron::Error>(()),
        }
    })?;
    // ANCHOR_END: launch
    let _ = std::fs::remove_dir_all(&dir);
    let learner_losses = recorder.values("Loss", true);

    // The plain loop: one rank, the global batches, the same optimizer.
    let plain_losses = launch(LaunchConfig::new(1), |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let mut model = initial.clone();
        let mut optim = optimizer.init(&model, &state, &[])?;
        let mut lr = schedule.init()?;
        let mut losses = Vec::new();
        for batch in loader::<Train>(args.batch * args.dp, samples).iter() {
            let loss = model.loss(&batch);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            losses.push(loss.into_scalar() as f64);
            model = optim
                .step(
                    burn::lr_scheduler::LrScheduler::step(&mut lr),
                    model,
                    &grads,
                )?
                .model;
        }
        Ok::<_, burn_megatron::Error>(losses)
    })?
    .remove(0);

    println!(
        "step  Learner, DP={} ZeRO-1   plain loop, one rank",
        args.dp
    );
    for (i, (a, b)) in learner_losses.iter().zip(&plain_losses).enumerate() {
        println!("{:>4}  {a:>20.6}   {b:>20.6}", i + 1);
    }
    let worst = learner_losses
        .iter()
        .zip(&plain_losses)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .fold(0.0, |worst: f64, d| {
            if worst.is_nan() || d.is_nan() {
                f64::NAN
            } else {
                worst.max(d)
            }
        });
    // Written so that a NaN anywhere makes the comparison fail.
    let equal = learner_losses.len() == plain_losses.len() && worst <= 1e-5;
    println!(
        "largest relative difference {worst:.2e}: {}",
        if equal { "equal" } else { "NOT equal" }
    );
    let learned = plain_losses.last() < plain_losses.first();
    if !equal || !learned {
        return Err(
            "the Learner's losses differ from the plain loop's, or the loss did not fall".into(),
        );
    }
    Ok(())
}
