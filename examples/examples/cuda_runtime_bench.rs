//! Our CUDA backend against burn-cuda, op by op, in one process (run on the device machine,
//! next to `bench/torch_reference.py` in the same call):
//!
//!     ../shared/gpu/pack build --release --features cuda --example cuda_runtime_bench
//!     source .gpu/env.sh && .gpu/bin/cuda_runtime_bench
//!
//! Each figure is the median of 7 timed runs, after warm-up (autotune runs on first use),
//! with a device sync around each run.

use std::time::{Duration, Instant};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};
use burn_megatron_kernels::cuda::{CudaGpu, ForeignQueue, Lane, MegatronCuda, MegatronCudaFusion};

type CudaUnfused = burn_cubecl::CubeBackend<burn_cubecl::cubecl::cuda::CudaRuntime, f32, i32, u8>;

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Median time of `op` (which runs `reps` times per sample), per repetition. Outputs are kept
/// until after the sync: with fusion, work whose output is dropped unread may never run.
fn time<B: Backend, T>(device: &B::Device, reps: usize, mut op: impl FnMut() -> T) -> Duration {
    let warm: Vec<T> = (0..3).map(|_| op()).collect();
    B::sync(device).unwrap();
    drop(warm);
    let samples = (0..7)
        .map(|_| {
            B::sync(device).unwrap();
            let start = Instant::now();
            let outputs: Vec<T> = (0..reps).map(|_| op()).collect();
            B::sync(device).unwrap();
            let elapsed = start.elapsed() / reps as u32;
            drop(outputs);
            elapsed
        })
        .collect();
    median(samples)
}

struct Figures {
    matmul: Vec<(String, f64)>,
    reduce_gbs: f64,
    elementwise_gbs: f64,
}

fn measure<B: Backend>(device: &B::Device) -> Figures {
    let mut matmul = Vec::new();
    for (n, dtype) in [(4096, DType::F32), (4096, DType::BF16), (8192, DType::BF16)] {
        let a = Tensor::<B, 2>::random([n, n], Distribution::Default, device).cast(dtype);
        let b = Tensor::<B, 2>::random([n, n], Distribution::Default, device).cast(dtype);
        let t = time::<B, _>(device, 5, || a.clone().matmul(b.clone()));
        let tflops = 2.0 * (n as f64).powi(3) / t.as_secs_f64() / 1e12;
        matmul.push((format!("matmul {dtype:?} {n}^3"), tflops));
    }
    let x = Tensor::<B, 2>::random([8192, 8192], Distribution::Default, device);
    let bytes = (8192 * 8192 * 4) as f64;
    let t = time::<B, _>(device, 10, || x.clone().sum_dim(1));
    let reduce_gbs = bytes / t.as_secs_f64() / 1e9;
    let t = time::<B, _>(device, 10, || (x.clone() * 2.0 + 1.0).exp().tanh());
    // One read and one write of the tensor when fused; more when not.
    let elementwise_gbs = 2.0 * bytes / t.as_secs_f64() / 1e9;
    Figures {
        matmul,
        reduce_gbs,
        elementwise_gbs,
    }
}

fn report(name: &str, ours: &Figures, reference: &Figures) {
    println!("\n== {name}: ours vs burn-cuda (ratio = ours / burn-cuda) ==");
    for ((label, a), (_, b)) in ours.matmul.iter().zip(&reference.matmul) {
        println!(
            "{label:<24} {a:8.1} vs {b:8.1} TFLOP/s   ratio {:.3}",
            a / b
        );
    }
    let (a, b) = (ours.reduce_gbs, reference.reduce_gbs);
    println!(
        "{:<24} {a:8.1} vs {b:8.1} GB/s      ratio {:.3}",
        "sum_dim 8192x8192 f32",
        a / b
    );
    let (a, b) = (ours.elementwise_gbs, reference.elementwise_gbs);
    println!(
        "{:<24} {a:8.1} vs {b:8.1} GB/s      ratio {:.3}",
        "exp(tanh(2x+1)) f32",
        a / b
    );
}

/// The host-side cost of a foreign operation against a kernel launch: each submitted
/// 10 000 times, then one sync.
fn foreign_cost() {
    let device = CudaGpu::new(0);
    let queue = ForeignQueue::new(&device);
    let x = Tensor::<MegatronCuda, 1>::zeros([1], &device);
    let per_op = |f: &mut dyn FnMut()| {
        let runs = 10_000;
        for _ in 0..100 {
            f();
        }
        <MegatronCuda as Backend>::sync(&device).unwrap();
        let start = Instant::now();
        for _ in 0..runs {
            f();
        }
        <MegatronCuda as Backend>::sync(&device).unwrap();
        start.elapsed().as_secs_f64() * 1e6 / runs as f64
    };
    let kernel = per_op(&mut || {
        let _ = x.clone() + 1.0;
    });
    let compute = per_op(&mut || {
        queue.submit("no-op", vec![], Lane::Compute, |_| Ok(()));
    });
    let side = per_op(&mut || {
        queue.submit("no-op", vec![], Lane::Side(0), |_| Ok(()));
    });
    println!("\n== foreign operation cost (µs per operation, host side, 10 000 in a row) ==");
    println!("kernel launch (x + 1, 1 element)  {kernel:6.2} µs");
    println!("foreign op, compute lane (no-op)  {compute:6.2} µs");
    println!("foreign op, side lane (no-op)     {side:6.2} µs   (two events and a wait)");
}

fn main() {
    let reference = measure::<Cuda>(&CudaDevice::default());
    let ours = measure::<MegatronCudaFusion>(&CudaGpu::new(0));
    report("with fusion", &ours, &reference);
    let reference = measure::<CudaUnfused>(&CudaDevice::default());
    let ours = measure::<MegatronCuda>(&CudaGpu::new(0));
    report("without fusion", &ours, &reference);
    foreign_cost();
}
