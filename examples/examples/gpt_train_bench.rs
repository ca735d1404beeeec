//! The end-to-end training step of our GPT on one GPU: forward, backward and AdamW on
//! `Autodiff<MegatronCuda>`, in tokens/s and MFU, to hold against `bench/torch_train.py` run
//! in the same device call (issue 13, "a training step at PyTorch speed"):
//!
//!     ../shared/gpu/pack build --release --features cuda -p burn-megatron-examples --example gpt_train_bench
//!     # on the device, in one call:
//!     source .gpu/env.sh
//!     BM_PROFILE=1 .gpu/bin/gpt_train_bench --preset gpt2-124m --batch 16 --dtype bf16
//!     python3 bench/torch_train.py --preset gpt2-124m --batch 16 --mode compile
//!
//! Each step is timed from its first operation to a device sync after the optimizer (the loss
//! is read once per step, which waits for the same work). The warm-up steps, which compile
//! kernels and run autotune, are left out; the step time is the median of the measured steps.
//! The optimizer is `burn_megatron::optimizer::FlatAdamW` (flat buffers, fp32 master weights
//! and moments, one fused kernel: Megatron's mixed precision); `--optimizer burn` steps with
//! Burn's per-parameter AdamW instead (moments in the parameters' dtype, no master weights).
//! With `BM_PROFILE=1` the measured steps are timed with the profile idle (one extra branch per
//! launch), then `--profile-steps` more steps are profiled per kernel (see
//! `burn_megatron_kernels::cuda::profile`).
//!
//! With `--data-parallel N` and/or `--tensor-parallel N` the step runs on N GPUs, one thread
//! rank per GPU over NCCL (issue 14): `--batch` is then each data-parallel rank's batch (as
//! torch DDP's per-GPU batch), the gradients are all-reduced bucket by bucket after backward,
//! or reduce-scattered with `--use-distributed-optimizer` (ZeRO-1, `DistributedAdamW`), and
//! tokens/s counts the whole world's tokens. Ranks are threads of this process, or processes
//! when started by `bm-launch --nproc-per-node N` (or torchrun). Compare with `torchrun
//! --nproc-per-node N bench/torch_train.py` (DDP) in the same call.
//!
//! `--fp8-format hybrid|e4m3` (with `--fp8-recipe tensorwise|delayed`) runs the transformer
//! layers' GEMMs in FP8 (issue 33, `burn_megatron::ops::fp8`); the RESULT line names it.
//! `--micro-batches N` accumulates the gradients of N batches per optimizer step (where FP8's
//! weight casts, made once a step, are shared); `--fp8-no-weight-cache` casts the weights in
//! every forward pass instead.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Int, IntDType, Tensor, TensorData, set_default_dtypes};
use burn_cubecl::cubecl::Runtime;
use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::models::GptModel;
use burn_megatron::ops::fp8::{Fp8Config, Fp8Format, Fp8Recipe};
use burn_megatron::optimizer::{DistributedAdamW, DistributedAdamWConfig};
use burn_megatron::tensor_parallel::SequenceParallelGrads;
use burn_megatron::transformer::{Recompute, TransformerConfig};
use burn_megatron_dist::{LaunchConfig, ParallelSizes, ProcessEnv, RankContext, launch, run_rank};
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda, MegatronCudaRuntime, profile};
use clap::{Parser, ValueEnum};

type Train = Autodiff<MegatronCuda>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Model shapes (see `TransformerConfig`'s presets).
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Preset {
    /// GPT-2 small: 12 layers, 768 wide, 12 heads (124M).
    #[value(name = "gpt2-124m")]
    Gpt2Small,
    /// GPT-2 medium: 24 layers, 1024 wide, 16 heads (350M).
    #[value(name = "gpt2-350m")]
    Gpt2Medium,
    /// Megatron's 1.3B GPT: 24 layers, 2048 wide, 16 heads.
    #[value(name = "gpt-1.3b")]
    Gpt1_3b,
    /// Llama-3.2-1B's shape (RMSNorm, SwiGLU, RoPE, 8 query groups) with a 32 000-token
    /// vocabulary and an untied output layer.
    #[value(name = "llama-1b")]
    Llama1b,
}

impl Preset {
    fn config(self) -> TransformerConfig {
        match self {
            Preset::Gpt2Small => TransformerConfig::gpt2_124m(),
            Preset::Gpt2Medium => TransformerConfig::gpt2_350m(),
            Preset::Gpt1_3b => TransformerConfig::gpt_1_3b(),
            Preset::Llama1b => {
                let mut config = TransformerConfig::llama_1b().with_tie_embeddings(false);
                config.vocab_size = 32_000;
                config.max_sequence_length = 2048;
                config
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum Precision {
    /// f32 parameters; matmuls on TF32 tensor cores.
    F32,
    /// bf16 parameters and activations; with `--optimizer burn`, bf16 AdamW moments too (Burn
    /// has no master weights), with `--optimizer flat` fp32 master weights and moments.
    Bf16,
}

/// Which AdamW steps the model.
#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum OptimizerArg {
    /// Burn's per-parameter AdamW (about ten launches per parameter, moments in the
    /// parameters' dtype).
    Burn,
    /// `burn_megatron::optimizer::FlatAdamW`: flat buffers, fp32 master weights and moments,
    /// one fused kernel (no weight decay on biases and norms).
    Flat,
}

/// The optimizer of a run.
enum StepOptimizer {
    Burn(burn::optim::adaptor::OptimizerAdaptor<burn::optim::AdamW, GptModel<Train>, Train>),
    Flat(Box<burn_megatron::optimizer::FlatAdamW<Train>>),
    /// Several GPUs: the flat fused AdamW of each data-parallel replica, its gradients
    /// reduced over the DP group (and, sharded, its state).
    Distributed(Box<DistributedAdamW<Train>>),
}

impl StepOptimizer {
    fn step(
        &mut self,
        lr: f64,
        model: GptModel<Train>,
        grads: GradientsParams,
    ) -> Result<GptModel<Train>, BoxError> {
        Ok(match self {
            StepOptimizer::Burn(optim) => optim.step(lr, model, grads),
            StepOptimizer::Flat(optim) => optim.step(lr, model, &grads)?,
            StepOptimizer::Distributed(optim) => optim.step(lr, model, &grads)?.model,
        })
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum RecomputeArg {
    None,
    Selective,
    Full,
}

/// One training step of a GPT on GPU 0, timed.
#[derive(Debug, Parser)]
struct Args {
    /// Model shape.
    #[arg(long, value_enum, default_value = "gpt2-124m")]
    preset: Preset,
    /// Sequences per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per sequence (default: the preset's maximum).
    #[arg(long)]
    seq: Option<usize>,
    /// Parameter and activation dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: Precision,
    /// Activation recomputation.
    #[arg(long, value_enum, default_value = "none")]
    recompute: RecomputeArg,
    /// Dropout on the residual stream (after attention and the MLP, and on the embeddings),
    /// fused with the residual add; attention dropout stays 0, so flash attention runs.
    #[arg(long, default_value_t = 0.0)]
    hidden_dropout: f64,
    /// Measured steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Warm-up steps (kernel compilation, autotune), not measured.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Steps profiled per kernel after the measured ones, with `BM_PROFILE=1`.
    #[arg(long, default_value_t = 2)]
    profile_steps: usize,
    /// Kernels listed in the profile.
    #[arg(long, default_value_t = 25)]
    top: usize,
    /// Dense peak TFLOP/s of the GPU for MFU (default: H100/H200 SXM, 989.4 bf16, 494.7 TF32).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-4)]
    lr: f64,
    /// The optimizer: Burn's AdamW, or AdamW fused over flat buffers with fp32 master weights.
    #[arg(long, value_enum, default_value = "flat")]
    optimizer: OptimizerArg,
    /// Print every step's loss (warm-up and measured) on one `LOSSES` line: the loss curve the
    /// bf16 run is compared on against f32 (the batches cycle through four fixed ones).
    #[arg(long)]
    print_losses: bool,
    /// Run the attention unfused (materialised scores, fused causal softmax) instead of flash
    /// attention, to compare the two.
    #[arg(long)]
    unfused_attention: bool,
    /// Data-parallel replicas, one GPU each (`--batch` sequences per replica).
    #[arg(long, default_value_t = 1)]
    data_parallel: usize,
    /// Tensor-parallel ranks per replica, one GPU each.
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// Sequence parallelism in the tensor-parallel group.
    #[arg(long)]
    sequence_parallel: bool,
    /// With --sequence-parallel: the column-parallel projections with their input's
    /// all-gather as one operation, the input gradient's reduce-scatter overlapped with the
    /// weight gradients' GEMMs (pretrain_gpt's --tp-comm-overlap).
    #[arg(long)]
    tp_comm_overlap: bool,
    /// Shard the master weights and moments over the data-parallel group (ZeRO-1).
    #[arg(long)]
    use_distributed_optimizer: bool,
    /// Elements per data-parallel gradient bucket.
    #[arg(long, default_value_t = 40_000_000)]
    bucket_numel: usize,
    /// Match every GPU collective on the host first (the launch default; off in torch).
    #[arg(long)]
    collective_checks: bool,
    /// Start each gradient bucket's reduction inside the backward pass, as soon as its
    /// layers' gradients are final (Megatron's option of the same name).
    #[arg(long)]
    overlap_grad_reduce: bool,
    /// With --use-distributed-optimizer: all-gather the updated parameters in buckets, in the
    /// next forward pass's order (Megatron's option of the same name).
    #[arg(long)]
    overlap_param_gather: bool,
    /// FP8 GEMMs in the transformer layers (Megatron's `--fp8-format`): hybrid (E4M3
    /// forward, E5M2 gradients) or e4m3. Off by default.
    #[arg(long)]
    fp8_format: Option<String>,
    /// How FP8 scales are chosen (Megatron's `--fp8-recipe`): tensorwise or delayed.
    #[arg(long, default_value = "tensorwise")]
    fp8_recipe: String,
    /// Cast each weight to FP8 in every forward pass instead of once per optimizer step
    /// (`Fp8Config::cache_weights` off).
    #[arg(long)]
    fp8_no_weight_cache: bool,
    /// Batches of `--batch` sequences per optimizer step, their gradients accumulated
    /// (Megatron's microbatches; the tokens of all count).
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
}

impl Args {
    fn world_size(&self) -> usize {
        self.data_parallel * self.tensor_parallel
    }
}

/// Host time of each part of a step, and the memory seen at its phase boundaries.
#[derive(Debug, Clone, Copy, Default)]
struct StepTimes {
    total: Duration,
    forward: Duration,
    backward: Duration,
    optimizer: Duration,
    /// From the optimizer's return to the end of the device sync (reading the loss included).
    wait: Duration,
    loss: f32,
    /// Largest bytes in use in the memory pool at the end of forward, backward or the
    /// optimizer step.
    in_use: u64,
    /// Bytes the pool holds from the driver at the end of backward.
    reserved: u64,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gpt_train_bench: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), BoxError> {
    let preset = args.preset.config();
    let seq = args.seq.unwrap_or(preset.max_sequence_length);
    let max_sequence_length = preset.max_sequence_length.max(seq);
    let recompute = match args.recompute {
        RecomputeArg::None => Recompute::None,
        RecomputeArg::Selective => Recompute::Selective,
        RecomputeArg::Full => Recompute::Full,
    };
    let mut config = preset
        .with_hidden_dropout(args.hidden_dropout)
        .with_attention_dropout(0.0)
        .with_recompute(recompute)
        .with_flash_attention(!args.unfused_attention);
    config.max_sequence_length = max_sequence_length;
    config.sequence_parallel = args.sequence_parallel;
    config.tp_comm_overlap = args.tp_comm_overlap;
    config.fp8 = match &args.fp8_format {
        Some(format) => Some(
            Fp8Config::new()
                .with_format(Fp8Format::parse(format)?)
                .with_recipe(Fp8Recipe::parse(&args.fp8_recipe)?)
                .with_cache_weights(!args.fp8_no_weight_cache),
        ),
        None => None,
    };
    if args.micro_batches == 0 {
        return Err("--micro-batches must be at least 1".into());
    }
    let world = args.world_size();
    if world == 0 {
        return Err("--data-parallel and --tensor-parallel must be at least 1".into());
    }
    let launch_config = LaunchConfig::new(world).with_collective_checks(args.collective_checks);
    let dtypes = |gpu: usize| -> Result<(), BoxError> {
        CudaGpu::available(gpu)?;
        if args.dtype == Precision::Bf16 {
            // Before any tensor exists on the device: parameters, activations and the tensors
            // the model creates (masks, RoPE tables) are all bf16 from here.
            set_default_dtypes::<Train>(&CudaGpu::new(gpu), FloatDType::BF16, IntDType::I32)?;
        }
        Ok(())
    };
    if std::env::var_os("RANK").is_some() {
        // One process per GPU (bm-launch or torchrun): this process runs its rank.
        let env = ProcessEnv::from_env()?;
        dtypes(env.local_rank)?;
        let outcome = run_rank(&env, launch_config, |ctx| {
            train(args, &config, seq, &ctx, &CudaGpu::new(ctx.local_rank()))
        })?;
        return match env.rank {
            0 => report(args, &config, seq, &outcome, "process"),
            _ => Ok(()),
        };
    }
    for gpu in 0..world {
        dtypes(gpu)?;
    }
    let mut outcome = launch(launch_config, |ctx| {
        train(args, &config, seq, &ctx, &CudaGpu::new(ctx.local_rank()))
    })?;
    let outcome = outcome.remove(0);
    report(args, &config, seq, &outcome, "thread")
}

/// What a run measured.
struct Outcome {
    params: usize,
    dtypes: String,
    gpu: String,
    warmup: Duration,
    first_loss: f32,
    /// Every step's loss, warm-up first.
    losses: Vec<f32>,
    steps: Vec<StepTimes>,
    profile: Option<(profile::Report, Duration)>,
    /// With `--overlap-grad-reduce`: parameter elements the hook took inside the backward
    /// pass, and whether their collectives started there.
    hooked: Option<(usize, bool)>,
}

fn train(
    args: &Args,
    config: &TransformerConfig,
    seq: usize,
    ctx: &RankContext,
    device: &CudaGpu,
) -> Result<Outcome, BoxError> {
    let state = ctx.parallel_state(ParallelSizes::default().with_tp(args.tensor_parallel))?;
    // As the schedules run it: sequence parallelism's partial gradients left partial by the
    // backward pass and summed over TP in one all-reduce after it (`train_step`).
    let mut model = config
        .init_gpt::<Train>(state.tp(), device)?
        .with_sequence_parallel_grads(SequenceParallelGrads::Deferred);
    let wanted = match args.dtype {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
    };
    let census = Census::of(&model);
    if census.keys().any(|dtype| *dtype != format!("{wanted:?}")) {
        model = model.map(&mut Cast(wanted));
    }
    let dtypes = format!("{:?} (before any cast: {census:?})", Census::of(&model));
    let params = model.num_params();
    let gpu = gpu_name(device.index);
    let mut optim = match args.optimizer {
        _ if args.world_size() > 1 => {
            if args.optimizer == OptimizerArg::Burn {
                return Err("--optimizer burn runs on one GPU only".into());
            }
            let data_parallel = DataParallelConfig::new()
                .with_bucket_numel(args.bucket_numel)
                .with_use_distributed_optimizer(args.use_distributed_optimizer)
                .with_overlap_param_gather(args.overlap_param_gather);
            let mut optim = DistributedAdamWConfig::new()
                .with_data_parallel(data_parallel)
                .init(&model, &state, &[])?;
            if args.overlap_grad_reduce {
                model.set_backward_hook(Some(optim.overlap_hook(&model, 1)));
            }
            StepOptimizer::Distributed(Box::new(optim))
        }
        OptimizerArg::Burn => {
            StepOptimizer::Burn(AdamWConfig::new().init::<Train, GptModel<Train>>())
        }
        OptimizerArg::Flat => StepOptimizer::Flat(Box::new(
            burn_megatron::optimizer::FlatAdamWConfig::new().init(&model)?,
        )),
    };
    // Each data-parallel replica reads its own batches; tensor-parallel ranks share theirs.
    let first_seed = 8 * state.dp().rank() as u64;
    let batches: Vec<_> = (0..4)
        .map(|i| {
            let seed = first_seed + 2 * i;
            (
                random_tokens(args.batch, seq, config.vocab_size, seed, device),
                random_tokens(args.batch, seq, config.vocab_size, seed + 1, device),
            )
        })
        .collect();

    let mut step = |model: GptModel<Train>, i: usize| {
        let microbatches: Vec<_> = (0..args.micro_batches)
            .map(|m| batches[(i * args.micro_batches + m) % batches.len()].clone())
            .collect();
        train_step(model, &mut optim, microbatches, args.lr, device)
    };
    let start = Instant::now();
    let mut first_loss = f32::NAN;
    let mut losses = Vec::with_capacity(args.warmup + args.steps);
    for i in 0..args.warmup {
        let (next, times) = step(model, i)?;
        model = next;
        if i == 0 {
            first_loss = times.loss;
        }
        losses.push(times.loss);
    }
    let warmup = start.elapsed();
    let mut steps = Vec::with_capacity(args.steps);
    for i in 0..args.steps {
        let (next, times) = step(model, args.warmup + i)?;
        model = next;
        losses.push(times.loss);
        steps.push(times);
    }
    let profile = match profile::enabled() && args.profile_steps > 0 {
        true => {
            profile::start(device);
            let start = Instant::now();
            for i in 0..args.profile_steps {
                model = step(model, i)?.0;
            }
            let elapsed = start.elapsed();
            Some((profile::report(device)?, elapsed))
        }
        false => None,
    };
    let hooked = match &optim {
        StepOptimizer::Distributed(optim) if args.overlap_grad_reduce => {
            Some((optim.hooked_numel(), optim.overlaps_backward()))
        }
        _ => None,
    };
    Ok(Outcome {
        losses,
        params,
        dtypes,
        gpu,
        warmup,
        first_loss,
        steps,
        profile,
        hooked,
    })
}

/// One step: forward and loss, backward (of each microbatch `(tokens, targets)`), AdamW,
/// then a device sync.
fn train_step(
    model: GptModel<Train>,
    optim: &mut StepOptimizer,
    mut microbatches: Vec<(Tensor<Train, 2, Int>, Tensor<Train, 2, Int>)>,
    lr: f64,
    device: &CudaGpu,
) -> Result<(GptModel<Train>, StepTimes), BoxError> {
    let mut times = StepTimes::default();
    let start = Instant::now();
    let (loss, grads) = match model.recompute() {
        // Full recomputation interleaves the layers' forward and backward passes; several
        // microbatches run as the schedules run them.
        recompute if recompute.reruns_layers() || microbatches.len() > 1 => {
            profile::phase(device, "fwd+bwd");
            let microbatches: Vec<_> = microbatches
                .into_iter()
                .map(|(tokens, targets)| {
                    burn_megatron::pipeline_parallel::Microbatch::new(tokens, targets)
                })
                .collect();
            let (loss, grads) = burn_megatron::pipeline_parallel::forward_backward_no_pipelining(
                &model,
                &microbatches,
            )?;
            times.forward = start.elapsed();
            times.in_use = memory(device).0;
            (loss, grads)
        }
        _ => {
            let (tokens, targets) = microbatches.pop().ok_or("no batch")?;
            // As the schedules do: sequence parallelism's partial gradients (the model defers
            // them, see `train`) summed over TP in one all-reduce after the backward pass.
            profile::phase(device, "forward");
            let loss = model.loss(model.try_forward(tokens)?, targets)?;
            times.forward = start.elapsed();
            times.in_use = memory(device).0;
            let backward = Instant::now();
            profile::phase(device, "backward");
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            burn_megatron::tensor_parallel::sum_sequence_parallel_grads(
                std::slice::from_ref(&model),
                std::slice::from_mut(&mut grads),
                model.tp(),
            )?;
            times.backward = backward.elapsed();
            (loss.inner(), grads)
        }
    };
    let (in_use, reserved) = memory(device);
    times.in_use = times.in_use.max(in_use);
    times.reserved = reserved;
    let optimizer = Instant::now();
    profile::phase(device, "optimizer");
    let model = optim.step(lr, model, grads)?;
    times.optimizer = optimizer.elapsed();
    // The optimizer's own buffers (the step's fp32 gradients) count too.
    times.in_use = times.in_use.max(memory(device).0);
    let wait = Instant::now();
    times.loss = loss
        .into_data()
        .iter::<f32>()
        .next()
        .ok_or("the loss is empty")?;
    <Train as Backend>::sync(device)?;
    times.wait = wait.elapsed();
    times.total = start.elapsed();
    Ok((model, times))
}

/// Bytes in use and bytes reserved in our runtime's memory pool, in queue order (no GPU wait).
fn memory(device: &CudaGpu) -> (u64, u64) {
    MegatronCudaRuntime::client(device)
        .memory_usage()
        .map(|usage| (usage.bytes_in_use, usage.bytes_reserved))
        .unwrap_or_default()
}

/// `[batch, seq]` token ids drawn uniformly from the vocabulary (SplitMix64, seeded by `seed`).
fn random_tokens(
    batch: usize,
    seq: usize,
    vocab: usize,
    seed: u64,
    device: &CudaGpu,
) -> Tensor<Train, 2, Int> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let ids: Vec<i32> = (0..batch * seq)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % vocab as u64) as i32
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq]), device)
}

fn gpu_name(index: usize) -> String {
    use cudarc::driver::result::device;
    device::get(index as i32)
        .and_then(device::get_name)
        .unwrap_or_else(|e| format!("unknown GPU ({e:?})"))
}

/// Parameter tensors per dtype.
struct Census(BTreeMap<String, usize>);

impl Census {
    fn of(model: &GptModel<Train>) -> BTreeMap<String, usize> {
        let mut census = Census(BTreeMap::new());
        model.visit(&mut census);
        census.0
    }
}

impl ModuleVisitor<Train> for Census {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        *self
            .0
            .entry(format!("{:?}", param.val().dtype()))
            .or_default() += 1;
    }
}

/// Casts every float parameter to a dtype, keeping it a leaf that requires its gradient.
struct Cast(DType);

impl ModuleMapper<Train> for Cast {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Train, D>>,
    ) -> Param<Tensor<Train, D>> {
        let dtype = self.0;
        param.map(|tensor| Tensor::from_inner(tensor.inner().cast(dtype)).require_grad())
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Dense peak FLOP/s of the GPU named `gpu` in `dtype`, when known.
fn peak_flops(gpu: &str, dtype: Precision, given: Option<f64>) -> Option<f64> {
    if let Some(tflops) = given {
        return Some(tflops * 1e12);
    }
    let sxm = (gpu.contains("H100") && !gpu.contains("PCIe")) || gpu.contains("H200");
    let pcie = gpu.contains("H100") && gpu.contains("PCIe");
    let bf16 = match (sxm, pcie) {
        (true, _) => 989.4e12,
        (_, true) => 756.0e12,
        _ => return None,
    };
    Some(match dtype {
        Precision::Bf16 => bf16,
        Precision::F32 => bf16 / 2.0,
    })
}

fn report(
    args: &Args,
    config: &TransformerConfig,
    seq: usize,
    outcome: &Outcome,
    ranks: &str,
) -> Result<(), BoxError> {
    let name = args
        .preset
        .to_possible_value()
        .map(|v| v.get_name().to_string());
    let name = name.unwrap_or_default();
    let dtype = format!("{:?}", args.dtype).to_lowercase();
    let fp8 = match &config.fp8 {
        Some(fp8) => format!(
            "{:?}-{:?}{}",
            fp8.format,
            fp8.recipe,
            if fp8.cache_weights { "" } else { "-nocache" }
        )
        .to_lowercase(),
        None => "off".to_string(),
    };
    let recompute = format!("{:?}", args.recompute).to_lowercase();
    let steps = &outcome.steps;
    let of = |f: fn(&StepTimes) -> Duration| median(steps.iter().map(|s| ms(f(s))).collect());
    let step_ms = of(|s| s.total);
    // The world's tokens and FLOPs; TFLOP/s and MFU are per GPU.
    let world = args.world_size() as f64;
    let global_batch = args.batch * args.micro_batches * args.data_parallel;
    let tokens = (global_batch * seq) as f64;
    let flops = config.training_flops(global_batch, seq)?;
    let tflops = flops / (step_ms / 1e3) / 1e12 / world;
    let peak = peak_flops(&outcome.gpu, args.dtype, args.peak_tflops);
    let mfu = peak.map_or(f64::NAN, |p| flops / (step_ms / 1e3) / p / world);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let in_use = steps.iter().map(|s| s.in_use).max().unwrap_or(0);
    let reserved = steps.iter().map(|s| s.reserved).max().unwrap_or(0);
    let last_loss = steps.last().map_or(f32::NAN, |s| s.loss);
    let (min, max) = steps.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), s| {
        (lo.min(ms(s.total)), hi.max(ms(s.total)))
    });
    println!(
        "gpt_train_bench: {name} ({:.1}M params; parameter tensors by dtype {}), batch {} × seq {seq} \
         × {} microbatches a step, recompute {recompute}, attention {}, {} lr {}, on {}",
        outcome.params as f64 / 1e6,
        outcome.dtypes,
        args.batch,
        args.micro_batches,
        if args.unfused_attention {
            "unfused"
        } else {
            "flash"
        },
        match args.optimizer {
            OptimizerArg::Burn => "Burn AdamW",
            OptimizerArg::Flat => "flat fused AdamW (fp32 master weights)",
        },
        args.lr,
        outcome.gpu
    );
    if args.world_size() > 1 {
        println!(
            "  layout: DP {} × TP {} (sequence parallel {}) on {} GPUs, {ranks} ranks over NCCL, \
             collective checks {}; {} optimizer, buckets of {} elements; batch {} per replica; \
             figures from rank 0 (its loss is its replica's)",
            args.data_parallel,
            args.tensor_parallel,
            args.sequence_parallel,
            args.world_size(),
            args.collective_checks,
            if args.overlap_param_gather {
                "distributed (ZeRO-1, parameter gather in buckets)"
            } else if args.use_distributed_optimizer {
                "distributed (ZeRO-1)"
            } else {
                "replicated"
            },
            args.bucket_numel,
            args.batch,
        );
        if let Some((numel, overlaps)) = outcome.hooked {
            println!(
                "  overlap: {numel} of {} parameter elements reduced from inside the backward \
                 pass ({})",
                outcome.params,
                if overlaps {
                    "collectives started there"
                } else {
                    "copied there, collectives after it"
                }
            );
        }
    }
    println!(
        "  warm-up: {} steps in {:.1} s (first loss {:.4}); measured: {} steps, loss now {last_loss:.4}",
        args.warmup,
        outcome.warmup.as_secs_f64(),
        outcome.first_loss,
        steps.len(),
    );
    println!(
        "  step: median {step_ms:.2} ms (min {min:.2}, max {max:.2}); {:.0} tokens/s; \
         {:.1} TFLOP/s per GPU ({:.3e} model FLOPs per step); MFU {:.1}%",
        tokens / (step_ms / 1e3),
        tflops,
        flops,
        100.0 * mfu
    );
    println!(
        "  host ms per step (medians): forward {:.2}, backward {:.2}, optimizer {:.2}, \
         waiting for the GPU {:.2}",
        of(|s| s.forward),
        of(|s| s.backward),
        of(|s| s.optimizer),
        of(|s| s.wait),
    );
    println!(
        "  memory pool: {:.2} GiB in use at most (sampled at the end of forward, backward and the optimizer step), \
         {:.2} GiB reserved from the driver",
        gib(in_use),
        gib(reserved)
    );
    if let Some((report, elapsed)) = &outcome.profile {
        let n = args.profile_steps;
        println!(
            "  profile of {n} more steps ({:.2} ms/step with the profile recording):",
            ms(*elapsed) / n as f64
        );
        for line in report.table(args.top, n).lines() {
            println!("    {line}");
        }
    }
    println!(
        "RESULT impl=burn-megatron preset={name} batch={} micro_batches={} seq={seq} dtype={dtype} \
         fp8={fp8} recompute={recompute} hidden_dropout={} dp={} tp={} sp={} zero={} overlap={} ranks={ranks} params={} step_ms={step_ms:.2} tok_s={:.0} tflops={tflops:.1} \
         mfu={:.4} mem_alloc_gib={:.2} mem_reserved_gib={:.2} loss={last_loss:.4}",
        args.batch,
        args.micro_batches,
        args.hidden_dropout,
        args.data_parallel,
        args.tensor_parallel,
        args.sequence_parallel,
        args.use_distributed_optimizer,
        args.overlap_grad_reduce,
        outcome.params,
        tokens / (step_ms / 1e3),
        mfu,
        gib(in_use),
        gib(reserved),
    );
    if args.print_losses {
        let losses: Vec<String> = outcome.losses.iter().map(|l| format!("{l:.5}")).collect();
        println!("LOSSES dtype={dtype} {}", losses.join(" "));
    }
    Ok(())
}
