//! The main job: pretrain a GPT with tensor and pipeline parallelism (Megatron-LM's
//! `pretrain_gpt.py`), with Megatron's option names.
//!
//!     cargo run --example pretrain_gpt                      # the embedded default run
//!     cargo run --example pretrain_gpt -- --help            # every option
//!     cargo run --example pretrain_gpt -- --config run.toml --train-iters 500
//!     cargo run --example pretrain_gpt -- --learner         # through burn-train's Learner
//!
//! With no launch variables it runs every rank as a thread of this process on the CPU
//! (TP × PP ranks). Started one process per rank (`bm-launch`, or torchrun's or SLURM's
//! variables), it runs this process's rank: on the CPU over TCP, or with `--features cuda`
//! on GPU `LOCAL_RANK` with NCCL:
//!
//!     cargo build --release --features cuda --example pretrain_gpt -p burn-megatron-examples
//!     cargo build --release --features cuda -p burn-megatron-dist --bin bm-launch
//!     target/release/bm-launch --nproc-per-node 4 -- target/release/examples/pretrain_gpt

use std::process::ExitCode;
use std::time::Duration;

use burn_megatron::training::learner::{LearnerReporting, pretrain_with_learner};
use burn_megatron::training::{
    ConsoleProgress, PretrainArgs, PretrainConfig, PretrainData, pretrain, pretrain_on_threads,
};
use burn_megatron_dist::{LaunchConfig, ProcessEnv, launch, run_rank};
use clap::Parser;

/// Where a run saves its checkpoints unless `--save` names a directory or `--no-save` is given
/// (under the git-ignored `target/`).
const DEFAULT_SAVE: &str = "target/pretrain_gpt";

fn main() -> ExitCode {
    let config = match PretrainArgs::parse().into_config() {
        Ok(mut config) => {
            if config.save.is_none() && !config.no_save {
                config.save = Some(DEFAULT_SAVE.into());
            }
            config
        }
        Err(e) => {
            eprintln!("pretrain_gpt: {e}");
            return ExitCode::from(2);
        }
    };
    if config.plan {
        return plan(&config);
    }
    let result =
        if std::env::var_os("RANK").is_some() || std::env::var_os("SLURM_PROCID").is_some() {
            process_rank(&config)
        } else if config.bf16 || config.fp16 {
            Err("--bf16 and --fp16 train on GPUs: build with --features cuda and start one process \
             per GPU (bm-launch); the CPU thread ranks train in f32"
            .to_string())
        } else if config.learner {
            learner_on_threads(&config)
        } else {
            pretrain_on_threads(&config, &ConsoleProgress::new(config.log_interval as u64))
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pretrain_gpt: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--plan`: the memory planner's table for every layout of the run's world, and its advice.
fn plan(config: &PretrainConfig) -> ExitCode {
    use burn_megatron::training::planner;
    let input = config.plan_input();
    let estimates = planner::plan(&input, config.world_size());
    print!("{}", planner::render(&input, &estimates));
    ExitCode::SUCCESS
}

#[cfg(feature = "cuda")]
type Training = burn::backend::Autodiff<burn_megatron_kernels::cuda::MegatronCuda>;
#[cfg(not(feature = "cuda"))]
type Training = burn_megatron::training::CpuTraining;

#[cfg(feature = "cuda")]
fn device(local_rank: usize) -> burn_megatron_kernels::cuda::CudaGpu {
    burn_megatron_kernels::cuda::CudaGpu::new(local_rank)
}
#[cfg(not(feature = "cuda"))]
fn device(_local_rank: usize) -> burn::backend::ndarray::NdArrayDevice {
    Default::default()
}

/// This process's rank of a multi-process launch: the data built by each process (the
/// default corpus is generated per process), the rank's stage on its device.
fn process_rank(config: &PretrainConfig) -> Result<(), String> {
    let env = ProcessEnv::from_env().map_err(|e| e.to_string())?;
    config.check(env.world_size).map_err(|e| e.to_string())?;
    let data = PretrainData::build(config).map_err(|e| e.to_string())?;
    let progress = ConsoleProgress::new(config.log_interval as u64);
    let launch = LaunchConfig::new(env.world_size)
        .with_timeout(Duration::from_secs(600))
        .with_collective_checks(config.collective_checks);
    let reporting = reporting();
    run_rank(&env, launch, |ctx| {
        let device = device(env.local_rank);
        if config.bf16 || config.fp16 {
            half_precision_by_default(&device, config.fp16)?;
        }
        if config.learner {
            pretrain_with_learner::<Training>(&ctx, config, &data, &device, &reporting)
        } else {
            pretrain::<Training>(&ctx, config, &data, &device, &progress).map(|_| ())
        }
    })
    .map(|_| ())
    .map_err(|e| e.to_string())
}

// ANCHOR: half_precision
/// `--bf16` (or `--fp16`): every float tensor made on `device` from here on is bf16 (f16)
/// (parameters, activations, masks); the optimizer keeps its own fp32 buffers.
#[cfg(feature = "cuda")]
fn half_precision_by_default(
    device: &burn_megatron_kernels::cuda::CudaGpu,
    fp16: bool,
) -> burn_megatron::Result<()> {
    use burn::tensor::{FloatDType, IntDType, set_default_dtypes};
    let dtype = if fp16 {
        FloatDType::F16
    } else {
        FloatDType::BF16
    };
    set_default_dtypes::<Training>(device, dtype, IntDType::I32).map_err(|e| {
        burn_megatron::ConfigError::Invalid(format!("cannot set the device's dtype: {e}")).into()
    })
}
// ANCHOR_END: half_precision
#[cfg(not(feature = "cuda"))]
fn half_precision_by_default(
    _: &burn::backend::ndarray::NdArrayDevice,
    _: bool,
) -> burn_megatron::Result<()> {
    Err(burn_megatron::ConfigError::Invalid(
        "--bf16 and --fp16 train on GPUs: build with --features cuda".into(),
    )
    .into())
}

/// burn-train's directory for a `--learner` run: its metric files and experiment log.
fn reporting() -> LearnerReporting {
    LearnerReporting {
        directory: "target/pretrain_gpt_learner".into(),
        ..Default::default()
    }
}

/// `--learner` on CPU thread ranks: one `SupervisedTraining` per rank, rank 0's dashboard.
fn learner_on_threads(config: &PretrainConfig) -> Result<(), String> {
    let world = config.world_size();
    config.check(world).map_err(|e| e.to_string())?;
    let data = PretrainData::build(config).map_err(|e| e.to_string())?;
    let reporting = reporting();
    let launch_config = LaunchConfig::new(world).with_timeout(Duration::from_secs(300));
    launch(launch_config, |ctx| {
        pretrain_with_learner::<burn_megatron::training::CpuTraining>(
            &ctx,
            config,
            &data,
            &Default::default(),
            &reporting,
        )
    })
    .map(|_| ())
    .map_err(|e| e.to_string())
}
