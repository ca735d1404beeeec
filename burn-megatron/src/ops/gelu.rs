//! GeLU, optionally after a bias add (Megatron's bias-GeLU), in its exact (erf) and tanh forms,
//! with a backward that is the true derivative of the forward.
//!
//! Burn 0.21's `activation::gelu` computes the erf form but backpropagates the derivative of the
//! tanh approximation: relative errors of ~1e-3 in every gradient upstream of the MLP.
//! [`ModelBackend::bias_gelu`] and [`ModelBackend::bias_gelu_backward`] are where a fused kernel
//! goes; `Autodiff<B>` records one node that stores only the input (and the bias) and calls
//! the backward on the inner backend.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{ModelBackend, wrap};

/// `sqrt(2 / π)`.
const SQRT_2_OVER_PI: f64 = FRAC_2_SQRT_PI * FRAC_1_SQRT_2;
/// `1 / sqrt(2π)`, the standard normal density at 0.
const FRAC_1_SQRT_2PI: f64 = FRAC_2_SQRT_PI * FRAC_1_SQRT_2 * 0.5;
/// The cubic coefficient of the tanh approximation.
const TANH_CUBIC: f64 = 0.044715;

/// Which GeLU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluForm {
    /// The exact GeLU, `x · Φ(x) = 0.5 · x · (1 + erf(x / √2))`: PyTorch's `gelu`, Megatron's
    /// default `activation_func`. Its derivative is `Φ(x) + x · φ(x)`.
    Erf,
    /// The tanh approximation, `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`: GPT-2's
    /// `gelu_new`, PyTorch's `gelu(approximate="tanh")`, Megatron's fused bias-GeLU.
    Tanh,
}

impl GeluForm {
    /// The activation, elementwise, as plain Burn operations: the default forward of
    /// [`ModelBackend::bias_gelu`] (a model calls [`gelu`] or [`bias_gelu`]).
    pub fn forward<B: Backend, const D: usize>(self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Self::Erf => {
                let cdf = x.clone().mul_scalar(FRAC_1_SQRT_2).erf().add_scalar(1.0);
                x * cdf.mul_scalar(0.5)
            }
            Self::Tanh => {
                let inner = tanh_argument(x.clone());
                x * inner.tanh().add_scalar(1.0).mul_scalar(0.5)
            }
        }
    }

    /// The activation's derivative, elementwise.
    pub fn derivative<B: Backend, const D: usize>(self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Self::Erf => {
                let cdf = x
                    .clone()
                    .mul_scalar(FRAC_1_SQRT_2)
                    .erf()
                    .add_scalar(1.0)
                    .mul_scalar(0.5);
                let pdf = (x.clone() * x.clone())
                    .mul_scalar(-0.5)
                    .exp()
                    .mul_scalar(FRAC_1_SQRT_2PI);
                cdf + x * pdf
            }
            Self::Tanh => {
                // Beyond |x| = 10 the tanh is ±1 in every float format, so the derivative is
                // exactly 1 or 0 there; clamping keeps x² finite in narrow formats, where the
                // second term would be 0 · inf = NaN.
                let x = x.clamp(-10.0, 10.0);
                let t = tanh_argument(x.clone()).tanh();
                let sech2 = (t.clone() * t.clone()).neg().add_scalar(1.0);
                let d_argument = (x.clone() * x.clone())
                    .mul_scalar(3.0 * TANH_CUBIC)
                    .add_scalar(1.0)
                    .mul_scalar(SQRT_2_OVER_PI);
                t.add_scalar(1.0).mul_scalar(0.5) + (x * sech2 * d_argument).mul_scalar(0.5)
            }
        }
    }
}

/// `√(2/π) · x · (1 + 0.044715 · x²)`.
fn tanh_argument<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let cubic = (x.clone() * x.clone())
        .mul_scalar(TANH_CUBIC)
        .add_scalar(1.0);
    (x * cubic).mul_scalar(SQRT_2_OVER_PI)
}

/// `gelu(x + bias)` over the last dimension of an `x` of any rank (`bias: [features]`),
/// flattened to `[tokens, features]` for [`ModelBackend::bias_gelu`], then reshaped back.
pub fn bias_gelu<B: ModelBackend, const D: usize>(
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    form: GeluForm,
) -> Tensor<B, D> {
    let dims = x.dims();
    let features = dims[D - 1];
    let tokens = dims[..D - 1].iter().product();
    B::bias_gelu(x.reshape([tokens, features]), bias, form).reshape(dims)
}

/// `gelu(x)`, elementwise, with an exact backward: [`bias_gelu`] without a bias.
pub fn gelu<B: ModelBackend, const D: usize>(x: Tensor<B, D>, form: GeluForm) -> Tensor<B, D> {
    bias_gelu(x, None, form)
}

/// `x + bias` (`x: [tokens, features]`, `bias: [features]`).
pub(crate) fn add_bias<B: Backend>(x: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    match bias {
        Some(bias) => x + bias.unsqueeze(),
        None => x,
    }
}

/// [`ModelBackend::bias_gelu`] on `Autodiff<B>`: the inner backend's forward, and one
/// [`BiasGeluBackward`] node holding `x` and the bias.
pub(crate) fn autodiff_bias_gelu<B: ModelBackend, C: CheckpointStrategy>(
    x: Tensor<Autodiff<B, C>, 2>,
    bias: Option<Tensor<Autodiff<B, C>, 1>>,
    form: GeluForm,
) -> Tensor<Autodiff<B, C>, 2> {
    let x = x.into_primitive().tensor();
    let bias = bias.map(|b| b.into_primitive().tensor());
    let output = B::bias_gelu(
        wrap::<B, 2>(x.primitive.clone()),
        bias.as_ref().map(|b| wrap::<B, 1>(b.primitive.clone())),
        form,
    )
    .into_primitive()
    .tensor();
    let state = (
        x.primitive.clone(),
        bias.as_ref().map(|b| b.primitive.clone()),
        form,
    );
    let output = match &bias {
        Some(bias) => match BiasGeluBackward
            .prepare::<C>([x.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match BiasGeluBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of `y = gelu(x + b)`: `dx = dy · gelu'(x + b)` (from
/// [`ModelBackend::bias_gelu_backward`]) and `db = Σ_tokens dx`. Its parents are `[x]` or
/// `[x, b]`.
#[derive(Debug)]
struct BiasGeluBackward;

/// `x`, the bias and the form.
type BiasGeluState<B> = (FloatTensor<B>, Option<FloatTensor<B>>, GeluForm);

impl BiasGeluBackward {
    fn run<B: ModelBackend>(
        parents: &[Option<NodeId>],
        grad: B::FloatTensorPrimitive,
        (x, bias, form): BiasGeluState<B>,
        grads: &mut Gradients,
    ) {
        let dx = match (parents.get(1), bias) {
            (Some(Some(id)), Some(bias)) => {
                let (dx, db) =
                    B::bias_gelu_backward_and_bias_gradient(wrap(x), wrap(bias), wrap(grad), form);
                grads.register::<B>(*id, db.into_primitive().tensor());
                dx
            }
            (_, bias) => B::bias_gelu_backward(wrap(x), bias.map(wrap), wrap(grad), form),
        };
        if let Some(id) = parents[0] {
            grads.register::<B>(id, dx.into_primitive().tensor());
        }
    }
}

impl<B: ModelBackend> Backward<B, 1> for BiasGeluBackward {
    type State = BiasGeluState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        Self::run::<B>(&parents, grad, ops.state, grads);
    }
}

impl<B: ModelBackend> Backward<B, 2> for BiasGeluBackward {
    type State = BiasGeluState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        Self::run::<B>(&parents, grad, ops.state, grads);
    }
}
