//! The flash-attention kernels against exact f64 values, and the op against the composition.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_megatron::ops::FlashAttentionOps;
use burn_megatron_testing::{assert_close, assert_near_zero, tolerance, values};

use crate::helpers::{W, poisoned, random_4d, raw4};

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
                    // One key: the probabilities are constant, dq and dk are zero (a NaN, as
                    // an unwritten poisoned element would be, fails).
                    assert_near_zero(&label(name), &got, 1e-5);
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
