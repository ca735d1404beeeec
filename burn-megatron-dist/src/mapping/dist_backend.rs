//! [`DistBackend`]: the backends Megatron's mappings run on, with the autodiff node that
//! gives each mapping its backward communication.

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

use super::{Comm, Mapping};
use crate::error::DistResult;
use crate::process_group::DeviceTransport;
use crate::process_group::ProcessGroup;

/// A Burn backend that distributed code can run on: its collectives move tensors
/// ([`DeviceTransport`]), and Megatron's [mappings](crate::mapping) are differentiable on it.
///
/// Plain backends run a [`Mapping`]'s forward communication only; `Autodiff<B>` also records
/// its backward communication in the graph, so that gradients flow through collectives the
/// way Megatron's `f` and `g` operators define. Implemented for NdArray, for `Autodiff` over
/// any implementing backend, and (features `cuda`, `wgpu`) for the CubeCL backends.
pub trait DistBackend: DeviceTransport {
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

/// Every CubeCL backend (without gradients: forward communication only).
#[cfg(feature = "cuda")]
impl<R, F, I, BT> DistBackend for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

#[cfg(feature = "cuda")]
impl<B: burn_fusion::FusionBackend> DistBackend for burn_fusion::Fusion<B> {}

#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
impl<F, I, BT> DistBackend for burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

/// On `Autodiff`, the forward communication runs on the inner tensor and a
/// `MappingBackward` node applies the backward one to the incoming gradient.
impl<B: DistBackend, C: CheckpointStrategy> DistBackend for Autodiff<B, C> {
    fn apply_mapping<const D: usize>(
        x: Tensor<Self, D>,
        mapping: Mapping,
        group: &ProcessGroup,
    ) -> DistResult<Tensor<Self, D>> {
        let x = x.into_primitive().tensor();
        // The backward needs nothing of the input: hand its buffer over, so that an
        // all-reduce of a tensor nothing else holds runs in place.
        let (primitive, node) = (x.primitive, x.node);
        let inner = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(primitive));
        let inner_shape = inner.shape();
        let output = mapping
            .forward
            .apply(group, inner)?
            .into_primitive()
            .tensor();
        let backward = MappingBackward::<D> {
            comm: mapping.backward,
            group: group.clone(),
            input_shape: inner_shape,
        };
        let output = backward
            .prepare::<C>([node])
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
    /// The shape of the mapping's input, which its gradient has.
    input_shape: burn::tensor::Shape,
}

impl<B: DistBackend, const D: usize> Backward<B, 1> for MappingBackward<D> {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grad));
            let (device, dtype) = (grad.device(), grad.dtype());
            // Backward has no error channel: a failed collective is recorded on the group
            // (whose every later call, and `backward_failure`, returns it) and the gradient
            // goes on as zeros, so the step ends and reports the error instead of panicking.
            match self.comm.apply(&self.group, grad) {
                Ok(grad) => grad.into_primitive().tensor(),
                Err(error) => {
                    self.group.fail_in_backward(error);
                    Tensor::<B, D>::zeros(self.input_shape, (&device, dtype))
                        .into_primitive()
                        .tensor()
                }
            }
        });
    }
}
