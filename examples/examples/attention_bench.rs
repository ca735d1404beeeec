//! Flash attention, through cuDNN's fused engines (what the model runs on our CUDA backend)
//! and through our CubeCL tensor-core kernels (the fallback), against PyTorch's
//! `scaled_dot_product_attention`: forward,
//! and forward + backward, bf16, causal, head dims 64 and 128, S from 1k to 8k with
//! `batch · S = 16k` tokens and `heads · head_dim = 2048` (FlashAttention's benchmark shapes),
//! plus GPT-2 124M's attention (16 × 12 heads × 1024 × 64). Run next to
//! `bench/torch_attention.py` in the same device call:
//!
//!     ../shared/gpu/pack build --release --features cuda -p burn-megatron-examples --example attention_bench
//!     source .gpu/env.sh && .gpu/bin/attention_bench; python3 bench/torch_attention.py
//!
//! `attention_bench --memory SEQ` instead runs one forward and backward of the model's
//! attention (`burn_megatron::ops::flash_attention::attention` under `Autodiff`, bf16, causal,
//! 1 × 16 heads × SEQ × 128) and prints the device memory it took, for the linear-memory
//! check (run it once per SEQ: each process starts from an empty pool).
//!
//! FLOPs as FlashAttention counts them: `4 · batch · heads · S² · head_dim` for the forward,
//! halved when causal; the backward is 2.5 times the forward.

use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};
use burn_cubecl::tensor::CubeTensor;
use burn_megatron_kernels::cuda::cudnn::attention as cudnn;
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda, MegatronCudaRuntime};
use burn_megatron_kernels::fused::flash_attention::tensor_core;

type B = MegatronCuda;
type Raw = CubeTensor<MegatronCudaRuntime>;

/// One implementation: forward `(q, k, v) -> (out, lse)` and backward.
struct Implementation {
    name: &'static str,
    forward: fn(&Raw, &Raw, &Raw, f32) -> (Raw, Raw),
    backward: fn(&Raw, &Raw, &Raw, Raw, Raw, &Raw, f32) -> [Raw; 3],
}

const IMPLEMENTATIONS: [Implementation; 2] = [
    Implementation {
        name: "cudnn",
        forward: |q, k, v, scale| {
            cudnn::forward(q, k, v, scale, true).expect("cuDNN takes the benchmark's shapes")
        },
        backward: |q, k, v, out, lse, grad, scale| {
            cudnn::backward(q, k, v, &out, &lse, grad, scale, true)
                .expect("cuDNN takes the benchmark's shapes")
        },
    },
    Implementation {
        name: "cubecl",
        forward: |q, k, v, scale| {
            tensor_core::forward(q.clone(), k.clone(), v.clone(), scale, true)
        },
        backward: |q, k, v, out, lse, grad, scale| {
            tensor_core::backward(
                q.clone(),
                k.clone(),
                v.clone(),
                out,
                lse,
                grad.clone(),
                scale,
                true,
            )
        },
    },
];

/// Median time of one call of `op`: 7 samples of 5 calls after 3 warm-up calls, with a device
/// sync around each sample.
fn time<T>(device: &CudaGpu, mut op: impl FnMut() -> T) -> Duration {
    let warm: Vec<T> = (0..3).map(|_| op()).collect();
    B::sync(device).unwrap();
    drop(warm);
    let mut samples: Vec<Duration> = (0..7)
        .map(|_| {
            B::sync(device).unwrap();
            let start = Instant::now();
            let out: Vec<T> = (0..5).map(|_| op()).collect();
            B::sync(device).unwrap();
            drop(out);
            start.elapsed() / 5
        })
        .collect();
    samples.sort();
    samples[3]
}

/// Device memory in use (the driver's view: our pool's reservations and cuDNN's scratch).
fn device_bytes_in_use() -> u64 {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: the driver writes two sizes; the context is current on this thread after a sync.
    unsafe { cudarc::driver::sys::cuMemGetInfo_v2(&mut free, &mut total) };
    (total - free) as u64
}

/// One forward and backward of the model's attention at `seq`; prints the memory it took.
fn memory(device: &CudaGpu, seq: usize) {
    type A = burn::backend::Autodiff<B>;
    let [batch, heads, head_dim] = [1, 16, 128];
    B::sync(device).unwrap();
    let before = device_bytes_in_use();
    let make = || {
        Tensor::<A, 4>::random(
            [batch, heads, seq, head_dim],
            Distribution::Normal(0.0, 1.0),
            device,
        )
        .cast(DType::BF16)
        .detach()
        .require_grad()
    };
    let (q, k, v) = (make(), make(), make());
    let scale = 1.0 / (head_dim as f64).sqrt();
    let out = burn_megatron::ops::flash_attention::attention(
        q.clone(),
        k.clone(),
        v.clone(),
        scale,
        true,
    );
    B::sync(device).unwrap();
    let after_forward = device_bytes_in_use() - before;
    let grads = out.sum().backward();
    let dq = q.grad(&grads).unwrap();
    B::sync(device).unwrap();
    let after_backward = device_bytes_in_use() - before;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "memory b{batch} h{heads} s{seq} d{head_dim} bf16 causal: {:.1} MiB after forward, {:.1} MiB after backward (device, driver's count; dq {:?})",
        mib(after_forward),
        mib(after_backward),
        dq.dims()
    );
    println!(
        "RESULT memory seq={seq} forward_mib={:.1} backward_mib={:.1}",
        mib(after_forward),
        mib(after_backward)
    );
}

fn main() {
    let device = CudaGpu::new(0);
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, seq] = &args[..]
        && flag == "--memory"
    {
        return memory(
            &device,
            seq.parse().expect("--memory takes a sequence length"),
        );
    }
    let causal = true;
    let mut shapes: Vec<[usize; 4]> = vec![[16, 12, 1024, 64]];
    for head_dim in [64, 128] {
        for seq in [1024, 2048, 4096, 8192] {
            shapes.push([16_384 / seq, 2048 / head_dim, seq, head_dim]);
        }
    }
    println!("burn-megatron flash attention, bf16, causal");
    for [batch, heads, seq, head_dim] in shapes {
        let make = || {
            Tensor::<B, 4>::random(
                [batch, heads, seq, head_dim],
                Distribution::Normal(0.0, 1.0),
                &device,
            )
            .cast(DType::BF16)
            .into_primitive()
            .tensor()
        };
        let (q, k, v, grad) = (make(), make(), make(), make());
        let scale = 1.0 / (head_dim as f32).sqrt();
        for imp in &IMPLEMENTATIONS {
            let forward = time(&device, || (imp.forward)(&q, &k, &v, scale));
            let both = time(&device, || {
                let (out, lse) = (imp.forward)(&q, &k, &v, scale);
                (imp.backward)(&q, &k, &v, out, lse, &grad, scale)
            });
            let flops = 4.0 * (batch * heads * seq * seq * head_dim) as f64
                / if causal { 2.0 } else { 1.0 };
            let tflops = |f: f64, t: Duration| f / t.as_secs_f64() / 1e12;
            let name = imp.name;
            println!(
                "{name:>6} b{batch:>2} h{heads:>2} s{seq:>5} d{head_dim:>3}: forward {:>8.3} ms {:>6.1} TFLOP/s, forward+backward {:>8.3} ms {:>6.1} TFLOP/s",
                forward.as_secs_f64() * 1e3,
                tflops(flops, forward),
                both.as_secs_f64() * 1e3,
                tflops(3.5 * flops, both)
            );
            println!(
                "RESULT impl={name} batch={batch} heads={heads} seq={seq} head_dim={head_dim} fwd_ms={:.4} fwd_tflops={:.1} fwdbwd_ms={:.4} fwdbwd_tflops={:.1}",
                forward.as_secs_f64() * 1e3,
                tflops(flops, forward),
                both.as_secs_f64() * 1e3,
                tflops(3.5 * flops, both)
            );
        }
    }
}
