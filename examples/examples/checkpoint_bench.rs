//! Save and load time of a ~1B-parameter GPT's state with our checkpoints, to hold against
//! `bench/torch_checkpoint.py` (`torch.save` / `torch.load` of the same tensors) run in the
//! same device call (issue 16):
//!
//!     cargo run --release --example checkpoint_bench -- --preset gpt-1b --dir /tmp/bm_ckpt
//!     python3 bench/torch_checkpoint.py --preset gpt-1b --dir /tmp/torch_ckpt
//!     # the model on the GPU (bf16 or f32): build with --features cuda, add --device cuda
//!     # (and --device cuda to the PyTorch peer)
//!
//! What is timed, each `--repeats` times (the median is reported):
//! - `save`: [`Checkpointer::save`] of the model (one rank, TP = PP = 1): device-to-host
//!   copies, safetensors files with their checksums, every file fsynced, the metadata, the
//!   directory renamed into place;
//! - `async save`: [`AsyncCheckpointer::save`], the time the step is blocked (host copies),
//!   then until [`AsyncCheckpointer::finish`] has published it; the first repetition's is the
//!   first save of the process, after [`AsyncCheckpointer::prepare`] and 3 s (as
//!   `pretrain_gpt --async-save` prepares the buffers when it starts);
//! - `load`: [`Checkpoint::open_latest`] and [`Checkpoint::load_model`] into a built model
//!   (reads, checksums, host-to-device copies), then a device sync; every loaded parameter
//!   is then checked, untimed, to hold the bytes of the one saved (the vocabulary's padding
//!   rows, which checkpoints do not store, zero).
//!
//! The files were just written, so loads read from the page cache, as the PyTorch peer's do.
//! Model initialisation is not timed.
//!
//! Where the time goes, timed apart after each repetition: `to host` (every parameter's
//! `into_data`, the device-to-host copies a save starts with), `read files` (every tensor's
//! `Checkpoint::read_full`: reads and checksums) and `to device` (the upload a load makes of
//! those, from its host buffers, then a device sync).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::ModelBackend;
use burn_megatron::checkpointing::{
    AsyncCheckpointer, Checkpoint, CheckpointMetadata, Checkpointer, TrainingState,
};
use burn_megatron::models::GptModel;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};
use clap::{Parser, ValueEnum};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Model shapes; the PyTorch peer has the same presets.
#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum Preset {
    /// Megatron's GPT shape at 2048 wide, 16 heads, 18 layers: 1.01B parameters.
    #[value(name = "gpt-1b")]
    Gpt1b,
    /// Megatron's 1.3B GPT: 24 layers, 2048 wide, 16 heads.
    #[value(name = "gpt-1.3b")]
    Gpt1_3b,
    /// 4 layers, 256 wide: a smoke test on CPU.
    Tiny,
}

impl Preset {
    fn config(self) -> TransformerConfig {
        let mut config = TransformerConfig::gpt_1_3b();
        match self {
            Preset::Gpt1b => config.num_layers = 18,
            Preset::Gpt1_3b => {}
            Preset::Tiny => {
                config.num_layers = 4;
                config.hidden_size = 256;
                config.ffn_hidden_size = 1024;
                config.num_attention_heads = 4;
            }
        }
        config
    }
}

#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum DeviceArg {
    /// Burn's NdArray backend: the state in host memory.
    Cpu,
    /// Our CUDA backend on GPU 0 (build with `--features cuda`).
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum Precision {
    F32,
    /// bf16 parameters (CUDA only).
    Bf16,
}

/// Times our checkpoint save and load of a GPT's parameters.
#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "gpt-1b")]
    preset: Preset,
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Precision,
    /// Where to write (removed at the end unless `--keep`).
    #[arg(long, default_value = "/tmp/bm_checkpoint_bench")]
    dir: PathBuf,
    /// Timed repetitions of each operation.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Keep the checkpoints written.
    #[arg(long)]
    keep: bool,
}

/// The timings of one run.
struct Timings {
    params: usize,
    bytes: u64,
    init: Duration,
    save: Vec<Duration>,
    async_blocked: Vec<Duration>,
    async_total: Vec<Duration>,
    load: Vec<Duration>,
    to_host: Vec<Duration>,
    read_files: Vec<Duration>,
    to_device: Vec<Duration>,
}

/// Every float parameter's value on the host.
struct ToHost(Vec<TensorData>);

impl<B: Backend> ModuleVisitor<B> for ToHost {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().into_data());
    }
}

fn bench<B: ModelBackend>(
    args: &Args,
    config: &TransformerConfig,
    device: B::Device,
) -> Result<Timings, BoxError> {
    let (sync_root, async_root) = (args.dir.join("sync"), args.dir.join("async"));
    let launch_config = LaunchConfig::new(1).with_timeout(Duration::from_secs(3600));
    let mut out = launch(launch_config, |ctx| -> Result<Timings, BoxError> {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let start = Instant::now();
        let model = config.init_gpt::<B>(state.tp(), &device)?;
        B::sync(&device)?;
        let init = start.elapsed();
        let chunks = [model];
        let saver = Checkpointer::new(&sync_root).with_keep_last(1);
        let mut async_saver =
            AsyncCheckpointer::new(Checkpointer::new(&async_root).with_keep_last(1));
        // As `pretrain_gpt --async-save` does: the first save's host buffers are prepared in
        // the background (page-locked on our CUDA backend), here before anything is timed.
        // Training runs some iterations before its first save: 3 s pass here.
        async_saver.prepare(&state, &chunks);
        B::sync(&device)?;
        std::thread::sleep(Duration::from_secs(3));
        let mut t = Timings {
            params: 0,
            bytes: 0,
            init,
            save: Vec::new(),
            async_blocked: Vec::new(),
            async_total: Vec::new(),
            load: Vec::new(),
            to_host: Vec::new(),
            read_files: Vec::new(),
            to_device: Vec::new(),
        };
        for repeat in 0..args.repeats {
            let training = TrainingState {
                iteration: repeat as u64 + 1,
                ..Default::default()
            };
            // The asynchronous save first: the first repetition's then shows what the first
            // save of a run blocks for (our CUDA backend locks its host buffers then).
            let start = Instant::now();
            async_saver.save(&state, config, &chunks, None, &training)?;
            t.async_blocked.push(start.elapsed());
            async_saver.finish(&state)?;
            t.async_total.push(start.elapsed());

            let start = Instant::now();
            let dir = saver.save(&state, config, &chunks, None, &training)?;
            t.save.push(start.elapsed());

            let template = chunks[0].clone();
            let start = Instant::now();
            let checkpoint = Checkpoint::open_latest(&sync_root)?;
            let loaded = checkpoint.load_model(template)?;
            B::sync(&device)?;
            t.load.push(start.elapsed());
            check_loaded(&chunks[0], &loaded, config.vocab_size)?;
            drop(loaded);

            let start = Instant::now();
            let mut host = ToHost(Vec::new());
            chunks[0].visit(&mut host);
            t.to_host.push(start.elapsed());
            drop(host);
            let start = Instant::now();
            let tensors: Vec<TensorData> = (checkpoint.metadata().model_tensors())
                .into_iter()
                .flat_map(|m| m.keys())
                .map(|path| checkpoint.read_full("model", path))
                .collect::<Result<_, _>>()?;
            t.read_files.push(start.elapsed());
            // In the host buffers a load reads into (page-locked on our CUDA backend).
            let staged: Vec<TensorData> = tensors
                .into_iter()
                .map(|data| {
                    let mut bytes = B::host_buffer(&device, data.bytes.len());
                    bytes.copy_from_slice(&data.bytes);
                    TensorData::from_bytes(bytes, [data.num_elements()], data.dtype)
                })
                .collect();
            let start = Instant::now();
            let uploaded: Vec<Tensor<B, 1>> = staged
                .into_iter()
                .map(|data| {
                    let dtype = data.dtype;
                    B::upload(data, &device, dtype)
                })
                .collect();
            B::sync(&device)?;
            t.to_device.push(start.elapsed());
            drop(uploaded);

            let metadata = CheckpointMetadata::read(&dir)?;
            t.bytes = metadata.files.values().map(|f| f.bytes).sum();
            t.params = metadata
                .model_tensors()
                .map(|m| m.values().map(|e| e.shape.iter().product::<usize>()).sum())
                .unwrap_or(0);
        }
        Ok(t)
    })?;
    Ok(out.remove(0))
}

/// Every parameter of `loaded` holds the bytes of `saved`'s (not timed): the benchmark's
/// saves and loads are checked, page-locked buffers reused across repetitions included.
/// Checkpoints do not store the vocabulary's padding rows (the tables' rows from
/// `vocab_size` on): a load makes them zero.
fn check_loaded<B: ModelBackend>(
    saved: &GptModel<B>,
    loaded: &GptModel<B>,
    vocab_size: usize,
) -> Result<(), BoxError> {
    let (mut a, mut b) = (ToHost(Vec::new()), ToHost(Vec::new()));
    saved.visit(&mut a);
    loaded.visit(&mut b);
    if a.0.len() != b.0.len() {
        return Err(format!("{} parameters loaded, {} saved", b.0.len(), a.0.len()).into());
    }
    for (i, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
        let differs = format!("parameter {i} loaded differs from the one saved");
        if x.dtype != y.dtype || x.shape != y.shape {
            return Err(differs.into());
        }
        let padded = x.shape.len() == 2 && x.shape[0] > vocab_size;
        let real = match padded {
            true => vocab_size * x.shape[1] * x.dtype.size(),
            false => x.as_bytes().len(),
        };
        let (kept, padding) = y.as_bytes().split_at(real);
        if x.as_bytes()[..real] != *kept || padding.iter().any(|&byte| byte != 0) {
            return Err(differs.into());
        }
    }
    Ok(())
}

fn median(times: &[Duration]) -> f64 {
    let mut s: Vec<f64> = times.iter().map(Duration::as_secs_f64).collect();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn report(args: &Args, t: &Timings) {
    let gb = t.bytes as f64 / 1e9;
    println!(
        "checkpoint_bench: {:?}, {} parameters, {:?} on {:?}, {:.3} GB of files, {} repeats \
         (model init {:.1} s, not timed)",
        args.preset,
        t.params,
        args.dtype,
        args.device,
        gb,
        args.repeats,
        t.init.as_secs_f64()
    );
    let line = |what: &str, times: &[Duration]| {
        let m = median(times);
        let all: Vec<String> = times
            .iter()
            .map(|d| format!("{:.3}", d.as_secs_f64()))
            .collect();
        println!(
            "  {what:<22} {m:>8.3} s  {:>6.2} GB/s   (each: {})",
            gb / m,
            all.join(", ")
        );
    };
    line("save", &t.save);
    line("async save (blocked)", &t.async_blocked);
    line("async save (total)", &t.async_total);
    line("load", &t.load);
    println!("  where the time goes:");
    line("  to host", &t.to_host);
    line("  read files", &t.read_files);
    line("  to device", &t.to_device);
    println!(
        "RESULT ours params={} bytes={} save_s={:.4} async_blocked_s={:.4} async_total_s={:.4} \
         load_s={:.4} to_host_s={:.4} read_files_s={:.4} to_device_s={:.4}",
        t.params,
        t.bytes,
        median(&t.save),
        median(&t.async_blocked),
        median(&t.async_total),
        median(&t.load),
        median(&t.to_host),
        median(&t.read_files),
        median(&t.to_device)
    );
}

fn run(args: &Args) -> Result<(), BoxError> {
    if args.repeats == 0 {
        return Err("--repeats must be at least 1".into());
    }
    let config = args.preset.config();
    let timings = match (args.device, args.dtype) {
        (DeviceArg::Cpu, Precision::F32) => {
            bench::<burn::backend::NdArray<f32>>(args, &config, Default::default())?
        }
        (DeviceArg::Cpu, Precision::Bf16) => {
            return Err("bf16 parameters need --device cuda (NdArray holds f32)".into());
        }
        #[cfg(feature = "cuda")]
        (DeviceArg::Cuda, dtype) => {
            use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};
            let device = CudaGpu::new(0);
            if dtype == Precision::Bf16 {
                burn::tensor::set_default_dtypes::<MegatronCuda>(
                    &device,
                    burn::tensor::FloatDType::BF16,
                    burn::tensor::IntDType::I32,
                )?;
            }
            bench::<MegatronCuda>(args, &config, device)?
        }
        #[cfg(not(feature = "cuda"))]
        (DeviceArg::Cuda, _) => {
            return Err("this build has no CUDA: build with --features cuda".into());
        }
    };
    report(args, &timings);
    Ok(())
}

fn remove(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        eprintln!("could not remove {}: {e}", dir.display());
    }
}

fn main() {
    let args = Args::parse();
    let result = run(&args);
    if !args.keep && args.dir.exists() {
        remove(&args.dir);
    }
    if let Err(error) = result {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}
