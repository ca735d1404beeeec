//! Ring attention (`context_parallel::ring_attention`, CP = 2 and 4 thread ranks): the
//! gradients of `q`, `k` and `v` that its backward gives (through the log-sum-exp merge of
//! the blocks and the ring exchange's reverse pass) against central differences of the
//! forward, element by element of the whole sequence, with grouped-query attention (2 query
//! heads on 1 K/V head); and the same for the fused ring (`ring_flash_attention`) and the
//! fused attention over all-gathered K/V (`all_gather_flash_attention`).
//!
//! Every rank perturbs the same element of the full inputs, runs its part of the forward and
//! sums `Σ probe ∘ out` over its tokens; an all-reduce gives the whole loss on every rank.

use burn::tensor::{Tensor, TensorData};
use burn_megatron::context_parallel::{
    LoadBalancedSplit, all_gather_flash_attention, ring_attention, ring_flash_attention,
};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::RingFlashAttentionOps;
use burn_megatron_dist::{ProcessGroup, ReduceOp};
use burn_megatron_testing::{assert_close, run, tolerance, values};

use crate::{AD, B, STEP, device};

const BATCH: usize = 1;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const SEQ: usize = 8;
const HEAD_DIM: usize = 3;

fn shapes() -> [[usize; 4]; 4] {
    let q = [BATCH, HEADS, SEQ, HEAD_DIM];
    let kv = [BATCH, KV_HEADS, SEQ, HEAD_DIM];
    [q, kv, kv, q]
}

/// The full `q`, `k`, `v` and `probe` values.
fn inputs() -> [Vec<f64>; 4] {
    let shapes = shapes();
    [(1.5, 61), (1.5, 62), (1.0, 63), (1.0, 64)]
        .into_iter()
        .zip(shapes)
        .map(|((std, seed), shape)| {
            values(init_full::<B, 4>(
                shape,
                InitDistribution::Normal { std },
                seed,
                &device(),
            ))
        })
        .collect::<Vec<_>>()
        .try_into()
        .expect("four inputs")
}

fn tensor(data: &[f64], shape: [usize; 4]) -> Tensor<B, 4> {
    Tensor::from_data(TensorData::new(data.to_vec(), shape), &device())
}

/// The attention whose gradients are checked.
#[derive(Debug, Clone, Copy)]
enum Variant {
    /// `ring_attention`, the composition.
    Ring,
    /// `ring_flash_attention`, one node.
    FusedRing,
    /// `all_gather_flash_attention`, the same node over gathered K/V.
    FusedAllGather,
}

fn attend<Bk: RingFlashAttentionOps>(
    variant: Variant,
    [q, k, v]: [Tensor<Bk, 4>; 3],
    group: &ProcessGroup,
    scale: f64,
) -> burn_megatron::Result<Tensor<Bk, 4>> {
    match variant {
        Variant::Ring => ring_attention(q, k, v, group, scale),
        Variant::FusedRing => ring_flash_attention(q, k, v, group, scale),
        Variant::FusedAllGather => all_gather_flash_attention(q, k, v, group, scale),
    }
}

#[test]
fn ring_attention_gradients_match_finite_differences() {
    check(Variant::Ring);
}

/// The same for the fused ring the model runs (`ring_flash_attention`: one node whose
/// backward recomputes each block from the merged output and log-sum-exp).
#[test]
fn fused_ring_attention_gradients_match_finite_differences() {
    check(Variant::FusedRing);
}

/// The same over all-gathered K/V (`all_gather_flash_attention`: the ring's node, its
/// K/V gradients reduce-scattered).
#[test]
fn fused_all_gather_attention_gradients_match_finite_differences() {
    check(Variant::FusedAllGather);
}

fn check(variant: Variant) {
    let shapes = shapes();
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    for cp in [2, 4] {
        let ranks = run(cp, |ctx| {
            let group = ctx.world();
            let split = LoadBalancedSplit::of_group(group);
            let local = |data: &[f64], n: usize| split.split(tensor(data, shapes[n]), 2);
            let full = inputs();
            let probe = local(&full[3], 3)?;

            let tracked = [0, 1, 2].map(|n| {
                Tensor::<AD, 4>::from_inner(local(&full[n], n).expect("splits")).require_grad()
            });
            let [q, k, v] = tracked.clone();
            let out = attend(variant, [q, k, v], group, scale)?;
            let grads = (out * Tensor::from_inner(probe.clone())).sum().backward();
            group.backward_failure()?;
            let analytic = tracked.map(|t| t.grad(&grads).expect("a gradient"));

            // The whole loss at `inputs` with element `e` of input `n` moved by `delta`.
            let loss = |n: usize, e: usize, delta: f64| -> Result<f64, burn_megatron::Error> {
                let mut moved = full.clone();
                moved[n][e] += delta;
                let [q, k, v] = [0, 1, 2].map(|i| local(&moved[i], i).expect("splits"));
                let out = attend(variant, [q, k, v], group, scale)?;
                let part = (out * probe.clone()).sum();
                Ok(group.all_reduce(part, ReduceOp::Sum)?.into_scalar())
            };
            let mut numeric = Vec::new();
            for (n, input) in full.iter().take(3).enumerate() {
                let mut grad = Vec::with_capacity(input.len());
                for e in 0..input.len() {
                    grad.push((loss(n, e, STEP)? - loss(n, e, -STEP)?) / (2.0 * STEP));
                }
                numeric.push(grad);
            }
            Ok((analytic.map(|g| g.into_data()), numeric))
        });
        for (n, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            let parts = ranks
                .iter()
                .map(|(analytic, _)| Tensor::<B, 4>::from_data(analytic[n].clone(), &device()))
                .collect();
            let got = LoadBalancedSplit::restore(parts, 2).expect("the parts restore");
            assert_close(
                &format!("{variant:?} CP={cp}: {name}"),
                &values(got),
                &ranks[0].1[n],
                tolerance::FINITE_DIFFERENCE_F64,
            );
        }
    }
}
