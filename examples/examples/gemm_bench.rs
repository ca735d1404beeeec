//! cuBLASLt GEMMs inside Burn against Burn's own matmul, on the shapes of a transformer's linear
//! layers (forward, input gradient and weight gradient). Run next to
//! `bench/torch_gemm.py` in the same device call:
//!
//!     ../shared/gpu/pack build --release --features cuda --example gemm_bench
//!     source .gpu/env.sh && .gpu/bin/gemm_bench; python3 bench/torch_gemm.py
//!
//! `gemm_bench fp8` times the FP8 GEMM (E4M3 operands, per-tensor scales, f32 accumulation)
//! against the bf16 GEMM on the same shapes, checks each against an f64 product of the same
//! quantised operands, and checks the FP8 casts bit for bit against a host reference (the fused
//! cast of both layouts and its amax against the separate kernels too) and times them; its peer
//! is `python3 bench/torch_gemm.py --fp8` (`torch._scaled_mm`).

use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_megatron_kernels::cuda::gemm::{gemm_fp8, matmul};
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda, MegatronCudaRuntime};
use burn_megatron_kernels::fused::fp8::{Fp8Kind, amax, quantize, quantize_both};

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
    if std::env::args().nth(1).as_deref() == Some("fp8") {
        fp8_casts(&device);
        fp8_gemms(&device);
        return;
    }
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

type Raw = CubeTensor<MegatronCudaRuntime>;

fn raw<const D: usize>(t: &Tensor<MegatronCuda, D>) -> Raw {
    t.clone().into_primitive().tensor()
}

fn wrap<const D: usize>(t: Raw) -> Tensor<MegatronCuda, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `(scale, scale_inv)` of per-tensor current scaling: `max / amax` and its inverse, on the device.
fn scales(x: &Tensor<MegatronCuda, 2>, kind: Fp8Kind) -> (Raw, Raw) {
    let amax: Tensor<MegatronCuda, 1> = wrap(amax(raw(x)));
    let scale = amax.clone().recip() * kind.max();
    (raw(&scale), raw(&(amax / kind.max())))
}

fn bytes(t: Raw) -> Vec<u8> {
    wrap::<2>(t).into_data().to_vec::<u8>().unwrap()
}

fn floats<const D: usize>(t: Tensor<MegatronCuda, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().to_vec::<f32>().unwrap()
}

/// The casts against the host reference ([`Fp8Kind::encode`]), every element, both formats,
/// both layouts, bf16 and f32 inputs spanning the formats' ranges (saturation, subnormals); then
/// their speed on a Llama-8B activation.
fn fp8_casts(device: &CudaGpu) {
    println!("== FP8 casts against the host reference ==");
    let (rows, cols) = (1000, 1040);
    for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
        for dtype in [DType::BF16, DType::F32] {
            // Normal values times 2^(-12..12): every binade of both formats, and beyond.
            let x = Tensor::<MegatronCuda, 2>::random(
                [rows, cols],
                Distribution::Normal(0.0, 1.0),
                device,
            );
            let e = Tensor::<MegatronCuda, 2>::random(
                [rows, cols],
                Distribution::Uniform(-12.0, 12.0),
                device,
            );
            let x = (x * e_scale(&e)).cast(dtype);
            let host = floats(x.clone());
            let scale_value = 1.75f32;
            let scale = raw(&Tensor::<MegatronCuda, 1>::from_floats(
                [scale_value],
                device,
            ));
            let both = quantize_both(raw(&x), &scale, kind, true);
            let both_amax = floats(wrap::<1>(both.amax.expect("asked for")))[0];
            let both = [bytes(both.row), bytes(both.transposed)];
            for transpose in [false, true] {
                let q = bytes(quantize(raw(&x), &scale, kind, transpose));
                let fused = &both[transpose as usize];
                println!(
                    "fused cast {kind:?} from {dtype:?} transpose={transpose}: {} of {} differ from quantize",
                    q.iter().zip(fused).filter(|(a, b)| a != b).count(),
                    q.len()
                );
                let q = fused.clone();
                let mut wrong = 0usize;
                let mut first = None;
                for r in 0..rows {
                    for c in 0..cols {
                        let want = kind.encode((host[r * cols + c] * scale_value) as f64);
                        let got = if transpose {
                            q[c * rows + r]
                        } else {
                            q[r * cols + c]
                        };
                        if got != want {
                            wrong += 1;
                            first.get_or_insert((r, c, host[r * cols + c], got, want));
                        }
                    }
                }
                println!(
                    "cast {kind:?} from {dtype:?} transpose={transpose}: {wrong} of {} differ{}",
                    rows * cols,
                    first
                        .map(|f| format!(" (first: {f:?})"))
                        .unwrap_or_default()
                );
            }
            let amax_gpu = floats(wrap::<1>(amax(raw(&x))))[0];
            let amax_host = host.iter().fold(0f32, |m, v| m.max(v.abs()));
            println!(
                "amax {dtype:?}: device {amax_gpu} fused {both_amax} host {amax_host}{}",
                if both_amax.to_bits() == amax_gpu.to_bits() {
                    ""
                } else {
                    " MISMATCH"
                }
            );
        }
    }
    let mut nan = vec![1.0f32; 4096];
    nan[777] = f32::NAN;
    let nan = Tensor::<MegatronCuda, 1>::from_floats(nan.as_slice(), device).reshape([64, 64]);
    let scale = raw(&Tensor::<MegatronCuda, 1>::from_floats([1.0], device));
    let both = quantize_both(raw(&nan), &scale, Fp8Kind::E4M3, true);
    println!(
        "amax of a tensor with a NaN: {}, fused {}; fused casts equal quantize's: {}",
        floats(wrap::<1>(amax(raw(&nan))))[0],
        floats(wrap::<1>(both.amax.expect("asked for")))[0],
        bytes(both.row) == bytes(quantize(raw(&nan), &scale, Fp8Kind::E4M3, false))
            && bytes(both.transposed) == bytes(quantize(raw(&nan), &scale, Fp8Kind::E4M3, true))
    );

    let x = Tensor::<MegatronCuda, 2>::random([16384, 4096], Distribution::Default, device)
        .cast(DType::BF16);
    let bytes_moved = (16384 * 4096 * 3) as f64;
    for transpose in [false, true] {
        let t = time(device, || {
            let (scale, _) = scales(&x, Fp8Kind::E4M3);
            wrap(quantize(raw(&x), &scale, Fp8Kind::E4M3, transpose))
        });
        println!(
            "amax + cast bf16 [16384, 4096] transpose={transpose}: {:.1} us, {:.0} GB/s (cast's bytes only)",
            t.as_secs_f64() * 1e6,
            bytes_moved / t.as_secs_f64() / 1e9
        );
    }
    // Both layouts: one read, two writes. Tensorwise scaling's amax pass then the fused cast,
    // against the two casts it replaces; and delayed scaling's fused cast with its amax.
    let bytes_both = (16384 * 4096 * 4) as f64;
    let (scale, _) = scales(&x, Fp8Kind::E4M3);
    let report = |what: &str, t: Duration| {
        println!(
            "{what} bf16 [16384, 4096]: {:.1} us, {:.0} GB/s (both casts' bytes only)",
            t.as_secs_f64() * 1e6,
            bytes_both / t.as_secs_f64() / 1e9
        )
    };
    let t = time(device, || {
        let (scale, _) = scales(&x, Fp8Kind::E4M3);
        let row = quantize(raw(&x), &scale, Fp8Kind::E4M3, false);
        let transposed = quantize(raw(&x), &scale, Fp8Kind::E4M3, true);
        drop(row);
        wrap(transposed)
    });
    report("amax + two casts (unfused)", t);
    let t = time(device, || {
        let (scale, _) = scales(&x, Fp8Kind::E4M3);
        wrap(quantize_both(raw(&x), &scale, Fp8Kind::E4M3, false).transposed)
    });
    report("amax + fused cast of both layouts (tensorwise)", t);
    let t = time(device, || {
        wrap(quantize_both(raw(&x), &scale, Fp8Kind::E4M3, false).transposed)
    });
    report("fused cast of both layouts", t);
    let t = time(device, || {
        wrap(quantize_both(raw(&x), &scale, Fp8Kind::E4M3, true).transposed)
    });
    report("fused cast of both layouts + amax (delayed)", t);
}

/// `2^e` for each element of `e` (floored), as a tensor.
fn e_scale(e: &Tensor<MegatronCuda, 2>) -> Tensor<MegatronCuda, 2> {
    (e.clone().floor() * 2f32.ln()).exp()
}

/// FP8 GEMMs against bf16 ones on [`shapes`], and against an f64 product of the quantised
/// operands at sampled outputs.
fn fp8_gemms(device: &CudaGpu) {
    println!(
        "{:<36} {:>9} {:>9} {:>9} {:>7} {:>10}",
        "GEMM a[m,k] . b[n,k]^T", "bf16", "fp8", "fp8 fast", "ratio", "rel. err"
    );
    for (label, m, n, k, _, _) in shapes() {
        let a = Tensor::<MegatronCuda, 2>::random([m, k], Distribution::Normal(0.0, 1.0), device)
            .cast(DType::BF16);
        let b = Tensor::<MegatronCuda, 2>::random([n, k], Distribution::Normal(0.0, 0.02), device)
            .cast(DType::BF16);
        let (sa, sa_inv) = scales(&a, Fp8Kind::E4M3);
        let (sb, sb_inv) = scales(&b, Fp8Kind::E4M3);
        let qa = quantize(raw(&a), &sa, Fp8Kind::E4M3, false);
        let qb = quantize(raw(&b), &sb, Fp8Kind::E4M3, false);
        let run = |out: DType, fast: bool| -> Tensor<MegatronCuda, 2> {
            wrap(
                gemm_fp8(
                    &qa,
                    Fp8Kind::E4M3,
                    &sa_inv,
                    &qb,
                    Fp8Kind::E4M3,
                    &sb_inv,
                    out,
                    fast,
                )
                .expect("FP8 GEMM"),
            )
        };
        let flops = 2.0 * (m * n * k) as f64;
        let tflops = |t: Duration| flops / t.as_secs_f64() / 1e12;
        let bf16 = tflops(time(device, || matmul(a.clone(), b.clone(), false, true)));
        let fp8 = tflops(time(device, || run(DType::BF16, false)));
        let fast = tflops(time(device, || run(DType::BF16, true)));
        // Sampled outputs against f64 sums of the decoded operands: the error relative to
        // Σ|a·b| (f32 accumulation of k terms).
        let out = floats(run(DType::F32, false));
        let (ha, hb) = (bytes(qa.clone()), bytes(qb.clone()));
        let (sa_inv, sb_inv) = (
            floats(wrap::<1>(sa_inv.clone()))[0] as f64,
            floats(wrap::<1>(sb_inv.clone()))[0] as f64,
        );
        let mut worst = 0f64;
        for s in 0..64usize {
            let (i, j) = ((s * 7919) % m, (s * 104_729) % n);
            let (mut sum, mut magnitude) = (0f64, 0f64);
            for l in 0..k {
                let term =
                    Fp8Kind::E4M3.decode(ha[i * k + l]) * Fp8Kind::E4M3.decode(hb[j * k + l]);
                sum += term;
                magnitude += term.abs();
            }
            let want = sum * sa_inv * sb_inv;
            let err =
                (out[i * n + j] as f64 - want).abs() / (magnitude * sa_inv * sb_inv).max(1e-30);
            worst = worst.max(if err.is_nan() { f64::INFINITY } else { err });
        }
        println!(
            "{label:<36} {bf16:9.1} {fp8:9.1} {fast:9.1} {:7.2} {worst:10.2e}",
            fast / bf16
        );
    }
}
