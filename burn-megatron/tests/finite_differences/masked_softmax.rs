//! The padded (and causal) softmax: the forward against the formula row by row, and the
//! gradient of the scores against central differences.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::SoftmaxOps;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

const DIMS: [usize; 4] = [3, 2, 4, 4];
const LENGTHS: [i64; 3] = [4, 2, 0];
const SCALE: f64 = 0.8;

fn lengths<T: burn::tensor::backend::Backend<Device = burn::backend::ndarray::NdArrayDevice>>()
-> Tensor<T, 1, Int> {
    Tensor::from_data(TensorData::new(LENGTHS.to_vec(), [3]), &device())
}

fn scores() -> Tensor<B, 4> {
    init_full::<B, 4>(DIMS, InitDistribution::Normal { std: 2.0 }, 41, &device())
}

#[test]
fn the_forward_is_the_formula() {
    let input = values(scores());
    let [batch, heads, queries, keys] = DIMS;
    for causal in [false, true] {
        let mut want = vec![0.0; input.len()];
        for (b, &length) in LENGTHS.iter().enumerate().take(batch) {
            for row in 0..heads * queries {
                let query = row % queries;
                let first = (b * heads * queries + row) * keys;
                let visible = |j: usize| (j as i64) < length && (!causal || j <= query);
                let total: f64 = (0..keys)
                    .filter(|&j| visible(j))
                    .map(|j| (SCALE * input[first + j]).exp())
                    .sum();
                for j in (0..keys).filter(|&j| visible(j)) {
                    want[first + j] = (SCALE * input[first + j]).exp() / total;
                }
            }
        }
        let got = B::masked_softmax(scores(), Some(lengths()), SCALE, causal);
        assert_close("masked softmax", &values(got), &want, tolerance::F64);
    }
}

#[test]
fn the_gradient_matches_finite_differences() {
    let w = init_full::<B, 4>(DIMS, InitDistribution::Normal { std: 1.0 }, 42, &device());
    for causal in [false, true] {
        let tracked = Tensor::<AD, 4>::from_inner(scores()).require_grad();
        let y = AD::masked_softmax(tracked.clone(), Some(lengths()), SCALE, causal);
        let grads = (y * Tensor::from_inner(w.clone())).sum().backward();
        let got = values(tracked.grad(&grads).expect("the scores have a gradient"));

        let loss = |x: Vec<f64>| {
            let x = Tensor::<B, 4>::from_data(TensorData::new(x, DIMS), &device());
            values((B::masked_softmax(x, Some(lengths()), SCALE, causal) * w.clone()).sum())[0]
        };
        let input = values(scores());
        let fd: Vec<f64> = (0..input.len())
            .map(|i| {
                let (mut plus, mut minus) = (input.clone(), input.clone());
                plus[i] += STEP;
                minus[i] -= STEP;
                (loss(plus) - loss(minus)) / (2.0 * STEP)
            })
            .collect();
        assert_close(
            &format!("d_scores causal={causal}"),
            &got,
            &fd,
            tolerance::FINITE_DIFFERENCE_F64,
        );
    }
}
