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
//! [`PackedFlashAttentionOps::packed_flash_attention`] returns the output and `lse` (`[batch, heads,
//! seq]`), and `Autodiff<B>` records one node whose parent is `qkv`, storing `qkv`, the output
//! and `lse`; its backward, [`PackedFlashAttentionOps::packed_flash_attention_backward`], returns the
//! gradient of `qkv` as one `[batch, seq, groups, heads_per_group + 2, head_dim]` tensor.
//! Splitting by Burn's `narrow` instead costs a copy per part forward (Burn makes a view only
//! at offsets aligned to the runtime's memory alignment, 512 bytes on CUDA) and a zero-filled
//! full-size gradient per part backward, summed.
//!
//! Every backend has the composition here: split `qkv` ([`split`]), call
//! [`FlashAttentionOps::flash_attention`] and its backward, assemble the gradients with one `cat`
//! ([`assemble`]). CubeCL backends read q, k and v as strided views of the `qkv` buffer and
//! write the gradients straight into views of one `dqkv` buffer (see
//! `burn_megatron_kernels::fused::flash_attention::packed`): our CUDA backend through cuDNN
//! first, then the CubeCL kernels. A view of `q` needs one head stride, which exists with one
//! head per group or one group; other layouts (and f64, head dims above 256) take the
//! composition.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::flash_attention::FlashAttentionOps;
use super::primitive::{raw, wrap};

/// Flash attention on the packed QKV projection.
pub trait PackedFlashAttentionOps: FlashAttentionOps {
    /// Flash attention on the fused QKV projection's output `qkv: [batch, seq, groups,
    /// heads_per_group + 2, head_dim]` (see the [module docs](self)): the output `[batch, seq,
    /// heads, head_dim]` (qkv's dtype) and `lse` `[batch, heads, seq]` (f32; f64 for f64
    /// inputs). `Autodiff<B>` records one node whose parent is `qkv`, storing `qkv`, the
    /// output and `lse` (its `lse` is not tracked), whose backward is
    /// [`packed_flash_attention_backward`](Self::packed_flash_attention_backward). CubeCL
    /// backends read q, k and v as views of `qkv` where one head stride exists (one head per
    /// group, or one group); the default splits `qkv` and calls
    /// [`flash_attention`](FlashAttentionOps::flash_attention).
    fn packed_flash_attention(
        qkv: Tensor<Self, 5>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        forward_composition(qkv, scale, causal)
    }

    /// The gradient of [`packed_flash_attention`](Self::packed_flash_attention)'s `qkv`, one
    /// `[batch, seq, groups, heads_per_group + 2, head_dim]` tensor, given the output's
    /// gradient `grad` (`[batch, seq, heads, head_dim]`), from `qkv`, the output and `lse`.
    /// CubeCL backends write dq, dk and dv into views of one buffer where the forward could
    /// read views; the default calls
    /// [`flash_attention_backward`](FlashAttentionOps::flash_attention_backward) and assembles
    /// the parts with one `cat`.
    fn packed_flash_attention_backward(
        qkv: Tensor<Self, 5>,
        out: Tensor<Self, 4>,
        lse: Tensor<Self, 3>,
        grad: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> Tensor<Self, 5> {
        backward_composition(qkv, out, lse, grad, scale, causal)
    }
}

/// Causal attention of `qkv: [batch, seq, groups, heads_per_group + 2, head_dim]` (see the
/// [module](self)) with `softmax(scale · q kᵀ + mask) v` per head: the output `[batch, seq,
/// heads, head_dim]` (`heads = groups · heads_per_group`) in qkv's dtype. With `causal`,
/// query `i` sees keys `0..=i`.
///
/// Differentiable under `Autodiff<B>` with one node and one gradient buffer. Panics, saying
/// what is wrong, when there is no query head per group.
pub fn attention<B: PackedFlashAttentionOps>(
    qkv: Tensor<B, 5>,
    scale: f64,
    causal: bool,
) -> Tensor<B, 4> {
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

/// [`PackedFlashAttentionOps::packed_flash_attention`] by [`split`] and
/// [`FlashAttentionOps::flash_attention`]: the output `[batch, seq, heads, head_dim]` (a view of
/// the `[batch, heads, seq, head_dim]` result) and `lse` `[batch, heads, seq]`.
pub fn forward_composition<B: FlashAttentionOps>(
    qkv: Tensor<B, 5>,
    scale: f64,
    causal: bool,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let [q, k, v] = split(qkv);
    let (out, lse) = B::flash_attention(q, k, v, scale, causal);
    (out.swap_dims(1, 2), lse)
}

/// [`PackedFlashAttentionOps::packed_flash_attention_backward`] by [`split`],
/// [`FlashAttentionOps::flash_attention_backward`] and [`assemble`].
pub fn backward_composition<B: FlashAttentionOps>(
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

/// The forward on the inner backend, one node whose parent is `qkv`, storing `qkv`, the
/// output and `lse`. The returned `lse` is not tracked.
impl<B: PackedFlashAttentionOps, C: CheckpointStrategy> PackedFlashAttentionOps for Autodiff<B, C> {
    fn packed_flash_attention(
        qkv: Tensor<Self, 5>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        let qkv = raw(qkv);
        let (out, lse) = B::packed_flash_attention(inner(&qkv), scale, causal);
        let out = raw(out);
        let state = PackedFlashAttentionState {
            qkv: qkv.primitive.clone(),
            out: out.clone(),
            lse: raw(lse.clone()),
            scale,
            causal,
        };
        let out = record::<B, C, _>(PackedFlashAttentionBackward, &[&qkv], state, out);
        (wrap(out), Tensor::from_inner(lse))
    }
}

/// What the backward keeps from the forward.
#[derive(Debug, Clone)]
struct PackedFlashAttentionState<B: Backend> {
    qkv: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    scale: f64,
    causal: bool,
}

/// The backward, [`PackedFlashAttentionOps::packed_flash_attention_backward`]. Its parent is
/// `qkv`.
#[derive(Debug)]
struct PackedFlashAttentionBackward;

impl<B: PackedFlashAttentionOps> BackwardStep<B> for PackedFlashAttentionBackward {
    type State = PackedFlashAttentionState<B>;

    fn backward(
        self,
        grad: FloatTensor<B>,
        s: <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 0), || {
            B::packed_flash_attention_backward(
                wrap(s.qkv),
                wrap(s.out),
                wrap(s.lse),
                wrap(grad),
                s.scale,
                s.causal,
            )
        });
    }
}

/// CubeCL backends: views of `qkv` and of one `dqkv` buffer, through the runtime's vendor
/// library first, then the CubeCL kernels, then the composition.
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Shape, Tensor};
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_megatron_kernels::fused::flash_attention as flash_kernels;
    use burn_megatron_kernels::fused::flash_attention::packed::views;

    use super::{PackedFlashAttentionOps, backward_composition, forward_composition};
    use crate::ops::flash_attention::kernels::{AttentionRuntime, kernels_take, options};
    use crate::ops::primitive::{raw, wrap};

    impl<R, F, I, BT> PackedFlashAttentionOps for CubeBackend<R, F, I, BT>
    where
        R: AttentionRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn packed_flash_attention(
            qkv: Tensor<Self, 5>,
            scale: f64,
            causal: bool,
        ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
            let [batch, seq, groups, slots, head_dim] = qkv.dims();
            let heads = groups * (slots - 2);
            let raw_qkv = raw(qkv.clone());
            let Some([q, k, v]) = views(&raw_qkv, R::VIEW_OFFSETS) else {
                return forward_composition(qkv, scale, causal);
            };
            if let Some((out, lse)) = R::vendor_forward(&q, &k, &v, scale, causal) {
                // The vendor stores the output `[batch, seq, heads, head_dim]`.
                return (wrap::<Self, 4>(out).swap_dims(1, 2), wrap(lse));
            }
            if !kernels_take(qkv.dtype(), head_dim) {
                return forward_composition(qkv, scale, causal);
            }
            let out = empty_device_contiguous_dtype::<R>(
                raw_qkv.client.clone(),
                raw_qkv.device.clone(),
                Shape::new([batch, seq, heads, head_dim]),
                raw_qkv.dtype,
            );
            let lse = flash_kernels::forward_into(
                q,
                k,
                v,
                burn_cubecl::ops::permute(out.clone(), &[0, 2, 1, 3]),
                options(scale, causal),
            );
            (wrap(out), wrap(lse))
        }

        fn packed_flash_attention_backward(
            qkv: Tensor<Self, 5>,
            out: Tensor<Self, 4>,
            lse: Tensor<Self, 3>,
            grad: Tensor<Self, 4>,
            scale: f64,
            causal: bool,
        ) -> Tensor<Self, 5> {
            let dtype = qkv.dtype();
            let raw_qkv = raw(qkv.clone());
            let dqkv = empty_device_contiguous_dtype::<R>(
                raw_qkv.client.clone(),
                raw_qkv.device.clone(),
                raw_qkv.meta.shape().clone(),
                dtype,
            );
            let views = views(&raw_qkv, R::VIEW_OFFSETS).zip(views(&dqkv, R::VIEW_OFFSETS));
            let Some(([q, k, v], grads)) = views else {
                return backward_composition(qkv, out, lse, grad, scale, causal);
            };
            let heads_major = |t: &Tensor<Self, 4>| raw(t.clone().cast(dtype).swap_dims(1, 2));
            let lse_f32 = raw(lse.clone().cast(DType::F32));
            let written = R::vendor_backward_into(
                [&q, &k, &v],
                &heads_major(&out),
                &lse_f32,
                &heads_major(&grad),
                &grads,
                scale,
                causal,
            );
            if written {
                return wrap(dqkv);
            }
            if !kernels_take(dtype, qkv.dims()[4]) {
                return backward_composition(qkv, out, lse, grad, scale, causal);
            }
            flash_kernels::backward_into(
                q,
                k,
                v,
                heads_major(&out),
                lse_f32,
                heads_major(&grad),
                grads,
                options(scale, causal),
            );
            wrap(dqkv)
        }
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

    fn normal<B: crate::ops::CounterNormalOps>(
        shape: [usize; 5],
        std: f64,
        seed: u64,
    ) -> Tensor<B, 5> {
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
            let (_, lse) = <NdArray as super::PackedFlashAttentionOps>::packed_flash_attention(
                qkv.clone(),
                scale,
                causal,
            );
            let [q, k, v] = reference_split(qkv);
            let (_, want_lse) =
                <NdArray as crate::ops::FlashAttentionOps>::flash_attention(q, k, v, scale, causal);
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
