//! Flash attention on the fused QKV projection's output as it comes, Megatron's grouped
//! layout `qkv: [batch, seq, groups, heads_per_group + 2, head_dim]` (per query group: its
//! query heads, its key head, its value head), without splitting it into three tensors first.
//!
//! Query head `h` is slot `h % heads_per_group` of group `h / heads_per_group` and reads that
//! group's key and value heads (grouped-query attention; one head per group is multi-head
//! attention, one group multi-query attention). The output is `[batch, seq, heads, head_dim]`,
//! the order in which merging the heads (`reshape([batch, seq, heads · head_dim])`) needs no
//! copy.
//!
//! [`ModelBackend::packed_flash_attention`] returns the output and `lse` (`[batch, heads,
//! seq]`), and `Autodiff<B>` records one node whose parent is `qkv`, storing `qkv`, the output
//! and `lse`; its backward, [`ModelBackend::packed_flash_attention_backward`], returns the
//! gradient of `qkv` as one `[batch, seq, groups, heads_per_group + 2, head_dim]` tensor.
//! Splitting by Burn's `narrow` instead costs a copy per part forward (Burn makes a view only
//! at offsets aligned to the runtime's memory alignment, 512 bytes on CUDA) and a zero-filled
//! full-size gradient per part backward, summed.
//!
//! Every backend has the composition here: split `qkv` ([`split`]), call
//! [`ModelBackend::flash_attention`] and its backward, assemble the gradients with one `cat`
//! ([`assemble`]). CubeCL backends read q, k and v as strided views of the `qkv` buffer and
//! write the gradients straight into views of one `dqkv` buffer (see
//! `burn_megatron_kernels::fused::flash_attention::packed`): our CUDA backend through cuDNN
//! first, then the CubeCL kernels. A view of `q` needs one head stride, which exists with one
//! head per group or one group; other layouts (and f64, head dims above 256) take the
//! composition.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// Causal attention of `qkv: [batch, seq, groups, heads_per_group + 2, head_dim]` (see the
/// [module](self)) with `softmax(scale · q kᵀ + mask) v` per head: the output `[batch, seq,
/// heads, head_dim]` (`heads = groups · heads_per_group`) in qkv's dtype. With `causal`,
/// query `i` sees keys `0..=i`.
///
/// Differentiable under `Autodiff<B>` with one node and one gradient buffer. Panics, saying
/// what is wrong, when there is no query head per group.
pub fn attention<B: ModelBackend>(qkv: Tensor<B, 5>, scale: f64, causal: bool) -> Tensor<B, 4> {
    check_shape(qkv.dims());
    B::packed_flash_attention(qkv, scale, causal).0
}

/// `heads_per_group` of a packed `[batch, seq, groups, heads_per_group + 2, head_dim]` shape;
/// panics unless it is at least one.
pub fn check_shape(qkv: [usize; 5]) -> usize {
    assert!(
        qkv[3] >= 3,
        "packed attention: qkv [batch, seq, groups, heads_per_group + 2, head_dim] = {qkv:?} \
         needs at least one query head per group besides its key and value heads"
    );
    qkv[3] - 2
}

/// `[q, k, v]` of `qkv` (`[batch, heads, seq, head_dim]`, `[batch, groups, seq, head_dim]`
/// twice) through Burn's `narrow`, `reshape` and `swap_dims`.
pub fn split<B: Backend>(qkv: Tensor<B, 5>) -> [Tensor<B, 4>; 3] {
    let [batch, seq, groups, _, head_dim] = qkv.dims();
    let heads_per_group = check_shape(qkv.dims());
    let q = qkv
        .clone()
        .narrow(3, 0, heads_per_group)
        .reshape([batch, seq, groups * heads_per_group, head_dim])
        .swap_dims(1, 2);
    let kv = |slot: usize| {
        qkv.clone()
            .narrow(3, heads_per_group + slot, 1)
            .reshape([batch, seq, groups, head_dim])
            .swap_dims(1, 2)
    };
    [q, kv(0), kv(1)]
}

/// The inverse of [`split`]: `dq: [batch, heads, seq, head_dim]` and `dk, dv: [batch, groups,
/// seq, head_dim]` as one `[batch, seq, groups, heads / groups + 2, head_dim]` tensor (one
/// `cat`).
pub fn assemble<B: Backend>(dq: Tensor<B, 4>, dk: Tensor<B, 4>, dv: Tensor<B, 4>) -> Tensor<B, 5> {
    let [batch, heads, seq, head_dim] = dq.dims();
    let groups = dk.dims()[1];
    let dq = dq
        .swap_dims(1, 2)
        .reshape([batch, seq, groups, heads / groups, head_dim]);
    let [dk, dv] = [dk, dv].map(|t| t.swap_dims(1, 2).unsqueeze_dim::<5>(3));
    Tensor::cat(vec![dq, dk, dv], 3)
}

/// [`ModelBackend::packed_flash_attention`] by [`split`] and
/// [`ModelBackend::flash_attention`]: the output `[batch, seq, heads, head_dim]` (a view of
/// the `[batch, heads, seq, head_dim]` result) and `lse` `[batch, heads, seq]`.
pub fn forward_composition<B: ModelBackend>(
    qkv: Tensor<B, 5>,
    scale: f64,
    causal: bool,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let [q, k, v] = split(qkv);
    let (out, lse) = B::flash_attention(q, k, v, scale, causal);
    (out.swap_dims(1, 2), lse)
}

/// [`ModelBackend::packed_flash_attention_backward`] by [`split`],
/// [`ModelBackend::flash_attention_backward`] and [`assemble`].
pub fn backward_composition<B: ModelBackend>(
    qkv: Tensor<B, 5>,
    out: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    grad: Tensor<B, 4>,
    scale: f64,
    causal: bool,
) -> Tensor<B, 5> {
    let [q, k, v] = split(qkv);
    let [dq, dk, dv] = B::flash_attention_backward(
        q,
        k,
        v,
        out.swap_dims(1, 2),
        lse,
        grad.swap_dims(1, 2),
        scale,
        causal,
    );
    assemble(dq, dk, dv)
}

/// A tensor of `Autodiff<B, C>`.
type Tracked<B, C, const D: usize> = Tensor<Autodiff<B, C>, D>;

/// The `Autodiff<B>` operation: the forward on the inner backend, one node whose parent is
/// `qkv`, storing `qkv`, the output and `lse`. The returned `lse` is not tracked.
pub(crate) fn autodiff_packed_flash_attention<B: ModelBackend, C: CheckpointStrategy>(
    qkv: Tracked<B, C, 5>,
    scale: f64,
    causal: bool,
) -> (Tracked<B, C, 4>, Tracked<B, C, 3>) {
    let qkv = qkv.into_primitive().tensor();
    let (out, lse) = B::packed_flash_attention(wrap::<B, 5>(qkv.primitive.clone()), scale, causal);
    let out = out.into_primitive().tensor();
    let output = match PackedFlashAttentionBackward
        .prepare::<C>([qkv.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            PackedFlashAttentionState {
                qkv: qkv.primitive,
                out: out.clone(),
                lse: lse.clone().into_primitive().tensor(),
                scale,
                causal,
            },
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (
        Tensor::from_primitive(TensorPrimitive::Float(output)),
        Tensor::from_inner(lse),
    )
}

/// What the backward of [`autodiff_packed_flash_attention`] keeps from the forward.
#[derive(Debug, Clone)]
struct PackedFlashAttentionState<B: Backend> {
    qkv: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    scale: f64,
    causal: bool,
}

#[derive(Debug)]
struct PackedFlashAttentionBackward;

impl<B: ModelBackend> Backward<B, 1> for PackedFlashAttentionBackward {
    type State = PackedFlashAttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        let Some(parent) = parent else {
            return;
        };
        let s = ops.state;
        let dqkv = B::packed_flash_attention_backward(
            wrap::<B, 5>(s.qkv),
            wrap::<B, 4>(s.out),
            wrap::<B, 3>(s.lse),
            wrap::<B, 4>(grad),
            s.scale,
            s.causal,
        );
        grads.register::<B>(parent.id, dqkv.into_primitive().tensor());
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::backend::Backend;
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_megatron_testing::{assert_close, tolerance, values};

    use crate::init::{InitDistribution, init_full};
    use crate::ops::flash_attention;

    type AD = Autodiff<NdArray>;

    /// `(batch, seq, groups, heads_per_group, head_dim, causal)`: multi-head, grouped-query
    /// (2 groups of 2) and multi-query attention (1 group of 3), causal and not.
    const CASES: [(usize, usize, usize, usize, usize, bool); 6] = [
        (2, 5, 3, 1, 4, true),
        (1, 6, 3, 1, 8, false),
        (2, 7, 2, 2, 6, true),
        (1, 4, 2, 2, 5, false),
        (2, 5, 1, 3, 4, true),
        (1, 6, 1, 3, 8, false),
    ];

    fn normal<B: Backend>(shape: [usize; 5], std: f64, seed: u64) -> Tensor<B, 5> {
        init_full::<B, 5>(
            shape,
            InitDistribution::Normal { std },
            seed,
            &Default::default(),
        )
    }

    /// q, k, v of `qkv` by their indices on the flattened `groups · slots` axis (`select`, not
    /// the op's `narrow`), `[batch, heads, seq, head_dim]` and `[batch, groups, seq,
    /// head_dim]`.
    fn reference_split<B: Backend>(qkv: Tensor<B, 5>) -> [Tensor<B, 4>; 3] {
        let [batch, seq, groups, slots, head_dim] = qkv.dims();
        let heads_per_group = slots - 2;
        let flat = qkv.reshape([batch, seq, groups * slots, head_dim]);
        let pick = |indices: Vec<i64>| {
            let n = indices.len();
            let indices =
                Tensor::<B, 1, Int>::from_data(TensorData::new(indices, [n]), &flat.device());
            flat.clone().select(2, indices).swap_dims(1, 2)
        };
        let slots = slots as i64;
        let q = (0..groups as i64)
            .flat_map(|g| (0..heads_per_group as i64).map(move |j| g * slots + j))
            .collect();
        let kv = |slot: i64| (0..groups as i64).map(|g| g * slots + slot).collect();
        [
            pick(q),
            pick(kv(heads_per_group as i64)),
            pick(kv(heads_per_group as i64 + 1)),
        ]
    }

    /// The packed op (its autodiff node, its composition forward) against the split done
    /// independently (`select`) followed by [`flash_attention::attention`] under Burn's
    /// autodiff: the output (as `[batch, seq, heads, head_dim]`), `lse`, and the gradient of
    /// `qkv`.
    #[test]
    fn the_packed_op_matches_split_then_flash_attention() {
        for (i, &(batch, seq, groups, heads_per_group, head_dim, causal)) in
            CASES.iter().enumerate()
        {
            let shape = [batch, seq, groups, heads_per_group + 2, head_dim];
            let heads = groups * heads_per_group;
            let scale = 1.0 / (head_dim as f64).sqrt();
            let seed = 100 + 10 * i as u64;
            let upstream = init_full::<AD, 4>(
                [batch, seq, heads, head_dim],
                InitDistribution::Normal { std: 1.0 },
                seed + 1,
                &Default::default(),
            )
            .detach();
            let run = |packed: bool| {
                let qkv = normal::<AD>(shape, 1.5, seed).require_grad();
                let out = if packed {
                    super::attention(qkv.clone(), scale, causal)
                } else {
                    let [q, k, v] = reference_split(qkv.clone());
                    flash_attention::attention(q, k, v, scale, causal).swap_dims(1, 2)
                };
                assert_eq!(out.dims(), [batch, seq, heads, head_dim]);
                let grads = (out.clone() * upstream.clone()).sum().backward();
                [
                    values(out),
                    values(qkv.grad(&grads).expect("qkv has a gradient")),
                ]
            };
            let (ours, want) = (run(true), run(false));
            assert_close(
                &format!("case {i} output"),
                &ours[0],
                &want[0],
                tolerance::F32,
            );
            assert_close(
                &format!("case {i} dqkv"),
                &ours[1],
                &want[1],
                tolerance::F32,
            );

            let qkv = normal::<NdArray>(shape, 1.5, seed);
            let (_, lse) = <NdArray as crate::backend::ModelBackend>::packed_flash_attention(
                qkv.clone(),
                scale,
                causal,
            );
            let [q, k, v] = reference_split(qkv);
            let (_, want_lse) =
                <NdArray as crate::backend::ModelBackend>::flash_attention(q, k, v, scale, causal);
            assert_eq!(lse.dims(), [batch, heads, seq]);
            assert_close(
                &format!("case {i} lse"),
                &values(lse),
                &values(want_lse),
                tolerance::F32,
            );
        }
    }

    /// [`super::assemble`] puts each part where [`super::split`] took it from: split then
    /// assemble is the identity.
    #[test]
    fn assemble_inverts_split() {
        for &(batch, seq, groups, heads_per_group, head_dim, _) in &CASES {
            let qkv =
                normal::<NdArray>([batch, seq, groups, heads_per_group + 2, head_dim], 1.0, 7);
            let [q, k, v] = super::split(qkv.clone());
            let back = super::assemble(q, k, v);
            assert_close("split then assemble", &values(back), &values(qkv), 0.0);
        }
    }

    #[test]
    #[should_panic(expected = "needs at least one query head per group")]
    fn a_group_without_query_heads_is_refused() {
        let qkv = normal::<NdArray>([1, 4, 2, 2, 4], 1.0, 1);
        super::attention(qkv, 0.5, true);
    }
}
