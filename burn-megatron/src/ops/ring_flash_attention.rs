//! Ring attention on the fused flash attention: context parallelism's `p2p` attention as one
//! operation whose backward recomputes each block from the merged output and log-sum-exp and
//! passes the K/V gradients back around the ring.
//!
//! A rank holds two chunks of queries and, at ring step `s`, the K/V block of the rank `s`
//! before it, whose passing on to the next rank starts before the step's attention reads it
//! (a copy is sent, so that the two overlap on our CUDA backend). Each block pair it computes
//! is one call of [`FlashAttentionOps::flash_attention`]: a chunk against itself is causal
//! attention on aligned blocks, a chunk against an earlier one is full attention, so the fused
//! kernels (cuDNN on our CUDA backend) take every pair as it is. Which pairs a step computes is
//! the caller's [`RingPlan`] (the load-balanced split of [`crate::context_parallel`]). The
//! pairs' results are merged by log-sum-exp
//! (`lse = log Σ exp(lse_j)`, `out = Σ exp(lse_j - lse) out_j`) in f32.
//!
//! The backward of the merged attention needs no gradient through the merge: with the merged
//! output `O` and log-sum-exp `L`, `exp(scale · q kᵀ - L)` over one block is exactly that
//! block's share of the global probabilities, and `rowsum(dO ∘ O)` is the global softmax
//! term, so [`FlashAttentionOps::flash_attention_backward`] of each pair, given `O` and `L`
//! in place of the pair's own, gives that pair's exact gradients. The node stores `q`, `k`,
//! `v` (the rank's own), `O` and `L`: memory linear in the sequence. Its backward replays the
//! ring: at step `s` the rank holds the K/V of rank `rank - s` and the gradient accumulated
//! for it by the ranks before, adds its own queries' share, and passes both on; one last
//! exchange brings each rank the complete gradient of its own K/V (`cp` exchanges of the
//! gradient, `cp - 1` of K/V). A failed exchange in the backward is recorded on the group
//! ([`ProcessGroup::fail_in_backward`]) and the gradients go on as zeros.
//!
//! Every backend runs this file's code; only `flash_attention` and its backward differ (the
//! Burn compositions on NdArray, which materialise one block pair's scores at a time).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::mapping::Comm;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::flash_attention::{FlashAttentionOps, check_shapes};
use super::primitive::{raw, wrap};

/// One block pair of a ring step: the rank's query chunk `query` (0 or 1) against chunk `key`
/// (0 or 1) of the K/V block held at that step, causal (aligned blocks) or full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingBlock {
    /// The rank's query chunk: 0 (the early one) or 1.
    pub query: usize,
    /// The chunk of the K/V block held at the step: 0 or 1.
    pub key: usize,
    /// Causal on aligned blocks (the query chunk against itself), else full attention.
    pub causal: bool,
}

/// What each ring step computes: `steps[s]` are the block pairs of step `s`, at which the
/// rank holds the K/V block of the rank `s` before it in the group. `steps.len()` is the
/// group's size; every query chunk must appear in some pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPlan {
    /// The block pairs of each step.
    pub steps: Vec<Vec<RingBlock>>,
}

/// Ring attention on the fused flash attention (see the [module docs](self)).
pub trait RingFlashAttentionOps: FlashAttentionOps + DistBackend {
    /// Attention of this rank's two query chunks against the K/V blocks of every rank of
    /// `group`, as `plan` pairs them, merged by log-sum-exp.
    ///
    /// # Shapes
    /// - `q`: `[batch, heads, 2 · len, head_dim]`, the rank's two chunks of `len` tokens;
    /// - `k`, `v`: `[batch, kv_heads, 2 · len, head_dim]`, `heads` a multiple of `kv_heads`;
    /// - returns `[batch, heads, 2 · len, head_dim]` in q's dtype.
    ///
    /// `Autodiff<B>` records one node (see the [module docs](self)). Fails if an exchange
    /// fails; panics on shapes that do not fit or a plan that leaves a query chunk unseen.
    fn ring_flash_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        group: &ProcessGroup,
        scale: f64,
        plan: &RingPlan,
    ) -> DistResult<Tensor<Self, 4>> {
        Ok(ring_forward(q, k, v, group, scale, plan)?.0)
    }
}

/// The forward on any backend: the output (q's dtype) and the merged log-sum-exp of each
/// query chunk, `[2, batch, heads, len]` (f32, f64 for f64): chunk-major, so that one chunk's
/// is a packed tensor, as cuDNN's backward takes it.
fn ring_forward<B: FlashAttentionOps + DistBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    group: &ProcessGroup,
    scale: f64,
    plan: &RingPlan,
) -> DistResult<(Tensor<B, 4>, Tensor<B, 4>)> {
    check_shapes(q.dims(), k.dims(), v.dims(), true);
    let seq = q.dims()[2];
    assert!(
        seq.is_multiple_of(2),
        "ring attention takes two query chunks: {seq} tokens do not cut in two"
    );
    assert_eq!(
        plan.steps.len(),
        group.size(),
        "a ring plan has one step per rank of the group"
    );
    let (len, dtype, kv_heads) = (seq / 2, q.dtype(), k.dims()[1]);
    let wide = wide(dtype);
    let queries = [0, 1].map(|i| q.clone().narrow(2, i * len, len));
    let mut running: [Option<(Tensor<B, 4>, Tensor<B, 3>)>; 2] = [None, None];
    let mut held = [k, v];
    for (step, blocks) in plan.steps.iter().enumerate() {
        let next = match step + 1 < plan.steps.len() {
            true => Some(pass_on(&held, group)?),
            false => None,
        };
        for block in blocks {
            let [keys, values] = held.clone().map(|t| t.narrow(2, block.key * len, len));
            let (out, lse) = B::flash_attention(
                queries[block.query].clone(),
                keys,
                values,
                scale,
                block.causal,
            );
            let partial = (out.cast(wide), lse.cast(wide));
            running[block.query] = Some(match running[block.query].take() {
                Some(so_far) => merge(so_far, partial),
                None => partial,
            });
        }
        if let Some(next) = next {
            held = split_kv(next, kv_heads);
        }
    }
    let [early, late] = running.map(|r| r.expect("the plan gives each query chunk a block"));
    let out = Tensor::cat(vec![early.0, late.0], 2).cast(dtype);
    let lse = Tensor::stack(vec![early.1, late.1], 0);
    Ok((out, lse))
}

/// Starts passing the K/V block `held` (`[k, v]`) to the next rank of the ring; returns the
/// block of the previous rank, `[batch, 2 · kv_heads, seq, head_dim]` (K's heads, then V's).
///
/// K and V travel as one tensor, a new one: one exchange a step, and no memory shared with
/// `held`. On our CUDA backend the exchange runs on a side stream, and a later kernel touching
/// its memory, even only reading it, waits for its end; so the step's attention, which reads
/// `held`, runs while the exchange is under way instead of after it.
fn pass_on<B: DistBackend>(
    held: &[Tensor<B, 4>; 2],
    group: &ProcessGroup,
) -> DistResult<Tensor<B, 4>> {
    Comm::RingToNext.apply(group, Tensor::cat(held.to_vec(), 1))
}

/// `[k, v]` of a block received from [`pass_on`].
fn split_kv<B: Backend>(kv: Tensor<B, 4>, kv_heads: usize) -> [Tensor<B, 4>; 2] {
    [0, 1].map(|i| kv.clone().narrow(1, i * kv_heads, kv_heads))
}

/// The dtype the merge and the gradient sums run in: f32, or f64 for f64.
fn wide(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// Two partial results over disjoint keys merged by log-sum-exp (the larger one subtracted,
/// so that both exponentials are at most 1).
fn merge<B: Backend>(
    (out_a, lse_a): (Tensor<B, 4>, Tensor<B, 3>),
    (out_b, lse_b): (Tensor<B, 4>, Tensor<B, 3>),
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let max = lse_a.clone().max_pair(lse_b.clone());
    let weight_a = (lse_a - max.clone()).exp();
    let weight_b = (lse_b - max.clone()).exp();
    let sum = weight_a.clone() + weight_b.clone();
    let lse = max + sum.clone().log();
    let [weight_a, weight_b] = [weight_a, weight_b].map(|w| (w / sum.clone()).unsqueeze_dim(3));
    (out_a * weight_a + out_b * weight_b, lse)
}

/// The forward on the inner backend, one node storing `q`, `k`, `v`, the merged output and
/// log-sum-exp.
impl<B: RingFlashAttentionOps, C: CheckpointStrategy> RingFlashAttentionOps for Autodiff<B, C> {
    fn ring_flash_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        group: &ProcessGroup,
        scale: f64,
        plan: &RingPlan,
    ) -> DistResult<Tensor<Self, 4>> {
        let [q, k, v] = [q, k, v].map(raw);
        let (out, lse) = ring_forward::<B>(inner(&q), inner(&k), inner(&v), group, scale, plan)?;
        let out = raw(out);
        let state = RingState {
            q: q.primitive.clone(),
            k: k.primitive.clone(),
            v: v.primitive.clone(),
            out: out.clone(),
            lse: raw(lse),
            group: group.clone(),
            scale,
            plan: plan.clone(),
        };
        Ok(wrap(record::<B, C, _>(
            RingBackward,
            &[&q, &k, &v],
            state,
            out,
        )))
    }
}

/// What the backward keeps from the forward.
#[derive(Debug, Clone)]
struct RingState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    group: ProcessGroup,
    scale: f64,
    plan: RingPlan,
}

/// The ring's backward (see the [module docs](self)). Its parents are `[q, k, v]`.
#[derive(Debug)]
struct RingBackward;

impl<B: RingFlashAttentionOps> BackwardStep<B> for RingBackward {
    type State = RingState<B>;

    fn backward(
        self,
        grad: FloatTensor<B>,
        s: <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let RingState {
            q,
            k,
            v,
            out,
            lse,
            group,
            scale,
            plan,
        } = s;
        let (q, k, v): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) = (wrap(q), wrap(k), wrap(v));
        let (shapes, dtypes, device) = (
            [q.shape(), k.shape(), v.shape()],
            [q.dtype(), k.dtype(), v.dtype()],
            q.device(),
        );
        let outputs = (wrap(out), wrap(lse), wrap(grad));
        let [dq, dk, dv] = match ring_backward(q, k, v, outputs, &group, scale, &plan) {
            Ok(gradients) => gradients,
            Err(error) => {
                // Backward has no error channel: the group keeps the error (its later calls
                // and `backward_failure` return it) and the gradients go on as zeros.
                group.fail_in_backward(error);
                [0, 1, 2].map(|i| Tensor::zeros(shapes[i].clone(), (&device, dtypes[i])))
            }
        };
        for (index, gradient) in [dq, dk, dv].into_iter().enumerate() {
            register(grads, parent(parents, index), || gradient);
        }
    }
}

/// `[dq, dk, dv]` of the ring from the merged output `out`, its log-sum-exp `lse` and the
/// output's gradient `grad`, each in its input's dtype.
fn ring_backward<B: FlashAttentionOps + DistBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    (out, lse, grad): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    group: &ProcessGroup,
    scale: f64,
    plan: &RingPlan,
) -> DistResult<[Tensor<B, 4>; 3]> {
    let (len, kv_heads) = (q.dims()[2] / 2, k.dims()[1]);
    let (q_dtype, kv_dtype) = (q.dtype(), k.dtype());
    let wide = wide(q_dtype);
    let chunk4 = |t: &Tensor<B, 4>, i: usize| t.clone().narrow(2, i * len, len);
    let [_, batch, heads, _] = lse.dims();
    let chunk_lse = |i: usize| lse.clone().narrow(0, i, 1).reshape([batch, heads, len]);
    let mut dq: [Option<Tensor<B, 4>>; 2] = [None, None];
    let [_, _, seq, head_dim] = k.dims();
    let device = k.device();
    let zeros = |shape: [usize; 4]| Tensor::<B, 4>::zeros(shape, (&device, wide));
    let mut dkv = zeros([batch, 2 * kv_heads, seq, head_dim]);
    let add = |sum: Option<Tensor<B, 4>>, t: Tensor<B, 4>| match sum {
        Some(sum) => sum + t,
        None => t,
    };
    let mut held = [k, v];
    for (step, blocks) in plan.steps.iter().enumerate() {
        // The block is passed on before this step's gradients are computed from it, so that
        // the exchange runs under them (see `pass_on`).
        let next = match step + 1 < plan.steps.len() {
            true => Some(pass_on(&held, group)?),
            false => None,
        };
        let mut dkv_chunks: [Option<Tensor<B, 4>>; 2] = [None, None];
        for block in blocks {
            let (i, j) = (block.query, block.key);
            let [keys, values] = held.clone().map(|t| chunk4(&t, j));
            let [dq_block, dk_block, dv_block] = B::flash_attention_backward(
                chunk4(&q, i),
                keys,
                values,
                chunk4(&out, i),
                chunk_lse(i),
                chunk4(&grad, i),
                scale,
                block.causal,
            );
            dq[i] = Some(add(dq[i].take(), dq_block.cast(wide)));
            let dkv_block = Tensor::cat(vec![dk_block, dv_block], 1).cast(wide);
            dkv_chunks[j] = Some(add(dkv_chunks[j].take(), dkv_block));
        }
        let [early, late] = dkv_chunks;
        if early.is_some() || late.is_some() {
            let own = zeros([batch, 2 * kv_heads, len, head_dim]);
            let [early, late] = [early, late].map(|c| c.unwrap_or_else(|| own.clone()));
            dkv = dkv + Tensor::cat(vec![early, late], 2);
        }
        // Pass the gradient on with what this rank added; after the last step, it goes to
        // the rank whose K/V it is.
        dkv = Comm::RingToNext.apply(group, dkv)?;
        if let Some(next) = next {
            held = split_kv(next, kv_heads);
        }
    }
    let [early, late] = dq.map(|d| d.unwrap_or_else(|| zeros([batch, heads, len, head_dim])));
    let dq = Tensor::cat(vec![early, late], 2).cast(q_dtype);
    let dk = dkv.clone().narrow(1, 0, kv_heads).cast(kv_dtype);
    let dv = dkv.narrow(1, kv_heads, kv_heads).cast(kv_dtype);
    Ok([dq, dk, dv])
}

/// CubeCL backends: the default, on their fused flash attention.
#[cfg(feature = "fused")]
impl<R, F, I, BT> RingFlashAttentionOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
    Self: FlashAttentionOps + DistBackend,
{
}
