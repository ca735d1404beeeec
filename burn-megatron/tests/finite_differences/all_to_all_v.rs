//! `mapping::all_to_all_v` (the MoE dispatcher's exchange of blocks of different sizes) on 1,
//! 2 and 3 thread ranks: the gradient its backward gives each rank's input against central
//! differences of `Σ_r Σ probe_r ∘ y_r²` (squared, so that the gradient depends on where each
//! row went), every element of every rank's input, with empty blocks among the others.
//!
//! Every rank knows every rank's input, moves the same element, runs its part of the
//! exchange and sums its share of the loss; an all-reduce gives the whole loss on every rank.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron_dist::ReduceOp;
use burn_megatron_dist::mapping::all_to_all_v;
use burn_megatron_testing::{assert_close, run, tolerance, values};

use crate::{AD, B, STEP, device};

const COLUMNS: usize = 2;

/// Rows rank `s` sends rank `q` of `n` (some blocks empty).
fn rows(s: usize, q: usize) -> usize {
    (s + 2 * q + 1) % 3
}

#[test]
fn all_to_all_v_gradients_match_finite_differences() {
    for n in [1, 2, 3] {
        let send = |s: usize| (0..n).map(|q| rows(s, q)).collect::<Vec<_>>();
        let recv = |r: usize| (0..n).map(|s| rows(s, r)).collect::<Vec<_>>();
        // Every rank's input and probe values, drawn from fixed seeds.
        let draw = |len: usize, seed: u64| {
            values(init_full::<B, 1>(
                [len.max(1)],
                InitDistribution::Normal { std: 1.0 },
                seed,
                &device(),
            ))[..len]
                .to_vec()
        };
        let inputs: Vec<Vec<f64>> = (0..n)
            .map(|s| draw(send(s).iter().sum::<usize>() * COLUMNS, 70 + s as u64))
            .collect();
        let probes: Vec<Vec<f64>> = (0..n)
            .map(|r| draw(recv(r).iter().sum::<usize>() * COLUMNS, 80 + r as u64))
            .collect();
        let ranks = run(n, |ctx| {
            let (group, r) = (ctx.world(), ctx.rank());
            let tensor = |data: &[f64]| {
                Tensor::<B, 2>::from_data(
                    TensorData::new(data.to_vec(), [data.len() / COLUMNS, COLUMNS]),
                    &device(),
                )
            };
            let probe = tensor(&probes[r]);
            let x = Tensor::<AD, 2>::from_inner(tensor(&inputs[r])).require_grad();
            let y = all_to_all_v(x.clone(), group, &send(r), &recv(r))?;
            let grads = (y.powi_scalar(2) * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            group.backward_failure()?;
            let analytic = values(x.grad(&grads).expect("a gradient"));

            // The whole loss with element `e` of rank `s`'s input moved by `delta`.
            let loss = |s: usize, e: usize, delta: f64| -> burn_megatron_dist::DistResult<f64> {
                let mut mine = inputs[r].clone();
                if s == r {
                    mine[e] += delta;
                }
                let y = all_to_all_v(tensor(&mine), group, &send(r), &recv(r))?;
                let part = (y.powi_scalar(2) * probe.clone()).sum();
                Ok(group.all_reduce(part, ReduceOp::Sum)?.into_scalar())
            };
            let mut numeric = Vec::new();
            for (s, input) in inputs.iter().enumerate() {
                let mut grad = Vec::with_capacity(input.len());
                for e in 0..input.len() {
                    grad.push((loss(s, e, STEP)? - loss(s, e, -STEP)?) / (2.0 * STEP));
                }
                numeric.push(grad);
            }
            Ok((analytic, numeric))
        });
        for (s, (analytic, _)) in ranks.iter().enumerate() {
            assert_close(
                &format!("all_to_all_v over {n} ranks: rank {s}'s input"),
                analytic,
                &ranks[0].1[s],
                tolerance::FINITE_DIFFERENCE_F64,
            );
        }
    }
}
