//! `ops::flash_attention::attention`: the gradients of `q`, `k` and `v` from its autodiff node
//! (whose backward recomputes the probabilities from the stored log-sum-exp) against central
//! differences of its forward, element by element, causal and not, with grouped-query
//! attention.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::flash_attention::attention;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

/// `(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal)`: 4 query heads on 2 key/value
/// heads, causal; and more keys than queries, not causal, all heads on one kv head.
const CASES: [(usize, usize, usize, usize, usize, usize, bool); 2] =
    [(1, 4, 2, 5, 5, 3, true), (2, 2, 1, 3, 6, 4, false)];

fn normal(shape: [usize; 4], std: f64, seed: u64) -> Vec<f64> {
    values(init_full::<B, 4>(
        shape,
        InitDistribution::Normal { std },
        seed,
        &device(),
    ))
}

#[test]
fn the_gradients_match_finite_differences() {
    for (i, &(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal)) in CASES.iter().enumerate() {
        let q_shape = [batch, heads, seq_q, head_dim];
        let kv_shape = [batch, kv_heads, seq_k, head_dim];
        let shapes = [q_shape, kv_shape, kv_shape];
        let seed = 30 + 10 * i as u64;
        let inputs = [
            normal(q_shape, 1.5, seed),
            normal(kv_shape, 1.5, seed + 1),
            normal(kv_shape, 1.0, seed + 2),
        ];
        let w = normal(q_shape, 1.0, seed + 3);
        let scale = 1.0 / (head_dim as f64).sqrt();
        let tensor = |n: usize, data: &[f64]| {
            Tensor::<B, 4>::from_data(TensorData::new(data.to_vec(), shapes[n]), &device())
        };
        // `Σ w ∘ attention(q, k, v)`.
        let objective = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let y = attention(tensor(0, q), tensor(1, k), tensor(2, v), scale, causal);
            values(y).iter().zip(&w).map(|(y, w)| y * w).sum()
        };

        let tracked: Vec<Tensor<AD, 4>> = (0..3)
            .map(|n| Tensor::from_inner(tensor(n, &inputs[n])).require_grad())
            .collect();
        let y = attention(
            tracked[0].clone(),
            tracked[1].clone(),
            tracked[2].clone(),
            scale,
            causal,
        );
        let upstream = Tensor::<AD, 4>::from_inner(tensor(0, &w));
        let grads = (y * upstream).sum().backward();

        for (n, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            let got = values(tracked[n].grad(&grads).expect("a gradient"));
            let want: Vec<f64> = (0..inputs[n].len())
                .map(|e| {
                    let at = |delta: f64| {
                        let mut shifted = inputs.clone();
                        shifted[n][e] += delta;
                        objective(&shifted[0], &shifted[1], &shifted[2])
                    };
                    (at(STEP) - at(-STEP)) / (2.0 * STEP)
                })
                .collect();
            let diff = assert_close(
                &format!("case {i} {name}"),
                &got,
                &want,
                tolerance::FINITE_DIFFERENCE_F64,
            );
            eprintln!("flash attention case {i}: {name} relative difference {diff:.2e}");
        }
    }
}
