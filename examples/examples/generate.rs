//! Text generation from one of our checkpoints (or a Hugging Face one, `--hf`) with the byte
//! tokenizer or a Hugging Face `tokenizer.json` (`--tokenizer-model`, feature `tokenizers`): the model's
//! configuration read from the checkpoint, its parameters loaded (resharded) at TP = `--tp`
//! x PP = `--pp` on CPU thread ranks, then greedy or seeded sampling with the KV cache
//! (`burn_megatron::inference`), stopping at the end-of-document token.
//!
//!     cargo run --example pretrain_gpt -- --train-iters 40
//!     cargo run --example generate -- --prompt "The " --max-new-tokens 40
//!     cargo run --example generate -- --prompt "The " --tp 2 --pp 2 --temperature 0.8 --top-p 0.9
//!     cargo run --example checkpoint_tool -- convert target/pretrain_gpt /tmp/hf --to-hf
//!     cargo run --example generate -- --hf /tmp/hf --prompt "The "

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::NdArray;
use burn_megatron::checkpointing::Checkpoint;
use burn_megatron::checkpointing::hugging_face::HfCheckpoint;
use burn_megatron::data::{ByteTokenizer, DataError, Tokenizer};
use burn_megatron::inference::{GenerationConfig, Sampling, generate_pipelined};
use burn_megatron::models::GptModel;
use burn_megatron::pipeline_parallel::StageSplit;
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};
use clap::Parser;

type B = NdArray<f32>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Generates text from a checkpoint saved by `pretrain_gpt` (any TP/PP layout).
#[derive(Parser, Debug)]
struct Args {
    /// A checkpoint directory (`iter_*`) or the root holding them (the latest is loaded).
    #[arg(long, default_value = "target/pretrain_gpt")]
    load: PathBuf,
    /// A Hugging Face GPT-2 or Llama checkpoint directory (`config.json`, safetensors) to load
    /// instead of `--load`.
    #[arg(long)]
    hf: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` (build with `--features tokenizers`); without it, the
    /// byte tokenizer (ids 0-255 are bytes, 256 ends a document).
    #[arg(long)]
    tokenizer_model: Option<PathBuf>,
    /// The end-of-document (stop) token of the Hugging Face tokenizer (default: the first of
    /// `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` it has).
    #[arg(long)]
    eod_token: Option<String>,
    /// A prompt; repeat for a batch of prompts (of any lengths).
    #[arg(long, default_value = "The ")]
    prompt: Vec<String>,
    /// Tensor-parallel ranks (threads) to generate on.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline stages (each of `--tp` threads) to generate on.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// The most tokens (bytes) generated per prompt.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sample at this temperature (greedy without it).
    #[arg(long)]
    temperature: Option<f64>,
    /// Sample from the k most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample from the most likely tokens up to this probability only.
    #[arg(long)]
    top_p: Option<f64>,
    /// The seed of the draws.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Where the parameters come from.
enum Source {
    /// One of our checkpoints (`iter_*`).
    Ours(PathBuf),
    /// A Hugging Face checkpoint directory.
    HuggingFace(PathBuf),
}

impl Source {
    /// This rank's part of `model` with the parameters loaded. Each rank opens the checkpoint
    /// and reads its slices (a checkpoint is not shared between threads).
    fn load(&self, model: GptModel<B>) -> Result<GptModel<B>, burn_megatron::Error> {
        match self {
            Source::Ours(dir) => Checkpoint::open(dir)?.load_model(model),
            Source::HuggingFace(dir) => HfCheckpoint::open(dir)?.load_model(model),
        }
    }
}

fn tokenizer(args: &Args) -> Result<Box<dyn Tokenizer>, DataError> {
    match &args.tokenizer_model {
        None => Ok(Box::new(ByteTokenizer)),
        #[cfg(feature = "tokenizers")]
        Some(path) => Ok(Box::new(burn_megatron::data::HfTokenizer::from_file(
            path,
            args.eod_token.as_deref(),
        )?)),
        #[cfg(not(feature = "tokenizers"))]
        Some(path) => Err(DataError::Tokenizer(format!(
            "{}: Hugging Face tokenizers need a build with `--features tokenizers`",
            path.display()
        ))),
    }
}

fn run(args: Args) -> Result<(), BoxError> {
    let (source, mut config) = match &args.hf {
        Some(dir) => {
            let hf = HfCheckpoint::open(dir)?;
            println!("{}: Hugging Face {:?}", dir.display(), hf.family());
            (Source::HuggingFace(dir.clone()), hf.config().clone())
        }
        None => {
            let checkpoint = if args.load.join("metadata.json").exists() {
                Checkpoint::open(&args.load)?
            } else {
                Checkpoint::open_latest(&args.load)?
            };
            let meta = checkpoint.metadata();
            println!(
                "{}: iteration {}, saved at TP {} x PP {}",
                checkpoint.dir().display(),
                meta.iteration,
                meta.layout.tp,
                meta.layout.pp,
            );
            let config = meta.model_config.clone();
            (Source::Ours(checkpoint.dir().to_path_buf()), config)
        }
    };
    println!("generating at TP {} x PP {}", args.tp, args.pp);
    // The same parameters; generation runs the layers without sequence parallelism.
    config.sequence_parallel = false;
    let tokenizer = tokenizer(&args)?;
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(format!(
            "the tokenizer has {} tokens, the model's vocabulary only {}: use the model's \
             tokenizer (--tokenizer-model)",
            tokenizer.vocab_size(),
            config.vocab_size
        )
        .into());
    }
    let prompts = args
        .prompt
        .iter()
        .map(|p| tokenizer.encode(p))
        .collect::<Result<Vec<_>, _>>()?;
    let sampling = match args.temperature {
        None if args.top_k.is_none() && args.top_p.is_none() => Sampling::Greedy,
        temperature => Sampling::Random {
            temperature: temperature.unwrap_or(1.0),
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
    };
    let generation = GenerationConfig::greedy(args.max_new_tokens)
        .with_stop_tokens(vec![tokenizer.eod()])
        .with_sampling(sampling);
    let mut outputs = launch(LaunchConfig::new(args.tp * args.pp), |ctx| {
        let sizes = ParallelSizes::default().with_tp(args.tp).with_pp(args.pp);
        let state = ctx.parallel_state(sizes)?;
        let stage = StageSplit::even(config.num_layers, args.pp)?.stage(state.pp_rank());
        let model = config.init_gpt_stage::<B>(state.tp(), &stage, &Default::default())?;
        let model = source.load(model)?;
        Ok::<_, BoxError>(generate_pipelined(
            &model,
            state.pp(),
            &prompts,
            &generation,
        )?)
    })?;
    // Every rank generated the same tokens; print rank 0's.
    for (prompt, generated) in args.prompt.iter().zip(outputs.swap_remove(0)) {
        let text = tokenizer.decode(&generated.tokens)?;
        println!(
            "--- {prompt:?} ({:?}, {} tokens)",
            generated.finish,
            generated.tokens.len()
        );
        println!("{prompt}{text}");
        println!("(ids {:?})", generated.tokens);
    }
    Ok(())
}
