//! Context-parallel causal attention by all-gathering K/V (Megatron's `--cp-comm-type
//! all_gather`): simple, and fine for small CP, where the gathered K/V fit.

use burn::tensor::Tensor;
use burn_megatron_dist::mapping::gather_from_sequence_parallel_region;
use burn_megatron_dist::{DistBackend, ProcessGroup};

use super::block_attention::block_attention;
use super::ring::fused_ring_attention;
use super::split::LoadBalancedSplit;
use crate::error::Result;
use crate::ops::RingFlashAttentionOps;
use crate::ops::flash_attention::check_shapes;
use crate::ops::ring_flash_attention::KvExchange;

/// Causal attention of this rank's queries against the whole sequence's keys and values,
/// every tensor in the [load-balanced split](LoadBalancedSplit) over `cp_group`.
///
/// K and V (packed into one tensor, so that one collective moves both) are all-gathered over
/// the group; the backward reduce-scatters their gradients, each rank summing what every
/// rank's queries contributed to its own K/V. The local queries then attend to all
/// `seq` keys with the causal mask in global positions
/// ([`block_attention`], a composition).
///
/// # Shapes
/// - `q`: `[batch, heads, seq / cp, head_dim]`, this rank's tokens in split order;
/// - `k`, `v`: `[batch, kv_heads, seq / cp, head_dim]`, `heads` a multiple of `kv_heads`;
/// - returns `[batch, heads, seq / cp, head_dim]` in q's dtype.
///
/// Fails if a collective fails, or if `seq / cp` is odd (the split needs two equal chunks);
/// panics on shapes that do not fit each other.
pub fn all_gather_attention<B: DistBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
) -> Result<Tensor<B, 4>> {
    check_shapes(q.dims(), k.dims(), v.dims(), true);
    let split = LoadBalancedSplit::of_group(cp_group);
    let (dtype, kv_heads) = (q.dtype(), k.dims()[1]);
    let seq = q.dims()[2] * split.cp;
    let q_positions = split.positions(seq)?;
    let k_positions: Vec<usize> = (0..split.cp)
        .map(|rank| LoadBalancedSplit::new(split.cp, rank).positions(seq))
        .collect::<core::result::Result<Vec<_>, _>>()?
        .concat();
    let kv = Tensor::cat(vec![k, v], 1);
    let kv = gather_from_sequence_parallel_region(kv, cp_group, 2, true)?;
    let k = kv.clone().narrow(1, 0, kv_heads);
    let v = kv.narrow(1, kv_heads, kv_heads);
    let partial = block_attention(q, k, v, &q_positions, &k_positions, scale);
    Ok(partial.out.cast(dtype))
}

/// [`all_gather_attention`] on the fused flash attention: the same result, as one operation
/// ([`RingFlashAttentionOps::ring_flash_attention`] with [`KvExchange::AllGather`]). K/V are
/// gathered once, and each query chunk attends to the gathered blocks as the ring's steps
/// would pair them (a flash call per block pair: full attention against an earlier chunk,
/// causal against its own), merged by log-sum-exp; the backward gathers K/V again and
/// reduce-scatters their gradients. No `[seq, seq]` tensor is formed. The model's
/// `all_gather` attention.
///
/// # Shapes
/// As [`all_gather_attention`].
///
/// Fails if a collective fails, or if `seq / cp` is odd.
pub fn all_gather_flash_attention<B: RingFlashAttentionOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
) -> Result<Tensor<B, 4>> {
    fused_ring_attention(q, k, v, cp_group, scale, KvExchange::AllGather)
}
