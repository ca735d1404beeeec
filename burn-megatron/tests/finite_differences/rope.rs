//! Rotary position embeddings on the packed QKV: the forward against the rotation written
//! out element by element, and the gradient against central differences.

use burn::tensor::Tensor;
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::RopeOps;
use burn_megatron::ops::rope::rotation_table;
use burn_megatron_testing::{assert_close, tolerance, values};

use crate::{AD, B, STEP, device};

/// `[batch, seq, groups, heads_per_group + 2, head_dim]`: two groups of three query heads.
const DIMS: [usize; 5] = [2, 9, 2, 5, 8];
const BASE: f64 = 100.0;

fn qkv(seed: u64) -> Tensor<B, 5> {
    init_full::<B, 5>(DIMS, InitDistribution::Normal { std: 1.0 }, seed, &device())
}

#[test]
fn the_forward_is_the_rotation() {
    let x = qkv(1);
    let input = values(x.clone());
    let [batch, seq, groups, slots, head_dim] = DIMS;
    let half = head_dim / 2;
    let mut want = input.clone();
    for row in 0..batch * seq * groups * slots {
        let (slot, position) = (row % slots, (row / (slots * groups)) % seq);
        if slot == slots - 1 {
            continue;
        }
        for i in 0..half {
            // The cosine and sine in f64, rounded to f32, as the operation's table has them.
            let angle = position as f64 * BASE.powf(-2.0 * i as f64 / head_dim as f64);
            let (c, s) = (angle.cos() as f32 as f64, angle.sin() as f32 as f64);
            let (lo, hi) = (input[row * head_dim + i], input[row * head_dim + half + i]);
            want[row * head_dim + i] = lo * c - hi * s;
            want[row * head_dim + half + i] = hi * c + lo * s;
        }
    }
    assert_close(
        "packed RoPE",
        &values(B::packed_rope(x, BASE)),
        &want,
        tolerance::F64,
    );
}

/// The gradient of `Σ w ∘ rope(qkv)` from the backward and from central differences, one
/// input element at a time over a sample of elements (each output element depends on two
/// input elements).
#[test]
fn the_gradient_matches_finite_differences() {
    let (x, w) = (qkv(2), qkv(3));
    let tracked = Tensor::<AD, 5>::from_inner(x.clone()).require_grad();
    let grads = (AD::packed_rope(tracked.clone(), BASE) * Tensor::from_inner(w.clone()))
        .sum()
        .backward();
    let got = values(tracked.grad(&grads).expect("qkv has a gradient"));

    let loss = |x: Vec<f64>| {
        let x = Tensor::<B, 5>::from_data(burn::tensor::TensorData::new(x, DIMS), &device());
        values((B::packed_rope(x, BASE) * w.clone()).sum())[0]
    };
    let (got, fd) = sampled_central_differences(&got, values(x), loss);
    assert_close("d_qkv", &got, &fd, tolerance::FINITE_DIFFERENCE_F64);
}

/// The table the operation uses is the f64 rotation rounded to f32.
#[test]
fn the_table_is_the_rounded_f64_rotation() {
    let [cos, sin] = rotation_table(3, 4, BASE);
    assert_eq!(cos.len(), 6);
    for (p, i) in [(0, 0), (2, 1), (1, 1)] {
        let angle = p as f64 * BASE.powf(-2.0 * i as f64 / 4.0);
        assert_eq!(cos[p * 2 + i], angle.cos() as f32);
        assert_eq!(sin[p * 2 + i], angle.sin() as f32);
    }
}

/// RoPE at given positions (a context-parallel rank's tokens: two chunks of the sequence, out
/// of order): the gradient of `Σ w ∘ rope_at(qkv, positions)` from its backward against
/// central differences, over a sample of elements.
#[test]
fn the_gradient_at_positions_matches_finite_differences() {
    let positions: Vec<usize> = [0, 1, 2, 3, 14, 15, 16, 17, 30].to_vec();
    assert_eq!(positions.len(), DIMS[1]);
    let (x, w) = (qkv(4), qkv(5));
    let tracked = Tensor::<AD, 5>::from_inner(x.clone()).require_grad();
    let rotated = AD::packed_rope_at(tracked.clone(), &positions, BASE);
    let grads = (rotated * Tensor::from_inner(w.clone())).sum().backward();
    let got = values(tracked.grad(&grads).expect("qkv has a gradient"));

    let loss = |x: Vec<f64>| {
        let x = Tensor::<B, 5>::from_data(burn::tensor::TensorData::new(x, DIMS), &device());
        values((B::packed_rope_at(x, &positions, BASE) * w.clone()).sum())[0]
    };
    let (got, fd) = sampled_central_differences(&got, values(x), loss);
    assert_close(
        "d_qkv at positions",
        &got,
        &fd,
        tolerance::FINITE_DIFFERENCE_F64,
    );
}

/// Central differences of `loss` at every 7th element of `input`, and `grad`'s values there.
fn sampled_central_differences(
    grad: &[f64],
    input: Vec<f64>,
    loss: impl Fn(Vec<f64>) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let sample: Vec<usize> = (0..input.len()).step_by(7).collect();
    let mut fd = Vec::with_capacity(sample.len());
    for &i in &sample {
        let mut plus = input.clone();
        plus[i] += STEP;
        let mut minus = input.clone();
        minus[i] -= STEP;
        fd.push((loss(plus) - loss(minus)) / (2.0 * STEP));
    }
    (sample.iter().map(|&i| grad[i]).collect(), fd)
}
