//! GeLU, optionally after a bias add (Megatron's bias-GeLU), in its exact (erf) and tanh forms,
//! with a backward that is the true derivative of the forward.
//!
//! Burn 0.21's `activation::gelu` computes the erf form but backpropagates the derivative of the
//! tanh approximation: relative errors of ~1e-3 in every gradient upstream of the MLP.
//! [`GeluOps::bias_gelu`] and [`GeluOps::bias_gelu_backward`] are where a fused kernel goes
//! (`burn_megatron_kernels::fused::bias_gelu`); `Autodiff<B>` records one node that stores only
//! the input (and the bias) and calls the backward on the inner backend.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::bias::BiasOps;
use super::primitive::{raw, wrap};

/// `sqrt(2 / π)`.
const SQRT_2_OVER_PI: f64 = FRAC_2_SQRT_PI * FRAC_1_SQRT_2;
/// `1 / sqrt(2π)`, the standard normal density at 0.
const FRAC_1_SQRT_2PI: f64 = FRAC_2_SQRT_PI * FRAC_1_SQRT_2 * 0.5;
/// The cubic coefficient of the tanh approximation.
const TANH_CUBIC: f64 = 0.044715;

// ANCHOR: trait
/// GeLU after an optional bias add.
pub trait GeluOps: BiasOps {
    /// `gelu(x + bias)` for `x: [tokens, features]`, `bias: [features]` (Megatron's
    /// bias-GeLU). `Autodiff<B>` stores `x` and the bias, and its backward calls
    /// [`bias_gelu_backward`](Self::bias_gelu_backward): the true derivative of this forward.
    fn bias_gelu(
        x: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        form: GeluForm,
    ) -> Tensor<Self, 2> {
        form.forward(add_bias(x, bias))
    }

    /// The gradient of [`bias_gelu`](Self::bias_gelu)'s `x` given its output's gradient
    /// `grad: [tokens, features]`: `grad · gelu'(x + bias)`. The bias's gradient is its sum
    /// over the tokens.
    fn bias_gelu_backward(
        x: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        grad: Tensor<Self, 2>,
        form: GeluForm,
    ) -> Tensor<Self, 2> {
        grad * form.derivative(add_bias(x, bias))
    }

    /// [`bias_gelu_backward`](Self::bias_gelu_backward) and the bias's gradient, its sum over
    /// the tokens, in `x`'s dtype. CubeCL backends take the bias gradient's first stage inside
    /// the backward kernel (the bits of [`bias_gradient`](BiasOps::bias_gradient) of `dx`,
    /// without reading `dx` again); the default is the two calls.
    fn bias_gelu_backward_and_bias_gradient(
        x: Tensor<Self, 2>,
        bias: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        form: GeluForm,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        let dx = Self::bias_gelu_backward(x, Some(bias), grad, form);
        let db = Self::bias_gradient(dx.clone());
        (dx, db)
    }
}
// ANCHOR_END: trait

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
    /// [`GeluOps::bias_gelu`] (a model calls [`gelu`] or [`bias_gelu`]).
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
/// flattened to `[tokens, features]` for [`GeluOps::bias_gelu`], then reshaped back.
///
/// # Shapes
/// - `x`: `[..., features]`
/// - `bias`: `[features]`
/// - output: the shape of `x`
pub fn bias_gelu<B: GeluOps, const D: usize>(
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
pub fn gelu<B: GeluOps, const D: usize>(x: Tensor<B, D>, form: GeluForm) -> Tensor<B, D> {
    bias_gelu(x, None, form)
}

/// `x + bias` (`x: [tokens, features]`, `bias: [features]`).
fn add_bias<B: Backend>(x: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    match bias {
        Some(bias) => x + bias.unsqueeze(),
        None => x,
    }
}

// ANCHOR: autodiff
/// The inner backend's forward, and one node holding `x` and the bias.
impl<B: GeluOps, C: CheckpointStrategy> GeluOps for Autodiff<B, C> {
    fn bias_gelu(
        x: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        form: GeluForm,
    ) -> Tensor<Self, 2> {
        let (x, bias) = (raw(x), bias.map(raw));
        let output = raw(B::bias_gelu(inner(&x), bias.as_ref().map(inner), form));
        let state = (
            x.primitive.clone(),
            bias.as_ref().map(|b| b.primitive.clone()),
            form,
        );
        wrap(match &bias {
            Some(bias) => record::<B, C, _>(BiasGeluBackward, &[&x, bias], state, output),
            None => record::<B, C, _>(BiasGeluBackward, &[&x], state, output),
        })
    }
}
// ANCHOR_END: autodiff

// ANCHOR: backward_step
/// The backward of `y = gelu(x + b)`: `dx = dy · gelu'(x + b)` (from
/// [`GeluOps::bias_gelu_backward`]) and `db = Σ_tokens dx`. Its parents are `[x]` or `[x, b]`.
#[derive(Debug)]
struct BiasGeluBackward;

impl<B: GeluOps> BackwardStep<B> for BiasGeluBackward {
    /// `x`, the bias and the form.
    type State = (FloatTensor<B>, Option<FloatTensor<B>>, GeluForm);

    fn backward(
        self,
        grad: FloatTensor<B>,
        (x, bias, form): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let dx = match (parent(parents, 1), bias) {
            (Some(id), Some(bias)) => {
                let (dx, db) =
                    B::bias_gelu_backward_and_bias_gradient(wrap(x), wrap(bias), wrap(grad), form);
                register(grads, Some(id), || db);
                dx
            }
            (_, bias) => B::bias_gelu_backward(wrap(x), bias.map(wrap), wrap(grad), form),
        };
        register(grads, parent(parents, 0), || dx);
    }
}
// ANCHOR_END: backward_step

/// CubeCL backends: one kernel each way, the bias gradient's first stage inside the backward
/// (f64: the composition).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::bias_gelu as kernels;

    use super::{GeluForm, GeluOps, add_bias};
    use crate::ops::bias::BiasOps;
    use crate::ops::primitive::{raw, wrap};

    fn kernel_form(form: GeluForm) -> kernels::Form {
        match form {
            GeluForm::Erf => kernels::Form::Erf,
            GeluForm::Tanh => kernels::Form::Tanh,
        }
    }

    // ANCHOR: cube_forward
    impl<R, F, I, BT> GeluOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn bias_gelu(
            x: Tensor<Self, 2>,
            bias: Option<Tensor<Self, 1>>,
            form: GeluForm,
        ) -> Tensor<Self, 2> {
            let dtype = x.dtype();
            if dtype == DType::F64 {
                return form.forward(add_bias(x, bias));
            }
            let bias = bias.map(|b| raw(b.cast(dtype)));
            wrap(kernels::forward(raw(x), bias, kernel_form(form)))
        }
        // ANCHOR_END: cube_forward

        fn bias_gelu_backward(
            x: Tensor<Self, 2>,
            bias: Option<Tensor<Self, 1>>,
            grad: Tensor<Self, 2>,
            form: GeluForm,
        ) -> Tensor<Self, 2> {
            let dtype = x.dtype();
            if dtype == DType::F64 {
                return grad * form.derivative(add_bias(x, bias));
            }
            let bias = bias.map(|b| raw(b.cast(dtype)));
            wrap(kernels::backward(
                raw(x),
                bias,
                raw(grad.cast(dtype)),
                kernel_form(form),
            ))
        }

        /// One kernel and the column sums' second stage.
        fn bias_gelu_backward_and_bias_gradient(
            x: Tensor<Self, 2>,
            bias: Tensor<Self, 1>,
            grad: Tensor<Self, 2>,
            form: GeluForm,
        ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
            let dtype = x.dtype();
            if dtype == DType::F64 {
                let dx = Self::bias_gelu_backward(x, Some(bias), grad, form);
                return (dx.clone(), Self::bias_gradient(dx));
            }
            let (dx, db) = kernels::backward_and_bias_gradient(
                raw(x),
                raw(bias.cast(dtype)),
                raw(grad.cast(dtype)),
                kernel_form(form),
            );
            (wrap(dx), wrap(db))
        }
    }
}
