//! The dropout kernel: the host's mask, the composition, the gradients.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor};
use burn_megatron::ops::DropoutOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, poisoned, random_4d, raw};

/// The dropout kernel (`DropoutOps::dropout` on a CubeCL backend) draws the host's mask bit
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
