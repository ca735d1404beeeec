//! SwiGLU's elementwise part with the projections' biases, `silu(gate + b_g) · (up + b_u)`
//! (Megatron's bias-SwiGLU), with a written-out backward.
//!
//! Burn 0.21's `sigmoid` (and so `silu`) computes in f32 whatever the dtype: for f16 and bf16
//! that widens, but an f64 model gets an f32 SiLU (relative error ~1e-8, and a forward that
//! f64 finite differences cannot differentiate). [`sigmoid`] here widens narrow floats and
//! keeps f64. [`SwiGluOps::swiglu`] and [`SwiGluOps::swiglu_backward`] run one kernel
//! each way on CubeCL backends (`burn_megatron_kernels::fused::swiglu`, f32 math for f32, f16
//! and bf16; f64 keeps this composition); `Autodiff<B>` records one node that stores `gate`,
//! `up` and the biases. The biases' gradients are column sums of `d_gate` and `d_up`
//! ([`BiasOps::bias_gradient`]).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, record, register};
use super::bias::BiasOps;
use super::primitive::{raw, wrap};

/// The biases of SwiGLU's gate and up projections, `[gate, up]`, `[features]` each.
pub type SwiGluBias<B> = [Tensor<B, 1>; 2];

/// SwiGLU's elementwise part after the projections' optional biases.
pub trait SwiGluOps: BiasOps {
    /// `silu(gate + b_g) · (up + b_u)` for `gate, up: [tokens, features]` and optional biases
    /// `[b_g, b_u]` of `[features]` (SwiGLU's elementwise part, Megatron's bias-SwiGLU).
    /// `Autodiff<B>` stores `gate`, `up` and the biases, and its backward calls
    /// [`swiglu_backward`](Self::swiglu_backward).
    fn swiglu(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: Option<SwiGluBias<Self>>,
    ) -> Tensor<Self, 2> {
        let (gate, up) = add_swiglu_bias(gate, up, bias);
        swiglu_forward(gate, up)
    }

    /// The gradients `[d_gate, d_up]` of [`swiglu`](Self::swiglu) given its output's gradient
    /// `grad: [tokens, features]`. The biases' gradients are their sums over the tokens.
    fn swiglu_backward(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: Option<SwiGluBias<Self>>,
        grad: Tensor<Self, 2>,
    ) -> [Tensor<Self, 2>; 2] {
        let (gate, up) = add_swiglu_bias(gate, up, bias);
        swiglu_derivatives(gate, up, grad)
    }

    /// [`swiglu_backward`](Self::swiglu_backward) and both biases' gradients, their sums over
    /// the tokens, in `gate`'s dtype: `([d_gate, d_up], [d_b_g, d_b_u])`. CubeCL backends take
    /// the bias gradients' first stage inside the backward kernel (the bits of
    /// [`bias_gradient`](BiasOps::bias_gradient) of each derivative, without reading them
    /// again); the default is the three calls.
    fn swiglu_backward_and_bias_gradients(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: SwiGluBias<Self>,
        grad: Tensor<Self, 2>,
    ) -> ([Tensor<Self, 2>; 2], [Tensor<Self, 1>; 2]) {
        let derivatives = Self::swiglu_backward(gate, up, Some(bias), grad);
        let bias_gradients = derivatives.clone().map(Self::bias_gradient);
        (derivatives, bias_gradients)
    }
}

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
/// added): the default forward of [`SwiGluOps::swiglu`] (a model calls [`swiglu`]).
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
        Some([gate_bias, up_bias]) => (gate + gate_bias.unsqueeze(), up + up_bias.unsqueeze()),
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
/// `[tokens, features]` for [`SwiGluOps::swiglu`], then reshaped back.
///
/// # Shapes
/// `gate`, `up` and the output: `[..., features]`.
pub fn swiglu<B: SwiGluOps, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    bias_swiglu(gate, up, None)
}

/// `silu(gate + b_g) · (up + b_u)` over the last dimension of tensors of any rank (biases
/// `[features]`), flattened to `[tokens, features]` for [`SwiGluOps::swiglu`], then
/// reshaped back: one kernel each way on CubeCL backends, the bias adds included.
///
/// # Shapes
/// - `gate`, `up` and the output: `[..., features]`
/// - each bias: `[features]`
pub fn bias_swiglu<B: SwiGluOps, const D: usize>(
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

/// The inner backend's forward, and one node holding `gate`, `up` and the biases.
impl<B: SwiGluOps, C: CheckpointStrategy> SwiGluOps for Autodiff<B, C> {
    fn swiglu(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: Option<SwiGluBias<Self>>,
    ) -> Tensor<Self, 2> {
        let (gate, up) = (raw(gate), raw(up));
        let bias = bias.map(|b| b.map(raw));
        let output = raw(B::swiglu(
            inner(&gate),
            inner(&up),
            bias.as_ref().map(|b| b.each_ref().map(inner)),
        ));
        let state = (
            gate.primitive.clone(),
            up.primitive.clone(),
            bias.as_ref()
                .map(|b| b.each_ref().map(|t| t.primitive.clone())),
        );
        wrap(match &bias {
            Some([gate_bias, up_bias]) => record::<B, C, _>(
                SwiGluBackward,
                &[&gate, &up, gate_bias, up_bias],
                state,
                output,
            ),
            None => record::<B, C, _>(SwiGluBackward, &[&gate, &up], state, output),
        })
    }
}

/// The backward of `y = silu(gate + b_g) · (up + b_u)`: `[d_gate, d_up]` and, when a bias is
/// tracked, the biases' gradients, their column sums, from
/// [`SwiGluOps::swiglu_backward_and_bias_gradients`] (else [`SwiGluOps::swiglu_backward`]).
/// Its parents are `[gate, up]` or `[gate, up, b_g, b_u]`.
#[derive(Debug)]
struct SwiGluBackward;

impl<B: SwiGluOps> BackwardStep<B> for SwiGluBackward {
    /// `gate`, `up` and the biases.
    type State = (FloatTensor<B>, FloatTensor<B>, Option<[FloatTensor<B>; 2]>);

    fn backward(
        self,
        grad: FloatTensor<B>,
        (gate, up, bias): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
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
                    register(grads, *parent, || db);
                }
                derivatives
            }
            bias => B::swiglu_backward(wrap(gate), wrap(up), bias.map(|b| b.map(wrap)), wrap(grad)),
        };
        for (parent, derivative) in parents.iter().zip(derivatives) {
            register(grads, *parent, || derivative);
        }
    }
}

/// CubeCL backends: one kernel each way, the bias gradients' first stage inside the backward
/// (f64: the composition).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::swiglu as kernels;

    use super::{SwiGluBias, SwiGluOps, add_swiglu_bias, swiglu_derivatives, swiglu_forward};
    use crate::ops::bias::BiasOps;
    use crate::ops::primitive::{raw, wrap};

    /// The biases as the kernels take them, in the activations' dtype.
    fn kernel_bias<R, F, I, BT>(
        bias: Option<SwiGluBias<CubeBackend<R, F, I, BT>>>,
        dtype: DType,
    ) -> Option<kernels::Biases<R>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        bias.map(|[gate, up]| kernels::Biases {
            gate: raw(gate.cast(dtype)),
            up: raw(up.cast(dtype)),
        })
    }

    impl<R, F, I, BT> SwiGluOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn swiglu(
            gate: Tensor<Self, 2>,
            up: Tensor<Self, 2>,
            bias: Option<SwiGluBias<Self>>,
        ) -> Tensor<Self, 2> {
            let dtype = gate.dtype();
            if dtype == DType::F64 {
                let (gate, up) = add_swiglu_bias(gate, up, bias);
                return swiglu_forward(gate, up);
            }
            wrap(kernels::forward(
                raw(gate),
                raw(up.cast(dtype)),
                kernel_bias(bias, dtype),
            ))
        }

        fn swiglu_backward(
            gate: Tensor<Self, 2>,
            up: Tensor<Self, 2>,
            bias: Option<SwiGluBias<Self>>,
            grad: Tensor<Self, 2>,
        ) -> [Tensor<Self, 2>; 2] {
            let dtype = gate.dtype();
            if dtype == DType::F64 {
                let (gate, up) = add_swiglu_bias(gate, up, bias);
                return swiglu_derivatives(gate, up, grad);
            }
            kernels::backward(
                raw(gate),
                raw(up.cast(dtype)),
                kernel_bias(bias, dtype),
                raw(grad.cast(dtype)),
            )
            .map(wrap)
        }

        /// One kernel and the column sums' second stage.
        fn swiglu_backward_and_bias_gradients(
            gate: Tensor<Self, 2>,
            up: Tensor<Self, 2>,
            bias: SwiGluBias<Self>,
            grad: Tensor<Self, 2>,
        ) -> ([Tensor<Self, 2>; 2], [Tensor<Self, 1>; 2]) {
            let dtype = gate.dtype();
            if dtype == DType::F64 {
                let derivatives = Self::swiglu_backward(gate, up, Some(bias), grad);
                let bias_gradients = derivatives.clone().map(Self::bias_gradient);
                return (derivatives, bias_gradients);
            }
            let (derivatives, bias_gradients) = kernels::backward_and_bias_gradients(
                raw(gate),
                raw(up.cast(dtype)),
                kernel_bias(Some(bias), dtype).expect("the biases are given"),
                raw(grad.cast(dtype)),
            );
            (derivatives.map(wrap), bias_gradients.map(wrap))
        }
    }
}
