//! The backend burn-megatron's models are generic over.

use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_megatron_dist::DistBackend;

use crate::transformer::AttentionCore;

/// A [`DistBackend`] with the model operations that need their own autodiff: plain backends
/// run the forward; `Autodiff<B>` records a backward that recomputes instead of storing.
pub trait ModelBackend: DistBackend {
    /// The attention core, storing only `q`, `k` and `v` for the backward pass (selective
    /// recomputation): the `[batch, heads, seq, seq]` probabilities are recomputed there.
    fn recomputed_attention_core(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        core: AttentionCore,
    ) -> Tensor<Self, 4> {
        core.forward(q, k, v)
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> ModelBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}

#[cfg(feature = "cuda")]
mod cube {
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_fusion::{Fusion, FusionBackend};

    use super::ModelBackend;

    impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ModelBackend
        for CubeBackend<R, F, I, BT>
    {
    }

    impl<B: FusionBackend> ModelBackend for Fusion<B> {}
}

impl<B: ModelBackend, C: CheckpointStrategy> ModelBackend for Autodiff<B, C> {
    fn recomputed_attention_core(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        core: AttentionCore,
    ) -> Tensor<Self, 4> {
        let [q, k, v] = [q, k, v].map(|t| t.into_primitive().tensor());
        let output = core
            .forward(
                wrap::<B>(q.primitive.clone()),
                wrap::<B>(k.primitive.clone()),
                wrap::<B>(v.primitive.clone()),
            )
            .into_primitive()
            .tensor();
        let prep = RecomputedAttention
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful();
        let output = match prep {
            OpsKind::Tracked(prep) => {
                prep.finish((q.primitive, k.primitive, v.primitive, core), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }
}

fn wrap<B: burn::tensor::backend::Backend>(primitive: B::FloatTensorPrimitive) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

#[derive(Debug)]
struct RecomputedAttention;

impl<B: ModelBackend> Backward<B, 3> for RecomputedAttention {
    type State = (
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        AttentionCore,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, core) = ops.state;
        let [grad_q, grad_k, grad_v] =
            core.backward(wrap::<B>(q), wrap::<B>(k), wrap::<B>(v), wrap::<B>(grad));
        for (node, grad) in [(node_q, grad_q), (node_k, grad_k), (node_v, grad_v)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}
