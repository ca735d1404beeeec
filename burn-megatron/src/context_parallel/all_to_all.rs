//! Context-parallel causal attention by all-to-all (Megatron's `--cp-comm-type a2a`,
//! DeepSpeed-Ulysses): trade the sequence split for a head split, attend over the whole
//! sequence with a share of the heads, and trade back.

use burn::tensor::Tensor;
use burn_megatron_dist::mapping::all_to_all;
use burn_megatron_dist::{DistBackend, ProcessGroup};

use super::block_attention::block_attention;
use super::split::LoadBalancedSplit;
use crate::error::{InputError, Result};
use crate::ops::FlashAttentionOps;
use crate::ops::flash_attention::{attention, check_shapes, repeat_heads};

/// Causal attention of this rank's tokens over the whole sequence, the sequence split over
/// `cp_group` traded for a split of the heads: every tensor in the
/// [load-balanced split](LoadBalancedSplit).
///
/// An all-to-all over the group (split the heads, concatenate the sequence) gives each rank
/// all `seq` tokens of `heads / cp` query heads, in the ranks' split order; the causal mask
/// is built from the global positions of that order ([`block_attention`]), and a second
/// all-to-all (split the sequence, concatenate the heads) brings the rank's own tokens back
/// with every head. The backward is the same all-to-alls the other way round. Grouped-query
/// attention: when `cp` divides the K/V heads, each rank receives the K/V heads its query
/// heads read; otherwise the K/V heads are repeated to one per query head first (a correct
/// fallback that moves more data).
///
/// # Shapes
/// - `q`: `[batch, heads, seq / cp, head_dim]`, this rank's tokens in split order;
/// - `k`, `v`: `[batch, kv_heads, seq / cp, head_dim]`, `heads` a multiple of `kv_heads`;
/// - returns `[batch, heads, seq / cp, head_dim]` in q's dtype.
///
/// Fails if a collective fails, if `seq / cp` is odd (the split needs two equal chunks), or
/// with [`InputError::HeadsNotDivisibleByCp`] unless `cp` divides the query heads.
pub fn all_to_all_attention<B: DistBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
) -> Result<Tensor<B, 4>> {
    ulysses(q, k, v, cp_group, |q, k, v, positions| {
        block_attention(q, k, v, positions, positions, scale).out
    })
}

/// [`all_to_all_attention`] with the fused flash attention (cuDNN on our CUDA backend): the
/// gathered sequence is put in its natural order (a copy), attended causally, and put back in
/// the ranks' order. No `[seq, seq]` tensor is kept for the backward. The model's `a2a`
/// attention.
///
/// # Shapes
/// As [`all_to_all_attention`].
pub fn all_to_all_flash_attention<B: DistBackend + FlashAttentionOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    scale: f64,
) -> Result<Tensor<B, 4>> {
    let cp = cp_group.size();
    ulysses(q, k, v, cp_group, |q, k, v, _| {
        // The ranks' parts in rank order, each its two chunks: the natural order is what
        // `restore` builds from them, and each rank's `split` of it gives them back.
        let natural = |t: Tensor<B, 4>| {
            let part = t.dims()[2] / cp;
            let parts = (0..cp)
                .map(|r| t.clone().narrow(2, r * part, part))
                .collect();
            LoadBalancedSplit::restore(parts, 2).expect("the gathered sequence cuts into chunks")
        };
        let out = attention(natural(q), natural(k), natural(v), scale, true);
        let parts = (0..cp)
            .map(|r| LoadBalancedSplit::new(cp, r).split(out.clone(), 2))
            .collect::<core::result::Result<Vec<_>, _>>()
            .expect("the sequence cuts into chunks");
        Tensor::cat(parts, 2)
    })
}

/// The all-to-alls around `attend(q, k, v, positions)`, which attends every token of a share
/// of the heads causally, the tokens in the ranks' split order (`positions` their global
/// positions).
fn ulysses<B: DistBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cp_group: &ProcessGroup,
    attend: impl FnOnce(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, &[usize]) -> Tensor<B, 4>,
) -> Result<Tensor<B, 4>> {
    check_shapes(q.dims(), k.dims(), v.dims(), true);
    let split = LoadBalancedSplit::of_group(cp_group);
    let cp = split.cp;
    let (dtype, heads, kv_heads) = (q.dtype(), q.dims()[1], k.dims()[1]);
    if !heads.is_multiple_of(cp) {
        return Err(InputError::HeadsNotDivisibleByCp { heads, cp }.into());
    }
    let seq = q.dims()[2] * cp;
    let positions: Vec<usize> = (0..cp)
        .map(|rank| LoadBalancedSplit::new(cp, rank).positions(seq))
        .collect::<core::result::Result<Vec<_>, _>>()?
        .concat();
    let (k, v, kv_heads) = match kv_heads.is_multiple_of(cp) {
        true => (k, v, kv_heads),
        false => (repeat_heads(k, heads), repeat_heads(v, heads), heads),
    };
    // K and V travel as one tensor, one collective: their heads interleaved rank by rank, so
    // that the head split hands each rank its own K heads and V heads.
    let local_kv = kv_heads / cp;
    let [batch, _, local_seq, head_dim] = k.dims();
    let kv = Tensor::cat(
        vec![
            k.reshape([batch, cp, local_kv, local_seq, head_dim]),
            v.reshape([batch, cp, local_kv, local_seq, head_dim]),
        ],
        2,
    )
    .reshape([batch, 2 * kv_heads, local_seq, head_dim]);
    let q = all_to_all(q, cp_group, 1, 2)?;
    let kv = all_to_all(kv, cp_group, 1, 2)?;
    let k = kv.clone().narrow(1, 0, local_kv);
    let v = kv.narrow(1, local_kv, local_kv);
    let out = attend(q, k, v, &positions);
    Ok(all_to_all(out.cast(dtype), cp_group, 2, 1)?)
}
