//! SwiGLU's elementwise part, `silu(gate) · up`, with a written-out backward.
//!
//! Burn 0.21's `sigmoid` (and so `silu`) computes in f32 whatever the dtype: for f16 and bf16
//! that widens, but an f64 model gets an f32 SiLU (relative error ~1e-8, and a forward that
//! f64 finite differences cannot differentiate). [`sigmoid`] here widens narrow floats and
//! keeps f64. [`ModelBackend::swiglu`] and [`ModelBackend::swiglu_backward`] run one kernel
//! each way on CubeCL backends (`burn_megatron_kernels::fused::swiglu`, f32 math for f32, f16
//! and bf16; f64 keeps this composition); `Autodiff<B>` records one node that stores `gate`
//! and `up`.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// `σ(x) = 1 / (1 + e^(-x))`, elementwise, in at least f32: f16 and bf16 are computed in f32
/// and rounded back, f32 and f64 stay as they are. Where `e^(-x)` overflows the result is 0,
/// as it should be.
pub fn sigmoid<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = x.dtype();
    let narrow = matches!(dtype, DType::F16 | DType::BF16);
    let x = if narrow { x.cast(DType::F32) } else { x };
    let sigmoid = x.neg().exp().add_scalar(1.0).recip();
    if narrow { sigmoid.cast(dtype) } else { sigmoid }
}

/// `silu(gate) · up = gate · σ(gate) · up`, as plain Burn operations: the default forward of
/// [`ModelBackend::swiglu`] (a model calls [`swiglu`]).
pub fn swiglu_forward<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    gate.clone() * sigmoid(gate) * up
}

/// The gradients of `gate` and `up` given the output's gradient `grad`:
/// `d_gate = grad · up · σ(gate) · (1 + gate · (1 - σ(gate)))`, `d_up = grad · silu(gate)`.
pub fn swiglu_derivatives<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    grad: Tensor<B, D>,
) -> [Tensor<B, D>; 2] {
    let sigmoid = sigmoid(gate.clone());
    let silu = gate.clone() * sigmoid.clone();
    let d_silu = sigmoid.clone() * (gate * sigmoid.neg().add_scalar(1.0)).add_scalar(1.0);
    [grad.clone() * up * d_silu, grad * silu]
}

/// `silu(gate) · up` over the last dimension of tensors of any rank, flattened to
/// `[tokens, features]` for [`ModelBackend::swiglu`], then reshaped back.
pub fn swiglu<B: ModelBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    let dims = gate.dims();
    let features = dims[D - 1];
    let tokens = dims[..D - 1].iter().product();
    let flat = |t: Tensor<B, D>| t.reshape([tokens, features]);
    B::swiglu(flat(gate), flat(up)).reshape(dims)
}

/// [`ModelBackend::swiglu`] on `Autodiff<B>`: the inner backend's forward, and one
/// [`SwiGluBackward`] node holding `gate` and `up`.
pub(crate) fn autodiff_swiglu<B: ModelBackend, C: CheckpointStrategy>(
    gate: Tensor<Autodiff<B, C>, 2>,
    up: Tensor<Autodiff<B, C>, 2>,
) -> Tensor<Autodiff<B, C>, 2> {
    let gate = gate.into_primitive().tensor();
    let up = up.into_primitive().tensor();
    let output = B::swiglu(
        wrap::<B, 2>(gate.primitive.clone()),
        wrap::<B, 2>(up.primitive.clone()),
    )
    .into_primitive()
    .tensor();
    let output = match SwiGluBackward
        .prepare::<C>([gate.node.clone(), up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((gate.primitive, up.primitive), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of `y = silu(gate) · up`, from [`ModelBackend::swiglu_backward`]. Its parents
/// are `[gate, up]`.
#[derive(Debug)]
struct SwiGluBackward;

impl<B: ModelBackend> Backward<B, 2> for SwiGluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let parents: [Option<NodeId>; 2] = ops.parents.map(|p| p.map(|node| node.id));
        let derivatives = B::swiglu_backward(wrap(gate), wrap(up), wrap(grad));
        for (parent, derivative) in parents.into_iter().zip(derivatives) {
            if let Some(id) = parent {
                grads.register::<B>(id, derivative.into_primitive().tensor());
            }
        }
    }
}
