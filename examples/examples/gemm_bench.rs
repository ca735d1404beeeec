//! cuBLASLt GEMMs inside Burn against Burn's own matmul, on the shapes of a transformer's linear
//! layers (forward, input gradient and weight gradient). Run next to
//! `bench/torch_gemm.py` in the same device call:
//!
//!     ../shared/gpu/pack build --release --features cuda --example gemm_bench
//!     source .gpu/env.sh && .gpu/bin/gemm_bench; python3 bench/torch_gemm.py

use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};
use burn_megatron_kernels::cuda::gemm::matmul;
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};

/// `(label, m, n, k, transpose_a, transpose_b)`: `op(a) [m, k] · op(b) [k, n]`, bf16.
fn shapes() -> Vec<(String, usize, usize, usize, bool, bool)> {
    let mut list = vec![
        ("square 4096".to_string(), 4096, 4096, 4096, false, false),
        ("square 8192".to_string(), 8192, 8192, 8192, false, false),
    ];
    // (model, layer, d_in, d_out) for GPT-2 1.5B and Llama 3 8B.
    let layers = [
        ("gpt2-1.5b", "qkv", 1600, 4800),
        ("gpt2-1.5b", "fc1", 1600, 6400),
        ("gpt2-1.5b", "fc2", 6400, 1600),
        ("llama-8b", "qkv", 4096, 6144),
        ("llama-8b", "out", 4096, 4096),
        ("llama-8b", "up", 4096, 14336),
        ("llama-8b", "down", 14336, 4096),
    ];
    for tokens in [4096, 16384] {
        for (model, layer, d_in, d_out) in layers {
            let name = |pass: &str| format!("{model} {layer} {pass} T={tokens}");
            // forward: X [T, in] · W [in, out]
            list.push((name("fwd"), tokens, d_out, d_in, false, false));
            // input gradient: dY [T, out] · Wᵀ
            list.push((name("dX"), tokens, d_in, d_out, false, true));
            // weight gradient: Xᵀ · dY [T, out]
            list.push((name("dW"), d_in, d_out, tokens, true, false));
        }
    }
    list
}

fn time(device: &CudaGpu, mut op: impl FnMut() -> Tensor<MegatronCuda, 2>) -> Duration {
    let warm: Vec<_> = (0..3).map(|_| op()).collect();
    <MegatronCuda as Backend>::sync(device).unwrap();
    drop(warm);
    let mut samples: Vec<Duration> = (0..7)
        .map(|_| {
            <MegatronCuda as Backend>::sync(device).unwrap();
            let start = Instant::now();
            let out: Vec<_> = (0..5).map(|_| op()).collect();
            <MegatronCuda as Backend>::sync(device).unwrap();
            drop(out);
            start.elapsed() / 5
        })
        .collect();
    samples.sort();
    samples[3]
}

fn main() {
    let device = CudaGpu::new(0);
    println!(
        "{:<36} {:>10} {:>10} {:>7}",
        "GEMM (bf16, f32 accumulation)", "cuBLASLt", "Burn", "ratio"
    );
    for (label, m, n, k, ta, tb) in shapes() {
        let a_shape = if ta { [k, m] } else { [m, k] };
        let b_shape = if tb { [n, k] } else { [k, n] };
        let a = Tensor::<MegatronCuda, 2>::random(a_shape, Distribution::Default, &device)
            .cast(DType::BF16);
        let b = Tensor::<MegatronCuda, 2>::random(b_shape, Distribution::Default, &device)
            .cast(DType::BF16);
        let flops = 2.0 * (m * n * k) as f64;
        let lt = time(&device, || matmul(a.clone(), b.clone(), ta, tb));
        let burn = time(&device, || {
            let a = if ta { a.clone().transpose() } else { a.clone() };
            let b = if tb { b.clone().transpose() } else { b.clone() };
            a.matmul(b)
        });
        let (lt, burn) = (
            flops / lt.as_secs_f64() / 1e12,
            flops / burn.as_secs_f64() / 1e12,
        );
        println!("{label:<36} {lt:10.1} {burn:10.1} {:7.2}", lt / burn);
    }
}
