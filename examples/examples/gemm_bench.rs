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
//! is `python3 bench/torch_gemm.py --fp8` (`torch._scaled_mm`). `gemm_bench fp8-casts` runs
//! the casts' part alone.
//!
//! `gemm_bench grouped` checks the experts' grouped GEMM by each engine of
//! `burn_megatron_kernels::cuda::grouped_gemm` (cuBLAS `cublasGemmGroupedBatchedEx`, cuBLASLt
//! GEMMs on 1-8 streams) against one cuBLASLt GEMM per expert, forward and both backward
//! products, with experts of zero rows, and through `grouped_linear`'s autodiff node; then
//! times them on Mixtral-like shapes (8 experts, 16k tokens split unevenly) and DeepSeek-like
//! ones (32 and 64 experts of about 200-400 rows) next to the padded blocks (each expert's
//! block at the largest count, one strided-batched GEMM: the MoE layer's layout for many
//! experts), the per-expert GEMMs and a dense GEMM of the same FLOPs. It exits with 1 on a mismatch. Its peer is `python3 bench/torch_gemm.py --grouped` (`torch._grouped_mm`).

use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_megatron::ops::grouped_linear::padded_block_rows;
use burn_megatron_kernels::cuda::gemm::{gemm_fp8, gemm_fp8_accumulate_at, matmul};
use burn_megatron_kernels::cuda::grouped_gemm::Engine;
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

fn time(device: &CudaGpu, op: impl FnMut() -> Tensor<MegatronCuda, 2>) -> Duration {
    time_of(device, op)
}

/// The median time of `op` (whatever it returns: the outputs are kept until the device syncs).
fn time_of<T>(device: &CudaGpu, mut op: impl FnMut() -> T) -> Duration {
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
    if std::env::args().nth(1).as_deref() == Some("grouped") {
        let ok = grouped_check(&device);
        grouped_times(&device);
        if !ok {
            eprintln!("gemm_bench grouped: MISMATCH (see the check above)");
            std::process::exit(1);
        }
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("fp8") {
        fp8_casts(&device);
        fp8_gemms(&device);
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("fp8-casts") {
        fp8_casts(&device);
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
/// both layouts, bf16 and f32 inputs spanning the formats' ranges (saturation, subnormals), on
/// shapes the vectorised kernels take (sides multiples of 8: 8 elements a thread from bf16, 4
/// from f32; multiples of 4: 4) and one the scalar kernels take; then their speed on a
/// Llama-8B activation.
fn fp8_casts(device: &CudaGpu) {
    println!("== FP8 casts against the host reference ==");
    for (rows, cols) in [(1000, 1040), (1000, 1044), (998, 1042)] {
        println!("-- [{rows}, {cols}] --");
        fp8_casts_on(device, rows, cols);
    }
    fp8_cast_speeds(device);
}

fn fp8_casts_on(device: &CudaGpu, rows: usize, cols: usize) {
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
    // A NaN in a tile of the kernel this shape takes.
    let (nan_rows, nan_cols) = (64, 64 + cols % 4);
    let mut nan = vec![1.0f32; nan_rows * nan_cols];
    nan[777] = f32::NAN;
    let nan = Tensor::<MegatronCuda, 1>::from_floats(nan.as_slice(), device)
        .reshape([nan_rows, nan_cols]);
    let scale = raw(&Tensor::<MegatronCuda, 1>::from_floats([1.0], device));
    let both = quantize_both(raw(&nan), &scale, Fp8Kind::E4M3, true);
    println!(
        "amax of a tensor with a NaN: {}, fused {}; fused casts equal quantize's: {}",
        floats(wrap::<1>(amax(raw(&nan))))[0],
        floats(wrap::<1>(both.amax.expect("asked for")))[0],
        bytes(both.row) == bytes(quantize(raw(&nan), &scale, Fp8Kind::E4M3, false))
            && bytes(both.transposed) == bytes(quantize(raw(&nan), &scale, Fp8Kind::E4M3, true))
    );
}

/// The casts' times and bandwidths on a bf16 [16384, 4096] activation (the vectorised
/// kernels, 8 elements a thread), and on [16384, 4092] (4 a thread) and [16384, 4094] (a side
/// not a multiple of 4: the scalar kernels, a byte a thread) for comparison.
fn fp8_cast_speeds(device: &CudaGpu) {
    let x = Tensor::<MegatronCuda, 2>::random([16384, 4096], Distribution::Default, device)
        .cast(DType::BF16);
    let bytes_moved = (16384 * 4096 * 3) as f64;
    // What the memory moves for a bf16 element read and written (4 bytes, as the fused cast
    // of both layouts): Burn's element-wise product, and its copy of a transposed view.
    let t = time(device, || x.clone() * 2.0);
    let bytes_copy = (16384 * 4096 * 4) as f64;
    println!(
        "reference: bf16 [16384, 4096] times 2 (Burn): {:.1} us, {:.0} GB/s",
        t.as_secs_f64() * 1e6,
        bytes_copy / t.as_secs_f64() / 1e9
    );
    let t = time(device, || {
        wrap(burn_cubecl::kernel::into_contiguous(raw(&x
            .clone()
            .transpose())))
    });
    println!(
        "reference: bf16 [16384, 4096] transposed copy (Burn): {:.1} us, {:.0} GB/s",
        t.as_secs_f64() * 1e6,
        bytes_copy / t.as_secs_f64() / 1e9
    );
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
    for (cols, kernel) in [(4092, "vectorised by 4"), (4094, "scalar kernel")] {
        let x = Tensor::<MegatronCuda, 2>::random([16384, cols], Distribution::Default, device)
            .cast(DType::BF16);
        let t = time(device, || {
            wrap(quantize_both(raw(&x), &scale, Fp8Kind::E4M3, false).transposed)
        });
        println!(
            "fused cast of both layouts, {kernel}, bf16 [16384, {cols}]: {:.1} us, {:.0} GB/s (both casts' bytes only)",
            t.as_secs_f64() * 1e6,
            (16384 * cols * 4) as f64 / t.as_secs_f64() / 1e9
        );
        let t = time(device, || {
            wrap(quantize(raw(&x), &scale, Fp8Kind::E4M3, true))
        });
        println!(
            "cast transposed, {kernel}, bf16 [16384, {cols}]: {:.1} us, {:.0} GB/s (cast's bytes only)",
            t.as_secs_f64() * 1e6,
            (16384 * cols * 3) as f64 / t.as_secs_f64() / 1e9
        );
    }
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
        let (a_inv, b_inv) = (sa_inv.clone(), sb_inv.clone());
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
        // The weight gradient's form: the same product added in place (beta 1) to an f32
        // buffer past a prefix (16-byte aligned), against the product added on the host.
        let prefix = 64;
        let buffer =
            Tensor::<MegatronCuda, 1>::random([prefix + m * n], Distribution::Default, device);
        let before = floats(buffer.clone());
        // The buffer's only handle: the GEMM writes it in place.
        let buffer = buffer.into_primitive().tensor();
        gemm_fp8_accumulate_at(
            &qa,
            Fp8Kind::E4M3,
            &a_inv,
            &qb,
            Fp8Kind::E4M3,
            &b_inv,
            false,
            &buffer,
            prefix,
        )
        .expect("FP8 GEMM accumulating");
        let after = floats(wrap::<1>(buffer));
        let mut accumulated = 0f64;
        for (i, (a, b)) in after.iter().zip(&before).enumerate() {
            let want = match i.checked_sub(prefix) {
                Some(j) => *b as f64 + out[j] as f64,
                None => *b as f64,
            };
            let err = (*a as f64 - want).abs() / want.abs().max(1.0);
            accumulated = accumulated.max(if err.is_nan() { f64::INFINITY } else { err });
        }
        let verdict = if accumulated <= 1e-6 { "" } else { " MISMATCH" };
        println!(
            "{label:<36} {bf16:9.1} {fp8:9.1} {fast:9.1} {:7.2} {worst:10.2e} accumulated {accumulated:.1e}{verdict}",
            fast / bf16
        );
    }
}

/// `counts` splitting `tokens` by `fractions` (the rest to the last expert).
fn split(tokens: usize, fractions: &[f64]) -> Vec<usize> {
    let mut counts: Vec<usize> = fractions
        .iter()
        .map(|f| (tokens as f64 * f) as usize)
        .collect();
    let rest = tokens - counts.iter().sum::<usize>();
    *counts.last_mut().expect("an expert") += rest;
    counts
}

/// A bf16 `N(0, 1)` tensor.
fn normal_bf16<const D: usize>(shape: [usize; D], device: &CudaGpu) -> Tensor<MegatronCuda, D> {
    Tensor::<MegatronCuda, D>::random(shape, Distribution::Normal(0.0, 1.0), device)
        .cast(DType::BF16)
}

/// Expert `e`'s matrix of stacked weights.
fn expert(w: &Tensor<MegatronCuda, 3>, e: usize) -> Tensor<MegatronCuda, 2> {
    let [_, rows, cols] = w.dims();
    w.clone().narrow(0, e, 1).reshape([rows, cols])
}

/// One of the three products of an expert layer: `x_e · w_e`, `dy_e · w_eᵀ`, `x_eᵀ · dy_e`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pass {
    Forward,
    InputGrad,
    WeightGrad,
}

/// The grouped GEMM of `pass` by `engine` (`a` is `x` or `dy`, `b` the weights or `dy`).
fn grouped(
    pass: Pass,
    a: &Tensor<MegatronCuda, 2>,
    b: &GroupedOperand,
    counts: &[usize],
    engine: Engine,
) -> Raw {
    use burn_megatron_kernels::cuda::grouped_gemm::{grouped_gemm, grouped_weight_gradient};
    match (pass, b) {
        (Pass::WeightGrad, GroupedOperand::Rows(dy)) => {
            grouped_weight_gradient(&raw(a), &raw(dy), counts, engine)
        }
        (_, GroupedOperand::Stacked(w)) => {
            grouped_gemm(&raw(a), &raw(w), counts, pass == Pass::InputGrad, engine)
        }
        _ => unreachable!("the weight gradient takes dy, the others the weights"),
    }
    .expect("cuBLAS takes the operands")
}

/// The grouped GEMM's output as host floats (a `[n, m]` or `[experts, k, m]` tensor).
fn grouped_floats(pass: Pass, t: Raw) -> Vec<f32> {
    match pass {
        Pass::WeightGrad => floats(wrap::<3>(t)),
        _ => floats(wrap::<2>(t)),
    }
}

/// The engines checked and timed: cuBLAS's grouped GEMM, and cuBLASLt GEMMs on 1-8 streams.
const ENGINES: [Engine; 5] = [
    Engine::Grouped,
    Engine::Streams(1),
    Engine::Streams(2),
    Engine::Streams(4),
    Engine::Streams(8),
];

/// The second operand of a grouped product.
enum GroupedOperand {
    /// Stacked weights `[experts, k, m]`.
    Stacked(Tensor<MegatronCuda, 3>),
    /// `dy`, `[n, m]`.
    Rows(Tensor<MegatronCuda, 2>),
}

/// The products of `pass`, one cuBLASLt GEMM per expert with rows (weight gradients of the
/// others zero), in the grouped GEMM's layout.
fn per_expert(
    pass: Pass,
    a: &Tensor<MegatronCuda, 2>,
    b: &GroupedOperand,
    counts: &[usize],
) -> Vec<Tensor<MegatronCuda, 2>> {
    let mut start = 0;
    let mut out = Vec::new();
    for (e, &count) in counts.iter().enumerate() {
        let rows = |t: &Tensor<MegatronCuda, 2>| t.clone().narrow(0, start, count);
        match (pass, b) {
            (Pass::WeightGrad, GroupedOperand::Rows(dy)) => {
                let [_, k] = a.dims();
                let [_, m] = dy.dims();
                out.push(match count {
                    0 => Tensor::zeros([k, m], (&a.device(), DType::BF16)),
                    _ => matmul(rows(a), rows(dy), true, false),
                });
            }
            (_, GroupedOperand::Stacked(w)) if count > 0 => {
                out.push(matmul(
                    rows(a),
                    expert(w, e),
                    false,
                    pass == Pass::InputGrad,
                ));
            }
            _ => {}
        }
        start += count;
    }
    out
}

/// `max |got - want| / max |want|`, infinite where either holds a NaN or an infinity.
fn max_relative_error(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() || got.iter().chain(want).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .fold(f64::MIN_POSITIVE, |m, v| m.max(v.abs() as f64));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
    diff / scale
}

/// Mixtral-like fractions of the tokens per expert, uneven, none empty.
const UNEVEN: [f64; 8] = [0.20, 0.08, 0.15, 0.05, 0.18, 0.12, 0.10, 0.12];

/// The grouped GEMM against one cuBLASLt GEMM per expert (bf16 in, f32 accumulation, bf16 out:
/// the two differ by the accumulation order and the rounding of the outputs), every product,
/// experts with zero rows included (their weight gradient must be exactly zero); then
/// `grouped_linear`'s autodiff node on the same operands against the direct calls. Returns
/// whether everything agreed.
fn grouped_check(device: &CudaGpu) -> bool {
    const TOLERANCE: f64 = 1e-2;
    println!("== grouped GEMM (each engine) against per-expert cuBLASLt GEMMs, bf16 ==");
    let cases: Vec<(&str, usize, usize, Vec<usize>)> = vec![
        (
            "zeros first/middle/last",
            256,
            384,
            vec![0, 37, 0, 300, 1, 0, 129, 0],
        ),
        ("one expert", 512, 256, vec![777]),
        ("all rows in one of 4", 128, 192, vec![0, 0, 515, 0]),
        (
            "mixtral-1b fc1, an idle expert",
            2048,
            5632,
            split(16384, &[0.22, 0.0, 0.15, 0.05, 0.25, 0.12, 0.11, 0.10]),
        ),
        ("mixtral-1b fc2", 5632, 2048, split(16384, &UNEVEN)),
        (
            "blocks of one size: one strided batch",
            256,
            384,
            vec![40; 6],
        ),
    ];
    let mut ok = true;
    for (label, k, m, counts) in cases {
        let n: usize = counts.iter().sum();
        let x = normal_bf16([n, k], device);
        let dy = normal_bf16([n, m], device);
        let w = GroupedOperand::Stacked(normal_bf16([counts.len(), k, m], device));
        let dy_rows = GroupedOperand::Rows(dy.clone());
        for (pass, a, b) in [
            (Pass::Forward, &x, &w),
            (Pass::InputGrad, &dy, &w),
            (Pass::WeightGrad, &x, &dy_rows),
        ] {
            let want: Vec<f32> = per_expert(pass, a, b, &counts)
                .into_iter()
                .flat_map(floats)
                .collect();
            for engine in ENGINES {
                let got = grouped_floats(pass, grouped(pass, a, b, &counts, engine));
                let err = max_relative_error(&got, &want);
                let mut fine = err <= TOLERANCE;
                let mut note = String::new();
                if pass == Pass::WeightGrad {
                    let block = k * m;
                    for (e, _) in counts.iter().enumerate().filter(|(_, c)| **c == 0) {
                        if got[e * block..(e + 1) * block].iter().any(|v| *v != 0.0) {
                            fine = false;
                            note += &format!(" dw[{e}] (no rows) is not zero;");
                        }
                    }
                }
                ok &= fine;
                println!(
                    "{label:<32} {pass:<10?} {engine:<11?} k {k:5} m {m:5} counts {counts:?}: max rel err {err:.2e} {}{note}",
                    if fine { "ok" } else { "MISMATCH" }
                );
            }
        }
    }
    ok &= autodiff_check(device);
    ok
}

/// `grouped_linear` under `Autodiff<MegatronCuda>`: its output and both gradients are, bit for
/// bit, what one of the direct calls gives (an engine, or one cuBLASLt GEMM an expert), so
/// training's products are wired as checked above.
fn autodiff_check(device: &CudaGpu) -> bool {
    use burn::backend::Autodiff;
    use burn_megatron::ops::grouped_linear;
    type AD = Autodiff<MegatronCuda>;
    let counts = vec![0, 300, 5, 0, 700, 1];
    let (k, m, n) = (256, 512, counts.iter().sum::<usize>());
    let x = normal_bf16([n, k], device);
    let w = normal_bf16([counts.len(), k, m], device);
    let dy = normal_bf16([n, m], device);
    let tx = Tensor::<AD, 2>::from_inner(x.clone()).require_grad();
    let tw = Tensor::<AD, 3>::from_inner(w.clone()).require_grad();
    let y = grouped_linear(tx.clone(), tw.clone(), &counts);
    // Σ y ∘ dy in f32, so that y's gradient is dy itself.
    let loss = (y.clone().cast(DType::F32) * Tensor::from_inner(dy.clone().cast(DType::F32))).sum();
    let grads = loss.backward();
    let stacked = GroupedOperand::Stacked(w);
    let rows = GroupedOperand::Rows(dy.clone());
    // What training may have run for each product: one cuBLASLt GEMM an expert, or an engine.
    let candidates = |pass: Pass, a: &Tensor<MegatronCuda, 2>| -> Vec<(String, Vec<f32>)> {
        let b = if pass == Pass::WeightGrad {
            &rows
        } else {
            &stacked
        };
        let mut all: Vec<(String, Vec<f32>)> = ENGINES
            .iter()
            .map(|&engine| {
                let got = grouped_floats(pass, grouped(pass, a, b, &counts, engine));
                (format!("{engine:?}"), got)
            })
            .collect();
        if pass != Pass::WeightGrad {
            let looped = per_expert(pass, a, b, &counts).into_iter().flat_map(floats);
            all.push(("one GEMM an expert".into(), looped.collect()));
        }
        all
    };
    let results = [
        ("y", floats(y.inner()), candidates(Pass::Forward, &x)),
        (
            "dx",
            floats(tx.grad(&grads).expect("x has a gradient")),
            candidates(Pass::InputGrad, &dy),
        ),
        (
            "dw",
            floats(tw.grad(&grads).expect("w has a gradient")),
            candidates(Pass::WeightGrad, &x),
        ),
    ];
    let mut ok = true;
    for (name, got, candidates) in results {
        let (label, err) = candidates
            .iter()
            .map(|(label, want)| (label, max_relative_error(&got, want)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("candidates");
        ok &= err == 0.0;
        println!(
            "grouped_linear (autodiff) {name}: max rel err {err:.2e} against the direct call ({label}) {}",
            if err == 0.0 { "ok" } else { "MISMATCH" }
        );
    }
    ok
}

/// The grouped GEMM's TFLOP/s by each engine on Mixtral-like experts (8 experts, 16k tokens
/// split unevenly) and DeepSeek-like ones (a rank's 32 experts of 1408 at EP 2, 12 288 rows:
/// one micro-batch of 2048 tokens, top-6, from both ranks; and the 64 of EP 1, as many rows,
/// split unevenly and evenly),
/// every product of fc1 (and gate) and fc2, next to one cuBLASLt GEMM per expert (each its own
/// foreign operation) and a dense GEMM of the same FLOPs.
fn grouped_times(device: &CudaGpu) {
    let fine = |experts: u32| -> Vec<f64> {
        let weights: Vec<f64> = (0..experts).map(|e| f64::from(e % 5 + 1)).collect();
        let total: f64 = weights.iter().sum();
        weights.iter().map(|w| w / total).collect()
    };
    // An even load as forced balancing gives it: 0.875-1.125 times the mean, 12 288 rows over
    // 64 experts (half a row above each count, so that `split`'s truncation gives it).
    let even = |experts: usize| -> Vec<f64> {
        let rows = [168.0, 176.0, 184.0, 192.0, 192.0, 200.0, 208.0, 216.0];
        (0..experts)
            .map(|e| (rows[e % 8] + 0.5) / 12288.0)
            .collect()
    };
    let cases = [
        ("mixtral-1b", 2048, 5632, 5632, 16384, UNEVEN.to_vec()),
        ("mixtral-8x7b", 4096, 14336, 14336, 16384, UNEVEN.to_vec()),
        ("deepseek-1b ep2", 2048, 1408, 1408, 12288, fine(32)),
        ("deepseek-1b ep1", 2048, 1408, 1408, 12288, fine(64)),
        ("deepseek-1b ep1 even", 2048, 1408, 1408, 12288, even(64)),
    ];
    let engine_names: Vec<String> = ENGINES.iter().map(|e| format!("{e:?}")).collect();
    // fc1's width (SwiGLU's gate is a second product of the same shape) and fc2's input width.
    for (model, hidden, fc1, fc2, tokens, fractions) in cases {
        let counts = split(tokens, &fractions);
        println!(
            "== grouped GEMM TFLOP/s, bf16, {model}: {tokens} tokens over {} experts {counts:?} ==",
            counts.len()
        );
        println!(
            "{:<38} {} {:>11} {:>11} {:>9} {:>11}",
            "product",
            engine_names
                .iter()
                .map(|n| format!("{n:>11}"))
                .collect::<String>(),
            "padded",
            "per-expert",
            "dense",
            "best/dense"
        );
        for (layer, k, m) in [("fc1", hidden, fc1), ("fc2", fc2, hidden)] {
            let x = normal_bf16([tokens, k], device);
            let dy = normal_bf16([tokens, m], device);
            let w = normal_bf16([counts.len(), k, m], device);
            let dense_w = normal_bf16([k, m], device);
            let stacked = GroupedOperand::Stacked(w.clone());
            let rows = GroupedOperand::Rows(dy.clone());
            let flops = 2.0 * (tokens * k * m) as f64;
            let tflops = |t: Duration| flops / t.as_secs_f64() / 1e12;
            let mut totals = vec![Duration::ZERO; ENGINES.len()];
            // The MoE layer's padded blocks: every expert's block at the largest count
            // (rounded up), one strided-batched GEMM; its TFLOP/s count the real rows only.
            let block = padded_block_rows(&counts, f64::INFINITY).expect("two experts or more");
            let padded_counts = vec![block; counts.len()];
            let padded_x = normal_bf16([block * counts.len(), k], device);
            let padded_dy = normal_bf16([block * counts.len(), m], device);
            let padded_rows = GroupedOperand::Rows(padded_dy.clone());
            let mut padded_total = Duration::ZERO;
            for pass in [Pass::Forward, Pass::InputGrad, Pass::WeightGrad] {
                let (a, b) = match pass {
                    Pass::Forward => (&x, &stacked),
                    Pass::InputGrad => (&dy, &stacked),
                    Pass::WeightGrad => (&x, &rows),
                };
                let engines: Vec<f64> = ENGINES
                    .iter()
                    .zip(&mut totals)
                    .map(|(&engine, total)| {
                        let t = time_of(device, || grouped(pass, a, b, &counts, engine));
                        *total += t;
                        tflops(t)
                    })
                    .collect();
                let (padded_a, padded_b) = match pass {
                    Pass::Forward => (&padded_x, &stacked),
                    Pass::InputGrad => (&padded_dy, &stacked),
                    Pass::WeightGrad => (&padded_x, &padded_rows),
                };
                let padded_time = time_of(device, || {
                    grouped(pass, padded_a, padded_b, &padded_counts, Engine::Grouped)
                });
                padded_total += padded_time;
                let padded = tflops(padded_time);
                let looped = tflops(time_of(device, || per_expert(pass, a, b, &counts)));
                let dense = tflops(time(device, || match pass {
                    Pass::Forward => matmul(x.clone(), dense_w.clone(), false, false),
                    Pass::InputGrad => matmul(dy.clone(), dense_w.clone(), false, true),
                    Pass::WeightGrad => matmul(x.clone(), dy.clone(), true, false),
                }));
                let best = engines.iter().copied().fold(looped.max(padded), f64::max);
                println!(
                    "{:<38} {} {padded:11.1} {looped:11.1} {dense:9.1} {:11.2}",
                    format!("{model} {layer} {pass:?} k={k} m={m}"),
                    engines
                        .iter()
                        .map(|t| format!("{t:11.1}"))
                        .collect::<String>(),
                    best / dense
                );
            }
            println!(
                "{:<38} {}",
                format!("{model} {layer} fwd+bwd (the three)"),
                totals
                    .iter()
                    .chain([&padded_total])
                    .map(|t| format!("{:11.1}", 3.0 * flops / t.as_secs_f64() / 1e12))
                    .collect::<String>()
            );
        }
    }
}
