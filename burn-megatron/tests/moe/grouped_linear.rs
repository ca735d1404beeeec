//! `grouped_linear`, the experts' grouped GEMM with one autodiff node, against the per-expert
//! composition it replaces (narrowed blocks, one matmul each, concatenated) under Burn's own
//! autodiff: the output and both gradients, with experts of zero rows (first, middle, last),
//! a single expert, and every row in one expert.

use burn::tensor::Tensor;
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::grouped_linear;
use burn_megatron_testing::assert_near_zero;

use crate::{AD, assert_close, tolerance, values};

fn normal<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<AD, D> {
    init_full::<AD, D>(
        shape,
        InitDistribution::Normal { std: 1.0 },
        seed,
        &Default::default(),
    )
}

/// The per-expert composition in plain Burn ops.
fn composition(x: Tensor<AD, 2>, w: Tensor<AD, 3>, counts: &[usize]) -> Tensor<AD, 2> {
    let [_, k, m] = w.dims();
    let mut start = 0;
    let mut blocks = Vec::new();
    for (e, &count) in counts.iter().enumerate() {
        if count > 0 {
            let block = x.clone().narrow(0, start, count);
            blocks.push(block.matmul(w.clone().narrow(0, e, 1).reshape([k, m])));
            start += count;
        }
    }
    Tensor::cat(blocks, 0)
}

/// `[output, dx, dw]` of `Σ probe ∘ f(x, w)`.
fn run(
    counts: &[usize],
    [k, m]: [usize; 2],
    f: impl Fn(Tensor<AD, 2>, Tensor<AD, 3>, &[usize]) -> Tensor<AD, 2>,
) -> [Vec<f64>; 3] {
    let n: usize = counts.iter().sum();
    let x = normal([n, k], 1).require_grad();
    let w = normal([counts.len(), k, m], 2).require_grad();
    let probe = normal([n, m], 3);
    let y = f(x.clone(), w.clone(), counts);
    let grads = (y.clone() * probe).sum().backward();
    [
        values(y.inner()),
        values(x.grad(&grads).expect("x has a gradient")),
        values(w.grad(&grads).expect("w has a gradient")),
    ]
}

#[test]
fn grouped_linear_matches_the_per_expert_composition() {
    let cases: [&[usize]; 6] = [
        &[3, 5, 2, 4],
        &[0, 5, 0, 4],
        &[3, 0, 0, 6],
        &[2, 3, 0],
        &[7],
        &[0, 0, 9, 0],
    ];
    for counts in cases {
        for shape in [[6, 5], [1, 3]] {
            let got = run(counts, shape, grouped_linear);
            let want = run(counts, shape, composition);
            for (name, (got, want)) in ["y", "dx", "dw"].iter().zip(got.iter().zip(&want)) {
                assert_close(
                    &format!("{name} (counts {counts:?}, k × m {shape:?})"),
                    got,
                    want,
                    tolerance::F32_SAME_ORDER,
                );
            }
            // An expert without rows gets a gradient, and it is exactly zero.
            let [k, m] = shape;
            for (e, _) in counts.iter().enumerate().filter(|(_, c)| **c == 0) {
                let dw_e = &got[2][e * k * m..(e + 1) * k * m];
                assert_near_zero(&format!("dw[{e}] (counts {counts:?})"), dw_e, 0.0);
            }
        }
    }
}

#[test]
#[should_panic(expected = "the counts add up to 5, the tokens have 6 rows")]
fn counts_that_miss_rows_are_refused() {
    grouped_linear(normal([6, 2], 1), normal([2, 2, 3], 2), &[2, 3]);
}

#[test]
#[should_panic(expected = "3 counts for 2 experts")]
fn a_count_per_expert_is_required() {
    grouped_linear(normal([6, 2], 1), normal([2, 2, 3], 2), &[2, 3, 1]);
}
