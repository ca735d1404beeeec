//! Text generation from one of our checkpoints, a Hugging Face one (`--hf`) or a randomly
//! initialised model of a preset's shape (`--preset`), with the byte tokenizer, a Hugging Face
//! `tokenizer.json` (`--tokenizer-model`, feature `tokenizers`) or token ids (`--prompt-ids`):
//! the model's configuration read from the checkpoint, its parameters loaded (resharded) at
//! TP = `--tp` x PP = `--pp` on thread ranks (on the CPU, or rank r on GPU r with
//! `--device cuda`, feature `cuda`), then greedy or seeded sampling with the KV cache
//! (`burn_megatron::inference`), stopping at the end-of-document token.
//!
//!     cargo run --example pretrain_gpt -- --train-iters 40
//!     cargo run --example generate -- --prompt "The " --max-new-tokens 40
//!     cargo run --example generate -- --prompt "The " --tp 2 --pp 2 --temperature 0.8 --top-p 0.9
//!     cargo run --example checkpoint_tool -- convert target/pretrain_gpt /tmp/hf --to-hf
//!     cargo run --example generate -- --hf /tmp/hf --prompt "The "
//!
//! On GPUs (issue 37), and the comparison with transformers' `generate` (bench/torch_generate.py,
//! bench/generate_gpu_check.sh):
//!
//!     bash bench/pack_gpu.sh build --release --features cuda -p burn-megatron-examples --example generate
//!     .gpu/bin/generate --device cuda --hf DIR --prompt-ids "1,2,3" --prompt-ids "4,5" --ignore-eos
//!     .gpu/bin/generate --device cuda --bf16 --preset llama-1b --tp 2 --benchmark \
//!         --batch-size 32 --prompt-length 128 --max-new-tokens 64
//!
//! `--benchmark` generates exactly `--max-new-tokens` tokens (no stop token) for
//! `--batch-size` prompts of `--prompt-length` random ids, and times it: a run of one new
//! token (the prefill, which picks the first token) and a run of N; decode is their
//! difference, the N - 1 tokens after the first. Each time is the median of `--repeats` runs
//! after a warm-up run of each (kernel compilation, autotune), measured from a device sync and
//! a barrier of every rank to a device sync after the run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, Instant};

use burn::backend::NdArray;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_megatron::backend::ModelBackend;
use burn_megatron::checkpointing::Checkpoint;
use burn_megatron::checkpointing::hugging_face::HfCheckpoint;
use burn_megatron::data::{ByteTokenizer, DataError, Tokenizer};
use burn_megatron::inference::{GenerationConfig, Sampling, generate_pipelined};
use burn_megatron::models::GptModel;
use burn_megatron::pipeline_parallel::StageSplit;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{LaunchConfig, ParallelSizes, ProcessGroup, launch};
use clap::{Parser, ValueEnum};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Generates text (or token ids) from a checkpoint, or times generation (`--benchmark`).
#[derive(Parser, Debug)]
struct Args {
    /// A checkpoint directory (`iter_*`) or the root holding them (the latest is loaded).
    #[arg(long, default_value = "target/pretrain_gpt")]
    load: PathBuf,
    /// A Hugging Face GPT-2 or Llama checkpoint directory (`config.json`, safetensors) to load
    /// instead of `--load`.
    #[arg(long)]
    hf: Option<PathBuf>,
    /// A randomly initialised model of this shape instead of a checkpoint (for `--benchmark`).
    #[arg(long, value_enum, conflicts_with = "hf")]
    preset: Option<Preset>,
    /// A Hugging Face `tokenizer.json` (build with `--features tokenizers`); without it, the
    /// byte tokenizer (ids 0-255 are bytes, 256 ends a document).
    #[arg(long)]
    tokenizer_model: Option<PathBuf>,
    /// The end-of-document (stop) token of the Hugging Face tokenizer (default: the first of
    /// `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` it has).
    #[arg(long)]
    eod_token: Option<String>,
    /// A prompt; repeat for a batch of prompts (of any lengths). Default: "The ".
    #[arg(long)]
    prompt: Vec<String>,
    /// A prompt as comma-separated token ids (e.g. "1,2,3"), instead of `--prompt`; repeat for
    /// a batch. Each output is printed as an `ids:` line of the new tokens' ids.
    #[arg(long, conflicts_with = "prompt")]
    prompt_ids: Vec<PromptIds>,
    /// Generate `--max-new-tokens` tokens, never stopping at the end-of-document token.
    #[arg(long)]
    ignore_eos: bool,
    /// Where the model runs: CPU thread ranks (NdArray, f32) or one GPU per rank (our CUDA
    /// backend, rank r on GPU r; build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// bf16 parameters and activations (with `--device cuda`); f32 without it.
    #[arg(long)]
    bf16: bool,
    /// Tensor-parallel ranks (threads) to generate on.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline stages (each of `--tp` threads) to generate on.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// The most tokens generated per prompt (with `--benchmark`: exactly this many).
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
    /// The seed of the draws (and of `--benchmark`'s random prompts).
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Time greedy generation of `--batch-size` random prompts of `--prompt-length` tokens
    /// instead (prefill and decode, tokens/s; collective checks off).
    #[arg(long)]
    benchmark: bool,
    /// Prompts of a `--benchmark` batch; several sizes separated by commas (e.g. "1,32") are
    /// timed one after the other on the same model.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch_size: Vec<usize>,
    /// Tokens of each `--benchmark` prompt.
    #[arg(long, default_value_t = 128)]
    prompt_length: usize,
    /// Timed `--benchmark` runs of each length (after one warm-up run); medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// After the timed `--benchmark` runs, one more whose GPU time is profiled per kernel
    /// (with `BM_PROFILE=1` on our CUDA backend; a captured decode step shows as its graph's
    /// launches, so run it with `BM_CUDA_GRAPHS=0` to see the kernels).
    #[arg(long)]
    profile: bool,
}

/// Model shapes for `--preset` (see `TransformerConfig`'s presets).
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Preset {
    /// A tiny Llama for checks on the CPU: 2 layers, 64 wide, 4 heads in 2 groups, a vocabulary
    /// of 512.
    #[value(name = "llama-tiny")]
    LlamaTiny,
    /// Llama-3.2-1B's shape: 16 layers, 2048 wide, 32 heads in 8 groups, SwiGLU 8192, RoPE
    /// base 500 000, 128 256 tokens, tied embeddings.
    #[value(name = "llama-1b")]
    Llama1b,
    /// Llama-3.2-3B's shape: 28 layers, 3072 wide, 24 heads in 8 groups.
    #[value(name = "llama-3b")]
    Llama3b,
    /// Llama-3.1-8B's shape: 32 layers, 4096 wide, 32 heads in 8 groups, untied output.
    #[value(name = "llama-8b")]
    Llama8b,
}

impl Preset {
    /// The name `--preset` takes.
    fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    fn config(self) -> TransformerConfig {
        match self {
            Preset::LlamaTiny => {
                let mut config = TransformerConfig::llama_1b();
                config.hidden_size = 64;
                config.num_layers = 2;
                config.num_attention_heads = 4;
                config.num_query_groups = Some(2);
                config.ffn_hidden_size = 128;
                config.vocab_size = 512;
                config.max_sequence_length = 512;
                config
            }
            Preset::Llama1b => TransformerConfig::llama_1b(),
            Preset::Llama3b => TransformerConfig::llama_3b(),
            Preset::Llama8b => TransformerConfig::llama_8b(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum DeviceArg {
    /// NdArray thread ranks on the CPU.
    Cpu,
    /// Our CUDA backend, rank r on GPU r (build with `--features cuda`).
    Cuda,
}

/// One `--prompt-ids` value: token ids separated by commas.
#[derive(Debug, Clone)]
struct PromptIds(Vec<i64>);

impl FromStr for PromptIds {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.split(',')
            .map(|id| {
                id.trim()
                    .parse::<i64>()
                    .map_err(|e| format!("{id:?} is not a token id ({e}): write ids as \"1,2,3\""))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(PromptIds)
    }
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

fn run(args: Args) -> Result<(), BoxError> {
    match args.device {
        DeviceArg::Cpu if args.bf16 => Err("--bf16 needs --device cuda (NdArray holds f32)".into()),
        DeviceArg::Cpu => run_on::<NdArray<f32>>(&args, |_| Default::default(), "CPU".into()),
        #[cfg(feature = "cuda")]
        DeviceArg::Cuda => {
            use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};
            let gpus = args.tp * args.pp;
            for gpu in 0..gpus {
                CudaGpu::available(gpu)?;
                if args.bf16 {
                    // Before any tensor exists on the GPU: parameters, activations and the
                    // tensors the model creates (masks, RoPE tables) are bf16 from here.
                    burn::tensor::set_default_dtypes::<MegatronCuda>(
                        &CudaGpu::new(gpu),
                        burn::tensor::FloatDType::BF16,
                        burn::tensor::IntDType::I32,
                    )?;
                }
            }
            let name = format!("{} x {gpus}", gpu_name(0));
            run_on::<MegatronCuda>(&args, CudaGpu::new, name)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceArg::Cuda => Err("this build has no CUDA: build with --features cuda".into()),
    }
}

/// Where the parameters come from.
enum Source {
    /// One of our checkpoints (`iter_*`).
    Ours(PathBuf),
    /// A Hugging Face checkpoint directory.
    HuggingFace(PathBuf),
    /// None: the model's own (random) initialisation.
    Random,
}

impl Source {
    /// The source `args` name and the model's configuration (without sequence parallelism,
    /// which generation does not run; the parameters are the same).
    fn of(args: &Args) -> Result<(Self, TransformerConfig), BoxError> {
        let (source, mut config) = match (&args.hf, args.preset) {
            (Some(dir), _) => {
                let hf = HfCheckpoint::open(dir)?;
                println!("{}: Hugging Face {:?}", dir.display(), hf.family());
                (Source::HuggingFace(dir.clone()), hf.config().clone())
            }
            (None, Some(preset)) => {
                println!("a randomly initialised {} (--preset)", preset.name());
                (Source::Random, preset.config())
            }
            (None, None) => {
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
        config.sequence_parallel = false;
        Ok((source, config))
    }

    /// This rank's part of `model` with the parameters loaded. Each rank opens the checkpoint
    /// and reads its slices (a checkpoint is not shared between threads).
    fn load<B: ModelBackend>(
        &self,
        model: GptModel<B>,
    ) -> Result<GptModel<B>, burn_megatron::Error> {
        match self {
            Source::Ours(dir) => Checkpoint::open(dir)?.load_model(model),
            Source::HuggingFace(dir) => HfCheckpoint::open(dir)?.load_model(model),
            Source::Random => Ok(model),
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

/// Everything after the choice of backend: the model built and loaded on `--tp` x `--pp`
/// thread ranks, rank r on `device(r)` (`device_name` names them for the report).
fn run_on<B: ModelBackend>(
    args: &Args,
    device: impl Fn(usize) -> B::Device + Sync,
    device_name: String,
) -> Result<(), BoxError> {
    let (source, config) = Source::of(args)?;
    let ranks = Ranks {
        args,
        config: &config,
        source: &source,
        device,
        dtype: if args.bf16 { DType::BF16 } else { DType::F32 },
    };
    println!(
        "generating at TP {} x PP {} on {device_name}, {:?}",
        args.tp, args.pp, ranks.dtype
    );
    if args.benchmark {
        // Rank 0 prints each batch size's report as soon as it has it (a run cut at a time
        // limit keeps what it measured); every rank times its own runs.
        return ranks.run::<B, _, _>(|model, pp, world, device| {
            for &batch in &args.batch_size {
                let prompts = random_prompts(args, config.vocab_size, batch);
                let lines = benchmark(
                    args,
                    &config,
                    &device_name,
                    model,
                    pp,
                    world,
                    device,
                    &prompts,
                )?;
                if world.rank() == 0 {
                    println!("{}", lines.join("\n"));
                }
            }
            Ok(())
        });
    }
    let tokenizer = tokenizer(args)?;
    let prompts = prompts(args, &config, tokenizer.as_ref())?;
    let ids: Vec<Vec<i64>> = prompts.iter().map(|p| p.ids.clone()).collect();
    let generation = generation_config(args, tokenizer.eod());
    let generated = ranks
        .run::<B, _, _>(|model, pp, _, _| Ok(generate_pipelined(model, pp, &ids, &generation)?))?;
    for (prompt, generated) in prompts.iter().zip(generated) {
        println!(
            "--- {} ({:?}, {} tokens)",
            prompt.label,
            generated.finish,
            generated.tokens.len()
        );
        let text = tokenizer.decode(&generated.tokens);
        match (&prompt.text, text) {
            (Some(prompt), Ok(text)) => println!("{prompt}{text}"),
            (None, Ok(text)) if args.tokenizer_model.is_some() => println!("{text}"),
            (_, Err(e)) if args.tokenizer_model.is_some() || prompt.text.is_some() => {
                println!("(no text: {e})")
            }
            _ => {}
        }
        // One line a prompt that scripts read (bench/torch_generate.py prints the same).
        let ids: Vec<String> = generated.tokens.iter().map(i64::to_string).collect();
        println!("ids: {}", ids.join(" "));
    }
    Ok(())
}

/// How the thread ranks get their part of the model.
struct Ranks<'a, D> {
    args: &'a Args,
    config: &'a TransformerConfig,
    source: &'a Source,
    /// Rank r's device.
    device: D,
    /// The parameters' dtype.
    dtype: DType,
}

impl<D> Ranks<'_, D> {
    /// Runs `work` on every rank with its part of the model (its stage, its TP slices), its
    /// pipeline group and the world group; returns rank 0's result (every rank's is the same).
    fn run<B, T, F>(&self, work: F) -> Result<T, BoxError>
    where
        B: ModelBackend,
        D: Fn(usize) -> B::Device + Sync,
        T: Send,
        F: Fn(&GptModel<B>, &ProcessGroup, &ProcessGroup, &B::Device) -> Result<T, BoxError> + Sync,
    {
        let args = self.args;
        let launch_config =
            LaunchConfig::new(args.tp * args.pp).with_collective_checks(!args.benchmark);
        let mut outputs = launch(launch_config, |ctx| {
            let sizes = ParallelSizes::default().with_tp(args.tp).with_pp(args.pp);
            let state = ctx.parallel_state(sizes)?;
            let device = (self.device)(ctx.local_rank());
            let stage = StageSplit::even(self.config.num_layers, args.pp)?.stage(state.pp_rank());
            let model = self
                .config
                .init_gpt_stage::<B>(state.tp(), &stage, &device)?;
            let model = self.source.load(model)?.map(&mut Cast(self.dtype));
            work(&model, state.pp(), ctx.world(), &device)
        })?;
        Ok(outputs.swap_remove(0))
    }
}

/// A prompt: how it is printed, its text (for text prompts) and its token ids.
struct Prompt {
    label: String,
    text: Option<String>,
    ids: Vec<i64>,
}

fn prompts(
    args: &Args,
    config: &TransformerConfig,
    tokenizer: &dyn Tokenizer,
) -> Result<Vec<Prompt>, BoxError> {
    if !args.prompt_ids.is_empty() {
        return Ok(args
            .prompt_ids
            .iter()
            .map(|p| Prompt {
                label: format!("ids {:?}", p.0),
                text: None,
                ids: p.0.clone(),
            })
            .collect());
    }
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(format!(
            "the tokenizer has {} tokens, the model's vocabulary only {}: use the model's \
             tokenizer (--tokenizer-model)",
            tokenizer.vocab_size(),
            config.vocab_size
        )
        .into());
    }
    let texts = match args.prompt.is_empty() {
        true => vec!["The ".to_string()],
        false => args.prompt.clone(),
    };
    texts
        .into_iter()
        .map(|text| {
            Ok(Prompt {
                label: format!("{text:?}"),
                ids: tokenizer.encode(&text)?,
                text: Some(text),
            })
        })
        .collect()
}

fn generation_config(args: &Args, eod: i64) -> GenerationConfig {
    let sampling = match args.temperature {
        None if args.top_k.is_none() && args.top_p.is_none() => Sampling::Greedy,
        temperature => Sampling::Random {
            temperature: temperature.unwrap_or(1.0),
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
    };
    let stop_tokens = match args.ignore_eos {
        true => Vec::new(),
        false => vec![eod],
    };
    GenerationConfig::greedy(args.max_new_tokens)
        .with_stop_tokens(stop_tokens)
        .with_sampling(sampling)
}

/// `batch` prompts of `--prompt-length` ids drawn uniformly from the vocabulary (SplitMix64
/// seeded by `--seed`).
fn random_prompts(args: &Args, vocab: usize, batch: usize) -> Vec<Vec<i64>> {
    let mut state = args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % vocab as u64) as i64
    };
    (0..batch)
        .map(|_| (0..args.prompt_length).map(|_| next()).collect())
        .collect()
}

/// Times greedy generation of `prompts` on this rank: one token and `--max-new-tokens`
/// tokens, a warm-up run of each, then `--repeats` of each. Returns the report lines.
#[allow(clippy::too_many_arguments)]
fn benchmark<B: ModelBackend>(
    args: &Args,
    config: &TransformerConfig,
    device_name: &str,
    model: &GptModel<B>,
    pp: &ProcessGroup,
    world: &ProcessGroup,
    device: &B::Device,
    prompts: &[Vec<i64>],
) -> Result<Vec<String>, BoxError> {
    let n = args.max_new_tokens;
    if n < 2 || args.repeats == 0 || prompts.is_empty() || args.prompt_length == 0 {
        return Err(
            "--benchmark needs --max-new-tokens >= 2, --repeats, --batch-size and \
                    --prompt-length >= 1"
                .into(),
        );
    }
    // No stop token: every prompt gets exactly `new` tokens (checked below).
    let time = |new: usize| -> Result<Duration, BoxError> {
        B::sync(device)?;
        world.barrier()?;
        let start = Instant::now();
        let generated = generate_pipelined(model, pp, prompts, &GenerationConfig::greedy(new))?;
        B::sync(device)?;
        let elapsed = start.elapsed();
        if let Some(g) = generated.iter().find(|g| g.tokens.len() != new) {
            return Err(format!(
                "a prompt got {} tokens, not {new} ({:?}): the model's maximum sequence is {}",
                g.tokens.len(),
                g.finish,
                config.max_sequence_length
            )
            .into());
        }
        Ok(elapsed)
    };
    let warmup = Instant::now();
    time(n)?;
    time(1)?;
    let warmup = warmup.elapsed();
    let (mut prefill, mut total) = (Vec::new(), Vec::new());
    for _ in 0..args.repeats {
        prefill.push(time(1)?.as_secs_f64());
        total.push(time(n)?.as_secs_f64());
    }
    let profile = match args.profile && B::profile_start(device) {
        true => {
            time(n)?;
            B::profile_report(device, 25, n)
        }
        false => None,
    };
    let (prefill, total) = (median(prefill), median(total));
    let decode = total - prefill;
    let (batch, prompt) = (prompts.len(), args.prompt_length);
    let decoded = (batch * (n - 1)) as f64;
    let source = match (&args.hf, args.preset) {
        (Some(dir), _) => format!("hf:{}", dir.display()),
        (None, Some(preset)) => preset.name(),
        (None, None) => format!("{}", args.load.display()),
    };
    let dtype = if args.bf16 { "bf16" } else { "f32" };
    let mut lines = vec![
        format!(
            "benchmark: {source} ({:.1}M parameters on rank 0), {dtype}, TP {} x PP {} on \
             {device_name}; batch {batch}, prompts of {prompt}, {n} new tokens; medians of {} \
             runs after {:.1} s of warm-up",
            model.num_params() as f64 / 1e6,
            args.tp,
            args.pp,
            args.repeats,
            warmup.as_secs_f64()
        ),
        format!(
            "  prefill (and the first token): {:.2} ms, {:.0} prompt tokens/s",
            prefill * 1e3,
            (batch * prompt) as f64 / prefill
        ),
        format!(
            "  decode ({} tokens a prompt after the first): {:.2} ms, {:.3} ms a step, {:.1} tokens/s",
            n - 1,
            decode * 1e3,
            decode * 1e3 / (n - 1) as f64,
            decoded / decode
        ),
        format!(
            "RESULT generate impl=burn-megatron tp={} pp={} dtype={dtype} batch={batch} \
             prompt={prompt} new={n} prefill_ms={:.3} total_ms={:.3} decode_ms_per_step={:.4} \
             decode_tok_s={:.1}",
            args.tp,
            args.pp,
            prefill * 1e3,
            total * 1e3,
            decode * 1e3 / (n - 1) as f64,
            decoded / decode
        ),
    ];
    if let Some(table) = profile {
        lines.push(format!(
            "profile of one more run, per generated token ({n} tokens: the prefill and every \
             decode step):\n{table}"
        ));
    }
    Ok(lines)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Casts every float parameter to a dtype (a no-op for those already in it): a checkpoint's
/// values arrive in the parameters' dtype, and a bf16 build should hold no f32 parameter.
struct Cast(DType);

impl<B: Backend> ModuleMapper<B> for Cast {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let dtype = self.0;
        param.map(|tensor| match tensor.dtype() == dtype {
            true => tensor,
            false => tensor.cast(dtype),
        })
    }
}

#[cfg(feature = "cuda")]
fn gpu_name(index: usize) -> String {
    use cudarc::driver::result::device;
    device::get(index as i32)
        .and_then(device::get_name)
        .unwrap_or_else(|e| format!("unknown GPU ({e:?})"))
}
