//! Code that runs inside the backward pass where a model marked a tensor: Megatron's gradient
//! hooks, which start a data-parallel bucket's reduction while the backward pass goes on.

use std::any::Any;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, parent, record};
use super::primitive::{raw, wrap};

/// Code that runs inside the backward pass where the model marked a tensor
/// ([`BackwardHookOps::backward_hook`]).
pub trait BackwardHook: Send + Sync + std::fmt::Debug {
    /// Called when the backward pass reaches the tensor marked with `point`, with the
    /// gradients computed so far (the marked tensor's own is not yet passed on).
    fn on_backward(&self, point: usize, grads: &mut Gradients);

    /// Offered, before it is computed, the gradient of the weight whose autodiff node is
    /// `weight` (by the layers given the hook: the dense ones through
    /// [`hooked_linear`](super::hooked_linear), the experts through
    /// [`hooked_grouped_linear`](super::hooked_grouped_linear)).
    /// A hook that sums gradients in a flat f32 buffer of its own adds it there with
    /// [`WeightGradient::add_to`], the GEMM accumulating in place (Megatron's
    /// gradient-accumulation fusion), and returns `true`: the gradient then never enters the
    /// container. The default takes nothing.
    fn take_weight_gradient(&self, weight: NodeId, gradient: &mut dyn WeightGradient) -> bool {
        let _ = (weight, gradient);
        false
    }
}

/// A weight's gradient, a product not computed yet (see
/// [`BackwardHook::take_weight_gradient`]).
pub trait WeightGradient {
    /// The gradient's shape, the weight's: `[rows, cols]`, or `[experts, rows, cols]` for
    /// stacked experts.
    fn shape(&self) -> Vec<usize>;

    /// `buffer`, a flat f32 `Tensor<B, 1>` of the backend `B` that computes the gradient (boxed:
    /// the hook is not generic over it), with the gradient added row-major at `start..start +`
    /// its elements; `Err(buffer)`, untouched, when it is not such a tensor.
    fn add_to(
        &mut self,
        buffer: Box<dyn Any + Send>,
        start: usize,
    ) -> Result<Box<dyn Any + Send>, Box<dyn Any + Send>>;
}

/// The autodiff node of a tensor of `Autodiff<B, C>` (the key of its gradient), `None` on
/// another autodiff backend: how a [`BackwardHook`] recognises a parameter whose gradient it
/// is offered ([`BackwardHook::take_weight_gradient`]).
pub fn node_id<BA: AutodiffBackend>(tensor: &FloatTensor<BA>) -> Option<NodeId> {
    let tensor: &dyn Any = tensor;
    tensor
        .downcast_ref::<FloatTensor<Autodiff<BA::InnerBackend>>>()
        .map(|t| t.node.id)
}

/// Marking tensors for a [`BackwardHook`].
pub trait BackwardHookOps: Backend {
    /// `x` itself. Under `Autodiff`, `hook` runs with `point` when the backward pass reaches
    /// `x`: after every operation that used `x` has put its gradients into the gradient
    /// container. A model marks each layer's input this way, so that a hook there sees that
    /// layer's parameter gradients final.
    fn backward_hook<const D: usize>(
        x: Tensor<Self, D>,
        hook: &Arc<dyn BackwardHook>,
        point: usize,
    ) -> Tensor<Self, D> {
        let _ = (hook, point);
        x
    }
}

impl<B: Backend, C: CheckpointStrategy> BackwardHookOps for Autodiff<B, C> {
    fn backward_hook<const D: usize>(
        x: Tensor<Self, D>,
        hook: &Arc<dyn BackwardHook>,
        point: usize,
    ) -> Tensor<Self, D> {
        let x = raw(x);
        let output = x.primitive.clone();
        wrap(record::<B, C, _>(
            HookBackward,
            &[&x],
            (hook.clone(), point),
            output,
        ))
    }
}

/// CubeCL backends: the default (hooks run in the autodiff graph).
#[cfg(feature = "fused")]
impl<R, F, I, BT> BackwardHookOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}

/// The backward of [`BackwardHookOps::backward_hook`]: runs the hook, then passes the
/// gradient through.
#[derive(Debug)]
struct HookBackward;

impl<B: Backend> BackwardStep<B> for HookBackward {
    type State = (Arc<dyn BackwardHook>, usize);

    fn backward(
        self,
        dy: FloatTensor<B>,
        (hook, point): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        hook.on_backward(point, grads);
        if let Some(id) = parent(parents, 0) {
            grads.register::<B>(id, dy);
        }
    }
}
