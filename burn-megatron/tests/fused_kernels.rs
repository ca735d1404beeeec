//! The fused CubeCL kernels against the plain Burn compositions they replace, on Burn's wgpu
//! backend: in CI that is Mesa's software Vulkan driver (lavapipe), with no GPU.
//!
//!     apt-get install -y mesa-vulkan-drivers
//!     XDG_RUNTIME_DIR=/tmp cargo test -p burn-megatron --features wgpu --test fused_kernels
//!
//! lavapipe reports no plane (subgroup) support, so this runs the kernels' portable
//! shared-memory reductions. The same comparisons run on the GPU in tests/tests/gpu.rs.

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::CubeBackend;
use burn_megatron::ModelBackend;
use burn_megatron::ops::cross_entropy::{VocabSlice, gradient_composition, statistics_composition};
use burn_megatron::ops::{
    AdamWOps, BiasOps, CrossEntropyOps, DropoutOps, EmbeddingOps, FlashAttentionOps, GeluOps,
    NormOps, PackedFlashAttentionOps, RopeOps, SoftmaxOps, SwiGluOps, WriteSlotOps,
};
use burn_megatron_kernels::fused::cross_entropy as kernels;
use burn_megatron_testing::{assert_close, tolerance, values, values_f32};

type W = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// Deterministic values in [-scale, scale).
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

struct Case {
    rows: usize,
    local: usize,
    slice: VocabSlice,
}

/// Shapes that are not multiples of the 256-thread block, a single element, a row of
/// GPT-2's padded vocabulary, a slice with no real column, and a slice that starts inside the
/// vocabulary (a TP rank's). The kernels read rows as vectors of the widest width that divides
/// the row (at most 4 on wgpu, 8 bf16 on CUDA): the cases take widths 4, 2 and 1, rows of
/// whole vectors and rows whose last real vector `real` cuts, rows shorter than one vector a
/// thread and rows of many unrolled rounds.
fn cases() -> Vec<Case> {
    let case = |rows, local, start, real| Case {
        rows,
        local,
        slice: VocabSlice { start, real },
    };
    vec![
        case(1, 1, 0, 1),
        case(3, 7, 0, 7),
        case(5, 1000, 0, 997),
        case(9, 300, 600, 300),
        case(4, 130, 650, 0),
        case(2, 50_304, 0, 50_257),
        // Width 4: one whole vector; a vector cut after one lane; three lanes of padding.
        case(4, 8, 0, 8),
        case(4, 8, 0, 5),
        case(4, 12, 40, 9),
        // Width 2, and a row of unrolled rounds, a remainder and a cut vector.
        case(4, 6, 0, 6),
        case(4, 4100, 0, 4099),
        // Padding vectors past the cut one, in a slice inside the vocabulary.
        case(4, 2048, 1000, 1023),
        // Width 1 (an odd row): the scalar path over a ragged GPT-2-sized row.
        case(4, 50_307, 0, 50_300),
    ]
}

fn inputs(case: &Case, dtype: DType, device: &WgpuDevice) -> (Tensor<W, 2>, Tensor<W, 1, Int>) {
    let Case { rows, local, slice } = *case;
    let logits = Tensor::<W, 2>::from_data(
        TensorData::new(random(rows * local, 7, 8.0), [rows, local]),
        device,
    )
    .cast(dtype);
    // Targets inside the slice, outside it (another rank's), ignored (-100), and the last real
    // column (in the vector `real` cuts, when it cuts one).
    let targets: Vec<i32> = (0..rows)
        .map(|r| match r % 4 {
            0 => (slice.start + (r * 31) % slice.real.max(1)) as i32,
            1 => (slice.start + slice.real + 5) as i32,
            2 => -100,
            _ => (slice.start + slice.real) as i32 - 1,
        })
        .collect();
    let targets = Tensor::<W, 1, Int>::from_data(TensorData::new(targets, [rows]), device);
    (logits, targets)
}

/// `[max, Σ exp(x - max), target logit]` of each row in f64 on the host: the exact values.
fn exact_statistics(logits: &[f64], targets: &[i64], case: &Case) -> [Vec<f64>; 3] {
    let Case { rows, local, slice } = *case;
    let mut out = [vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]];
    for r in 0..rows {
        let row = &logits[r * local..r * local + slice.real];
        let max = row.iter().cloned().fold(-1.0e30, f64::max);
        out[0][r] = max;
        out[1][r] = row.iter().map(|x| (x - max).exp()).sum();
        let column = targets[r] - slice.start as i64;
        if column >= 0 && (column as usize) < slice.real {
            out[2][r] = row[column as usize];
        }
    }
    out
}

#[test]
fn cross_entropy_statistics_are_exact_and_equal_the_composition() {
    let device = WgpuDevice::default();
    for dtype in [DType::F32, DType::F16] {
        for case in cases() {
            let (logits, targets) = inputs(&case, dtype, &device);
            let host_targets: Vec<i64> = targets
                .clone()
                .into_data()
                .convert::<i64>()
                .to_vec()
                .expect("i64 targets");
            let exact = exact_statistics(&values(logits.clone()), &host_targets, &case);
            let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), case.slice);
            let plain = statistics_composition(logits, targets, case.slice);
            let names = ["max", "sum_exp", "target_logit"];
            for (((name, fused), plain), exact) in names.iter().zip(fused).zip(plain).zip(&exact) {
                assert_eq!(fused.dtype(), DType::F32, "statistics are f32");
                let label = format!(
                    "{dtype:?} {}x{} {:?} {name}",
                    case.rows, case.local, case.slice
                );
                let fused = values(fused);
                assert_close(
                    &format!("{label} (fused vs exact)"),
                    &fused,
                    exact,
                    tolerance::F32,
                );
                // Burn's own sum of a 50k-column f32 row on wgpu is off by ~5e-5 from the exact
                // value (the fused kernel by ~1e-7), hence the wider bound here.
                assert_close(
                    &format!("{label} (Burn ops vs fused)"),
                    &values(plain),
                    &fused,
                    tolerance::F32_LONG_SUM,
                );
            }
        }
    }
}

#[test]
fn cross_entropy_gradient_equals_the_composition_and_writes_every_element() {
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for case in cases() {
            let (logits, targets) = inputs(&case, dtype, &device);
            let [max, sum_exp, _] =
                statistics_composition(logits.clone(), targets.clone(), case.slice);
            let grad_loss = Tensor::<W, 1>::from_data(
                TensorData::new(random(case.rows, 3, 1.0), [case.rows]),
                &device,
            );
            let plain = gradient_composition(
                logits.clone(),
                targets.clone(),
                max.clone(),
                sum_exp.clone(),
                grad_loss.clone(),
                case.slice,
            );
            // Poisoned: an element the kernel leaves unwritten stays NaN and fails the check.
            let poisoned =
                Tensor::<W, 2>::full([case.rows, case.local], f32::NAN, &device).cast(dtype);
            let raw = |t: Tensor<W, 1>| t.into_primitive().tensor();
            kernels::gradient_into(
                logits.into_primitive().tensor(),
                targets.into_primitive(),
                raw(max),
                raw(sum_exp),
                raw(grad_loss),
                kernels::VocabSlice {
                    start: case.slice.start,
                    real: case.slice.real,
                },
                poisoned.clone().into_primitive().tensor(),
            );
            let fused: Tensor<W, 2> =
                Tensor::from_primitive(TensorPrimitive::Float(poisoned.into_primitive().tensor()));
            assert_eq!(fused.dtype(), dtype);
            let label = format!(
                "{dtype:?} {}x{} {:?} gradient",
                case.rows, case.local, case.slice
            );
            assert_close(&label, &values(fused), &values(plain), bound);
        }
    }
}

/// `[batch, heads, seq, seq]` shapes: a single element, ragged sizes, a row longer than the
/// 256-thread block.
/// Rows of one key to more than a 32-thread group holds at 32 elements a thread (1 030 keys,
/// read two at a time), and row counts that leave rows of the last cube idle.
const SOFTMAX_SHAPES: [[usize; 4]; 5] = [
    [1, 1, 1, 1],
    [2, 3, 5, 5],
    [1, 2, 37, 37],
    [2, 1, 300, 300],
    [1, 1, 1030, 1030],
];

fn random_4d(
    shape: [usize; 4],
    seed: u64,
    scale: f32,
    dtype: DType,
    device: &WgpuDevice,
) -> Tensor<W, 4> {
    let n = shape.iter().product();
    Tensor::<W, 4>::from_data(TensorData::new(random(n, seed, scale), shape), device).cast(dtype)
}

fn poisoned(shape: [usize; 4], dtype: DType, device: &WgpuDevice) -> Tensor<W, 4> {
    Tensor::<W, 4>::full(shape, f32::NAN, device).cast(dtype)
}

fn raw4(t: Tensor<W, 4>) -> burn_cubecl::tensor::CubeTensor<WgpuRuntime> {
    t.into_primitive().tensor()
}

#[test]
fn causal_softmax_equals_the_composition_and_writes_every_element() {
    use burn_megatron::ops::causal_softmax::{backward_composition, forward_composition};
    use burn_megatron_kernels::fused::causal_softmax as softmax;
    let device = WgpuDevice::default();
    let scale = 0.125;
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for shape in SOFTMAX_SHAPES {
            let label = |what: &str| format!("{dtype:?} {shape:?} {what}");
            let scores = random_4d(shape, 11, 30.0, dtype, &device);
            let want = forward_composition(scores.clone(), scale);
            let got = poisoned(shape, dtype, &device);
            softmax::forward_into(raw4(scores.clone()), scale, raw4(got.clone()));
            assert_eq!(got.dtype(), dtype);
            assert_close(
                &label("probabilities"),
                &values(got),
                &values(want.clone()),
                bound,
            );
            // Both kernel sets: rows in registers (the default) and streamed.
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let got = poisoned(shape, dtype, &device);
                softmax::masked_forward_into_with(
                    raw4(scores.clone()),
                    None,
                    scale,
                    true,
                    raw4(got.clone()),
                    kernels,
                );
                assert_close(
                    &label(&format!("probabilities, {kernels:?}")),
                    &values(got),
                    &values(want.clone()),
                    bound,
                );
            }
            // With a fresh output.
            let fresh = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(softmax::forward(
                raw4(scores),
                scale,
            )));
            assert_close(
                &label("fresh output"),
                &values(fresh),
                &values(want.clone()),
                bound,
            );

            let grad = random_4d(shape, 12, 1.0, dtype, &device);
            let want = backward_composition(want.clone(), grad.clone(), scale);
            let got = poisoned(shape, dtype, &device);
            let probs = forward_composition(random_4d(shape, 11, 30.0, dtype, &device), scale);
            softmax::backward_into(
                raw4(probs.clone()),
                raw4(grad.clone()),
                scale,
                raw4(got.clone()),
            );
            assert_close(
                &label("gradient"),
                &values(got),
                &values(want.clone()),
                bound,
            );
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let got = poisoned(shape, dtype, &device);
                softmax::masked_backward_into_with(
                    raw4(probs.clone()),
                    raw4(grad.clone()),
                    scale,
                    true,
                    raw4(got.clone()),
                    kernels,
                );
                assert_close(
                    &label(&format!("gradient, {kernels:?}")),
                    &values(got),
                    &values(want.clone()),
                    bound,
                );
            }
        }
    }
}

/// Inputs whose rows are not packed (a narrowed view: as our CUDA runtime pitches rows to an
/// aligned size) are read in place, by stride.
#[test]
fn kernels_read_strided_rows_in_place() {
    use burn_megatron::ops::causal_softmax::{backward_composition, forward_composition};
    let device = WgpuDevice::default();
    let (rows, local, pad) = (6, 300, 13);
    let slice = VocabSlice {
        start: 0,
        real: 297,
    };
    let wide = Tensor::<W, 2>::from_data(
        TensorData::new(random(rows * (local + pad), 5, 8.0), [rows, local + pad]),
        &device,
    );
    let logits = wide.narrow(1, 0, local);
    let targets = Tensor::<W, 1, Int>::from_data(
        TensorData::new(vec![3i32, 299, -100, 0, 296, 150], [rows]),
        &device,
    );
    let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), slice);
    let plain = statistics_composition(logits.clone(), targets.clone(), slice);
    for (i, (a, b)) in fused.into_iter().zip(plain).enumerate() {
        assert_close(
            &format!("strided statistic {i}"),
            &values(a),
            &values(b),
            tolerance::F32,
        );
    }
    let [max, sum_exp, _] = statistics_composition(logits.clone(), targets.clone(), slice);
    let grad_loss = Tensor::<W, 1>::ones([rows], &device);
    let want = gradient_composition(
        logits.clone(),
        targets.clone(),
        max.clone(),
        sum_exp.clone(),
        grad_loss.clone(),
        slice,
    );
    let got = W::cross_entropy_gradient(logits, targets, max, sum_exp, grad_loss, slice);
    assert_close(
        "strided gradient",
        &values(got),
        &values(want),
        tolerance::F32,
    );

    let shape = [2, 3, 40, 40];
    let wide = random_4d([2, 3, 40, 47], 9, 20.0, DType::F32, &device);
    let scores = wide.narrow(3, 0, 40);
    assert_eq!(scores.dims(), shape);
    let want = forward_composition(scores.clone(), 0.5);
    let got = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(
        burn_megatron_kernels::fused::causal_softmax::forward(raw4(scores), 0.5),
    ));
    assert_close(
        "strided softmax",
        &values(got.clone()),
        &values(want.clone()),
        tolerance::F32,
    );
    let grad = random_4d([2, 3, 40, 47], 10, 1.0, DType::F32, &device).narrow(3, 0, 40);
    let expect = backward_composition(want.clone(), grad.clone(), 0.5);
    let got = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(
        burn_megatron_kernels::fused::causal_softmax::backward(raw4(want), raw4(grad), 0.5),
    ));
    assert_close(
        "strided softmax gradient",
        &values(got),
        &values(expect),
        tolerance::F32,
    );
}

/// Pitched rows whose stride allows vector reads (as our CUDA runtime pitches GPT-2's 50304
/// columns to 50432): the cross-entropy kernels read the logits by vector in place and write
/// the gradient into a pitched output, every element of the view and nothing past it.
#[test]
fn cross_entropy_reads_and_writes_pitched_rows_by_vector() {
    let device = WgpuDevice::default();
    let (rows, local, pitch, out_pitch) = (6, 304, 312, 320);
    let slice = VocabSlice {
        start: 0,
        real: 301,
    };
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        let label = |what: &str| format!("{dtype:?} pitched {what}");
        let wide = Tensor::<W, 2>::from_data(
            TensorData::new(random(rows * pitch, 21, 8.0), [rows, pitch]),
            &device,
        )
        .cast(dtype);
        let logits = wide.narrow(1, 0, local);
        // The last real column (in the vector `real` cuts), a padding column, ignored, ...
        let targets = Tensor::<W, 1, Int>::from_data(
            TensorData::new(vec![300i32, 303, -100, 0, 150, 299], [rows]),
            &device,
        );
        let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), slice);
        let plain = statistics_composition(logits.clone(), targets.clone(), slice);
        for (name, (a, b)) in ["max", "sum_exp", "target_logit"]
            .iter()
            .zip(fused.into_iter().zip(plain))
        {
            assert_close(&label(name), &values(a), &values(b), tolerance::F32);
        }

        let [max, sum_exp, _] = statistics_composition(logits.clone(), targets.clone(), slice);
        let grad_loss =
            Tensor::<W, 1>::from_data(TensorData::new(random(rows, 22, 1.0), [rows]), &device);
        let want = gradient_composition(
            logits.clone(),
            targets.clone(),
            max.clone(),
            sum_exp.clone(),
            grad_loss.clone(),
            slice,
        );
        let out = Tensor::<W, 2>::full([rows, out_pitch], f32::NAN, &device).cast(dtype);
        let raw = |t: Tensor<W, 1>| t.into_primitive().tensor();
        kernels::gradient_into(
            logits.into_primitive().tensor(),
            targets.into_primitive(),
            raw(max),
            raw(sum_exp),
            raw(grad_loss),
            kernels::VocabSlice {
                start: slice.start,
                real: slice.real,
            },
            out.clone().narrow(1, 0, local).into_primitive().tensor(),
        );
        assert_close(
            &label("gradient"),
            &values(out.clone().narrow(1, 0, local)),
            &values(want),
            bound,
        );
        let past = values(out.narrow(1, local, out_pitch - local));
        assert!(
            past.iter().all(|x| x.is_nan()),
            "{}",
            label("gradient wrote past its view")
        );
    }
}

/// More rows than one grid dimension holds (65535 cubes on some backends): the kernels' grid
/// goes on in its second dimension.
#[test]
fn cross_entropy_kernels_cover_more_rows_than_one_grid_dimension() {
    let device = WgpuDevice::default();
    let case = Case {
        rows: 65_537,
        local: 5,
        slice: VocabSlice { start: 0, real: 4 },
    };
    let (logits, targets) = inputs(&case, DType::F32, &device);
    let fused = W::cross_entropy_statistics(logits.clone(), targets.clone(), case.slice);
    let plain = statistics_composition(logits.clone(), targets.clone(), case.slice);
    for (name, (a, b)) in ["max", "sum_exp", "target_logit"]
        .iter()
        .zip(fused.into_iter().zip(plain))
    {
        assert_close(name, &values(a), &values(b), tolerance::F32);
    }
    let [max, sum_exp, _] = statistics_composition(logits.clone(), targets.clone(), case.slice);
    let grad_loss = Tensor::<W, 1>::ones([case.rows], &device);
    let want = gradient_composition(
        logits.clone(),
        targets.clone(),
        max.clone(),
        sum_exp.clone(),
        grad_loss.clone(),
        case.slice,
    );
    let got = W::cross_entropy_gradient(logits, targets, max, sum_exp, grad_loss, case.slice);
    assert_close("gradient", &values(got), &values(want), tolerance::F32);
}

/// One training step of a small GPT (tied embeddings, learned positions, LayerNorm, GeLU) and
/// a small Llama on wgpu, where the fused kernels run, equals the same step on NdArray, where
/// the Burn compositions run: loss and every gradient.
#[test]
fn a_training_step_on_wgpu_equals_ndarray() {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::backend::AutodiffBackend;
    use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
    use burn_megatron::tensor_parallel::gather_full_grads;
    use burn_megatron::transformer::{
        Activation, Normalization, PositionEmbedding, TransformerConfig,
    };

    fn step<A>(config: &TransformerConfig, device: A::Device) -> (f64, Vec<(String, Vec<f64>)>)
    where
        A: AutodiffBackend + ModelBackend,
        A::InnerBackend: burn_megatron_dist::DistBackend,
    {
        burn_megatron_testing::run(1, |ctx| {
            let model = config.init_gpt::<A>(ctx.world(), &device)?;
            let ids = |seed: i64| {
                let v: Vec<i32> = (0..2 * 16).map(|i| ((i * 13 + seed) % 50) as i32).collect();
                Tensor::<A, 2, Int>::from_data(TensorData::new(v, [2, 16]), &device)
            };
            let (loss, grads) =
                forward_backward_no_pipelining(&model, &[Microbatch::new(ids(1), ids(2))])?;
            let grads = gather_full_grads::<A, _>(&model, &grads, ctx.world())?;
            let grads = grads
                .into_iter()
                .map(|(path, data)| (path, burn_megatron_testing::data_values(&data)))
                .collect();
            Ok((values(loss)[0], grads))
        })
        .remove(0)
    }
    let llama = TransformerConfig::new(64, 2, 8, 96, 50, 16)
        .with_num_query_groups(Some(4))
        .with_normalization(Normalization::RmsNorm)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 })
        .with_add_bias_linear(false)
        .with_tie_embeddings(false);
    let gpt = TransformerConfig::new(64, 2, 4, 256, 50, 16);
    // Dropout masks drawn by the kernels on wgpu and on the host on NdArray.
    let dropout = gpt
        .clone()
        .with_hidden_dropout(0.2)
        .with_attention_dropout(0.3);
    for (name, config) in [
        ("llama", llama),
        ("gpt", gpt),
        ("gpt with dropout", dropout),
    ] {
        let (loss, grads) = step::<Autodiff<W>>(&config, WgpuDevice::default());
        let (want_loss, want) = step::<Autodiff<NdArray>>(&config, Default::default());
        assert_close(
            &format!("{name} loss"),
            &[loss],
            &[want_loss],
            tolerance::F32,
        );
        for ((path, got), (_, want)) in grads.iter().zip(&want) {
            assert_close(
                &format!("{name} {path}"),
                got,
                want,
                tolerance::F32_LONG_SUM,
            );
        }
    }
}

/// The fused AdamW kernel against the composition: weights in f32 (out of place: a model
/// views them) and in f16 (in place, with an f16 copy for the model), decayed and exempt
/// blocks, a gradient factor, the bias correction at steps 1 and 1000, and a skipped step
/// (every input unchanged, though the gradients hold NaN).
#[test]
fn flat_adamw_equals_the_composition() {
    use burn_megatron::ops::adamw::{AdamWScalars, FlatAdamWBuffers, flat_adamw_composition};
    let device = WgpuDevice::default();
    let (block, blocks) = (8, 129);
    let n = block * blocks;
    let f32s = |v: Vec<f32>| {
        let len = v.len();
        Tensor::<W, 1>::from_data(TensorData::new(v, [len]), (&device, DType::F32))
    };
    let flags: Vec<f32> = (0..blocks).map(|b| (b % 3 != 0) as u8 as f32).collect();
    let scalars = AdamWScalars::new(3e-3, 0.9, 0.95, 1e-8, 0.1, block);
    for (model_dtype, step, found, shared) in [
        (None, 0.0, 0.0, true),
        (None, 999.0, 0.0, false),
        (Some(DType::F16), 0.0, 0.0, false),
        (Some(DType::F16), 4.0, 0.0, true),
        (None, 4.0, 1.0, false),
        (Some(DType::F16), 4.0, 1.0, false),
    ] {
        let label = format!("{model_dtype:?} step {step} found_inf {found} shared {shared}");
        let mut grad = random(n, 21, 1e-2);
        if found != 0.0 {
            grad[5] = f32::NAN;
            grad[n - 1] = f32::INFINITY;
        }
        let buffers = || FlatAdamWBuffers {
            master: f32s(random(n, 20, 0.5)),
            grad: f32s(grad.clone()),
            exp_avg: f32s(random(n, 22, 1e-3)),
            exp_avg_sq: f32s(random(n, 23, 1e-4).iter().map(|v| v.abs()).collect()),
            decay: f32s(flags.clone()),
            step: f32s(vec![step]),
            grad_factor: f32s(vec![0.7]),
            found_inf: f32s(vec![found]),
        };
        let want = flat_adamw_composition(buffers(), &scalars, model_dtype);
        let inputs = buffers();
        // A view of the master weights held elsewhere forces the out-of-place path.
        let view = shared.then(|| inputs.master.clone());
        let before =
            [&inputs.master, &inputs.exp_avg, &inputs.exp_avg_sq].map(|t| values(t.clone()));
        let got = W::flat_adamw(inputs, &scalars, model_dtype);
        if let Some(view) = view {
            assert_eq!(
                values(view),
                before[0],
                "{label}: a shared master is not written"
            );
        }
        let pairs = [
            ("master", got.master, want.master),
            ("exp_avg", got.exp_avg, want.exp_avg),
            ("exp_avg_sq", got.exp_avg_sq, want.exp_avg_sq),
        ];
        for (i, (name, got, want)) in pairs.into_iter().enumerate() {
            let (got, want) = (values(got), values(want));
            if found != 0.0 {
                assert_eq!(
                    got, before[i],
                    "{label}: {name} unchanged by a skipped step"
                );
            }
            assert_close(
                &format!("{label}: {name}"),
                &got,
                &want,
                tolerance::F32_SAME_ORDER,
            );
        }
        assert_eq!(got.model.is_some(), model_dtype.is_some());
        if let (Some(got), Some(want)) = (got.model, want.model) {
            assert_eq!(got.dtype(), DType::F16);
            assert_close(
                &format!("{label}: model copy"),
                &values(got),
                &values(want),
                tolerance::F16,
            );
        }
    }
}

/// `gelu(x + bias)` and its derivative as one kernel each (`ModelBackend::bias_gelu` and
/// `bias_gelu_backward` on a CubeCL backend) against the Burn compositions, both forms, with
/// and without a bias, on a narrowed (strided) `x`, with values out to ±12 (past the tanh
/// form's clamp) and sizes that are not multiples of the 256-thread cube.
#[test]
fn bias_gelu_equals_the_composition() {
    use burn_megatron::ops::GeluForm;
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for form in [GeluForm::Erf, GeluForm::Tanh] {
            // (rows, columns, extra columns the view leaves out): odd row pitches read
            // element by element, packed rows of a multiple of 4 as vectors.
            for (rows, cols, extra) in [(1, 1, 5), (7, 300, 5), (33, 129, 5), (9, 256, 0)] {
                for with_bias in [false, true] {
                    let wide = Tensor::<W, 2>::from_data(
                        TensorData::new(
                            random(rows * (cols + extra), 3, 12.0),
                            [rows, cols + extra],
                        ),
                        &device,
                    )
                    .cast(dtype);
                    let x = wide.narrow(1, extra.min(2), cols);
                    let bias = with_bias.then(|| {
                        Tensor::<W, 1>::from_data(
                            TensorData::new(random(cols, 4, 1.0), [cols]),
                            &device,
                        )
                        .cast(dtype)
                    });
                    let grad = Tensor::<W, 2>::from_data(
                        TensorData::new(random(rows * cols, 5, 1.0), [rows, cols]),
                        &device,
                    )
                    .cast(dtype);
                    let biased = |x: Tensor<W, 2>| match &bias {
                        Some(b) => x + b.clone().unsqueeze(),
                        None => x,
                    };
                    // The compositions in f32, so that the bound measures the kernel alone.
                    let wide32 = |t: Tensor<W, 2>| t.cast(DType::F32);
                    let forward_reference = form.forward(wide32(biased(x.clone())));
                    let backward_reference =
                        wide32(grad.clone()) * form.derivative(wide32(biased(x.clone())));
                    let forward = W::bias_gelu(x.clone(), bias.clone(), form);
                    let backward =
                        W::bias_gelu_backward(x.clone(), bias.clone(), grad.clone(), form);
                    assert_eq!(forward.dtype(), dtype);
                    assert_eq!(backward.dtype(), dtype);
                    let name = format!("{form:?} {dtype:?} {rows}x{cols} bias {with_bias}");
                    assert_close(
                        &format!("forward {name}"),
                        &values(forward.cast(DType::F32)),
                        &values(forward_reference),
                        bound,
                    );
                    assert_close(
                        &format!("backward {name}"),
                        &values(backward.cast(DType::F32)),
                        &values(backward_reference),
                        bound,
                    );
                }
            }
        }
    }
}

/// Bit for bit, the element-wise kernels' bits do not depend on their layout
/// (`ElementwiseLayout::Rows`: a thread on one column vector of several rows, against `Flat`):
/// bias-GeLU (both forms) and SwiGLU, forward and backward, with and without biases, into
/// poisoned outputs. Row counts that are and are not multiples of the block, one row, strided
/// views (element by element) and packed rows (vectors), and more vectors a row than a cube
/// has threads.
#[test]
fn elementwise_layouts_give_the_flat_kernels_bits() {
    use burn_megatron_kernels::fused::vectors::ElementwiseLayout;
    use burn_megatron_kernels::fused::{bias_gelu, swiglu};
    let device = WgpuDevice::default();
    let bits = |t: Tensor<W, 2>| -> Vec<u64> { values(t).iter().map(|v| v.to_bits()).collect() };
    for dtype in [DType::F32, DType::F16] {
        for (rows, cols, extra) in [(1, 8, 0), (7, 300, 5), (33, 129, 1), (10, 2052, 0)] {
            let view = |seed, scale| {
                matrix(rows, cols + extra, seed, scale, &device)
                    .cast(dtype)
                    .narrow(1, 0, cols)
            };
            let (x, up, grad) = (view(91, 6.0), view(94, 2.0), view(92, 1.0));
            for with_bias in [false, true] {
                let bias =
                    |seed| with_bias.then(|| raw(vector(cols, seed, 0.5, &device).cast(dtype)));
                let run = |layout| {
                    let mut outputs = Vec::new();
                    for form in [bias_gelu::Form::Erf, bias_gelu::Form::Tanh] {
                        outputs.push(wrap::<2>(bias_gelu::forward_with(
                            layout,
                            raw(x.clone()),
                            bias(93),
                            form,
                        )));
                        outputs.push(wrap::<2>(bias_gelu::backward_with(
                            layout,
                            raw(x.clone()),
                            bias(93),
                            raw(grad.clone()),
                            form,
                        )));
                    }
                    let biases = || {
                        with_bias.then(|| swiglu::Biases {
                            gate: bias(95).unwrap(),
                            up: bias(96).unwrap(),
                        })
                    };
                    outputs.push(wrap::<2>(swiglu::forward_with(
                        layout,
                        raw(x.clone()),
                        raw(up.clone()),
                        biases(),
                    )));
                    let [d_gate, d_up] = swiglu::backward_with(
                        layout,
                        raw(x.clone()),
                        raw(up.clone()),
                        biases(),
                        raw(grad.clone()),
                    );
                    outputs.push(wrap::<2>(d_gate));
                    outputs.push(wrap::<2>(d_up));
                    outputs.into_iter().map(bits).collect::<Vec<_>>()
                };
                let flat = run(ElementwiseLayout::Flat);
                for rows_per_thread in [1, 3, 4] {
                    let name =
                        format!("{dtype:?} {rows}x{cols} bias {with_bias} rows {rows_per_thread}");
                    // Poison the pool with the outputs' size, so that an output reusing the
                    // flat run's buffers shows NaN, not the flat run's bits, where the kernel
                    // leaves an element unwritten.
                    let poison =
                        || Tensor::<W, 2>::full([rows, cols], f32::NAN, &device).cast(dtype);
                    drop((0..flat.len()).map(|_| poison()).collect::<Vec<_>>());
                    let blocked = run(ElementwiseLayout::Rows(rows_per_thread));
                    for (i, (got, want)) in blocked.iter().zip(&flat).enumerate() {
                        let first_bad = got.iter().zip(want).position(|(a, b)| a != b);
                        assert_eq!(first_bad, None, "output {i} {name}");
                        assert!(
                            got.iter().all(|&b| f64::from_bits(b).is_finite()),
                            "output {i} {name}: not finite"
                        );
                    }
                }
            }
        }
    }
}

/// The bias-GeLU backward with the bias gradient's first stage inside it
/// (`bias_gelu::backward_and_bias_gradient`, `ModelBackend::bias_gelu_backward_and_bias_gradient`
/// on a CubeCL backend) gives the bits of the backward kernel followed by the column sum of
/// `dx`: both forms, f32 and f16 storage, one row, fewer rows than a block and several blocks
/// with a partial last one, strided views (element by element) and packed rows (vectors), into
/// poisoned outputs.
#[test]
fn bias_gelu_backward_with_the_bias_gradient_equals_the_two_kernels() {
    use burn_megatron::ops::GeluForm;
    use burn_megatron_kernels::fused::bias_gelu::{
        Form, backward, backward_and_bias_gradient, backward_and_bias_gradient_with,
    };
    use burn_megatron_kernels::fused::column_sum::column_sum;
    let device = WgpuDevice::default();
    let bits = |t: Tensor<W, 2>| -> Vec<u64> { values(t).iter().map(|v| v.to_bits()).collect() };
    let bits1 = |t: Tensor<W, 1>| -> Vec<u64> { values(t).iter().map(|v| v.to_bits()).collect() };
    for dtype in [DType::F32, DType::F16] {
        for (rows, cols, extra) in [(1, 8, 0), (7, 300, 5), (200, 129, 1), (130, 2052, 0)] {
            let view = |seed, scale| {
                matrix(rows, cols + extra, seed, scale, &device)
                    .cast(dtype)
                    .narrow(1, 0, cols)
            };
            let (x, grad) = (view(101, 6.0), view(102, 1.0));
            let bias = vector(cols, 103, 0.5, &device).cast(dtype);
            for (form, model_form) in [(Form::Erf, GeluForm::Erf), (Form::Tanh, GeluForm::Tanh)] {
                let name = format!("{dtype:?} {rows}x{cols} {form:?}");
                let dx = wrap::<2>(backward(
                    raw(x.clone()),
                    Some(raw(bias.clone())),
                    raw(grad.clone()),
                    form,
                ));
                let db = wrap::<1>(column_sum(raw(dx.clone()), dtype));
                let (want_dx, want_db) = (bits(dx), bits1(db));
                // Poison the pool with the outputs' sizes (see the layouts' test).
                drop((
                    Tensor::<W, 2>::full([rows, cols], f32::NAN, &device).cast(dtype),
                    Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dtype),
                ));
                let (dx, db) = backward_and_bias_gradient(
                    raw(x.clone()),
                    raw(bias.clone()),
                    raw(grad.clone()),
                    form,
                );
                let (got_dx, got_db) = (bits(wrap::<2>(dx)), bits1(wrap::<1>(db)));
                assert_eq!(got_dx, want_dx, "dx {name}");
                assert_eq!(got_db, want_db, "db {name}");
                assert!(
                    got_db.iter().all(|&b| f64::from_bits(b).is_finite()),
                    "db {name}: not finite"
                );
                assert!(
                    got_dx.iter().all(|&b| f64::from_bits(b).is_finite()),
                    "dx {name}: not finite"
                );
                // Any number of rows in flight, a partial last group included: the same bits.
                for rows_in_flight in [1, 3] {
                    let (dx, db) = backward_and_bias_gradient_with(
                        rows_in_flight,
                        raw(x.clone()),
                        raw(bias.clone()),
                        raw(grad.clone()),
                        form,
                    );
                    assert_eq!(
                        bits(wrap::<2>(dx)),
                        want_dx,
                        "dx {name} {rows_in_flight} rows"
                    );
                    assert_eq!(
                        bits1(wrap::<1>(db)),
                        want_db,
                        "db {name} {rows_in_flight} rows"
                    );
                }
                // Through the backend, as the autodiff node calls it.
                let (dx, db) = W::bias_gelu_backward_and_bias_gradient(
                    x.clone(),
                    bias.clone(),
                    grad.clone(),
                    model_form,
                );
                assert_eq!(bits(dx), want_dx, "backend dx {name}");
                assert_eq!(bits1(db), want_db, "backend db {name}");
            }
        }
    }
}

/// The SwiGLU backward with both bias gradients' first stage inside it
/// (`swiglu::backward_and_bias_gradients`, `ModelBackend::swiglu_backward_and_bias_gradients`
/// on a CubeCL backend) gives the bits of the backward kernel followed by the column sums of
/// `d_gate` and `d_up`: f32 and f16 storage, one row, fewer rows than a block and several
/// blocks with a partial last one, strided views (element by element) and packed rows
/// (vectors), into poisoned outputs.
#[test]
fn swiglu_backward_with_the_bias_gradients_equals_the_kernel_and_column_sums() {
    use burn_megatron_kernels::fused::column_sum::column_sum;
    use burn_megatron_kernels::fused::swiglu::{
        Biases, backward, backward_and_bias_gradients, backward_and_bias_gradients_with,
    };
    let device = WgpuDevice::default();
    let bits = |t: Tensor<W, 2>| -> Vec<u64> { values(t).iter().map(|v| v.to_bits()).collect() };
    let bits1 = |t: Tensor<W, 1>| -> Vec<u64> { values(t).iter().map(|v| v.to_bits()).collect() };
    for dtype in [DType::F32, DType::F16] {
        for (rows, cols, extra) in [(1, 8, 0), (7, 300, 5), (200, 129, 1), (130, 2052, 0)] {
            let view = |seed, scale| {
                matrix(rows, cols + extra, seed, scale, &device)
                    .cast(dtype)
                    .narrow(1, 0, cols)
            };
            let (gate, up, grad) = (view(111, 6.0), view(112, 2.0), view(113, 1.0));
            let gate_bias = vector(cols, 114, 0.5, &device).cast(dtype);
            let up_bias = vector(cols, 115, -0.5, &device).cast(dtype);
            let biases = || Biases {
                gate: raw(gate_bias.clone()),
                up: raw(up_bias.clone()),
            };
            let name = format!("{dtype:?} {rows}x{cols}");
            let derivatives = backward(
                raw(gate.clone()),
                raw(up.clone()),
                Some(biases()),
                raw(grad.clone()),
            )
            .map(wrap::<2>);
            let want_db = derivatives
                .clone()
                .map(|d| bits1(wrap::<1>(column_sum(raw(d), dtype))));
            let want_d = derivatives.map(bits);
            // Poison the pool with the outputs' sizes (see the layouts' test).
            drop((
                Tensor::<W, 2>::full([rows, cols], f32::NAN, &device).cast(dtype),
                Tensor::<W, 2>::full([rows, cols], f32::NAN, &device).cast(dtype),
                Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dtype),
                Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dtype),
            ));
            let (got_d, got_db) = backward_and_bias_gradients(
                raw(gate.clone()),
                raw(up.clone()),
                biases(),
                raw(grad.clone()),
            );
            let got_d = got_d.map(|d| bits(wrap::<2>(d)));
            let got_db = got_db.map(|d| bits1(wrap::<1>(d)));
            for (i, what) in ["gate", "up"].iter().enumerate() {
                assert_eq!(got_d[i], want_d[i], "d_{what} {name}");
                assert_eq!(got_db[i], want_db[i], "{what} bias gradient {name}");
                assert!(
                    got_d[i].iter().all(|&b| f64::from_bits(b).is_finite()),
                    "d_{what} {name}: not finite"
                );
                assert!(
                    got_db[i].iter().all(|&b| f64::from_bits(b).is_finite()),
                    "{what} bias gradient {name}: not finite"
                );
            }
            // Any number of rows in flight, a partial last group included: the same bits.
            for rows_in_flight in [1, 3] {
                let (d, db) = backward_and_bias_gradients_with(
                    rows_in_flight,
                    raw(gate.clone()),
                    raw(up.clone()),
                    biases(),
                    raw(grad.clone()),
                );
                let what = format!("{name}, {rows_in_flight} rows in flight");
                assert_eq!(d.map(|d| bits(wrap::<2>(d))), want_d, "derivatives {what}");
                assert_eq!(
                    db.map(|d| bits1(wrap::<1>(d))),
                    want_db,
                    "bias gradients {what}"
                );
            }
            // Through the backend, as the autodiff node calls it.
            let (d, db) = W::swiglu_backward_and_bias_gradients(
                gate.clone(),
                up.clone(),
                [gate_bias.clone(), up_bias.clone()],
                grad.clone(),
            );
            assert_eq!(d.map(bits), want_d, "backend derivatives {name}");
            assert_eq!(db.map(bits1), want_db, "backend bias gradients {name}");
        }
    }
}

/// SwiGLU (`ModelBackend::swiglu` and `swiglu_backward` on a CubeCL backend: one kernel each
/// way, with and without the projections' biases) against the Burn compositions in f32, for
/// f32 and f16 storage, on strided views read element by element and packed rows read as
/// vectors, with f32 gates far into both tails of the sigmoid. Under `Autodiff` the biases'
/// gradients are the column sums of the inputs' gradients.
#[test]
fn swiglu_equals_the_composition() {
    use burn_megatron::ops::swiglu::{add_swiglu_bias, swiglu_derivatives, swiglu_forward};
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, cols, extra) in [(1, 1, 3), (7, 300, 5), (9, 256, 0), (33, 129, 1)] {
            for with_bias in [false, true] {
                let view = |seed, scale| {
                    matrix(rows, cols + extra, seed, scale, &device)
                        .cast(dtype)
                        .narrow(1, 0, cols)
                };
                // f32 gates reach far into the sigmoid's tails; f16 ones stay where silu is
                // representable (silu(-40) ≈ -2e-16 is below f16's smallest subnormal).
                let gate_scale = if dtype == DType::F32 { 40.0 } else { 6.0 };
                let (gate, up, grad) = (view(81, gate_scale), view(82, 2.0), view(83, 1.0));
                let bias = with_bias.then(|| {
                    [
                        vector(cols, 84, 0.5, &device).cast(dtype),
                        vector(cols, 85, -0.5, &device).cast(dtype),
                    ]
                });
                let f32_of = |t: Tensor<W, 2>| t.cast(DType::F32);
                let bias32 = bias.clone().map(|b| b.map(|t| t.cast(DType::F32)));
                let (gate32, up32) =
                    add_swiglu_bias(f32_of(gate.clone()), f32_of(up.clone()), bias32);
                let want = swiglu_forward(gate32.clone(), up32.clone());
                let [want_gate, want_up] = swiglu_derivatives(gate32, up32, f32_of(grad.clone()));
                let got = W::swiglu(gate.clone(), up.clone(), bias.clone());
                let [got_gate, got_up] =
                    W::swiglu_backward(gate.clone(), up.clone(), bias.clone(), grad.clone());
                let name = format!("{dtype:?} {rows}x{cols} (+{extra}) bias {with_bias}");
                for (what, got, want) in [
                    ("forward", got, want),
                    ("d_gate", got_gate.clone(), want_gate),
                    ("d_up", got_up.clone(), want_up),
                ] {
                    assert_eq!(got.dtype(), dtype, "{what} {name}");
                    assert_close(
                        &format!("{what} {name}"),
                        &values(f32_of(got)),
                        &values(want),
                        bound,
                    );
                }
                let Some([gate_bias, up_bias]) = bias else {
                    continue;
                };
                // The autodiff node: the biases' gradients are the column sums of d_gate, d_up.
                type A = burn::backend::Autodiff<W>;
                let tracked = |t: Tensor<W, 1>| Tensor::<A, 1>::from_inner(t).require_grad();
                let (tracked_gate_bias, tracked_up_bias) = (tracked(gate_bias), tracked(up_bias));
                let y = A::swiglu(
                    Tensor::from_inner(gate),
                    Tensor::from_inner(up),
                    Some([tracked_gate_bias.clone(), tracked_up_bias.clone()]),
                );
                let grads = (y * Tensor::from_inner(grad)).sum().backward();
                for (what, tracked, d) in [
                    ("gate bias", tracked_gate_bias, got_gate),
                    ("up bias", tracked_up_bias, got_up),
                ] {
                    let want = f32_of(d).sum_dim(0).squeeze_dim::<1>(0);
                    let got = tracked.grad(&grads).expect("the bias has a gradient");
                    assert_close(
                        &format!("{what} gradient {name}"),
                        &values(got.cast(DType::F32)),
                        &values(want),
                        bound,
                    );
                }
            }
        }
    }
}

/// `ModelBackend::write_slot` (a gradient cast into its slot of the flat f32 buffer, one
/// kernel, in place) equals the cast + `slice_assign` composition bit for bit, for f32 and f16
/// values, packed and strided, at slot starts that are and are not whole vectors; elements
/// outside the slot keep their values; and a buffer someone else still holds is not written
/// through (the holder's copy is unchanged).
#[test]
fn write_slot_equals_the_composition_and_leaves_shared_buffers_alone() {
    use burn_megatron::ops::write_slot::write_slot_composition;
    let device = WgpuDevice::default();
    let numel = 64;
    let fresh =
        || Tensor::<W, 1>::from_data(TensorData::new(random(numel, 91, 1.0), [numel]), &device);
    for dtype in [DType::F32, DType::F16] {
        for (start, n, strided) in [
            (0, 16, false),
            (8, 24, false),
            (3, 7, false),
            (12, 10, true),
        ] {
            let name = format!("{dtype:?} {start}..{} strided {strided}", start + n);
            let values = if strided {
                matrix(n, 2, 92, 3.0, &device)
                    .cast(dtype)
                    .narrow(1, 0, 1)
                    .reshape([n])
            } else {
                vector(n, 92, 0.0, &device).cast(dtype)
            };
            let want = values_f32(write_slot_composition(fresh(), start, values.clone()));
            let got = values_f32(W::write_slot(fresh(), start, values.clone()));
            assert_eq!(got, want, "{name}");

            let buffer = fresh();
            let held = buffer.clone();
            let before = values_f32(held.clone());
            let got = values_f32(W::write_slot(buffer, start, values));
            assert_eq!(got, want, "{name}: shared buffer");
            assert_eq!(
                values_f32(held),
                before,
                "{name}: written through a shared buffer"
            );
        }
    }
}

/// `ModelBackend::bias_gradient` (the two-stage column sums) against exact f64 sums of the
/// stored values, for f32 and f16 `dy`: no rows, one row, row counts that are not multiples
/// of the 32-row blocks or that need more than 512 blocks, strided views read element by
/// element and packed rows read as vectors. Every element of the output is first poisoned
/// with NaN, and two runs give the same bits.
#[test]
fn bias_gradient_equals_exact_sums_and_is_deterministic() {
    use burn_megatron_kernels::fused::column_sum;
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        // (rows, columns, extra columns the view leaves out)
        for (rows, cols, extra) in [
            (0, 8, 0),
            (1, 1, 0),
            (70, 300, 0),
            (70, 300, 3),
            (33, 7, 1),
            (17_000, 12, 0),
        ] {
            let name = format!("{dtype:?} {rows}x{cols} (+{extra})");
            let dy = matrix(rows, cols + extra, 61, 2.0, &device)
                .cast(dtype)
                .narrow(1, 0, cols);
            let stored = values(dy.clone());
            let mut exact = vec![0.0f64; cols];
            for (i, v) in stored.iter().enumerate() {
                exact[i % cols] += v;
            }
            let got = W::bias_gradient(dy.clone());
            // (Burn's cast of an empty tensor keeps its dtype.)
            assert_eq!(got.dtype(), dy.dtype(), "{name}");
            let poisoned = raw(Tensor::<W, 1>::full([cols], f32::NAN, &device).cast(dy.dtype()));
            assert_close(
                &format!("bias gradient {name}"),
                &values(got.clone().cast(DType::F32)),
                &exact,
                bound,
            );
            column_sum::column_sums_into(raw(dy), None, Some(poisoned.clone()), None);
            let bits = |t: Tensor<W, 1>| -> Vec<u32> {
                values_f32(t.cast(DType::F32))
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(
                bits(wrap(poisoned)),
                bits(got),
                "{name}: a second run into a poisoned buffer gives other bits"
            );
        }
    }
}

/// Hidden sizes of the norm tests: one element, fewer than a cube's threads, not a multiple
/// of the block, and the widest rows (16k) the model takes.
const NORM_SHAPES: [(usize, usize); 5] = [(3, 1), (37, 7), (70, 300), (5, 4099), (3, 16_384)];

fn matrix(rows: usize, cols: usize, seed: u64, scale: f32, device: &WgpuDevice) -> Tensor<W, 2> {
    Tensor::<W, 2>::from_data(
        TensorData::new(random(rows * cols, seed, scale), [rows, cols]),
        device,
    )
}

fn vector(n: usize, seed: u64, offset: f32, device: &WgpuDevice) -> Tensor<W, 1> {
    Tensor::<W, 1>::from_data(TensorData::new(random(n, seed, 0.5), [n]), device).add_scalar(offset)
}

fn raw<const D: usize>(t: Tensor<W, D>) -> burn_cubecl::tensor::CubeTensor<WgpuRuntime> {
    t.into_primitive().tensor()
}

fn wrap<const D: usize>(t: burn_cubecl::tensor::CubeTensor<WgpuRuntime>) -> Tensor<W, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// LayerNorm and RMSNorm (`ModelBackend::norm_forward` and `norm_backward` on a CubeCL
/// backend: one kernel forward, three backward) against the Burn compositions in f32, for f32
/// and f16 storage, with and without a shift, on narrowed (strided) `x` and `dy` whose rows
/// are not packed, for rows of 1 to 16k elements and row counts that are not multiples of the
/// column stage's 32-row blocks. Every output is first poisoned with NaN, so an unwritten
/// element fails.
#[test]
fn norm_equals_the_composition_and_writes_every_element() {
    use burn_megatron::ops::NormKind;
    use burn_megatron::ops::norm::{backward_composition, forward_composition};
    use burn_megatron_kernels::fused::norm as kernels;
    let device = WgpuDevice::default();
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, hidden) in NORM_SHAPES {
            // A one-element RMSNorm row has `dx = dy · scale · rstd · eps / (x² + eps)`, the
            // difference of two nearly equal terms: with eps = 1e-5 it is f32 rounding noise
            // in any implementation, so that row gets an eps that keeps it well conditioned.
            let epsilon = if hidden == 1 { 0.1 } else { 1e-5 };
            // Burn slices in place only where the cut is aligned (else it copies): a start of
            // 0 and 128 dropped columns keep both views strided, which the asserts check.
            let x = matrix(rows, hidden + 128, 31, 4.0, &device)
                .add_scalar(1.5)
                .cast(dtype)
                .narrow(1, 0, hidden);
            let grad = matrix(rows, hidden + 128, 32, 1.0, &device)
                .cast(dtype)
                .narrow(1, 0, hidden);
            if rows > 1 {
                assert!(!raw(x.clone()).is_contiguous(), "x is a strided view");
                assert!(!raw(grad.clone()).is_contiguous(), "dy is a strided view");
            }
            let scale = vector(hidden, 33, 1.0, &device).cast(dtype);
            let shift = vector(hidden, 34, 0.0, &device).cast(dtype);
            let f32_of = |t: Tensor<W, 2>| t.cast(DType::F32);
            for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
                for with_shift in [true, false] {
                    let name = format!("{kind:?} {dtype:?} {rows}x{hidden} shift {with_shift}");
                    let shift = with_shift.then(|| shift.clone());
                    let want = forward_composition(
                        f32_of(x.clone()),
                        scale.clone().cast(DType::F32),
                        shift.clone().map(|s| s.cast(DType::F32)),
                        kind,
                        epsilon,
                    );
                    let got =
                        W::norm_forward(x.clone(), scale.clone(), shift.clone(), kind, epsilon);
                    assert_eq!(got.output.dtype(), dtype);
                    assert_eq!(got.rstd.dtype(), DType::F32);
                    assert_close(
                        &format!("output {name}"),
                        &values(got.output.cast(DType::F32)),
                        &values(want.output),
                        bound,
                    );
                    assert_close(
                        &format!("rstd {name}"),
                        &values(got.rstd.clone()),
                        &values(want.rstd.clone()),
                        tolerance::F32,
                    );
                    if kind == NormKind::LayerNorm {
                        assert_close(
                            &format!("mean {name}"),
                            &values(got.mean.clone()),
                            &values(want.mean.clone()),
                            tolerance::F32,
                        );
                    }

                    // Poisoned outputs, written by the kernels directly.
                    let nan = |shape: [usize; 2], dtype| {
                        Tensor::<W, 2>::full(shape, f32::NAN, &device).cast(dtype)
                    };
                    let poisoned = kernels::Forward {
                        output: raw(nan([rows, hidden], dtype)),
                        mean: raw(nan([1, rows], DType::F32).reshape([rows])),
                        rstd: raw(nan([1, rows], DType::F32).reshape([rows])),
                    };
                    let kernel_kind = match kind {
                        NormKind::LayerNorm => kernels::Kind::LayerNorm,
                        NormKind::RmsNorm => kernels::Kind::RmsNorm,
                    };
                    let (output, mean, rstd) = (
                        poisoned.output.clone(),
                        poisoned.mean.clone(),
                        poisoned.rstd.clone(),
                    );
                    kernels::forward_into(
                        raw(x.clone()),
                        raw(scale.clone()),
                        shift.clone().map(raw),
                        kernel_kind,
                        epsilon,
                        poisoned,
                    );
                    assert_close(
                        &format!("poisoned output {name}"),
                        &values(wrap::<2>(output).cast(DType::F32)),
                        &values(
                            forward_composition(
                                f32_of(x.clone()),
                                scale.clone().cast(DType::F32),
                                shift.clone().map(|s| s.cast(DType::F32)),
                                kind,
                                epsilon,
                            )
                            .output,
                        ),
                        bound,
                    );
                    assert_close(
                        &format!("poisoned rstd {name}"),
                        &values(wrap::<1>(rstd)),
                        &values(want.rstd.clone()),
                        tolerance::F32,
                    );
                    // RMSNorm's mean is zero; the kernel writes it all the same.
                    assert_eq!(
                        values(wrap::<1>(mean))
                            .iter()
                            .map(|m| m.is_finite())
                            .collect::<Vec<_>>(),
                        vec![true; rows],
                        "{name}: every mean is written"
                    );

                    let want_grads = backward_composition(
                        f32_of(x.clone()),
                        scale.clone().cast(DType::F32),
                        want.mean.clone(),
                        want.rstd.clone(),
                        f32_of(grad.clone()),
                        kind,
                        with_shift,
                    );
                    let poisoned = kernels::Gradients {
                        x: raw(nan([rows, hidden], dtype)),
                        scale: raw(nan([1, hidden], DType::F32).reshape([hidden])),
                        shift: with_shift
                            .then(|| raw(nan([1, hidden], DType::F32).reshape([hidden]))),
                    };
                    let (gx, gscale, gshift) = (
                        poisoned.x.clone(),
                        poisoned.scale.clone(),
                        poisoned.shift.clone(),
                    );
                    kernels::backward_into(
                        raw(x.clone()),
                        raw(scale.clone()),
                        raw(got.mean.clone()),
                        raw(got.rstd.clone()),
                        raw(grad.clone()),
                        kernel_kind,
                        poisoned,
                    );
                    let got_grads = W::norm_backward(
                        x.clone(),
                        scale.clone(),
                        got.mean,
                        got.rstd,
                        grad.clone(),
                        kind,
                        with_shift,
                    );
                    assert_eq!(got_grads.x.dtype(), dtype);
                    assert_eq!(got_grads.scale.dtype(), dtype);
                    for (what, got, want) in [
                        (
                            "dx",
                            values(wrap::<2>(gx).cast(DType::F32)),
                            values(want_grads.x.clone()),
                        ),
                        (
                            "dx (hook)",
                            values(got_grads.x.cast(DType::F32)),
                            values(want_grads.x),
                        ),
                        (
                            "dscale",
                            values(wrap::<1>(gscale)),
                            values(want_grads.scale.clone()),
                        ),
                        (
                            "dscale (hook)",
                            values(got_grads.scale.cast(DType::F32)),
                            values(want_grads.scale),
                        ),
                    ] {
                        assert_close(&format!("{what} {name}"), &got, &want, bound);
                    }
                    match (gshift, got_grads.shift, want_grads.shift) {
                        (Some(kernel), Some(hook), Some(want)) => {
                            assert_close(
                                &format!("dshift {name}"),
                                &values(wrap::<1>(kernel)),
                                &values(want.clone()),
                                bound,
                            );
                            assert_close(
                                &format!("dshift (hook) {name}"),
                                &values(hook.cast(DType::F32)),
                                &values(want),
                                bound,
                            );
                        }
                        (None, None, None) => assert!(!with_shift),
                        _ => panic!("{name}: a shift gradient only with a shift"),
                    }
                }
            }
        }
    }
}

/// The norm kernels against the formulas evaluated in f64 on the host, for a small LayerNorm
/// with a shift and an RMSNorm: output, `dx`, `dscale` and `dshift`.
#[test]
fn norm_kernels_equal_exact_f64_values() {
    use burn_megatron::ops::NormKind;
    let device = WgpuDevice::default();
    let (rows, hidden, epsilon) = (5, 9, 1e-5);
    let x = matrix(rows, hidden, 41, 3.0, &device).add_scalar(2.0);
    let grad = matrix(rows, hidden, 42, 1.0, &device);
    let scale = vector(hidden, 43, 1.0, &device);
    let shift = vector(hidden, 44, 0.0, &device);
    let (xs, gs, ss, bs) = (
        values(x.clone()),
        values(grad.clone()),
        values(scale.clone()),
        values(shift.clone()),
    );
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        let n = hidden as f64;
        let (mut y, mut dx) = (vec![], vec![]);
        let (mut dscale, mut dshift) = (vec![0.0; hidden], vec![0.0; hidden]);
        for r in 0..rows {
            let row = &xs[r * hidden..(r + 1) * hidden];
            let dy = &gs[r * hidden..(r + 1) * hidden];
            let mean = match kind {
                NormKind::LayerNorm => row.iter().sum::<f64>() / n,
                NormKind::RmsNorm => 0.0,
            };
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            let rstd = 1.0 / (var + epsilon).sqrt();
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
            let g: Vec<f64> = (0..hidden).map(|j| dy[j] * ss[j]).collect();
            let mean_g = match kind {
                NormKind::LayerNorm => g.iter().sum::<f64>() / n,
                NormKind::RmsNorm => 0.0,
            };
            let mean_gx = (0..hidden).map(|j| g[j] * xhat[j]).sum::<f64>() / n;
            for j in 0..hidden {
                y.push(xhat[j] * ss[j] + bs[j]);
                dx.push(rstd * (g[j] - mean_g - xhat[j] * mean_gx));
                dscale[j] += dy[j] * xhat[j];
                dshift[j] += dy[j];
            }
        }
        let forward = W::norm_forward(x.clone(), scale.clone(), Some(shift.clone()), kind, epsilon);
        let grads = W::norm_backward(
            x.clone(),
            scale.clone(),
            forward.mean,
            forward.rstd,
            grad.clone(),
            kind,
            true,
        );
        let name = |what: &str| format!("{kind:?} {what} against f64");
        assert_close(&name("output"), &values(forward.output), &y, tolerance::F32);
        assert_close(&name("dx"), &values(grads.x), &dx, tolerance::F32);
        assert_close(
            &name("dscale"),
            &values(grads.scale),
            &dscale,
            tolerance::F32,
        );
        assert_close(
            &name("dshift"),
            &values(grads.shift.expect("asked for")),
            &dshift,
            tolerance::F32,
        );
    }
}

/// `dscale` and `dshift` come from a fixed-order two-stage sum, not atomics: two runs on the
/// same inputs give the same bits (1000 rows: 32 blocks of partial sums).
/// Every shape of the column sums' two stages (`ColumnSumLayout`: row lanes, loads in flight,
/// block sizes, second-stage lanes, CubeCL's bounds checks; `kernel_bench column_sum_layouts`
/// picks the default among them) gives the exact sums of `dy` and of `dy · x̂`, on strided views, with blocks that end
/// inside a group of loads, with columns past the last cube's, and with no rows.
#[test]
fn column_sum_layouts_all_give_the_exact_sums() {
    use burn_megatron_kernels::fused::column_sum::{
        ColumnSumLayout, Normalised, column_sums_into_with,
    };
    let device = WgpuDevice::default();
    let layouts = [
        ColumnSumLayout::default(),
        ColumnSumLayout {
            checked: false,
            ..ColumnSumLayout::default()
        },
        ColumnSumLayout {
            column_vectors: 32,
            row_lanes: 8,
            loads_in_flight: 4,
            min_rows_per_block: 8,
            max_blocks: 512,
            total_columns: 16,
            total_lanes: 16,
            checked: true,
        },
        ColumnSumLayout {
            column_vectors: 64,
            row_lanes: 4,
            loads_in_flight: 2,
            min_rows_per_block: 128,
            max_blocks: 4,
            total_columns: 4,
            total_lanes: 64,
            checked: false,
        },
        ColumnSumLayout {
            column_vectors: 16,
            row_lanes: 2,
            loads_in_flight: 3,
            min_rows_per_block: 7,
            max_blocks: 512,
            total_columns: 32,
            total_lanes: 8,
            checked: false,
        },
    ];
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, cols, extra) in [(0, 8, 0), (1, 1, 0), (70, 300, 3), (1000, 260, 0)] {
            let dy = matrix(rows, cols + extra, 62, 2.0, &device)
                .cast(dtype)
                .narrow(1, 0, cols);
            let x = matrix(rows, cols, 63, 3.0, &device).cast(dtype);
            let mean = vector(rows, 64, 0.5, &device);
            let rstd = vector(rows, 65, 1.5, &device);
            let (dy_v, x_v) = (values(dy.clone()), values(x.clone()));
            let (mean_v, rstd_v) = (values(mean.clone()), values(rstd.clone()));
            let mut exact_dy = vec![0.0f64; cols];
            let mut exact_dyx = vec![0.0f64; cols];
            for (i, g) in dy_v.iter().enumerate() {
                let (row, col) = (i / cols, i % cols);
                exact_dy[col] += g;
                exact_dyx[col] += g * (x_v[i] - mean_v[row]) * rstd_v[row];
            }
            for (l, layout) in layouts.iter().enumerate() {
                let name = format!("{dtype:?} {rows}x{cols} (+{extra}) layout {l}");
                let poisoned = || raw(Tensor::<W, 1>::full([cols], f32::NAN, &device));
                let (sum_dy, sum_dyx) = (poisoned(), poisoned());
                let normalised = Normalised {
                    x: raw(x.clone()),
                    mean: raw(mean.clone()),
                    rstd: raw(rstd.clone()),
                    centred: true,
                };
                column_sums_into_with(
                    *layout,
                    raw(dy.clone()),
                    Some(normalised),
                    Some(sum_dy.clone()),
                    Some(sum_dyx.clone()),
                );
                assert_close(
                    &format!("Σ dy {name}"),
                    &values(wrap::<1>(sum_dy)),
                    &exact_dy,
                    bound,
                );
                assert_close(
                    &format!("Σ dy·x̂ {name}"),
                    &values(wrap::<1>(sum_dyx)),
                    &exact_dyx,
                    bound,
                );
            }
        }
    }
}

/// The norm backward's work layouts (`NormBackwardLayout`: bytes a thread, blocks, the second
/// stage's shape, CubeCL's bounds checks) give the default layout's gradients, with the last
/// block ending inside the rows and rows shorter than a thread group; the bounds checks alone
/// give its bits.
#[test]
fn norm_backward_layouts_agree() {
    use burn_megatron_kernels::fused::norm::{self, Kind, NormBackwardLayout};
    let device = WgpuDevice::default();
    let layouts = [
        NormBackwardLayout {
            totals: burn_megatron_kernels::fused::column_sum::ColumnSumLayout {
                total_columns: 32,
                total_lanes: 8,
                ..Default::default()
            },
            ..NormBackwardLayout::default()
        },
        NormBackwardLayout {
            bytes_per_thread: 16,
            target_threads: 1 << 10,
            rows_per_block: (3, 5),
            ..NormBackwardLayout::default()
        },
        NormBackwardLayout {
            bytes_per_thread: 64,
            target_threads: 1 << 12,
            rows_per_block: (1, 200),
            ..NormBackwardLayout::default()
        },
        NormBackwardLayout {
            checked: true,
            ..NormBackwardLayout::default()
        },
    ];
    let default = NormBackwardLayout::default();
    // CubeCL's bounds checks change no arithmetic: that layout gives the default's bits.
    let same_bits = |layout: &NormBackwardLayout| {
        NormBackwardLayout {
            checked: false,
            ..*layout
        } == default
    };
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, hidden) in [(1, 3), (37, 7), (301, 300), (9, 4099)] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                let x = matrix(rows, hidden, 66, 3.0, &device).cast(dtype);
                let grad = matrix(rows, hidden, 67, 1.0, &device).cast(dtype);
                let scale = vector(hidden, 68, 1.0, &device).cast(dtype);
                let stats = norm::forward(raw(x.clone()), raw(scale.clone()), None, kind, 1e-5);
                let run = |layout: NormBackwardLayout| {
                    let g = norm::backward_with(
                        layout,
                        raw(x.clone()),
                        raw(scale.clone()),
                        stats.mean.clone(),
                        stats.rstd.clone(),
                        raw(grad.clone()),
                        kind,
                        true,
                    );
                    [
                        values(wrap::<2>(g.x).cast(DType::F32)),
                        values(wrap::<1>(g.scale)),
                        values(wrap::<1>(g.shift.expect("asked for"))),
                    ]
                };
                let want = run(NormBackwardLayout::default());
                for (l, layout) in layouts.iter().enumerate() {
                    let got = run(*layout);
                    if same_bits(layout) {
                        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        for (what, (got, want)) in
                            ["dx", "dscale", "dshift"].iter().zip(got.iter().zip(&want))
                        {
                            assert_eq!(
                                bits(got),
                                bits(want),
                                "{what} {kind:?} {dtype:?} {rows}x{hidden} layout {l}: not the default's bits"
                            );
                        }
                    }
                    for (what, got, want) in ["dx", "dscale", "dshift"]
                        .iter()
                        .zip(&got)
                        .zip(&want)
                        .map(|((w, g), v)| (w, g, v))
                    {
                        assert_close(
                            &format!("{what} {kind:?} {dtype:?} {rows}x{hidden} layout {l}"),
                            got,
                            want,
                            bound,
                        );
                    }
                }
            }
        }
    }
}

/// The norm forward's work layouts (`NormForwardLayout`: elements a thread, threads a cube,
/// CubeCL's bounds checks) give the default layout's output and statistics, into poisoned
/// outputs, with rows shorter than a thread group and longer than a cube; the bounds checks
/// alone give its bits.
#[test]
fn norm_forward_layouts_agree() {
    use burn_megatron_kernels::fused::norm::{self, Forward, Kind, NormForwardLayout};
    let device = WgpuDevice::default();
    let default = NormForwardLayout::default();
    let layouts = [
        NormForwardLayout {
            elements_per_thread: 8,
            cube_threads: 512,
            ..default
        },
        NormForwardLayout {
            elements_per_thread: 64,
            cube_threads: 128,
            checked: true,
        },
        NormForwardLayout {
            checked: true,
            ..default
        },
    ];
    for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
        for (rows, hidden) in [(1, 3), (37, 7), (301, 300), (9, 4099)] {
            for kind in [Kind::LayerNorm, Kind::RmsNorm] {
                let x = matrix(rows, hidden, 76, 3.0, &device).cast(dtype);
                let scale = vector(hidden, 77, 1.0, &device).cast(dtype);
                let shift = vector(hidden, 78, 0.5, &device).cast(dtype);
                let run = |layout: NormForwardLayout| {
                    let nan = |shape: [usize; 2], dtype| {
                        Tensor::<W, 2>::full(shape, f32::NAN, &device).cast(dtype)
                    };
                    let out = Forward {
                        output: raw(nan([rows, hidden], dtype)),
                        mean: raw(nan([1, rows], DType::F32).reshape([rows])),
                        rstd: raw(nan([1, rows], DType::F32).reshape([rows])),
                    };
                    let (output, mean, rstd) =
                        (out.output.clone(), out.mean.clone(), out.rstd.clone());
                    norm::forward_into_with(
                        layout,
                        raw(x.clone()),
                        raw(scale.clone()),
                        Some(raw(shift.clone())),
                        kind,
                        1e-5,
                        out,
                    );
                    [
                        values(wrap::<2>(output).cast(DType::F32)),
                        values(wrap::<1>(mean)),
                        values(wrap::<1>(rstd)),
                    ]
                };
                let want = run(default);
                for (l, layout) in layouts.iter().enumerate() {
                    let got = run(*layout);
                    let same_bits = NormForwardLayout {
                        checked: false,
                        ..*layout
                    } == default;
                    for (what, (got, want)) in
                        ["output", "mean", "rstd"].iter().zip(got.iter().zip(&want))
                    {
                        let name = format!("{what} {kind:?} {dtype:?} {rows}x{hidden} layout {l}");
                        assert!(got.iter().all(|v| v.is_finite()), "{name}: not finite");
                        if same_bits {
                            let bits =
                                |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(got), bits(want), "{name}: not the default's bits");
                        } else {
                            assert_close(&name, got, want, bound);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn norm_parameter_gradients_are_deterministic() {
    use burn_megatron::ops::NormKind;
    let device = WgpuDevice::default();
    let (rows, hidden) = (1000, 300);
    let x = matrix(rows, hidden, 51, 3.0, &device);
    let grad = matrix(rows, hidden, 52, 1.0, &device);
    let scale = vector(hidden, 53, 1.0, &device);
    let forward = W::norm_forward(x.clone(), scale.clone(), None, NormKind::LayerNorm, 1e-5);
    let run = || {
        let g = W::norm_backward(
            x.clone(),
            scale.clone(),
            forward.mean.clone(),
            forward.rstd.clone(),
            grad.clone(),
            NormKind::LayerNorm,
            true,
        );
        let bits = |t: Tensor<W, 1>| -> Vec<u32> {
            t.into_data()
                .to_vec::<f32>()
                .expect("f32")
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        (bits(g.scale), bits(g.shift.expect("asked for")))
    };
    let (first, second) = (run(), run());
    assert!(first.0.iter().all(|v| f32::from_bits(*v).is_finite()));
    let differing = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(a, b)| a != b).count();
    assert_eq!(
        (
            differing(&first.0, &second.0),
            differing(&first.1, &second.1)
        ),
        (0, 0),
        "elements of (dscale, dshift) that differ between two runs"
    );
}

/// One flash-attention problem: `q: [batch, heads, seq_q, head_dim]`, `k, v: [batch,
/// kv_heads, seq_k, head_dim]`.
#[derive(Debug, Clone, Copy)]
struct Attention {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    causal: bool,
}

impl Attention {
    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// Whether query `i` sees key `j`.
    fn sees(&self, i: usize, j: usize) -> bool {
        !self.causal || j <= i
    }

    /// The kv head and key row `j`'s offset for query head `h` of batch `b`.
    fn key(&self, b: usize, h: usize, j: usize) -> usize {
        let kv = h / (self.heads / self.kv_heads);
        ((b * self.kv_heads + kv) * self.seq_k + j) * self.head_dim
    }

    fn query(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.heads + h) * self.seq_q + i) * self.head_dim
    }

    /// The probabilities `p[j]` of query row `(b, h, i)` and their log-sum-exp, in f64.
    fn probabilities(&self, q: &[f64], k: &[f64], b: usize, h: usize, i: usize) -> (Vec<f64>, f64) {
        let d = self.head_dim;
        let qi = &q[self.query(b, h, i)..][..d];
        let scores: Vec<f64> = (0..self.seq_k)
            .map(|j| {
                let kj = &k[self.key(b, h, j)..][..d];
                qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * self.scale()
            })
            .collect();
        let max = (0..self.seq_k)
            .filter(|&j| self.sees(i, j))
            .map(|j| scores[j])
            .fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = (0..self.seq_k)
            .filter(|&j| self.sees(i, j))
            .map(|j| (scores[j] - max).exp())
            .sum();
        let lse = max + sum.ln();
        let p = (0..self.seq_k)
            .map(|j| {
                if self.sees(i, j) {
                    (scores[j] - lse).exp()
                } else {
                    0.0
                }
            })
            .collect();
        (p, lse)
    }

    /// The output and `lse`, exact (f64) for the given inputs.
    fn exact_forward(&self, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let d = self.head_dim;
        let mut out = vec![0.0; q.len()];
        let mut lses = Vec::new();
        for b in 0..self.batch {
            for h in 0..self.heads {
                for i in 0..self.seq_q {
                    let (p, lse) = self.probabilities(q, k, b, h, i);
                    lses.push(lse);
                    let o = self.query(b, h, i);
                    for (j, pj) in p.iter().enumerate() {
                        let vj = self.key(b, h, j);
                        for x in 0..d {
                            out[o + x] += pj * v[vj + x];
                        }
                    }
                }
            }
        }
        (out, lses)
    }

    /// `[dq, dk, dv]`, exact (f64) for the given inputs, with `delta = rowsum(dO ∘ out)` of
    /// the given output (as the kernels take it).
    fn exact_backward(&self, [q, k, v, out, grad]: [&[f64]; 5]) -> [Vec<f64>; 3] {
        let d = self.head_dim;
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        for b in 0..self.batch {
            for h in 0..self.heads {
                for i in 0..self.seq_q {
                    let (p, _) = self.probabilities(q, k, b, h, i);
                    let qi = self.query(b, h, i);
                    let delta: f64 = (0..d).map(|x| grad[qi + x] * out[qi + x]).sum();
                    for (j, pj) in p.iter().enumerate() {
                        let kj = self.key(b, h, j);
                        let dp: f64 = (0..d).map(|x| grad[qi + x] * v[kj + x]).sum();
                        let ds = pj * (dp - delta);
                        for x in 0..d {
                            dq[qi + x] += self.scale() * ds * k[kj + x];
                            dk[kj + x] += self.scale() * ds * q[qi + x];
                            dv[kj + x] += pj * grad[qi + x];
                        }
                    }
                }
            }
        }
        [dq, dk, dv]
    }
}

/// `[batch, heads, seq, head_dim]` random values of `dtype` as a strided view (`swap_dims` of
/// a `[batch, seq, heads, head_dim]` tensor, or a `narrow` of a wider one then `swap_dims`),
/// or contiguous.
fn attention_input(
    shape: [usize; 4],
    seed: u64,
    scale: f32,
    dtype: DType,
    layout: usize,
    device: &WgpuDevice,
) -> Tensor<W, 4> {
    let [b, h, s, d] = shape;
    match layout {
        0 => random_4d(shape, seed, scale, dtype, device),
        1 => random_4d([b, s, h, d], seed, scale, dtype, device).swap_dims(1, 2),
        _ => random_4d([b, s, h, 2 * d + 3], seed, scale, dtype, device)
            .narrow(3, d + 1, d)
            .swap_dims(1, 2),
    }
}

/// The portable flash-attention kernels against exact f64 math on the host (computed from
/// the inputs as stored): output, `lse`, and `dq`, `dk`, `dv` in f32 and f16, causal and not,
/// a single position, lengths that are not multiples of the 64-row cube (37, 130), head_dim
/// 5, 8, 64, 128 and 256, GQA (4 heads on 2 and on 1 kv heads), contiguous and strided
/// views (`swap_dims`, `narrow`).
#[test]
fn flash_attention_kernels_equal_exact_f64_values() {
    use burn_megatron_kernels::fused::flash_attention as flash;
    let device = WgpuDevice::default();
    let case = |batch, heads, kv_heads, seq_q, seq_k, head_dim, causal| Attention {
        batch,
        heads,
        kv_heads,
        seq_q,
        seq_k,
        head_dim,
        causal,
    };
    // Each (head_dim, causal, dtype) compiles its own kernels, slowly on lavapipe (about 10 s
    // each way): the cases share them.
    let cases = [
        case(1, 1, 1, 1, 1, 64, true),
        case(1, 2, 1, 1, 1, 128, false),
        case(2, 4, 2, 37, 37, 64, true),
        case(1, 4, 1, 130, 130, 128, true),
        case(2, 2, 2, 37, 70, 8, false),
        case(1, 4, 2, 5, 1, 64, false),
        case(1, 4, 2, 70, 9, 128, false),
        case(1, 2, 1, 9, 9, 5, true),
        case(1, 2, 2, 20, 20, 256, true),
        case(1, 4, 4, 130, 37, 128, false),
    ];
    let mut worst = [0.0f64; 5];
    for (n, problem) in cases.into_iter().enumerate() {
        for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
            let Attention {
                batch,
                heads,
                kv_heads,
                seq_q,
                seq_k,
                head_dim,
                causal,
            } = problem;
            let layout = n % 3;
            let label = |what: &str| format!("{dtype:?} {problem:?} layout {layout}: {what}");
            let q_shape = [batch, heads, seq_q, head_dim];
            let kv_shape = [batch, kv_heads, seq_k, head_dim];
            let seed = 100 * n as u64;
            let q = attention_input(q_shape, seed, 2.0, dtype, layout, &device);
            let k = attention_input(kv_shape, seed + 1, 2.0, dtype, layout, &device);
            let v = attention_input(kv_shape, seed + 2, 1.0, dtype, layout, &device);
            let options = flash::AttentionOptions {
                scale: problem.scale() as f32,
                causal,
            };
            let [qh, kh, vh] = [&q, &k, &v].map(|t| values(t.clone()));
            let (want_out, want_lse) = problem.exact_forward(&qh, &kh, &vh);

            // Freed NaN buffers of the outputs' sizes, so that the pool likely hands the
            // kernels poisoned memory: an element they do not write fails the comparison.
            drop(poisoned(q_shape, dtype, &device));
            let (out, lse) =
                flash::forward(raw4(q.clone()), raw4(k.clone()), raw4(v.clone()), options);
            let out = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(out));
            let lse = Tensor::<W, 3>::from_primitive(TensorPrimitive::Float(lse));
            assert_eq!(out.dtype(), dtype);
            assert_eq!(lse.dtype(), DType::F32);
            assert_eq!(out.dims(), q_shape);
            assert_eq!(lse.dims(), [batch, heads, seq_q]);
            let out_diff = assert_close(&label("output"), &values(out), &want_out, bound);
            let lse_diff = assert_close(&label("lse"), &values(lse), &want_lse, tolerance::F32);
            if dtype == DType::F32 {
                worst[0] = worst[0].max(out_diff);
                worst[1] = worst[1].max(lse_diff);
            }

            // The backward from the exact output (in the dtype) and lse, and a strided dO.
            let out = attention_input(q_shape, 0, 0.0, dtype, layout, &device)
                + Tensor::<W, 4>::from_data(TensorData::new(want_out.clone(), q_shape), &device)
                    .cast(dtype);
            let lse = Tensor::<W, 3>::from_data(
                TensorData::new(want_lse.clone(), [batch, heads, seq_q]),
                (&device, DType::F32),
            );
            let grad = attention_input(q_shape, seed + 3, 1.0, dtype, (layout + 1) % 3, &device);
            let [oh, gh] = [&out, &grad].map(|t| values(t.clone()));
            let want = problem.exact_backward([&qh, &kh, &vh, &oh, &gh]);
            drop(poisoned(kv_shape, dtype, &device));
            let got = flash::backward(
                raw4(q),
                raw4(k),
                raw4(v),
                raw4(out),
                lse.into_primitive().tensor(),
                raw4(grad),
                options,
            );
            for (i, (name, got, want)) in ["dq", "dk", "dv"]
                .into_iter()
                .zip(got)
                .zip(want)
                .map(|((name, got), want)| (name, got, want))
                .enumerate()
            {
                let got = Tensor::<W, 4>::from_primitive(TensorPrimitive::Float(got));
                assert_eq!(got.dtype(), dtype, "{}", label(name));
                let shape = if name == "dq" { q_shape } else { kv_shape };
                assert_eq!(got.dims(), shape, "{}", label(name));
                let got = values(got);
                if name != "dv" && seq_k == 1 {
                    // One key: the probabilities are constant, dq and dk are zero.
                    let largest = got.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                    assert!(largest < 1e-5, "{}: {largest:e} should be 0", label(name));
                    continue;
                }
                let diff = assert_close(&label(name), &got, &want, bound);
                if dtype == DType::F32 {
                    worst[2 + i] = worst[2 + i].max(diff);
                }
            }
        }
    }
    eprintln!(
        "flash attention f32: worst relative difference out {:.1e}, lse {:.1e}, dq {:.1e}, dk \
         {:.1e}, dv {:.1e}",
        worst[0], worst[1], worst[2], worst[3], worst[4]
    );
}

/// The backend's operation on wgpu (the kernels) against the Burn composition on the same
/// device, through `ModelBackend` and under `Autodiff<W>`: output and the three gradients, in
/// f32 with GQA.
#[test]
fn flash_attention_op_equals_the_composition() {
    use burn::backend::Autodiff;
    use burn_megatron::ops::flash_attention::{
        attention, backward_composition, forward_composition,
    };
    let device = WgpuDevice::default();
    for (shape, kv_heads, causal) in [([2, 4, 37, 16], 2, true), ([1, 4, 9, 8], 1, false)] {
        let [batch, _, seq, head_dim] = shape;
        let kv_shape = [batch, kv_heads, seq, head_dim];
        let scale = 1.0 / (head_dim as f64).sqrt();
        let q = random_4d(shape, 1, 2.0, DType::F32, &device);
        let k = random_4d(kv_shape, 2, 2.0, DType::F32, &device);
        let v = random_4d(kv_shape, 3, 1.0, DType::F32, &device);
        let grad = random_4d(shape, 4, 1.0, DType::F32, &device);
        let label = |what: &str| format!("{shape:?} kv_heads {kv_heads} causal {causal}: {what}");

        let (want_out, want_lse) =
            forward_composition(q.clone(), k.clone(), v.clone(), scale, causal);
        let (out, lse) = W::flash_attention(q.clone(), k.clone(), v.clone(), scale, causal);
        assert_close(
            &label("output"),
            &values(out.clone()),
            &values(want_out.clone()),
            tolerance::F32,
        );
        assert_close(
            &label("lse"),
            &values(lse.clone()),
            &values(want_lse.clone()),
            tolerance::F32,
        );
        let want = backward_composition(
            q.clone(),
            k.clone(),
            v.clone(),
            want_out,
            want_lse,
            grad.clone(),
            scale,
            causal,
        );

        let track =
            |t: &Tensor<W, 4>| Tensor::<Autodiff<W>, 4>::from_inner(t.clone()).require_grad();
        let (tq, tk, tv) = (track(&q), track(&k), track(&v));
        let y = attention(tq.clone(), tk.clone(), tv.clone(), scale, causal);
        let grads = (y * Tensor::from_inner(grad)).sum().backward();
        for (name, tracked, want) in [
            ("dq", tq, &want[0]),
            ("dk", tk, &want[1]),
            ("dv", tv, &want[2]),
        ] {
            assert_close(
                &label(name),
                &values(tracked.grad(&grads).expect("a gradient")),
                &values(want.clone()),
                tolerance::F32,
            );
        }
    }
}

/// Flash attention on a packed `[batch, seq, groups, heads_per_group + 2, head_dim]` QKV on
/// wgpu: q, k and v read as views of the buffer (where q has one head stride and WebGPU's
/// binding-offset alignment allows the offsets), else split by Burn. Against Burn's split and
/// the flash-attention composition on the same device: the output (`[batch, seq, heads,
/// head_dim]`), `lse` and `dqkv`, through `ModelBackend`, under `Autodiff<W>` (one node), and
/// through the kernels into NaN-poisoned buffers (output, one `dqkv`), so an element nobody
/// writes fails. MHA and MQA with 256-byte rows (views), GQA (no single head stride), and MHA
/// with 32- and 20-byte rows (views only where the device allows such binding offsets:
/// lavapipe's alignment is 32 bytes, so 20-byte rows take Burn's split), causal and not.
#[test]
fn packed_flash_attention_through_views_equals_the_composition() {
    use burn::backend::Autodiff;
    use burn_megatron::ops::flash_attention::{backward_composition, forward_composition};
    use burn_megatron::ops::packed_flash_attention::{assemble, attention, split};
    use burn_megatron_kernels::fused::flash_attention::{self as flash, packed};
    let device = WgpuDevice::default();
    let offsets = packed::ViewOffsets::MemoryAlignment;
    let mut viewed = 0;
    for (batch, seq, groups, per_group, head_dim, causal) in [
        (2, 37, 3, 1, 64, true),
        (1, 20, 1, 3, 64, false),
        (1, 9, 2, 2, 64, true),
        (1, 9, 2, 1, 8, false),
        (1, 9, 2, 1, 5, true),
    ] {
        let shape = [batch, seq, groups, per_group + 2, head_dim];
        let out_shape = [batch, seq, groups * per_group, head_dim];
        let scale = 1.0 / (head_dim as f64).sqrt();
        let label = |what: &str| format!("{shape:?} causal {causal}: {what}");
        let qkv = Tensor::<W, 5>::from_data(
            TensorData::new(random(shape.iter().product(), 11, 2.0), shape),
            &device,
        );
        let grad = random_4d(out_shape, 12, 1.0, DType::F32, &device);

        let [q, k, v] = split(qkv.clone());
        let (want_out, want_lse) =
            forward_composition(q.clone(), k.clone(), v.clone(), scale, causal);
        let [dq, dk, dv] = backward_composition(
            q,
            k,
            v,
            want_out.clone(),
            want_lse.clone(),
            grad.clone().swap_dims(1, 2),
            scale,
            causal,
        );
        let want_dqkv = values(assemble(dq, dk, dv));
        let (want_out, want_lse) = (values(want_out.swap_dims(1, 2)), values(want_lse));

        let alignment = raw(qkv.clone()).client.properties().memory.alignment as usize;
        let row = head_dim * 4;
        let views = (per_group == 1 || groups == 1)
            && (per_group * row).is_multiple_of(alignment)
            && ((per_group + 1) * row).is_multiple_of(alignment);
        assert_eq!(
            packed::views(&raw(qkv.clone()), offsets).is_some(),
            views,
            "{}",
            label(&format!("views (memory alignment {alignment})"))
        );
        viewed += usize::from(views);
        println!(
            "{}",
            label(&format!("views {views} (memory alignment {alignment})"))
        );

        let (out, lse) = W::packed_flash_attention(qkv.clone(), scale, causal);
        assert_eq!(out.dims(), out_shape);
        assert_close(
            &label("output"),
            &values(out.clone()),
            &want_out,
            tolerance::F32,
        );
        assert_close(
            &label("lse"),
            &values(lse.clone()),
            &want_lse,
            tolerance::F32,
        );
        let dqkv =
            W::packed_flash_attention_backward(qkv.clone(), out, lse, grad.clone(), scale, causal);
        assert_eq!(dqkv.dims(), shape);
        assert_close(&label("dqkv"), &values(dqkv), &want_dqkv, tolerance::F32);

        let tracked = Tensor::<Autodiff<W>, 5>::from_inner(qkv.clone()).require_grad();
        let y = attention(tracked.clone(), scale, causal);
        let grads = (y * Tensor::from_inner(grad.clone())).sum().backward();
        assert_close(
            &label("dqkv under autodiff"),
            &values(tracked.grad(&grads).expect("qkv has a gradient")),
            &want_dqkv,
            tolerance::F32,
        );

        if views {
            let options = flash::AttentionOptions {
                scale: scale as f32,
                causal,
            };
            let [q, k, v] = packed::views(&raw(qkv.clone()), offsets).expect("views");
            let out = poisoned(out_shape, DType::F32, &device);
            let heads_major = |t: &Tensor<W, 4>| raw4(t.clone().swap_dims(1, 2));
            let lse =
                flash::forward_into(q.clone(), k.clone(), v.clone(), heads_major(&out), options);
            assert_close(
                &label("output into a poisoned buffer"),
                &values(out.clone()),
                &want_out,
                tolerance::F32,
            );
            let dqkv = Tensor::<W, 5>::full(shape, f32::NAN, &device);
            let grads = packed::views(&raw(dqkv.clone()), offsets).expect("views of dqkv");
            flash::backward_into(
                q,
                k,
                v,
                heads_major(&out),
                lse,
                heads_major(&grad),
                grads,
                options,
            );
            assert_close(
                &label("dqkv into a poisoned buffer"),
                &values(dqkv),
                &want_dqkv,
                tolerance::F32,
            );
        }
    }
    assert!(viewed >= 2, "only {viewed} cases ran through views");
}

/// Ids in `0..vocab` with repeats (a few ids far more often than the rest, as in text), the
/// first and last id of the vocabulary included.
fn token_ids(tokens: usize, vocab: usize, seed: u64) -> Vec<i32> {
    random(tokens, seed, 1.0)
        .into_iter()
        .enumerate()
        .map(|(t, r)| match t % 7 {
            0 => 0,
            1 => vocab as i32 - 1,
            2 => (vocab / 2) as i32,
            _ => ((r.abs() * vocab as f32) as usize).min(vocab - 1) as i32,
        })
        .collect()
}

/// `dW` summed on the host in f32, one token after the other: the order the kernel promises.
fn sequential_sums(grad: &[f32], ids: &[i32], vocab: usize, hidden: usize) -> Vec<f32> {
    let mut sums = vec![0.0f32; vocab * hidden];
    for (t, &id) in ids.iter().enumerate() {
        if id as usize >= vocab {
            continue;
        }
        let row = &mut sums[id as usize * hidden..][..hidden];
        for (s, g) in row.iter_mut().zip(&grad[t * hidden..][..hidden]) {
            *s += g;
        }
    }
    sums
}

/// The embedding's weight gradient (`fused::embedding`) against the sum taken on the host in
/// token order, bit for bit: f32 storage, and f16 storage (the same f32 sum, rounded once).
/// Vocabularies that are and are not multiples of the bucket count, buckets of one row and of
/// many, hidden sizes that are not multiples of any vector width, a strided (narrowed)
/// gradient, more tokens than one chunk of the cube's walk, and the default bucket count
/// through `ModelBackend`. The output is freshly allocated, and rows no token hit must come
/// back zero. In every other case some ids are `vocab` or more (another TP rank's tokens, as
/// `embedding_lookup_or_zero` passes them): they must add nothing.
#[test]
fn embedding_backward_equals_the_sequential_sum() {
    use burn_megatron_kernels::fused::embedding as kernel;
    let device = WgpuDevice::default();
    // (tokens, vocab, hidden, buckets)
    let cases = [
        (1, 1, 1, 1),
        (20, 37, 7, 8),
        (300, 64, 12, 16),
        (2500, 101, 13, 4),
        (700, 50, 260, 256),
        (64, 5, 4, 3),
    ];
    for (case, &(tokens, vocab, hidden, buckets)) in cases.iter().enumerate() {
        let mut ids = token_ids(tokens, vocab, 10 + case as u64);
        if case % 2 == 1 {
            for (t, id) in ids.iter_mut().enumerate().filter(|(t, _)| t % 3 == 1) {
                *id = (vocab + t % 4) as i32;
            }
        }
        let ids_tensor =
            Tensor::<W, 1, Int>::from_data(TensorData::new(ids.clone(), [tokens]), &device);
        // A narrowed view: rows two elements apart, read by stride.
        let wide = matrix(tokens, hidden + 2, 20 + case as u64, 1.0, &device);
        for dtype in [DType::F32, DType::F16] {
            for strided in [false, true] {
                let grad = if strided {
                    wide.clone().cast(dtype).narrow(1, 1, hidden)
                } else {
                    wide.clone().narrow(1, 1, hidden).cast(dtype)
                };
                let host: Vec<f32> = values(grad.clone()).iter().map(|&v| v as f32).collect();
                let expected = Tensor::<W, 2>::from_data(
                    TensorData::new(sequential_sums(&host, &ids, vocab, hidden), [vocab, hidden]),
                    &device,
                )
                .cast(dtype);
                let out = wrap::<2>(kernel::embedding_backward(
                    raw(grad.clone()),
                    ids_tensor.clone().into_primitive(),
                    vocab,
                    buckets,
                ));
                assert_eq!(out.dtype(), dtype);
                let what = format!("case {case} {dtype:?} strided {strided}");
                let (got, want) = (values(out), values(expected));
                assert!(got.iter().all(|v| v.is_finite()), "{what}: not finite");
                let first_bad = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(first_bad, None, "{what}: {got:?} vs {want:?}");
            }
        }
        // The model's bucket count, and Burn's composition (f32: every sum in the same
        // order, up to Burn's kernel being the same sequential loop).
        let grad = wide.narrow(1, 1, hidden);
        let ours = <W as EmbeddingOps>::embedding_gradient(grad.clone(), ids_tensor.clone(), vocab);
        let burns = burn_megatron::ops::embedding::backward_composition(grad, ids_tensor, vocab);
        assert_close(
            &format!("case {case} against select_add"),
            &values(ours),
            &values(burns),
            tolerance::F32_SAME_ORDER,
        );
    }
}

/// The dropout kernel (`ModelBackend::dropout` on a CubeCL backend) draws the host's mask bit
/// for bit, at offsets in the global tensor and over shapes that are and are not whole
/// vectors; applied to f32 and f16 strided views, with and without the residual add, it equals
/// the composition, writes every element, and its `Autodiff` gradients are `dy ∘ m` and `dy`.
#[test]
fn dropout_draws_the_host_mask_and_equals_the_composition() {
    use burn::backend::Autodiff;
    use burn_megatron::ops::DropoutMask;
    use burn_megatron::ops::dropout::dropout_composition;
    use burn_megatron_kernels::fused::dropout as kernel;
    let device = WgpuDevice::default();
    let shapes = [[1, 1, 1, 1], [2, 3, 5, 7], [1, 4, 9, 64], [3, 2, 17, 130]];
    for (i, dims) in shapes.into_iter().enumerate() {
        for prob in [0.1, 0.5, 0.9] {
            let mask = DropoutMask {
                prob,
                seed: 0xdead_beef_0000 + i as u64,
                offset: [i, 2 * i, 0, 3 * i],
            };
            let name = format!("{dims:?} p={prob}");
            // The mask itself: the kernel applied to ones.
            let ones = Tensor::<W, 4>::ones(dims, &device);
            let drawn = values(W::dropout(ones, None, mask));
            let host: Vec<f64> = mask.multipliers(dims).into_iter().map(f64::from).collect();
            assert_eq!(drawn, host, "mask {name}");
            let dropped = host.iter().filter(|m| **m == 0.0).count() as f64 / host.len() as f64;
            if host.len() > 1000 {
                assert!((dropped - prob).abs() < 0.05, "{name}: dropped {dropped}");
            }

            for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
                let [d0, d1, d2, d3] = dims;
                let view = |seed| {
                    random_4d([d0, d1, d2, d3 + 3], seed, 2.0, dtype, &device).narrow(3, 0, d3)
                };
                let (x, residual) = (view(91), view(92));
                let f32_of = |t: Tensor<W, 4>| t.cast(DType::F32);
                for with_residual in [false, true] {
                    let r = with_residual.then(|| residual.clone());
                    let want = dropout_composition(f32_of(x.clone()), r.clone().map(f32_of), mask);
                    let output = poisoned(dims, dtype, &device);
                    let flat = |t: Tensor<W, 4>| raw(t.reshape([d0 * d1 * d2, d3]));
                    kernel::forward_into(
                        flat(x.clone()),
                        r.clone().map(flat),
                        kernel::MaskPlacement {
                            prob,
                            seed: mask.seed,
                            inner: [d1, d2],
                            offset: mask.offset,
                        },
                        flat(output.clone()),
                    );
                    let got = W::dropout(x.clone(), r, mask);
                    assert_eq!(got.dtype(), dtype);
                    let what = format!("{name} {dtype:?} residual={with_residual}");
                    assert_close(&what, &values(f32_of(got)), &values(want.clone()), bound);
                    assert_close(
                        &format!("{what} (into a poisoned buffer)"),
                        &values(f32_of(output)),
                        &values(want),
                        bound,
                    );
                }
            }

            // Gradients: `dx = dy ∘ m`, `d_residual = dy`.
            let x =
                Tensor::<Autodiff<W>, 4>::from_inner(random_4d(dims, 93, 1.0, DType::F32, &device))
                    .require_grad();
            let residual =
                Tensor::<Autodiff<W>, 4>::from_inner(random_4d(dims, 94, 1.0, DType::F32, &device))
                    .require_grad();
            let dy = random_4d(dims, 95, 1.0, DType::F32, &device);
            let y = <Autodiff<W>>::dropout(x.clone(), Some(residual.clone()), mask);
            let grads = (y * Tensor::from_inner(dy.clone())).sum().backward();
            let want_dx: Vec<f64> = values(dy.clone())
                .iter()
                .zip(&host)
                .map(|(g, m)| (*g as f32 * *m as f32) as f64)
                .collect();
            assert_close(
                &format!("dx {name}"),
                &values(x.grad(&grads).expect("x has a gradient")),
                &want_dx,
                tolerance::F32,
            );
            assert_eq!(
                values(residual.grad(&grads).expect("the residual has a gradient")),
                values(dy),
                "d_residual {name}"
            );
        }
    }
}

/// The RoPE kernel (`ModelBackend::packed_rope` and its backward on a CubeCL backend) against
/// the composition, in f32 and f16, for packed layouts with one and several query heads per
/// group, odd sequence lengths and head dims whose halves are and are not whole vectors; every
/// element of a poisoned output is written; value heads are copied bit for bit; a tensor
/// nothing else holds is rotated in place with the same bits and its value heads untouched,
/// and a shared one is left as it was; and the backward undoes the forward (the rotation is
/// orthogonal).
#[test]
fn rope_equals_the_composition_and_its_backward_undoes_it() {
    use burn_megatron::ops::rope::{packed_rope_composition, rotation_table};
    use burn_megatron_kernels::fused::rope as kernel;
    let device = WgpuDevice::default();
    // [batch, seq, groups, heads_per_group + 2, head_dim]
    let shapes = [
        [1, 1, 1, 3, 2],
        [2, 7, 3, 3, 6],
        [1, 33, 2, 4, 64],
        [2, 5, 1, 10, 16],
    ];
    for dims in shapes {
        let [batch, seq, groups, slots, head_dim] = dims;
        let n = dims.iter().product();
        for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
            let name = format!("{dims:?} {dtype:?}");
            let qkv =
                Tensor::<W, 5>::from_data(TensorData::new(random(n, 101, 2.0), dims), &device)
                    .cast(dtype);
            let f32_of = |t: Tensor<W, 5>| t.cast(DType::F32);
            let input = values(f32_of(qkv.clone()));
            for inverse in [false, true] {
                let want = packed_rope_composition(f32_of(qkv.clone()), 10_000.0, inverse);
                let got = if inverse {
                    W::packed_rope_backward(qkv.clone(), 10_000.0)
                } else {
                    W::packed_rope(qkv.clone(), 10_000.0)
                };
                assert_eq!(got.dtype(), dtype);
                let what = format!("{name} inverse={inverse}");
                assert_close(
                    &what,
                    &values(f32_of(got.clone())),
                    &values(want.clone()),
                    bound,
                );
                let values_of = |t: Tensor<W, 5>| values(t.narrow(3, slots - 1, 1));
                assert_eq!(
                    values_of(got.clone()),
                    values_of(qkv.clone()),
                    "{what}: value heads"
                );
                // `qkv` is shared (cloned above), so it was not rotated in place.
                assert_eq!(values(f32_of(qkv.clone())), input, "{what}: input kept");

                // A tensor nothing else holds is rotated in place: query and key rows as
                // above, bit for bit, and value rows left as they were.
                let unique = Tensor::<W, 5>::from_data(qkv.to_data(), (&device, dtype));
                let in_place = if inverse {
                    W::packed_rope_backward(unique, 10_000.0)
                } else {
                    W::packed_rope(unique, 10_000.0)
                };
                assert_eq!(
                    values(f32_of(in_place)),
                    values(f32_of(got.clone())),
                    "{what}: in place"
                );

                let rows = batch * seq * groups * slots;
                let output = Tensor::<W, 2>::full([rows, head_dim], f32::NAN, &device).cast(dtype);
                let table = rotation_table(seq, head_dim, 10_000.0).map(|values| {
                    raw(Tensor::<W, 2>::from_data(
                        TensorData::new(values, [seq, head_dim / 2]),
                        (&device, DType::F32),
                    ))
                });
                kernel::rotate_into(
                    raw(qkv.clone().reshape([rows, head_dim])),
                    table.clone(),
                    kernel::PackedRows { seq, groups, slots },
                    inverse,
                    raw(output.clone()),
                );
                // The in-place kernel itself, called on a buffer that is also held elsewhere.
                let target = Tensor::<W, 2>::from_data(
                    qkv.clone().reshape([rows, head_dim]).to_data(),
                    (&device, dtype),
                );
                let rotated: Tensor<W, 2> = wrap(kernel::rotate_in_place(
                    raw(target.clone()),
                    table,
                    kernel::PackedRows { seq, groups, slots },
                    inverse,
                ));
                assert_eq!(
                    values(f32_of(target.reshape(dims))),
                    values(f32_of(got.clone())),
                    "{what}: rotate_in_place writes over its argument"
                );
                drop(rotated);
                assert_close(
                    &format!("{what} (into a poisoned buffer)"),
                    &values(output.cast(DType::F32)),
                    &values(want),
                    bound,
                );
            }
            let there_and_back = W::packed_rope_backward(W::packed_rope(qkv.clone(), 500.0), 500.0);
            assert_close(
                &format!("{name}: backward ∘ forward"),
                &values(f32_of(there_and_back)),
                &values(f32_of(qkv)),
                bound * 4.0,
            );
        }
    }
}

/// The padded softmax kernels (`ModelBackend::masked_softmax` and its backward on a CubeCL
/// backend) against the composition, f32 and f16, with and without the causal mask, for key
/// lengths of zero (a row with no visible key is zeros), within and beyond the row, rectangular
/// scores and rows longer than a cube's threads; every element of a poisoned output written.
#[test]
fn masked_softmax_equals_the_composition_and_writes_every_element() {
    use burn_megatron::ops::causal_softmax::{backward_composition, masked_forward_composition};
    use burn_megatron_kernels::fused::causal_softmax as softmax;
    let device = WgpuDevice::default();
    let cases: [([usize; 4], bool, Option<[i32; 3]>); 6] = [
        ([3, 2, 5, 5], true, Some([0, 3, 9])),
        ([3, 2, 5, 5], false, Some([5, 1, 0])),
        ([3, 1, 4, 700], false, Some([700, 333, 1])),
        ([3, 2, 37, 37], true, Some([37, 20, 2])),
        ([3, 2, 6, 9], false, None),
        ([3, 1, 1, 1], false, Some([1, 0, 1])),
    ];
    for (i, (dims, causal, lengths)) in cases.into_iter().enumerate() {
        for (dtype, bound) in [(DType::F32, tolerance::F32), (DType::F16, tolerance::F16)] {
            let name = format!("{dims:?} causal={causal} lengths={lengths:?} {dtype:?}");
            let scores = random_4d(dims, 111 + i as u64, 4.0, dtype, &device);
            let grad = random_4d(dims, 121 + i as u64, 1.0, dtype, &device);
            let key_lengths = lengths
                .map(|l| Tensor::<W, 1, Int>::from_data(TensorData::new(l.to_vec(), [3]), &device));
            let f32_of = |t: Tensor<W, 4>| t.cast(DType::F32);
            let want = masked_forward_composition(
                f32_of(scores.clone()),
                key_lengths.clone(),
                0.7,
                causal,
            );
            let got = W::masked_softmax(scores.clone(), key_lengths.clone(), 0.7, causal);
            assert_eq!(got.dtype(), dtype);
            let probs_f32 = values(f32_of(got.clone()));
            assert!(
                probs_f32.iter().all(|p| p.is_finite()),
                "{name}: not finite"
            );
            assert_close(
                &format!("forward {name}"),
                &probs_f32,
                &values(want.clone()),
                bound,
            );
            // Both kernel sets (rows in registers, rows streamed), into poisoned buffers.
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let probs = poisoned(dims, dtype, &device);
                softmax::masked_forward_into_with(
                    raw4(scores.clone()),
                    key_lengths.clone().map(|l| l.into_primitive()),
                    0.7,
                    causal,
                    raw4(probs.clone()),
                    kernels,
                );
                assert_close(
                    &format!("forward {name} (into a poisoned buffer, {kernels:?})"),
                    &values(f32_of(probs)),
                    &values(want.clone()),
                    bound,
                );
            }

            let want = backward_composition(want, f32_of(grad.clone()), 0.7);
            let got_grad = W::masked_softmax_backward(got.clone(), grad.clone(), 0.7, causal);
            assert_close(
                &format!("backward {name}"),
                &values(f32_of(got_grad)),
                &values(want.clone()),
                bound,
            );
            for kernels in [
                softmax::SoftmaxKernels::Registers,
                softmax::SoftmaxKernels::Streaming,
            ] {
                let grad_scores = poisoned(dims, dtype, &device);
                softmax::masked_backward_into_with(
                    raw4(got.clone()),
                    raw4(grad.clone()),
                    0.7,
                    causal,
                    raw4(grad_scores.clone()),
                    kernels,
                );
                assert_close(
                    &format!("backward {name} (into a poisoned buffer, {kernels:?})"),
                    &values(f32_of(grad_scores)),
                    &values(want.clone()),
                    bound,
                );
            }
        }
    }
}
