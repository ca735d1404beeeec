//! The backend extension that distributed code is generic over.

use burn::backend::Autodiff;
use burn::backend::NdArray;
use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, unary};

use crate::error::DistResult;
use crate::mapping::{Comm, Mapping};
use crate::process_group::ProcessGroup;

/// A Burn backend that distributed code can run on.
///
/// Plain backends run a [`Mapping`]'s forward communication only; `Autodiff<B>` also records
/// its backward communication in the graph, so that gradients flow through collectives the
/// way Megatron's `f` and `g` operators define. Implemented for NdArray and for `Autodiff`
/// over any implementing backend; a backend with its own collectives (NCCL) overrides the
/// defaults here.
pub trait DistBackend: burn::tensor::backend::Backend {
    /// Applies `mapping` to `x` over `group`, differentiably where the backend tracks gradients.
    fn apply_mapping<const D: usize>(
        x: Tensor<Self, D>,
        mapping: Mapping,
        group: &ProcessGroup,
    ) -> DistResult<Tensor<Self, D>> {
        mapping.forward.apply(group, x)
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> DistBackend for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}

#[cfg(feature = "cuda")]
mod cube {
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_fusion::{Fusion, FusionBackend};

    use super::DistBackend;

    /// Every CubeCL backend (burn-cuda's, ours): collectives through the host for now.
    impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DistBackend
        for CubeBackend<R, F, I, BT>
    {
    }

    impl<B: FusionBackend> DistBackend for Fusion<B> {}
}

impl<B: DistBackend, C: CheckpointStrategy> DistBackend for Autodiff<B, C> {
    fn apply_mapping<const D: usize>(
        x: Tensor<Self, D>,
        mapping: Mapping,
        group: &ProcessGroup,
    ) -> DistResult<Tensor<Self, D>> {
        let x = x.into_primitive().tensor();
        let inner = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
        let output = mapping
            .forward
            .apply(group, inner)?
            .into_primitive()
            .tensor();
        let backward = MappingBackward::<D> {
            comm: mapping.backward,
            group: group.clone(),
        };
        let output = backward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateless(output);
        Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
    }
}

/// The gradient side of a mapping: one communication applied to the incoming gradient.
#[derive(Debug)]
struct MappingBackward<const D: usize> {
    comm: Comm,
    group: ProcessGroup,
}

impl<B: DistBackend, const D: usize> Backward<B, 1> for MappingBackward<D> {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grad));
            // Backward has no error channel: a failed collective here (a dead peer, a timeout)
            // stops this rank, and the launcher releases the others with this message.
            match self.comm.apply(&self.group, grad) {
                Ok(grad) => grad.into_primitive().tensor(),
                Err(err) => panic!("backward of a distributed mapping failed: {err}"),
            }
        });
    }
}
