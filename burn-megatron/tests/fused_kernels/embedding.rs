//! The embedding's weight gradient against the sequential sum.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron::ops::EmbeddingOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::helpers::{W, matrix, random, raw, wrap};

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
                assert_eq!(got.len(), want.len(), "{what}: sizes");
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
