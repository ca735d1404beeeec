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
//! (`lse = log Σ exp(lse_j)`, `out = Σ exp(lse_j - lse) out_j`) in f32
//! ([`RingFlashAttentionOps::lse_merge`]: one kernel on CubeCL backends).
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
//! gradient, `cp - 1` of K/V). The gradients are summed in flat f32 buffers, each block's
//! added in place to its slot ([`WriteSlotOps::add_slot`]). A failed exchange in the backward
//! is recorded on the group ([`ProcessGroup::fail_in_backward`]) and the gradients go on as
//! zeros.
//!
//! The same operation serves `--cp-comm-type all_gather` ([`KvExchange::AllGather`]): every
//! rank's K/V block is gathered once, the steps take their blocks from it in the ring's order
//! (the same block pairs, the same flash calls and merges), and the backward sums each block's
//! gradient on the rank that computed it and reduce-scatters them to their owners. It holds the
//! whole sequence's K/V during the attention, which the ring never does.
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
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup, ReduceOp};

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::flash_attention::{FlashAttentionOps, check_shapes};
use super::primitive::{raw, wrap};
use super::write_slot::WriteSlotOps;

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

/// How the K/V block of each step reaches the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvExchange {
    /// Passed around the ring, one block a step, the next exchange under the step's
    /// attention (`--cp-comm-type p2p`); the K/V gradients travel back around it.
    #[default]
    Ring,
    /// Every rank's block all-gathered before the first step (`--cp-comm-type all_gather`);
    /// the K/V gradients of every block are summed on the rank that computed them, then
    /// reduce-scattered to the blocks' ranks. The forward and the backward each gather once.
    AllGather,
}

/// What each ring step computes: `steps[s]` are the block pairs of step `s`, at which the
/// rank holds the K/V block of the rank `s` before it in the group. `steps.len()` is the
/// group's size; every query chunk must appear in some pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPlan {
    /// The block pairs of each step.
    pub steps: Vec<Vec<RingBlock>>,
    /// How each step's block arrives.
    pub exchange: KvExchange,
}

impl RingPlan {
    /// The rank whose K/V block rank `rank` of a group of `size` holds at step `step`.
    fn source(rank: usize, size: usize, step: usize) -> usize {
        (rank + size - step) % size
    }
}

/// Ring attention on the fused flash attention (see the [module docs](self)).
pub trait RingFlashAttentionOps: FlashAttentionOps + DistBackend + WriteSlotOps {
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

    /// Two partial results over disjoint keys merged by log-sum-exp: `(out, lse)` of the
    /// union, both in `wide` (see [`lse_merge_composition`], the default and the reference).
    ///
    /// # Shapes
    /// - `out_a`, `out_b`: `[batch, heads, len, head_dim]`, any float dtypes;
    /// - `lse_a`, `lse_b`: `[batch, heads, len]` in `wide`;
    /// - returns `[batch, heads, len, head_dim]` and `[batch, heads, len]`, in `wide`.
    fn lse_merge(
        a: (Tensor<Self, 4>, Tensor<Self, 3>),
        b: (Tensor<Self, 4>, Tensor<Self, 3>),
        wide: DType,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        lse_merge_composition(a, b, wide)
    }
}

/// The forward on any backend: the output (q's dtype) and the merged log-sum-exp of each
/// query chunk, `[2, batch, heads, len]` (f32, f64 for f64): chunk-major, so that one chunk's
/// is a packed tensor, as cuDNN's backward takes it.
fn ring_forward<B: RingFlashAttentionOps>(
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
    let gathered = match plan.exchange {
        KvExchange::Ring => None,
        KvExchange::AllGather => Some(gather_kv(&k, &v, group)?),
    };
    let mut held = [k, v];
    for (step, blocks) in plan.steps.iter().enumerate() {
        let next = match (&gathered, step + 1 < plan.steps.len()) {
            (None, true) => Some(pass_on(&held, group)?),
            _ => None,
        };
        if let Some(all) = &gathered {
            held = gathered_block(all, group, step, kv_heads);
        }
        for block in blocks {
            let [keys, values] = held.clone().map(|t| t.narrow(2, block.key * len, len));
            let (out, lse) = B::flash_attention(
                queries[block.query].clone(),
                keys,
                values,
                scale,
                block.causal,
            );
            // The first pair's output stays in q's dtype: the merge reads either.
            let partial = (out, lse.cast(wide));
            running[block.query] = Some(match running[block.query].take() {
                Some(so_far) => B::lse_merge(so_far, partial, wide),
                None => partial,
            });
        }
        if let Some(next) = next {
            held = split_kv(next, kv_heads);
        }
    }
    let [early, late] = running.map(|r| r.expect("the plan gives each query chunk a block"));
    // Sequence-major (`[batch, seq, heads, head_dim]` in memory), as the model reads it
    // next: its heads then merge without a copy.
    let sequence_major = |t: Tensor<B, 4>| t.cast(dtype).swap_dims(1, 2);
    let out = Tensor::cat(vec![sequence_major(early.0), sequence_major(late.0)], 1).swap_dims(1, 2);
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

/// Every rank's K/V block, `[size, batch, 2 · kv_heads, seq, head_dim]` (K's heads, then
/// V's), in one all-gather over `group`.
fn gather_kv<B: DistBackend>(
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    group: &ProcessGroup,
) -> DistResult<Tensor<B, 5>> {
    let kv = Tensor::cat(vec![k.clone(), v.clone()], 1).unsqueeze_dim::<5>(0);
    group.all_gather(kv, 0)
}

/// `[k, v]` of the block this rank holds at `step`, out of [`gather_kv`]'s result.
fn gathered_block<B: Backend>(
    all: &Tensor<B, 5>,
    group: &ProcessGroup,
    step: usize,
    kv_heads: usize,
) -> [Tensor<B, 4>; 2] {
    let source = RingPlan::source(group.rank(), group.size(), step);
    split_kv(
        all.clone().narrow(0, source, 1).squeeze_dim::<4>(0),
        kv_heads,
    )
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
/// so that both exponentials are at most 1), in Burn operations: `lse = log(exp(lse_a) +
/// exp(lse_b))`, `out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b`, in `wide`.
pub fn lse_merge_composition<B: Backend>(
    (out_a, lse_a): (Tensor<B, 4>, Tensor<B, 3>),
    (out_b, lse_b): (Tensor<B, 4>, Tensor<B, 3>),
    wide: DType,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let (out_a, out_b) = (out_a.cast(wide), out_b.cast(wide));
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
///
/// The gradients are summed in flat buffers in `wide` dtype, one slot per (chunk, tensor),
/// each slot sequence-major as the fused backward writes its gradients: `dq` as
/// `[chunk][batch, len, heads, head_dim]`, the K/V gradient that travels the ring as
/// `[k or v][chunk][batch, len, kv_heads, head_dim]`. Each block's gradient is added to its
/// slot where it lies ([`WriteSlotOps::add_slot`]: in place, cast included, one kernel on
/// CubeCL backends), and the results come out sequence-major.
fn ring_backward<B: RingFlashAttentionOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    (out, lse, grad): (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>),
    group: &ProcessGroup,
    scale: f64,
    plan: &RingPlan,
) -> DistResult<[Tensor<B, 4>; 3]> {
    let [batch, heads, seq, head_dim] = q.dims();
    let (len, kv_heads) = (seq / 2, k.dims()[1]);
    let (q_dtype, kv_dtype) = (q.dtype(), k.dtype());
    let wide = wide(q_dtype);
    let chunk4 = |t: &Tensor<B, 4>, i: usize| t.clone().narrow(2, i * len, len);
    let chunk_lse = |i: usize| lse.clone().narrow(0, i, 1).reshape([batch, heads, len]);
    let device = k.device();
    // Elements of one slot: a chunk of dq, or of dk or dv.
    let (q_slot, kv_slot) = (
        batch * heads * len * head_dim,
        batch * kv_heads * len * head_dim,
    );
    let zeros = |n: usize| Tensor::<B, 1>::zeros([n], (&device, wide));
    let mut dq = zeros(2 * q_slot);
    let gathered = match plan.exchange {
        KvExchange::Ring => None,
        KvExchange::AllGather => Some(gather_kv(&k, &v, group)?),
    };
    // The ring's travelling gradient holds one block's slots; gathered, every block's (the
    // slots of the rank whose block it is at `4 · kv_slot · rank`).
    let blocks_held = if gathered.is_some() { group.size() } else { 1 };
    let mut dkv = zeros(4 * kv_slot * blocks_held);
    let mut held = [k, v];
    for (step, blocks) in plan.steps.iter().enumerate() {
        // The block is passed on before this step's gradients are computed from it, so that
        // the exchange runs under them (see `pass_on`).
        let next = match (&gathered, step + 1 < plan.steps.len()) {
            (None, true) => Some(pass_on(&held, group)?),
            _ => None,
        };
        let at = match &gathered {
            Some(all) => {
                held = gathered_block(all, group, step, kv_heads);
                4 * kv_slot * RingPlan::source(group.rank(), group.size(), step)
            }
            None => 0,
        };
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
            dq = accumulate(dq, i * q_slot, dq_block, wide);
            dkv = accumulate(dkv, at + j * kv_slot, dk_block, wide);
            dkv = accumulate(dkv, at + (2 + j) * kv_slot, dv_block, wide);
        }
        if gathered.is_none() {
            // Pass the gradient on with what this rank added; after the last step, it goes
            // to the rank whose K/V it is.
            dkv = Comm::RingToNext.apply(group, dkv)?;
        }
        if let Some(next) = next {
            held = split_kv(next, kv_heads);
        }
    }
    if gathered.is_some() {
        // Each block's gradient summed over the ranks that computed one, on its own rank.
        let size = group.size();
        dkv = group
            .reduce_scatter(dkv.reshape([size, 4 * kv_slot]), 0, ReduceOp::Sum)?
            .reshape([4 * kv_slot]);
    }
    // Two chunks' slots, `[chunk][batch, len, heads, head_dim]`, as `[batch, heads, 2 · len,
    // head_dim]` (sequence-major in memory; no copy for one sequence).
    let unchunk = |flat: Tensor<B, 1>, heads: usize, dtype: DType| {
        let t = flat.cast(dtype);
        let t = match batch {
            1 => t.reshape([1, seq, heads, head_dim]),
            _ => t
                .reshape([2, batch, len, heads, head_dim])
                .swap_dims(0, 1)
                .reshape([batch, seq, heads, head_dim]),
        };
        t.swap_dims(1, 2)
    };
    let [dk, dv] = [0, 1].map(|t| {
        let flat = dkv.clone().narrow(0, 2 * t * kv_slot, 2 * kv_slot);
        unchunk(flat, kv_heads, kv_dtype)
    });
    Ok([unchunk(dq, heads, q_dtype), dk, dv])
}

/// `sum` (flat, `wide`) with `block` (`[batch, heads, len, head_dim]`) added sequence-major at
/// `start..`, cast to `wide`: in place where the backend can ([`WriteSlotOps::add_slot`],
/// whose buffers are f32), else as a slice's sum. A block the fused backward wrote
/// sequence-major is read where it lies.
fn accumulate<B: RingFlashAttentionOps>(
    sum: Tensor<B, 1>,
    start: usize,
    block: Tensor<B, 4>,
    wide: DType,
) -> Tensor<B, 1> {
    let n = block.shape().num_elements();
    let block = block.swap_dims(1, 2).reshape([n]);
    match wide {
        DType::F32 => B::add_slot(sum, start, block),
        _ => {
            let total = sum.clone().slice(start..start + n) + block.cast(wide);
            sum.slice_assign(start..start + n, total)
        }
    }
}

/// CubeCL backends: the default, on their fused flash attention, and the merge in one kernel.
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_dist::DistBackend;
    use burn_megatron_kernels::fused::lse_merge::lse_merge;

    use super::{FlashAttentionOps, RingFlashAttentionOps};
    use crate::ops::primitive::{raw, wrap};

    /// A partial result: `[batch, heads, len, head_dim]` and `[batch, heads, len]`.
    type Partial<R, F, I, BT> = (
        Tensor<CubeBackend<R, F, I, BT>, 4>,
        Tensor<CubeBackend<R, F, I, BT>, 3>,
    );

    /// [`RingFlashAttentionOps::lse_merge`] in one kernel.
    fn merged<R, F, I, BT>(
        (out_a, lse_a): Partial<R, F, I, BT>,
        (out_b, lse_b): Partial<R, F, I, BT>,
        wide: DType,
    ) -> Partial<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let (out, lse) = lse_merge((raw(out_a), raw(lse_a)), (raw(out_b), raw(lse_b)), wide);
        (wrap(out), wrap(lse))
    }

    impl<R, F, I, BT> RingFlashAttentionOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
        Self: FlashAttentionOps + DistBackend,
    {
        fn lse_merge(
            a: (Tensor<Self, 4>, Tensor<Self, 3>),
            b: (Tensor<Self, 4>, Tensor<Self, 3>),
            wide: DType,
        ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
            merged(a, b, wide)
        }
    }
}
