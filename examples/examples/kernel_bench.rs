//! The fused kernels against the Burn compositions they replace, on our CUDA backend, at
//! transformer sizes; with the device's copy bandwidth from the same process. Run next to
//! `bench/torch_kernels.py` (PyTorch eager and torch.compile) in the same device call:
//!
//!     ../shared/gpu/pack build --release --features cuda --example kernel_bench
//!     source .gpu/env.sh && .gpu/bin/kernel_bench; python3 bench/torch_kernels.py
//!
//! GB/s counts the bytes a kernel must move at least (each input read once, each output
//! written once), so it compares with the copy bandwidth directly.

use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorPrimitive};
use burn_megatron::ops::causal_softmax::{backward_composition, forward_composition};
use burn_megatron::ops::cross_entropy::{VocabSlice, gradient_composition, statistics_composition};
use burn_megatron::ops::{
    BiasOps, CrossEntropyOps, DropoutOps, EmbeddingOps, GeluOps, NormOps, RopeOps, SoftmaxOps,
    SwiGluOps,
};
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};
use burn_megatron_kernels::fused::causal_softmax as softmax;

type B = MegatronCuda;

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

fn report(name: &str, bytes: usize, took: Duration) {
    let gbs = bytes as f64 / took.as_secs_f64() / 1e9;
    println!(
        "{name:<48} {:>9.3} ms {gbs:>8.0} GB/s",
        took.as_secs_f64() * 1e3
    );
    println!(
        "RESULT kernel=\"{name}\" ms={:.4} gbs={gbs:.1}",
        took.as_secs_f64() * 1e3
    );
}

/// A named part of the benchmark.
type Section = (&'static str, fn(&CudaGpu));

/// Runs every section, or those named on the command line (e.g. `kernel_bench
/// dropout_rope_and_padded_softmax`).
fn main() {
    let device = CudaGpu::new(0);
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let sections: [Section; 11] = [
        ("cross_entropy", cross_entropy),
        ("elementwise_layouts", elementwise_layouts),
        ("column_sum_layouts", column_sum_layouts),
        ("norm_forward_layouts", norm_forward_layouts),
        ("norm_profile", norm_profile),
        ("norm_backward_layouts", norm_backward_layouts),
        ("bias_swiglu", bias_swiglu),
        ("causal_softmax", causal_softmax),
        ("embedding_gradient", embedding_gradient),
        ("norm_gelu_and_bias_gradient", norm_gelu_and_bias_gradient),
        (
            "dropout_rope_and_padded_softmax",
            dropout_rope_and_padded_softmax,
        ),
    ];
    for (name, section) in sections {
        if wanted.is_empty() || wanted.iter().any(|w| w == name) {
            section(&device);
        }
    }
}

/// The vocabulary-parallel cross-entropy's two kernels against the Burn compositions.
fn cross_entropy(device: &CudaGpu) {
    let device = device.clone();
    // 16k tokens × GPT-2's vocabulary padded to 50304 (one rank's slice at TP = 1).
    let (rows, local, real) = (16_384, 50_304, 50_257);
    let slice = VocabSlice { start: 0, real };
    println!("burn-megatron kernels on {rows} × {local} (real vocabulary {real})");
    for dtype in [DType::BF16, DType::F32] {
        let size = dtype.size();
        let x = Tensor::<B, 2>::random([rows, local], Distribution::Normal(0.0, 2.0), &device)
            .cast(dtype);
        let targets =
            Tensor::<B, 1, Int>::random([rows], Distribution::Uniform(0.0, real as f64), &device);
        let elements = rows * local;
        let copy = time(&device, || x.clone().add_scalar(1.0));
        report(
            &format!("{dtype:?} copy (x + 1)"),
            2 * elements * size,
            copy,
        );

        let fwd_bytes = elements * size + rows * 4 * 4;
        let fused = time(&device, || {
            B::cross_entropy_statistics(x.clone(), targets.clone(), slice)
        });
        report(
            &format!("{dtype:?} cross-entropy forward, fused"),
            fwd_bytes,
            fused,
        );
        let plain = time(&device, || {
            statistics_composition(x.clone(), targets.clone(), slice)
        });
        report(
            &format!("{dtype:?} cross-entropy forward, Burn ops"),
            fwd_bytes,
            plain,
        );

        let [max, sum_exp, _] = B::cross_entropy_statistics(x.clone(), targets.clone(), slice);
        let grad_loss = Tensor::<B, 1>::ones([rows], &device).div_scalar(rows as f64);
        let bwd_bytes = 2 * elements * size + rows * 4 * 4;
        let fused = time(&device, || {
            B::cross_entropy_gradient(
                x.clone(),
                targets.clone(),
                max.clone(),
                sum_exp.clone(),
                grad_loss.clone(),
                slice,
            )
        });
        report(
            &format!("{dtype:?} cross-entropy backward, fused"),
            bwd_bytes,
            fused,
        );
        let plain = time(&device, || {
            gradient_composition(
                x.clone(),
                targets.clone(),
                max.clone(),
                sum_exp.clone(),
                grad_loss.clone(),
                slice,
            )
        });
        report(
            &format!("{dtype:?} cross-entropy backward, Burn ops"),
            bwd_bytes,
            plain,
        );
    }
}

/// Dropout + residual add on 16k tokens × 4096 (the mask drawn in the kernel against the
/// composition's host mask), RoPE on a Llama-sized packed QKV (`[8, 2048, 8, 6, 128]`: 32
/// query heads in 8 groups), and the padded causal softmax on GPT-2's scores.
fn dropout_rope_and_padded_softmax(device: &CudaGpu) {
    use burn_megatron::ops::DropoutMask;
    use burn_megatron::ops::causal_softmax::masked_forward_composition;
    use burn_megatron::ops::dropout::dropout_composition;
    use burn_megatron::ops::rope::packed_rope_composition;
    for dtype in [DType::BF16, DType::F32] {
        let size = dtype.size();
        let random = |shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 1.0), device).cast(dtype)
        };
        let dims = [1, 16, 1024, 4096];
        let elements: usize = dims.iter().product();
        let (x, residual) = (
            random(dims.to_vec()).reshape(dims),
            random(dims.to_vec()).reshape(dims),
        );
        let mask = DropoutMask {
            prob: 0.1,
            seed: 7,
            offset: [0; 4],
        };
        report(
            &format!("{dtype:?} dropout + residual, fused, 16384x4096"),
            3 * elements * size,
            time(device, || {
                B::dropout(x.clone(), Some(residual.clone()), mask)
            }),
        );
        report(
            &format!("{dtype:?} dropout backward (dy * mask), fused, 16384x4096"),
            2 * elements * size,
            time(device, || B::dropout(x.clone(), None, mask)),
        );
        report(
            &format!("{dtype:?} dropout + residual, Burn ops + host mask, 16384x4096"),
            3 * elements * size,
            time(device, || {
                dropout_composition(x.clone(), Some(residual.clone()), mask)
            }),
        );

        let rope = [8, 2048, 8, 6, 128];
        let elements: usize = rope.iter().product();
        let qkv = random(rope.to_vec()).reshape(rope);
        report(
            &format!("{dtype:?} RoPE on packed QKV, fused, copy, {rope:?}"),
            2 * elements * size,
            time(device, || B::packed_rope(qkv.clone(), 500_000.0)),
        );
        // A buffer nothing else holds is rotated in place (q and k rows only): the step's
        // case, where RoPE gets the QKV projection's fresh output.
        let mut only = Some(random(rope.to_vec()).reshape(rope));
        report(
            &format!("{dtype:?} RoPE on packed QKV, fused, in place, {rope:?}"),
            2 * elements * size,
            time(device, || {
                let x = only.take().expect("the buffer is put back after each call");
                only = Some(B::packed_rope(x, 500_000.0));
            }),
        );
        report(
            &format!("{dtype:?} RoPE on packed QKV, Burn ops, {rope:?}"),
            2 * elements * size,
            time(device, || {
                packed_rope_composition(qkv.clone(), 500_000.0, false)
            }),
        );

        let shape = [16, 12, 1024, 1024];
        let elements: usize = shape.iter().product();
        let scores = random(shape.to_vec()).reshape(shape).mul_scalar(4.0);
        let lengths: Vec<i64> = (0..16).map(|b| 1024 - 37 * b).collect();
        let lengths =
            Tensor::<B, 1, Int>::from_data(burn::tensor::TensorData::new(lengths, [16]), device);
        report(
            &format!("{dtype:?} padded causal softmax forward, fused"),
            2 * elements * size,
            time(device, || {
                B::masked_softmax(scores.clone(), Some(lengths.clone()), 0.125, true)
            }),
        );
        report(
            &format!("{dtype:?} padded causal softmax forward, Burn ops"),
            2 * elements * size,
            time(device, || {
                masked_forward_composition(scores.clone(), Some(lengths.clone()), 0.125, true)
            }),
        );
        let probs = B::masked_softmax(scores.clone(), Some(lengths.clone()), 0.125, false);
        report(
            &format!("{dtype:?} padded softmax backward, fused"),
            3 * elements * size,
            time(device, || {
                B::masked_softmax_backward(probs.clone(), scores.clone(), 0.125, false)
            }),
        );
    }
}

/// The attention's causal softmax at GPT-2 124M's shape, batch 16: `[16, 12, 1024, 1024]`.
fn causal_softmax(device: &CudaGpu) {
    let shape = [16, 12, 1024, 1024];
    let scale = 0.125;
    let elements: usize = shape.iter().product();
    println!("causal softmax on {shape:?}");
    for dtype in [DType::BF16, DType::F32] {
        let size = dtype.size();
        let scores =
            Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 4.0), device).cast(dtype);
        let copy = time(device, || scores.clone().add_scalar(1.0));
        report(
            &format!("{dtype:?} copy (x + 1)"),
            2 * elements * size,
            copy,
        );
        let raw = |t: &Tensor<B, 4>| t.clone().into_primitive().tensor();
        let fused = time(device, || softmax::forward(raw(&scores), scale));
        let bytes = 2 * elements * size;
        report(
            &format!("{dtype:?} causal softmax forward, fused"),
            bytes,
            fused,
        );
        // The kernels that stream each row twice through one cube (the default before the
        // rows moved into registers), written into one buffer.
        let out = scores.clone().zeros_like();
        let streamed = time(device, || {
            softmax::masked_forward_into_with(
                raw(&scores),
                None,
                scale,
                true,
                raw(&out),
                softmax::SoftmaxKernels::Streaming,
            )
        });
        report(
            &format!("{dtype:?} causal softmax forward, fused, streamed"),
            bytes,
            streamed,
        );
        let plain = time(device, || forward_composition(scores.clone(), scale));
        report(
            &format!("{dtype:?} causal softmax forward, Burn ops"),
            bytes,
            plain,
        );
        let probs = forward_composition(scores.clone(), scale);
        let grad =
            Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype);
        let bytes = 3 * elements * size;
        let fused = time(device, || softmax::backward(raw(&probs), raw(&grad), scale));
        report(
            &format!("{dtype:?} causal softmax backward, fused"),
            bytes,
            fused,
        );
        let streamed = time(device, || {
            softmax::masked_backward_into_with(
                raw(&probs),
                raw(&grad),
                scale,
                true,
                raw(&out),
                softmax::SoftmaxKernels::Streaming,
            )
        });
        report(
            &format!("{dtype:?} causal softmax backward, fused, streamed"),
            bytes,
            streamed,
        );
        let plain = time(device, || {
            backward_composition(probs.clone(), grad.clone(), scale)
        });
        report(
            &format!("{dtype:?} causal softmax backward, Burn ops"),
            bytes,
            plain,
        );
    }
}

/// The token embedding's weight gradient at GPT-2 124M's shape: 16 × 1024 tokens, a
/// 50 304 × 768 table, bf16. Uniform ids, and ids where a few tokens are frequent, as in text
/// (one in five tokens is one of four ids: their buckets are the kernel's longest walks).
fn embedding_gradient(device: &CudaGpu) {
    let (tokens, vocab, hidden) = (16_384, 50_304, 768);
    println!("embedding gradient, {tokens} tokens, {vocab} × {hidden}");
    let dtype = DType::BF16;
    let grad = Tensor::<B, 2>::random([tokens, hidden], Distribution::Normal(0.0, 1.0), device)
        .cast(dtype);
    let uniform =
        Tensor::<B, 1, Int>::random([tokens], Distribution::Uniform(0.0, vocab as f64), device);
    let frequent: Vec<i32> = (0..tokens as i32)
        .map(|t| match t % 20 {
            0 => 11,
            1 => 13,
            2 => 198,
            3 => 262,
            _ => (t * 7919) % vocab as i32,
        })
        .collect();
    let frequent =
        Tensor::<B, 1, Int>::from_data(burn::tensor::TensorData::new(frequent, [tokens]), device);
    // The gradient read once, the table written once.
    let bytes = (tokens + vocab) * hidden * dtype.size();
    for (name, ids) in [("uniform ids", uniform), ("frequent ids", frequent)] {
        let fused = time(device, || {
            B::embedding_gradient(grad.clone(), ids.clone(), vocab)
        });
        report(
            &format!("{dtype:?} embedding gradient, fused, {name}"),
            bytes,
            fused,
        );
        let plain = time(device, || {
            burn_megatron::ops::embedding::backward_composition(grad.clone(), ids.clone(), vocab)
        });
        report(
            &format!("{dtype:?} embedding gradient, Burn ops, {name}"),
            bytes,
            plain,
        );
    }
}

/// LayerNorm (forward; backward = dx, dscale, dshift), bias-GeLU (tanh) and the bias
/// gradient's column sums at 16k tokens × 4096 (the transformer size) and GPT-2
/// 124M's widths (LayerNorm over 768, GeLU over 3072), bf16 and f32.
fn norm_gelu_and_bias_gradient(device: &CudaGpu) {
    use burn_megatron::ops::{GeluForm, NormKind};
    let rows = 16_384;
    for (norm_width, gelu_width) in [(4096, 4096), (768, 3072)] {
        println!("LayerNorm over {rows} × {norm_width}, bias-GeLU over {rows} × {gelu_width}");
        for dtype in [DType::BF16, DType::F32] {
            let size = dtype.size();
            let random = |shape: [usize; 2]| {
                Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
            };
            let vector = |n: usize| {
                Tensor::<B, 1>::random([n], Distribution::Normal(1.0, 0.1), device).cast(dtype)
            };
            let (x, grad) = (random([rows, norm_width]), random([rows, norm_width]));
            let (scale, shift) = (vector(norm_width), vector(norm_width));
            let elements = rows * norm_width;
            let copy = time(device, || x.clone().add_scalar(1.0));
            report(
                &format!("{dtype:?} copy (x + 1), {rows}x{norm_width}"),
                2 * elements * size,
                copy,
            );
            let forward = || {
                B::norm_forward(
                    x.clone(),
                    scale.clone(),
                    Some(shift.clone()),
                    NormKind::LayerNorm,
                    1e-5,
                )
            };
            report(
                &format!("{dtype:?} LayerNorm forward, fused, {rows}x{norm_width}"),
                2 * elements * size,
                time(device, forward),
            );
            let stats = forward();
            report(
                &format!("{dtype:?} LayerNorm backward, fused, {rows}x{norm_width}"),
                3 * elements * size,
                time(device, || {
                    B::norm_backward(
                        x.clone(),
                        scale.clone(),
                        stats.mean.clone(),
                        stats.rstd.clone(),
                        grad.clone(),
                        NormKind::LayerNorm,
                        true,
                    )
                }),
            );

            let (h, dh) = (random([rows, gelu_width]), random([rows, gelu_width]));
            let bias = vector(gelu_width);
            let elements = rows * gelu_width;
            let form = GeluForm::Tanh;
            report(
                &format!("{dtype:?} bias-GeLU forward, fused, {rows}x{gelu_width}"),
                2 * elements * size,
                time(device, || B::bias_gelu(h.clone(), Some(bias.clone()), form)),
            );
            report(
                &format!("{dtype:?} bias-GeLU backward, fused, {rows}x{gelu_width}"),
                3 * elements * size,
                time(device, || {
                    B::bias_gelu_backward(h.clone(), Some(bias.clone()), dh.clone(), form)
                }),
            );
            report(
                &format!("{dtype:?} bias gradient, column sums, {rows}x{gelu_width}"),
                elements * size,
                time(device, || B::bias_gradient(dh.clone())),
            );
            report(
                &format!(
                    "{dtype:?} bias-GeLU backward + bias gradient, two kernels, {rows}x{gelu_width}"
                ),
                3 * elements * size,
                time(device, || {
                    let dx = B::bias_gelu_backward(h.clone(), Some(bias.clone()), dh.clone(), form);
                    (B::bias_gradient(dx.clone()), dx)
                }),
            );
            report(
                &format!(
                    "{dtype:?} bias-GeLU backward + bias gradient, one kernel, {rows}x{gelu_width}"
                ),
                3 * elements * size,
                time(device, || {
                    B::bias_gelu_backward_and_bias_gradient(
                        h.clone(),
                        bias.clone(),
                        dh.clone(),
                        form,
                    )
                }),
            );
            for rows_in_flight in [1, 2, 4] {
                let raw = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
                report(
                    &format!(
                        "{dtype:?} bias-GeLU backward + bias gradient, one kernel, {rows_in_flight} rows in flight, {rows}x{gelu_width}"
                    ),
                    3 * elements * size,
                    time(device, || {
                        burn_megatron_kernels::fused::bias_gelu::backward_and_bias_gradient_with(
                            rows_in_flight,
                            raw(&h),
                            bias.clone().into_primitive().tensor(),
                            raw(&dh),
                            burn_megatron_kernels::fused::bias_gelu::Form::Tanh,
                        )
                    }),
                );
            }
            report(
                &format!("{dtype:?} bias gradient, Burn sum_dim, {rows}x{gelu_width}"),
                elements * size,
                time(device, || dh.clone().sum_dim(0)),
            );
        }
    }
}

/// The element-wise kernels (bias-GeLU in the tanh form, bias-SwiGLU) in their flat layout
/// and in blocks of 1 to 8 rows a thread (`ElementwiseLayout`), forward and backward, bf16
/// and f32, at 16k tokens × 4096 and GPT-2's 3072, next to the copy. Each layout's outputs
/// must equal the flat kernel's bit for bit (the layouts' check on CUDA).
fn elementwise_layouts(device: &CudaGpu) {
    use burn_megatron_kernels::fused::vectors::ElementwiseLayout;
    use burn_megatron_kernels::fused::{bias_gelu, swiglu};
    let rows = 16_384;
    let layouts = [
        ElementwiseLayout::Flat,
        ElementwiseLayout::Rows(1),
        ElementwiseLayout::Rows(2),
        ElementwiseLayout::Rows(4),
        ElementwiseLayout::Rows(8),
    ];
    let form = bias_gelu::Form::Tanh;
    for width in [4096, 3072] {
        for dtype in [DType::BF16, DType::F32] {
            let random = |shape: [usize; 2]| {
                Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
            };
            let (x, up, dy) = (
                random([rows, width]),
                random([rows, width]),
                random([rows, width]),
            );
            let bias = |seed: u64| {
                let b = Tensor::<B, 1>::random([width], Distribution::Normal(0.0, 0.1), device)
                    .cast(dtype)
                    .add_scalar(seed as f64 * 1e-3);
                b.into_primitive().tensor()
            };
            let (b, bg, bu) = (bias(1), bias(2), bias(3));
            let biases = || {
                Some(swiglu::Biases {
                    gate: bg.clone(),
                    up: bu.clone(),
                })
            };
            let bytes = rows * width * dtype.size();
            report(
                &format!("{dtype:?} copy (x + 1), {rows}x{width}"),
                2 * bytes,
                time(device, || x.clone().add_scalar(1.0)),
            );
            let raw = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
            let bits = |t| -> Vec<u32> {
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t))
                    .cast(DType::F32)
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            let outputs = |layout| {
                let [d_gate, d_up] =
                    swiglu::backward_with(layout, raw(&x), raw(&up), biases(), raw(&dy));
                [
                    bits(bias_gelu::forward_with(
                        layout,
                        raw(&x),
                        Some(b.clone()),
                        form,
                    )),
                    bits(bias_gelu::backward_with(
                        layout,
                        raw(&x),
                        Some(b.clone()),
                        raw(&dy),
                        form,
                    )),
                    bits(swiglu::forward_with(layout, raw(&x), raw(&up), biases())),
                    bits(d_gate),
                    bits(d_up),
                ]
            };
            let flat = outputs(ElementwiseLayout::Flat);
            for layout in layouts {
                assert!(
                    outputs(layout) == flat,
                    "{layout:?} differs from the flat kernels"
                );
                let name = |op: &str| format!("{dtype:?} {op}, {layout:?}, {rows}x{width}");
                report(
                    &name("bias-GeLU forward"),
                    2 * bytes,
                    time(device, || {
                        bias_gelu::forward_with(layout, raw(&x), Some(b.clone()), form)
                    }),
                );
                report(
                    &name("bias-GeLU backward"),
                    3 * bytes,
                    time(device, || {
                        bias_gelu::backward_with(layout, raw(&x), Some(b.clone()), raw(&dy), form)
                    }),
                );
                report(
                    &name("bias-SwiGLU forward"),
                    3 * bytes,
                    time(device, || {
                        swiglu::forward_with(layout, raw(&x), raw(&up), biases())
                    }),
                );
                report(
                    &name("bias-SwiGLU backward"),
                    5 * bytes,
                    time(device, || {
                        swiglu::backward_with(layout, raw(&x), raw(&up), biases(), raw(&dy))
                    }),
                );
            }
        }
    }
}

/// The column sums' stage shapes (`ColumnSumLayout`) at the model's bias widths, against the
/// default layout and Burn's `sum_dim`: what picks the default.
fn column_sum_layouts(device: &CudaGpu) {
    use burn_megatron_kernels::fused::column_sum::{ColumnSumLayout, column_sum_with};
    let rows = 16_384;
    let mut layouts = vec![
        ColumnSumLayout::default(),
        ColumnSumLayout {
            checked: false,
            ..ColumnSumLayout::default()
        },
    ];
    // The row-lane grid with `BM_COLUMN_GRID` (it compiles kernels for each layout and shape).
    let grid = std::env::var_os("BM_COLUMN_GRID").is_some();
    let lanes: &[(u32, u32)] = if grid {
        &[(32, 8), (64, 4), (32, 4), (128, 2), (64, 2)]
    } else {
        &[]
    };
    for &(column_vectors, row_lanes) in lanes {
        for loads_in_flight in [1, 2, 4] {
            for (min_rows_per_block, max_blocks) in [(32, 512), (64, 256), (128, 128)] {
                for total_lanes in [16, 64] {
                    layouts.push(ColumnSumLayout {
                        column_vectors,
                        row_lanes,
                        loads_in_flight,
                        min_rows_per_block,
                        max_blocks,
                        total_columns: 256 / total_lanes,
                        total_lanes,
                        checked: true,
                    });
                }
            }
        }
    }
    for (column_vectors, loads_in_flight) in [(128, 2), (128, 4), (64, 1), (64, 4)] {
        for (min_rows_per_block, max_blocks) in [(32, 512), (64, 256)] {
            layouts.push(ColumnSumLayout {
                column_vectors,
                row_lanes: 1,
                loads_in_flight,
                min_rows_per_block,
                max_blocks,
                ..ColumnSumLayout::default()
            });
        }
    }
    for dtype in [DType::BF16, DType::F32] {
        for columns in [4096, 768, 2304, 3072] {
            let dy =
                Tensor::<B, 2>::random([rows, columns], Distribution::Normal(0.0, 1.0), device)
                    .cast(dtype);
            let bytes = rows * columns * dtype.size();
            report(
                &format!("{dtype:?} copy (x + 1), {rows}x{columns}"),
                2 * bytes,
                time(device, || dy.clone().add_scalar(1.0)),
            );
            report(
                &format!("{dtype:?} Burn sum_dim(0), {rows}x{columns}"),
                bytes,
                time(device, || dy.clone().sum_dim(0)),
            );
            let raw = dy.clone().into_primitive().tensor();
            sweep(
                &format!("{dtype:?} column sums {rows}x{columns}"),
                &layouts,
                bytes,
                |layout| time(device, || column_sum_with(*layout, raw.clone(), DType::F32)),
            );
        }
    }
    for (i, layout) in layouts.iter().enumerate() {
        println!("layout {i}: {layout:?}");
    }
}

/// Reports `run`'s time for each of `layouts` as `name layout i`, then the fastest.
fn sweep<L: std::fmt::Debug>(
    name: &str,
    layouts: &[L],
    bytes: usize,
    mut run: impl FnMut(&L) -> Duration,
) {
    let mut best: Option<(Duration, usize)> = None;
    for (i, layout) in layouts.iter().enumerate() {
        let took = run(layout);
        if best.is_none_or(|(fastest, _)| took < fastest) {
            best = Some((took, i));
        }
        report(&format!("{name} layout {i}"), bytes, took);
    }
    if let Some((_, i)) = best {
        println!("BEST {name}: layout {i} {:?}", layouts[i]);
    }
}

/// One launch each of the bf16 LayerNorm forward and backward at 16 384 × 4 096 in the
/// default layouts and in the alternatives, after a warm-up: for `ncu` (the kernels' names
/// contain `forward_kernel` and `backward_kernel`).
fn norm_profile(device: &CudaGpu) {
    use burn_megatron_kernels::fused::norm::{self, Kind, NormBackwardLayout, NormForwardLayout};
    let (rows, hidden) = (16_384, 4096);
    let dtype = DType::BF16;
    let random = |shape: [usize; 2]| {
        Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device)
            .cast(dtype)
            .into_primitive()
            .tensor()
    };
    let (x, grad) = (random([rows, hidden]), random([rows, hidden]));
    let scale = Tensor::<B, 1>::random([hidden], Distribution::Normal(1.0, 0.1), device)
        .cast(dtype)
        .into_primitive()
        .tensor();
    let forwards = [
        NormForwardLayout::default(),
        NormForwardLayout {
            checked: true,
            ..NormForwardLayout::default()
        },
    ];
    let backwards = [
        NormBackwardLayout::default(),
        NormBackwardLayout {
            checked: true,
            ..NormBackwardLayout::default()
        },
    ];
    for _ in 0..2 {
        for layout in forwards {
            let stats = norm::forward_with(
                layout,
                x.clone(),
                scale.clone(),
                Some(scale.clone()),
                Kind::LayerNorm,
                1e-5,
            );
            for layout in backwards {
                norm::backward_with(
                    layout,
                    x.clone(),
                    scale.clone(),
                    stats.mean.clone(),
                    stats.rstd.clone(),
                    grad.clone(),
                    Kind::LayerNorm,
                    true,
                );
            }
        }
        B::sync(device).unwrap();
    }
}

/// The LayerNorm forward's work layouts (`NormForwardLayout`: elements a thread, threads a
/// cube, CubeCL's bounds checks) at GPT-2's and a 1B model's widths.
fn norm_forward_layouts(device: &CudaGpu) {
    use burn_megatron_kernels::fused::norm::{self, Kind, NormForwardLayout};
    let rows = 16_384;
    let mut layouts = vec![NormForwardLayout::default()];
    for elements_per_thread in [8, 16, 32] {
        for cube_threads in [256, 512] {
            for checked in [false, true] {
                layouts.push(NormForwardLayout {
                    elements_per_thread,
                    cube_threads,
                    checked,
                });
            }
        }
    }
    for dtype in [DType::BF16, DType::F32] {
        for hidden in [4096, 768, 2048] {
            let random = |shape: [usize; 2]| {
                Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
            };
            let x = random([rows, hidden]);
            let vector = || {
                Tensor::<B, 1>::random([hidden], Distribution::Normal(1.0, 0.1), device)
                    .cast(dtype)
                    .into_primitive()
                    .tensor()
            };
            let (scale, shift) = (vector(), vector());
            let bytes = rows * hidden * dtype.size();
            report(
                &format!("{dtype:?} copy (x + 1), {rows}x{hidden}"),
                2 * bytes,
                time(device, || x.clone().add_scalar(1.0)),
            );
            sweep(
                &format!("{dtype:?} LayerNorm forward {rows}x{hidden}"),
                &layouts,
                2 * bytes,
                |layout| {
                    time(device, || {
                        norm::forward_with(
                            *layout,
                            x.clone().into_primitive().tensor(),
                            scale.clone(),
                            Some(shift.clone()),
                            Kind::LayerNorm,
                            1e-5,
                        )
                    })
                },
            );
        }
    }
    for (i, layout) in layouts.iter().enumerate() {
        println!("layout {i}: {layout:?}");
    }
}

/// The LayerNorm backward's work layouts (`NormBackwardLayout`) at GPT-2's and a 1B model's
/// widths: what picks the default.
fn norm_backward_layouts(device: &CudaGpu) {
    use burn_megatron_kernels::fused::column_sum::ColumnSumLayout;
    use burn_megatron_kernels::fused::norm::{self, Kind, NormBackwardLayout};
    let rows = 16_384;
    let mut layouts = vec![NormBackwardLayout::default()];
    // The whole grid with `BM_NORM_GRID` (it compiles a kernel for each layout and shape).
    let grid = std::env::var_os("BM_NORM_GRID").is_some();
    for bytes_per_thread in [16, 32, 64] {
        layouts.push(NormBackwardLayout {
            bytes_per_thread,
            checked: true,
            ..NormBackwardLayout::default()
        });
        for target_threads in [1 << 16, 1 << 17, 1 << 18] {
            for rows_per_block in [(16, 64), (8, 32), (32, 128)] {
                let layout = NormBackwardLayout {
                    bytes_per_thread,
                    target_threads,
                    rows_per_block,
                    totals: ColumnSumLayout::default(),
                    ..NormBackwardLayout::default()
                };
                if grid || (target_threads == 1 << 17 && rows_per_block == (16, 64)) {
                    layouts.push(layout);
                }
            }
        }
    }
    for dtype in [DType::BF16, DType::F32] {
        for hidden in [4096, 768, 2048] {
            let random = |shape: [usize; 2]| {
                Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
            };
            let (x, grad) = (random([rows, hidden]), random([rows, hidden]));
            let scale = Tensor::<B, 1>::random([hidden], Distribution::Normal(1.0, 0.1), device)
                .cast(dtype);
            let bytes = rows * hidden * dtype.size();
            report(
                &format!("{dtype:?} copy (x + 1), {rows}x{hidden}"),
                2 * bytes,
                time(device, || x.clone().add_scalar(1.0)),
            );
            let raw = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
            let stats = norm::forward(
                raw(&x),
                scale.clone().into_primitive().tensor(),
                None,
                Kind::LayerNorm,
                1e-5,
            );
            sweep(
                &format!("{dtype:?} LayerNorm backward {rows}x{hidden}"),
                &layouts,
                3 * bytes,
                |layout| {
                    time(device, || {
                        norm::backward_with(
                            *layout,
                            raw(&x),
                            scale.clone().into_primitive().tensor(),
                            stats.mean.clone(),
                            stats.rstd.clone(),
                            raw(&grad),
                            Kind::LayerNorm,
                            true,
                        )
                    })
                },
            );
        }
    }
    for (i, layout) in layouts.iter().enumerate() {
        println!("layout {i}: {layout:?}");
    }
}

/// Bias-SwiGLU forward and backward (one kernel each) against the Burn composition, at a 1B
/// Llama's MLP width with biases.
fn bias_swiglu(device: &CudaGpu) {
    use burn_megatron::ops::swiglu::{add_swiglu_bias, swiglu_derivatives, swiglu_forward};
    let (rows, columns) = (16_384, 4096);
    for dtype in [DType::BF16, DType::F32] {
        let random = |shape: [usize; 2]| {
            Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
        };
        let vector = || {
            Tensor::<B, 1>::random([columns], Distribution::Normal(0.0, 0.1), device).cast(dtype)
        };
        let (gate, up, grad) = (
            random([rows, columns]),
            random([rows, columns]),
            random([rows, columns]),
        );
        let bias = Some([vector(), vector()]);
        let bytes = rows * columns * dtype.size();
        report(
            &format!("{dtype:?} copy (x + 1), {rows}x{columns}"),
            2 * bytes,
            time(device, || gate.clone().add_scalar(1.0)),
        );
        report(
            &format!("{dtype:?} bias-SwiGLU forward, fused, {rows}x{columns}"),
            3 * bytes,
            time(device, || B::swiglu(gate.clone(), up.clone(), bias.clone())),
        );
        report(
            &format!("{dtype:?} bias-SwiGLU backward, fused, {rows}x{columns}"),
            5 * bytes,
            time(device, || {
                B::swiglu_backward(gate.clone(), up.clone(), bias.clone(), grad.clone())
            }),
        );
        let [bias_gate, bias_up] = bias.clone().expect("biases");
        report(
            &format!(
                "{dtype:?} bias-SwiGLU backward + both bias gradients, two kernels and two column sums, {rows}x{columns}"
            ),
            5 * bytes,
            time(device, || {
                let [d_gate, d_up] =
                    B::swiglu_backward(gate.clone(), up.clone(), bias.clone(), grad.clone());
                (B::bias_gradient(d_gate), B::bias_gradient(d_up))
            }),
        );
        report(
            &format!(
                "{dtype:?} bias-SwiGLU backward + both bias gradients, one kernel, {rows}x{columns}"
            ),
            5 * bytes,
            time(device, || {
                B::swiglu_backward_and_bias_gradients(
                    gate.clone(),
                    up.clone(),
                    [bias_gate.clone(), bias_up.clone()],
                    grad.clone(),
                )
            }),
        );
        for rows_in_flight in [1, 2, 4] {
            let raw = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
            report(
                &format!(
                    "{dtype:?} bias-SwiGLU backward + both bias gradients, one kernel, {rows_in_flight} rows in flight, {rows}x{columns}"
                ),
                5 * bytes,
                time(device, || {
                    burn_megatron_kernels::fused::swiglu::backward_and_bias_gradients_with(
                        rows_in_flight,
                        raw(&gate),
                        raw(&up),
                        burn_megatron_kernels::fused::swiglu::Biases {
                            gate: bias_gate.clone().into_primitive().tensor(),
                            up: bias_up.clone().into_primitive().tensor(),
                        },
                        raw(&grad),
                    )
                }),
            );
        }
        report(
            &format!("{dtype:?} bias-SwiGLU forward, Burn ops, {rows}x{columns}"),
            3 * bytes,
            time(device, || {
                let (g, u) = add_swiglu_bias(gate.clone(), up.clone(), bias.clone());
                swiglu_forward(g, u)
            }),
        );
        report(
            &format!("{dtype:?} bias-SwiGLU backward, Burn ops, {rows}x{columns}"),
            5 * bytes,
            time(device, || {
                let (g, u) = add_swiglu_bias(gate.clone(), up.clone(), bias.clone());
                swiglu_derivatives(g, u, grad.clone())
            }),
        );
    }
}
