//! SwiGLU's elementwise part with the projections' biases, `silu(gate + b_g) · (up + b_u)`
//! (Megatron's bias-SwiGLU), with a written-out backward.
//!
//! Burn 0.21's `sigmoid` (and so `silu`) computes in f32 whatever the dtype: for f16 and bf16
//! that widens, but an f64 model gets an f32 SiLU (relative error ~1e-8, and a forward that
//! f64 finite differences cannot differentiate). [`sigmoid`] here widens narrow floats and
//! keeps f64. [`ModelBackend::swiglu`] and [`ModelBackend::swiglu_backward`] run one kernel
//! each way on CubeCL backends (`burn_megatron_kernels::fused::swiglu`, f32 math for f32, f16
//! and bf16; f64 keeps this composition); `Autodiff<B>` records one node that stores `gate`,
//! `up` and the biases. The biases' gradients are column sums of `d_gate` and `d_up`
//! ([`ModelBackend::bias_gradient`]).

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
use crate::ops::gelu::add_bias;

/// The biases of SwiGLU's gate and up projections, `[gate, up]`, `[features]` each.
pub type SwiGluBias<B> = [Tensor<B, 1>; 2];

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

/// `silu(gate) · up = gate · σ(gate) · up`, as plain Burn operations (the biases already
/// added): the default forward of [`ModelBackend::swiglu`] (a model calls [`swiglu`]).
pub fn swiglu_forward<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    gate.clone() * sigmoid(gate) * up
}

/// `(gate + b_g, up + b_u)` for `[tokens, features]` inputs, or the inputs without biases.
pub fn add_swiglu_bias<B: Backend>(
    gate: Tensor<B, 2>,
    up: Tensor<B, 2>,
    bias: Option<SwiGluBias<B>>,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    match bias {
        Some([gate_bias, up_bias]) => {
            (add_bias(gate, Some(gate_bias)), add_bias(up, Some(up_bias)))
        }
        None => (gate, up),
    }
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
    bias_swiglu(gate, up, None)
}

/// `silu(gate + b_g) · (up + b_u)` over the last dimension of tensors of any rank (biases
/// `[features]`), flattened to `[tokens, features]` for [`ModelBackend::swiglu`], then
/// reshaped back: one kernel each way on CubeCL backends, the bias adds included.
pub fn bias_swiglu<B: ModelBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    bias: Option<SwiGluBias<B>>,
) -> Tensor<B, D> {
    let dims = gate.dims();
    let features = dims[D - 1];
    let tokens = dims[..D - 1].iter().product();
    let flat = |t: Tensor<B, D>| t.reshape([tokens, features]);
    B::swiglu(flat(gate), flat(up), bias).reshape(dims)
}

/// [`ModelBackend::swiglu`] on `Autodiff<B>`: the inner backend's forward, and one
/// [`SwiGluBackward`] node holding `gate`, `up` and the biases.
pub(crate) fn autodiff_swiglu<B: ModelBackend, C: CheckpointStrategy>(
    gate: Tensor<Autodiff<B, C>, 2>,
    up: Tensor<Autodiff<B, C>, 2>,
    bias: Option<SwiGluBias<Autodiff<B, C>>>,
) -> Tensor<Autodiff<B, C>, 2> {
    let gate = gate.into_primitive().tensor();
    let up = up.into_primitive().tensor();
    let bias = bias.map(|b| b.map(|t| t.into_primitive().tensor()));
    let output = B::swiglu(
        wrap::<B, 2>(gate.primitive.clone()),
        wrap::<B, 2>(up.primitive.clone()),
        bias.as_ref()
            .map(|b| b.each_ref().map(|t| wrap::<B, 1>(t.primitive.clone()))),
    )
    .into_primitive()
    .tensor();
    let state = (
        gate.primitive.clone(),
        up.primitive.clone(),
        bias.as_ref()
            .map(|b| b.each_ref().map(|t| t.primitive.clone())),
    );
    let output = match &bias {
        Some([gate_bias, up_bias]) => match SwiGluBackward
            .prepare::<C>([
                gate.node.clone(),
                up.node.clone(),
                gate_bias.node.clone(),
                up_bias.node.clone(),
            ])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match SwiGluBackward
            .prepare::<C>([gate.node.clone(), up.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of `y = silu(gate + b_g) · (up + b_u)`: `[d_gate, d_up]` and, when a bias is
/// tracked, the biases' gradients, their column sums, from
/// [`ModelBackend::swiglu_backward_and_bias_gradients`] (else [`ModelBackend::swiglu_backward`]).
/// Its parents
/// are `[gate, up]` or `[gate, up, b_g, b_u]`.
#[derive(Debug)]
struct SwiGluBackward;

/// `gate`, `up` and the biases.
type SwiGluState<B> = (FloatTensor<B>, FloatTensor<B>, Option<[FloatTensor<B>; 2]>);

impl SwiGluBackward {
    fn run<B: ModelBackend>(
        parents: &[Option<NodeId>],
        grad: FloatTensor<B>,
        (gate, up, bias): SwiGluState<B>,
        grads: &mut Gradients,
    ) {
        let biases_tracked = parents.iter().skip(2).any(Option::is_some);
        let derivatives = match bias {
            Some(bias) if biases_tracked => {
                let (derivatives, bias_gradients) = B::swiglu_backward_and_bias_gradients(
                    wrap(gate),
                    wrap(up),
                    bias.map(wrap),
                    wrap(grad),
                );
                for (parent, db) in parents.iter().skip(2).zip(bias_gradients) {
                    if let Some(id) = parent {
                        grads.register::<B>(*id, db.into_primitive().tensor());
                    }
                }
                derivatives
            }
            bias => B::swiglu_backward(wrap(gate), wrap(up), bias.map(|b| b.map(wrap)), wrap(grad)),
        };
        for (parent, derivative) in parents.iter().zip(derivatives) {
            if let Some(id) = parent {
                grads.register::<B>(*id, derivative.into_primitive().tensor());
            }
        }
    }
}

impl<B: ModelBackend> Backward<B, 2> for SwiGluBackward {
    type State = SwiGluState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        Self::run::<B>(&parents, grad, ops.state, grads);
    }
}

impl<B: ModelBackend> Backward<B, 4> for SwiGluBackward {
    type State = SwiGluState<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        Self::run::<B>(&parents, grad, ops.state, grads);
    }
}
