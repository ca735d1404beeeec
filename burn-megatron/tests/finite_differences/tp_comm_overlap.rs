//! `--tp-comm-overlap`'s two operations over TP = 2 thread ranks, against central differences:
//! [`GatheredLinearOps::gathered_linear`] (the input all-gathered, then a linear projection
//! with bias or SwiGLU's two projections with biases; its backward reduce-scatters the input's
//! gradient) and [`ReduceScatteredLinearOps::reduce_scattered_linear`] (a projection whose
//! output is reduce-scattered; its backward all-gathers the output's gradient and computes
//! this rank's rows first).
//!
//! Every input is rank-local. For each rank `q`, input `n` and element `e`, every rank runs the
//! forward with that element of rank `q`'s input moved, sums `Σ probe ∘ out` over its output
//! and all-reduces it: the whole loss, whose difference quotient is rank `q`'s gradient.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::{GatheredLinearOps, GatheredProjection, ReduceScatteredLinearOps};
use burn_megatron_dist::{ProcessGroup, ReduceOp};
use burn_megatron_testing::{assert_close, run, tolerance, values};

use crate::{AD, B, STEP, device};

const TP: usize = 2;
/// Tokens per rank.
const TOKENS: usize = 3;
/// Input features of the rank's slice.
const D_IN: usize = 4;
/// Output features of the rank's slice.
const D_OUT: usize = 5;

/// Which operation, and the shapes of its rank-local inputs and output.
#[derive(Debug, Clone, Copy)]
enum Op {
    GatheredLinear,
    GatheredSwiGlu,
    ReduceScattered,
    /// The same with an even number of tokens a rank, so that the forward runs in chunks
    /// (`FORWARD_CHUNKS`).
    ReduceScatteredChunked,
}

impl Op {
    fn input_shapes(self) -> Vec<Vec<usize>> {
        match self {
            Op::GatheredLinear => vec![vec![TOKENS, D_IN], vec![D_IN, D_OUT], vec![D_OUT]],
            Op::GatheredSwiGlu => vec![
                vec![TOKENS, D_IN],
                vec![D_IN, D_OUT],
                vec![D_IN, D_OUT],
                vec![D_OUT],
                vec![D_OUT],
            ],
            Op::ReduceScattered => vec![vec![TP * TOKENS, D_IN], vec![D_IN, D_OUT]],
            Op::ReduceScatteredChunked => vec![vec![TP * 2 * TOKENS, D_IN], vec![D_IN, D_OUT]],
        }
    }

    fn output_shape(self) -> [usize; 2] {
        match self {
            Op::GatheredLinear | Op::GatheredSwiGlu => [TP * TOKENS, D_OUT],
            Op::ReduceScattered => [TOKENS, D_OUT],
            Op::ReduceScatteredChunked => [2 * TOKENS, D_OUT],
        }
    }

    fn forward(self, inputs: Vec<Tensor<AD, 2>>, group: &ProcessGroup) -> Tensor<AD, 2> {
        let vector = |t: &Tensor<AD, 2>| t.clone().reshape([D_OUT]);
        let out = match self {
            Op::GatheredLinear => {
                let projection = GatheredProjection::Linear {
                    weight: inputs[1].clone(),
                    bias: Some(vector(&inputs[2])),
                };
                AD::gathered_linear(inputs[0].clone(), projection, group)
            }
            Op::GatheredSwiGlu => {
                let projection = GatheredProjection::SwiGlu {
                    gate: inputs[1].clone(),
                    up: inputs[2].clone(),
                    bias: Some([vector(&inputs[3]), vector(&inputs[4])]),
                };
                AD::gathered_linear(inputs[0].clone(), projection, group)
            }
            Op::ReduceScattered | Op::ReduceScatteredChunked => {
                AD::reduce_scattered_linear(inputs[0].clone(), inputs[1].clone(), group)
            }
        };
        out.expect("the collectives of thread ranks")
    }
}

/// Rank `rank`'s inputs (values drawn per rank and input) and probe.
fn values_of(op: Op, rank: usize) -> (Vec<Vec<f64>>, Vec<f64>) {
    let draw = |n: usize, seed: u64| {
        values(init_full::<B, 1>(
            [n],
            InitDistribution::Normal { std: 0.8 },
            seed,
            &device(),
        ))
    };
    let inputs = op
        .input_shapes()
        .iter()
        .enumerate()
        .map(|(n, shape)| draw(shape.iter().product(), 100 * rank as u64 + n as u64 + 1))
        .collect();
    let [rows, cols] = op.output_shape();
    (inputs, draw(rows * cols, 100 * rank as u64 + 99))
}

/// A tensor of `data` with `shape`, vectors as `[1, n]`.
fn tensor(data: &[f64], shape: &[usize]) -> Tensor<B, 2> {
    let shape = match shape {
        [n] => [1, *n],
        [r, c] => [*r, *c],
        _ => unreachable!("inputs are vectors or matrices"),
    };
    Tensor::from_data(TensorData::new(data.to_vec(), shape), &device())
}

fn check(op: Op) {
    let shapes = op.input_shapes();
    let ranks = run(TP, |ctx| {
        let group = ctx.world();
        let (inputs, probe) = values_of(op, group.rank());
        let probe = tensor(&probe, &op.output_shape());
        let tracked: Vec<Tensor<AD, 2>> = inputs
            .iter()
            .zip(&shapes)
            .map(|(v, s)| Tensor::from_inner(tensor(v, s)).require_grad())
            .collect();
        let out = op.forward(tracked.clone(), group);
        let grads = (out * Tensor::from_inner(probe.clone())).sum().backward();
        group.backward_failure()?;
        let analytic: Vec<Vec<f64>> = tracked
            .iter()
            .map(|t| values(t.grad(&grads).expect("a gradient")))
            .collect();
        // The whole loss with element `e` of rank `q`'s input `n` moved by `delta`.
        let loss =
            |q: usize, n: usize, e: usize, delta: f64| -> Result<f64, burn_megatron::Error> {
                let mut moved = inputs.clone();
                if q == group.rank() {
                    moved[n][e] += delta;
                }
                let moved = moved
                    .iter()
                    .zip(&shapes)
                    .map(|(v, s)| Tensor::from_inner(tensor(v, s)))
                    .collect();
                let part = (op.forward(moved, group).inner() * probe.clone()).sum();
                Ok(group.all_reduce(part, ReduceOp::Sum)?.into_scalar())
            };
        // numeric[q][n]: the difference quotients of rank q's input n.
        let mut numeric = vec![vec![Vec::new(); shapes.len()]; TP];
        for (q, per_rank) in numeric.iter_mut().enumerate() {
            for (n, shape) in shapes.iter().enumerate() {
                for e in 0..shape.iter().product() {
                    let quotient = (loss(q, n, e, STEP)? - loss(q, n, e, -STEP)?) / (2.0 * STEP);
                    per_rank[n].push(quotient);
                }
            }
        }
        Ok((analytic, numeric))
    });
    for (q, (analytic, _)) in ranks.iter().enumerate() {
        for (n, got) in analytic.iter().enumerate() {
            assert_close(
                &format!("{op:?} TP={TP}: rank {q}'s input {n}"),
                got,
                &ranks[0].1[q][n],
                tolerance::FINITE_DIFFERENCE_F64,
            );
        }
    }
}

#[test]
fn gathered_linear_matches_finite_differences() {
    check(Op::GatheredLinear);
}

#[test]
fn gathered_swiglu_matches_finite_differences() {
    check(Op::GatheredSwiGlu);
}

#[test]
fn reduce_scattered_linear_matches_finite_differences() {
    check(Op::ReduceScattered);
}

#[test]
fn chunked_reduce_scattered_linear_matches_finite_differences() {
    check(Op::ReduceScatteredChunked);
}
