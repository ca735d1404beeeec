//! Causal attention over CP = 1, 2, 4 by the ring (`p2p`), `all_gather` and `a2a`, against the
//! single-device attention (`ops::flash_attention::attention`, causal): each rank's output and
//! the gradients of its q, k and v, put back in sequence order, equal the reference's (f32,
//! 1e-5 relative). The loss is `Σ probe ∘ out`, each rank's part of it on its own tokens, so
//! the ranks' losses sum to the reference's.
//!
//! Cases: multi-head attention; chunks of one token (`seq = 2 · cp`); grouped-query attention
//! (4 query heads on 2 K/V heads); one K/V head for 4 query heads (fewer K/V heads than CP).

use burn::tensor::{Tensor, TensorData};
use burn_megatron::context_parallel::{
    CpCommType, LoadBalancedSplit, context_parallel_attention, context_parallel_flash_attention,
};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::flash_attention::attention;

use crate::{AD, B, assert_close, run, tolerance, values};

/// One attention shape; `seq: None` means `2 · cp` (chunks of one token).
#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq: Option<usize>,
    head_dim: usize,
}

const CASES: [Case; 4] = [
    Case {
        name: "multi-head",
        batch: 2,
        heads: 3,
        kv_heads: 3,
        seq: Some(16),
        head_dim: 8,
    },
    Case {
        name: "one-token chunks",
        batch: 1,
        heads: 2,
        kv_heads: 2,
        seq: None,
        head_dim: 4,
    },
    Case {
        name: "grouped-query",
        batch: 2,
        heads: 4,
        kv_heads: 2,
        seq: Some(24),
        head_dim: 4,
    },
    Case {
        name: "one K/V head",
        batch: 1,
        heads: 4,
        kv_heads: 1,
        seq: Some(8),
        head_dim: 6,
    },
];

/// The full-sequence `q`, `k`, `v` and `probe`, `[batch, heads or kv_heads, seq, head_dim]`.
fn inputs(case: Case, seq: usize) -> [Tensor<B, 4>; 4] {
    let q = [case.batch, case.heads, seq, case.head_dim];
    let kv = [case.batch, case.kv_heads, seq, case.head_dim];
    [(q, 1.0, 11), (kv, 1.0, 12), (kv, 1.0, 13), (q, 1.0, 14)].map(|(shape, std, seed)| {
        init_full::<B, 4>(
            shape,
            InitDistribution::Normal { std },
            seed,
            &Default::default(),
        )
    })
}

fn scale(case: Case) -> f64 {
    1.0 / (case.head_dim as f64).sqrt()
}

/// `[out, dq, dk, dv]` of one computation, as tensor data.
type Results = [TensorData; 4];

/// The single-device causal attention and its gradients.
fn reference(case: Case, seq: usize) -> Results {
    let [q, k, v, probe] = inputs(case, seq);
    let [q, k, v] = [q, k, v].map(|t| Tensor::<AD, 4>::from_inner(t).require_grad());
    let out = attention(q.clone(), k.clone(), v.clone(), scale(case), true);
    let grads = (out.clone() * Tensor::from_inner(probe)).sum().backward();
    let grad = |t: &Tensor<AD, 4>| t.grad(&grads).expect("a gradient").into_data();
    [out.inner().into_data(), grad(&q), grad(&k), grad(&v)]
}

/// Context-parallel attention on `cp` thread ranks: each rank's results, on its tokens.
fn context_parallel(
    case: Case,
    seq: usize,
    cp: usize,
    comm: CpCommType,
    fused: bool,
) -> Vec<Results> {
    run(cp, |ctx| {
        // ANCHOR: cp_rank
        let split = LoadBalancedSplit::of_group(ctx.world());
        let [q, k, v, probe] = inputs(case, seq).map(|t| split.split(t, 2).expect("seq splits"));
        let [q, k, v] = [q, k, v].map(|t| Tensor::<AD, 4>::from_inner(t).require_grad());
        let attend = match fused {
            true => context_parallel_flash_attention,
            false => context_parallel_attention,
        };
        let out = attend(
            q.clone(),
            k.clone(),
            v.clone(),
            ctx.world(),
            scale(case),
            comm,
        )?;
        let grads = (out.clone() * Tensor::from_inner(probe)).sum().backward();
        // ANCHOR_END: cp_rank
        ctx.world().backward_failure()?;
        let grad = |t: &Tensor<AD, 4>| t.grad(&grads).expect("a gradient").into_data();
        Ok([out.inner().into_data(), grad(&q), grad(&k), grad(&v)])
    })
}

fn check(case: Case, comm: CpCommType) {
    check_variant(case, comm, false);
}

/// `check` for the fused path the model runs ([`context_parallel_flash_attention`]).
fn check_variant(case: Case, comm: CpCommType, fused: bool) {
    for cp in [1, 2, 4] {
        let seq = case.seq.unwrap_or(2 * cp);
        let want = reference(case, seq);
        let ranks = context_parallel(case, seq, cp, comm, fused);
        for (n, name) in ["output", "dq", "dk", "dv"].into_iter().enumerate() {
            let parts = ranks
                .iter()
                .map(|r| Tensor::<B, 4>::from_data(r[n].clone(), &Default::default()))
                .collect();
            let got = LoadBalancedSplit::restore(parts, 2).expect("the parts restore");
            let want = Tensor::<B, 4>::from_data(want[n].clone(), &Default::default());
            assert_close(
                &format!(
                    "{} {comm} fused={fused} CP={cp} seq={seq}: {name}",
                    case.name
                ),
                &values(got),
                &values(want),
                tolerance::F32,
            );
        }
    }
}

#[test]
fn ring_attention_equals_single_device_attention() {
    for case in CASES {
        check(case, CpCommType::P2p);
    }
}

#[test]
fn all_gather_attention_equals_single_device_attention() {
    for case in CASES {
        check(case, CpCommType::AllGather);
    }
}

#[test]
fn all_to_all_attention_equals_single_device_attention() {
    // 3 heads do not split over CP = 2 or 4: the other cases, with the K/V-head fallback for
    // fewer K/V heads than CP.
    for case in CASES.into_iter().filter(|c| c.heads.is_multiple_of(4)) {
        check(case, CpCommType::A2a);
    }
}

/// The fused ring (one node, flash attention per block pair, its backward from the merged
/// output and log-sum-exp), the same over all-gathered blocks, and the fused all-to-all, as
/// the model runs them.
#[test]
fn fused_ring_all_gather_and_all_to_all_equal_single_device_attention() {
    for case in CASES {
        check_variant(case, CpCommType::P2p, true);
        check_variant(case, CpCommType::AllGather, true);
        if case.heads.is_multiple_of(4) {
            check_variant(case, CpCommType::A2a, true);
        }
    }
}

#[test]
fn all_to_all_refuses_heads_that_do_not_split_over_cp() {
    let case = CASES[0];
    let errors = run(2, |ctx| {
        let split = LoadBalancedSplit::of_group(ctx.world());
        let [q, k, v, _] = inputs(case, 8).map(|t| split.split(t, 2).expect("seq splits"));
        Ok(
            context_parallel_attention(q, k, v, ctx.world(), 1.0, CpCommType::A2a)
                .unwrap_err()
                .to_string(),
        )
    });
    for err in errors {
        assert!(
            err.contains("splits the 3 attention heads") && err.contains("--cp-comm-type p2p"),
            "{err}"
        );
    }
}

#[test]
fn comm_types_parse_by_megatron_names() {
    for comm in [CpCommType::P2p, CpCommType::AllGather, CpCommType::A2a] {
        assert_eq!(comm.name().parse::<CpCommType>().unwrap(), comm);
    }
    let err = "a2a+p2p".parse::<CpCommType>().unwrap_err().to_string();
    assert!(err.contains("use p2p, all_gather or a2a"), "{err}");
}
