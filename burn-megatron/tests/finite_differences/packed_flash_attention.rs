//! `ops::packed_flash_attention::attention`: the gradient of the packed `qkv` from its one
//! autodiff node (flash attention's backward, the parts assembled into one buffer) against
//! central differences of its forward, element by element: multi-head, grouped-query and
//! multi-query layouts, causal and not.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::packed_flash_attention::attention;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

/// `(batch, seq, groups, heads_per_group, head_dim, causal)`: 3 groups of one head (MHA),
/// causal; 2 groups of 2 (GQA), not causal; one group of 3 (MQA), causal.
const CASES: [(usize, usize, usize, usize, usize, bool); 3] = [
    (2, 4, 3, 1, 3, true),
    (1, 5, 2, 2, 3, false),
    (1, 4, 1, 3, 4, true),
];

fn normal<const D: usize>(shape: [usize; D], std: f64, seed: u64) -> Vec<f64> {
    values(init_full::<B, D>(
        shape,
        InitDistribution::Normal { std },
        seed,
        &device(),
    ))
}

#[test]
fn the_gradient_of_qkv_matches_finite_differences() {
    for (i, &(batch, seq, groups, heads_per_group, head_dim, causal)) in CASES.iter().enumerate() {
        let shape = [batch, seq, groups, heads_per_group + 2, head_dim];
        let out_shape = [batch, seq, groups * heads_per_group, head_dim];
        let seed = 70 + 10 * i as u64;
        let input = normal(shape, 1.5, seed);
        let w = normal(out_shape, 1.0, seed + 1);
        let scale = 1.0 / (head_dim as f64).sqrt();
        let tensor = |data: &[f64]| {
            Tensor::<B, 5>::from_data(TensorData::new(data.to_vec(), shape), &device())
        };
        // `Σ w ∘ attention(qkv)`.
        let objective = |qkv: &[f64]| -> f64 {
            let y = attention(tensor(qkv), scale, causal);
            values(y).iter().zip(&w).map(|(y, w)| y * w).sum()
        };

        let tracked = Tensor::<AD, 5>::from_inner(tensor(&input)).require_grad();
        let y = attention(tracked.clone(), scale, causal);
        let upstream = Tensor::<AD, 4>::from_inner(Tensor::from_data(
            TensorData::new(w.clone(), out_shape),
            &device(),
        ));
        let grads = (y * upstream).sum().backward();

        let got = values(tracked.grad(&grads).expect("qkv has a gradient"));
        let want: Vec<f64> = (0..input.len())
            .map(|e| {
                let at = |delta: f64| {
                    let mut shifted = input.clone();
                    shifted[e] += delta;
                    objective(&shifted)
                };
                (at(STEP) - at(-STEP)) / (2.0 * STEP)
            })
            .collect();
        let diff = assert_close(
            &format!("case {i} dqkv"),
            &got,
            &want,
            tolerance::FINITE_DIFFERENCE_F64,
        );
        eprintln!("packed flash attention case {i}: dqkv relative difference {diff:.2e}");
    }
}
