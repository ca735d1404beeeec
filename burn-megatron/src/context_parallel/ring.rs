//! Context-parallel causal attention over a ring (Megatron's `--cp-comm-type p2p`, ring
//! attention): K/V blocks travel around the CP group, so no rank ever holds more than two
//! blocks of them.

use burn::tensor::Tensor;
use burn_megatron_dist::mapping::ring_exchange;
use burn_megatron_dist::{DistBackend, ProcessGroup};

use super::block_attention::{PartialAttention, block_attention, merge};
use super::split::LoadBalancedSplit;
use crate::error::Result;
use crate::ops::RingFlashAttentionOps;
use crate::ops::flash_attention::check_shapes;
use crate::ops::ring_flash_attention::{KvExchange, RingBlock, RingPlan};

/// Causal attention of this rank's queries against the whole sequence's keys and values, the
/// K/V blocks passed around `cp_group`; every tensor in the
/// [load-balanced split](LoadBalancedSplit).
///
/// At step `s` (`0..cp`) this rank holds the K/V of rank `rank - s` (mod `cp`), and passes it
/// on to rank `rank + 1` ([`ring_exchange`], `cp - 1` exchanges in all). Each of its two query
/// chunks attends to each of the block's two key chunks that is not entirely in its future
/// (chunk indices compared: an earlier chunk is seen whole, the same chunk under the causal
/// mask, a later one skipped), and the partial result is merged into the chunk's running
/// output by log-sum-exp ([`merge`]). With the load-balanced split every step after the first
/// costs the same on every rank: half the queries against the whole block, or all the queries
/// against half of it.
///
/// Backward: every piece is differentiable under `Autodiff<B>` (the block attention and merge
/// as compositions, the exchange as a mapping whose gradient goes the other way round the ring),
/// so the gradients of K/V travel back around the ring, `cp - 1` exchanges, each rank summing
/// its queries' contributions into the block as it passes. Autodiff keeps every step's
/// probabilities (`[batch, heads, seq / 2cp, seq / 2cp]` per block pair) for the backward
/// rather than recomputing them, and the exchange and the attention run one after the other
/// (no overlap).
///
/// # Shapes
/// - `q`: `[batch, heads, seq / cp, head_dim]`, this rank's tokens in split order;
/// - `k`, `v`: `[batch, kv_heads, seq / cp, head_dim]`, `heads` a multiple of `kv_heads`;
/// - returns `[batch, heads, seq / cp, head_dim]` in q's dtype.
///
/// Fails if an exchange fails, or if `seq / cp` is odd (the split needs two equal chunks);
/// panics on shapes that do not fit each other.
pub fn ring_attention<B: DistBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
) -> Result<Tensor<B, 4>> {
    check_shapes(q.dims(), k.dims(), v.dims(), true);
    let split = LoadBalancedSplit::of_group(cp_group);
    let (cp, dtype, kv_heads) = (split.cp, q.dtype(), k.dims()[1]);
    let seq = q.dims()[2] * cp;
    let len = split.chunk_len(seq)?;
    let positions = |chunk: usize| (chunk * len..(chunk + 1) * len).collect::<Vec<_>>();
    let queries = [0, 1].map(|i| q.clone().narrow(2, i * len, len));
    let mut running: [Option<PartialAttention<B>>; 2] = [None, None];
    // K and V travel as one tensor: one exchange a step, and one node a step in the graph, so
    // that every rank's backward runs the exchanges in the same order.
    let mut kv = Tensor::cat(vec![k, v], 1);
    for step in 0..cp {
        let source = LoadBalancedSplit::new(cp, (split.rank + cp - step) % cp);
        let next = match step + 1 < cp {
            true => Some(ring_exchange(kv.clone(), cp_group)?),
            false => None,
        };
        for (query, q_chunk) in split.chunks().into_iter().enumerate() {
            for (key, k_chunk) in source.chunks().into_iter().enumerate() {
                if k_chunk > q_chunk {
                    continue;
                }
                let block = kv.clone().narrow(2, key * len, len);
                let partial = block_attention(
                    queries[query].clone(),
                    block.clone().narrow(1, 0, kv_heads),
                    block.narrow(1, kv_heads, kv_heads),
                    &positions(q_chunk),
                    &positions(k_chunk),
                    scale,
                );
                running[query] = Some(match running[query].take() {
                    Some(so_far) => merge(so_far, partial),
                    None => partial,
                });
            }
        }
        if let Some(next) = next {
            kv = next;
        }
    }
    let [early, late] = running.map(|r| {
        r.expect("each query chunk sees its own chunk at step 0")
            .out
    });
    Ok(Tensor::cat(vec![early, late], 2).cast(dtype))
}

/// This rank's ring: at step `s` it holds the K/V block of rank `rank - s` (mod `cp`), and
/// each of its two query chunks attends to each key chunk of the block not entirely in its
/// future: an earlier chunk in full, the same chunk causally (aligned blocks), a later one not
/// at all. The plan of [`ring_attention`], for [`RingFlashAttentionOps`], the blocks passed
/// around the ring ([`KvExchange::Ring`]).
pub fn ring_plan(split: LoadBalancedSplit) -> RingPlan {
    let cp = split.cp;
    let steps = (0..cp)
        .map(|step| {
            let source = LoadBalancedSplit::new(cp, (split.rank + cp - step) % cp);
            let mut blocks = Vec::new();
            for (query, q_chunk) in split.chunks().into_iter().enumerate() {
                for (key, k_chunk) in source.chunks().into_iter().enumerate() {
                    if k_chunk <= q_chunk {
                        blocks.push(RingBlock {
                            query,
                            key,
                            causal: k_chunk == q_chunk,
                        });
                    }
                }
            }
            blocks
        })
        .collect();
    RingPlan {
        steps,
        exchange: KvExchange::Ring,
    }
}

/// [`ring_attention`] on the fused flash attention: the same result, as one operation
/// ([`RingFlashAttentionOps::ring_flash_attention`]) whose every block pair is a flash
/// attention call (cuDNN on our CUDA backend) and whose backward recomputes each block from
/// the merged output and log-sum-exp, with dK/dV passed back around the ring. No
/// `[seq, seq]` tensor is kept for the backward. The model's `p2p` attention.
///
/// # Shapes
/// - `q`: `[batch, heads, seq / cp, head_dim]`, this rank's tokens in split order;
/// - `k`, `v`: `[batch, kv_heads, seq / cp, head_dim]`, `heads` a multiple of `kv_heads`;
/// - returns `[batch, heads, seq / cp, head_dim]` in q's dtype.
///
/// Fails if an exchange fails, or if `seq / cp` is odd.
pub fn ring_flash_attention<B: RingFlashAttentionOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
) -> Result<Tensor<B, 4>> {
    fused_ring_attention(q, k, v, cp_group, scale, KvExchange::Ring)
}

/// The ring's plan over `cp_group`, its blocks reaching the rank by `exchange`, run as one
/// operation ([`RingFlashAttentionOps::ring_flash_attention`]): [`ring_flash_attention`] and
/// [`all_gather_flash_attention`](super::all_gather_flash_attention). Fails if an exchange
/// fails, or if `seq / cp` is odd.
pub(super) fn fused_ring_attention<B: RingFlashAttentionOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
    exchange: KvExchange,
) -> Result<Tensor<B, 4>> {
    let split = LoadBalancedSplit::of_group(cp_group);
    split.chunk_len(q.dims()[2] * split.cp)?;
    let plan = RingPlan {
        exchange,
        ..ring_plan(split)
    };
    Ok(B::ring_flash_attention(q, k, v, cp_group, scale, &plan)?)
}
