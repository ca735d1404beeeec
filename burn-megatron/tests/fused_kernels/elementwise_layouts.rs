//! The element-wise kernels' layouts (bias-GeLU and SwiGLU) give the flat kernels' bits.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor};
use burn_megatron_testing::values;

use crate::helpers::{W, matrix, raw, vector, wrap};

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
                    assert_eq!(blocked.len(), flat.len(), "{name}: outputs");
                    for (i, (got, want)) in blocked.iter().zip(&flat).enumerate() {
                        assert_eq!(got.len(), want.len(), "output {i} {name}: sizes");
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
